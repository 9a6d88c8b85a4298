"""Gemma 4 causal LMs as DiffusionGemmas (issue 38): a tiny random transformers `Gemma4ForCausalLM`
(tests/gemma4_reference.py) loads as the DiffusionGemma whose encoder it is, with logits equal to transformers'
(1e-4, float32; measured ~1e-6); what DiffusionGemma lacks is refused by name; the encoder is written back as a
Gemma 4 folder that transformers loads with equal logits; round trips through both formats.
"""

import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from flax import traverse_util

import diffusiongemma as dg
from diffusiongemma.model import quantize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_reference = pytest.importorskip("benchmarks.hf_reference")
import gemma4_reference  # noqa: E402  (after the skips: a broken reference fails, tests/hf_guard.py)

pytestmark = pytest.mark.hf
ATOL = 1e-4
ROOT = pathlib.Path(__file__).parent.parent


def _tokens(seed, shape, vocab=64):
  return np.random.default_rng(seed).integers(0, vocab, shape)


def _encoder_logits(cfg, params, tokens):
  model = dg.DiffusionGemma(cfg)
  logits, _ = jax.jit(lambda p, t: model.apply({"params": p}, t, method=model.encode))(params, jnp.asarray(tokens))
  return np.asarray(logits)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
  """A 3-layer Gemma 4 (S S F), its transformers model, and what load_hf makes of it."""
  path = tmp_path_factory.mktemp("gemma4")
  reference = gemma4_reference.make_tiny_gemma4(path, seed=0)
  cfg, params = dg.convert.load_hf(path)
  return path, reference, cfg, params


@pytest.mark.parametrize("num_layers, k_eq_v", [(3, True), (12, True), (3, False)])
def test_gemma4_loads_as_the_encoder_with_equal_logits(tmp_path, num_layers, k_eq_v):
  """At 3 and 12 layers (per_layer_config keys "05", "11": zero-padded), and with a V projection of its own in
  full attention (attention_k_eq_v false: ModelConfig.full_k_eq_v=False runs it). Prompts longer than the
  sliding window (4)."""
  reference = gemma4_reference.make_tiny_gemma4(tmp_path, seed=num_layers, num_hidden_layers=num_layers,
                                                attention_k_eq_v=k_eq_v, branch_scale=0.1 if num_layers > 3 else 1.0)
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["model_type"] == "gemma4_text" and saved["architectures"] == ["Gemma4ForCausalLM"]
  assert sorted(saved["per_layer_config"]) == ([f"{i:02d}" for i in range(5, num_layers, 6)] if num_layers > 9
                                               else ["2"])
  cfg, params = dg.convert.load_hf(tmp_path)
  assert (cfg.num_layers, cfg.full_head_dim, cfg.full_k_eq_v, cfg.final_logit_softcap) == (num_layers, 16, k_eq_v,
                                                                                           30.0)
  assert (cfg.canvas_length, cfg.noise, cfg.vision) == (256, "uniform", None)  # the released model's settings
  assert ("v_einsum" in params[f"layer_{num_layers - 1}"]["attn"]) == (not k_eq_v)
  tokens = _tokens(num_layers, (2, 9))
  np.testing.assert_allclose(_encoder_logits(cfg, params, tokens), gemma4_reference.logits(reference, tokens),
                             atol=ATOL)


def test_what_gemma4_lacks_is_made_as_documented(gemma4):
  """The denoiser's layer scalars are the encoder's; self-conditioning is a fresh initialisation whose output
  projection is zero, so a self-conditioning signal changes nothing yet (exactly)."""
  path, _, cfg, params = gemma4
  for i in range(cfg.num_layers):
    assert params[f"layer_{i}"]["decoder_scalar"] == params[f"layer_{i}"]["encoder_scalar"] != 1.0
  sc = params["self_conditioning"]
  assert not np.any(sc["mlp"]["linear"]) and np.all(np.isfinite(sc["mlp"]["gating_einsum"]))
  assert np.std(sc["mlp"]["gating_einsum"]) > 0
  cfg = cfg.replace(canvas_length=8, moe_impl="dense")
  model = dg.DiffusionGemma(cfg)
  prompt, canvas = jnp.asarray(_tokens(1, (2, 6))), jnp.asarray(_tokens(2, (2, 8)))
  signal = jnp.asarray(3 * np.random.default_rng(3).standard_normal((2, 8, cfg.vocab_size)), jnp.float32)
  apply = jax.jit(lambda p, s: model.apply({"params": p}, prompt, canvas, s))
  plain, with_signal = apply(params, None), apply(params, signal)
  np.testing.assert_array_equal(plain, with_signal)


def test_checkpoint_dtype_sharding_and_int8_load_as_for_diffusiongemma_folders(gemma4, tmp_path):
  """A bfloat16 folder in shards with an index loads in bfloat16 (self-conditioning too), with logits equal to
  transformers' on the same weights; placed into shardings as it streams; quantised as it reads."""
  path, _, cfg, params = gemma4
  reference = gemma4_reference.make_tiny_gemma4(tmp_path / "bf16", seed=0, dtype=torch.bfloat16,
                                                max_shard_size="8KB")
  assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
  bf16_cfg, bf16 = dg.convert.load_hf(tmp_path / "bf16")
  assert bf16_cfg == cfg
  assert {leaf.dtype for leaf in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
  tokens = _tokens(5, (2, 9))
  np.testing.assert_allclose(_encoder_logits(cfg, bf16, tokens), gemma4_reference.logits(reference, tokens),
                             atol=ATOL)

  _, placed = dg.convert.load_hf(path, shardings=dg.convert.mesh_shardings())
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(placed))
  jax.tree.map(np.testing.assert_array_equal, placed, params)
  int8_cfg, int8 = dg.convert.load_hf(path, quantize="int8")
  want = quantize.quantize_params(params, cfg)
  assert (jax.tree.structure(int8) == jax.tree.structure(want)) and int8_cfg.quantize == "int8"
  jax.tree.map(np.testing.assert_array_equal, int8, want)


def test_an_untied_head_loads_when_it_is_the_embedding_and_is_refused_otherwise(tmp_path):
  gemma4_reference.make_tiny_gemma4(tmp_path / "copy", head="copy")
  with safetensors.safe_open(tmp_path / "copy" / "model.safetensors", "np") as f:
    assert "lm_head.weight" in f.keys()
  dg.convert.load_hf(tmp_path / "copy")
  gemma4_reference.make_tiny_gemma4(tmp_path / "own", head="own")
  message = (r"config.json: tie_word_embeddings is false and .*model.safetensors: lm_head.weight differs from "
             r"model.embed_tokens.weight \(max \|difference\| .*\): an output head of its own, which DiffusionGemma "
             r"lacks")
  with pytest.raises(ValueError, match=message):
    dg.convert.load_hf(tmp_path / "own")


# (config.json changes, the field the error must name). Each is a Gemma 4 feature DiffusionGemma lacks.
REFUSED = [
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input=256"),
    ({"hidden_size_per_layer_input": None}, "hidden_size_per_layer_input=256"),  # transformers' default
    ({"num_kv_shared_layers": 1}, "num_kv_shared_layers=1"),
    ({"num_kv_shared_layers": 1, "use_double_wide_mlp": True}, "use_double_wide_mlp=True"),
    ({"enable_moe_block": False}, "enable_moe_block=False"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
]


@pytest.mark.parametrize("changes, field", REFUSED, ids=[f for _, f in REFUSED])
def test_a_feature_diffusiongemma_lacks_is_refused_naming_the_field(gemma4, changes, field):
  path, _, _, _ = gemma4
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  config = {k: v for k, v in config.items() if v is not None}
  with pytest.raises(ValueError, match=re.escape(f"config.json: this Gemma 4 has what DiffusionGemma lacks")
                     + ".*" + re.escape(field)):
    dg.convert.config_from_hf(config, source=path / "config.json")


def test_full_layers_without_per_layer_config_read_global_head_dim_as_transformers_does(gemma4):
  """A config.json without `per_layer_config` (hub configs name `global_head_dim`, `num_global_key_value_heads`):
  the full layers' head dim is global_head_dim (transformers' default 512), their key/value heads
  num_global_key_value_heads where k = v, else num_key_value_heads."""
  path, _, cfg, _ = gemma4
  config = json.loads((path / "config.json").read_text())
  del config["per_layer_config"]
  legacy = dict(config, global_head_dim=16, num_global_key_value_heads=1, num_key_value_heads=2,
                num_attention_heads=4)
  read = dg.convert.config_from_hf(legacy)
  assert (read.full_head_dim, read.num_full_kv_heads, read.num_kv_heads) == (16, 1, 2)
  read = dg.convert.config_from_hf(dict(legacy, attention_k_eq_v=False))
  assert (read.full_head_dim, read.num_full_kv_heads) == (16, 2)
  assert dg.convert.config_from_hf(config).full_head_dim == 512


def test_the_text_part_of_a_multimodal_gemma4_loads_and_audio_is_refused(gemma4):
  """model_type 'gemma4': the same text config under text_config (fields named with it); audio refused."""
  path, _, cfg, _ = gemma4
  text = json.loads((path / "config.json").read_text())
  multimodal = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
  assert dg.convert.config_from_hf(multimodal) == cfg
  with pytest.raises(ValueError, match=re.escape("text_config.num_kv_shared_layers=2")):
    dg.convert.config_from_hf({**multimodal, "text_config": {**text, "num_kv_shared_layers": 2}})
  with pytest.raises(ValueError, match=re.escape("audio_config (an audio encoder")):
    dg.convert.config_from_hf({**multimodal, "audio_config": {"model_type": "gemma4_audio"}})


def test_a_transformers_gemma4_with_per_layer_inputs_and_dense_layers_is_refused(tmp_path):
  """Gemma4TextConfig's defaults (per-layer inputs, no MoE block), saved by transformers: both fields named."""
  gemma4_reference.make_tiny_gemma4(tmp_path, hidden_size_per_layer_input=4, enable_moe_block=False)
  with pytest.raises(ValueError, match=r"hidden_size_per_layer_input=4 .*enable_moe_block=False"):
    dg.convert.load_hf(tmp_path)


@pytest.mark.parametrize("architecture", ["Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"])
def test_save_hf_writes_the_encoder_as_gemma4_that_transformers_loads(gemma4, tmp_path, architecture):
  """The loaded model written back as Gemma 4: transformers' AutoModelForCausalLM (or the multimodal class)
  loads it with logits equal to ours; as Gemma4ForCausalLM every tensor equals the original folder's."""
  path, _, cfg, params = gemma4
  dg.convert.save_hf(cfg, params, tmp_path, architecture=architecture)
  tokens = _tokens(7, (2, 9))
  if architecture == "Gemma4ForCausalLM":
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert type(exported).__name__ == "Gemma4ForCausalLM"
    with safetensors.safe_open(path / "model.safetensors", "np") as a, \
        safetensors.safe_open(tmp_path / "model.safetensors", "np") as b:
      assert sorted(a.keys()) == sorted(b.keys())
      for key in a.keys():
        np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key))
  else:
    exported = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
  np.testing.assert_allclose(gemma4_reference.logits(exported, tokens), _encoder_logits(cfg, params, tokens),
                             atol=ATOL)
  round_trip_cfg, round_trip = dg.convert.load_hf(tmp_path)
  assert round_trip_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, round_trip, params)


def test_a_diffusiongemma_round_trips_through_gemma4_and_a_gemma4_through_diffusiongemma(gemma4, tmp_path):
  """DiffusionGemma -> Gemma 4 -> DiffusionGemma keeps the encoder exactly (the denoiser's own parameters are
  made afresh, the canvas is the released 256); Gemma 4 -> DiffusionGemma folder (transformers' DiffusionGemma
  loads it: its encoder's logits are Gemma 4's) -> back, exactly."""
  reference = hf_reference.make_tiny_hf(tmp_path / "dg", seed=1)
  cfg, params = dg.convert.load_hf(tmp_path / "dg")
  dg.convert.save_hf(cfg, params, tmp_path / "g4", architecture="Gemma4ForCausalLM")
  g4_cfg, g4 = dg.convert.load_hf(tmp_path / "g4")
  assert g4_cfg == cfg.replace(canvas_length=256)
  flat, g4_flat = traverse_util.flatten_dict(params), traverse_util.flatten_dict(g4)
  for key, value in flat.items():
    if key[0] != "self_conditioning" and key[-1] != "decoder_scalar":
      np.testing.assert_array_equal(g4_flat[key], value, err_msg=str(key))
  prompt = _tokens(8, (2, 7), cfg.vocab_size)
  np.testing.assert_allclose(_encoder_logits(g4_cfg, g4, prompt), hf_reference.encoder_logits(reference, prompt),
                             atol=ATOL)

  path, gemma4_model, cfg, params = gemma4
  dg.convert.save_hf(cfg, params, tmp_path / "as_dg")
  as_dg = hf_reference.load_hf(tmp_path / "as_dg")
  prompt = _tokens(9, (2, 9))
  np.testing.assert_allclose(hf_reference.encoder_logits(as_dg, prompt), gemma4_reference.logits(gemma4_model, prompt),
                             atol=ATOL)
  back_cfg, back = dg.convert.load_hf(tmp_path / "as_dg")
  assert back_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, back, params)
  with pytest.raises(ValueError, match="full_k_eq_v=False"):
    dg.convert.save_hf(cfg.replace(full_k_eq_v=False), params, tmp_path / "bad")
  assert not (tmp_path / "bad").exists()


def _convert(*args):
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), *map(str, args)],
                        capture_output=True, text=True, timeout=600, check=False)


def test_convert_script_both_directions(gemma4, tmp_path):
  """scripts/convert.py: Gemma 4 folder -> DiffusionGemma folder -> Gemma 4 folder (--architecture), the last
  one's tensors those of the first."""
  path, _, _, _ = gemma4
  for args in ([f"--from_hf={path}", f"--to_hf={tmp_path / 'dg'}"],
               [f"--from_hf={tmp_path / 'dg'}", f"--to_hf={tmp_path / 'g4'}", "--architecture=Gemma4ForCausalLM"]):
    result = _convert(*args)
    assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((tmp_path / "dg" / "config.json").read_text())["architectures"] == [
      "DiffusionGemmaForBlockDiffusion"]
  with safetensors.safe_open(path / "model.safetensors", "np") as a, \
      safetensors.safe_open(tmp_path / "g4" / "model.safetensors", "np") as b:
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
      np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key))
  result = _convert(f"--from_hf={path}", f"--to_orbax={tmp_path / 'o'}", "--architecture=Gemma4ForCausalLM")
  assert result.returncode != 0 and "--architecture is for --to_hf" in result.stderr
