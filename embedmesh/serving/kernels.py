"""Host (CPU) kernels over numpy memory, used where XLA's CPU gather is slow.

The serving lookup's inner loops: `bag_combine` (gather rows, scale, sum
per bag given by offsets, normalise; TensorFlow's pruning and the id range
check in the same pass), `gather` (a checked plain lookup, written with
non-temporal stores where rows are whole cache lines), `sparse_offsets`
(validate COO indices and derive bag offsets in one pass), and the older
`weighted_segment_sum` (bags given by a sorted per-entry row array).
`prepare_bag_combine` / `prepare_gather` split the first two into checks
(now) and the kernel (later), so a caller can run many kernels back to back.

Three backends compute the same thing:

- "native" (the default where its library loads): C++ kernels
  (`embedmesh/serving/cpu/serving.cc`, plain C called through ctypes, which
  releases the GIL; found or built by `embedmesh.serving.native.library()`,
  imported at first use). The bag kernel makes one pass per bag: range check,
  pruning, denominator, software prefetch of the rows ahead, and the sums held
  in vector registers (one template instance per register-block width, a masked
  tail for odd widths); float32, in entry order, no FMA. Nothing is compiled at a
  call: a serving process's first lookup is as fast as its later ones.
- "numba" (when the C++ kernels are unavailable and numba is importable;
  compiled kernels in `embedmesh.serving.numba_kernels`, imported at first use,
  never by `import embedmesh`, compiled at a process's first call): one
  sequential pass over
  the entries, software-prefetching the table rows a few entries ahead;
  each bag accumulated in float32, in entry order, in registers (stack
  accumulators, options fixed at compile time), then normalised; no
  intermediate [nnz, dim] array. A `prange` version was no
  faster on 2 shared cores and, under OpenMP, up to 10x slower whenever the
  other core is busy, so kernels are single-threaded and release the GIL
  (nogil); `serving.set_host_threads` spreads features over threads.
- "numpy" (always available): gather, scale, then a segment sum done per
  group of equal-length rows as `[rows, L, dim].sum(axis=1)`.

`set_backend` switches between them (tests, benchmarks); the environment
variable `EMBEDMESH_SERVING_NATIVE=0` disables the C++ kernels and
`EMBEDMESH_NUMBA=0` (read once, by `embedmesh._runtime`) numba altogether,
here and in host preprocessing.
Outputs are 64-byte aligned so `jax.device_put(out, may_alias=True)` can wrap
them without a copy, and come from a pool of buffers reused once nothing
references them (`set_output_pool_limit`, `EMBEDMESH_OUTPUT_POOL_MB`: the free
bytes kept).
"""

from __future__ import annotations

import array
import ctypes
import functools
import math
import threading
from typing import Any

import numpy as np

from embedmesh import _runtime
from embedmesh._runtime import aligned_empty, combiner_code

__all__ = [
    "IdOutOfRange",
    "aligned_empty",
    "bag_combine",
    "gather",
    "get_backend",
    "output_empty",
    "prepare_bag_combine",
    "prepare_gather",
    "set_backend",
    "set_output_pool_limit",
    "set_release_hook",
    "sparse_offsets",
    "weighted_segment_sum",
    "weighted_segment_sum_numba",
    "weighted_segment_sum_native",
    "weighted_segment_sum_numpy",
]

_ALIGN = 64  # bytes; XLA's CPU client aliases host buffers aligned like this

_NUMBA = None  # None: not tried yet; False: unavailable; else embedmesh.serving.numba_kernels
_backend: str | None = None  # "native", "numba" or "numpy"; None: chosen at first use


def _numba_kernels():
    """The compiled kernels module, or None (EMBEDMESH_NUMBA=0, numba not importable)."""
    global _NUMBA
    if _NUMBA is None:
        _NUMBA = _runtime.numba_module("embedmesh.serving.numba_kernels") or False
    return _NUMBA or None


def _native_library():
    """The C++ serving kernels (`embedmesh.serving.native.library()`), or None."""
    global _LIB
    if _LIB is None:
        from embedmesh.serving import native

        _LIB = native.library() or False
    return _LIB or None


_LIB: Any = None  # None: not tried yet; False: unavailable; else the ctypes library
_BACKENDS = ("native", "numba", "numpy")


def __getattr__(name):
    # HAVE_NUMBA: whether the numba backend can be used (asking imports numba);
    # HAVE_NATIVE: whether the C++ kernels can be used (asking builds or loads them)
    if name == "HAVE_NUMBA":
        return _numba_kernels() is not None
    if name == "HAVE_NATIVE":
        return _native_library() is not None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_backend() -> str:
    """The implementation the kernels use now: "native", "numba" or "numpy"."""
    global _backend
    if _backend is None:
        if _native_library() is not None:
            _backend = "native"
        else:
            _backend = "numba" if _numba_kernels() is not None else "numpy"
    return _backend


def set_backend(name: str) -> str:
    """Select "native" (the C++ kernels; needs a C++ compiler or the built library),
    "numba" (requires numba) or "numpy"; returns the previous backend."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(_BACKENDS)}")
    if name == "numba" and _numba_kernels() is None:
        raise RuntimeError(
            "the numba backend needs numba, which is not importable (or EMBEDMESH_NUMBA=0)"
        )
    if name == "native" and _native_library() is None:
        from embedmesh.serving import native

        raise RuntimeError(f"the native backend is unavailable: {native.reason()}")
    previous, _backend = get_backend(), name
    return previous


class _Lease:
    """One output buffer handed out. numpy reads its memory through
    `__array_interface__`, so the array made over it, every numpy view of that array
    and every jax.Array aliasing it (`device_put(..., may_alias=True)` holds the
    numpy array) keep this object alive; when the last of them goes, `__del__` gives
    the memory back to the pool, in O(1), with no scan of reference counts."""

    __slots__ = ("__array_interface__", "_raw", "_pool")

    def __del__(self) -> None:
        try:
            self._pool._give_back(self._raw)
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be gone
            pass


class _BufferPool:
    """Output buffers reused once nothing references them any more.

    On the serving machine (a VM) the first touch of fresh memory costs
    ~0.45 ms per MB in page faults: 3.7 ms for eight 1 MB outputs against
    0.15 ms to rewrite reused ones, as much as the lookup itself. Each buffer
    handed out is an array over a `_Lease`, which returns the memory when the
    last array over it is gone; buffers are matched by byte size.

    `limit` bounds the bytes of free buffers kept (the oldest freed go first),
    not the buffers in use: those are the caller's outputs. A caller that holds
    one result while it asks for the next (a serving loop) needs two requests'
    outputs in the pool; counting the held ones against the limit made every
    request over half the limit allocate afresh and fault its pages in (dense
    dim 128, batch 4096 x 10, 8 tables: 168 MB a request, 29.6 against 18.8 ms
    a call; benchmarks/RESULTS_serving.md, seventh session).
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        # byte size -> free raw buffers of that size, oldest first (`_aligned_raw`)
        self._free: dict[int, list[list]] = {}
        self._free_bytes = 0
        self.release = None  # called before allocating afresh (see set_release_hook)
        # re-entrant: a lease's __del__ may run inside this pool's own allocation (the
        # cyclic garbage collector runs there) and give a buffer back
        self._lock = threading.RLock()

    def empty(self, shape, dtype) -> np.ndarray:
        return self.empty_at(shape, dtype)[0]

    def empty_at(self, shape, dtype) -> tuple[np.ndarray, int]:
        """`empty`, and the array's address (kept with the buffer: reading it from
        numpy costs ~1 us, and a call takes 8+ buffers)."""
        # cheap on purpose: the serving lookup takes 8+ buffers per call, on caches
        # its kernels have just flushed
        dtype = np.dtype(dtype)
        shape = tuple(map(int, shape))
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or dtype.hasobject:
            out = aligned_empty(shape, dtype)
            return out, address(out)
        raw = self._take(nbytes)
        if raw is None and self.release is not None:
            self.release()  # jax.Arrays deleted but not yet released give theirs back
            raw = self._take(nbytes)
        if raw is None:
            raw = _aligned_raw(nbytes)
        lease = _Lease()
        lease._raw, lease._pool = raw, self
        if dtype.isbuiltin != 1:  # ml_dtypes' bfloat16, structured: bytes, viewed as the dtype
            lease.__array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (raw[1], False),
                "version": 3,
            }
            return np.asarray(lease).view(dtype).reshape(shape), raw[1]
        key = (shape, dtype.str)  # numpy's own dtypes: the type string says it all
        if raw[3] != key:  # a buffer mostly comes back for the same shape: its interface kept
            raw[3] = key
            raw[4] = {"shape": shape, "typestr": dtype.str, "data": (raw[1], False), "version": 3}
        lease.__array_interface__ = raw[4]
        return np.asarray(lease), raw[1]

    def _take(self, nbytes: int):
        with self._lock:
            free = self._free.get(nbytes)
            if not free:
                return None
            raw = free.pop()  # the most recently freed: the likeliest still in cache
            self._free_bytes -= nbytes
            return raw

    def _give_back(self, raw: list) -> None:
        nbytes = raw[2]
        with self._lock:
            if nbytes > self.limit:
                return
            while self._free_bytes + nbytes > self.limit:  # the oldest freed go first
                size, free = next((k, v) for k, v in self._free.items() if v)
                free.pop(0)
                self._free_bytes -= size
            self._free.setdefault(nbytes, []).append(raw)
            self._free_bytes += nbytes

    def free_bytes(self) -> int:
        """Bytes of free buffers kept for reuse."""
        return self._free_bytes

    def clear(self) -> None:
        with self._lock:
            self._free, self._free_bytes = {}, 0


def _aligned_raw(nbytes: int) -> list:
    """A fresh buffer: `[raw, address, nbytes, key, interface]`, where raw is a uint8
    array with room for `nbytes` from its 64-byte aligned `address` on, and `interface`
    the `__array_interface__` last handed out over it, for (shape, type string) `key`."""
    raw, start = _runtime.aligned_buffer(nbytes, _ALIGN)
    return [raw, address(raw) + start, nbytes, None, None]


_pool = _BufferPool(_runtime.output_pool_bytes())  # EMBEDMESH_OUTPUT_POOL_MB


def set_release_hook(fn) -> None:
    """`fn()` lets owners of outputs drop references they hold only lazily (jaxlib
    defers releasing a deleted jax.Array's numpy buffer); called before the pool
    allocates a fresh buffer."""
    _pool.release = fn


def set_output_pool_limit(nbytes: int) -> int:
    """Bytes of free output buffers kept for reuse (0: none; the outputs in use do not
    count); returns the previous limit."""
    previous, _pool.limit = _pool.limit, int(nbytes)
    _pool.clear()
    return previous


def output_empty(shape, dtype) -> np.ndarray:
    """An aligned output array, from the reuse pool when one is free."""
    return _pool.empty(shape, dtype)


def output_empty_at(shape, dtype) -> tuple[np.ndarray, int]:
    """`output_empty`, and the array's address."""
    return _pool.empty_at(shape, dtype)


class BadSparseIndex(ValueError):
    """A sparse index outside dense_shape or out of row-major order; `entry` is its
    position in the indices (see `prepare_sparse_bag_combine`)."""

    def __init__(self, entry: int):
        self.entry = int(entry)
        super().__init__(f"bad sparse index at entry {self.entry}")


class IdOutOfRange(ValueError):
    """An id outside [0, vocabulary_size); `entry` is its position in the ids."""

    def __init__(self, entry: int, id_: int, vocabulary_size: int):
        self.entry, self.id, self.vocabulary_size = int(entry), int(id_), int(vocabulary_size)
        super().__init__(
            f"ids must lie in [0, {self.vocabulary_size}), got id {self.id} at entry {self.entry}"
        )


def _prepare(table, ids, rows, weights, num_rows):
    """Validated (table, ids, rows, weights) with canonical dtypes."""
    table = np.asarray(table)
    ids = np.asarray(ids)
    rows = np.asarray(rows)
    if table.ndim != 2:
        raise ValueError(f"table must be 2-D [vocabulary, dim], got shape {table.shape}")
    if ids.dtype.kind not in "iu" or rows.dtype.kind not in "iu":
        raise TypeError(f"ids and rows must be integers, got {ids.dtype} and {rows.dtype}")
    n = ids.shape[0] if ids.ndim == 1 else -1
    if ids.ndim != 1 or np.shape(rows) != (n,) or np.shape(weights) != (n,):
        raise ValueError(
            f"ids {ids.shape}, rows {np.shape(rows)} and weights "
            f"{np.shape(weights)} must be 1-D of one length"
        )
    num_rows = int(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    return table, ids, rows, weights, num_rows


def _check_ids(ids, vocab):
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"ids must lie in [0, {vocab}), got [{lo}, {hi}]")


def _rows_error(rows, num_rows) -> ValueError:
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        return ValueError(
            f"rows must lie in [0, num_rows={num_rows}), got [{int(rows.min())}, {int(rows.max())}]"
        )
    return ValueError("rows must be non-decreasing")


def _is_plain_lookup(rows, weights, num_rows, mode) -> bool:
    """One entry per output row, in order, weight 1, no normalisation: a gather."""
    n = rows.shape[0]
    return (
        mode == 0
        and n == num_rows
        and bool(np.all(weights == 1.0))
        and np.array_equal(rows, np.arange(n))
    )


def _finish(out32: np.ndarray, dtype) -> np.ndarray:
    """The float32 accumulator as `dtype` (aligned; no copy for float32)."""
    if out32.dtype == dtype:
        return out32
    out = output_empty(out32.shape, dtype)
    out[...] = out32
    return out


def _signed_ids(ids: np.ndarray) -> tuple[np.ndarray, bool]:
    """ids as a signed integer array, and whether negative ids can be real.

    Unsigned ids are viewed as int64 (huge ones turn negative and then fail
    the range check), so the kernels never mix signed and unsigned compares.
    """
    if ids.dtype.kind == "u":
        return ids.astype(np.int64), False
    return ids, True


def _numba_ids(ids: np.ndarray) -> np.ndarray:
    """Signed ids as int64 for the numba kernels: one compile per kernel instead of one
    per id type (~3 CPU-s each on a cold cache; the copy of int32 ids costs less than
    the rows they fetch)."""
    ids, _ = _signed_ids(ids)
    return ids.astype(np.int64, copy=False)


def _check_offsets(offsets, n) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.shape[0] < 1 or offsets.dtype.kind not in "iu":
        raise ValueError(
            f"offsets must be a non-empty 1-D integer array, got {offsets.dtype} {offsets.shape}"
        )
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0 or offsets[-1] != n or (offsets[1:] < offsets[:-1]).any():
        raise ValueError(f"offsets must be non-decreasing from 0 to the number of ids ({n})")
    return offsets


def _drop_pruned(ids, offsets, weights, vocab, prune_ids, prune_w):
    """Drop pruned entries (ids, offsets, weights renumbered); IdOutOfRange for the
    first kept id outside [0, vocab)."""
    keep = ids >= 0 if prune_ids else None
    if prune_w and weights is not None:
        keep = weights > 0 if keep is None else keep & (weights > 0)
    bad = (ids < 0) | (ids >= vocab)
    if keep is not None:
        bad &= keep
    if ids.size and bad.any():
        k = int(np.argmax(bad))
        raise IdOutOfRange(k, ids[k], vocab)
    if keep is None or keep.all():
        return ids, offsets, weights
    kept_before = np.zeros(ids.shape[0] + 1, np.int64)
    np.cumsum(keep, out=kept_before[1:])
    return ids[keep], kept_before[offsets], None if weights is None else weights[keep]


# ---------------------------------------------------------------------------
# numpy backend


def _sum_sorted_numpy(table, ids, offsets, weights, mode) -> np.ndarray:
    """Float32 [rows, dim] sums of valid entries grouped by offsets, normalised."""
    num_rows, dim = offsets.shape[0] - 1, table.shape[1]
    out = output_empty((num_rows, dim), np.float32)
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


def _bag_numpy(table, ids, offsets, weights, mode, prune_ids, prune_w) -> np.ndarray:
    ids, offsets, weights = _drop_pruned(ids, offsets, weights, table.shape[0], prune_ids, prune_w)
    return _finish(_sum_sorted_numpy(table, ids, offsets, weights, mode), table.dtype)


def _gather_numpy(table, ids) -> np.ndarray:
    _drop_pruned(ids, None, None, table.shape[0], False, False)  # range check only
    return np.take(
        table, ids, axis=0, out=output_empty((ids.shape[0], table.shape[1]), table.dtype)
    )


def _sparse_offsets_numpy(indices, shape, num_rows):
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


def weighted_segment_sum_numpy(
    table: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    weights: np.ndarray,
    num_rows: int,
    combiner: str | None,
) -> np.ndarray:
    """`weighted_segment_sum` in plain numpy (the fallback when numba is absent)."""
    mode = combiner_code(combiner)
    table, ids, rows, weights, num_rows = _prepare(table, ids, rows, weights, num_rows)
    n = ids.shape[0]
    if n:
        _check_ids(ids, table.shape[0])
    if n and (int(rows[0]) < 0 or int(rows[-1]) >= num_rows or np.any(rows[1:] < rows[:-1])):
        raise _rows_error(rows, num_rows)
    if _is_plain_lookup(rows, weights, num_rows, mode):
        return _gather_numpy(table, ids)
    offsets = np.searchsorted(rows, np.arange(num_rows + 1), side="left")
    return _finish(_sum_sorted_numpy(table, ids, offsets, weights, mode), table.dtype)


# ---------------------------------------------------------------------------
# numba backend: calls into `embedmesh.serving.numba_kernels` (`_NUMBA`, loaded by
# `get_backend` / `set_backend` before any of these runs)

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NO_WEIGHTS = np.ones(1, np.float32)


def _gather_numba(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """np.take(table, ids, axis=0) via the prefetching numba kernel (any 1/2/4/8-byte
    dtype), checking the ids on the way (IdOutOfRange)."""
    return _prepare_gather_numba(table, ids)()


def _prepare_gather_numba(table: np.ndarray, ids: np.ndarray):
    uint = _UINT_OF_SIZE.get(table.dtype.itemsize)
    if uint is None or table.dtype.hasobject:
        return lambda: _gather_numpy(table, ids)
    out = output_empty((ids.shape[0], table.shape[1]), table.dtype)
    ids = _numba_ids(ids)
    row_bytes = table.shape[1] * table.dtype.itemsize
    if row_bytes % 64 == 0 and row_bytes and out.ctypes.data % 64 == 0 and table.flags.c_contiguous:
        kernel = _NUMBA.gather_streaming_kernel
        args = (table.view(np.uint8), ids, out.view(np.uint8))
    else:
        kernel, args = _NUMBA.gather_kernel, (table.view(uint), ids, out.view(uint))
    return _KernelCall(kernel, args, out, ids, table.shape[0])


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


def _widened_bag(gather, bag, table, ids, offsets, weights, mode, prune_ids, prune_w):
    """A bag kernel for a table of another dtype than float32 (float16, bfloat16: no
    arithmetic of theirs in the kernels): when run, prune, `gather` the rows, widen them
    to float32, then reduce them with the float32 `bag` kernel of the same backend."""

    def run():
        c_ids, c_offsets, c_w = _drop_pruned(
            ids, offsets, weights, table.shape[0], prune_ids, prune_w
        )
        wide = gather(table, c_ids).astype(np.float32)
        return bag(
            wide, np.arange(c_ids.shape[0], dtype=np.int64), c_offsets, c_w, mode, False, False
        )

    return run


def _bag_numba(table, ids, offsets, weights, mode, prune_ids, prune_w) -> np.ndarray:
    return _prepare_bag_numba(table, ids, offsets, weights, mode, prune_ids, prune_w)()


def _prepare_bag_numba(table, ids, offsets, weights, mode, prune_ids, prune_w):
    """The bag kernel ready to run, giving float32 sums; tables of other dtypes are
    pruned, gathered and widened when run."""
    if table.dtype != np.float32:
        return _widened_bag(
            _gather_numba, _bag_numba, table, ids, offsets, weights, mode, prune_ids, prune_w
        )
    out = output_empty((offsets.shape[0] - 1, table.shape[1]), np.float32)
    ids = _numba_ids(ids)
    has_w = weights is not None
    kernel = _NUMBA.bag_kernel(mode, has_w, prune_ids, prune_w)
    return _KernelCall(
        kernel,
        (table, ids, offsets, weights if has_w else _NO_WEIGHTS, out),
        out,
        ids,
        table.shape[0],
    )


def weighted_segment_sum_numba(
    table: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    weights: np.ndarray,
    num_rows: int,
    combiner: str | None,
) -> np.ndarray:
    """`weighted_segment_sum` with the numba kernels (requires numba)."""
    if _numba_kernels() is None:
        raise RuntimeError(
            "the numba backend needs numba, which is not importable (or EMBEDMESH_NUMBA=0)"
        )
    mode = combiner_code(combiner)
    table, ids, rows, weights, num_rows = _prepare(table, ids, rows, weights, num_rows)
    offsets = np.empty(num_rows + 1, np.int64)
    if not _NUMBA.rows_to_offsets(rows, num_rows, offsets):
        raise _rows_error(rows, num_rows)
    ids, _ = _signed_ids(ids)
    try:
        if _is_plain_lookup(rows, weights, num_rows, mode):
            return _gather_numba(table, ids)
        return _finish(_bag_numba(table, ids, offsets, weights, mode, False, False), table.dtype)
    except IdOutOfRange:
        _check_ids(ids, table.shape[0])  # the old message: the range of the ids
        raise


# ---------------------------------------------------------------------------
# native backend: the C++ kernels (`embedmesh/serving/cpu/serving.cc`) through ctypes
# (`_LIB`, loaded by `get_backend` / `set_backend` before any of these runs); ctypes
# releases the GIL for each call.


class _NativeCall:
    """A C++ kernel with its checked arguments (raw addresses), the arrays behind them
    (`keep`: alive until it has run) and its output, run later (see `_KernelCall`):
    alone (calling it), or with a request's other kernels (`run_native`,
    `NativeRequest`; `words`: its task for `EmServingRun`, whose task `kind` it is:
    0 bag, 1 sparse bag, 2 gather, 3 sparse offsets + bag)."""

    __slots__ = ("fn", "args", "keep", "out", "ids", "vocab", "kind", "_words")

    def __init__(self, fn, args, keep, out, ids, vocab, kind):
        self.fn, self.args, self.keep, self.out = fn, args, keep, out
        self.ids, self.vocab = ids, vocab
        self.kind = kind
        self._words = None

    def __call__(self) -> np.ndarray:
        if self.fn is None:  # a task only EmServingRun runs (kind 3)
            return self.finish(run_native([self], 1)[0])
        return self.finish(self.fn(*self.args))

    def words(self) -> tuple:
        """Its task row for `EmServingRun`: the kind, then the arguments (None as 0)."""
        if self._words is None:
            w = (self.kind, *[0 if a is None else a for a in self.args])
            self._words = w + (0,) * (TASK_WORDS - len(w))
        return self._words

    def finish(self, bad: int) -> np.ndarray:
        """The output, given what the kernel returned (an error raised)."""
        if bad >= 0:
            raise IdOutOfRange(bad, self.ids[bad], self.vocab)
        return self.out


TASK_WORDS = 20  # EM_TASK_WORDS (serving.h)


def run_native(calls: list, threads: int) -> list:
    """Run prepared `_NativeCall`s (a request's kernels) in one C++ call on `threads`
    threads (`EmServingRun`: chunks of whole bags, a pool of threads that sleep between
    requests); return what each kernel returned, for its `finish`."""
    return run_tasks(array.array("q", [w for c in calls for w in c.words()]), threads)


def run_tasks(words: array.array, threads: int) -> list:
    """Run the tasks whose `TASK_WORDS` words each (`EmServingRun`'s rows) `words` holds,
    in one C++ call on `threads` threads; return each task's result."""
    n = len(words) // TASK_WORDS
    results = array.array("q", bytes(8 * n))
    bad = _LIB.EmServingRun(
        words.buffer_info()[0], n, max(int(threads), 1), results.buffer_info()[0]
    )
    if bad >= 0:  # pragma: no cover - every kind here is one the library knows
        raise RuntimeError(f"EmServingRun: unknown task kind in task {bad}")
    return results.tolist()


def runner_addresses() -> tuple[int, int, int, int]:
    """The addresses of EmServingOpen, Add, Close and ThreadsForEntries (for the
    compiled request path, `embedmesh.serving._request.bind`)."""
    return tuple(  # type: ignore[return-value]
        ctypes.cast(getattr(_LIB, name), ctypes.c_void_p).value
        for name in (
            "EmServingOpen",
            "EmServingAdd",
            "EmServingClose",
            "EmServingThreadsForEntries",
        )
    )


def threads_for_entries(entries: int, threads: int) -> int:
    """Threads of `threads` that a request of `entries` ids runs on (the C++ runner's
    rule: enough entries a thread to be worth waking it)."""
    return _LIB.EmServingThreadsForEntries(int(entries), int(threads))


class NativeRequest:
    """A request's C++ kernels handed over one by one as they are prepared
    (`EmServingOpen` / `Add` / `Close`): with more than one thread, the pool starts on
    the first feature while the caller prepares the next. `close()` must follow
    `open`, whatever happens in between (it waits for the kernels already running,
    which write into buffers the caller owns)."""

    __slots__ = ("_handle", "_tasks", "_addr", "calls")

    def __init__(self, max_tasks: int, threads: int):
        self._tasks = np.zeros((max(max_tasks, 1), TASK_WORDS), np.int64)
        self._addr = address(self._tasks)
        self.calls: list = []
        self._handle = _LIB.EmServingOpen(max_tasks, max(int(threads), 1))

    def add(self, call) -> None:
        """Hand `call` (a `_NativeCall`) to the pool now."""
        self.add_words(call.words())
        self.calls[-1] = call

    def add_words(self, words) -> None:
        """Hand a task given as its `TASK_WORDS` words (a sequence of ints) to the pool now."""
        i = len(self.calls)
        self._tasks[i] = words
        if _LIB.EmServingAdd(self._handle, self._addr + i * TASK_WORDS * 8) != -1:
            raise RuntimeError("EmServingAdd: an unknown task kind, or more than max_tasks")
        self.calls.append(None)

    def close(self) -> list:
        """Wait for every added call; what each returned, for its `finish`."""
        results = np.empty(max(len(self.calls), 1), np.int64)
        handle, self._handle = self._handle, None
        if handle is not None:
            _LIB.EmServingClose(handle, address(results))
        return results[: len(self.calls)].tolist()


def native_in_use() -> bool:
    """Whether the lookup's kernels are the C++ ones now (the backend in use)."""
    return (_backend or get_backend()) == "native"


def is_native_call(run) -> bool:
    """Whether `run` (from a prepare_* function) can go to `run_native`."""
    return type(run) in (_NativeCall, _NativeSparseCall)


def _native_ids(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Signed ids as a contiguous int32 or int64 array, and whether they are int64."""
    if ids.dtype == np.int64 or ids.dtype == np.int32:
        ids = np.ascontiguousarray(ids)
    else:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
    return ids, int(ids.dtype == np.int64)


def _row_major(table: np.ndarray) -> np.ndarray:
    """The table, or a contiguous copy if its rows are not each contiguous."""
    item = table.dtype.itemsize
    if table.strides[1] == item and table.strides[0] >= 0 and table.strides[0] % item == 0:
        return table
    return np.ascontiguousarray(table)


def address(a: np.ndarray) -> int:
    """The data address of an array: through ctypes' view of a writable contiguous
    buffer (~0.3 us), else numpy's interface (~1.1 us; read-only, strided or empty
    arrays). A request takes 3-5 addresses a feature."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]


def _prepare_gather_native(table: np.ndarray, ids: np.ndarray):
    if table.dtype.hasobject or table.dtype.itemsize == 0:
        return lambda: _gather_numpy(table, ids)
    table = _row_major(table)
    out, out_addr = _pool.empty_at((ids.shape[0], table.shape[1]), table.dtype)
    ids, is64 = _native_ids(ids)
    args = (
        address(table),
        table.shape[0],
        table.shape[1] * table.dtype.itemsize,
        table.strides[0],
        address(ids),
        is64,
        ids.shape[0],
        out_addr,
    )
    return _NativeCall(_LIB.EmServingGather, args, (table, ids), out, ids, table.shape[0], 2)


def _bag_native(table, ids, offsets, weights, mode, prune_ids, prune_w) -> np.ndarray:
    return _prepare_bag_native(table, ids, offsets, weights, mode, prune_ids, prune_w)()


def _prepare_bag_native(table, ids, offsets, weights, mode, prune_ids, prune_w):
    """The C++ bag kernel ready to run, giving float32 sums; tables of other dtypes are
    pruned, gathered and widened when run."""
    if table.dtype != np.float32:
        gather = lambda t, i: _prepare_gather_native(t, i)()
        return _widened_bag(
            gather, _bag_native, table, ids, offsets, weights, mode, prune_ids, prune_w
        )
    table = _row_major(table)
    num_rows, dim = offsets.shape[0] - 1, table.shape[1]
    out, out_addr = _pool.empty_at((num_rows, dim), np.float32)
    ids, is64 = _native_ids(ids)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    has_w = weights is not None
    args = (
        address(table),
        table.shape[0],
        dim,
        table.strides[0] // 4,
        address(ids),
        is64,
        address(offsets),
        num_rows,
        address(weights) if has_w else None,
        mode,
        int(prune_ids),
        int(prune_w and has_w),
        out_addr,
        dim,
    )
    keep = (table, ids, offsets, weights)
    return _NativeCall(_LIB.EmServingBagF32, args, keep, out, ids, table.shape[0], 0)


def _rows_to_offsets_native(rows: np.ndarray, num_rows: int) -> np.ndarray | None:
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    offsets = np.empty(num_rows + 1, np.int64)
    bad = _LIB.EmServingRowsToOffsets(address(rows), rows.shape[0], num_rows, address(offsets))
    return offsets if bad < 0 else None


def weighted_segment_sum_native(
    table: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    weights: np.ndarray,
    num_rows: int,
    combiner: str | None,
) -> np.ndarray:
    """`weighted_segment_sum` with the C++ kernels (requires them)."""
    if _native_library() is None:
        from embedmesh.serving import native

        raise RuntimeError(f"the native backend is unavailable: {native.reason()}")
    mode = combiner_code(combiner)
    table, ids, rows, weights, num_rows = _prepare(table, ids, rows, weights, num_rows)
    offsets = _rows_to_offsets_native(rows, num_rows)
    if offsets is None:
        raise _rows_error(rows, num_rows)
    ids, _ = _signed_ids(ids)
    try:
        if _is_plain_lookup(rows, weights, num_rows, mode):
            return _prepare_gather_native(table, ids)()
        return _finish(_bag_native(table, ids, offsets, weights, mode, False, False), table.dtype)
    except IdOutOfRange:
        _check_ids(ids, table.shape[0])  # the old message: the range of the ids
        raise


class _NativeSparseCall(_NativeCall):
    """`EmServingSparseBagF32` with its arguments: -2 - k names a bad index k."""

    __slots__ = ()

    def finish(self, bad: int) -> np.ndarray:
        if bad >= 0:
            raise IdOutOfRange(bad, self.ids[bad], self.vocab)
        if bad < -1:
            raise BadSparseIndex(-2 - bad)
        return self.out


_MAX_FUSED_DIM: list = []  # [EmServingMaxFusedDim()] once asked
# Widest rows given to the one-pass sparse kernel. Same process, interleaved with torch,
# 8 x 1M tables, sparse/sum (benchmarks/serving_sparse_ab.py): one pass 1.30x / 1.17x /
# 1.08-1.11x the speed of offsets then bag at dims 16 / 32 / 64, 0.94-0.95x at dim 128
# (2026-12-03, wall clock); once the bag kernel prefetched only the first line of rows
# over 3 lines (same day, thread CPU time, 11 rounds): 1.22x / 1.00x / 0.83x at 16 / 32 /
# 64, so dims over 32 took the offsets pass and the bag kernel. Once the bag kernel's
# walk was cut to ~14 instructions an entry and the offsets pass went 8 entries a step
# (later the same day, quiet machine, thread CPU time, 11 rounds): one pass 0.95x / 0.89x
# at dims 16 / 32 (0.78x at 64), so no dim takes it now: 0. The kernel stays, the
# baseline of that A/B (serving_sparse_ab.py) and tested as any other.
SPARSE_ONE_PASS_MAX_DIM = 0


def prepare_sparse_bag_combine(
    table,
    ids,
    indices,
    dense_shape,
    weights=None,
    combiner=None,
    *,
    prune_ids=False,
    prune_weights=False,
):
    """`prepare_bag_combine` for 2-D sparse input whose bags are the rows of COO
    `indices [n, 2]`, checked (inside `dense_shape`, row-major order, no repeats)
    when the kernels run, not now: the run raises `BadSparseIndex(k)` for the first
    bad index (before any bad id), `IdOutOfRange` as `bag_combine`. Dims up to
    `SPARSE_ONE_PASS_MAX_DIM` check the indices in the bag kernel's own pass;
    wider rows derive the bag offsets first, in `run_native`'s first phase (in
    parallel over features, no Python between). Only with the C++ kernels, a float32
    table, signed int32/int64 ids and indices; None otherwise (the caller takes
    `sparse_offsets` + `prepare_bag_combine`)."""
    if (_backend or get_backend()) != "native":
        return None
    table = np.asarray(table)
    ids = np.asarray(ids)
    indices = np.asarray(indices)
    if (
        table.dtype != np.float32
        or table.ndim != 2
        or ids.ndim != 1
        or indices.ndim != 2
        or indices.shape != (ids.shape[0], 2)
        or len(dense_shape) != 2
        or ids.dtype not in (np.int32, np.int64)
        or indices.dtype not in (np.int32, np.int64)
    ):
        return None
    if not _MAX_FUSED_DIM:
        _MAX_FUSED_DIM.append(int(_LIB.EmServingMaxFusedDim()))
    dim = table.shape[1]
    if dim <= 0:
        return None
    one_pass = dim <= min(_MAX_FUSED_DIM[0], SPARSE_ONE_PASS_MAX_DIM)
    mode = combiner_code(combiner)
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != ids.shape:
            raise ValueError(f"weights {weights.shape} must match ids {ids.shape}")
    table = _row_major(table)
    ids = np.ascontiguousarray(ids)
    indices = np.ascontiguousarray(indices)
    num_rows, num_cols = int(dense_shape[0]), int(dense_shape[1])
    out, out_addr = _pool.empty_at((num_rows, dim), np.float32)
    has_w = weights is not None
    args = (
        address(table),
        table.shape[0],
        dim,
        table.strides[0] // 4,
        address(ids),
        int(ids.dtype == np.int64),
        address(indices),
        int(indices.dtype == np.int64),
        ids.shape[0],
        num_rows,
        num_cols,
        address(weights) if has_w else None,
        mode,
        int(prune_ids),
        int(prune_weights and has_w),
        out_addr,
        dim,
    )
    keep = (table, ids, indices, weights)
    if one_pass:
        fn = _LIB.EmServingSparseBagF32
        return _NativeSparseCall(fn, args, keep, out, ids, table.shape[0], 1)
    offsets = np.empty(num_rows + 1, np.int64)  # written by the run's first phase
    bag_args = (*args[:6], address(offsets), num_rows, *args[11:])
    more = (address(indices), int(indices.dtype == np.int64), ids.shape[0], num_cols)
    keep = (*keep, offsets)
    return _NativeSparseCall(None, (*bag_args, *more), keep, out, ids, table.shape[0], 3)


def _sparse_offsets_native(indices, shape, num_rows):
    rank = shape.shape[0]
    if indices.ndim != 2 or indices.shape[1] != rank or rank < 1:
        return None
    if indices.dtype != np.int64 and indices.dtype != np.int32:
        indices = indices.astype(np.int64)
    indices = np.ascontiguousarray(indices)
    shape = np.ascontiguousarray(shape, dtype=np.int64)
    offsets = np.empty(num_rows + 1, np.int64)
    bad = _LIB.EmServingSparseOffsets(
        address(indices),
        int(indices.dtype == np.int64),
        indices.shape[0],
        rank,
        address(shape),
        address(offsets),
    )
    return (offsets, -1) if bad < 0 else (None, int(bad))


def weighted_segment_sum(
    table: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    weights: np.ndarray,
    num_rows: int,
    combiner: str | None,
) -> np.ndarray:
    """out[r] = sum w_k table[ids_k] over k with rows_k == r, normalised by `combiner`.

    `rows` must be non-decreasing and lie in [0, num_rows) (ValueError
    otherwise, as for ids outside the table); rows with no entry are zero.
    combiner None or "sum": no normalisation; "mean": divide by sum w;
    "sqrtn": divide by sqrt(sum w^2); a zero denominator gives a zero row
    (TensorFlow's div_no_nan). Accumulates in float32, in entry order, and
    returns a new, 64-byte aligned `[num_rows, dim]` array of the table's
    dtype. Uses the numba backend when numba is importable (see
    `set_backend`); both backends give the same values.
    """
    backend = _backend or get_backend()
    if backend == "native":
        return weighted_segment_sum_native(table, ids, rows, weights, num_rows, combiner)
    if backend == "numba":
        return weighted_segment_sum_numba(table, ids, rows, weights, num_rows, combiner)
    return weighted_segment_sum_numpy(table, ids, rows, weights, num_rows, combiner)


def bag_combine(
    table: np.ndarray,
    ids: np.ndarray,
    offsets: np.ndarray,
    weights: np.ndarray | None = None,
    combiner: str | None = None,
    *,
    prune_ids: bool = False,
    prune_weights: bool = False,
) -> np.ndarray:
    """Combine the bags `ids[offsets[r]:offsets[r+1]]`: out[r] = sum w_k table[ids_k], normalised.

    The serving lookup's kernel, fed straight from ragged row_splits or
    sparse row offsets (no per-entry row array). `offsets` runs from 0 to
    len(ids), non-decreasing; `weights` None means all ones. With
    `prune_ids`, ids < 0 are skipped; with `prune_weights`, entries whose
    weight is not > 0 (TensorFlow's safe lookup). Kept ids outside the table
    raise `IdOutOfRange` (a ValueError) naming the first such entry.
    Combiners, accumulation order and output as `weighted_segment_sum`.
    """
    return prepare_bag_combine(
        table, ids, offsets, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )()


def prepare_bag_combine(
    table,
    ids,
    offsets,
    weights=None,
    combiner=None,
    *,
    prune_ids: bool = False,
    prune_weights: bool = False,
    offsets_checked: bool = False,
):
    """`bag_combine` in two steps: checks the arguments and takes the output buffer
    now, and returns a function that runs the kernel (raising `IdOutOfRange`)
    and returns the output. Lets a caller run many kernels back to back.
    `offsets_checked`: the caller has already checked that `offsets` is a 1-D
    integer array running non-decreasing from 0 to len(ids) (ragged row_splits
    validated by `inputs.validate_structure`)."""
    mode = combiner_code(combiner)
    table = np.asarray(table)
    ids = np.asarray(ids)
    if table.ndim != 2 or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"table must be 2-D and ids 1-D integers, got {table.shape} and {ids.dtype} {ids.shape}"
        )
    if offsets_checked:
        offsets = np.asarray(offsets).astype(np.int64, copy=False)
    else:
        offsets = _check_offsets(offsets, ids.shape[0])
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != ids.shape:
            raise ValueError(f"weights {weights.shape} must match ids {ids.shape}")
    given = ids
    ids, can_be_negative = _signed_ids(ids)
    prune_ids = prune_ids and can_be_negative
    prune_weights = prune_weights and weights is not None
    backend = _backend or get_backend()
    if backend == "native":
        run = _prepare_bag_native(table, ids, offsets, weights, mode, prune_ids, prune_weights)
        if table.dtype != np.float32:
            run = functools.partial(_finish_run, run, table.dtype)
    elif backend == "numba":
        run = _prepare_bag_numba(table, ids, offsets, weights, mode, prune_ids, prune_weights)
        if table.dtype != np.float32:
            run = functools.partial(_finish_run, run, table.dtype)
    else:
        run = functools.partial(
            _bag_numpy, table, ids, offsets, weights, mode, prune_ids, prune_weights
        )
    return _report_given_ids(run, given)


def _finish_run(run, dtype) -> np.ndarray:
    """`run()`'s float32 result as `dtype`."""
    return _finish(run(), dtype)


def gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table[ids] for 1-D ids, bit for bit, into a new 64-byte aligned array;
    ids outside the table raise `IdOutOfRange`."""
    return prepare_gather(table, ids)()


def prepare_gather(table, ids):
    """`gather` in two steps, as `prepare_bag_combine`."""
    table = np.asarray(table)
    ids = np.asarray(ids)
    if table.ndim != 2 or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"table must be 2-D and ids 1-D integers, got {table.shape} and {ids.dtype} {ids.shape}"
        )
    backend = _backend or get_backend()
    if backend == "native":
        return _report_given_ids(_prepare_gather_native(table, _signed_ids(ids)[0]), ids)
    if backend == "numba":
        return _report_given_ids(_prepare_gather_numba(table, ids), ids)
    return _report_given_ids(lambda: _gather_numpy(table, _signed_ids(ids)[0]), ids)


def _report_given_ids(run, given: np.ndarray):
    """`run`, its IdOutOfRange naming the id as given: uint64 ids are viewed as
    int64 by the kernels, so 2**64 - 1 would read -1. Other dtypes: `run` itself."""
    if given.dtype != np.uint64:
        return run

    def checked():
        try:
            return run()
        except IdOutOfRange as e:
            raise IdOutOfRange(e.entry, given[e.entry], e.vocabulary_size) from None

    return checked


def sparse_offsets(indices: np.ndarray, dense_shape: tuple) -> tuple[np.ndarray | None, int]:
    """Bag offsets over the flattened leading dims of COO `indices [n, rank]`.

    Returns (offsets [prod(dense_shape[:-1]) + 1], -1) when every index lies
    in `dense_shape` and follows the previous one in row-major order without
    repeats, else (None, k) for the first entry k breaking that. One pass.
    """
    indices = np.asarray(indices)
    shape = np.asarray(dense_shape, np.int64)
    num_rows = int(np.prod(shape[:-1]))
    backend = _backend or get_backend()
    if backend == "native":
        done = _sparse_offsets_native(indices, shape, num_rows)
        if done is not None:
            return done
    elif backend == "numba":
        offsets = np.empty(num_rows + 1, np.int64)
        if shape.shape[0] == 2 and indices.ndim == 2 and indices.shape[1] == 2:
            bad = _NUMBA.sparse_offsets_2d(indices, shape[0], shape[1], offsets)
        else:
            bad = _NUMBA.sparse_offsets_kernel(indices, shape, offsets)
        return (offsets, -1) if bad < 0 else (None, int(bad))
    return _sparse_offsets_numpy(indices, tuple(int(d) for d in shape), num_rows)
