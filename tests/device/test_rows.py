"""The row-layout seam (`embedmesh.layout.rows`): the mod layout against a plain
reference, the plan's locate/unlocate through it, and checkpoint re-cutting between the
mod layout and a layout written only against the abstract interface."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_common import apply_copies
from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.checkpoint import recut
from embedmesh.config import FeatureConfig, TableConfig
from embedmesh.layout.rows import ROW_LAYOUTS, ModRowLayout, RowLayout, logical_layout, row_layout
from embedmesh.layout.stacking import TablePlacement, plan_stacking


def placement(v: int, n: int, rotation: int, offset_rows: int = 0) -> TablePlacement:
    rps = -(-v // n)
    return TablePlacement(
        name="t",
        index=0,
        stack="t",
        num_shards=n,
        vocabulary_size=v,
        padded_vocabulary_size=rps * n,
        dim=3,
        padded_dim=8,
        row_offset=offset_rows * n,
        rotation=rotation,
    )


def reference(v: int, n: int, rotation: int):
    """The mod rule, plainly: row i on shard (i % n + rotation) % n at block row i // n.
    Returns (shard of each row, block row of each row, {shard: rows in block order})."""
    shard = [(i % n + rotation) % n for i in range(v)]
    block = [i // n for i in range(v)]
    on = {j: [] for j in range(n)}
    for i in range(v):  # increasing i: block rows 0, 1, 2, ... on each shard
        on[shard[i]].append(i)
    return np.array(shard, np.int64), np.array(block, np.int64), on


@st.composite
def tables(draw):
    n = draw(st.integers(1, 9))
    v = draw(st.integers(1, 70))
    rotation = draw(st.integers(0, n - 1))
    return v, n, rotation


@settings(max_examples=150, deadline=None)
@given(tables())
def test_mod_layout_matches_the_plain_rule(case):
    v, n, rotation = case
    layout, t = ModRowLayout(n), placement(v, n, rotation)
    shard, block, on = reference(v, n, rotation)
    rows = np.arange(v)
    np.testing.assert_array_equal(layout.shard_of(t, rows), shard)
    np.testing.assert_array_equal(layout.block_row(t, rows), block)
    # logical_rows inverts (shard_of, block_row)
    np.testing.assert_array_equal(layout.logical_rows(t, shard, block), rows)
    seen = []
    for j in range(n):
        got = layout.rows_on_shard(t, j)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, on[j])
        # rows_index indexes the logical table to the same rows (a slice: no gather)
        index = layout.rows_index(t, j)
        assert isinstance(index, slice)
        np.testing.assert_array_equal(rows[index], on[j])
        assert layout.count_on_shard(t, j) == len(on[j]) <= t.rows_per_shard
        # every block row of the shard, padding included, maps back: rows < v are the
        # shard's rows in block order, the rest are padding (>= v)
        back = layout.logical_rows(t, j, np.arange(t.rows_per_shard))
        np.testing.assert_array_equal(back[: len(on[j])], on[j])
        assert (back[len(on[j]) :] >= v).all()
        if on[j]:
            assert layout.first_row(t, j) == on[j][0]
        seen += list(got)
    # the shards partition range(v)
    assert sorted(seen) == list(range(v)) and len(seen) == v
    assert layout.shards_of(t) == tuple(j for j in range(n) if on[j])
    assert layout.columns_on_shard(t, 0) == (0, t.dim)
    assert layout.kernel_params(t) == (n, rotation, 0, v)  # (span, rotation, first, V)
    assert layout.block_rows(v) == t.rows_per_shard == max(len(r) for r in on.values())
    # period: row i + P is on the same shard, B block rows further
    p, b = layout.period(t)
    ext = np.arange(v + 2 * n)
    np.testing.assert_array_equal(layout.shard_of(t, ext + p), layout.shard_of(t, ext))
    np.testing.assert_array_equal(layout.block_row(t, ext + p), layout.block_row(t, ext) + b)


def test_the_rule_runs_traced_with_the_kernel_params_as_arguments():
    """What the checkpoint checksum program does: one compiled function, the table only
    in its (traced) parameters."""
    layout = ModRowLayout(5)
    fn = jax.jit(lambda params, j, q: layout.logical_rows_from_params(params, j, q))
    q = np.arange(9)
    for v, rotation in ((23, 0), (23, 4), (3, 2)):
        t = placement(v, 5, rotation)
        for j in range(5):
            got = fn(
                jnp.asarray(layout.kernel_params(t), jnp.int32),
                jnp.int32(j),
                jnp.asarray(q, jnp.int32),
            )
            np.testing.assert_array_equal(np.asarray(got), layout.logical_rows(t, j, q))


def test_logical_layout_and_names():
    t = placement(11, 4, 3)
    flat = logical_layout()
    assert flat.num_shards == 1
    np.testing.assert_array_equal(np.arange(11)[flat.rows_index(t, 0)], np.arange(11))
    np.testing.assert_array_equal(flat.shard_of(t, np.arange(11)), 0)
    np.testing.assert_array_equal(flat.block_row(t, np.arange(11)), np.arange(11))
    assert sorted(ROW_LAYOUTS) == ["mod"]
    assert row_layout("mod", 4) == ModRowLayout(4) and ModRowLayout(4).name == "mod"
    for bad in ("tablewise", None, 4):
        with pytest.raises(ValueError, match=r"sharding must be one of \['mod'\]"):
            row_layout(bad, 4)
    with pytest.raises(
        ValueError, match=r"sharding must be one of \['mod', 'table_wise', 'data_parallel'\]"
    ):
        plan_stacking({"f": FeatureConfig(TableConfig(5, 2, name="a"))}, 2, sharding="cols")


@st.composite
def plans(draw):
    k = draw(st.integers(1, 4))
    vocabs = draw(st.lists(st.integers(1, 40), min_size=k, max_size=k))
    dims = draw(st.lists(st.sampled_from([2, 8, 9]), min_size=k, max_size=k))
    n = draw(st.integers(1, 8))
    feats = {
        f"f{i}": FeatureConfig(TableConfig(v, d, name=f"t{i}"))
        for i, (v, d) in enumerate(zip(vocabs, dims))
    }
    return plan_stacking(feats, n, stack_tables=draw(st.booleans()), sharding="mod")


@settings(max_examples=60, deadline=None)
@given(plans())
def test_plan_unlocate_then_locate_round_trips_every_local_row(plan):
    """Every (shard, local row) of every stack is a table row that locates back to it, or
    padding (-1), and each table row is exactly one of them."""
    assert plan.row_layout == ModRowLayout(plan.num_shards)
    for s in plan.stacks:
        shard, local = np.meshgrid(
            np.arange(plan.num_shards), np.arange(s.rows_per_shard), indexing="ij"
        )
        index, row = plan.unlocate(s.name, shard, local)
        real = index >= 0
        assert ((row >= 0) == real).all()
        for name in s.tables:
            t = plan.table(name)
            mine = index == t.index
            assert sorted(row[mine]) == list(range(t.vocabulary_size))
            back_shard, back_local = plan.locate(name, row[mine])
            np.testing.assert_array_equal(back_shard, shard[mine])
            np.testing.assert_array_equal(back_local, local[mine])


@dataclasses.dataclass(frozen=True)
class BlockedLayout(RowLayout):
    """A layout written only against the abstract interface (no `rows_index` slice, the
    default `period`): row i on shard i // rows_per_shard, block row i % rows_per_shard."""

    num_shards: int
    name: str = "blocked"

    def shard_of(self, table, rows):
        return np.asarray(rows, np.int64) // table.rows_per_shard

    def block_row(self, table, rows):
        return np.asarray(rows, np.int64) % table.rows_per_shard

    def rows_on_shard(self, table, shard):
        rps = table.rows_per_shard
        return np.arange(shard * rps, min((shard + 1) * rps, table.vocabulary_size), dtype=np.int64)

    def logical_rows_from_params(self, params, shard, block_rows):
        return shard * params[0] + block_rows

    def block_rows(self, vocabulary_size):
        return -(-vocabulary_size // self.num_shards)

    def kernel_params(self, table):
        return (table.rows_per_shard,)


def stored_array(table: np.ndarray, layout: RowLayout, t) -> np.ndarray:
    """A table's stored `[N * rows_per_shard, ...]` array, block j = shard j (numpy)."""
    out = np.full((layout.num_shards * t.rows_per_shard,) + table.shape[1:], np.nan)
    for j in range(layout.num_shards):
        rows = layout.rows_on_shard(t, j)
        out[j * t.rows_per_shard + layout.block_row(t, rows)] = table[rows]
    return out


@settings(max_examples=60, deadline=None)
@given(tables(), st.integers(1, 6), st.integers(0, 1000))
def test_checkpoint_recut_goes_through_any_layout(case, n_other, seed):
    """The checkpoint's copy lists re-cut stored blocks between the mod layout and a
    layout with only the abstract interface, both ways, and into the logical table."""
    v, n, rotation = case
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(v, 3))
    mod, t_mod = ModRowLayout(n), placement(v, n, rotation)
    blocked, t_blocked = BlockedLayout(n_other), placement(v, n_other, 0)
    flat, t_flat = logical_layout(), placement(v, 1, 0)
    for (src, ts), (dst, td) in (
        ((mod, t_mod), (blocked, t_blocked)),
        ((blocked, t_blocked), (mod, t_mod)),
        ((blocked, t_blocked), (flat, t_flat)),
        ((mod, t_mod), (flat, t_flat)),
    ):
        stored = stored_array(table, src, ts)
        for j in range(dst.num_shards):
            out = np.full((td.rows_per_shard, 3), np.nan)
            apply_copies(stored, recut.recut_copies(src, ts, dst, td, j), out)
            rows = dst.rows_on_shard(td, j)
            np.testing.assert_array_equal(out[: len(rows)], table[rows])
