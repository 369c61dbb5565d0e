"""Host preprocessing: a batch of features -> fixed-shape partitioned CSR arrays.

This is the host half of the engine, what the SparseCore's input pipeline
does: for every stack (see `embedmesh.layout.stacking`), for every source device of
this process and every destination shard, the ids that device needs from that
shard, sorted and de-duplicated, plus for every (output row, id) pair the
position of its id in that list and its gain. Every array has a static padded
size (the stack's `Capacity`) so the device program compiles once.

Semantics (all pinned by `tests/test_preprocess.py` against a loop-and-dict
reference):

- The process-local batch of `B` samples is split evenly and in order over
  its `D` local devices: device `d` gets samples `[d*B/D, (d+1)*B/D)`.
- Every entry of an input is an id (`embedmesh.inputs.to_coo`'s training
  semantics); ids must lie in `[0, vocabulary_size)`, else a `ValueError`
  names the feature and the first bad id. This holds whatever
  `validate_weights_and_indices` says: an out-of-range id has no safe meaning
  in a stacked table (TensorFlow silently reads the next table's rows).
- Gains follow the SparseCore: each entry's gain is `w * scale[row]`, scale 1
  (sum), `1/sum(w)` (mean), `1/sqrt(sum(w^2))` (sqrtn), the sums taken over
  all of the row's entries before duplicates merge, 0 when the sum is 0.
  Sequence features (`max_sequence_length = L > 0`) give one output row per
  (sample, position < L) with gain `w`. Duplicate (row, id) pairs merge by
  adding gains (in float64, rounded once to float32).
- Activation buffer of one stack on one device: the rows of the stack's
  features in config order, `B/D * rows_per_sample` rows each (see
  `FeatureSlot`); `R` rows in all.
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

Two interchangeable backends give bit-identical output: a numba kernel
(`backend="numba"`, used by `"auto"` when numba is importable: radix sort per
(table, device) block, one pass to dedup and fill, devices in parallel) and a
pure numpy one (`backend="numpy"`: one composite-key sort per stack). See
`benchmarks/RESULTS_preprocess.md` for their speed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
from typing import Any, Iterable, Mapping, Optional, Union

import jax
import numpy as np

from embedmesh.inputs import (FeatureLayout, check_id_range, flatten_inputs_like, to_csr,
                              validate_structure)
from embedmesh.layout.stacking import StackingPlan, plan_stacking

__all__ = ["Capacity", "FeatureSlot", "OVERFLOW_POLICIES", "PAD_ID", "PartitionedCsrFormatTensor",
           "PreprocessStats", "SparseCoreStats", "StackStats", "capacity_bucket",
           "compute_sparse_core_stats", "default_num_threads", "numba_available",
           "preprocess_batch", "preprocess_features", "preprocess_features_tf"]

OVERFLOW_POLICIES = ("error", "drop", "grow")
PAD_ID = int(np.iinfo(np.int32).max)  # unique_ids padding: out of range on every shard
_COMBINER_CODE = {None: 0, "sum": 0, "mean": 1, "sqrtn": 2}


# ---------------------------------------------------------------------------
# Capacities


def _check_count(cls: str, field: str, value) -> int:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{cls}.{field} must be an int >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static sizes of one stack's partitions (one per source device and shard)."""

    max_ids_per_partition: int  # P: (row, id) pairs, after duplicates merge
    max_unique_ids_per_partition: int  # U: distinct ids

    def __post_init__(self):
        object.__setattr__(self, "max_ids_per_partition",
                           _check_count("Capacity", "max_ids_per_partition",
                                        self.max_ids_per_partition))
        object.__setattr__(self, "max_unique_ids_per_partition",
                           _check_count("Capacity", "max_unique_ids_per_partition",
                                        self.max_unique_ids_per_partition))


def capacity_bucket(n: int, minimum: int = 8) -> int:
    """Smallest bucket >= n among 8, 12, 16, 24, 32, 48, 64, ... (2^k and 1.5 * 2^k).

    Buckets keep recompilations logarithmic when capacities grow, at most
    1.5x the need.
    """
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # next power of two >= n
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


# ---------------------------------------------------------------------------
# Output containers


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    """Where one feature's activations sit in a stack's per-device buffer.

    Rows `[row_offset, row_offset + num_rows)` of the buffer, `samples` local
    samples of `sample_shape` rows each (`FeatureLayout`: `()` for a
    combined feature, `(L,)` for a sequence, `(n,)` for dense `[B, n]` ids),
    row `s * rows_per_sample + p` for local sample `s` and sub-row `p`; the
    first `dim` columns. `output_shape` is the global activation's shape
    without `dim` where `FeatureConfig.output_shape` reshapes it.
    """

    name: str
    row_offset: int
    samples: int
    sample_shape: tuple
    dim: int
    output_shape: Optional[tuple] = None

    @property
    def rows_per_sample(self) -> int:
        return math.prod(self.sample_shape)

    @property
    def num_rows(self) -> int:
        return self.samples * self.rows_per_sample

    def local_shape(self) -> tuple:
        """One device's activation block: `[samples, *sample_shape, dim]`."""
        return (self.samples,) + tuple(self.sample_shape) + (self.dim,)

    def activation_shape(self, num_devices: int) -> tuple:
        """The global activation's shape over `num_devices` devices."""
        if self.output_shape is not None:
            return tuple(self.output_shape) + (self.dim,)
        return (self.samples * num_devices,) + tuple(self.sample_shape) + (self.dim,)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PartitionedCsrFormatTensor:
    """Preprocessed input of ONE stack for the `D` local devices of a process.

    `N` is the number of shards, `U`/`P` the stack's capacities
    (`max_unique_ids_per_partition` / `max_ids_per_partition`), `R` the rows
    of the per-device activation buffer. Partition `(d, j)` holds what source
    device `d` needs from shard `j`. Arrays are numpy on the host (the leaves
    of the pytree); the rest is static aux data.

    Fields:
      unique_ids   [D, N, U] int32: local rows of shard j that device d needs,
                   ascending, distinct; padding `PAD_ID` (int32 max: out of
                   range on every shard, so `take(mode="fill")` reads zeros
                   and `.at[].add(mode="drop")` ignores it).
      unique_counts [D, N] int32: valid entries of `unique_ids[d, j]`.
      pair_rows    [D, N, P] int32: output row (in device d's buffer, < R)
                   of each (row, id) pair; padding `R` (dropped by
                   `segment_sum(num_segments=R)`).
      pair_unique  [D, N, P] int32: index of the pair's id in
                   `unique_ids[d, j]`; padding 0.
      pair_gains   [D, N, P] float32: the pair's gain (combiner scale times
                   weight, duplicates summed); padding 0.
      pair_counts  [D, N] int32: valid entries of the pair arrays.
      stack: the stack's name.  rows_per_device: R.
      features: `FeatureSlot`s of the stack's features, in buffer order.

    On device d: `buffer = segment_sum(gains[..., None] *
    rows_j[pair_unique], pair_rows, R)` over all (j, p), with `rows_j` the
    rows gathered for `unique_ids[d, j]` from shard j; gradients run the
    other way.
    """

    unique_ids: Any
    unique_counts: Any
    pair_rows: Any
    pair_unique: Any
    pair_gains: Any
    pair_counts: Any
    stack: str
    rows_per_device: int
    features: tuple

    _ARRAYS = ("unique_ids", "unique_counts", "pair_rows", "pair_unique", "pair_gains",
               "pair_counts")

    def tree_flatten(self):
        return (tuple(getattr(self, a) for a in self._ARRAYS),
                (self.stack, self.rows_per_device, self.features))

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def num_devices(self) -> int:
        return int(np.shape(self.unique_ids)[0])

    @property
    def num_shards(self) -> int:
        return int(np.shape(self.unique_ids)[1])

    @property
    def capacity(self) -> Capacity:
        return Capacity(int(np.shape(self.pair_rows)[2]), int(np.shape(self.unique_ids)[2]))

    def feature_slot(self, name: str) -> FeatureSlot:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"feature {name!r} is not in stack {self.stack}")


@dataclasses.dataclass(frozen=True)
class StackStats:
    """What one stack's preprocessing saw (counts before any dropping)."""

    ids_per_partition: np.ndarray  # [D, N] int64: (row, id) pairs after merging
    unique_ids_per_partition: np.ndarray  # [D, N] int64
    num_ids: int  # input entries (row, id) of this stack, before merging
    dropped_ids: int  # input entries lost to overflow="drop"
    capacity: Capacity  # capacity of the returned arrays
    grown: bool  # overflow="grow" raised the capacity for this batch

    @property
    def max_ids_per_partition(self) -> int:
        return int(self.ids_per_partition.max(initial=0))

    @property
    def max_unique_ids_per_partition(self) -> int:
        return int(self.unique_ids_per_partition.max(initial=0))

    @property
    def required_capacity(self) -> Capacity:
        """The smallest bucketed capacity that holds this batch."""
        return Capacity(capacity_bucket(self.max_ids_per_partition),
                        capacity_bucket(self.max_unique_ids_per_partition))


@dataclasses.dataclass(frozen=True)
class PreprocessStats:
    """Per-stack `StackStats` of one `preprocess_features` call."""

    stacks: Mapping[str, StackStats]

    def __getitem__(self, stack: str) -> StackStats:
        return self.stacks[stack]

    @property
    def dropped_ids(self) -> dict:
        return {k: v.dropped_ids for k, v in self.stacks.items()}

    @property
    def capacities(self) -> dict:
        """Capacities of the returned arrays (after any growth)."""
        return {k: v.capacity for k, v in self.stacks.items()}

    @property
    def grown(self) -> dict:
        """Stacks whose capacity overflow="grow" raised: `{stack: new Capacity}`."""
        return {k: v.capacity for k, v in self.stacks.items() if v.grown}


# ---------------------------------------------------------------------------
# Canonical host form of one feature: (ids, splits, weights) and its layout


@dataclasses.dataclass
class _Canon:
    ids: np.ndarray  # [nnz] int32 or int64, C-contiguous
    splits: np.ndarray  # [num_rows + 1] int64: output row r holds entries splits[r]:splits[r+1]
    weights: Optional[np.ndarray]  # [nnz] float32 or None (all ones)
    layout: FeatureLayout

    @property
    def batch(self) -> int:
        return self.layout.batch


def _as_kernel_ids(ids: np.ndarray) -> np.ndarray:
    if ids.dtype != np.int32 and ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    return np.ascontiguousarray(ids)


def _canonical(name: str, feature, inp, weight, batch_scale: int) -> _Canon:
    """One feature as bags, through `inputs.to_csr` (the serving path's rules too).

    `to_csr` checks sparse indices while deriving row offsets, so only the
    structure is validated first.
    """
    validate_structure(name, inp, weight)
    c = to_csr(name, feature, inp, weight, batch_scale=batch_scale)
    if c.ids.dtype == np.uint64:  # checked before the int64 view turns 2**64-1 into -1
        check_id_range(name, c.ids, feature.table.vocabulary_size)
    return _Canon(_as_kernel_ids(c.ids), np.ascontiguousarray(c.splits, np.int64),
                  None if c.weights is None else np.ascontiguousarray(c.weights, np.float32),
                  c.layout)


def _canonical_batch(plan: StackingPlan, features, weights,
                     batch_scale: int = 1) -> tuple[list, int]:
    resolved = plan.resolved
    flat_inputs = flatten_inputs_like(resolved, features, "features")
    flat_weights = ([None] * len(flat_inputs) if weights is None
                    else flatten_inputs_like(resolved, weights, "weights"))
    canon = []
    batch = None
    first = None
    for name, feature, inp, w in zip(resolved.feature_names, resolved.features, flat_inputs,
                                     flat_weights):
        if inp is None:
            raise ValueError(f"feature {name} has no input (feature {name} is missing); "
                             f"preprocessing needs every feature of the config")
        c = _canonical(name, feature, inp, w, batch_scale)
        if batch is None:
            batch, first = c.batch, name
        elif c.batch != batch:
            raise ValueError(f"feature {name} has batch size {c.batch} but feature {first} has "
                             f"{batch}; all features of one call share one batch size")
        canon.append(c)
    return canon, batch


# ---------------------------------------------------------------------------
# numba backend


_NUMBA = None  # None: not tried yet; False: unavailable; else a namespace of kernels


def _build_numba():
    import numba
    from numba import njit

    @njit(cache=True, nogil=True)
    def table_kernel(ids, weights, splits, fmeta, d0, d1, n_shards, shard_shift, rotation, rps,
                     local_off, vocab, nbits, low_bits, row_base, row_span, cap_u, cap_p,
                     unique_ids, pair_rows, pair_unique, pair_gains, u_total, p_total, u_kept,
                     p_kept, dropped, bad):
        """One table's features for local devices [d0, d1) (no GIL: threads run devices).

        fmeta[f] = (first split index, rows per device, buffer row offset,
        combiner code). Each (table, device) block is sorted by key
        `shard * rps + row // N` (a stable LSD radix sort, so entries with one
        key stay in entry order, i.e. in output-row order), then one pass per
        shard merges duplicates and appends to the partition. Sort values pack
        the key above `low_bits` bits holding the output row (unweighted) or
        the entry's index in the block (weighted). Counters [D, N] carry over
        from the stack's previous tables.
        """
        # (No calls to other jitted functions: a closure over them would change numba's
        # cache key in every process and force a recompilation.)
        has_w = weights.shape[0] > 0
        n_feat = fmeta.shape[0]
        passes = (nbits + 10) // 11  # LSD radix sort: <= 11 bits a pass
        bits = (nbits + passes - 1) // passes if passes else 1
        mask = (1 << bits) - 1
        low_mask = (np.int64(1) << low_bits) - 1
        for d in range(d0, d1):
            m = 0
            for f in range(n_feat):
                sb = fmeta[f, 0]
                rpd = fmeta[f, 1]
                m += splits[sb + (d + 1) * rpd] - splits[sb + d * rpd]
            vals = np.empty(m, np.int64)
            hist = np.zeros((max(passes, 1), 1 << bits), np.int64)
            per_shard = np.zeros(n_shards + 1, np.int64)
            if has_w:
                gain = np.empty(m, np.float64)
                orow = np.empty(m, np.int32)
                row_scale = np.empty(0, np.float64)
            else:
                gain = np.empty(0, np.float64)
                orow = np.empty(0, np.int32)
                row_scale = np.empty(row_span, np.float64)
            i = 0
            badk = -1
            for f in range(n_feat):
                sb = fmeta[f, 0]
                rpd = fmeta[f, 1]
                ooff = fmeta[f, 2]
                comb = fmeta[f, 3]
                for r in range(rpd):
                    s = splits[sb + d * rpd + r]
                    e = splits[sb + d * rpd + r + 1]
                    scale = 1.0
                    if comb != 0:
                        acc = 0.0
                        if has_w:
                            for k in range(s, e):
                                w = np.float64(weights[k])
                                acc += w if comb == 1 else w * w
                        else:
                            acc = np.float64(e - s)
                        if comb == 2:
                            acc = math.sqrt(acc)
                        scale = 1.0 / acc if acc != 0.0 else 0.0
                    o = ooff + r
                    if not has_w:
                        row_scale[o - row_base] = scale
                    for k in range(s, e):
                        v = np.int64(ids[k])
                        if v < 0 or v >= vocab:
                            if badk < 0:
                                badk = k
                            continue
                        if shard_shift >= 0:
                            q = v >> shard_shift
                            rem = v & (n_shards - 1)
                        else:
                            q = v // n_shards
                            rem = v - q * n_shards
                        j = rem + rotation
                        if j >= n_shards:
                            j -= n_shards
                        key = j * rps + q
                        for p in range(passes):
                            hist[p, (key >> (p * bits)) & mask] += 1
                        per_shard[j + 1] += 1
                        if has_w:
                            gain[i] = np.float64(weights[k]) * scale
                            orow[i] = o
                            vals[i] = (key << low_bits) | i
                        else:
                            vals[i] = (key << low_bits) | o
                        i += 1
            if badk >= 0:
                bad[d] = badk
                continue
            # Stable LSD radix sort of vals by `vals >> low_bits` (histograms counted above).
            srt = vals
            dst = np.empty(m, np.int64)
            for p in range(passes):
                c = hist[p]
                trivial = False
                for b in range(1 << bits):
                    if c[b] == m:
                        trivial = True
                        break
                if trivial:
                    continue
                acc_c = 0
                for b in range(1 << bits):
                    cnt = c[b]
                    c[b] = acc_c
                    acc_c += cnt
                shift = low_bits + p * bits
                for i in range(m):
                    x = srt[i]
                    b = (x >> shift) & mask
                    pos = c[b]
                    c[b] = pos + 1
                    dst[pos] = x
                srt, dst = dst, srt
            for j in range(n_shards):
                per_shard[j + 1] += per_shard[j]
            n_drop = 0
            for j in range(n_shards):
                t0 = per_shard[j]
                t1 = per_shard[j + 1]
                if t0 == t1:
                    continue
                uo = unique_ids[d, j]
                pr = pair_rows[d, j]
                pu = pair_unique[d, j]
                pg = pair_gains[d, j]
                uc = u_total[d, j]
                pc = p_total[d, j]
                uk = u_kept[d, j]
                pk = p_kept[d, j]
                base = local_off - j * rps
                prev_key = -1
                prev_o = -1
                cur_u = 0
                cur_q = 0
                keep_u = False
                keep_p = False
                acc_g = 0.0
                for t in range(t0, t1):
                    x = srt[t]
                    key = x >> low_bits
                    lo = x & low_mask
                    if has_w:
                        o = np.int64(orow[lo])
                        g = gain[lo]
                    else:
                        o = lo
                        g = row_scale[o - row_base]
                    if key != prev_key:
                        if keep_p:
                            pg[cur_q] = acc_g
                        prev_key = key
                        cur_u = uc
                        uc += 1
                        keep_u = cur_u < cap_u and pc < cap_p
                        if keep_u:
                            uo[cur_u] = base + key
                            uk = cur_u + 1
                        new_pair = True
                    else:
                        new_pair = o != prev_o
                        if new_pair and keep_p:
                            pg[cur_q] = acc_g
                    if new_pair:
                        prev_o = o
                        cur_q = pc
                        pc += 1
                        keep_p = keep_u and cur_q < cap_p
                        if keep_p:
                            pr[cur_q] = o
                            pu[cur_q] = cur_u
                            pk = cur_q + 1
                            acc_g = g
                        else:
                            n_drop += 1
                    elif keep_p:
                        acc_g += g
                    else:
                        n_drop += 1
                if keep_p:
                    pg[cur_q] = acc_g
                u_total[d, j] = uc
                p_total[d, j] = pc
                u_kept[d, j] = uk
                p_kept[d, j] = pk
            dropped[d] += n_drop

    @njit(cache=True, nogil=True)
    def fill_padding(unique_ids, pair_rows, pair_unique, pair_gains, u_kept, p_kept, pad_id,
                     pad_row, d0, d1):
        n_shards = unique_ids.shape[1]
        for d in range(d0, d1):
            for j in range(n_shards):
                unique_ids[d, j, u_kept[d, j]:] = pad_id
                pair_rows[d, j, p_kept[d, j]:] = pad_row
                pair_unique[d, j, p_kept[d, j]:] = 0
                pair_gains[d, j, p_kept[d, j]:] = 0.0

    class _Kernels:
        pass

    ns = _Kernels()
    ns.table_kernel = table_kernel
    ns.fill_padding = fill_padding
    ns.numba = numba
    return ns


def _numba_kernels():
    global _NUMBA
    if _NUMBA is None:
        try:
            _NUMBA = _build_numba()
        except ImportError:
            _NUMBA = False
    return _NUMBA or None


def numba_available() -> bool:
    """True when the numba backend can be used."""
    return _numba_kernels() is not None


# ---------------------------------------------------------------------------
# Per-stack work shared by both backends


@dataclasses.dataclass
class _StackJob:
    name: str
    feats: list  # (FeaturePlacement, _Canon, FeatureSlot) in buffer order
    tables: list  # TablePlacement in stack row order
    rows_per_shard: int
    rows_per_device: int
    slots: tuple

    def members(self, table_name: str) -> list:
        return [m for m in self.feats if m[0].table == table_name]


def _overflow_message(job: _StackJob, u_tot, p_tot, cap: Capacity, process_index: int,
                      num_devices_local: int) -> Optional[str]:
    for what, tot, c in (("unique ids", u_tot, cap.max_unique_ids_per_partition),
                         ("ids", p_tot, cap.max_ids_per_partition)):
        over = np.argwhere(tot > c)
        if over.size:
            d, j = (int(x) for x in over[0])
            field = ("max_unique_ids_per_partition" if what == "unique ids"
                     else "max_ids_per_partition")
            return (f"stack {job.name}: device {process_index * num_devices_local + d} (local "
                    f"device {d}) needs {int(tot[d, j])} {what} from shard {j}, over the "
                    f"capacity {field}={c} ({over.shape[0]} partition(s) over, largest "
                    f"{int(tot.max())}); raise the stack's capacity (capacities=..., see "
                    f"compute_sparse_core_stats) or pass overflow='drop' or 'grow'")
    return None


def _range_error(job: _StackJob, table):
    for fp, c, _ in job.members(table.name):
        check_id_range(fp.name, c.ids, table.vocabulary_size)
    raise AssertionError("id range error not found")  # pragma: no cover


def _bits(x: int) -> int:
    return int(max(x, 0)).bit_length()


def _numba_fits(job: _StackJob, N: int) -> bool:
    """Whether every sort value (key bits + low bits) fits 62 bits."""
    for t in job.tables:
        nnz = sum(int(c.splits[-1]) for _, c, _ in job.members(t.name))
        low = max(_bits(job.rows_per_device), _bits(nnz))
        if _bits(t.padded_vocabulary_size - 1) + low > 62:
            return False
    return True


def _table_args(members: list):
    """Kernel inputs of one table: its features' ids, weights and splits, concatenated."""
    if len(members) == 1:
        fp, c, slot = members[0]
        ids, splits = c.ids, c.splits
        weights = c.weights if c.weights is not None else np.zeros(0, np.float32)
        fmeta = np.array([[0, slot.num_rows, slot.row_offset,
                           _COMBINER_CODE[c.layout.combiner]]], np.int64)
        return ids, weights, splits, fmeta
    ids = np.concatenate([c.ids for _, c, _ in members])
    if any(c.weights is not None for _, c, _ in members):
        weights = np.concatenate([c.weights if c.weights is not None
                                  else np.ones(c.ids.shape[0], np.float32)
                                  for _, c, _ in members])
    else:
        weights = np.zeros(0, np.float32)
    parts, rows, base, sbase = [], [], 0, 0
    for fp, c, slot in members:
        parts.append(c.splits + base)
        rows.append([sbase, slot.num_rows, slot.row_offset, _COMBINER_CODE[c.layout.combiner]])
        base += c.ids.shape[0]
        sbase += c.splits.shape[0]
    return ids, weights, np.concatenate(parts), np.array(rows, np.int64)


_POOL = (None, 0)  # (executor, its number of threads), shared by every call
_POOL_LOCK = threading.Lock()


def _thread_pool(n: int):
    global _POOL
    with _POOL_LOCK:
        if _POOL[1] < n:
            _POOL = (concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="embedmesh"), n)
        return _POOL[0]


def default_num_threads() -> int:
    """Threads `preprocess_features` uses by default: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class _NumbaRun:
    """One stack's numba work at one capacity: output arrays, then one task per device."""

    def __init__(self, job: _StackJob, D: int, N: int, cap: Capacity, K):
        U, P = cap.max_unique_ids_per_partition, cap.max_ids_per_partition
        self.job, self.K, R = job, K, job.rows_per_device
        self.unique_ids = np.empty((D, N, U), np.int32)
        self.pair_rows = np.empty((D, N, P), np.int32)
        self.pair_unique = np.empty((D, N, P), np.int32)
        self.pair_gains = np.empty((D, N, P), np.float32)
        self.u_total = np.zeros((D, N), np.int64)
        self.p_total = np.zeros((D, N), np.int64)
        self.u_kept = np.zeros((D, N), np.int32)
        self.p_kept = np.zeros((D, N), np.int32)
        self.dropped = np.zeros(D, np.int64)
        shift = N.bit_length() - 1 if N & (N - 1) == 0 else -1
        self.calls = []
        for t in job.tables:
            members = job.members(t.name)
            if not members:
                continue
            ids, weights, splits, fmeta = _table_args(members)
            low_bits = _bits(ids.shape[0] - 1) if weights.shape[0] else _bits(R - 1)
            row_base = min(slot.row_offset for _, _, slot in members)
            row_span = max(slot.row_offset + slot.num_rows for _, _, slot in members) - row_base
            self.calls.append((t, np.full(D, -1, np.int64), (ids, weights, splits, fmeta), (
                N, shift, t.rotation, t.rows_per_shard, t.local_row_offset, t.vocabulary_size,
                _bits(t.padded_vocabulary_size - 1), low_bits, row_base, row_span, U, P,
                self.unique_ids, self.pair_rows, self.pair_unique, self.pair_gains,
                self.u_total, self.p_total, self.u_kept, self.p_kept, self.dropped)))

    def device(self, d: int) -> None:
        """Every table of the stack, in row order, for local device d (no GIL held)."""
        for _, bad, head, tail in self.calls:
            self.K.table_kernel(*head, d, d + 1, *tail, bad)
            if bad[d] >= 0:
                return
        self.K.fill_padding(self.unique_ids, self.pair_rows, self.pair_unique, self.pair_gains,
                            self.u_kept, self.p_kept, PAD_ID, self.job.rows_per_device, d, d + 1)

    def finish(self):
        for t, bad, _, _ in self.calls:
            if (bad >= 0).any():
                _range_error(self.job, t)
        arrays = (self.unique_ids, self.u_kept, self.pair_rows, self.pair_unique,
                  self.pair_gains, self.p_kept)
        return arrays, self.u_total, self.p_total, int(self.dropped.sum())


def _execute(runs: list, D: int, threads: int) -> list:
    """Run every (stack, device) task, on `threads` threads; results in order of `runs`."""
    tasks = [(r, d) for r in runs if hasattr(r, "device") for d in range(D)]
    if threads <= 1 or len(tasks) <= 1:
        for r, d in tasks:
            r.device(d)
    else:
        list(_thread_pool(threads).map(lambda task: task[0].device(task[1]), tasks))
    return [r.finish() for r in runs]


# ---------------------------------------------------------------------------
# numpy backend


def _numpy_table(job: _StackJob, t, D: int, N: int) -> Optional[dict]:
    """One table's entries sorted by (partition, row, entry order), merged into pairs.

    Capacity-independent; ranks are within this table's part of each partition.
    """
    members = job.members(t.name)
    if not members:
        return None
    keys, orows, gains = [], [], []
    S = t.rows_per_shard
    for fp, c, slot in members:
        check_id_range(fp.name, c.ids, t.vocabulary_size)
        rows_total = c.splits.shape[0] - 1
        lengths = np.diff(c.splits)
        row_of = np.repeat(np.arange(rows_total, dtype=np.int64), lengths)
        rpd = slot.num_rows
        d = row_of // rpd if rpd else row_of
        orows.append(slot.row_offset + row_of - d * rpd)
        w = None if c.weights is None else c.weights.astype(np.float64)
        combiner = c.layout.combiner
        if combiner in ("mean", "sqrtn"):
            if w is None:
                den = lengths.astype(np.float64)
            else:
                den = np.bincount(row_of, weights=w if combiner == "mean" else w * w,
                                  minlength=rows_total).astype(np.float64, copy=False)
            if combiner == "sqrtn":
                den = np.sqrt(den)
            scale = np.divide(1.0, den, out=np.zeros_like(den), where=den != 0)
            gains.append(scale[row_of] if w is None else w * scale[row_of])
        else:
            gains.append(np.ones(row_of.shape[0]) if w is None else w)
        ids = c.ids.astype(np.int64)
        if N & (N - 1) == 0:  # shifts and masks: much cheaper than int64 division
            shift = N.bit_length() - 1
            j = ((ids & (N - 1)) + t.rotation) & (N - 1)
            keys.append((d * N + j) * S + (ids >> shift))
        else:
            j = (ids % N + t.rotation) % N
            keys.append((d * N + j) * S + ids // N)
    key, orow, gain = (x[0] if len(x) == 1 else np.concatenate(x) for x in (keys, orows, gains))
    n = key.shape[0]
    ibits = _bits(n - 1)
    if _bits(D * N * S - 1) + ibits <= 63:
        packed = (key << ibits) | np.arange(n, dtype=np.int64)
        packed.sort()
        idx = packed & ((1 << ibits) - 1)
        key = packed >> ibits
    else:
        idx = np.argsort(key, kind="stable")
        key = key[idx]
    orow = orow[idx]
    gain = gain[idx]
    new_u = np.ones(n, bool)
    new_u[1:] = key[1:] != key[:-1]
    new_p = new_u.copy()
    new_p[1:] |= orow[1:] != orow[:-1]
    pstart = np.flatnonzero(new_p)
    DN = D * N
    pair_key = key[pstart]
    ukey = key[new_u]
    u_part = ukey // S
    p_part = pair_key // S
    u_cnt = np.bincount(u_part, minlength=DN)
    p_cnt = np.bincount(p_part, minlength=DN)
    u_first = np.cumsum(u_cnt) - u_cnt
    p_first = np.cumsum(p_cnt) - p_cnt
    return dict(
        u_part=u_part, u_row=t.local_row_offset + ukey - u_part * S,
        u_rank=np.arange(ukey.shape[0]) - u_first[u_part],
        p_part=p_part, p_rank=np.arange(pstart.shape[0]) - p_first[p_part],
        p_urank=np.cumsum(new_u)[pstart] - 1 - u_first[p_part],
        p_first=new_u[pstart], p_orow=orow[pstart],
        p_gain=np.add.reduceat(gain, pstart) if n else np.zeros(0),
        p_entries=np.diff(np.append(pstart, n)), u_cnt=u_cnt, p_cnt=p_cnt)


class _NumpyRun:
    """One stack's numpy work at one capacity (runs in `finish`)."""

    def __init__(self, job: _StackJob, D: int, N: int, cap: Capacity, per_table: list):
        self.args = (job, D, N, cap, per_table)

    def finish(self):
        return _run_numpy(*self.args)


def _run_numpy(job: _StackJob, D: int, N: int, cap: Capacity, per_table: list):
    U, P = cap.max_unique_ids_per_partition, cap.max_ids_per_partition
    DN = D * N
    unique_ids = np.full((DN, U), PAD_ID, np.int32)
    pair_rows = np.full((DN, P), job.rows_per_device, np.int32)
    pair_unique = np.zeros((DN, P), np.int32)
    pair_gains = np.zeros((DN, P), np.float32)
    u_tot = np.zeros(DN, np.int64)
    p_tot = np.zeros(DN, np.int64)
    u_kept = np.zeros(DN, np.int64)
    p_kept = np.zeros(DN, np.int64)
    dropped = 0
    for tt in per_table:
        if tt is None:
            continue
        u_ord = u_tot[tt["u_part"]] + tt["u_rank"]
        q_ord = p_tot[tt["p_part"]] + tt["p_rank"]
        pu_ord = u_tot[tt["p_part"]] + tt["p_urank"]
        keep_p = (pu_ord < U) & (q_ord < P)
        keep_u = (u_ord < U) & (q_ord[tt["p_first"]] < P)
        dropped += int(tt["p_entries"][~keep_p].sum())
        up, uo = tt["u_part"][keep_u], u_ord[keep_u]
        unique_ids[up, uo] = tt["u_row"][keep_u]
        kp, kq = tt["p_part"][keep_p], q_ord[keep_p]
        pair_rows[kp, kq] = tt["p_orow"][keep_p]
        pair_unique[kp, kq] = pu_ord[keep_p]
        pair_gains[kp, kq] = tt["p_gain"][keep_p]
        u_kept += np.bincount(up, minlength=DN)
        p_kept += np.bincount(kp, minlength=DN)
        u_tot += tt["u_cnt"]
        p_tot += tt["p_cnt"]
    arrays = (unique_ids.reshape(D, N, U), u_kept.astype(np.int32).reshape(D, N),
              pair_rows.reshape(D, N, P), pair_unique.reshape(D, N, P),
              pair_gains.reshape(D, N, P), p_kept.astype(np.int32).reshape(D, N))
    return arrays, u_tot.reshape(D, N), p_tot.reshape(D, N), dropped


# ---------------------------------------------------------------------------
# Public entry points


CapacitiesArg = Union[None, Capacity, Mapping[str, Capacity]]


def _capacity_for(capacities: CapacitiesArg, plan: StackingPlan, stack: str) -> Optional[Capacity]:
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


def _make_jobs(plan: StackingPlan, canon: list, batch: int, D: int) -> list:
    b = batch // D
    by_name = dict(zip(plan.resolved.feature_names, canon))
    jobs = []
    for s in plan.stacks:
        feats, slots, off = [], [], 0
        for fname in s.features:
            fp = plan.feature(fname)
            layout = by_name[fname].layout
            slot = FeatureSlot(fname, off, b, tuple(layout.sample_shape), fp.dim,
                               layout.output_shape)
            off += slot.num_rows
            feats.append((fp, by_name[fname], slot))
            slots.append(slot)
        jobs.append(_StackJob(s.name, feats, [plan.table(t) for t in s.tables], s.rows_per_shard,
                              off, tuple(slots)))
    return jobs


def _resolve_backend(backend: str):
    if backend not in ("auto", "numba", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    if backend == "numpy":
        return None
    K = _numba_kernels()
    if K is None and backend == "numba":
        raise ImportError("backend='numba' needs the numba package")
    return K


_SEED_ARGS = ("num_replicas_in_sync", "max_ids_per_chip_per_sample", "max_minibatches_per_sc",
              "num_sc_per_chip", "num_sc_shards", "stacked_table_to_tables",
              "table_to_stacked_table_offset", "table_to_sample_count",
              "feature_to_sample_offset", "flat_features", "flat_inputs", "flat_weights")


def preprocess_features(*args, **kwargs):
    """Preprocess a batch; two call forms.

    - embedmesh's: `preprocess_features(features, weights, plan, *,
      num_devices_local=1, capacities=None, overflow="error", process_index=0,
      backend="auto", num_threads=None)` -> `({stack: PartitionedCsrFormatTensor},
      PreprocessStats)`; see `preprocess_batch`.
    - TensorFlow's (`TPUEmbeddingV2.preprocess_features`): `num_replicas_in_sync,
      max_ids_per_chip_per_sample, max_minibatches_per_sc, num_sc_per_chip,
      num_sc_shards, stacked_table_to_tables, table_to_stacked_table_offset,
      table_to_sample_count, feature_to_sample_offset, flat_features,
      flat_inputs, flat_weights=None` (by keyword or position; embedmesh's
      keyword options may be added) -> `({stack: PartitionedCsrFormatTensor},
      max_ids_per_partition, max_unique_ids_per_partition)`, the
      `(dict, int, int)` tuple `dequeue` takes; see `preprocess_features_tf`.

    The form is told by the first argument (an int: TensorFlow's) or by any
    of TensorFlow's keywords.
    """
    if any(k in kwargs for k in _SEED_ARGS) or (
            args and isinstance(args[0], (int, np.integer)) and not isinstance(args[0], bool)):
        return preprocess_features_tf(*args, **kwargs)
    return preprocess_batch(*args, **kwargs)


def _seed_int(field: str, value, minimum: int = 1) -> int:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and value >= minimum):
        raise ValueError(f"preprocess_features: {field} must be an int >= {minimum}, got "
                         f"{value!r}")
    return int(value)


def _seed_features(flat_features):
    """(ResolvedFeatures, names) of TensorFlow's flat_features: `[(joined path,
    FeatureConfig)]` as `nest.flatten_with_joined_string_paths` gives, or a
    (nested) feature config itself."""
    from embedmesh.config import FeatureConfig, _resolve_feature_config, resolve_feature_config

    pairs = isinstance(flat_features, (list, tuple)) and flat_features and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], FeatureConfig)
        for p in flat_features)
    if not pairs:
        return resolve_feature_config(flat_features), False
    paths = [str(p[0]) for p in flat_features]
    configs = [p[1] for p in flat_features]
    resolved = _resolve_feature_config(configs)
    names = tuple(f.name or path for path, f in zip(paths, configs))
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"preprocess_features: flat_features names are not unique: {dup}")
    return dataclasses.replace(resolved, feature_names=names), True


def preprocess_features_tf(num_replicas_in_sync: int, max_ids_per_chip_per_sample: int,
                           max_minibatches_per_sc: int, num_sc_per_chip: int, num_sc_shards: int,
                           stacked_table_to_tables: Optional[Mapping[str, Any]],
                           table_to_stacked_table_offset: Optional[Mapping[str, tuple]],
                           table_to_sample_count: Optional[Mapping[str, int]],
                           feature_to_sample_offset: Optional[Mapping[str, int]],
                           flat_features: Any, flat_inputs: Any, flat_weights: Optional[Any] = None,
                           **options) -> tuple:
    """TensorFlow's `TPUEmbeddingV2.preprocess_features` on embedmesh's plan.

    Mapping of TensorFlow's SparseCore terms:

    - `num_replicas_in_sync` -> the number of shards N (the mesh size); the
      local devices D default to N (one process; pass `num_devices_local`
      with several).
    - `flat_features` -> the feature structure: TensorFlow's `[(joined path,
      FeatureConfig)]` (feature names are `FeatureConfig.name or path`, as
      `MeshEmbedding` names a nested config's features), or a feature config.
      `flat_inputs` / `flat_weights`: the inputs (weights, None entries
      allowed) in that order (a flat list; or nested like a given config).
    - `stacked_table_to_tables` (`{stack: [TableConfig or table name]}`) is
      checked against embedmesh's stacking and selects it: the same groups as
      `plan_stacking(stack_tables=True)` or as `stack_tables=False` (None:
      the default); any other grouping is a ValueError. The returned dict is
      keyed by embedmesh's stack names (a table's name, or names joined by
      "+"), which may differ from the given keys.
    - `table_to_stacked_table_offset` (`{table: (stack, offset, shift)}`):
      checked to name every table and its stack; offsets and shifts are
      ignored (embedmesh's layout: `StackingPlan`, `TablePlacement.rotation`).
    - `table_to_sample_count`, `feature_to_sample_offset`: checked to be
      int-valued dicts over the stacks / feature paths; values ignored
      (embedmesh derives the activation layout from the batch).
    - `num_sc_shards` checked to equal `num_replicas_in_sync *
      num_sc_per_chip`; `num_sc_per_chip`, `max_ids_per_chip_per_sample`,
      `max_minibatches_per_sc` checked to be ints >= 1 and otherwise ignored
      (no SparseCores, no minibatching: partition sizes are `capacities`).
    - `**options`: `preprocess_batch`'s keywords (capacities, overflow,
      num_devices_local, process_index, backend, num_threads).

    Returns `({stack: PartitionedCsrFormatTensor}, max_ids_per_partition,
    max_unique_ids_per_partition)`: the tuple `MeshEmbedding.dequeue` takes,
    host numpy arrays identical to `preprocess_batch`'s for the same features
    (the ints: the batch's largest partition, before padding; TensorFlow's are
    its unpadded CSR sizes). Statistics: use `preprocess_batch`.
    """
    n = _seed_int("num_replicas_in_sync", num_replicas_in_sync)
    per_chip = _seed_int("num_sc_per_chip", num_sc_per_chip)
    _seed_int("max_ids_per_chip_per_sample", max_ids_per_chip_per_sample)
    _seed_int("max_minibatches_per_sc", max_minibatches_per_sc)
    if _seed_int("num_sc_shards", num_sc_shards) != n * per_chip:
        raise ValueError(f"preprocess_features: num_sc_shards ({num_sc_shards}) must be "
                         f"num_replicas_in_sync * num_sc_per_chip = {n * per_chip}")
    resolved, flat = _seed_features(flat_features)
    plan = _seed_plan(resolved, n, stacked_table_to_tables)
    table_names = set(resolved.table_names)
    groups = _seed_groups(stacked_table_to_tables, resolved) if stacked_table_to_tables else {}
    if table_to_stacked_table_offset is not None:
        got = set(map(str, table_to_stacked_table_offset))
        if got != table_names:
            raise ValueError(f"preprocess_features: table_to_stacked_table_offset names tables "
                             f"{sorted(got)}, the features use {sorted(table_names)}")
        for t, v in table_to_stacked_table_offset.items():
            if not (isinstance(v, (tuple, list)) and len(v) == 3):
                raise ValueError(f"preprocess_features: table_to_stacked_table_offset[{t!r}] "
                                 f"must be (stack, offset, shift), got {v!r}")
            if groups and (v[0] not in groups or t not in groups[v[0]]):
                raise ValueError(f"preprocess_features: table_to_stacked_table_offset puts table "
                                 f"{t} in stack {v[0]!r}, stacked_table_to_tables does not")
    for field, value, keys in (("table_to_sample_count", table_to_sample_count,
                                set(groups) if groups else None),
                               ("feature_to_sample_offset", feature_to_sample_offset,
                                set(resolved.feature_names))):
        if value is None:
            continue
        if not isinstance(value, Mapping) or not all(
                isinstance(v, (int, np.integer)) for v in value.values()):
            raise ValueError(f"preprocess_features: {field} must be a dict of ints, got "
                             f"{value!r}")
        if keys is not None and set(map(str, value)) != keys:
            raise ValueError(f"preprocess_features: {field} has keys {sorted(map(str, value))}, "
                             f"expected {sorted(keys)}")
    if flat:
        features = list(flat_inputs) if isinstance(flat_inputs, (list, tuple)) else flat_inputs
        weights = (None if flat_weights is None else
                   list(flat_weights) if isinstance(flat_weights, (list, tuple)) else flat_weights)
    else:
        features, weights = flat_inputs, flat_weights
        if isinstance(flat_inputs, (list, tuple)) and not isinstance(
                _config_structure(resolved), (list, tuple)):
            features = jax.tree_util.tree_unflatten(resolved.treedef, list(flat_inputs))
            if isinstance(flat_weights, (list, tuple)):
                weights = jax.tree_util.tree_unflatten(resolved.treedef, list(flat_weights))
    options.setdefault("num_devices_local", n)
    out, stats = preprocess_batch(features, weights, plan, **options)
    return (out, max((st.max_ids_per_partition for st in stats.stacks.values()), default=0),
            max((st.max_unique_ids_per_partition for st in stats.stacks.values()), default=0))


def _config_structure(resolved):
    return jax.tree_util.tree_unflatten(resolved.treedef, list(resolved.features))


def _seed_groups(stacked_table_to_tables, resolved) -> dict:
    from embedmesh.config import TableConfig

    if not isinstance(stacked_table_to_tables, Mapping):
        raise ValueError(f"preprocess_features: stacked_table_to_tables must be a dict "
                         f"{{stack: [tables]}}, got {type(stacked_table_to_tables).__name__}")
    groups = {}
    for stack, tables in stacked_table_to_tables.items():
        names = []
        for t in (tables if isinstance(tables, (list, tuple)) else [tables]):
            try:
                names.append(resolved.table_name(t) if isinstance(t, TableConfig) else str(t))
            except KeyError:
                raise ValueError(f"preprocess_features: stacked_table_to_tables[{stack!r}] holds "
                                 f"a table no feature uses: {t!r}") from None
        groups[stack] = names
    return groups


def _seed_plan(resolved, n: int, stacked_table_to_tables) -> StackingPlan:
    if stacked_table_to_tables is None:
        return plan_stacking(resolved, n)
    groups = _seed_groups(stacked_table_to_tables, resolved)
    want = sorted(sorted(g) for g in groups.values())
    for stack_tables in (True, False):
        plan = plan_stacking(resolved, n, stack_tables=stack_tables)
        if sorted(sorted(s.tables) for s in plan.stacks) == want:
            return plan
    raise ValueError(f"preprocess_features: stacked_table_to_tables groups the tables as {want}; "
                     f"embedmesh stacks tables of one padded dim, optimizer and dtype (or each "
                     f"alone) and cannot realise that grouping")


def preprocess_batch(features: Any, weights: Optional[Any], plan: StackingPlan, *,
                     num_devices_local: int = 1, capacities: CapacitiesArg = None,
                        overflow: str = "error", process_index: int = 0,
                        backend: str = "auto",
                        num_threads: Optional[int] = None) -> tuple[dict, PreprocessStats]:
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
      backend: "auto" (numba when importable), "numba" or "numpy".
      num_threads: threads of the numba backend, which runs every (stack,
        local device) pair as one task (default: the cores this process may
        use, `default_num_threads()`; 1 is faster on an oversubscribed host,
        see benchmarks/RESULTS_preprocess.md).

    Returns:
      `({stack name: PartitionedCsrFormatTensor}, PreprocessStats)`; pure
      numpy, nothing touches a device.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if not isinstance(plan, StackingPlan):
        raise TypeError(f"plan must be a StackingPlan (see plan_stacking), got "
                        f"{type(plan).__name__}")
    D = int(num_devices_local)
    if D < 1:
        raise ValueError(f"num_devices_local must be >= 1, got {num_devices_local}")
    K = _resolve_backend(backend)
    threads = default_num_threads() if num_threads is None else int(num_threads)
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
    N = plan.num_shards
    # output_shape is global: this process's batch is 1/(N/D) of it (every process
    # drives D devices of the N-device mesh)
    canon, batch = _canonical_batch(plan, features, weights, max(N // D, 1))
    if batch % D:
        raise ValueError(f"the batch size {batch} is not a multiple of the {D} local devices")
    jobs = _make_jobs(plan, canon, batch, D)
    sorted_tables = {}  # numpy backend: per-table sorts, reused by every run of a stack

    def make_run(job, cap):
        if K is not None and _numba_fits(job, N):
            return _NumbaRun(job, D, N, cap, K)
        if job.name not in sorted_tables:
            sorted_tables[job.name] = [_numpy_table(job, t, D, N) for t in job.tables]
        return _NumpyRun(job, D, N, cap, sorted_tables[job.name])

    caps = {job.name: _capacity_for(capacities, plan, job.name) for job in jobs}
    counting = [job for job in jobs if caps[job.name] is None]
    if counting:  # count first (capacity 0 writes nothing), then fill at the bucketed need
        done = _execute([make_run(job, Capacity(0, 0)) for job in counting], D, threads)
        for job, (_, u_tot, p_tot, _) in zip(counting, done):
            caps[job.name] = Capacity(capacity_bucket(p_tot.max(initial=0)),
                                      capacity_bucket(u_tot.max(initial=0)))
    results = dict(zip([job.name for job in jobs],
                       _execute([make_run(job, caps[job.name]) for job in jobs], D, threads)))
    grow = []
    for job in jobs:
        _, u_tot, p_tot, _ = results[job.name]
        cap = caps[job.name]
        if (u_tot.max(initial=0) > cap.max_unique_ids_per_partition
                or p_tot.max(initial=0) > cap.max_ids_per_partition):
            if overflow == "error":
                raise ValueError(_overflow_message(job, u_tot, p_tot, cap, process_index, D))
            if overflow == "grow":
                caps[job.name] = Capacity(
                    max(cap.max_ids_per_partition, capacity_bucket(p_tot.max())),
                    max(cap.max_unique_ids_per_partition, capacity_bucket(u_tot.max())))
                grow.append(job)
    if grow:
        for job, res in zip(grow, _execute([make_run(job, caps[job.name]) for job in grow], D,
                                           threads)):
            results[job.name] = res
    grown = {job.name for job in grow}
    out, stats = {}, {}
    for job in jobs:
        arrays, u_tot, p_tot, dropped = results[job.name]
        out[job.name] = PartitionedCsrFormatTensor(*arrays, stack=job.name,
                                                   rows_per_device=job.rows_per_device,
                                                   features=job.slots)
        num_ids = sum(int(c.splits[-1]) for _, c, _ in job.feats)
        stats[job.name] = StackStats(p_tot.astype(np.int64), u_tot.astype(np.int64), num_ids,
                                     dropped, caps[job.name], job.name in grown)
    return out, PreprocessStats(stats)


@dataclasses.dataclass(frozen=True)
class SparseCoreStats:
    """Maxima over sample batches, per stack (see `compute_sparse_core_stats`)."""

    max_ids_per_partition: Mapping[str, int]
    max_unique_ids_per_partition: Mapping[str, int]
    num_batches: int

    def capacities(self, headroom: float = 1.0) -> dict:
        """`{stack: Capacity}`: the maxima times `headroom`, rounded up to buckets."""
        return {s: Capacity(capacity_bucket(math.ceil(self.max_ids_per_partition[s] * headroom)),
                            capacity_bucket(math.ceil(
                                self.max_unique_ids_per_partition[s] * headroom)))
                for s in self.max_ids_per_partition}


def compute_sparse_core_stats(feature_batches: Iterable[Any], plan_or_feature_config: Any, *,
                              weight_batches: Optional[Iterable[Any]] = None,
                              num_shards: Optional[int] = None, num_devices_local: int = 1,
                              backend: str = "auto",
                              num_threads: Optional[int] = None) -> SparseCoreStats:
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
        _, st = preprocess_features(feats, w, plan, num_devices_local=num_devices_local,
                                    capacities=caps, overflow="drop", backend=backend,
                                    num_threads=num_threads)
        for s, v in st.stacks.items():
            max_ids[s] = max(max_ids[s], v.max_ids_per_partition)
            max_unique[s] = max(max_unique[s], v.max_unique_ids_per_partition)
        count += 1
    return SparseCoreStats(max_ids, max_unique, count)
