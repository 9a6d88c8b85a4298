"""The environment of a test's subprocess that simulates `count` CPU devices: this process's, with the suite's
other XLA flags kept (tests/conftest.py sets them before JAX starts)."""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def with_devices(count: int, *extra_flags: str) -> dict[str, str]:
  """os.environ on CPU with `count` simulated devices and `extra_flags` added to XLA_FLAGS."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
  flags += [f"{DEVICE_COUNT}={count}", *extra_flags]
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
