"""The serving request's rules restated in Python: the tests' oracle, never run by the
package.

`embedmesh/serving/ext/request.cc` (`embedmesh.serving._request`) is the one statement the
package runs of which features of a request are common cases and how each becomes a C++
kernel task. This module says the same in Python, feature by feature, task word by task
word, over the same runner (`native_backend.run_tasks` / `NativeRequest`), so that the
tests can compare three things on every input: the compiled rules (what a request
takes), these rules (what the compiled ones should decide), and the general path
(`embedmesh/serving/lookup.py`, which raises TensorFlow's errors). `lookup` returns the
outputs where every feature is a common case and the kernels reported no error, else
None, as the compiled `_request.lookup` does.
"""

from __future__ import annotations

import array

import jax
import numpy as np

from embedmesh._runtime import combiner_code
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.serving import pool
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.quantized import FORMAT_CODES, QuantizedTable

_I32, _I64, _F32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
_KIND_BAG_CHECKED, _KIND_SPARSE_OFFSETS_BAG, _KIND_GATHER = 4, 3, 2
_PAD = (0,) * native_backend.TASK_WORDS
_Tracer = jax.core.Tracer


def _ids_ok(v) -> bool:
    """Signed int32/int64 ids in one contiguous numpy array."""
    return type(v) is np.ndarray and (v.dtype is _I64 or v.dtype is _I32) and v.flags.c_contiguous


def _table_ok(t, feature) -> np.ndarray | None:
    """The table as a float32 numpy array of the feature's shape with contiguous rows, or
    None (another dtype or shape, a tracer: the general path's)."""
    if not isinstance(t, np.ndarray):  # np.memmap tables (a checkpoint mapped) are arrays
        if isinstance(t, _Tracer) or not isinstance(t, jax.Array):
            return None
        t = np.asarray(t)
    cfg = feature.table
    if (
        t.dtype is not _F32
        or t.ndim != 2
        or t.shape[0] != cfg.vocabulary_size
        or t.shape[1] != cfg.dim
        or cfg.dim <= 0
        or t.strides[1] != 4
        or t.strides[0] < 0
        or t.strides[0] % 4
    ):
        return None
    return t


def lookup(features, flat_inputs, flat_weights, tables, threads: int) -> list | None:
    """The request's outputs (None where a feature has no input), or None: some feature
    is not a common case, or the kernels reported an error (the general path then
    raises it). Needs the C++ kernels (`native_backend.load()`).

    A request large enough for several threads is handed to the runner task by task as
    each is made (`native_backend.NativeRequest`), as the compiled rules hand it."""
    if native_backend.load() is None:
        return None
    entries = _plausible(features, flat_inputs, flat_weights)
    if entries < 0:
        return None
    keep: list = []
    if threads > 1 and native_backend.threads_for_entries(entries, threads) > 1:
        return _handed_over(features, flat_inputs, flat_weights, tables, threads, keep)
    words: list = []
    outs = _prepare(features, flat_inputs, flat_weights, tables, words.extend, keep)
    if outs is None:
        return None  # not a common request: the general path's
    if words and any(c != -1 for c in native_backend.run_tasks(array.array("q", words), threads)):
        return None  # an error: the general path names it
    return outs


def _handed_over(features, flat_inputs, flat_weights, tables, threads, keep):
    """`lookup`'s request, each task handed to the runner as it is made."""
    request = native_backend.NativeRequest(len(flat_inputs), threads)
    outs = None
    try:
        outs = _prepare(features, flat_inputs, flat_weights, tables, request.add_words, keep)
    finally:
        results = request.close()  # waits for the tasks added: they write into `outs`
    if outs is None or any(c != -1 for c in results):
        return None
    return outs


def _plausible(features, flat_inputs, flat_weights) -> int:
    """The request's ids, or -1: some feature is not a common case, by the tests that
    cost nothing, made before any output buffer is taken (a sequence feature among the
    others is common in recommenders: its requests go to the general path at once)."""
    entries = 0
    for feature, inp, weight in zip(features, flat_inputs, flat_weights):
        if inp is None:
            continue
        kind = type(inp)
        if (
            feature.max_sequence_length
            or feature.output_shape
            or not (kind is RaggedTensor or kind is SparseTensor or kind is np.ndarray)
            or (weight is not None and (type(weight) is not kind or kind is np.ndarray))
        ):
            return -1
        ids = inp if kind is np.ndarray else inp.values
        if type(ids) is np.ndarray:
            entries += ids.size
    return entries


class _Rows:
    """A table as the bag tasks see it: the rows' address, vocabulary, dim, row stride
    (floats; bytes for a quantized table) and the row format's address (0: float32)."""

    __slots__ = ("addr", "vocab", "dim", "stride", "fmt", "keep")

    def __init__(self, addr, vocab, dim, stride, fmt, keep):
        self.addr, self.vocab, self.dim, self.stride = addr, vocab, dim, stride
        self.fmt, self.keep = fmt, keep


_QROW = {"int8": (np.dtype(np.uint8), 8), "fp16": (np.dtype(np.float16), 0)}
_QROW["codes"] = (np.dtype(np.uint8), 0)  # bf16: the general path (as the compiled form)


def _rows_ok(t, feature) -> _Rows | None:
    """`_table_ok`'s table as `_Rows`, or a `QuantizedTable` whose rows the bag kernels
    decode (`EmServingBagQ`): numpy rows of its kind's layout, contiguous (bf16 and
    anything else: the general path's)."""
    if type(t) is not QuantizedTable:
        t = _table_ok(t, feature)
        if t is None:
            return None
        return _Rows(pool.address(t), t.shape[0], t.shape[1], t.strides[0] >> 2, 0, t)
    cfg, data = feature.table, t.data
    spec = _QROW.get(t.kind)
    if (
        spec is None
        or type(data) is not np.ndarray
        or t.dim != cfg.dim
        or cfg.dim <= 0
        or data.dtype != spec[0]
        or data.ndim != 2
        or data.shape != (cfg.vocabulary_size, cfg.dim + spec[1])
        or data.strides[1] != data.itemsize
        or data.strides[0] < data.shape[1] * data.itemsize
    ):
        return None
    values = 0
    if t.kind == "codes":
        v = t.values
        if (
            type(v) is not np.ndarray
            or v.dtype is not _F32
            or v.ndim != 1
            or v.size < 1
            or not v.flags.c_contiguous
        ):
            return None
        values = pool.address(v)
    fmt = np.array([FORMAT_CODES[t.kind], values], np.int64)
    return _Rows(
        pool.address(data), data.shape[0], cfg.dim, data.strides[0], pool.address(fmt), (t, fmt)
    )


def _prepare(features, flat_inputs, flat_weights, tables, add, keep) -> list | None:
    """Each given feature's output buffer (None where no input is given), its task's
    words given to `add` as they are made, or None: a feature that is not a common case.
    `keep` gets the arrays the tasks read that nothing else holds (tables converted here,
    sparse offsets): the caller holds them until the kernels ran."""
    outs: list = []
    for feature, inp, weight in zip(features, flat_inputs, flat_weights):
        if inp is None:
            outs.append(None)
            continue
        table = _rows_ok(tables[feature.table] if feature.table in tables else None, feature)
        if table is None:
            return None
        kind = type(inp)  # with fitting weights (see _plausible)
        if kind is RaggedTensor:
            task = _ragged(feature, inp, weight, table)
        elif kind is SparseTensor:
            task = _sparse(feature, inp, weight, table, keep)
        elif table.fmt == 0:
            task = _dense(inp, table)
        else:  # a dense lookup gathers float rows: the general path decodes them
            task = None
        if task is None:
            return None
        out, task_words = task
        outs.append(out)
        keep.append(table.keep)
        add(task_words)
    return outs


def _weights_address(weight, ids) -> int | None:
    """The address of finite float32 weights fitting `ids` (0 for no weights), or None
    (another dtype or layout, a NaN or Inf: the general path converts or names it)."""
    if weight is None:
        return 0
    w = weight.values
    if (
        type(w) is not np.ndarray
        or w.dtype is not _F32
        or w.shape != ids.shape
        or not w.flags.c_contiguous
        or not np.isfinite(w).all()
    ):
        return None
    return pool.address(w)


def _ragged(feature, inp, weight, table):
    ids, splits = inp.values, inp.row_splits
    if (
        not _ids_ok(ids)
        or ids.ndim != 1
        or type(splits) is not np.ndarray
        or splits.dtype is not _I64
        or splits.ndim != 1
        or splits.shape[0] < 2
        or not splits.flags.c_contiguous
    ):
        return None
    if (
        weight is not None
        and weight.row_splits is not splits
        and not np.array_equal(weight.row_splits, splits)
    ):
        return None  # the general path names the mismatch
    w_addr = _weights_address(weight, ids)
    if w_addr is None:
        return None
    rows = splits.shape[0] - 1
    out, out_addr = pool.output_empty_at((rows, table.dim), _F32)
    task = _bag_words(_KIND_BAG_CHECKED, table, ids, pool.address(splits), rows, w_addr, feature)
    task += (out_addr, table.dim, ids.shape[0])  # ids: checked against row_splits[-1]
    return out, _padded(task, table)


def _padded(task: tuple, table: _Rows) -> tuple:
    """A task's words padded to TASK_WORDS, a quantized table's format in the last."""
    task = task + _PAD[len(task) :]
    return task if table.fmt == 0 else task[:-1] + (table.fmt,)


def _bag_words(kind, table, ids, offsets_addr, rows, w_addr, feature, prune_ids=0, prune_w=0):
    """A bag task's first words: its kind, then EmServingBagF32's arguments up to the
    output's (EmServingBagQ's: the stride in bytes)."""
    return (
        kind,
        table.addr,
        table.vocab,
        table.dim,
        table.stride,
        pool.address(ids),
        int(ids.dtype is _I64),
        offsets_addr,
        rows,
        w_addr,
        combiner_code(feature.table.combiner),
        prune_ids,
        prune_w,
    )


def _sparse(feature, inp, weight, table, keep):
    ids, idx, shape = inp.values, inp.indices, inp.dense_shape
    if (
        len(shape) != 2
        or not _ids_ok(ids)
        or ids.ndim != 1
        or type(idx) is not np.ndarray
        or not (idx.dtype is _I64 or idx.dtype is _I32)
        or idx.ndim != 2
        or idx.shape[0] != ids.shape[0]
        or idx.shape[1] != 2
        or not idx.flags.c_contiguous
    ):
        return None
    rows, cols, dim = int(shape[0]), int(shape[1]), table.dim
    if rows <= 0 or cols <= 0:
        return None
    if weight is not None and tuple(weight.dense_shape) != tuple(shape):
        return None
    w_addr = _weights_address(weight, ids)
    if w_addr is None:
        return None
    # TensorFlow's safe lookup (validate_weights_and_indices): ids < 0 dropped, and with
    # a combiner other than sum weights not > 0
    safe = bool(feature.validate_weights_and_indices)
    combiner = feature.table.combiner
    out, out_addr = pool.output_empty_at((rows, dim), _F32)
    offsets = np.empty(rows + 1, np.int64)  # written by the request's first phase
    keep.append(offsets)
    prune_w = int(safe and w_addr != 0 and combiner != "sum")
    task = _bag_words(
        _KIND_SPARSE_OFFSETS_BAG,
        table,
        ids,
        pool.address(offsets),
        rows,
        w_addr,
        feature,
        int(safe),
        prune_w,
    )
    task += (out_addr, dim, pool.address(idx), int(idx.dtype is _I64), ids.shape[0], cols)
    return out, _padded(task, table)


def _dense(inp, table):
    if not _ids_ok(inp) or inp.ndim < 1:
        return None
    dim = table.dim
    out, out_addr = pool.output_empty_at((*inp.shape, dim), _F32)
    task = (
        _KIND_GATHER,
        table.addr,
        table.vocab,
        dim * 4,
        table.stride * 4,
        pool.address(inp),
        int(inp.dtype is _I64),
        inp.size,
        out_addr,
    )
    return out, task + _PAD[len(task) :]
