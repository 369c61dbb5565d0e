"""export_saved_model: a TensorFlow SavedModel that TF alone (a fresh process, no
embedmesh import) serves with the same outputs as serving_embedding_lookup + the model,
for ragged, sparse (combined and sequence) and dense features, weighted and not, at
several batch sizes, with and without empty (padded) samples."""

import jax.numpy as jnp
import numpy as np
import pytest
from process_helpers import check_saved_model

import embedmesh as em
from embedmesh.serving import Dense, Ragged, Sparse, export_serving, load_serving

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
    """The request's cases for saved_model_check.py ("in/..." fed as they are, a ragged
    feature's "ragged/..." and "lengths/..." as a tf.RaggedTensor's components)."""
    out = {}
    for f, comp in names.items():
        if f in weights:
            out["in/" + comp["weights"]] = np.asarray(weights[f].values, np.float32)
        x = inputs[f]
        if isinstance(x, em.RaggedTensor):  # fed as a tf.RaggedTensor's components
            key = f"{comp['values']}/{comp['row_splits']}"
            out[f"ragged/{key}"] = np.asarray(x.values, np.int32)
            out[f"lengths/{key}"] = np.diff(np.asarray(x.row_splits)).astype(np.int64)
        elif isinstance(x, em.SparseTensor):
            out["in/" + comp["indices"]] = np.asarray(x.indices, np.int64)
            out["in/" + comp["values"]] = np.asarray(x.values)
            out["in/" + comp["dense_shape"]] = np.asarray(x.dense_shape, np.int64)
        else:
            out["in/" + comp["ids"]] = np.asarray(x)
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
            cases[f"case{i}/{k}"] = v
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


def dlrm_features():
    t1 = em.TableConfig(30, 4, combiner="mean", name="t1")
    t2 = em.TableConfig(20, 4, combiner="sum", name="t2")
    return {"c": em.FeatureConfig(t1), "cats": [em.FeatureConfig(t2), em.FeatureConfig(t1)]}


# the model's other inputs beside the features: at the top, beside a list's features
# ("cats/2") and in a nested dict ("side/age")
DLRM_SIGNATURE = {
    "c": Ragged(4),
    "cats": [Dense(), Dense((2,)), Dense((2,), np.float32)],
    "dense": Dense((3,), np.float32),
    "side": {"age": Dense((), np.float32)},
}


def dlrm(p, x):
    emb = x["c"] + x["cats"][0] + x["cats"][1].sum(1)
    bottom = jnp.tanh(x["dense"] @ p["bottom"] + x["cats"][2] @ p["pair"])
    return (emb * bottom).sum(1) + x["side"]["age"] * p["a"]


def test_saved_model_takes_the_models_other_inputs(tmp_path):
    """A whole model (a DLRM's dense float features beside its embeddings): the inputs
    that are not features are passed to the model in their place in the signature, and
    TensorFlow alone serves what the model gives on serving_embedding_lookup's
    activations in process, as export_serving does from the same signature."""
    feats = dlrm_features()
    rng = np.random.default_rng(5)
    tables = {
        t: rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32)
        for t in (feats["c"].table, feats["cats"][0].table)
    }
    params = {
        "bottom": rng.normal(size=(3, 4)).astype(np.float32),
        "pair": rng.normal(size=(2, 4)).astype(np.float32),
        "a": np.float32(-0.7),
    }
    names = export_saved_model(
        dlrm,
        tmp_path / "saved",
        tables=tables,
        params=params,
        feature_config=feats,
        input_signature=DLRM_SIGNATURE,
    )
    assert names["dense"] == {"array": "dense"}
    assert names["cats/2"] == {"array": "cats_2"}
    assert names["side/age"] == {"array": "side_age"}
    assert names["cats/0"] == {"ids": "cats_0"}

    def serve(inputs, tabs, p):  # export_serving's form: the same signature, the same model
        acts = em.serving_embedding_lookup(
            {"c": inputs["c"], "cats": inputs["cats"][:2]}, None, tabs, feats
        )
        return dlrm(p, {**inputs, "c": acts["c"], "cats": [*acts["cats"], inputs["cats"][2]]})

    export_serving(
        serve,
        tmp_path / "export",
        tables=tables,
        params=params,
        input_signature=DLRM_SIGNATURE,
        batch_sizes=(8,),
    )
    server = load_serving(tmp_path / "export")
    cases = {}
    for i, b in enumerate((1, 6)):
        lengths = rng.integers(0, 4, b)
        lengths[-1] = 0
        values = rng.integers(0, 30, int(lengths.sum())).astype(np.int32)
        ragged = em.RaggedTensor.from_row_lengths(values, lengths)
        ids0 = rng.integers(0, 20, b).astype(np.int32)
        ids1 = rng.integers(0, 30, (b, 2)).astype(np.int32)
        pair = rng.normal(size=(b, 2)).astype(np.float32)
        dense = rng.normal(size=(b, 3)).astype(np.float32)
        age = rng.uniform(10, 80, b).astype(np.float32)
        acts = em.serving_embedding_lookup({"c": ragged, "cats": [ids0, ids1]}, None, tables, feats)
        want = dlrm(
            params,
            {
                "c": acts["c"],
                "cats": [acts["cats"][0], acts["cats"][1], pair],
                "dense": dense,
                "side": {"age": age},
            },
        )
        got = server(
            {"c": ragged, "cats": [ids0, ids1, pair], "dense": dense, "side": {"age": age}}
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
        key = "c_values/c_row_splits"
        cases[f"case{i}/ragged/{key}"] = np.asarray(ragged.values, np.int32)
        cases[f"case{i}/lengths/{key}"] = lengths.astype(np.int64)
        for name, v in [("cats_0", ids0), ("cats_1", ids1), ("cats_2", pair)]:
            cases[f"case{i}/in/{name}"] = v
        cases[f"case{i}/in/dense"] = dense
        cases[f"case{i}/in/side_age"] = age
        cases[f"case{i}/out/output_0"] = np.asarray(want)
    check_saved_model(tmp_path / "saved", cases, 2, tmp_path)


def test_other_inputs_errors_name_the_entry(tmp_path):
    feats = dlrm_features()

    def export(signature):
        export_saved_model(
            dlrm, tmp_path / "x", tables={}, feature_config=feats, input_signature=signature
        )

    with pytest.raises(ValueError, match=r"entry side/age is not a feature .* must be a Dense"):
        export(dict(DLRM_SIGNATURE, side={"age": Ragged(2)}))
    with pytest.raises(ValueError, match="no spec for feature cats/1"):
        export(dict(DLRM_SIGNATURE, cats=[Dense()]))
    with pytest.raises(ValueError, match="signature input c_values would serve both c and"):
        export(dict(DLRM_SIGNATURE, c_values=Dense()))
