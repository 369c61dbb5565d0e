"""Test-wide setup: 8 virtual CPU devices for multi-device tests (set before jax loads)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
