"""Pallas TPU (Mosaic) kernels: the pair sums of a lookup and of its backward on the MXU,
and row moves a DMA a row.

The pair sums: `reduce(src, key, dst, gains, num_out)` is `out[key[p]] += gains[p] *
src[dst[p]]` (a backward: `src` the activation gradients, `key` each pair's distinct
row, the result each distinct row's gradient sum); `combine(src, key, dst, gains,
num_dst)` is `out[dst[p]] += gains[p] * src[key[p]]` (a lookup: `src` the gathered
distinct rows), computed as a `reduce` keyed by dst after one device sort of the pairs.
`reduce` needs the pairs ordered by key (the host's order: by distinct id, then output
row; `is_sorted` checks it, and any other order is sorted on the device first);
`reduce_ordered` takes the order from the caller (empty: the pairs come in it, as a
lookup's from the host's `pairs_by_row`) and sorts nothing.

Each work item of `schedule` (a block of `TW` keys x a block of `TP` pairs that share
pairs) gathers its pairs' `src` rows into VMEM (a row a step, 8 a loop turn: the reads
are independent, unlike an add into a row another pair may also add to), scales them by
their gains and adds `onehot(key) @ rows` to its key block on the MXU: the one-hot
matrix is exact in bfloat16, the rows go as three bfloat16 parts (`_split3`) whose
products sum in float32, so the sums are float32 sums. `src` (the resident side) is
copied into VMEM once, a block of at most `RESIDENT_BYTES` a call (more: one call a
column block, and where 128 lanes of every row are still more, a row range, each
skipping the pairs of the others). A row range's pass visits only the pair blocks that
read one of its rows, adding into the sums of the passes before (`_in_range`): pairs
in the host's order read nearby rows where a table's output rows lie together, as
one-hot features' do, and then every pair is read about once in all the passes, where a
pass over every pair block read each once a range (26 one-hot features at batch 32768,
dim 128: 6.8 M pair reads a step, 1.7 M with the skip; counted by
`benchmarks/tpu_onehot_profile.py --count`). Pairs outside `[0, num_keys)` x `[0,
num_src)` are skipped (the host's padding).

Measured on a v5e chip (2026-12-04, `benchmarks/tpu_probe.py`, 117,295 distinct rows of
an 8M-row table, 308,894 pairs; runs in `benchmarks/runs/tpu_probe_*`):

- `reduce`: 3.7 ms at dims 64 and 128, 5.3 ms at 256; XLA's take + segment_sum of the
  same pairs 6.1, 6.0 and 7.6 ms; the scalar pair loop this replaces (an add a pair
  into VMEM, ~26 ns a pair whatever its form: each add waits for the last) 7.9 and 8.9;
- a running sum a pair in place of the one-hot matmuls (each pair's row read from VMEM,
  added into a register restarted where the key changes, stored into its key's row;
  tried 2026-12-05, `runs/tpu_probe_2026-12-05_a.json`): 2.39-2.55 ms against 2.56 for
  the backward's 309k pairs, 2.58 against 2.21 for a lookup's; the step the same (12.81
  against 12.62 ms at dim 64, 13.00 against 12.93 at 16). Both forms cost ~8 ns a pair:
  the pair's row read from a dynamic place in VMEM, not the matmuls, bounds them;
  pairs given already sorted by output row took 2.21 ms against 2.23 with the sort, so
  sending the host's order would not help either (at run time: it saves the sort's
  compile, which is why a lookup now takes it, `reduce_ordered`);
- `combine` (its device sort included, ~1.3 ms): 3.35 ms at dims 64 and 128, 8.2 ms at
  256 (then in two row ranges; in two column blocks since, not yet measured), against
  XLA's 6.2, 6.1 and 9.5 ms;
- `scatter_rows_dma` (in place, a DMA a row, blocks of `TG` rows): 49.5 M rows/s at 128
  lanes where the valid ids come first (24-29 M with a test and a wait a row; 19 M at
  512 lanes then), against XLA's scatter (`unique_indices`) at 12.7 M and 8.5 M;
  `gather_rows_dma`: 21 M / 17 M rows/s, slower than XLA's gather (66 M / 52 M), so
  gathers stay XLA's.

Block sizes on a TPU: a rank-1 block in SMEM (`TP`, `TG`) must be a power of two of at
least 128 (or a multiple of 1024); the interpreter takes any.

`INTERPRET = True` runs them in Pallas's TPU interpreter (on CPU: the tests).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from embedmesh.device.ops.tpu import LANES, lane_width

__all__ = [
    "INTERPRET",
    "combine",
    "gather_pairs_dma",
    "gather_rows_dma",
    "in_place_rows_call",
    "is_sorted",
    "lane_width",
    "pair_rows",
    "pair_words",
    "reduce",
    "reduce_ordered",
    "reduce_sorted",
    "scatter_pairs_dma",
    "scatter_rows_dma",
    "schedule",
]

INTERPRET = False
TW = 256  # keys a block
TP = 512  # pairs a block
UNROLL = 8  # pair rows gathered into VMEM a loop turn (a divisor of TP)
RESIDENT_BYTES = 80 << 20  # the resident side's one VMEM buffer at most (a core: 128 MiB)
# Where the resident side goes in row ranges: each range's pass visits only the pair blocks
# that read a row of it, and adds into the sums of the passes before (`_in_range`);
# False: every pass walks every pair block (the A/B switch of the benchmarks)
SKIP_RANGES = True
_VMEM_LIMIT = 120 << 20


def _interpret():
    return pltpu.InterpretParams() if INTERPRET else False


class Schedule(NamedTuple):
    """The work items of one pair walk (int32 arrays of `num_items`): `block` the key
    block, `pair_block` the pair block, `[lo, hi)` the item's pairs within it, `first` 1
    on the first item of a key block; the pair arrays padded to whole pair blocks
    (`key`, `dst`, `gains`); `num_blocks` the key blocks."""

    block: Any
    pair_block: Any
    lo: Any
    hi: Any
    first: Any
    key: Any
    dst: Any
    gains: Any
    num_blocks: int

    @property
    def scalars(self) -> tuple:
        """The arrays Pallas prefetches into SMEM, in the kernels' argument order."""
        return (self.block, self.pair_block, self.lo, self.hi, self.first)


def schedule(key, dst, gains, num_keys: int, num_dst: int, tw: int = TW, tp: int = TP):
    """The items that walk pairs sorted by `key` block by block (see the module).

    Invalid pairs (key outside `[0, num_keys)` or dst outside `[0, num_dst)`) get key
    `num_blocks * tw`, past every block. Returns (Schedule, sorted): `sorted` a traced
    bool, False when the valid pairs are not in ascending key order (the caller then
    takes another path)."""
    p = key.shape[0]
    nkb = max(1, -(-num_keys // tw))
    npb = max(1, -(-p // tp))
    ppad = npb * tp
    valid = (key >= 0) & (key < num_keys) & (dst >= 0) & (dst < num_dst)
    big = jnp.int32(nkb * tw)
    k = jnp.where(valid, key, big).astype(jnp.int32)
    k = jnp.pad(k, (0, ppad - p), constant_values=big)
    d = jnp.pad(jnp.where(valid, dst, 0).astype(jnp.int32), (0, ppad - p))
    g = jnp.pad(jnp.where(valid, gains, 0).astype(jnp.float32), (0, ppad - p))
    ok = is_sorted(key, dst, num_keys, num_dst)
    bounds = jnp.arange(nkb + 1, dtype=jnp.int32) * tw
    off = jnp.searchsorted(k, bounds, side="left").astype(jnp.int32)  # [nkb + 1]
    first_pb = jnp.minimum(off[:-1] // tp, npb - 1)
    last_pb = jnp.minimum(jnp.maximum(off[1:] - 1, off[:-1]) // tp, npb - 1)
    count = last_pb - first_pb + 1  # >= 1: every key block has an item
    starts = jnp.cumsum(count) - count
    total = starts[-1] + count[-1]
    num_items = nkb + npb
    j = jnp.arange(num_items, dtype=jnp.int32)
    live = j < total
    b = jnp.clip(jnp.searchsorted(starts, j, side="right").astype(jnp.int32) - 1, 0, nkb - 1)
    pb = first_pb[b] + (j - starts[b])
    b = jnp.where(live, b, nkb - 1)
    pb = jnp.where(live, pb, last_pb[nkb - 1])
    lo = jnp.maximum(off[b], pb * tp) - pb * tp
    hi = jnp.minimum(off[b + 1], (pb + 1) * tp) - pb * tp
    hi = jnp.where(live, jnp.maximum(hi, lo), lo)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32), (b[1:] != b[:-1]).astype(jnp.int32)])
    sched = Schedule(b, pb, lo, hi, first, k, d, g, nkb)
    return sched, ok


# ---------------------------------------------------------------------------
# The pair sums on the MXU


def _split3(x):
    """`x` (float32) as three bfloat16 parts whose float32 sum is `x` to float32
    precision: a one-hot matrix times each part, summed in float32 on the MXU, is then
    the float32 segment sum (the one-hot entries are exact in bfloat16)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


def _reduce_kernel(
    b_ref,
    pb_ref,
    lo_ref,
    hi_ref,
    first_ref,
    pd_ref,
    key_ref,
    gain_ref,
    src_hbm,
    *refs,
    tw,
    r0,
    rows,
    every_row,
    unroll,
    accumulate,
):
    """One work item: gather `src[dst[p]]` of the item's pairs into `x` (zero rows for a
    dst outside the resident range), scale them by their gains (zero outside the item's
    [lo, hi)), and add `onehot(key) @ x` to the key block (at its first item zeroed, or
    with `accumulate` the block of the sums so far, `refs[0]`). An item without pairs
    only does that first step. The resident rows are copied into VMEM once, at the first
    item."""
    acc_ref = refs[0] if accumulate else None
    out_ref, src_ref, x_ref, sem = refs[1:] if accumulate else refs
    j = pl.program_id(0)
    lo, hi = lo_ref[j], hi_ref[j]

    @pl.when(j == 0)
    def _():
        copy = pltpu.make_async_copy(src_hbm, src_ref, sem)
        copy.start()
        copy.wait()

    @pl.when(first_ref[j] == 1)
    def _():
        out_ref[...] = acc_ref[...] if accumulate else jnp.zeros(out_ref.shape, out_ref.dtype)

    def add():  # the item's pairs [lo, hi) of its pair block added into its key block
        block, tp = b_ref[j], x_ref.shape[0]

        def group(gi, c):
            base = pl.multiple_of(gi * unroll, unroll)
            for k in range(unroll):
                r = pd_ref[base + k] - r0
                if every_row:  # `schedule` made every dst a row of src: read it as it is
                    x_ref[pl.ds(base + k, 1), :] = src_ref[pl.ds(r, 1), :]
                    continue
                row = src_ref[pl.ds(jnp.clip(r, 0, rows - 1), 1), :]
                x_ref[pl.ds(base + k, 1), :] = jnp.where((r >= 0) & (r < rows), row, 0.0)
            return c

        jax.lax.fori_loop(lo // unroll, (hi + unroll - 1) // unroll, group, 0)
        at = jax.lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
        x = jnp.where((at >= lo) & (at < hi), x_ref[...] * gain_ref[...], 0.0)
        keys = key_ref[...] - block * tw  # [1, tp]
        onehot = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (tw, tp), 0) == keys, 1.0, 0.0)
        onehot = onehot.astype(jnp.bfloat16)
        acc = out_ref[...]
        for part in _split3(x):
            acc = acc + jnp.dot(onehot, part, preferred_element_type=jnp.float32)
        out_ref[...] = acc

    if accumulate:  # a range's pass: most items have no pairs there
        pl.when(hi > lo)(add)
    else:  # one pass over every row: only an empty key block has an item without pairs
        add()


def _chunks(num_rows: int, width: int):
    """Blocks `(r0, rows, c0, cols)` of the resident side [num_rows, width], each within
    RESIDENT_BYTES: column blocks first (the widest multiple of 128 lanes whose rows all
    fit), then row ranges (multiples of 8) where even 128 lanes of every row do not. A
    column block's pass gathers only its lanes; a row range's gathers every lane of its
    pairs' rows and skips the others' pairs, so columns cost less."""
    lanes = width // LANES
    per_lane_row = num_rows * LANES * 4
    cw = LANES * max(1, min(lanes, RESIDENT_BYTES // max(1, per_lane_row)))
    per = max(8, (RESIDENT_BYTES // (cw * 4)) // 8 * 8)
    return [
        (r0, min(per, num_rows - r0), c0, min(cw, width - c0))
        for c0 in range(0, width, cw)
        for r0 in range(0, num_rows, per)
    ]


def _in_range(sched, r0: int, rows: int, tw: int, tp: int):
    """The scalars of `sched` for the pass over the resident rows `[r0, r0 + rows)`: an
    item whose pair block reads none of them is given its last visited predecessor's
    blocks and no pairs, so Pallas moves no block for it and the kernel does nothing;
    the key blocks no item visits keep the sums of the passes before (the call
    accumulates). Pair blocks sorted by key read a few nearby rows where the batch's
    output rows of a table lie together (one-hot features: a pass then visits the pair
    blocks of its features' tables), but every row range where the pairs read rows at
    random (the walk each pass did before)."""
    npb = sched.dst.shape[0] // tp
    valid = (sched.key < sched.num_blocks * tw).reshape(npb, tp)
    dst = sched.dst.reshape(npb, tp)
    top = jnp.max(jnp.where(valid, dst, -1), axis=1)
    bottom = jnp.min(jnp.where(valid, dst, jnp.iinfo(jnp.int32).max), axis=1)
    hit = (top >= r0) & (bottom < r0 + rows)  # [npb]: the block may read the range
    j = jnp.arange(sched.block.shape[0], dtype=jnp.int32)
    live = hit[sched.pair_block] & (sched.hi > sched.lo)
    kept = live | (j == 0)  # the first item loads its key block however
    at = jax.lax.cummax(jnp.where(kept, j, 0))  # each item's last kept item
    block, pair_block = sched.block[at], sched.pair_block[at]
    lo = jnp.where(live, sched.lo, 0)
    hi = jnp.where(live, sched.hi, 0)
    before = jnp.concatenate([jnp.full((1,), -1, jnp.int32), block[at[:-1]]])
    first = (kept & ((j == 0) | (block != before))).astype(jnp.int32)
    return (block, pair_block, lo, hi, first)


def _reduce_call(sched, key_row, gains_col, part, acc, *, tw, tp, dc, r0, rows, every_row, unroll):
    """One `pallas_call` of `_reduce_kernel` over the resident rows `part` [rows8, dc];
    with `acc` (the sums of the passes before, [num_blocks * tw, dc]) the pass over rows
    `[r0, r0 + rows)` of several, added into `acc` in place."""
    at_pair_block = lambda j, b, pb, *_: pb[j]
    at_block = lambda j, b, *_: (b[j], 0)
    accumulate = acc is not None
    scalars = _in_range(sched, r0, rows, tw, tp) if accumulate else sched.scalars
    return pl.pallas_call(
        functools.partial(
            _reduce_kernel,
            tw=tw,
            r0=r0,
            rows=rows,
            every_row=every_row,
            unroll=unroll,
            accumulate=accumulate,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(sched.block.shape[0],),
            in_specs=[
                pl.BlockSpec((tp,), lambda *a: (at_pair_block(*a),), memory_space=pltpu.SMEM),
                pl.BlockSpec((1, tp), lambda *a: (0, at_pair_block(*a))),
                pl.BlockSpec((tp, 1), lambda *a: (at_pair_block(*a), 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ]
            + ([pl.BlockSpec((tw, dc), at_block)] if accumulate else []),
            out_specs=pl.BlockSpec((tw, dc), at_block),
            scratch_shapes=[
                pltpu.VMEM(part.shape, jnp.float32),
                pltpu.VMEM((tp, dc), jnp.float32),
                pltpu.SemaphoreType.DMA(()),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((sched.num_blocks * tw, dc), jnp.float32),
        input_output_aliases={9: 0} if accumulate else {},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT
        ),
        interpret=_interpret(),
    )(*scalars, sched.dst, key_row, gains_col, part, *([acc] if accumulate else []))


@functools.partial(jax.jit, static_argnames=("num_out", "tw", "tp", "unroll"))
def reduce_sorted(
    src, key, dst, gains, *, num_out: int, tw: int = TW, tp: int = TP, unroll: int = UNROLL
):
    """`out[key[p]] += gains[p] * src[dst[p]]` ([num_out, Dc] float32, Dc = src's width
    rounded to 128 lanes) for pairs sorted by key. Returns (out, sorted)."""
    num_src, width = src.shape
    dc = lane_width(width)
    sched, ok = schedule(key, dst, gains, num_out, num_src, tw, tp)
    ppad = sched.key.shape[0]
    key_row, gains_col = sched.key.reshape(1, ppad), sched.gains.reshape(ppad, 1)
    chunks = _chunks(num_src, dc)
    ranged = SKIP_RANGES and len(chunks) > len({c0 for _, _, c0, _ in chunks})
    columns: dict[int, list] = {}  # column block -> the sums of its row ranges
    for r0, rows, c0, cols in chunks:
        rows8 = -(-rows // 8) * 8
        real = max(0, min(cols, width - c0))  # the block's columns of src (the rest: zero)
        if (rows8, cols) == src.shape == (rows, real) and src.dtype == jnp.float32:
            part = src  # whole vregs already (a TPU stack's rows): no copy
        else:
            part = (
                jnp.zeros((rows8, cols), jnp.float32)
                .at[:rows, :real]
                .set(src[r0 : r0 + rows, c0 : c0 + real].astype(jnp.float32))
            )
        sums = columns.setdefault(c0, [])
        acc = None
        if ranged:  # one buffer of sums a column block, each range's pass adding into it
            acc = sums.pop() if sums else jnp.zeros((sched.num_blocks * tw, cols), jnp.float32)
        sums.append(
            _reduce_call(
                sched,
                key_row,
                gains_col,
                part,
                acc,
                tw=tw,
                tp=tp,
                dc=cols,
                r0=r0,
                rows=rows,
                every_row=rows == num_src,  # no dst outside this block's rows
                unroll=unroll,
            )
        )
    blocks = [functools.reduce(jnp.add, columns[c0]) for c0 in sorted(columns)]
    out = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)
    return out[:num_out], ok


def _sort_by(key, dst, gains, num_keys: int, num_dst: int):
    """The pairs sorted by key, the invalid ones (key outside `[0, num_keys)` or dst
    outside `[0, num_dst)`) last: one device sort of the three arrays."""
    valid = (key >= 0) & (key < num_keys) & (dst >= 0) & (dst < num_dst)
    k = jnp.where(valid, key, num_keys).astype(jnp.int32)
    return jax.lax.sort((k, dst.astype(jnp.int32), gains.astype(jnp.float32)), num_keys=1)


def reduce(src, key, dst, gains, num_out: int, *, tw: int = TW, tp: int = TP, unroll: int = UNROLL):
    """`reduce_sorted`'s sums for pairs in any order (sorted on the device unless they
    come sorted by key): [num_out, D] float32."""
    num_src, width = src.shape
    ok = is_sorted(key, dst, num_out, num_src)
    key, dst, gains = (jnp.asarray(a) for a in (key, dst, gains))
    key, dst, gains = jax.lax.cond(
        ok,
        lambda k, d, g: (k, d, g),
        lambda k, d, g: _sort_by(k, d, g, num_out, num_src),
        key,
        dst,
        gains,
    )
    out = reduce_sorted(src, key, dst, gains, num_out=num_out, tw=tw, tp=tp, unroll=unroll)
    return out[0][:, :width]


def reduce_ordered(
    src, key, dst, gains, order, num_out: int, *, tw: int = TW, tp: int = TP, unroll: int = UNROLL
):
    """`reduce`'s sums for pairs in any order, given `order`: the positions of the valid
    pairs in ascending key order, then the invalid ones (the host's `pair_order`). The
    pairs are gathered in that order and summed, with no device sort (whose compile on a
    TPU outlasts the rest of a lookup's). Returns `(out [num_out, D] float32,
    in_order)`: `in_order` a traced bool, False where `order` did not sort the pairs (the
    sums are then not to be used: the caller takes another path). An empty `order`: the
    pairs come in that order already (none gathered)."""
    order = jnp.asarray(order, jnp.int32)
    key, dst, gains = (jnp.asarray(a) for a in (key, dst, gains))
    if order.shape[0]:
        key, dst, gains = (a[order] for a in (key, dst, gains))
    out, ok = reduce_sorted(src, key, dst, gains, num_out=num_out, tw=tw, tp=tp, unroll=unroll)
    return out[:, : src.shape[1]], ok


def combine(
    src, key, dst, gains, num_dst: int, *, tw: int = TW, tp: int = TP, unroll: int = UNROLL
):
    """`out[dst[p]] += gains[p] * src[key[p]]` ([num_dst, D] float32) for pairs in any
    order: sorted by dst on the device, then `reduce_sorted` keyed by dst."""
    num_src, width = src.shape
    d, k, g = _sort_by(jnp.asarray(dst), jnp.asarray(key), jnp.asarray(gains), num_dst, num_src)
    out = reduce_sorted(src, d, k, g, num_out=num_dst, tw=tw, tp=tp, unroll=unroll)
    return out[0][:, :width]


def is_sorted(key, dst, num_keys: int, num_dst: int):
    """Whether the valid pairs (key in `[0, num_keys)`, dst in `[0, num_dst)`) come in
    ascending key order with the invalid ones (the host's padding) all after them."""
    valid = (key >= 0) & (key < num_keys) & (dst >= 0) & (dst < num_dst)
    k = jnp.where(valid, key, num_keys)
    return jnp.all(k[1:] >= k[:-1]) if k.shape[0] > 1 else jnp.asarray(True)


# ---------------------------------------------------------------------------
# Row moves between HBM and VMEM, a DMA a row


TG = 512  # rows a block of a row move


def _dma_rows(ids_ref, n: int, num_rows: int, copy, missing=None):
    """Start `copy(i, row)` (a DMA descriptor) for each of the block's `n` ids in
    `[0, num_rows)` (`missing(i)` for the others), then wait for them all: every copy in
    flight at once on the one semaphore the descriptors share."""

    def each(i, c, *, start):
        row = ids_ref[i]
        ok = (row >= 0) & (row < num_rows)

        @pl.when(ok)
        def _():
            if start:
                copy(i, row).start()
            else:
                copy(i, 0).wait()  # a wait counts the bytes of one copy of that shape

        if start and missing is not None:

            @pl.when(jnp.logical_not(ok))
            def _():
                missing(i)

        return c

    jax.lax.fori_loop(0, n, functools.partial(each, start=True), 0)
    jax.lax.fori_loop(0, n, functools.partial(each, start=False), 0)


def _valid_prefix(ids, num_rows: int):
    """[1] int32: how many ids lead that are all inside `[0, num_rows)` with none inside
    after them (a stack's distinct ids: ascending, padding past the end), else -1."""
    n = ids.shape[0]
    ok = (ids >= 0) & (ids < num_rows)
    valid = jnp.sum(ok, dtype=jnp.int32)
    is_prefix = jnp.all(ok == (jnp.arange(n, dtype=jnp.int32) < valid))
    return jnp.where(is_prefix, valid, -1)[None]


def _pairs(ref):
    """A 16-bit table's HBM ref (R, W) seen as uint32 (R / 2, W): word (p, c) holds row
    2p's column c in its low half and row 2p + 1's in its high half. This is how a TPU
    lays 16-bit rows out (two rows interleaved a 32-bit word), so it moves no byte; a DMA
    moves 32-bit words, hence a 16-bit row moves with its partner."""
    return ref.bitcast(jnp.uint32)


def pair_words(table):
    """`_pairs` of a 16-bit array as an XLA op (a copy): what Pallas's interpreter, which
    cannot bitcast a ref a DMA reads or writes, runs the pair kernels on."""
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16).astype(jnp.uint32)
    return bits[0::2] | (bits[1::2] << 16)


def pair_rows(words, dtype):
    """The inverse of `pair_words`: uint32 [R / 2, W] -> `dtype` [R, W]."""
    lo = (words & 0xFFFF).astype(jnp.uint16)
    hi = (words >> 16).astype(jnp.uint16)
    bits = jnp.stack([lo, hi], axis=1).reshape(-1, words.shape[1])
    return jax.lax.bitcast_convert_type(bits, dtype)


def _gather_kernel(meta_ref, ids_ref, table_ref, out_ref, sem, *, num_rows, view=None):
    if view is not None:
        table_ref = view(table_ref)
    tg = out_ref.shape[0]
    prefix = meta_ref[0]
    full = (prefix >= 0) & (prefix - pl.program_id(0) * tg >= tg)

    def copy(i, row):
        return pltpu.make_async_copy(table_ref.at[pl.ds(row, 1)], out_ref.at[pl.ds(i, 1)], sem)

    def zero(i):
        out_ref[pl.ds(i, 1), :] = jnp.zeros((1, out_ref.shape[1]), out_ref.dtype)

    @pl.when(full)
    def _():  # every id of the block inside: no test, one wait

        def start(i, c):
            copy(i, ids_ref[i]).start()
            return c

        _unrolled(tg, start)
        pltpu.make_async_copy(out_ref, out_ref, sem).wait()

    @pl.when(jnp.logical_not(full))
    def _():
        _dma_rows(ids_ref, tg, num_rows, copy, zero)


def gather_rows_dma(table, ids, *, tg: int = TG):
    """`table[ids]` (zero rows for ids outside it), a DMA a row."""
    return _gather_call(table, ids, table.shape, table.dtype, tg=tg)


def gather_pairs_dma(table, pairs, *, tg: int = TG):
    """A 16-bit table's row pairs `pairs` as uint32 words (`_pairs`; zero words for
    pairs outside it), a DMA a pair: [n, W]."""
    rows, width = table.shape
    if _interpret():
        return _gather_call(pair_words(table), pairs, (rows // 2, width), jnp.uint32, tg=tg)
    table = _as_bf16(table)
    return _gather_call(table, pairs, (rows // 2, width), jnp.uint32, tg=tg, view=_pairs)


def _as_bf16(table):
    """A 16-bit table as bfloat16 bits (Mosaic takes no float16 argument); a bitcast of
    the same width, which moves nothing."""
    return jax.lax.bitcast_convert_type(table, jnp.bfloat16)


def _gather_call(table, ids, shape, dtype, *, tg, view=None):
    """`gather_rows_dma` of the table seen as `shape` / `dtype` through `view`."""
    n = ids.shape[0]
    nb = max(1, -(-n // tg))
    ids = ids.astype(jnp.int32)
    meta = _valid_prefix(ids, shape[0])
    idp = jnp.pad(ids, (0, nb * tg - n), constant_values=-1)
    out = pl.pallas_call(
        functools.partial(_gather_kernel, num_rows=shape[0], view=view),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nb,),
            in_specs=[
                pl.BlockSpec((tg,), lambda i, m: (i,), memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((tg, shape[1]), lambda i, m: (i, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct((nb * tg, shape[1]), dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret(),
    )(meta, idp, table)
    return out[:n]


def _unrolled(n, body, unroll: int = 8):
    """`fori_loop(0, n, body)` with `unroll` calls a turn (n dynamic): the scalar core
    issues a DMA descriptor in a few cycles, and a loop turn costs as much again."""

    def turn(k, c):
        for u in range(unroll):
            c = body(k * unroll + u, c)
        return c

    c = jax.lax.fori_loop(0, n // unroll, turn, 0)
    jax.lax.fori_loop((n // unroll) * unroll, n, body, c)


def _scatter_kernel(meta_ref, ids_ref, rows_ref, table_in, table_ref, sem, *, num_rows, view=None):
    del table_in  # aliased to table_ref
    if view is not None:
        table_ref = view(table_ref)
    tg = rows_ref.shape[0]
    prefix = meta_ref[0]  # the valid ids are the first `prefix`; -1: they are not a prefix

    def copy(i, row):
        return pltpu.make_async_copy(rows_ref.at[pl.ds(i, 1)], table_ref.at[pl.ds(row, 1)], sem)

    def wait_rows(count):
        jax.lax.fori_loop(0, count, lambda i, c: (copy(0, 0).wait(), c)[1], 0)

    @pl.when(prefix >= 0)
    def _():  # no test per id, one wait for a full block
        count = jnp.clip(prefix - pl.program_id(0) * tg, 0, tg)

        def start(i, c):
            copy(i, ids_ref[i]).start()
            return c

        _unrolled(count, start)

        @pl.when(count == tg)
        def _():
            pltpu.make_async_copy(rows_ref, rows_ref, sem).wait()  # a block's bytes

        @pl.when(count < tg)
        def _():
            wait_rows(count)

    @pl.when(prefix < 0)
    def _():
        _dma_rows(ids_ref, tg, num_rows, copy)


def scatter_rows_dma(table, ids, rows, *, tg: int = TG):
    """`table.at[ids].set(rows)` in place (ids distinct; outside the table: skipped):
    the table is aliased to the result (donate it, or XLA copies it first).

    Where the ids inside the table come first (a stack's distinct ids: ascending, the
    padding past the end), each block starts its copies without a test and waits for
    them at once, 8 a loop turn: 49.5 M rows/s at 128 lanes on a v5e, against 28.9 M
    with a test and a wait a row (`runs/tpu_probe_2026-12-04_e.json`); other orders
    take the tested loop."""
    return _scatter_call(table, ids, rows.astype(table.dtype), table.shape[0], tg=tg)


def scatter_pairs_dma(table, pairs, words, *, tg: int = TG):
    """A 16-bit table's row pairs `pairs` set to `words` (uint32 [n, W], `_pairs`) in
    place, a DMA a pair (outside the table: skipped; the same pair twice only with the
    same words)."""
    words = words.astype(jnp.uint32)
    if _interpret():
        out = _scatter_call(pair_words(table), pairs, words, table.shape[0] // 2, tg=tg)
        return pair_rows(out, table.dtype)
    out = _scatter_call(_as_bf16(table), pairs, words, table.shape[0] // 2, tg=tg, view=_pairs)
    return jax.lax.bitcast_convert_type(out, table.dtype)


def _scatter_call(table, ids, rows, num_rows: int, *, tg, view=None):
    """`scatter_rows_dma` of `rows` into the table seen through `view` (`num_rows` rows)."""
    n = ids.shape[0]
    nb = max(1, -(-n // tg))
    ids = ids.astype(jnp.int32)
    meta = _valid_prefix(ids, num_rows)
    idp = jnp.pad(ids, (0, nb * tg - n), constant_values=-1)
    rp = jnp.pad(rows, ((0, nb * tg - n), (0, 0)))
    kernel = functools.partial(_scatter_kernel, num_rows=num_rows, view=view)
    return in_place_rows_call(kernel, table, tg, rows.shape[1], nb)(meta, idp, rp, table)


def in_place_rows_call(kernel, table, tg: int, width: int, nb: int, *, rows_in_hbm=False):
    """The `pallas_call` of a kernel that writes rows into `table` in place: called with
    (one prefetched int32 scalar, ids [nb * tg] (SMEM blocks), rows [nb * tg, width]
    (VMEM blocks, or `rows_in_hbm`: left in HBM), table (aliased to the result));
    `kernel(meta, ids, rows, table_in, table_out, sem)`."""
    rows_spec = (
        pl.BlockSpec(memory_space=pl.ANY)
        if rows_in_hbm
        else pl.BlockSpec((tg, width), lambda i, m: (i, 0))
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nb,),
            in_specs=[
                pl.BlockSpec((tg,), lambda i, m: (i,), memory_space=pltpu.SMEM),
                rows_spec,
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), has_side_effects=True
        ),
        interpret=_interpret(),
    )
