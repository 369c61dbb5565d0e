"""The numba serving backend: the host kernels compiled by numba
(`embedmesh.serving.backends.numba_kernels`, imported at first use, never by
`import embedmesh`, compiled at a process's first call), for an install without
the C++ kernels (no C++ compiler) where numba is importable.

One sequential pass over the entries, software-prefetching the table rows a few
entries ahead; each bag accumulated in float32, in entry order, in registers
(stack accumulators, options fixed at compile time), then normalised; no
intermediate [nnz, dim] array. A `prange` version was no faster on 2 shared cores
and, under OpenMP, up to 10x slower whenever the other core is busy, so kernels
are single-threaded and release the GIL (nogil); `serving.set_host_threads`
spreads features over threads.

Kept because it serves that user (measured again for issue #39,
benchmarks/runs/serving_2026-12-04_numba_vs_numpy.txt: 8 tables of 100k rows, ragged,
sum and mean, one thread, medians of 7 interleaved rounds' ratios, the same outputs bit
for bit): 2.1-2.6x the numpy backend's speed at batch 1, 2.1-6.8x at batch 64,
2.6-7.4x at batch 4096 (dims 16, 64, 256; the C++ backend 1.3-3.8x numba's, 2026-12-04).
Its cost: a kernel variant's first call compiles, 3.2-4.6 s with an empty numba cache
(0.7 s with numba's disk cache warm), and ~19 s of compiling in the test suite.
Implements the backend interface (`embedmesh.serving.backends`).
"""

from __future__ import annotations

import numpy as np

from embedmesh import _runtime
from embedmesh.serving import pool
from embedmesh.serving.backends import numpy as numpy_backend
from embedmesh.serving.backends.common import IdOutOfRange, decoded_bag, signed_ids, widened_bag
from embedmesh.serving.quantized import QuantizedTable

__all__ = ["NAME", "load", "prepare_bag", "prepare_gather", "sparse_offsets"]

NAME = "numba"
_NUMBA = None  # None: not tried yet; False: unavailable; else the compiled kernels module
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NO_WEIGHTS = np.ones(1, np.float32)


def load():
    """The compiled kernels module, or None (EMBEDMESH_NUMBA=0, numba not importable)."""
    global _NUMBA
    if _NUMBA is None:
        _NUMBA = _runtime.numba_module("embedmesh.serving.backends.numba_kernels") or False
    return _NUMBA or None


class _KernelCall:
    """A compiled kernel with its checked arguments and output, run later: the
    serving lookup prepares every feature first and then runs the kernels back
    to back, so no Python runs between them on caches the kernels have just
    flushed (that Python took 1.5 ms of a 9 ms call on the serving benchmark,
    ~5x its cost on warm caches)."""

    __slots__ = ("kernel", "args", "out", "ids", "vocab")

    def __init__(self, kernel, args, out, ids, vocab):
        self.kernel, self.args, self.out, self.ids, self.vocab = kernel, args, out, ids, vocab

    def __call__(self) -> np.ndarray:
        bad = self.kernel(*self.args)
        if bad >= 0:
            raise IdOutOfRange(bad, self.ids[bad], self.vocab)
        return self.out


def _ids(ids: np.ndarray) -> np.ndarray:
    """Signed ids as int64 for the numba kernels: one compile per kernel instead of one
    per id type (~3 CPU-s each on a cold cache; the copy of int32 ids costs less than
    the rows they fetch)."""
    ids, _ = signed_ids(ids)
    return ids.astype(np.int64, copy=False)


def prepare_gather(table: np.ndarray, ids: np.ndarray):
    """np.take(table, ids, axis=0) for signed ids via the prefetching numba kernel (any 1/2/4/8-byte
    dtype), checking the ids on the way (IdOutOfRange), ready to run."""
    uint = _UINT_OF_SIZE.get(table.dtype.itemsize)
    if uint is None or table.dtype.hasobject:
        return lambda: numpy_backend.gather(table, ids)
    out = pool.output_empty((ids.shape[0], table.shape[1]), table.dtype)
    ids = _ids(ids)
    row_bytes = table.shape[1] * table.dtype.itemsize
    if row_bytes % 64 == 0 and row_bytes and out.ctypes.data % 64 == 0 and table.flags.c_contiguous:
        kernel = _NUMBA.gather_streaming_kernel
        args = (table.view(np.uint8), ids, out.view(np.uint8))
    else:
        kernel, args = _NUMBA.gather_kernel, (table.view(uint), ids, out.view(uint))
    return _KernelCall(kernel, args, out, ids, table.shape[0])


def _gather(table, ids) -> np.ndarray:
    return prepare_gather(table, ids)()


def _bag(table, ids, offsets, weights, mode, prune_ids, prune_w) -> np.ndarray:
    return prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_w)()


def prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_w):
    """The bag kernel ready to run, giving float32 sums; tables of other dtypes are
    pruned, gathered and widened when run (a `QuantizedTable`: decoded)."""
    if isinstance(table, QuantizedTable):
        return decoded_bag(_bag, table, ids, offsets, weights, mode, prune_ids, prune_w)
    if table.dtype != np.float32:
        return widened_bag(_gather, _bag, table, ids, offsets, weights, mode, prune_ids, prune_w)
    out = pool.output_empty((offsets.shape[0] - 1, table.shape[1]), np.float32)
    ids = _ids(ids)
    has_w = weights is not None
    kernel = _NUMBA.bag_kernel(mode, has_w, prune_ids, prune_w)
    return _KernelCall(
        kernel,
        (table, ids, offsets, weights if has_w else _NO_WEIGHTS, out),
        out,
        ids,
        table.shape[0],
    )


def sparse_offsets(indices, shape, num_rows):
    """`kernels.sparse_offsets` given the shape as an int64 array: (offsets, -1) or
    (None, first bad entry)."""
    offsets = np.empty(num_rows + 1, np.int64)
    if shape.shape[0] == 2 and indices.ndim == 2 and indices.shape[1] == 2:
        bad = _NUMBA.sparse_offsets_2d(indices, shape[0], shape[1], offsets)
    else:
        bad = _NUMBA.sparse_offsets_kernel(indices, shape, offsets)
    return (offsets, -1) if bad < 0 else (None, int(bad))
