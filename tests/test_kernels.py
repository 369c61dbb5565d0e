"""Property tests of `embedmesh.kernels.weighted_segment_sum`, both backends.

The reference is a float64 loop written out below. Every output buffer the
kernels allocate is poisoned with NaN first, so an element a kernel forgets
to write shows up. Weights are multiples of 1/4 (negative and zero included)
or positive floats, so sums of weights are exact in float32 and float64 and
both decide "zero denominator" alike.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh import kernels

BACKENDS = ["numpy"] + (["numba"] if kernels.HAVE_NUMBA else [])
IMPLS = {"numpy": kernels.weighted_segment_sum_numpy,
         "numba": kernels.weighted_segment_sum_numba}
COMBINERS = [None, "sum", "mean", "sqrtn"]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
EPS = {np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float16): 2.0 ** -11,
       np.dtype(ml_dtypes.bfloat16): 2.0 ** -8}
TINY = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0 ** -24,  # subnormal spacing
        np.dtype(ml_dtypes.bfloat16): 0.0}

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every buffer the kernels allocate starts as NaN (all-ones bits for ints)."""
    real = kernels.output_empty

    def poisoned(shape, dtype):
        out = real(shape, dtype)
        out.view(np.uint8)[...] = 0xFF  # NaN for every float dtype
        return out

    monkeypatch.setattr(kernels, "output_empty", poisoned)
    yield


def reference(table, ids, rows, weights, num_rows, combiner):
    """float64 loops: sum, then normalise; a zero denominator gives a zero row."""
    dim = table.shape[1]
    tab = np.asarray(table, dtype=np.float64)
    out = np.zeros((num_rows, dim))
    den = np.zeros(num_rows)
    scale = np.zeros(num_rows)  # sum |w x|: sets the tolerance
    for k in range(len(ids)):
        r, w = int(rows[k]), float(weights[k])
        for j in range(dim):
            out[r, j] += w * tab[ids[k], j]
        scale[r] += abs(w) * np.abs(tab[ids[k]]).max()
        if combiner == "mean":
            den[r] += w
        elif combiner == "sqrtn":
            den[r] += w * w
    if combiner in ("mean", "sqrtn"):
        if combiner == "sqrtn":
            den = np.sqrt(den)
        for r in range(num_rows):
            if den[r] == 0:
                out[r] = 0.0
                scale[r] = 0.0
            else:
                out[r] /= den[r]
                scale[r] /= abs(den[r])
    return out, scale


@st.composite
def problems(draw, dtypes=tuple(DTYPES)):
    vocab = draw(st.integers(1, 30))
    dim = draw(st.integers(1, 20))
    counts = draw(st.lists(st.integers(0, 6), min_size=0, max_size=12))
    extra_rows = draw(st.integers(0, 3))  # num_rows beyond the last row used
    num_rows = len(counts) + extra_rows
    rows = np.repeat(np.arange(len(counts), dtype=draw(st.sampled_from([np.int32, np.int64]))),
                     counts)
    n = rows.shape[0]
    ids = np.asarray(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)),
                     dtype=draw(st.sampled_from([np.int32, np.int64])))
    kind = draw(st.sampled_from(["ones", "quarters", "positive"]))
    if kind == "ones":
        weights = np.ones(n, np.float32)
    elif kind == "quarters":  # negative, zero and positive; sums exact
        weights = np.asarray(draw(st.lists(st.integers(-12, 12), min_size=n, max_size=n)),
                             np.float32) / 4
    else:
        weights = np.asarray(draw(st.lists(
            st.floats(0.0625, 10.0, width=32), min_size=n, max_size=n)), np.float32)
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    table = np.random.default_rng(seed).standard_normal((vocab, dim)).astype(dtype)
    combiner = draw(st.sampled_from(COMBINERS))
    return table, ids, rows, weights, num_rows, combiner


def check_against_reference(out, table, ids, rows, weights, num_rows, combiner):
    dim = table.shape[1]
    assert out.shape == (num_rows, dim)
    assert out.dtype == table.dtype
    assert out.size == 0 or out.ctypes.data % 64 == 0
    got = np.asarray(out, dtype=np.float64)
    assert not np.isnan(got).any(), "an output element was never written"
    want, scale = reference(table, ids, rows, weights, num_rows, combiner)
    counts = np.bincount(np.asarray(rows, np.int64), minlength=num_rows)[:num_rows]
    # float32 accumulation over counts[r] terms, then rounding to the table dtype
    tol = (4 * (counts + 2) * 2.0 ** -24 * scale)[:, None] + EPS[table.dtype] * np.abs(want) + TINY[table.dtype]
    assert np.all(np.abs(got - want) <= tol + 1e-30), (
        f"max err {np.max(np.abs(got - want))}, combiner {combiner}")


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=problems())
def test_matches_float64_reference(backend, problem):
    table, ids, rows, weights, num_rows, combiner = problem
    out = IMPLS[backend](table, ids, rows, weights, num_rows, combiner)
    check_against_reference(out, table, ids, rows, weights, num_rows, combiner)


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba is not importable")
@SETTINGS
@given(problem=problems(dtypes=(np.float32,)))
def test_backends_agree(problem):
    """Same float32 products added in the same order: sums agree bit for bit."""
    table, ids, rows, weights, num_rows, combiner = problem
    a = kernels.weighted_segment_sum_numpy(table, ids, rows, weights, num_rows, combiner)
    b = kernels.weighted_segment_sum_numba(table, ids, rows, weights, num_rows, combiner)
    if combiner in (None, "sum"):
        np.testing.assert_array_equal(a, b)
    else:  # the denominators may be summed in another order by numpy
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_follows_backend(backend, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, f"weighted_segment_sum_{backend}",
                        lambda *a: calls.append(backend) or "sentinel")
    previous = kernels.set_backend(backend)
    try:
        assert kernels.get_backend() == backend
        assert kernels.weighted_segment_sum(None, None, None, None, 0, None) == "sentinel"
    finally:
        kernels.set_backend(previous)
    assert calls == [backend]


def test_default_backend():
    assert kernels.get_backend() == ("numba" if kernels.HAVE_NUMBA else "numpy")
    with pytest.raises(ValueError, match="unknown backend"):
        kernels.set_backend("cuda")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_lookup_is_bit_exact(backend, dtype):
    table = np.random.default_rng(0).standard_normal((50, 7)).astype(dtype)
    table[3, 0] = -0.0
    table[4, 1] = np.nan
    ids = np.array([3, 4, 3, 49, 0])
    out = IMPLS[backend](table, ids, np.arange(5), np.ones(5, np.float32), 5, None)
    assert out.dtype == table.dtype and out.ctypes.data % 64 == 0
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_not_a_plain_lookup_when_rows_repeat(backend):
    """n == num_rows, first row 0, last row n-1, but rows [0, 0, 2]: a real sum."""
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = IMPLS[backend](table, np.array([1, 2, 3]), np.array([0, 0, 2]),
                         np.ones(3, np.float32), 3, None)
    np.testing.assert_array_equal(out, [[9, 11, 13], [0, 0, 0], [9, 10, 11]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("num_rows", [0, 4])
def test_empty_input(backend, combiner, num_rows):
    table = np.ones((5, 3), ml_dtypes.bfloat16)
    out = IMPLS[backend](table, np.zeros(0, np.int64), np.zeros(0, np.int32),
                         np.zeros(0, np.float32), num_rows, combiner)
    assert out.shape == (num_rows, 3) and out.dtype == table.dtype
    assert not np.any(np.asarray(out, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_denominators_give_zero_rows(backend):
    table = np.array([[1, 2], [3, 5], [7, 11]], np.float32)
    ids = np.array([0, 1, 2, 0])
    rows = np.array([0, 0, 1, 3])
    weights = np.array([1.5, -1.5, 0.0, 2.0], np.float32)
    # row 0: weights sum to 0 but the weighted sum is not 0; row 1: weight 0;
    # rows 2 and 4: no entries
    mean = IMPLS[backend](table, ids, rows, weights, 5, "mean")
    np.testing.assert_array_equal(mean, [[0, 0], [0, 0], [0, 0], [1, 2], [0, 0]])
    sqrtn = IMPLS[backend](table, ids, rows, weights, 5, "sqrtn")
    np.testing.assert_allclose(sqrtn[0], np.array([-3, -4.5]) / np.sqrt(4.5), rtol=1e-6)
    np.testing.assert_array_equal(sqrtn[1:], [[0, 0], [0, 0], [1, 2], [0, 0]])
    total = IMPLS[backend](table, ids, rows, weights, 5, "sum")
    np.testing.assert_array_equal(total, [[-3, -4.5], [0, 0], [0, 0], [2, 4], [0, 0]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend):
    f = IMPLS[backend]
    table = np.ones((4, 2), np.float32)
    w = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="ids must lie"):
        f(table, np.array([0, 4, 1]), np.array([0, 1, 2]), w, 3, "sum")
    with pytest.raises(ValueError, match="ids must lie"):
        f(table, np.array([0, -1, 1]), np.array([0, 1, 2]), w, 3, "sum")
    with pytest.raises(ValueError, match="non-decreasing"):
        f(table, np.array([0, 1, 1]), np.array([0, 2, 1]), w, 3, "sum")
    with pytest.raises(ValueError, match="num_rows"):
        f(table, np.array([0, 1, 1]), np.array([0, 1, 3]), w, 3, "sum")
    with pytest.raises(ValueError, match="num_rows"):
        f(table, np.array([0, 1, 1]), np.array([-1, 1, 2]), w, 3, "sum")
    with pytest.raises(ValueError, match="combiner"):
        f(table, np.array([0, 1, 1]), np.array([0, 1, 2]), w, 3, "max")
    with pytest.raises(ValueError, match="1-D of one length"):
        f(table, np.array([0, 1]), np.array([0, 1, 2]), w, 3, "sum")


def test_large_random_batch_both_backends():
    """A serving-sized feature (Poisson lengths, many empty rows at the end)."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((1000, 16)).astype(np.float32)
    lengths = rng.poisson(4, 300)
    rows = np.repeat(np.arange(300), lengths)
    ids = rng.integers(0, 1000, rows.shape[0])
    weights = rng.uniform(0.1, 2, rows.shape[0]).astype(np.float32)
    for backend in BACKENDS:
        for combiner in COMBINERS:
            out = IMPLS[backend](table, ids, rows, weights, 310, combiner)
            check_against_reference(out, table, ids, rows, weights, 310, combiner)


def test_numpy_fallback_without_numba(tmp_path):
    """With numba not importable, the module loads, picks numpy and computes."""
    path = os.path.join(os.path.dirname(kernels.__file__), "kernels.py")
    script = f"""
import sys, importlib.util
import numpy as np
sys.modules["numba"] = None  # import numba -> ImportError
spec = importlib.util.spec_from_file_location("kernels_without_numba", {path!r})
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
assert not k.HAVE_NUMBA and k.get_backend() == "numpy"
try:
    k.set_backend("numba")
except RuntimeError:
    pass
else:
    raise AssertionError("set_backend('numba') should fail without numba")
t = np.arange(8, dtype=np.float32).reshape(4, 2)
out = k.weighted_segment_sum(t, np.array([1, 3, 2]), np.array([0, 0, 2]),
                             np.array([1, 3, 2], np.float32), 4, "mean")
np.testing.assert_allclose(out, [[5, 6], [0, 0], [4, 5], [0, 0]])
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_module_loads_standalone():
    """kernels.py imports nothing from embedmesh (the fallback test relies on it)."""
    spec = importlib.util.find_spec("embedmesh.kernels")
    with open(spec.origin) as fh:
        assert "from embedmesh" not in fh.read()
