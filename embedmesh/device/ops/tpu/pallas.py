"""Pallas TPU (Mosaic) kernels: row moves a DMA a row, and the pair loops of a lookup
and of its backward.

Measured on a v5e chip (2026-12-04, `benchmarks/tpu_probe.py`, 117,749 distinct rows of
an 8M-row table, 310,109 pairs; runs in `benchmarks/runs/tpu_probe_*`):

- `scatter_rows_dma` (in place, a DMA a row, blocks of `TG` rows): 24 M rows/s at 128
  lanes, 19 M at 512, against XLA's scatter (`unique_indices`) at 12.7 M and 8.5 M;
  `gather_rows_dma`: 21 M / 17 M rows/s, slower than XLA's gather (66 M / 52 M), so
  gathers stay XLA's;
- `combine` / `reduce`: 35-39 M pairs/s at dims 64 and 256 whatever the form of the
  loop (a branch a pair, selects, 8 pairs unrolled, 8-row tiles rotated and masked:
  all within 3%): the loop is bound by its chain of dependent VMEM reads and writes,
  not by its arithmetic. XLA's take + segment_sum of the same pairs: 6.4 ms at dim 64
  (the kernel: 7.9 ms), 11.6 ms at dim 256 (the kernel: 8.9 ms).

The pair loops: each kernel keeps one side of the pairs whole in VMEM (the activation
rows, or their gradients: [R, Dc] float32, Dc the dim in whole 128-lane vregs) and
streams the other (the batch's distinct rows, in blocks of `TW`); a scalar loop over
the pairs adds `gain * row` from one to the other inside VMEM.

- `combine(src, key, dst, gains, num_dst)`: `out[dst[p]] += gains[p] * src[key[p]]`,
  `src` streamed by blocks of its rows, `out` [num_dst, D] resident (a lookup:
  `src` the gathered distinct rows, `key` each pair's position among them);
- `reduce(src, key, dst, gains, num_out)`: `out[key[p]] += gains[p] * src[dst[p]]`,
  `src` resident, `out` streamed (a backward: `src` the activation gradients, the
  result each distinct row's gradient sum).

Both need the pairs ordered by `key` (the host's order: by unique id, then output
row; `is_sorted` checks it and XLA's segment sum takes any other order); `schedule`
walks them as work items, one per (block of `TW` keys, block of `TP` pairs) that
share pairs, so that every item's pairs and rows are fixed-size blocks Pallas
pipelines (pairs into SMEM, rows into VMEM) and a block of keys stays in VMEM while
its items run. Pairs outside `[0, num_src)` or `[0, num_dst)` are skipped (the host's
padding). A resident side larger than `RESIDENT_BYTES` is split into row ranges,
each a call that skips the pairs of the others.

`INTERPRET = True` runs them in Pallas's TPU interpreter (on CPU: the tests).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from embedmesh.device.ops import reference
from embedmesh.device.ops.tpu import lane_width

__all__ = [
    "INTERPRET",
    "combine",
    "combine_sorted",
    "gather_rows_dma",
    "is_sorted",
    "lane_width",
    "reduce",
    "reduce_sorted",
    "scatter_rows_dma",
    "schedule",
]

INTERPRET = False
TW = 512  # keys a block (rows of the streamed side)
TP = 1024  # pairs a block
RESIDENT_BYTES = 48 << 20  # the resident side's VMEM at most (a v5e core has 128 MiB)
_VMEM_LIMIT = 100 << 20


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
# Row access inside VMEM


def _add_row(dst_ref, r, src_ref, u, g):
    """`dst_ref[r] += g * src_ref[u]` (refs [n, Dc]; r, u traced scalars)."""
    dst_ref[pl.ds(r, 1), :] = dst_ref[pl.ds(r, 1), :] + g * src_ref[pl.ds(u, 1), :]


def _rows_spec(rows: int, width: int, row_block):
    """A block of `rows` rows, the `row_block(*grid_and_scalars)`-th."""
    return pl.BlockSpec((rows, width), lambda *a: (row_block(*a), 0))


# ---------------------------------------------------------------------------
# The kernels


def _pair_loop(lo, hi, pk_ref, pd_ref, pg_ref, base, tw, r0, rows, step):
    """`step(u, r, g)` for the item's pairs [lo, hi) whose dst lies in [r0, r0 + rows)
    (and, a guard against damaged input, whose key lies in the item's block)."""

    def body(p, carry):
        r = pd_ref[p] - r0
        u = pk_ref[p] - base
        g = pg_ref[p]

        @pl.when((r >= 0) & (r < rows) & (u >= 0) & (u < tw))
        def _():
            step(u, r, g)

        return carry

    jax.lax.fori_loop(lo, hi, body, 0)


def _pair_kernel(
    b_ref,
    pb_ref,
    lo_ref,
    hi_ref,
    first_ref,
    pk_ref,
    pd_ref,
    pg_ref,
    src_ref,
    out_ref,
    *,
    tw,
    r0,
    rows,
    streamed_out,
):
    """One work item of `combine` (`streamed_out` False: `out[dst] += g * src[key]`,
    `out` resident, zeroed at the first item) or `reduce` (True: `out[key] += g *
    src[dst]`, `out` the item's key block, zeroed at its block's first item)."""
    j = pl.program_id(0)

    @pl.when((first_ref[j] == 1) if streamed_out else (j == 0))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def step(u, r, g):
        if streamed_out:
            _add_row(out_ref, u, src_ref, r, g)
        else:
            _add_row(out_ref, r, src_ref, u, g)

    _pair_loop(lo_ref[j], hi_ref[j], pk_ref, pd_ref, pg_ref, b_ref[j] * tw, tw, r0, rows, step)


def _pair_specs(tp):
    def at(j, b, pb, *_):
        return (pb[j],)

    return [pl.BlockSpec((tp,), at, memory_space=pltpu.SMEM) for _ in range(3)]


def _chunks(num_rows: int, width: int):
    """Row ranges of the resident side, each within RESIDENT_BYTES (multiples of 8)."""
    per = max(8, (RESIDENT_BYTES // (width * 4)) // 8 * 8)
    return [(r0, min(per, num_rows - r0)) for r0 in range(0, num_rows, per)]


def _call(kernel, sched, grid, in_specs, out_spec, out_shape, args):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(grid,),
            in_specs=in_specs,
            out_specs=out_spec,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT
        ),
        interpret=_interpret(),
    )(*sched.scalars, sched.key, sched.dst, sched.gains, *args)


@functools.partial(jax.jit, static_argnames=("num_dst", "tw", "tp"))
def combine_sorted(src, key, dst, gains, *, num_dst: int, tw: int = TW, tp: int = TP):
    """`out[dst[p]] += gains[p] * src[key[p]]` ([num_dst, Dc] float32, Dc = src's
    width rounded to 128 lanes) for pairs sorted by key. Returns (out, sorted)."""
    num_src, width = src.shape
    dc = lane_width(width)
    sched, ok = schedule(key, dst, gains, num_src, num_dst, tw, tp)
    nkb = sched.num_blocks
    padded = (
        jnp.zeros((nkb * tw, dc), jnp.float32).at[:num_src, :width].set(src.astype(jnp.float32))
    )
    grid = sched.block.shape[0]
    pieces = []
    for r0, rows in _chunks(num_dst, dc):
        rows8 = -(-rows // 8) * 8
        kernel = functools.partial(_pair_kernel, tw=tw, r0=r0, rows=rows, streamed_out=False)
        src_spec = _rows_spec(tw, dc, lambda j, b, *_: b[j])
        out_spec = _rows_spec(rows8, dc, lambda j, *_: 0)
        out_shape = jax.ShapeDtypeStruct((rows8, dc), jnp.float32)
        out = _call(
            kernel, sched, grid, _pair_specs(tp) + [src_spec], out_spec, out_shape, (padded,)
        )
        pieces.append(out[:rows])
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    return out, ok


@functools.partial(jax.jit, static_argnames=("num_out", "tw", "tp"))
def reduce_sorted(src, key, dst, gains, *, num_out: int, tw: int = TW, tp: int = TP):
    """`out[key[p]] += gains[p] * src[dst[p]]` ([num_out, Dc] float32) for pairs sorted
    by key (`src` [num_src, D] the resident side). Returns (out, sorted)."""
    num_src, width = src.shape
    dc = lane_width(width)
    sched, ok = schedule(key, dst, gains, num_out, num_src, tw, tp)
    nkb = sched.num_blocks
    grid = sched.block.shape[0]
    total = None
    for r0, rows in _chunks(num_src, dc):
        rows8 = -(-rows // 8) * 8
        part = (
            jnp.zeros((rows8, dc), jnp.float32)
            .at[:rows, :width]
            .set(src[r0 : r0 + rows].astype(jnp.float32))
        )
        kernel = functools.partial(_pair_kernel, tw=tw, r0=r0, rows=rows, streamed_out=True)
        src_spec = _rows_spec(rows8, dc, lambda j, *_: 0)
        out_spec = _rows_spec(tw, dc, lambda j, b, *_: b[j])
        out_shape = jax.ShapeDtypeStruct((nkb * tw, dc), jnp.float32)
        out = _call(kernel, sched, grid, _pair_specs(tp) + [src_spec], out_spec, out_shape, (part,))
        total = out if total is None else total + out
    return total[:num_out], ok


def _kernel_or_xla(ok, kernel, src, read, write, gains, num_out: int):
    """`kernel()`'s [num_out, D] where `ok` (the pairs in key order), else the op's
    reference (XLA's segment sum, any order) of `src[read]` into `write`, where a
    negative index is out of range too (never wrapped)."""
    width = src.shape[1]

    def fallback(src, read, write, gains):
        read = jnp.where(read < 0, src.shape[0], read)
        return reference.segment_gather_sum(
            src.astype(jnp.float32), read, gains, write, num_segments=num_out
        )

    return jax.lax.cond(ok, lambda *_: kernel()[0][:, :width], fallback, src, read, write, gains)


def combine(src, key, dst, gains, num_dst: int):
    """`combine_sorted` where the pairs are sorted by key, else XLA's segment sum (any
    order): [num_dst, D] float32."""
    ok = is_sorted(key, dst, src.shape[0], num_dst)
    kernel = lambda: combine_sorted(src, key, dst, gains, num_dst=num_dst)
    return _kernel_or_xla(ok, kernel, src, key, dst, gains, num_dst)


def reduce(src, key, dst, gains, num_out: int):
    """`reduce_sorted` where the pairs are sorted by key, else XLA's: [num_out, D]."""
    ok = is_sorted(key, dst, num_out, src.shape[0])
    kernel = lambda: reduce_sorted(src, key, dst, gains, num_out=num_out)
    return _kernel_or_xla(ok, kernel, src, dst, key, gains, num_out)


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


def _gather_kernel(ids_ref, table_ref, out_ref, sem, *, num_rows):
    def copy(i, row):
        return pltpu.make_async_copy(table_ref.at[pl.ds(row, 1)], out_ref.at[pl.ds(i, 1)], sem)

    def zero(i):
        out_ref[pl.ds(i, 1), :] = jnp.zeros((1, out_ref.shape[1]), out_ref.dtype)

    _dma_rows(ids_ref, out_ref.shape[0], num_rows, copy, zero)


def gather_rows_dma(table, ids, *, tg: int = TG):
    """`table[ids]` (zero rows for ids outside it), a DMA a row."""
    n = ids.shape[0]
    nb = max(1, -(-n // tg))
    idp = jnp.pad(ids.astype(jnp.int32), (0, nb * tg - n), constant_values=-1)
    out = pl.pallas_call(
        functools.partial(_gather_kernel, num_rows=table.shape[0]),
        grid=(nb,),
        in_specs=[
            pl.BlockSpec((tg,), lambda i: (i,), memory_space=pltpu.SMEM),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((tg, table.shape[1]), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((nb * tg, table.shape[1]), table.dtype),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret(),
    )(idp, table)
    return out[:n]


def _scatter_kernel(ids_ref, rows_ref, table_in, table_ref, sem, *, num_rows):
    del table_in  # aliased to table_ref

    def copy(i, row):
        return pltpu.make_async_copy(rows_ref.at[pl.ds(i, 1)], table_ref.at[pl.ds(row, 1)], sem)

    _dma_rows(ids_ref, rows_ref.shape[0], num_rows, copy)


def scatter_rows_dma(table, ids, rows, *, tg: int = TG):
    """`table.at[ids].set(rows)` in place (ids distinct; outside the table: skipped):
    the table is aliased to the result (donate it, or XLA copies it first)."""
    n = ids.shape[0]
    nb = max(1, -(-n // tg))
    idp = jnp.pad(ids.astype(jnp.int32), (0, nb * tg - n), constant_values=-1)
    rp = jnp.pad(rows.astype(table.dtype), ((0, nb * tg - n), (0, 0)))
    return pl.pallas_call(
        functools.partial(_scatter_kernel, num_rows=table.shape[0]),
        grid=(nb,),
        in_specs=[
            pl.BlockSpec((tg,), lambda i: (i,), memory_space=pltpu.SMEM),
            pl.BlockSpec((tg, table.shape[1]), lambda i: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), has_side_effects=True
        ),
        interpret=_interpret(),
    )(idp, rp, table)
