"""A table of raw 64-bit ids placed table-wise (`sharding="table_wise"`, issue 42): the whole
table, and its one id map of `vocabulary_size` rows, on its owner device; every raw id of
the table routed to that owner, mapped there (admission, eviction, fresh rows) as the
row-sharded placements map theirs. Trained beside a static table-wise table on another
owner, against the dict-and-float64 reference of `test_dynamic_ids` (its `Reference`
given the owner: `core.id_owners`), on a stream that evicts, and its serving read
(`RawIdTable`)."""

from __future__ import annotations

import numpy as np
import pytest
from test_dynamic_ids import IDS_PER_SAMPLE, POOL, SAMPLES_PER_DEVICE, _engine, _run

from embedmesh.device import core as core_module

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
    first, k = core_module.id_owners(emb.plan, "dyn")
    assert k == 1 and (dyn.first_shard, dyn.span) == (first, 1)  # whole, on one owner
    assert (static.span, static.first_shard != first) == (1, True)  # another owner
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
