"""Run by test_multihost.py in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=D: the
latest checkpoint of WORKDIR restored onto this process's mesh (the config's `mesh` overrides) must hold
exactly the saved parameters, each array placed on the new mesh; then training goes on to num_steps.

  python _resume_on_mesh.py WORKDIR '{"mesh.fsdp": 2, "train.num_steps": 3, ...}'
"""

import json
import pathlib
import sys

from absl import logging
import jax
import numpy as np

from diffusiongemma import build
from diffusiongemma import training
from diffusiongemma.build.config import load_config_file
from diffusiongemma.training import checkpoint as ckpt_lib
from diffusiongemma.training import loop

ROOT = pathlib.Path(__file__).parent.parent


def main(workdir, overrides):
  config = load_config_file(ROOT / "configs" / "tiny.py")
  for key, value in json.loads(overrides).items():
    section, field = key.split(".")
    config[section][field] = value
  setup = loop._Setup(build.train_task(config, workdir), workdir)  # pylint: disable=protected-access
  checkpointer = ckpt_lib.Checkpointer(workdir, async_save=False)
  step = checkpointer.latest_step()
  state, _, _ = setup.restore(checkpointer, step)
  checkpointer.close()
  saved, _ = training.load_params(workdir, step=step)  # onto one device, as saved
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(saved), strict=True):
    assert a.sharding.mesh.shape == setup.mesh.shape, (jax.tree_util.keystr(path), a.sharding)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  print(f"restored step {step} equal on mesh {dict(setup.mesh.shape)}", flush=True)
  build.train(config, workdir)


if __name__ == "__main__":
  logging.use_absl_handler()
  logging.set_verbosity(logging.INFO)  # the loop's log lines (the reshard), as scripts/train.py shows them
  main(*sys.argv[1:])
