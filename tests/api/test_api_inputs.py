"""Items 15, 20, 21: non-finite weights, serving table shapes, messages with the real value."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meshes import mesh_of

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, SparseTensor, TableConfig
from embedmesh.facade import MeshEmbedding
from embedmesh.inputs import check_id_range
from embedmesh.serving import kernels


def layer(n=2):
    t = TableConfig(10, 4, name="t")
    u = TableConfig(10, 4, name="u", combiner="sum")
    feats = {"r": FeatureConfig(t), "s": FeatureConfig(u)}
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(n))
    emb.build()
    return t, u, feats, emb


def batch(bad_value=None, where=3, kind="ragged"):
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    if bad_value is not None:
        w[where] = bad_value
    r = RaggedTensor.from_row_lengths(ids, [2, 2, 2, 2])
    idx = np.array([[b, c] for b in range(4) for c in range(2)])
    s = SparseTensor(idx, ids, (4, 2))
    feats = {"r": r, "s": s}
    weights = {
        "r": RaggedTensor(np.linspace(0.5, 1.5, 8).astype(np.float32), r.row_splits),
        "s": SparseTensor(idx, np.ones(8, np.float32), (4, 2)),
    }
    weights[kind[0]] = (
        RaggedTensor(w, r.row_splits) if kind == "ragged" else SparseTensor(idx, w, (4, 2))
    )
    return feats, weights


def snapshot(emb):
    return {t: {k: np.array(a) for k, a in d.items()} for t, d in emb.variables.items()}, int(
        emb.state.step
    )


# -- item 15 ------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    where=st.integers(0, 7),
    kind=st.sampled_from(["ragged", "sparse"]),
)
def test_non_finite_weight_is_value_error_in_training_and_serving(bad, where, kind):
    t, u, feats, emb = LAYER
    name = kind[0]
    snap = snapshot(emb)
    f, w = batch(bad, where, kind)
    with pytest.raises(
        ValueError, match=rf"feature {name}: weights must be finite, got {bad} at entry {where}$"
    ):
        emb(f, w)
    with pytest.raises(ValueError, match=rf"feature {name}: .*entry {where}"):
        emb.enqueue(f, w)
    with pytest.raises(ValueError, match=rf"feature {name}: .*entry {where}"):
        em.serving_embedding_lookup(f, w, emb.embedding_tables, feats)
    v, step = snapshot(emb)
    assert step == snap[1]
    for tab in v:
        for k in v[tab]:
            assert np.array_equal(v[tab][k], snap[0][tab][k])


LAYER = layer()


def test_finite_weights_still_train():
    t, u, feats, emb = layer()
    f, w = batch()
    acts, pre = emb(f, w)
    emb.apply_gradients({k: jnp.ones(v.shape) for k, v in acts.items()}, pre)
    for d in emb.variables.values():
        for a in d.values():
            assert np.isfinite(a).all()


# -- item 20 ------------------------------------------------------------------


def test_serving_checks_table_shape():
    t = TableConfig(1000, 8, name="big")
    feats = {"f": FeatureConfig(t)}
    ids = np.array([1, 2])
    for shape in [(1000, 16), (999, 8), (1000,)]:
        msg = re.escape(f"table big has shape {shape}, expected (vocabulary_size, dim) = (1000, 8)")
        with pytest.raises(ValueError, match=msg):
            em.serving_embedding_lookup({"f": ids}, None, {t: np.zeros(shape, np.float32)}, feats)
    # inside jit the (static) shape is checked too
    with pytest.raises(ValueError, match="table big"):
        jax.jit(
            lambda tab: em.serving_embedding_lookup({"f": jnp.asarray(ids)}, None, {t: tab}, feats)
        )(jnp.zeros((1000, 16)))
    out = em.serving_embedding_lookup({"f": ids}, None, {t: np.zeros((1000, 8), np.float32)}, feats)
    assert out["f"].shape == (2, 8)


# -- item 21 ------------------------------------------------------------------


def test_uint64_id_reported_as_its_value():
    big = np.uint64(2**64 - 1)
    with pytest.raises(ValueError, match=str(2**64 - 1)):
        check_id_range("f", np.array([1, big], np.uint64), 10)
    t = TableConfig(10, 4, name="t")
    feats = {"f": FeatureConfig(t)}
    ids = np.array([1, big, 2], np.uint64)
    table = np.zeros((10, 4), np.float32)
    for inp in (
        ids,
        RaggedTensor.from_row_lengths(ids, [1, 2]),
        SparseTensor(np.array([[0, 0], [1, 0], [1, 1]]), ids, (2, 2)),
    ):
        with pytest.raises(ValueError, match=rf"feature f: id {2**64 - 1} \(entry 1\)"):
            em.serving_embedding_lookup({"f": inp}, None, {t: table}, feats)
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))
    with pytest.raises(ValueError, match=rf"feature f: id {2**64 - 1} \(entry 1\)"):
        emb({"f": np.array([1, big, 2, 3], np.uint64)})


def test_kernel_reports_uint64_value():
    table = np.zeros((10, 4), np.float32)
    ids = np.array([1, 2**64 - 1], np.uint64)
    with pytest.raises(kernels.IdOutOfRange, match=str(2**64 - 1)):
        kernels.gather(table, ids)
    with pytest.raises(kernels.IdOutOfRange, match=str(2**64 - 1)):
        kernels.bag_combine(table, ids, np.array([0, 1, 2]))


@pytest.mark.parametrize(
    "splits,pos,value",
    [
        ([0, 2, 4, 5, 6, 7, 8, 8, 9, 11], 9, 11),
        ([0, 2, 1, 5, 6, 7, 8, 8, 9, 10], 2, 1),
        ([1, 2, 4, 5, 6, 7, 8, 8, 9, 10], 0, 1),
    ],
)
def test_bad_row_splits_message_shows_the_offending_split(splits, pos, value):
    t = TableConfig(10, 4, name="t")
    feats = {"f": FeatureConfig(t)}
    r = RaggedTensor(np.arange(10) % 10, np.array(splits))
    with pytest.raises(ValueError, match=rf"feature f: .*row_splits\[{pos}\] = {value}"):
        em.serving_embedding_lookup({"f": r}, None, {t: np.zeros((10, 4), np.float32)}, feats)
