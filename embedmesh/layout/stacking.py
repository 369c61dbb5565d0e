"""Table stacking plan: which tables share one array, and where each row lives.

Tables whose padded dim, optimizer and dtype match are *stacked*: their rows
are concatenated into one array so that one lookup serves all their features.
The stacked array is sharded over the `N` shards of the mesh by the plan's
row layout (`plan.row_layout`, `embedmesh.layout.rows`; `sharding="mod"`, the
only one today).

Layout of one stack (every number here is static, a pure function of the
feature config and `N`):

- a table occupies a block of `rows_per_shard = row_layout.block_rows(V)`
  local rows on every shard (its rows there, then padding; mod: `ceil(V / N)`),
  the blocks of a stack's tables one after another: the table's block starts
  at local row `local_row_offset` (`row_offset // N`, where `row_offset`, a
  multiple of N, counts the padded rows `Vp = N * rows_per_shard` of the
  tables before it);
- table row `i` lives on shard `row_layout.shard_of(i)` at local row
  `local_row_offset + row_layout.block_row(i)` (mod: shard
  `(i % N + rotation) % N`, block row `i // N`); its *stacked row* is
  `local_row * N + shard` (an encoding of the pair, whatever the layout:
  stacked row `r` is shard `r % N`, local row `r // N`);
- `rotation` (`row_layout.rotations`) spreads small tables: a cursor moves
  over the shards, starting each table where the previous one's last, partial
  round of rows ended (and at least one shard further), so that e.g. eight
  one-row tables land on eight different shards and row 0 of consecutive big
  tables does too;
- the stack's dim is padded to a multiple of `dim_multiple` (default 8);
  padded columns and padded rows are zero and never touched by a lookup.

`plan_stacking(feature_config, num_shards)` returns an immutable, hashable
`StackingPlan` with vectorised mappings between (table, row) and (stack,
shard, local row). `embedmesh.layout.sharding` moves arrays between the logical and
the sharded layouts with the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Union

import numpy as np

from embedmesh.config import ResolvedFeatures, TableConfig, resolve_feature_config
from embedmesh.layout.rows import RowLayout, row_layout

__all__ = ["FeaturePlacement", "StackSpec", "StackingPlan", "TablePlacement", "plan_stacking"]

DEFAULT_DIM_MULTIPLE = 8
_INT32_MAX = int(np.iinfo(np.int32).max)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """Where one table's rows live in its stack (see the module docstring)."""

    name: str
    index: int  # position of the table in the resolved config (order of first use)
    stack: str
    num_shards: int
    vocabulary_size: int
    padded_vocabulary_size: int  # multiple of num_shards
    dim: int
    padded_dim: int  # the stack's dim
    row_offset: int  # first stacked row, a multiple of num_shards
    rotation: int  # in [0, num_shards)

    @property
    def rows_per_shard(self) -> int:
        """Local rows this table owns on every shard (`padded_vocabulary_size // N`)."""
        return self.padded_vocabulary_size // self.num_shards

    @property
    def local_row_offset(self) -> int:
        """First local row of this table on every shard."""
        return self.row_offset // self.num_shards


@dataclasses.dataclass(frozen=True)
class FeaturePlacement:
    """A feature's table and stack, and how many activation rows a sample gives."""

    name: str
    index: int  # position in the flattened feature config
    table: str
    stack: str
    rows_per_sample: int  # max_sequence_length for sequence features, else 1
    dim: int  # the table's (unpadded) dim
    combiner: str | None  # None for sequence features (one row per position)


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """One stacked array: its tables in row order, the features reading it."""

    name: str
    tables: tuple  # table names, in row order
    features: tuple  # feature names, in config order (the activation buffer order)
    dim: int  # padded dim
    optimizer: Any  # the tables' effective optimizer (None: the engine's default)
    dtype: Any  # numpy dtype of the parameters
    num_shards: int
    num_rows: int  # stacked rows, a multiple of num_shards

    @property
    def rows_per_shard(self) -> int:
        return self.num_rows // self.num_shards


TableKey = Union[str, TableConfig, TablePlacement]


@dataclasses.dataclass(frozen=True)
class StackingPlan:
    """Immutable result of `plan_stacking`; compare and hash like a value.

    `tables` is in the resolved config's table order, `stacks` in order of
    their first table, `features` in flattened config order.
    """

    num_shards: int
    stacks: tuple  # StackSpec
    tables: tuple  # TablePlacement
    features: tuple  # FeaturePlacement
    resolved: ResolvedFeatures = dataclasses.field(repr=False)
    row_layout: RowLayout = None  # where a table's rows live on the shards (default: mod)

    def __post_init__(self):
        if self.row_layout is None:
            object.__setattr__(self, "row_layout", row_layout("mod", self.num_shards))

    # -- look-ups -----------------------------------------------------------

    @functools.cached_property
    def _table_by_name(self) -> dict:
        return {t.name: t for t in self.tables}

    @functools.cached_property
    def _stack_by_name(self) -> dict:
        return {s.name: s for s in self.stacks}

    @functools.cached_property
    def _feature_by_name(self) -> dict:
        return {f.name: f for f in self.features}

    @functools.cached_property
    def _stack_local_offsets(self) -> dict:
        """stack -> (sorted local row offsets, table placements) for reverse look-ups."""
        out = {}
        for s in self.stacks:
            placed = [self._table_by_name[n] for n in s.tables]
            out[s.name] = (np.array([t.local_row_offset for t in placed], np.int64), placed)
        return out

    def table(self, table: TableKey) -> TablePlacement:
        """The placement of a table given by name, `TableConfig` or placement."""
        if isinstance(table, TablePlacement):
            return table
        if isinstance(table, TableConfig):
            table = self.resolved.table_name(table)
        try:
            return self._table_by_name[table]
        except KeyError:
            raise KeyError(
                f"no table named {table!r} in this plan (tables: {sorted(self._table_by_name)})"
            ) from None

    def stack(self, name: str) -> StackSpec:
        try:
            return self._stack_by_name[name]
        except KeyError:
            raise KeyError(
                f"no stack named {name!r} in this plan (stacks: {[s.name for s in self.stacks]})"
            ) from None

    def feature(self, name: str) -> FeaturePlacement:
        try:
            return self._feature_by_name[name]
        except KeyError:
            raise KeyError(f"no feature named {name!r} in this plan") from None

    def stack_of(self, table: TableKey) -> StackSpec:
        return self.stack(self.table(table).stack)

    def table_config(self, table: TableKey) -> TableConfig:
        return self.resolved.tables[self.table(table).index]

    # -- row mappings (vectorised) -----------------------------------------

    def locate(self, table: TableKey, ids) -> tuple:
        """`(shard, local_row)` of table rows `ids` (int64 arrays, shape of `ids`).

        Raises ValueError for ids outside `[0, vocabulary_size)`.
        """
        t = self.table(table)
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= t.vocabulary_size):
            bad = ids.reshape(-1)[
                np.nonzero(((ids < 0) | (ids >= t.vocabulary_size)).reshape(-1))[0][0]
            ]
            raise ValueError(f"table {t.name}: row {int(bad)} is outside [0, {t.vocabulary_size})")
        ids = ids.astype(np.int64, copy=False)
        layout = self.row_layout
        return layout.shard_of(t, ids), t.local_row_offset + layout.block_row(t, ids)

    def stacked_rows(self, table: TableKey, ids) -> np.ndarray:
        """Stacked rows `local_row * N + shard` of table rows `ids`."""
        shard, local = self.locate(table, ids)
        return local * self.num_shards + shard

    def unlocate(self, stack: str, shard, local_row) -> tuple:
        """Inverse of `locate`: `(table_index, row)` for local rows of a stack's shard.

        `table_index` indexes `plan.tables`; both are -1 for padding rows (past
        a table's vocabulary). Raises ValueError for rows outside the stack.
        """
        s = self.stack(stack)
        offsets, placed = self._stack_local_offsets[s.name]
        shard = np.asarray(shard, np.int64)
        local = np.asarray(local_row, np.int64)
        shard, local = np.broadcast_arrays(shard, local)
        if local.size and (
            local.min() < 0
            or local.max() >= s.rows_per_shard
            or shard.min() < 0
            or shard.max() >= self.num_shards
        ):
            raise ValueError(
                f"stack {s.name}: (shard, local row) outside "
                f"[0, {self.num_shards}) x [0, {s.rows_per_shard})"
            )
        k = np.searchsorted(offsets, local, side="right") - 1
        index = np.array([t.index for t in placed], np.int64)[k]
        vocab = np.array([t.vocabulary_size for t in placed], np.int64)[k]
        row = np.empty_like(local)
        for i, t in enumerate(placed):  # per table: the layout's inverse
            sel = k == i
            row[sel] = self.row_layout.logical_rows(t, shard[sel], local[sel] - offsets[i])
        pad = row >= vocab
        return np.where(pad, -1, index), np.where(pad, -1, row)

    def from_stacked_rows(self, stack: str, rows) -> tuple:
        """Inverse of `stacked_rows`: `(table_index, row)`, -1 for padding rows."""
        rows = np.asarray(rows, np.int64)
        return self.unlocate(stack, rows % self.num_shards, rows // self.num_shards)


def _effective_optimizer(table: TableConfig, default):
    return table.optimizer if table.optimizer is not None else default


def plan_stacking(
    feature_config: Any,
    num_shards: int,
    *,
    stack_tables: bool = True,
    max_stack_rows: int | None = None,
    dim_multiple: int = DEFAULT_DIM_MULTIPLE,
    default_optimizer: Any = None,
    table_dtypes: Mapping[str, Any] | None = None,
    sharding: str = "mod",
) -> StackingPlan:
    """Group the tables of `feature_config` into stacks for `num_shards` shards.

    Args:
      feature_config: a nested structure of `FeatureConfig` (or the
        `ResolvedFeatures` of one).
      num_shards: N, the number of shards (devices) each stack is split over.
      stack_tables: False gives one stack per table.
      max_stack_rows: a stack stops growing before its padded rows would
        exceed this (a table larger than it gets a stack of its own).
      dim_multiple: dims are padded to a multiple of this (1: no padding).
      default_optimizer: the optimizer of tables whose `optimizer` is None
        (the engine's default); stacking compares effective optimizers by
        equality.
      table_dtypes: optional `{table name: dtype}` (default float32); only
        tables of one dtype stack.
      sharding: the row layout (`embedmesh.layout.rows`); only "mod".

    Tables stack when (padded dim, optimizer, dtype) match, in order of first
    use. A single-table stack is named after its table; a multi-table stack
    joins its tables' names with "+".
    """
    resolved = (
        feature_config
        if isinstance(feature_config, ResolvedFeatures)
        else resolve_feature_config(feature_config)
    )
    if not (
        isinstance(num_shards, (int, np.integer))
        and not isinstance(num_shards, bool)
        and num_shards >= 1
    ):
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if not (isinstance(dim_multiple, (int, np.integer)) and dim_multiple >= 1):
        raise ValueError(f"dim_multiple must be an int >= 1, got {dim_multiple!r}")
    if max_stack_rows is not None and not (
        isinstance(max_stack_rows, (int, np.integer)) and max_stack_rows >= 1
    ):
        raise ValueError(f"max_stack_rows must be None or an int >= 1, got {max_stack_rows!r}")
    n = int(num_shards)
    layout = row_layout(sharding, n)
    dtypes = dict(table_dtypes or {})
    unknown = set(dtypes) - set(resolved.table_names)
    if unknown:
        raise ValueError(f"table_dtypes names unknown tables {sorted(unknown)}")

    # Group tables (in order of first use) by their stacking key.
    groups: list[tuple[Any, list[int]]] = []
    for i, t in enumerate(resolved.tables):
        key = (
            _round_up(t.dim, dim_multiple),
            _effective_optimizer(t, default_optimizer),
            np.dtype(dtypes.get(resolved.table_names[i], np.float32)),
        )
        for gkey, members in groups:
            if stack_tables and gkey == key:
                members.append(i)
                break
        else:
            groups.append((key, [i]))

    # Split groups by the size limit, keeping table order.
    stacks_idx: list[tuple[Any, list[int]]] = []
    for key, members in groups:
        current: list[int] = []
        rows = 0
        for i in members:
            vp = layout.block_rows(resolved.tables[i].vocabulary_size) * n
            if current and max_stack_rows is not None and rows + vp > max_stack_rows:
                stacks_idx.append((key, current))
                current, rows = [], 0
            current.append(i)
            rows += vp
        stacks_idx.append((key, current))
    stacks_idx.sort(key=lambda s: s[1][0])

    # Rotation: the layout's parameter per table, in table order (see module docstring).
    rotation = dict(enumerate(layout.rotations([t.vocabulary_size for t in resolved.tables])))

    table_placements: dict[int, TablePlacement] = {}
    stack_specs = []
    used_names = set(resolved.table_names)
    for key, members in stacks_idx:
        dim, optimizer, dtype = key
        names = [resolved.table_names[i] for i in members]
        name = names[0] if len(members) == 1 else "+".join(names)
        if len(members) > 1 and name in used_names:
            raise ValueError(f"stack name {name!r} collides with a table or stack name")
        used_names.add(name)
        offset = 0
        for i in members:
            t = resolved.tables[i]
            vp = layout.block_rows(t.vocabulary_size) * n
            table_placements[i] = TablePlacement(
                name=resolved.table_names[i],
                index=i,
                stack=name,
                num_shards=n,
                vocabulary_size=t.vocabulary_size,
                padded_vocabulary_size=vp,
                dim=t.dim,
                padded_dim=dim,
                row_offset=offset,
                rotation=rotation[i],
            )
            offset += vp
        if offset // n > _INT32_MAX:
            raise ValueError(
                f"stack {name}: {offset // n} rows per shard do not fit int32; "
                f"use more shards or a smaller max_stack_rows"
            )
        feats = tuple(
            fname
            for fname, f in zip(resolved.feature_names, resolved.features)
            if any(f.table is resolved.tables[i] for i in members)
        )
        stack_specs.append(
            StackSpec(
                name=name,
                tables=tuple(names),
                features=feats,
                dim=dim,
                optimizer=optimizer,
                dtype=dtype,
                num_shards=n,
                num_rows=offset,
            )
        )

    table_of = {id(t): i for i, t in enumerate(resolved.tables)}
    features = []
    for k, (fname, f) in enumerate(zip(resolved.feature_names, resolved.features)):
        ti = table_of[id(f.table)]
        seq = f.max_sequence_length > 0
        features.append(
            FeaturePlacement(
                name=fname,
                index=k,
                table=resolved.table_names[ti],
                stack=table_placements[ti].stack,
                rows_per_sample=f.max_sequence_length if seq else 1,
                dim=f.table.dim,
                combiner=None if seq else f.table.combiner,
            )
        )
    return StackingPlan(
        num_shards=n,
        stacks=tuple(stack_specs),
        tables=tuple(table_placements[i] for i in range(len(resolved.tables))),
        features=tuple(features),
        resolved=resolved,
        row_layout=layout,
    )
