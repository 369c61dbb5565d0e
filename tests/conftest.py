"""Test-wide setup: 8 virtual CPU devices for multi-device tests (set before jax loads)."""

import importlib.metadata
import os
import sys

import hypothesis
import pytest

# The helpers (support/) and every layer's test modules importable by bare name
# (support/paths.py says why)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from paths import import_path

for _folder in reversed(import_path()):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

# XLA's CPU compiler at its cheapest: the suite's programs are small and compiled once
# each, so compiling dominates. Optimisation level 0 (-20% CPU measured on
# test_data_parallel) and the loop emitters instead of the fusion emitters (test_engine
# with test_packed_rows: 92-101 -> 73 CPU-s, 2026-12-07; LLVM without its expensive
# passes gained nothing there). Only on jaxlib 0.10, which has the flag: 0.12.1 does not
# (an unknown flag aborts XLA: CI's Python 3.12 run, 2026-12-07). The loop emitters
# contract a multiply and an add into one rounding:
# the one test that compares XLA's float32 with the serving kernels' bit for bit runs in a
# process without that flag (test_serving_quantized). Children (multi-process workers,
# fresh-process checks) get these flags too, with their own device count.
_LOOP_EMITTERS = (
    " --xla_cpu_use_fusion_emitters=false"
    if importlib.metadata.version("jaxlib").startswith("0.10.")
    else ""
)
os.environ.setdefault(
    "EMBEDMESH_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0" + _LOOP_EMITTERS
)
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 " + os.environ["EMBEDMESH_TEST_XLA_FLAGS"],
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No test times anything, Hypothesis's per-example deadline (200 ms) included: under CI's
# load an example of a string test took 316 ms once and failed the run (the Python 3.12
# subset, 2026-12-06). A test's own settings may still set one.
hypothesis.settings.register_profile("embedmesh", deadline=None)
hypothesis.settings.load_profile("embedmesh")

# JAX's persistent compilation cache, fresh for each run (never kept between runs): the
# tests build the same small programs again and again (every MeshEmbedding, every
# fresh jit of the same body, every child process), and XLA compiled each one anew.
# A program is found by the hash of its HLO, its compile options and XLA's flags, so a
# hit is the executable XLA would compile again: nothing is tested differently.
# test_engine.py on 2 workers: 164 -> 88 CPU-seconds. Each xdist worker has its own
# directory (a cache file is written in place: a worker must not read one another is
# writing); its children (multi-process workers, fresh-process checks) share it. One
# directory for all the workers was tried (2026-12-07: tests/checkpoint, tests/api and
# test_coordinator_death.py on 2 workers, 258 -> 264 CPU-s): the files share few programs.
# One set by whoever runs the tests (not by this file) is kept.
if "EMBEDMESH_TEST_JAX_CACHE" in os.environ or "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_root = os.environ.get("EMBEDMESH_TEST_JAX_CACHE")
    if _cache_root is None:  # the first process of the run: the controller, or -n 0
        _cache_root = tempfile.mkdtemp(prefix="embedmesh-tests-jax-cache-")
        os.environ["EMBEDMESH_TEST_JAX_CACHE"] = _cache_root
        atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
    _worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_cache_root, _worker)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# embedmesh's own default cache (under ~/.cache/embedmesh) is never used by the tests: the
# directory above is set whenever it applies, and this keeps a child process given an
# environment of its own (without JAX_COMPILATION_CACHE_DIR) out of the user's home too.
os.environ.setdefault("EMBEDMESH_COMPILATION_CACHE", "0")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output buffer of the serving kernels starts as all-ones bytes (NaN for every
    float dtype) until a kernel writes it: an element a kernel forgets shows."""
    import numpy as np

    from embedmesh.serving import pool

    real = pool._pool.empty_at  # every output buffer comes from here

    def poisoned(shape, dtype):
        out, addr = real(shape, dtype)
        out.view(np.uint8)[...] = 0xFF
        return out, addr

    monkeypatch.setattr(pool._pool, "empty_at", poisoned)


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


# Files whose tests take 20-55 s each (real processes, the scripts' smoke runs, the
# README's blocks, TensorFlow): collected first, so that xdist's worksteal, which hands
# each worker a contiguous share and lets an idle one steal the end of another's, ends
# the run on short tests, not on one of these with the other worker idle. Each file's
# own order is kept.
LONG_FIRST = (
    "processes/",
    "project/test_tpu_script.py",
    "project/test_gpu_script.py",
    "project/test_readme.py",
    "project/test_movielens.py",
    "serving/test_saved_model",
    "device/test_table_wise.py",
    "device/test_pooled.py",
)


def pytest_collection_modifyitems(config, items):
    def long(item) -> bool:
        path = item.nodeid.replace(os.sep, "/")
        return any(path.startswith("tests/" + prefix) for prefix in LONG_FIRST)

    items.sort(key=lambda item: not long(item))  # stable: the long files first
