"""The numba kernel of `embedmesh.host.pair_order` (importing this module imports numba:
`pair_order` loads it at first use, `_runtime.numba_module`)."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["order_by_row"]


@njit(cache=True)
def order_by_row(rows, unique, num_rows, unique_capacity, out):  # pragma: no cover - numba
    """`out[d]`: the positions of device d's pairs (`rows[d]`, `unique[d]`, flat [M]) in
    ascending (output row, position) order, the invalid pairs (row outside `[0,
    num_rows)` or id outside `[0, unique_capacity)`) last in position order: a counting
    sort, bucket `num_rows` holding the invalid ones."""
    num_devices, m = rows.shape
    starts = np.zeros(num_rows + 2, np.int64)
    for d in range(num_devices):
        starts[:] = 0
        for i in range(m):
            r, u = rows[d, i], unique[d, i]
            b = r if (r >= 0 and r < num_rows and u >= 0 and u < unique_capacity) else num_rows
            starts[b + 1] += 1
        for b in range(num_rows + 1):
            starts[b + 1] += starts[b]
        for i in range(m):
            r, u = rows[d, i], unique[d, i]
            b = r if (r >= 0 and r < num_rows and u >= 0 and u < unique_capacity) else num_rows
            out[d, starts[b]] = i
            starts[b] += 1
