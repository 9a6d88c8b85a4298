"""The router and the sparse mixture of GeGLU experts.

Axes: T tokens, D model, E experts, k chosen experts per token, F expert feed-forward, X tile rows.

Three interchangeable implementations of the same function (`ModelConfig.moe_impl`; its default "auto" is
`ragged` on GPU/TPU and `grouped` on CPU, `config.default_moe_impl`):
- `grouped`: sort the T*k (token, expert) assignments by expert; each expert's first S assignments (a
  slab of ~1.25x the mean group) go through one batched matmul pair over all experts, and a busy expert's
  overflow through tiles of X rows (a `lax.scan` over the tiles in use). No token is dropped, and the work
  is at most (T*k + E*S + E*X) rows instead of T*E, so the cost stays flat as E grows at fixed k. This is
  what is truly sparse on CPU. For few tokens (`grouped_plan`) it gathers each assignment's weights, or
  runs every expert when that is no more rows than the slab and the tiles (`_every_expert`: no sort, no
  scan, two 2-D matmuls against the weights as stored).
- `ragged`: the sorted assignments through `jax.lax.ragged_dot` (real kernels on GPU/TPU; on CPU it
  computes every expert: see docs/moe.md).
- `dense`: every expert on every token, weighted by the (mostly zero) routing weights. The reference.

Under a mesh with an `expert` axis the experts run expert-parallel in `jax.shard_map` (tokens all-gathered
along `expert`, local experts applied, `psum_scatter` back; exact, weights never move). The design, why not
an all-to-all, and the measurements: docs/moe.md.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.model import layers
from diffusiongemma.model.config import ModelConfig
from diffusiongemma.parallel import mesh as mesh_lib

Array = jax.Array
_TILE_MULTIPLE = 8
_EXPERT_AXIS, _TENSOR_AXIS, _FSDP_AXIS = "expert", "tensor", "fsdp"  # mesh axes (parallel/mesh.py)


class Router(nn.Module):
  """Top-k routing as the reference: RMSNorm without scale on the residual, times a learned scale and
  D^-0.5, linear to E logits, float32 softmax over all experts, top-k, renormalise, per-expert scale."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> tuple[Array, Array]:
    cfg = self.config
    pdt = jnp.dtype(cfg.param_dtype)
    w = layers.param(self, "router_logits", layers.fan_in_init([0]), (cfg.hidden_size, cfg.num_experts),
                     pdt, ("embed", "experts"))
    scale = layers.param(self, "router_scale", nn.initializers.ones, (cfg.hidden_size,), pdt, ("embed",))
    per_expert = layers.param(self, "per_expert_scale", nn.initializers.ones, (cfg.num_experts,), pdt,
                              ("experts",))
    h = layers.rms_norm(x, None, cfg.rms_norm_eps) * scale.astype(x.dtype) * (cfg.hidden_size**-0.5)
    logits = layers.einsum("TD,DE->TE", h, w, x.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * per_expert.astype(jnp.float32)[experts], experts


def _geglu(gate_up: Array) -> Array:
  return jax.nn.gelu(gate_up[..., 0, :], approximate=True) * gate_up[..., 1, :]


def tile_size(num_tokens: int, top_k: int, num_experts: int) -> int:
  """Rows per tile: the mean group size, rounded up to a multiple of 8."""
  mean = -(-num_tokens * top_k // num_experts)
  return max(_TILE_MULTIPLE, -(-mean // _TILE_MULTIPLE) * _TILE_MULTIPLE)


class Experts(nn.Module):
  """E GeGLU experts with fused gate/up weights; combines the k chosen experts' outputs per token."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, weights: Array, experts: Array, skip: Array | None = None) -> Array:
    """x: [T, D]; weights, experts: [T, k] routing weights and expert ids. Returns [T, D].

    skip [T] (optional): tokens whose result is not needed (e.g. rows of a batch that are done). The
    `grouped` path leaves them out of its tiles, so they cost nothing, and returns zeros for them; the
    other tokens' results are unchanged (each tile is a matmul of the same shape whoever fills it).
    """
    cfg = self.config
    pdt = jnp.dtype(cfg.param_dtype)
    shape = (cfg.num_experts, 2, cfg.moe_intermediate_size, cfg.hidden_size)
    gating = layers.weight(self, "gating_einsum", layers.fan_in_init([3]), shape, pdt,
                           ("experts", None, "expert_mlp", "embed"), contract=(3,), quantize=cfg.quantize)
    linear = layers.weight(self, "linear", layers.fan_in_init([1]), shape[:1] + shape[2:], pdt,
                           ("experts", "expert_mlp", "embed"), contract=(1,), quantize=cfg.quantize)
    gating, linear = gating.astype(x.dtype), linear.astype(x.dtype)
    mesh = expert_parallel_mesh(cfg.num_experts)
    if mesh is not None:
      return _expert_parallel(mesh, cfg.moe_impl, x, weights, experts, gating, linear)
    if cfg.moe_impl == "grouped":
      return _grouped(x, weights, experts, gating, linear, skip)
    impl = {"ragged": _ragged, "dense": _dense}[cfg.moe_impl]
    return impl(x, weights, experts, gating, linear)


def _combine_matrix(weights: Array, experts: Array, num_experts: int) -> Array:
  """[T, E] float32: each token's routing weight on the experts it chose, 0 elsewhere."""
  combine = jnp.zeros((experts.shape[0], num_experts), jnp.float32)
  return combine.at[jnp.arange(experts.shape[0])[:, None], experts].add(weights)


def _dense(x, weights, experts, gating, linear):
  combine = _combine_matrix(weights, experts, gating.shape[0])  # [T, E]
  h = _geglu(jnp.einsum("TD,EGFD->TEGF", x, gating))  # [T, E, F]
  out = jnp.einsum("TEF,EFD->TED", h, linear)
  return jnp.einsum("TED,TE->TD", out.astype(jnp.float32), combine).astype(x.dtype)


def _sort_assignments(experts: Array, num_experts: int):
  """Assignments sorted by expert: (order [T*k], sorted expert ids [T*k], group sizes [E])."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, flat[order], sizes


def _combine(rows: Array, order: Array, weights: Array, num_tokens: int) -> Array:
  """Weighted sum of the k expert outputs of each token; rows [T*k, D] are in sorted order."""
  top_k = weights.shape[1]
  unsorted = jnp.zeros_like(rows).at[order].set(rows)  # [T*k, D]
  unsorted = unsorted.reshape(num_tokens, top_k, -1).astype(jnp.float32)
  return jnp.einsum("TkD,Tk->TD", unsorted, weights)


def _ragged(x, weights, experts, gating, linear):
  num_tokens, top_k = experts.shape
  num_experts, _, ffn, dim = gating.shape
  order, _, sizes = _sort_assignments(experts, num_experts)
  rows = x[order // top_k]  # [T*k, D]
  gate_up = jax.lax.ragged_dot(rows, gating.reshape(num_experts, 2 * ffn, dim).transpose(0, 2, 1), sizes)
  h = _geglu(gate_up.reshape(-1, 2, ffn))
  out = jax.lax.ragged_dot(h, linear, sizes)  # [T*k, D]
  return _combine(out, order, weights, num_tokens).astype(x.dtype)


def _group_ranks(sorted_experts: Array, sizes: Array) -> Array:
  """Each sorted assignment's place within its expert's group (ids >= E: meaningless, masked by callers)."""
  group_start = jnp.cumsum(sizes) - sizes  # [E] first sorted assignment of each expert
  return jnp.arange(sorted_experts.shape[0]) - group_start[jnp.minimum(sorted_experts, sizes.shape[0] - 1)]


def _row_tokens(dest: Array, token: Array, num_rows: int, pad: int) -> Array:
  """The token of each of `num_rows` padded rows: `token[i]` at row `dest[i]` (past the end: dropped),
  `pad` (a row read as zeros) elsewhere."""
  return jnp.full((num_rows,), pad, jnp.int32).at[dest].set(token, mode="drop")


def _tile_layout(experts: Array, rank: Array, sizes: Array, tile: int, num_tiles: int):
  """Groups of `sizes` [E] assignments padded to whole tiles: (the padded row of each assignment, given its
  expert [A] (ids >= E: none, past the end) and its rank in the group [A]; the expert of each tile, any
  valid one for the empty tiles after the last; tiles in use)."""
  num_experts = sizes.shape[0]
  expert = jnp.minimum(experts, num_experts - 1)
  tiles_per_expert = -(-sizes // tile)
  tile_end = jnp.cumsum(tiles_per_expert)  # [E] first tile after each expert's tiles
  padded_start = (tile_end - tiles_per_expert) * tile  # [E] first padded row of each expert
  dest = jnp.where(experts < num_experts, padded_start[expert] + rank, num_tiles * tile)
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"),
                            num_experts - 1)
  return dest, tile_expert, tile_end[-1]


def _tile_ffn(tiles: Array, tile_expert: Array, gating: Array, linear: Array) -> Array:
  """tiles [n, X, D], each through its own expert: [n, X, D]."""
  h = _geglu(jnp.einsum("nXD,nGFD->nXGF", tiles, gating[tile_expert]))
  return jnp.einsum("nXF,nFD->nXD", h, linear[tile_expert])


def slab_capacity(num_tokens: int, top_k: int, num_experts: int) -> int:
  """Rows per expert in `_grouped`'s batched slab: 1.25x the mean group size, a multiple of 8. Measured on
  one CPU core, D=F=256, 16 experts top-2 (CPU time): against 1x and 1.5x the mean, the least at 256 and
  512 tokens and within noise of the best at 2048."""
  mean = -(-num_tokens * top_k // num_experts)
  return max(_TILE_MULTIPLE, -(-(5 * mean // 4) // _TILE_MULTIPLE) * _TILE_MULTIPLE)


def _tiles(capacity: int, num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int]:
  """(rows per overflow tile, tiles the scan runs over: sum ceil(n_e / X) <= A / X + E)."""
  tile = max(_TILE_MULTIPLE, capacity // 4 // _TILE_MULTIPLE * _TILE_MULTIPLE)
  return tile, -(-num_tokens * top_k // tile) + num_experts


def grouped_plan(num_tokens: int, top_k: int, num_experts: int) -> str:
  """What `_grouped` computes for T tokens: "gathered" (T*k <= E: each assignment through its own copy of
  its expert's weights); "dense" (every expert on every token is no more rows than the slab and every tile
  the scan may run, so it runs that, with no sort and no scan); else "slab" (the slab and the tiles)."""
  if num_tokens * top_k <= num_experts:
    return "gathered"
  capacity = slab_capacity(num_tokens, top_k, num_experts)
  tile, num_tiles = _tiles(capacity, num_tokens, top_k, num_experts)
  return "dense" if num_tokens * num_experts <= num_experts * capacity + num_tiles * tile else "slab"


def _every_expert(x, weights, experts, gating, linear):
  """`_dense` as two 2-D matmuls: [T, D] against all experts' up weights as they are stored ([E*2F, D],
  contracted on D), the GeGLU scaled by each token's routing weight (0 for the experts it did not choose),
  then [T, E*F] against the down weights [E*F, D]. No weight is copied or transposed per call."""
  num_tokens = x.shape[0]
  num_experts, _, ffn, dim = gating.shape
  combine = _combine_matrix(weights, experts, num_experts)  # [T, E]
  h = layers.einsum("TD,ND->TN", x, gating.reshape(num_experts * 2 * ffn, dim), x.dtype)
  h = _geglu(h.reshape(num_tokens, num_experts, 2, ffn)) * combine[:, :, None].astype(x.dtype)  # [T, E, F]
  return layers.einsum("TN,ND->TD", h.reshape(num_tokens, num_experts * ffn),
                       linear.reshape(num_experts * ffn, dim), x.dtype)


def _gathered(x, weights, experts, gating, linear):
  """Each (token, expert) assignment through its own gathered copy of the expert's weights: for a few
  tokens (an autoregressive step), where it reads no more than all experts once and runs no loop."""
  num_tokens, top_k = experts.shape
  num_experts, _, ffn, dim = gating.shape
  chosen = experts.reshape(-1)  # [A] with A = T*k
  rows = jnp.repeat(x, top_k, axis=0)  # [A, D]
  h = layers.einsum("AD,AGD->AG", rows, gating.reshape(num_experts, 2 * ffn, dim)[chosen], x.dtype)
  out = layers.einsum("AF,AFD->AD", _geglu(h.reshape(-1, 2, ffn)), linear[chosen], x.dtype)  # [A, D]
  out = out.reshape(num_tokens, top_k, dim).astype(jnp.float32)
  return jnp.einsum("TkD,Tk->TD", out, weights).astype(x.dtype)


def _grouped(x, weights, experts, gating, linear, skip=None):
  """Each expert's first S assignments (S = `slab_capacity`, ~1.25x the mean group) in one batched matmul
  pair over all experts, [E, S, D] against the weights as they are; the assignments past S (a busy
  expert's overflow) in tiles of X rows, one matmul pair per tile in a `lax.scan` (tiles past the last one
  in use skipped by `lax.cond`). Nothing is dropped, and every assignment is computed once. Why and the
  measurements: docs/moe.md. For few tokens, `grouped_plan`: `_gathered` or `_every_expert`."""
  num_tokens, top_k = experts.shape
  num_experts, _, ffn, dim = gating.shape
  plan = grouped_plan(num_tokens, top_k, num_experts)
  if plan != "slab":
    weights = weights if skip is None else jnp.where(skip[:, None], 0.0, weights)
    return (_gathered if plan == "gathered" else _every_expert)(x, weights, experts, gating, linear)
  if skip is not None:  # expert id E: sorted last, in no group, in neither the slab nor a tile
    experts = jnp.where(skip[:, None], num_experts, experts)
  capacity = slab_capacity(num_tokens, top_k, num_experts)
  order, sorted_experts, sizes = _sort_assignments(experts, num_experts)
  rank = _group_ranks(sorted_experts, sizes)
  token = order // top_k  # [A] the token of each sorted assignment
  gate_up, linear = jnp.asarray(gating).reshape(num_experts, 2 * ffn, dim), jnp.asarray(linear)

  in_slab = (sorted_experts < num_experts) & (rank < capacity)
  slab_row = jnp.where(in_slab, sorted_experts * capacity + rank, num_experts * capacity)
  rows_token = _row_tokens(slab_row, token, num_experts * capacity, num_tokens)
  slab = jnp.take(x, rows_token, axis=0, mode="fill", fill_value=0).reshape(num_experts, capacity, dim)
  # The barriers keep XLA's CPU fusions apart (the gather out of the first matmul, the GeGLU out of the
  # second): slightly faster (docs/moe.md).
  slab = jax.lax.optimization_barrier(slab)
  h = layers.einsum("EXD,EGD->EXG", slab, gate_up, x.dtype).reshape(num_experts, capacity, 2, ffn)
  h = jax.lax.optimization_barrier(_geglu(h))
  out = layers.einsum("EXF,EFD->EXD", h, linear, x.dtype).reshape(num_experts * capacity, dim)
  rows = jnp.take(out, slab_row, axis=0, mode="fill", fill_value=0)  # [A, D] sorted; 0 past the slab

  tile, num_tiles = _tiles(capacity, num_tokens, top_k, num_experts)
  overflow = jnp.where(in_slab, num_experts, sorted_experts)
  dest, tile_expert, used = _tile_layout(overflow, rank - capacity, jnp.maximum(sizes - capacity, 0), tile,
                                         num_tiles)
  tile_token = _row_tokens(dest, token, num_tiles * tile, num_tokens)
  tiles = jnp.take(x, tile_token, axis=0, mode="fill", fill_value=0).reshape(num_tiles, tile, dim)

  def run(rows, expert):  # [X, D] through one expert
    h = layers.einsum("XD,GD->XG", rows, gate_up[expert], rows.dtype).reshape(tile, 2, ffn)
    return layers.einsum("XF,FD->XD", _geglu(h), linear[expert], rows.dtype)

  def body(_, inputs):
    index, rows, expert = inputs
    return None, jax.lax.cond(index < used, run, lambda rows, expert: jnp.zeros_like(rows), rows, expert)

  _, out = jax.lax.scan(body, None, (jnp.arange(num_tiles), tiles, tile_expert))  # [tiles, X, D]
  rows += jnp.take(out.reshape(num_tiles * tile, dim), dest, axis=0, mode="fill", fill_value=0)
  return _combine(rows, order, weights, num_tokens).astype(x.dtype)


def expert_parallel_mesh(num_experts: int):
  """The context mesh (`jax.set_mesh`) if its `expert` axis splits the experts, else None (one device's
  path). Raises if that axis does not divide the experts: silently replicating them would undo the split."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or _EXPERT_AXIS not in mesh.axis_names:
    return None
  if _EXPERT_AXIS in mesh.manual_axes:  # already inside a shard_map over experts
    return None
  size = mesh.shape[_EXPERT_AXIS]
  if size == 1:
    return None
  if num_experts % size:
    raise ValueError(f"num_experts={num_experts} is not divisible by the mesh's expert axis size {size}: "
                     f"expert parallelism needs the same number of experts on every device.")
  return mesh


def _expert_parallel(mesh, impl, x, weights, experts, gating, linear):
  """The experts under `shard_map` over `mesh` (see the module docstring). x: [T, D] -> [T, D]."""
  expert_axis, tensor_axis = _EXPERT_AXIS, _TENSOR_AXIS
  batch_axes = tuple(a for a in mesh_lib.BATCH_AXES if a in mesh.axis_names)
  shards = math.prod(mesh.shape[a] for a in batch_axes)
  ffn = gating.shape[2]
  tensor = mesh.shape.get(tensor_axis, 1)
  split_ffn = tensor > 1 and ffn % tensor == 0
  ffn_axis = tensor_axis if split_ffn else None  # otherwise every tensor device runs the whole F
  num_tokens = x.shape[0]
  pad = -num_tokens % shards  # padded tokens carry zero routing weights
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    weights, experts = jnp.pad(weights, ((0, pad), (0, 0))), jnp.pad(experts, ((0, pad), (0, 0)))
  # Weights split along D by fsdp are gathered in here, so their gradients leave by a reduce-scatter.
  fsdp = mesh.shape.get(_FSDP_AXIS, 1)
  fsdp_axis = _FSDP_AXIS if fsdp > 1 and gating.shape[3] % fsdp == 0 else None
  replicated_axes = tuple(a for a in batch_axes if a not in (expert_axis, fsdp_axis))

  def body(x, weights, experts, gating, linear):
    tokens = x.shape[0]  # this device's
    xs = jax.lax.all_gather(x, expert_axis, tiled=True)  # [n*T, D]
    ws = jax.lax.all_gather(weights, expert_axis, tiled=True)  # [n*T, k]
    first = jax.lax.axis_index(expert_axis) * gating.shape[0]
    es = jax.lax.all_gather(experts, expert_axis, tiled=True) - first  # local ids, others out of range
    # Make every operand vary over every axis here, so that the gradient's reductions over the batch
    # (of the weights) and over `tensor` (of the tokens) happen once out here: inside the skipped
    # chunks' `cond` a collective would hang the devices that skip.
    if fsdp_axis:
      gating = jax.lax.all_gather(gating, fsdp_axis, axis=3, tiled=True)
      linear = jax.lax.all_gather(linear, fsdp_axis, axis=2, tiled=True)
    gating, linear = (jax.lax.pcast(w, replicated_axes, to="varying") for w in (gating, linear))
    if split_ffn:
      xs = jax.lax.pcast(xs, (tensor_axis,), to="varying")
    # The grouped tiles are sized by this device's own tokens; the others need only the gathered ones.
    local = (functools.partial(_local_grouped, tokens=tokens) if impl == "grouped" else
             {"ragged": _local_ragged, "dense": _local_dense}[impl])
    partial = local(xs, ws, es, gating, linear)  # [n*T, D] float32, this device's experts only
    out = jax.lax.psum_scatter(partial, expert_axis, scatter_dimension=0, tiled=True)  # [T, D]
    if split_ffn:
      out = jax.lax.psum(out, tensor_axis)
    return out.astype(x.dtype)

  rows = jax.P(batch_axes, None)
  out = jax.shard_map(
      body, mesh=mesh, out_specs=rows,
      in_specs=(rows, rows, rows, jax.P(expert_axis, None, ffn_axis, fsdp_axis),
                jax.P(expert_axis, ffn_axis, fsdp_axis)),
  )(x, weights, experts, gating, linear)
  return out[:num_tokens]


def _local_dense(x, weights, experts, gating, linear):
  """Every local expert on every gathered token; `experts` are local ids, others out of [0, E/n)."""
  num_local = gating.shape[0]
  experts = jnp.where((experts >= 0) & (experts < num_local), experts, num_local)  # negatives would wrap
  combine = jnp.zeros((x.shape[0], num_local), jnp.float32)
  combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights, mode="drop")  # [M, El]
  h = _geglu(jnp.einsum("MD,EGFD->MEGF", x, gating))  # [M, El, F]
  out = jnp.einsum("MEF,EFD->MED", h, linear)
  return jnp.einsum("MED,ME->MD", out.astype(jnp.float32), combine)


def _local_assignments(experts, num_local):
  """Assignments sorted by local expert, other devices' last: (order, sorted ids, local group sizes)."""
  flat = experts.reshape(-1)
  key = jnp.where((flat >= 0) & (flat < num_local), flat, num_local)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
  return order, key[order], sizes


def _local_ragged(x, weights, experts, gating, linear):
  num_rows, top_k = experts.shape
  num_local, _, ffn, dim = gating.shape
  order, sorted_experts, sizes = _local_assignments(experts, num_local)
  order = order[:num_rows * min(top_k, num_local)]  # the worst-case number of local assignments
  rows = x[order // top_k]  # [W, D]
  gate_up = jax.lax.ragged_dot(rows, gating.reshape(num_local, 2 * ffn, dim).transpose(0, 2, 1), sizes)
  out = jax.lax.ragged_dot(_geglu(gate_up.reshape(-1, 2, ffn)), linear, sizes)  # [W, D], 0 past the groups
  row_weight = jnp.where(sorted_experts[:order.shape[0]] < num_local, weights.reshape(-1)[order], 0.0)
  return jnp.zeros((num_rows, dim), jnp.float32).at[order // top_k].add(out.astype(jnp.float32)
                                                                          * row_weight[:, None])


def _local_grouped(x, weights, experts, gating, linear, tokens):
  """`_grouped` over the local experts, a chunk of tiles at a time: the tile layout has room for the worst
  case, but only chunks holding assignments gather their rows and compute."""
  num_rows, top_k = experts.shape
  num_local, dim = gating.shape[0], gating.shape[-1]
  tile = tile_size(tokens, top_k, num_local)  # the mean group size when the routing is balanced
  worst_tiles = -(-num_rows * min(top_k, num_local) // tile) + num_local
  chunk = min(worst_tiles, -(-tokens * top_k // tile) + num_local)  # tiles: the one-device buffer
  num_chunks = -(-worst_tiles // chunk)
  num_tiles = num_chunks * chunk
  order, sorted_experts, sizes = _local_assignments(experts, num_local)
  dest, tile_expert, used_tiles = _tile_layout(sorted_experts, _group_ranks(sorted_experts, sizes), sizes,
                                                 tile, num_tiles)
  # Per padded row: its token (num_rows for padding, read as zeros) and routing weight (0 for padding).
  row_token = _row_tokens(dest, order // top_k, num_tiles * tile, num_rows)
  row_weight = jnp.zeros((num_tiles * tile,), jnp.float32).at[dest].set(weights.reshape(-1)[order],
                                                                         mode="drop")

  def run_chunk(out, inputs):  # out [M, D] float32: the weighted sum so far
    index, token, weight, tile_expert = inputs  # [chunk*X], [chunk*X], [chunk]

    def compute(out):
      tiles = jnp.take(x, token, axis=0, mode="fill", fill_value=0).reshape(chunk, tile, dim)
      rows = _tile_ffn(tiles, tile_expert, gating, linear).reshape(chunk * tile, dim)
      return out.at[token].add(rows.astype(jnp.float32) * weight[:, None], mode="drop")

    return jax.lax.cond(index * chunk < used_tiles, compute, lambda out: out, out), None

  inputs = (jnp.arange(num_chunks), row_token.reshape(num_chunks, -1), row_weight.reshape(num_chunks, -1),
            tile_expert.reshape(num_chunks, chunk))
  # zeros_like(x): under shard_map, zeros varying over the same mesh axes as the chunks' sums.
  out, _ = jax.lax.scan(run_chunk, jnp.zeros_like(x, jnp.float32, shape=(num_rows, dim)), inputs)
  return out
