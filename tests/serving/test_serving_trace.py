"""A serving request's call trace enters each serving module once.

The request rules live in one place (the compiled `embedmesh.serving._request`); the
Python around them makes the arguments once a model and the result once a request. A
request that bounced between modules (lookup -> request -> pool -> lookup -> ...) would
mean the rules, or their plumbing, are split again. Traced with `sys.setprofile`: every
Python call into a module of `embedmesh.serving` from another module counts as a visit
(a callback the compiled code makes runs in the frame of the Python that called it, so
`lookup`'s own callbacks are not visits); a warm request (the model planned by the
request before) of each input kind, on float32, quantized and raw-id tables, with numpy
and jax outputs, small (the compiled module's own buffers) and large (the output pool's),
must visit each module at most once and never the general path's modules (`kernels`,
`backends`), and its outputs equal the float64 reference.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
from test_serving import reference_lookup

import embedmesh as em
from embedmesh import _compat
from embedmesh.serving import kernels, native, quantize_table, request
from embedmesh.serving import settings as serving_settings

pytestmark = pytest.mark.skipif(
    not kernels.HAVE_NATIVE or request.compiled is None,
    reason=f"no C++ serving kernels or compiled request rules: {native.reason()}",
)

VOCAB = 500
GENERAL = ("embedmesh.serving.kernels", "embedmesh.serving.backends")


def _visits(fn) -> tuple[list, object]:
    """(the serving modules `fn()` entered, in order, one entry a visit; its result)."""
    visits: list = []

    def module_of(frame):
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name:
                return name
            frame = frame.f_back
        return ""

    def profile(frame, event, arg):
        if event != "call":
            return
        name = module_of(frame)
        if name.startswith("embedmesh.serving") and module_of(frame.f_back) != name:
            visits.append(name)

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return visits, out


def _ragged(rng, batch, width=3):
    lengths = rng.integers(0, width + 1, batch)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return em.RaggedTensor(rng.integers(0, VOCAB, int(splits[-1])), splits)


def _sparse(rng, batch, width=4):
    rows, cols = [], []
    for r in range(batch):
        c = np.sort(rng.choice(width, rng.integers(0, width + 1), replace=False))
        rows += [r] * len(c)
        cols += list(c)
    idx = np.stack([rows, cols], 1).astype(np.int64).reshape(-1, 2)
    return em.SparseTensor(idx, rng.integers(0, VOCAB, len(rows)), (batch, width))


def _case(kind: str, batch: int, rng):
    """(feature config, inputs, weights, tables, float64 reference per flat output)."""
    tab = em.TableConfig(VOCAB, 16, combiner="mean", name="t")
    table = rng.standard_normal((VOCAB, 16)).astype(np.float32)
    if kind == "ragged":  # a dict model asked with a dict: one compiled call (serve)
        fc = {"a": em.FeatureConfig(tab), "b": em.FeatureConfig(tab)}
        x = {"a": _ragged(rng, batch), "b": _ragged(rng, batch)}
        return fc, x, None, {tab: table}, {k: (fc[k], x[k], None, table) for k in x}
    if kind == "sparse":  # weights: the flat compiled call
        fc = {"a": em.FeatureConfig(tab), "b": em.FeatureConfig(tab)}
        x = {"a": _sparse(rng, batch), "b": _sparse(rng, batch)}
        w = {
            k: em.SparseTensor(
                v.indices, rng.uniform(0.5, 2, len(v.values)).astype(np.float32), v.dense_shape
            )
            for k, v in x.items()
        }
        return fc, x, w, {tab: table}, {k: (fc[k], x[k], w[k], table) for k in x}
    if kind == "dense":  # a list-structured model: the flat compiled call
        fc = [em.FeatureConfig(tab), em.FeatureConfig(tab)]
        x = [rng.integers(0, VOCAB, (batch, 2)), rng.integers(0, VOCAB, (batch,))]
        return fc, x, None, {tab: table}, {i: (fc[i], x[i], None, table) for i in range(2)}
    if kind == "quantized":  # int8 rows decoded in the bag kernels
        q = quantize_table(table, "int8")
        fc = {"a": em.FeatureConfig(tab), "b": em.FeatureConfig(tab)}
        x = {"a": _ragged(rng, batch), "b": _ragged(rng, batch)}
        return fc, x, None, {tab: q}, {k: (fc[k], x[k], None, q.dequantize()) for k in x}
    assert kind == "raw ids"  # positions found in the RawIdTable, then the compiled call
    items = em.TableConfig(VOCAB, 16, combiner="sum", name="items", id_map=em.DynamicIds())
    ids = np.unique(rng.integers(-(2**62), 2**62, 40))
    rows = rng.standard_normal((len(ids), 16)).astype(np.float32)
    raw = em.RawIdTable(ids, rows, VOCAB, step=1)
    fc = {"a": em.FeatureConfig(items), "b": em.FeatureConfig(tab)}
    a = _ragged(rng, batch)
    a = em.RaggedTensor(rng.choice(ids, a.values.shape[0]), a.row_splits)
    x = {"a": a, "b": _ragged(rng, batch)}
    dense = np.zeros((VOCAB, 16), np.float32)
    positions = em.RaggedTensor(np.searchsorted(ids, a.values), a.row_splits)
    dense[: len(ids)] = rows
    want = {"a": (fc["a"], positions, None, dense), "b": (fc["b"], x["b"], None, table)}
    return fc, x, None, {items: raw, tab: table}, want


KINDS = ["ragged", "sparse", "dense", "quantized", "raw ids"]
# a covering set, pairwise: each kind small and large, with numpy and with jax outputs, and
# every (size, outputs) pair (the kinds alternate which size gets which outputs)
CASES = [
    (kind, numpy_outputs, batch)
    for i, kind in enumerate(KINDS)
    for numpy_outputs, batch in (((True, 3), (False, 700)), ((False, 3), (True, 700)))[i % 2]
]


@pytest.mark.parametrize("kind, numpy_outputs, batch", CASES)
def test_a_request_visits_each_serving_module_once(kind, numpy_outputs, batch):
    rng = np.random.default_rng(len(kind) * 1000 + batch)
    fc, x, w, tables, want = _case(kind, batch, rng)
    previous = serving_settings.set_numpy_outputs(numpy_outputs)
    # No collection inside the trace (one would free garbage of the calls before there):
    # the collector off while tracing, not a full `gc.collect()` before it, which in a
    # worker of the whole suite walks its every object (seconds a call)
    gc.disable()
    try:
        em.serving_embedding_lookup(x, w, tables, fc)  # planned: the model's one-time work
        collect = _compat.collect_garbage()
        if collect is not None:
            collect()  # outputs of the request before given back now, not inside the trace
        visits, out = _visits(lambda: em.serving_embedding_lookup(x, w, tables, fc))
    finally:
        gc.enable()
        serving_settings.set_numpy_outputs(previous)
    assert visits[0] == "embedmesh.serving.lookup", visits
    assert len(visits) == len(set(visits)), f"a module entered twice: {visits}"
    assert not [v for v in visits if v.startswith(GENERAL)], f"the general path ran: {visits}"
    for key, (feature, inp, weight, table) in want.items():
        assert (type(out[key]) is np.ndarray) == numpy_outputs
        ref = reference_lookup(feature, inp, weight, table)
        np.testing.assert_allclose(np.asarray(out[key]), ref, rtol=2e-5, atol=2e-5, err_msg=key)


def test_the_general_path_is_traced_as_such():
    """The trace sees a request leave the compiled rules: a sequence feature runs the
    general path's kernels (so the test above would catch a request that fell there)."""
    rng = np.random.default_rng(1)
    tab = em.TableConfig(VOCAB, 8, name="t")
    fc = {"s": em.FeatureConfig(tab, max_sequence_length=3)}
    x = {"s": _ragged(rng, 4)}
    tables = {tab: rng.standard_normal((VOCAB, 8)).astype(np.float32)}
    em.serving_embedding_lookup(x, None, tables, fc)
    visits, _ = _visits(lambda: em.serving_embedding_lookup(x, None, tables, fc))
    assert [v for v in visits if v.startswith(GENERAL)], visits


def test_a_compiled_module_of_another_source_is_not_used(monkeypatch):
    """An editable install whose sources moved on keeps its old `_request` module: one
    that does not speak this source's calling convention is set aside with a warning
    that says how to rebuild it, and requests take the general path (same results).
    (The module's source run afresh here, as a module of its own, with the stale one in
    the old one's place: no process of its own to import jax in.)"""
    import importlib.util
    import types
    import warnings

    import embedmesh.serving

    stale = types.ModuleType("embedmesh.serving._request")
    stale.__file__ = "stale.so"
    monkeypatch.setitem(sys.modules, "embedmesh.serving._request", stale)
    monkeypatch.setattr(embedmesh.serving, "_request", stale, raising=False)
    spec = importlib.util.spec_from_file_location("fresh_serving_request", request.__file__)
    fresh = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        spec.loader.exec_module(fresh)
    assert fresh.compiled is None, fresh.compiled
    assert request.compiled is not None and request.compiled is not stale  # untouched
    (out,) = [str(x.message) for x in w if "another version" in str(x.message)]
    assert "interface 1, this one speaks 2" in out and "pip install -e ." in out
    assert "stale.so" in out
