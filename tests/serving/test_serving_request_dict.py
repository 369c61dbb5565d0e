"""The compiled request rules on dict requests, their outputs and buffers: a model
configured as one dict of features served in one compiled call (`_request.serve`) as the
config is now, the outputs bit for bit the oracle's (tests/support/request_rules.py) and
the general path's, small requests' buffers reused only once their outputs are gone, and
the model served last remembered and forgotten as its settings change. The fixtures and
request builders are test_serving_request.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_serving_request as base
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serving import reference_lookup
from test_serving_request import (
    SETTINGS,
    VOCAB,
    _build,
    _equal_and_near_reference,
    _feature_input,
    _general_only,
    _oracle,
    _set,
    requests,
)

import embedmesh as em
from embedmesh.serving import kernels, lookup, native, pool, request
from embedmesh.serving import settings as serving_settings

pytestmark = pytest.mark.skipif(
    not kernels.HAVE_NATIVE, reason=f"no C++ serving kernels: {native.reason()}"
)
compiled_rules = base.compiled_rules  # autouse: the compiled rules, nothing remembered
spy = base.spy  # what each compiled call answered


def _dict_model(rng) -> tuple:
    """`(a spare table, a dict model {"b": dim 17 mean, "a": dim 8 sum}, the tables of all
    three)`: the model the dict tests serve, the spare table to replace a feature's."""
    ta, tb = em.TableConfig(VOCAB, 8, combiner="sum"), em.TableConfig(VOCAB, 17, combiner="mean")
    tc = em.TableConfig(VOCAB, 5, combiner="sqrtn")
    fcs = {"b": em.FeatureConfig(tb), "a": em.FeatureConfig(ta)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in (ta, tb, tc)}
    return tc, fcs, tables


@pytest.mark.parametrize("numpy_outputs", [False, True])
def test_dict_requests_follow_the_config_as_it_is_now(numpy_outputs, spy, monkeypatch):
    """A model configured as one dict of features, asked with a dict of inputs: one
    compiled call (`_request.serve`) whose outputs come as a dict in
    the inputs' key order, equal to the general path's; after a FeatureConfig is replaced
    under its key (the same dict object), the new one is looked up; a key the config lacks
    raises the general path's error; an explicit None input gives its None."""
    rng = np.random.default_rng(11)
    tc, fcs, tables = _dict_model(rng)
    _set(monkeypatch, "numpy_outputs", numpy_outputs)

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
    assert taken and taken[0] is not None  # the compiled rules answered
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


@settings(SETTINGS, max_examples=15)
@given(p=requests(), numpy_outputs=st.booleans())
def test_compiled_outputs_equal_the_oracles_and_share_no_memory(p, numpy_outputs, spy, monkeypatch):
    """The compiled rules read numpy arrays' fields and make each output a view of the
    request's one buffer made by numpy's C API: the same outputs, bit for bit, as the
    oracle's (the buffer's addresses read in Python, one pool buffer a feature), within
    float32 rounding of the float64 reference; numpy outputs are C-contiguous writable
    float32 arrays over memory no other output shares."""
    fcs, tables, inputs, weights = _build(p)
    _set(monkeypatch, "numpy_outputs", numpy_outputs)
    _set(monkeypatch, "host_threads", p["threads"])
    spy.clear()
    got = em.serving_embedding_lookup(inputs, weights, tables, fcs)
    assert spy and spy[0] is not None, "a common request left the compiled rules"
    want = _oracle(fcs, inputs, weights, tables, p["threads"])
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


def test_arrays_of_other_dtype_objects_are_read_through_the_buffer_protocol(spy):
    """Direct reads take numpy's shared int64/int32/float32 dtype objects only: ids of an
    int64 dtype with metadata (another dtype object) are read through the buffer protocol
    and take the compiled rules all the same; big-endian ids (not native) take the
    general path; both equal the float64 reference."""
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
    reinserted in another order, and inputs in any order, still take the compiled rules and
    equal the float64 reference under each key."""
    rng = np.random.default_rng(13)
    tcs = [em.TableConfig(VOCAB, d, combiner=c) for d, c in ((8, "sum"), (17, "mean"), (5, "sum"))]
    fcs = {k: em.FeatureConfig(t) for k, t in zip("cab", tcs)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in tcs}
    _set(monkeypatch, "numpy_outputs", numpy_outputs)
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
    numpy_outputs, spy, monkeypatch
):
    """A small request's one output buffer comes from the compiled form's own cache
    (`_request.set_block_cache`: within the output pool's limit, at most 1 MiB): outputs
    still held are never written by later requests, buffers whose outputs are gone are
    reused, every result equals the float64 reference, and a pool limit of 0 keeps none."""
    import gc

    compiled = request.compiled
    rng = np.random.default_rng(14)
    shapes = ((16, "sum"), (33, "mean"), (64, "sum"))
    tcs = [em.TableConfig(VOCAB, d, combiner=c) for d, c in shapes]
    fcs = {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tcs)}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in tcs}
    _set(monkeypatch, "numpy_outputs", numpy_outputs)

    def one_request():
        inputs = {
            k: _feature_input(rng, "ragged", 3, np.int64, np.int64, False, False) for k in fcs
        }
        spy.clear()
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        assert spy and spy[0] is not None, "a common request left the compiled rules"
        return inputs, got

    def check(inputs, got):
        for k, fc in fcs.items():
            want = reference_lookup(fc, inputs[k], None, tables[fc.table])
            np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5, atol=1e-5, err_msg=k)

    previous = pool.set_output_pool_limit(4 << 20)
    try:
        held = [one_request() for _ in range(3)]
        for _ in range(4):  # buffers given back and reused, the held ones untouched
            check(*one_request())
        for inputs, got in held:
            check(inputs, got)
        del held
        gc.collect()
        if pool._pool.release is not None:
            pool._pool.release()  # jaxlib lets go of the numpy arrays its arrays aliased
        assert compiled.block_cache()[0] >= 1
        check(*one_request())
        pool.set_output_pool_limit(0)
        assert compiled.block_cache() == (0, 0)
        check(*one_request())
        gc.collect()
        if pool._pool.release is not None:
            pool._pool.release()  # jaxlib lets go of the numpy arrays its arrays aliased
        assert compiled.block_cache() == (0, 0)
    finally:
        pool.set_output_pool_limit(previous)


@pytest.mark.parametrize("numpy_outputs", [True, False])
def test_served_requests_equal_the_general_path(numpy_outputs, monkeypatch):
    """A dict request of a dict model goes straight to one compiled call (`_request.serve`,
    enter and leave included), the model remembered for the next: its outputs (numpy, or
    jax arrays over the same buffers) equal the general path's bit for bit and the
    float64 reference; a config changed in place is planned again; weights take the flat
    compiled call; a bad id raises the general path's error and forgets the model; a
    setting's change or another backend forgets it too; the threads inside a lookup
    return to 0."""
    rng = np.random.default_rng(14)
    tc, fcs, tables = _dict_model(rng)
    _set(monkeypatch, "numpy_outputs", numpy_outputs)
    calls = []
    real = lookup._serve
    monkeypatch.setattr(lookup, "_serve", lambda *a: calls.append(1) or real(*a))

    def new_request():
        return {k: _feature_input(rng, "ragged", 6, np.int64, np.int64, False, False) for k in "ab"}

    def general(inputs, weights=None):
        with monkeypatch.context() as m:
            _general_only(m)
            return em.serving_embedding_lookup(inputs, weights, tables, fcs)

    first = new_request()
    em.serving_embedding_lookup(first, None, tables, fcs)
    assert request.served is not None and calls
    for step in range(3):
        if step == 2:
            fcs["a"] = em.FeatureConfig(tc)  # replaced in place: planned again
        for _ in range(2):  # after a change of the config: the flat call, then planned again
            em.serving_embedding_lookup(new_request(), None, tables, fcs)
        assert request.served is not None
        calls.clear()
        inputs = new_request()
        got = em.serving_embedding_lookup(inputs, None, tables, fcs)
        assert calls == [1] and request.served is not None
        want = general(inputs)
        assert list(got) == list(inputs)
        for k, fc in fcs.items():
            assert (type(got[k]) is np.ndarray) == numpy_outputs
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
            ref = reference_lookup(fc, inputs[k], None, tables[fc.table])
            np.testing.assert_allclose(np.asarray(got[k]), ref, rtol=1e-5, atol=1e-6, err_msg=k)
        assert request.in_flight() == 0
    calls.clear()
    weights = {
        k: em.RaggedTensor(np.ones_like(v.values, np.float32), v.row_splits)
        for k, v in inputs.items()
    }
    got = em.serving_embedding_lookup(inputs, weights, tables, fcs)  # weights: the flat call
    assert not calls
    for k in fcs:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(general(inputs, weights)[k]))
    bad = {"a": em.RaggedTensor(np.array([0, VOCAB], np.int64), np.array([0, 2], np.int64))}
    em.serving_embedding_lookup(first, None, tables, fcs)  # remembered again
    assert request.served is not None
    with pytest.raises(ValueError, match="outside the table") as served_error:
        em.serving_embedding_lookup(bad, None, tables, fcs)
    assert calls and request.served is None and request.in_flight() == 0
    with pytest.raises(ValueError) as general_error:
        general(bad)
    assert str(served_error.value) == str(general_error.value)
    em.serving_embedding_lookup(first, None, tables, fcs)
    assert request.served is not None
    previous = serving_settings.set_numpy_outputs(numpy_outputs)  # a setting's change forgets it
    assert request.served is None
    serving_settings.set_numpy_outputs(previous)
    em.serving_embedding_lookup(first, None, tables, fcs)
    assert request.served is not None
    previous = kernels.set_backend("numpy")
    try:
        assert request.served is None
        calls.clear()
        out = em.serving_embedding_lookup(first, None, tables, fcs)
        assert not calls and request.served is None
    finally:
        kernels.set_backend(previous)
    for k in fcs:
        np.testing.assert_allclose(
            np.asarray(out[k]), np.asarray(general(first)[k]), rtol=1e-5, atol=1e-6
        )


def test_a_dict_model_and_one_served_otherwise_alternate(spy):
    """The model served last is one config; a request of another config (a nested dict:
    not served in one call, the flat compiled call instead) never takes it, before or
    after, and each result equals the float64 reference."""
    rng = np.random.default_rng(15)
    ta, tb = em.TableConfig(VOCAB, 8, combiner="sum"), em.TableConfig(VOCAB, 4, combiner="mean")
    flat = {"a": em.FeatureConfig(ta)}
    nested = {"n": {"b": em.FeatureConfig(tb)}}
    tables = {t: rng.standard_normal((VOCAB, t.dim)).astype(np.float32) for t in (ta, tb)}
    for _ in range(3):
        x = _feature_input(rng, "ragged", 5, np.int64, np.int64, False, False)
        got = em.serving_embedding_lookup({"a": x}, None, tables, flat)
        want = reference_lookup(flat["a"], x, None, tables[ta])
        np.testing.assert_allclose(np.asarray(got["a"]), want, rtol=1e-5, atol=1e-6)
        y = _feature_input(rng, "ragged", 6, np.int64, np.int64, False, False)
        got = em.serving_embedding_lookup({"n": {"b": y}}, None, tables, nested)
        want = reference_lookup(nested["n"]["b"], y, None, tables[tb])
        np.testing.assert_allclose(np.asarray(got["n"]["b"]), want, rtol=1e-5, atol=1e-6)
    assert spy and all(s is not None for s in spy)
