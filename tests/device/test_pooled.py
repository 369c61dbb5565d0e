"""Pooling on the owner (`exchange="pooled"`): the same training as the row exchange,
against the float64 reference, on 2/4/8 in-process devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedmesh as em
from embedmesh import _runtime
from embedmesh.device.core import EmbeddingCore
from embedmesh.device.strategies import pooled

POOLED = ("row_wise_pooled", "table_wise")
# both pooled strategies in every case's embedding: a and c (the table smaller than the
# mesh) table-wise, on their owners, b pooled over all shards (stacks split by strategy)
BOTH_POOLED = {"a": "table_wise", "b": "row_wise_pooled", "c": "table_wise"}

# (devices, optimizer, variant): every optimizer once with both strategies, on 2 and on
# 4 devices stacked (even index) and not; the variants with a learning-rate
# schedule (the step carried into the owners' update: SGD, Adagrad, RowWiseAdagrad's 1)
# and Adam's dense one (lazy_adam=False: the row exchange's update) on 8. (Every variant
# of every optimizer: tests/engine/test_engine.py, mod; the pooled kernels' options and
# schedules: tests/device/test_pooled_ops.py. test_pooled_training_property draws the
# other combinations.)
POOLED_CASES = [
    (2, "SGD", 1),
    (4, "Adagrad", 1),
    (4, "AdagradMomentum", 0),
    (2, "FTRL", 1),
    (2, "RowWiseAdagrad", 1),
    (4, "Adam", 1),
    (8, "Adam", 2),
]


def test_pooled_cases_cover_every_optimizer_device_count_and_stacking():
    assert {o for _, o, _ in POOLED_CASES} == set(test_engine.OPTIMIZER_HP)
    # stacked (even index) and not, each on 2 and on 4 devices
    stacked = {(n, i % 2 == 0) for i, (n, _, _) in enumerate(POOLED_CASES)}
    assert {(2, True), (2, False), (4, True), (4, False)} <= stacked
    assert {n for n, _, _ in POOLED_CASES} == {2, 4, 8}
    assert set(BOTH_POOLED.values()) == set(POOLED)
    for _, opt, variant in POOLED_CASES:
        hp = test_engine.OPTIMIZER_HP[opt][variant]
        if opt in ("SGD", "Adagrad", "RowWiseAdagrad"):
            assert hp["lr_spec"][0] != "const", opt
    assert (8, "Adam", 2) in POOLED_CASES
    assert test_engine.OPTIMIZER_HP["Adam"][2]["lazy_adam"] is False


@pytest.mark.parametrize("index", range(len(POOLED_CASES)))
def test_pooled_training_matches_reference(index):
    """Every optimizer, both pooled strategies side by side in one embedding
    (`POOLED_CASES`), against the float64 reference from a poisoned state."""
    num_devices, opt_name, variant = POOLED_CASES[index]
    test_engine.check_training(
        num_devices,
        opt_name,
        test_engine.OPTIMIZER_HP[opt_name][variant],
        stack_tables=index % 2 == 0,
        seed=77 * num_devices + index,
        sharding=BOTH_POOLED,
        poison=True,
    )


def test_mixed_strategies_match_reference():
    """Pooled, row and table-wise tables side by side (stacks split by exchange form)."""
    rng = np.random.default_rng(11)
    feats, _ = test_engine.make_case(rng, None, True, 8)
    names = sorted({f.table.name for f in feats.values()})
    mix = {name: ("mod", "row_wise_pooled", "table_wise")[i % 3] for i, name in enumerate(names)}
    # (4 devices: both pooled strategies, without mod, on 2 and 4: POOLED_CASES)
    hp = test_engine.OPTIMIZER_HP["Adagrad"][0]
    test_engine.check_training(4, "Adagrad", hp, True, 16, sharding=mix, poison=True)


# each example builds and compiles a new embedding: few examples
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    num_devices=st.sampled_from([2, 4, 8]),
    opt_name=st.sampled_from(list(test_engine.OPTIMIZER_HP)),
    variant=st.integers(0, 2),
    stack=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_pooled_training_property(num_devices, opt_name, variant, stack, seed):
    variants = test_engine.OPTIMIZER_HP[opt_name]
    test_engine.check_training(
        num_devices,
        opt_name,
        variants[variant % len(variants)],
        stack,
        seed,
        steps=2,
        sharding=POOLED[seed % 2],
        poison=True,
    )


def test_pooled_training_with_unpacked_pairs(monkeypatch):
    """Pairs whose position and row do not fit one int32 travel as three words (both
    pooled strategies in one embedding)."""
    monkeypatch.setattr(_runtime, "PACK_LIMIT", 0)
    hp = test_engine.OPTIMIZER_HP["Adagrad"][0]
    test_engine.check_training(
        4, "Adagrad", hp, stack_tables=True, seed=5, steps=2, sharding=BOTH_POOLED
    )


def test_pooled_rows_feed_only_the_owners_rows():
    # rows 0-3 fed by shard 1 only, rows 4-9 by every shard, rows 10-11 by shards 0 and 2
    p = pooled.PooledRows(12, [(0, 4, (1,)), (4, 6, (0, 1, 2)), (10, 2, (0, 2))], 3)
    assert p.width == 10
    fed = [sorted(int(r) for r in p.rows[o] if r < 12) for o in range(3)]
    assert fed == [list(range(4, 12)), list(range(0, 10)), list(range(4, 12))]
    for o in range(3):
        for pos, r in enumerate(p.rows[o]):
            if r < 12:
                assert p.compact[o, r] == pos
        assert p.compact[o, 12] == p.width  # the pad row
    assert (p.compact[1, 10:12] == p.width).all()
    assert p.runs == [[(4, 6), (10, 2)], [(0, 4), (4, 6)], [(4, 6), (10, 2)]]
    assert not p.one_owner
    everyone = pooled.PooledRows(5, [(0, 5, (0, 1))], 2)
    assert everyone.rows is None and everyone.width == 5
    table_wise = pooled.PooledRows(7, [(0, 3, (1,)), (3, 0, (0,)), (3, 4, (0,))], 2)
    assert table_wise.one_owner and table_wise.runs == [[(3, 4)], [(0, 3)]]
    assert table_wise.width == 4 and list(table_wise.rows[1]) == [0, 1, 2, 7]


def test_strategy_errors_name_the_table_and_value():
    t = em.TableConfig(10, 4, name="t")
    feats = {"f": em.FeatureConfig(t)}
    with pytest.raises(ValueError, match="sharding must be one of.*'bogus'"):
        em.MeshEmbedding(feats, em.SGD(0.1), sharding="bogus")
    with pytest.raises(ValueError, match="'nope'"):
        em.MeshEmbedding(feats, em.SGD(0.1), sharding={"nope": "table_wise"})
    with pytest.raises(ValueError, match="sharding of table t.*'fast'"):
        em.MeshEmbedding(feats, em.SGD(0.1), sharding={t: "fast"})
    emb = em.MeshEmbedding(feats, em.SGD(0.1), mesh=test_engine.mesh_of(2))
    emb.build()
    plan = emb.plan
    with pytest.raises(ValueError, match="exchange must be one of"):
        EmbeddingCore(plan, test_engine.mesh_of(2), em.SGD(0.1), exchange="bogus")
    with pytest.raises(ValueError, match="'nope'"):
        EmbeddingCore(plan, test_engine.mesh_of(2), em.SGD(0.1), exchange={"nope": "pooled"})


def test_exchange_bytes_count_what_the_all_to_alls_send():
    """Rows: 2 x U x (4 + 4D) a peer; pooled: 4U + 8P + 4D x Rc, then 4D x Rc a peer
    (the ids and pairs a second time without the lookup's view)."""
    t = em.TableConfig(1000, 16, name="t", combiner="sum")
    feats = {"f": em.FeatureConfig(t), "g": em.FeatureConfig(t)}
    mesh = test_engine.mesh_of(4)
    rng = np.random.default_rng(3)
    batch = {
        "f": em.RaggedTensor.from_row_lengths(rng.integers(0, 1000, 40), np.full(8, 5)),
        "g": rng.integers(0, 1000, 8),
    }
    got = {}
    for form in ("rows", "pooled"):
        emb = em.MeshEmbedding(
            feats,
            em.SGD(0.1),
            mesh=mesh,
            sharding={"rows": "mod", "pooled": "row_wise_pooled"}[form],
            capacities=em.Capacity(64, 32),
        )
        emb.build()
        csr = emb.enqueue(batch)
        got[form] = emb.core.exchange_bytes(csr)["t"]
        got[form + " again"] = emb.core.exchange_bytes(csr, carrying=False)["t"]
    r = 2 * 2  # rows per device: 2 samples x 2 features
    assert got["rows"] == got["rows again"] == 3 * 2 * 32 * (4 + 4 * 16)
    # the update takes the lookup's view: only the gradients go back
    assert got["pooled"] == 3 * ((4 * 32 + 8 * 64 + 4 * 16 * r) + 4 * 16 * r)
    assert got["pooled again"] == 3 * 2 * (4 * 32 + 8 * 64 + 4 * 16 * r)


@pytest.mark.parametrize(
    ("sharding", "opt"), [("row_wise_pooled", em.SGD(0.2)), ("table_wise", em.Adagrad(0.2))]
)
def test_update_with_the_lookups_view_sends_only_gradients(sharding, opt):
    """The owners' view from the lookup gives the update the same tables as sending the
    pairs again, with one exchange fewer per pooled stack; the facade carries it. (Both
    strategies, an optimizer without slots and one with: one embedding each.)"""
    tables = [
        em.TableConfig(300, 8, name=f"t{i}", combiner=c) for i, c in enumerate(["sum", "mean"])
    ]
    feats = {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tables)}
    emb = em.MeshEmbedding(
        feats, opt, mesh=test_engine.mesh_of(4), sharding=sharding, capacities=em.Capacity(64, 64)
    )
    emb.build()
    rng = np.random.default_rng(1)
    batch = {
        f: em.RaggedTensor.from_row_lengths(rng.integers(0, 300, 80), np.full(16, 5)) for f in feats
    }
    csr = emb.enqueue(batch)
    core = emb.core
    state = core.state_from_tables(
        {t.name: rng.standard_normal((300, 8)).astype(np.float32) for t in tables}
    )
    acts, view = core.lookup(state, csr, carrying=True)
    assert set(view) == set(csr) and len(view) >= 1
    grads = {
        k: jnp.asarray(rng.standard_normal(a.shape).astype(np.float32)) for k, a in acts.items()
    }

    def update(st, view):
        return core.apply_gradients(st, grads, csr, view=view)[0]

    with_view = jax.jit(update)(state, view)
    again = jax.jit(update)(state, None)
    for s in csr:
        np.testing.assert_array_equal(np.asarray(with_view.tables[s]), np.asarray(again.tables[s]))
    assert not np.array_equal(np.asarray(with_view.tables[s]), np.asarray(state.tables[s]))

    def exchanges(view):
        text = jax.jit(update).lower(state, view).as_text()
        return text.count("embedmesh_exchange") + text.count("all_to_all")

    assert exchanges(view) == exchanges(None) - len(view)
    # the facade hands its dequeue's view to that batch's update
    _, preserved = emb.dequeue(csr)
    emb.apply_gradients(None, preserved)
    assert set(emb._pending[2]) == set(csr)


@pytest.mark.parametrize("sharding", ["row_wise_pooled", "auto"])
def test_two_processes_pooled_match_one_process_mod(tmp_path, sharding):
    """Two real processes (shared-memory exchange on one host) with pooling on the
    owners, or the planner's choice, train like one process with the row exchange."""
    from process_helpers import check_two_processes_match_one

    check_two_processes_match_one(tmp_path, "mod", sharding, rtol=2e-5, atol=1e-6)


def test_plan_is_readable_and_auto_plans_from_the_first_batch():
    big = em.TableConfig(5000, 16, name="big", combiner="sum")
    small = em.TableConfig(40, 8, name="small", combiner="mean")
    feats = {"b": em.FeatureConfig(big), "s": em.FeatureConfig(small)}
    emb = em.MeshEmbedding(
        feats,
        em.Adagrad(0.1),
        mesh=test_engine.mesh_of(2),
        sharding={"big": "auto", small: "table_wise"},
    )
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 6, 64)
    batch = {
        "b": em.RaggedTensor.from_row_lengths(rng.integers(0, 5000, lengths.sum()), lengths),
        "s": rng.integers(0, 40, 64),
    }
    emb.enqueue(batch)  # builds, planning "big" from this batch
    strategies = dict(emb.plan.strategies)
    assert strategies["small"] == "table_wise"
    assert strategies["big"] in ("row_wise_rows", "row_wise_pooled", "table_wise")
    text = str(emb.plan)
    assert text == emb.plan.describe()
    small_line = next(line for line in text.splitlines() if line.startswith("small "))
    # 40 rows x dim 8 x 4 bytes x (table + Adagrad slot) on its one owner
    assert "table_wise" in small_line and f"{40 * 8 * 4 * 2 / 1e6:,.1f}" in small_line
    assert "cost model" in text.splitlines()[0]
    owner = emb.plan.table("small").first_shard
    assert small_line.split()[3] == str(owner)
