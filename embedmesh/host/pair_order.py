"""The pairs of a preprocessed batch in output-row order, computed on the host.

A lookup sums each pair's row into its output row. The TPU kernel that does it walks the
pairs grouped by output row, while the host hands them over grouped by distinct id (the
order the update wants): without help, the lookup sorts them on the device, and XLA's
TPU compiler takes much longer over that one sort than over the rest of the program.
`pair_order` gives the device the permutation instead, from a counting sort on the host
(linear in pairs and rows), so the lookup only gathers.
"""

from __future__ import annotations

import numpy as np

from embedmesh import _runtime

__all__ = ["pair_order"]


def _kernel():
    """The numba kernel (`embedmesh.host.numba_pair_order.order_by_row`), or None."""
    module = _runtime.numba_module("embedmesh.host.numba_pair_order")
    return None if module is None else module.order_by_row


def pair_order(pair_rows, pair_unique, num_rows: int, unique_capacity: int) -> np.ndarray:
    """For each device's pairs (`pair_rows`, `pair_unique` [D, N, P], a batch's), the
    positions of its valid pairs in its flattened [N * P] pairs, in ascending (output
    row, position) order, then its invalid ones in position order: [D, N, P] int32.

    A pair is valid where its output row is in `[0, num_rows)` and its id's position in
    `[0, unique_capacity)` (the batch's padding, `pair_rows == num_rows`, is not): the
    pairs a lookup sums. A stable counting sort (numba's where it loads, else numpy's
    stable argsort; the same result)."""
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
    out = np.empty(flat_rows.shape, np.int32)
    kernel = _kernel()
    if kernel is not None:
        kernel(flat_rows, flat_unique, int(num_rows), int(unique_capacity), out)
    else:
        valid = (flat_rows >= 0) & (flat_rows < num_rows)
        valid &= (flat_unique >= 0) & (flat_unique < unique_capacity)
        key = np.where(valid, flat_rows, num_rows)
        out[:] = np.argsort(key, axis=1, kind="stable")
    return out.reshape(rows.shape)
