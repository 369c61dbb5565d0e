"""The serving request's compiled rules (`embedmesh/serving/ext/request.cc`, bound by
`embedmesh/serving/request.py`) against their Python restatement (the oracle,
tests/support/request_rules.py), the general host path and float64 numpy.

The compiled rules must take every common input (ragged, 2-D sparse and dense ids, with
or without weights, on float32 and quantized tables) exactly where the oracle does, give
the oracle's and the general path's outputs bit for bit (and the float64 reference's
within float32 rounding), hand every other input to the general path, and on any error
let the general path raise exactly the error it always raised. Outputs are poisoned
(0xFF bytes) before the kernels write them.
"""

from __future__ import annotations

import array
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import request_rules
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serving import reference_lookup

import embedmesh as em
from embedmesh.config import resolve_feature_config
from embedmesh.inputs import flatten_inputs_like
from embedmesh.serving import kernels, lookup, native, pool, request
from embedmesh.serving import settings as serving_settings
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.quantized import QuantizedTable, quantize_table

pytestmark = pytest.mark.skipif(
    not kernels.HAVE_NATIVE, reason=f"no C++ serving kernels: {native.reason()}"
)

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VOCAB = 300


@pytest.fixture(autouse=True)
def compiled_rules(native_poisoned):
    """The native backend, outputs poisoned, tiny requests shared (conftest), and the
    compiled request rules (built at install); no model remembered from another test."""
    if request.compiled is None:
        pytest.skip("embedmesh.serving._request was not built")
    request.forget_served()
    yield
    request.forget_served()


def _set(monkeypatch, name: str, value) -> None:
    """A serving setting for this test (the model served last forgotten, as the
    settings' setters do)."""
    monkeypatch.setattr(serving_settings, name, value)
    request.forget_served()


@pytest.fixture
def spy(monkeypatch):
    """What each compiled call answered, one entry a request that reached it: the result,
    or None (the general path's). A dict request of a dict model takes `_request.serve`
    (NotImplemented or False: not of its form, or the config changed: then
    `_request.lookup`), any other `_request.lookup`."""
    seen: list = []
    real_serve, real_lookup = lookup._serve, request.compiled.lookup

    def spied_serve(*a):
        out = real_serve(*a)
        if out is not NotImplemented and out is not False:
            seen.append(out if type(out) is dict else None)
        return out

    def spied_lookup(*a):
        out = real_lookup(*a)
        seen.append(out)
        return out

    monkeypatch.setattr(lookup, "_serve", spied_serve)
    monkeypatch.setattr(request.compiled, "lookup", spied_lookup)
    return seen


def _general_only(monkeypatch):
    """Every request on the general path (as without the compiled module)."""
    monkeypatch.setattr(lookup, "_serve", None)
    monkeypatch.setattr(request, "served", None)
    monkeypatch.setattr(request, "compiled", None)


def _oracle(fcs, inputs, weights, tables, threads):
    """The oracle's outputs of the request (a list in the config's flat order), or None
    where its rules leave it to the general path."""
    resolved = resolve_feature_config(fcs)
    flat = flatten_inputs_like(resolved, inputs, "features")
    flat_w = (
        [None] * len(flat) if weights is None else flatten_inputs_like(resolved, weights, "weights")
    )
    if type(tables) is not dict:
        return None
    out = request_rules.lookup(resolved.features, flat, flat_w, tables, threads)
    return None if out is None else dict(zip(resolved.feature_names, out))


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
    (compiled result, general result, whether the first request took the compiled
    rules). The oracle takes the request exactly where the compiled rules do, with the
    same outputs bit for bit."""
    previous = lookup.set_host_threads(p["threads"])
    try:
        spy.clear()
        got = em.serving_embedding_lookup(inputs, weights, tables, fcs)
        assert len(spy) == 1
        oracle = _oracle(fcs, inputs, weights, tables, p["threads"])
        with monkeypatch.context() as m:
            _general_only(m)
            want = em.serving_embedding_lookup(inputs, weights, tables, fcs)
    finally:
        lookup.set_host_threads(previous)
    taken = spy[0] is not None
    assert (oracle is not None) == taken, "the compiled rules and the oracle disagree"
    for name, x in (oracle or {}).items():
        if x is not None:
            np.testing.assert_array_equal(np.asarray(got[name]), x, err_msg=name)
    return got, want, taken


@SETTINGS
@given(p=requests())
def test_common_inputs_take_the_compiled_rules_and_equal_the_general_path(p, spy, monkeypatch):
    fcs, tables, inputs, weights = _build(p)
    got, want, fast = _both_paths(p, fcs, tables, inputs, weights, spy, monkeypatch)
    assert fast, "a common request left the compiled rules"
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
def test_quantized_tables_take_the_compiled_rules_and_equal_the_general_path(
    p, qkinds, spy, monkeypatch
):
    """Ragged and sparse features on int8, fp16 and codes tables (numpy rows) are common:
    the compiled rules sum them with EmServingBagQ, bit for bit the general path's, within
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
    """(what, features, tables, inputs, weights) the compiled rules must leave to the general path
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
    """Each uncommon input: the compiled rules say None (as the oracle does), and the
    lookup equals the general path's (which the other serving tests check against
    float64), on 1 and 2 threads."""
    rng = np.random.default_rng(3)
    fcs, tables, inputs = _common(rng)
    _set(monkeypatch, "host_threads", threads)
    for what, f, t, x, w in _uncommon_cases(rng, fcs, tables, inputs):
        spy.clear()
        got = em.serving_embedding_lookup(x, w, t, f)
        assert spy == [None], what
        assert _oracle(f, x, w, t, threads) is None, what
        with monkeypatch.context() as m:
            _general_only(m)
            want = em.serving_embedding_lookup(x, w, t, f)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=what)


def _finishes(monkeypatch) -> list:
    """`before_run` of each call that makes a compiled request's result (`_finish_dict`
    for a dict request, `_finish_common` for any other)."""
    made: list = []
    for name in ("_finish_dict", "_finish_common"):
        real = getattr(lookup, name)
        monkeypatch.setattr(lookup, name, lambda *a, real=real: made.append(a[-1]) or real(*a))
    return made


@pytest.mark.parametrize("threads", [1, 2])
def test_outputs_are_wrapped_before_the_kernels_and_alias_their_buffers(threads, monkeypatch):
    """The result is made once, before the kernels run (its arrays read the buffers the
    kernels then fill), and holds the kernels' values, not the buffers' poison."""
    rng = np.random.default_rng(6)
    fcs, tables, inputs = _common(rng, n=4)
    inputs["f2"] = rng.integers(0, VOCAB, (20, 3))  # a dense feature among the bags
    del inputs["f3"]  # and a feature without input
    made = _finishes(monkeypatch)
    _set(monkeypatch, "host_threads", threads)
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
    made = _finishes(monkeypatch)
    monkeypatch.setattr(
        lookup, "_host_to_jax_via", lambda outs: ([jnp.array(x) for x in outs], batched)
    )
    monkeypatch.setattr(lookup, "_batched_put_aliases", False)
    _set(monkeypatch, "host_threads", threads)
    got = em.serving_embedding_lookup(inputs, None, tables, fcs)
    assert made == [True, False]
    for name, x in got.items():
        fc = fcs[name]
        want = reference_lookup(fc, inputs[name], None, tables[fc.table])
        np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("threads, min_entries", [(1, 1), (2, 1), (2, 10**9)])
def test_requests_run_in_the_compiled_call_alone(threads, min_entries, monkeypatch):
    """A common request runs its tasks from the compiled call (on one thread, or shared by
    several): none goes through the Python runner's calls (`NativeRequest`, `run_tasks`,
    the general path's and the oracle's), and the outputs are the kernels' values."""
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
    _set(monkeypatch, "host_threads", threads)
    previous = native.library().EmServingSetMinEntriesPerThread(min_entries)
    try:
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
    finally:
        native.library().EmServingSetMinEntriesPerThread(previous)
    assert calls == {"add_words": 0, "run_tasks": 0}
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
    _set(monkeypatch, "host_threads", 2)
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
    """A bad request: the compiled rules hand it on (None), the lookup raises the general
    path's error word for word, naming the feature, and a good request after it takes the
    compiled rules again; on 1 thread or 2."""
    _set(monkeypatch, "host_threads", threads)
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
    assert request.compiled is not None, "embedmesh.serving._request was not built"
