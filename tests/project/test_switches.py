"""Each environment switch does what README says, in a fresh process with it set.

Switches are read once (`embedmesh._runtime`), so every case runs in a
subprocess with the variable in its environment and reports what it saw as
one JSON line.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from process_helpers import run_json

HAVE_NUMBA = importlib.util.find_spec("numba") is not None


NUMBA_MODULES = 'any(m.split(".")[0] in ("numba", "llvmlite") for m in sys.modules)'


IMPORT = f"""
import json, sys
import embedmesh
print(json.dumps({{"numba": {NUMBA_MODULES},
                  "compiled": [m for m in sys.modules if m.startswith("embedmesh.")
                               and m.endswith(("numba_backend", "numba_kernels"))]}}))
"""

# Several switches' checks in one fresh process (a process costs seconds of imports): each
# part runs in turn, in a namespace of its own, and reports its last stdout line; the
# process prints {part: what it saw}. Parts that patch a module only add recording.
PARTS = """
import contextlib, io, json
seen = {}
for name, code in PARTS:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, name, "exec"), {"__name__": name})
    seen[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
print(json.dumps(seen))
"""


def run_parts(parts: dict, env: dict, *args) -> dict:
    """`parts` ({name: code}) run in this order in one process with `env`."""
    return run_json(f"PARTS = {list(parts.items())!r}\n" + PARTS, env, *args)


def test_import_embedmesh_loads_no_numba_and_builds_no_kernels(default_run):
    assert default_run["import"] == {"numba": False, "compiled": []}


# Random features of every kind through one preprocessing and one serving call;
# the arrays are saved to argv[1].
WORKLOAD = f"""
import json, sys
import numpy as np
import embedmesh as em
from embedmesh.host import preprocess
from embedmesh.serving import kernels

rng = np.random.default_rng(7)
ta = em.TableConfig(50, 8, combiner="mean", name="a")
tb = em.TableConfig(30, 4, combiner="sqrtn", name="b")
fc = {{"r": em.FeatureConfig(ta), "s": em.FeatureConfig(tb), "d": em.FeatureConfig(tb),
      "q": em.FeatureConfig(ta, max_sequence_length=3)}}
B = 16
lengths = rng.integers(0, 6, B)
splits = np.concatenate([[0], np.cumsum(lengths)])
n = int(splits[-1])
rows = np.repeat(np.arange(B), lengths)
cols = np.concatenate([np.sort(rng.choice(6, k, replace=False)) for k in lengths])
inputs = {{"r": em.RaggedTensor(rng.integers(0, 50, n), splits),
          "s": em.SparseTensor(np.stack([rows, cols], 1), rng.integers(0, 30, n), (B, 6)),
          "d": rng.integers(0, 30, (B, 2)),
          "q": em.RaggedTensor(rng.integers(0, 50, n), splits)}}
weights = {{"r": em.RaggedTensor(rng.uniform(0.5, 2, n).astype(np.float32), splits),
           "s": em.SparseTensor(np.stack([rows, cols], 1),
                                rng.uniform(0.5, 2, n).astype(np.float32), (B, 6)),
           "d": None, "q": None}}
tables = {{ta: rng.standard_normal((50, 8)).astype(np.float32),
          tb: rng.standard_normal((30, 4)).astype(np.float32)}}
plan = em.plan_stacking(fc, 4)
csr, _ = em.preprocess_features(inputs, weights, plan, num_devices_local=4)
served = em.serving_embedding_lookup(inputs, weights, tables, fc)
seen = {{"numba": {NUMBA_MODULES}, "preprocess": preprocess.auto_backend()}}
out = {{}}
for stack, t in csr.items():
    for field in t._ARRAYS:
        out[f"pre/{{stack}}/{{field}}"] = np.asarray(getattr(t, field))
for k, v in served.items():
    out[f"serve/{{k}}"] = np.asarray(v)
np.savez(sys.argv[1], **out)
seen.update(preprocess_numba=preprocess.numba_available(), serving=kernels.get_backend())
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def numpy_run(tmp_path_factory):
    """WORKLOAD with numba and the C++ serving kernels off (one process for the two
    tests that compare with it): (what it saw, its arrays' file)."""
    out = tmp_path_factory.mktemp("switches") / "off.npz"
    # EMBEDMESH_SERVING_NATIVE=0 / EMBEDMESH_PREPROCESS_NATIVE=0: the C++ kernels of
    # serving and preprocessing off too (they need no numba)
    seen = run_json(WORKLOAD, {"EMBEDMESH_NUMBA": "0", **NO_CC}, out)
    return seen, out


NO_CC = {"EMBEDMESH_SERVING_NATIVE": "0", "EMBEDMESH_PREPROCESS_NATIVE": "0"}


def test_numba_off_makes_preprocessing_and_serving_use_numpy(numpy_run, tmp_path):
    off, off_file = numpy_run
    assert off == {
        "numba": False,
        "preprocess": "numpy",
        "preprocess_numba": False,
        "serving": "numpy",
    }
    if not HAVE_NUMBA:
        pytest.skip("numba is not installed: no numba run to compare with")
    on = run_json(WORKLOAD, {"EMBEDMESH_NUMBA": "1", **NO_CC}, tmp_path / "on.npz")
    assert on == {
        "numba": True,
        "preprocess": "numba",
        "preprocess_numba": True,
        "serving": "numba",
    }
    a, b = np.load(off_file), np.load(tmp_path / "on.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 6
    for k in a.files:
        if k.startswith("pre/"):  # the backends are bit-identical
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:  # mean/sqrtn denominators may be summed in another order
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    """WORKLOAD with numba off (the C++ kernels on), then the 0 MB output pool's check
    (test_output_pool_mb) in the same process: ({part: what it saw}, the arrays' file)."""
    out = tmp_path_factory.mktemp("switches") / "native.npz"
    env = {"EMBEDMESH_NUMBA": "0", "EMBEDMESH_OUTPUT_POOL_MB": "0"}
    return run_parts({"workload": WORKLOAD, "output_pool": OUTPUT_POOL}, env, out), out


def test_serving_native_is_the_default_and_needs_no_numba(numpy_run, native_run):
    from embedmesh.serving import kernels, native

    if not kernels.HAVE_NATIVE:
        pytest.skip(f"no C++ serving kernels here: {native.reason()}")
    from embedmesh.host import preprocess

    pre = "native" if preprocess.native_available() else "numpy"
    seen, native_file = native_run
    assert seen["workload"] == {
        "numba": False,
        "preprocess": pre,
        "preprocess_numba": False,
        "serving": "native",
    }
    ref, ref_file = numpy_run  # the same workload, the C++ kernels off
    assert ref["serving"] == "numpy"
    a, b = np.load(native_file), np.load(ref_file)
    for k in a.files:
        if k.startswith("pre/"):  # preprocessing's backends are bit-identical
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """One process with no switch set but the output pool's size (4 MB: test_output_pool_mb;
    its first request, before any other): `import embedmesh` alone (first), WORKLOAD, a
    device op's lowering and the serving pool's spin."""
    out = tmp_path_factory.mktemp("switches") / "default.npz"
    parts = {
        "import": IMPORT,
        "output_pool": OUTPUT_POOL,
        "workload": WORKLOAD.replace("preprocess.numba_available()", "None"),
        "cpu_kernels": CPU_KERNELS,
        "spin": SERVING_SPIN,
    }
    return run_parts(parts, {"EMBEDMESH_OUTPUT_POOL_MB": "4"}, out)


def test_preprocessing_and_serving_import_no_numba_by_default(default_run):
    """No switch set: preprocessing and serving run their C++ kernels, and numba is
    never imported, though it is installed (EMBEDMESH_PREPROCESS_NATIVE=0 is the
    numba run above)."""
    from embedmesh.host import preprocess
    from embedmesh.serving import kernels, native

    if not preprocess.native_available() or not kernels.HAVE_NATIVE:
        pytest.skip(f"no C++ kernels here: {native.reason()}")
    assert default_run["workload"] == {
        "numba": False,
        "preprocess": "native",
        "preprocess_numba": None,
        "serving": "native",
    }


SERVING_THREADS = """
import json
import numpy as np
import embedmesh as em
from embedmesh.serving import lookup
from embedmesh.serving.backends import native as native_backend

used = []
real = lookup._run_on_threads
lookup._run_on_threads = lambda runs, threads: used.append(threads) or real(runs, threads)
real_run = native_backend.run_native
native_backend.run_native = lambda calls, threads: used.append(threads) or real_run(calls, threads)
real_tasks = native_backend.run_tasks
native_backend.run_tasks = lambda words, threads: used.append(threads) or real_tasks(words, threads)
class Request(native_backend.NativeRequest):
    def __init__(self, n, threads):
        used.append(threads)
        super().__init__(n, threads)
native_backend.NativeRequest = Request
from embedmesh.serving import lookup as serving_lookup
from embedmesh.serving import request
compiled = request.compiled  # the compiled request rules get the threads as their last argument
if compiled is not None:
    real_lookup = compiled.lookup
    compiled.lookup = lambda *a: used.append(a[-1]) or real_lookup(*a)
    real_serve = serving_lookup._serve  # a dict request of a dict model: its one call
    serving_lookup._serve = lambda served, *a: used.append(served[7]) or real_serve(served, *a)
t = em.TableConfig(40, 8, name="t")
fc = {f"f{i}": em.FeatureConfig(t) for i in range(6)}
rng = np.random.default_rng(0)
inputs = {k: rng.integers(0, 40, (5, 3)) for k in fc}
em.serving_embedding_lookup(inputs, None, {t: rng.standard_normal((40, 8)).astype(np.float32)}, fc)
print(json.dumps({"used": used, "previous": em.serving.set_host_threads(2)}))
"""


@pytest.mark.parametrize("threads", [1, 3])
def test_serving_threads(rows, threads):
    """The lookup runs on that many threads (the C++ kernels' one call or request, or
    Python's thread runner, is given it; 1: the caller's thread); `set_host_threads`
    reports the setting as the value it replaces."""
    seen = rows(f"threads{threads}")["serving_threads"]
    assert seen["previous"] == threads
    # one call or request (the C++ kernels, even on one thread), or Python's runner
    assert seen["used"] == [threads] or (threads == 1 and seen["used"] == [])


PREPROCESS_THREADS = """
import json
import numpy as np
import embedmesh as em
from embedmesh import _runtime
from embedmesh.host import preprocess

asked = []
real = _runtime.thread_pool
_runtime.thread_pool = lambda n: asked.append(n) or real(n)
t = em.TableConfig(64, 8, name="t")
plan = em.plan_stacking({"a": em.FeatureConfig(t)}, 4)
preprocess.preprocess_features({"a": np.arange(32).reshape(16, 2)}, None, plan,
                               num_devices_local=4, backend="numba")
print(json.dumps({"default": preprocess.default_num_threads(), "asked": sorted(set(asked))}))
"""


@pytest.mark.skipif(not HAVE_NUMBA, reason="threads are the numba backend's")
@pytest.mark.parametrize("threads", [1, 3])
def test_preprocess_threads(rows, threads):
    """The default `num_threads`: 1 runs the (stack, device) tasks on the caller's
    thread, 3 on a pool of three."""
    seen = rows(f"threads{threads}")["preprocess_threads"]
    assert seen == {"default": threads, "asked": [] if threads == 1 else [threads]}


SERVING_SPIN = """
import json
from embedmesh.serving import native

try:
    lib = native.library()
    print(json.dumps({"spin_us": lib.EmServingSetPoolSpin(0)}))
except ValueError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.mark.parametrize(
    "row, want", [("default", 300), ("threads1", 0), ("threads3", 2500), ("bad_spin", None)]
)
def test_serving_spin_us(rows, default_run, row, want):
    """How long the serving pool's threads poll before they sleep: the C++ default when
    unset, the value given (0, 2500), and a clear error naming the variable for a bad one
    (-1)."""
    seen = (default_run if row == "default" else rows(row))["spin"]
    if want is None:
        assert "EMBEDMESH_SERVING_SPIN_US='-1'" in seen["error"]
    else:
        assert seen == {"spin_us": want}


OUTPUT_POOL = """
import gc
import json
import numpy as np
import embedmesh as em
from embedmesh.serving import pool

t = em.TableConfig(1000, 64, name="t")
fc = {"a": em.FeatureConfig(t), "b": em.FeatureConfig(t)}
rng = np.random.default_rng(0)
inputs = {k: rng.integers(0, 1000, (1200, 2)) for k in fc}  # 600 KiB outputs
out = em.serving_embedding_lookup(inputs, None,
                                  {t: rng.standard_normal((1000, 64)).astype(np.float32)}, fc)
in_use = pool._pool.free_bytes()
del out
gc.collect()
if pool._pool.release is not None:
    pool._pool.release()  # jaxlib lets go of the numpy arrays its arrays aliased
print(json.dumps({"limit": pool._pool.limit, "in_use": in_use,
                  "kept": pool._pool.free_bytes()}))
"""


@pytest.mark.parametrize("mb", [0, 1, 4])
def test_output_pool_mb(rows, native_run, default_run, mb):
    """The serving output pool keeps at most the given MB of free buffers for reuse. A
    request's outputs are views of one buffer (the compiled request rules'): its two 600 KiB
    outputs one 1.2 MB buffer, which a 1 MB pool does not keep and a 4 MB pool does. (Each
    setting in a process that checks other switches too: `native_run`, ROWS,
    `default_run`.)"""
    seen = {0: native_run[0], 1: rows("threads3"), 4: default_run}[mb]["output_pool"]
    one = 1200 * 2 * 64 * 4  # an output's bytes
    assert seen == {"limit": mb << 20, "in_use": 0, "kept": {0: 0, 1: 0, 4: 2 * one}[mb]}


CPU_KERNELS = """
import json
import jax
import jax.numpy as jnp
import embedmesh.device.ops as ops

text = jax.jit(lambda t, i: ops.gather_rows(t, i)).lower(
    jnp.zeros((10, 4)), jnp.zeros(3, jnp.int32)).as_text()
print(json.dumps({"custom_call": "custom_call" in text}))
"""


def test_cpu_kernels_off_lowers_device_ops_to_pure_jax(rows, default_run):
    """EMBEDMESH_CPU_KERNELS=0: a device op lowers to plain XLA, no FFI custom call
    (seen in the lowered program, whatever the ops layer looks like inside)."""
    if not default_run["cpu_kernels"]["custom_call"]:
        pytest.skip("the C++ CPU kernels are not available here: nothing to switch off")
    assert rows("threads1")["cpu_kernels"] == {"custom_call": False}


def _switches(threads: int, spin: str) -> dict:
    return {
        "EMBEDMESH_SERVING_THREADS": str(threads),
        "EMBEDMESH_PREPROCESS_THREADS": str(threads),
        "EMBEDMESH_SERVING_SPIN_US": spin,
    }


# the processes of the switches' settings: (env, parts in order); the thread counts' patches
# record only, the spin's part reads (and resets) the spin last; the output pool's runs as
# the process's first request (nothing kept before it), or with nothing kept (its 0 MB
# setting: in `native_run`, after WORKLOAD; 4 MB: `default_run`)
ROWS = {
    "threads1": (
        {**_switches(1, "0"), "EMBEDMESH_CPU_KERNELS": "0"},
        ("preprocess_threads", "serving_threads", "cpu_kernels", "spin"),
    ),
    "threads3": (
        {**_switches(3, "2500"), "EMBEDMESH_OUTPUT_POOL_MB": "1"},
        ("output_pool", "preprocess_threads", "serving_threads", "spin"),
    ),
    "bad_spin": ({"EMBEDMESH_SERVING_SPIN_US": "-1"}, ("spin",)),
}


@pytest.fixture(scope="module")
def rows():
    """`rows(name)`: what ROWS[name]'s process saw, {part: its JSON}; each process runs
    once, when a test first asks for it."""
    code = {
        "preprocess_threads": PREPROCESS_THREADS,
        "output_pool": OUTPUT_POOL,
        "serving_threads": SERVING_THREADS,
        "cpu_kernels": CPU_KERNELS,
        "spin": SERVING_SPIN,
    }
    done = {}

    def get(name):
        if name not in done:
            env, parts = ROWS[name]
            if not HAVE_NUMBA:  # the preprocess threads are the numba backend's
                parts = tuple(p for p in parts if p != "preprocess_threads")
            done[name] = run_parts({p: code[p] for p in parts}, env)
        return done[name]

    return get
