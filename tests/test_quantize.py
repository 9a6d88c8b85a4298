"""Int8 weight-only quantisation: the rounding, the model it makes, and every way in (load_hf, build.load,
the plan), and the places that must refuse it (training, export)."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma.build import plan as plan_lib
from diffusiongemma.model import layers
from diffusiongemma.model import quantize
from diffusiongemma.parallel import mesh as mesh_lib
from test_model import TINY, _random_params

INT8 = TINY.replace(quantize="int8")


@pytest.fixture(scope="module")
def params():
  return _random_params(TINY)


def _logits(config, params, seed=0):
  rng = np.random.default_rng(seed)
  prompt = jnp.asarray(rng.integers(3, config.vocab_size, (2, 5)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, config.vocab_size, (2, config.canvas_length)), jnp.int32)
  return np.asarray(dg.DiffusionGemma(config).apply({"params": params}, prompt, canvas))


def test_int8_rounds_each_output_channel_to_its_own_scale():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((3, 8, 5)) * np.array([0.01, 1.0, 100.0, 3.0, 0.5])  # [heads, D, H]; D contracted
  w[1, :, 2] = 0.0  # an all-zero channel
  values, scale = quantize.int8(w, (3, 1, 5))
  assert values.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (3, 1, 5)
  assert np.all(np.abs(w - values * scale) <= scale / 2 * (1 + 1e-6))  # nearest multiple of the scale
  assert np.all(np.abs(values).max(axis=1)[np.abs(w).max(axis=1) > 0] == 127)  # each channel's max is +-127
  assert np.all(values[1, :, 2] == 0) and scale[1, 0, 2] == 1.0
  with pytest.raises(ValueError, match=r"\(3, 1\) does not fit a weight of shape \(3, 8, 5\)"):
    quantize.int8(w, (3, 1))


def test_quantised_params_are_int8_weights_with_scales_and_the_rest_unchanged(params):
  quantized = flax.traverse_util.flatten_dict(quantize.quantize_params(params, TINY))
  original = flax.traverse_util.flatten_dict(params)
  int8 = {path for path, leaf in quantized.items() if leaf.dtype == np.int8}
  names = {path[-2:] for path in int8}
  assert names == {("attn", "q_einsum"), ("attn", "k_einsum"), ("attn", "v_einsum"), ("attn", "attn_vec_einsum"),
                   ("mlp", "gating_einsum"), ("mlp", "linear"), ("experts", "gating_einsum"), ("experts", "linear")}
  for path in int8:
    assert quantized[path[:-1] + (path[-1] + "_scale",)].dtype == np.float32
  kept = [p for p in original if p not in int8]
  assert ("embedder", "input_embedding") in kept and any(p[-1] == "router_logits" for p in kept)
  for path in kept:
    np.testing.assert_array_equal(quantized[path], original[path])
  abstract = flax.traverse_util.flatten_dict(dg.model.transformer.abstract_params(INT8))
  assert {p: (v.shape, v.dtype) for p, v in quantized.items()} == {p: (v.shape, v.dtype) for p, v in abstract.items()}
  with pytest.raises(ValueError, match="already int8"):
    quantize.quantize_params(quantize.quantize_params(params, TINY), TINY)


def test_int8_model_is_the_float_model_on_the_rounded_weights(params):
  """Exactly (to float rounding) the float model with each weight replaced by values * scale: the
  dequantisation happens where each weight is used, with its own scale."""
  quantized = quantize.quantize_params(params, TINY)
  flat = flax.traverse_util.flatten_dict(quantized)
  rounded = {p: jnp.asarray(v.astype(np.float32) * flat[p[:-1] + (p[-1] + "_scale",)])
             for p, v in flat.items() if v.dtype == np.int8}
  rounded_params = flax.traverse_util.unflatten_dict({**flax.traverse_util.flatten_dict(params), **rounded})
  int8_logits = _logits(INT8, quantized)
  np.testing.assert_allclose(int8_logits, _logits(TINY, rounded_params), rtol=1e-5, atol=1e-5)
  assert not np.allclose(int8_logits, _logits(TINY, params), rtol=1e-5, atol=1e-5)  # the rounding is there


class _Projection(nn.Module):
  quantize: str

  @nn.compact
  def __call__(self, x):
    w = layers.weight(self, "w", layers.fan_in_init([1]), (3, 16, 8), jnp.float32, ("q_heads", "embed", "head_dim"),
                      contract=(1,), quantize=self.quantize)
    return layers.einsum("BD,NDH->BNH", x, w, jnp.float32)


def test_an_int8_matmul_is_within_its_rounding_bound_of_the_float_one():
  """|y_int8 - y| <= sum_d |x_d| * scale / 2 for every output: each weight moved by at most half its scale."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  w = rng.standard_normal((3, 16, 8)).astype(np.float32)
  values, scale = quantize.int8(w, (3, 1, 8))
  y = _Projection("none").apply({"params": {"w": w}}, x)
  y8 = _Projection("int8").apply({"params": {"w": values, "w_scale": scale}}, x)
  bound = np.abs(np.asarray(x)).sum(-1)[:, None, None] * scale[None, :, 0, :] / 2
  error = np.abs(np.asarray(y8 - y))
  assert np.all(error <= bound * (1 + 1e-4) + 1e-6) and error.max() > 0
  assert error.max() < 0.01 * np.abs(np.asarray(y)).max()


def test_load_hf_quantises_as_it_reads(params, tmp_path):
  dg.convert.save_hf(TINY, params, tmp_path)
  cfg, float_params = dg.convert.load_hf(tmp_path, moe_impl=TINY.moe_impl)
  cfg8, int8_params = dg.convert.load_hf(tmp_path, moe_impl=TINY.moe_impl, quantize="int8")
  assert cfg8 == cfg.replace(quantize="int8")
  expected = flax.traverse_util.flatten_dict(quantize.quantize_params(float_params, cfg))
  got = flax.traverse_util.flatten_dict(int8_params)
  assert set(got) == set(expected)
  for path, value in expected.items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(value), err_msg="/".join(path))
  with pytest.raises(ValueError, match="quantize='int8'.*no int8"):
    dg.convert.save_hf(cfg8, int8_params, tmp_path / "out")


def _config(quantize_name):
  config = dg.build.config.base_config(**{k: v for k, v in TINY.to_dict().items()
                                          if k not in ("noise", "mask_token_id", "vision", "quantize")})
  config.data.vocab_size = TINY.vocab_size
  config.model.quantize = quantize_name
  return config


def test_build_load_quantises_what_it_loads_and_training_refuses_int8():
  int8 = dg.build.load(_config("int8"), random_init=True, seed=3)
  plain = dg.build.load(_config("none"), random_init=True, seed=3)
  assert int8.model_config.quantize == "int8" and "int8 weights" in int8.source
  expected = flax.traverse_util.flatten_dict(quantize.quantize_params(plain.variables["params"], plain.model_config))
  got = flax.traverse_util.flatten_dict(int8.variables["params"])
  assert set(got) == set(expected)
  for path, value in expected.items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(value))
  with pytest.raises(ValueError, match=r"config.model.quantize='int8' is for inference"):
    dg.build.train_task(_config("int8"), "/nonexistent")
  with pytest.raises(ValueError, match=r"ModelConfig.quantize='int4' is invalid: must be one of \('none', 'int8'\)"):
    TINY.replace(quantize="int4")


def test_int8_scales_shard_like_their_weights_except_the_contracted_axes():
  boxed = jax.eval_shape(dg.DiffusionGemma(INT8).init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                         jnp.zeros((1, INT8.canvas_length), jnp.int32))["params"]
  specs = flax.traverse_util.flatten_dict(mesh_lib.param_specs(boxed, {"data": 1, "fsdp": 1, "expert": 1, "tensor": 2}))
  layer = ("layer_0",)
  assert specs[layer + ("attn", "q_einsum")][0] == specs[layer + ("attn", "q_einsum_scale")][0] == "tensor"
  assert specs[layer + ("attn", "q_einsum_scale")][1] is None  # the contracted model axis has size 1
  assert specs[layer + ("mlp", "linear")][0] == "tensor" and specs[layer + ("mlp", "linear_scale")][0] is None


def test_plan_counts_int8_weights_at_a_byte_and_one_dequantised_weight():
  config = dg.ModelConfig(vocab_size=1024, hidden_size=256, num_layers=6, num_experts=8, top_k=2,
                          moe_intermediate_size=128, intermediate_size=256, head_dim=32, full_head_dim=64,
                          canvas_length=32, max_positions=512)
  sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
  plain = plan_lib.memory_plan(config, sizes, batch_size=1, sequence_length=64, training=False)
  int8 = plan_lib.memory_plan(config.replace(quantize="int8"), sizes, batch_size=1, sequence_length=64, training=False)
  flat = flax.traverse_util.flatten_dict(dg.model.transformer.abstract_params(config.replace(quantize="int8")))
  weights = {p for p, v in flat.items() if v.dtype == jnp.int8}
  scales = {p[:-1] + (p[-1] + "_scale",) for p in weights}
  expected = sum(v.size * (1 if p in weights else 4 if p in scales else 2) for p, v in flat.items())
  assert int8["parameters"] == expected < 0.6 * plain["parameters"]
  assert int8["dequantized_weight"] == 2 * max(flat[p].size for p in weights)
  assert int8["total"] == pytest.approx(sum(v for k, v in int8.items() if k != "total"))


def test_a_released_style_checkpoint_chats_with_int8_weights(chat_checkpoint):
  """The checkpoint path a user takes (`build.pretrained` / `ChatSampler.from_pretrained`, i.e. chat.py,
  sample.py and serve.py with --quantize=int8): int8 weights in the sampler's model, and a reply."""
  chat = dg.ChatSampler.from_pretrained(chat_checkpoint, dtype="float32", max_new_tokens=8,
                                        model_overrides={"quantize": "int8"})
  assert chat.sampler.model.config.quantize == "int8"
  leaves = flax.traverse_util.flatten_dict(chat.variables["params"])
  assert sum(v.dtype == jnp.int8 for v in leaves.values()) >= 4
  reply = chat.send("What is 2+2?")
  assert reply.tokens and isinstance(reply.text, str)
