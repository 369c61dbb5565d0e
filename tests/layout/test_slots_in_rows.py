"""Optimizer slots kept in the table's rows (`plan_stacking(slots_in_rows=...)`, a TPU's
layout): the plan's columns and bytes, the optimizer on whole rows against the float64
rule, and training, `variables`, `set_tables`, checkpoints (between the two layouts, any
device count) and the pipelined step the same as with each slot an array of its own.

The layout is the TPU's; here it is switched on for CPU devices
(`stacking.PLATFORM_SLOTS_IN_ROWS`), where every op then runs its reference.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meshes import mesh_of
from optimizer_reference import numpy_update_rows

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, TableConfig
from embedmesh import checkpoint as ckpt
from embedmesh.device.slots_in_rows import SlotsInRows, device_optimizer
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity
from embedmesh.layout import stacking
from embedmesh.layout.stacking import plan_stacking

CAPS = Capacity(64, 64)

OPTIMIZERS = {
    "SGD": em.SGD(0.3),
    "Adagrad": em.Adagrad(0.2, initial_accumulator_value=0.1),
    "AdagradMomentum": em.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True),
    "Adam": em.Adam(0.05),
    "DenseAdam": em.Adam(0.05, lazy_adam=False),
    "FTRL": em.FTRL(0.2, l1_regularization_strength=0.01),
    "RowWiseAdagrad": em.RowWiseAdagrad(0.3, l2_regularization_strength=0.05),
}


def signed(r, shape):
    return (r.uniform(0.1, 2.0, shape) * r.choice([-1, 1], shape)).astype(np.float32)


@pytest.fixture
def in_rows(monkeypatch):
    """`in_rows(True)`: CPU stacks keep their slots in their rows (a TPU's layout)."""

    def set_(on: bool):
        monkeypatch.setitem(stacking.PLATFORM_SLOTS_IN_ROWS, "cpu", 128 if on else 0)

    return set_


# ---------------------------------------------------------------------------
# The plan


def _config(dims, opt=None):
    return {
        f"f{i}": FeatureConfig(TableConfig(100 + i, d, name=f"t{i}", optimizer=opt))
        for i, d in enumerate(dims)
    }


def test_plan_puts_each_slot_in_its_columns():
    """Adagrad: tables of dims 16 and 64 share 128-lane rows `[w | acc]` (the stack's dim
    64); 100 and 128 share 256-lane rows; Adam's two slots; SGD keeps the padded dim;
    a row-wise optimizer's tables stack apart, each its mean over its own dim. The bytes
    a device holds are its rows times the row width."""
    plan = plan_stacking(
        _config([16, 64, 100, 128]),
        2,
        dim_multiple=128,
        default_optimizer=em.Adagrad(0.1),
        slots_in_rows=128,
    )
    got = {s.tables: (s.dim, s.width, s.slot_columns) for s in plan.stacks}
    assert got == {
        ("t0", "t1"): (64, 128, (("accumulators", 64, 64),)),
        ("t2", "t3"): (128, 256, (("accumulators", 128, 128),)),
    }
    want = sum(s.rows_per_shard * s.width * 4 for s in plan.stacks)
    assert plan.bytes_per_device == (want, want)

    plan = plan_stacking(_config([24, 40]), 1, default_optimizer=em.Adam(0.1), slots_in_rows=128)
    (s,) = plan.stacks
    assert (s.dim, s.width) == (40, 128)
    assert s.slot_columns == (("momenta", 40, 40), ("velocities", 80, 40))
    assert s.columns_of("parameters") == (0, 40) and s.lookup_columns == 40
    with pytest.raises(KeyError, match="velocity"):
        s.columns_of("velocity")

    plan = plan_stacking(
        _config([24]), 1, dim_multiple=128, default_optimizer=em.SGD(0.1), slots_in_rows=128
    )
    assert [(s.dim, s.width, s.slot_columns) for s in plan.stacks] == [(128, 128, ())]

    plan = plan_stacking(
        _config([24, 40], em.RowWiseAdagrad(0.1)), 1, default_optimizer=None, slots_in_rows=128
    )
    got = {s.tables: (s.dim, s.width, s.slot_columns, s.optimizer.mean_dim) for s in plan.stacks}
    assert got == {
        ("t0",): (24, 128, (("accumulators", 24, 1),), 24),
        ("t1",): (40, 128, (("accumulators", 40, 1),), 40),
    }
    with pytest.raises(ValueError, match="slots_in_rows"):
        plan_stacking(_config([8]), 1, slots_in_rows=-1)


def test_a_chip_model_fits_with_its_slots_in_its_rows():
    """26 tables x 1M x 64 with Adagrad: 26.6 GB with the accumulators apart in 128-lane
    rows, 13.3 GB with `[w | acc]` in one 128-lane row, what the planner's memory rule
    counts on a TPU."""
    from embedmesh.config import resolve_feature_config
    from embedmesh.layout import planner

    fc = {f"f{i}": FeatureConfig(TableConfig(1_000_000, 64, name=f"t{i}")) for i in range(26)}
    resolved = resolve_feature_config(fc)
    assign = {t: "mod" for t in resolved.table_names}
    for slots, want in ((0, 26 * 1_000_000 * 128 * 4 * 2), (128, 26 * 1_000_000 * 128 * 4)):
        memory = planner.layout_memory(
            resolved,
            1,
            default_optimizer=em.Adagrad(0.1),
            dim_multiple=stacking.dim_multiple_for("tpu"),
            slots_in_rows=slots,
        )
        assert memory(assign) == (want,)
    assert stacking.slots_in_rows_for("tpu") == 128 and stacking.slots_in_rows_for("cpu") == 0


# ---------------------------------------------------------------------------
# The optimizer on whole rows


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    dim=st.sampled_from([1, 8, 24, 40, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_update_of_whole_rows_is_the_float64_rule(name, dim, seed):
    """`SlotsInRows.update_rows` on rows `[w | slots | padding]`: the parameter and slot
    columns as the float64 rule on the separate arrays, the padding columns (poisoned)
    untouched; gradients wider than the parameters (the dense update's) read as theirs."""
    opt = OPTIMIZERS[name]
    spec = plan_stacking(_config([dim]), 1, default_optimizer=opt, slots_in_rows=128).stacks[0]
    dev = device_optimizer(spec, spec.optimizer)
    if not opt.slot_names:
        assert dev is spec.optimizer
        return
    assert isinstance(dev, SlotsInRows) and dev.slot_names == () and dev.fused_kernel is None
    r = np.random.default_rng(seed)
    n = 7
    rows = signed(r, (n, spec.width))
    slots = {}
    for k, a, w in spec.slot_columns:
        rows[:, a : a + w] = r.uniform(0.1, 2.0, (n, w))  # accumulators stay positive
        slots[k] = rows[:, a : a + min(w, dim)].astype(np.float64)  # the table's columns
    grads = np.zeros((n, spec.dim + 5), np.float32)  # wider: only the first dim columns count
    grads[:, :dim] = signed(r, (n, dim))  # past the table's dim: zero, as the core pads
    grads[:, spec.dim :] = np.nan
    got, none = dev.update_rows(jnp.asarray(rows), {}, jnp.asarray(grads), 3)
    got = np.asarray(got)
    assert none == {}
    want_w, want_s = numpy_update_rows(
        opt, rows[:, :dim].astype(np.float64), slots, grads[:, :dim], 3
    )
    np.testing.assert_allclose(got[:, :dim], want_w, rtol=2e-5, atol=1e-6)
    used = spec.dim
    for k, a, w in spec.slot_columns:
        np.testing.assert_allclose(got[:, a : a + min(w, dim)], want_s[k], rtol=2e-5, atol=1e-6)
        used = max(used, a + w)
    np.testing.assert_array_equal(got[:, used:], rows[:, used:])
    with pytest.raises(ValueError, match="in the rows"):
        dev.update_rows(jnp.asarray(rows), {"x": rows}, jnp.asarray(grads), 3)


def test_lookups_never_hand_a_kernel_a_row_read_it_does_not_apply():
    """A lookup with `columns` runs a kernel only where it applies them itself (the TPU's
    gather-and-combine); the CPU kernels take every other call."""
    from embedmesh.device import ops

    table = jnp.ones((10, 128), jnp.float32)
    args = (
        table,
        jnp.arange(3, dtype=jnp.int32),
        jnp.zeros(4, jnp.int32),
        jnp.ones(4),
        jnp.zeros(4, jnp.int32),
    )
    ref = ops.reference_of("segment_gather_sum_mapped")
    assert (
        ops.kernel_for("segment_gather_sum_mapped", "cpu", *args, num_segments=2, columns=8) is ref
    )
    tpu_fn = ops.kernel_for("segment_gather_sum_mapped", "tpu", *args, num_segments=2, columns=8)
    assert tpu_fn is not ref
    assert (
        ops.kernel_for(
            "segment_gather_sum_mapped", "tpu", *args, num_segments=2, quantization=(3, 0.0, 1.0)
        )
        is ref
    )


# ---------------------------------------------------------------------------
# Training, reading, writing


def _features(optimizers=None, dims=(24, 40, 8), rows=(50, 40, 30)):
    """Tables a, b, c of `rows` x `dims` (b also read as a sequence); `optimizers`: each
    table's own."""
    opts = optimizers or (None, None, None)
    a, b, c = (
        TableConfig(v, d, name=name, combiner=combiner, optimizer=o)
        for v, d, name, combiner, o in zip(rows, dims, "abc", ("mean", "sum", "sqrtn"), opts)
    )
    return (a, b, c), {
        "fa": FeatureConfig(a),
        "fb": FeatureConfig(b),
        "fc": FeatureConfig(c),
        "seq": FeatureConfig(b, max_sequence_length=3),
    }


def _batch(r):
    lengths = r.integers(0, 4, 8)
    return {
        "fa": RaggedTensor.from_row_lengths(r.integers(0, 50, lengths.sum()), lengths),
        "fb": r.integers(0, 40, (8, 2)),
        "fc": em.SparseTensor(
            indices=np.array([[i, j] for i in range(8) for j in range(i % 3)], np.int64),
            values=r.integers(0, 30, sum(i % 3 for i in range(8))),
            dense_shape=(8, 2),
        ),
        "seq": RaggedTensor.from_row_lengths(r.integers(0, 40, lengths.sum()), lengths),
    }


def _weights(batch, r):
    """Per-id weights for the ragged feature "fa" (positive and negative)."""
    return {
        "fa": RaggedTensor(
            values=signed(r, batch["fa"].values.shape), row_splits=batch["fa"].row_splits
        )
    }


def _variables(emb):
    return {t.name: {k: np.asarray(v) for k, v in d.items()} for t, d in emb.variables.items()}


def _train(in_rows, on, opt, n, sharding="mod", steps=3, optimizers=None):
    """An embedding on `n` devices trained `steps` steps from fixed tables (the random
    initialisers depend on which shard owns a table); its activations and variables."""
    in_rows(on)
    tables, feats = _features(optimizers)
    if isinstance(sharding, tuple):
        sharding = dict(zip(tables, sharding))
    emb = MeshEmbedding(feats, opt, mesh=mesh_of(n), capacities=CAPS, sharding=sharding)
    return emb, _steps(emb, tables, steps, _batch, _weights), tables


def _steps(emb, tables, steps, batch_of, weights_of=None) -> list:
    """`emb` built with signed random `tables`, then trained `steps` steps on `batch_of(r)`
    (weighted by `weights_of(batch, r)`) with gradients of the activations; the
    activations of each step."""
    emb.build()
    r = np.random.default_rng(5)
    emb.set_tables({t: signed(r, (t.vocabulary_size, t.dim)) for t in tables})
    acts_seen = []
    for _ in range(steps):
        batch = batch_of(r)
        acts, pre = emb(batch, weights=weights_of(batch, r) if weights_of else None)
        acts_seen.append({k: np.asarray(v) for k, v in acts.items()})
        grads = {
            k: jnp.asarray(np.tanh(np.asarray(v)) + signed(r, v.shape)) for k, v in acts.items()
        }
        emb.apply_gradients(grads, pre)
    return acts_seen


def _assert_same(got, want, rtol=1e-5, atol=2e-6):
    assert set(got) == set(want)
    for t in want:
        assert set(got[t]) == set(want[t]), t
        for k in want[t]:
            np.testing.assert_allclose(
                got[t][k], want[t][k], rtol=rtol, atol=atol, err_msg=f"{t}.{k}"
            )


O = OPTIMIZERS
CASES = {  # (default optimizer, each table's own, devices, each table's strategy)
    "every_optimizer_1dev": (O["RowWiseAdagrad"], (O["Adam"], O["FTRL"], O["SGD"]), 1, "mod"),
    "strategies_4dev": (
        O["Adagrad"],
        (O["Adam"], None, O["RowWiseAdagrad"]),
        4,
        ("row_wise_pooled", "mod", "table_wise"),
    ),
    "replicas_2dev": (O["FTRL"], (None, O["DenseAdam"], None), 2, ("data_parallel",) * 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_as_with_slots_apart(in_rows, case):
    """Optimizers (one a table; AdagradMomentum in the checkpoint test below) on one device,
    and every strategy on 2-4 devices (dense Adam on 2): activations
    and every variable after 3 steps (weights, sequences, sparse inputs) as the same run
    with each slot an array; a stack's table array is its row width and has no slot
    arrays; the bytes the plan counts are the arrays'."""
    opt, optimizers, n, sharding = CASES[case]
    got_emb, got_acts, _ = _train(in_rows, True, opt, n, sharding, optimizers=optimizers)
    want_emb, want_acts, _ = _train(in_rows, False, opt, n, sharding, optimizers=optimizers)
    for g, w in zip(got_acts, want_acts):
        _assert_same({"acts": g}, {"acts": w})
    _assert_same(_variables(got_emb), _variables(want_emb))
    state = got_emb.observed_state()
    for s in got_emb.plan.stacks:
        assert state.tables[s.name].shape == (s.num_rows, s.width)
        opt_s = got_emb.core.optimizer_of(s.name)
        assert bool(s.slot_columns) == bool(opt_s.slot_names)
        assert state.slots[s.name] == {} or not s.slot_columns
    assert got_emb.plan.measured_bytes_per_device == got_emb.plan.bytes_per_device


def test_set_tables_writes_each_slot_into_its_columns(in_rows):
    """`set_tables` with slots (a row slot too) reads back exactly, and slots not given
    start at their initial value in their columns."""
    r = np.random.default_rng(2)
    for opt in (OPTIMIZERS["FTRL"], OPTIMIZERS["RowWiseAdagrad"]):
        emb, _, tables = _train(in_rows, True, opt, 2, steps=0)
        values = {t: signed(r, (t.vocabulary_size, t.dim)) for t in tables}
        width = {k: opt.slot_width(k, 2) for k in opt.slot_names}
        first = opt.slot_names[0]
        slots = {
            t: {first: r.uniform(0.1, 2, (t.vocabulary_size, t.dim if width[first] > 1 else 1))}
            for t in tables[:2]
        }
        emb.set_tables(values, slots)
        got = _variables(emb)
        for t in tables:
            np.testing.assert_array_equal(got[t.name]["parameters"], values[t])
            for k in opt.slot_names:
                if t in slots and k in slots[t]:
                    np.testing.assert_array_equal(got[t.name][k], slots[t][k].astype(np.float32))
                else:
                    init = opt.slot_initial_values[k]
                    np.testing.assert_array_equal(
                        got[t.name][k], np.full_like(got[t.name][k], init)
                    )


def test_checkpoints_move_between_the_layouts(in_rows, tmp_path):
    """A checkpoint saved with the slots in the rows (4 devices, trained) restores onto
    slots apart on 1 device, and that layer's checkpoint back onto slots in the rows on
    4: every variable bit-identical each time (the checkpoint stores each slot per table,
    whatever the layout)."""
    opt = OPTIMIZERS["AdagradMomentum"]
    saved, _, _ = _train(in_rows, True, opt, 4)
    want = _variables(saved)
    for on, n, name in ((False, 1, "rows"), (True, 4, "apart")):
        ckpt.save(str(tmp_path / name), saved)
        target, _, _ = _train(in_rows, on, opt, n, steps=0)
        assert bool(target.plan.stacks[0].slot_columns) == on
        assert ckpt.restore(target, str(tmp_path / name)) == 3
        got = _variables(target)
        for t in want:
            for k in want[t]:
                np.testing.assert_array_equal(got[t][k], want[t][k], err_msg=f"{name} {t}.{k}")
        saved = target  # its checkpoint, of slots apart, restored next


def test_pipelined_run_with_slots_in_rows_resumes_from_a_checkpoint(in_rows, tmp_path):
    """Pipelined (each lookup one update stale), saved with an update pending, restored
    onto a fresh pipelined embedding and run on: the same activations and variables as
    the run never interrupted."""
    opt = OPTIMIZERS["Adam"]
    in_rows(True)
    tables, feats = _features()
    r = np.random.default_rng(5)
    start = {t: signed(r, (t.vocabulary_size, t.dim)) for t in tables}
    first = MeshEmbedding(feats, opt, True, mesh=mesh_of(2), capacities=CAPS)
    first.set_tables(start)
    straight = MeshEmbedding(feats, opt, True, mesh=mesh_of(2), capacities=CAPS)
    straight.set_tables(start)

    def step(emb, r):
        batch = _batch(r)
        acts, pre = emb(batch)
        emb.apply_gradients({k: jnp.tanh(v) + 0.1 for k, v in acts.items()}, pre)
        return {k: np.asarray(v) for k, v in acts.items()}

    r1, r2 = np.random.default_rng(9), np.random.default_rng(9)
    for _ in range(2):
        step(first, r1), step(straight, r2)
    ckpt.save(str(tmp_path / "p"), first)  # an update pending
    resumed = MeshEmbedding(feats, opt, True, mesh=mesh_of(2), capacities=CAPS)
    assert ckpt.restore(resumed, str(tmp_path / "p")) == 2
    assert resumed.plan.stacks[0].slot_columns
    for _ in range(2):
        _assert_same({"a": step(resumed, r1)}, {"a": step(straight, r2)}, rtol=0, atol=0)
    _assert_same(_variables(resumed), _variables(straight), rtol=0, atol=0)


def test_the_layout_is_recorded_in_the_plan(in_rows):
    """`emb.plan` says which stacks keep their slots in their rows and the bytes it
    counts are the arrays' (`measured_bytes_per_device`)."""
    emb, _, _ = _train(in_rows, True, OPTIMIZERS["Adagrad"], 2, steps=0)
    (s,) = emb.plan.stacks
    assert s.slot_columns and s.width == 128
    text = emb.plan.describe()
    assert "slots in rows" in text
    assert emb.plan.measured_bytes_per_device == emb.plan.bytes_per_device
    dataclasses.replace(s)  # a plain frozen dataclass (hashable, comparable)
