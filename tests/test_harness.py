"""The lm-evaluation-harness model `diffusiongemma` (build/harness.py) and what it runs (evaluation/harness.py,
evaluation/likelihood.py) on a tiny random transformers checkpoint with a Gemma-like tokenizer
(tests/chat_fixtures.py; 2 layers, canvas 8, 12 denoising steps), in float32.

Log-likelihoods are checked against transformers' own encoder; generation against the module's rules
(stop strings, canvases, batch sizes); the harness's command line runs the local tasks of
tests/harness_tasks offline.
"""

import dataclasses
import glob
import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import chat_fixtures
from diffusiongemma.build.config import load_config_file
from diffusiongemma.chat import format as chat_format
from diffusiongemma.evaluation import harness as harness_lib
from diffusiongemma.evaluation import likelihood

torch = pytest.importorskip("torch")  # the checkpoint is written by transformers
lm_eval_utils = pytest.importorskip("lm_eval.utils")  # the `eval` extra
from diffusiongemma.build import harness as build_harness  # pylint: disable=g-import-not-at-top,wrong-import-position
from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.hf
ROOT = pathlib.Path(__file__).parent.parent
HARNESS_DEFAULTS = {"batch_size": "1", "device": "cuda:0", "max_batch_size": None}  # what lm-eval passes
C = 8  # the fixture's canvas
BOS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  folder = tmp_path_factory.mktemp("harness_checkpoint")
  reference = chat_fixtures.write_chat_checkpoint(folder, num_hidden_layers=2)
  return folder, reference


@pytest.fixture(scope="module")
def lm(checkpoint):
  args = f"hf_checkpoint={checkpoint[0]},batch_size=4,max_gen_toks=24"  # dtype: auto, the checkpoint's float32
  return build_harness.DiffusionGemmaLM.create_from_arg_string(args, HARNESS_DEFAULTS)


def _with(harness, **settings):
  """Another harness on the same objects (compiled programs are shared where shapes agree)."""
  return harness_lib.Harness(harness.model, harness.variables, harness.tokenizer, harness.sampler,
                             dataclasses.replace(harness.settings, **settings),
                             make_sampler=harness.make_sampler, adapters=harness.adapters)


def _enc(folder, text):
  """The reference tokenization: tokenizer.json through the `tokenizers` library, no special tokens."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _reference(model, context_ids, continuation_ids):
  """(sum of log_softmax(softcap(lm_head(encoder hidden))) over the continuation, greedy) by transformers."""
  tokens = list(context_ids) + list(continuation_ids)
  logits = torch.as_tensor(hf_reference.encoder_logits(model, np.asarray([tokens[:-1]])))[0]
  log_p = torch.log_softmax(logits.double(), -1)
  rows = range(len(context_ids) - 1, len(tokens) - 1)
  total = sum(float(log_p[i, t]) for i, t in zip(rows, continuation_ids))
  return total, all(int(logits[i].argmax()) == t for i, t in zip(rows, continuation_ids))


def _split(folder, context, continuation):
  """The harness's HF split, written out: trailing spaces move to the continuation, whole vs context."""
  if not context:
    return [BOS], _enc(folder, continuation)
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole, ctx = [BOS] + _enc(folder, context + continuation), [BOS] + _enc(folder, context)
  return ctx, whole[len(ctx):]


REQUESTS = [("The cat sat on the", " mat"), ("Question: 2+2=\nAnswer: ", "4 exactly"), ("", "Hello world"),
            ("A", "bc"), ("Some much longer context that spans several buckets of tokens? " * 2, " yes")]


def _greedy_request(folder, reference):
  """A (context, continuation) whose continuation is the model's argmax next character after the context."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
  for i in range(50):
    context = f"Greedy probe {i}:"
    logits = hf_reference.encoder_logits(reference, np.asarray([[BOS] + _enc(folder, context)]))
    piece = tokenizer.id_to_token(int(logits[0, -1].argmax()))
    if len(piece) == 1 and piece.isprintable() and not piece.isspace():
      return context, piece
  raise AssertionError("no printable greedy continuation found")


def test_loglikelihood_equals_transformers_and_an_off_by_one_boundary_fails(lm, checkpoint):
  """With the default dtype (auto: the checkpoint's own, float32 here, as lm-eval's HF model computes it)."""
  folder, reference = checkpoint
  assert build_harness.checkpoint_dtype(folder) == "float32" and lm.loaded.model.config.dtype == "float32"
  requests = REQUESTS + [_greedy_request(folder, reference)]
  ours = lm.loglikelihood([Instance("loglikelihood", {}, request, i) for i, request in enumerate(requests)])
  greedy_seen = []
  for (context, continuation), (value, greedy) in zip(requests, ours):
    ctx, cont = _split(folder, context, continuation)
    expected, expected_greedy = _reference(reference, ctx, cont)
    assert abs(value - expected) < 1e-4, (context, continuation, value, expected)
    assert greedy == expected_greedy
    greedy_seen.append(greedy)
    # The boundary one token earlier or later scores other tokens: far outside the tolerance.
    for shifted in (_reference(reference, ctx[:-1], ctx[-1:] + cont)[0],
                    _reference(reference, ctx + cont[:1], cont[1:])[0] if len(cont) > 1 else None):
      assert shifted is None or abs(value - shifted) > 1e-2
  assert greedy_seen[-1] and not any(greedy_seen[:-1])
  # Batched, one by one and head-chunked: equal within float32 rounding of sums of up to ~200 nats.
  one_by_one = _with(lm.harness, batch_size=1).loglikelihood(requests)
  np.testing.assert_allclose([v for v, _ in one_by_one], [v for v, _ in ours], atol=1e-5, rtol=1e-6)
  assert [g for _, g in one_by_one] == [g for _, g in ours]
  h = lm.harness
  scored = [h._scored(*h.encode_pair(*request)) for request in requests]  # pylint: disable=protected-access
  chunked = likelihood.exact(h.model, h.variables, scored, head_chunk=4)  # the head 4 targets at a time
  np.testing.assert_allclose([v for v, _ in chunked], [v for v, _ in ours], atol=1e-5, rtol=1e-6)
  assert [g for _, g in chunked] == greedy_seen


def test_rolling_windows_are_the_harness_windows_and_score_like_transformers(lm, checkpoint):
  for n, max_length in ((1, 4), (5, 5), (9, 4), (23, 8), (7, 100)):
    tokens = list(range(10, 10 + n))
    expected = [lm_eval_utils.make_disjoint_window(w)
                for w in lm_eval_utils.get_rolling_token_windows(tokens, BOS, max_length, 1)]
    assert harness_lib.rolling_windows(tokens, BOS, max_length) == expected
  folder, reference = checkpoint
  text = "A rolling text, long enough for three windows."
  short = _with(lm.harness, max_length=16)
  windows = harness_lib.rolling_windows(_enc(folder, text), BOS, 16)
  assert len(windows) >= 3
  expected = sum(_reference(reference, ctx, cont)[0] for ctx, cont in windows)
  value, empty = short.loglikelihood_rolling([text, ""])
  assert abs(value - expected) < 1e-4 and empty == 0.0
  whole = lm.harness.loglikelihood_rolling([text])[0]  # one window: every token sees all before it
  assert abs(whole - _reference(reference, [BOS], _enc(folder, text))[0]) < 1e-4


def test_elbo_is_a_deterministic_per_request_bound(lm):
  bound = _with(lm.harness, likelihood="elbo", elbo_samples=4)
  requests = REQUESTS[:4]
  values = bound.loglikelihood(requests)
  exact = lm.harness.loglikelihood(requests)
  assert all(np.isfinite(v) and v < 0 for v, _ in values)
  assert [g for _, g in values] == [g for _, g in exact]  # is_greedy comes from the encoder
  alone = [bound.loglikelihood([request])[0][0] for request in requests]  # other rows, other places
  np.testing.assert_allclose(alone, [v for v, _ in values], rtol=1e-5)
  other_seed = _with(bound, seed=1).loglikelihood(requests)
  assert [v for v, _ in other_seed] != [v for v, _ in values]


def _generate(harness, context, **kwargs):
  text = harness.generate_until([(context, kwargs)])[0]
  return text, harness.generation_stats[0]


def _first_unique_char(text, start=1):
  """(index, character) of the first printable character of `text` at or after `start` that does not
  occur before it, or None."""
  for i in range(start, len(text)):
    if text[i].isprintable() and not text[i].isspace() and text[i] != "\ufffd" and text.find(text[i]) == i:
      return i, text[i]
  return None


def test_a_stop_string_cuts_at_its_earliest_occurrence_and_ends_the_canvases(lm):
  harness = lm.harness
  contexts = [f"Story {i}: once upon a time" for i in range(6)]
  full = harness.generate_until([(c, {"max_gen_toks": 3 * C}) for c in contexts])
  stats = list(harness.generation_stats)
  first = harness.generate_until([(c, {"max_gen_toks": C}) for c in contexts])
  first_stats = list(harness.generation_stats)
  picked = None
  for i, context in enumerate(contexts):
    if not full[i].startswith(first[i]):  # bytes of a later canvas re-decoded canvas 0's (module docstring)
      continue
    early = _first_unique_char(first[i])
    later = early and _first_unique_char(first[i], early[0] + 1)  # in the same canvas, after it
    late = _first_unique_char(full[i], len(first[i]))  # only in a later canvas
    if stats[i].ended_by == "length" and early and later and late and late[1] not in first[i]:
      picked = i, context, early, later, late
      break
  assert picked is not None, (full, stats)
  i, context, (at, stop), (_, later_stop), (_, late_stop) = picked
  assert stats[i].canvases == 3 and first_stats[i].canvases == 1
  text, stat = _generate(harness, context, max_gen_toks=3 * C, until=[late_stop, later_stop, stop])
  assert text == first[i][:at]
  assert (stat.canvases, stat.passes, stat.ended_by) == (1, first_stats[i].passes, "stop string")
  assert stat.passes < stats[i].passes
  text, stat = _generate(harness, context, max_gen_toks=3 * C, until=[late_stop])
  assert text == full[i][:full[i].find(late_stop)] and stat.canvases >= 2
  text, stat = _generate(harness, context, max_gen_toks=3 * C, until=["never appears"])
  assert (text, stat) == (full[i], stats[i])


def test_generation_is_the_same_with_batch_sizes_1_and_4(lm, caplog):
  requests = [("Q: What is 2+2?\nA:", {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False,
                                        "temperature": 0.0})] * 2
  requests += [(f"Prompt number {i} with some words", {"until": ["\n\n"], "max_gen_toks": 16}) for i in range(3)]
  with caplog.at_level(logging.WARNING):
    four = lm.harness.generate_until(requests)
  assert "ignores ['do_sample', 'temperature']" in caplog.text
  four_stats = list(lm.harness.generation_stats)
  single = _with(lm.harness, batch_size=1)
  assert single.generate_until(requests) == four
  assert single.generation_stats == four_stats
  assert four[0] != four[1]  # a repeated request is a new draw


def test_bad_input_is_refused_or_documented(lm, checkpoint, caplog):
  folder, reference = checkpoint
  harness = lm.harness
  with pytest.raises(ValueError, match="Empty continuation"):
    harness.loglikelihood([("Context", "")])
  with pytest.raises(ValueError, match="Empty continuation"):
    harness.loglikelihood([("", "")])
  # An empty context is scored after BOS (the harness's rule), as transformers scores [BOS] + text.
  value = harness.loglikelihood([("", "Hi there")])[0][0]
  assert abs(value - _reference(reference, [BOS], _enc(folder, "Hi there"))[0]) < 1e-4
  # A context longer than max_length is left-truncated with a warning, as the harness's HF model does.
  short = _with(harness, max_length=16, batch_size=1)
  context, continuation = "An overlong context that does not fit" * 2, " at all"
  with caplog.at_level(logging.WARNING):
    value = short.loglikelihood([(context, continuation)])[0][0]
  assert "left truncation" in caplog.text
  ctx, cont = _split(folder, context, continuation)
  kept = (ctx + cont)[-17:]
  assert abs(value - _reference(reference, kept[:len(kept) - len(cont)], cont)[0]) < 1e-4
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    text = _with(harness, max_length=40, batch_size=1).generate_until([(context, {"max_gen_toks": 8})])[0]
  assert "left-truncated to 32" in caplog.text and isinstance(text, str)
  with pytest.raises(ValueError, match="leaves no room for a prompt"):
    short.generate_until([("Hi", {"max_gen_toks": 16})])
  with pytest.raises(ValueError, match="Unknown generation arguments \\['beams'\\]"):
    harness.generate_until([("Hi", {"beams": 2})])
  with pytest.raises(ValueError, match="Unknown adapter 'nope'"):
    harness.generate_until([("Hi", {"adapter": "nope"})])
  with pytest.raises(ValueError, match="Unknown diffusiongemma model_args \\['pretrained'\\]"):
    build_harness.DiffusionGemmaLM.create_from_arg_string(f"pretrained={folder}", HARNESS_DEFAULTS)
  with pytest.raises(ValueError, match="no 'auto'"):
    build_harness.DiffusionGemmaLM.create_from_arg_string(f"hf_checkpoint={folder}", {"batch_size": "auto"})
  with pytest.raises(ValueError, match="not both"):
    build_harness.DiffusionGemmaLM.create_from_arg_string(f"hf_checkpoint={folder},workdir=/tmp", {})
  with pytest.raises(ValueError, match="needs hf_checkpoint=DIR"):
    build_harness.DiffusionGemmaLM.create_from_arg_string("seed=3", {})
  with pytest.raises(ValueError, match="max_length=999999 exceeds"):
    _with(harness, max_length=999_999)


def test_model_args_win_over_the_harness_defaults_and_name_sampler_settings(checkpoint, lm):
  assert lm.batch_size == 4 and lm.max_gen_toks == 24  # model_args batch_size=4 over lm-eval's "1"
  other = build_harness.DiffusionGemmaLM.create_from_arg_string(
      f"hf_checkpoint={checkpoint[0]},dtype=bfloat16,preset=creative,t_min=0.5,stop_tokens=1|6", HARNESS_DEFAULTS)
  config = other.harness.sampler.config
  assert (config.t_max, config.entropy_bound, config.t_min, config.stop_tokens) == (1.0, 0.15, 0.5, (1, 6))
  assert other.batch_size == 1
  assert other.loaded.model.config.dtype == "bfloat16"  # dtype= overrides the checkpoint's float32
  assert {str(x.dtype) for x in jax.tree.leaves(other.loaded.variables)} == {"bfloat16"}


def test_dtype_auto_reads_config_json_else_the_first_floating_point_tensor(checkpoint, tmp_path):
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  config = json.loads((checkpoint[0] / "config.json").read_text())
  for section in (config, config.get("text_config", {})):
    for key in ("dtype", "torch_dtype"):
      section.pop(key, None)
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file({"a_step": torch.zeros(2, dtype=torch.int64), "b_weight": torch.zeros(2, dtype=torch.bfloat16)},
            str(tmp_path / "model.safetensors"))
  assert build_harness.checkpoint_dtype(tmp_path) == "bfloat16"
  (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "torch.float16"}))
  assert build_harness.checkpoint_dtype(tmp_path) == "float16"
  (tmp_path / "model.safetensors").unlink()
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="names no dtype in config.json and holds no floating-point tensor"):
    build_harness.checkpoint_dtype(tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    build_harness.checkpoint_dtype(tmp_path / "missing")


def test_chat_template_is_the_gemma4_format(lm):
  history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
  prompt = lm.apply_chat_template(history)
  assert prompt == chat_format.render_prompt(history)
  assert prompt.endswith("<|turn>user\n2+2?<turn|>\n<|turn>model\n")
  ids = lm.harness.encode(prompt)
  assert ids[0] == BOS and ids[1] != BOS  # the template's BOS is not doubled
  prefill = lm.apply_chat_template(history + [{"role": "assistant", "content": "The answer is "}],
                                   add_generation_prompt=False)
  assert prefill == prompt + "The answer is"  # the model turn is left open
  assert lm.tokenizer_name.startswith("diffusiongemma:")


class ToyAdapter:
  """Digits in, letters out: its own prompt layout, answer mapping and a held first canvas."""

  held = [50, 51, 52]

  def __init__(self):
    self.answered = []

  def prompt_tokens(self, context):
    return [BOS] + [100 + int(d) for d in context]

  def answer(self, context, tokens):
    self.answered.append((context, list(tokens)))
    return "".join(chr(ord("a") + t % 26) for t in tokens)

  def generate_kwargs(self, contexts):
    canvas = np.full((len(contexts), C), 60, np.int32)
    given = np.zeros(canvas.shape, bool)
    canvas[:, :3], given[:, :3] = self.held, True
    return {"initial_canvas": canvas, "given": given}


def test_an_adapter_maps_requests_to_its_own_tokens_and_answers(checkpoint, monkeypatch):
  toy = ToyAdapter()
  monkeypatch.setitem(build_harness.ADAPTERS, "toy", lambda model, tokenizer: toy)
  lm = build_harness.DiffusionGemmaLM.create_from_arg_string(
      f"hf_checkpoint={checkpoint[0]},dtype=float32,batch_size=4", HARNESS_DEFAULTS)
  requests = [Instance("generate_until", {}, (digits, {"adapter": "toy", "max_gen_toks": 2 * C, "until": ["zz"]}), i)
              for i, digits in enumerate(["123", "4567", "89"])]
  texts = lm.generate_until(requests)
  finals = {context: tokens for context, tokens in toy.answered}  # the last call per context is the final one
  for request, text in zip(requests, texts):
    tokens = finals[request.args[0]]
    assert tokens[:3] == ToyAdapter.held and len(tokens) <= 2 * C  # the held positions stayed
    assert text == harness_lib.cut_at_stop(toy.answer(request.args[0], tokens), ["zz"])[0]
  with pytest.raises(ValueError, match="no tokenizer"):
    harness_lib.Harness(lm.harness.model, lm.harness.variables, None, lm.harness.sampler).loglikelihood([("a", "b")])


def test_a_training_workdir_loads_with_its_config_and_sentencepiece_tokenizer(tmp_path):
  from diffusiongemma import build, training  # pylint: disable=import-outside-toplevel
  from diffusiongemma.data import tokenizer as sp  # pylint: disable=import-outside-toplevel
  lines = [f"line {i}: the quick brown fox jumps over {i * 7} lazy dogs." for i in range(300)]
  sp.Tokenizer.train(lines, tmp_path / "tokenizer.model", vocab_size=400)
  config_file = tmp_path / "config.py"
  config_file.write_text(
      "from diffusiongemma.build.config import base_config\n"
      "def get_config(arg=None):\n"
      "  config = base_config(vocab_size=512, hidden_size=32, num_layers=2, layer_types=('sliding', 'full'),\n"
      "      num_heads=2, num_kv_heads=1, head_dim=8, num_full_kv_heads=1, full_head_dim=8, sliding_window=4,\n"
      "      intermediate_size=32, num_experts=2, top_k=1, moe_intermediate_size=16, canvas_length=8,\n"
      "      max_positions=256)\n"
      "  config.data.vocab_size = 400\n"
      "  return config\n")
  config = load_config_file(str(config_file))
  variables = build.random_variables(build.model_config(config), seed=3)
  checkpointer = training.Checkpointer(tmp_path, async_save=False)
  checkpointer.save(1, {"step": np.int32(1), "params": variables, "opt_state": {}, "rng": np.zeros(2, np.uint32)},
                    {}, {})
  checkpointer.close()
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
  for args in (f"config={config_file},workdir={tmp_path}", f"workdir={tmp_path}"):
    lm = build_harness.DiffusionGemmaLM.create_from_arg_string(args + ",dtype=float32", HARNESS_DEFAULTS)
    h = lm.harness
    ctx, cont = h.encode_pair("the quick brown", " fox jumps")
    assert ctx[0] == h.tokenizer.bos_id and ctx[1:] == h.tokenizer.encode("the quick brown")
    value = h.loglikelihood([("the quick brown", " fox jumps")])[0][0]
    logits, _ = h.model.apply(h.variables, np.asarray([(ctx + cont)[:-1]]), method=h.model.encode)
    log_p = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    assert abs(value - sum(log_p[len(ctx) - 1 + j, t] for j, t in enumerate(cont))) < 1e-4
    with pytest.raises(ValueError, match="Gemma 4 control tokens"):
      lm.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.slow
def test_the_harness_command_line_runs_the_local_tasks_offline(checkpoint, lm, tmp_path):
  folder, _ = checkpoint
  env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"),
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run(
      [sys.executable, "scripts/lm_eval_harness.py", "--model", "diffusiongemma", "--model_args",
       f"hf_checkpoint={folder},batch_size=2,max_gen_toks=16", "--include_path", "tests/harness_tasks",
       "--tasks", "dg_choice,dg_generate", "--output_path", str(tmp_path / "out"), "--log_samples"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  results = json.loads(pathlib.Path(glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))[0]).read_text())
  assert set(results["results"]) == {"dg_choice", "dg_generate"}
  assert 0 <= results["results"]["dg_choice"]["acc,none"] <= 1
  assert 0 <= results["results"]["dg_generate"]["exact_match,none"] <= 1
  samples = glob.glob(str(tmp_path / "out" / "*" / "samples_dg_choice_*.jsonl"))[0]
  for line in pathlib.Path(samples).read_text().splitlines():
    sample = json.loads(line)
    pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
    ours = lm.harness.loglikelihood(pairs)
    np.testing.assert_allclose([float(r[0][0]) for r in sample["resps"]], [v for v, _ in ours], atol=1e-4)
  generated = glob.glob(str(tmp_path / "out" / "*" / "samples_dg_generate_*.jsonl"))[0]
  for line in pathlib.Path(generated).read_text().splitlines():
    sample = json.loads(line)
    context, kwargs = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
    assert sample["resps"][0][0] == lm.harness.generate_until([(context, kwargs)])[0]
