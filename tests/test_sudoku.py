"""Sudoku, SFT and LoRA: the puzzle generator and encoding, SFT batches and masking, LoRA's
properties, the Sudoku evaluation and the solve script end to end."""

import json
import pathlib
import random
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diffusiongemma as dg
from diffusiongemma.build.config import load_config_file
from diffusiongemma.data import sft
from diffusiongemma.data import sudoku
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.evaluation import sudoku as sudoku_eval
from diffusiongemma.training import lora
from diffusiongemma.training import optim
import notebooks

ROOT = pathlib.Path(__file__).parent.parent
# A 30-clue puzzle with a unique solution and that solution (generate(30, 0), checked here).
GRID = "617394285983652471452178639765421398391867524248935716536219847124786953879543162"
PUZZLE = "010090200080002400002000039060000308301007504200000706006019047000080003070003002"


def _tiny_model(vocab=sudoku.VOCAB_SIZE, canvas=sudoku.NUM_CELLS, **changes):
  cfg = dg.build.model_config(load_config_file(ROOT / "configs/sudoku.py", "tiny"))
  return dg.DiffusionGemma(cfg.replace(vocab_size=vocab, canvas_length=canvas, **changes))


def _init(model, seed=0):
  prompt = jnp.zeros((1, 4), jnp.int32)
  canvas = jnp.zeros((1, model.config.canvas_length), jnp.int32)
  return nn.unbox(model.init(jax.random.key(seed), prompt, canvas))


# ------------------------------------------------------------------------------------ generator
def test_known_puzzle_has_its_unique_solution():
  puzzle = sudoku.parse_puzzle(PUZZLE)
  solutions = sudoku.solve(puzzle, limit=3)
  assert len(solutions) == 1
  assert sudoku.format_grid(solutions[0]) == GRID
  grid = sudoku.parse_puzzle(GRID)
  two_blank = grid.copy()
  two_blank[[0, 1]] = 0  # two cells of one row: their values are forced, still unique
  assert sudoku.count_solutions(two_blank) == 1
  rectangle = grid.copy()  # the four corners of a swappable rectangle: two solutions
  rows, cols = _deadly_rectangle(grid)
  rectangle[[r * 9 + c for r in rows for c in cols]] = 0
  assert sudoku.count_solutions(rectangle) == 2


def _deadly_rectangle(grid):
  """Rows r1, r2 of one band and columns c1, c2 whose corners hold a, b / b, a: swapping them gives a
  second valid grid (the four cells lie in at most two boxes)."""
  g = grid.reshape(9, 9)
  for r1 in range(9):
    for r2 in range(r1 + 1, 9):
      if r1 // 3 != r2 // 3:
        continue
      for c1 in range(9):
        for c2 in range(c1 + 1, 9):
          if g[r1, c1] == g[r2, c2] and g[r1, c2] == g[r2, c1]:
            return (r1, r2), (c1, c2)
  pytest.skip("no swappable rectangle in this grid")


@pytest.mark.parametrize("clues", [36, 40])
def test_generate_is_deterministic_unique_and_valid(clues):
  puzzle, solution = sudoku.generate(clues, seed=3, split="train", index=5)
  again, again_solution = sudoku.generate(clues, seed=3, split="train", index=5)
  np.testing.assert_array_equal(puzzle, again)
  np.testing.assert_array_equal(solution, again_solution)
  assert (puzzle != 0).sum() == clues
  assert sudoku.check_solution(puzzle, solution)
  solutions = sudoku.solve(puzzle, limit=2)
  assert len(solutions) == 1
  np.testing.assert_array_equal(solutions[0], solution)


def test_splits_and_seeds_give_different_puzzles():
  train, _ = sudoku.generate_many(20, (36, 38, 40), seed=0, split="train")
  validation, _ = sudoku.generate_many(20, (36, 38, 40), seed=0, split="validation")
  other_seed, _ = sudoku.generate_many(20, (36, 38, 40), seed=1, split="train")
  key = lambda rows: {r.tobytes() for r in rows}
  assert len(key(train)) == 20
  assert not key(train) & key(validation)
  assert not key(train) & key(other_seed)
  assert list((train != 0).sum(1)[:3]) == [36, 38, 40]
  with pytest.raises(ValueError, match="split"):
    sudoku.generate(36, 0, split="test")
  with pytest.raises(ValueError, match="num_clues"):
    sudoku.generate(10, 0)


def test_random_grids_are_valid_and_varied():
  rng = random.Random(0)
  grids = np.asarray([sudoku.random_grid(rng) for _ in range(5)])
  assert sudoku.is_valid_grid(grids).all()
  assert len({g.tobytes() for g in grids}) == 5


def test_symmetries_preserve_validity_clues_and_uniqueness():
  puzzle, solution = sudoku.parse_puzzle(PUZZLE), sudoku.parse_puzzle(GRID)
  rng = np.random.default_rng(0)
  for _ in range(5):
    cells, digits = sudoku.random_symmetry(rng)
    assert sorted(cells.tolist()) == list(range(81))
    p, s = sudoku.apply_symmetry(puzzle, cells, digits), sudoku.apply_symmetry(solution, cells, digits)
    assert (p != 0).sum() == (puzzle != 0).sum()
    assert sudoku.check_solution(p, s)
    assert sudoku.count_solutions(p) == 1
  more = sudoku.reveal(puzzle, solution, 38, rng)
  assert (more != 0).sum() == 38 and sudoku.check_solution(more, solution)
  assert ((puzzle == 0) | (more == puzzle)).all()


def test_puzzle_pool_is_cached(tmp_path):
  first = sudoku.puzzle_pool(4, 36, seed=0, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("sudoku-*.npz"))) == 1
  second = sudoku.puzzle_pool(4, 36, seed=0, cache_dir=tmp_path)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------- encoding and files
def test_encoding_round_trip():
  puzzle, solution = sudoku.parse_puzzle(PUZZLE), sudoku.parse_puzzle(GRID)
  prompt = sudoku.encode_puzzle(puzzle)
  assert prompt.shape == (82,) and prompt[0] == sudoku.BOS
  assert set(prompt[1:][puzzle == 0].tolist()) == {sudoku.BLANK}
  assert prompt.max() < sudoku.VOCAB_SIZE - 1  # the last id is left for the mask token
  np.testing.assert_array_equal(sudoku.decode_puzzle(prompt), puzzle)
  response = sudoku.encode_solution(solution)
  np.testing.assert_array_equal(sudoku.decode_solution(response), solution)
  assert not {sudoku.PAD, sudoku.EOS, sudoku.BOS} & set(response.tolist())
  garbled = response.copy()
  garbled[[3, 7]] = [sudoku.EOS, 15]
  decoded = sudoku.decode_solution(garbled)
  assert decoded[3] == decoded[7] == 0 and not sudoku.check_solution(puzzle, decoded)
  with pytest.raises(ValueError, match="digits 1..9"):
    sudoku.encode_solution(puzzle)


def test_check_solution():
  puzzle, solution = sudoku.parse_puzzle(PUZZLE), sudoku.parse_puzzle(GRID)
  assert sudoku.check_solution(puzzle, solution)
  swapped = solution.copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # still a permutation in its row, breaks columns
  assert not sudoku.check_solution(puzzle, swapped)
  relabelled = np.where(solution == 1, 2, np.where(solution == 2, 1, solution))
  assert sudoku.is_valid_grid(relabelled) and (puzzle == 1).any()
  assert not sudoku.check_solution(puzzle, relabelled)  # a valid grid, but not the clues'
  batch = np.stack([solution, swapped])
  np.testing.assert_array_equal(sudoku.check_solution(puzzle[None], batch), [True, False])


def test_puzzle_files(tmp_path):
  path = tmp_path / "p.txt"
  path.write_text(PUZZLE + "\n\n" + PUZZLE.replace("0", ".") + "\n")
  puzzles = sudoku.read_puzzles(path)
  assert puzzles.shape == (2, 81)
  np.testing.assert_array_equal(puzzles[0], puzzles[1])
  sudoku.write_puzzles(tmp_path / "q.txt", puzzles)
  assert (tmp_path / "q.txt").read_text().splitlines() == [PUZZLE, PUZZLE]
  path.write_text(PUZZLE[:80] + "\n")
  with pytest.raises(ValueError, match=r"p.txt:1: expected 81 characters"):
    sudoku.read_puzzles(path)


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


def test_sudoku_dataset_batches(tmp_path):
  settings = dict(batch_size=4, seed=0, pool_size=8, pool_clues=36, min_clues=38, max_clues=40,
                  validation_size=4, validation_clues=(36, 40), cache_dir=tmp_path)
  train = iter(sft.sudoku_dataset("train", **settings))
  batches = [next(train) for _ in range(3)]
  for batch in batches:
    assert batch["tokens"].shape == (4, 163) and batch["tokens"].dtype == np.int32
    np.testing.assert_array_equal(batch["prompt_length"], 82)
    puzzles = sudoku.decode_puzzle(batch["tokens"][:, :82])
    solutions = sudoku.decode_solution(batch["tokens"][:, 82:])
    assert sudoku.check_solution(puzzles, solutions).all()
    assert ((puzzles != 0).sum(1) >= 38).all() and ((puzzles != 0).sum(1) <= 40).all()
  again = iter(sft.sudoku_dataset("train", **settings))
  np.testing.assert_array_equal(next(again)["tokens"], batches[0]["tokens"])
  validation = list(sft.sudoku_dataset("validation", **settings))
  assert len(validation) == 1
  clues = (sudoku.decode_puzzle(validation[0]["tokens"][:, :82]) != 0).sum(1)
  assert clues.tolist() == [36, 40, 36, 40]
  padded = next(iter(sft.sudoku_dataset("validation", **settings, canvas_length=96)))
  assert padded["tokens"].shape == (4, 82 + 96)
  assert (padded["tokens"][:, 82 + 81:] == sudoku.EOS).all()


def test_sudoku_curriculum_starts_easy(tmp_path):
  settings = dict(batch_size=4, seed=0, pool_size=8, pool_clues=36, min_clues=36, max_clues=44,
                  curriculum_steps=4, cache_dir=tmp_path)
  train = iter(sft.sudoku_dataset("train", **settings))
  lowest = [(sudoku.decode_puzzle(next(train)["tokens"][:, :82]) != 0).sum(1).min() for _ in range(8)]
  assert lowest[0] >= 43 and min(lowest[5:]) < 40
  assert all(clues >= 36 for clues in lowest)


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
  loss, _ = loss_lib.diffusion_loss(model, params, batch, rng, config, num_canvases=2)

  # The same loss by hand: clean prompt in the cache, the one response canvas noised, CE on it only.
  k_t, k_noise, _, _ = jax.random.split(rng, 4)
  tokens, start = batch["tokens"], batch["prompt_length"]
  clean = jnp.stack([jax.lax.dynamic_slice(tokens[b], (start[b],), (16,)) for b in range(2)]).reshape(2, 2, 8)
  t = dg.diffusion.sample_time(k_t, (2, 2), config.eps)
  noisy, corrupted = noise_fn.corrupt(k_noise, clean, t[..., None])
  weights = noise_fn.loss_weights(corrupted, t[..., None])
  total = 0.0
  for b in range(2):
    _, cache = model.apply(params, tokens[b:b + 1, :int(start[b])], method=model.encode)
    logits = model.apply(params, noisy[b:b + 1, 0], cache, method=model.denoise)
    ce = optax.softmax_cross_entropy_with_integer_labels(noise_fn.prepare_logits(logits), clean[b:b + 1, 0])
    total += (weights[b, 0] * ce[0]).mean()
  np.testing.assert_allclose(loss, total / 2, rtol=2e-5)

  # Gradient: the encoder's logits (the only per-position output of the prompt) get none.
  def tapped(delta):
    return loss_lib.diffusion_loss(_LogitTap(model, delta), params, batch, rng, config, num_canvases=2)[0]

  delta = jnp.zeros(tokens.shape + (model.config.vocab_size,))
  assert not np.asarray(jax.grad(tapped)(delta)).any()
  # With the AR loss on the response only, the logits predicting prompt tokens still get none, and
  # nothing past a row's canvases (padding) gets any.
  config = config.replace(ar_loss_weight=1.0, ar_loss_on_prompt=False)
  grad = np.abs(np.asarray(jax.grad(tapped)(delta))).sum(-1)  # [B, L]
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
  (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params, batch)
  changed = dict(batch)
  tokens = np.asarray(batch["tokens"]).copy()
  for b in range(2):  # scribble over the unused second canvas slot and the padding
    tokens[b, int(batch["prompt_length"][b]) + 8:] = 7
  changed["tokens"] = jnp.asarray(tokens)
  (loss2, _), grads2 = jax.value_and_grad(fn, has_aux=True)(params, changed)
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
  prompt = jnp.asarray(sudoku.encode_puzzle(sudoku.parse_puzzle(PUZZLE))[None])
  canvas = jnp.full((1, 81), 4, jnp.int32)
  base_logits = model.apply(params, prompt, canvas)
  # B = 0 at init: the merged model is the base model, exactly.
  np.testing.assert_array_equal(model.apply(lora.merge(params, adapters, LORA), prompt, canvas), base_logits)
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
  merged_logits = model.apply(lora.merge(params, adapters, LORA), prompt, canvas)
  np.testing.assert_allclose(merged_logits, model.apply(expected, prompt, canvas), rtol=1e-4, atol=1e-4)
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


def _sudoku_batch(n=4, canvas=81):
  puzzles, solutions = sudoku.generate_many(n, 40, seed=0)
  rows = [sft.sudoku_example(p, s, canvas) for p, s in zip(puzzles, solutions)]
  return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def test_lora_training_freezes_the_base_and_optimizes_only_adapters(tmp_path):
  model = _tiny_model()
  base = _init(model)
  base_copy = jax.tree.map(lambda x: np.array(x, copy=True), base)
  train = dict(load_config_file(ROOT / "configs/sudoku.py", "tiny").train)
  train.update(learning_rate=1e-2, warmup_steps=0)
  optimizer = optim.make_optimizer(train)
  loss_cfg = loss_lib.LossConfig(noise=dg.diffusion.MaskedNoise(model.config.vocab_size), self_conditioning_prob=0.5)
  state = lora.create_train_state(base, optimizer, LORA, seed=0)
  adapters0 = jax.tree.map(np.asarray, state.params)
  step = lora.make_train_step(model, optimizer, loss_cfg, LORA, num_canvases=1)
  batch = _sudoku_batch()
  fixed_loss = lambda adapters: float(loss_lib.diffusion_loss(
      model, lora.merge(base, adapters, LORA), batch, jax.random.key(9), loss_cfg, num_canvases=1)[0])
  before = fixed_loss(state.params)
  for _ in range(4):
    state, _ = step(state, batch, base)
  # The base: bit-identical.
  bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(bits(a), bits(b)), base, base_copy)
  # The adapters moved (B away from zero), the loss went down on this batch.
  assert any(np.abs(np.asarray(x) - y).max() > 0 for x, y in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(adapters0)))
  assert fixed_loss(state.params) < before
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


# ------------------------------------------------------------------------------------- evaluation
def test_solve_counts_passes_and_checks_solutions():
  model = _tiny_model()
  params = _init(model)
  puzzles, _ = sudoku.generate_many(3, 40, seed=0, split="validation")
  sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=4, prompt_bucket=2),
                       noise=dg.diffusion.MaskedNoise(model.config.vocab_size))
  result = sudoku_eval.solve(sampler, params, puzzles, batch_size=2)
  assert result.solutions.shape == (3, 81) and result.passes.shape == (3,)
  assert ((result.passes >= 1) & (result.passes <= 4)).all()
  np.testing.assert_array_equal(result.solved, sudoku.check_solution(puzzles, result.solutions))
  ar = sudoku_eval.solve(dg.ARSampler(model, prompt_bucket=2), params, puzzles, batch_size=3)
  assert ((ar.passes >= 1) & (ar.passes <= 81)).all()  # one per token, until a stop token
  summary = ar.summary()
  # AR: one token per pass; a random model may write the pad id, which is not a new token (stats).
  assert summary["puzzles"] == 3 and summary["tokens_per_forward"] == ar.new_tokens.sum() / ar.passes.sum()
  assert 0.5 < summary["tokens_per_forward"] <= 1.0
  with pytest.raises(ValueError, match="needs a Sampler or an ARSampler"):
    sudoku_eval.solve("beam", params, puzzles)


@pytest.mark.slow
def test_train_and_solve_script_end_to_end(tmp_path):
  """configs/sudoku.py:tiny trains for a few steps with scripts/train.py, then solve_sudoku.py writes a
  line per puzzle and its summary (an untrained model solves nothing: the plumbing is what is tested)."""
  workdir = tmp_path / "w"
  env_run = lambda *args: subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True,
                                         text=True, timeout=900)
  env_run("scripts/train.py", "--config=configs/sudoku.py:tiny", f"--workdir={workdir}",
          "--config.train.num_steps=4", "--config.train.eval_every=0")
  puzzles, _ = sudoku.generate_many(5, (36, 40), seed=0, split="validation")
  sudoku.write_puzzles(tmp_path / "in.txt", puzzles, blank=".")
  for extra in ([], ["--autoregressive"]):
    out = env_run("scripts/solve_sudoku.py", "--config=configs/sudoku.py:tiny", f"--workdir={workdir}",
                  f"--puzzles={tmp_path / 'in.txt'}", f"--output={tmp_path / 'out.txt'}",
                  "--config.sampler.max_denoising_steps=3", "--batch_size=4", *extra)
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert len(lines) == 5 and all(len(line) == 81 and line.isdigit() for line in lines)
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("solved ") and "passes/puzzle" in last and "puzzles/s" in last
    stats = json.loads(out.stdout.strip().splitlines()[-2])
    assert stats["puzzles"] == 5 and 1 <= stats["passes_per_puzzle"] <= (81 if extra else 3)


@pytest.mark.slow
def test_sudoku_notebook_runs(tmp_path):
  """colabs/sudoku.ipynb end to end: brief training at an easy level, solving, the pass-by-pass grids."""
  text = notebooks.run_notebook("sudoku.ipynb", {"DG_SUDOKU_WORKDIR": str(tmp_path), "DG_SUDOKU_STEPS": "20"})
  assert "trained to step 20" in text and "denoiser passes per puzzle" in text and "noise masked" in text
  assert "accepted per pass:" in text and "passes per puzzle:" in text
