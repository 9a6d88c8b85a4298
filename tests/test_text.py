"""The text project (projects/text): distillation data, its task, the recipe end to end on a tiny corpus,
the text-against-AR benchmark's JSON, and the shipped weights."""

import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import build
from diffusiongemma.build import release
from diffusiongemma.build.config import load_config_file
from projects.text import runs
from projects.text import task as task_lib
from projects.text import teacher

ROOT = pathlib.Path(__file__).parent.parent
CONFIG = ROOT / "projects" / "text" / "config.py"


def test_teacher_rows_hold_eos_after_the_stop_and_ar_targets_on_the_prompt_only():
  prompt = np.arange(3, 7)
  continuation = np.array([9, 9, 1, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8])  # EOS (1) at 2, then pad (0)
  row = task_lib.teacher_example(prompt, continuation, canvas_length=8, eos_id=1)
  np.testing.assert_array_equal(row["tokens"], [3, 4, 5, 6, 9, 9] + [1] * 14)
  assert row["prompt_length"] == 4 and row["num_canvases"] == 1
  np.testing.assert_array_equal(row["ar_targets"], [True] * 4 + [False] * 16)
  whole = task_lib.teacher_example(prompt, np.full(16, 9), canvas_length=8, eos_id=1)
  assert whole["num_canvases"] == 2 and (whole["tokens"][4:] == 9).all()
  with pytest.raises(ValueError, match="not whole canvases of 8"):
    task_lib.teacher_example(prompt, np.full(12, 9), canvas_length=8, eos_id=1)


def test_held_out_prompt_sets_are_separate_and_parse():
  sets = {name: [json.loads(line) for line in (runs.PROMPTS / f"{name}.jsonl").read_text().splitlines()]
          for name in ("dev", "validation", "packages")}
  assert all(len(records) >= 32 for records in sets.values())
  prompts = {name: {r["prompt"] for r in records} for name, records in sets.items()}
  assert not prompts["dev"] & (prompts["validation"] | prompts["packages"])
  assert all("stdlib validation split" in r["source"] for r in sets["validation"])
  assert not any("stdlib" in r["source"] for r in sets["packages"])


def _run(*args, timeout=900):
  return subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True, text=True,
                        timeout=timeout)


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
  """The recipe of projects/text/config.py:tiny on a corpus of a few standard-library files: pretraining
  (8 steps), the teacher's greedy continuations, distillation (4 steps). Returns the folders."""
  root = tmp_path_factory.mktemp("text_recipe")
  corpus = root / "corpus"
  corpus.mkdir()
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  for name in ("textwrap.py", "shlex.py", "glob.py", "fnmatch.py", "bisect.py", "colorsys.py", "keyword.py",
               "opcode.py", "stat.py", "string.py", "tabnanny.py", "heapq.py"):
    shutil.copy(stdlib / name, corpus / name)
  common = [f"--config.data.corpus={corpus}", "--config.data.validation_fraction=0.2",
            "--config.train.eval_every=0", "--config.train.checkpoint_every=4"]
  pre, folder, distilled = root / "pretrain", root / "teacher", root / "distil"
  _run("scripts/train.py", f"--config={CONFIG}:tiny", f"--workdir={pre}", "--config.train.num_steps=8", *common)
  _run("-m", "projects.text.teacher", f"--workdir={pre}", f"--output={folder}", "--num_prompts=24",
       "--num_validation=8", "--batch_size=8")
  _run("scripts/train.py", f"--config={CONFIG}:tiny_distil", f"--workdir={distilled}",
       "--config.train.num_steps=4", f"--config.train.init_from={pre}",
       f"--config.data.tokenizer_path={pre / 'tokenizer.model'}", f"--config.data.distil.teacher={folder}", *common)
  return pre, folder, distilled


@pytest.mark.slow
def test_teacher_data_is_ar_greedy_and_refuses_other_weights(tiny_recipe, tmp_path):
  """Every stored continuation is `ARSampler`'s greedy output for its prompt decoded alone; a folder made by
  other weights is refused, not mixed."""
  pre, folder, distilled = tiny_recipe
  prompts, continuations = teacher.load(folder, "train")
  assert prompts.shape == (24, 16) and continuations.shape == (24, 16)
  config = build.workdir_config(pre)
  weights = build.load(config, workdir=pre)
  ar = dg.ARSampler(dg.DiffusionGemma(weights.model_config), stop_tokens=(1,), prompt_bucket=16)
  for i in (0, 7, 23):
    alone = ar.generate(weights.variables, prompts[i:i + 1], jax.random.key(5), 16, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], continuations[i])
  provenance = teacher.provenance(folder)
  assert provenance["teacher"]["params_sha256"] == teacher.params_hash(weights.variables)
  assert provenance["decoding"]["temperature"] == 0.0 and sum(p["rows"] for p in provenance["parts"].values()) == 32
  with pytest.raises(ValueError, match="made with other teacher"):
    teacher.make(distilled, folder, num_prompts=24, num_validation=8, batch_size=8)


@pytest.mark.slow
def test_distilled_run_decodes_and_the_benchmark_writes_every_field(tiny_recipe, tmp_path):
  """benchmarks.text_vs_ar on the distilled tiny run: every field of its interface, keyed by batch size."""
  _, _, distilled = tiny_recipe
  prompts = tmp_path / "prompts.jsonl"
  lines = (runs.PROMPTS / "validation.jsonl").read_text().splitlines()[:5]
  prompts.write_text("\n".join(lines + ['{"prompt": "def f(x):\\n", "source": "extra keys are ignored"}']) + "\n")
  output = tmp_path / "text.json"
  _run("-m", "benchmarks.text_vs_ar", f"--workdir={distilled}", f"--prompts={prompts}", f"--output={output}",
       "--max_new_tokens=16", "--timing_prompts=2", "--repeats=1", "--allow_load")
  result = json.loads(output.read_text())
  d, a = result["diffusion"], result["ar"]
  assert result["num_prompts"] == 6 and 1.0 <= d["tokens_per_pass"] <= 8.0
  for side in (d, a):
    assert side["judged_perplexity"] > 1 and 0 <= side["distinct_4gram"] <= 1
    assert set(side["tokens_per_second"]) == {"1", "8"} and all(v > 0 for v in side["tokens_per_second"].values())
  assert len(result["machine"]["load_average"]) == 3 and result["machine"]["git_commit"]
  assert result["settings"]["decoder"] == "speculative" and result["settings"]["sampler"]["draft_length"] == 8
  assert result["settings"]["max_new_tokens"] == 16 and d["judged_perplexity"] == a["judged_perplexity"]
  # Shipped as the text weights are: bf16 parameters, the tokenizer its config names (the run has none).
  pre = tiny_recipe[0]
  assert not (distilled / release.TOKENIZER).exists()
  folder = release.save(distilled, tmp_path / "shipped", {"command": "test"}, storage_dtype="bfloat16")
  _, variables, provenance = release.load(folder)
  assert (folder / release.TOKENIZER).read_bytes() == (pre / "tokenizer.model").read_bytes()
  assert provenance == {"step": 4, "storage_dtype": "bfloat16", "command": "test"}
  trained = build.load(build.workdir_config(distilled), workdir=distilled).variables
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(
      got, np.asarray(want).astype(jnp.bfloat16).astype(np.float32)), variables, trained)
  # One pass's cost per way of running the experts (timings unchecked: only that it measures each).
  _run("-m", "benchmarks.pass_cost", f"--workdir={distilled}", f"--output={tmp_path / 'passes.json'}",
       "--tokens=1,5", "--moe=grouped,slab", "--repeats=1", "--max_load=1000")
  passes = json.loads((tmp_path / "passes.json").read_text())["passes"]
  assert passes["grouped"]["5"]["plan"] == "dense" and passes["slab"]["5"]["plan"] == "slab"
  assert passes["slab"]["1"]["plan"] == "gathered" and passes["grouped"]["1"]["encode_ms"] > 0
  (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"text": "no prompt"}\n')
  with pytest.raises(subprocess.CalledProcessError) as error:
    _run("-m", "benchmarks.text_vs_ar", f"--workdir={distilled}", f"--prompts={tmp_path / 'bad.jsonl'}",
         f"--output={output}", "--allow_load")
  assert "bad.jsonl: line 2 has no string field 'prompt'" in error.value.stderr


def test_the_text_config_builds_every_variant(tmp_path):
  for arg in ("pretrain", "distil", "tiny", "tiny_distil"):
    config = load_config_file(CONFIG, arg)
    sampler = build.sampler(config)
    assert sampler.config.draw == "argmax" and sampler.noise.name == "masked"
  with pytest.raises(ValueError, match="config.data.distil.teacher is empty"):
    config = load_config_file(CONFIG, "tiny_distil")
    next(iter(build.train_task(config, tmp_path).datasets("train")))


_SHIPPED = """
import json
from projects.text import runs
run = runs.load()
prompts = runs.read_prompts(runs.PROMPTS / "validation.jsonl", run.tokenizer)
continuations, passes = runs.speculative(run.speculative_sampler(), run.variables, prompts, 128, 64)
print(json.dumps({"source": run.source, "tokens": sum(map(len, continuations)), "passes": passes.tolist()}))
"""


def test_the_shipped_weights_write_ar_greedy_text_at_over_4_tokens_per_denoiser_pass(optimized_env):
  """projects/text/weights/distilled, self-speculative at its shipped setting (16-token drafts) on the
  64 validation prompts in one batch: >= 4 new tokens per denoiser pass (the text is AR greedy's by
  construction, which tests/test_sampling.py checks on a tiny model). A process of its own: compute-bound."""
  result = subprocess.run([sys.executable, "-c", _SHIPPED], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          check=False, env=optimized_env)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert "shipped distilled text weights" in out["source"]
  assert out["tokens"] / np.sum(out["passes"]) >= 4.0, out["passes"]
