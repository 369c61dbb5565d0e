"""Narrow rows packed several to a 128-lane row (`plan_stacking(pack_lanes=...)`, a TPU's
layout): the plan's widths and bytes (dims 8 to 64 at their own bytes), and training,
`variables`, `embedding_table_shards` and checkpoints (to and from the padded layout,
any device count) the same as with every slot an array of its own.

The layout is the TPU's; here it is switched on for CPU devices
(`stacking.PLATFORM_PACK_LANES`, with the slots in the rows), where every op then runs
its reference.
"""

import numpy as np
import pytest
from meshes import mesh_of
from test_slots_in_rows import OPTIMIZERS, _assert_same, _steps, _variables
from test_slots_in_rows import _features as three_tables

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, TableConfig
from embedmesh import checkpoint as ckpt
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity
from embedmesh.layout import stacking
from embedmesh.layout.stacking import plan_stacking

CAPS = Capacity(64, 64)


@pytest.fixture
def packing(monkeypatch):
    """`packing(True)`: CPU stacks keep their slots in their rows, narrow rows packed."""

    def set_(on: bool, when: str = "always"):
        monkeypatch.setitem(stacking.PLATFORM_SLOTS_IN_ROWS, "cpu", 128 if on else 0)
        monkeypatch.setitem(stacking.PLATFORM_PACK_LANES, "cpu", 128 if on else 0)
        monkeypatch.setattr(stacking, "PACK_NARROW_ROWS", when)

    return set_


def test_narrow_rows_hold_their_own_bytes():
    """On a TPU's layout, 1M-row Adagrad tables of dims 8, 16 and 32 hold their rows and
    accumulators' float32 bytes exactly (8, 4 and 2 rows a 128-lane row), dim 64 its
    row of 128 lanes; SGD's dim 16 rows go 8 a row; the optimizers that move every row,
    16-bit tables and table-wise tables keep whole rows; and the planner's memory rule
    counts the packed bytes."""
    from embedmesh.config import resolve_feature_config
    from embedmesh.layout import planner

    tpu = dict(
        dim_multiple=stacking.dim_multiple_for("tpu"),
        slots_in_rows=stacking.slots_in_rows_for("tpu"),
        pack_lanes=stacking.pack_lanes_for("tpu"),
    )
    assert stacking.pack_lanes_for("cpu") == 0 and tpu["pack_lanes"] == 128
    assert stacking.pack_lanes_for("tpu", padded_over_limit=False) == 0  # the default: padded
    v = 1_000_000
    for dim, pack in ((8, 8), (16, 4), (32, 2), (64, 1)):
        fc = {"f": FeatureConfig(TableConfig(v, dim, name="t"))}
        plan = plan_stacking(fc, 1, default_optimizer=em.Adagrad(0.1), **tpu)
        (s,) = plan.stacks
        assert (s.pack, s.width * s.pack) == (pack, 128)
        assert plan.bytes_per_device == (v * 2 * dim * 4,)  # 1x: rows and accumulators
        memory = planner.layout_memory(
            resolve_feature_config(fc), 1, default_optimizer=em.Adagrad(0.1), **tpu
        )
        assert memory({"t": "mod"}) == plan.bytes_per_device
    fc = {"f": FeatureConfig(TableConfig(64, 16, name="t", optimizer=em.SGD(0.1)))}
    (s,) = plan_stacking(fc, 1, **tpu).stacks
    assert (s.dim, s.width, s.pack) == (16, 16, 8)
    for table, sharding in (
        (TableConfig(64, 16, name="t", optimizer=em.Adam(0.1, lazy_adam=False)), "mod"),
        (TableConfig(64, 16, name="t", dtype="bfloat16"), "mod"),
        (TableConfig(64, 16, name="t"), "table_wise"),
    ):
        fc = {"f": FeatureConfig(table)}
        plan = plan_stacking(fc, 2, default_optimizer=em.Adagrad(0.1), sharding=sharding, **tpu)
        assert plan.stacks[0].pack == 1 and plan.stacks[0].width % 128 == 0


def _features(opts):
    """Narrow tables a (dim 8), b (dim 16, also read as a sequence), c (dim 32)."""
    return three_tables(opts, dims=(8, 16, 32), rows=(50, 41, 30))


def _batch(r):
    """Ids drawn from few rows, so that a batch's ids share packed rows."""
    lengths = r.integers(0, 4, 8)
    return {
        "fa": RaggedTensor.from_row_lengths(r.integers(0, 12, lengths.sum()), lengths),
        "fb": r.integers(0, 41, (8, 2)),
        "fc": RaggedTensor.from_row_lengths(r.integers(0, 30, lengths.sum()), lengths),
        "seq": RaggedTensor.from_row_lengths(r.integers(0, 10, lengths.sum()), lengths),
    }


def _train(
    packing, on, opt, n, sharding="mod", steps=3, optimizers=(None, None, None), pipelined=False
):
    packing(on)
    tables, feats = _features(optimizers)
    emb = MeshEmbedding(feats, opt, pipelined, mesh=mesh_of(n), capacities=CAPS, sharding=sharding)
    return emb, _steps(emb, tables, steps, _batch), tables


O = OPTIMIZERS
CASES = {  # (default optimizer, each table's own, devices, strategy, pipelined)
    "optimizers_1dev": (
        O["Adagrad"],
        (O["FTRL"], O["RowWiseAdagrad"], O["SGD"]),
        1,
        "mod",
        False,
    ),
    "rows_4dev": (O["Adam"], (O["AdagradMomentum"], None, O["Adagrad"]), 4, "mod", False),
    "pooled_pipelined_2dev": (O["Adagrad"], (None, O["SGD"], None), 2, "row_wise_pooled", True),
}


# where a case's checkpoint goes (`test_trains_as_the_padded_layout`): (which run's, onto
# packed rows?, devices); every direction between the layouts, across device counts
MOVES = {"optimizers_1dev": ("padded", True, 4), "rows_4dev": ("packed", False, 1)}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_as_the_padded_layout(packing, tmp_path, case):
    """Every optimizer (dense Adam keeps whole rows, above) on one device, the row exchange
    on 4 devices and pooling on the owners on 2, pipelined: activations and every variable
    after 3 steps as the run with each slot an array; the table arrays are stored packed
    and the bytes the plan counts are theirs; `embedding_table_shards` reads each table's
    rows. And a checkpoint saved from packed rows restores onto the padded layout on
    another device count, and one from padded rows onto packed rows: every variable
    bit-identical."""
    opt, optimizers, n, sharding, pipelined = CASES[case]
    run = dict(optimizers=optimizers, pipelined=pipelined)
    got_emb, got_acts, tables = _train(packing, True, opt, n, sharding, **run)
    want_emb, want_acts, _ = _train(packing, False, opt, n, sharding, **run)
    for g, w in zip(got_acts, want_acts):
        _assert_same({"acts": g}, {"acts": w})
    _assert_same(_variables(got_emb), _variables(want_emb))
    state = got_emb.observed_state()
    assert all(s.pack > 1 for s in got_emb.plan.stacks)
    for s in got_emb.plan.stacks:
        assert state.tables[s.name].shape == (s.num_rows // s.pack, 128)
    assert got_emb.plan.measured_bytes_per_device == got_emb.plan.bytes_per_device
    logical = {t.name: np.asarray(a) for t, a in got_emb.embedding_tables.items()}
    for t, shards in got_emb.embedding_table_shards.items():
        rows = np.concatenate([np.asarray(x) for _, x in shards])
        assert rows.shape[1] == t.dim
        got = np.sort(rows[np.any(rows != 0, axis=1)], axis=0)
        np.testing.assert_array_equal(got, np.sort(logical[t.name], axis=0))
    if case not in MOVES:
        return
    source, onto_packed, devices = MOVES[case]
    saved = got_emb if source == "packed" else want_emb
    ckpt.save(str(tmp_path / "c"), saved)
    want = _variables(saved)
    target, _, _ = _train(packing, onto_packed, opt, devices, sharding, steps=0, **run)
    assert all((s.pack > 1) == onto_packed for s in target.plan.stacks)
    assert ckpt.restore(target, str(tmp_path / "c")) == 3
    got = _variables(target)
    for t in want:
        for k in want[t]:
            np.testing.assert_array_equal(got[t][k], want[t][k], err_msg=f"{t}.{k}")


def test_by_default_packs_only_a_model_whose_padded_rows_do_not_fit(packing):
    """The default (`PACK_NARROW_ROWS = "memory"`): whole 128-lane rows (the faster step)
    while they fit the devices' memory, packed rows where only those fit."""
    packing(True, "memory")
    _, feats = _features((None, None, None))
    padded = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(2), capacities=CAPS)
    padded.build()
    assert all(s.pack == 1 and s.width == 128 for s in padded.plan.stacks)
    need = padded.plan.bytes_per_device[0]
    tight = MeshEmbedding(
        feats, em.Adagrad(0.1), mesh=mesh_of(2), capacities=CAPS, memory_limit_bytes=need - 1
    )
    tight.build()
    assert all(s.pack > 1 for s in tight.plan.stacks)
    assert tight.plan.bytes_per_device[0] < need / 2
    assert "packed 4 to a stored row of 128" in tight.plan.describe()
