"""Item 10: TensorFlow's keyword form of preprocess_features, identical arrays."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import embedmesh as em
import embedmesh.tpu
from embedmesh import FeatureConfig, RaggedTensor, TableConfig
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import preprocess_features
from embedmesh.layout.stacking import plan_stacking


def config():
    t1 = TableConfig(30, 4, name="t1", combiner="sum")
    t2 = TableConfig(20, 4, name="t2")
    t3 = TableConfig(11, 16)  # unnamed
    return {
        "a": FeatureConfig(t1),
        "b": {"c": FeatureConfig(t2), "s": FeatureConfig(t1, max_sequence_length=2)},
        "d": FeatureConfig(t3),
    }, (t1, t2, t3)


def flat_with_paths(cfg, prefix=""):  # what TF's nest.flatten_with_joined_string_paths gives
    out = []
    for k in sorted(cfg):
        path = f"{prefix}/{k}" if prefix else k
        v = cfg[k]
        out += flat_with_paths(v, path) if isinstance(v, dict) else [(path, v)]
    return out


def batch(rng, b):
    lengths = rng.integers(0, 4, b)
    w = rng.uniform(0.1, 2.0, int(lengths.sum())).astype(np.float32)
    rag = RaggedTensor.from_row_lengths(rng.integers(0, 20, int(lengths.sum())), lengths)
    feats = {
        "a": rng.integers(0, 30, (b, 2)),
        "b": {
            "c": rag,
            "s": RaggedTensor.from_row_lengths(rng.integers(0, 30, int(lengths.sum())), lengths),
        },
        "d": rng.integers(0, 11, b),
    }
    weights = {"a": None, "b": {"c": RaggedTensor(w, rag.row_splits), "s": None}, "d": None}
    return feats, weights


def seed_kwargs(cfg, tables, n, feats, weights, stacked=None):
    t1, t2, t3 = tables
    flat = flat_with_paths(cfg)
    stacked = stacked or {"t1_t2": [t1, t2], "t3": [t3]}
    stack_of = {t.name or "table_2": s for s, ts in stacked.items() for t in ts}

    def leaves(tree):
        return [
            tree[p.split("/")[0]] if "/" not in p else tree[p.split("/")[0]][p.split("/")[1]]
            for p, _ in flat
        ]

    return dict(
        num_replicas_in_sync=n,
        max_ids_per_chip_per_sample=64,
        max_minibatches_per_sc=64,
        num_sc_per_chip=4,
        num_sc_shards=4 * n,
        stacked_table_to_tables=stacked,
        table_to_stacked_table_offset={k: (v, 0, 0) for k, v in stack_of.items()},
        table_to_sample_count={s: 0 for s in stacked},
        feature_to_sample_offset={p: 0 for p, _ in flat},
        flat_features=flat,
        flat_inputs=leaves(feats),
        flat_weights=leaves(weights),
    )


def assert_same_csr(a, b):
    assert set(a) == set(b)
    for k in a:
        la, ta = jax.tree.flatten(a[k])
        lb, tb = jax.tree.flatten(b[k])
        assert ta == tb
        for x, y in zip(la, lb):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000), b=st.sampled_from([4, 8]))
def test_seed_form_gives_identical_arrays(n, seed, b):
    cfg, tables = config()
    feats, weights = batch(np.random.default_rng(seed), b)
    want, stats = preprocess_features(feats, weights, plan_stacking(cfg, n), num_devices_local=n)
    got = preprocess_features(**seed_kwargs(cfg, tables, n, feats, weights))
    assert isinstance(got, tuple) and len(got) == 3
    assert_same_csr(got[0], want)
    assert got[1] == max(s.max_ids_per_partition for s in stats.stacks.values())
    assert got[2] == max(s.max_unique_ids_per_partition for s in stats.stacks.values())
    # positional, through the facade's staticmethod
    kw = seed_kwargs(cfg, tables, n, feats, weights)
    got2 = MeshEmbedding.preprocess_features(*kw.values())
    assert_same_csr(got2[0], want)
    # the embedmesh form through the staticmethod still works
    assert_same_csr(
        MeshEmbedding.preprocess_features(
            feats, weights, plan_stacking(cfg, n), num_devices_local=n
        )[0],
        want,
    )


def test_seed_form_output_feeds_dequeue():
    cfg, tables = config()
    n = 2
    emb = MeshEmbedding(cfg, em.Adagrad(0.1), mesh=Mesh(np.array(jax.devices()[:n]), ("x",)))
    emb.build()
    feats, weights = batch(np.random.default_rng(0), 4)
    want, _ = emb(feats, weights)
    acts, pre = emb.dequeue(preprocess_features(**seed_kwargs(cfg, tables, n, feats, weights)))
    for a, b in zip(jax.tree.leaves(acts), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    emb.apply_gradients(jax.tree.map(np.ones_like, acts), pre)


def test_seed_form_stack_tables_false_and_errors():
    cfg, tables = config()
    t1, t2, t3 = tables
    feats, weights = batch(np.random.default_rng(1), 4)
    alone = {"t1": [t1], "t2": [t2], "t3": [t3]}
    got = preprocess_features(**seed_kwargs(cfg, tables, 2, feats, weights, alone))
    want, _ = preprocess_features(
        feats, weights, plan_stacking(cfg, 2, stack_tables=False), num_devices_local=2
    )
    assert_same_csr(got[0], want)
    kw = seed_kwargs(cfg, tables, 2, feats, weights, {"x": [t1, t3], "y": [t2]})
    with pytest.raises(ValueError, match="cannot realise"):
        preprocess_features(**kw)
    offsets = seed_kwargs(cfg, tables, 2, feats, weights)["table_to_stacked_table_offset"]
    wrong = [  # (arguments changed, the error's words)
        ({"num_sc_shards": 7}, "num_sc_shards"),
        (
            {"table_to_stacked_table_offset": {**offsets, "t1": ("t3", 0, 0)}},
            "table t1 in stack 't3'",
        ),
        ({"feature_to_sample_offset": {"a": 0}}, "feature_to_sample_offset"),
        ({"max_minibatches_per_sc": 0}, "max_minibatches_per_sc"),
    ]
    for change, words in wrong:
        with pytest.raises(ValueError, match=words):
            preprocess_features(**{**seed_kwargs(cfg, tables, 2, feats, weights), **change})


# TPUEmbeddingV2.preprocess_features's parameters (seeds/: the TF docs), in order
SEED_SIGNATURE = (
    "num_replicas_in_sync",
    "max_ids_per_chip_per_sample",
    "max_minibatches_per_sc",
    "num_sc_per_chip",
    "num_sc_shards",
    "stacked_table_to_tables",
    "table_to_stacked_table_offset",
    "table_to_sample_count",
    "feature_to_sample_offset",
    "flat_features",
    "flat_inputs",
    "flat_weights",
)


@pytest.mark.parametrize(
    "fn",
    [
        em.preprocess_features,
        MeshEmbedding.preprocess_features,
        em.tpu.TPUEmbeddingV2.preprocess_features,
        preprocess_features,
    ],
)
def test_signature_is_the_seeds(fn):
    """help() and IDEs show TensorFlow's keyword signature (embedmesh's own form is
    `preprocess_batch`); embedmesh's options may follow as **options."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())
    assert tuple(p.name for p in params[:12]) == SEED_SIGNATURE
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:12])
    assert [p.name for p in params if p.default is not p.empty] == ["flat_weights"]
    assert params[11].default is None
    assert [(p.name, p.kind) for p in params[12:]] == [("options", inspect.Parameter.VAR_KEYWORD)]
