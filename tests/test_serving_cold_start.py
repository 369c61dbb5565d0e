"""No cold start: in a fresh process the first serving call is within 2x of the tenth.

Ratios, never absolute times. Each check runs in a fresh subprocess; the C++ serving
library is built (or found) by this process first, so no child measures a compile.
The children start jax's runtime before timing (`jax.devices()`): any process holding
tables as jax arrays, or loading an export, has done that already, and it is jax's
process start, not the lookup's. A check passes when one of three fresh processes shows
a ratio under 2 (the machine is shared: noise only ever slows a call down; a compile at
first use, tens to hundreds of milliseconds, fails both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import embedmesh as em
from embedmesh.serving import kernels, native
from embedmesh.serving.export import Dense, Ragged, export_serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOOKUP_CHILD = r"""
import json, time
import numpy as np
import jax
import embedmesh as em
from embedmesh.serving import kernels

jax.devices()  # jax's runtime: started by any process holding jax arrays
rng = np.random.default_rng(0)
V, D, B = 200000, 64, 4096
tcs = [em.TableConfig(V, D, combiner=c, name=f"t{i}") for i, c in enumerate(["sum", "mean", "sum"])]
fcs = {"ragged": em.FeatureConfig(tcs[0]), "sparse": em.FeatureConfig(tcs[1]),
       "dense": em.FeatureConfig(tcs[2])}
tables = {t: rng.standard_normal((V, D), dtype=np.float32) for t in tcs}

def batch():
    lengths = rng.poisson(20, B)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    n = int(splits[-1])
    rows = np.repeat(np.arange(B), lengths)
    pos = np.arange(n) - splits[:-1][rows]
    return {
        "ragged": em.RaggedTensor(rng.integers(0, V, n), splits),
        "sparse": em.SparseTensor(np.stack([rows, pos], 1), rng.integers(0, V, n),
                                  (B, int(lengths.max()))),
        "dense": rng.integers(0, V, (B, 5)),
    }

batches = [batch() for _ in range(12)]
times = []
for b in batches:
    t0 = time.perf_counter()
    out = em.serving_embedding_lookup(b, None, tables, fcs)
    for v in out.values():
        v.block_until_ready()
    times.append(time.perf_counter() - t0)
print(json.dumps({"backend": kernels.get_backend(), "times": times}))
"""

EXPORT_CHILD = r"""
import json, sys, time
import numpy as np
import jax
import embedmesh as em
from embedmesh.serving import load_serving

fn = load_serving(sys.argv[1])  # loads the tables and compiles the programs
# the tables read once, so the first call finds them in the caches as the tenth does
# (these are small: otherwise the first call measures cold rows, not a cold start)
for t in fn.tables.values():
    float(np.asarray(t).sum())
rng = np.random.default_rng(0)
B = 2048
times = []
for _ in range(12):
    lengths = rng.integers(0, 17, B)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = {"bag": em.RaggedTensor(rng.integers(0, 50000, int(splits[-1])).astype(np.int32),
                                     splits),
              "one": rng.integers(0, 50000, (B,)).astype(np.int32)}
    t0 = time.perf_counter()
    out = fn(inputs)
    np.asarray(out["score"])
    times.append(time.perf_counter() - t0)
print(json.dumps({"times": times}))
"""


def _first_over_tenth(script: str, *args: str, **env_vars: str) -> list[float]:
    """first / tenth call of up to three fresh processes (the next only if needed)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(env_vars)
    ratios = []
    for _ in range(3):
        res = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        report = json.loads(res.stdout.strip().splitlines()[-1])
        times = report["times"]
        assert report.get("backend", "native") == "native"
        ratios.append(times[0] / times[9])
        if ratios[-1] < 2.0:
            break
    return ratios


@pytest.mark.skipif(not kernels.HAVE_NATIVE, reason=f"no C++ serving kernels: {native.reason()}")
def test_first_lookup_in_a_fresh_process_is_not_slow():
    assert native.library() is not None  # built here, so that no child compiles it
    # One thread: a pool thread's start at the first call is ~0.1 ms on a quiet machine
    # but waits several ms for a core on an overloaded one (scheduling, not a cold start).
    # No output pool and a fixed malloc mmap threshold: every call then writes fresh
    # memory, so the ratio shows the one-time costs (compiles, imports, loading the
    # library), not the page faults of fresh outputs that, with the pool, only the first
    # calls pay (~0.45 ms per MB on this VM; glibc's adaptive threshold makes its first few
    # large allocations fresh mappings too; benchmarks/RESULTS_serving.md).
    ratios = _first_over_tenth(
        LOOKUP_CHILD,
        EMBEDMESH_SERVING_THREADS="1",
        EMBEDMESH_OUTPUT_POOL_MB="0",
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    assert min(ratios) < 2.0, f"first call / tenth call: {ratios}"


BAG = em.TableConfig(50000, 64, combiner="mean", name="bag")
ONE = em.TableConfig(50000, 32, name="one")


def _serve(inputs, tables, params):
    acts = em.serving_embedding_lookup(
        inputs, None, tables, {"bag": em.FeatureConfig(BAG), "one": em.FeatureConfig(ONE)}
    )
    h = jnp.concatenate([acts["bag"], acts["one"]], axis=1)
    return {"score": h @ params["w"]}


def test_first_call_of_a_loaded_export_is_not_slow(tmp_path):
    rng = np.random.default_rng(1)
    tables = {t: rng.standard_normal((50000, t.dim), dtype=np.float32) for t in (BAG, ONE)}
    export_serving(
        _serve,
        tmp_path,
        tables=tables,
        params={"w": rng.standard_normal((96, 1), dtype=np.float32)},
        input_signature={"bag": Ragged(nnz_per_example=16), "one": Dense()},
        batch_sizes=(2048,),
    )
    ratios = _first_over_tenth(EXPORT_CHILD, str(tmp_path))
    assert min(ratios) < 2.0, f"first call / tenth call: {ratios}"
