"""Exact match with the transformers reference: a tiny random checkpoint loaded by `dg.convert.load_hf`.

The reference model (benchmarks/hf_reference.py) has every weight and every otherwise-constant scale drawn at
random, sliding window 5, layers S S F F, 5 experts top-2, odd sizes. Prompts shorter and longer than the
window. Tolerance 1e-4 (float32); measured: encoder <= 8e-6, decoder <= 5e-5 on logits of magnitude ~10.
"""

import functools
import json
import logging
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

import diffusiongemma as dg

torch = pytest.importorskip("torch")
hf_reference = pytest.importorskip("benchmarks.hf_reference")

pytestmark = pytest.mark.hf
ATOL = 1e-4
ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf_tiny")
  reference = hf_reference.make_tiny_hf(path, seed=0)
  config, params = dg.convert.load_hf(path)
  return path, reference, config, params


@functools.partial(jax.jit, static_argnames="config")
def _ours(params, prompt, canvas, sc_logits, sc_mask, config):
  model = dg.DiffusionGemma(config)
  encoder_logits, cache = model.apply({"params": params}, prompt, method=model.encode)
  decoder_logits = model.apply({"params": params}, canvas, cache, sc_logits, sc_mask, method=model.denoise)
  return encoder_logits, decoder_logits


def _tokens(seed, shape, vocab):
  return np.random.default_rng(seed).integers(0, vocab, shape)


def test_config_from_checkpoint(checkpoint):
  _, _, config, _ = checkpoint
  assert config.layer_types == ("sliding", "sliding", "full", "full")
  assert (config.hidden_size, config.vocab_size, config.sliding_window) == (48, 97, 5)
  assert (config.num_experts, config.top_k, config.canvas_length) == (5, 2, 8)
  assert (config.num_full_kv_heads, config.full_head_dim, config.final_logit_softcap) == (1, 16, 30.0)


@pytest.mark.parametrize("prompt_length", [3, 9])  # shorter and longer than the sliding window (5)
def test_logits_match_reference(checkpoint, prompt_length):
  _, reference, config, params = checkpoint
  prompt = _tokens(prompt_length, (2, prompt_length), config.vocab_size)
  canvas = _tokens(100 + prompt_length, (2, config.canvas_length), config.vocab_size)
  sc_logits = 3 * np.random.default_rng(7).standard_normal((2, config.canvas_length, config.vocab_size))
  sc_mask = np.asarray([True, False])

  enc, plain = _ours(params, jnp.asarray(prompt), jnp.asarray(canvas), None, None, config)
  _, with_sc = _ours(params, jnp.asarray(prompt), jnp.asarray(canvas), jnp.asarray(sc_logits, jnp.float32),
                     None, config)
  _, masked = _ours(params, jnp.asarray(prompt), jnp.asarray(canvas), jnp.asarray(sc_logits, jnp.float32),
                    jnp.asarray(sc_mask), config)

  pairs = {"encoder": (enc, hf_reference.encoder_logits(reference, prompt)),
           "decoder": (plain, hf_reference.decoder_logits(reference, prompt, canvas)),
           "decoder, self-conditioning": (with_sc, hf_reference.decoder_logits(reference, prompt, canvas,
                                                                              sc_logits)),
           "decoder, self-conditioning mask": (masked, hf_reference.decoder_logits(reference, prompt, canvas,
                                                                                   sc_logits, sc_mask))}
  for name, (ours, theirs) in pairs.items():
    print(f"prompt {prompt_length}, {name}: max |ours - transformers| = {np.abs(ours - theirs).max():.1e}")
    np.testing.assert_allclose(ours, theirs, atol=ATOL)
  assert np.abs(with_sc - plain).max() > 1e-2  # the signal matters, so the comparison means something


# Tiny widths at the depths where transformers zero-pads `per_layer_config` keys ("05", "11", ...).
DEEP = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16,
            num_global_key_value_heads=1, sliding_window=4, intermediate_size=16, moe_intermediate_size=8,
            num_experts=3, top_k_experts=2, vocab_size=64, canvas_length=4)


@pytest.mark.parametrize("num_layers", [12, 30])
def test_deep_checkpoints_load_and_export_with_the_released_layer_pattern(tmp_path, num_layers):
  """12 and 30 layers (5 sliding + 1 full, repeated; the last full), saved by transformers: loaded, the
  logits equal transformers'; exported by save_hf, transformers' logits equal ours; read back exactly.
  Branches damped (`branch_scale`), else float32 rounding grows ~1.3x per layer of a random network
  (measured at 30 layers: 3.5e-3 on the denoiser's logits; damped: 3e-5)."""
  types = hf_reference.released_layer_types(num_layers)
  reference = hf_reference.make_tiny_hf(tmp_path / "hf", seed=num_layers, num_hidden_layers=num_layers,
                                        layer_types=types, branch_scale=0.1, **DEEP)
  saved = json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]["per_layer_config"]
  assert sorted(saved) == [f"{i:02d}" for i in range(5, num_layers, 6)]  # zero-padded: what broke loading
  config, params = dg.convert.load_hf(tmp_path / "hf")
  assert config.layer_types == tuple(t.split("_")[0] for t in types)
  assert (config.num_layers, config.full_head_dim, config.num_full_kv_heads) == (num_layers, 16, 1)
  prompt = _tokens(num_layers, (2, 7), config.vocab_size)  # longer than the sliding window (4)
  canvas = _tokens(num_layers + 1, (2, config.canvas_length), config.vocab_size)
  encoder, decoder = _ours(params, jnp.asarray(prompt), jnp.asarray(canvas), None, None, config)
  np.testing.assert_allclose(encoder, hf_reference.encoder_logits(reference, prompt), atol=ATOL)
  np.testing.assert_allclose(decoder, hf_reference.decoder_logits(reference, prompt, canvas), atol=ATOL)

  dg.convert.save_hf(config, params, tmp_path / "out", vision_from=tmp_path / "hf")
  exported = hf_reference.load_hf(tmp_path / "out")
  np.testing.assert_allclose(hf_reference.encoder_logits(exported, prompt), encoder, atol=ATOL)
  np.testing.assert_allclose(hf_reference.decoder_logits(exported, prompt, canvas), decoder, atol=ATOL)
  round_trip_config, round_trip = dg.convert.load_hf(tmp_path / "out")
  assert round_trip_config == config
  jax.tree.map(np.testing.assert_array_equal, round_trip, params)


def test_per_layer_config_keys_are_layer_indices():
  """Keys are read as integers ("05" is layer 5); anything else is refused, naming the key and the range."""
  text = {"layer_types": ["sliding_attention"] * 11 + ["full_attention"], "vocab_size": 64, "hidden_size": 16,
          "num_hidden_layers": 12, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
          "sliding_window": 4, "intermediate_size": 16, "num_experts": 3, "top_k_experts": 2,
          "moe_intermediate_size": 8}
  full = {"head_dim": 16, "num_key_value_heads": 1}
  for keys in ({"11": full}, {11: full}, {"0011": full}):
    config = dg.convert.config_from_hf({"text_config": {**text, "per_layer_config": keys}})
    assert (config.full_head_dim, config.num_full_kv_heads) == (16, 1)
  for keys, message in (({"12": full}, "key '12' is out of range; layer indices are integers in [0, 12)"),
                        ({"-1": full}, "key '-1' is not a layer index; layer indices are integers in [0, 12)"),
                        ({"eleven": full}, "key 'eleven' is not a layer index"),
                        ({"11": full, "011": full}, "names layer 11 twice"),
                        ({"11": full, "3": {"head_dim": 4}}, "per_layer_config['3'] sets head_dim=4 on a sliding")):
    with pytest.raises(ValueError, match=re.escape(message)):
      dg.convert.config_from_hf({"text_config": {**text, "per_layer_config": keys}})


def test_sharded_checkpoint_loads_the_same(checkpoint, tmp_path):
  path, _, config, params = checkpoint
  hf_reference.make_tiny_hf(tmp_path, seed=0, max_shards=3)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) == 3
  sharded_config, sharded_params = dg.convert.load_hf(tmp_path)
  assert sharded_config == config
  jax.tree.map(np.testing.assert_array_equal, sharded_params, params)


def test_vision_tower_is_skipped_with_a_log_line(checkpoint, caplog):
  """The reference's placeholder vision tower (its image tokens lie outside the 97-token vocabulary) is
  skipped, and the log says why and how many tensors (counted here from the file)."""
  path, _, _, _ = checkpoint
  with safetensors.safe_open(path / "model.safetensors", "np") as file:
    skipped = sum(k.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head."))
                  for k in file.keys())
  assert skipped > 0
  with caplog.at_level(logging.INFO):
    dg.convert.load_hf(path)
  messages = [record.getMessage() for record in caplog.records]
  assert f"load_hf: skipped {skipped} vision-tower / lm_head tensors (text model only)." in messages, messages
  assert any(re.fullmatch(r"config.json has a vision_config, but image tokens \{.*\} lie outside the vocabulary "
                          r"\(97\): loading the text model only.", m) for m in messages), messages


@pytest.mark.parametrize("max_shard_bytes", [2**30, 20_000])  # one file; several shards with an index
def test_save_hf_loads_in_transformers_with_equal_logits(checkpoint, tmp_path, max_shard_bytes):
  path, _, config, params = checkpoint
  dg.convert.save_hf(config, params, tmp_path, max_shard_bytes=max_shard_bytes, vision_from=path)
  assert ((tmp_path / "model.safetensors.index.json").exists()) == (max_shard_bytes < 2**30)
  exported = hf_reference.load_hf(tmp_path)
  prompt = _tokens(1, (2, 7), config.vocab_size)
  canvas = _tokens(2, (2, config.canvas_length), config.vocab_size)
  encoder, decoder = _ours(params, jnp.asarray(prompt), jnp.asarray(canvas), None, None, config)
  np.testing.assert_allclose(hf_reference.encoder_logits(exported, prompt), encoder, atol=ATOL)
  np.testing.assert_allclose(hf_reference.decoder_logits(exported, prompt, canvas), decoder, atol=ATOL)
  round_trip_config, round_trip = dg.convert.load_hf(tmp_path)
  assert round_trip_config == config
  jax.tree.map(np.testing.assert_array_equal, round_trip, params)


def test_save_hf_without_vision_and_refuses_what_transformers_cannot_hold(checkpoint, tmp_path):
  _, _, config, params = checkpoint
  dg.convert.save_hf(config, params, tmp_path / "text_only", dtype="bfloat16")
  exported = hf_reference.load_hf(tmp_path / "text_only")  # a placeholder vision tower, initialised
  assert exported.model.decoder.embed_tokens.weight.shape == (config.vocab_size, config.hidden_size)
  with pytest.raises(ValueError, match="final_logit_softcap=50.0"):
    dg.convert.save_hf(config.replace(final_logit_softcap=50.0), params, tmp_path / "bad")


def _convert(*args):
  result = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600, check=False)
  return result


def test_convert_script_round_trips_workdir_hf_orbax_hf(checkpoint, tmp_path):
  """scripts/convert.py: a training workdir's checkpoint -> transformers -> orbax params -> transformers;
  the last folder loads in transformers with logits equal to ours, and its weights are ours exactly."""
  _, _, config, params = checkpoint
  workdir = tmp_path / "workdir"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps({"model": config.to_dict()}))
  checkpointer = dg.training.Checkpointer(workdir, async_save=False)
  state = {"step": np.int32(7), "params": {"params": params}, "opt_state": {}, "rng": np.zeros(2, np.uint32)}
  checkpointer.save(7, state, {}, {})
  checkpointer.close()
  for args in ([f"--from_workdir={workdir}", f"--to_hf={tmp_path / 'hf'}"],
               [f"--from_hf={tmp_path / 'hf'}", f"--to_orbax={tmp_path / 'orbax'}"],
               [f"--from_orbax={tmp_path / 'orbax'}", f"--to_hf={tmp_path / 'hf_again'}"]):
    result = _convert(*args)
    assert result.returncode == 0, result.stderr[-3000:]
  exported = hf_reference.load_hf(tmp_path / "hf_again")
  prompt = _tokens(3, (2, 6), config.vocab_size)
  canvas = _tokens(4, (2, config.canvas_length), config.vocab_size)
  encoder, decoder = _ours(params, jnp.asarray(prompt), jnp.asarray(canvas), None, None, config)
  np.testing.assert_allclose(hf_reference.encoder_logits(exported, prompt), encoder, atol=ATOL)
  np.testing.assert_allclose(hf_reference.decoder_logits(exported, prompt, canvas), decoder, atol=ATOL)
  round_trip_config, round_trip = dg.convert.load_hf(tmp_path / "hf_again")
  assert round_trip_config == config
  jax.tree.map(np.testing.assert_array_equal, round_trip, params)

  result = _convert(f"--from_workdir={workdir}", f"--to_orbax={tmp_path / 'bad'}")
  assert result.returncode != 0 and "--from_workdir converts to --to_hf, not --to_orbax" in result.stderr
  result = _convert(f"--from_orbax={tmp_path / 'hf'}", f"--to_hf={tmp_path / 'bad'}")
  assert result.returncode != 0 and "is not an orbax params checkpoint" in result.stderr
