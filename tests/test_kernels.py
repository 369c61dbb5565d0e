"""Property tests of `embedmesh.serving.kernels.weighted_segment_sum`, every backend.

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

from embedmesh.serving import kernels

BACKENDS = (
    ["numpy"]
    + (["numba"] if kernels.HAVE_NUMBA else [])
    + (["native"] if kernels.HAVE_NATIVE else [])
)
IMPLS = {
    "numpy": kernels.weighted_segment_sum_numpy,
    "numba": kernels.weighted_segment_sum_numba,
    "native": kernels.weighted_segment_sum_native,
}
COMBINERS = [None, "sum", "mean", "sqrtn"]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
EPS = {
    np.dtype(np.float32): 2.0**-24,
    np.dtype(np.float16): 2.0**-11,
    np.dtype(ml_dtypes.bfloat16): 2.0**-8,
}
TINY = {
    np.dtype(np.float32): 0.0,
    np.dtype(np.float16): 2.0**-24,  # subnormal spacing
    np.dtype(ml_dtypes.bfloat16): 0.0,
}

SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(autouse=True)
def poison(poisoned_outputs):
    """Every buffer the kernels allocate starts as NaN (all-ones bits for ints): conftest."""


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
    rows = np.repeat(
        np.arange(len(counts), dtype=draw(st.sampled_from([np.int32, np.int64]))), counts
    )
    n = rows.shape[0]
    ids = np.asarray(
        draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)),
        dtype=draw(st.sampled_from([np.int32, np.int64])),
    )
    kind = draw(st.sampled_from(["ones", "quarters", "positive"]))
    if kind == "ones":
        weights = np.ones(n, np.float32)
    elif kind == "quarters":  # negative, zero and positive; sums exact
        weights = (
            np.asarray(draw(st.lists(st.integers(-12, 12), min_size=n, max_size=n)), np.float32) / 4
        )
    else:
        weights = np.asarray(
            draw(st.lists(st.floats(0.0625, 10.0, width=32), min_size=n, max_size=n)), np.float32
        )
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**32 - 1))
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
    tol = (
        (4 * (counts + 2) * 2.0**-24 * scale)[:, None]
        + EPS[table.dtype] * np.abs(want)
        + TINY[table.dtype]
    )
    assert np.all(np.abs(got - want) <= tol + 1e-30), (
        f"max err {np.max(np.abs(got - want))}, combiner {combiner}"
    )


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=problems())
def test_matches_float64_reference(backend, problem):
    table, ids, rows, weights, num_rows, combiner = problem
    out = IMPLS[backend](table, ids, rows, weights, num_rows, combiner)
    check_against_reference(out, table, ids, rows, weights, num_rows, combiner)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="neither numba nor the C++ kernels are usable")
@pytest.mark.parametrize("backend", BACKENDS[1:])
@SETTINGS
@given(problem=problems(dtypes=(np.float32,)))
def test_backends_agree(backend, problem):
    """Same float32 products added in the same order: sums agree bit for bit."""
    table, ids, rows, weights, num_rows, combiner = problem
    a = kernels.weighted_segment_sum_numpy(table, ids, rows, weights, num_rows, combiner)
    b = IMPLS[backend](table, ids, rows, weights, num_rows, combiner)
    if combiner in (None, "sum"):
        np.testing.assert_array_equal(a, b)
    else:  # the denominators may be summed in another order by numpy
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_follows_backend(backend, monkeypatch):
    calls = []
    monkeypatch.setattr(
        kernels, f"weighted_segment_sum_{backend}", lambda *a: calls.append(backend) or "sentinel"
    )
    previous = kernels.set_backend(backend)
    try:
        assert kernels.get_backend() == backend
        assert kernels.weighted_segment_sum(None, None, None, None, 0, None) == "sentinel"
    finally:
        kernels.set_backend(previous)
    assert calls == [backend]


def test_default_backend():
    default = "native" if kernels.HAVE_NATIVE else "numba" if kernels.HAVE_NUMBA else "numpy"
    assert kernels.get_backend() == default
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
    out = IMPLS[backend](
        table, np.array([1, 2, 3]), np.array([0, 0, 2]), np.ones(3, np.float32), 3, None
    )
    np.testing.assert_array_equal(out, [[9, 11, 13], [0, 0, 0], [9, 10, 11]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("num_rows", [0, 4])
def test_empty_input(backend, combiner, num_rows):
    table = np.ones((5, 3), ml_dtypes.bfloat16)
    out = IMPLS[backend](
        table,
        np.zeros(0, np.int64),
        np.zeros(0, np.int32),
        np.zeros(0, np.float32),
        num_rows,
        combiner,
    )
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
    env = {**os.environ, "EMBEDMESH_SERVING_NATIVE": "0"}  # the C++ kernels off too
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_module_loads_standalone():
    """kernels.py imports from embedmesh only `_runtime` (numpy only) at import, and
    its numba kernels at first use (the fallback test relies on it)."""
    import re

    spec = importlib.util.find_spec("embedmesh.serving.kernels")
    with open(spec.origin) as fh:
        imports = re.findall(
            r"^( *)(?:from|import) (embedmesh\S*)(?: import (\w+))?", fh.read(), re.M
        )
    top = {(mod, name) for indent, mod, name in imports if not indent}
    assert top <= {("embedmesh", "_runtime"), ("embedmesh._runtime", "aligned_empty")}, top
    lazy = {(mod, name) for indent, mod, name in imports if indent}
    assert lazy <= {("embedmesh.serving", "native")}, lazy  # the C++ kernels' loader
    with open(spec.origin) as fh:  # the kernels module, imported at first use only
        assert '_runtime.numba_module("embedmesh.serving.numba_kernels")' in fh.read()
    with open(importlib.util.find_spec("embedmesh._runtime").origin) as fh:
        runtime = fh.read()
    assert "from embedmesh" not in runtime and "import jax" not in runtime


# ---------------------------------------------------------------------------
# bag_combine, gather, sparse_offsets and the output pool


def bag_reference(table, ids, offsets, weights, combiner, prune_ids, prune_weights):
    """Loops over bags in float64, with TensorFlow's pruning rules."""
    rows, kept_ids, kept_w = [], [], []
    for r in range(len(offsets) - 1):
        for k in range(offsets[r], offsets[r + 1]):
            w = 1.0 if weights is None else float(weights[k])
            if (prune_ids and ids[k] < 0) or (prune_weights and not w > 0):
                continue
            rows.append(r)
            kept_ids.append(int(ids[k]))
            kept_w.append(w)
    return (
        reference(
            table,
            np.array(kept_ids, np.int64),
            np.array(rows, np.int64),
            np.array(kept_w),
            len(offsets) - 1,
            combiner,
        ),
        rows,
        kept_ids,
        kept_w,
    )


@st.composite
def bag_problems(draw):
    vocab = draw(st.integers(1, 30))
    # 64-wide blocks, 16-wide blocks and a tail, in every combination
    dim = draw(st.sampled_from([1, 3, 15, 16, 17, 33, 64, 65, 80, 100, 128, 143]))
    counts = draw(st.lists(st.integers(0, 6), min_size=0, max_size=10))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(
        draw(st.sampled_from([np.int32, np.int64]))
    )
    n = int(offsets[-1])
    prune_ids = draw(st.booleans())
    low = -3 if prune_ids else 0
    ids = np.asarray(
        draw(st.lists(st.integers(low, vocab - 1), min_size=n, max_size=n)),
        dtype=draw(st.sampled_from([np.int32, np.int64])),
    )
    weights = None
    if draw(st.booleans()):
        weights = (
            np.asarray(draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n)), np.float32) / 4
        )
    combiner = draw(st.sampled_from(COMBINERS))
    prune_weights = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    table = np.random.default_rng(seed).standard_normal((vocab, dim)).astype(np.float32)
    return table, ids, offsets, weights, combiner, prune_ids, prune_weights


def _with_backend(backend, fn, *args, **kwargs):
    previous = kernels.set_backend(backend)
    try:
        return fn(*args, **kwargs)
    finally:
        kernels.set_backend(previous)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=bag_problems())
def test_bag_combine_matches_reference(backend, problem):
    table, ids, offsets, weights, combiner, prune_ids, prune_weights = problem
    out = _with_backend(
        backend,
        kernels.bag_combine,
        table,
        ids,
        offsets,
        weights,
        combiner,
        prune_ids=prune_ids,
        prune_weights=prune_weights,
    )
    (want, _), rows, kept_ids, kept_w = bag_reference(
        table, ids, offsets, weights, combiner, prune_ids, prune_weights
    )
    check_against_reference(
        out,
        table,
        np.array(kept_ids, np.int64),
        np.array(rows, np.int64),
        np.array(kept_w, np.float32),
        len(offsets) - 1,
        combiner,
    )


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba is not importable")
@SETTINGS
@given(problem=bag_problems())
def test_bag_combine_backends_and_segment_sum_agree(problem):
    """Both backends, and weighted_segment_sum on the pruned entries, bit for bit (sum)."""
    table, ids, offsets, weights, combiner, prune_ids, prune_weights = problem
    a = _with_backend(
        "numba",
        kernels.bag_combine,
        table,
        ids,
        offsets,
        weights,
        combiner,
        prune_ids=prune_ids,
        prune_weights=prune_weights,
    )
    b = _with_backend(
        "numpy",
        kernels.bag_combine,
        table,
        ids,
        offsets,
        weights,
        combiner,
        prune_ids=prune_ids,
        prune_weights=prune_weights,
    )
    _, rows, kept_ids, kept_w = bag_reference(
        table, ids, offsets, weights, combiner, prune_ids, prune_weights
    )
    c = kernels.weighted_segment_sum_numba(
        table,
        np.array(kept_ids, np.int64),
        np.array(rows, np.int64),
        np.array(kept_w, np.float32),
        len(offsets) - 1,
        combiner,
    )
    np.testing.assert_array_equal(a, c)
    if combiner in (None, "sum"):
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bag_combine_errors_name_the_first_bad_kept_entry(backend):
    table = np.ones((5, 2), np.float32)
    offsets = np.array([0, 2, 4])
    ids = np.array([-1, 1, 7, 9])
    with pytest.raises(kernels.IdOutOfRange) as info:
        _with_backend(backend, kernels.bag_combine, table, ids, offsets, prune_ids=True)
    assert (info.value.entry, info.value.id, info.value.vocabulary_size) == (2, 7, 5)
    with pytest.raises(kernels.IdOutOfRange) as info:  # -1 is not pruned: it is the error
        _with_backend(backend, kernels.bag_combine, table, ids, offsets)
    assert (info.value.entry, info.value.id) == (0, -1)
    # a pruned weight hides its (bad) id
    w = np.array([1, 1, 0, 1], np.float32)
    with pytest.raises(kernels.IdOutOfRange) as info:
        _with_backend(
            backend,
            kernels.bag_combine,
            table,
            ids,
            offsets,
            w,
            "mean",
            prune_ids=True,
            prune_weights=True,
        )
    assert info.value.entry == 3
    huge = np.array([1, 2**63 + 5], np.uint64)  # unsigned ids: never pruned, range checked
    with pytest.raises(kernels.IdOutOfRange):
        _with_backend(backend, kernels.bag_combine, table, huge, np.array([0, 2]), prune_ids=True)
    with pytest.raises(ValueError, match="offsets"):
        _with_backend(backend, kernels.bag_combine, table, ids, np.array([0, 3, 2, 4]))
    with pytest.raises(ValueError, match="offsets"):
        _with_backend(backend, kernels.bag_combine, table, ids, np.array([0, 3]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bag_combine_narrow_tables(backend, dtype):
    """float16/bfloat16 tables: float32 accumulation, output in the table's dtype."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((20, 70)).astype(dtype)
    ids = np.array([3, -1, 4, 19, 0, 5])
    offsets = np.array([0, 3, 3, 6])
    w = np.array([1, 2, 0.5, -1, 2, 1], np.float32)
    out = _with_backend(
        backend,
        kernels.bag_combine,
        table,
        ids,
        offsets,
        w,
        "mean",
        prune_ids=True,
        prune_weights=True,
    )
    assert out.dtype == table.dtype and out.shape == (3, 70)
    t = table.astype(np.float32)
    want = np.stack([(t[3] + 0.5 * t[4]) / 1.5, np.zeros(70), (2 * t[0] + t[5]) / 3])
    np.testing.assert_allclose(
        out.astype(np.float32), want, rtol=EPS[np.dtype(dtype)] * 4, atol=EPS[np.dtype(dtype)] * 4
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES + [np.float64, np.int8])
@pytest.mark.parametrize("row_bytes", [None, 64, 192])  # None: 7 wide; else streaming stores
def test_gather_is_bit_exact_and_checks_ids(backend, dtype, row_bytes):
    dim = 7 if row_bytes is None else row_bytes // np.dtype(dtype).itemsize
    table = (np.random.default_rng(0).standard_normal((50, dim)) * 10).astype(dtype)
    ids = np.array([3, 4, 3, 49, 0], np.int32)
    out = _with_backend(backend, kernels.gather, table, ids)
    assert out.dtype == table.dtype and out.ctypes.data % 64 == 0
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))
    # a table whose rows are not contiguous takes the plain copy
    wide = np.repeat(table, 2, axis=1)[:, ::2]
    np.testing.assert_array_equal(_with_backend(backend, kernels.gather, wide, ids), table[ids])
    with pytest.raises(kernels.IdOutOfRange) as info:
        _with_backend(backend, kernels.gather, table, np.array([0, 50, -1]))
    assert info.value.entry == 1


def _sparse_reference(idx, shape):
    """(offsets, -1) or (None, first bad entry) by plain loops."""
    rows = []
    prev = None
    for k, index in enumerate(idx.tolist()):
        if any(v < 0 or v >= d for v, d in zip(index, shape)) or (
            prev is not None and index <= prev
        ):
            return None, k
        prev = index
        rows.append(int(np.ravel_multi_index(tuple(index[:-1]), shape[:-1])))
    num_rows = int(np.prod(shape[:-1]))
    return np.searchsorted(np.array(rows, np.int64), np.arange(num_rows + 1)), -1


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(data=st.data())
def test_sparse_offsets_match_loops(backend, data):
    rank = data.draw(st.integers(2, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    cells = [list(c) for c in np.ndindex(*shape)]
    chosen = sorted(
        data.draw(st.lists(st.sampled_from(range(len(cells))), max_size=12, unique=True))
    )
    idx = np.array([cells[c] for c in chosen], np.int64).reshape(-1, rank)
    if idx.shape[0] and data.draw(st.booleans()):  # break it: out of range or out of order
        k = data.draw(st.integers(0, idx.shape[0] - 1))
        d = data.draw(st.integers(0, rank - 1))
        idx[k, d] = data.draw(st.sampled_from([-1, shape[d], 0, shape[d] - 1]))
    idx = idx.astype(data.draw(st.sampled_from([np.int32, np.int64])))
    got, bad = _with_backend(backend, kernels.sparse_offsets, idx, shape)
    want, want_bad = _sparse_reference(idx, shape)
    assert bad == want_bad
    if want is None:
        assert got is None
    else:
        np.testing.assert_array_equal(got, want)


def test_output_pool_reuses_only_unreferenced_buffers():
    import jax

    previous = kernels.set_output_pool_limit(64 << 20)
    try:
        a = kernels.output_empty((100, 64), np.float32)
        a[...] = 1
        held = jax.device_put(a, may_alias=True)
        view = a[3:5]
        del a
        b = kernels.output_empty((100, 64), np.float32)  # a is still referenced twice over
        assert not np.shares_memory(b, view)
        b[...] = 2
        del held
        c = kernels.output_empty((100, 64), np.float32)  # the numpy view still holds it
        assert not np.shares_memory(c, view)
        np.testing.assert_array_equal(view, 1)
        addr = view.ctypes.data - 3 * 64 * 4
        del view, b, c
        # free again: reused (once jaxlib lets go of the numpy array `held` aliased)
        d, e, g = (kernels.output_empty((100, 64), np.float32) for _ in range(3))
        assert addr in (d.ctypes.data, e.ctypes.data, g.ctypes.data)
        assert d.ctypes.data % 64 == 0
        kernels.set_output_pool_limit(0)  # no pooling: every buffer is fresh
        del d, e, g
        assert kernels._pool.free_bytes() == 0
        f = kernels.output_empty((100, 64), np.float32)
        del f
        assert kernels._pool.free_bytes() == 0
    finally:
        kernels.set_output_pool_limit(previous)


def test_output_pool_limit_bounds_the_free_buffers_oldest_go_first(monkeypatch):
    from embedmesh import _runtime

    fresh = []
    real = _runtime.aligned_buffer
    monkeypatch.setattr(_runtime, "aligned_buffer", lambda *a: fresh.append(a) or real(*a))
    one = 1024 * 4  # bytes of a (1024,) float32 buffer
    previous = kernels.set_output_pool_limit(2 * one + 100)
    try:
        a = kernels.output_empty((1024,), np.float32)
        b = kernels.output_empty((32, 32), np.float32)  # the same bytes, another shape
        c = kernels.output_empty((1000,), np.float32)
        addr_b, addr_c = b.ctypes.data, c.ctypes.data
        assert kernels._pool.free_bytes() == 0 and len(fresh) == 3  # in use: not the pool's
        del a
        del c
        assert kernels._pool.free_bytes() == one + 4000
        del b  # no room for a third: the oldest freed (a's) goes
        assert kernels._pool.free_bytes() == one + 4000
        x = kernels.output_empty((1024,), np.float32)
        assert x.ctypes.data == addr_b and len(fresh) == 3
        y = kernels.output_empty((1024,), np.float32)  # a's was dropped: a fresh one
        assert len(fresh) == 4 and not np.shares_memory(x, y)
        z = kernels.output_empty((10, 100), np.float32)
        assert z.ctypes.data == addr_c and kernels._pool.free_bytes() == 0 and len(fresh) == 4
        big = kernels.output_empty((4096,), np.float32)  # over the limit: never kept
        del big
        assert kernels._pool.free_bytes() == 0
    finally:
        kernels.set_output_pool_limit(previous)


def test_output_pool_keeps_a_loop_in_its_buffers_while_the_caller_holds_a_result(monkeypatch):
    """A serving loop holds its last result while it asks for the next: with room for
    one request's outputs in the pool (4.5 buffers' bytes, not 8), only the first two
    requests allocate; every later one reuses the buffers freed by the one before."""
    from embedmesh import _runtime

    fresh = []
    real = _runtime.aligned_buffer
    monkeypatch.setattr(_runtime, "aligned_buffer", lambda *a: fresh.append(a) or real(*a))
    shape, n = (256, 64), 4
    nbytes = 256 * 64 * 4
    previous = kernels.set_output_pool_limit(n * nbytes + nbytes // 2)
    try:
        held = None
        for request in range(8):
            outs = [kernels.output_empty(shape, np.float32) for _ in range(n)]
            for o in outs:
                o[...] = request
            assert len(fresh) == n * min(request + 1, 2), request
            assert held is None or not any(np.shares_memory(o, h) for o in outs for h in held)
            held = outs
        assert held[0][0, 0] == 7
    finally:
        kernels.set_output_pool_limit(previous)


def test_output_pool_hands_out_non_native_dtypes_over_the_same_memory():
    import ml_dtypes

    previous = kernels.set_output_pool_limit(1 << 20)
    try:
        a, addr = kernels.output_empty_at((3, 5), ml_dtypes.bfloat16)
        assert a.dtype == ml_dtypes.bfloat16 and a.shape == (3, 5) and addr % 64 == 0
        assert a.ctypes.data == addr and a.flags.writeable and a.flags.c_contiguous
        a[...] = 1.5
        b, addr_b = kernels.output_empty_at((5, 3), np.dtype(">f4"))
        assert b.dtype == np.dtype(">f4") and b.ctypes.data == addr_b != addr
        del a
        c, addr_c = kernels.output_empty_at((15,), np.float16)  # the same 30 bytes
        assert addr_c == addr and c.dtype == np.float16
    finally:
        kernels.set_output_pool_limit(previous)
