"""Initializers beyond `jax.nn.initializers`.

An initializer is `f(key, shape, dtype)`. One that also has `rows(row_ids,
dim, dtype)` is *row-aware*: the engine hands it the logical row ids of each
shard it builds, so its values do not depend on the number of shards.
"""

from __future__ import annotations

import numpy as np


class RowIdInitializer:
    """Row r of a table holds `offset + r` in every column: makes layouts checkable."""

    def __init__(self, offset: float = 0.0):
        self.offset = float(offset)

    def rows(self, row_ids, dim: int, dtype) -> np.ndarray:
        ids = np.asarray(row_ids, np.float64).reshape(-1, 1)
        return np.broadcast_to(self.offset + ids, (ids.shape[0], dim)).astype(dtype)

    def __call__(self, key, shape, dtype=np.float32):
        return self.rows(np.arange(shape[0]), int(np.prod(shape[1:])), dtype).reshape(shape)

    def __repr__(self):
        return f"RowIdInitializer(offset={self.offset})"


def row_id_initializer(offset: float = 0.0) -> RowIdInitializer:
    return RowIdInitializer(offset)
