"""Host preprocessing: a batch of features -> fixed-shape partitioned CSR arrays.

This is the host half of the engine, what the SparseCore's input pipeline
does: for every stack (see `embedmesh.layout.stacking`), for every source device of
this process and every destination shard, the ids that device needs from that
shard, sorted and de-duplicated, plus for every (output row, id) pair the
position of its id in that list and its gain. Every array has a static padded
size (the stack's `Capacity`) so the device program compiles once.

Semantics (all pinned by `tests/host/test_preprocess.py` against a loop-and-dict
reference):

- The process-local batch of `B` samples is split evenly and in order over
  its `D` local devices: device `d` gets samples `[d*B/D, (d+1)*B/D)`.
- Inputs become bags under TensorFlow's rules (`embedmesh.inputs.to_csr`,
  the form the serving lookup takes too); every entry is an id; ids must
  lie in `[0, vocabulary_size)`, else a `ValueError` names the feature and
  the first bad id. This holds whatever
  `validate_weights_and_indices` says: an out-of-range id has no safe meaning
  in a stacked table (TensorFlow silently reads the next table's rows). A table
  of raw ids (`TableConfig.id_map`) takes any int64 id instead, routed to its
  owner by a hash (`embedmesh.host.dynamic_ids`; numba kernels in
  `embedmesh.host.numba_dynamic`, the numpy path without them).
- Gains follow the SparseCore: each entry's gain is `w * scale[row]`, scale 1
  (sum), `1/sum(w)` (mean), `1/sqrt(sum(w^2))` (sqrtn), the sums taken over
  all of the row's entries before duplicates merge, 0 when the sum is 0.
  Sequence features (`max_sequence_length = L > 0`) give one output row per
  (sample, position < L) with gain `w`. Duplicate (row, id) pairs merge by
  adding gains (in float64, rounded once to float32).
- Activation buffer of one stack on one device: the rows of the stack's
  features in config order, `B/D * rows_per_sample` rows each (see
  `FeatureSegment`); `R` rows in all.
- Order inside a partition: unique ids ascending; pairs by (unique id,
  output row).
- Overflow (a partition with more pairs than `max_ids_per_partition` or more
  unique ids than `max_unique_ids_per_partition`): `"error"` raises a
  `ValueError` naming the stack, the device, the shard, the count and the
  capacity; `"drop"` keeps, in the order above, the unique ids whose ordinal
  is below the unique capacity and whose first pair's ordinal is below the
  pair capacity, and the pairs whose ordinals are below both; the number of
  input entries lost is in the statistics; `"grow"` loses nothing: the stack's
  arrays get the next capacity bucket (`capacity_bucket`) and the statistics
  report it, so the engine can recompile once.

Three interchangeable backends give bit-identical output, picked in one place
(`_resolve_backend`): C++ kernels (`embedmesh.host.native_backend`,
`embedmesh/host/cpu/preprocess.cc`, `backend="native"`, used by `"auto"` when the
package's "host" library loads and `EMBEDMESH_PREPROCESS_NATIVE` is not 0: one ctypes
call per (stack, device) task, the GIL released, nothing compiled at run time, no
numba imported), numba kernels (`embedmesh.host.numba_backend`, `backend="numba"`,
used by `"auto"` next, when numba is importable and `EMBEDMESH_NUMBA` is not 0; the
same algorithm: radix sort per (table, device) block, one pass to dedup and fill,
(stack, device) tasks on a thread pool) and pure numpy (`embedmesh.host.numpy_backend`,
`backend="numpy"`: one composite-key sort per table). numba is imported at the first
preprocessing call that uses it (the numba backend, or a table of raw ids, whose
kernels are numba's under either compiled backend), never by `import embedmesh`. All
place rows through the plan's `RowLayout` (the kernels receive its `kernel_params`).
Threads: `num_threads`, default `EMBEDMESH_PREPROCESS_THREADS`, else one per usable
core. Their speed: `benchmarks/train/RESULTS.md`, `benchmarks/runs/preprocess-history.md`.

This module holds the orchestration and the entry points: embedmesh's form
`preprocess_batch`, TensorFlow's `preprocess_features_tf` (its arguments mapped
by `embedmesh.host.preprocess_tf`, which does not import this module) and
`preprocess_features`, which takes both and shows TensorFlow's signature. The
batch types live in `embedmesh.batch` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from embedmesh import _runtime
from embedmesh._runtime import PAD_ID, combiner_code
from embedmesh.batch import (
    Capacity,
    FeatureSegment,
    PartitionedCsrFormatTensor,
    PreprocessStats,
    StackStats,
    capacity_bucket,
)
from embedmesh.host import dynamic_ids as _dynamic
from embedmesh.host import kernel_params, numpy_backend
from embedmesh.host.numpy_backend import bits_needed
from embedmesh.host.preprocess_tf import SEED_ARGS, seed_batch_arguments
from embedmesh.inputs import Csr, check_id_range, flatten_inputs_like, to_csr
from embedmesh.layout.stacking import StackingPlan, plan_stacking

_log = logging.getLogger(__name__)

__all__ = [
    "Capacity",
    "FeatureSegment",
    "OVERFLOW_POLICIES",
    "PAD_ID",
    "PartitionedCsrFormatTensor",
    "PreprocessStats",
    "SparseCoreStats",
    "StackStats",
    "capacity_bucket",
    "compute_sparse_core_stats",
    "default_num_threads",
    "auto_backend",
    "native_available",
    "numba_available",
    "preprocess_batch",
    "preprocess_features",
    "preprocess_features_tf",
]

OVERFLOW_POLICIES = ("error", "drop", "grow")


# ---------------------------------------------------------------------------
# The batch as bags: one `inputs.Csr` per feature, ready for the kernels


def _kernel_csr(name: str, feature, inp, weight, batch_scale: int) -> Csr:
    """One feature as bags (`inputs.to_csr`, the serving lookup's rules too), with
    the dtypes the kernels take: int32/int64 ids, int64 splits, float32 weights."""
    c = to_csr(name, feature, inp, weight, batch_scale=batch_scale)
    ids = c.ids
    dynamic = getattr(feature.table, "id_map", None) is not None  # raw ids: any 64 bits
    if ids.dtype == np.uint64 and not dynamic:  # checked before the int64 view turns
        check_id_range(name, ids, feature.table.vocabulary_size)  # 2**64-1 into -1
    if dynamic and ids.dtype == np.uint64:
        ids = ids.view(np.int64)
    if ids.dtype != np.int32 and ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    splits = np.ascontiguousarray(c.splits, np.int64)
    if not splits.flags.writeable:  # to_csr's shared arange of dense inputs: one
        splits = splits.copy()  # array type for the compiled kernels
    return dataclasses.replace(
        c,
        ids=np.ascontiguousarray(ids),
        splits=splits,
        weights=None if c.weights is None else np.ascontiguousarray(c.weights, np.float32),
    )


def _batch_csrs(plan: StackingPlan, features, weights, batch_scale: int = 1) -> tuple[list, int]:
    """Every feature's `Csr`, in config order, and the batch size they share."""
    resolved = plan.resolved
    flat_inputs = flatten_inputs_like(resolved, features, "features")
    flat_weights = (
        [None] * len(flat_inputs)
        if weights is None
        else flatten_inputs_like(resolved, weights, "weights")
    )
    csrs = []
    batch = None
    first = None
    for name, feature, inp, w in zip(
        resolved.feature_names, resolved.features, flat_inputs, flat_weights
    ):
        if inp is None:
            raise ValueError(
                f"feature {name} has no input (feature {name} is missing); training "
                f"needs an input for every feature of the config: give one for each (a "
                f"sample without ids is an empty row of a RaggedTensor or SparseTensor); "
                f"only serving_embedding_lookup takes a subset"
            )
        c = _kernel_csr(name, feature, inp, w, batch_scale)
        if batch is None:
            batch, first = c.batch_size, name
        elif c.batch_size != batch:
            raise ValueError(
                f"feature {name} has batch size {c.batch_size} but feature {first} "
                f"has {batch}; all features of one call share one batch size"
            )
        csrs.append(c)
    return csrs, batch


# ---------------------------------------------------------------------------
# The numba backend, loaded at first use


_NUMBA = None  # None: not tried yet; False: unavailable; else embedmesh.host.numba_backend


def _numba_backend():
    """The numba backend module, or None (EMBEDMESH_NUMBA=0, or numba not importable)."""
    global _NUMBA
    if _NUMBA is None:
        _NUMBA = _runtime.numba_module("embedmesh.host.numba_backend") or False
    return _NUMBA or None


def _numba_dynamic():
    """The raw ids' numba kernels (`embedmesh.host.numba_dynamic`), or None."""
    return _runtime.numba_module("embedmesh.host.numba_dynamic")


def _id_map(plan: StackingPlan, job: _StackJob):
    """The stack's `DynamicIds` (a table of raw ids, alone in its stack), or None."""
    if len(job.tables) != 1:
        return None
    return getattr(plan.table_config(job.tables[0].name), "id_map", None)


def _native_backend():
    """The C++ backend module (`embedmesh.host.native_backend`) when its library loads
    (and `EMBEDMESH_PREPROCESS_NATIVE` is not 0), else None; imports no numba."""
    from embedmesh.host import native_backend

    return native_backend if native_backend.library() is not None else None


def numba_available() -> bool:
    """True when the numba backend can be used (numba importable, and
    `EMBEDMESH_NUMBA` not 0); asking imports numba."""
    return _numba_backend() is not None


def native_available() -> bool:
    """True when the C++ backend can be used (its library built or buildable, and
    `EMBEDMESH_PREPROCESS_NATIVE` not 0); asking loads it, and imports no numba."""
    return _native_backend() is not None


def auto_backend() -> str:
    """The backend `backend="auto"` uses: "native" (the C++ kernels) when their library
    loads, else "numba" when numba is importable, else "numpy"."""
    return _resolve_backend("auto")[0]


def default_num_threads() -> int:
    """Threads `preprocess_features` uses by default: `EMBEDMESH_PREPROCESS_THREADS`,
    else the cores this process may run on."""
    return _runtime.preprocess_threads()


# ---------------------------------------------------------------------------
# Per-stack work shared by both backends


@dataclasses.dataclass
class _StackJob:
    name: str
    feats: list  # (FeaturePlacement, Csr, FeatureSegment) in buffer order
    tables: list  # TablePlacement in stack row order
    rows_per_shard: int
    rows_per_device: int
    segments: tuple

    def members(self, table_name: str) -> list:
        return [m for m in self.feats if m[0].table == table_name]


def _overflow_message(
    job: _StackJob, u_tot, p_tot, cap: Capacity, process_index: int, num_devices_local: int
) -> str | None:
    for what, tot, c in (
        ("unique ids", u_tot, cap.max_unique_ids_per_partition),
        ("ids", p_tot, cap.max_ids_per_partition),
    ):
        over = np.argwhere(tot > c)
        if over.size:
            d, j = (int(x) for x in over[0])
            field = (
                "max_unique_ids_per_partition" if what == "unique ids" else "max_ids_per_partition"
            )
            return (
                f"stack {job.name}: device {process_index * num_devices_local + d} (local "
                f"device {d}) needs {int(tot[d, j])} {what} from shard {j}, over the "
                f"capacity {field}={c} ({over.shape[0]} partition(s) over, largest "
                f"{int(tot.max())}); raise the stack's capacity (capacities=..., see "
                f"compute_sparse_core_stats) or pass overflow='drop' or 'grow'"
            )
    return None


def _range_error(job: _StackJob, table):
    for fp, c, _ in job.members(table.name):
        check_id_range(fp.name, c.ids, table.vocabulary_size)
    raise AssertionError("id range error not found")  # pragma: no cover


def _numba_fits(job: _StackJob, plan: StackingPlan, K) -> bool:
    """Whether the kernels apply: a row layout they implement, and every sort
    value (key bits + low bits) fits 62 bits."""
    if plan.row_layout.name not in kernel_params.KERNEL_LAYOUTS:
        return False
    for t in job.tables:
        nnz = sum(int(c.splits[-1]) for _, c, _ in job.members(t.name))
        if not _values_fit(job, nnz, plan.num_shards * t.rows_per_shard):
            return False
    return True


def _values_fit(job: _StackJob, nnz: int, keys: int) -> bool:
    """Whether a table's sort values (a key of `keys`, then the output row or one of its
    `nnz` entries) fit 62 bits."""
    low = max(bits_needed(job.rows_per_device), bits_needed(nnz))
    return bits_needed(keys - 1) + low <= 62


def _table_inputs(members: list):
    """Kernel inputs of one table: its features' ids, weights and splits concatenated,
    and `fmeta` (first split index, rows per device, buffer row offset, combiner code)."""
    if len(members) == 1:
        fp, c, seg = members[0]
        ids, splits = c.ids, c.splits
        weights = c.weights if c.weights is not None else np.zeros(0, np.float32)
        fmeta = np.array(
            [[0, seg.num_rows, seg.row_offset, combiner_code(c.layout.combiner)]], np.int64
        )
        return ids, weights, splits, fmeta
    ids = np.concatenate([c.ids for _, c, _ in members])
    if any(c.weights is not None for _, c, _ in members):
        weights = np.concatenate(
            [
                c.weights if c.weights is not None else np.ones(c.ids.shape[0], np.float32)
                for _, c, _ in members
            ]
        )
    else:
        weights = np.zeros(0, np.float32)
    parts, rows, base, sbase = [], [], 0, 0
    for _, c, seg in members:
        parts.append(c.splits + base)
        rows.append([sbase, seg.num_rows, seg.row_offset, combiner_code(c.layout.combiner)])
        base += c.ids.shape[0]
        sbase += c.splits.shape[0]
    return ids, weights, np.concatenate(parts), np.array(rows, np.int64)


def _partition_arrays(D: int, N: int, U: int, P: int, raw: bool = False) -> tuple:
    """A stack's output arrays, unfilled, each on a 64-byte boundary (what jax's put on
    CPU aliases rather than copies: `EmbeddingCore.put(copy=False)`, the facade's
    enqueue; 1.5 MB in ~6 us against ~43 us copied): unique ids `[D, N, U]`, pair rows,
    pair unique indices `[D, N, P]` int32, pair gains float32, and with `raw` the raw
    words `[D, N, U, 2]` uint32. One allocation for all."""
    shapes = [(D, N, U), (D, N, P), (D, N, P), (D, N, P)] + ([(D, N, U, 2)] if raw else [])
    dtypes = [np.int32, np.int32, np.int32, np.float32, np.uint32]
    sizes = [-(-math.prod(s) * 4 // 64) * 64 for s in shapes]  # 4-byte items
    buf = np.empty(sum(sizes) + 64, np.uint8)
    at = (-buf.ctypes.data) % 64
    out = []
    for shape, dtype, size in zip(shapes, dtypes, sizes):
        out.append(buf[at : at + math.prod(shape) * 4].view(dtype).reshape(shape))
        at += size
    return tuple(out)


def _run_result(run) -> tuple:
    """A compiled run's `(arrays, unique totals, pair totals, dropped)` from its outputs,
    counters and drops (`_KernelRun`, `_RawIdsRun`)."""
    c = run.counts
    arrays = (
        run.unique_ids,
        c[kernel_params.C_UNIQUE_KEPT].astype(np.int32),
        run.pair_rows,
        run.pair_unique,
        run.pair_gains,
        c[kernel_params.C_PAIR_KEPT].astype(np.int32),
    )
    totals = (c[kernel_params.C_UNIQUE_TOTAL], c[kernel_params.C_PAIR_TOTAL])
    return (arrays, *totals, int(run.dropped.sum()))


class _KernelRun:
    """One stack's work on compiled kernels at one capacity (numba's or C++'s, the
    subclasses): output arrays and every table's kernel inputs, then one task per
    device (`device`), the tables' sorts ahead of it where threads are spare (`sort`)."""

    def __init__(self, job: _StackJob, plan: StackingPlan, D: int, cap: Capacity, K):
        N = plan.num_shards
        U, P = cap.max_unique_ids_per_partition, cap.max_ids_per_partition
        self.job, self.K, R = job, K, job.rows_per_device
        self.unique_ids, self.pair_rows, self.pair_unique, self.pair_gains = _partition_arrays(
            D, N, U, P
        )
        self.counts = np.zeros((kernel_params.COUNTERS, D, N), np.int64)
        self.dropped = np.zeros(D, np.int64)
        self.outputs = (
            self.unique_ids,
            self.pair_rows,
            self.pair_unique,
            self.pair_gains,
            self.counts,
        )
        self.calls = []  # (table, bad entry per device, kernel inputs)
        self.sorted = {}  # (device, table index) -> table_sort's outputs, until appended
        for t in job.tables:
            members = job.members(t.name)
            if not members:
                continue
            ids, weights, splits, fmeta = _table_inputs(members)
            low_bits = bits_needed(ids.shape[0] - 1) if weights.shape[0] else bits_needed(R - 1)
            row_base = min(seg.row_offset for _, _, seg in members)
            row_span = max(seg.row_offset + seg.num_rows for _, _, seg in members) - row_base
            span, rotation, first_shard, _ = plan.row_layout.kernel_params(t)
            params = kernel_params.table_params(
                span,
                rotation,
                first_shard,
                t.rows_per_shard,
                t.local_row_offset,
                t.vocabulary_size,
                bits_needed(N * t.rows_per_shard - 1),
                low_bits,
                row_base,
                row_span,
                U,
                P,
            )
            self.calls.append((t, np.full(D, -1, np.int64), (ids, weights, splits, fmeta, params)))

    def finish(self):
        for t, bad, _ in self.calls:
            if (bad >= 0).any():
                _range_error(self.job, t)
        return _run_result(self)


class _NumbaRun(_KernelRun):
    """A stack's work on numba's kernels (`embedmesh.host.numba_backend`, or
    `numba_dynamic` on raw ids' codes)."""

    def sort(self, d: int, i: int) -> None:
        """Table i's entries for local device d keyed and sorted (no GIL held): the
        tables of a stack sort in parallel, `device` appends them in order."""
        self.sorted[d, i] = self.K.table_sort(*self.calls[i][2], d, self.unique_ids.shape[1])

    def device(self, d: int) -> None:
        """Every table of the stack, in row order, for local device d (no GIL held):
        sorted (where `sort` has not), then appended to the partitions."""
        for i, (_, bad, inputs) in enumerate(self.calls):
            first_bad, *sorted_ = self.sorted.pop((d, i), None) or self.K.table_sort(
                *inputs, d, self.unique_ids.shape[1]
            )
            if first_bad >= 0:
                bad[d] = first_bad
                return
            params = inputs[4]
            self.dropped[d] += self.K.table_fill(
                *sorted_, params, d, *self.outputs[:4], self.counts
            )
        self.K.fill_padding(*self.outputs, PAD_ID, self.job.rows_per_device, d)


class _NativeRun(_KernelRun):
    """A stack's work on the C++ kernels (`embedmesh.host.native_backend`): one call a
    device task (`EmHostDevice`: sort, append, pad), the GIL released; a table's sort
    run ahead (`EmHostSort`) leaves a handle that the device's call consumes."""

    def __init__(self, job: _StackJob, plan: StackingPlan, D: int, cap: Capacity, K):
        super().__init__(job, plan, D, cap, K)
        self.lib = K.library()
        T = len(self.calls)
        self.desc = K.describe([inputs for _, _, inputs in self.calls])
        self.bad = np.full((T, D), -1, np.int64)
        for i, (t, _, inputs) in enumerate(self.calls):  # `finish` reads bad by table
            self.calls[i] = (t, self.bad[i], inputs)
        self.handles = np.zeros((D, max(T, 1)), np.int64)
        # the calls' addresses, taken once (a batch of small stacks is bound by the calls)
        D_, N, U = self.unique_ids.shape
        self.desc_at, self.handles_at = self.desc.ctypes.data, self.handles.ctypes.data
        self.row_bytes = self.handles.strides[0]
        self.before = (self.desc_at, T)
        self.after = (
            D_,
            N,
            U,
            self.pair_rows.shape[2],
            self.unique_ids.ctypes.data,
            self.pair_rows.ctypes.data,
            self.pair_unique.ctypes.data,
            self.pair_gains.ctypes.data,
            self.counts.ctypes.data,
            PAD_ID,
            self.job.rows_per_device,
            self.bad.ctypes.data,
            self.dropped.ctypes.data,
        )

    def sort(self, d: int, i: int) -> None:
        handle = self.lib.EmHostSort(self.desc_at + i * self.desc.strides[0], d, self.after[1])
        if handle == 0:
            raise MemoryError("host preprocessing (C++): out of memory sorting a table")
        self.handles[d, i] = handle

    def device(self, d: int) -> None:
        rc = self.lib.EmHostDevice(
            *self.before, self.handles_at + d * self.row_bytes, d, *self.after
        )
        if rc != 0:
            raise MemoryError("host preprocessing (C++): out of memory")

    def __del__(self):  # handles of sorts whose device task never ran (an error)
        handles = getattr(self, "handles", None)
        if handles is not None and handles.any():
            for h in handles[handles != 0]:
                self.lib.EmHostFree(int(h))


class _RawIdsRun:
    """A stack of raw ids (one table, `TableConfig.id_map`) on numba's kernels
    (`embedmesh.host.numba_dynamic`, no GIL held): `prepare` codes its ids once a
    preprocessing call (`raw_codes`, kept in `coded` for the stack's other runs: the
    count at capacity 0, a grown capacity), `device` fills a local device's partitions
    and the raw words of their unique ids (`device_fill`). `_execute` runs both in one
    task where the process has one device: no pass over all stacks between them."""

    calls = ()  # no tables' sorts ahead (`_execute`)

    def __init__(self, job: _StackJob, plan: StackingPlan, D: int, cap: Capacity, KD, coded):
        # (the arrays are made in `prepare`, on a pool thread: the calling thread makes
        # every stack's run before any task starts)
        self.job, self.K, self.coded, self.D, self.N = job, KD, coded, D, plan.num_shards
        self.cap = (cap.max_unique_ids_per_partition, cap.max_ids_per_partition)
        self.owners = plan.id_owners(job.tables[0].name)
        self.seed = int(_id_map(plan, job).seed)

    @staticmethod
    def fits(job: _StackJob, N: int) -> bool:
        """Whether every sort value fits 62 bits for any batch of these entries (the
        key bits of N shards of at most as many rows as entries, and the low bits)."""
        nnz = sum(int(c.splits[-1]) for _, c, _ in job.feats)
        return _values_fit(job, nnz, N * max(nnz, 1))

    def prepare(self) -> None:
        """The stack's kernel inputs and its ids coded (once a preprocessing call), this
        run's output arrays and kernel parameters (K rows a shard: the distinct ids). No
        GIL held in the kernel."""
        if self.job.name not in self.coded:
            members = self.job.members(self.job.tables[0].name)
            ids, *inputs = _table_inputs(
                [
                    (fp, dataclasses.replace(c, ids=_dynamic.raw_ids(c.ids)), seg)
                    for fp, c, seg in members
                ]
            )
            first, k = self.owners
            _, splits, fmeta = inputs
            words = _dynamic.owner_words(self.seed)
            keys, uniq = self.K.raw_codes(ids, splits, fmeta, self.D, k, *words)
            if first:  # owner first + h % k: its key `owner * K + code` shifted by `first * K`
                keys += first * uniq.shape[0]
            row_base = min(seg.row_offset for _, _, seg in members)
            row_end = max(seg.row_offset + seg.num_rows for _, _, seg in members)
            weighted = inputs[0].shape[0] > 0
            low = bits_needed(ids.shape[0] - 1 if weighted else self.job.rows_per_device - 1)
            self.coded[self.job.name] = (keys, uniq, tuple(inputs), low, row_base, row_end)
        keys, uniq, _, low, row_base, row_end = self.coded[self.job.name]
        (D, N), (U, P) = (self.D, self.N), self.cap
        self.unique_ids, self.pair_rows, self.pair_unique, self.pair_gains, self.raw = (
            _partition_arrays(D, N, U, P, raw=True)
        )
        self.counts = np.zeros((kernel_params.COUNTERS, D, N), np.int64)
        self.dropped = np.zeros(D, np.int64)
        K = max(int(uniq.shape[0]), 1)
        self.params = kernel_params.table_params(
            N, 0, 0, K, 0, N * K, bits_needed(N * K - 1), low, row_base, row_end - row_base, U, P
        )

    def device(self, d: int) -> None:
        keys, uniq, inputs, *_ = self.coded[self.job.name]
        outputs = (self.unique_ids, self.pair_rows, self.pair_unique, self.pair_gains)
        dropped = self.K.device_fill(
            keys,
            uniq,
            inputs,
            self.params,
            d,
            outputs,
            self.counts,
            self.raw,
            PAD_ID,
            self.job.rows_per_device,
        )
        if dropped < 0:  # (raw_codes's keys are in range: a defect if reached)
            raise RuntimeError(f"stack {self.job.name}: a raw id's code out of range")
        self.dropped[d] = dropped

    def finish(self):
        return _run_result(self)


class _NumpyRun:
    """One stack's numpy work at one capacity (runs in `finish`)."""

    def __init__(self, job: _StackJob, D: int, N: int, cap: Capacity, sorted_tables: list):
        self.args = (D, N, cap, job.rows_per_device, sorted_tables)

    def finish(self):
        return numpy_backend.fill(*self.args)


def _execute(runs: list, D: int, threads: int) -> list:
    """Run every (stack, device) task, on `threads` threads; results in order of `runs`.

    With threads to spare (fewer (stack, device) tasks than threads), the tables'
    sorts (most of the work) run first as tasks of their own, so that one stack of
    several tables on one device is not one thread's work: a v5e host's enqueue of 8
    tables on one chip took 10-13 ms on one of its 13 cores."""
    tasks = [(r, d) for r in runs if hasattr(r, "device") for d in range(D)]
    sorts = [(r, d, i) for r, d in tasks for i in range(len(r.calls))]
    if threads > 1 and len(tasks) < threads and len(sorts) > len(tasks):
        pool = _runtime.thread_pool(threads)
        list(pool.map(lambda task: task[0].sort(task[1], task[2]), sorts))
    prepares = [r for r in runs if hasattr(r, "prepare")]
    if D > 1 and prepares:  # a stack's coding before any of its devices' tasks
        if threads > 1 and len(prepares) > 1:
            list(_runtime.thread_pool(threads).map(lambda r: r.prepare(), prepares))
        else:
            for r in prepares:
                r.prepare()

    def task(run_and_device):
        r, d = run_and_device
        if D == 1 and hasattr(r, "prepare"):  # one task a stack: coding with it
            r.prepare()
        r.device(d)

    if threads <= 1 or len(tasks) <= 1:
        for t in tasks:
            task(t)
    else:
        list(_runtime.thread_pool(threads).map(task, tasks))
    return [r.finish() for r in runs]


# ---------------------------------------------------------------------------
# Public entry points


CapacitiesArg = Capacity | Mapping[str, Capacity] | None


def _capacity_for(capacities: CapacitiesArg, plan: StackingPlan, stack: str) -> Capacity | None:
    """The explicit capacity of a stack, else one from its tables' configs, else None."""
    if isinstance(capacities, Capacity):
        return capacities
    if capacities is not None and stack in capacities:
        c = capacities[stack]
        if not isinstance(c, Capacity):
            raise ValueError(f"capacities[{stack!r}] must be a Capacity, got {c!r}")
        return c
    # Per-table limits, where a table config carries them (fields named as in
    # jax-tpu-embedding's TableSpec), add up: a partition holds ids of every table.
    ids = unique = 0
    for name in plan.stack(stack).tables:
        config = plan.table_config(name)
        a = getattr(config, "max_ids_per_partition", None)
        b = getattr(config, "max_unique_ids_per_partition", None)
        if a is None or b is None:
            return None
        ids, unique = ids + int(a), unique + int(b)
    return Capacity(ids, unique)


def _make_jobs(plan: StackingPlan, csrs: list, batch: int, D: int) -> list:
    b = batch // D
    by_name = dict(zip(plan.resolved.feature_names, csrs))
    jobs = []
    for s in plan.stacks:
        feats, segments, off = [], [], 0
        for fname in s.features:
            fp = plan.feature(fname)
            layout = by_name[fname].layout
            seg = FeatureSegment(
                fname, off, b, tuple(layout.sample_shape), fp.dim, layout.output_shape
            )
            off += seg.num_rows
            feats.append((fp, by_name[fname], seg))
            segments.append(seg)
        jobs.append(
            _StackJob(
                s.name,
                feats,
                [plan.table(t) for t in s.tables],
                s.rows_per_shard,
                off,
                tuple(segments),
            )
        )
    return jobs


BACKENDS = ("auto", "native", "numba", "numpy")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'native', 'numba' or 'numpy', got {backend!r}")


def _resolve_backend(backend: str):
    """`(name, kernels module or None)` for a `backend` argument: the one place that
    picks a backend. "auto": the C++ kernels, else numba's, else numpy (None)."""
    _check_backend(backend)
    if backend == "numpy":
        return "numpy", None
    if backend in ("auto", "native"):
        K = _native_backend()
        if K is not None:
            return "native", K
        if backend == "native":
            from embedmesh.host import native_backend

            raise ImportError(
                f"backend='native' needs the C++ preprocessing kernels: {native_backend.reason()}"
            )
    K = _numba_backend()
    if K is not None:
        return "numba", K
    if backend == "numba":
        raise ImportError(
            "backend='numba' needs the numba package (and EMBEDMESH_NUMBA not set to 0)"
        )
    return "numpy", None


def preprocess_features_tf(*args, **kwargs) -> tuple:
    """TensorFlow's `TPUEmbeddingV2.preprocess_features` on embedmesh's plan (the
    arguments' mapping: `embedmesh.host.preprocess_tf.seed_batch_arguments`);
    `**options` are `preprocess_batch`'s keywords (capacities, overflow,
    num_devices_local, process_index, backend, num_threads).

    Returns `({stack: PartitionedCsrFormatTensor}, max_ids_per_partition,
    max_unique_ids_per_partition)`: the tuple `MeshEmbedding.dequeue` takes,
    host numpy arrays identical to `preprocess_batch`'s for the same features
    (the ints: the batch's largest partition, before padding; TensorFlow's are
    its unpadded CSR sizes). Statistics: use `preprocess_batch`.
    """
    features, weights, plan, options = seed_batch_arguments(*args, **kwargs)
    out, stats = preprocess_batch(features, weights, plan, **options)
    return (
        out,
        max((st.max_ids_per_partition for st in stats.stacks.values()), default=0),
        max((st.max_unique_ids_per_partition for st in stats.stacks.values()), default=0),
    )


# TensorFlow's parameters, those `seed_batch_arguments` takes (help(), inspect.signature)
preprocess_features_tf.__signature__ = inspect.signature(seed_batch_arguments).replace(  # type: ignore[attr-defined]
    return_annotation="tuple"
)


def preprocess_features(*args, **kwargs):
    """Preprocess a batch; two call forms (`inspect.signature` shows TensorFlow's).

    - TensorFlow's (`TPUEmbeddingV2.preprocess_features`): `num_replicas_in_sync,
      max_ids_per_chip_per_sample, max_minibatches_per_sc, num_sc_per_chip,
      num_sc_shards, stacked_table_to_tables, table_to_stacked_table_offset,
      table_to_sample_count, feature_to_sample_offset, flat_features,
      flat_inputs, flat_weights=None` (by keyword or position; embedmesh's
      keyword options may be added) -> `({stack: PartitionedCsrFormatTensor},
      max_ids_per_partition, max_unique_ids_per_partition)`, the
      `(dict, int, int)` tuple `dequeue` takes; see `preprocess_features_tf`.
    - embedmesh's, also under its own name `preprocess_batch`:
      `preprocess_features(features, weights, plan, *, num_devices_local=1,
      capacities=None, overflow="error", process_index=0, backend="auto",
      num_threads=None)` -> `({stack: PartitionedCsrFormatTensor},
      PreprocessStats)`.

    The form is told by the first argument (an int: TensorFlow's) or by any
    of TensorFlow's keywords.
    """
    if any(k in kwargs for k in SEED_ARGS) or (
        args and isinstance(args[0], (int, np.integer)) and not isinstance(args[0], bool)
    ):
        return preprocess_features_tf(*args, **kwargs)
    return preprocess_batch(*args, **kwargs)


# help(), IDEs and inspect.signature show the seed's form (TPUEmbeddingV2's).
preprocess_features.__signature__ = inspect.signature(preprocess_features_tf)  # type: ignore[attr-defined]


def preprocess_batch(
    features: Any,
    weights: Any | None,
    plan: StackingPlan,
    *,
    num_devices_local: int = 1,
    capacities: CapacitiesArg = None,
    overflow: str = "error",
    process_index: int = 0,
    backend: str = "auto",
    num_threads: int | None = None,
) -> tuple[dict, PreprocessStats]:
    """Preprocess one process-local batch into partitioned CSR arrays, per stack.

    Args:
      features: inputs in the structure of the plan's feature config (every
        feature present; dense, `SparseTensor` or `RaggedTensor`), all with
        one batch size `B`, a multiple of `num_devices_local`.
      weights: None, or weights in the same structure (None entries allowed).
      plan: the `StackingPlan` (its `num_shards` is N, the mesh size).
      num_devices_local: D, this process's devices, in mesh order.
      capacities: per-stack `Capacity` (a dict by stack name, or one for all
        stacks). A stack without one takes the sum of its tables' limits when
        every table config has `max_ids_per_partition` and
        `max_unique_ids_per_partition` attributes, else the bucketed need of
        this batch (shapes then vary from batch to batch: fix them for
        training, e.g. from `compute_sparse_core_stats`).
      overflow: "error" (default), "drop" or "grow" (module docstring).
      process_index: this process's index, for error messages (global device
        = process_index * D + local device).
      backend: "auto" (the C++ kernels where their library loads, else
        numba's when importable and `EMBEDMESH_NUMBA` is not 0, else numpy's;
        `auto_backend()` says which), "native", "numba" or "numpy" (the same
        arrays from each).
      num_threads: threads of the compiled backends, which run every (stack,
        local device) pair as one task (default `default_num_threads()`: the
        environment variable `EMBEDMESH_PREPROCESS_THREADS`, read once, else
        the cores this process may use; 1 is faster on an oversubscribed
        host, see benchmarks/runs/preprocess-history.md).

    Returns:
      `({stack name: PartitionedCsrFormatTensor}, PreprocessStats)`; pure
      numpy, nothing touches a device.
    """
    D, threads = _check_options(plan, num_devices_local, overflow, backend, num_threads)
    csrs, batch = _local_batch(plan, features, weights, D)
    jobs = _make_jobs(plan, csrs, batch, D)
    name, K = _resolve_backend(backend)
    id_maps = {job.name: _id_map(plan, job) for job in jobs}
    # the raw ids' numba kernels (with the native or numba backend), only where a stack
    # has raw ids: numba is not imported otherwise
    todo = [job for job in jobs if id_maps[job.name] is not None]
    KD = _numba_dynamic() if K is not None and todo else None
    make_run, raws = _run_maker(plan, D, name, K, KD, id_maps)
    caps = {job.name: _capacity_for(capacities, plan, job.name) for job in jobs}
    results, grown = _run_stacks(jobs, caps, make_run, D, threads, overflow, process_index)
    out, stats = _assemble(jobs, results, caps, grown, raws)
    if name == "numba" or KD is not None:  # numba ran: its LLVM is not needed again
        _runtime.page_out_llvm()  # until it compiles
    return out, PreprocessStats(stats)


def _check_options(
    plan: StackingPlan, num_devices_local: int, overflow: str, backend: str, num_threads
) -> tuple[int, int]:
    """`preprocess_batch`'s options checked before any input is read: `(D, threads)`."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if not isinstance(plan, StackingPlan):
        raise TypeError(
            f"plan must be a StackingPlan (see plan_stacking), got {type(plan).__name__}"
        )
    D = int(num_devices_local)
    if D < 1:
        raise ValueError(f"num_devices_local must be >= 1, got {num_devices_local}")
    _check_backend(backend)
    threads = default_num_threads() if num_threads is None else int(num_threads)
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
    return D, threads


def _local_batch(plan: StackingPlan, features, weights, D: int) -> tuple[list, int]:
    """The inputs as kernel `Csr`s and their batch size, checked to split over D devices."""
    # output_shape is global: this process's batch is 1/(N/D) of it (every process
    # drives D devices of the N-device mesh)
    csrs, batch = _batch_csrs(plan, features, weights, max(plan.num_shards // D, 1))
    if batch % D:
        raise ValueError(
            f"the batch size {batch} is not a multiple of the {D} local devices (each "
            f"takes an equal share): pad the batch to a multiple of {D} (masking the "
            f"padded samples out of the loss) or drop the remainder"
        )
    return csrs, batch


def _run_maker(plan: StackingPlan, D: int, name: str, K, KD, id_maps: dict):
    """`(make_run, raws)`: `make_run(job, capacity)`, a stack's run on the backend that
    applies to it (the compiled kernels, numba's for a stack of raw ids where KD loaded,
    or numpy's where they do not fit); numpy's sorts and the raw ids' codes are made
    once a call and reused by every capacity. `raws(job, arrays)`: a stack of raw ids'
    `unique_raw_ids` for its last run's arrays (None for other stacks)."""
    N = plan.num_shards
    Run = _NativeRun if name == "native" else _NumbaRun
    sorted_tables: dict = {}  # numpy backend: per-table sorts, reused by every run of a stack
    coded: dict = {}  # raw ids on numba: each stack's codes, reused by every run of it
    last_raw: dict = {}  # ... and its last run's raw words
    uniq_of: dict = {}  # raw ids on numpy: each stack's distinct ids (`prepare_stack`)

    def make_run(job, cap):
        id_map = id_maps[job.name]
        if id_map is not None and KD is not None and _RawIdsRun.fits(job, N):  # numba's
            run = _RawIdsRun(job, plan, D, cap, KD, coded)
            last_raw[job.name] = run  # (its raw words: made by its task)
            return run
        if id_map is not None:  # raw ids: the numpy path on codes (`host.dynamic_ids`)
            if job.name not in sorted_tables:
                members = [(fp.name, c, seg) for fp, c, seg in job.members(job.tables[0].name)]
                coded_, table, layout, uniq = _dynamic.prepare_stack(
                    members, D, N, id_map.seed, plan.id_owners(job.tables[0])
                )
                uniq_of[job.name] = uniq
                sorted_tables[job.name] = [numpy_backend.sort_table(coded_, table, layout, D, N)]
            return _NumpyRun(job, D, N, cap, sorted_tables[job.name])
        if K is not None and _numba_fits(job, plan, K):
            return Run(job, plan, D, cap, K)
        if job.name not in sorted_tables:
            sorted_tables[job.name] = [
                numpy_backend.sort_table(
                    [(fp.name, c, seg) for fp, c, seg in job.members(t.name)],
                    t,
                    plan.row_layout,
                    D,
                    N,
                )
                for t in job.tables
            ]
        return _NumpyRun(job, D, N, cap, sorted_tables[job.name])

    def raws(job, arrays):
        if job.name in last_raw:
            return last_raw[job.name].raw
        if job.name in uniq_of:
            return _dynamic.raw_pairs(arrays[0], uniq_of[job.name], PAD_ID)
        return None

    return make_run, raws


def _run_stacks(
    jobs: list, caps: dict, make_run, D: int, threads: int, overflow: str, process_index: int
) -> tuple[dict, set]:
    """Every stack run at its capacity (the overflow policy applied): `({stack: (arrays,
    unique totals, pair totals, dropped)}, {grown stacks})`; fills in `caps` where a
    stack had none (the bucketed need) or grew."""
    counting = [job for job in jobs if caps[job.name] is None]
    if counting:  # count first (capacity 0 writes nothing), then fill at the bucketed need
        done = _execute([make_run(job, Capacity(0, 0)) for job in counting], D, threads)
        for job, (_, u_tot, p_tot, _) in zip(counting, done):
            caps[job.name] = Capacity(
                capacity_bucket(p_tot.max(initial=0)), capacity_bucket(u_tot.max(initial=0))
            )
    results = dict(
        zip(
            [job.name for job in jobs],
            _execute([make_run(job, caps[job.name]) for job in jobs], D, threads),
        )
    )
    grow = []
    for job in jobs:
        _, u_tot, p_tot, _ = results[job.name]
        cap = caps[job.name]
        if (
            u_tot.max(initial=0) > cap.max_unique_ids_per_partition
            or p_tot.max(initial=0) > cap.max_ids_per_partition
        ):
            if overflow == "error":
                raise ValueError(_overflow_message(job, u_tot, p_tot, cap, process_index, D))
            if overflow == "grow":
                caps[job.name] = Capacity(
                    max(cap.max_ids_per_partition, capacity_bucket(p_tot.max())),
                    max(cap.max_unique_ids_per_partition, capacity_bucket(u_tot.max())),
                )
                grow.append(job)
                _log.info(
                    "stack %s: capacity grown from %d ids (%d unique) a partition to %d "
                    "(%d) for a batch that needed %d (%d); the step compiles again for the "
                    "new shapes",
                    job.name,
                    cap.max_ids_per_partition,
                    cap.max_unique_ids_per_partition,
                    caps[job.name].max_ids_per_partition,
                    caps[job.name].max_unique_ids_per_partition,
                    int(p_tot.max()),
                    int(u_tot.max()),
                )
    if grow:
        for job, res in zip(
            grow, _execute([make_run(job, caps[job.name]) for job in grow], D, threads)
        ):
            results[job.name] = res
    return results, {job.name for job in grow}


def _assemble(jobs: list, results: dict, caps: dict, grown: set, raws) -> tuple[dict, dict]:
    """The runs' arrays as `PartitionedCsrFormatTensor`s (with a stack of raw ids' raw
    ids, `raws(job, arrays)`) and their `StackStats`: `({stack: tensor}, {stack: stats})`."""
    out, stats = {}, {}
    for job in jobs:
        arrays, u_tot, p_tot, dropped = results[job.name]
        raw = raws(job, arrays)
        out[job.name] = PartitionedCsrFormatTensor(
            *arrays,
            stack=job.name,
            rows_per_device=job.rows_per_device,
            features=job.segments,
            unique_raw_ids=raw,
        )
        num_ids = sum(int(c.splits[-1]) for _, c, _ in job.feats)
        stats[job.name] = StackStats(
            p_tot.astype(np.int64),
            u_tot.astype(np.int64),
            num_ids,
            dropped,
            caps[job.name],
            job.name in grown,
        )
    return out, stats


@dataclasses.dataclass(frozen=True)
class SparseCoreStats:
    """Maxima over sample batches, per stack (see `compute_sparse_core_stats`)."""

    max_ids_per_partition: Mapping[str, int]
    max_unique_ids_per_partition: Mapping[str, int]
    num_batches: int

    def capacities(self, headroom: float = 1.0) -> dict:
        """`{stack: Capacity}`: the maxima times `headroom`, rounded up to buckets."""
        return {
            s: Capacity(
                capacity_bucket(math.ceil(self.max_ids_per_partition[s] * headroom)),
                capacity_bucket(math.ceil(self.max_unique_ids_per_partition[s] * headroom)),
            )
            for s in self.max_ids_per_partition
        }


def compute_sparse_core_stats(
    feature_batches: Iterable[Any],
    plan_or_feature_config: Any,
    *,
    weight_batches: Iterable[Any] | None = None,
    num_shards: int | None = None,
    num_devices_local: int = 1,
    backend: str = "auto",
    num_threads: int | None = None,
) -> SparseCoreStats:
    """Measure per-stack partition maxima over sample batches.

    `feature_batches` is an iterable of batches (a list of one batch is fine),
    each like `preprocess_features`'s `features`; `weight_batches` matches it
    or is None. The second argument is a `StackingPlan`, or a feature config
    together with `num_shards`. `.capacities()` turns the maxima into
    `Capacity`s for `preprocess_features(capacities=...)`.
    """
    if isinstance(plan_or_feature_config, StackingPlan):
        plan = plan_or_feature_config
    else:
        if num_shards is None:
            raise ValueError("num_shards is needed when a feature config is given")
        plan = plan_stacking(plan_or_feature_config, num_shards)
    zero = Capacity(0, 0)
    caps = {s.name: zero for s in plan.stacks}
    max_ids = {s.name: 0 for s in plan.stacks}
    max_unique = {s.name: 0 for s in plan.stacks}
    weight_iter = iter(weight_batches) if weight_batches is not None else None
    count = 0
    for feats in feature_batches:
        w = next(weight_iter) if weight_iter is not None else None
        _, st = preprocess_features(
            feats,
            w,
            plan,
            num_devices_local=num_devices_local,
            capacities=caps,
            overflow="drop",
            backend=backend,
            num_threads=num_threads,
        )
        for s, v in st.stacks.items():
            max_ids[s] = max(max_ids[s], v.max_ids_per_partition)
            max_unique[s] = max(max_unique[s], v.max_unique_ids_per_partition)
        count += 1
    return SparseCoreStats(max_ids, max_unique, count)
