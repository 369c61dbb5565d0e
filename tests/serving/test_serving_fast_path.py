"""The serving lookup's fast path (`embedmesh/serving/fast_path.py`) against the general
host path and float64 numpy.

The fast path must take every common input (ragged, 2-D sparse and dense ids without
weights on float32 tables), give the general path's outputs bit for bit (and the float64
reference's within float32 rounding), hand every other input to the general path, and on
any error let the general path raise exactly the error it always raised. Outputs are
poisoned (0xFF bytes) before the kernels write them.
"""

from __future__ import annotations

import array
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serving import reference_lookup

import embedmesh as em
from embedmesh.serving import fast_path, kernels, lookup, native, pool
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.quantized import QuantizedTable, quantize_table

pytestmark = pytest.mark.skipif(
    not kernels.HAVE_NATIVE, reason=f"no C++ serving kernels: {native.reason()}"
)

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VOCAB = 300


@pytest.fixture(autouse=True, params=["compiled", "python"])
def request_form(request, native_poisoned, monkeypatch):
    """The native backend, outputs poisoned, tiny requests shared (conftest); every test
    runs on both forms of the fast path's checks: the compiled one
    (`embedmesh.serving._request`, where the install built it) and fast_path.py's."""
    if request.param == "compiled" and not fast_path.compiled_available():
        pytest.skip("embedmesh.serving._request was not built")
    monkeypatch.setattr(fast_path, "_use_compiled", request.param == "compiled")
    _no_served(monkeypatch)
    return request.param


def _no_served(monkeypatch):
    """Every request through the layers these tests spy on or replace (`fast_path.lookup`,
    `lookup_dict`), none straight to `_request.serve` (test_serving_threads.py's
    test_served_requests_equal_the_usual_path covers that one)."""
    monkeypatch.setattr(fast_path, "_use_serve", False)
    monkeypatch.setattr(fast_path, "served", None)


@pytest.fixture
def spy(monkeypatch):
    """What each fast-path call returned: a list of results, or None (the general path).
    A request of a dict model takes `fast_path.lookup_dict` (NotImplemented: not of its
    form, then `fast_path.lookup`), any other `fast_path.lookup`."""
    seen: list = []
    real, real_dict = fast_path.lookup, fast_path.lookup_dict

    def spied(*a, **k):
        out = real(*a, **k)
        seen.append(out)
        return out

    def spied_dict(*a, **k):
        out = real_dict(*a, **k)
        if out is not NotImplemented:
            seen.append(out)
        return out

    _no_served(monkeypatch)
    monkeypatch.setattr(fast_path, "lookup", spied)
    monkeypatch.setattr(fast_path, "lookup_dict", spied_dict)
    return seen


def _general_only(monkeypatch):
    _no_served(monkeypatch)
    monkeypatch.setattr(fast_path, "lookup", lambda *a, **k: None)
    monkeypatch.setattr(fast_path, "lookup_dict", lambda *a, **k: None)


def _lengths(rng, batch, empty_rows):
    lengths = rng.poisson(3, batch)
    if empty_rows:
        lengths[rng.random(batch) < 0.3] = 0
    return lengths


def _feature_input(rng, kind, batch, id_dtype, idx_dtype, empty, negative):
    """One feature's common-case input (empty: no ids at all)."""
    lengths = np.zeros(batch, np.int64) if empty else _lengths(rng, batch, True)
    n = int(lengths.sum())
    ids = rng.integers(0, VOCAB, n).astype(id_dtype)
    if kind == "dense":
        return rng.integers(0, VOCAB, (batch, 0 if empty else 3)).astype(id_dtype)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if kind == "ragged":
        return em.RaggedTensor(ids, splits)
    if negative and n:
        ids[rng.random(n) < 0.2] = -1  # pruned by TensorFlow's safe lookup
    rows = np.repeat(np.arange(batch), lengths)
    cols = np.arange(n) - splits[:-1][rows]
    indices = np.stack([rows, cols], axis=1).astype(idx_dtype)
    return em.SparseTensor(indices, ids, (batch, int(lengths.max(initial=0)) + 2))


@st.composite
def requests(draw):
    n = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["ragged", "sparse", "dense"]), min_size=n, max_size=n))
    dims = draw(
        st.lists(st.sampled_from([1, 7, 8, 16, 17, 33, 64, 100, 128, 257]), min_size=n, max_size=n)
    )
    combiners = draw(st.lists(st.sampled_from(["sum", "mean", "sqrtn"]), min_size=n, max_size=n))
    return dict(
        kinds=kinds,
        dims=dims,
        combiners=combiners,
        batch=draw(st.integers(1, 70)),
        id_dtype=draw(st.sampled_from([np.int32, np.int64])),
        idx_dtype=draw(st.sampled_from([np.int32, np.int64])),
        empty=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        validate=draw(st.booleans()),
        weighted=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        threads=draw(st.sampled_from([1, 2])),
        tables=draw(st.sampled_from(["numpy", "jax", "memmap"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _weights_for(rng, inp):
    """Weights for a ragged or sparse input: quarters in [-0.5, 2] (some not > 0: TensorFlow's
    safe lookup drops those under mean and sqrtn)."""
    values = (rng.integers(-2, 9, inp.values.shape[0]) / 4).astype(np.float32)
    if isinstance(inp, em.RaggedTensor):
        return em.RaggedTensor(values, inp.row_splits)
    return em.SparseTensor(inp.indices, values, inp.dense_shape)


_MAPPED = tempfile.TemporaryDirectory()  # removed when the test process exits


def _memmap(t):
    """`t` as a read-only np.memmap (a served checkpoint's table mapped from its file)."""
    path = os.path.join(_MAPPED.name, f"{len(os.listdir(_MAPPED.name))}.npy")
    np.save(path, t)
    return np.load(path, mmap_mode="r")


def _build(p):
    rng = np.random.default_rng(p["seed"])
    fcs, tables, inputs, weights = {}, {}, {}, {}
    for i, (kind, dim, comb) in enumerate(zip(p["kinds"], p["dims"], p["combiners"])):
        tc = em.TableConfig(VOCAB, dim, combiner=comb, name=f"t{i}")
        fcs[f"f{i}"] = em.FeatureConfig(
            tc, name=f"f{i}", validate_weights_and_indices=p["validate"]
        )
        t = rng.standard_normal((VOCAB, dim)).astype(np.float32)
        tables[tc] = {"numpy": t, "jax": jnp.asarray(t), "memmap": _memmap(t)}[p["tables"]]
        inputs[f"f{i}"] = _feature_input(
            rng, kind, p["batch"], p["id_dtype"], p["idx_dtype"], p["empty"][i], p["validate"]
        )
        if p["weighted"][i] and kind != "dense":
            weights[f"f{i}"] = _weights_for(rng, inputs[f"f{i}"])
    return fcs, tables, inputs, weights or None


def _both_paths(p, fcs, tables, inputs, weights, spy, monkeypatch):
    """The lookup on `p["threads"]` host threads, then again on the general path alone:
    (fast result, general result, whether the first request took the fast path)."""
    previous = lookup.set_host_threads(p["threads"])
    try:
        spy.clear()
        got = em.serving_embedding_lookup(inputs, weights, tables, fcs)
        assert len(spy) == 1
        with monkeypatch.context() as m:
            _general_only(m)
            want = em.serving_embedding_lookup(inputs, weights, tables, fcs)
    finally:
        lookup.set_host_threads(previous)
    return got, want, spy[0] is not None


@SETTINGS
@given(p=requests())
def test_common_inputs_take_the_fast_path_and_equal_the_general_path(p, spy, monkeypatch):
    fcs, tables, inputs, weights = _build(p)
    got, want, fast = _both_paths(p, fcs, tables, inputs, weights, spy, monkeypatch)
    assert fast, "a common request left the fast path"
    for name, fc in fcs.items():
        assert isinstance(got[name], jax.Array)
        _equal_and_near_reference(name, fc, got, want, tables, inputs, weights)


def _equal_and_near_reference(name, fc, got, want, tables, inputs, weights) -> None:
    """Feature `name`'s output equals the other path's bit for bit and the float64
    reference within float32 summation error."""
    g = np.asarray(got[name])
    np.testing.assert_array_equal(g, np.asarray(want[name]), err_msg=name)
    w = (weights or {}).get(name)
    table = np.asarray(tables[fc.table])
    ref = reference_lookup(fc, inputs[name], w, table)
    scale = reference_lookup(fc, inputs[name], w, table, scale=True)
    assert g.shape == ref.shape
    np.testing.assert_array_less(np.abs(g - ref), 1e-5 * (1 + scale) + 1e-30, err_msg=name)


def _quantized(rng, kind, dim):
    """A QuantizedTable of `kind` for a [VOCAB, dim] table (codes: 7 levels)."""
    if kind == "codes":
        values = np.sort(rng.standard_normal(7)).astype(np.float32)
        codes = rng.integers(0, 7, (VOCAB, dim)).astype(np.uint8)
        return QuantizedTable("codes", codes, dim, values)
    return quantize_table(rng.standard_normal((VOCAB, dim)).astype(np.float32), kind)


@settings(SETTINGS, max_examples=25)
@given(
    p=requests(),
    qkinds=st.lists(st.sampled_from(["int8", "fp16", "bf16", "codes"]), min_size=4, max_size=4),
)
def test_quantized_tables_take_the_fast_path_and_equal_the_general_path(
    p, qkinds, spy, monkeypatch
):
    """Ragged and sparse features on int8, fp16 and codes tables (numpy rows) are common:
    the fast path sums them with EmServingBagQ, bit for bit the general path's, within
    float32 summation of the float64 sums of the decoded rows. A dense lookup (a gather of
    float rows) or a bf16 table leaves the request to the general path."""
    fcs, tables, inputs, weights = _build(p)
    rng = np.random.default_rng(p["seed"] + 1)
    tables = {tc: _quantized(rng, k, tc.dim) for tc, k in zip(tables, qkinds)}
    common = all(
        not isinstance(inputs[name], np.ndarray) and tables[fc.table].kind != "bf16"
        for name, fc in fcs.items()
    )
    got, want, fast = _both_paths(p, fcs, tables, inputs, weights, spy, monkeypatch)
    assert fast == common
    for name, fc in fcs.items():
        g = np.asarray(got[name])
        np.testing.assert_array_equal(g, np.asarray(want[name]), err_msg=name)
        w = (weights or {}).get(name)
        decoded = tables[fc.table].dequantize()
        ref = reference_lookup(fc, inputs[name], w, decoded)
        scale = reference_lookup(fc, inputs[name], w, decoded, scale=True)
        assert g.shape == ref.shape
        np.testing.assert_array_less(np.abs(g - ref), 1e-5 * (1 + scale) + 1e-30, err_msg=name)


def _common(rng, n=3, dim=16, batch=20):
    fcs, tables, inputs = {}, {}, {}
    for i in range(n):
        tc = em.TableConfig(VOCAB, dim, combiner="mean", name=f"t{i}")
        fcs[f"f{i}"] = em.FeatureConfig(tc, name=f"f{i}")
        tables[tc] = rng.standard_normal((VOCAB, dim)).astype(np.float32)
        inputs[f"f{i}"] = _feature_input(rng, "ragged", batch, np.int64, np.int64, False, False)
    return fcs, tables, inputs


def _uncommon_cases(rng, fcs, tables, inputs):
    """(what, features, tables, inputs, weights) the fast path must leave to the general path
    (the feature in the middle uncommon, f0 prepared before it)."""
    f1 = inputs["f1"]
    tc1 = fcs["f1"].table
    cases = []
    w = em.RaggedTensor(np.full(f1.values.shape, 0.5, np.float64), f1.row_splits)
    cases.append(("float64 weights", fcs, tables, inputs, {"f1": w}))
    seq = dict(fcs, f1=em.FeatureConfig(tc1, name="f1", max_sequence_length=4))
    cases.append(("sequence feature", seq, tables, inputs, None))
    batch = f1.nrows
    shaped = dict(fcs, f1=em.FeatureConfig(tc1, name="f1", output_shape=[batch]))
    cases.append(("output_shape", shaped, tables, inputs, None))
    for what, changed in [
        ("uint64 ids", em.RaggedTensor(f1.values.astype(np.uint64), f1.row_splits)),
        ("int16 ids", em.RaggedTensor(f1.values.astype(np.int16), f1.row_splits)),
        ("int32 row_splits", em.RaggedTensor(f1.values, f1.row_splits.astype(np.int32))),
        ("strided ids", em.RaggedTensor(np.repeat(f1.values, 2)[::2], f1.row_splits)),
        ("jax ids", em.RaggedTensor(jnp.asarray(f1.values), f1.row_splits)),
        ("a list of ids", np.asarray(f1.values)[: batch * 2].reshape(batch, 2).tolist()),
    ]:
        cases.append((what, fcs, tables, dict(inputs, f1=changed), None))
    t64 = {**tables, tc1: tables[tc1].astype(np.float64)}
    cases.append(("float64 table", fcs, t64, inputs, None))
    return cases


@pytest.mark.parametrize("threads", [1, 2])
def test_uncommon_inputs_take_the_general_path(threads, spy, monkeypatch):
    """Each uncommon input: the fast path says None, and the lookup equals the general
    path's (which the other serving tests check against float64), on 1 and 2 threads. A
    sequence feature or output_shape is seen before anything is prepared."""
    rng = np.random.default_rng(3)
    fcs, tables, inputs = _common(rng)
    prepared = []
    real_prepare = fast_path._prepare
    monkeypatch.setattr(fast_path, "_prepare", lambda *a: prepared.append(1) or real_prepare(*a))
    monkeypatch.setattr(lookup, "_host_threads", threads)
    for what, f, t, x, w in _uncommon_cases(rng, fcs, tables, inputs):
        spy.clear()
        prepared.clear()
        got = em.serving_embedding_lookup(x, w, t, f)
        assert spy == [None], what
        if what in ("sequence feature", "output_shape", "a list of ids"):
            assert not prepared, what
        with monkeypatch.context() as m:
            _general_only(m)
            want = em.serving_embedding_lookup(x, w, t, f)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=what)


@pytest.mark.parametrize("threads", [1, 2])
def test_outputs_are_wrapped_before_the_kernels_and_alias_their_buffers(threads, monkeypatch):
    """The result is made once, before the kernels run (its arrays read the buffers the
    kernels then fill), and holds the kernels' values, not the buffers' poison."""
    rng = np.random.default_rng(6)
    fcs, tables, inputs = _common(rng, n=4)
    inputs["f2"] = rng.integers(0, VOCAB, (20, 3))  # a dense feature among the bags
    del inputs["f3"]  # and a feature without input
    made = []
    real = lookup._finish_common
    monkeypatch.setattr(lookup, "_finish_common", lambda *a: made.append(a[-1]) or real(*a))
    monkeypatch.setattr(lookup, "_host_threads", threads)
    got = em.serving_embedding_lookup(inputs, None, tables, fcs)
    assert made == [True]
    assert sorted(got) == ["f0", "f1", "f2"]
    for name, x in got.items():
        fc = fcs[name]
        want = reference_lookup(fc, inputs[name], None, tables[fc.table])
        np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batched", [False, True])
def test_outputs_copied_when_wrapped_are_wrapped_again_after_the_kernels(
    threads, batched, monkeypatch
):
    """Where jax copies the output buffers (jax.device_put to another device, or a
    jaxlib whose batched put copied when first seen), the copies made before the
    kernels ran hold poison: the result is made again after them, with the kernels'
    values."""
    rng = np.random.default_rng(7)
    fcs, tables, inputs = _common(rng, n=3)
    made = []
    real = lookup._finish_common
    monkeypatch.setattr(lookup, "_finish_common", lambda *a: made.append(a[-1]) or real(*a))
    monkeypatch.setattr(
        lookup, "_host_to_jax_via", lambda outs: ([jnp.array(x) for x in outs], batched)
    )
    monkeypatch.setattr(lookup, "_batched_put_aliases", False)
    monkeypatch.setattr(lookup, "_host_threads", threads)
    got = em.serving_embedding_lookup(inputs, None, tables, fcs)
    assert made == [True, False]
    for name, x in got.items():
        fc = fcs[name]
        want = reference_lookup(fc, inputs[name], None, tables[fc.table])
        np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "threads, min_entries, handed_over", [(1, 1, False), (2, 1, True), (2, 10**9, False)]
)
def test_requests_for_several_threads_are_handed_over_task_by_task(
    threads, min_entries, handed_over, request_form, monkeypatch
):
    """A request that several threads share goes to the pool task by task as each is
    made; one that runs on one thread (one given, or too few ids for two) is one C++
    call. Both give the kernels' values. (The Python form's routes: the compiled form
    always hands its tasks over, and none of these run.)"""
    rng = np.random.default_rng(8)
    fcs, tables, inputs = _common(rng, n=3)
    calls = {"add_words": 0, "run_tasks": 0}
    real_add, real_run = native_backend.NativeRequest.add_words, native_backend.run_tasks

    def add_words(self, words):
        calls["add_words"] += 1
        return real_add(self, words)

    def run_tasks(words, n):
        calls["run_tasks"] += 1
        return real_run(words, n)

    monkeypatch.setattr(native_backend.NativeRequest, "add_words", add_words)
    monkeypatch.setattr(native_backend, "run_tasks", run_tasks)
    monkeypatch.setattr(lookup, "_host_threads", threads)
    previous = native.library().EmServingSetMinEntriesPerThread(min_entries)
    try:
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
    finally:
        native.library().EmServingSetMinEntriesPerThread(previous)
    if request_form == "compiled":
        assert calls == {"add_words": 0, "run_tasks": 0}
    else:
        assert calls == (
            {"add_words": 3, "run_tasks": 0} if handed_over else {"add_words": 0, "run_tasks": 1}
        )
    for name, x in got.items():
        fc = fcs[name]
        want = reference_lookup(fc, inputs[name], None, tables[fc.table])
        np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("spin_us", [0, 300, 50_000])
def test_pool_polling_leaves_results_alone(spin_us, monkeypatch):
    """However long the pool's threads poll for the next request (0: they sleep at
    once), requests back to back and after a pause give the kernels' values."""
    import time

    rng = np.random.default_rng(9)
    fcs, tables, inputs = _common(rng, n=4, batch=40)
    lib = native.library()
    previous = lib.EmServingSetPoolSpin(spin_us)
    monkeypatch.setattr(lookup, "_host_threads", 2)
    try:
        for i in range(6):
            if i == 3:
                time.sleep(0.002)
            got = em.serving_embedding_lookup(inputs, None, tables, fcs)
            for name, x in got.items():
                fc = fcs[name]
                want = reference_lookup(fc, inputs[name], None, tables[fc.table])
                np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-6)
    finally:
        lib.EmServingSetPoolSpin(previous)


def test_traced_inputs_take_the_traced_path(spy):
    rng = np.random.default_rng(4)
    fcs, tables, inputs = _common(rng)
    want = em.serving_embedding_lookup(inputs, None, tables, fcs)
    got = jax.jit(lambda t: em.serving_embedding_lookup(inputs, None, t, fcs))(tables)
    assert spy[-1] is None
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


def _bad_requests(rng):
    """(what, inputs, features) of bad common-case requests, the bad feature in the middle."""
    out = []
    base_fcs, tables, inputs = _common(rng, n=3)
    f1 = inputs["f1"]
    n = f1.values.shape[0]
    for what, splits in [
        ("first split not 0", np.concatenate([[1], f1.row_splits[1:]])),
        ("last split not len(values)", np.concatenate([f1.row_splits[:-1], [n + 5]])),
        ("last split short", np.concatenate([f1.row_splits[:-1], [n - 1]])),
        ("decreasing splits", f1.row_splits.copy()),
    ]:
        if what == "decreasing splits":
            splits[3] = splits[2] - 1
        out.append((what, dict(inputs, f1=em.RaggedTensor(f1.values, splits.astype(np.int64)))))
    for bad_id in (VOCAB, -1, 2**40):
        ids = f1.values.copy()
        ids[n // 2] = bad_id
        out.append((f"ragged id {bad_id}", dict(inputs, f1=em.RaggedTensor(ids, f1.row_splits))))
    ids = f1.values.astype(np.int32)
    ids[-1] = VOCAB + 3
    out.append(("int32 id", dict(inputs, f1=em.RaggedTensor(ids, f1.row_splits))))
    dense = rng.integers(0, VOCAB, (20, 3))
    dense[4, 1] = VOCAB
    out.append(("dense id", dict(inputs, f1=dense)))
    out = [(what, x, None) for what, x in out]
    w = _weights_for(rng, f1)
    w.values[2] = np.nan
    out.append(("NaN weight", inputs, {"f1": w}))
    w = em.RaggedTensor(np.ones(n, np.float32), f1.row_splits.copy())
    w.row_splits[1] += 1
    out.append(("weights of other splits", inputs, {"f1": w}))
    out.append(("weights of another kind", inputs, {"f1": np.ones(n, np.float32)}))
    dense_w = {"f1": np.ones((20, 3), np.float32)}
    out.append(("weights for dense ids", dict(inputs, f1=rng.integers(0, VOCAB, (20, 3))), dense_w))
    sp = _feature_input(rng, "sparse", 20, np.int64, np.int64, False, False)
    for what in ("index outside", "index out of order", "sparse id", "index repeated"):
        idx, vals = sp.indices.copy(), sp.values.copy()
        if what == "index outside":
            idx[len(idx) // 2, 1] = sp.dense_shape[1]
        elif what == "index out of order":
            idx[[0, -1]] = idx[[-1, 0]]  # the last entry first
        elif what == "index repeated":
            idx[2] = idx[1]
        else:
            vals[3] = VOCAB
        out.append((what, dict(inputs, f1=em.SparseTensor(idx, vals, sp.dense_shape)), None))
    w = _weights_for(rng, sp)
    w = em.SparseTensor(w.indices, w.values, (w.dense_shape[0] + 1, w.dense_shape[1]))
    out.append(("sparse weights of another shape", dict(inputs, f1=sp), {"f1": w}))
    return base_fcs, tables, out


@pytest.mark.parametrize("threads", [1, 2])
def test_errors_are_the_general_paths(threads, spy, monkeypatch):
    """A bad request: the fast path hands it on (None), the lookup raises the general
    path's error word for word, naming the feature, and a good request after it runs on
    the fast path again; one C++ call (1 thread) or tasks handed over (2)."""
    monkeypatch.setattr(lookup, "_host_threads", threads)
    rng = np.random.default_rng(5)
    fcs, tables, bad = _bad_requests(rng)
    good = _common(np.random.default_rng(5), n=3)[2]
    for what, inputs, weights in bad:
        spy.clear()
        with pytest.raises(ValueError, match="f1") as fast:
            em.serving_embedding_lookup(inputs, weights, tables, fcs)
        assert spy == [None], what
        with monkeypatch.context() as m:
            _general_only(m)
            with pytest.raises(ValueError) as general:
                em.serving_embedding_lookup(inputs, weights, tables, fcs)
        assert str(fast.value) == str(general.value), what
    spy.clear()
    em.serving_embedding_lookup(good, None, tables, fcs)
    assert spy[0] is not None


@pytest.mark.parametrize(
    "splits", [[1, 2, 4], [0, 2, 5], [0, 2, 3], [0, 3, 2, 4], [0, -1, 4], [0, 9, 4]]
)
def test_checked_bag_task_rejects_bad_offsets_before_any_write(splits):
    """Task kind 4: offsets that do not run non-decreasing from 0 to the id count give -3,
    no bag is summed (the poisoned output stays poisoned), a good task beside it runs."""
    rng = np.random.default_rng(6)
    table = rng.standard_normal((50, 8)).astype(np.float32)
    ids = rng.integers(0, 50, 4).astype(np.int64)
    offsets = np.array(splits, np.int64)
    rows = offsets.shape[0] - 1
    out, out_addr = pool.output_empty_at((rows, 8), np.float32)
    good_off = np.array([0, 1, 4], np.int64)
    good, good_addr = pool.output_empty_at((2, 8), np.float32)

    def task(off, rows, addr):
        w = [4, pool.address(table), 50, 8, 8, pool.address(ids), 1]
        w += [pool.address(off), rows, 0, 0, 0, 0, addr, 8, 4]
        return w + [0] * (native_backend.TASK_WORDS - len(w))

    codes = native_backend.run_tasks(
        array.array("q", task(offsets, rows, out_addr) + task(good_off, 2, good_addr)), 2
    )
    assert codes == [-3, -1]
    assert (out.view(np.uint32) == 0xFFFFFFFF).all()
    np.testing.assert_allclose(good[0], table[ids[0]], rtol=1e-6)
    np.testing.assert_allclose(good[1], table[ids[1:]].sum(0), rtol=1e-5)


def test_concurrent_requests_from_python_threads(spy):
    """Requests from several Python threads at once (one holds the C++ pool, the others
    run on their own threads) each get their own outputs."""
    import concurrent.futures

    rng = np.random.default_rng(9)
    fcs, tables, _ = _common(rng, n=3, batch=500)
    requests_ = [_common(np.random.default_rng(100 + i), n=3, batch=500)[2] for i in range(6)]
    want = [
        {k: np.asarray(v) for k, v in em.serving_embedding_lookup(x, None, tables, fcs).items()}
        for x in requests_
    ]
    previous = lookup.set_host_threads(2)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(3):
                got = list(
                    pool.map(lambda x: em.serving_embedding_lookup(x, None, tables, fcs), requests_)
                )
                for g, w in zip(got, want):
                    for k in w:
                        np.testing.assert_array_equal(np.asarray(g[k]), w[k])
    finally:
        lookup.set_host_threads(previous)
    assert spy and all(s is not None for s in spy)


def test_the_install_built_the_compiled_checks():
    """README's install builds `embedmesh.serving._request` wherever it builds the C++
    kernels (a failed build is optional for the install, so this says it)."""
    assert fast_path.compiled_available(), "embedmesh.serving._request was not built"


def test_the_compiled_checks_run_no_python_form(request_form, monkeypatch):
    """On the compiled form a common request passes none of this module's Python checks
    (they would double its cost); on the Python form it passes all of them."""
    rng = np.random.default_rng(10)
    fcs, tables, inputs = _common(rng, n=3)
    ran = []
    real = fast_path._prepare
    monkeypatch.setattr(fast_path, "_prepare", lambda *a: ran.append(1) or real(*a))
    got = em.serving_embedding_lookup(inputs, None, tables, fcs)
    assert ran == ([] if request_form == "compiled" else [1])
    for name, x in got.items():
        fc = fcs[name]
        want = reference_lookup(fc, inputs[name], None, tables[fc.table])
        np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("numpy_outputs", [False, True])
def test_dict_requests_follow_the_config_as_it_is_now(numpy_outputs, spy, monkeypatch):
    """A model configured as one dict of features, asked with a dict of inputs: one
    compiled call (`fast_path.lookup_dict`, where built) whose outputs come as a dict in
    the inputs' key order, equal to the general path's; after a FeatureConfig is replaced
    under its key (the same dict object), the new one is looked up; a key the config lacks
    raises the general path's error; an explicit None input gives its None."""
    rng = np.random.default_rng(11)
    ta, tb = em.TableConfig(VOCAB, 8, combiner="sum"), em.TableConfig(VOCAB, 17, combiner="mean")
    tc = em.TableConfig(VOCAB, 5, combiner="sqrtn")
    fcs = {"b": em.FeatureConfig(tb), "a": em.FeatureConfig(ta)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in (ta, tb, tc)}
    monkeypatch.setattr(lookup, "_numpy_outputs", numpy_outputs)

    def both(inputs):
        spy.clear()
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        taken = list(spy)
        with monkeypatch.context() as m:
            _general_only(m)
            want = em.serving_embedding_lookup(inputs, None, tables, fcs)
        assert list(got) == list(want) == list(inputs)
        for k in want:
            if want[k] is None:
                assert got[k] is None
                continue
            assert (type(got[k]) is np.ndarray) == numpy_outputs
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
        return got, taken

    inputs = {k: _feature_input(rng, "ragged", 9, np.int64, np.int64, False, False) for k in "ba"}
    got, taken = both(inputs)
    assert taken and taken[0] is not None  # the fast path answered
    got, _ = both({"a": inputs["a"], "b": inputs["b"]})  # the other key order
    assert got["a"].shape == (9, 8)
    fcs["a"] = em.FeatureConfig(tc)  # replaced in place: the same dict, a new table
    got, taken = both(inputs)
    assert got["a"].shape == (9, 5) and taken and taken[0] is not None
    both({"a": None, "b": inputs["b"]})
    with pytest.raises(ValueError) as fast_error:
        em.serving_embedding_lookup({**inputs, "zz": inputs["a"]}, None, tables, fcs)
    with monkeypatch.context() as m, pytest.raises(ValueError) as general_error:
        _general_only(m)
        em.serving_embedding_lookup({**inputs, "zz": inputs["a"]}, None, tables, fcs)
    assert str(fast_error.value) == str(general_error.value)


def _direct_numpy_or_skip(request_form) -> None:
    if request_form != "compiled" or fast_path.direct_numpy(True) is None:
        pytest.skip("the compiled form's direct numpy reads were not built")


@settings(SETTINGS, max_examples=15)
@given(p=requests(), numpy_outputs=st.booleans())
def test_direct_numpy_reads_equal_buffer_exports(p, numpy_outputs, request_form, spy, monkeypatch):
    """The compiled form reads numpy arrays' fields and makes each output a view made by
    numpy's C API (`fast_path.direct_numpy`, on by default): the same outputs, bit for
    bit, as through the buffer protocol and Python's API (a slice and a reshape), within
    float32 rounding of the float64 reference; numpy outputs are C-contiguous writable
    float32 arrays over memory no other output shares."""
    _direct_numpy_or_skip(request_form)
    fcs, tables, inputs, weights = _build(p)
    monkeypatch.setattr(lookup, "_numpy_outputs", numpy_outputs)
    results = []
    previous_threads = lookup.set_host_threads(p["threads"])
    try:
        for direct in (True, False):
            previous = fast_path.direct_numpy(direct)
            try:
                spy.clear()
                results.append(em.serving_embedding_lookup(inputs, weights, tables, fcs))
                assert spy and spy[0] is not None, "a common request left the fast path"
            finally:
                fast_path.direct_numpy(previous)
    finally:
        lookup.set_host_threads(previous_threads)
    got, want = results
    spans = []
    for name, fc in fcs.items():
        _equal_and_near_reference(name, fc, got, want, tables, inputs, weights)
        if numpy_outputs:
            out = got[name]
            assert type(out) is np.ndarray and out.dtype == np.float32
            assert out.flags.c_contiguous and out.flags.writeable
            if out.nbytes:
                start = out.__array_interface__["data"][0]
                spans.append((start, start + out.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "outputs overlap"


def test_arrays_of_other_dtype_objects_are_read_through_the_buffer_protocol(request_form, spy):
    """Direct reads take numpy's shared int64/int32/float32 dtype objects only: ids of an
    int64 dtype with metadata (another dtype object) are read through the buffer protocol
    and take the fast path all the same; big-endian ids (not native) take the general
    path; both equal the float64 reference."""
    _direct_numpy_or_skip(request_form)
    rng = np.random.default_rng(12)
    ta = em.TableConfig(VOCAB, 16, combiner="sum")
    tb = em.TableConfig(VOCAB, 8, combiner="mean")
    fcs = {"a": em.FeatureConfig(ta), "b": em.FeatureConfig(tb)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in (ta, tb)}
    splits = np.array([0, 2, 2, 5], np.int64)
    ids = rng.integers(0, VOCAB, 5)
    for dtype, fast in ((np.dtype(np.int64, metadata={"m": 1}), True), (np.dtype(">i8"), False)):
        assert dtype is not np.dtype(np.int64)
        inputs = {k: em.RaggedTensor(ids.astype(dtype), splits) for k in fcs}
        spy.clear()
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        assert spy and (spy[0] is not None) == fast, dtype
        for name, fc in fcs.items():
            plain = em.RaggedTensor(ids.astype(np.int64), splits)
            want = reference_lookup(fc, plain, None, tables[fc.table])
            np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numpy_outputs", [False, True])
def test_dict_requests_after_the_config_is_reordered(numpy_outputs, spy, monkeypatch):
    """The compiled dict request walks the config alongside the order it had when planned
    and maps inputs given in that order without lookups: a config whose same entries were
    reinserted in another order, and inputs in any order, still take the fast path and
    equal the float64 reference under each key."""
    rng = np.random.default_rng(13)
    tcs = [em.TableConfig(VOCAB, d, combiner=c) for d, c in ((8, "sum"), (17, "mean"), (5, "sum"))]
    fcs = {k: em.FeatureConfig(t) for k, t in zip("cab", tcs)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in tcs}
    monkeypatch.setattr(lookup, "_numpy_outputs", numpy_outputs)
    inputs = {k: _feature_input(rng, "ragged", 4, np.int64, np.int64, False, False) for k in fcs}
    for step in range(3):
        if step == 1:
            fcs["c"] = fcs.pop("c")  # the same entries, another order
        for keys in ("cab", "bac", "ab"):
            spy.clear()
            got = em.serving_embedding_lookup({k: inputs[k] for k in keys}, None, tables, fcs)
            assert spy and spy[0] is not None and list(got) == list(keys)
            for k in keys:
                want = reference_lookup(fcs[k], inputs[k], None, tables[fcs[k].table])
                np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numpy_outputs", [False, True])
def test_small_request_buffers_are_reused_only_once_their_outputs_are_gone(
    numpy_outputs, request_form, spy, monkeypatch
):
    """A small request's one output buffer comes from the compiled form's own cache
    (`_request.set_block_cache`: within the output pool's limit, at most 1 MiB): outputs
    still held are never written by later requests, buffers whose outputs are gone are
    reused, every result equals the float64 reference, and a pool limit of 0 keeps none."""
    _direct_numpy_or_skip(request_form)
    import gc

    compiled = fast_path._compiled
    if not hasattr(compiled, "block_cache"):
        pytest.skip("this build has no cache of small buffers")
    rng = np.random.default_rng(14)
    shapes = ((16, "sum"), (33, "mean"), (64, "sum"))
    tcs = [em.TableConfig(VOCAB, d, combiner=c) for d, c in shapes]
    fcs = {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tcs)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in tcs}
    monkeypatch.setattr(lookup, "_numpy_outputs", numpy_outputs)

    def request():
        inputs = {
            k: _feature_input(rng, "ragged", 3, np.int64, np.int64, False, False) for k in fcs
        }
        spy.clear()
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        assert spy and spy[0] is not None, "a common request left the fast path"
        return inputs, got

    def check(inputs, got):
        for k, fc in fcs.items():
            want = reference_lookup(fc, inputs[k], None, tables[fc.table])
            np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5, atol=1e-5, err_msg=k)

    previous = pool.set_output_pool_limit(4 << 20)
    try:
        held = [request() for _ in range(3)]
        for _ in range(4):  # buffers given back and reused, the held ones untouched
            check(*request())
        for inputs, got in held:
            check(inputs, got)
        del held
        gc.collect()
        if pool._pool.release is not None:
            pool._pool.release()  # jaxlib lets go of the numpy arrays its arrays aliased
        assert compiled.block_cache()[0] >= 1
        check(*request())
        pool.set_output_pool_limit(0)
        assert compiled.block_cache() == (0, 0)
        check(*request())
        gc.collect()
        if pool._pool.release is not None:
            pool._pool.release()  # jaxlib lets go of the numpy arrays its arrays aliased
        assert compiled.block_cache() == (0, 0)
    finally:
        pool.set_output_pool_limit(previous)


def test_served_requests_equal_the_usual_path(request_form, monkeypatch):
    """A dict request with numpy outputs of the model served last goes straight to one
    compiled call (`_request.serve`, enter and leave included): its outputs equal the
    usual path's bit for bit and the float64 reference; a config changed in place, weights,
    jax outputs, another backend and a bad id each take the usual path (the same error),
    and the threads inside a lookup return to 0."""
    if request_form != "compiled" or fast_path.serve is None:
        pytest.skip("the compiled form's serve was not built")
    monkeypatch.setattr(fast_path, "_use_serve", True)
    rng = np.random.default_rng(14)
    ta, tb = em.TableConfig(VOCAB, 8, combiner="sum"), em.TableConfig(VOCAB, 17, combiner="mean")
    tc = em.TableConfig(VOCAB, 5, combiner="sqrtn")
    fcs = {"b": em.FeatureConfig(tb), "a": em.FeatureConfig(ta)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in (ta, tb, tc)}
    monkeypatch.setattr(fast_path, "served", None)
    monkeypatch.setattr(lookup, "_numpy_outputs", True)
    calls = []
    real = lookup._serve
    monkeypatch.setattr(lookup, "_serve", lambda *a: calls.append(1) or real(*a))

    def request():
        return {k: _feature_input(rng, "ragged", 6, np.int64, np.int64, False, False) for k in "ab"}

    def usual(inputs, weights=None):
        previous = fast_path.serve_calls(False)
        try:
            return em.serving_embedding_lookup(inputs, weights, tables, fcs)
        finally:
            fast_path.serve_calls(previous)

    first = request()
    em.serving_embedding_lookup(first, None, tables, fcs)  # remembered for the next
    assert fast_path.served is not None and not calls
    for step in range(3):
        if step == 2:
            fcs["a"] = em.FeatureConfig(tc)  # replaced in place: planned again
        for _ in range(2):  # after a change of the config: planned again, then remembered
            em.serving_embedding_lookup(request(), None, tables, fcs)
        assert fast_path.served is not None
        calls.clear()
        inputs = request()
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        assert calls and fast_path.served is not None
        want = usual(inputs)
        assert list(got) == list(inputs)
        for k, fc in fcs.items():
            assert type(got[k]) is np.ndarray
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
            ref = reference_lookup(fc, inputs[k], None, tables[fc.table])
            np.testing.assert_allclose(got[k], ref, rtol=1e-5, atol=1e-6, err_msg=k)
        assert fast_path.in_flight() == 0
    calls.clear()
    weights = {
        k: em.RaggedTensor(np.ones_like(v.values, np.float32), v.row_splits)
        for k, v in inputs.items()
    }
    got = em.serving_embedding_lookup(inputs, weights, tables, fcs)  # weights: the usual path
    assert not calls
    for k in fcs:
        np.testing.assert_array_equal(got[k], usual(inputs, weights)[k])
    bad = {"a": em.RaggedTensor(np.array([0, VOCAB], np.int64), np.array([0, 2], np.int64))}
    em.serving_embedding_lookup(first, None, tables, fcs)  # remembered again
    assert fast_path.served is not None
    with pytest.raises(ValueError, match="outside the table") as served_error:
        em.serving_embedding_lookup(bad, None, tables, fcs)
    assert calls and fast_path.served is None and fast_path.in_flight() == 0
    with pytest.raises(ValueError) as usual_error:
        usual(bad)
    assert str(served_error.value) == str(usual_error.value)
    em.serving_embedding_lookup(first, None, tables, fcs)
    assert fast_path.served is not None
    lookup.set_numpy_outputs(True)  # a setting's change forgets it
    assert fast_path.served is None
    em.serving_embedding_lookup(first, None, tables, fcs)
    monkeypatch.setattr(lookup, "_numpy_outputs", False)
    calls.clear()
    out = em.serving_embedding_lookup(first, None, tables, fcs)  # jax outputs: not served
    assert not calls and not any(type(x) is np.ndarray for x in out.values())
    monkeypatch.setattr(lookup, "_numpy_outputs", True)
    em.serving_embedding_lookup(first, None, tables, fcs)
    previous = kernels.set_backend("numpy")
    try:
        assert fast_path.served is None
        out = em.serving_embedding_lookup(first, None, tables, fcs)
    finally:
        kernels.set_backend(previous)
    for k in fcs:
        np.testing.assert_allclose(out[k], usual(first)[k], rtol=1e-5, atol=1e-6)
