"""Move arrays between the logical and the sharded layouts (`plan.row_layout`).

With a `StackingPlan` for N shards, the rows of one table on one shard are
`table[plan.row_layout.rows_index(table, shard)]` (see `embedmesh.layout.rows`),
padded with zero rows to `rows_per_shard`; for the mod layout, the strided
slice `table[(shard - rotation) % N :: N]`: no gather, no full-stack copy. A
shard outside the table's span (a table-wise table's other shards) holds no
block of it: its table-level shard has no rows. A replicated (data_parallel)
table's block on every shard is a copy of its canonical block
(`row_layout.copy_of`): `table_shard` and `stack_shard` build every copy, the
read-back helpers read the canonical one.

Table-level helpers (checkpoints, serving): `table_to_shards`,
`shards_to_table`, `table_shard`, `table_rows_on_shard`.
Stack-level helpers (the engine lays out and reads back one device's shard
of a stack): `stack_shard`, `stack_to_shards`, `shards_to_tables`,
`tables_from_stack_shard`.

Arrays are numpy in and numpy out (anything `np.asarray` accepts goes in);
they may have any trailing shape (`[V, dim]` tables, `[V]` or `[V, dim]`
optimizer slots). Stack-level helpers pad the last axis of 2-D arrays to the
stack's padded dim (zeros) and strip it on the way back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from embedmesh.layout.stacking import StackingPlan, TableKey

__all__ = [
    "shards_to_table",
    "shards_to_tables",
    "stack_shard",
    "stack_to_shards",
    "table_rows_on_shard",
    "table_shard",
    "table_to_shards",
    "tables_from_stack_shard",
]


def _check_shard(plan: StackingPlan, shard: int) -> int:
    if not 0 <= int(shard) < plan.num_shards:
        raise ValueError(f"shard {shard} is outside [0, {plan.num_shards})")
    return int(shard)


def table_rows_on_shard(plan: StackingPlan, table: TableKey, shard: int) -> np.ndarray:
    """Logical rows of `table` held by `shard`, in local-row order (no padding rows)."""
    t = plan.table(table)
    return plan.row_layout.rows_on_shard(t, _check_shard(plan, shard))


def _block_rows(plan: StackingPlan, t, shard: int) -> int:
    """Rows of the table's block on `shard`: `rows_per_shard` in its span, else 0."""
    return t.rows_per_shard if plan.row_layout.holds(t, shard) else 0


def _copied_rows(plan: StackingPlan, t, shard: int):
    """(index into the logical table, block rows) of what `shard` physically holds of
    table `t`: its own rows, a copy of the canonical block (a replica), or nothing."""
    source = plan.row_layout.copy_of(t, shard)
    if source is None:
        return slice(0, 0), 0
    return plan.row_layout.rows_index(t, source), t.rows_per_shard


def table_shard(table_array, plan: StackingPlan, table: TableKey, shard: int) -> np.ndarray:
    """Rows of `table` on `shard`: `[rows_per_shard, ...]`, zero padding rows at the end;
    `[0, ...]` on a shard outside the table's span (it holds no block of the table)."""
    t = plan.table(table)
    arr = np.asarray(table_array)
    if arr.ndim < 1 or arr.shape[0] != t.vocabulary_size:
        raise ValueError(
            f"table {t.name}: expected {t.vocabulary_size} rows, got shape {arr.shape}"
        )
    index, block = _copied_rows(plan, t, _check_shard(plan, shard))
    rows = arr[index]
    out = np.zeros((block,) + arr.shape[1:], arr.dtype)
    out[: rows.shape[0]] = rows
    return out


def table_to_shards(table_array, plan: StackingPlan, table: TableKey) -> list:
    """The N shards of one logical table: `[table_shard(..., j) for j in range(N)]`."""
    return [table_shard(table_array, plan, table, j) for j in range(plan.num_shards)]


def shards_to_table(shards: Sequence[Any], plan: StackingPlan, table: TableKey) -> np.ndarray:
    """Inverse of `table_to_shards`: the logical `[vocabulary_size, ...]` table (each
    shard at least its block's rows: `rows_per_shard` in the table's span, any outside)."""
    t = plan.table(table)
    n = plan.num_shards
    if len(shards) != n:
        raise ValueError(f"table {t.name}: expected {n} shards, got {len(shards)}")
    shards = [np.asarray(s) for s in shards]
    for j, s in enumerate(shards):
        want = _block_rows(plan, t, j)
        if s.ndim < 1 or s.shape[0] < want or s.shape[1:] != shards[0].shape[1:]:
            raise ValueError(
                f"table {t.name}: shard {j} has shape {s.shape}, expected "
                f"[{want}, ...] like shard 0 {shards[0].shape}"
            )
    out = np.empty((t.vocabulary_size,) + shards[0].shape[1:], shards[0].dtype)
    layout = plan.row_layout
    for j, s in enumerate(shards):
        out[layout.rows_index(t, j)] = s[: layout.count_on_shard(t, j)]
    return out


def _given_table(tables: Mapping, plan: StackingPlan, name: str):
    if name in tables:
        return tables[name]
    config = plan.table_config(name)
    for key, value in tables.items():
        if key is config:
            return value
    raise KeyError(f"no array given for table {name}")


def stack_shard(
    tables: Mapping, plan: StackingPlan, stack: str, shard: int, *, dtype: Any | None = None
) -> np.ndarray:
    """One shard of a stack, `[rows_per_shard, ...]`, built from its logical tables.

    `tables` maps table names or `TableConfig`s to `[vocabulary_size, ...]`
    arrays (all tables of the stack). 2-D arrays are padded to the stack's
    dim; padding rows and columns are zero.
    """
    s = plan.stack(stack)
    shard = _check_shard(plan, shard)
    arrays = [np.asarray(_given_table(tables, plan, name)) for name in s.tables]
    rest = arrays[0].shape[1:]
    if len(rest) == 1:
        rest = (s.dim,)
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(*arrays)
    out = np.zeros((s.rows_per_shard,) + rest, dtype)
    for name, arr in zip(s.tables, arrays):
        t = plan.table(name)
        fits = (
            arr.ndim == len(rest) + 1
            and arr.shape[0] == t.vocabulary_size
            and (arr.shape[1] <= s.dim if arr.ndim == 2 else arr.shape[1:] == rest)
        )
        if not fits:
            raise ValueError(
                f"table {name}: array of shape {arr.shape} does not fit "
                f"[{t.vocabulary_size}{', ' + str(t.dim) if arr.ndim == 2 else ''}]"
                f" in stack {s.name}"
            )
        rows = arr[_copied_rows(plan, t, shard)[0]]
        lo = t.local_row_offset
        if arr.ndim == 2:
            out[lo : lo + rows.shape[0], : arr.shape[1]] = rows
        else:
            out[lo : lo + rows.shape[0]] = rows
    return out


def stack_to_shards(
    tables: Mapping, plan: StackingPlan, stack: str, *, dtype: Any | None = None
) -> list:
    """All N shards of a stack (see `stack_shard`)."""
    return [stack_shard(tables, plan, stack, j, dtype=dtype) for j in range(plan.num_shards)]


def tables_from_stack_shard(shard_array, plan: StackingPlan, stack: str, shard: int) -> dict:
    """`{table name: (rows, values)}` held by one shard of a stack.

    `rows` are logical table rows (`table_rows_on_shard`), `values` the
    matching slice of `shard_array` with padded columns stripped. Lets a
    checkpoint be written one device shard at a time.
    """
    s = plan.stack(stack)
    shard = _check_shard(plan, shard)
    arr = np.asarray(shard_array)
    if arr.ndim < 1 or arr.shape[0] != s.rows_per_shard:
        raise ValueError(
            f"stack {s.name}: shard array of shape {arr.shape}, expected [{s.rows_per_shard}, ...]"
        )
    out = {}
    for name in s.tables:
        t = plan.table(name)
        rows = table_rows_on_shard(plan, name, shard)
        values = arr[t.local_row_offset : t.local_row_offset + rows.shape[0]]
        if arr.ndim == 2:
            values = values[:, : t.dim]
        out[name] = (rows, values)
    return out


def shards_to_tables(shards: Sequence[Any], plan: StackingPlan, stack: str) -> dict:
    """Inverse of `stack_to_shards`: `{table name: [vocabulary_size, ...]}`."""
    s = plan.stack(stack)
    n = plan.num_shards
    if len(shards) != n:
        raise ValueError(f"stack {s.name}: expected {n} shards, got {len(shards)}")
    out = {}
    for j, sh in enumerate(shards):
        for name, (_rows, values) in tables_from_stack_shard(sh, plan, stack, j).items():
            if name not in out:
                out[name] = np.empty(
                    (plan.table(name).vocabulary_size,) + values.shape[1:], values.dtype
                )
            out[name][plan.row_layout.rows_index(plan.table(name), j)] = values
    return out
