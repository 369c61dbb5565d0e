"""The numba backend of host preprocessing: compiled kernels over one table.

Importing this module imports numba (`embedmesh.host.preprocess` does that at
first use, never at `import embedmesh`). Module-level `@njit` functions, cached
on disk (`cache=True`), taking arrays and a few ints:

- `table_sort`: one table's features for one local device, keyed and sorted
  (radix sort per (table, device) block; the tables of a stack in parallel);
- `table_fill`: its sorted entries appended to the stack's partitions (one pass
  to merge duplicates and fill; a stack's tables in row order);
- `fill_padding`: the padding after the last kept entry of every partition.

A table's scalar parameters travel in one int64 array (`table_params`, indexed
by the `P_*` constants), declared with the counters in `embedmesh.host.kernel_params`
and shared with the C++ backend (`embedmesh.host.native_backend`, the same arrays
bit for bit): the kernel applies the mod rule over the table's span it is given
(`KERNEL_LAYOUTS`: "mod" and "table_wise" placements alike), and a plan with another
layout takes the numpy backend.
"""

from __future__ import annotations

import collections
import math

import numpy as np
from numba import njit

from embedmesh.host.kernel_params import (  # noqa: F401 (the kernels' constants, here too)
    _NUM_PARAMS,
    C_PAIR_KEPT,
    C_PAIR_TOTAL,
    C_UNIQUE_KEPT,
    C_UNIQUE_TOTAL,
    COUNTERS,
    KERNEL_LAYOUTS,
    P_CAP_PAIRS,
    P_CAP_UNIQUE,
    P_FIRST_SHARD,
    P_KEY_BITS,
    P_LOCAL_ROW_OFFSET,
    P_LOW_BITS,
    P_ROTATION,
    P_ROW_BASE,
    P_ROW_SPAN,
    P_ROWS_PER_SHARD,
    P_SHARD_SHIFT,
    P_SPAN,
    P_VOCAB,
    table_params,
)

__all__ = ["fill_padding", "table_fill", "table_sort"]

# A table's parameters (the `P_*` entries of its `table_params` array), read once by a
# kernel (`_table_params`); preprocess.cc's TableParams, field for field.
TableParams = collections.namedtuple(
    "TableParams",
    "span rotation shard_shift rps local_off vocab key_bits low_bits row_base row_span "
    "cap_u cap_p first_shard",
)


@njit(cache=True, nogil=True)
def _table_params(params):  # pragma: no cover (compiled)
    """A table's `table_params` array as a `TableParams`."""
    return TableParams(
        params[P_SPAN],
        params[P_ROTATION],
        params[P_SHARD_SHIFT],
        params[P_ROWS_PER_SHARD],
        params[P_LOCAL_ROW_OFFSET],
        params[P_VOCAB],
        params[P_KEY_BITS],
        params[P_LOW_BITS],
        params[P_ROW_BASE],
        params[P_ROW_SPAN],
        params[P_CAP_UNIQUE],
        params[P_CAP_PAIRS],
        params[P_FIRST_SHARD],
    )


@njit(cache=True, nogil=True)
def _entries(splits, fmeta, d):  # pragma: no cover (compiled)
    """The entries of device `d`'s rows over a table's features (`table_sort`'s `m`)."""
    m = 0
    for f in range(fmeta.shape[0]):
        sb = fmeta[f, 0]
        rpd = fmeta[f, 1]
        m += splits[sb + (d + 1) * rpd] - splits[sb + d * rpd]
    return m


@njit(cache=True, nogil=True)
def _combiner_scale(weights, s, e, comb, has_w):  # pragma: no cover (compiled)
    """What an output row's entries `[s, e)` are scaled by: 1 for "sum" (`comb` 0), one
    over their weights' sum ("mean", 1) or root of their squares' sum ("sqrtn", 2),
    their count where unweighted; 0 where that is 0."""
    if comb == 0:
        return 1.0
    acc = 0.0
    if has_w:
        for k in range(s, e):
            w = np.float64(weights[k])
            acc += w if comb == 1 else w * w
    else:
        acc = np.float64(e - s)
    if comb == 2:
        acc = math.sqrt(acc)
    return 1.0 / acc if acc != 0.0 else 0.0


@njit(cache=True, nogil=True)
def _radix_sort(vals, hist, passes, bits, low_bits):  # pragma: no cover (compiled)
    """`vals` sorted by `vals >> low_bits` (stable LSD radix sort, `bits` a pass, with the
    histograms `hist` of each pass counted by the caller; consumed). Returns the sorted
    array (`vals` or a new one)."""
    m = vals.shape[0]
    mask = (1 << bits) - 1
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
    return srt


@njit(cache=True, nogil=True)
def table_sort(ids, weights, splits, fmeta, params, d, n_shards):  # pragma: no cover (compiled)
    """The first half of one table's work for local device `d`: its entries keyed and
    sorted. Tables of a stack sort independently (a thread each); `table_fill` then
    appends them to the partitions in row order.

    `ids`, `weights` (empty: all ones), `splits`: the table's features
    concatenated; `fmeta[f] = (first split index, rows per device, buffer row
    offset, combiner code)`; `params`: `table_params`.

    The (table, device) block is sorted by key `shard * rows_per_shard +
    block row` (a stable LSD radix sort, so entries with one key stay in entry
    order, i.e. in output-row order). Sort values pack the key above
    `low_bits` bits holding the output row (unweighted) or the entry's index
    in the block (weighted).

    Returns `(bad, sorted values, per-shard starts [n_shards + 1], gain, orow,
    row_scale)`: `bad` is the first entry whose id is outside the table (-1: none;
    the arrays are then meaningless); `gain`/`orow` (weighted) or `row_scale`
    (unweighted) are what `table_fill` reads through the values' low bits.

    The per-entry loop stays here in one piece (the hot part); the helpers around it
    (`_entries`, `_combiner_scale`, `_radix_sort`) measured at par with the one-function
    kernel (benchmarks/train/preprocess.py's workload, 2026-12-04).
    """
    tp = _table_params(params)
    has_w = weights.shape[0] > 0
    passes = (tp.key_bits + 10) // 11  # LSD radix sort: <= 11 bits a pass
    bits = (tp.key_bits + passes - 1) // passes if passes else 1
    mask = (1 << bits) - 1
    m = _entries(splits, fmeta, d)
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
        row_scale = np.empty(tp.row_span, np.float64)
    i = 0
    for f in range(fmeta.shape[0]):
        sb = fmeta[f, 0]
        rpd = fmeta[f, 1]
        ooff = fmeta[f, 2]
        comb = fmeta[f, 3]
        for r in range(rpd):
            s = splits[sb + d * rpd + r]
            e = splits[sb + d * rpd + r + 1]
            scale = _combiner_scale(weights, s, e, comb, has_w)
            o = ooff + r
            if not has_w:
                row_scale[o - tp.row_base] = scale
            for k in range(s, e):
                v = np.int64(ids[k])
                if v < 0 or v >= tp.vocab:
                    return k, vals, per_shard, gain, orow, row_scale
                if tp.shard_shift >= 0:
                    q = v >> tp.shard_shift
                    rem = v & (tp.span - 1)
                else:
                    q = v // tp.span
                    rem = v - q * tp.span
                j = rem + tp.rotation
                if j >= tp.span:
                    j -= tp.span
                j += tp.first_shard
                key = j * tp.rps + q
                for p in range(passes):
                    hist[p, (key >> (p * bits)) & mask] += 1
                per_shard[j + 1] += 1
                if has_w:
                    gain[i] = np.float64(weights[k]) * scale
                    orow[i] = o
                    vals[i] = (key << tp.low_bits) | i
                else:
                    vals[i] = (key << tp.low_bits) | o
                i += 1
    srt = _radix_sort(vals, hist, passes, bits, tp.low_bits)
    for j in range(n_shards):
        per_shard[j + 1] += per_shard[j]
    return -1, srt, per_shard, gain, orow, row_scale


@njit(cache=True, nogil=True)
def _entry(x, gain, orow, row_scale, tp, has_w, low_mask):  # pragma: no cover (compiled)
    """A sorted entry's `(key, output row, gain)` (`table_sort`'s value `x`)."""
    lo = x & low_mask
    if has_w:
        return x >> tp.low_bits, np.int64(orow[lo]), gain[lo]
    return x >> tp.low_bits, lo, row_scale[lo - tp.row_base]


@njit(cache=True, nogil=True)
def _fill_all(
    srt, t0, t1, gain, orow, row_scale, tp, has_w, base, uo, pr, pu, pg, uc, pc
):  # pragma: no cover (compiled)
    """`table_fill`'s pass over one shard's sorted entries `[t0, t1)` where nothing is
    dropped: each entry bumps the unique id and pair counters by whether it starts
    one (no branch on that: a new id is about one entry in three, unpredictable) and
    rewrites the current id, pair and running gain (float64, the last write is the
    pair's sum). Returns the counters after."""
    low_mask = (np.int64(1) << tp.low_bits) - 1
    cur_u = uc - 1
    cur_q = pc - 1
    prev_key = np.int64(-1)
    prev_o = np.int64(-1)
    acc = 0.0
    for t in range(t0, t1):
        key, o, g = _entry(srt[t], gain, orow, row_scale, tp, has_w, low_mask)
        new_u = key != prev_key
        new_p = new_u | (o != prev_o)
        cur_u += new_u
        cur_q += new_p
        acc = g if new_p else acc + g
        uo[cur_u] = base + key
        pr[cur_q] = o
        pu[cur_q] = cur_u
        pg[cur_q] = acc
        prev_key = key
        prev_o = o
    return cur_u + 1, cur_q + 1


@njit(cache=True, nogil=True)
def table_fill(
    srt,
    per_shard,
    gain,
    orow,
    row_scale,
    params,
    d,
    unique_ids,
    pair_rows,
    pair_unique,
    pair_gains,
    counts,
):  # pragma: no cover (compiled)
    """The second half: one table's sorted entries (`table_sort`'s outputs) for local
    device `d`, appended to its partitions (outputs `[D, N, U|P]`, counters
    `[COUNTERS, D, N]` carried over from the stack's previous tables, so tables run in
    row order here): one pass per shard merges duplicates and appends.

    Returns the input entries dropped for capacity.
    """
    n_shards = unique_ids.shape[1]
    tp = _table_params(params)
    has_w = row_scale.shape[0] == 0  # table_sort's row_scale: empty when weighted
    low_mask = (np.int64(1) << tp.low_bits) - 1
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
        uc = counts[C_UNIQUE_TOTAL, d, j]
        pc = counts[C_PAIR_TOTAL, d, j]
        uk = counts[C_UNIQUE_KEPT, d, j]
        pk = counts[C_PAIR_KEPT, d, j]
        base = tp.local_off - j * tp.rps
        if t1 - t0 <= tp.cap_p - pc and min(t1 - t0, tp.rps) <= tp.cap_u - uc:
            # nothing can be dropped (a pair an entry at most, a unique id a row of the
            # shard's block at most): every entry written, without branches
            uc, pc = _fill_all(
                srt, t0, t1, gain, orow, row_scale, tp, has_w, base, uo, pr, pu, pg, uc, pc
            )
            counts[C_UNIQUE_TOTAL, d, j] = counts[C_UNIQUE_KEPT, d, j] = uc
            counts[C_PAIR_TOTAL, d, j] = counts[C_PAIR_KEPT, d, j] = pc
            continue
        prev_key = -1
        prev_o = -1
        cur_u = 0
        cur_q = 0
        keep_u = False
        keep_p = False
        acc_g = 0.0
        for t in range(t0, t1):
            key, o, g = _entry(srt[t], gain, orow, row_scale, tp, has_w, low_mask)
            if key != prev_key:
                if keep_p:
                    pg[cur_q] = acc_g
                prev_key = key
                cur_u = uc
                uc += 1
                keep_u = cur_u < tp.cap_u and pc < tp.cap_p
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
                keep_p = keep_u and cur_q < tp.cap_p
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
        counts[C_UNIQUE_TOTAL, d, j] = uc
        counts[C_PAIR_TOTAL, d, j] = pc
        counts[C_UNIQUE_KEPT, d, j] = uk
        counts[C_PAIR_KEPT, d, j] = pk
    return n_drop


@njit(cache=True, nogil=True)
def fill_padding(
    unique_ids, pair_rows, pair_unique, pair_gains, counts, pad_id, pad_row, d
):  # pragma: no cover (compiled)
    """Padding after the kept entries of device `d`'s partitions: `pad_id`
    unique ids, pairs of row `pad_row`, index 0 and gain 0."""
    n_shards = unique_ids.shape[1]
    for j in range(n_shards):
        uk = counts[C_UNIQUE_KEPT, d, j]
        pk = counts[C_PAIR_KEPT, d, j]
        unique_ids[d, j, uk:] = pad_id
        pair_rows[d, j, pk:] = pad_row
        pair_unique[d, j, pk:] = 0
        pair_gains[d, j, pk:] = 0.0
