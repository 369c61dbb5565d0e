"""Quantized serving tables (`embedmesh.serving.quantize_tables`, issue 41 item 3):
int8 rows (FBGEMM's fused 8-bit row-wise layout), fp16, bf16 and bucket codes, served
by `serving_embedding_lookup` (C++ and numpy backends, and the traced path),
`export_serving` / `load_serving` and the SavedModel export's table conversion.

References are float64, written here: the decoded value of each layout (`q * scale +
bias`, the float16 / bfloat16 value, training's formula for codes) and the bag sums
over them. Tables are random normal (never zeros), outputs poisoned (conftest), weights
multiples of 1/4 so sums of weights are exact in float32 and float64 alike.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from paths import child_pythonpath

import embedmesh as em
from embedmesh.device.ops import reference
from embedmesh.serving import (
    Dense,
    QuantizedTable,
    Ragged,
    export_serving,
    kernels,
    load_serving,
    quantize_table,
    quantize_tables,
)

# Not numba: its quantized bag is the numpy backend's decode (`backends.common.decoded_bag`)
# then its float32 bag kernel, which tests/device/test_kernels.py checks against float64 (the
# same kernels, bit for bit); here it cost ~19 s of compiling in a CI worker.
BACKENDS = ["numpy"] + (["native"] if kernels.HAVE_NATIVE else [])
KINDS = ["int8", "fp16", "bf16", "codes"]
COMBINERS = ["sum", "mean", "sqrtn"]
QUANT = em.QuantizationConfig(200, -1.5, 1.25)
SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(autouse=True)
def poison(poisoned_outputs):
    """Every buffer the kernels allocate starts as NaN: conftest."""


@pytest.fixture(autouse=True)
def restore_backend():
    previous = kernels.get_backend()
    yield
    kernels.set_backend(previous)


def _table(r, vocab, dim, spread=1.0):
    x = r.normal(size=(vocab, dim)) * spread + r.normal(size=(vocab, 1))
    x = x.astype(np.float32)
    x[0] = 0.75  # a constant row: int8 scale 0, exact
    return x


def decoded64(q: QuantizedTable) -> np.ndarray:
    """The float64 value of every element, from the layout's definition."""
    data = np.asarray(q.data)
    if q.kind in ("fp16", "bf16"):
        return data.astype(np.float64)
    if q.kind == "codes":
        return np.asarray(q.values, np.float64)[data]
    sb = np.ascontiguousarray(data[:, q.dim :]).view(np.float32).astype(np.float64)
    return data[:, : q.dim].astype(np.float64) * sb[:, :1] + sb[:, 1:]


def element_bound(q: QuantizedTable, x: np.ndarray) -> np.ndarray:
    """The stated bound on |x - decoded| per element (float32 decode included)."""
    x = x.astype(np.float64)
    if q.kind == "fp16":
        return np.maximum(2.0**-11 * np.abs(x), 2.0**-25)
    if q.kind == "bf16":
        return 2.0**-8 * np.abs(x)
    if q.kind == "int8":
        sb = np.ascontiguousarray(np.asarray(q.data)[:, q.dim :]).view(np.float32)
        scale, bias = sb[:, :1].astype(np.float64), sb[:, 1:].astype(np.float64)
        return scale / 2 + 2.0**-23 * (np.abs(bias) + 255 * scale)
    return np.zeros_like(x)  # codes: exact against training's values (tested apart)


# ---------------------------------------------------------------------------
# The layouts and their bounds


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_int8_layout_and_error_bound(dim):
    r = np.random.default_rng(dim)
    x = _table(r, 40, dim, spread=float(r.uniform(0.01, 100)))
    q = quantize_table(x, "int8")
    data = np.asarray(q.data)
    assert q.kind == "int8" and data.dtype == np.uint8 and data.shape == (40, dim + 8)
    assert q.shape == (40, dim) and q.nbytes == 40 * (dim + 8)
    sb = np.ascontiguousarray(data[:, dim:]).view(np.float32)
    np.testing.assert_array_equal(sb[:, 1], x.min(axis=1))  # bias = row min
    want_scale = ((x.max(axis=1) - x.min(axis=1)) / np.float32(255)).astype(np.float32)
    np.testing.assert_array_equal(sb[:, 0], want_scale)
    exact = decoded64(q)  # q * scale + bias in float64: within scale / 2
    assert (np.abs(exact - x) <= sb[:, :1].astype(np.float64) / 2 * (1 + 1e-12)).all()
    got = q.dequantize().astype(np.float64)  # the float32 decode the kernels do
    assert (np.abs(got - x) <= element_bound(q, x)).all()
    np.testing.assert_array_equal(got[0], x[0])  # the constant row is exact
    assert dim == 1 or np.abs(got - x).max() > 0  # quantized for real (dim 1: exact)


@pytest.mark.parametrize("kind, dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_half_tables_round_to_nearest(kind, dtype):
    r = np.random.default_rng(3)
    x = _table(r, 30, 9)
    x[1, :3] = [1e-6, -3e-7, 2.0**-20]  # float16 subnormals
    q = quantize_table(x, kind)
    assert np.asarray(q.data).dtype == dtype and q.nbytes == 30 * 9 * 2
    got = q.dequantize().astype(np.float64)
    assert (np.abs(got - x) <= element_bound(q, x)).all()
    assert np.abs(got - x).max() > 0


@pytest.mark.parametrize(
    "buckets, lower, upper", [(2, -0.5, 0.5), (7, -1.0, 1.5), (256, -1.0, 1.0), (200, -1.5, 1.25)]
)
def test_codes_decode_to_training_formula_bit_for_bit(buckets, lower, upper):
    cfg = em.TableConfig(64, 5, quantization_config=em.QuantizationConfig(buckets, lower, upper))
    r = np.random.default_rng(buckets)
    x = r.uniform(lower - 1, upper + 1, (64, 5)).astype(np.float32)
    quantum = np.float32((np.float32(upper) - np.float32(lower)) / np.float32(buckets - 1))
    k = np.arange(buckets, dtype=np.float32)
    half = (k[:-1] + np.float32(0.5)) * quantum + np.float32(lower)  # on half-way points
    x.reshape(-1)[: min(half.size, x.size)] = half[: x.size]
    x[-1, :2] = [lower - 5, upper + 5]  # clipped
    q = quantize_table(x, "codes", config=cfg)
    assert np.asarray(q.data).dtype == np.uint8 and q.values.shape == (buckets,)
    want = np.asarray(jax.jit(lambda t: reference.quantize(t, (buckets, lower, upper)))(x))
    np.testing.assert_array_equal(q.dequantize(), want)  # training's own function
    x64 = np.clip(x.astype(np.float64), lower, upper)  # and TF's formula, float64
    q64 = np.floor((x64 - lower) / ((upper - lower) / (buckets - 1)) + 0.5)
    q64 = q64 * ((upper - lower) / (buckets - 1)) + lower
    away = np.ones(x.size, bool)  # off the planted half-way points (float32 and float64
    away[: half.size] = False  # may round those apart)
    np.testing.assert_allclose(
        q.dequantize().reshape(-1)[away], q64.reshape(-1)[away], rtol=0, atol=2e-6
    )


# ---------------------------------------------------------------------------
# The bag kernels, every backend


@st.composite
def bag_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    r = np.random.default_rng(seed)
    vocab = draw(st.integers(1, 30))
    dim = draw(st.sampled_from([1, 3, 8, 16, 17, 33, 64, 100, 128, 256, 272, 300]))
    bags = draw(st.integers(0, 9))
    lengths = r.integers(0, 6, bags)
    n = int(lengths.sum())
    ids = r.integers(0, vocab, n).astype(draw(st.sampled_from([np.int32, np.int64])))
    weights = None
    if draw(st.booleans()):
        weights = (r.integers(-4, 9, n) / 4).astype(np.float32)
    prune = draw(st.booleans())
    if prune and n:
        ids[r.random(n) < 0.2] = -1
    combiner = draw(st.sampled_from(COMBINERS))
    kind = draw(st.sampled_from(KINDS))
    return r, vocab, dim, ids, np.concatenate([[0], np.cumsum(lengths)]), weights, combiner, kind


def bag64(table64, ids, offsets, weights, combiner, prune):
    """Float64 bag sums of the rows of table64, TensorFlow's pruning, the combiners."""
    out = np.zeros((offsets.shape[0] - 1, table64.shape[1]))
    absum = np.zeros_like(out)
    for b in range(out.shape[0]):
        num, den, den2 = 0.0, 0.0, 0.0
        for k in range(offsets[b], offsets[b + 1]):
            w = 1.0 if weights is None else float(weights[k])
            if prune and (ids[k] < 0 or (weights is not None and not w > 0)):
                continue
            num = num + w * table64[ids[k]]
            absum[b] += abs(w) * np.abs(table64[ids[k]])
            den, den2 = den + w, den2 + w * w
        d = {"sum": 1.0, "mean": den, "sqrtn": np.sqrt(den2)}[combiner]
        out[b] = 0.0 if d == 0 else num / d
        absum[b] = 0.0 if d == 0 else absum[b] / abs(d)
    return out, absum


@SETTINGS
@given(case=bag_cases())
def test_bag_combine_quantized_every_backend(case):
    r, vocab, dim, ids, offsets, weights, combiner, kind = case
    cfg = em.TableConfig(vocab, dim, quantization_config=QUANT)
    x = _table(r, vocab, dim)
    q = quantize_table(x, kind, config=cfg)
    prune = bool((ids < 0).any()) or weights is not None
    # the sums' reference: float64 sums of the float32 decoded values (the decode itself:
    # test_int8_layout_and_error_bound, test_half_tables_..., test_codes_...)
    want, absum = bag64(q.dequantize().astype(np.float64), ids, offsets, weights, combiner, prune)
    length = int(np.diff(offsets).max(initial=0))
    got = {}
    for backend in BACKENDS:
        kernels.set_backend(backend)
        out = kernels.bag_combine(
            q, ids, offsets, weights, combiner, prune_ids=prune, prune_weights=prune
        )
        assert out.dtype == np.float32 and out.shape == want.shape
        err = np.abs(out.astype(np.float64) - want)
        assert (err <= (length + 3) * 2.0**-23 * absum + 1e-30).all(), (backend, err.max())
        got[backend] = out.copy()
    if "native" in got and combiner == "sum":  # the same decode and sums, bit for bit
        np.testing.assert_array_equal(got["native"], got["numpy"])  # (denominators: any order)
    # against the unquantized table: within the stated element bound, summed
    if kind != "codes":
        want_x, _ = bag64(x.astype(np.float64), ids, offsets, weights, combiner, prune)
        absw = None if weights is None else np.abs(weights)
        bound, _ = bag64(element_bound(q, x), ids, offsets, absw, "sum", prune)
        den = _denominators(ids, offsets, weights, combiner, prune)
        tol = bound / np.where(den == 0, 1.0, den)[:, None] + (length + 3) * 2.0**-23 * absum
        assert (np.abs(got[BACKENDS[-1]] - want_x) <= tol * (1 + 1e-9) + 1e-30).all()


def _denominators(ids, offsets, weights, combiner, prune):
    out = np.ones(offsets.shape[0] - 1)
    for b in range(out.shape[0]):
        ws = [
            1.0 if weights is None else float(weights[k])
            for k in range(offsets[b], offsets[b + 1])
            if not (prune and (ids[k] < 0 or (weights is not None and not weights[k] > 0)))
        ]
        if combiner == "mean":
            out[b] = abs(sum(ws))
        elif combiner == "sqrtn":
            out[b] = np.sqrt(sum(w * w for w in ws))
    return out


@pytest.mark.parametrize("dim", [4, 16, 256])  # two passes; one pass; one, all lines prefetched
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_id_in_a_quantized_table_names_the_feature(backend, dim):
    kernels.set_backend(backend)
    t = em.TableConfig(10, dim, name="tab")
    q = quantize_tables({t: _table(np.random.default_rng(0), 10, dim)}, "int8")
    bad = em.RaggedTensor(values=np.array([1, 10]), row_splits=np.array([0, 2]))
    with pytest.raises(ValueError, match="feat"):
        em.serving_embedding_lookup({"feat": bad}, None, q, {"feat": em.FeatureConfig(t)})


# ---------------------------------------------------------------------------
# serving_embedding_lookup: host and traced


def _features():
    ta = em.TableConfig(50, 16, combiner="mean", name="ta", quantization_config=QUANT)
    tb = em.TableConfig(40, 7, combiner="sqrtn", name="tb", quantization_config=QUANT)
    tc = em.TableConfig(30, 33, combiner="sum", name="tc", quantization_config=QUANT)
    feats = {
        "ragged": em.FeatureConfig(ta),
        "sparse": em.FeatureConfig(tb),
        "dense": em.FeatureConfig(tc),
        "seq": em.FeatureConfig(ta, max_sequence_length=3),
        "safe": em.FeatureConfig(tc),  # sum: no safe lookup; weights prune nothing
    }
    return feats, (ta, tb, tc)


def _inputs(r, batch=5):
    lengths = r.integers(0, 5, batch)
    values = r.integers(0, 50, int(lengths.sum()))
    splits = np.concatenate([[0], np.cumsum(lengths)])
    ragged = em.RaggedTensor(values=values, row_splits=splits)
    w_ragged = em.RaggedTensor(
        values=(r.integers(1, 9, values.size) / 4).astype(np.float32), row_splits=splits
    )
    cols = [r.choice(4, r.integers(0, 4), replace=False) for _ in range(batch)]
    idx = np.array([[i, c] for i, cs in enumerate(cols) for c in sorted(cs)], np.int64)
    idx = idx.reshape(-1, 2)
    sparse = em.SparseTensor(
        indices=idx, values=r.integers(0, 40, len(idx)), dense_shape=(batch, 4)
    )
    w_sparse = em.SparseTensor(
        indices=idx,
        values=(r.integers(1, 9, len(idx)) / 4).astype(np.float32),
        dense_shape=(batch, 4),
    )
    inputs = {
        "ragged": ragged,
        "sparse": sparse,
        "dense": r.integers(0, 30, batch),
        "seq": em.RaggedTensor(values=values, row_splits=splits),
        "safe": em.RaggedTensor(values=r.integers(0, 30, values.size), row_splits=splits),
    }
    weights = {"ragged": w_ragged, "sparse": w_sparse, "dense": None, "seq": None, "safe": None}
    return inputs, weights


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_quantized_equals_lookup_of_decoded_tables(kind):
    """Every backend, host path: the quantized lookup is the float32 lookup of the decoded
    tables, bit for bit (the same sums of the same values), within a float64 reference;
    the traced path (jax.jit) agrees to float32 rounding."""
    feats, configs = _features()
    r = np.random.default_rng(KINDS.index(kind))
    tables = {t: _table(r, t.vocabulary_size, t.dim) for t in configs}
    q = quantize_tables(tables, kind)
    assert all(isinstance(v, QuantizedTable) and v.kind == kind for v in q.values())
    decoded = {t: v.dequantize() for t, v in q.items()}
    inputs, weights = _inputs(r)
    for backend in BACKENDS:
        kernels.set_backend(backend)
        got = em.serving_embedding_lookup(inputs, weights, q, feats)
        want = em.serving_embedding_lookup(inputs, weights, decoded, feats)
        for name in feats:
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)
    serve = jax.jit(lambda i, w, t: em.serving_embedding_lookup(i, w, t, feats))
    traced = serve(inputs, weights, q)
    for name in feats:
        np.testing.assert_allclose(
            np.asarray(traced[name]), np.asarray(got[name]), rtol=2e-6, atol=1e-6, err_msg=name
        )
    # the float64 reference of one combined feature
    f = feats["ragged"]
    splits = np.asarray(inputs["ragged"].row_splits)
    want64, absum = bag64(
        q[f.table].dequantize().astype(np.float64),
        np.asarray(inputs["ragged"].values),
        splits,
        np.asarray(weights["ragged"].values),
        "mean",
        False,
    )
    err = np.abs(np.asarray(got["ragged"]) - want64)
    assert (err <= 8 * 2.0**-23 * absum + 1e-30).all()
    assert np.abs(want64).max() > 0


@pytest.mark.skipif(not kernels.HAVE_NATIVE, reason="no C++ serving kernels")
@pytest.mark.parametrize("threads", [1, 2])
def test_quantized_bags_split_over_threads(native_poisoned, threads):
    """The C++ runner cuts a quantized bag task into chunks of bags over its threads
    (however small the request: native_poisoned), one call or handed over feature by
    feature: the same values as the decoded float32 tables."""
    from embedmesh.serving import lookup

    feats, configs = _features()
    r = np.random.default_rng(21 + threads)
    tables = {t: _table(r, t.vocabulary_size, t.dim) for t in configs}
    q = quantize_tables(tables, {"ta": "int8", "tb": "fp16", "tc": "bf16"})
    decoded = {t: v.dequantize() for t, v in q.items()}
    inputs, weights = _inputs(r, batch=3000)  # ~6k ids a feature: chunks of >= 2048 (runner.cc)
    previous = lookup.set_host_threads(threads)
    try:
        got = em.serving_embedding_lookup(inputs, weights, q, feats)
        want = em.serving_embedding_lookup(inputs, weights, decoded, feats)
    finally:
        lookup.set_host_threads(previous)
    for name in feats:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)


def test_codes_serve_what_training_looked_up():
    """A table with a QuantizationConfig trained on one device: serving its codes gives
    training's activations, bit for bit where a row is not combined with another (a
    sequence feature, one id a sample under "sum"), to float32 rounding otherwise (training
    scales by the combiner's gains before it sums). In a process of its own, with XLA's
    CPU fusion emitters as users have them: the suite's faster loop emitters contract a
    multiply and an add into one rounding (`-1 + 255 * (2 / 255)` gives 1.0000001, not 1),
    which the serving kernels never do."""
    flags = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "").replace(
        "--xla_cpu_use_fusion_emitters=false", ""
    )
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=child_pythonpath())
    code = "import test_serving_quantized as t; t.codes_against_training()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK"), proc.stdout[-3000:]


def codes_against_training():
    q1 = em.QuantizationConfig(9, -0.5, 0.75)
    q2 = em.QuantizationConfig(256, -1.0, 1.0)
    ta = em.TableConfig(30, 6, combiner="sum", name="a", quantization_config=q1)
    tb = em.TableConfig(20, 16, combiner="mean", name="b", quantization_config=q2)
    feats = {
        "one": em.FeatureConfig(ta),
        "seq": em.FeatureConfig(tb, max_sequence_length=3),
        "bag": em.FeatureConfig(tb),
    }
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    emb = em.MeshEmbedding(feats, em.SGD(0.1), mesh=mesh)
    emb.build()
    r = np.random.default_rng(7)
    start = {
        t: r.uniform(-1.5, 1.5, (t.vocabulary_size, t.dim)).astype(np.float32) for t in (ta, tb)
    }
    emb.set_tables(start)
    splits = np.array([0, 2, 3, 3, 6])
    features = {
        "one": r.integers(0, 30, 4),
        "seq": em.RaggedTensor(values=r.integers(0, 20, 6), row_splits=splits),
        "bag": em.RaggedTensor(values=r.integers(0, 20, 6), row_splits=splits),
    }
    acts, _ = emb.dequeue(emb.enqueue(features))
    codes = quantize_tables(emb.embedding_tables, "codes", feature_config=feats)
    served = em.serving_embedding_lookup(features, None, codes, feats)
    for name in ("one", "seq"):
        np.testing.assert_array_equal(np.asarray(served[name]), np.asarray(acts[name]), name)
    np.testing.assert_allclose(np.asarray(served["bag"]), np.asarray(acts["bag"]), rtol=1e-6)
    # and it differs from serving the float tables (TF's lookup, which does not quantize)
    plain = em.serving_embedding_lookup(features, None, start, feats)
    assert not np.allclose(np.asarray(plain["one"]), np.asarray(served["one"]))
    print("OK")


# ---------------------------------------------------------------------------
# Export and load


def test_export_round_trip_keeps_the_dtypes(tmp_path):
    feats, configs = _features()
    r = np.random.default_rng(11)
    tables = {t: _table(r, t.vocabulary_size, t.dim) for t in configs}
    kinds = {"ta": "int8", "tb": "codes", "tc": "bf16"}
    q = quantize_tables(tables, kinds)
    params = {"w": r.normal(size=(7, 2)).astype(np.float32)}

    def serve(inputs, tabs, p):
        acts = em.serving_embedding_lookup(inputs, None, tabs, feats)
        return {"score": acts["sparse"] @ p["w"], "ragged": acts["ragged"], "dense": acts["dense"]}

    sig = {
        "ragged": Ragged(nnz_per_example=4),
        "sparse": Ragged(nnz_per_example=4),
        "dense": Dense(),
    }
    manifest = export_serving(
        serve,
        tmp_path,
        tables=q,
        params=params,
        input_signature=sig,
        batch_sizes=(4,),
        feature_config=feats,
    )
    assert manifest["format_version"] == 2
    by_name = {e["name"]: e for e in manifest["tables"]}
    assert {n: e["quantized"]["kind"] for n, e in by_name.items()} == kinds
    assert by_name["ta"]["dtype"] == "uint8" and by_name["ta"]["shape"] == [50, 16 + 8]
    assert by_name["tc"]["dtype"] == "bfloat16" and len(by_name["tb"]["more"]) == 1
    server = load_serving(tmp_path)
    for name, kind in kinds.items():
        loaded = server.tables[name]
        assert isinstance(loaded, QuantizedTable) and loaded.kind == kind
    original = {t.name: t for t in configs}
    for name in kinds:
        np.testing.assert_array_equal(
            np.asarray(server.tables[name].data), np.asarray(q[original[name]].data)
        )
    lengths = np.array([2, 0, 3])
    inputs = {
        "ragged": em.RaggedTensor.from_row_lengths(r.integers(0, 50, 5), lengths),
        "sparse": em.RaggedTensor.from_row_lengths(r.integers(0, 40, 5), lengths),
        "dense": r.integers(0, 30, 3),
    }
    got = server(inputs)
    want = serve(inputs, q, params)
    for k in want:
        np.testing.assert_allclose(got[k], np.asarray(want[k]), rtol=2e-6, atol=1e-6, err_msg=k)


def test_load_tables_quantizes_a_checkpoint_table_by_table(tmp_path):
    """`embedmesh.serving.load_tables(..., dtype=)`: the checkpoint's tables, quantized
    as `quantize_tables` quantizes what `checkpoint.load_tables` returns."""
    from embedmesh import checkpoint as ckpt
    from embedmesh.serving import load_tables

    ta = em.TableConfig(30, 16, name="a")
    tb = em.TableConfig(20, 5, name="b", quantization_config=QUANT)
    feats = {"fa": em.FeatureConfig(ta), "fb": em.FeatureConfig(tb)}
    emb = em.MeshEmbedding(feats, em.SGD(0.1), mesh=Mesh(np.array(jax.devices()[:1]), ("x",)))
    r = np.random.default_rng(3)
    emb.set_tables({t: _table(r, t.vocabulary_size, t.dim) for t in (ta, tb)})
    ckpt.save(tmp_path, emb)
    plain = ckpt.load_tables(tmp_path, feature_config=feats)
    kinds = {"a": "int8", "b": "codes"}
    got = load_tables(tmp_path, feature_config=feats, dtype=kinds)  # one table at a time
    want = quantize_tables(plain, kinds)
    assert set(got) == {ta, tb}
    for t in (ta, tb):
        assert got[t].kind == kinds[t.name]
        np.testing.assert_array_equal(np.asarray(got[t].data), np.asarray(want[t].data))
    np.testing.assert_array_equal(got[tb].values, want[tb].values)
    for t, v in load_tables(tmp_path, feature_config=feats).items():  # dtype None: float32
        np.testing.assert_array_equal(v, plain[t])
    together = load_tables(tmp_path, dtype="fp16")  # no feature config: read, then quantized
    assert {t.name: v.kind for t, v in together.items()} == {"a": "fp16", "b": "fp16"}


def test_saved_model_tables_are_decoded():
    """`export_saved_model` (TensorFlow, not installed in CI) gives TF the decoded float32
    tables: checked on its table conversion, which needs no TensorFlow."""
    from embedmesh.config import resolve_feature_config
    from embedmesh.serving.saved_model import _tables_by_name

    feats, configs = _features()
    r = np.random.default_rng(5)
    q = quantize_tables({t: _table(r, t.vocabulary_size, t.dim) for t in configs}, "int8")
    by_name, raw_ids = _tables_by_name(resolve_feature_config(feats), q)
    assert raw_ids == {}  # no table of raw ids
    for t in configs:
        np.testing.assert_array_equal(by_name[t.name], q[t].dequantize())
        assert by_name[t.name].dtype == np.float32


# ---------------------------------------------------------------------------
# Errors


def test_bad_requests_raise_value_errors_naming_the_table():
    r = np.random.default_rng(1)
    plain = em.TableConfig(10, 4, name="plain")
    many = em.TableConfig(10, 4, name="many", quantization_config=em.QuantizationConfig(257, 0, 1))
    x = _table(r, 10, 4)
    with pytest.raises(ValueError, match="table plain.*unknown serving dtype 'int4'"):
        quantize_tables({plain: x}, "int4")
    with pytest.raises(ValueError, match="table many.*at most 256 buckets.*257"):
        quantize_tables({many: x}, "codes")
    with pytest.raises(ValueError, match="table plain.*quantization_config"):
        quantize_tables({plain: x}, "codes")
    nan = x.copy()
    nan[3, 1] = np.nan
    with pytest.raises(ValueError, match="table plain.*non-finite.*row 3"):
        quantize_tables({plain: nan}, "int8")
    big = x.copy()
    big[2, 0] = 1e6
    with pytest.raises(ValueError, match="table plain.*float16's range"):
        quantize_tables({plain: big}, "fp16")
    with pytest.raises(ValueError, match="'nope', which is not in tables"):
        quantize_tables({plain: x}, {"nope": "int8"})
    with pytest.raises(ValueError, match="table x.*unknown serving dtype"):
        quantize_table(x, np.int16, name="x")
    # unnamed tables are named as the feature config names them
    anon = em.TableConfig(10, 4)
    with pytest.raises(ValueError, match="table table_0"):
        quantize_tables({anon: x}, "codes", feature_config={"f": em.FeatureConfig(anon)})
    # float32 / None keep the table as it is
    kept = quantize_tables({plain: x, many: x}, {"plain": "int8", "many": None})
    assert isinstance(kept[plain], QuantizedTable) and isinstance(kept[many], np.ndarray)


# ---------------------------------------------------------------------------
# Tables trained in bfloat16 / float16


def _trained_low_precision(tmp_path, dtype):
    """A bfloat16 / float16 table trained two SGD steps (its values no float32 table's),
    saved to a checkpoint at `tmp_path`: the feature config and the trained table."""
    from embedmesh import checkpoint as ckpt

    t = em.TableConfig(24, 6, name="v", dtype=dtype)
    feats = {"f": em.FeatureConfig(t)}
    emb = em.MeshEmbedding(feats, em.SGD(0.5), mesh=Mesh(np.array(jax.devices()[:1]), ("x",)))
    r = np.random.default_rng(11)
    for _ in range(2):
        ids = r.integers(0, 24, size=(8, 3))
        acts, keep = emb({"f": ids})
        emb.apply_gradients({"f": np.asarray(r.normal(size=acts["f"].shape), np.float32)}, keep)
    trained = np.asarray(emb.embedding_tables[t])
    assert trained.dtype == np.dtype(dtype)
    ckpt.save(tmp_path, emb)
    return feats, t, trained


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_low_precision_tables_quantize_from_memory_and_checkpoints(tmp_path, dtype):
    """A table trained in bfloat16 (numpy dtype kind 'V', not 'f') or float16 serves in
    every kind, quantized from memory and from its checkpoint, within the stated bound of
    its float64 values. (One table trained and saved, every kind read from it.)"""
    from embedmesh.serving import load_tables

    feats, t, trained = _trained_low_precision(tmp_path, dtype)
    x64 = trained.astype(np.float64)
    for kind in ["int8", "fp16", "bf16", "float32"]:
        from_memory = quantize_tables({t: trained}, kind)[t]
        from_checkpoint = load_tables(tmp_path, feature_config=feats, dtype=kind)[t]
        together = load_tables(tmp_path, dtype=kind)  # no feature config: read, then quantized
        assert [c.name for c in together] == ["v"]
        for got in (from_memory, from_checkpoint, next(iter(together.values()))):
            if kind == "float32":  # every bfloat16 / float16 value is a float32 value
                assert isinstance(got, np.ndarray) and got.dtype == np.float32
                np.testing.assert_array_equal(got.astype(np.float64), x64)
                continue
            assert got.kind == kind and got.shape == trained.shape, kind
            err = np.abs(decoded64(got) - x64)
            assert (err <= element_bound(got, x64)).all(), kind
            dequantized = got.dequantize().astype(np.float64)
            assert (np.abs(dequantized - x64) <= element_bound(got, x64)).all(), kind
            np.testing.assert_array_equal(
                np.asarray(got.data), np.asarray(from_memory.data), err_msg=kind
            )


# ---------------------------------------------------------------------------
# Rows that no kind can encode within its bound


F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def test_rows_beyond_a_kinds_range_are_refused_naming_row_and_column():
    """An int8 row whose range overflows float32 (its scale would be inf and every value
    serve NaN) and a value beyond bfloat16's largest finite (stored as inf) are refused
    as float16's are: a ValueError naming the table, row, column and value, no warning."""
    import warnings

    t = em.TableConfig(3, 4, name="wide")
    x = np.array([[1, 2, 3, 4], [-3e38, 0, 1, 3e38], [5, 6, 7, 8]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning is no longer the signal
        with pytest.raises(ValueError, match=r"table wide: value 3e\+38 at row 1, column 3"):
            quantize_tables({t: x}, "int8")
        y = np.full((3, 4), 0.5, np.float32)
        y[2, 1] = -3.39e38  # beyond bfloat16's largest finite (3.3895e38)
        with pytest.raises(ValueError, match=r"table wide: value -3.39e\+38 at row 2, column 1"):
            quantize_tables({t: y}, "bf16")
        with pytest.raises(ValueError, match=r"table wide: value .* at row 2, column 1.*float16"):
            quantize_tables({t: y}, "fp16")
        y[2, 1] = -BF16_MAX  # the largest finite itself is exact
        assert quantize_tables({t: y}, "bf16")[t].dequantize()[2, 1] == -BF16_MAX
        wide = quantize_tables({t: x}, "bf16")[t]  # the int8 row bfloat16 does serve
        x64 = x.astype(np.float64)
        assert (
            np.abs(wide.dequantize().astype(np.float64) - x64) <= element_bound(wide, x64)
        ).all()


EXTREMES = [F32_MAX, -F32_MAX, F32_MAX / 2, -F32_MAX / 2, 3e38, -3e38, 1.7e38, -1.7e38, 0.0, 1.0]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(-F32_MAX, F32_MAX, width=32, allow_subnormal=False),
            st.sampled_from(EXTREMES),
        ),
        min_size=2,
        max_size=6,
    ),
    st.sampled_from([1.0, 0.5, 0.25]),
)
@example([-3e38, 0.0, 1.0, 3e38], 1.0)
@example([0.0, F32_MAX], 1.0)
@example([-F32_MAX, F32_MAX / 2], 1.0)
def test_int8_rows_near_float32s_limit_encode_within_the_bound_or_are_refused(row, spread):
    """Rows with values up to float32's largest finite: either every decoded value (the
    float32 decode the kernels run, and q * scale + bias in float64) is within the stated
    bound of its float64 value, or the row is refused naming row 1 and a column."""
    x = np.array([[0.25] * len(row), row], np.float32) * np.float32(spread)
    try:
        q = quantize_table(x, "int8", name="near")
    except ValueError as e:
        assert "table near: value" in str(e) and "at row 1, column" in str(e)
        span = float(x[1].max()) - float(x[1].min())  # float64: exact
        assert span > F32_MAX or "float32 decode gives" in str(e)  # refused for a cause
        return
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        got = q.dequantize().astype(np.float64)
    assert (np.abs(got - x64) <= element_bound(q, x64)).all()
    assert (np.abs(decoded64(q) - x64) <= element_bound(q, x64)).all()
