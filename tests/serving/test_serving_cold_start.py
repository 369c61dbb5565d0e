"""No cold start: in a fresh process the first serving call does no one-time work.

What made a first call slow was always one of: compiling (a C++ build, a numba or XLA
compile, tracing), importing a module, or starting a process (the compiler). The
children here record each of those while their first call runs: a Python audit hook
sees imports, code compiles, subprocesses and `dlopen`s; jax's monitoring listeners see
every trace and compile. None may happen, except loading the installed C++ library
(milliseconds). Nothing is timed: the timings live in `benchmarks/train/cold_start.py` and
`benchmarks/serving/RESULTS.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from paths import ROOT

import embedmesh as em
from embedmesh import _native
from embedmesh.serving import kernels, native
from embedmesh.serving.export import Dense, Ragged, export_serving

# Installed in each child before its first call; FIRST_CALL() wraps the call and prints
# what it saw as the last line of output (JSON).
RECORDER = r"""
import json, sys
import jax

_seen = {"events": [], "jax": []}
_on = [False]
_WATCHED = ("import", "compile", "exec", "subprocess.Popen", "os.system", "os.exec",
            "os.posix_spawn", "os.fork", "ctypes.dlopen")

def _audit(name, args):
    if _on[0] and name in _WATCHED:
        _seen["events"].append([name, str(args[0])[:200] if args else ""])

sys.addaudithook(_audit)
jax.monitoring.register_event_listener(
    lambda event, **kw: _on[0] and _seen["jax"].append(event))
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _on[0] and _seen["jax"].append(event))

def FIRST_CALL(fn, report=None):
    _on[0] = True
    try:
        out = fn()
        jax.block_until_ready(out)
    finally:
        _on[0] = False
    print(json.dumps({**_seen, **(report or {})}))
    return out
"""

LOOKUP_CHILD = (
    RECORDER
    + r"""
import numpy as np
import embedmesh as em
from embedmesh.serving import kernels

jax.devices()  # jax's runtime: started by any process holding jax arrays
rng = np.random.default_rng(0)
V, D, B = 5000, 64, 256
tcs = [em.TableConfig(V, D, combiner=c, name=f"t{i}") for i, c in enumerate(["sum", "mean", "sum"])]
fcs = {"ragged": em.FeatureConfig(tcs[0]), "sparse": em.FeatureConfig(tcs[1]),
       "dense": em.FeatureConfig(tcs[2]), "weighted": em.FeatureConfig(tcs[1])}
tables = {t: rng.standard_normal((V, D), dtype=np.float32) for t in tcs}
lengths = rng.poisson(20, B)
splits = np.concatenate([[0], np.cumsum(lengths)])
n = int(splits[-1])
rows = np.repeat(np.arange(B), lengths)
pos = np.arange(n) - splits[:-1][rows]
batch = {
    "ragged": em.RaggedTensor(rng.integers(0, V, n), splits),
    "sparse": em.SparseTensor(np.stack([rows, pos], 1), rng.integers(0, V, n),
                              (B, int(lengths.max()))),
    "dense": rng.integers(0, V, (B, 5)),
    "weighted": em.RaggedTensor(rng.integers(0, V, n), splits),
}
weights = {"weighted": em.RaggedTensor(rng.random(n, dtype=np.float32), splits)}
FIRST_CALL(lambda: em.serving_embedding_lookup(batch, weights, tables, fcs),
           {"backend": kernels.get_backend()})
"""
)

EXPORT_CHILD = (
    RECORDER
    + r"""
import numpy as np
import embedmesh as em
from embedmesh.serving import load_serving

fn = load_serving(sys.argv[1])  # loads the tables and compiles the programs
rng = np.random.default_rng(0)
B = 2048
lengths = rng.integers(0, 17, B)
splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
inputs = {"bag": em.RaggedTensor(rng.integers(0, 50000, int(splits[-1])).astype(np.int32),
                                 splits),
          "one": rng.integers(0, 50000, (B,)).astype(np.int32)}
FIRST_CALL(lambda: fn(inputs)["score"])
"""
)


def _first_call_report(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    res = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _one_time_work(report: dict, allowed_dlopen: str = "") -> list:
    """What the first call did that a later call would not (empty when nothing)."""
    work = [e for e in report["events"] if not (e[0] == "ctypes.dlopen" and e[1] == allowed_dlopen)]
    return work + [["jax", e] for e in report["jax"]]


def test_recorder_sees_each_kind_of_one_time_work():
    """The check can fail: a first call that imports, starts the compiler, loads a
    library, and traces and compiles with jax is reported for each of them."""
    script = (
        RECORDER
        + r"""
import ctypes.util, subprocess
libm = ctypes.util.find_library("m")
def first():
    import wave  # noqa: F401 - an import at first call
    subprocess.run([sys.executable, "-c", ""], check=True)
    ctypes.CDLL(libm)
    return jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0))
FIRST_CALL(first)
"""
    )
    report = _first_call_report(script)
    kinds = {e[0] for e in _one_time_work(report)}
    assert {"import", "subprocess.Popen", "ctypes.dlopen", "jax"} <= kinds, report
    assert any("wave" in e[1] for e in report["events"] if e[0] == "import"), report
    assert any("compile" in e for e in report["jax"]), report["jax"]


@pytest.mark.skipif(not kernels.HAVE_NATIVE, reason=f"no C++ serving kernels: {native.reason()}")
def test_first_lookup_in_a_fresh_process_does_no_one_time_work():
    path, why = _native._installed(
        "serving", _native.selected_variant(), _native.LIBRARIES["serving"].digest()
    )
    assert path is not None, (
        f"the installed serving library cannot be used ({why}): the first lookup would "
        "build it (reinstall: pip install -e .)"
    )
    report = _first_call_report(LOOKUP_CHILD)
    assert report["backend"] == "native"
    assert _one_time_work(report, allowed_dlopen=path) == [], report


BAG = em.TableConfig(50000, 64, combiner="mean", name="bag")
ONE = em.TableConfig(50000, 32, name="one")


def _serve(inputs, tables, params):
    acts = em.serving_embedding_lookup(
        inputs, None, tables, {"bag": em.FeatureConfig(BAG), "one": em.FeatureConfig(ONE)}
    )
    h = jnp.concatenate([acts["bag"], acts["one"]], axis=1)
    return {"score": h @ params["w"]}


def test_first_call_of_a_loaded_export_does_no_one_time_work(tmp_path):
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
    report = _first_call_report(EXPORT_CHILD, str(tmp_path))
    assert _one_time_work(report) == [], report
