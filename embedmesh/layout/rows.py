"""The row-layout rule: which shard holds a table's row, and where on that shard.

Every caller that needs to know where a row lives goes through a `RowLayout`
(the stacking plan holds one: `plan.row_layout`): host preprocessing (its
kernels receive `kernel_params`), table read-back and shard views, checkpoint
re-cutting and checksums. Only the mod layout exists today
(`sharding="mod"`); the interface also has room for table-wise placement
(`shards_of`: the shards holding any row of a table) and column-wise splits
(`columns_on_shard`: which columns of its rows a shard holds).

Mod layout over N shards: table row `i` lives on shard `(i % N + rotation) % N`
at row `i // N` of the table's block on that shard (the block starts at the
table's `local_row_offset` in the stack). `rotation` (from the stacking plan)
spreads the partial last round of small tables over different shards.

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
        the table's vocabulary size are padding."""

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

    def count_on_shard(self, table, shard: int) -> int:
        """How many of the table's rows `shard` holds (the rest of its block is padding)."""
        return int(self.rows_on_shard(table, shard).size)

    def rows_index(self, table, shard: int):
        """`rows_on_shard` as an index into the logical table: a slice where the
        rule allows one (a view, no gather), else the int64 rows."""
        return self.rows_on_shard(table, shard)

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
    """Row `i` on shard `(i % N + rotation) % N`, block row `i // N`."""

    num_shards: int
    name: str = "mod"

    def shard_of(self, table, rows) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        n = self.num_shards
        return (rows % n + table.rotation) % n

    def block_row(self, table, rows) -> np.ndarray:
        return np.asarray(rows, np.int64) // self.num_shards

    def block_rows(self, vocabulary_size: int) -> int:
        """`ceil(V / N)`."""
        return -(-int(vocabulary_size) // self.num_shards)

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
        """The table's first logical row on `shard` (the others follow every N rows):
        the row at block row 0."""
        return int(self.logical_rows_from_params(self.kernel_params(table), int(shard), 0))

    def rows_on_shard(self, table, shard: int) -> np.ndarray:
        return np.arange(
            self.first_row(table, shard), table.vocabulary_size, self.num_shards, dtype=np.int64
        )

    def count_on_shard(self, table, shard: int) -> int:
        return len(range(self.first_row(table, shard), table.vocabulary_size, self.num_shards))

    def rows_index(self, table, shard: int) -> slice:
        return slice(self.first_row(table, shard), table.vocabulary_size, self.num_shards)

    def logical_rows_from_params(self, params, shard, block_rows):
        """`block_rows * N + (shard - rotation) % N` with `params = (N, rotation)`."""
        n, rotation = params[0], params[1]
        return block_rows * n + (shard - rotation) % n

    def period(self, table) -> tuple:
        """`(N, 1)`: row `i + N` follows row `i` on its shard."""
        return (self.num_shards, 1)

    def kernel_params(self, table) -> tuple:
        """`(num_shards, rotation)`."""
        return (self.num_shards, table.rotation)


ROW_LAYOUTS = {"mod": ModRowLayout}


def logical_layout() -> RowLayout:
    """The logical table as a layout: one shard holding row `i` at block row `i` (the
    mod layout on one shard, whatever the table's rotation)."""
    return ModRowLayout(1)


def row_layout(sharding: str, num_shards: int) -> RowLayout:
    """The `RowLayout` named `sharding` (today only "mod") over `num_shards` shards."""
    try:
        cls = ROW_LAYOUTS[sharding]
    except (KeyError, TypeError):
        raise ValueError(
            f"sharding must be one of {sorted(ROW_LAYOUTS)}, got {sharding!r}"
        ) from None
    return cls(int(num_shards))
