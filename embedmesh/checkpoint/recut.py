"""Layout conversions of stored tables: which stored rows go where (pure index
arithmetic through the two `RowLayout`s, no arrays)."""

from __future__ import annotations

import dataclasses

import numpy as np

from embedmesh.layout.rows import ROW_LAYOUTS, RowLayout, row_layout
from embedmesh.layout.stacking import TablePlacement


def stored_row_count(span: int, rows_per_shard: int, num_shards: int) -> int:
    """Rows of a table's stored array: its span's blocks, rounded up to a multiple of the
    saving mesh's shards (`N * rows_per_shard` for a table on every shard)."""
    return -(-span * rows_per_shard // num_shards) * num_shards


def stored_shards(meta: dict, meta_table: dict) -> int:
    """The blocks of a table's stored array: the shards of its span ("span"; every shard
    of the saving mesh in checkpoints without it)."""
    return int(meta_table.get("span", meta["num_shards"]))


def stored_shape_check(
    shape: tuple, meta_table: dict, n: int, num_shards: int, dim: int | None = None
):
    """`n`: the table's stored blocks (`stored_shards`); `num_shards`: the saving mesh's."""
    rps = meta_table["rows_per_shard"]
    rows = stored_row_count(n, rps, num_shards)
    if shape[0] != rows:
        padded = f", padded to a multiple of {num_shards}" if rows != n * rps else ""
        raise ValueError(
            f"table {meta_table['name']}: stored array has {shape[0]} rows, "
            f"metadata says {n} x {rps}{padded}"
        )
    if dim is not None and len(shape) == 2 and shape[1] != dim:
        raise ValueError(f"table {meta_table['name']}: stored dim {shape[1]} != {dim}")


def stored_layout(meta: dict, where) -> RowLayout:
    """The row layout of the saving mesh ("row_layout", "mod" when absent)."""
    name = meta.get("row_layout", "mod")
    if not isinstance(name, str) or name not in ROW_LAYOUTS:
        raise ValueError(
            f"{where} lays its rows out by {name!r} (its 'row_layout'), a row "
            f"layout this embedmesh does not know (it knows "
            f"{sorted(ROW_LAYOUTS)})"
        )
    return row_layout(name, int(meta["num_shards"]))


def stored_table(meta_table: dict, n: int) -> TablePlacement:
    """A table's stored array as a placement on `n` shards (`stored_shards`: its span on
    the saving mesh, renumbered from 0): a stack of its own, block b at rows
    `[b * rows_per_shard, (b+1) * rows_per_shard)`."""
    v, rps = meta_table["vocabulary_size"], meta_table["rows_per_shard"]
    return TablePlacement(
        name=meta_table["name"],
        index=0,
        stack=meta_table["name"],
        num_shards=n,
        vocabulary_size=v,
        padded_vocabulary_size=n * rps,
        dim=meta_table["dim"],
        padded_dim=meta_table["dim"],
        row_offset=0,
        rotation=meta_table["rotation"],
    )


def saved_logical_rows(layout_name: str, n_old: int, m: dict, shard, row) -> np.ndarray:
    """The logical rows of a stored table of raw ids (metadata `m`, saved on `n_old`
    shards) at its saved maps' (shard, row) pairs: block row `row` of the saving mesh's
    shard `shard`, in the table's span (`first_shard`, `span`: every shard, or a
    table-wise table's owner)."""
    first, k = int(m.get("first_shard", 0)), int(m.get("span", n_old))
    layout = row_layout(layout_name, k)
    params = np.asarray(layout.kernel_params(stored_table(m, k)), np.int64)
    local = np.asarray(shard, np.int64) - first
    return layout.logical_rows_from_params(params, local, np.asarray(row, np.int64))


def logical_table(meta_table: dict) -> TablePlacement:
    """The logical `[vocabulary_size, ...]` table as a placement of `logical_layout()`."""
    return stored_table(
        dict(meta_table, rows_per_shard=meta_table["vocabulary_size"], rotation=0), 1
    )


def _stored_row(layout: RowLayout, t, row: int) -> int:
    """Where logical row `row` of table `t` is in its stored `[k * rows_per_shard, ...]`
    array (`t` a stored placement: first shard 0)."""
    return int(layout.shard_of(t, row)) * t.rows_per_shard + int(layout.block_row(t, row))


def recut_copies(src_layout: RowLayout, src, dst_layout: RowLayout, dst, shard: int) -> list:
    """[(dst_start, dst_step, src_start, src_step, rows)] filling block rows
    `[0, count_on_shard)` of table `dst`'s block on shard `shard` of `dst_layout` from the
    stored array of table `src` laid out by `src_layout` (block j at rows
    `j * src.rows_per_shard`), as arithmetic progressions: no index arrays.

    The new block's rows are `i = first + step * r` (`dst_layout.rows_index`). The
    stored layout repeats every `P` rows, moving `B` rows down the block
    (`src_layout.period`); with `L = lcm(step, P)`, the rows of phase `p` of `r` (mod
    `L / step`) sit in one stored block, `(L / P) * B` stored rows apart. Same layout
    is one contiguous copy per shard; to the logical table (`logical_layout`, step 1),
    one per stored block.
    """
    count = dst_layout.count_on_shard(dst, shard)
    index = dst_layout.rows_index(dst, shard)
    if not isinstance(index, slice):  # the layout gives no progression: a copy per row
        return [
            (r, 1, _stored_row(src_layout, src, int(i)), 1, 1)
            for r, i in enumerate(np.asarray(index, np.int64)[:count])
        ]
    first, _, step = index.indices(dst.vocabulary_size)
    rows, advance = src_layout.period(src)
    lcm = step * rows // int(np.gcd(step, rows))
    phases, stride = lcm // step, (lcm // rows) * advance
    return [
        (
            p,
            phases,
            _stored_row(src_layout, src, first + step * p),
            stride,
            len(range(p, count, phases)),
        )
        for p in range(min(phases, count))
    ]


def same_layout(src_layout: RowLayout, src, dst_layout: RowLayout, dst) -> bool:
    """Whether the stored blocks are exactly the new blocks of the table. A table on part
    of the mesh (table-wise) is compared in its stored form: its span renumbered from
    shard 0."""
    k = dst_layout.span(dst)[1]
    if k != dst_layout.num_shards:
        dst = dataclasses.replace(dst, num_shards=k, first_shard=0, span=k, row_offset=0)
        dst_layout = row_layout(dst_layout.name, k) if dst_layout.name in ROW_LAYOUTS else None
        if dst_layout is None:
            return False
    return (
        src_layout == dst_layout
        and src.rows_per_shard == dst.rows_per_shard
        and tuple(src_layout.kernel_params(src)) == tuple(dst_layout.kernel_params(dst))
    )
