"""The row-layout rule: which shard holds a table's row, and where on that shard.

Every caller that needs to know where a row lives goes through a `RowLayout`
(the stacking plan holds one: `plan.row_layout`): host preprocessing (its
kernels receive `kernel_params`), table read-back and shard views, checkpoint
re-cutting and checksums. The interface also has room for column-wise splits
(`columns_on_shard`: which columns of its rows a shard holds).

The mod rule over a table's *span*: a table lives on `k` consecutive shards
`[first, first + k)` of the N (its placement's `first_shard` and `span`); table
row `i` lives on shard `first + (i % k + rotation) % k` at row `i // k` of the
table's block on that shard (the block starts at the table's
`local_row_offset` in the stack). Shards outside the span hold no block of the
table. `rotation` (from the stacking plan) spreads the partial last round of
small tables over different shards. Two placements are this one rule:

- `sharding="mod"` (TPUEmbeddingV2's): every shard, `first = 0, k = N`: row `i`
  on shard `(i % N + rotation) % N`, block row `i // N`;
- `sharding="table_wise"`: one shard, the table's owner: `first = owner, k = 1,
  rotation = 0`: the whole table, row `i` at block row `i`.

(`k` in between, a table over part of the mesh, is the same rule.)

A replicated table (`sharding="data_parallel"`, the placement's `replicated`) is
the table-wise rule on shard 0, its canonical copy, as far as every mapping
here goes: a row "lives" on shard 0, which is where preprocessing sends its ids
(the device program reads them from its own replica) and what checkpoints
store. What each shard physically holds is `copy_of(table, shard)`: the shard
whose block it holds a copy of (0 on every shard for a replica; itself, or None,
for the other placements). Building, restoring and showing shards go by it.

The rule in one place: `ModRowLayout` states it once as array arithmetic
(`logical_rows_from_params`, which numpy and traced jax arrays both run: the
checkpoint checksum program takes `kernel_params` as arguments) and once as
its inverse (`shard_of`, `block_row`); everything else (`rows_on_shard`,
`rows_index`, `count_on_shard`, `period`) follows from `first_row`.
`logical_layout()` is the logical `[vocabulary_size, ...]` table seen as a
layout (one shard, every row at its own index), so converting between the
logical table and any layout is one case of converting between two layouts.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

__all__ = ["ROW_LAYOUTS", "ModRowLayout", "RowLayout", "logical_layout", "row_layout"]


class RowLayout(abc.ABC):
    """Where the rows of a placed table (`TablePlacement`) live on `num_shards` shards."""

    name: str
    num_shards: int

    @abc.abstractmethod
    def shard_of(self, table, rows) -> np.ndarray:
        """The shard holding each of the table's logical rows `rows` (int64)."""

    @abc.abstractmethod
    def block_row(self, table, rows) -> np.ndarray:
        """Each row's position in the table's block on its shard (int64); the
        stack's local row is `table.local_row_offset + block_row`."""

    @abc.abstractmethod
    def rows_on_shard(self, table, shard: int) -> np.ndarray:
        """The table's logical rows on `shard`, in block order (no padding rows)."""

    @abc.abstractmethod
    def logical_rows_from_params(self, params, shard, block_rows):
        """The logical rows at `block_rows` of a table's block on `shard`, the table
        given by its `kernel_params`: plain array arithmetic, so numpy arrays and
        traced jax arrays (inside a compiled program) both go through it. Rows past
        the table's vocabulary size are padding (every row of a shard that holds no
        block of the table is)."""

    def logical_rows(self, table, shard, block_rows) -> np.ndarray:
        """Inverse of (`shard_of`, `block_row`): the logical rows (int64) at `block_rows`
        of the table's block on `shard` (>= vocabulary size for padding rows)."""
        return self.logical_rows_from_params(
            tuple(np.int64(p) for p in self.kernel_params(table)),
            np.asarray(shard, np.int64),
            np.asarray(block_rows, np.int64),
        )

    def period(self, table) -> tuple:
        """`(rows, block_rows)`: logical row `i + rows` is on the same shard as row `i`,
        `block_rows` further in the block. Checkpoint re-cutting turns it into strided
        copies. The default, the whole table (no row comes back, so every row is a
        phase of its own; `block_rows` is then never used), holds for any layout."""
        return (max(int(table.vocabulary_size), 1), 1)

    @abc.abstractmethod
    def block_rows(self, vocabulary_size: int) -> int:
        """The rows of a table's block on every shard (its rows there and padding): the
        table's `rows_per_shard` in a stack."""

    def rotations(self, vocabulary_sizes) -> list:
        """Each table's `rotation` (a parameter of the rule), for the tables of a plan in
        order; 0 for layouts that have none."""
        return [0] * len(vocabulary_sizes)

    def span(self, table) -> tuple:
        """`(first, k)`: the table has a block on shards `[first, first + k)` only (the
        others hold none of its rows, nor padding of it). Default: every shard."""
        return (0, self.num_shards)

    def holds(self, table, shard: int) -> bool:
        """Whether `shard` holds a block of the table (is in its span)."""
        first, k = self.span(table)
        return first <= int(shard) < first + k

    def count_on_shard(self, table, shard: int) -> int:
        """How many of the table's rows `shard` holds (the rest of its block is padding)."""
        return int(self.rows_on_shard(table, shard).size)

    def rows_index(self, table, shard: int):
        """`rows_on_shard` as an index into the logical table: a slice where the
        rule allows one (a view, no gather), else the int64 rows."""
        return self.rows_on_shard(table, shard)

    def copy_of(self, table, shard: int) -> int | None:
        """The shard whose block of the table `shard` holds a copy of: `shard` itself
        where it holds a block, the canonical shard (the span's first) on every shard
        for a replicated table, None where it holds none of the table."""
        if getattr(table, "replicated", False):
            return self.span(table)[0]
        return int(shard) if self.holds(table, shard) else None

    def shards_of(self, table) -> tuple:
        """The shards holding any row of the table."""
        return tuple(j for j in range(self.num_shards) if self.count_on_shard(table, j))

    def columns_on_shard(self, table, shard: int) -> tuple:
        """`(first, end)` columns of the table's rows that `shard` holds."""
        return (0, table.dim)

    @abc.abstractmethod
    def kernel_params(self, table) -> tuple:
        """The ints a compiled kernel needs to apply this rule to the table."""


@dataclasses.dataclass(frozen=True)
class ModRowLayout(RowLayout):
    """The mod rule over the table's span `[first, first + k)`: row `i` on shard
    `first + (i % k + rotation) % k`, block row `i // k` (see the module docstring;
    `sharding="mod"`: `first = 0, k = N`; `"table_wise"`: `k = 1`)."""

    num_shards: int
    name: str = "mod"

    def span(self, table) -> tuple:
        """The placement's `(first_shard, span)`. A placement made for another number of
        shards (e.g. any table seen through `logical_layout()`, one shard) is read as
        spanning all of this layout's shards."""
        n = self.num_shards
        if int(getattr(table, "num_shards", n)) != n:
            return (0, n)
        k = getattr(table, "span", None)
        return (int(getattr(table, "first_shard", 0)), n if k is None else int(k))

    def shard_of(self, table, rows) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        first, k = self.span(table)
        return first + (rows % k + table.rotation) % k

    def block_row(self, table, rows) -> np.ndarray:
        return np.asarray(rows, np.int64) // self.span(table)[1]

    def block_rows(self, vocabulary_size: int, span: int | None = None) -> int:
        """`ceil(V / k)` (`k = span`, default N)."""
        k = self.num_shards if span is None else int(span)
        return -(-int(vocabulary_size) // k)

    def rotations(self, vocabulary_sizes) -> list:
        """A cursor over the shards: each table starts where the previous one's last,
        partial round of rows ended (and at least one shard further), so that small
        tables land on different shards, and row 0 of consecutive big tables does too."""
        out, cursor, n = [], 0, self.num_shards
        for v in vocabulary_sizes:
            out.append(cursor)
            cursor = (cursor + max(int(v) % n, 1)) % n
        return out

    def first_row(self, table, shard: int) -> int:
        """The table's first logical row on `shard` (the others follow every `k` rows):
        the row at block row 0 (>= vocabulary size: none, or `shard` outside the span)."""
        return int(self.logical_rows_from_params(self.kernel_params(table), int(shard), 0))

    def rows_on_shard(self, table, shard: int) -> np.ndarray:
        return np.arange(
            self.first_row(table, shard),
            table.vocabulary_size,
            self.span(table)[1],
            dtype=np.int64,
        )

    def count_on_shard(self, table, shard: int) -> int:
        return len(range(self.first_row(table, shard), table.vocabulary_size, self.span(table)[1]))

    def rows_index(self, table, shard: int) -> slice:
        v = table.vocabulary_size
        return slice(min(self.first_row(table, shard), v), v, self.span(table)[1])

    def logical_rows_from_params(self, params, shard, block_rows):
        """`block_rows * k + (shard - first - rotation) % k` with `params = (k, rotation,
        first, V)`, plus `V` (padding) on shards outside `[first, first + k)`."""
        k, rotation, first, vocab = params[0], params[1], params[2], params[3]
        local = shard - first
        outside = (local < 0) | (local >= k)
        return block_rows * k + (local - rotation) % k + outside * vocab

    def period(self, table) -> tuple:
        """`(k, 1)`: row `i + k` follows row `i` on its shard."""
        return (self.span(table)[1], 1)

    def kernel_params(self, table) -> tuple:
        """`(k, rotation, first, vocabulary_size)`: the span's size, the rotation, the
        span's first shard, and what marks rows outside the span as padding."""
        first, k = self.span(table)
        return (k, int(table.rotation), first, int(table.vocabulary_size))


ROW_LAYOUTS = {"mod": ModRowLayout}


def logical_layout() -> RowLayout:
    """The logical table as a layout: one shard holding row `i` at block row `i` (the
    mod layout on one shard, whatever the table's rotation and span)."""
    return ModRowLayout(1)


def row_layout(sharding: str, num_shards: int) -> RowLayout:
    """The `RowLayout` named `sharding` (today only "mod": the mod rule over each table's
    span, which `sharding="mod"` and `"table_wise"` placements both use) over
    `num_shards` shards."""
    try:
        cls = ROW_LAYOUTS[sharding]
    except (KeyError, TypeError):
        raise ValueError(
            f"sharding must be one of {sorted(ROW_LAYOUTS)}, got {sharding!r}"
        ) from None
    return cls(int(num_shards))
