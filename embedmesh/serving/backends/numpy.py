"""The numpy serving backend (always available, the fallback): gather, scale,
then a segment sum done per group of equal-length rows as
`[rows, L, dim].sum(axis=1)`, which adds in entry order, as the other backends do.
Implements the backend interface (`embedmesh.serving.backends`)."""

from __future__ import annotations

import functools

import numpy as np

from embedmesh import sparse_index
from embedmesh.serving import pool
from embedmesh.serving.backends.common import decoded_bag, drop_pruned
from embedmesh.serving.quantized import QuantizedTable

__all__ = ["NAME", "gather", "load", "prepare_bag", "prepare_gather", "sparse_offsets"]

NAME = "numpy"


def load():
    """Always available."""
    return True


def gather(table, ids) -> np.ndarray:
    """np.take(table, ids, axis=0) into a pool buffer, the ids range-checked
    (IdOutOfRange); the other backends' form for dtypes their kernels do not move."""
    drop_pruned(ids, None, None, table.shape[0], False, False)  # range check only
    return np.take(
        table, ids, axis=0, out=pool.output_empty((ids.shape[0], table.shape[1]), table.dtype)
    )


def prepare_gather(table, ids):
    """`gather`, run later (signed ids)."""
    return functools.partial(gather, table, ids)


def prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_w):
    """The bag sums, run later: float32 [bags, dim] (a `QuantizedTable`'s kept rows
    decoded first)."""
    if isinstance(table, QuantizedTable):
        return decoded_bag(_bag, table, ids, offsets, weights, mode, prune_ids, prune_w)
    return functools.partial(_bag, table, ids, offsets, weights, mode, prune_ids, prune_w)


def _bag(table, ids, offsets, weights, mode, prune_ids, prune_w) -> np.ndarray:
    ids, offsets, weights = drop_pruned(ids, offsets, weights, table.shape[0], prune_ids, prune_w)
    return _sum_sorted(table, ids, offsets, weights, mode)


def _sum_sorted(table, ids, offsets, weights, mode) -> np.ndarray:
    """Float32 [rows, dim] sums of valid entries grouped by offsets, normalised."""
    num_rows, dim = offsets.shape[0] - 1, table.shape[1]
    out = pool.output_empty((num_rows, dim), np.float32)
    out[...] = 0.0
    if ids.shape[0] == 0:
        return out
    gathered = np.take(table, ids, axis=0).astype(np.float32, copy=False)
    if weights is not None and not np.all(weights == 1.0):
        gathered *= weights[:, None]
    lengths = np.diff(offsets)
    # Sum each group of equal-length rows as one [rows, L, dim] reduction over
    # L, which adds in entry order; np.add.reduceat along axis 0 is ~2x slower.
    order = np.argsort(lengths, kind="stable")
    bounds = np.flatnonzero(np.diff(lengths[order])) + 1
    for group in np.split(order, bounds):
        length = int(lengths[group[0]])
        if length == 1:
            out[group] = gathered[offsets[group]]
        elif length > 1:
            out[group] = gathered[offsets[group][:, None] + np.arange(length)].sum(axis=1)
    if mode:
        w = np.ones(ids.shape[0], np.float32) if weights is None else weights
        wd = w if mode == 1 else w * w
        den = np.zeros(num_rows, np.float32)
        nonempty = lengths > 0
        den[nonempty] = np.add.reduceat(wd, offsets[:-1][nonempty])
        if mode == 2:
            den = np.sqrt(den)
        zero = den == 0
        np.divide(out, den[:, None], out=out, where=~zero[:, None])
        out[zero] = 0.0
    return out


def sparse_offsets(indices, shape, num_rows):
    """`kernels.sparse_offsets` given the shape as an int64 array: (offsets, -1) or
    (None, first bad entry)."""
    return sparse_index.offsets_numpy(indices, tuple(int(d) for d in shape), num_rows)
