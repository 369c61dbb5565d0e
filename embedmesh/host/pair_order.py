"""The pairs of a preprocessed batch in output-row order, computed on the host.

A lookup sums each pair's row into its output row. The TPU kernel that does it walks the
pairs grouped by output row, while the host hands them over grouped by distinct id (the
order the update wants): without help, the lookup sorts them on the device, and XLA's
TPU compiler takes much longer over that one sort than over the rest of the program.
`pair_order` finds that permutation with a counting sort on the host (linear in pairs and
rows), and `pairs_by_row` hands the device the pairs themselves in that order: a TPU
gathers scalars slowly (three gathers of a batch's 393k pairs by a permutation took
longer than the lookup's own sums), so the device neither sorts nor gathers them.
"""

from __future__ import annotations

import numpy as np

from embedmesh import _runtime

__all__ = ["pair_order", "pairs_by_row"]


def _kernel():
    """The numba kernel (`embedmesh.host.numba_pair_order.pairs_by_row`), or None."""
    module = _runtime.numba_module("embedmesh.host.numba_pair_order")
    return None if module is None else module.pairs_by_row


def pair_order(pair_rows, pair_unique, num_rows: int, unique_capacity: int) -> np.ndarray:
    """For each device's pairs (`pair_rows`, `pair_unique` [D, N, P], a batch's), the
    positions of its valid pairs in its flattened [N * P] pairs, in ascending (output
    row, position) order, then its invalid ones in position order: [D, N, P] int32.

    A pair is valid where its output row is in `[0, num_rows)` and its id's position in
    `[0, unique_capacity)` (the batch's padding, `pair_rows == num_rows`, is not): the
    pairs a lookup sums. numpy's stable argsort: `pairs_by_row`'s fallback where numba
    does not load (its numba kernel sorts by counting and writes the pairs at once)."""
    rows = np.asarray(pair_rows)
    unique = np.asarray(pair_unique)
    if rows.shape != unique.shape or rows.ndim != 3:
        raise ValueError(
            f"pair_order: pair_rows {rows.shape} and pair_unique {unique.shape} must be "
            f"one [D, N, P] shape"
        )
    d = rows.shape[0]
    flat_rows = np.ascontiguousarray(rows.reshape(d, -1), np.int32)
    flat_unique = np.ascontiguousarray(unique.reshape(d, -1), np.int32)
    valid = (flat_rows >= 0) & (flat_rows < num_rows)
    valid &= (flat_unique >= 0) & (flat_unique < unique_capacity)
    key = np.where(valid, flat_rows, num_rows)
    return np.argsort(key, axis=1, kind="stable").astype(np.int32).reshape(rows.shape)


def pairs_by_row(pair_rows, pair_unique, pair_gains, num_rows: int, unique_capacity: int):
    """Each device's pairs in output-row order (`pair_order`'s), as the lookup sums them:
    `(slots, gains, rows)`, each [D, N, P] over the flattened [N * P] pairs. `slots`: a
    pair's position in its device's N stacked [U] distinct-id lists (`n * U + id
    position`), `rows` its output row, `gains` its gain; the invalid pairs last, with
    slot `N * U`, row `num_rows` and gain 0 (they contribute nothing). One counting sort
    writing them (numba's where it loads, else `pair_order` and numpy's takes)."""
    rows = np.asarray(pair_rows)
    unique = np.asarray(pair_unique)
    gains = np.asarray(pair_gains)
    if rows.shape != unique.shape or rows.shape != gains.shape or rows.ndim != 3:
        raise ValueError(
            f"pairs_by_row: pair_rows {rows.shape}, pair_unique {unique.shape} and "
            f"pair_gains {gains.shape} must be one [D, N, P] shape"
        )
    d, n, p = rows.shape
    flat = [
        np.ascontiguousarray(a.reshape(d, -1), t)
        for a, t in ((rows, np.int32), (unique, np.int32), (gains, np.float32))
    ]
    kernel = _kernel()
    if kernel is not None and p:
        out = (np.empty_like(flat[0]), np.empty_like(flat[2]), np.empty_like(flat[0]))
        kernel(*flat, p, int(num_rows), int(unique_capacity), *out)
        return tuple(a.reshape(rows.shape) for a in out)
    rows2, unique2, gains2 = flat
    order = pair_order(rows, unique, num_rows, unique_capacity).reshape(d, -1)
    valid = (rows2 >= 0) & (rows2 < num_rows) & (unique2 >= 0) & (unique2 < unique_capacity)
    part = np.repeat(np.arange(n, dtype=np.int32), p)[None, :]
    slots = np.where(valid, part * np.int32(unique_capacity) + unique2, n * unique_capacity)
    out_rows = np.where(valid, rows2, num_rows)
    out_gains = np.where(valid, gains2, 0)
    return tuple(
        np.take_along_axis(a, order, axis=1).astype(dt).reshape(rows.shape)
        for a, dt in ((slots, np.int32), (out_gains, np.float32), (out_rows, np.int32))
    )
