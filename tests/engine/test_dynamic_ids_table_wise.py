"""A table of raw 64-bit ids placed table-wise (`sharding="table_wise"`, issue 42): the whole
table, and its one id map of `vocabulary_size` rows, on its owner device; every raw id of
the table routed to that owner, mapped there (admission, eviction, fresh rows) as the
row-sharded placements map theirs. Trained beside a static table-wise table on another
owner, against the dict-and-float64 reference of `test_dynamic_ids` (its `Reference`
given the owner: `StackingPlan.id_owners`), on a stream that evicts; then a checkpoint of it
restored onto another device count (the maps rebuilt on the new placement's owners) and
back into a table-wise placement, and its serving read (`RawIdTable`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from meshes import mesh_of
from test_dynamic_ids import IDS_PER_SAMPLE, POOL, SAMPLES_PER_DEVICE, _engine, _run

import embedmesh as em
from embedmesh import checkpoint as em_ckpt
from embedmesh.checkpoint import id_maps

# 6 rows for the 14 ids of the pool: every step admits and evicts
CAPACITY = 6


def _policy(eviction: str, combiner: str) -> tuple:
    # (eviction, admit_after, evict_batch, sharding, combiner, pipelined, the static table's
    # sharding, the capacity): `test_dynamic_ids._engine`'s arguments
    return (eviction, 1, 1, "table_wise", combiner, False, "table_wise", CAPACITY)


def _batches(n: int, seed: int, count: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.choice(POOL, size=(SAMPLES_PER_DEVICE * n, IDS_PER_SAMPLE)) for _ in range(count)]


@pytest.mark.parametrize(("n", "eviction", "combiner"), [(2, "lru", "mean"), (4, "lfu", "sum")])
def test_table_wise_matches_the_reference(n, eviction, combiner):
    policy = _policy(eviction, combiner)
    emb = _engine(n, *policy)
    dyn, static = emb.plan.table("dyn"), emb.plan.table("static")
    first, k = emb.plan.id_owners("dyn")
    assert k == 1 and (dyn.first_shard, dyn.span) == (first, 1)  # whole, on one owner
    # the other table on another owner, or spread over the shards (the raw ids' stack, on
    # every device, would otherwise double what a device holds)
    assert static.first_shard != first or static.span > 1
    _, config = emb.core.dynamic[dyn.stack]
    assert config.capacity == CAPACITY  # the table's one map: not divided by the shards
    _run(n, policy, _batches(n, n, 3))
    counts = emb.last_stats["dyn"].id_map
    assert counts["evictions"] > 0 and counts["occupancy"] == CAPACITY
    live = emb.core.read_dynamic(emb.state, "dyn")
    assert {j for j, _, _ in live.values()} == {first}  # every live id on the owner
    # the serving read: the live ids, sorted, with their rows
    served = emb.embedding_tables[emb.plan.table_config("dyn")]
    assert served.ids.tolist() == sorted(live)
    for i, row in zip(served.ids.tolist(), np.asarray(served.rows)):
        np.testing.assert_array_equal(row, live[i][2])


def _steps(emb, batches, grads) -> list:
    out = []
    for ids, g in zip(batches, grads):
        raw = em.RaggedTensor(ids.reshape(-1), np.arange(0, ids.size + 1, IDS_PER_SAMPLE))
        plain = np.full((ids.shape[0], 1), 3, np.int64)
        acts, preserved = emb({"raw": raw, "plain": plain})
        emb.apply_gradients({"raw": jnp.asarray(g), "plain": None}, preserved)
        out.append(np.asarray(acts["raw"]))
    return out


def test_checkpoint_onto_another_device_count(tmp_path, monkeypatch):
    """Saved from a table-wise placement on 2 devices (LRU): restored as it was (bit for
    bit, the same next step), onto 4 devices table-wise (LFU: the map rebuilt on the new
    owner) and onto 4 devices mod (the ids hashed over every shard): every live id keeps
    its values and slots and reads them, and `load_tables` reads it by id without a mesh."""
    two = _engine(2, *_policy("lru", "mean"))
    batches = _batches(2, 21, 3)
    rng = np.random.default_rng(22)
    grads = [rng.normal(size=(b.shape[0], 4)).astype(np.float32) for b in batches]
    _steps(two, batches[:2], grads[:2])
    em_ckpt.save(tmp_path / "c", two)
    before = two.core.read_dynamic(two.state, "dyn")
    slots = two.core.read_dynamic(two.state, "dyn", "accumulators")
    assert len(before) == CAPACITY
    want = _steps(two, batches[2:], grads[2:])
    with monkeypatch.context() as m:  # as it was (no map rebuilt): the same next step
        m.setattr(id_maps, "rebuild", None)
        em_ckpt.restore(two, tmp_path / "c")
    np.testing.assert_array_equal(_steps(two, batches[2:], grads[2:])[0], want[0])

    served = em_ckpt.load_tables(tmp_path / "c")  # by id, no mesh
    got = served[next(c for c in served if c.name == "dyn")]
    assert got.ids.tolist() == sorted(before)
    for i, row in zip(got.ids.tolist(), np.asarray(got.rows)):
        np.testing.assert_array_equal(row, before[i][2])

    # onto 4 devices: table-wise (the reference test's engine: LFU, `vocabulary_size` 6;
    # the ids on its owner) and mod (the ids hashed over every shard, 6 rows each)
    for policy in (_policy("lfu", "sum"), ("lru", 1, 1, "mod", "mean", False, "table_wise", 24)):
        four = _engine(4, *policy)
        em_ckpt.restore(four, tmp_path / "c")
        first, k = four.plan.id_owners("dyn")
        after = four.core.read_dynamic(four.state, "dyn")
        acc = four.core.read_dynamic(four.state, "dyn", "accumulators")
        assert after.keys() == before.keys()
        for i, (j, _, values) in after.items():
            assert first <= j < first + k
            np.testing.assert_array_equal(values, before[i][2])
            np.testing.assert_array_equal(acc[i][2], slots[i][2])
        if k != 1:
            continue  # (mod: the maps rebuilt; its lookups: test_dynamic_ids)
        # and it trains on: a lookup of the live ids reads their rows
        ids = np.array(sorted(before)[: SAMPLES_PER_DEVICE * 4], np.int64)
        ids = np.resize(ids, SAMPLES_PER_DEVICE * 4)[:, None].repeat(IDS_PER_SAMPLE, 1)
        raw = em.RaggedTensor(ids.reshape(-1), np.arange(0, ids.size + 1, IDS_PER_SAMPLE))
        acts, _ = four({"raw": raw, "plain": np.zeros((ids.shape[0], 1), np.int64)})
        scale = 2.0 if policy[4] == "sum" else 1.0  # (two equal ids a sample)
        want_acts = scale * np.stack([before[int(i)][2] for i in ids[:, 0]])
        np.testing.assert_allclose(np.asarray(acts["raw"]), want_acts, rtol=1e-6)


def test_auto_never_replicates_a_table_of_raw_ids():
    """`sharding="auto"`: the planner may place a table of raw ids table-wise or
    row-sharded, never data_parallel (a replica cannot hold its id map): the facade
    excludes it (`excluded=`), where a small, hot table is otherwise replicated."""
    from embedmesh.layout import cost_model, planner

    stats = [
        cost_model.TableStats("dyn", rows=64, dim=4, ids_per_sample=8.0),
        cost_model.TableStats("big", rows=1 << 20, dim=64),
    ]
    args = (stats, {"dyn": "auto", "big": "auto"}, 4, 512, cost_model.Machine.this_cpu("shm"))
    free, _ = planner.plan(*args)
    assert free["dyn"] == "data_parallel"  # (what the exclusion changes)
    chosen, _ = planner.plan(*args, excluded={"dyn": ("data_parallel",)})
    assert chosen["dyn"] in ("mod", "row_wise_rows", "row_wise_pooled", "table_wise")
    # the facade passes it: a small table of raw ids, planned on 4 devices, then built
    dyn = em.TableConfig(64, 4, name="dyn", id_map=em.DynamicIds())
    features = {"a": em.FeatureConfig(dyn, max_sequence_length=0)}
    emb = em.MeshEmbedding(features, em.SGD(0.1), mesh=mesh_of(4), sharding="auto")
    emb.build()
    assert not emb.plan.table("dyn").replicated
    assert emb.plan.stack(emb.plan.table("dyn").stack).name in emb.core.dynamic
