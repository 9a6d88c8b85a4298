"""Run by test_training.py in a fresh process with 2 simulated CPU devices: the reference for a run of
two processes with one device each. It trains on the same global batches (process i's rows are shard i
of 2 of the training data) with the same mesh shape, in one process.

  python _train_reference.py WORKDIR OUT.npz '{"train.num_steps": 3, ...}'

writes the per-step losses and the final parameters (flattened, in tree order) to OUT.npz.
"""

import json
import os
import pathlib
import sys

import device_env  # pylint: disable=wrong-import-position  (tests/, this script's folder)

os.environ.update(device_env.with_devices(2))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

from diffusiongemma import build
from diffusiongemma.build.config import load_config_file
from diffusiongemma.training import loop

ROOT = pathlib.Path(__file__).parent.parent


def main(workdir, out, overrides):
  assert jax.device_count() == 2, jax.devices()
  config = load_config_file(ROOT / "configs" / "tiny.py")
  for key, value in json.loads(overrides).items():
    section, field = key.split(".")
    config[section][field] = type(config[section][field])(value)
  setup = loop._Setup(build.train_task(config, workdir), workdir)  # pylint: disable=protected-access
  tokenizer = build.tokenizer(config, workdir, train_if_missing=True)  # it trains: a fresh workdir
  shards = [iter(build.dataset(config, workdir, "train", shard_index=i, shard_count=2, tok=tokenizer))
            for i in range(2)]
  state = setup.init_state()
  losses = []
  for _ in range(config.train.num_steps):
    parts = [next(shard) for shard in shards]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    state, metrics = setup.train_step(state, loop.to_global(batch, setup.batch_sharding))
    losses.append(float(metrics["loss"]))
  leaves = {f"param_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state.params))}
  np.savez(out, losses=np.array(losses), **leaves)
  print("OK")


if __name__ == "__main__":
  main(*sys.argv[1:])
