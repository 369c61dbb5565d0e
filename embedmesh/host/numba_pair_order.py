"""The numba kernel of `embedmesh.host.pair_order` (importing this module imports numba:
`pair_order` loads it at first use, `_runtime.numba_module`)."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["pairs_by_row"]


@njit(cache=True, nogil=True)
def pairs_by_row(
    rows, unique, gains, p, num_rows, unique_capacity, slots_out, gains_out, rows_out
):  # pragma: no cover - numba
    """A stable counting sort of each device's pairs by output row, bucket `num_rows`
    holding the invalid ones, writing the pairs themselves in that order: device
    d's pair i (flat [M], `p` pairs a partition) goes to its place as (slot `i // p * U +
    unique`, gain, row); the invalid ones as (`M // p * U`, 0, `num_rows`). Each pair's
    bucket is found once (the first pass keeps it)."""
    num_devices, m = rows.shape
    invalid_slot = (m // p) * unique_capacity
    starts = np.zeros(num_rows + 2, np.int32)
    bucket = np.empty(m, np.int32)
    for d in range(num_devices):
        starts[:] = 0
        for i in range(m):
            r, u = rows[d, i], unique[d, i]
            b = r if (r >= 0 and r < num_rows and u >= 0 and u < unique_capacity) else num_rows
            bucket[i] = b
            starts[b + 1] += 1
        for b in range(num_rows + 1):
            starts[b + 1] += starts[b]
        base = 0
        for i in range(m):
            if i == base + p:
                base += p
            b = bucket[i]
            at = starts[b]
            starts[b] = at + 1
            if b < num_rows:
                slots_out[d, at] = base // p * unique_capacity + unique[d, i]
                gains_out[d, at] = gains[d, i]
            else:
                slots_out[d, at] = invalid_slot
                gains_out[d, at] = 0.0
            rows_out[d, at] = b
