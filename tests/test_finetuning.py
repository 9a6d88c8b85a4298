"""Fine-tuning: SFT data (packing, JSONL pairs), the loss's masking of prompts, padding and held positions,
and LoRA's properties (targets, merged weights, frozen base, adapters only in the optimizer)."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diffusiongemma as dg
from diffusiongemma.data import sft
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.training import lora
from diffusiongemma.training import optim

TINY = dict(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
            num_full_kv_heads=1, full_head_dim=16, sliding_window=256, intermediate_size=64, num_experts=1,
            top_k=1, moe_intermediate_size=32, canvas_length=81, max_positions=256, moe_impl="dense")


def _tiny_model(vocab=16, canvas=81, **changes):
  return dg.DiffusionGemma(dg.ModelConfig(**{**TINY, "vocab_size": vocab, "canvas_length": canvas, **changes}))


def _init(model, seed=0):
  prompt = jnp.zeros((1, 4), jnp.int32)
  canvas = jnp.zeros((1, model.config.canvas_length), jnp.int32)
  return nn.unbox(jax.jit(model.init)(jax.random.key(seed), prompt, canvas))


def _batch(n=4, canvas=81, seed=0):
  """Random prompt/response examples: a 6-token prompt and one canvas."""
  rng = np.random.default_rng(seed)
  rows = [sft.pack_example([2] + rng.integers(3, 15, 5).tolist(), rng.integers(3, 15, canvas - 1).tolist(),
                           prompt_length=6, canvas_length=canvas, num_canvases=1, eos_id=1, pad_id=0)
          for _ in range(n)]
  return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}

# ---------------------------------------------------------------------------------------- SFT data
def test_pack_example_layout():
  ex = sft.pack_example([2, 5, 6], [7, 8, 9, 10, 11], prompt_length=4, canvas_length=4, num_canvases=3,
                        eos_id=1, pad_id=0)
  assert ex["tokens"].tolist() == [2, 5, 6, 7, 8, 9, 10, 11, 1, 1, 1, 0, 0, 0, 0, 0]
  assert int(ex["prompt_length"]) == 3 and int(ex["num_canvases"]) == 2
  with pytest.raises(ValueError, match="num_canvases=1"):
    sft.pack_example([2], [7] * 4, prompt_length=4, canvas_length=4, num_canvases=1, eos_id=1, pad_id=0)
  with pytest.raises(ValueError, match="prompt_length=2"):
    sft.pack_example([2, 3, 4], [7], prompt_length=2, canvas_length=4, num_canvases=1, eos_id=1, pad_id=0)


def test_jsonl_examples(tmp_path):
  path = tmp_path / "pairs.jsonl"
  records = [{"prompt": f"q{i}", "response": "a" * (i % 7)} for i in range(40)]
  path.write_text("\n".join(json.dumps(r) for r in records) + "\n")

  class CharTokenizer:  # one id per character, ids from 3
    bos_id, eos_id, pad_id = 2, 1, 0

    def encode_batch(self, texts):
      return [[3 + ord(ch) % 50 for ch in t] for t in texts]

  train = sft.jsonl_examples(path, CharTokenizer(), "train", prompt_length=4, canvas_length=4,
                             num_canvases=2, validation_fraction=0.25)
  validation = sft.jsonl_examples(path, CharTokenizer(), "validation", prompt_length=4, canvas_length=4,
                                  num_canvases=2, validation_fraction=0.25)
  assert len(train) + len(validation) == 40 and validation
  for ex in train:
    tokens, p, k = ex["tokens"], int(ex["prompt_length"]), int(ex["num_canvases"])
    assert tokens[0] == 2 and tokens.shape == (12,)
    assert tokens[p + k * 4 - 1] == 1 and (tokens[p + k * 4:] == 0).all()
  path.write_text('{"prompt": "x"}\n')
  with pytest.raises(ValueError, match="line 1 has no string fields .prompt. and .response."):
    sft.read_jsonl_pairs(path)


# ------------------------------------------------------------------------------------- SFT masking
def _sft_batch(model, rng):
  """Two rows of prompts 3 and 5 long, one canvas each (plus a second, empty slot)."""
  c = model.config.canvas_length
  rows = [sft.pack_example(rng.integers(3, 12, p).tolist(), rng.integers(3, 12, c - 1).tolist(),
                           prompt_length=5, canvas_length=c, num_canvases=2, eos_id=1, pad_id=0)
          for p in (3, 5)]
  return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


class _LogitTap:
  """The model, with `delta` added to the encoder's logits: d loss / d delta is what each position's
  logits contribute to the loss's gradient."""

  def __init__(self, model, delta):
    self.model, self.delta, self.config = model, delta, model.config
    self.encode, self.denoise = model.encode, model.denoise

  def apply(self, params, *args, method=None, **kwargs):
    out = self.model.apply(params, *args, method=method, **kwargs)
    if getattr(method, "__name__", None) == "encode":
      return out[0] + self.delta[:, :out[0].shape[1]], out[1]
    return out


@pytest.mark.parametrize("noise", ["uniform", "masked"])
def test_prompt_positions_contribute_nothing_to_the_diffusion_loss(noise):
  model = _tiny_model(canvas=8)
  params = _init(model)
  batch = _sft_batch(model, np.random.default_rng(0))
  noise_fn = {"uniform": dg.diffusion.UniformNoise, "masked": dg.diffusion.MaskedNoise}[noise](
      model.config.vocab_size)
  config = loss_lib.LossConfig(noise=noise_fn, self_conditioning_prob=0.0, ar_loss_weight=0.0)
  rng = jax.random.key(1)
  loss, _ = jax.jit(lambda p: loss_lib.diffusion_loss(model, p, batch, rng, config, num_canvases=2))(params)

  # The same loss by hand: clean prompt in the cache, the one response canvas noised, CE on it only.
  k_t, k_noise, _, _ = jax.random.split(rng, 4)
  tokens, start = batch["tokens"], batch["prompt_length"]
  clean = jnp.stack([jax.lax.dynamic_slice(tokens[b], (start[b],), (16,)) for b in range(2)]).reshape(2, 2, 8)
  t = dg.diffusion.sample_time(k_t, (2, 2), config.eps)
  noisy, corrupted = noise_fn.corrupt(k_noise, clean, t[..., None])
  weights = noise_fn.loss_weights(corrupted, t[..., None])
  total = 0.0
  encode = jax.jit(lambda tokens: model.apply(params, tokens, method=model.encode)[1])
  denoise = jax.jit(lambda canvas, cache: model.apply(params, canvas, cache, method=model.denoise))
  for b in range(2):
    logits = denoise(noisy[b:b + 1, 0], encode(tokens[b:b + 1, :int(start[b])]))
    ce = optax.softmax_cross_entropy_with_integer_labels(noise_fn.prepare_logits(logits), clean[b:b + 1, 0])
    total += (weights[b, 0] * ce[0]).mean()
  np.testing.assert_allclose(loss, total / 2, rtol=2e-5)

  # Gradient: the encoder's logits (the only per-position output of the prompt) get none.
  def tapped(delta):
    return loss_lib.diffusion_loss(_LogitTap(model, delta), params, batch, rng, config, num_canvases=2)[0]

  delta = jnp.zeros(tokens.shape + (model.config.vocab_size,))
  assert not np.asarray(jax.jit(jax.grad(tapped))(delta)).any()
  # With the AR loss on the response only, the logits predicting prompt tokens still get none, and
  # nothing past a row's canvases (padding) gets any.
  config = config.replace(ar_loss_weight=1.0, ar_loss_on_prompt=False)
  grad = np.abs(np.asarray(jax.jit(jax.grad(tapped))(delta))).sum(-1)  # [B, L]
  for b in range(2):
    p = int(start[b])
    assert not grad[b, :p - 1].any()  # logits at i predict token i + 1: the prompt's own targets
    assert grad[b, p - 1:p + 8 - 1].all()  # the response canvas
    assert not grad[b, p + 8 - 1:].any()  # past the row's only canvas


def test_per_row_canvases_and_padding_do_not_change_the_loss():
  model = _tiny_model(canvas=8)
  params = _init(model)
  batch = _sft_batch(model, np.random.default_rng(1))
  config = loss_lib.LossConfig(noise=dg.diffusion.MaskedNoise(model.config.vocab_size),
                               self_conditioning_prob=0.5, all_canvases=True)
  fn = lambda p, b: loss_lib.diffusion_loss(model, p, b, jax.random.key(2), config, num_canvases=2)
  step = jax.jit(jax.value_and_grad(fn, has_aux=True))
  (loss, metrics), grads = step(params, batch)
  changed = dict(batch)
  tokens = np.asarray(batch["tokens"]).copy()
  for b in range(2):  # scribble over the unused second canvas slot and the padding
    tokens[b, int(batch["prompt_length"][b]) + 8:] = 7
  changed["tokens"] = jnp.asarray(tokens)
  (loss2, _), grads2 = step(params, changed)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, grads2)
  assert metrics["corrupted_fraction"] > 0


# ------------------------------------------------------------------------------------------- LoRA
LORA = lora.LoraConfig(rank=2, alpha=4.0)


def test_lora_targets_and_shapes():
  model = _tiny_model()
  params = _init(model)
  adapters = lora.init_adapters(params, LORA, jax.random.key(0))
  layer = adapters["layer_0"]
  assert set(layer) == {"attn", "mlp", "experts"}
  assert set(layer["attn"]) == {"q_einsum", "k_einsum", "v_einsum", "attn_vec_einsum"}
  base = params["params"]["layer_0"]
  d = model.config.hidden_size
  assert layer["attn"]["q_einsum"]["lora_a"].shape == (d, 2)
  assert layer["attn"]["q_einsum"]["lora_b"].shape == (2,) + tuple(np.take(base["attn"]["q_einsum"].shape, [0, 2]))
  e = model.config.num_experts
  assert layer["experts"]["linear"]["lora_a"].shape == (e, model.config.moe_intermediate_size, 2)
  assert "self_conditioning" in adapters  # its MLP is an MLP projection too
  only_q = lora.init_adapters(params, lora.LoraConfig(rank=2, targets=(r"attn/q_einsum$",)), jax.random.key(0))
  assert {k for layer in only_q.values() for k in layer["attn"]} == {"q_einsum"}
  with pytest.raises(ValueError, match="match no adaptable weight"):
    lora.init_adapters(params, lora.LoraConfig(targets=("nothing",)), jax.random.key(0))
  with pytest.raises(ValueError, match="rank"):
    lora.LoraConfig(rank=0)


@pytest.mark.parametrize("layout", sorted(lora.LAYOUTS))
def test_merged_weight_acts_as_base_plus_low_rank_path(layout):
  """x . W' == x . W + (alpha / r) (x . A) . B, contracting the weight's input axes."""
  axes, inputs, batch = lora.LAYOUTS[layout]
  sizes = dict(zip("NKDHGFE", (4, 2, 6, 3, 2, 5, 3)))
  rng = np.random.default_rng(0)
  weight = rng.normal(size=[sizes[a] for a in axes]).astype(np.float32)
  a_shape, b_shape = lora._factor_shapes(layout, weight.shape, 2)  # pylint: disable=protected-access
  a, b = rng.normal(size=a_shape).astype(np.float32), rng.normal(size=b_shape).astype(np.float32)
  merged = weight + LORA.scale * np.asarray(lora.delta(layout, a, b))
  x = rng.normal(size=[7] + [sizes[c] for c in batch + inputs]).astype(np.float32)
  outputs = "".join(c for c in axes if c not in inputs and c not in batch)
  contract = f"T{batch}{inputs},{axes}->T{batch}{outputs}"
  low_rank = np.einsum(f"T{batch}r,{batch}r{outputs}->T{batch}{outputs}",
                       np.einsum(f"T{batch}{inputs},{batch}{inputs}r->T{batch}r", x, a), b)
  np.testing.assert_allclose(np.einsum(contract, x, merged),
                             np.einsum(contract, x, weight) + LORA.scale * low_rank, rtol=1e-4, atol=1e-4)


def test_merged_model_logits():
  model = _tiny_model(moe_impl="dense")
  params = _init(model)
  adapters = lora.init_adapters(params, LORA, jax.random.key(1))
  prompt = jnp.asarray([[2, 5, 6, 7, 8, 9, 10]])
  canvas = jnp.full((1, 81), 4, jnp.int32)
  logits = jax.jit(lambda variables: model.apply(variables, prompt, canvas))  # one program for the three
  base_logits = logits(params)
  # B = 0 at init: the merged model is the base model, exactly.
  np.testing.assert_array_equal(logits(lora.merge(params, adapters, LORA)), base_logits)
  # With B != 0, the merged model equals the base with each W replaced by W + scale A B, computed
  # here by reshaping the factors to matrices (independently of lora.delta's einsums).
  adapters = jax.tree.map(lambda x: x + 0.3, adapters)
  expected = jax.tree.map(np.asarray, params)
  for path, adapter in _adapter_items(adapters):
    weight = _at(expected["params"], path)
    layout = "/".join(path[-2:])
    axes, inputs, batch = lora.LAYOUTS[layout]
    outputs = [c for c in axes if c not in inputs and c not in batch]
    order = list(batch) + list(inputs) + outputs
    w = np.transpose(weight, [axes.index(c) for c in order])
    lead = len(batch)
    a = np.asarray(adapter["lora_a"]).reshape(w.shape[:lead] + (-1, LORA.rank))
    b = np.asarray(adapter["lora_b"]).reshape(w.shape[:lead] + (LORA.rank, -1))
    update = (a @ b).reshape(w.shape)
    _put(expected["params"], path, np.transpose(w + LORA.scale * update, np.argsort([axes.index(c) for c in order])))
  merged_logits = logits(lora.merge(params, adapters, LORA))
  np.testing.assert_allclose(merged_logits, logits(expected), rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(logits(params), base_logits)  # merging left the base as it was
  assert np.abs(np.asarray(merged_logits - base_logits)).max() > 1e-3


def _adapter_items(adapters, path=()):
  if set(adapters) == set(lora.ADAPTER_KEYS):
    yield path, adapters
    return
  for key, value in adapters.items():
    yield from _adapter_items(value, path + (key,))


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _put(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def test_lora_training_freezes_the_base_and_optimizes_only_adapters(tmp_path):
  model = _tiny_model()
  base = _init(model)
  base_copy = jax.tree.map(lambda x: np.array(x, copy=True), base)
  train = dict(learning_rate=1e-2, warmup_steps=0, num_steps=20)
  optimizer = optim.make_optimizer(train)
  loss_cfg = loss_lib.LossConfig(noise=dg.diffusion.MaskedNoise(model.config.vocab_size), self_conditioning_prob=0.5)
  state = lora.create_train_state(base, optimizer, LORA, seed=0)
  adapters0 = jax.tree.map(np.asarray, state.params)
  step = lora.make_train_step(model, optimizer, loss_cfg, LORA, num_canvases=1)
  batch = _batch()
  fixed_loss = jax.jit(lambda adapters: loss_lib.diffusion_loss(
      model, lora.merge(base, adapters, LORA), batch, jax.random.key(9), loss_cfg, num_canvases=1)[0])
  before = fixed_loss(state.params)
  for _ in range(4):
    state, _ = step(state, batch, base)
  # The adapters moved (B away from zero), the loss went down on this batch.
  assert any(np.abs(np.asarray(x) - y).max() > 0 for x, y in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(adapters0)))
  assert fixed_loss(state.params) < before
  # The base, after training and merging: bit-identical.
  bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(bits(a), bits(b)), base, base_copy)
  # The optimizer state: the adapters' moments and scalars, nothing of the base's size.
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
  moment_shapes = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert moment_shapes == sorted(adapter_shapes * 2)
  opt_size = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert opt_size - 2 * lora.num_parameters(state.params) < 8
  assert lora.num_parameters(state.params) < lora.num_parameters(base) / 3

  # Adapters are checkpointed apart from the base, and merge back for export.
  lora.save_adapters(tmp_path / "adapters", state.params, LORA)
  restored, restored_config = lora.load_adapters(tmp_path / "adapters")
  assert restored_config == LORA
  jax.tree.map(np.testing.assert_array_equal, restored, jax.tree.map(np.asarray, state.params))
  merged = lora.merge(base, restored, LORA)
  assert jax.tree.structure(merged) == jax.tree.structure(base)


@pytest.mark.hf
def test_lora_save_hf_writes_the_merged_model(tmp_path):
  pytest.importorskip("safetensors")
  model = _tiny_model(vocab=32)
  base = _init(model)
  adapters = jax.tree.map(lambda x: x + 0.1, lora.init_adapters(base, LORA, jax.random.key(0)))
  lora.save_hf(model.config, base, adapters, LORA, tmp_path / "hf")
  _, loaded = dg.convert.load_hf(tmp_path / "hf")
  merged = lora.merge(base, adapters, LORA)["params"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), loaded,
               jax.tree.map(np.asarray, merged))




@pytest.mark.parametrize("noise,weighting", [("uniform", "elbo"), ("masked", "elbo"), ("masked", "flat")])
def test_given_positions_are_held_clean_and_never_targets(noise, weighting):
  """`given` (a puzzle's clues, infilling's held text): the denoiser sees those positions clean whatever t
  is, and the loss is the mean over the other positions only (checked against the loss by hand)."""
  model = _tiny_model(canvas=8)
  params = _init(model)
  batch = dict(_batch(n=3, canvas=8, seed=2))
  given = np.zeros(batch["tokens"].shape, bool)
  given[:, 6:14:3] = True  # canvas positions 0, 3, 6
  batch["given"] = jnp.asarray(given)
  noise_fn = {"uniform": dg.diffusion.UniformNoise, "masked": dg.diffusion.MaskedNoise}[noise](16)
  config = loss_lib.LossConfig(noise=noise_fn, self_conditioning_prob=0.0, ar_loss_weight=0.0, eps=0.3,
                               loss_weighting=weighting)
  rng = jax.random.key(4)
  loss, metrics = jax.jit(lambda p: loss_lib.diffusion_loss(model, p, batch, rng, config, num_canvases=1))(params)

  k_t, k_noise, _, _ = jax.random.split(rng, 4)
  clean = batch["tokens"][:, 6:14][:, None]  # [B, 1, C]
  held = jnp.asarray(given[:, 6:14])[:, None]
  t = dg.diffusion.sample_time(k_t, (3, 1), config.eps)
  noisy, corrupted = noise_fn.corrupt(k_noise, clean, t[..., None])
  assert np.asarray(corrupted & held).any()  # without holding, some given positions would be noised
  noisy = jnp.where(held, clean, noisy)
  weights = noise_fn.loss_weights(corrupted & ~held, t[..., None])
  if weighting == "flat":  # masked: every masked token alike, no 1/t
    weights = (corrupted & ~held).astype(jnp.float32)
  logits = jax.jit(lambda tokens, canvas: model.apply(
      params, canvas, model.apply(params, tokens, method=model.encode)[1], method=model.denoise))
  logits = noise_fn.prepare_logits(logits(batch["tokens"][:, :6], noisy[:, 0]))
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, clean[:, 0])
  free = ~held[:, 0]
  np.testing.assert_allclose(loss, (weights[:, 0] * ce * free).sum() / free.sum(), rtol=2e-5)
  assert 0 < float(metrics["corrupted_fraction"]) <= 1
