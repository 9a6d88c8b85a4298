"""`dg.ChatSampler` and scripts/chat.py on the tiny random checkpoint folders of tests/chat_fixtures.py.

The folders are complete transformers checkpoints (random weights written by transformers, a Gemma-like
tokenizer.json with the Gemma 4 control tokens, generation_config.json: 12 denoising steps, 16 new
tokens = 2 canvases of 8). One has a tiny Gemma 4 vision tower (as tests/test_vision.py's) whose image
tokens are the tokenizer's `<|image|>`, `<|image>`, `<image|>`. Everything runs in float32.
"""

import dataclasses
import functools
import io
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest

import chat_fixtures
import diffusiongemma as dg
from diffusiongemma import chat as chat_lib
from diffusiongemma.chat import display
from diffusiongemma.data import images as images_lib

torch = pytest.importorskip("torch")  # the checkpoint folders are written by transformers
pytestmark = pytest.mark.hf

ROOT = pathlib.Path(__file__).parent.parent
CONTROL_TEXTS = chat_fixtures.CONTROL + chat_fixtures.SPECIAL
IMAGE_IDS = tuple(chat_fixtures.tokenizer_pieces().index(t) for t in ("<|image|>", "<|image>", "<image|>"))
HF_VISION = dict(hidden_size=24, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=3,
                 position_embedding_size=256, standardize=True)


@pytest.fixture(scope="module")
def checkpoint(chat_checkpoint):
  return chat_checkpoint  # the session's (tests/conftest.py), shared with the other chat and server tests


@pytest.fixture(scope="module")
def loaded(checkpoint):
  """One loaded ChatSampler; tests start their own conversations on its sampler (sharing its programs)."""
  return dg.ChatSampler.from_pretrained(checkpoint, dtype="float32", prompt_bucket=128)  # one program for all turns


def _conversation(chat, **changes) -> dg.ChatSampler:
  options = dict(max_new_tokens=chat.max_new_tokens, empty_thought=chat.empty_thought)
  options.update(changes)
  return dg.ChatSampler(chat.sampler, chat.variables, chat.tokenizer, **options)


def _image(seed, height, width):
  return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# --- the script --------------------------------------------------------------------------------------


def test_chat_script_prints_the_exact_prompt_and_a_reply(checkpoint):
  result = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "chat.py"), f"--hf_checkpoint={checkpoint}", "--message=What is 2+2?",
       "--system=Be brief.", "--thinking", "--show_prompt"],
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  prompt = ("<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n"
            "<|turn>model\n")
  assert out.startswith("--- prompt ---\n" + prompt + "\n--- ")
  answer = out.split("--- answer ---\n", 1)[1]
  assert "tokens per forward" in answer and "tokens/s" in answer
  assert "\x1b" not in out  # stdout is not a terminal: plain text
  for control in ("<|turn>", "<turn|>", "<|channel>", "<channel|>"):  # none in the thought or the answer
    assert control not in out[len("--- prompt ---\n" + prompt):]


# --- conversations ------------------------------------------------------------------------------------


def test_turn_two_encodes_only_its_new_tokens_and_equals_a_fresh_encoding(loaded, monkeypatch):
  """Turn 2 continues the cache (only what the conversation added is encoded) and its reply equals the
  reply of a conversation that encodes everything every turn, with the same seeds."""
  prompts = []
  generate = type(loaded.sampler).generate

  def spy(self, params, prompt_tokens, *args, **kwargs):
    prompts.append([int(t) for t in prompt_tokens[0]])
    return generate(self, params, prompt_tokens, *args, **kwargs)

  monkeypatch.setattr(type(loaded.sampler), "generate", spy)
  replies = {}
  for reuse in (True, False):
    chat = _conversation(loaded, reuse_cache=reuse)
    first = chat.send("What is 2+2?", system="Be brief.", thinking=True, seed=1)
    second = chat.send("And 3+3?", thinking=True, seed=2)
    replies[reuse] = (first, second, list(chat._cached_ids))  # pylint: disable=protected-access
  (first, second, _), (first_fresh, second_fresh, _) = replies[True], replies[False]

  turn1 = chat_lib.render_ids([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2+2?"}], loaded.tokenizer, thinking=True)
  turn2 = chat_lib.render_ids([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2+2?"},
                               {"role": "model", "content": first.text},
                               {"role": "user", "content": "And 3+3?"}], loaded.tokenizer, thinking=True)
  assert turn2[:len(turn1)] == turn1
  assert prompts[0] == turn1 and first.stats["encoded_tokens"] == len(turn1)
  assert second.stats["prompt_tokens"] == len(turn2)
  reused = second.stats["reused_tokens"]
  assert reused >= len(turn1)  # the whole first prompt (and any of the answer that the cache holds as is)
  assert prompts[1] == turn2[reused:] and second.stats["encoded_tokens"] == len(turn2) - reused
  assert prompts[3] == turn2 and second_fresh.stats["encoded_tokens"] == len(turn2)  # from scratch

  assert first.tokens == first_fresh.tokens
  assert second.tokens == second_fresh.tokens and second.text == second_fresh.text
  assert second.stats["new_tokens"] == len(second.tokens) and second.stats["denoiser_passes"] >= 1


def test_live_drafts_show_no_control_tokens(loaded):
  """on_step is called after every denoiser pass with the draft split as the reply is."""
  chat = _conversation(loaded)
  drafts = []
  reply = chat.send("Hello", thinking=True, seed=3, on_step=drafts.append)
  assert len(drafts) == reply.stats["denoiser_passes"]
  assert drafts[0].canvas == 0 and drafts[0].step == 0
  assert [d.step for d in drafts if d.canvas == 0] == list(range(sum(d.canvas == 0 for d in drafts)))
  for draft in drafts:
    assert len(draft.tokens) == loaded.config.canvas_length
    assert not any(t in draft.parts.text for t in CONTROL_TEXTS)
  # The display redraws in place on a terminal and writes plain text otherwise.
  stream = io.StringIO()
  live = display.LiveDraft(stream)
  for draft in drafts[:2]:
    live(draft)
  live.clear()
  assert stream.getvalue().count("\x1b[") >= 2 and "canvas 1, step 2" in stream.getvalue()
  assert "\x1b" not in display.format_reply(reply, style=False)


def test_a_thought_is_shown_apart_and_dropped_from_the_next_prompt(loaded):
  chat = _conversation(loaded)
  chat.history = [{"role": "user", "content": "2+2?"}, {"role": "model", "content": "4", "thought": "Two and two."}]
  prompts = []
  chat.send("And 3+3?", on_prompt=prompts.append, seed=0)
  assert prompts == ["<bos><|turn>user\n2+2?<turn|>\n<|turn>model\n4<turn|>\n<|turn>user\nAnd 3+3?<turn|>\n"
                     "<|turn>model\n"]
  reply = dg.chat.Reply("4", "Two and two.", [], True, "", {"tokens_per_second": 1.0, "new_tokens": 1,
                        "seconds": 1.0, "pooled_tokens_per_forward": 1.0, "denoiser_passes": 1,
                        "prompt_tokens": 3, "encoded_tokens": 3, "reused_tokens": 0})
  assert display.format_reply(reply, style=False).startswith("--- thought ---\nTwo and two.\n--- answer ---\n4\n")


def test_a_conversation_longer_than_the_model_is_refused_before_encoding(loaded, monkeypatch):
  cfg = dataclasses.replace(loaded.config, max_positions=64)
  sampler = dg.Sampler(dg.DiffusionGemma(cfg), loaded.sampler.config)
  chat = dg.ChatSampler(sampler, loaded.variables, loaded.tokenizer, max_new_tokens=16)
  monkeypatch.setattr(dg.Sampler, "generate", lambda *a, **k: pytest.fail("encoded"))
  with pytest.raises(ValueError, match=r"conversation is 67 tokens long .* 83 exceed the model's max_positions=64"):
    chat.send("Tell me a long story about a cat who learns to fly.")
  assert chat.history == []  # nothing of the conversation changed


# --- bad input ----------------------------------------------------------------------------------------


def _copy(checkpoint, folder, skip=()):
  folder.mkdir()
  for f in checkpoint.iterdir():
    if f.name not in skip:
      shutil.copy(f, folder / f.name)
  return folder


def test_bad_checkpoint_folders_and_settings_are_clear_errors(checkpoint, tmp_path):
  with pytest.raises(FileNotFoundError, match="holds no weights"):
    dg.ChatSampler.from_pretrained(_copy(checkpoint, tmp_path / "no_weights", skip=("model.safetensors",)))
  with pytest.raises(FileNotFoundError, match="no_tokenizer has no tokenizer: neither tokenizer.json"):
    dg.ChatSampler.from_pretrained(_copy(checkpoint, tmp_path / "no_tokenizer", skip=("tokenizer.json",)))
  plain = _copy(checkpoint, tmp_path / "plain_tokenizer", skip=("tokenizer.json",))
  chat_fixtures.write_tokenizer(plain, control=())
  with pytest.raises(ValueError, match=r"ChatSampler needs a tokenizer with the Gemma 4 control tokens.*lacks "
                     r"\['<\|turn>'"):  # a text tokenizer: it completes text (tests/test_cli.py), but cannot chat
    dg.ChatSampler.from_pretrained(plain)
  with pytest.raises(ValueError, match=r"Unknown sampler preset 'fast'; known presets: \['code', 'creative'"):
    dg.ChatSampler.from_pretrained(checkpoint, "fast")
  with pytest.raises(ValueError, match=r"image_budget=100 is not supported.*\(70, 140, 280, 560, 1120\)"):
    dg.ChatSampler.from_pretrained(checkpoint, image_budget=100)
  with pytest.raises(FileNotFoundError, match="missing"):
    dg.ChatSampler.from_pretrained(tmp_path / "missing")


def test_a_training_workdir_needs_a_checkpoint_tokenizer(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model": {}, "data": {}, "sampler": {}}))
  with pytest.raises(ValueError, match="Cannot chat with the workdir .*sentencepiece.*never seen a conversation"):
    dg.build.chat_sampler(tmp_path)


def test_presets_and_generation_defaults_reach_the_sampler(checkpoint):
  chat = dg.ChatSampler.from_pretrained(checkpoint, "code", dtype="float32", max_denoising_steps=5)
  settings = chat.sampler.config
  assert (settings.t_min, settings.confidence_threshold, settings.max_denoising_steps) == (0.3, 0.001, 5)
  assert settings.t_max == 0.8 and chat.max_new_tokens == 16  # generation_config.json
  turn_close = chat.tokenizer.control_ids["<turn|>"]
  assert turn_close in settings.stop_tokens and chat.tokenizer.eos_id in settings.stop_tokens
  leaf = jax.tree.leaves(chat.variables)[0]
  assert leaf.dtype == jnp.float32 and isinstance(leaf.sharding, jax.sharding.NamedSharding)


# --- images -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
  folder = tmp_path_factory.mktemp("vision_checkpoint")
  chat_fixtures.write_chat_checkpoint(folder, seed=3, vision_config=HF_VISION, image_token_ids=IMAGE_IDS,
                                      use_bidirectional_attention="vision")
  return folder


@pytest.fixture(scope="module")
def vision_chat(vision_checkpoint):
  return dg.ChatSampler.from_pretrained(vision_checkpoint, dtype="float32", image_budget=70)


@functools.partial(jax.jit, static_argnames="model")
def _encode(model, variables, tokens, pixel_values=None, image_position_ids=None):
  return model.apply(variables, tokens, pixel_values=pixel_values, image_position_ids=image_position_ids,
                     method=model.encode)[1]


@functools.partial(jax.jit, static_argnames="model")
def _denoise(model, variables, canvas, cache):
  return model.apply(variables, canvas, cache, method=model.denoise)


def _first_step_logits(chat, cache):
  """The denoiser's logits for the first canvas's starting tokens after `cache`."""
  canvas, _ = chat.sampler.start_canvas(jax.random.split(jax.random.key(0), 1), 0)
  return _denoise(chat.sampler.model, chat.variables, canvas, cache)


def test_a_turn_with_an_image_runs_and_the_image_changes_the_logits(vision_chat):
  cfg = vision_chat.config
  logits, replies = [], []
  for seed in (0, 1):
    chat = _conversation(vision_chat, image_budget=70)
    replies.append(chat.send("What is this?", images=[_image(seed, 40, 60)], seed=5))
    prompt_cache = chat._cache.with_length(replies[-1].stats["prompt_tokens"])  # pylint: disable=protected-access
    logits.append(_first_step_logits(chat, prompt_cache))
  reply = replies[0]
  assert reply.prompt == "<bos><|turn>user\n<|image|>What is this?<turn|>\n<|turn>model\n"
  image = images_lib.preprocess(_image(0, 40, 60), 70, patch_size=4)
  assert reply.stats["prompt_tokens"] == len(chat.tokenizer.encode(reply.prompt)) - 1 + image.num_soft_tokens + 2
  assert np.abs(np.asarray(logits[0] - logits[1])).max() > 1e-3  # the image reaches the reply

  # The cache the sampler built is the model's own encoding of the prompt with the image.
  ids = images_lib.expand_image_placeholders(chat_lib.render_ids(
      [{"role": "user", "content": "What is this?", "media": "<|image|>"}], vision_chat.tokenizer),
      [image.num_soft_tokens], cfg)
  cache = _encode(vision_chat.sampler.model, vision_chat.variables, jnp.asarray([ids]), image.pixel_values[None],
                  image.position_ids[None])
  np.testing.assert_allclose(logits[0], _first_step_logits(vision_chat, cache), atol=1e-4)


def test_rows_with_and_without_images_batch_together(vision_chat):
  cfg, sampler, variables = vision_chat.config, vision_chat.sampler, vision_chat.variables
  image = images_lib.preprocess(_image(2, 50, 30), 70, patch_size=4)
  with_image = [cfg.bos_id, 20, *([cfg.image_id]), 21, 22]
  with_image = images_lib.expand_image_placeholders(with_image, [image.num_soft_tokens], cfg)
  text_only = [cfg.bos_id, 30, 31, 32, 33]
  out = sampler.generate(variables, [with_image, text_only], jax.random.key(0), 8, return_cache=True,
                         images=(image.pixel_values[None], image.position_ids[None]))
  for row, (ids, pixels) in enumerate([(with_image, (image.pixel_values[None], image.position_ids[None])),
                                       (text_only, (None, None))]):
    alone = _encode(sampler.model, variables, jnp.asarray([ids]), *pixels)
    for layer in (0, cfg.num_layers - 1):
      np.testing.assert_allclose(out.cache.keys[layer][row, :len(ids)], alone.keys[layer][0], atol=1e-4)
  assert out.cache.length.tolist() == [len(with_image), len(text_only)]
  with pytest.raises(ValueError, match=r"hold 0 image soft-token placeholders .* 1 images have \d+ soft tokens"):
    sampler.generate(variables, [text_only], jax.random.key(0), 8,
                     images=(image.pixel_values[None], image.position_ids[None]))
  with pytest.raises(ValueError, match="no images were given"):
    sampler.generate(variables, [with_image], jax.random.key(0), 8)


def test_bad_images_are_clear_errors(vision_chat, loaded, tmp_path):
  garbage = tmp_path / "garbage.png"
  garbage.write_bytes(b"not an image")
  chat = _conversation(vision_chat, image_budget=70)
  with pytest.raises(ValueError, match="Cannot read image .*garbage.png"):
    chat.send("What is this?", images=[garbage])
  with pytest.raises(FileNotFoundError, match="missing.png"):
    chat.send("What is this?", images=[tmp_path / "missing.png"])
  assert chat.history == []
  with pytest.raises(ValueError, match="has no vision encoder"):
    _conversation(loaded).send("What is this?", images=[_image(0, 30, 30)])


@pytest.mark.slow  # the same path as an image turn, with another program (two frames)
def test_a_video_turn_runs(vision_chat):
  chat = _conversation(vision_chat)
  frames = [_image(i, 30, 40) for i in range(4)]  # 2 s at 2 fps: frames 0 and 2, at 00:00 and 00:01
  reply = chat.send("What happens?", video=(frames, 2.0), seed=0)
  assert reply.prompt == ("<bos><|turn>user\n00:00 <|image|> 00:01 <|image|>What happens?<turn|>\n"
                          "<|turn>model\n")
  assert reply.stats["new_tokens"] >= 1 and len(chat._images) == 2  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"lasts 61.0 s \(61 frames at 1 fps\); at most 60 s"):
    chat.send("What happens?", video=(np.zeros((61, 8, 8, 3), np.uint8), 1.0))


# --- the sample script --------------------------------------------------------------------------------


@pytest.mark.slow
def test_sample_script_with_a_checkpoint_alone_and_an_image(vision_checkpoint, tmp_path):
  """scripts/sample.py --hf_checkpoint needs no --config or --workdir (the checkpoint's tokenizer and
  generation defaults) and takes --image."""
  image = tmp_path / "image.png"
  PIL.Image.fromarray(_image(0, 40, 60)).save(image)
  result = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "sample.py"), f"--hf_checkpoint={vision_checkpoint}",
       f"--image={image}", "--image_budget=70", "--prompt=Hello", "--prompt=Hi", "--preset=creative"],
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "max_denoising_steps 12" in out and "t_max 1" in out and "entropy_bound 0.15" in out
  assert "stop_tokens [1, 6]" in out and out.count("--- [") == 2 and "diffusion: rows 2" in out


@pytest.mark.slow
def test_turn_two_after_a_long_system_prompt_encodes_only_its_new_tokens(loaded):
  """After a ~600-token system prompt (the cache grows past its first bucket of prompt positions), turn 2
  encodes only what it adds (under a fifth of the conversation), against a conversation that encodes
  everything every turn. (Their replies may differ: this random model's near-flat logits turn the two
  encodings' float rounding into different draws; the short conversation above checks equal replies.)"""
  system = " ".join(f"Rule {i}: answer in plain words." for i in range(20))
  replies = {}
  for reuse in (True, False):
    chat = _conversation(loaded, reuse_cache=reuse)
    chat.send("What is 2+2?", system=system, seed=1)
    replies[reuse] = chat.send("And 3+3?", seed=2)
  kept, fresh = replies[True], replies[False]
  assert fresh.stats["encoded_tokens"] == fresh.stats["prompt_tokens"] > 600
  assert kept.stats["prompt_tokens"] == fresh.stats["prompt_tokens"]
  assert kept.stats["encoded_tokens"] == kept.stats["prompt_tokens"] - kept.stats["reused_tokens"]
  assert kept.stats["encoded_tokens"] < kept.stats["prompt_tokens"] / 5
