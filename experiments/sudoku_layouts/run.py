"""Exploratory Sudoku runs that chose the recipe's layout: how fast a small DiffusionGemma starts to learn
the puzzle under several token layouts, objectives and initialisations (a plain training loop on the
library's model, one core of a shared machine; single short runs, read them as such).

  python experiments/sudoku_layouts/run.py --layout=plain --theta_period=9 --budget=900 --out=OUT.jsonl

Layouts: `plain` (prompt = BOS + the 81 cells, canvas = the 81 digits: the recipe), `interleaved`
(canvas = cell-id token, digit, ... with the ids held), `rows` (a row token before each row), `plain_id`
(prompt tokens name their cell and value), `cells` (every canvas token names its cell, no prompt).
Needs a pool and a validation set (projects.sudoku.data.generate_many) saved as .npz (--pool).
The logs beside this file are the runs projects/sudoku/README.md cites.
"""
import argparse, json, time, os, sys, functools
import numpy as np
import jax, jax.numpy as jnp
import optax
import flax.linen as nn
from diffusiongemma.model import DiffusionGemma, ModelConfig
from projects.sudoku import data as sudoku

p = argparse.ArgumentParser()
p.add_argument("--layout", default="interleaved")  # interleaved | plain
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--head_dim", type=int, default=32)
p.add_argument("--ffn", type=int, default=256)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--steps", type=int, default=2000)
p.add_argument("--budget", type=float, default=1200)
p.add_argument("--weight", default="flat")  # flat | elbo
p.add_argument("--min_clues", type=int, default=30)
p.add_argument("--max_clues", type=int, default=45)
p.add_argument("--pool", default="pool_30_8192.npz")
p.add_argument("--validation", default="val_36_40.npz")
p.add_argument("--theta", type=float, default=10000.0)
p.add_argument("--bf16", action="store_true")
p.add_argument("--eval_every", type=int, default=250)
p.add_argument("--out", default="run.jsonl")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--tmax", type=float, default=1.0)
p.add_argument("--theta_period", type=float, default=0)
p.add_argument("--struct_init", action="store_true")
p.add_argument("--hold_clues", action="store_true")
p.add_argument("--qk_init", type=float, default=1.0)
args = p.parse_args()

PAD, EOS, BOS = 0, 1, 2
DIG = 3  # digit d -> 3 + d (4..12)
IDS = 13  # cell c -> 13 + c (13..93)
MASK = 94
V = 96
N = 81
if args.layout == "cells":
  V = 16 + 810 + 6
  MASK = V - 1  # unused: each cell has its own mask token(c, 0)
if args.layout == "cells":
  V = 16 + 810 + 6
  MASK = V - 1  # unused: each cell has its own mask token(c, 0)
if args.layout == "plain_id":
  V = 16 + 810 + 6  # digits/specials, then token(cell, value) for the prompt
  MASK = V - 1

pool = np.load(args.pool)
P_puz, P_sol = pool["puzzles"], pool["solutions"]
val = np.load(args.validation)
V_puz, V_sol = val["puzzles"][:100], val["solutions"][:100]

interleaved = args.layout == "interleaved"
CELLS = args.layout == "cells"
CELL_MASK_NP = (16 + 10 * np.arange(N)).astype(np.int32)[None]
CELL_MASK = jnp.asarray(CELL_MASK_NP)
NEVER_CELLS = jnp.zeros((832,)).at[16 + 10 * np.arange(N)].set(-1e9) if CELLS else 0.0  # no mask is a target
ROWS = args.layout == "rows"
C = 2 * N if interleaved else (90 if ROWS else N)
import math
if args.theta_period:
  args.theta = (args.theta_period / (2 * math.pi)) ** (args.head_dim / 2)
  print("theta", args.theta)
DIGPOS = np.arange(1, C, 2) if interleaved else (np.array([10 * (c // 9) + 1 + c % 9 for c in range(N)]) if ROWS else np.arange(N))


def layout(puz, sol):
  """-> canvas clean [B,C], given [B,C] bool, prompt [B,P]"""
  b = puz.shape[0]
  if interleaved:
    clean = np.zeros((b, C), np.int32)
    clean[:, 0::2] = IDS + np.arange(N)
    clean[:, 1::2] = sol + DIG
    given = np.zeros((b, C), bool)
    given[:, 0::2] = True
    given[:, 1::2] = puz > 0
    prompt = np.full((b, 1), BOS, np.int32)
  elif ROWS:
    clean = np.zeros((b, C), np.int32)
    clean[:, 0::10] = IDS + np.arange(9)
    clean[:, DIGPOS] = sol + DIG
    given = np.zeros((b, C), bool)
    given[:, 0::10] = True
    given[:, DIGPOS] = puz > 0
    prompt = np.full((b, 1), BOS, np.int32)
  elif args.layout == "cells":
    clean = (16 + 10 * np.arange(N)[None] + sol).astype(np.int32)
    given = (puz > 0) if args.hold_clues else np.zeros_like(puz, bool)
    prompt = np.full((b, 1), BOS, np.int32)
  elif args.layout == "plain_id":
    clean = (sol + DIG).astype(np.int32)
    given = (puz > 0) if args.hold_clues else np.zeros_like(puz, bool)
    prompt = np.concatenate([np.full((b, 1), BOS), 16 + 10 * np.arange(N)[None] + puz], 1).astype(np.int32)
  else:
    clean = (sol + DIG).astype(np.int32)
    given = (puz > 0) if args.hold_clues else np.zeros_like(puz, bool)
    prompt = np.concatenate([np.full((b, 1), BOS), np.where(puz > 0, puz + DIG, 3)], 1).astype(np.int32)
  return clean, given, prompt


def batch_sym(rng, puz, sol):
  out_p, out_s = [], []
  for i in range(puz.shape[0]):
    cells, dmap = sudoku.random_symmetry(rng)
    out_p.append(dmap[puz[i][cells]]); out_s.append(dmap[sol[i][cells]])
  return np.stack(out_p), np.stack(out_s)


def train_batch(rng):
  idx = rng.integers(0, len(P_puz), args.batch)
  puz, sol = batch_sym(rng, P_puz[idx], P_sol[idx])
  puz = np.stack([sudoku.reveal(puz[i], sol[i], int(rng.integers(args.min_clues, args.max_clues + 1)), rng)
                  for i in range(args.batch)])
  return layout(puz, sol)


cfg = ModelConfig(vocab_size=V, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                  num_kv_heads=max(1, args.heads // 2), head_dim=args.head_dim, num_full_kv_heads=max(1, args.heads // 2),
                  full_head_dim=args.head_dim, sliding_window=512, rope_theta=args.theta, full_rope_theta=args.theta,
                  intermediate_size=args.ffn, num_experts=1, top_k=1, moe_intermediate_size=64, canvas_length=C,
                  max_positions=512, moe_impl="dense", final_logit_softcap=30.0,
                  dtype="bfloat16" if args.bf16 else "float32")
model = DiffusionGemma(cfg)
params = jax.jit(lambda r: nn.unbox(model.init(r, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, C), jnp.int32))))(jax.random.key(args.seed))
if args.struct_init and args.layout in ("plain_id", "cells"):
  emb = np.array(params["params"]["embedder"]["input_embedding"])
  r = np.random.default_rng(123)
  sd = emb.std()
  R, K, X, Dg = (r.normal(0, sd, (10, emb.shape[1])) for _ in range(4))
  for c in range(N):
    for v in range(10):
      emb[16 + 10 * c + v] = (R[c // 9] + K[c % 9] + X[3 * (c // 27) + (c % 9) // 3] + Dg[v]) / 2
  for v in range(1, 10):
    emb[DIG + v] = Dg[v]  # the canvas digit is the prompt token's digit component: copying is the identity
  params["params"]["embedder"]["input_embedding"] = jnp.asarray(emb)
elif args.struct_init:
  emb = np.array(params["params"]["embedder"]["input_embedding"])
  r = np.random.default_rng(123)
  sd = emb.std()
  R, K, X = (r.normal(0, sd, (9, emb.shape[1])) for _ in range(3))
  for c in range(N):
    emb[IDS + c] = (R[c // 9] + K[c % 9] + X[3 * (c // 27) + (c % 9) // 3]) / np.sqrt(3)
  params["params"]["embedder"]["input_embedding"] = jnp.asarray(emb)
if args.qk_init != 1.0:
  def _scale(path, x):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return x * args.qk_init if ("query_norm" in name or "key_norm" in name) else x
  params = jax.tree_util.tree_map_with_path(_scale, params)
  print("qk norm scales set to", args.qk_init)
nparams = sum(x.size for x in jax.tree.leaves(params))
print("params", nparams, flush=True)

sched = optax.warmup_cosine_decay_schedule(0, args.lr, 100, args.steps, args.lr * 0.1)
opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
opt_state = opt.init(params)


def forward(params, prompt, canvas):
  return model.apply(params, prompt, canvas)


def loss_fn(params, prompt, clean, given, rng):
  b = clean.shape[0]
  k1, k2 = jax.random.split(rng)
  t = jax.random.uniform(k1, (b, 1), minval=1e-3, maxval=args.tmax)
  masked = (jax.random.uniform(k2, clean.shape) < t) & ~given
  canvas = jnp.where(masked, CELL_MASK if CELLS else MASK, clean)
  logits = forward(params, prompt, canvas)
  logits = logits.at[..., MASK].set(-1e9)
  if CELLS:
    logits = logits + NEVER_CELLS
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, clean)
  m = masked.astype(jnp.float32)
  if args.weight == "elbo":
    loss = (ce * m / t).sum() / (~given).sum()
  else:
    loss = (ce * m).sum() / jnp.maximum(m.sum(), 1)
  acc = ((logits.argmax(-1) == clean) * m).sum() / jnp.maximum(m.sum(), 1)
  return loss, acc


@jax.jit
def train_step(params, opt_state, prompt, clean, given, rng):
  (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, prompt, clean, given, rng)
  upd, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, upd), opt_state, loss, acc


@jax.jit
def logits_at(params, prompt, canvas):
  lg = forward(params, prompt, canvas)
  lg = lg.at[..., MASK].set(-1e9)
  return lg + NEVER_CELLS if CELLS else lg


def solve(params, puz, sol, rule="conf", thr=0.9, max_passes=81):
  clean, given, prompt = layout(puz, sol)
  if args.layout == "plain":
    given = puz > 0  # the clues are held at inference whether or not training held them
  b = puz.shape[0]
  canvas = np.where(given, clean, CELL_MASK_NP if CELLS else MASK)
  passes = np.zeros(b, int)
  active = np.ones(b, bool)
  for _ in range(max_passes):
    open_ = (canvas == CELL_MASK_NP) if CELLS else (canvas == MASK)
    active = open_.any(1)
    if not active.any():
      break
    lg = np.asarray(logits_at(params, prompt, canvas))
    pr = jax.nn.softmax(lg, -1)
    pr = np.asarray(pr)
    top2 = np.sort(pr, -1)[..., -2:]
    conf = top2[..., 1] if rule == "conf" else top2[..., 1] - top2[..., 0]
    conf = np.where(open_, conf, -1)
    acc = (conf >= thr) & open_
    best = conf.argmax(1)
    acc[np.arange(b), best] |= open_[np.arange(b), best]
    pred = lg.argmax(-1)
    canvas = np.where(acc, pred, canvas)
    passes += active
  digits = ((canvas - 16) % 10) * (canvas >= 16) if CELLS else canvas[:, DIGPOS] - DIG
  ok = sudoku.check_solution(puz, np.where((digits >= 1) & (digits <= 9), digits, 0))
  return ok.mean(), passes.mean()


def one_shot_acc(params, puz, sol):
  clean, given, prompt = layout(puz, sol)
  if args.layout == "plain":
    given = puz > 0
  canvas = np.where(given, clean, CELL_MASK_NP if CELLS else MASK)
  lg = np.asarray(logits_at(params, prompt, canvas))
  m = np.zeros_like(given)
  m[:, DIGPOS] = puz == 0
  return float(((lg.argmax(-1) == clean) & m).sum() / m.sum())


rng = np.random.default_rng(args.seed)
key = jax.random.key(args.seed + 1)
log = open(args.out, "w")
t0 = time.time()
train_time = 0.0
for step in range(1, args.steps + 1):
  clean, given, prompt = train_batch(rng)
  ts = time.time()
  params, opt_state, loss, acc = train_step(params, opt_state, prompt, clean, given, jax.random.fold_in(key, step))
  if step % 50 == 0 or step == 1:
    loss = float(loss)
    train_time += time.time() - ts
    print(f"step {step} loss {loss:.4f} acc {float(acc):.4f} elapsed {time.time()-t0:.0f}s", flush=True)
  if step % args.eval_every == 0 or step == args.steps or time.time() - t0 > args.budget:
    te = time.time()
    osa = one_shot_acc(params, V_puz, V_sol)
    r = {"step": step, "elapsed": time.time() - t0, "loss": float(loss), "one_shot_acc": osa}
    for rule, thr in (("conf", 0.9), ("margin", 0.9), ("margin", 0.5)):
      s, ps = solve(params, V_puz, V_sol, rule, thr)
      r[f"{rule}{thr}"] = [float(s), float(ps)]
    r["eval_s"] = time.time() - te
    print(json.dumps(r), flush=True)
    log.write(json.dumps(r) + "\n"); log.flush()
    t0 += time.time() - te  # eval not counted
    if time.time() - t0 > args.budget:
      break
import pickle
pickle.dump(jax.device_get(params), open(args.out.replace(".jsonl", ".pkl"), "wb"))
