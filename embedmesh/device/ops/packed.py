"""Packed narrow rows: a stack array that stores `pack` logical rows side by side in each
of its rows (`StackSpec.pack`, chosen by the stacking plan: a TPU's layout).

A TPU moves a row between HBM and its core at a cost a row whatever its width up to 128
lanes, and lays every array out in 128-lane tiles: a `[rows, 32]` array takes as much
memory as a `[rows, 128]` one. So a narrow stack (a dim-16 table with its Adagrad slot:
32 columns) is stored as `[rows / pack, pack * width]` (`pack = 128 // width`): logical row
`r` is stored row `r // pack`, lanes `[(r % pack) * width, (r % pack + 1) * width)`. On the
host that is the logical `[rows, width]` array reshaped, which moves no byte.

`PackedRows(data, pack)` is such an array seen as its logical `[rows, width]` table (a
pytree over `data`): the ops read and write it by logical row (`ops.gather_rows`,
`ops.scatter_rows`, `ops.sparse_update` and every op composed of them), so the strategies
and the programs are the same code for both layouts; the device core wraps a packed
stack's array for its lookup and update (`view`) and keeps the stored array (`stored`).

Reads gather the stored rows (whole 128-lane rows: the fast gather) and select each id's
lanes. An update is exact when several ids of one batch share a stored row: each id's
new logical row is computed from the stored rows read before any write, then every id
writes its whole stored row with the new rows of all the batch's ids in it (its
neighbours in the ascending ids, at most `pack - 1` places either side), so the ids of
one stored row all write the same bytes and none loses a neighbour's update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["PackedRows", "gather", "scatter", "sparse_update", "stored", "view"]


@jax.tree_util.register_pytree_node_class
class PackedRows:
    """The stored array `data` [rows / pack, pack * width] seen as logical rows [rows, width]."""

    def __init__(self, data, pack: int):
        self.data = data
        self.pack = int(pack)

    def tree_flatten(self):
        return (self.data,), self.pack

    @classmethod
    def tree_unflatten(cls, pack, children):
        return cls(children[0], pack)

    @property
    def width(self) -> int:
        return self.data.shape[1] // self.pack

    @property
    def shape(self) -> tuple:
        return (self.data.shape[0] * self.pack, self.width)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __repr__(self) -> str:
        return f"PackedRows({self.shape} in {self.data.shape}, pack={self.pack})"


def view(table, pack: int):
    """`table` (a stack's stored array) as its logical rows: a `PackedRows` where `pack` > 1."""
    return PackedRows(table, pack) if int(pack) > 1 else table


def stored(table):
    """The stored array of `table` (a `PackedRows`, or a plain array: itself)."""
    return table.data if isinstance(table, PackedRows) else table


def _locate(table: PackedRows, ids):
    """`(stored row, slot, valid)` of logical `ids`: the stored row past the end (skipped
    by reads and writes) for an id outside the table."""
    valid = (ids >= 0) & (ids < table.shape[0])
    row = jnp.where(valid, ids // table.pack, table.data.shape[0]).astype(jnp.int32)
    return row, jnp.where(valid, ids % table.pack, 0).astype(jnp.int32), valid


def _select(words, slot, pack: int):
    """Each row's lanes of its `slot`: words [n, pack * w] -> [n, w] (a select a slot)."""
    w = words.shape[1] // pack
    out = words[:, :w]
    for k in range(1, pack):
        out = jnp.where((slot == k)[:, None], words[:, k * w : (k + 1) * w], out)
    return out


def gather(table: PackedRows, ids):
    """`table[ids]` [n, width], zero rows for ids outside it: the stored rows gathered
    whole (`ops.gather_rows` of the stored array), then each id's lanes."""
    from embedmesh.device import ops

    row, slot, _ = _locate(table, ids.astype(jnp.int32))
    return _select(ops.gather_rows(table.data, row), slot, table.pack)


def _shifted(x, by: int, fill):
    """`x[i + by]` at i along the first axis, `fill` past either end."""
    n = x.shape[0]
    if by == 0:
        return x
    if abs(by) >= n:
        return jnp.full(x.shape, fill, x.dtype)
    gap = jnp.full((abs(by),) + x.shape[1:], fill, x.dtype)
    return jnp.concatenate([x[by:], gap] if by > 0 else [gap, x[:by]])


def _merged(words, row, slot, new, pack: int):
    """Each id's stored row `words` [n, pack * w] with the new logical rows `new` [n, w]
    of every id in it written into their lanes. The ids are distinct and ascending, so
    those of one stored row are at most `pack - 1` places apart. Every array here is
    [n, pack * w], whole 128-lane rows on a TPU (a [n, pack, w] form would pad each
    w-lane row to 128 lanes and each pack to 8 sublanes there)."""
    n, w = new.shape
    lane_slot = jnp.arange(pack * w, dtype=jnp.int32)[None, :] // w
    tiled = jnp.tile(new, (1, pack))  # each id's new row in the lanes of every slot
    out = words
    for d in range(-(pack - 1), pack):
        same = (_shifted(row, d, -1) == row)[:, None]
        hit = same & (lane_slot == _shifted(slot, d, -1)[:, None])
        out = jnp.where(hit, _shifted(tiled, d, 0), out)
    return out


def _ascending(ids, *xs):
    """`ids` and the rows `xs` ordered by id, the negative ones last (as they are where
    already so: a stack's distinct ids, `PAD_ID` after them; else sorted on the device)."""
    if ids.shape[0] < 2:
        return (ids, *xs)
    top = jnp.iinfo(jnp.int32).max
    key = jnp.where(ids >= 0, ids, top)  # the padding (negative or past the end) last

    def by_id(ids, *xs):
        order = jnp.argsort(key)
        return (ids[order], *(x[order] for x in xs))

    ok = jnp.all((key[1:] > key[:-1]) | (key[1:] == top))
    return jax.lax.cond(ok, lambda *a: a, by_id, ids, *xs)


def _write(table: PackedRows, ids, rows, words):
    """`table` with the logical rows `ids` (distinct) set to `rows`, `words` the stored
    rows of the ids as they were: whole stored rows written (`ops.scatter_rows`)."""
    from embedmesh.device import ops

    row, slot, _ = _locate(table, ids)
    merged = _merged(words, row, slot, rows.astype(table.dtype), table.pack)
    return PackedRows(ops.scatter_rows(table.data, row, merged), table.pack)


def scatter(table: PackedRows, ids, rows):
    """`table.at[ids].set(rows, mode="drop")`, ids distinct: the stored rows of the ids
    read, their lanes replaced, written back whole."""
    from embedmesh.device import ops

    ids, rows = _ascending(ids.astype(jnp.int32), rows)
    words = ops.gather_rows(table.data, _locate(table, ids)[0])
    return _write(table, ids, rows, words)


def sparse_update(optimizer, table: PackedRows, slots: dict, ids, grads, step):
    """`ops.sparse_update` of a packed table: the stored rows of the ids gathered once,
    `optimizer.update_rows` on each id's logical row, the stored rows written back whole
    with every updated row of the batch in them. Returns `(table, {})`."""
    from embedmesh.device import ops

    if slots:
        raise ValueError(f"a packed table keeps its slots in its rows; got {sorted(slots)}")
    ids, grads = _ascending(ids.astype(jnp.int32), grads)
    row, slot, _ = _locate(table, ids)
    words = ops.gather_rows(table.data, row)
    rows = _select(words, slot, table.pack)
    if getattr(optimizer, "takes_ids", False):
        new, _ = optimizer.update_rows(rows, {}, grads, step, ids=ids)
    else:
        new, _ = optimizer.update_rows(rows, {}, grads, step)
    return _write(table, ids, new, words), {}
