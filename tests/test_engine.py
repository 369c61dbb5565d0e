"""MeshEmbedding training on 1, 2, 4 and 8 CPU devices against a float64 reference."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st
from jax.sharding import Mesh

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, SparseTensor, TableConfig
from embedmesh.engine import MeshEmbedding
from embedmesh.preprocess import Capacity

import training_reference as ref
from test_optimizers import build as build_optimizer, ref_update

OPTIMIZER_HP = {
    "SGD": [dict(lr_spec=("const", 0.2)),
            dict(lr_spec=("exp", 0.3, 2, 0.7), clipvalue=0.4, weight_decay_factor=0.05,
                 clip_weight_min=-0.6, clip_weight_max=0.7)],
    "Adagrad": [dict(lr_spec=("const", 0.3), initial_accumulator_value=0.2),
                dict(lr_spec=("linear", 0.3, 0.1, 3), initial_accumulator_value=0.5,
                     clipvalue=(None, 0.3), weight_decay_factor=0.1,
                     multiply_weight_decay_factor_by_learning_rate=True, clip_weight_max=0.8)],
    "AdagradMomentum": [dict(lr_spec=("const", 0.2), momentum=0.5, use_nesterov=True,
                             exponent=3.0, beta2=0.9, epsilon=1e-3),
                        dict(lr_spec=("const", 0.1), momentum=0.8, clipvalue=(-0.2, 0.5),
                             weight_decay_factor=0.02, clip_weight_min=-0.5)],
    "Adam": [dict(lr_spec=("const", 0.05), beta_1=0.8, beta_2=0.9, epsilon=1e-3),
             dict(lr_spec=("const", 0.05), sum_inside_sqrt=False, epsilon=1e-2, clipvalue=0.3,
                  weight_decay_factor=0.1, clip_weight_max=0.5),
             dict(lr_spec=("const", 0.05), lazy_adam=False, beta_1=0.5)],
    "FTRL": [dict(lr_spec=("const", 0.5), l1_regularization_strength=0.01,
                  l2_regularization_strength=0.1, beta=0.1),
             dict(lr_spec=("const", 0.5), multiply_linear_by_learning_rate=True,
                  learning_rate_power=-0.7, l1_regularization_strength=0.02, clipvalue=1.0,
                  weight_decay_factor=0.01, clip_weight_min=-0.9)],
}


def mesh_of(n):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def random_input(rng, kind, batch, vocab, seq_len, weighted):
    if kind == "dense":
        n = int(rng.integers(1, 4))
        ids = rng.integers(0, vocab, (batch, n))
        return ids, (rng.uniform(0.2, 2.0, ids.shape).astype(np.float32) if weighted else None)
    lengths = rng.integers(0, 5, batch)
    total = int(lengths.sum())
    ids = rng.integers(0, vocab, total)
    w = rng.uniform(-0.5, 2.0, total).astype(np.float32)
    if kind == "ragged":
        r = RaggedTensor.from_row_lengths(ids, lengths)
        return r, (RaggedTensor(w, r.row_splits) if weighted else None)
    idx = []
    for b, n in enumerate(lengths):
        cols = np.sort(rng.choice(6, size=n, replace=False))
        idx += [[b, c] for c in cols]
    idx = np.array(idx, np.int64).reshape(-1, 2)
    return SparseTensor(idx, ids, (batch, 6)), (SparseTensor(idx, w, (batch, 6))
                                                 if weighted else None)


def make_case(rng, optimizer, stack_tables):
    t_a = TableConfig(37, 5, combiner="mean", name="a")
    t_b = TableConfig(23, 8, combiner="sqrtn", name="b")
    t_c = TableConfig(3, 3, combiner="sum", name="c")  # smaller than the mesh
    feats = {"f_a": FeatureConfig(t_a), "f_b": FeatureConfig(t_b), "f_c": FeatureConfig(t_c),
             "seq": FeatureConfig(t_a, max_sequence_length=2), "f_a2": FeatureConfig(t_a)}
    kinds = {"f_a": "ragged", "f_b": "sparse", "f_c": "dense", "seq": "ragged", "f_a2": "dense"}
    return feats, kinds


def make_batch(rng, feats, kinds, batch):
    inputs, weights = {}, {}
    for name, f in feats.items():
        weighted = f.max_sequence_length == 0 and bool(rng.integers(0, 2))
        inputs[name], weights[name] = random_input(rng, kinds[name], batch,
                                                   f.table.vocabulary_size,
                                                   f.max_sequence_length, weighted)
    return inputs, weights


def reference_step(feats, inputs, weights, tables, batch):
    """Activations and the per-feature gain lists of one step."""
    acts, gain_lists = {}, []
    for name, f in feats.items():
        g = ref.gains(f, ref.entries(inputs[name], weights[name]))
        acts[name] = ref.activation(f, tables[f.table.name], g, batch)
        gain_lists.append((name, f, f.table.name, g))
    return acts, gain_lists


def reference_update(opt_name, hp, tables, slots, row_grads, step):
    for tname, per_id in row_grads.items():
        ids = sorted(per_id)
        if hp.get("lazy_adam") is False:  # every row moves, untouched ones with g = 0
            zero = np.zeros(tables[tname].shape[1])
            per_id = {i: per_id.get(i, zero) for i in range(tables[tname].shape[0])}
            ids = sorted(per_id)
        rows = tables[tname][ids]
        s = {k: v[ids] for k, v in slots[tname].items()}
        g = np.stack([per_id[i] for i in ids])
        w, _, new_s, _ = ref_update(opt_name, hp, rows, s, g, step)
        tables[tname][ids] = w
        for k in new_s:
            slots[tname][k][ids] = new_s[k]


def check_training(num_devices, opt_name, hp, stack_tables, seed, steps=3, batch=8):
    rng = np.random.default_rng(seed)
    feats, kinds = make_case(rng, None, stack_tables)
    opt = build_optimizer(opt_name, hp)
    hp = {**{f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}, **hp}
    emb = MeshEmbedding(feats, opt, mesh=mesh_of(num_devices), stack_tables=stack_tables,
                        capacities=Capacity(256, 128))
    emb.build()
    tables = {t.name: np.asarray(v, np.float64) for t, v in emb.embedding_tables.items()}
    slots = {t.name: {k: np.asarray(v, np.float64) for k, v in d.items() if k != "parameters"}
             for t, d in emb.variables.items()}
    for step in range(steps):
        inputs, weights = make_batch(rng, feats, kinds, batch)
        acts, preserved = emb(inputs, weights)
        want, gain_lists = reference_step(feats, inputs, weights, tables, batch)
        for name in feats:
            np.testing.assert_allclose(np.asarray(acts[name]), want[name], rtol=2e-5, atol=2e-5,
                                       err_msg=f"activation {name} at step {step}")
        dacts = {name: rng.normal(size=a.shape).astype(np.float32) for name, a in acts.items()}
        emb.apply_gradients({k: jnp.asarray(v) for k, v in dacts.items()}, preserved)
        reference_update(opt_name, hp, tables, slots, ref.row_gradients(gain_lists, dacts), step)
        got = emb.variables
        for t, d in got.items():
            np.testing.assert_allclose(d["parameters"], tables[t.name], rtol=1e-4, atol=1e-5,
                                       err_msg=f"table {t.name} after step {step}")
            for k, v in slots[t.name].items():
                np.testing.assert_allclose(d[k], v, rtol=1e-4, atol=1e-5,
                                           err_msg=f"slot {k} of {t.name} after step {step}")
    # the lookup after training matches the serving lookup on the trained tables
    inputs, _ = make_batch(rng, feats, kinds, batch)
    acts, _ = emb(inputs)
    served = em.serving_embedding_lookup({"f_a": inputs["f_a"]}, None, emb.embedding_tables,
                                         feats)
    np.testing.assert_allclose(np.asarray(acts["f_a"]), np.asarray(served["f_a"]), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("opt_name", list(OPTIMIZER_HP))
def test_training_matches_reference(num_devices, opt_name):
    for variant, hp in enumerate(OPTIMIZER_HP[opt_name]):
        check_training(num_devices, opt_name, hp, stack_tables=bool(variant % 2 == 0),
                       seed=1000 * num_devices + variant)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_devices=st.sampled_from([1, 2, 4, 8]), opt_name=st.sampled_from(list(OPTIMIZER_HP)),
       variant=st.integers(0, 2), stack=st.booleans(), seed=st.integers(0, 2**31 - 1),
       batch=st.sampled_from([8, 16]))
def test_training_property(num_devices, opt_name, variant, stack, seed, batch):
    variants = OPTIMIZER_HP[opt_name]
    check_training(num_devices, opt_name, variants[variant % len(variants)], stack, seed,
                   steps=2, batch=batch)


# ---------------------------------------------------------------------------
# Layout


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
def test_row_id_layout_end_to_end(num_devices):
    t1 = TableConfig(19, 4, initializer=em.row_id_initializer(100.0), name="t1")
    t2 = TableConfig(5, 4, initializer=em.row_id_initializer(1000.0), name="t2")
    feats = {"x": FeatureConfig(t1), "y": FeatureConfig(t2)}
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(num_devices))
    emb.build()
    tables = emb.embedding_tables
    np.testing.assert_array_equal(tables[t1], np.repeat(100.0 + np.arange(19)[:, None], 4, 1))
    np.testing.assert_array_equal(tables[t2], np.repeat(1000.0 + np.arange(5)[:, None], 4, 1))
    shards = emb.embedding_table_shards[t1]
    assert len(shards) == num_devices
    seen = []
    for j, (device, shard) in enumerate(shards):
        assert device == emb.mesh.devices.flat[j]
        rows = np.asarray(shard)[:, 0]
        seen += [int(r - 100) for r in rows if r != 0]
    assert sorted(seen) == list(range(19))
    acts, _ = emb({"x": np.array([3, 18, 0, 7] * 2), "y": np.array([4, 0, 1, 2] * 2)})
    np.testing.assert_array_equal(np.asarray(acts["x"])[:, 0], 100 + np.array([3, 18, 0, 7] * 2))
    assert acts["x"].sharding.spec[0] is not None or num_devices == 1


# ---------------------------------------------------------------------------
# Errors


def _small():
    t = TableConfig(10, 4, name="t")
    feats = {"x": FeatureConfig(t), "y": FeatureConfig(t)}
    return t, feats


def test_apply_gradients_before_build_is_runtime_error():
    _, feats = _small()
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))
    with pytest.raises(RuntimeError, match="build"):
        emb.apply_gradients({"x": None, "y": None}, {})


def test_gradient_errors_name_the_feature_and_leave_tables_untouched():
    t, feats = _small()
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(2))
    emb.build()
    before = emb.variables[t]
    acts, pre = emb({"x": np.array([1, 2, 3, 4]), "y": np.array([5, 6, 7, 8])})
    with pytest.raises(ValueError, match="feature y has shape"):
        emb.apply_gradients({"x": jnp.ones((4, 4)), "y": jnp.ones((4, 3))}, pre)
    with pytest.raises(TypeError, match="feature x must be floating"):
        emb.apply_gradients({"x": jnp.ones((4, 4), jnp.int32), "y": None}, pre)
    with pytest.raises(ValueError, match="not in the feature config"):
        emb.apply_gradients({"z": jnp.ones((4, 4))}, pre)
    with pytest.raises(FloatingPointError, match=r"\['y'\]"):
        emb.apply_gradients({"x": jnp.ones((4, 4)), "y": jnp.full((4, 4), jnp.inf)}, pre)
    after = emb.variables[t]
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    assert int(emb.state.step) == 0
    with pytest.raises(ValueError, match="feature y is missing"):
        emb({"x": np.array([1, 2, 3, 4])})
    with pytest.raises(ValueError, match="feature x: id 10"):
        emb({"x": np.array([1, 2, 3, 10]), "y": np.array([5, 6, 7, 8])})


def test_none_gradient_is_zero_gradient():
    t, feats = _small()
    emb = MeshEmbedding(feats, em.SGD(0.5), mesh=mesh_of(2))
    emb.build()
    before = emb.embedding_tables[t]
    acts, pre = emb({"x": np.array([1, 1, 2, 2]), "y": np.array([5, 6, 7, 8])})
    emb.apply_gradients({"x": jnp.ones((4, 4)), "y": None}, pre)
    after = emb.embedding_tables[t]
    changed = np.nonzero(np.abs(after - before).sum(1))[0].tolist()
    assert changed == [1, 2]
    np.testing.assert_allclose(after[1], before[1] - 0.5 * 2, rtol=1e-6)
