"""COO sparse indices checked and turned into bag offsets, in one pass.

`sparse_offsets(indices, dense_shape)` is the check `inputs` runs on every
SparseTensor (`inputs.sparse_row_offsets`, for training's host preprocessing and
the serving lookup alike): every index inside `dense_shape`, each after the
previous one in row-major order with no repeats, and the offsets of each row of
the leading dimensions. It lives below `inputs` (imports nothing of embedmesh)
so that the declared layer never reaches up into serving.

The plain numpy form is here (`offsets_numpy`). The host kernels' faster forms
(C++, numba) belong to the serving backends (`embedmesh.serving.backends`); the
serving kernels' dispatch (`embedmesh.serving.kernels`, imported by `import
embedmesh`) installs its `sparse_offsets` here with `set_kernel`, so that this
check follows the backend the serving kernels use (`kernels.set_backend`).
Every form gives the same answer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["offsets_numpy", "set_kernel", "sparse_offsets"]

# (indices, dense_shape) -> (offsets | None, first bad entry); None: offsets_numpy
_kernel: Callable | None = None


def set_kernel(fn: Callable | None) -> Callable | None:
    """Use `fn(indices, dense_shape)` (same contract as `sparse_offsets`) for the
    check from now on (None: the numpy form); returns the previous one."""
    global _kernel
    previous, _kernel = _kernel, fn
    return previous


def sparse_offsets(indices: np.ndarray, dense_shape: tuple) -> tuple[np.ndarray | None, int]:
    """Bag offsets over the flattened leading dims of COO `indices [n, rank]`.

    Returns (offsets [prod(dense_shape[:-1]) + 1], -1) when every index lies
    in `dense_shape` and follows the previous one in row-major order without
    repeats, else (None, k) for the first entry k breaking that. One pass.
    """
    if _kernel is not None:
        return _kernel(indices, dense_shape)
    indices = np.asarray(indices)
    shape = tuple(int(d) for d in np.asarray(dense_shape, np.int64))
    return offsets_numpy(indices, shape, int(np.prod(shape[:-1], dtype=np.int64)))


def offsets_numpy(indices: np.ndarray, shape: tuple, num_rows: int):
    """`sparse_offsets` in numpy, given `shape` as a tuple of ints and `num_rows`
    (the product of its leading dims)."""
    n, rank = indices.shape
    if n == 0:
        return np.zeros(num_rows + 1, np.int64), -1
    outside = (indices < 0) | (indices >= np.asarray(shape, np.int64))
    flat = indices[:, 0].astype(np.int64)
    for d in range(1, rank):
        flat = flat * shape[d] + indices[:, d]
    bad = np.flatnonzero(outside.any(axis=1))
    first = int(bad[0]) if bad.size else n
    order = np.flatnonzero(flat[1:] <= flat[:-1])
    if order.size:
        first = min(first, int(order[0]) + 1)
    if first < n:
        return None, first
    rows = flat // shape[-1]
    return np.searchsorted(rows, np.arange(num_rows + 1), side="left").astype(np.int64), -1
