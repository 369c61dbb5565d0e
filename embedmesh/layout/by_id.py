"""Where the rows of a table of raw 64-bit ids live when it is served: by id.

A trained table of raw ids (`TableConfig(id_map=embedmesh.DynamicIds(...))`) keeps each
live id's row where its owner's id map put it: those row numbers mean nothing outside
the training state. Served, the table is a `RawIdTable`: its live raw ids sorted (int64)
and their rows in the same order, zero rows after them (`padded`), so that a binary
search gives each id's row and an unknown id the zero row at `capacity`. A `RawIdUpdate`
holds the changes between two training steps (`embedmesh.export_increment`); `apply`
gives the later table. Pure numpy; read from a training state by
`embedmesh.device.by_id`, looked up by `embedmesh.serving` (docs/dynamic-ids.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["RawIdTable", "RawIdUpdate", "apply_increment"]


def _ids64(ids, what: str) -> np.ndarray:
    """int64 ids from any integer array (uint64 read as two's complement bits)."""
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: raw ids must be integers, got {a.dtype}")
    if a.dtype == np.uint64:
        return a.view(np.int64)
    return a.astype(np.int64, copy=False)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class RawIdTable:
    """A table of raw ids as served: `ids`, the live raw ids (int64 `[n]`, sorted,
    distinct) and `rows` (`[n, dim]`, `rows[i]` the row of `ids[i]`), at most `capacity`
    (the table's `vocabulary_size`) of them. Immutable (its arrays are read-only);
    `apply` makes a new one.

    `step`: the training step whose state it was read from (`EmbeddingState.step`: the
    updates of steps `< step` are in the rows), or None for a table made by hand;
    `embedmesh.export_increment` needs it. `padded`: `[capacity + 1, dim]`, the rows, then zero
    rows (what the kernels read; `rows` is a view of its first `n` rows).

    `RawIdTable(ids, rows, capacity, step=None)` sorts the ids (and rows with them).
    """

    ids: np.ndarray
    rows: np.ndarray
    capacity: int
    step: int | None
    padded: np.ndarray

    def __init__(self, ids, rows, capacity: int, step: int | None = None):
        ids = _ids64(ids, "RawIdTable.ids").reshape(-1)
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
            raise ValueError(
                f"RawIdTable.rows must be [len(ids), dim] = [{ids.shape[0]}, dim], got {rows.shape}"
            )
        capacity = int(capacity)
        if ids.shape[0] > capacity:
            raise ValueError(f"RawIdTable: {ids.shape[0]} ids, more than the capacity ({capacity})")
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():
            order = np.argsort(ids, kind="stable")
            ids, rows = ids[order], rows[order]
            if (ids[1:] == ids[:-1]).any():
                dup = int(ids[1:][ids[1:] == ids[:-1]][0])
                raise ValueError(f"RawIdTable.ids must be distinct; {dup} occurs twice")
        padded = np.zeros((capacity + 1, rows.shape[1]), rows.dtype)
        padded[: ids.shape[0]] = rows
        self._set(ids, padded, capacity, step)

    def _set(self, ids, padded, capacity, step):
        padded = _frozen(padded)
        object.__setattr__(self, "ids", _frozen(ids))
        object.__setattr__(self, "padded", padded)
        object.__setattr__(self, "rows", padded[: ids.shape[0]])
        object.__setattr__(self, "capacity", int(capacity))
        object.__setattr__(self, "step", None if step is None else int(step))

    @classmethod
    def _of_sorted(cls, ids, padded, capacity, step) -> RawIdTable:
        obj = object.__new__(cls)
        obj._set(ids, padded, capacity, step)
        return obj

    @property
    def dim(self) -> int:
        return int(self.padded.shape[1])

    @property
    def dtype(self):
        return self.padded.dtype

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __repr__(self) -> str:
        return (
            f"RawIdTable({len(self)} ids of {self.capacity}, dim={self.dim}, "
            f"dtype={self.dtype}, step={self.step})"
        )

    def positions(self, raw_ids) -> np.ndarray:
        """Each raw id's row in `padded` (int32, or int64 past 2**31 rows): its place in
        `ids`, `capacity` (a zero row) for an id the table does not hold."""
        x = _ids64(raw_ids, "raw ids")
        n = self.ids.shape[0]
        pos = np.searchsorted(self.ids, x)
        if n:
            found = self.ids[np.minimum(pos, n - 1)] == x
            pos = np.where(found, pos, self.capacity)
        else:
            pos = np.full(x.shape, self.capacity)
        return pos.astype(np.int32 if self.capacity < 2**31 - 1 else np.int64)

    def get(self, raw_ids) -> np.ndarray:
        """The rows of `raw_ids` (`[..., dim]`; zero rows for unknown ids)."""
        return self.padded[self.positions(raw_ids)]

    @property
    def lookup_table(self):
        """What the lookup kernels read at the positions `positions` gives: `padded` (a
        subclass holding encoded rows gives its decoding table instead)."""
        return self.padded

    def _stored_rows(self, rows: np.ndarray) -> np.ndarray:
        """An update's float rows as this table stores rows (a subclass encodes them)."""
        return rows.astype(self.dtype, copy=False)

    def _like(self, ids: np.ndarray, padded: np.ndarray, step: int) -> RawIdTable:
        """A table of this kind over other sorted ids and stored rows."""
        return RawIdTable._of_sorted(ids, padded, self.capacity, step)

    def apply(self, update: RawIdUpdate) -> RawIdTable:
        """This table with `update` applied: its `removed` ids dropped, its `ids` set to
        its rows (new ids added): the table at `update.step`. The update must have been
        made against this table's step (`update.since_step == self.step`): an update
        skipped or applied twice would leave stale rows, so it raises instead."""
        if not isinstance(update, RawIdUpdate):
            raise TypeError(f"apply takes a RawIdUpdate, got {type(update).__name__}")
        if update.since_step != self.step:
            raise ValueError(
                f"this RawIdUpdate holds the changes since step {update.since_step}, but the "
                f"table is at step {self.step}: apply the updates in order, each to the "
                f"table it was exported against"
            )
        if update.rows.shape[1:] != (self.dim,):
            raise ValueError(f"update rows are {update.rows.shape}, the table's dim is {self.dim}")
        drop = np.concatenate([update.removed, update.ids])
        keep = ~_isin_sorted(self.ids, np.sort(drop))
        ids = np.concatenate([self.ids[keep], update.ids])
        if ids.shape[0] > self.capacity:
            raise ValueError(
                f"the update leaves {ids.shape[0]} ids, more than the capacity ({self.capacity})"
            )
        order = np.argsort(ids, kind="stable")
        padded = np.zeros_like(self.padded)
        n = ids.shape[0]
        src = np.concatenate([self.rows[keep], self._stored_rows(np.asarray(update.rows))])
        padded[:n] = src[order]
        return self._like(ids[order], padded, update.step)


def _isin_sorted(a: np.ndarray, sorted_b: np.ndarray) -> np.ndarray:
    """bool of a's shape: whether each value is in `sorted_b` (sorted int64)."""
    if sorted_b.size == 0:
        return np.zeros(a.shape, bool)
    pos = np.minimum(np.searchsorted(sorted_b, a), sorted_b.size - 1)
    return sorted_b[pos] == a


@dataclasses.dataclass(frozen=True, eq=False)
class RawIdUpdate:
    """The changes of one table of raw ids between two training steps
    (`export_increment`): `ids` (int64 `[k]`, sorted) live at `step` and used (looked up,
    so trained, or admitted) at a step `>= since_step`, with their rows `rows`
    (`[k, dim]`) at `step`; `removed` (int64 `[r]`, sorted): ids the table at
    `since_step` held that are no longer live (evicted). `RawIdTable.apply` applies it."""

    ids: np.ndarray
    rows: np.ndarray
    removed: np.ndarray
    since_step: int
    step: int

    def __post_init__(self):
        ids = _ids64(self.ids, "RawIdUpdate.ids").reshape(-1)
        removed = _ids64(self.removed, "RawIdUpdate.removed").reshape(-1)
        rows = np.asarray(self.rows)
        if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
            raise ValueError(f"RawIdUpdate.rows must be [len(ids), dim], got {rows.shape}")
        order = np.argsort(ids, kind="stable")
        object.__setattr__(self, "ids", _frozen(ids[order]))
        object.__setattr__(self, "rows", _frozen(rows[order]))
        object.__setattr__(self, "removed", _frozen(np.sort(removed)))
        object.__setattr__(self, "since_step", int(self.since_step))
        object.__setattr__(self, "step", int(self.step))

    def __repr__(self) -> str:
        return (
            f"RawIdUpdate(steps {self.since_step} -> {self.step}: {self.ids.shape[0]} rows, "
            f"{self.removed.shape[0]} removed)"
        )


def apply_increment(tables: dict, updates: dict) -> dict:
    """`tables` (`{key: table}`) with each `updates[key]` (`RawIdUpdate`) applied to its
    `RawIdTable`; other entries unchanged. A new dict: `tables` is not modified."""
    out = dict(tables)
    for key, update in updates.items():
        if key not in out:
            raise KeyError(f"no table {getattr(key, 'name', key)!r} to apply an update to")
        base = out[key]
        if not isinstance(base, RawIdTable):
            raise TypeError(
                f"table {getattr(key, 'name', key)!r} is not a RawIdTable "
                f"({type(base).__name__}): only tables of raw ids take updates"
            )
        out[key] = base.apply(update)
    return out
