"""The C++ serving backend (the default where its library loads): the kernels of
`embedmesh/serving/cpu/serving.cc`, plain C called through ctypes, which releases
the GIL (the library found or built by `embedmesh.serving.native.library()`,
loaded at first use). The bag kernel makes one pass per bag: range check, pruning,
denominator, software prefetch of the rows ahead, and the sums held in vector
registers (one template instance per register-block width, a masked tail for odd
widths); float32, in entry order, no FMA. Nothing is compiled at a call: a serving
process's first lookup is as fast as its later ones.

Implements the backend interface (`embedmesh.serving.backends`), and beyond it
what only this backend has: a request's kernels run in one C++ call on a pool of
threads (`run_native`, `run_tasks`, `NativeRequest`), 2-D sparse bags among them
(`prepare_sparse_bag`: the offsets from the indices, then the bag kernel, in one task).
"""

from __future__ import annotations

import array
import ctypes

import numpy as np

from embedmesh.serving import pool
from embedmesh.serving.backends import numpy as numpy_backend
from embedmesh.serving.backends.common import BadSparseIndex, IdOutOfRange, widened_bag
from embedmesh.serving.pool import address
from embedmesh.serving.quantized import FORMAT_CODES, QuantizedTable

__all__ = [
    "NAME",
    "TASK_WORDS",
    "NativeRequest",
    "is_native_call",
    "load",
    "prepare_bag",
    "prepare_gather",
    "prepare_sparse_bag",
    "run_native",
    "run_tasks",
    "runner_addresses",
    "sparse_offsets",
    "threads_for_entries",
]

NAME = "native"
_LIB = None  # None: not tried yet; False: unavailable; else the ctypes library


def load():
    """The C++ serving kernels (`embedmesh.serving.native.library()`), or None."""
    global _LIB
    if _LIB is None:
        from embedmesh.serving import native

        _LIB = native.library() or False
    return _LIB or None


def reason() -> str:
    """Why `load()` is None."""
    from embedmesh.serving import native

    return native.reason()


class _NativeCall:
    """A C++ kernel with its checked arguments (raw addresses), the arrays behind them
    (`keep`: alive until it has run) and its output, run later (see `kernels.prepare_bag_combine`):
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


def is_native_call(run) -> bool:
    """Whether `run` (from a prepare_* function) can go to `run_native`."""
    return type(run) in (_NativeCall, _NativeSparseCall, _NativeQuantizedCall)


class _NativeSparseCall(_NativeCall):
    """A 2-D sparse bag task (kind 3: the offsets from the COO indices, then the bag
    kernel): a result of -2 - k names a bad index k."""

    __slots__ = ()

    def finish(self, bad: int) -> np.ndarray:
        if bad >= 0:
            raise IdOutOfRange(bad, self.ids[bad], self.vocab)
        if bad < -1:
            raise BadSparseIndex(-2 - bad)
        return self.out


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


def prepare_gather(table: np.ndarray, ids: np.ndarray):
    """The C++ gather ready to run (signed ids; any dtype of 1+ bytes)."""
    if table.dtype.hasobject or table.dtype.itemsize == 0:
        return lambda: numpy_backend.gather(table, ids)
    table = _row_major(table)
    out, out_addr = pool._pool.empty_at((ids.shape[0], table.shape[1]), table.dtype)
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


def _bag(table, ids, offsets, weights, mode, prune_ids, prune_w) -> np.ndarray:
    return prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_w)()


def prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_w):
    """The C++ bag kernel ready to run, giving float32 sums: a float32 table, or a
    `QuantizedTable` (its rows decoded inside the kernel: `EmServingBagQ`); tables of
    other dtypes are pruned, gathered and widened when run."""
    if isinstance(table, QuantizedTable):
        return _prepare_quantized_bag(table, ids, offsets, weights, mode, prune_ids, prune_w)
    if table.dtype != np.float32:
        gather = lambda t, i: prepare_gather(t, i)()
        return widened_bag(gather, _bag, table, ids, offsets, weights, mode, prune_ids, prune_w)
    table = _row_major(table)
    stride = table.strides[0] // 4  # in floats
    args, out, ids, offsets = _bag_args(
        table, table.shape[1], stride, ids, offsets, weights, mode, prune_ids, prune_w
    )
    keep = (table, ids, offsets, weights)
    return _NativeCall(_LIB.EmServingBagF32, args, keep, out, ids, table.shape[0], 0)


def _options_and_out(weights, mode, prune_ids, prune_w, out_addr, dim) -> tuple:
    """The last 6 arguments of every C++ bag kernel: the weights (or none), the
    options, the output and its row stride."""
    has_w = weights is not None
    prune = (int(prune_ids), int(prune_w and has_w))
    return (address(weights) if has_w else None, mode, *prune, out_addr, dim)


def _bag_args(data, dim, row_stride, ids, offsets, weights, mode, prune_ids, prune_w):
    """The arguments the C++ bag kernels share (`EmServingBagF32`, `EmServingBagQ`'s
    first 14: rows `data` of `row_stride` elements or bytes, ids, offsets, weights,
    options, the output), the output taken from the pool, and the ids and offsets in
    the form the arguments point at (to keep alive): (args, out, ids, offsets)."""
    num_rows = offsets.shape[0] - 1
    out, out_addr = pool._pool.empty_at((num_rows, dim), np.float32)
    ids, is64 = _native_ids(ids)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    args = (
        address(data),
        data.shape[0],
        dim,
        row_stride,
        address(ids),
        is64,
        address(offsets),
        num_rows,
        *_options_and_out(weights, mode, prune_ids, prune_w, out_addr, dim),
    )
    return args, out, ids, offsets


class _NativeQuantizedCall(_NativeCall):
    """`EmServingBagQ` with its arguments: a bag task whose row format (its last
    argument) goes to word 19 of the task (`EmServingRun`'s convention)."""

    __slots__ = ()

    def words(self) -> tuple:
        if self._words is None:
            w = (self.kind, *[0 if a is None else a for a in self.args[:-1]])
            self._words = w + (0,) * (TASK_WORDS - 1 - len(w)) + (self.args[-1],)
        return self._words


def _prepare_quantized_bag(table, ids, offsets, weights, mode, prune_ids, prune_w):
    """`EmServingBagQ` over a host `QuantizedTable` (numpy arrays, contiguous rows)."""
    data, values = table.data, table.values
    fmt = np.array([FORMAT_CODES[table.kind], 0 if values is None else address(values)], np.int64)
    args, out, ids, offsets = _bag_args(
        data, table.dim, data.strides[0], ids, offsets, weights, mode, prune_ids, prune_w
    )
    args += (address(fmt),)
    keep = (data, values, fmt, ids, offsets, weights)
    return _NativeQuantizedCall(_LIB.EmServingBagQ, args, keep, out, ids, data.shape[0], 0)


def sparse_offsets(indices, shape, num_rows):
    """`kernels.sparse_offsets` given the shape as an int64 array: (offsets, -1),
    (None, first bad entry), or None where the kernel does not apply."""
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


def prepare_sparse_bag(table, ids, indices, num_rows, num_cols, weights, mode, prune_ids, prune_w):
    """The sparse bag ready to run (see `kernels.prepare_sparse_bag_combine`, which
    checks the arguments): a float32 table, contiguous int32/int64 ids and indices
    [n, 2], float32 weights or None. The bag offsets are derived from the indices
    (checked) in `run_native`'s first phase, then the bag kernel sums."""
    table = _row_major(table)
    offsets = np.empty(num_rows + 1, np.int64)  # written by the run's first phase
    stride = table.strides[0] // 4  # in floats
    args, out, ids, offsets = _bag_args(
        table, table.shape[1], stride, ids, offsets, weights, mode, prune_ids, prune_w
    )
    more = (address(indices), int(indices.dtype == np.int64), ids.shape[0], num_cols)
    keep = (table, ids, indices, weights, offsets)
    return _NativeSparseCall(None, (*args, *more), keep, out, ids, table.shape[0], 3)
