"""The cost model (`embedmesh.layout.cost_model`): distinct ids, bytes per strategy by
hand and by brute force, properties, the planner. Pure numpy: no jax, no timing."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.layout import cost_model as cm
from embedmesh.layout.cost_model import Machine, TableStats, expected_unique, strategy_cost


def _zipf_probs(v, a):
    p = np.arange(1, v + 1, dtype=np.float64) ** -a
    return p / p.sum()


# ---------------------------------------------------------------------------
# expected distinct ids


@pytest.mark.parametrize("v,a,n", [(5000, 1.05, 3000), (2000, 0.0, 1500), (300, 1.3, 50)])
def test_expected_unique_matches_monte_carlo(v, a, n):
    rng = np.random.default_rng(1)
    p = _zipf_probs(v, a)
    counts = np.array([np.unique(rng.choice(v, size=n, p=p)).size for _ in range(300)])
    mean, se = counts.mean(), counts.std(ddof=1) / np.sqrt(counts.size)
    got = expected_unique(TableStats("t", v, 8, zipf_a=a), n)
    assert abs(got - mean) < 4 * se + 1e-9, (got, mean, se)


def test_expected_unique_approximation_within_its_bound():
    v = cm.EXACT_RANKS * 2 + 12345  # past the exact limit: head + integral tail
    for a, n in ((1.05, 2e5), (0.8, 3e6), (1.2, 1e4)):
        approx, bound = cm.zipf_unique(v, a, n, with_bound=True)
        w = np.arange(1, v + 1, dtype=np.float64) ** -a
        p = w / w.sum()
        exact = float(-np.expm1(n * np.log1p(-p)).sum())
        assert abs(approx - exact) <= bound + 1e-6 * exact, (a, n, approx, exact, bound)
        assert bound < 1e-3 * exact + 1.0


def test_expected_unique_hot_groups_and_explicit_function():
    t = TableStats("t", 10**6, 8, zipf_a=1.05, hot_group=4)
    one = TableStats("t", 10**6, 8, zipf_a=1.05)
    assert expected_unique(t, 4000) == pytest.approx(4 * expected_unique(one, 1000))
    f = TableStats("t", 100, 8, unique_fn=lambda n: 0.5 * n)
    assert expected_unique(f, 60) == 30
    assert expected_unique(f, 1000) == 100  # capped at the rows


@settings(max_examples=30, deadline=None)
@given(
    v=st.integers(1, 5000),
    a=st.floats(0, 2),
    n1=st.floats(0, 1e5),
    n2=st.floats(0, 1e5),
)
def test_expected_unique_bounds_and_monotone(v, a, n1, n2):
    t = TableStats("t", v, 8, zipf_a=a)
    lo, hi = sorted((n1, n2))
    u_lo, u_hi = expected_unique(t, lo), expected_unique(t, hi)
    assert 0 <= u_lo <= u_hi + 1e-9
    assert u_hi <= min(v, hi) + 1e-6 * max(1.0, hi)


# ---------------------------------------------------------------------------
# a small case by hand: N = 2 devices, b = 2 samples each (global batch 4), 3 ids per
# sample, D = 8 float32 (32-byte rows), every id distinct (unique_fn: n -> n), so
# one device's batch has 6 distinct ids and the global batch 12.

HAND = TableStats("hand", 10**6, 8, slots=1, ids_per_sample=3, unique_fn=lambda n: n)
COPYING = Machine.h100_cluster()  # copies its bytes (the in-process CPU kernels do not)


def test_hand_row_wise_rows():
    c = strategy_cost("row_wise_rows", HAND, 2, 2, COPYING)
    # 6 distinct ids, half of them on the other device: 3 ids (4 B) out, 3 rows
    # (32 B) back; the backward sends 3 ids again and 3 gradient rows.
    assert c.owner.fwd.sent == c.owner.fwd.recv == 3 * 4 + 3 * 32
    assert c.owner.bwd.sent == c.owner.bwd.recv == 3 * 4 + 3 * 32
    assert c.owner.fwd.collectives == 2 and c.owner.bwd.collectives == 2
    assert c.owner.table_reads == 6  # 3 rows for itself, 3 for the peer
    assert c.owner.rows_updated == 6  # half of the 12 distinct ids
    assert c.owner.memory == 500_000 * 32 * 2  # half the rows, table + Adagrad slot


def test_hand_row_wise_pooled():
    c = strategy_cost("row_wise_pooled", HAND, 2, 2, COPYING)
    # pairs: 6, half to the peer (3 x 8 B) with half of the 6 distinct ids (3 x 4 B);
    # partials: one [2 samples, 8] per peer (64 B) back; backward: the [2, 8] act grads
    # (64 B) only (the owners keep the pairs and ids from the lookup)
    assert c.owner.fwd.sent == c.owner.fwd.recv == 24 + 12 + 64
    assert c.owner.bwd.sent == c.owner.bwd.recv == 64
    assert c.owner.rows_updated == 6


def test_hand_table_wise():
    c = strategy_cost("table_wise", HAND, 2, 2, COPYING)
    # the owner receives the peer's 6 pairs (8 B) and 6 distinct ids (4 B), sends it
    # [2, 8] pooled rows, receives its [2, 8] activation gradients (it kept the pairs and
    # ids from the lookup), updates all 12 distinct rows
    ids = 6 * 8 + 6 * 4
    assert (c.owner.fwd.recv, c.owner.fwd.sent) == (ids, 2 * 32)
    assert (c.owner.bwd.recv, c.owner.bwd.sent) == (2 * 32, 0)
    assert (c.source.fwd.sent, c.source.fwd.recv, c.source.bwd.sent) == (ids, 64, 64)
    assert c.owner.rows_updated == 12 and c.owner.table_reads == 12
    assert c.owner.memory == HAND.state_bytes and c.source.memory == 0


def test_hand_data_parallel_and_column_wise():
    dp = strategy_cost("data_parallel", HAND, 2, 2, COPYING, variant="sparse")
    assert dp.owner.fwd.sent == dp.owner.fwd.recv == 0
    # every device all-gathers its 6 (id, gradient row) pairs to the peer
    assert dp.owner.bwd.sent == dp.owner.bwd.recv == 6 * (4 + 32)
    assert dp.owner.rows_updated == 12  # every replica applies every update
    dense = strategy_cost("data_parallel", HAND, 2, 2, COPYING, variant="dense")
    assert dense.owner.bwd.sent == 2 * (2 - 1) / 2 * HAND.table_bytes  # ring all-reduce
    cw = strategy_cost("column_wise", HAND, 2, 2, COPYING, column_shards=2)
    # each owner holds 4 of the 8 columns: sends its 6 ids + 2 lengths to the other
    # column owner and the peer's [2, 4] pooled half (32 B); receives the same
    assert cw.owner.fwd.sent == cw.owner.fwd.recv == 32 + 32
    assert cw.owner.bwd.sent == cw.owner.bwd.recv == 32
    assert cw.owner.memory == HAND.state_bytes / 2


def test_hand_table_row_wise():
    """N = 4 devices in 2 hosts of 2 (group = 2); the table on host 0's two members."""
    c = strategy_cost("table_row_wise", HAND, 4, 2, COPYING, group=2)
    assert c.owners == 2 and c.placed
    m = c.owner.fwd
    # ids: each of the 3 other sources sends the member the half of its 6 ids + 2
    # lengths (32 B) whose rows it owns: 1 source on its host, 2 on the other host;
    # the member sends the other member half of its own (16 B).
    # partials: [4 sources x 2 samples, 8] reduce-scattered in the group: half of
    # 8 rows (128 B) each way. Then each member owns 1 sample of every source and
    # sends it to the 3 others (1 on its host, 2 off it): 32 B each; it receives its
    # own other sample (32 B) from the other member.
    assert (m.sent_intra, m.sent_inter) == (16 + 128 + 32, 2 * 32)
    assert (m.recv_intra, m.recv_inter) == (16 + 128 + 32, 2 * 16)
    src = c.source.fwd  # a device on the other host: all its ids out, 2 rows back
    assert (src.sent_inter, src.recv_inter) == (32, 64)
    assert c.owner.rows_updated == 24 / 2  # 4 x 6 distinct ids, half on each member
    assert c.owner.memory == 500_000 * 32 * 2


# ---------------------------------------------------------------------------
# brute force: build the batch, count what each device would send


def _batch(rng, n, b, lam, v, a):
    """ids[device][sample] -> array of ids: Poisson(lam) ids per sample, Zipf(a) ranks
    mapped to ids through a random permutation (as the training benchmark)."""
    p = _zipf_probs(v, a)
    perm = rng.permutation(v)
    return [[perm[rng.choice(v, size=rng.poisson(lam), p=p)] for _ in range(b)] for _ in range(n)]


def _brute_counts(batch, n, rb):
    """Per device: bytes each strategy sends in forward and backward (counted from
    the batch as the implementation would move them)."""
    out = {k: [] for k in ("rows_fwd_sent", "rows_fwd_recv", "pooled_fwd_sent", "dp_bwd_sent")}
    out["rows_updated"] = []
    out["tw_owner_fwd_recv"] = 0
    everything = np.concatenate([np.concatenate(dev) for dev in batch])
    for d, dev in enumerate(batch):
        mine = np.unique(np.concatenate(dev))
        remote = mine[mine % n != d]
        out["rows_fwd_sent"].append(remote.size * (4 + rb))
        asked = sum(
            np.count_nonzero(np.unique(np.concatenate(other)) % n == d)
            for s, other in enumerate(batch)
            if s != d
        )
        out["rows_fwd_recv"].append(asked * (4 + rb))
        ids = np.concatenate(dev)
        b = len(dev)
        # pairs (8 B) and distinct ids (4 B) to their owners, a partial row back per sample
        out["pooled_fwd_sent"].append(
            np.count_nonzero(ids % n != d) * 8 + remote.size * 4 + (n - 1) * b * rb
        )
        out["dp_bwd_sent"].append((n - 1) * mine.size * (4 + rb))
        out["rows_updated"].append(np.count_nonzero(np.unique(everything) % n == d))
        if d != 0:
            out["tw_owner_fwd_recv"] += ids.size * 8 + mine.size * 4
    return {k: np.asarray(x, np.float64) for k, x in out.items()}


@pytest.mark.parametrize("n,b,lam", [(2, 64, 3.0), (4, 32, 5.0)])
def test_strategies_against_brute_force(n, b, lam):
    v, a, d = 4000, 1.05, 8
    rb = d * 4
    table = TableStats("t", v, d, ids_per_sample=lam, zipf_a=a)
    rng = np.random.default_rng(7)
    runs = [_brute_counts(_batch(rng, n, b, lam, v, a), n, rb) for _ in range(40)]

    def check(key, model, per_device=True):
        x = (
            np.concatenate([r[key] for r in runs])
            if per_device
            else np.array([r[key] for r in runs])
        )
        se = x.std(ddof=1) / np.sqrt(x.size)
        assert abs(x.mean() - model) < 4 * se + 1e-3 * model, (key, x.mean(), model, se)

    rows = strategy_cost("row_wise_rows", table, n, b, COPYING)
    check("rows_fwd_sent", rows.owner.fwd.sent)
    check("rows_fwd_recv", rows.owner.fwd.recv)
    check("rows_updated", rows.owner.rows_updated)
    pooled = strategy_cost("row_wise_pooled", table, n, b, COPYING)
    check("pooled_fwd_sent", pooled.owner.fwd.sent)
    dp = strategy_cost("data_parallel", table, n, b, COPYING, variant="sparse")
    check("dp_bwd_sent", dp.owner.bwd.sent)
    tw = strategy_cost("table_wise", table, n, b, COPYING)
    check("tw_owner_fwd_recv", tw.owner.fwd.recv, per_device=False)


# ---------------------------------------------------------------------------
# properties

tables = st.builds(
    TableStats,
    name=st.just("t"),
    rows=st.integers(1, 10**8),
    dim=st.sampled_from([8, 16, 64, 128]),
    ids_per_sample=st.floats(0.5, 50),
    zipf_a=st.floats(0, 1.5),
)


@settings(max_examples=40, deadline=None)
@given(t=tables, n=st.sampled_from([1, 2, 8, 64, 512]), b=st.integers(1, 4096))
def test_strategy_properties(t, n, b):
    m = COPYING
    pooled = strategy_cost("row_wise_pooled", t, n, b, m)
    other = strategy_cost("row_wise_pooled", dataclasses.replace(t, rows=t.rows * 7 + 3), n, b, m)
    # only the distinct ids sent with the pairs depend on the rows (more rows, more
    # distinct ids, at most one per pair, twice a step)
    slack = 2 * b * t.ids_per_sample * 4 * (n - 1) / n
    pairs_of_bytes = [
        (pooled.owner.bytes_sent, other.owner.bytes_sent),
        (pooled.owner.bytes_recv, other.owner.bytes_recv),
    ]
    for x, y in pairs_of_bytes:
        assert x <= y * (1 + 1e-9) + 1e-6 and y <= x + slack * (1 + 1e-9) + 1e-6
    tw = strategy_cost("table_wise", t, n, b, m)
    assert tw.owner.memory == t.state_bytes and tw.owners == 1
    for variant in ("sparse", "dense"):
        dp = strategy_cost("data_parallel", t, n, b, m, variant=variant)
        assert dp.owner.fwd.sent == dp.owner.fwd.recv == 0
        assert dp.owner.memory >= t.state_bytes
    rows = strategy_cost("row_wise_rows", t, n, b, m)
    assert rows.owner.memory == -(-t.rows // n) * t.row_bytes * (1 + t.slots)
    # rows: at most one row per distinct id moves each way, and no more ids than pairs
    assert rows.owner.fwd.sent <= b * t.ids_per_sample * (4 + t.row_bytes) + 1e-6
    for s in cm.STRATEGIES:
        c = strategy_cost(s, t, n, b, m)
        assert c.owner.bytes_sent >= 0 and c.owner.bytes_recv >= 0
        assert cm.step_time(c, t, n, b, m) > 0
        if n == 1:
            assert c.owner.bytes_sent == c.owner.bytes_recv == 0


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 300),
    lam=st.floats(1, 60),
    n=st.sampled_from([1, 2, 4, 8]),
    b=st.integers(64, 4096),
)
def test_a_lookup_reads_each_distinct_row_from_memory_once(rows, lam, n, b):
    """Every strategy's lookup of a small table costs its distinct rows as cold reads
    and its other pairs as reads from cache: no owner reads more cold rows than the
    table has, and the pairs are all counted (cold + cached >= the pairs it combines).
    Before, table-wise, row-wise and column-wise counted every pair as a cold row, so a
    16-row table read 40 times a sample looked 40x dearer than a replica's lookup."""
    t = TableStats("t", rows, 16, ids_per_sample=lam, zipf_a=0.0)
    pairs = b * lam
    owners_pairs = {"table_wise": n * pairs, "column_wise": n * pairs}
    for machine in (COPYING, Machine.this_cpu("shm")):
        for s in cm.STRATEGIES:
            c = strategy_cost(s, t, n, b, machine)
            assert c.owner.table_reads <= rows * (1 + 1e-9), (s, c.owner.table_reads)
            combined = owners_pairs.get(s, pairs / n if s == "row_wise_pooled" else pairs)
            if s == "table_row_wise":
                combined = n * pairs / c.owners
            assert c.owner.table_reads + c.owner.buffer_pairs >= combined * (1 - 1e-9), s


def test_a_big_uniform_table_reads_every_pair_cold():
    """Where the ids rarely repeat (10^9 rows, uniform), the cold reads are the pairs."""
    t = TableStats("t", 10**9, 16, ids_per_sample=10, zipf_a=0.0)
    c = strategy_cost("row_wise_rows", t, 1, 4096, COPYING)
    assert c.owner.table_reads == pytest.approx(4096 * 10, rel=1e-3)


def test_memory_shrinks_with_devices_for_sharded_strategies():
    t = TableStats("big", 40_000_000, 128, ids_per_sample=1)
    for s in ("row_wise_rows", "row_wise_pooled", "table_row_wise"):
        mems = [strategy_cost(s, t, n, 64, COPYING).owner.memory for n in (1, 8, 64)]
        assert mems[0] > mems[1] > mems[2] or s == "table_row_wise"


def test_table_wise_placement_balances():
    where, loads = cm.table_wise_placement([5, 4, 3, 3, 2, 1], 3)
    assert sorted(loads) == [6, 6, 6]
    assert all(len(w) == 1 for w in where)


def test_plan_places_unequal_table_wise_tables_by_cost():
    """Three table-wise tables of costs ~2:1:1 on 2 devices: the heavy one alone, the
    two light ones together; the step is the busier device."""
    m = COPYING
    ts = [
        TableStats("heavy", 10**6, 64, ids_per_sample=20),
        TableStats("light0", 10**6, 64, ids_per_sample=10),
        TableStats("light1", 10**6, 64, ids_per_sample=10),
    ]
    items = [(t, strategy_cost("table_wise", t, 2, 512, m)) for t in ts]
    total, d = cm.plan_step_time(items, m, return_detail=True)
    where = [tuple(int(x) for x in a) for a in d["assignment"]]
    assert where[1] == where[2] != where[0]
    assert d["memory"].max() == 2 * ts[0].state_bytes  # the two light ones' device
    busiest = float(d["per_device"].max())
    assert total == pytest.approx(busiest + sum(d["latency"].values()) + d["overhead"])


def test_in_process_cpu_predicts_the_measured_points_roughly():
    """The calibrated CPU model reproduces the 1/2/4 in-process device medians of
    benchmarks/runs/train_run_2026-12-01_ndev.txt within 10%."""
    m = Machine.this_cpu()
    ts = [TableStats(f"t{i}", 1_000_000, 64, ids_per_sample=10, zipf_a=1.05) for i in range(8)]
    for n, measured in ((1, 26.3e-3), (2, 27.0e-3), (4, 30.8e-3)):
        items = [(t, strategy_cost("row_wise_rows", t, n, 4096 // n, m)) for t in ts]
        assert cm.plan_step_time(items, m) == pytest.approx(measured, rel=0.1)


# ---------------------------------------------------------------------------
# the planner


def test_planner_tiny_table_replicated_huge_table_sharded():
    m = Machine.h100_cluster()
    tiny = TableStats("tiny", 100, 128, ids_per_sample=1)
    huge = TableStats("huge", 40_000_000, 128, ids_per_sample=20)
    alone = cm.plan_tables([tiny], 64, m, batch_per_device=4096)
    assert alone.strategy_of("tiny") == "data_parallel"  # one small all-reduce
    plan = cm.plan_tables([tiny, huge], 64, m, batch_per_device=4096)
    assert plan.strategy_of("huge") not in ("data_parallel", "table_wise")
    # next to a sharded table, the tiny one may instead ride in its fused row
    # exchange (at most 100 rows move), saving the all-reduce's latency
    assert plan.strategy_of("tiny") in ("data_parallel", "row_wise_rows")
    text = plan.describe()
    assert "tiny" in text and "huge" in text and plan.strategy_of("huge") in text


def test_planner_respects_overrides_and_memory():
    m = Machine.h100_cluster()
    t = [TableStats(f"t{i}", 2_000_000, 64, ids_per_sample=5) for i in range(4)]
    plan = cm.plan_tables(t, 8, m, {"t0": "table_wise"}, batch_per_device=1024)
    assert plan.strategy_of("t0") == "table_wise"
    assert "(override)" in plan.describe()
    # a limit below one table + slot: nothing that keeps a whole table on a device
    limit = t[0].state_bytes * 0.9
    plan = cm.plan_tables(t, 8, m, batch_per_device=1024, memory_limit=limit)
    assert max(plan.memory_per_device) <= limit
    assert all(s not in ("data_parallel", "table_wise") for s in plan.strategies.values())
    with pytest.raises(ValueError, match="no plan fits"):
        cm.plan_tables(t, 8, m, batch_per_device=1024, memory_limit=t[0].state_bytes / 100)
    with pytest.raises(ValueError, match="unknown"):
        cm.plan_tables(t, 8, m, {"nope": "table_wise"}, batch_per_device=1024)


def test_cost_model_imports_only_numpy():
    """The planner's core stays free of jax (the package's own __init__ loads jax; this
    module adds nothing but the standard library and numpy)."""
    import ast

    tree = ast.parse(open(cm.__file__).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= {"__future__", "collections", "dataclasses", "functools", "math", "numpy"}
