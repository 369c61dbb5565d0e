"""TableConfig.quantization_config (TensorFlow's QuantizationConfig): a training lookup
clips and rounds every row it reads onto the config's levels before the combiner; the
gradient is straight-through; serving does not quantize (TF's CPU lookup ignores it).

Checked against a float64 reference of TF's documented formula (`q64` here) applied to
the tables, then the plain float64 training reference (`training_reference.py`): every
strategy on 1 and 4 devices, every combiner with weights, a sequence feature.
"""

import numpy as np
import pytest
from jax.sharding import Mesh
from training_reference import activation, layout, row_gradients

import embedmesh as em
from embedmesh import FeatureConfig, QuantizationConfig, TableConfig, serving_embedding_lookup
from embedmesh.device import ops
from embedmesh.device.ops import reference


def q64(x, buckets, lower, upper):
    """TF's formula in float64: clip, then round onto `buckets` levels."""
    x = np.clip(np.asarray(x, np.float64), lower, upper)
    quantum = (upper - lower) / (buckets - 1)
    return np.floor((x - lower) / quantum + 0.5) * quantum + lower


def away_from_ties(r, shape, buckets, lower, upper):
    """Values over and beyond [lower, upper], none within 1e-3 quanta of a half-way
    point (where float32 and float64 may round apart)."""
    x = r.uniform(lower - 1.0, upper + 1.0, shape)
    quantum = (upper - lower) / (buckets - 1)
    t = (x - lower) / quantum + 0.5
    frac = t - np.floor(t)
    near = (frac < 1e-3) | (frac > 1 - 1e-3)
    return np.where(near, x + 0.01 * quantum, x).astype(np.float32)


@pytest.mark.parametrize("buckets, lower, upper", [(7, -1.0, 1.5), (2, -0.5, 0.5), (256, 0.0, 1.0)])
def test_quantize_is_tf_formula(buckets, lower, upper):
    r = np.random.default_rng(buckets)
    x = away_from_ties(r, (200, 5), buckets, lower, upper)
    got = np.asarray(reference.quantize(x, (buckets, lower, upper)))
    np.testing.assert_allclose(got, q64(x, buckets, lower, upper), rtol=0, atol=1e-6)
    assert got.min() >= lower and got.max() <= upper
    assert len(np.unique(got)) <= buckets


def test_quantize_rounds_half_way_up_and_clips():
    # quantum 0.25 (exact in float32): 0.125 and 0.375 are half-way points
    x = np.array([0.125, 0.375, -3.0, 7.0, 1.0, 0.0, 0.1249], np.float32)
    got = np.asarray(reference.quantize(x, (5, 0.0, 1.0)))
    np.testing.assert_array_equal(got, [0.25, 0.5, 0.0, 1.0, 1.0, 0.0, 0.0])


def test_a_quantized_call_runs_the_reference():
    """No kernel applies the row transform: the registry picks the reference."""
    args = (np.zeros((4, 8), np.float32), np.arange(2, dtype=np.int32))
    for platform in ("cpu", "gpu", "tpu"):
        fn = ops.kernel_for("segment_gather_sum_mapped", platform, *args, quantization=(4, 0, 1))
        assert fn is ops.reference_of("segment_gather_sum_mapped")


QUANT = {"a": (7, -1.0, 1.5), "b": (3, -0.5, 0.5)}


def _model(sharding, n):
    qa, qb = (QuantizationConfig(*QUANT[k]) for k in "ab")
    ta = TableConfig(40, 4, name="a", combiner="mean", quantization_config=qa)
    tb = TableConfig(30, 8, name="b", combiner="sqrtn", quantization_config=qb)
    tc = TableConfig(20, 4, name="c", combiner="sum")  # not quantized
    feats = {
        "fa": FeatureConfig(ta),
        "fb": FeatureConfig(tb),
        "fc": FeatureConfig(tc),
        "fs": FeatureConfig(ta, max_sequence_length=3, name="fs"),
    }
    import jax

    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    emb = em.MeshEmbedding(feats, em.SGD(0.5), mesh=mesh, sharding=sharding)
    return emb, feats, (ta, tb, tc)


def _batch(r, b):
    def ragged(vocab, lo=1, hi=4):
        lengths = r.integers(lo, hi, b)
        values = r.integers(0, vocab, int(lengths.sum()))
        splits = np.concatenate([[0], np.cumsum(lengths)])
        weights = r.uniform(0.2, 2.0, values.size).astype(np.float32)
        return em.RaggedTensor(values=values, row_splits=splits), em.RaggedTensor(
            values=weights, row_splits=splits
        )

    fa, wa = ragged(40)
    fb, wb = ragged(30)
    fc, wc = ragged(20)
    fs, _ = ragged(40, 1, 5)
    return {"fa": fa, "fb": fb, "fc": fc, "fs": fs}, {"fa": wa, "fb": wb, "fc": wc, "fs": None}


@pytest.mark.parametrize(
    "n, sharding",
    [(1, "mod"), (4, "mod"), (4, "row_wise_pooled"), (4, "table_wise"), (4, "data_parallel")],
)
def test_training_lookups_quantize_and_the_update_is_straight_through(n, sharding):
    r = np.random.default_rng(n + len(sharding))
    emb, feats, tables = _model(sharding, n)
    emb.build()
    stacks = {s.tables: s.quantization for s in emb.plan.stacks}  # each config its own stack
    assert stacks[("a",)] == QUANT["a"] and stacks[("b",)] == QUANT["b"], stacks
    start = {
        t: away_from_ties(r, (t.vocabulary_size, t.dim), *QUANT.get(t.name, (7, -1.0, 1.5)))
        for t in tables
    }
    emb.set_tables(start)
    features, weights = _batch(r, 8)
    acts, preserved = emb.dequeue(emb.enqueue(features, weights))

    want_tables = {}
    for t in tables:
        v = start[t].astype(np.float64)
        want_tables[t.name] = q64(v, *QUANT[t.name]) if t.name in QUANT else v
    lays = {}
    for name, f in feats.items():
        lays[name] = layout(f, features[name], weights[name])
        want = activation(want_tables[f.table.name], lays[name])
        np.testing.assert_allclose(np.asarray(acts[name]), want, rtol=1e-5, atol=1e-6, err_msg=name)
    # quantization changed something (the tables reach outside [lower, upper])
    assert not np.allclose(np.asarray(acts["fa"]), activation(start[tables[0]], lays["fa"]))

    # the update: d loss / d activation as given, SGD on the unquantized tables
    dacts = {k: r.uniform(-1, 1, np.shape(a)).astype(np.float32) for k, a in acts.items()}
    emb.apply_gradients(dacts, preserved)
    grads = row_gradients([(name, f.table.name, lays[name]) for name, f in feats.items()], dacts)
    got = emb.embedding_tables
    for t in tables:
        want = start[t].astype(np.float64)
        for i, g in grads[t.name].items():
            want[i] -= 0.5 * g
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5, err_msg=t.name)


def test_serving_does_not_quantize():
    """TF's serving_embedding_lookup is its plain CPU lookup: the config is not applied."""
    t = TableConfig(4, 2, quantization_config=QuantizationConfig(4, -1.0, 1.0))
    table = np.array([[0.1, 0.2], [0.3, 0.45], [0.0, 0.0], [1.9, 0.7]], np.float32)
    out = serving_embedding_lookup(
        {"f": np.array([1, 3])}, None, {t: table}, {"f": FeatureConfig(t)}
    )
    np.testing.assert_array_equal(np.asarray(out["f"]), table[[1, 3]])
