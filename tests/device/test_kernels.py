"""The serving kernels (`embedmesh.serving.kernels`), every available backend, against
plain float64 references written out below: `bag_combine` (each combiner, with and
without weights, TensorFlow's pruning of ids and weights, tables of every dtype),
`gather`, `sparse_offsets` (also as `inputs`' check, through `embedmesh.sparse_index`),
the backend switch and the output pool.

Every output buffer the kernels allocate is poisoned with NaN first, so an element a
kernel forgets to write shows up. Inputs are random (tables standard normal); the
seeded cases check their reference is mostly non-zero, so a kernel that writes zeros
cannot pass. Weights are multiples of 1/4 (negative and zero included) or positive
floats, so sums of weights are exact in float32 and float64 and both decide "zero
denominator" alike.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from bag_reference import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh import QuantizationConfig, TableConfig, sparse_index
from embedmesh.serving import backends, kernels, pool
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.backends import numba as numba_backend
from embedmesh.serving.backends import numpy as numpy_backend

BACKENDS = (
    ["numpy"]
    + (["numba"] if kernels.HAVE_NUMBA else [])
    + (["native"] if kernels.HAVE_NATIVE else [])
)
MODULES = {"numpy": numpy_backend, "numba": numba_backend, "native": native_backend}
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


def _with_backend(backend, fn, *args, **kwargs):
    previous = kernels.set_backend(backend)
    try:
        return fn(*args, **kwargs)
    finally:
        kernels.set_backend(previous)


def check_against_reference(out, table, ids, offsets, weights, combiner, prune_ids, prune_w):
    """`out` (a kernel's) within float32 accumulation's error of the float64 reference."""
    num_rows, dim = len(offsets) - 1, table.shape[1]
    assert out.shape == (num_rows, dim)
    assert out.dtype == table.dtype
    assert out.size == 0 or out.ctypes.data % 64 == 0
    got = np.asarray(out, dtype=np.float64)
    assert not np.isnan(got).any(), "an output element was never written"
    want, scale, counts = reference(table, ids, offsets, weights, combiner, prune_ids, prune_w)
    # float32 accumulation over counts[r] terms, then rounding to the table dtype
    tol = (
        (4 * (counts + 2) * 2.0**-24 * scale)[:, None]
        + EPS[table.dtype] * np.abs(want)
        + TINY[table.dtype]
    )
    assert np.all(np.abs(got - want) <= tol + 1e-30), (
        f"max err {np.max(np.abs(got - want))}, combiner {combiner}"
    )
    return want


def _weights(draw, n):
    kind = draw(st.sampled_from(["none", "ones", "quarters", "positive"]))
    if kind == "none":
        return None
    if kind == "ones":
        return np.ones(n, np.float32)
    if kind == "quarters":  # negative, zero and positive; sums exact
        return (
            np.asarray(draw(st.lists(st.integers(-12, 12), min_size=n, max_size=n)), np.float32) / 4
        )
    return np.asarray(
        draw(st.lists(st.floats(0.0625, 10.0, width=32), min_size=n, max_size=n)), np.float32
    )


@st.composite
def bag_problems(draw, dtypes=tuple(DTYPES)):
    vocab = draw(st.integers(1, 30))
    # 64-wide blocks, 16-wide blocks and a tail, in every combination
    dim = draw(st.sampled_from([1, 3, 7, 15, 16, 17, 20, 33, 64, 65, 80, 100, 128, 143]))
    counts = draw(st.lists(st.integers(0, 6), min_size=0, max_size=12))
    counts += [0] * draw(st.integers(0, 3))  # empty bags at the end
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
    weights = _weights(draw, n)
    combiner = draw(st.sampled_from(COMBINERS))
    prune_weights = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(dtypes))
    table = np.random.default_rng(seed).standard_normal((vocab, dim)).astype(dtype)
    return table, ids, offsets, weights, combiner, prune_ids, prune_weights


def _bag(backend, table, ids, offsets, weights, combiner, prune_ids, prune_weights):
    kw = {"prune_ids": prune_ids, "prune_weights": prune_weights}
    return _with_backend(backend, kernels.bag_combine, table, ids, offsets, weights, combiner, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=bag_problems())
def test_bag_combine_matches_float64_reference(backend, problem):
    out = _bag(backend, *problem)
    check_against_reference(out, *problem)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="neither numba nor the C++ kernels are usable")
@pytest.mark.parametrize("backend", BACKENDS[1:])
@SETTINGS
@given(problem=bag_problems())
def test_backends_agree_with_numpy(backend, problem):
    """Same float32 products added in the same order: sums agree with the numpy
    backend's exactly (as values: numpy copies a one-entry bag's -0.0 product where the
    compiled kernels add it to +0.0; its denominators may be summed in another order)."""
    a = _bag("numpy", *problem)
    b = _bag(backend, *problem)
    if problem[4] in (None, "sum"):
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(
    not (kernels.HAVE_NUMBA and kernels.HAVE_NATIVE), reason="numba or the C++ kernels missing"
)
@pytest.mark.parametrize("kind", ["int8", "fp16", "codes"])
def test_numba_and_native_agree_on_quantized_tables(kind):
    """numba's quantized bag (numpy's decode, then its float32 kernel) against the C++
    kernel's decode in the sum, bit for bit (tests/serving/test_serving_quantized.py checks the
    C++ and numpy backends against float64 references)."""
    from embedmesh.serving import quantize_table

    rng = np.random.default_rng(5)
    cfg = TableConfig(50, 20, quantization_config=QuantizationConfig(200, -1.5, 1.25))
    q = quantize_table(rng.standard_normal((50, 20)).astype(np.float32), kind, config=cfg)
    ids = rng.integers(-1, 50, 40)
    offsets = np.array([0, 0, 7, 19, 20, 40])
    w = (rng.integers(-2, 8, 40) / 4).astype(np.float32)
    for combiner in ("sum", "mean", "sqrtn"):
        problem = (q, ids, offsets, w, combiner, True, True)
        want = _bag("native", *problem)
        assert not np.isnan(want).any() and np.abs(want).max() > 0
        np.testing.assert_array_equal(_bag("numba", *problem), want)


@pytest.mark.skipif(
    not (kernels.HAVE_NUMBA and kernels.HAVE_NATIVE), reason="numba or the C++ kernels missing"
)
@SETTINGS
@given(problem=bag_problems())
def test_numba_and_native_agree_bit_for_bit(problem):
    """The two compiled backends: the same values, bit for bit, for every combiner."""
    a = _bag("numba", *problem)
    b = _bag("native", *problem)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("dim", [16, 64, 70])
def test_bag_combine_random_batch(backend, combiner, weighted, prune, dim):
    """A serving-sized feature (Poisson lengths, empty bags, the last ones too), seeded:
    each combiner with and without weights, with and without pruned ids and weights."""
    rng = np.random.default_rng(dim)
    table = rng.standard_normal((1000, dim)).astype(np.float32)
    lengths = np.concatenate([rng.poisson(4, 300), [0] * 10])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    ids = rng.integers(0, 1000, n)
    weights = rng.uniform(0.1, 2, n).astype(np.float32) if weighted else None
    if prune:
        ids[rng.random(n) < 0.2] = -1
        if weighted:
            weights[rng.random(n) < 0.2] = 0.0
    problem = (table, ids, offsets, weights, combiner, prune, prune)
    out = _bag(backend, *problem)
    want = check_against_reference(out, *problem)
    assert np.count_nonzero(want) > 0.8 * want.size  # only the empty (or pruned) bags are zero
    if backend != "numpy" and combiner in (None, "sum"):
        np.testing.assert_array_equal(out, _bag("numpy", *problem))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_follows_backend(backend, monkeypatch):
    """Each op runs the backend chosen by set_backend, and only that one."""
    calls = []
    for name, module in MODULES.items():
        for op in ("prepare_bag", "prepare_gather", "sparse_offsets"):
            monkeypatch.setattr(
                module,
                op,
                lambda *a, name=name, op=op: calls.append((name, op)) or (lambda: "sentinel"),
            )
    table, ids = np.ones((4, 2), np.float32), np.array([0, 1])
    previous = kernels.set_backend(backend)
    try:
        assert kernels.get_backend() == backend
        assert kernels.bag_combine(table, ids, np.array([0, 2])) == "sentinel"
        assert kernels.gather(table, ids) == "sentinel"
        kernels.sparse_offsets(np.zeros((0, 2), np.int64), (2, 2))
    finally:
        kernels.set_backend(previous)
    assert calls == [
        (backend, "prepare_bag"),
        (backend, "prepare_gather"),
        (backend, "sparse_offsets"),
    ]


def test_backends_implement_one_interface():
    """Every backend module has the same ops (the interface in `backends`' docstring)."""
    for name, module in MODULES.items():
        assert name == module.NAME
        for op in ("load", "prepare_bag", "prepare_gather", "sparse_offsets"):
            assert callable(getattr(module, op)), (name, op)
        assert op in backends.__doc__
    assert not hasattr(kernels, "weighted_segment_sum")


def test_default_backend():
    default = "native" if kernels.HAVE_NATIVE else "numba" if kernels.HAVE_NUMBA else "numpy"
    assert kernels.get_backend() == default
    with pytest.raises(ValueError, match="unknown backend"):
        kernels.set_backend("cuda")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("num_rows", [0, 4])
def test_empty_input(backend, combiner, num_rows):
    table = np.ones((5, 3), ml_dtypes.bfloat16)
    ids = np.zeros(0, np.int64)
    offsets = np.zeros(num_rows + 1, np.int64)
    for weights in (None, np.zeros(0, np.float32)):
        out = _bag(backend, table, ids, offsets, weights, combiner, False, False)
        assert out.shape == (num_rows, 3) and out.dtype == table.dtype
        assert not np.any(np.asarray(out, np.float32))
    out = _with_backend(backend, kernels.gather, table, ids)
    assert out.shape == (0, 3) and out.dtype == table.dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_denominators_give_zero_rows(backend):
    table = np.array([[1, 2], [3, 5], [7, 11]], np.float32)
    ids = np.array([0, 1, 2, 0])
    offsets = np.array([0, 2, 3, 3, 4, 4])
    weights = np.array([1.5, -1.5, 0.0, 2.0], np.float32)
    # bag 0: weights sum to 0 but the weighted sum is not 0; bag 1: weight 0;
    # bags 2 and 4: no entries
    mean = _bag(backend, table, ids, offsets, weights, "mean", False, False)
    np.testing.assert_array_equal(mean, [[0, 0], [0, 0], [0, 0], [1, 2], [0, 0]])
    sqrtn = _bag(backend, table, ids, offsets, weights, "sqrtn", False, False)
    np.testing.assert_allclose(sqrtn[0], np.array([-3, -4.5]) / np.sqrt(4.5), rtol=1e-6)
    np.testing.assert_array_equal(sqrtn[1:], [[0, 0], [0, 0], [1, 2], [0, 0]])
    total = _bag(backend, table, ids, offsets, weights, "sum", False, False)
    np.testing.assert_array_equal(total, [[-3, -4.5], [0, 0], [0, 0], [2, 4], [0, 0]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend):
    table = np.ones((4, 2), np.float32)
    ids, offsets = np.array([0, 1, 1]), np.array([0, 1, 3])

    def bag(*args, **kwargs):
        return _with_backend(backend, kernels.bag_combine, *args, **kwargs)

    with pytest.raises(ValueError, match="combiner"):
        bag(table, ids, offsets, None, "max")
    with pytest.raises(ValueError, match="must match ids"):
        bag(table, ids, offsets, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        bag(table[0], ids, offsets)
    with pytest.raises(ValueError, match="1-D integers"):
        bag(table, ids.astype(np.float32), offsets)
    with pytest.raises(ValueError, match="offsets"):
        bag(table, ids, offsets.astype(np.float32))
    with pytest.raises(ValueError, match="1-D integers"):
        _with_backend(backend, kernels.gather, table, ids[:, None])


def test_numpy_fallback_without_numba_or_native():
    """With numba not importable and the C++ kernels off, the kernels load, pick numpy
    and compute (a process without a compiler and without numba)."""
    script = """
import sys
import numpy as np
sys.modules["numba"] = None  # import numba -> ImportError
from embedmesh.serving import kernels
assert not kernels.HAVE_NUMBA and not kernels.HAVE_NATIVE and kernels.get_backend() == "numpy"
for name in ("numba", "native"):
    try:
        kernels.set_backend(name)
    except RuntimeError:
        pass
    else:
        raise AssertionError(f"set_backend({name!r}) should fail")
t = np.arange(8, dtype=np.float32).reshape(4, 2)
out = kernels.bag_combine(t, np.array([1, 3, 2]), np.array([0, 2, 2, 3, 3]),
                          np.array([1, 3, 2], np.float32), "mean")
np.testing.assert_allclose(out, [[5, 6], [0, 0], [4, 5], [0, 0]])
print("ok")
"""
    env = {**os.environ, "EMBEDMESH_SERVING_NATIVE": "0"}
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


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
        _bag(backend, table, ids, offsets, w, "mean", True, True)
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
    out = _bag(backend, table, ids, offsets, w, "mean", True, True)
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
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((50, dim)) * 10).astype(dtype)
    if np.dtype(dtype).kind == "f" or dtype is ml_dtypes.bfloat16:
        table[3, 0], table[4, 1] = -0.0, np.nan  # copied as bits
    ids = np.concatenate([[3, 4, 3, 49, 0], rng.integers(0, 50, 200)]).astype(np.int32)
    out = _with_backend(backend, kernels.gather, table, ids)
    assert out.dtype == table.dtype and out.ctypes.data % 64 == 0
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))
    # a table whose rows are not contiguous takes the plain copy (bits compared: NaN and
    # -0.0 included, whatever ml_dtypes' NaN comparison of a bfloat16 array)
    wide = np.repeat(table, 2, axis=1)[:, ::2]
    out = _with_backend(backend, kernels.gather, wide, ids)
    assert out.dtype == table.dtype
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_sparse_check_follows_the_backend(backend, monkeypatch):
    """`inputs`' check of sparse indices (`sparse_index.sparse_offsets`) runs the
    serving kernels' backend in use; without it installed, its numpy form: the same
    answers."""
    idx = np.array([[0, 1], [0, 3], [2, 0], [2, 2]], np.int64)
    want = np.array([0, 2, 2, 4, 4])
    got, bad = _with_backend(backend, sparse_index.sparse_offsets, idx, (4, 5))
    assert bad == -1
    np.testing.assert_array_equal(got, want)
    seen = []
    monkeypatch.setattr(MODULES[backend], "sparse_offsets", lambda *a: seen.append(a) or (None, 3))
    assert _with_backend(backend, sparse_index.sparse_offsets, idx, (4, 5)) == (None, 3)
    assert len(seen) == 1
    previous = sparse_index.set_kernel(None)
    try:
        got, bad = sparse_index.sparse_offsets(idx, (4, 5))
        np.testing.assert_array_equal(got, want)
        assert sparse_index.sparse_offsets(idx[::-1], (4, 5)) == (None, 1)
    finally:
        sparse_index.set_kernel(previous)
    assert previous == kernels.sparse_offsets


def test_output_pool_reuses_only_unreferenced_buffers():
    import jax

    previous = pool.set_output_pool_limit(64 << 20)
    try:
        a = pool.output_empty((100, 64), np.float32)
        a[...] = 1
        held = jax.device_put(a, may_alias=True)
        view = a[3:5]
        del a
        b = pool.output_empty((100, 64), np.float32)  # a is still referenced twice over
        assert not np.shares_memory(b, view)
        b[...] = 2
        del held
        c = pool.output_empty((100, 64), np.float32)  # the numpy view still holds it
        assert not np.shares_memory(c, view)
        np.testing.assert_array_equal(view, 1)
        addr = view.ctypes.data - 3 * 64 * 4
        del view, b, c
        # free again: reused (once jaxlib lets go of the numpy array `held` aliased)
        d, e, g = (pool.output_empty((100, 64), np.float32) for _ in range(3))
        assert addr in (d.ctypes.data, e.ctypes.data, g.ctypes.data)
        assert d.ctypes.data % 64 == 0
        pool.set_output_pool_limit(0)  # no pooling: every buffer is fresh
        del d, e, g
        assert pool._pool.free_bytes() == 0
        f = pool.output_empty((100, 64), np.float32)
        del f
        assert pool._pool.free_bytes() == 0
    finally:
        pool.set_output_pool_limit(previous)


def test_output_pool_limit_bounds_the_free_buffers_oldest_go_first(monkeypatch):
    from embedmesh import _runtime

    fresh = []
    real = _runtime.aligned_buffer
    monkeypatch.setattr(_runtime, "aligned_buffer", lambda *a: fresh.append(a) or real(*a))
    one = 1024 * 4  # bytes of a (1024,) float32 buffer
    previous = pool.set_output_pool_limit(2 * one + 100)
    try:
        a = pool.output_empty((1024,), np.float32)
        b = pool.output_empty((32, 32), np.float32)  # the same bytes, another shape
        c = pool.output_empty((1000,), np.float32)
        addr_b, addr_c = b.ctypes.data, c.ctypes.data
        assert pool._pool.free_bytes() == 0 and len(fresh) == 3  # in use: not the pool's
        del a
        del c
        assert pool._pool.free_bytes() == one + 4000
        del b  # no room for a third: the oldest freed (a's) goes
        assert pool._pool.free_bytes() == one + 4000
        x = pool.output_empty((1024,), np.float32)
        assert x.ctypes.data == addr_b and len(fresh) == 3
        y = pool.output_empty((1024,), np.float32)  # a's was dropped: a fresh one
        assert len(fresh) == 4 and not np.shares_memory(x, y)
        z = pool.output_empty((10, 100), np.float32)
        assert z.ctypes.data == addr_c and pool._pool.free_bytes() == 0 and len(fresh) == 4
        big = pool.output_empty((4096,), np.float32)  # over the limit: never kept
        del big
        assert pool._pool.free_bytes() == 0
    finally:
        pool.set_output_pool_limit(previous)


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
    previous = pool.set_output_pool_limit(n * nbytes + nbytes // 2)
    try:
        held = None
        for request in range(8):
            outs = [pool.output_empty(shape, np.float32) for _ in range(n)]
            for o in outs:
                o[...] = request
            assert len(fresh) == n * min(request + 1, 2), request
            assert held is None or not any(np.shares_memory(o, h) for o in outs for h in held)
            held = outs
        assert held[0][0, 0] == 7
    finally:
        pool.set_output_pool_limit(previous)


def test_output_pool_hands_out_non_native_dtypes_over_the_same_memory():
    import ml_dtypes

    previous = pool.set_output_pool_limit(1 << 20)
    try:
        a, addr = pool.output_empty_at((3, 5), ml_dtypes.bfloat16)
        assert a.dtype == ml_dtypes.bfloat16 and a.shape == (3, 5) and addr % 64 == 0
        assert a.ctypes.data == addr and a.flags.writeable and a.flags.c_contiguous
        a[...] = 1.5
        b, addr_b = pool.output_empty_at((5, 3), np.dtype(">f4"))
        assert b.dtype == np.dtype(">f4") and b.ctypes.data == addr_b != addr
        del a
        c, addr_c = pool.output_empty_at((15,), np.float16)  # the same 30 bytes
        assert addr_c == addr and c.dtype == np.float16
    finally:
        pool.set_output_pool_limit(previous)
