"""Table stacking plan: which tables share one array, and where each row lives.

Tables whose padded dim, optimizer and dtype match are *stacked*: their rows
are concatenated into one array so that one lookup serves all their features.
The stacked array is sharded over the `N` shards of the mesh by the plan's
row layout (`plan.row_layout`, `embedmesh.layout.rows`: the mod rule over each
table's span of shards).

Placement, per table (`sharding=`: "mod" for every table, the default;
"table_wise" or "data_parallel" for every table; or `{table name: one of them}`, tables
not named being "mod"):

- "mod" (TPUEmbeddingV2's): the table spans all N shards (`first_shard = 0`,
  `span = N`), row `i` on shard `(i % N + rotation) % N`, block row `i // N`;
- "table_wise": the whole table on one shard, its owner (`first_shard =
  owner`, `span = 1`, `rotation = 0`), row `i` at block row `i`. Owners are
  bin-packed in each stack (`pack_owners`): its table-wise tables, largest first
  (rows, then config order), each go to the shard with the fewest rows of the
  stack so far (ties: the fewest table-wise rows * dim over the stacks placed
  before, the stacks with the most table-wise rows * dim first; then the lowest
  index), which keeps the stack's block, its fullest owner's rows, small. Where
  whole tables would leave a device holding more than `TABLE_WISE_MAX_OVERHEAD`
  times its fullest owner's own bytes (memory, below), some are spread over a
  few consecutive shards (`first_shard = owner`, `1 < span`, rows mod the span:
  the mod rule over part of the mesh; `_spread_table_wise`), placed in their
  stack before its whole tables;
- "data_parallel": the whole table on every shard, a replica each (block row
  `i` is row `i`, as for "table_wise"). Its lookups read the device's own
  replica, and every replica applies the same update, made of every device's
  gradients. Row mappings and checkpoints see one canonical copy: the table
  reads as table-wise on shard 0 (`row_layout.span`, `holds`), while
  `row_layout.copy_of(table, j)` names the block each shard holds a copy of
  (0 on every shard). Such a table reserves its local rows on every shard and
  never shares a stack with tables of another placement;
- on one shard the three are the same layout (every table is "mod" there).

Layout of one stack (every number here is static, a pure function of the
feature config, the placements and `N`):

- a table occupies a block of `rows_per_shard = ceil(V / span)` local rows on
  each shard of its span (its rows there, then padding) and nothing on the
  other shards; the block starts at local row `local_row_offset` on every
  shard of its span (`row_offset // N`; `row_offset`, a multiple of N, is
  `N * local_row_offset`, and `padded_vocabulary_size = span *
  rows_per_shard` the rows of its blocks);
- the mod tables' blocks come first, one after another (the same local rows on
  every shard), then the table-wise tables, each after the earlier table-wise
  tables of its owner: tables on different shards share local rows. The
  stack's `rows_per_shard` is the most any shard uses (`StackSpec.tables` is in
  this order: the mod tables, then the table-wise ones in config order, so that
  on every shard its tables are in increasing local rows);
- table row `i` lives on shard `row_layout.shard_of(i)` at local row
  `local_row_offset + row_layout.block_row(i)`; its *stacked row* is
  `local_row * N + shard` (an encoding of the pair, whatever the layout:
  stacked row `r` is shard `r % N`, local row `r // N`);
- `rotation` (`row_layout.rotations`, over the mod tables) spreads small
  tables: a cursor moves over the shards, starting each table where the
  previous one's last, partial round of rows ended (and at least one shard
  further), so that e.g. eight one-row tables land on eight different shards
  and row 0 of consecutive big tables does too;
- the stack's dim is padded to a multiple of `dim_multiple` (default 8; a row-wise
  optimizer's stack keeps its table's dim below `ROW_WISE_PADDED_FROM`, see `_stack_dim`);
  padded columns and padded rows are zero and never touched by a lookup;
- slots in rows (`slots_in_rows`, a TPU's): a stack whose optimizer has slots keeps them
  in its table's rows, `[parameters | slot ... | zero]`, each row padded to a multiple of
  `slots_in_rows` columns (`StackSpec.width`, `StackSpec.slot_columns`): one row move
  reads or writes a row and all its state, where separate arrays cost one move each
  (a v5e moves rows at a cost a row: `embedmesh.device.ops.tpu`). Tables stack there by
  that row width; the stack's dim is its widest table's, rounded to `DEFAULT_DIM_MULTIPLE`;
- packed narrow rows (`pack_lanes`, a TPU's 128 where its padded rows would not fit:
  `pack_lanes_for`): a float32 mod table whose row (parameters and slots in it) takes at
  most half of `pack_lanes` is a row of its own width, a power of two, and `pack` of them
  share each stored row (`StackSpec.pack`; every shard's rows a multiple of it): the table
  holds its own bytes (`embedmesh.device.ops.packed`);
- memory: a stacked array is evenly sharded, so every device holds
  `rows_per_shard` rows of every stack (`StackingPlan.bytes_per_device`): a
  table-wise block costs its rows on every device, filled there by other
  owners' tables. Hence a stack of table-wise tables only joins a wider stack
  of the same optimizer, dtype and key (its tables' dims padded to that width)
  where that costs fewer bytes a device than two stacks; then (up to 16 of
  them) single table-wise tables move to another such stack, or to one of their
  own, while that saves bytes (a narrow table fits for free under another
  owner's rows), and a class of at most 6 table-wise tables that may share
  stacks takes the grouping of all that costs the fewest bytes
  (`merge_table_wise`). A device holds `sum over stacks of width * fullest
  owner's rows`; with whole tables that can stay well above an owner's own
  bytes (a table wider than the others needs a stack of its own, whose rows
  every device holds; a stack's tables may leave its owners uneven). So where a
  device would hold more than `TABLE_WISE_MAX_OVERHEAD` (1.25) times the most
  any shard's own rows take (each table at its own width, with its slots),
  table-wise tables are spread over a few shards, one spread a round: of those
  that bring it within the bound, the one moving the fewest rows off their
  owners, else the one saving the most bytes a device per shard added; for the
  merged grouping and the grouping by key alone, the one within the bound that
  moves the fewest rows kept (else the one holding the fewest bytes). A shard a
  spread table spans also pools its features' lookups (the same exchange,
  several owners a table).

`plan_stacking(feature_config, num_shards)` returns an immutable, hashable
`StackingPlan` with vectorised mappings between (table, row) and (stack,
shard, local row). `embedmesh.layout.sharding` moves arrays between the logical and
the sharded layouts with the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

import numpy as np

from embedmesh.config import ResolvedFeatures, TableConfig, resolve_feature_config
from embedmesh.layout.rows import RowLayout, row_layout
from embedmesh.layout.table_wise import merge_table_wise, owners_of, spread_order

__all__ = [
    "SHARDINGS",
    "FeaturePlacement",
    "StackSpec",
    "StackingPlan",
    "TablePlacement",
    "plan_stacking",
    "table_shardings",
]

DEFAULT_DIM_MULTIPLE = 8
# A platform's dim multiple where it differs: a TPU moves rows of whole 128-lane vregs
# many times faster than narrower ones (embedmesh.device.ops.tpu).
PLATFORM_DIM_MULTIPLE = {"tpu": 128}
# From this dim multiple (whole vregs: a TPU's) a row-wise optimizer's stack is padded too,
# its mean told its table's dim (`mean_dim`); below it the stack keeps its own dim (the CPU
# kernel's mean is over the whole row, and a few padded columns buy nothing there).
ROW_WISE_PADDED_FROM = 128
# A platform whose stacks keep their optimizer slots in the table's rows, and the multiple
# such a row's width is padded to: a TPU's 128 lanes (one row move, not one per array).
PLATFORM_SLOTS_IN_ROWS = {"tpu": 128}
# A platform that can store narrow rows several to a row of this many lanes (`pack_lanes`):
# a TPU's 128, so that a dim-16 table with its Adagrad slot holds its own bytes, not 4x them.
PLATFORM_PACK_LANES = {"tpu": 128}
# When such a platform packs: "memory" (the default: only a model whose padded rows would not
# fit its devices' memory; on a v5e the packed step measured 1.25-1.28x the padded one at
# dims 16 and 32), "always" or "never".
PACK_NARROW_ROWS = "memory"


def dim_multiple_for(platform: str) -> int:
    """The dim multiple of stacks on devices of `platform` ("cpu", "gpu", "tpu")."""
    return PLATFORM_DIM_MULTIPLE.get(platform, DEFAULT_DIM_MULTIPLE)


def slots_in_rows_for(platform: str) -> int:
    """`plan_stacking`'s `slots_in_rows` on devices of `platform` (0: slots apart)."""
    return PLATFORM_SLOTS_IN_ROWS.get(platform, 0)


def pack_lanes_for(platform: str, padded_over_limit: bool = True) -> int:
    """`plan_stacking`'s `pack_lanes` on devices of `platform` (0: no packing) for a model
    whose padded rows would (`padded_over_limit`) or would not exceed its devices' memory:
    `PACK_NARROW_ROWS` says when a platform that can pack does."""
    if PACK_NARROW_ROWS == "never" or (PACK_NARROW_ROWS == "memory" and not padded_over_limit):
        return 0
    return PLATFORM_PACK_LANES.get(platform, 0)


def _slot_columns(opt, dim: int) -> tuple:
    """`((slot, first column, width), ...)` of `opt`'s slots after `dim` parameter columns."""
    out, start = [], dim
    for slot in getattr(opt, "slot_names", ()) or ():
        width = opt.slot_width(slot, dim)
        out.append((slot, start, width))
        start += width
    return tuple(out)


def _row_width(opt, dim: int, multiple: int) -> int:
    """The columns of a row holding `dim` parameters and `opt`'s slots, padded to `multiple`."""
    cols = _slot_columns(opt, dim)
    return _round_up(cols[-1][1] + cols[-1][2] if cols else dim, multiple)


SHARDINGS = (
    "mod",
    "table_wise",
    "data_parallel",
)  # the placements a table may have (see the module docstring)
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
    padded_vocabulary_size: int  # span * rows_per_shard: the rows of its blocks (multiple of span)
    dim: int
    padded_dim: int  # the stack's dim
    row_offset: int  # N * local_row_offset: a multiple of num_shards
    rotation: int  # in [0, span)
    first_shard: int = 0  # the table's blocks are on shards [first_shard, first_shard + span)
    span: int | None = None  # None: num_shards (mod)
    # data_parallel: every shard holds a replica of the canonical block (shard 0's)
    replicated: bool = False

    def __post_init__(self):
        if self.span is None:
            object.__setattr__(self, "span", self.num_shards)

    @property
    def rows_per_shard(self) -> int:
        """Local rows of this table's block on each shard of its span
        (`padded_vocabulary_size // span`)."""
        return self.padded_vocabulary_size // self.span

    @property
    def local_row_offset(self) -> int:
        """First local row of this table on every shard of its span."""
        return self.row_offset // self.num_shards

    @property
    def shards(self) -> range:
        """The shards holding a block of this table."""
        return range(self.first_shard, self.first_shard + self.span)

    @property
    def sharding(self) -> str:
        """ "mod" (every shard), "table_wise" (one shard of several), "data_parallel"
        (a replica on every shard) or "table_row_wise" (part of the mesh, a layout no
        plan makes today)."""
        if self.replicated:
            return "data_parallel"
        if self.span == self.num_shards:
            return "mod"
        return "table_wise" if self.span == 1 else "table_row_wise"


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
    tables: tuple  # table names, in row order (the mod tables, then the table-wise ones)
    features: tuple  # feature names, in config order (the activation buffer order)
    dim: int  # padded dim
    optimizer: Any  # the tables' effective optimizer (None: the engine's default)
    dtype: Any  # numpy dtype of the parameters (its tables' `TableConfig.dtype`)
    num_shards: int
    num_rows: int  # stacked rows: num_shards * the most local rows any shard uses
    replicated: bool = False  # its tables are data_parallel (all or none of them are)
    # its tables' QuantizationConfig as (num_buckets, lower, upper), or None: tables with
    # different ones never share a stack (their lookups quantize the rows they read)
    quantization: tuple | None = None
    # slots in rows: ((slot, first column, width), ...) of each optimizer slot inside the
    # table's rows (`plan_stacking(slots_in_rows=...)`); () keeps each slot an array
    slot_columns: tuple = ()
    row_width: int = 0  # the table array's columns where slots are in rows (0: `dim`)
    # numpy dtype of the optimizer slot arrays (`TableConfig.slot_dtype`; None: float32);
    # slots kept in the rows have the table's (they are kept there only where equal)
    slot_dtype: Any = None
    # packed narrow rows (`plan_stacking(pack_lanes=...)`): `pack` logical rows of `width`
    # columns side by side in each stored row of `pack * width` lanes (1: a row a row)
    pack: int = 1

    @property
    def slots_dtype(self) -> np.dtype:
        """The optimizer slots' dtype: the table's where they are in its rows, else
        `slot_dtype` (float32 where None)."""
        if self.slot_columns:
            return np.dtype(self.dtype)
        return np.dtype(self.slot_dtype if self.slot_dtype is not None else np.float32)

    @property
    def rows_per_shard(self) -> int:
        return self.num_rows // self.num_shards

    @property
    def width(self) -> int:
        """The columns of the stack's table array: `dim`, or with its slots in its rows
        the parameters, the slots and zero padding."""
        return self.row_width or self.dim

    @property
    def row_columns(self) -> int:
        """A row's columns with its optimizer's slots, in the table's rows or apart."""
        return self.width if self.slot_columns else _row_width(self.optimizer, self.dim, 1)

    @property
    def lookup_columns(self) -> int | None:
        """The columns a lookup reads of each row: the parameters' (`dim`) where the rows
        also hold slots, else None (all of them)."""
        return self.dim if self.slot_columns else None

    def columns_of(self, field: str) -> tuple:
        """`(first column, width)` of `field` ("parameters" or a slot kept in the rows)
        in the table array's rows; a KeyError for a slot kept apart."""
        if field == "parameters":
            return 0, self.dim
        for slot, start, width in self.slot_columns:
            if slot == field:
                return start, width
        raise KeyError(f"stack {self.name} keeps no slot {field!r} in its rows")


TableKey = Union[str, TableConfig, TablePlacement]


def _named(by_name: Mapping, name, kind: str, known: Callable[[], str]):
    """`by_name[name]`, else a KeyError "no `kind` named `name` in this plan" + `known()`
    (what the plan has; only computed for the error)."""
    try:
        return by_name[name]
    except KeyError:
        raise KeyError(f"no {kind} named {name!r} in this plan{known()}") from None


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
    # ((table name, strategy), ...) when a `MeshEmbedding` chose them (layout.planner)
    strategies: tuple = ()
    # the cost model's `Plan` of those strategies (predicted bytes and step time)
    predicted: Any = dataclasses.field(default=None, compare=False, repr=False)
    # the batch the strategies were planned for, in words (the facade's)
    planned_batch: str = dataclasses.field(default="", compare=False)
    # bytes of tables + slots each device holds, measured from the built arrays' shards
    # (None: a device of another process); () before a `MeshEmbedding` builds
    measured_bytes_per_device: tuple = dataclasses.field(default=(), compare=False)
    # the bytes a device needs for a step of the planned batch, by term
    # (`embedmesh.layout.step_memory.StepMemory`); None where not planned for a batch
    step_memory: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.row_layout is None:
            object.__setattr__(self, "row_layout", row_layout("mod", self.num_shards))

    def __str__(self) -> str:
        return self.describe()

    @functools.cached_property
    def bytes_per_device(self) -> tuple:
        """Bytes of tables + optimizer slots each device holds: every stack's block
        (`rows_per_shard` rows of its width) on every device, since a stacked array is
        evenly sharded; what the built arrays' shards measure."""
        per_device = sum((s.rows_per_shard * self.row_bytes(s.name) for s in self.stacks), start=0)
        return (int(per_device),) * self.num_shards

    def row_bytes(self, stack: str) -> int:
        """Bytes of one local row of a stack: its parameters and each optimizer slot."""
        s = self.stack(stack)
        if s.slot_columns:
            return s.width * np.dtype(s.dtype).itemsize  # the slots in the table's rows
        opt = s.optimizer
        slots = getattr(opt, "slot_names", ()) or ()
        slot_width = sum(opt.slot_width(k, s.dim) for k in slots)  # a row slot: 1
        return s.dim * np.dtype(s.dtype).itemsize + slot_width * s.slots_dtype.itemsize

    def describe(self) -> str:
        """The plan for a person: each table's strategy, stack, owners, and the memory
        its block takes on a device that holds it (table and optimizer slots, exact);
        the memory of every device (predicted, and measured from the arrays' shards once
        built); and, when the strategies were planned, the batch they were planned for
        and the cost model's bytes a device moves per step for each table and the
        predicted step; the bytes a step of that batch needs besides the state (the
        limit applies to their sum)."""
        strategies = dict(self.strategies)
        costs = dict(self.predicted.choices) if self.predicted is not None else {}
        n = self.num_shards

        def mb(x) -> str:
            return f"{x / 1e6:,.1f}"

        lines = [f"{len(self.tables)} tables in {len(self.stacks)} stacks on {n} devices"]
        if self.predicted is not None:
            p = self.predicted
            lines[0] += (
                f"; cost model ({p.machine}, {p.batch_per_device} samples a device): "
                f"step {p.step_time_s * 1e3:.2f} ms, at most "
                f"{p.max_bytes_per_device / 1e6:.2f} MB sent + received a device a step"
            )
        if self.planned_batch:
            lines.append(f"planned for {self.planned_batch}")
        header = f"{'table':<16} {'strategy':<16} {'stack':<16} {'devices':<9} {'MB/device':>10}"
        if costs:
            header += f" {'MB moved/step':>14}"
        lines.append(header)
        for s in self.stacks:
            row_bytes = self.row_bytes(s.name)
            for name in s.tables:
                t = self.table(name)
                shards = [j for j in range(n) if self.row_layout.copy_of(t, j) is not None]
                where = f"{shards[0]}" if len(shards) == 1 else f"{shards[0]}-{shards[-1]}"
                line = (
                    f"{name:<16} {strategies.get(name, t.sharding):<16} {s.name:<16} "
                    f"{where:<9} {mb(t.rows_per_shard * row_bytes):>10}"
                )
                if name in costs:
                    c = costs[name]
                    line += f" {mb(c.owner.bytes_sent + c.owner.bytes_recv):>14}"
                lines.append(line)
        for s in self.stacks:
            if np.dtype(s.dtype) != np.float32 or s.slots_dtype != np.float32:
                lines.append(
                    f"stack {s.name}: {np.dtype(s.dtype).name} rows, {s.slots_dtype.name} slots"
                )
        in_rows = [s for s in self.stacks if s.slot_columns]
        for s in in_rows:
            cols = ", ".join(f"{k} [{a}, {a + w})" for k, a, w in s.slot_columns)
            lines.append(
                f"stack {s.name}: slots in rows of {s.width} columns "
                f"(parameters [0, {s.dim}), {cols})"
            )
        for s in self.stacks:
            if s.pack > 1:
                lines.append(
                    f"stack {s.name}: rows of {s.width} columns packed {s.pack} to a stored "
                    f"row of {s.width * s.pack}"
                )
        lines.append(
            "memory a device holds (tables + slots, every stack's block, MB): "
            + ", ".join(f"{j}: {mb(x)}" for j, x in enumerate(self.bytes_per_device))
        )
        if self.predicted is not None and self.predicted.memory_limit < float("inf"):
            lines[-1] += f"; limit {mb(self.predicted.memory_limit)}"
        if self.step_memory is not None:
            needs = "a step of the planned batch needs, on the device that needs the most: "
            lines.append(needs + self.step_memory.describe())
        if self.measured_bytes_per_device:
            lines.append(
                "measured from the arrays' shards (MB): "
                + ", ".join(
                    f"{j}: {mb(x)}"
                    for j, x in enumerate(self.measured_bytes_per_device)
                    if x is not None
                )
            )
        return "\n".join(lines)

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
        """stack -> per shard (sorted local row offsets, table placements) of the tables
        with a block on that shard, for reverse look-ups."""
        out = {}
        for s in self.stacks:
            placed = [self._table_by_name[n] for n in s.tables]
            per_shard = []
            for j in range(self.num_shards):
                mine = sorted(
                    (t for t in placed if self.row_layout.holds(t, j)),
                    key=lambda t: t.local_row_offset,
                )
                per_shard.append((np.array([t.local_row_offset for t in mine], np.int64), mine))
            out[s.name] = per_shard
        return out

    def table(self, table: TableKey) -> TablePlacement:
        """The placement of a table given by name, `TableConfig` or placement."""
        if isinstance(table, TablePlacement):
            return table
        if isinstance(table, TableConfig):
            table = self.resolved.table_name(table)
        known = lambda: f" (tables: {sorted(self._table_by_name)})"
        return _named(self._table_by_name, table, "table", known)

    def id_owners(self, table: TableKey) -> tuple:
        """`(first, k)`: the shards `[first, first + k)` owning a table of raw ids' ids, its
        span; id x goes to shard `first + owner_of(x, k, seed)` (`device.id_map.owner_of`;
        every shard for mod and row-wise placements, `(owner, 1)` for table-wise). The one
        rule the host's routing, the device's maps and checkpoint rebuilds share."""
        first, k = self.row_layout.span(self.table(table))
        return int(first), int(k)

    def stack(self, name: str) -> StackSpec:
        known = lambda: f" (stacks: {[s.name for s in self.stacks]})"
        return _named(self._stack_by_name, name, "stack", known)

    def feature(self, name: str) -> FeaturePlacement:
        return _named(self._feature_by_name, name, "feature", lambda: "")

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
        out_shape = local.shape
        shard, local = shard.reshape(-1), local.reshape(-1)
        index = np.full(local.shape, -1, np.int64)
        row = np.full(local.shape, -1, np.int64)
        for j, (offsets, placed) in enumerate(self._stack_local_offsets[s.name]):
            on_j = shard == j
            if not placed or not on_j.any():
                continue
            k = np.searchsorted(offsets, local, side="right") - 1
            for i, t in enumerate(placed):  # per table: the layout's inverse
                block = local - offsets[i]
                sel = np.flatnonzero(on_j & (k == i) & (block < t.rows_per_shard))
                r = self.row_layout.logical_rows(t, shard[sel], block[sel])
                real = sel[r < t.vocabulary_size]
                index[real] = t.index
                row[real] = r[r < t.vocabulary_size]
        return index.reshape(out_shape), row.reshape(out_shape)

    def from_stacked_rows(self, stack: str, rows) -> tuple:
        """Inverse of `stacked_rows`: `(table_index, row)`, -1 for padding rows."""
        rows = np.asarray(rows, np.int64)
        return self.unlocate(stack, rows % self.num_shards, rows // self.num_shards)


def quantization_of(table: TableConfig) -> tuple | None:
    """A table's `QuantizationConfig` as the value `(num_buckets, lower, upper)`."""
    q = table.quantization_config
    return None if q is None else (int(q.num_buckets), float(q.lower), float(q.upper))


def _effective_optimizer(table: TableConfig, default):
    return table.optimizer if table.optimizer is not None else default


def _stack_dim(dim: int, opt, dim_multiple: int) -> tuple[int, Any]:
    """The width of a table's stack and the optimizer its stack runs. A row-wise
    optimizer's mean is over its table's own columns: its stack keeps the table's dim, or
    from `ROW_WISE_PADDED_FROM` is padded like any other with the optimizer told its
    table's dim (`mean_dim`; tables of other dims then stack apart)."""
    padded = _round_up(dim, dim_multiple)
    if not getattr(opt, "row_wise", False):
        return padded, opt
    if dim_multiple < ROW_WISE_PADDED_FROM or padded == dim:
        return dim, opt
    return padded, dataclasses.replace(opt, mean_dim=dim)


ShardingArg = Union[str, Mapping[Any, str]]


def table_shardings(
    sharding: ShardingArg, resolved: ResolvedFeatures, choices: tuple = SHARDINGS
) -> tuple:
    """Each table's placement (one of `SHARDINGS`), in the resolved config's table
    order, from `sharding`: one of `choices` (default `SHARDINGS`; the facade passes
    its strategies) for every table, or a mapping from table names (or `TableConfig`s)
    to one (tables not named: "mod"). Unknown tables or values raise a ValueError
    naming them."""
    names = resolved.table_names
    valid = list(choices)
    if isinstance(sharding, str):
        if sharding not in choices:
            raise ValueError(f"sharding must be one of {valid}, got {sharding!r}")
        return (sharding,) * len(names)
    if not isinstance(sharding, Mapping):
        raise ValueError(
            f"sharding must be one of {valid} or a mapping "
            f"{{table name: one of them}}, got {sharding!r}"
        )
    out = dict.fromkeys(names, "mod")
    for key, value in sharding.items():
        name = resolved.table_name(key) if isinstance(key, TableConfig) else key
        if not isinstance(name, str) or name not in out:
            raise ValueError(
                f"sharding names table {key!r}, which the feature config does not have "
                f"(its tables: {sorted(names)})"
            )
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"sharding of table {name}: must be one of {valid}, got {value!r}")
        out[name] = value
    return tuple(out[n] for n in names)


class _StackKey(NamedTuple):
    """What tables must share to stack (a tuple: compared and hashed as one)."""

    dim: int  # padded dim; with slots in rows, the row width
    optimizer: Any  # the effective optimizer (a row-wise one told its table's dim)
    dtype: np.dtype
    exchange: Any  # `stack_keys`' value for the table (None: not named)
    replicated: bool  # data_parallel: replicas stack only with replicas
    quantization: tuple | None
    slot_dtype: np.dtype
    alone: str | None  # a table of raw ids (`TableConfig.id_map`): its name, alone in its stack
    pack: int = 1  # logical rows a stored row holds (packed narrow rows)


def _check_plan_args(num_shards, dim_multiple, slots_in_rows, max_stack_rows) -> None:
    """ValueError for a `plan_stacking` number out of its range, before any work."""
    if not (
        isinstance(num_shards, (int, np.integer))
        and not isinstance(num_shards, bool)
        and num_shards >= 1
    ):
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if not (isinstance(dim_multiple, (int, np.integer)) and dim_multiple >= 1):
        raise ValueError(f"dim_multiple must be an int >= 1, got {dim_multiple!r}")
    if not (isinstance(slots_in_rows, (int, np.integer)) and slots_in_rows >= 0):
        raise ValueError(f"slots_in_rows must be an int >= 0, got {slots_in_rows!r}")
    if max_stack_rows is not None and not (
        isinstance(max_stack_rows, (int, np.integer)) and max_stack_rows >= 1
    ):
        raise ValueError(f"max_stack_rows must be None or an int >= 1, got {max_stack_rows!r}")


def _stack_key(
    t: TableConfig,
    name: str,
    strategy: str,
    *,
    default_optimizer: Any,
    dim_multiple: int,
    dtype: Any,
    exchange: Any,
    slots_in_rows: int,
    pack_lanes: int = 0,
) -> _StackKey:
    """Table `t`'s stacking key. With slots in rows its width is the row's (parameters and
    slots, padded to `slots_in_rows`), so that tables whose rows are as wide stack; a
    packed narrow row's is its own (`_packed_width`)."""
    dtype = np.dtype(dtype)
    slot_dtype = np.dtype(t.storage_slot_dtype)
    packed = _packed_width(
        t,
        strategy,
        _effective_optimizer(t, default_optimizer),
        dtype,
        slot_dtype,
        slots_in_rows,
        pack_lanes,
    )
    if packed is not None:
        width, opt = packed
        return _StackKey(
            width,
            opt,
            dtype,
            exchange,
            False,
            quantization_of(t),
            slot_dtype,
            None,
            pack_lanes // width,
        )
    dim, opt = _stack_dim(t.dim, _effective_optimizer(t, default_optimizer), dim_multiple)
    if slots_in_rows and getattr(opt, "slot_names", ()) and slot_dtype == dtype:
        if getattr(opt, "row_wise", False) and opt.mean_dim is None:  # a mean a dim
            opt = dataclasses.replace(opt, mean_dim=t.dim)
        dim = _row_width(opt, _round_up(t.dim, DEFAULT_DIM_MULTIPLE), slots_in_rows)
    return _StackKey(
        dim,
        opt,
        dtype,
        exchange,
        strategy == "data_parallel",
        quantization_of(t),
        slot_dtype,
        name if getattr(t, "id_map", None) is not None else None,
    )


def _packed_width(t, strategy, opt, dtype, slot_dtype, slots_in_rows, pack_lanes):
    """`(row width, optimizer)` of table `t` where its rows are packed (`pack_lanes`), else
    None. A row of its parameters (its dim rounded to `DEFAULT_DIM_MULTIPLE`) and the slots
    kept in it, rounded up to a power of two, packs where at least two fit in `pack_lanes`:
    then `pack_lanes // width` rows share a stored row and the table holds its own bytes.
    Packed are float32 tables of the mod placement whose optimizer updates only the rows it
    touches, with their slots in their rows (where they have slots); the others keep
    whole rows (their own width padded as before)."""
    if not pack_lanes or strategy != "mod" or dtype != np.float32:
        return None
    if getattr(t, "id_map", None) is not None or getattr(opt, "touches_all_rows", False):
        return None
    cols = _round_up(t.dim, DEFAULT_DIM_MULTIPLE)
    if getattr(opt, "slot_names", ()):
        if not slots_in_rows or slot_dtype != dtype:
            return None
        if getattr(opt, "row_wise", False) and opt.mean_dim is None:  # a mean a dim
            opt = dataclasses.replace(opt, mean_dim=t.dim)
        last = _slot_columns(opt, cols)[-1]
        cols = last[1] + last[2]
    width = DEFAULT_DIM_MULTIPLE
    while width < cols:
        width *= 2
    return (width, opt) if 2 * width <= pack_lanes else None


def _group(keys: list, stack_tables: bool) -> list:
    """`[(key, [table index, ...])]`: the tables of equal keys together, in order of first
    use (every table on its own where not `stack_tables`)."""
    groups: list[tuple[Any, list[int]]] = []
    for i, key in enumerate(keys):
        for gkey, members in groups:
            if stack_tables and gkey == key:
                members.append(i)
                break
        else:
            groups.append((key, [i]))
    return groups


def _split_by_rows(groups: list, padded: list, limit: int | None) -> list:
    """Each group cut, in table order, before a table that would take its padded rows
    (`padded[i]`) over `limit` (`max_stack_rows`; None: no limit)."""
    out: list[tuple[Any, list[int]]] = []
    for key, members in groups:
        current: list[int] = []
        rows = 0
        for i in members:
            if current and limit is not None and rows + padded[i] > limit:
                out.append((key, current))
                current, rows = [], 0
            current.append(i)
            rows += padded[i]
        out.append((key, current))
    return out


def _rotations(layout: RowLayout, vocabs: list, strategies: tuple) -> dict:
    """`{table index: rotation}`: the layout's, over the mod tables in table order (module
    docstring); 0 for the others."""
    mod_tables = [i for i, st in enumerate(strategies) if st == "mod"]
    rotation = dict.fromkeys(range(len(vocabs)), 0)
    rotation.update(zip(mod_tables, layout.rotations([vocabs[i] for i in mod_tables])))
    return rotation


def _row_order(members: list, strategies: tuple, vocabs: list, spans: list) -> list:
    """A stack's tables in row order: the mod tables (config order), the spread table-wise
    ones (`spread_order`), then the others (config order), each after the rows its
    shards already use."""
    spread = spread_order([i for i in members if strategies[i] == "table_wise"], vocabs, spans)
    rest = [i for i in members if strategies[i] != "mod" and i not in spread]
    return [i for i in members if strategies[i] == "mod"] + spread + rest


# `_spread_table_wise` tries each table-wise table at a few spans a round: past this many
# table-wise tables it keeps every one whole
_SPREAD_MAX_TABLES = 32
# and it takes at most this many spreads a table-wise table (each widens a span), trying
# at most `_SPREAD_BUDGET` in all (the plan stops spreading there, every spread it took
# having saved bytes)
_SPREAD_ROUNDS = 4
_SPREAD_BUDGET = 600
# A table-wise plan spreads tables while a device holds more than this times the bytes its
# fullest owner's tables take at their own widths
TABLE_WISE_MAX_OVERHEAD = 1.25


def _owner_bytes(strategies: tuple, vocabs: list, n: int, spans: list, owners: dict, own: list):
    """The most bytes any shard's own rows take (`own[i]`: a row of table i at its own
    width, parameters and slots): a mod table's share on every shard, a replica whole on
    every shard, a table-wise table's rows on each shard of its span."""
    held = [0] * n
    for i, st in enumerate(strategies):
        k = spans[i]
        first = 0 if st != "table_wise" else owners[i]
        rows = vocabs[i] if st == "data_parallel" else -(-vocabs[i] // k)
        for j in range(n) if st == "data_parallel" else range(first, first + k):
            held[j] += rows * own[i]
    return max(held)


def _spread_table_wise(
    stacks_idx: list, strategies: tuple, vocabs: list, n: int, row_bytes: list, own: list, keys
) -> tuple:
    """`(spans, bytes a device, the fullest owner's own bytes)`; `spans`: each table's span:
    N for the mod tables, 1 for the others, except the table-wise
    tables spread over several consecutive shards (rows mod the span, as a mod table over
    part of the mesh) while a device holds more than `TABLE_WISE_MAX_OVERHEAD` times its
    fullest owner's own bytes (`_owner_bytes`) and a spread saves bytes a device. A stack
    holds its fullest shard's rows at its width on every device, so a table that is short
    and wide, or on an owner fuller than the others, costs every device its rows; spread,
    it shares them with the shards beside it. Each round takes, of the spreads that
    bring a device within the bound, the one that moves the fewest rows off their owner;
    where none does, the one that saves the most bytes a device per shard added to a span
    (ties: the first candidate, `candidates`); tables of raw ids keep their owner. Every
    shard added to a table's span also pools that table's features (the same exchange,
    several owners a table)."""
    spans = [n if st == "mod" else 1 for st in strategies]
    movable = [i for i, st in enumerate(strategies) if st == "table_wise" and keys[i].alone is None]
    if n == 1 or not movable or len(movable) > _SPREAD_MAX_TABLES:
        return spans, None, None

    def cost(spans: list) -> tuple:
        owners = owners_of(stacks_idx, vocabs, strategies, n, spans)
        padded = [-(-v // k) * k for v, k in zip(vocabs, spans)]
        where = _Where(n, spans, padded, owners, {})
        held, tops = 0, []
        for s, (key, members) in enumerate(stacks_idx):
            order = _row_order(members, strategies, vocabs, spans)
            offsets, rows = _block_offsets(order, where, key.replicated)
            held += row_bytes[s] * rows
            # the stack's tables whose blocks reach its fullest shards' last row
            tops.append([i for i in order if offsets[i] + padded[i] // spans[i] == rows])
        return held, _owner_bytes(strategies, vocabs, n, spans, owners, own), tops

    def candidates(spans: list, tops: list):
        """The tables at the top of their stack (only they set its rows): each spread one
        shard further, twice as far or over every shard, and those of a stack all spread
        over at least 2, 4, ... or N shards (where several owners are as full, spreading
        one alone saves nothing)."""
        widths = sorted({min(2**b, n) for b in range(1, n.bit_length() + 1)})
        for top in tops:
            mine = [i for i in top if i in movable]
            for i in mine:
                for k in sorted({spans[i] + 1, 2 * spans[i], n}):
                    if spans[i] < k <= n:
                        yield spans[:i] + [k] + spans[i + 1 :]
            for k in widths if len(mine) > 1 else ():
                trial = [max(k, s) if i in mine else s for i, s in enumerate(spans)]
                if trial != spans:
                    yield trial

    now, owner, tops = cost(spans)
    budget = _SPREAD_BUDGET  # spreads tried: a bound on the time a plan takes
    for _ in range(_SPREAD_ROUNDS * len(movable)):
        if now <= TABLE_WISE_MAX_OVERHEAD * owner or budget <= 0:
            break
        best = None
        for trial in itertools.islice(candidates(spans, tops), budget):
            budget -= 1
            c = cost(trial)
            if c[0] >= now:
                continue
            if c[0] <= TABLE_WISE_MAX_OVERHEAD * c[1]:  # enough: the fewest rows moved
                rank: tuple = (0, sum(vocabs[i] - vocabs[i] // trial[i] for i in movable))
            else:  # the most bytes saved a shard added
                rank = (1, -(now - c[0]) / (sum(trial) - sum(spans)))
            if best is None or rank < best[0]:
                best = (rank, trial, c)
        if best is None:
            break
        _, spans, (now, owner, tops) = best
    return spans, now, owner


def _spread_grouping(groupings, resolved, keys, strategies, n: int, slots_in_rows: int) -> tuple:
    """`(stacks, spans)`: of the groupings of the tables into stacks (the merged one, that
    costs the fewest bytes a device with every table whole, then the one by key alone),
    with their table-wise tables spread (`_spread_table_wise`), the one that holds a device
    within `TABLE_WISE_MAX_OVERHEAD` of its fullest owner's own bytes moving the fewest
    rows off their owners; where none does, the one that costs the fewest bytes a device
    (ties: the first). Its stacks in order of their first table."""
    vocabs = [t.vocabulary_size for t in resolved.tables]
    own = [_key_row_bytes(k, [t], slots_in_rows) for k, t in zip(keys, resolved.tables)]
    best = None
    for groups in groupings:
        groups = sorted(groups, key=lambda s: s[1][0])
        row_bytes = [
            _key_row_bytes(key, [resolved.tables[i] for i in members], slots_in_rows)
            for key, members in groups
        ]
        spans, held, owner = _spread_table_wise(groups, strategies, vocabs, n, row_bytes, own, keys)
        if held is None:  # nothing to spread: the first grouping as it is
            return groups, spans
        moved = sum(v - v // k for v, k, st in zip(vocabs, spans, strategies) if st != "mod")
        rank = (0, moved) if held <= TABLE_WISE_MAX_OVERHEAD * owner else (1, held)
        if best is None or rank < best[0]:
            best = (rank, groups, spans)
    return best[1], best[2]


def _stack_name(members: list, table_names: tuple, used: set) -> str:
    """A stack's name: its table's, or its tables' joined by "+" (a ValueError where that
    is already the name of a table or another stack)."""
    names = [table_names[i] for i in members]
    name = names[0] if len(members) == 1 else "+".join(names)
    if len(members) > 1 and name in used:
        raise ValueError(f"stack name {name!r} collides with a table or stack name")
    return name


class _Where(NamedTuple):
    """Where each table goes, by table index (what `_place_stack` reads)."""

    n: int  # shards
    spans: list  # the shards of its span (N, or 1: table-wise, data_parallel)
    padded: list  # the rows of its blocks
    owners: dict  # a table-wise table's owner shard
    rotation: dict  # its rotation


def _block_offsets(members: list, where: _Where, replicated: bool) -> tuple:
    """`({table index: local row offset}, rows per shard)` of a stack whose tables are
    `members` in row order: each table's block after the rows its shards already use (a
    replicated one: the same local rows on every shard)."""
    n, spans, padded = where.n, where.spans, where.padded
    used = [0] * n  # local rows used on each shard
    offsets = {}
    for i in members:
        first = where.owners.get(i, 0)
        reserved = slice(0, n) if replicated else slice(first, first + spans[i])
        offsets[i] = max(used[reserved])
        used[reserved] = [offsets[i] + padded[i] // spans[i]] * len(used[reserved])
    return offsets, max(used)


def _stack_columns(key: _StackKey, tables: list, slots_in_rows: int) -> tuple:
    """`(dim, slot columns, row width)` of a stack: with its slots in its rows (the key's dim
    is then the row width), its widest table's dim rounded to `DEFAULT_DIM_MULTIPLE` and
    where each slot sits; else the key's dim, (), 0."""
    if slots_in_rows and getattr(key.optimizer, "slot_names", ()) and key.slot_dtype == key.dtype:
        dim = _round_up(max(t.dim for t in tables), DEFAULT_DIM_MULTIPLE)
        return dim, _slot_columns(key.optimizer, dim), key.dim
    return key.dim, (), 0


def _key_row_bytes(key: _StackKey, tables: list, slots_in_rows: int) -> int:
    """Bytes of one local row of a stack of `tables` under `key` (its parameters and each
    optimizer slot): `StackingPlan.row_bytes` before the stack is placed."""
    dim, slot_columns, row_width = _stack_columns(key, tables, slots_in_rows)
    itemsize = np.dtype(key.dtype).itemsize
    if slot_columns:
        return row_width * itemsize
    opt = key.optimizer
    slots = getattr(opt, "slot_names", ()) or ()
    slot_width = sum(opt.slot_width(k, dim) for k in slots)
    return dim * itemsize + slot_width * np.dtype(key.slot_dtype).itemsize


def _place_stack(
    key: _StackKey,
    members: list,
    name: str,
    resolved: ResolvedFeatures,
    where: _Where,
    slots_in_rows: int,
) -> tuple:
    """`(StackSpec, [TablePlacement of each member])` of one stack, its tables `members`
    (indices) in row order; a ValueError where its rows a shard do not fit int32."""
    tables = [resolved.tables[i] for i in members]
    dim, slot_columns, row_width = _stack_columns(key, tables, slots_in_rows)
    n = where.n
    offsets, rows_per_shard = _block_offsets(members, where, key.replicated)
    rows_per_shard = _round_up(rows_per_shard, key.pack)  # whole stored rows
    if rows_per_shard > _INT32_MAX:
        raise ValueError(
            f"stack {name}: {rows_per_shard} rows per shard do not fit int32; "
            f"use more shards or a smaller max_stack_rows"
        )
    placements = [
        TablePlacement(
            name=resolved.table_names[i],
            index=i,
            stack=name,
            num_shards=n,
            vocabulary_size=t.vocabulary_size,
            padded_vocabulary_size=where.padded[i],
            dim=t.dim,
            padded_dim=dim,
            row_offset=offsets[i] * n,
            rotation=where.rotation[i],
            first_shard=where.owners.get(i, 0),
            span=where.spans[i],
            replicated=key.replicated,
        )
        for i, t in zip(members, tables)
    ]
    spec = StackSpec(
        name=name,
        tables=tuple(resolved.table_names[i] for i in members),
        features=tuple(
            fname
            for fname, f in zip(resolved.feature_names, resolved.features)
            if any(f.table is t for t in tables)
        ),
        dim=dim,
        optimizer=key.optimizer,
        dtype=key.dtype,
        num_shards=n,
        num_rows=rows_per_shard * n,
        replicated=key.replicated,
        quantization=key.quantization,
        slot_columns=slot_columns,
        row_width=row_width,
        slot_dtype=None if key.slot_dtype == np.float32 else key.slot_dtype,
        pack=key.pack,
    )
    return spec, placements


def _feature_placements(resolved: ResolvedFeatures, stack_of: list) -> tuple:
    """Each feature's `FeaturePlacement`, in config order (`stack_of[i]`: table i's stack)."""
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
                stack=stack_of[ti],
                rows_per_sample=f.max_sequence_length if seq else 1,
                dim=f.table.dim,
                combiner=None if seq else f.table.combiner,
            )
        )
    return tuple(features)


def plan_stacking(
    feature_config: Any,
    num_shards: int,
    *,
    stack_tables: bool = True,
    max_stack_rows: int | None = None,
    dim_multiple: int = DEFAULT_DIM_MULTIPLE,
    default_optimizer: Any = None,
    table_dtypes: Mapping[str, Any] | None = None,
    sharding: ShardingArg = "mod",
    stack_keys: Mapping[str, Any] | None = None,
    slots_in_rows: int = 0,
    pack_lanes: int = 0,
) -> StackingPlan:
    """Group the tables of `feature_config` into stacks for `num_shards` shards.

    Args:
      feature_config: a nested structure of `FeatureConfig` (or the
        `ResolvedFeatures` of one).
      num_shards: N, the number of shards (devices) each stack is split over.
      stack_tables: False gives one stack per table.
      max_stack_rows: a stack stops growing before its padded rows would
        exceed this (a table larger than it gets a stack of its own; a
        table-wise table counts its own rows, V).
      dim_multiple: dims are padded to a multiple of this (1: no padding).
      default_optimizer: the optimizer of tables whose `optimizer` is None
        (the engine's default); stacking compares effective optimizers by
        equality.
      table_dtypes: optional `{table name: dtype}` overriding the tables'
        `TableConfig.dtype`; only tables of one dtype (and one slot dtype) stack.
      sharding: each table's placement (module docstring): "mod" (default),
        "table_wise" or "data_parallel" for every table, or `{table name: one of
        them}` (tables not named: "mod").
      stack_keys: optional `{table name: hashable}`: tables with different
        keys never share a stack (the facade keeps one exchange form a stack).
      slots_in_rows: 0 (default) keeps each optimizer slot an array of its own; a
        multiple of columns (a TPU's 128, `slots_in_rows_for`) keeps the slots of every
        stack whose optimizer has some in the table's rows, each row padded to it,
        except where the slots' dtype differs from the table's (`TableConfig.slot_dtype`:
        a bfloat16 table's float32 slots stay arrays of their own).
      pack_lanes: 0 (default) stores a row a row; a number of lanes (a TPU's 128,
        `pack_lanes_for`) stores narrow rows several to a row of that many lanes
        (`StackSpec.pack`): float32 tables of the mod placement whose rows, slots
        included, take at most half of it.

    Tables stack when (padded dim, optimizer, dtype, slot dtype) match, in order of first
    use; then table-wise tables join wider stacks (their dims padded) where that costs
    fewer bytes a device (module docstring). A
    single-table stack is named after its table; a multi-table stack joins its
    tables' names with "+"."""
    resolved = (
        feature_config
        if isinstance(feature_config, ResolvedFeatures)
        else resolve_feature_config(feature_config)
    )
    _check_plan_args(num_shards, dim_multiple, slots_in_rows, max_stack_rows)
    n = int(num_shards)
    layout = row_layout("mod", n)
    strategies = table_shardings(sharding, resolved)
    if n == 1:  # one shard: table-wise is the mod layout
        strategies = ("mod",) * len(strategies)
    spans = [n if st == "mod" else 1 for st in strategies]
    dtypes = dict(table_dtypes or {})
    unknown = set(dtypes) - set(resolved.table_names)
    if unknown:
        raise ValueError(f"table_dtypes names unknown tables {sorted(unknown)}")

    keys = [
        _stack_key(
            t,
            name,
            strategy,
            default_optimizer=default_optimizer,
            dim_multiple=dim_multiple,
            dtype=dtypes.get(name, t.dtype),
            exchange=(stack_keys or {}).get(name),
            slots_in_rows=slots_in_rows,
            pack_lanes=pack_lanes,
        )
        for t, name, strategy in zip(resolved.tables, resolved.table_names, strategies)
    ]
    # the rows of each table's blocks
    padded = [layout.block_rows(t.vocabulary_size, s) * s for t, s in zip(resolved.tables, spans)]
    grouped = _split_by_rows(_group(keys, stack_tables), padded, max_stack_rows)
    groupings = [grouped]
    if stack_tables and n > 1:
        merged = merge_table_wise(grouped, strategies, padded, n, max_stack_rows, keys)
        groupings = [merged] + ([grouped] if merged != grouped else [])
    vocabs = [t.vocabulary_size for t in resolved.tables]
    stacks_idx, spans = _spread_grouping(groupings, resolved, keys, strategies, n, slots_in_rows)
    padded = [layout.block_rows(t.vocabulary_size, s) * s for t, s in zip(resolved.tables, spans)]
    owners = owners_of(stacks_idx, vocabs, strategies, n, spans)
    where = _Where(n, spans, padded, owners, _rotations(layout, vocabs, strategies))
    table_placements: dict[int, TablePlacement] = {}
    stack_specs = []
    used_names = set(resolved.table_names)
    for key, members in stacks_idx:
        # row order: the mod tables one after another, then the spread table-wise tables,
        # then each other table after the earlier ones of its owner
        named = [i for i in members if strategies[i] == "mod"]
        named += [i for i in members if strategies[i] != "mod"]
        name = _stack_name(named, resolved.table_names, used_names)
        members = _row_order(members, strategies, vocabs, spans)
        used_names.add(name)
        spec, placed = _place_stack(key, members, name, resolved, where, slots_in_rows)
        stack_specs.append(spec)
        table_placements.update(zip(members, placed))
    tables = tuple(table_placements[i] for i in range(len(resolved.tables)))
    return StackingPlan(
        num_shards=n,
        stacks=tuple(stack_specs),
        tables=tables,
        features=_feature_placements(resolved, [t.stack for t in tables]),
        resolved=resolved,
        row_layout=layout,
    )
