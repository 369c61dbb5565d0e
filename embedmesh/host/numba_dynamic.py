"""The numba kernels of tables of raw 64-bit ids (`embedmesh.host.dynamic_ids`).

Importing this module imports numba (`embedmesh.host.preprocess` does that at first
use, as it does `numba_backend`). Module-level `@njit(cache=True, nogil=True)`
functions:

- `raw_codes`: one table's raw ids -> each entry's sort key `owner * K + code` (a
  code to each id at its first sighting on its device, device by device: K codes, and
  the shard owning the id by the id map's keyed hash, `embedmesh.device.ops.id_hash`)
  and the distinct ids by code: one hash-table pass, no sort;
- `table_sort`: `numba_backend.table_sort` on those keys, by one counting sort;
- `device_fill`: a local device's partitions: `table_sort`, `numba_backend`'s
  `table_fill` and `fill_padding`, then the uint32 `(high, low)` words of the raw id
  behind each kept unique id (zeros at padding), in one call.

Key `owner * K + code` is what the static tables' kernels (`numba_backend`, the mod
layout over N shards, K rows a shard) key row `code * N + owner` by: each entry on
its owner at block row `code`, the numpy path's placement (`dynamic_ids.prepare_stack`),
so both give the same arrays. `preprocess._RawIdsRun` calls `raw_codes` once a stack
and `device_fill` once a local device, in one task where the process has one device.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from embedmesh.host.numba_backend import (
    C_UNIQUE_KEPT,
    _combiner_scale,
    _entries,
    _table_params,
    fill_padding,
    table_fill,
)

__all__ = ["device_fill", "raw_codes", "table_sort"]

_M32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def _fmix32(h):  # pragma: no cover (compiled)
    """MurmurHash3's 32-bit finaliser on a uint64 holding 32 bits (`id_hash.fmix32`)."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & _M32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & _M32
    return h ^ (h >> np.uint64(16))


@intrinsic
def _prefetch(typingctx, arr, i):
    """Prefetch the cache line of `arr[i]` for reading (LLVM's `llvm.prefetch`, locality
    3): a probe's line is on its way while earlier entries are probed."""

    def codegen(context, builder, signature, args):
        aty, _ = signature.args
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]])
        i8p = ir.PointerType(ir.IntType(8))
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8",
        )
        builder.call(
            fn,
            [
                builder.bitcast(ptr, i8p),
                ir.Constant(i32, 0),
                ir.Constant(i32, 3),
                ir.Constant(i32, 1),
            ],
        )
        return context.get_dummy_value()

    return types.void(arr, i), codegen


_AHEAD = 16  # entries ahead whose slot `raw_codes` prefetches


@njit(cache=True, nogil=True)
def _slot_hash(u, shift):  # pragma: no cover (compiled)
    """The dedup table's slot of id `u` (uint64): its high word folded into the low one,
    then Fibonacci hashing (the top bits of a product by 2**64 / golden ratio), which
    spreads strided ids too; `shift` = 64 - log2(table size)."""
    u = u ^ (u >> np.uint64(32))
    return np.int64((u * np.uint64(0x9E3779B97F4A7C15)) >> shift)


@njit(cache=True, nogil=True)
def raw_codes(ids, splits, fmeta, n_devices, n_shards, s0, s1, s2):  # pragma: no cover (compiled)
    """`(keys int64 [m], distinct ids int64 [K])` of one table's ids.

    `ids`: int64 (or int32) raw ids; `splits`, `fmeta`: `table_sort`'s (a device's rows
    of each feature); `s0, s1, s2`: the owner hash's seed words (`id_hash.hash_words`).
    Codes are given device by device, each device's entries in order (features in
    `fmeta` order, each over the device's rows): a code to each id at its first sighting
    on the device (device d's codes follow device d - 1's), found by a hash table whose
    slots of earlier devices count as empty. Entry e's key is `owner * K + code` of its
    id: the sort key of the static tables' kernels for `code * n_shards + owner` on the
    mod layout over `n_shards` shards, `K` rows a shard (`table_sort` takes the keys), so
    a partition lists its device's ids in order of first sighting. With one shard every
    key is the code (no owner hash: 0.43-0.45 against 0.53 ms a table of 41,000 entries
    in benchmarks/train/dynamic_ids.py's workload). Entries of no device's rows keep
    whatever `keys` held (no kernel reads them).
    """
    m = ids.shape[0]
    most = 0
    for d in range(n_devices):
        most = max(most, _entries(splits, fmeta, d))
    bits = 4
    while (1 << bits) < most + most // 2:  # load factor at most 2/3
        bits += 1
    size = 1 << bits
    mask = size - 1
    shift = np.uint64(64 - bits)
    slot_code = np.full(size, -1, np.int32)  # a slot below the device's first code: empty
    slot_key = np.empty(size, np.int64)
    uniq = np.empty(m, np.int64)  # distinct ids by code
    keys = np.empty(m, np.int64)  # each entry's code (its key, with one shard)
    # each entry's first slot, in a loop of its own (vectorised), so that the probe loop
    # prefetches the slots `_AHEAD` entries on: 0.43 -> 0.34 ms a table of 41,000
    # uniform ids (0.30 -> 0.25 Zipf), the probes' misses overlapping
    first = np.empty(m, np.int64)
    for e in range(m):
        first[e] = _slot_hash(np.uint64(np.int64(ids[e])), shift)
    k = 0
    for d in range(n_devices):
        base = k
        for f in range(fmeta.shape[0]):
            sb, rpd = fmeta[f, 0], fmeta[f, 1]
            end = splits[sb + (d + 1) * rpd]
            for e in range(splits[sb + d * rpd], end):
                if e + _AHEAD < end:
                    _prefetch(slot_code, first[e + _AHEAD])
                    _prefetch(slot_key, first[e + _AHEAD])
                x = np.int64(ids[e])
                s = first[e]
                while True:
                    j = slot_code[s]
                    if j < base:
                        slot_code[s] = k
                        slot_key[s] = x
                        uniq[k] = x
                        keys[e] = k
                        k += 1
                        break
                    if slot_key[s] == x:
                        keys[e] = j
                        break
                    s = (s + 1) & mask
    if n_shards == 1 or k == 0:  # one owner (one device, or a table-wise table)
        return keys, uniq[:k]
    key_of = np.empty(k, np.int64)
    n = np.uint64(n_shards)
    w0, w1, w2 = np.uint64(s0), np.uint64(s1), np.uint64(s2)
    for c in range(k):
        u = np.uint64(uniq[c])
        a = _fmix32((u & _M32) ^ w0)
        b = _fmix32((u >> np.uint64(32)) ^ w1)
        h = _fmix32(((a + b * np.uint64(0x9E3779B1)) & _M32) ^ w2)
        key_of[c] = np.int64(h % n) * k + c
    for d in range(n_devices):
        for f in range(fmeta.shape[0]):
            sb, rpd = fmeta[f, 0], fmeta[f, 1]
            for e in range(splits[sb + d * rpd], splits[sb + (d + 1) * rpd]):
                keys[e] = key_of[keys[e]]
    return keys, uniq[:k]


@njit(cache=True, nogil=True)
def table_sort(keys, weights, splits, fmeta, params, d, n_shards):  # pragma: no cover (compiled)
    """`numba_backend.table_sort` for a table of raw ids, on `raw_codes`'s keys (`owner *
    K + code`, `K` = `params[P_ROWS_PER_SHARD]`): the same outputs, by one counting sort
    over the `n_shards * K` keys (stable: entries of one key stay in entry order)."""
    tp = _table_params(params)
    nkeys = n_shards * tp.rps
    has_w = weights.shape[0] > 0
    m = _entries(splits, fmeta, d)
    vals = np.empty(m, np.int64)
    start = np.zeros(nkeys + 1, np.int64)  # key counts, then each key's first position
    per_shard = np.zeros(n_shards + 1, np.int64)
    # weighted: each entry's gain and output row; unweighted: each output row's scale
    gain = np.empty(m if has_w else 0, np.float64)
    orow = np.empty(m if has_w else 0, np.int32)
    row_scale = np.empty(0 if has_w else tp.row_span, np.float64)
    i = 0
    for f in range(fmeta.shape[0]):
        sb, rpd, ooff, comb = fmeta[f, 0], fmeta[f, 1], fmeta[f, 2], fmeta[f, 3]
        first_split = sb + d * rpd - ooff
        for o in range(ooff, ooff + rpd):
            lo, hi = splits[first_split + o], splits[first_split + o + 1]
            scale = _combiner_scale(weights, lo, hi, comb, has_w)
            if not has_w:
                row_scale[o - tp.row_base] = scale
            for k in range(lo, hi):
                key = keys[k]
                if key < 0 or key >= nkeys:
                    return k, vals, per_shard, gain, orow, row_scale
                start[key + 1] += 1
                if has_w:
                    gain[i], orow[i] = np.float64(weights[k]) * scale, o
                vals[i] = (key << tp.low_bits) | (i if has_w else o)
                i += 1
    for c in range(nkeys):
        start[c + 1] += start[c]
    for j in range(n_shards + 1):
        per_shard[j] = start[j * tp.rps]
    srt = np.empty(m, np.int64)
    for t in range(m):
        x = vals[t]
        c = x >> tp.low_bits
        srt[start[c]] = x
        start[c] += 1
    return -1, srt, per_shard, gain, orow, row_scale


@njit(cache=True, nogil=True)
def device_fill(
    keys, uniq, inputs, params, d, outputs, counts, raw, pad_id, pad_row
):  # pragma: no cover (compiled)
    """Local device `d`'s partitions of a stack of raw ids (its one table) from
    `raw_codes`'s keys and distinct ids (by code): `table_sort` (`inputs`: its weights, splits and
    fmeta), `numba_backend.table_fill` and `fill_padding` on them (`params`: the table's
    on the mod layout over N shards, K rows a shard; `outputs`: the unique ids, pair rows,
    pair unique indices and pair gains), then each kept unique id's raw words in `raw`
    (`[D, N, U, 2]` uint32, zeros at padding). One call a (stack, device): no Python
    between the kernels. Returns the entries dropped for capacity, or -1 for a key out
    of range."""
    unique_ids, pair_rows, pair_unique, pair_gains = outputs
    n_shards = unique_ids.shape[1]
    weights, splits, fmeta = inputs
    first_bad, srt, per_shard, gain, orow, row_scale = table_sort(
        keys, weights, splits, fmeta, params, d, n_shards
    )
    if first_bad >= 0:
        return -1
    dropped = table_fill(srt, per_shard, gain, orow, row_scale, params, d, *outputs, counts)
    fill_padding(unique_ids, pair_rows, pair_unique, pair_gains, counts, pad_id, pad_row, d)
    for j in range(n_shards):
        uk = counts[C_UNIQUE_KEPT, d, j]
        for u in range(uk):
            x = np.uint64(uniq[unique_ids[d, j, u]])
            raw[d, j, u, 0] = np.uint32(x >> np.uint64(32))
            raw[d, j, u, 1] = np.uint32(x & _M32)
        raw[d, j, uk:] = 0
    return dropped
