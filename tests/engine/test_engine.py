"""MeshEmbedding training on 1, 2, 4 and 8 CPU devices against a float64 reference."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import training_reference as ref
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from meshes import mesh_of
from optimizer_reference import numpy_update_rows
from test_optimizers import build as build_optimizer
from test_optimizers import ref_update

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, SparseTensor, TableConfig
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity

OPTIMIZER_HP = {
    "SGD": [
        dict(lr_spec=("const", 0.2)),
        dict(
            lr_spec=("exp", 0.3, 2, 0.7),
            clipvalue=0.4,
            weight_decay_factor=0.05,
            clip_weight_min=-0.6,
            clip_weight_max=0.7,
        ),
    ],
    "Adagrad": [
        dict(lr_spec=("const", 0.3), initial_accumulator_value=0.2),
        dict(
            lr_spec=("linear", 0.3, 0.1, 3),
            initial_accumulator_value=0.5,
            clipvalue=(None, 0.3),
            weight_decay_factor=0.1,
            multiply_weight_decay_factor_by_learning_rate=True,
            clip_weight_max=0.8,
        ),
    ],
    "AdagradMomentum": [
        dict(
            lr_spec=("const", 0.2),
            momentum=0.5,
            use_nesterov=True,
            exponent=3.0,
            beta2=0.9,
            epsilon=1e-3,
        ),
        dict(
            lr_spec=("const", 0.1),
            momentum=0.8,
            clipvalue=(-0.2, 0.5),
            weight_decay_factor=0.02,
            clip_weight_min=-0.5,
        ),
    ],
    "Adam": [
        dict(lr_spec=("const", 0.05), beta_1=0.8, beta_2=0.9, epsilon=1e-3),
        dict(
            lr_spec=("const", 0.05),
            sum_inside_sqrt=False,
            epsilon=1e-2,
            clipvalue=0.3,
            weight_decay_factor=0.1,
            clip_weight_max=0.5,
        ),
        dict(lr_spec=("const", 0.05), lazy_adam=False, beta_1=0.5),
    ],
    "FTRL": [
        dict(
            lr_spec=("const", 0.5),
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.1,
            beta=0.1,
        ),
        dict(
            lr_spec=("const", 0.5),
            multiply_linear_by_learning_rate=True,
            learning_rate_power=-0.7,
            l1_regularization_strength=0.02,
            clipvalue=1.0,
            weight_decay_factor=0.01,
            clip_weight_min=-0.9,
        ),
    ],
    # not in test_optimizers' element-wise reference: optimizer_reference's numpy rule
    "RowWiseAdagrad": [
        dict(lr_spec=("const", 0.3), initial_accumulator_value=0.1, epsilon=1e-3),
        dict(
            lr_spec=("linear", 0.3, 0.1, 3),
            l2_regularization_strength=0.05,
            clipvalue=0.5,
            weight_decay_factor=0.1,
            multiply_weight_decay_factor_by_learning_rate=True,
            clip_weight_min=-0.7,
        ),
    ],
}


def random_input(rng, kind, batch, vocab, seq_len, weighted, width=None):
    """One feature's random ids (and weights) of `kind`; a "dense" feature is [batch,
    width] (`width` drawn from 1-3 when None)."""
    if kind == "dense1":
        return rng.integers(0, vocab, batch), None
    if kind == "sparse3":  # [B, 2, 5]: combined per (sample, group)
        idx = [
            [b, a, c]
            for b in range(batch)
            for a in range(2)
            for c in np.sort(rng.choice(5, size=int(rng.integers(0, 4)), replace=False))
        ]
        idx = np.array(idx, np.int64).reshape(-1, 3)
        ids = rng.integers(0, vocab, idx.shape[0])
        w = rng.uniform(-0.5, 2.0, idx.shape[0]).astype(np.float32)
        return SparseTensor(idx, ids, (batch, 2, 5)), (
            SparseTensor(idx, w, (batch, 2, 5)) if weighted else None
        )
    if kind == "dense":
        n = int(rng.integers(1, 4)) if width is None else width
        ids = rng.integers(0, vocab, (batch, n))
        return ids, None  # dense ids are plain lookups: no weights (TensorFlow's rule)
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
    return SparseTensor(idx, ids, (batch, 6)), (
        SparseTensor(idx, w, (batch, 6)) if weighted else None
    )


def make_case(rng, optimizer, stack_tables, batch=8):
    t_a = TableConfig(37, 5, combiner="mean", name="a")
    t_b = TableConfig(23, 8, combiner="sqrtn", name="b")
    t_c = TableConfig(3, 3, combiner="sum", name="c")  # smaller than the mesh
    feats = {
        "f_a": FeatureConfig(t_a),
        "f_b": FeatureConfig(t_b),
        "f_c": FeatureConfig(t_c),
        "seq": FeatureConfig(t_a, max_sequence_length=2),
        "f_a2": FeatureConfig(t_a),
        "f_b3": FeatureConfig(t_b),
        "f_bu": FeatureConfig(t_b, validate_weights_and_indices=False),
        "f_c1": FeatureConfig(t_c),
        # output_shape (global): a sequence of 3 (P = 3B), and a combined reshape (P = B)
        "f_os": FeatureConfig(t_c, output_shape=(batch, 3)),
        "f_oc": FeatureConfig(t_a, output_shape=(batch // 2, 2)),
        "s_seq": FeatureConfig(t_b, max_sequence_length=3),
    }
    kinds = {
        "f_a": "ragged",
        "f_b": "sparse",
        "f_c": "dense",
        "seq": "ragged",
        "f_a2": "dense",
        "f_b3": "sparse3",
        "f_bu": "sparse",
        "f_c1": "dense1",
        "f_os": "ragged",
        "f_oc": "ragged",
        "s_seq": "sparse",
    }
    return feats, kinds


def draw_shapes(rng, feats):
    """Each feature's (weighted, dense width): what decides a batch's program."""
    return {
        name: (f.max_sequence_length == 0 and bool(rng.integers(0, 2)), int(rng.integers(1, 4)))
        for name, f in feats.items()
    }


def make_batch(rng, feats, kinds, batch, shapes=None):
    """A random batch; with `shapes` (`draw_shapes`) every batch has the same program
    inputs, without it each draws its own (weights present or not, dense widths)."""
    shapes = draw_shapes(rng, feats) if shapes is None else shapes
    inputs, weights = {}, {}
    for name, f in feats.items():
        weighted, width = shapes[name]
        inputs[name], weights[name] = random_input(
            rng, kinds[name], batch, f.table.vocabulary_size, f.max_sequence_length, weighted, width
        )
    return inputs, weights


def reference_step(feats, inputs, weights, tables, batch):
    """Activations and the per-feature gain lists of one step."""
    acts, layouts = {}, []
    for name, f in feats.items():
        lay = ref.layout(f, inputs[name], weights[name])
        acts[name] = ref.activation(tables[f.table.name], lay)
        layouts.append((name, f.table.name, lay))
    return acts, layouts


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
        if opt_name == "RowWiseAdagrad":  # one accumulator a row: the numpy rule
            opt = em.RowWiseAdagrad(**{k: v for k, v in hp.items() if k != "lr_spec"})
            w, new_s = numpy_update_rows(opt, rows, s, g, step)
        else:
            w, _, new_s, _ = ref_update(opt_name, hp, rows, s, g, step)
        tables[tname][ids] = w
        for k in new_s:
            slots[tname][k][ids] = new_s[k]


def assert_close(got, want, rtol, atol, what):
    """`np.testing.assert_allclose` with an `atol` per element, naming the first element
    off, its values and its tolerance."""
    got = np.asarray(got, np.float64)
    tol = atol + rtol * np.abs(want)
    bad = ~(np.abs(got - want) <= tol)
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off, first {i}: got "
            f"{got[i]!r}, want {want[i]!r}, tolerance {np.broadcast_to(tol, bad.shape)[i]!r}"
        )


def gradient_rounding(gain_lists, dacts) -> dict:
    """`{table name: {id: bound}}`: how far float32 arithmetic may put each element of a
    row's gradient from `ref.row_gradients`' exact one.

    The kernels sum the products gain * dact of a row in float32, in an order of their
    own (per device, then across shards), with gains computed in float32: n products
    sum to within (n + 4) * u * sum(|product|) (u = 2**-24; n - 1 additions, the
    product's rounding, the gain's few operations). Against sum(|product|) that is a few
    ulps, invisible, except where the products nearly cancel and the rule then divides
    by the gradient's own size. AdagradMomentum's first step is one: from zero slots its
    scaled gradient is g / sqrt(g**2 + epsilon), whose slope epsilon / (g**2 +
    epsilon)**1.5 reaches 1 / sqrt(epsilon) = 1e5 at g = 0 (epsilon = 1e-10, the
    default). test_training_property's recorded example (4 devices, variant 1, seed
    299, batch 16): row 7 of table b, element 4, is the sum of 5 products of magnitudes
    summing to 1.32 that cancel to g = -3.3351e-5; the kernel's sum, -3.3379e-5, is one
    of the float32 sums of those products in some order (0.35 u sum|product| away),
    which moves g / sqrt(g**2 + 1e-10) by 6.5e-5 (slope 2.4e3); at step 1 the momentum
    0.8 * -0.958 + 1.0 = 0.234 carries 0.8 of it: 5.2e-5, 2.2e-4 of its value.
    check_training runs the rule from gradients moved by this bound both ways and lets
    each result differ from the reference's by what that moves it, besides its
    rtol / atol: a few ulps of the values where the rule is well conditioned."""
    u = 2.0**-24
    sums: dict = collections.defaultdict(dict)
    counts: dict = collections.defaultdict(collections.Counter)
    for name, table_name, (shape, gain_list, _) in gain_lists:
        d = np.asarray(dacts[name], np.float64)
        d = d.reshape(tuple(shape) + (d.shape[-1],))
        for row, i, g in gain_list:
            acc = sums[table_name].setdefault(i, np.zeros(d.shape[-1]))
            acc += np.abs(g * d[row])
            counts[table_name][i] += 1
    return {
        n: {i: (counts[n][i] + 4) * u * s for i, s in per_id.items()} for n, per_id in sums.items()
    }


def poison_state(emb, rng):
    """Random non-zero tables and slots (slots positive, as accumulators are), so that a
    row read or written in the wrong place shows."""
    tables, slots = {}, {}
    for t, d in emb.variables.items():
        tables[t] = rng.normal(size=d["parameters"].shape).astype(np.float32)
        slots[t] = {
            k: rng.uniform(0.1, 1.0, size=v.shape).astype(np.float32)
            for k, v in d.items()
            if k != "parameters"
        }
    emb.set_tables(tables, slots)
    for t, d in emb.variables.items():  # read back exactly as set
        np.testing.assert_array_equal(d["parameters"], tables[t], err_msg=t.name)
        for k, v in slots[t].items():
            np.testing.assert_array_equal(d[k], v, err_msg=f"{t.name}.{k}")


def check_training(
    num_devices,
    opt_name,
    hp,
    stack_tables,
    seed,
    steps=3,
    batch=8,
    sharding="mod",
    poison=False,
    case=make_case,
    vary_shapes=False,
):
    """`steps` training steps of `opt_name` against the float64 reference. Each step's
    batch has the shapes (weights present or not, dense widths) of the first unless
    `vary_shapes`: each program then compiles once (a step of new shapes compiles the
    lookup and update anew: test_training_property's steps draw theirs)."""
    rng = np.random.default_rng(seed)
    feats, kinds = case(rng, None, stack_tables, batch)
    opt = build_optimizer(opt_name, hp)
    hp = {**{f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}, **hp}
    emb = MeshEmbedding(
        feats,
        opt,
        mesh=mesh_of(num_devices),
        stack_tables=stack_tables,
        capacities=Capacity(1024, 512),
        sharding=sharding,
    )
    emb.build()
    if poison:
        poison_state(emb, rng)
    start = {
        t.name: {k: np.asarray(v, np.float64) for k, v in d.items()}
        for t, d in emb.variables.items()
    }
    # the reference's state, then the same rule's from gradients moved by float32's
    # rounding bound one way and the other (`gradient_rounding`)
    states = [{n: {k: v.copy() for k, v in d.items()} for n, d in start.items()} for _ in range(3)]
    tables = {n: d["parameters"] for n, d in states[0].items()}
    shapes = None if vary_shapes else draw_shapes(rng, feats)
    for step in range(steps):
        inputs, weights = make_batch(rng, feats, kinds, batch, shapes)
        acts, preserved = emb(inputs, weights)
        want, gain_lists = reference_step(feats, inputs, weights, tables, batch)
        for name in feats:
            np.testing.assert_allclose(
                np.asarray(acts[name]),
                want[name],
                rtol=2e-5,
                atol=2e-5,
                err_msg=f"activation {name} at step {step}",
            )
        dacts = {name: rng.normal(size=a.shape).astype(np.float32) for name, a in acts.items()}
        emb.apply_gradients({k: jnp.asarray(v) for k, v in dacts.items()}, preserved)
        grads = ref.row_gradients(gain_lists, dacts)
        bound = gradient_rounding(gain_lists, dacts)
        for state, sign in zip(states, (0, 1, -1)):
            moved = {
                n: {i: g + sign * bound[n][i] for i, g in per_id.items()}
                for n, per_id in grads.items()
            }
            state_tables = {n: d["parameters"] for n, d in state.items()}
            state_slots = {
                n: {k: v for k, v in d.items() if k != "parameters"} for n, d in state.items()
            }
            reference_update(opt_name, hp, state_tables, state_slots, moved, step)
        for t, d in emb.variables.items():
            for k, v in states[0][t.name].items():
                # how far float32's rounding of the gradients can move the rule's result
                spread = np.maximum(
                    np.abs(states[1][t.name][k] - v), np.abs(states[2][t.name][k] - v)
                )
                what = f"table {t.name}" if k == "parameters" else f"slot {k} of {t.name}"
                assert_close(d[k], v, 1e-4, 1e-5 + spread, f"{what} after step {step}")
    # the lookup after training matches the serving lookup on the trained tables
    inputs, _ = make_batch(rng, feats, kinds, batch, shapes)
    acts, _ = emb(inputs)
    served = em.serving_embedding_lookup(inputs, None, emb.embedding_tables, feats)
    for name in feats:
        assert served[name].shape == acts[name].shape, name
        np.testing.assert_allclose(
            np.asarray(acts[name]), np.asarray(served[name]), rtol=1e-5, atol=1e-6, err_msg=name
        )


def check_placed_training(num_devices, opt_name, variant, sharding, seed):
    """`check_training` of `OPTIMIZER_HP[opt_name][variant]` under `sharding` from a
    poisoned state, the tables stacked except in variant 1 (the placements' tests)."""
    check_training(
        num_devices,
        opt_name,
        OPTIMIZER_HP[opt_name][variant],
        stack_tables=variant != 1,
        seed=seed,
        sharding=sharding,
        poison=True,
    )


DEVICE_COUNTS = (1, 2, 4, 8)
# a covering set: each optimizer's option variants rotate over the device counts (the
# variant and the stacking follow the count's index), so every variant runs once, every
# optimizer stacked and unstacked and on one device and on several, every device count
# with several optimizers stacked and unstacked
TRAINING_CASES = [
    (1, "SGD"),
    (2, "SGD"),
    (1, "Adagrad"),
    (8, "Adagrad"),
    (2, "AdagradMomentum"),
    (4, "AdagradMomentum"),
    (1, "Adam"),
    (2, "Adam"),
    (4, "Adam"),
    (4, "FTRL"),
    (8, "FTRL"),
    (1, "RowWiseAdagrad"),
    (2, "RowWiseAdagrad"),
]


def test_training_cases_cover_every_variant_and_device_count():
    for opt, variants in OPTIMIZER_HP.items():
        counts = [n for n, o in TRAINING_CASES if o == opt]
        runs = {DEVICE_COUNTS.index(n) % len(variants) for n in counts}
        assert runs == set(range(len(variants))), opt
        assert {DEVICE_COUNTS.index(n) % 2 for n in counts} == {0, 1}, opt  # (un)stacked
        assert max(counts) > 1, opt  # on several devices
    for n in DEVICE_COUNTS:
        assert len({o for m, o in TRAINING_CASES if m == n}) >= 2, n


@pytest.mark.parametrize("num_devices, opt_name", TRAINING_CASES)
def test_training_matches_reference(num_devices, opt_name):
    """A covering set (`TRAINING_CASES`): every option variant of every optimizer,
    each optimizer stacked and unstacked (alternating with the device count) and on
    several devices, every device count 1 to 8. test_training_property draws the
    other combinations."""
    i = DEVICE_COUNTS.index(num_devices)
    variants = OPTIMIZER_HP[opt_name]
    check_training(
        num_devices,
        opt_name,
        variants[i % len(variants)],
        stack_tables=i % 2 == 0,
        seed=1000 * num_devices + i,
    )


# two drawn examples (Hypothesis's first is the strategies' simplest: one device, SGD)
# beside the recorded one: each example's steps compile programs of their own on 11
# features; test_training_matches_reference's covering set runs every optimizer variant
# and every device count
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    num_devices=st.sampled_from([1, 2, 4, 8]),
    opt_name=st.sampled_from(list(OPTIMIZER_HP)),
    variant=st.integers(0, 2),
    stack=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    batch=st.sampled_from([8, 16]),
)
@example(num_devices=4, opt_name="AdagradMomentum", variant=1, stack=False, seed=299, batch=16)
def test_training_property(num_devices, opt_name, variant, stack, seed, batch):
    hp = OPTIMIZER_HP[opt_name][variant % len(OPTIMIZER_HP[opt_name])]
    check_training(num_devices, opt_name, hp, stack, seed, steps=2, batch=batch, vary_shapes=True)


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


def _small_built(opt):
    """`_small`'s table and an engine of it and `opt` on 2 devices, built."""
    t, feats = _small()
    emb = MeshEmbedding(feats, opt, mesh=mesh_of(2))
    emb.build()
    return t, emb


def test_apply_gradients_before_build_is_runtime_error():
    _, feats = _small()
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))
    with pytest.raises(RuntimeError, match="build"):
        emb.apply_gradients({"x": None, "y": None}, {})


def test_gradient_errors_name_the_feature_and_leave_tables_untouched():
    t, emb = _small_built(em.Adagrad(0.1))
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
    t, emb = _small_built(em.SGD(0.5))
    before = emb.embedding_tables[t]
    acts, pre = emb({"x": np.array([1, 1, 2, 2]), "y": np.array([5, 6, 7, 8])})
    emb.apply_gradients({"x": jnp.ones((4, 4)), "y": None}, pre)
    after = emb.embedding_tables[t]
    changed = np.nonzero(np.abs(after - before).sum(1))[0].tolist()
    assert changed == [1, 2]
    np.testing.assert_allclose(after[1], before[1] - 0.5 * 2, rtol=1e-6)


# ---------------------------------------------------------------------------
# One layout for training and serving (TensorFlow's serving rules)


def _train_and_serve(feats, inputs, weights=None, num_devices=2):
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(num_devices))
    emb.build()
    acts, _ = emb(inputs, weights)
    served = em.serving_embedding_lookup(inputs, weights, emb.embedding_tables, feats)
    return acts, served


def test_every_input_form_gives_serving_shapes_and_values_in_training():
    rng = np.random.default_rng(11)
    t = TableConfig(30, 4, combiner="mean", name="t")
    B = 4
    idx3 = np.array([[0, 0, 1], [0, 1, 0], [1, 1, 2], [2, 0, 0], [3, 1, 3], [3, 1, 4]])
    sp3 = SparseTensor(idx3, rng.integers(0, 30, 6), (B, 2, 5))
    rag = RaggedTensor.from_row_lengths(rng.integers(0, 30, 9), [3, 0, 4, 2])
    feats = {
        "dense1": FeatureConfig(t),
        "dense2": FeatureConfig(t),
        "dense3": FeatureConfig(t),
        "sparse3": FeatureConfig(t),
        "ragged": FeatureConfig(t),
        "seq": FeatureConfig(t, max_sequence_length=3),
        # output_shape has priority over max_sequence_length (TF): a sequence of 2
        "os_seq": FeatureConfig(t, max_sequence_length=3, output_shape=(B, 2)),
        "os_comb": FeatureConfig(t, output_shape=(2, 2)),
    }
    inputs = {
        "dense1": rng.integers(0, 30, B),
        "dense2": rng.integers(0, 30, (B, 3)),
        "dense3": rng.integers(0, 30, (B, 2, 2)),
        "sparse3": sp3,
        "ragged": rag,
        "seq": rag,
        "os_seq": rag,
        "os_comb": rag,
    }
    acts, served = _train_and_serve(feats, inputs)
    want_shapes = {
        "dense1": (B, 4),
        "dense2": (B, 3, 4),
        "dense3": (B, 2, 2, 4),
        "sparse3": (B, 2, 4),
        "ragged": (B, 4),
        "seq": (B, 3, 4),
        "os_seq": (B, 2, 4),
        "os_comb": (2, 2, 4),
    }
    for name, shape in want_shapes.items():
        assert acts[name].shape == shape == served[name].shape, name
        np.testing.assert_allclose(
            np.asarray(acts[name]), np.asarray(served[name]), rtol=1e-6, atol=1e-7, err_msg=name
        )
    assert np.abs(np.asarray(acts["dense2"])).min() > 0  # real rows, not zeros


def test_wrong_output_shape_is_a_value_error_naming_the_feature():
    t = TableConfig(30, 4, name="t")
    feats = {"a": FeatureConfig(t), "r": FeatureConfig(t, output_shape=(3,))}
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))
    emb.build()
    rag = RaggedTensor.from_row_lengths(np.arange(6), [2, 2, 1, 1])
    with pytest.raises(
        ValueError,
        match=r"output shape \[3\], input data batch size 4 "
        r"\(feature r\)",
    ):
        emb({"a": np.arange(4), "r": rag})


def test_output_shape_is_global_and_a_per_replica_one_is_explained():
    from embedmesh.inputs import feature_layout

    t = TableConfig(30, 4, name="t")
    rag = RaggedTensor.from_row_lengths(np.arange(4), [1, 1, 1, 1])  # 4 local samples
    # 2 processes: the global batch is 8; TF's per-replica (4,) does not fit it
    with pytest.raises(ValueError, match="global"):
        feature_layout("r", FeatureConfig(t, output_shape=(4,)), rag, batch_scale=2)
    lay = feature_layout("r", FeatureConfig(t, output_shape=(8,)), rag, batch_scale=2)
    assert (lay.kind, lay.output_shape, lay.batch) == ("combined", (8,), 4)
    lay = feature_layout("r", FeatureConfig(t, output_shape=(8, 3)), rag, batch_scale=2)
    assert (lay.kind, lay.length, lay.output_shape) == ("sequence", 3, (8, 3))


def test_rank3_sparse_sits_beside_rank2_features_of_the_same_batch():
    t = TableConfig(30, 4, combiner="sum", name="t")
    feats = {"a": FeatureConfig(t), "s3": FeatureConfig(t)}
    sp3 = SparseTensor(np.array([[0, 0, 0], [1, 2, 1], [3, 1, 0]]), np.array([5, 6, 7]), (4, 3, 2))
    acts, served = _train_and_serve(feats, {"a": np.arange(4), "s3": sp3})
    assert acts["s3"].shape == (4, 3, 4)
    np.testing.assert_allclose(np.asarray(acts["s3"]), np.asarray(served["s3"]), rtol=1e-6)


def test_steps_hold_no_second_state_and_leave_no_cycles():
    """Memory structure of a training step (issue #25 item 1; no timing): the update
    program aliases the tables and slots it is given (donated: the old arrays are
    deleted after a step, no copy of a table exists) and its temporaries scale with the
    batch's ids x dim, not with the table; and a step leaves no reference cycle (one kept
    each step's gradients alive until the cyclic GC ran: ~100 MB in the benchmark)."""
    import gc

    vocab, dim, batch = 20_000, 16, 32
    table = TableConfig(vocab, dim, name="t", combiner="sum")
    feats = {"a": FeatureConfig(table), "b": FeatureConfig(table)}
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    emb = MeshEmbedding(feats, em.RowWiseAdagrad(learning_rate=0.1), mesh=mesh)
    rng = np.random.default_rng(3)

    def batch_of():
        return {
            k: RaggedTensor.from_row_lengths(
                rng.integers(0, vocab, 3 * batch).astype(np.int32), np.full(batch, 3)
            )
            for k in feats
        }

    def step():
        acts, pres = emb.dequeue(emb.enqueue(batch_of()))
        emb.apply_gradients(jax.tree_util.tree_map(lambda a: 0.5 * a + 1.0, acts), pres)

    step()
    step()  # the first update program has run: compiled, state donated once
    old_table = emb.state.tables["t"]
    (old_slot,) = emb.state.slots["t"].values()
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            step()
        jax.block_until_ready(emb.state)
        assert gc.collect() == 0, "a training step made a reference cycle"
    finally:
        gc.enable()
    assert old_table.is_deleted() and old_slot.is_deleted(), "state not donated"
    new = emb.state.tables["t"]
    assert not new.is_deleted() and np.all(np.isfinite(np.asarray(new)))

    csr = emb.enqueue(batch_of())
    acts, _ = emb.dequeue(csr)
    grads = {k: jnp.ones_like(v) for k, v in acts.items()}
    program = jax.jit(
        lambda st, g, c: emb.core.apply_gradients(st, g, c, check_finite=False)[0],
        donate_argnums=0,
    )
    mem = program.lower(emb.state, grads, csr).compile().memory_analysis()
    table_bytes = new.nbytes
    assert mem.alias_size_in_bytes >= table_bytes, "tables not updated in place"
    c = next(iter(csr.values()))
    per_batch = 4 * dim * (c.unique_ids.size + c.pair_rows.size) + 4 * 4 * c.pair_rows.size
    assert mem.temp_size_in_bytes <= 4 * per_batch < table_bytes // 4, (
        f"temporaries {mem.temp_size_in_bytes} B: more than the batch needs ({per_batch} B)"
    )
