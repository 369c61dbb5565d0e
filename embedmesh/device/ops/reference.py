"""The pure-JAX reference of each device op: the semantics every kernel must match.

They run on any backend and are what `embedmesh.device.ops` calls where no
kernel is registered, ready, or able to take a call. Arguments arrive already
normalised by the op (int32 ids, float32 gains and sums; see its docstring).
All ids are non-negative; `PAD_ID` and other ids past the end of a table are
padding: gathers read zeros (`mode="fill"`) and scatters skip them
(`mode="drop"`).

`sparse_update` and `backward_update` have no entry here: their reference is
their definition in terms of these ops (in `embedmesh.device.ops`), so that
each part still runs its platform's kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh._runtime import PAD_ID

__all__ = [
    "dedup_sum",
    "dedup_sum_by_sort",
    "exchange",
    "full",
    "gather_rows",
    "quantize",
    "huge_page_copy",
    "scatter_rows",
    "segment_gather_sum",
    "segment_gather_sum_mapped",
]


def gather_rows(table, ids):
    """`table[ids]`, zero rows for ids outside the table."""
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def scatter_rows(table, ids, rows):
    """`table.at[ids].set(rows, mode="drop")` (ids distinct, or duplicates carry equal rows)."""
    return table.at[ids].set(rows.astype(table.dtype), mode="drop")


def segment_gather_sum(src, src_idx, gains, dst_idx, *, num_segments: int):
    """`segment_sum(src[src_idx] * gains[:, None], dst_idx, num_segments)`; pairs with an
    out-of-range `src_idx` or `dst_idx` contribute nothing. No id outside reaches XLA's
    segment sum: such a pair adds an exact zero row to segment 0 (on the v5e chip, XLA's
    segment sum added the rows of ids outside `[0, num_segments)` into segment 0, where
    the CPU drops them: tests/device/test_tpu_ops.py, 2026-12-04)."""
    g = jnp.take(src, src_idx, axis=0, mode="fill", fill_value=0) * gains[:, None]
    if num_segments == 0:
        return jnp.zeros((0,) + g.shape[1:], g.dtype)
    valid = (dst_idx >= 0) & (dst_idx < num_segments)
    g = jnp.where(valid.reshape((-1,) + (1,) * (g.ndim - 1)), g, 0)
    return jax.ops.segment_sum(g, jnp.where(valid, dst_idx, 0), num_segments=num_segments)


def quantize(rows, quantization):
    """TensorFlow's simulated quantization of looked-up rows, in float32:
    `quantization = (num_buckets, lower, upper)`; each value clipped to [lower, upper],
    then `floor((x - lower) / quantum + 0.5) * quantum + lower`, `quantum = (upper -
    lower) / (num_buckets - 1)` (`config.QuantizationConfig`)."""
    buckets, lower, upper = quantization
    lo, hi = jnp.float32(lower), jnp.float32(upper)
    quantum = (hi - lo) / jnp.float32(buckets - 1)
    x = jnp.clip(rows.astype(jnp.float32), lo, hi)
    return jnp.floor((x - lo) / quantum + jnp.float32(0.5)) * quantum + lo


def segment_gather_sum_mapped(
    src, src_map, src_idx, gains, dst_idx, *, num_segments: int, quantization=None, columns=None
):
    """`segment_gather_sum` over the rows `src[src_map]` (in float32; their first `columns`
    columns where given), each row `quantize`d first when a `quantization` is given."""
    rows = gather_rows(src, src_map)
    if columns is not None:
        rows = rows[:, :columns]
    rows = rows.astype(jnp.float32)
    if quantization is not None:
        rows = quantize(rows, quantization)
    return segment_gather_sum(rows, src_idx, gains, dst_idx, num_segments=num_segments)


def dedup_sum_by_sort(ids, grads, *, sorted_hint: bool = False):
    """`dedup_sum` for ids in any order: a stable sort, then a segment sum (told its
    segment ids are sorted with `sorted_hint`: what GPUs need to skip contended atomics)."""
    flat = ids.reshape(-1)
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    segment = jnp.cumsum(starts.astype(jnp.int32)) - 1
    uniq = jnp.full((m,), PAD_ID, jnp.int32).at[segment].set(sorted_ids)
    sums = jax.ops.segment_sum(
        grads[order], segment, num_segments=m, indices_are_sorted=sorted_hint
    )
    # ids equal to PAD_ID sort last and form (at most) one segment: zero its sum.
    sums = jnp.where((uniq == PAD_ID)[:, None], 0, sums)
    return uniq, sums


def _ascending_distinct(flat):
    """Whether `flat` is strictly ascending up to trailing PAD_IDs."""
    return jnp.all((flat[1:] > flat[:-1]) | (flat[1:] == PAD_ID))


def dedup_sum(ids, grads, *, sorted_hint: bool = False):
    """(distinct ids of `ids` [N, U] ascending, PAD_ID padded; the sum of the `grads`
    [N*U, D] rows of each); ids equal to PAD_ID are dropped. `sorted_hint`: see
    `dedup_sum_by_sort`."""
    by_sort = functools.partial(dedup_sum_by_sort, sorted_hint=sorted_hint)
    if ids.shape[0] != 1:
        return by_sort(ids, grads)
    # One list, as the host preprocessing makes it (ascending, distinct): skip the sort
    # when a cheap check confirms it.
    flat = ids.reshape(-1)

    def as_is(flat, grads):
        return flat, jnp.where((flat == PAD_ID)[:, None], 0, grads)

    return jax.lax.cond(_ascending_distinct(flat), as_is, by_sort, flat, grads)


def exchange(x, *, transport):
    """`all_to_all` over the transport's axis: block j of axis 0 to device j (inside
    `shard_map`)."""
    if transport.num_shards == 1:
        return x
    return jax.lax.all_to_all(x, transport.axis_name, 0, 0, tiled=True)


def huge_page_copy(x):
    """`x` itself: only a kernel has a page size to choose."""
    return x


def full(shape: tuple, value, dtype, device):
    """`jnp.full(shape, value, dtype)` made on `device` (`value` already there)."""
    return _full_fn(shape, np.dtype(dtype).name, device)(value)


@functools.lru_cache(maxsize=64)
def _full_fn(shape, dtype, device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda v: jnp.full(shape, v, dtype), out_shardings=sharding)
