"""Generative quality: the metrics on hand-built inputs, the AR-baseline objective, and the binaries
(evaluate.py --generative, sweep.py, benchmarks/suite.py, sample.py) end to end on tiny workdirs trained for a few
steps with masked noise: each binary must sample with the noise the model was trained with."""

import functools
import json
import math
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import diffusion
from diffusiongemma.build.config import load_config_file
from diffusiongemma.evaluation import generative as quality
from test_training import _script_args, corpus, VOCAB  # noqa: F401  (corpus is a fixture)

ROOT = pathlib.Path(__file__).parent.parent
TINY = dg.ModelConfig.from_dict({**load_config_file(ROOT / "configs" / "tiny.py").model.to_dict(),
                                 "vocab_size": 64, "num_layers": 2, "canvas_length": 8, "moe_impl": "dense"})


@pytest.fixture(scope="module")
def judge():
  model = dg.DiffusionGemma(TINY)
  return quality.Judge("self", model, dg.build.random_variables(TINY, seed=3))


def test_unigram_entropy_of_constant_uniform_and_empty_sequences():
  assert quality.unigram_entropy([7] * 50) == 0.0
  np.testing.assert_allclose(quality.unigram_entropy(np.arange(64)), math.log(64), rtol=1e-12)
  np.testing.assert_allclose(quality.unigram_entropy([1, 1, 2, 2]), math.log(2), rtol=1e-12)
  with pytest.raises(ValueError, match="empty"):
    quality.unigram_entropy([])


def test_perplexity_is_exp_of_the_mean_nll_computed_row_by_row(judge):
  rng = np.random.default_rng(0)
  splits = ((5, 7), (9, 3), (1, 11))  # equal total lengths: one unpadded reference call
  prompts = [rng.integers(3, 64, p).tolist() for p, _ in splits]
  continuations = [rng.integers(3, 64, c).tolist() for _, c in splits]
  nll, count = quality.continuation_nll(judge, prompts, continuations)  # right-padded to 64
  np.testing.assert_array_equal(count, [7, 3, 11])
  rows = np.array([p + c for p, c in zip(prompts, continuations)], np.int32)
  logits, _ = jax.jit(lambda v, t: judge.model.apply(v, t, method=judge.model.encode))(judge.variables, rows)
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))  # [3, 12, V]
  expected = [-sum(log_probs[i, j - 1, rows[i, j]] for j in range(p, p + c))
              for i, (p, c) in enumerate(splits)]
  np.testing.assert_allclose(nll, expected, rtol=2e-5)
  np.testing.assert_allclose(quality.perplexity(judge, prompts, continuations),
                             math.exp(sum(expected) / 21), rtol=2e-5)


def test_score_reports_judges_entropy_and_the_reference(judge):
  prompts = [[3, 4, 5]] * 2
  scores = quality.score(prompts, [[9] * 6, [9, 10]], [judge], references=[list(range(10, 30))] * 2)
  assert scores["num_samples"] == 2 and scores["new_tokens"] == 8 and scores["mean_length"] == 4
  np.testing.assert_allclose(scores["unigram_entropy"], math.log(2) / 2)
  np.testing.assert_allclose(scores["reference_unigram_entropy"], (math.log(6) + math.log(2)) / 2)
  for key in ("perplexity_self", "reference_perplexity_self"):
    assert 1 < scores[key] < 10 * TINY.vocab_size


def test_zero_diffusion_weight_trains_the_encoder_alone(judge):
  batch = {"tokens": np.random.default_rng(1).integers(3, 64, (2, 24)).astype(np.int32),
           "prompt_length": np.full((2,), 8, np.int32)}

  @functools.partial(jax.jit, static_argnums=0)
  def loss(config, variables):
    return diffusion.diffusion_loss(judge.model, variables, batch, jax.random.PRNGKey(0), config,
                                    num_canvases=2)

  noise = diffusion.UniformNoise(TINY.vocab_size)
  both = loss(diffusion.LossConfig(noise=noise, self_conditioning_prob=0.0), judge.variables)[1]
  total, ar_only = loss(diffusion.LossConfig(noise=noise, diffusion_loss_weight=0.0), judge.variables)
  np.testing.assert_allclose(total, both["ar_loss"], rtol=1e-6)
  assert float(ar_only["diffusion_loss"]) == 0.0
  np.testing.assert_allclose(both["loss"], both["diffusion_loss"] + both["ar_loss"], rtol=1e-6)
  with pytest.raises(ValueError, match="diffusion_loss_weight must be >= 0, got -1"):
    diffusion.LossConfig(noise=noise, diffusion_loss_weight=-1.0)
  with pytest.raises(ValueError, match="both 0"):
    diffusion.LossConfig(noise=noise, diffusion_loss_weight=0.0, ar_loss_weight=0.0)
  ar = load_config_file(ROOT / "configs" / "small_ar.py", "tiny")
  assert ar.diffusion.diffusion_loss_weight == 0.0 and ar.model == load_config_file(ROOT / "configs" /
                                                                                       "tiny.py").model


def _run(args, timeout=600):
  result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


# Masked noise needs its mask token outside the tokenizer: one more model vocabulary entry, for the
# baseline judge too (a judge shares the model's vocabulary).
MASKED = ("--config.diffusion.noise=masked", f"--config.model.vocab_size={VOCAB + 1}")


def _masked_args(corpus, workdir, num_steps, *extra):  # noqa: F811
  return _script_args(corpus, workdir, num_steps, *MASKED, *extra)


@pytest.fixture(scope="module")
def workdirs(corpus, tmp_path_factory):  # noqa: F811
  """A tiny masked-noise diffusion model and its AR baseline (configs/small_ar.py:tiny), 4 steps each,
  same tokenizer."""
  root = tmp_path_factory.mktemp("quality")
  _run(_masked_args(corpus, root / "diffusion", 4))
  baseline = _masked_args(corpus, root / "ar", 4)
  baseline[2] = f"--config={ROOT / 'configs' / 'small_ar.py'}:tiny"
  _run(baseline)
  return root / "diffusion", root / "ar"


def _with_script(args, script, *extra):
  """train.py's command line (config and overrides) for another binary (`script`: its path from the
  repository root), without the train flags."""
  return [args[0], str(ROOT / script), *args[2:], *extra]


def _check_masked_settings(settings, **expected):
  """The recorded settings are those of the masked model's sampler (every field, the noise included)."""
  assert settings["noise"] == "masked" and settings["never_token"] == VOCAB
  assert settings["acceptance_rule"].startswith("EntropyBound(") and "ArgmaxStable" in settings["stopping_rule"]
  for key, value in expected.items():
    assert settings[key] == value, (key, settings[key], value)


@pytest.mark.slow
def test_evaluate_generative_end_to_end(corpus, workdirs):  # noqa: F811
  diffusion_dir, ar_dir = workdirs
  args = _with_script(_masked_args(corpus, diffusion_dir, 4), "scripts/evaluate.py", "--generative",
                      "--num_samples=3", "--batch_size=2", "--max_new_tokens=8",
                      f"--baseline_workdir={ar_dir}", "--config.sampler.max_denoising_steps=6")
  _run(args)
  results = json.loads((diffusion_dir / "generative.json").read_text())
  assert results["num_samples"] == 3 and results["max_denoising_steps"] == 6
  assert "step 4" in results["weights"]
  _check_masked_settings(results["sampler"], max_denoising_steps=6)
  for key in ("perplexity_self", "perplexity_baseline", "reference_perplexity_self",
              "reference_perplexity_baseline", "pooled_tokens_per_forward", "unigram_entropy"):
    assert math.isfinite(results[key]) and results[key] > 0, (key, results[key])
  # Four steps of training: every judge is still close to uniform over the vocabulary.
  for key in ("perplexity_self", "perplexity_baseline"):
    assert 0.3 * VOCAB < results[key] < 3 * VOCAB, (key, results[key])
  assert results["unigram_entropy"] <= math.log(results["mean_length"]) + 1e-9


@pytest.mark.slow
def test_sweep_writes_json_and_png_with_the_defaults_marked(corpus, workdirs, tmp_path):  # noqa: F811
  diffusion_dir, ar_dir = workdirs
  output = tmp_path / "sweep.json"
  args = _with_script(_masked_args(corpus, diffusion_dir, 4), "experiments/sweep.py", "--entropy_bounds=1.0",
                      "--max_steps=48", "--num_samples=2", "--batch_size=2", "--max_new_tokens=8",
                      f"--baseline_workdir={ar_dir}", f"--output={output}")
  result = _run(args)
  sweep = json.loads(output.read_text())
  grid = {(s["entropy_bound"], s["max_denoising_steps"]) for s in sweep["settings"]}
  assert grid == {(0.1, 48), (1.0, 48)}  # the released default bound is added
  assert sweep["judge"] == "baseline"
  assert sweep["defaults"] == {"entropy_bound": 0.1, "max_denoising_steps": 48}
  for s in sweep["settings"]:
    _check_masked_settings(s["sampler"], entropy_bound=s["entropy_bound"], max_denoising_steps=48)
    for key in ("pooled_tokens_per_forward", "perplexity_baseline", "perplexity_self", "unigram_entropy"):
      assert math.isfinite(s[key]) and s[key] > 0, (key, s)
    assert s["steps_per_canvas"] <= s["max_denoising_steps"]
  assert pathlib.Path(sweep["plot"]).read_bytes()[:4] == b"\x89PNG"
  assert "| entropy bound | max steps |" in result.stdout


@pytest.mark.slow
def test_benchmark_samples_with_the_trained_noise_and_reports_the_samplers_statistics(corpus, workdirs):  # noqa: F811
  """benchmarks/suite.py on the masked workdir: the recorded settings are the masked model's, and its statistics
  are the sampler's own: the same sampler built here, on the recorded prompts, gives the same per-row
  tokens per forward, and the summaries follow from them."""
  diffusion_dir, _ = workdirs
  output = diffusion_dir / "bench" / "benchmark.json"
  result = _run(_with_script(_masked_args(corpus, diffusion_dir, 4), "benchmarks/suite.py", "--quick",
                             "--max_new_tokens=16", "--prompt_length=8", f"--output={output}",
                             "--config.sampler.max_denoising_steps=6"), timeout=900)
  results = json.loads(output.read_text())
  _check_masked_settings(results["sampler"], max_denoising_steps=6, max_new_tokens=16)
  assert "step 4" in results["params"] and "noise masked" in result.stdout
  config = load_config_file(ROOT / "configs" / "tiny.py")
  for key, value in [f.split("=", 1) for f in _masked_args(corpus, diffusion_dir, 4)[4:]]:
    section, field = key[len("--config."):].split(".")
    config[section][field] = type(config[section][field])(value)
  config.sampler.max_denoising_steps = 6
  weights = dg.build.load(config, workdir=diffusion_dir)
  sampler = dg.build.sampler(config, weights.model_config)
  assert sampler.noise == diffusion.MaskedNoise(VOCAB + 1)
  out = sampler.generate(weights.variables, np.asarray(results["prompts"]), jax.random.key(1), 16)
  row = results["decoding"][0]
  np.testing.assert_allclose(row["row_tokens_per_forward"], np.asarray(out.tokens_per_forward), rtol=1e-6)
  summary = dg.sampling.stats.summary(out.tokens, out.canvas_passes, weights.model_config.pad_id)
  for key in ("pooled_tokens_per_forward", "mean_tokens_per_forward", "steps_per_canvas", "denoiser_passes"):
    np.testing.assert_allclose(row[key], summary[key], rtol=1e-6)
  assert row["diffusion_new_tokens"] == summary["new_tokens"]
  assert [r["batch_size"] for r in results["decoding"]] == [1, 4]
  for r in results["decoding"]:
    for key in ("diffusion_tokens_per_second", "ar_tokens_per_second", "speedup", "diffusion_latency_seconds"):
      assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
    assert 0 < r["steps_per_canvas"] <= 6
  for key in ("denoiser_mfu", "ar_step_bandwidth_fraction", "denoiser_flops"):
    assert math.isfinite(results["efficiency"][key]) and results["efficiency"][key] > 0, key
  step = results["step"]
  for key in ("denoiser_fraction", "head_fraction", "sampling_fraction", "rest_fraction", "step_seconds"):
    assert math.isfinite(step[key]) and step[key] >= 0, key
  # Standalone timings of the parts can overlap a step's (their sum tops 1 on a busy machine): sampling is
  # the rest of the step, never below 0.
  rest = max(0.0, 1.0 - step["denoiser_fraction"] - step["head_fraction"])
  assert step["sampling_fraction"] == pytest.approx(rest)
  assert [r["config"] for r in results["training"]] == ["tiny"]
  for plot in results["plots"]:
    assert pathlib.Path(plot).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_sample_script_samples_with_the_trained_noise(corpus, workdirs):  # noqa: F811
  diffusion_dir, _ = workdirs
  result = _run(_with_script(_masked_args(corpus, diffusion_dir, 4), "scripts/sample.py", "--prompt=def f(",
                             "--max_new_tokens=8", "--config.sampler.max_denoising_steps=4"))
  assert "noise masked" in result.stdout and f"never_token {VOCAB}" in result.stdout
  assert "step 4" in result.stdout
  result = _run(_with_script(_masked_args(corpus, diffusion_dir, 4), "scripts/sample.py", "--prompt=def f(",
                             "--prompt=x = ", "--max_new_tokens=8", "--decoder=speculative", "--temperature=0.8",
                             "--draft_length=4"))  # self-speculative sampling at a temperature
  assert "speculative: draft_length 4, temperature 0.8, top_p 1.0" in result.stdout
  assert result.stdout.count("--- [") == 2 and re.search(r"speculative: \d+ tokens in \d+ denoiser passes",
                                                         result.stdout), result.stdout


def test_precision_compares_bfloat16_with_float32_on_a_text_run(workdirs, tmp_path):
  """benchmarks/precision.py --text_workdir: the trained run's weights continue validation prompts in float32
  and in bfloat16 with the same keys; the JSON says how many new tokens agree and records both times."""
  diffusion_dir, _ = workdirs
  output = tmp_path / "precision.json"
  _run([sys.executable, "-m", "benchmarks.precision", f"--text_workdir={diffusion_dir}", "--text_samples=3",
        "--batch_size=2", "--repeats=1", f"--output={output}"])
  report = json.loads(output.read_text())
  assert report["settings"]["prompts"] == 3 and "step 4" in report["settings"]["weights"]
  assert report["settings"]["sampler"]["dtype"] == "float32" and report["settings"]["sampler"]["noise"] == "masked"
  for key in ("new_tokens_equal_to_float32", "rows_equal_to_float32", "first_step_argmax_equal"):
    assert 0.0 <= report[key] <= 1.0, (key, report[key])
  assert set(report["seconds_batch"]) == set(report["seconds_batch_1"]) == {"float32", "bfloat16"}
  assert report["speed_over_float32_batch"] > 0 and report["machine"]["git_commit"]
  for name in ("float32", "bfloat16"):  # what each wrote, judged by the float32 model
    assert report["judged"][name]["num_samples"] == 3 and report["judged"][name]["perplexity_self"] > 1
