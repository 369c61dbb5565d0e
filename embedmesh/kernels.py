"""Host (CPU) kernels over numpy memory, used where XLA's CPU gather is slow.

`weighted_segment_sum` is the serving lookup's inner loop: gather rows,
scale, sum per output row, normalise. Rows arrive sorted (row-major inputs).

Two backends compute the same thing:

- "numba" (the default when numba is importable): one sequential pass over
  the entries, software-prefetching the table rows a few entries ahead, each
  output row accumulated in float32 in entry order and then normalised; no
  intermediate [nnz, dim] array. On the serving benchmark (8 tables x 1M x
  64, Zipf ids; benchmarks/RESULTS_serving.md) it is 3-4x the numpy backend
  and ~7x the original reduceat version. A `prange` version was no faster on
  2 shared cores and, under OpenMP, up to 10x slower whenever the other core
  is busy, so the kernel is single-threaded and releases the GIL (nogil).
- "numpy" (always available): gather, scale, then a segment sum done per
  group of equal-length rows as `[rows, L, dim].sum(axis=1)`.

`set_backend` switches between them (tests, benchmarks); the environment
variable `EMBEDMESH_NUMBA=0` (read at import) disables numba altogether.
Outputs are 64-byte aligned so `jax.device_put(out, may_alias=True)` can wrap
them without a copy.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

try:  # numba is optional: the numpy backend computes the same thing.
    if os.environ.get("EMBEDMESH_NUMBA", "1").strip().lower() in ("0", "false", "no", "off"):
        raise ImportError("disabled by EMBEDMESH_NUMBA")
    import numba as _numba
    from llvmlite import binding as _llvm_binding
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic as _intrinsic
except ImportError:  # pragma: no cover - exercised when numba is absent
    _numba = None

HAVE_NUMBA = _numba is not None

# Which implementation `weighted_segment_sum` runs: "numba" or "numpy".
_backend = "numba" if HAVE_NUMBA else "numpy"

_COMBINER_MODE = {None: 0, "sum": 0, "mean": 1, "sqrtn": 2}
_ALIGN = 64  # bytes; XLA's CPU client aliases host buffers aligned like this


def get_backend() -> str:
    """The implementation `weighted_segment_sum` uses now: "numba" or "numpy"."""
    return _backend


def set_backend(name: str) -> str:
    """Select "numba" (requires numba) or "numpy"; returns the previous backend."""
    global _backend
    if name not in ("numba", "numpy"):
        raise ValueError(f"unknown backend {name!r}: expected 'numba' or 'numpy'")
    if name == "numba" and not HAVE_NUMBA:
        raise RuntimeError("the numba backend needs numba, which is not importable")
    previous, _backend = _backend, name
    return previous


def aligned_empty(shape, dtype) -> np.ndarray:
    """`np.empty(shape, dtype)` whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-buf.ctypes.data) % _ALIGN
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def _mode_of(combiner: Optional[str]) -> int:
    try:
        return _COMBINER_MODE[combiner]
    except (KeyError, TypeError):
        raise ValueError(f"unknown combiner {combiner!r}: expected None, 'sum', 'mean' or "
                         f"'sqrtn'") from None


def _prepare(table, ids, rows, weights, num_rows, check_ids=True):
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
        raise ValueError(f"ids {ids.shape}, rows {np.shape(rows)} and weights "
                         f"{np.shape(weights)} must be 1-D of one length")
    num_rows = int(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if n and check_ids:
        _check_ids(ids, table.shape[0])
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    return table, ids, rows, weights, num_rows


def _check_ids(ids, vocab):
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"ids must lie in [0, {vocab}), got [{lo}, {hi}]")


def _rows_error(rows, num_rows) -> ValueError:
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        return ValueError(f"rows must lie in [0, num_rows={num_rows}), got "
                          f"[{int(rows.min())}, {int(rows.max())}]")
    return ValueError("rows must be non-decreasing")


def _is_plain_lookup(rows, weights, num_rows, mode) -> bool:
    """One entry per output row, in order, weight 1, no normalisation: a gather."""
    n = rows.shape[0]
    return (mode == 0 and n == num_rows and bool(np.all(weights == 1.0))
            and np.array_equal(rows, np.arange(n)))


def _finish(out32: np.ndarray, dtype) -> np.ndarray:
    """The float32 accumulator as `dtype` (aligned; no copy for float32)."""
    if out32.dtype == dtype:
        return out32
    out = aligned_empty(out32.shape, dtype)
    out[...] = out32
    return out


# ---------------------------------------------------------------------------
# numpy backend


def weighted_segment_sum_numpy(table: np.ndarray, ids: np.ndarray, rows: np.ndarray,
                               weights: np.ndarray, num_rows: int,
                               combiner: Optional[str]) -> np.ndarray:
    """`weighted_segment_sum` in plain numpy (the fallback when numba is absent)."""
    mode = _mode_of(combiner)
    table, ids, rows, weights, num_rows = _prepare(table, ids, rows, weights, num_rows)
    n, dim = ids.shape[0], table.shape[1]
    if n and (int(rows[0]) < 0 or int(rows[-1]) >= num_rows or np.any(rows[1:] < rows[:-1])):
        raise _rows_error(rows, num_rows)
    if _is_plain_lookup(rows, weights, num_rows, mode):
        return np.take(table, ids, axis=0, out=aligned_empty((n, dim), table.dtype))
    out = aligned_empty((num_rows, dim), np.float32)
    out[...] = 0.0
    if n == 0:
        return _finish(out, table.dtype)
    gathered = np.take(table, ids, axis=0).astype(np.float32, copy=False)
    if not np.all(weights == 1.0):
        gathered *= weights[:, None]
    # Entries of output row r are [offsets[r], offsets[r + 1]) (rows are sorted).
    offsets = np.searchsorted(rows, np.arange(num_rows + 1), side="left")
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
        wd = weights if mode == 1 else weights * weights
        den = np.zeros(num_rows, np.float32)
        nonempty = lengths > 0
        den[nonempty] = np.add.reduceat(wd, offsets[:-1][nonempty])
        if mode == 2:
            den = np.sqrt(den)
        zero = den == 0
        np.divide(out, den[:, None], out=out, where=~zero[:, None])
        out[zero] = 0.0
    return _finish(out, table.dtype)


# ---------------------------------------------------------------------------
# numba backend

_PREFETCH_AHEAD = 16  # entries ahead; measured: 8-24 alike, 32 worse (1M x 64 f32 tables)
# Only a row's first cache line is prefetched: on 1M x 64 f32 tables that ran
# ~1.2x faster than prefetching all four lines, and alike for 128-wide rows.

if HAVE_NUMBA:
    _PREFETCH_FN = ("llvm.prefetch.p0" if _llvm_binding.llvm_version_info[0] >= 17
                    else "llvm.prefetch.p0i8")

    @_intrinsic
    def _prefetch(typingctx, arr, row, col):  # pragma: no cover (compiled)
        """Hint the CPU to load the cache line of arr[row, col] (never faults)."""
        sig = _types.void(arr, row, col)

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = _cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]],
                                            wraparound=False)
            i8p = _ir.IntType(8).as_pointer()
            i32 = _ir.IntType(32)
            fnty = _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32])
            fn = _cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_FN)
            # read, high temporal locality, data cache
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return sig, codegen

    @_numba.njit(cache=True, nogil=True)
    def _row_offsets(ids, vocab, rows, num_rows, offsets):  # pragma: no cover (compiled)
        """One pass: fill offsets[0..num_rows] and check ids and rows.

        Returns 0 when every id is in [0, vocab) and rows are non-decreasing
        in [0, num_rows); 1 for a bad id; 2 for bad rows.
        """
        n = rows.shape[0]
        for k in range(n):
            i = ids[k]
            if i < 0 or i >= vocab:
                return 1
        cur = 0
        offsets[0] = 0
        prev = 0
        for k in range(n):
            row = rows[k]
            if row < prev or row >= num_rows:
                return 2
            while cur < row:
                cur += 1
                offsets[cur] = k
            prev = row
        while cur < num_rows:
            cur += 1
            offsets[cur] = n
        return 0

    @_numba.njit(cache=True, nogil=True, fastmath=False)
    def _segment_sum_kernel(src, idx, offsets, weights, mode, out):  # pragma: no cover
        """out[r] = sum_k weights[k] * src[idx[k]] over k in [offsets[r], offsets[r+1]).

        Adds in entry order in float32 (fastmath off: no reassociation, no
        FMA), then divides by sum w (mode 1) or sqrt(sum w^2) (mode 2); a
        zero denominator gives a zero row. idx and offsets are unsigned (no
        negative-index code); rows of src are prefetched _PREFETCH_AHEAD
        entries ahead. The accumulator is a fresh array, so LLVM knows it
        aliases neither src nor out and keeps the inner loop tight.
        """
        num_rows = out.shape[0]
        dim = out.shape[1]
        n = idx.shape[0]
        if n == 0:
            out[:, :] = np.float32(0.0)
            return
        acc = np.empty(dim, np.float32)
        last = _numba.uint64(n - 1)
        ahead = _numba.uint64(_PREFETCH_AHEAD)
        for k in range(min(_PREFETCH_AHEAD, n)):
            for j in range(0, min(dim, 16), 16):
                _prefetch(src, idx[k], j)
        for r in range(num_rows):
            acc[:] = np.float32(0.0)
            den = np.float32(0.0)
            for k in range(offsets[r], offsets[r + 1]):
                pf = idx[min(_numba.uint64(k) + ahead, last)]
                for j in range(0, min(dim, 16), 16):
                    _prefetch(src, pf, j)
                w = weights[k]
                row = src[idx[k]]
                for j in range(dim):
                    acc[j] += w * row[j]
                if mode == 1:
                    den += w
                elif mode == 2:
                    den += w * w
            if mode != 0:
                if mode == 2:
                    den = np.sqrt(den)
                if den == np.float32(0.0):
                    acc[:] = np.float32(0.0)
                else:
                    for j in range(dim):
                        acc[j] = acc[j] / den
            for j in range(dim):
                out[r, j] = acc[j]

    @_numba.njit(cache=True, nogil=True)
    def _gather_kernel(src, idx, out):  # pragma: no cover (compiled)
        """out[k] = src[idx[k]], bit for bit (src and out are unsigned-int views)."""
        n = idx.shape[0]
        dim = src.shape[1]
        if n == 0:
            return
        last = _numba.uint64(n - 1)
        ahead = _numba.uint64(_PREFETCH_AHEAD)
        for k in range(min(_PREFETCH_AHEAD, n)):
            for j in range(0, min(dim, 16), 16):
                _prefetch(src, idx[k], j)
        for k in range(n):
            pf = idx[min(_numba.uint64(k) + ahead, last)]
            for j in range(0, min(dim, 16), 16):
                _prefetch(src, pf, j)
            row = src[idx[k]]
            for j in range(dim):
                out[k, j] = row[j]


_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _unsigned(ids: np.ndarray) -> np.ndarray:
    """Validated (non-negative) ids as uint64, without a copy when they are int64."""
    return ids.astype(np.int64, copy=False).view(np.uint64)


def _gather_numba(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """np.take(table, ids, axis=0) via the prefetching numba kernel (any 1/2/4/8-byte dtype)."""
    out = aligned_empty((ids.shape[0], table.shape[1]), table.dtype)
    uint = _UINT_OF_SIZE.get(table.dtype.itemsize)
    if uint is None or table.dtype.hasobject:
        return np.take(table, ids, axis=0, out=out)
    _gather_kernel(table.view(uint), _unsigned(ids), out.view(uint))
    return out


def weighted_segment_sum_numba(table: np.ndarray, ids: np.ndarray, rows: np.ndarray,
                               weights: np.ndarray, num_rows: int,
                               combiner: Optional[str]) -> np.ndarray:
    """`weighted_segment_sum` with the numba kernels (requires numba)."""
    if not HAVE_NUMBA:
        raise RuntimeError("the numba backend needs numba, which is not importable")
    mode = _mode_of(combiner)
    table, ids, rows, weights, num_rows = _prepare(table, ids, rows, weights, num_rows,
                                                   check_ids=False)
    n, dim = ids.shape[0], table.shape[1]
    offsets = np.empty(num_rows + 1, np.uint64)
    status = _row_offsets(ids, table.shape[0], rows, num_rows, offsets)
    if status == 1:
        _check_ids(ids, table.shape[0])
    if status:
        raise _rows_error(rows, num_rows)
    if _is_plain_lookup(rows, weights, num_rows, mode):
        return _gather_numba(table, ids)
    if table.dtype == np.float32:
        src, idx = table, _unsigned(ids)
    else:  # numba has no float16/bfloat16 arithmetic: gather, widen, then reduce
        src = _gather_numba(table, ids).astype(np.float32)
        idx = np.arange(n, dtype=np.uint64)
    out = aligned_empty((num_rows, dim), np.float32)
    _segment_sum_kernel(src, idx, offsets, weights, mode, out)
    return _finish(out, table.dtype)


def weighted_segment_sum(table: np.ndarray, ids: np.ndarray, rows: np.ndarray,
                         weights: np.ndarray, num_rows: int,
                         combiner: Optional[str]) -> np.ndarray:
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
    if _backend == "numba":
        return weighted_segment_sum_numba(table, ids, rows, weights, num_rows, combiner)
    return weighted_segment_sum_numpy(table, ids, rows, weights, num_rows, combiner)
