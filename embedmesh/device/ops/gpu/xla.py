"""The device ops in plain XLA, arranged for GPUs: sorts instead of contended atomics.

On a GPU, XLA lowers a scatter-add with repeated indices (`segment_sum` on
unsorted segment ids, the references' per-unique sums) to atomic adds that
collide on hot rows, and a scatter whose ids may repeat to a serialising
one. Each function here has its reference's signature and semantics (see
`embedmesh.device.ops`): the segment sums sort the pairs by destination first
(stable: each segment still sums in pair order) and tell XLA the segment ids
are sorted; the scatter tells XLA the ids are distinct, which the op's
contract guarantees.

Only the ops where this changes something are here: `gather_rows` would be
the reference itself, and `sparse_update` / `backward_update`'s references
are compositions of the ops, which pick these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedmesh.device.ops import reference

__all__ = [
    "dedup_sum",
    "scatter_rows",
    "segment_gather_sum",
    "segment_gather_sum_mapped",
    "sorted_pairs",
]


def scatter_rows(table, ids, rows):
    """`table.at[ids].set(rows, mode="drop")` with `unique_indices` (ids distinct)."""
    return table.at[ids].set(rows.astype(table.dtype), mode="drop", unique_indices=True)


def sorted_pairs(valid, dst_idx, num_segments: int):
    """(order, key): the stable permutation that sorts the pairs by destination, the
    invalid ones last (key `num_segments`, which a segment sum drops), and the
    sorted keys."""
    key = jnp.where(valid, dst_idx, num_segments).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    return order, key[order]


def _sorted_segment_sum(src, rows, gains, valid, dst_idx, num_segments: int):
    """`segment_sum(src[rows] * gains, dst_idx)` over the valid pairs, sorted first."""
    order, key = sorted_pairs(valid, dst_idx, num_segments)
    rows = jnp.where(valid, rows, 0)[order]
    picked = jnp.take(src, rows, axis=0, mode="clip").astype(jnp.float32)
    contrib = picked * jnp.where(valid, gains, 0.0)[order][:, None]
    return jax.ops.segment_sum(contrib, key, num_segments=num_segments, indices_are_sorted=True)


def in_range(idx, n: int):
    """Whether each of `idx` is in [0, n)."""
    return (idx >= 0) & (idx < n)


def segment_sums(segment_sum):
    """The ops `segment_gather_sum` and `segment_gather_sum_mapped` over a segment sum
    `segment_sum(src, rows, gains, valid, dst_idx, num_segments)` of the valid pairs:
    which pairs are valid (their row in `src`, their segment in range) and, mapped, each
    pair's row `src_map[src_idx]`, read from `src` directly (no [len(src_map), D] buffer):
    the same for every backend's sum."""

    def segment_gather_sum(src, src_idx, gains, dst_idx, *, num_segments: int):
        """The sum over the pairs whose row and segment are in range."""
        valid = in_range(src_idx, src.shape[0]) & in_range(dst_idx, num_segments)
        return segment_sum(src, src_idx, gains, valid, dst_idx, num_segments)

    def segment_gather_sum_mapped(src, src_map, src_idx, gains, dst_idx, *, num_segments: int):
        """`segment_gather_sum` over `src[src_map]`, each pair's row read from `src`."""
        in_map = in_range(src_idx, src_map.shape[0])
        rows = jnp.take(src_map, jnp.where(in_map, src_idx, 0), mode="clip")
        valid = in_map & in_range(rows, src.shape[0]) & in_range(dst_idx, num_segments)
        return segment_sum(src, rows, gains, valid, dst_idx, num_segments)

    return segment_gather_sum, segment_gather_sum_mapped


# the reference's sums, pairs sorted by `dst_idx` (no atomics on repeated segments)
segment_gather_sum, segment_gather_sum_mapped = segment_sums(_sorted_segment_sum)


def dedup_sum(ids, grads):
    """The reference's `dedup_sum` with its segment sum told the segments are sorted; a
    single list already ascending and distinct (the host's) is only checked and kept."""
    if ids.shape[0] == 0 or ids.size == 0:
        return ids.reshape(-1), grads
    return reference.dedup_sum(ids, grads, sorted_hint=True)
