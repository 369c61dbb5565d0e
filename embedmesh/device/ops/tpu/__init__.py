"""TPU kernels of the device ops, registered through the same registry as the CPU and GPU
ones (`embedmesh.device.ops`).

What a v5e chip showed (`benchmarks/tpu_probe.py`, `pallas`'s docstring): rows move
between HBM and the core at a cost a row, and narrow rows cost as much as 128-lane ones
or far more (XLA's gather reads 64-float rows at 10 M rows/s, 128-float rows at 66 M;
its scatter writes them at 5.6 M and 12.7 M rows/s). Hence, on a TPU mesh:

- every stack's rows are whole 128-lane vregs: `layout.stacking.dim_multiple_for`
  pads dims to a multiple of 128 there, a row-wise optimizer's stack too (its mean
  over its table's own columns, `RowWiseAdagrad.mean_dim`: before, its 64-wide rows
  made its step 2.1x Adagrad's); a model whose padded rows would not fit stores its narrow
  rows several to a 128-lane row instead (`embedmesh.device.ops.packed`: the same kernels
  move whole 128-lane rows, XLA selects each id's lanes; its step 1.25-1.28x the padded
  one at dims 16 and 32);
- a stack's optimizer slots live in its rows (`layout.stacking.slots_in_rows_for`:
  `[w | acc]` in one 128-lane row at dims up to 64, 256 lanes at 128): the update
  gathers and scatters each touched row once, not once per array, and a dim-64 Adagrad
  model takes half the HBM (`embedmesh.device.slots_in_rows`); a lookup reads only the
  parameters' vregs (`segment_gather_sum_mapped(columns=...)`, `gather_columns`);
- `scatter_rows`: a DMA a row from VMEM into the table in place
  (`pallas.scatter_rows_dma`, 49.5 M rows/s at 128 lanes) for float32 tables of
  whole vregs, else XLA's scatter told the ids are distinct;
- `segment_gather_sum(_mapped)`: the pair sums on the MXU (`pallas.reduce`, `pallas.combine`:
  each item's rows gathered into VMEM, one-hot matmuls), at every width: 3.7 ms for a
  backward of 309k pairs at dims 64-128 against XLA's take + segment_sum at 6.1, 3.35
  against 6.2 for a lookup's (its device sort included); a lookup's pairs come from the
  host in output-row order too (the batch's `pairs_by_row`, made where the mesh is a
  TPU's), so it sorts nothing: XLA's TPU compiler takes far longer over that sort than
  over the rest of the lookup's program, and gathering the pairs by a permutation on the
  device (three scalar gathers) would cost more than the sums;
- gathers stay XLA's (66 M rows/s, against 21 M for a DMA a row); `sparse_update` and
  `backward_update` are their references' compositions of these.

`ENABLED = False` turns them all off (every op its reference: the A/B switch of
`benchmarks/tpu.py`). `KERNELS` maps op names to `(kernel, supports)` like the CPU
and GPU tables.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from embedmesh.device.ops import reference
from embedmesh.device.ops.gpu import xla  # XLA's ops told what the op guarantees

__all__ = [
    "ENABLED",
    "HINTS",
    "KERNELS",
    "LANES",
    "PARTNERS",
    "ROW_READ",
    "gather_columns",
    "lane_width",
    "ready",
    "scatter_rows_paired",
]

ENABLED = True


LANES = 128


def lane_width(dim: int) -> int:
    """Columns a row takes on a TPU: `dim` rounded up to whole 128-lane vregs."""
    return -(-int(dim) // LANES) * LANES


def _pallas():
    """`embedmesh.device.ops.tpu.pallas`, imported at the first TPU call (it imports
    Pallas, which `import embedmesh` does not)."""
    return importlib.import_module("embedmesh.device.ops.tpu.pallas")


def ready() -> bool:
    """Whether the TPU kernels are used (`ENABLED`)."""
    return ENABLED


def _whole_vregs(table) -> bool:
    return (
        table.ndim == 2
        and table.shape[1] % LANES == 0
        and jnp.dtype(table.dtype).itemsize == 4
        and table.shape[0] < 2**31
    )


def _paired(table) -> bool:
    """A 16-bit table whose rows move in pairs (`pallas.scatter_pairs_dma`)."""
    return (
        table.ndim == 2
        and table.shape[1] % LANES == 0
        and jnp.dtype(table.dtype).itemsize == 2
        and table.shape[0] % 2 == 0
        and table.shape[0] < 2**31
    )


def scatter_rows(table, ids, rows):
    """`table.at[ids].set(rows, mode="drop")`, ids distinct: a DMA a row where the rows
    are whole float32 vregs, a DMA a row pair for 16-bit ones (`scatter_rows_paired`),
    else XLA's scatter told the ids are distinct."""
    if _whole_vregs(table):
        return _pallas().scatter_rows_dma(table, ids, rows)
    if _paired(table):
        return scatter_rows_paired(table, ids, rows)
    return xla.scatter_rows(table, ids, rows)


# Where `scatter_rows_paired` reads the partners it does not write: "xla" (XLA's gather
# of the partner rows) or "dma" (`pallas.gather_pairs_dma` of the pairs)
PARTNERS = "xla"


def _ascending(ids, rows):
    """`(ids, rows)` ordered by id: as they are where ascending already (a stack's
    distinct ids, the padding last), else sorted on the device."""

    def by_id():
        order = jnp.argsort(ids)
        return ids[order], rows[order]

    if ids.shape[0] < 2:
        return ids, rows
    return jax.lax.cond(jnp.all(ids[1:] > ids[:-1]), lambda: (ids, rows), by_id)


def _shifted(x, by: int, fill):
    """`x` moved `by` places along its first axis (+1: x[i - 1] at i), `fill` in the gap."""
    gap = jnp.full((abs(by),) + x.shape[1:], fill, x.dtype)
    return jnp.concatenate([gap, x[:-by]] if by > 0 else [x[-by:], gap])


def scatter_rows_paired(table, ids, rows):
    """`table.at[ids].set(rows, mode="drop")` for a 16-bit table, ids distinct: a TPU
    keeps two 16-bit rows in one 32-bit word (rows 2p and 2p + 1, `pallas._pairs`), and a
    DMA moves words, so each row is written with its partner: the partner's new row
    where it is among `ids` (then its neighbour once the ids are ascending), else its
    current one (`PARTNERS`). A pair written twice gets the same words both times.

    On a v5e (`benchmarks/tpu_probe.py`, case sixteen): 117k rows of an 8M x 128
    bfloat16 table, XLA's scatter 9.0 ms, this 3.8 ms, of which the partners' gather
    1.4 ms; a float32 DMA scatter of as many 128-lane rows 2.4 ms (run i)."""
    if ids.shape[0] == 0:
        return table
    num_rows = table.shape[0]
    ids, rows = _ascending(ids.astype(jnp.int32), rows.astype(table.dtype))
    inside = (ids >= 0) & (ids < num_rows)
    own = jax.lax.bitcast_convert_type(rows, jnp.uint16).astype(jnp.uint32)
    odd = (ids & 1)[:, None] == 1
    if PARTNERS == "dma":
        words = _pallas().gather_pairs_dma(table, jnp.where(inside, ids >> 1, -1))
        old = jnp.where(odd, words & 0xFFFF, words >> 16)
    else:
        partner_rows = reference.gather_rows(table, jnp.where(inside, ids ^ 1, -1))
        old = jax.lax.bitcast_convert_type(partner_rows, jnp.uint16).astype(jnp.uint32)
    # ascending and distinct: an even id's partner can only follow it, an odd one's precede
    after = (_shifted(ids, -1, -1) == (ids ^ 1))[:, None]
    before = (_shifted(ids, 1, -1) == (ids ^ 1))[:, None]
    partner = jnp.where(
        after & inside[:, None],
        _shifted(own, -1, 0),
        jnp.where(before & inside[:, None], _shifted(own, 1, 0), old),
    )
    words = jnp.where(odd, partner | (own << 16), own | (partner << 16))
    pairs = jnp.where(inside, ids >> 1, jnp.where(ids < 0, -1, ids))
    return _pallas().scatter_pairs_dma(table, pairs, words)


def _rows(src) -> bool:
    return src.ndim == 2 and src.shape[0] < 2**31


def _finite_or_reference(kernel, src, src_idx, gains, dst_idx, num_segments: int):
    """`kernel()` where every row of `src` and every gain is finite, else the op's
    reference. The MXU sums multiply each row by the one-hot matrix's zeros for every
    other key of its block, and 0 * NaN is NaN: a non-finite row would reach up to a
    block of other rows' sums, where the reference keeps it to its own. One pass over
    `src` (~0.1 ms for 60 MB on a v5e) buys the reference's semantics there."""
    finite = jnp.all(jnp.isfinite(src)) & jnp.all(jnp.isfinite(gains))

    def fallback(src, src_idx, gains, dst_idx):
        return _reference_sums(src, src_idx, gains, dst_idx, num_segments)

    return jax.lax.cond(finite, lambda *_: kernel(), fallback, src, src_idx, gains, dst_idx)


def _reference_sums(src, src_idx, gains, dst_idx, num_segments: int):
    src_idx = jnp.where(src_idx < 0, src.shape[0], src_idx)  # skipped, never wrapped
    return reference.segment_gather_sum(src, src_idx, gains, dst_idx, num_segments=num_segments)


def _sorted_sums(src, src_idx, gains, dst_idx, num_segments: int):
    """The reference's sums of pairs in ascending `dst_idx` order, the invalid ones (out
    of range, either index) after them: XLA's segment sum told its segments are sorted,
    which compiles no sort (an unsorted one's sort outlasted the rest of a lookup's
    compile on the chip)."""
    if num_segments == 0:
        return jnp.zeros((0, src.shape[1]), jnp.float32)
    valid = (dst_idx >= 0) & (dst_idx < num_segments) & (src_idx >= 0)
    valid &= src_idx < src.shape[0]
    g = jnp.take(src, jnp.where(valid, src_idx, 0), axis=0).astype(jnp.float32)
    g = jnp.where(valid[:, None], g * gains[:, None], 0.0)
    seg = jnp.where(valid, dst_idx, num_segments - 1)  # zero rows, last: still ascending
    return jax.ops.segment_sum(g, seg, num_segments=num_segments, indices_are_sorted=True)


def _looped_sums(src, src_idx, gains, dst_idx, num_segments: int):
    """The reference's sums a pair at a time: no sort to compile, slow to run. For pairs
    said to be in order that are not (the host's order would be wrong): exact still."""
    out = jnp.zeros((num_segments, src.shape[1]), jnp.float32)
    if num_segments == 0 or src.shape[0] == 0:
        return out

    def add(p, out):
        s, d = src_idx[p], dst_idx[p]
        ok = (s >= 0) & (s < src.shape[0]) & (d >= 0) & (d < num_segments)
        s, d = jnp.clip(s, 0, src.shape[0] - 1), jnp.clip(d, 0, num_segments - 1)
        row = jax.lax.dynamic_slice_in_dim(src, s, 1).astype(jnp.float32) * gains[p]
        new = jax.lax.dynamic_slice_in_dim(out, d, 1) + jnp.where(ok, row, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, new, d, 0)

    return jax.lax.fori_loop(0, src_idx.shape[0], add, out)


def _pair_sums(src, src_idx, gains, dst_idx, num_segments: int, dst_order, any_order):
    """`out[dst_idx[p]] += gains[p] * src[src_idx[p]]` (float32) by `pallas.reduce` keyed
    by `dst_idx`. With `dst_order` (empty: the pairs come in `dst_idx` order; else the
    positions in that order, the pairs gathered so first): `pallas.reduce_ordered`, and
    where a row or gain is not finite the reference's sums of the ordered pairs, where
    they were not in order a pair at a time: neither compiles a sort. Without it:
    `any_order()`'s sums (`_finite_or_reference`)."""
    if dst_order is None:
        return _finite_or_reference(any_order, src, src_idx, gains, dst_idx, num_segments)
    order = jnp.asarray(dst_order, jnp.int32).reshape(-1)
    if order.shape[0]:
        src_idx, gains, dst_idx = (jnp.asarray(a)[order] for a in (src_idx, gains, dst_idx))
    none = jnp.zeros((0,), jnp.int32)
    out, in_order = _pallas().reduce_ordered(src, dst_idx, src_idx, gains, none, num_segments)
    finite = jnp.all(jnp.isfinite(src)) & jnp.all(jnp.isfinite(gains))

    def fallback(src, src_idx, gains, dst_idx):
        args = (src, src_idx, gains, dst_idx)
        return jax.lax.cond(
            in_order,
            lambda *a: _sorted_sums(*a, num_segments),
            lambda *a: _looped_sums(*a, num_segments),
            *args,
        ).astype(out.dtype)

    return jax.lax.cond(in_order & finite, lambda *_: out, fallback, src, src_idx, gains, dst_idx)


def segment_gather_sum(src, src_idx, gains, dst_idx, *, num_segments: int, dst_order=None):
    """The backward's per-unique sums (pairs sorted by `dst_idx`, else sorted on the
    device): `pallas.reduce`; given the pairs' order by `dst_idx` (`dst_order`),
    `pallas.reduce_ordered`."""
    return _pair_sums(
        src,
        src_idx,
        gains,
        dst_idx,
        num_segments,
        dst_order,
        lambda: _pallas().reduce(src, dst_idx, src_idx, gains, num_segments),
    )


def gather_columns(table, ids, columns: int):
    """`table[ids, :columns]`, zero rows for ids outside the table: XLA's gather reading
    only those columns of each row. On a v5e it took 126 ms for 117k rows of 256 lanes
    against 1.9 ms for whole rows then a slice (`benchmarks/tpu_gather_probe.py`), so the
    lookups gather whole rows; kept for that probe."""
    dnums = jax.lax.GatherDimensionNumbers(
        offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    return jax.lax.gather(
        table,
        ids.reshape(-1, 1),
        dnums,
        slice_sizes=(1, columns),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
        fill_value=0,
    )


def segment_gather_sum_mapped(
    src, src_map, src_idx, gains, dst_idx, *, num_segments: int, columns=None, dst_order=None
):
    """A lookup from the table: the distinct rows gathered (XLA; of a stack keeping its
    slots in its rows, the parameters' vregs), then `pallas.combine` (the pairs sorted by
    output row on the device), or with `dst_order` (the host's order of the pairs by
    output row) `pallas.reduce_ordered` (no device sort); `columns`: the parameters'
    columns of each row."""
    if columns is None:
        rows = reference.gather_rows(src, src_map).astype(jnp.float32)
    else:  # whole vregs moved and summed (the MXU's work is a vreg's), the rest cut after
        lanes = min(lane_width(columns), src.shape[1])
        rows = reference.gather_rows(src, src_map)
        if lanes < src.shape[1]:  # the parameters' vregs of whole rows: the barrier keeps
            # XLA from fusing the slice into the gather (`gather_columns`, 66x slower)
            rows = jax.lax.optimization_barrier(rows)[:, :lanes]
        rows = rows.astype(jnp.float32)
        if lanes != columns:
            rows = jnp.where(jnp.arange(lanes) < columns, rows, 0.0)  # no slot is summed

    out = _pair_sums(
        rows,
        src_idx,
        gains,
        dst_idx,
        num_segments,
        dst_order,
        lambda: _pallas().combine(rows, src_idx, dst_idx, gains, num_segments),
    )
    return out if columns is None else out[:, :columns]


# the row-read parameters (`ops._ROW_READ`) a kernel applies itself
ROW_READ = {"segment_gather_sum_mapped": ("columns",)}
# the hints (`ops._HINTS`) a kernel reads: the pairs' order by output row
HINTS = {
    "segment_gather_sum": ("dst_order",),
    "segment_gather_sum_mapped": ("dst_order",),
}

KERNELS = {
    "scatter_rows": (scatter_rows, None),
    "segment_gather_sum": (segment_gather_sum, lambda src, *a, **k: _rows(src)),
    "segment_gather_sum_mapped": (segment_gather_sum_mapped, lambda src, *a, **k: _rows(src)),
}
