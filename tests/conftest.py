"""Test-wide setup: 8 virtual CPU devices for multi-device tests (set before jax loads)."""

import os

# XLA's backend at optimisation level 0: the suite's programs are small and compiled
# once each, so compiling dominates (-20% CPU measured on test_data_parallel).
# Children (multi-process workers, fresh-process checks) get these flags too, with their
# own device count: float results can differ by an ulp between optimisation levels.
os.environ.setdefault("EMBEDMESH_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 " + os.environ["EMBEDMESH_TEST_XLA_FLAGS"],
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
