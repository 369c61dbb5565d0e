"""The C++ serving kernels (`embedmesh/serving/cpu/serving.cc`) against float64 numpy.

Row widths cover every code path of the build's vector width (16 floats with AVX-512,
8 with AVX2): one register block of up to 16 vectors with and without a masked tail (the
one-pass kernel: dims up to 256 with AVX-512, 128 with AVX2), several blocks (the
two-pass kernel beyond), and both the one-pass and the two-pass kernel
(`EmServingSetFused`) for every width. Outputs are poisoned (NaN) before the
kernels write them; tables are random; weights are quarters (exact sums).
"""

from __future__ import annotations

import numpy as np
import pytest
from bag_reference import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh.serving import kernels, lookup, native, pool, request
from embedmesh.serving.backends import native as native_backend

pytestmark = pytest.mark.skipif(
    not kernels.HAVE_NATIVE, reason=f"no C++ serving kernels: {native.reason()}"
)

DIMS = [1, 3, 7, 8, 15, 16, 17, 31, 48, 64, 100, 127, 128, 129, 255, 256, 257, 300, 520]
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(autouse=True)
def native_kernels(native_poisoned):
    """The native backend, outputs poisoned (conftest); the one-pass kernel back on after."""
    yield
    native.library().EmServingSetFused(1)


@st.composite
def bags(draw):
    dim = draw(st.sampled_from(DIMS))
    vocab = draw(st.integers(1, 40))
    counts = draw(st.lists(st.integers(0, 7), max_size=9))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n = int(offsets[-1])
    prune_ids = draw(st.booleans())
    ids = np.asarray(
        draw(st.lists(st.integers(-2 if prune_ids else 0, vocab - 1), min_size=n, max_size=n)),
        dtype=draw(st.sampled_from([np.int32, np.int64])),
    )
    weights = None
    if draw(st.booleans()):
        weights = (
            np.asarray(draw(st.lists(st.integers(-6, 8), min_size=n, max_size=n)), np.float32) / 4
        )
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    prune_weights = draw(st.booleans())
    fused = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    table = np.random.default_rng(seed).standard_normal((vocab, dim)).astype(np.float32)
    return table, ids, offsets, weights, combiner, prune_ids, prune_weights, fused


@SETTINGS
@given(problem=bags())
def test_bag_matches_float64_reference(problem):
    table, ids, offsets, weights, combiner, prune_ids, prune_weights, fused = problem
    native.library().EmServingSetFused(int(fused))
    out = kernels.bag_combine(
        table, ids, offsets, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )
    assert out.shape == (len(offsets) - 1, table.shape[1]) and out.dtype == np.float32
    assert not np.isnan(out).any(), "an output element was never written"
    want, scale, _ = reference(table, ids, offsets, weights, combiner, prune_ids, prune_weights)
    counts = np.diff(offsets)
    tol = (4 * (counts + 2) * 2.0**-24 * scale)[:, None] + 2.0**-24 * np.abs(want)
    assert np.all(np.abs(out - want) <= tol + 1e-30), np.max(np.abs(out - want))


@SETTINGS
@given(problem=bags())
def test_one_pass_and_two_pass_kernels_agree_bit_for_bit(problem):
    table, ids, offsets, weights, combiner, prune_ids, prune_weights, _ = problem
    outs = []
    for fused in (1, 0):
        native.library().EmServingSetFused(fused)
        kw = {"prune_ids": prune_ids, "prune_weights": prune_weights}
        outs.append(kernels.bag_combine(table, ids, offsets, weights, combiner, **kw).copy())
    np.testing.assert_array_equal(outs[0], outs[1])
    kernels.set_backend("numpy")
    ref = kernels.bag_combine(
        table, ids, offsets, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )
    if combiner == "sum":  # same products added in the same order as the numpy backend
        np.testing.assert_array_equal(outs[0], ref)


@pytest.mark.parametrize("fused", [1, 0])
@pytest.mark.parametrize("dim", [16, 100, 300])
def test_out_of_range_id_names_the_entry(fused, dim):
    native.library().EmServingSetFused(fused)
    table = np.ones((10, dim), np.float32)
    ids = np.array([1, 2, -1, 3, 10, 4], np.int64)
    offsets = np.array([0, 3, 6])
    # id -1 is pruned; id 10 (entry 4) is outside the table
    with pytest.raises(kernels.IdOutOfRange, match="got id 10 at entry 4"):
        kernels.bag_combine(table, ids, offsets, None, "sum", prune_ids=True)
    with pytest.raises(kernels.IdOutOfRange, match="got id -1 at entry 2"):
        kernels.bag_combine(table, ids, offsets, None, "sum")


@SETTINGS
@given(problem=bags(), fused=st.booleans(), past=st.integers(1, 3), where=st.integers(0, 10**6))
def test_first_kept_bad_id_is_the_error_whatever_pruning_drops(problem, fused, past, where):
    """Ids outside the table among pruned ones: the error names the first entry TensorFlow
    would keep (ids < 0 pruned, then weights not > 0), pruned bad ids are no error."""
    table, ids, offsets, weights, combiner, prune_ids, prune_weights, _ = problem
    if ids.size == 0:
        return
    ids = ids.copy()
    vocab = table.shape[0]
    ids[where % ids.size] = vocab - 1 + past  # outside the table
    if where % 3 == 0:
        ids[(where // 7) % ids.size] = -1 - past  # negative: an error unless pruned
    native.library().EmServingSetFused(int(fused))
    kept = [
        k
        for k in range(ids.size)
        if not (prune_ids and ids[k] < 0)
        and not (prune_weights and weights is not None and not weights[k] > 0)
    ]
    bad = [k for k in kept if not 0 <= ids[k] < vocab]
    run = lambda: kernels.bag_combine(
        table, ids, offsets, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )
    if not bad:
        out = run()
        want, _, _ = reference(table, ids, offsets, weights, combiner, prune_ids, prune_weights)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        return
    with pytest.raises(kernels.IdOutOfRange) as err:
        run()
    assert err.value.entry == bad[0], (err.value.entry, bad)


@SETTINGS
@given(
    dim=st.sampled_from(DIMS + [4, 32]),
    dtype=st.sampled_from([np.float32, np.float16, np.int8, np.float64]),
    n=st.integers(0, 40),
    seed=st.integers(0, 2**31),
)
def test_gather_is_bit_exact(dim, dtype, n, seed):
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((50, dim)) * 100).astype(dtype)
    ids = rng.integers(0, 50, n)
    out = kernels.gather(table, ids)
    assert out.dtype == table.dtype and (n == 0 or out.ctypes.data % 64 == 0)
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))


def test_bag_on_a_strided_table_and_low_precision_tables():
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((30, 40)).astype(np.float32)
    table = wide[:, 3:20]  # rows not contiguous with each other
    ids = rng.integers(0, 30, 25)
    offsets = np.array([0, 5, 5, 17, 25])
    out = kernels.bag_combine(table, ids, offsets, None, "mean")
    want, _, _ = reference(table, ids, offsets, None, "mean", False, False)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    half = table.astype(np.float16)
    out16 = kernels.bag_combine(half, ids, offsets, None, "sum")
    assert out16.dtype == np.float16
    want16, _, _ = reference(half, ids, offsets, None, "sum", False, False)
    np.testing.assert_allclose(out16.astype(np.float64), want16, rtol=2e-3, atol=2e-3)


def _assert_offsets_like_numpy(idx, shape):
    """The C++ offsets pass gives numpy's offsets, or names the same first bad entry."""
    got = kernels.sparse_offsets(idx, shape)
    kernels.set_backend("numpy")
    want = kernels.sparse_offsets(idx, shape)
    assert got[1] == want[1]
    if want[0] is None:
        assert got[0] is None
    else:
        np.testing.assert_array_equal(got[0], want[0])


@SETTINGS
@given(
    rows=st.lists(st.integers(0, 4), max_size=12),
    cols=st.integers(1, 5),
    rank3=st.booleans(),
    idx64=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_sparse_offsets_match_numpy(rows, cols, rank3, idx64, shuffle, seed):
    rng = np.random.default_rng(seed)
    entries = sorted({(r, int(rng.integers(0, cols))) for r in rows})
    idx = np.array(entries, np.int64).reshape(-1, 2)
    shape = (5, cols)
    if rank3:  # [5, 2, cols]: the leading dims flattened
        idx = np.stack([idx[:, 0] // 3, idx[:, 0] % 2, idx[:, 1]], 1)
        shape = (2, 2, cols)
        idx = idx[np.lexsort(idx.T[::-1])] if len(idx) else idx.reshape(0, 3)
    if shuffle and len(idx) > 1:
        idx = idx[::-1].copy()
    _assert_offsets_like_numpy(idx.astype(np.int64 if idx64 else np.int32), shape)


def _coo(offsets, rng, extra_cols=3):
    """Row-major COO indices [n, 2] of bags given by offsets: each row's columns
    strictly increasing, with gaps; and the dense_shape's column count."""
    counts = np.diff(offsets)
    width = int(counts.max(initial=0)) + extra_cols
    cols = [np.sort(rng.choice(width, int(c), replace=False)) for c in counts]
    rows = np.repeat(np.arange(len(counts)), counts)
    col = np.concatenate(cols).astype(np.int64) if cols else np.zeros(0, np.int64)
    return np.stack([rows, col], 1).reshape(-1, 2), width


@SETTINGS
@given(problem=bags(), idx64=st.booleans())
def test_sparse_bag_matches_float64_reference(problem, idx64):
    """The sparse bag that checks the indices when it runs (offsets in EmServingRun's
    first phase, then the bag kernel) against float64 loops, and bit for bit against
    the offsets kernel on the offsets the indices give."""
    table, ids, offsets, weights, combiner, prune_ids, prune_weights, _ = problem
    rng = np.random.default_rng(len(ids))
    idx, width = _coo(offsets, rng)
    idx = idx.astype(np.int64 if idx64 else np.int32)
    shape = (len(offsets) - 1, width)
    run = kernels.prepare_sparse_bag_combine(
        table, ids, idx, shape, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )
    assert run is not None
    out = run().copy()
    assert out.shape == (shape[0], table.shape[1]) and not np.isnan(out).any()
    want, scale, _ = reference(table, ids, offsets, weights, combiner, prune_ids, prune_weights)
    tol = (4 * (np.diff(offsets) + 2) * 2.0**-24 * scale)[:, None] + 2.0**-24 * np.abs(want)
    assert np.all(np.abs(out - want) <= tol + 1e-30), np.max(np.abs(out - want))
    same = kernels.bag_combine(
        table, ids, offsets, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )
    np.testing.assert_array_equal(out, same)


@pytest.mark.parametrize("dim", [16, 100])
def test_sparse_bag_errors_bad_index_first(dim):
    """A bad index is reported (its entry) before any bad id, wherever each lies; a
    bad id alone is reported by entry as bag_combine does."""
    rng = np.random.default_rng(dim)
    offsets = np.array([0, 3, 3, 7, 12], np.int64)
    idx, width = _coo(offsets, rng)
    table = rng.standard_normal((20, dim)).astype(np.float32)
    ids = rng.integers(0, 20, 12)
    shape = (4, width)

    def run(ids, idx):
        return kernels.prepare_sparse_bag_combine(table, ids, idx, shape, None, "sum")()

    bad_ids = ids.copy()
    bad_ids[2] = 20
    with pytest.raises(kernels.IdOutOfRange) as e:
        run(bad_ids, idx)
    assert (e.value.entry, e.value.id) == (2, 20)
    for k, change in [(9, (1, 0)), (9, (0, width)), (4, (0, -1)), (0, (-1, 0)), (11, (1, 0))]:
        bad_idx = idx.copy()
        bad_idx[k] = idx[k] + np.array(change) if change != (0, -1) else idx[k - 1]
        if change == (-1, 0):
            bad_idx[k, 0] = -1
        _, want = kernels.sparse_offsets(bad_idx, shape)
        assert want >= 0
        for i in (ids, bad_ids):  # with a bad id at entry 2 too
            with pytest.raises(kernels.BadSparseIndex) as e:
                run(i, bad_idx)
            assert e.value.entry == want


@pytest.mark.parametrize("dim", [17, 64])
@pytest.mark.parametrize("case", ["good", "bad_id", "bad_index", "both", "weights"])
def test_lookup_sparse_checking_kernels_equal_offsets_path(case, dim, monkeypatch):
    """serving_embedding_lookup on 2-D sparse input: the kernels that check the indices
    when they run (offsets in EmServingRun's first phase) give the Python offsets path's
    outputs bit for bit and its errors word for word."""
    import embedmesh as em

    rng = np.random.default_rng(7)
    offsets = np.array([0, 2, 2, 6, 9], np.int64)
    idx, width = _coo(offsets, rng)
    ids = rng.integers(0, 30, 9)
    w = None
    if case in ("bad_id", "both"):
        ids[5] = 30
    if case in ("bad_index", "both"):
        idx[7] = idx[6]
    if case == "weights":
        ids[1] = -1
        w = em.SparseTensor(idx, (rng.integers(-2, 8, 9) / 4).astype(np.float32), (4, width))
    tc = em.TableConfig(30, dim, combiner="mean", name="t")
    fc = {"f": em.FeatureConfig(tc, name="f")}
    tables = {tc: rng.standard_normal((30, dim)).astype(np.float32)}
    inputs = {"f": em.SparseTensor(idx, ids, (4, width))}
    weights = None if w is None else {"f": w}
    used = []
    real = kernels.prepare_sparse_bag_combine
    monkeypatch.setattr(
        kernels, "prepare_sparse_bag_combine", lambda *a, **k: used.append(1) or real(*a, **k)
    )
    results = []
    # the compiled rules, the general path with the checking kernels,
    # the general path with Python's offsets
    for path in ("fast", "checking kernels", "python offsets"):
        if path == "checking kernels":
            monkeypatch.setattr(lookup, "_serve", None)  # no compiled rules: the general path
            monkeypatch.setattr(request, "served", None)
            monkeypatch.setattr(request, "compiled", None)
        if path == "python offsets":
            monkeypatch.setattr(kernels, "prepare_sparse_bag_combine", lambda *a, **k: None)
        try:
            results.append(np.array(em.serving_embedding_lookup(inputs, weights, tables, fc)["f"]))
        except ValueError as e:
            results.append(str(e))
    assert used
    if case in ("good", "weights"):
        assert not np.isnan(results[0]).any()
        np.testing.assert_array_equal(results[0], results[1])
        np.testing.assert_array_equal(results[0], results[2])
    else:
        assert isinstance(results[0], str) and results[0] == results[1] == results[2]
        assert ("sorted in row-major order" in results[0]) == (case != "bad_id")


@pytest.mark.parametrize("idx64", [True, False])
def test_sparse_offsets_across_blocks(idx64):
    """The branchless offsets pass checks 1024 entries a block: a bad entry in a later
    block, and good input spanning several blocks with empty rows, against numpy."""
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, 1500)
    counts[::7] = 0
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    idx, width = _coo(offsets, rng)
    idx = idx.astype(np.int64 if idx64 else np.int32)
    shape = (len(counts), width)
    got, bad = kernels.sparse_offsets(idx, shape)
    assert bad == -1
    np.testing.assert_array_equal(got, offsets)
    assert len(idx) > 2100
    for k, value in [(2100, (len(counts), 0)), (1100, (idx[1099, 0], idx[1099, 1]))]:
        broken = idx.copy()
        broken[k] = value
        assert kernels.sparse_offsets(broken, shape) == (None, k)


@SETTINGS
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    idx64=st.booleans(),
    damage=st.sampled_from(["none", "row", "col", "negative", "repeat", "order"]),
    where=st.integers(0, 10**6),
    seed=st.integers(0, 2**31),
)
def test_sparse_offsets_8_entries_a_step(counts, idx64, damage, where, seed):
    """The offsets pass 8 entries a step (AVX-512 builds): rows ending inside and across
    steps, empty rows, a tail of under 8, and one bad entry anywhere (outside the shape,
    negative, a repeat, out of order) named as numpy names it."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    idx, width = _coo(offsets, rng)
    shape = (len(counts), width)
    n = len(idx)
    if damage != "none" and n:
        k = where % n
        if damage == "row":
            idx[k, 0] = len(counts) + where % 3
        elif damage == "col":
            idx[k, 1] = width + where % 3
        elif damage == "negative":
            idx[k, where % 2] = -1 - where % 3
        elif damage == "repeat" and k > 0:
            idx[k] = idx[k - 1]
        elif damage == "order" and k > 0:
            idx[[k - 1, k]] = idx[[k, k - 1]]
    _assert_offsets_like_numpy(idx.astype(np.int64 if idx64 else np.int32), shape)


# ---------------------------------------------------------------------------
# EmServingRun: a request's kernels in one call, in chunks, on a pool of threads


def _task(rng, kind, n, dim, vocab, bad=()):
    """A prepared native call of `kind` (bag, sparse, gather) over ~n entries, with ids
    outside the table at the entries in `bad` (sparse: offsets in the run's first phase,
    task kind 3)."""
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    if kind == "gather":
        ids = rng.integers(0, vocab, n)
        ids[list(bad)] = vocab + 3
        return lambda: kernels.prepare_gather(table, ids)
    lengths = rng.poisson(6, max(n // 6, 1))
    lengths[rng.integers(0, lengths.size)] += 3000  # one long bag: chunks by entries
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(-1, vocab, int(offsets[-1])).astype(rng.choice([np.int32, np.int64]))
    ids[[b % ids.size for b in bad]] = vocab + 5
    w = (rng.integers(-2, 8, ids.size) / 4).astype(np.float32) if rng.random() < 0.5 else None
    combiner = rng.choice(["sum", "mean", "sqrtn"])
    if kind == "sparse":
        idx, width = _coo(offsets, rng)
        return lambda: kernels.prepare_sparse_bag_combine(
            table,
            ids,
            idx,
            (offsets.size - 1, width),
            w,
            combiner,
            prune_ids=True,
            prune_weights=w is not None,
        )
    return lambda: kernels.prepare_bag_combine(
        table, ids, offsets, w, combiner, prune_ids=True, prune_weights=w is not None
    )


def _outcome(call, code=None):
    try:
        return call() if code is None else call.finish(code)
    except (kernels.IdOutOfRange, kernels.BadSparseIndex) as e:
        return (type(e).__name__, e.entry)


@settings(max_examples=12, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["bag", "sparse", "gather"]), min_size=1, max_size=5),
    threads=st.integers(1, 4),
    sizes=st.lists(st.integers(0, 30_000), min_size=5, max_size=5),
    dims=st.lists(st.sampled_from([1, 8, 17, 32, 64, 100, 300]), min_size=5, max_size=5),
    bad=st.lists(st.integers(0, 30_000), max_size=3),
    bad_task=st.integers(0, 4),
    seed=st.integers(0, 2**31),
)
def test_run_native_equals_each_kernel_alone(kinds, threads, sizes, dims, bad, bad_task, seed):
    """A request's kernels in one EmServingRun, or handed over one by one (split into
    chunks of whole bags or id ranges on 1-4 threads), give each kernel's own output bit
    for bit, and its own error: the first bad entry of the whole task whichever chunk
    holds it."""
    rng = np.random.default_rng(seed)
    makers = []
    for i, kind in enumerate(kinds):
        dim, n = dims[i], sizes[i]
        marks = [b % n for b in bad] if (i == bad_task % len(kinds) and n) else []
        makers.append(_task(rng, kind, n, dim, 50, marks))
    alone = [_outcome(make()) for make in makers]
    calls = [make() for make in makers]
    assert all(native_backend.is_native_call(c) for c in calls)
    if seed % 2:  # one call (EmServingRun)
        codes = native_backend.run_native(calls, threads)
    else:  # handed over one by one (EmServingOpen / Add / Close)
        request = native_backend.NativeRequest(len(calls), threads)
        for c in calls:
            request.add(c)
        codes = request.close()
    together = [_outcome(c, code) for c, code in zip(calls, codes)]
    for a, t in zip(alone, together):
        if isinstance(a, tuple):
            assert a == t
        else:
            assert not np.isnan(t).any(), "an output element was never written"
            np.testing.assert_array_equal(a, t)


def test_run_native_from_many_request_threads_at_once():
    """Requests on several Python threads at once: one holds the pool, the others run on
    their own threads; every result is each kernel's own."""
    import concurrent.futures

    rng = np.random.default_rng(3)
    makers = [_task(rng, k, 20_000, 64, 200) for k in ("bag", "gather", "bag", "sparse")]
    want = [make()().copy() for make in makers]

    def request(_):
        calls = [make() for make in makers]
        codes = native_backend.run_native(calls, 2)
        return [c.finish(code).copy() for c, code in zip(calls, codes)]

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for got in ex.map(request, range(16)):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)


@pytest.mark.filterwarnings("ignore:os.fork")
def test_run_native_in_a_forked_child():
    """A child forked after the pool started gets a pool of its own (the parent's threads
    do not exist there): its request finishes with the right result."""
    import os
    import time

    rng = np.random.default_rng(4)
    makers = [_task(rng, "bag", 20_000, 32, 100) for _ in range(3)]
    want = [make()() for make in makers]
    calls = [make() for make in makers]
    native_backend.run_native(calls, 2)  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = 1
        try:
            calls = [make() for make in makers]
            codes = native_backend.run_native(calls, 2)
            ok = int(not all(np.array_equal(c.finish(k), w) for c, k, w in zip(calls, codes, want)))
        finally:
            os._exit(ok)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's request did not finish (a pool without threads?)")


def _lookup_problem(rng, n_features=6, dim=24, batch=3000):
    import embedmesh as em

    tcs = [em.TableConfig(500, dim, combiner="mean", name=f"t{i}") for i in range(n_features)]
    fcs = {f"f{i}": em.FeatureConfig(tc, name=f"f{i}") for i, tc in enumerate(tcs)}
    tables = {tc: rng.standard_normal((500, dim)).astype(np.float32) for tc in tcs}
    inputs = {}
    for i in range(n_features):
        lengths = rng.poisson(5, batch)
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        inputs[f"f{i}"] = em.RaggedTensor(rng.integers(0, 500, int(splits[-1])), splits)
    return fcs, tables, inputs


@pytest.mark.parametrize("threads", [2, 3])
def test_lookup_on_threads_hands_features_over_as_prepared(threads):
    """The lookup on several threads (each feature handed to the pool once prepared)
    equals the lookup on one, with a feature in the middle that is no C++ kernel call
    (uint64 ids: the kernels' error names them as given) and one whose input is bad
    (its error, and the lookups after it still right: the request was closed)."""
    import embedmesh as em
    from embedmesh.serving import lookup

    rng = np.random.default_rng(11)
    fcs, tables, inputs = _lookup_problem(rng)
    mixed = dict(inputs)
    mixed["f2"] = em.RaggedTensor(inputs["f2"].values.astype(np.uint64), inputs["f2"].row_splits)
    previous = lookup.set_host_threads(1)
    try:
        want = {
            k: np.asarray(v)
            for k, v in em.serving_embedding_lookup(mixed, None, tables, fcs).items()
        }
        lookup.set_host_threads(threads)
        for _ in range(3):
            got = em.serving_embedding_lookup(mixed, None, tables, fcs)
            for k in want:
                np.testing.assert_array_equal(np.asarray(got[k]), want[k])
        bad = dict(inputs)
        splits = np.array(inputs["f4"].row_splits)
        splits[5] = splits[4] - 1  # decreasing
        bad["f4"] = em.RaggedTensor(inputs["f4"].values, splits)
        with pytest.raises(ValueError, match="f4"):
            em.serving_embedding_lookup(bad, None, tables, fcs)
        bad_id = dict(inputs)
        ids = np.array(inputs["f3"].values)
        ids[-1] = 500
        bad_id["f3"] = em.RaggedTensor(ids, inputs["f3"].row_splits)
        with pytest.raises(ValueError, match="f3"):
            em.serving_embedding_lookup(bad_id, None, tables, fcs)
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        for k in want:
            if k != "f2":
                np.testing.assert_array_equal(np.asarray(got[k]), want[k])
    finally:
        lookup.set_host_threads(previous)


@pytest.mark.parametrize(
    "entries, threads, want",
    [
        ([5000], 4, 1),
        ([3000, 3000, 3000], 2, 1),
        ([10000, 10000], 2, 2),
        ([100_000], 4, 4),
        ([20_000], 8, 2),
        ([0], 3, 1),
    ],
)
def test_a_small_request_runs_on_fewer_threads(entries, threads, want):
    """A request is shared only among threads with at least 8,192 entries each (waking
    a pool thread costs more than a smaller share saves), counted from what each task was
    given (a ragged task's id count, a sparse one's entries), never its unchecked offsets."""
    lib = native.library()
    min_entries = lib.EmServingSetMinEntriesPerThread(8192)
    try:
        rows = []
        for i, n in enumerate(entries):
            kind = (4, 3, 2)[i % 3]  # checked bag (w[15]), sparse offsets bag (w[17]), gather
            w = [kind] + [0] * (native_backend.TASK_WORDS - 1)
            w[{4: 15, 3: 17, 2: 7}[kind]] = n
            w[7 if kind != 2 else 8] = 0 if kind == 2 else 1  # unchecked offsets: never read
            rows += w
        import array

        words = array.array("q", rows)
        got = lib.EmServingThreadsFor(words.buffer_info()[0], len(entries), threads)
        assert got == want
    finally:
        lib.EmServingSetMinEntriesPerThread(min_entries)


@pytest.mark.parametrize("dim", [16, 17, 48, 64, 80, 128, 300])
@pytest.mark.parametrize("threads", [1, 3])
def test_streamed_outputs_equal_cached_ones(dim, threads):
    """Outputs of 256 KB or more are written with streaming stores where their rows sit
    on 64-byte lines (EmServingSetStreamOutput): the same values bit for bit as plain
    stores, on one thread and in the runner's chunks (which judge by the whole task's
    output), and the float64 reference's."""
    lib = native.library()
    rng = np.random.default_rng(dim)
    rows = (300 << 10) // (4 * dim) + 7  # over 256 KB of output
    table = rng.standard_normal((1000, dim)).astype(np.float32)
    lengths = rng.poisson(3, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, 1000, int(offsets[-1]))
    weights = (rng.integers(1, 8, ids.shape[0]) / 4).astype(np.float32)
    outs = []
    previous = lib.EmServingSetStreamOutput(1)
    try:
        for stream in (1, 0):
            lib.EmServingSetStreamOutput(stream)
            alone = kernels.bag_combine(table, ids, offsets, weights, "mean")
            call = kernels.prepare_bag_combine(table, ids, offsets, weights, "mean")
            together = call.finish(native_backend.run_native([call], threads)[0])
            np.testing.assert_array_equal(alone, together)
            outs.append(np.array(alone))
    finally:
        lib.EmServingSetStreamOutput(previous)
    np.testing.assert_array_equal(outs[0], outs[1])
    want, scale, _ = reference(table, ids, offsets, weights, "mean", False, False)
    assert (np.abs(outs[0] - want) <= 1e-5 * scale[:, None] + 1e-30).all()


@pytest.mark.parametrize("dim", [1, 7, 15, 16, 17, 31, 32, 33, 48])
@pytest.mark.parametrize("weighted", [False, True])
def test_rows_on_64_byte_lines_give_the_same_sums(dim, weighted):
    """A table whose rows start on 64-byte lines takes the kernels that prefetch fewer
    lines an entry (EmServingSetAlignedPrefetch): the same values bit for bit as the
    same rows 16 bytes past a line and as with the switch off, and the float64
    reference's."""
    from embedmesh import _runtime

    lib = native.library()
    rng = np.random.default_rng(dim)
    stride = -(-dim // 16) * 16  # floats: rows on 64-byte lines

    def rows_at(skip):  # a [500, dim] view whose rows start `skip` floats past a line
        raw = _runtime.aligned_empty((500 * stride + 4,), np.float32, 64)
        raw[...] = np.nan  # poison: the padding is never read
        return raw[skip : skip + 500 * stride].reshape(500, stride)[:, :dim]

    aligned, shifted = rows_at(0), rows_at(4)
    aligned[...] = rng.standard_normal((500, dim)).astype(np.float32)
    shifted[...] = aligned
    assert pool.address(aligned) % 64 == 0 and pool.address(shifted) % 64 == 16
    lengths = rng.poisson(4, 300)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, 500, int(offsets[-1]))
    weights = (rng.integers(1, 8, ids.shape[0]) / 4).astype(np.float32) if weighted else None
    previous = lib.EmServingSetAlignedPrefetch(1)
    try:
        on = kernels.bag_combine(aligned, ids, offsets, weights, "sum")
        lib.EmServingSetAlignedPrefetch(0)
        off = kernels.bag_combine(aligned, ids, offsets, weights, "sum")
    finally:
        lib.EmServingSetAlignedPrefetch(previous)
    np.testing.assert_array_equal(on, off)
    np.testing.assert_array_equal(on, kernels.bag_combine(shifted, ids, offsets, weights, "sum"))
    want, scale, _ = reference(aligned, ids, offsets, weights, "sum", False, False)
    assert (np.abs(on - want) <= 1e-5 * scale[:, None] + 1e-30).all()


@pytest.mark.parametrize("row_bytes", [4, 12, 28, 64, 100, 400, 404, 1000, 4096, 4100])
@pytest.mark.parametrize("offset", [0, 4, 16, 60])
def test_gather_of_long_outputs_at_any_alignment(row_bytes, offset):
    """The gather's output streamed through its staging buffer (outputs of 64 KB and more
    whose rows are not whole 64-byte lines): every row byte for byte, at any offset of the
    output from a line, nothing written outside it, a bad id stopping it with the rows
    before it written (the rows after it untouched), and the same split into two chunks
    (the runner's threads) as in one."""
    lib = native.library()
    rng = np.random.default_rng(row_bytes + offset)
    vocab = 97
    table = rng.integers(0, 256, (vocab, row_bytes + 8), dtype=np.uint8)  # row stride > row
    n = (200 << 10) // row_bytes + 3
    ids = rng.integers(0, vocab, n).astype(np.int64)
    want = table[ids, :row_bytes].reshape(-1)
    stride = table.strides[0]

    def run(ids, pieces):
        buf = np.full(n * row_bytes + offset + 256, 0xAB, np.uint8)
        base = pool.address(buf) + (-pool.address(buf)) % 64 + offset
        start = base - pool.address(buf)
        codes = []
        for j in range(pieces):
            lo, hi = n * j // pieces, n * (j + 1) // pieces
            codes.append(
                lib.EmServingGather(
                    pool.address(table), vocab, row_bytes, stride,
                    pool.address(ids) + 8 * lo, 1, hi - lo, base + lo * row_bytes,
                )
            )  # fmt: skip
        return buf, start, codes

    for pieces in (1, 2):
        buf, start, codes = run(ids, pieces)
        assert codes == [-1] * pieces
        np.testing.assert_array_equal(buf[start : start + n * row_bytes], want)
        assert (buf[:start] == 0xAB).all() and (buf[start + n * row_bytes :] == 0xAB).all()
    bad_at = n // 2 + 1
    bad = ids.copy()
    bad[bad_at] = vocab
    buf, start, codes = run(bad, 1)
    assert codes == [bad_at]
    written = bad_at * row_bytes
    np.testing.assert_array_equal(buf[start : start + written], want[:written])
    assert (buf[start + written :] == 0xAB).all() and (buf[:start] == 0xAB).all()
