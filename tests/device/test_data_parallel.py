"""Replicated tables (`sharding="data_parallel"`): every device holds the whole table,
looks it up in place and applies the same update, made of every device's gradients.

Training against the float64 reference (tests/engine/test_engine.py) with every optimizer,
mixed with mod and table-wise tables; the replicas stay bitwise equal; pipelined
execution; rejected updates; two processes; checkpoints across placements and device
counts; the bytes it sends; the planner picking it. (The plan's layout against the plain
rule and the sharding helpers' round trips, replicas included, are in
tests/device/test_table_wise.py, whose random plans draw this placement too.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_engine
import test_table_wise
from checkpoint_common import (
    make_batch,
    make_features,
    make_tables,
    train_step,
    variables_by_name,
)
from meshes import mesh_of
from process_helpers import check_two_processes_match_one

import embedmesh as em
from embedmesh.checkpoint import reading
from embedmesh.config import FeatureConfig, TableConfig
from embedmesh.facade import MeshEmbedding
from embedmesh.layout import cost_model
from embedmesh.layout.planner import BUILT_OPTIONS, PLANNED
from embedmesh.layout.stacking import plan_stacking


def replica_blocks(emb, table_name: str, state=None) -> list:
    """`[(field, [block of every device])]`: the table's rows as each device holds them,
    for its parameters and every slot, read from the raw arrays of `state` (default: the
    engine's)."""
    t = emb.plan.table(table_name)
    state = emb.observed_state() if state is None else state
    fields = [("parameters", state.tables[t.stack])] + sorted(state.slots[t.stack].items())
    out = []
    for field, arr in fields:
        shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
        lo = t.local_row_offset
        blocks = [np.asarray(s.data)[lo : lo + t.vocabulary_size, : t.dim] for s in shards]
        out.append((field, blocks))
    return out


def assert_replicas_equal(emb):
    """Every replicated table's blocks on every device equal its canonical one, bit for
    bit, and the canonical one is what `variables` reports."""
    variables = variables_by_name(emb)
    checked = 0
    for t in emb.plan.tables:
        if not t.replicated:
            continue
        for field, blocks in replica_blocks(emb, t.name):
            assert len(blocks) == emb.plan.num_shards
            for j, b in enumerate(blocks):
                np.testing.assert_array_equal(b, blocks[0], err_msg=f"{t.name}.{field} on {j}")
            np.testing.assert_array_equal(blocks[0], variables[t.name][field])
            checked += 1
    assert checked, "no replicated table"


# ---------------------------------------------------------------------------
# The plan


def test_replicas_have_their_own_stacks_and_rows_on_every_shard():
    feats = {
        f"f{i}": FeatureConfig(TableConfig(v, 8, name=f"t{i}"))
        for i, v in enumerate([10, 40, 5, 30])
    }
    plan = plan_stacking(
        feats, 4, sharding={"t0": "data_parallel", "t2": "data_parallel", "t3": "table_wise"}
    )
    by_stack = {s.name: (s.replicated, s.tables) for s in plan.stacks}
    assert by_stack == {"t0+t2": (True, ("t0", "t2")), "t1+t3": (False, ("t1", "t3"))}
    t0, t2 = plan.table("t0"), plan.table("t2")
    assert (t0.sharding, t0.local_row_offset, t2.local_row_offset) == ("data_parallel", 0, 10)
    assert plan.stack("t0+t2").rows_per_shard == 15  # both whole tables, on every shard
    assert [plan.row_layout.copy_of(t2, j) for j in range(4)] == [0, 0, 0, 0]
    # preprocessing routes a replicated table's ids to its canonical shard, as local rows
    np.testing.assert_array_equal(plan.stacked_rows("t2", np.arange(5)), (10 + np.arange(5)) * 4)
    text = plan.describe()
    assert "data_parallel" in text and "0-3" in text
    # one shard: every placement is mod
    assert plan_stacking(feats, 1, sharding="data_parallel") == plan_stacking(feats, 1)


def test_shard_views_show_every_replica():
    t = TableConfig(19, 4, initializer=em.row_id_initializer(100.0), name="t")
    u = TableConfig(5, 4, name="u")  # random initializer: the replicas still agree
    emb = MeshEmbedding(
        {"x": FeatureConfig(t), "y": FeatureConfig(u)},
        em.Adagrad(0.1),
        mesh=mesh_of(4),
        sharding="data_parallel",
    )
    emb.build()
    want = em.row_id_initializer(100.0).rows(np.arange(19), 4, np.float32)
    np.testing.assert_array_equal(emb.embedding_tables[t], want)
    for j, (device, block) in enumerate(emb.embedding_table_shards[t]):
        assert device == emb.mesh.devices.flat[j]
        np.testing.assert_array_equal(np.asarray(block), want)
    assert_replicas_equal(emb)


# ---------------------------------------------------------------------------
# Training: the float64 reference, poisoned initial state


MIXED = {"a": "data_parallel", "c": "data_parallel"}  # b stays mod
WITH_TABLE_WISE = {"a": "table_wise", "c": "data_parallel"}
# (one device: the mod plan and core, test_table_wise's test_one_shard_is_the_same_layout;
# every table replicated on 2 devices: Adam's dense variant below)
TRAINING = [
    (8, "SGD", 1, "data_parallel"),
    (2, "Adagrad", 1, MIXED),
    (4, "AdagradMomentum", 0, "data_parallel"),
    (8, "Adam", 0, MIXED),
    (2, "Adam", 2, "data_parallel"),  # lazy_adam=False: every row of every replica moves
    (4, "FTRL", 1, WITH_TABLE_WISE),
]


@pytest.mark.parametrize(("num_devices", "opt_name", "variant", "sharding"), TRAINING)
def test_training_matches_reference(num_devices, opt_name, variant, sharding):
    seed = 91 * num_devices + variant
    test_engine.check_placed_training(num_devices, opt_name, variant, sharding, seed)


def engine(n, sharding, pipelined=False):
    feats = make_features(make_tables())
    emb = MeshEmbedding(
        feats,
        em.Adagrad(0.1),
        pipelined,
        mesh=mesh_of(n),
        sharding=sharding,
    )
    return emb, feats


CK_MIXED = {"a": "data_parallel", "c": "data_parallel", "d": "table_wise"}  # b stays mod


@pytest.mark.parametrize("pipelined", [False, True])
def test_replicas_stay_equal_and_train_as_mod(pipelined):
    """After steps (pipelined: the lookup one update stale, in one program with it), the
    same tables as mod sharding, and every replica bit for bit its canonical block."""
    mod, feats = engine(4, "mod", pipelined)
    dp, _ = engine(4, CK_MIXED, pipelined)
    for seed in range(4):
        want = train_step(mod, feats, seed)
        got = train_step(dp, feats, seed)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    want, got = variables_by_name(mod), variables_by_name(dp)
    for name in want:
        for k in want[name]:
            np.testing.assert_allclose(
                got[name][k], want[name][k], rtol=1e-5, atol=1e-6, err_msg=f"{name}.{k}"
            )
    assert np.abs(got["a"]["accumulators"] - 0.1).max() > 1e-3  # the replicas moved
    assert_replicas_equal(dp)


def test_a_rejected_update_leaves_every_replica_as_it_was():
    """A non-finite gradient: the facade raises, and the core's own check (its update
    hands no row to any replica) returns False with every replica as it was."""
    emb, feats = engine(4, "data_parallel")
    train_step(emb, feats, 0)
    before = [(f, [b.copy() for b in blocks]) for f, blocks in replica_blocks(emb, "a")]
    csr = emb.enqueue(make_batch(feats, 123))
    acts, preserved = emb.dequeue(csr)
    grads = {k: jnp.ones(a.shape, jnp.float32) for k, a in acts.items()}
    grads["fa"] = grads["fa"].at[0, 0].set(jnp.nan)
    with pytest.raises(FloatingPointError, match="non-finite"):
        emb.apply_gradients(grads, preserved)
    state = emb.observed_state()
    new, ok = jax.jit(emb.core.apply_gradients)(state, grads, csr)
    assert not bool(ok)
    for after in (replica_blocks(emb, "a"), replica_blocks(emb, "a", new)):
        for (field, want), (_, got) in zip(before, after):
            for j, (w, g) in enumerate(zip(want, got)):
                np.testing.assert_array_equal(g, w, err_msg=f"a.{field} on {j}")


def test_two_processes_match_one_process(tmp_path):
    """Two processes of two devices each, every table replicated (the update's ids and
    gradients go through shared memory), against one process of four devices, mod."""
    check_two_processes_match_one(tmp_path, "mod", "data_parallel", rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Checkpoints across placements and device counts


SOURCES = {"dp4": (4, "data_parallel"), "mixed8": (8, CK_MIXED), "mod2": (2, "mod")}

sources = test_table_wise.sources_fixture(SOURCES, engine)


RESTORES = {
    "dp4_to_dp4": ("dp4", 4, "data_parallel"),
    "dp4_to_mod2": ("dp4", 2, "mod"),
    "dp4_to_dp8": ("dp4", 8, "data_parallel"),
    "dp4_to_tw3": ("dp4", 3, "table_wise"),
    "mixed8_to_mod1": ("mixed8", 1, "mod"),
    "mixed8_to_dp2": ("mixed8", 2, "data_parallel"),
    "mod2_to_mixed8": ("mod2", 8, CK_MIXED),
}


@pytest.mark.parametrize("case", list(RESTORES))
def test_restore_across_placements_and_device_counts(sources, case):
    src, emb, feats = test_table_wise.restore_case(sources, SOURCES, RESTORES[case], engine)
    if any(t.replicated for t in emb.plan.tables):
        assert_replicas_equal(emb)  # every replica restored, not only the canonical one
    if case in ("dp4_to_mod2", "mod2_to_mixed8"):  # and training goes on alike
        test_table_wise.assert_trains_alike(src["emb"], emb, feats)


def test_stored_arrays_hold_one_copy(sources):
    """A replicated table is stored once (its canonical block), not N times."""
    src = sources["dp4"]
    plan = src["emb"].plan
    with reading.TreeReader(src["path"] / "2" / "embedding") as reader:
        for t, m in test_table_wise.stored_tables(src):
            assert (m["sharding"], m["first_shard"], m["span"]) == ("data_parallel", 0, 1)
            n = plan.num_shards
            assert reader.shape(("tables", m["key"])) == (-(-t.vocabulary_size // n) * n, t.dim)
            stored = np.asarray(reader.read(("tables", m["key"])))
            np.testing.assert_array_equal(
                stored[: t.vocabulary_size], src["saved"][t.name]["parameters"]
            )
    test_table_wise.assert_loads_as_saved(src)


# ---------------------------------------------------------------------------
# Bytes and the planner


def test_exchange_bytes_of_a_replicated_stack():
    """Nothing in the lookup; in the update, each device's U distinct ids and their [U, D]
    gradient sums to each of the N - 1 others."""
    emb, feats = engine(4, {"a": "data_parallel"})
    csr = emb.enqueue(make_batch(feats, 3))
    stack = emb.plan.table("a").stack
    c = csr[stack]
    u, d = int(c.unique_ids.shape[-1]), emb.plan.stack(stack).dim
    got = emb.core.exchange_bytes(csr)
    assert got[stack] == 3 * u * (4 + 4 * d)
    emb.dequeue(csr)


def test_the_planner_replicates_tiny_tables_and_never_one_that_does_not_fit():
    """Between processes (shared memory), tables of 16 and 100 rows are cheapest
    replicated: no exchange in the lookup, one in the update. A table whose replica does
    not fit a device's memory is never replicated."""
    tiny = cost_model.TableStats(
        name="tiny", rows=16, dim=16, slots=1, ids_per_sample=40.0, zipf_a=0.0, pooled=True
    )
    small = cost_model.TableStats(
        name="small", rows=100, dim=16, slots=1, ids_per_sample=1.0, zipf_a=0.0, pooled=True
    )
    big = cost_model.TableStats(
        name="big", rows=1_000_000, dim=64, slots=1, ids_per_sample=1.0, zipf_a=0.0, pooled=True
    )
    kw = dict(batch_per_device=4096, strategies=PLANNED, strategy_options=BUILT_OPTIONS)
    plan = cost_model.plan_tables([tiny, small], 4, cost_model.Machine.this_cpu("host_shm"), **kw)
    assert [plan.strategy_of(t) for t in ("tiny", "small")] == ["data_parallel"] * 2
    # the planner costs what is built: the sparse all-gather, not the dense all-reduce
    assert {c.variant for _, c in plan.choices} == {"sparse"}
    cluster = cost_model.Machine.h100_cluster()
    assert cost_model.plan_tables([big], 4, cluster, **kw).strategy_of("big") == "data_parallel"
    limit = 0.5 * big.state_bytes  # a replica does not fit; a quarter of the rows does
    plan = cost_model.plan_tables([big], 4, cluster, memory_limit=limit, **kw)
    assert plan.strategy_of("big") != "data_parallel"


def test_the_plan_shows_a_data_parallel_override():
    feats = make_features(make_tables())
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(2), sharding={"c": "data_parallel"})
    emb.build()
    assert dict(emb.plan.strategies)["c"] == "data_parallel"
    assert emb.plan.table("c").replicated and "data_parallel" in str(emb.plan)
