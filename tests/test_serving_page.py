"""The web page at `/` in a real headless Chromium (Debian's `chromium`, driven by playwright through
`executable_path`): it loads, sends a message, draws the canvas as it denoises (at least two different
canvases), and shows the same final answer the API gives for that seed.

The screenshot is written under the test's tmp dir; with `DG_KEEP_ARTIFACTS=1` it is also copied to
`results/serve_page.png`.
"""

import json
import os
import pathlib
import shutil

import openai
import pytest

import serving_helpers

playwright_sync = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.slow, pytest.mark.hf]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
MESSAGE = "Show me the canvas."


def _seed_with_an_answer(client, model) -> tuple[int, str]:
  """A seed with a non-empty answer (the tiny model's weights are random: many answers end at once)."""
  for seed in range(50):
    reply = client.chat.completions.create(model=model, seed=seed, messages=[{"role": "user", "content": MESSAGE}])
    if len(reply.choices[0].message.content) >= 3:
      return seed, reply.choices[0].message.content
  pytest.fail("no seed gave an answer")


@pytest.mark.skipif(not pathlib.Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_the_page_shows_the_canvas_denoising_and_the_final_answer(server, tmp_path):
  client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
  model = client.models.list().data[0].id
  seed, answer = _seed_with_an_answer(client, model)
  with playwright_sync.sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    try:
      page = browser.new_page(viewport={"width": 1200, "height": 800})
      errors = []
      page.on("pageerror", lambda e: errors.append(str(e)))
      page.goto(server.url + "/")
      page.wait_for_function("document.getElementById('model').textContent === " + repr(model), timeout=30_000)
      schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
      page.fill("#schema", json.dumps(schema))
      page.check("#thinking")
      body = page.evaluate("requestBody()")  # what the schema box and the thinking switch send
      assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "page_schema",
                                                                               "schema": schema}}
      assert body["reasoning_effort"] == "medium" and body["stream_canvas"] is True
      page.fill("#schema", "")
      page.uncheck("#thinking")
      page.fill("#seed", str(seed))
      page.fill("#message", MESSAGE)
      page.click("#send")
      page.wait_for_selector(".msg.assistant[data-done='true']", timeout=120_000)
      stats = page.evaluate("window.dgStats")
      shown = page.text_content(".msg.assistant .content")
      counter = page.inner_text("#pass-counter")
      cells = page.locator("#canvas .cell").count()
      page.screenshot(path=str(tmp_path / "serve_page.png"), full_page=True)
    finally:
      browser.close()
  if os.environ.get("DG_KEEP_ARTIFACTS") == "1":
    results = serving_helpers.ROOT / "results"
    results.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "serve_page.png", results / "serve_page.png")
  assert not errors, errors
  assert stats["canvasUpdates"] >= 3 and stats["distinctCanvases"] >= 2, stats  # the canvas changed twice
  assert shown == answer  # the final text, as the API gives it for this seed
  assert cells == 8 and counter.startswith("canvas ") and "pass" in counter
  assert (tmp_path / "serve_page.png").stat().st_size > 10_000
