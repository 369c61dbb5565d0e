"""export_saved_model: a TensorFlow SavedModel that TF alone (a fresh process, no
embedmesh import) serves with the same outputs as serving_embedding_lookup + the model,
for ragged, sparse (combined and sequence) and dense features, weighted and not, at
several batch sizes, with and without empty (padded) samples."""

import jax.numpy as jnp
import numpy as np
import pytest
from process_helpers import check_saved_model

import embedmesh as em
from embedmesh.serving import Dense, Ragged, Sparse

pytest.importorskip("tensorflow")
from embedmesh.serving.saved_model import export_saved_model


def features():
    t1 = em.TableConfig(30, 4, combiner="mean", name="t1")
    t2 = em.TableConfig(20, 4, combiner="sqrtn", name="t2")
    t3 = em.TableConfig(10, 4, combiner="sum", name="t3")
    return {
        "ragged": em.FeatureConfig(t1),
        "sparse": em.FeatureConfig(t2),
        "dense": em.FeatureConfig(t3),
        "dense2": em.FeatureConfig(t2),
        "seq": em.FeatureConfig(t1, max_sequence_length=2),
    }


SIGNATURE = {
    "ragged": Ragged(4),
    "sparse": Sparse((3,), np.int64),
    "dense": Dense(),
    "dense2": Dense((2,)),
    "seq": Sparse((3,)),
}


def model(p, a):
    x = (
        a["ragged"]
        + a["sparse"]
        + a["dense"]
        + a["dense2"].sum(1)
        + jnp.einsum("bld,l->bd", a["seq"], p["m"])
    )
    return {"score": jnp.tanh(x @ p["w"]) + p["b"], "first": x[:, 0]}


def batch(rng, b, empty_tail=False):
    lengths = rng.integers(0, 4, b)
    if empty_tail:
        lengths[-1] = 0  # a padded sample: no ids
    ragged = em.RaggedTensor.from_row_lengths(rng.integers(0, 30, int(lengths.sum())), lengths)

    def sparse(vocab, dtype):
        idx = [[s, c] for s in range(b) for c in sorted(rng.choice(3, rng.integers(0, 3), False))]
        if empty_tail:
            idx = [ix for ix in idx if ix[0] != b - 1]
        idx = np.array(idx, np.int64).reshape(-1, 2)
        return em.SparseTensor(idx, rng.integers(0, vocab, len(idx)).astype(dtype), (b, 3))

    return {
        "ragged": ragged,
        "sparse": sparse(20, np.int64),
        "dense": rng.integers(0, 10, b).astype(np.int32),
        "dense2": rng.integers(0, 20, (b, 2)).astype(np.int32),
        "seq": sparse(30, np.int32),
    }


WEIGHTED = ("ragged", "sparse")


def weights_of(rng, inputs):
    """Weights of the WEIGHTED features (a few negative: TF's pruning rules apply)."""
    out = {}
    for f in WEIGHTED:
        x = inputs[f]
        w = rng.uniform(-0.3, 2.0, len(x.values)).astype(np.float32)
        if isinstance(x, em.RaggedTensor):
            out[f] = em.RaggedTensor(w, x.row_splits)
        else:
            out[f] = em.SparseTensor(x.indices, w, x.dense_shape)
    return out


def components(inputs, names, weights):
    out = {}
    for f, comp in names.items():
        if f in weights:
            out[comp["weights"]] = np.asarray(weights[f].values, np.float32)
        x = inputs[f]
        if isinstance(x, em.RaggedTensor):
            out[comp["values"]] = np.asarray(x.values, np.int32)
            out[comp["row_splits"]] = np.asarray(x.row_splits, np.int32)
        elif isinstance(x, em.SparseTensor):
            out[comp["indices"]] = np.asarray(x.indices, np.int64)
            out[comp["values"]] = np.asarray(x.values)
            out[comp["dense_shape"]] = np.asarray(x.dense_shape, np.int64)
        else:
            out[comp["ids"]] = np.asarray(x)
    return out


def test_saved_model_serves_like_serving_embedding_lookup(tmp_path):
    feats = features()
    rng = np.random.default_rng(3)
    tables = {
        t: rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32)
        for t in {f.table for f in feats.values()}
    }
    params = {
        "w": rng.normal(size=(4,)).astype(np.float32),
        "m": rng.normal(size=(2,)).astype(np.float32),
        "b": np.float32(0.25),
    }
    names = export_saved_model(
        model,
        tmp_path / "saved",
        tables=tables,
        params=params,
        feature_config=feats,
        input_signature=SIGNATURE,
        weighted=WEIGHTED,
    )
    cases = {}
    sizes = [(1, False), (5, True), (8, False), (8, True)]
    for i, (b, empty_tail) in enumerate(sizes):
        inputs = batch(rng, b, empty_tail)
        weights = weights_of(rng, inputs)
        full = {f: weights.get(f) for f in feats}
        acts = em.serving_embedding_lookup(inputs, full, tables, feats)
        want = model(params, acts)
        for k, v in components(inputs, names, weights).items():
            cases[f"case{i}/in/{k}"] = v
        for k, v in want.items():
            cases[f"case{i}/out/{k}"] = np.asarray(v)
    check_saved_model(tmp_path / "saved", cases, len(sizes), tmp_path)


def test_input_signature_errors_name_the_feature(tmp_path):
    feats = features()
    bad = dict(SIGNATURE, seq="ids")
    with pytest.raises(ValueError, match="feature seq"):
        export_saved_model(
            model, tmp_path / "x", tables={}, feature_config=feats, input_signature=bad
        )
    for weighted, message in [(["dense"], "feature dense, a Dense input"), (["nope"], "'nope'")]:
        with pytest.raises(ValueError, match=message):
            export_saved_model(
                model,
                tmp_path / "x",
                tables={},
                feature_config=feats,
                input_signature=SIGNATURE,
                weighted=weighted,
            )
