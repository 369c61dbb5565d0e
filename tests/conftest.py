"""Test-wide setup: 8 virtual CPU devices for multi-device tests (set before jax loads)."""

import os

import pytest

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


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output buffer of the serving kernels starts as all-ones bytes (NaN for every
    float dtype) until a kernel writes it: an element a kernel forgets shows."""
    import numpy as np

    from embedmesh.serving import kernels

    real = kernels._pool.empty_at  # every output buffer comes from here

    def poisoned(shape, dtype):
        out, addr = real(shape, dtype)
        out.view(np.uint8)[...] = 0xFF
        return out, addr

    monkeypatch.setattr(kernels._pool, "empty_at", poisoned)


@pytest.fixture
def native_poisoned(poisoned_outputs):
    """The C++ serving kernels as the backend, outputs poisoned, and every request shared
    over the threads it is given however small (the tests' requests are)."""
    from embedmesh.serving import kernels, native

    previous = kernels.set_backend("native")
    min_entries = native.library().EmServingSetMinEntriesPerThread(1)
    yield
    native.library().EmServingSetMinEntriesPerThread(min_entries)
    kernels.set_backend(previous)
