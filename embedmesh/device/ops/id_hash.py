"""The id map's keyed hash and two-bucket probe (`embedmesh.device.id_map`, issue 42), in
plain `jax.numpy`, and the reference of the op `id_map_hits` built on them.

They live with the ops because the op's reference needs them and the ops import nothing
of the device layer above them; `id_map` hashes and probes with these same functions, so
the CPU kernel (cpu/id_map.cc), this reference and the map agree by construction. The
index layout is `id_map`'s: `[num_buckets, 3, BUCKET_WIDTH]` uint32, the words of a slot
`[high word, low word, row]`, `EMPTY` the row word of an empty slot.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

BUCKET_WIDTH = 16  # slots a bucket: one lookup reads 2 buckets
EMPTY = np.uint32(0xFFFFFFFF)  # the row word of an empty slot
KEY, LO, ROW = 0, 1, 2  # the words of a slot: [hi, lo, row]
INT32_MAX = np.iinfo(np.int32).max


def fmix32(h):
    """MurmurHash3's 32-bit finaliser (a bijection), on uint32 arrays."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def fmix32_int(h: int) -> int:
    """`fmix32` of a Python int."""
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def hash_words(seed: int, salt: int) -> tuple[int, int, int]:
    """The three seed words of the keyed hash for a seed and a salt."""
    s0 = fmix32_int((seed ^ salt) & 0xFFFFFFFF)
    s1 = fmix32_int((s0 + 0x9E3779B9) & 0xFFFFFFFF)
    s2 = fmix32_int((s1 + 0x9E3779B9) & 0xFFFFFFFF)
    return s0, s1, s2


def hash_keyed(hi, lo, words):
    """The keyed 32-bit hash of (hi, lo) given its seed words (`hash_words`): each half
    through its own seeded finaliser, combined, finalised again."""
    s0, s1, s2 = words
    a = fmix32(lo ^ jnp.uint32(s0))
    b = fmix32(hi ^ jnp.uint32(s1))
    return fmix32((a + b * jnp.uint32(0x9E3779B1)) ^ jnp.uint32(s2))


def buckets(num_buckets: int, keys, hi, lo):
    """The two buckets (int32) of each id: `keys` the two hashes' seed words, 3 each."""
    mask = jnp.uint32(num_buckets - 1)
    return tuple(
        (hash_keyed(hi, lo, keys[3 * i : 3 * i + 3]) & mask).astype(jnp.int32) for i in (0, 1)
    )


def find(index, keys, hi, lo):
    """(found, row, flat slot) of 1-D id words in `index`; one gather of both buckets,
    the first matching slot (the first bucket's, then the second's)."""
    b1, b2 = buckets(index.shape[0], keys, hi, lo)
    t = jnp.concatenate([index[b1], index[b2]], axis=-1)  # [n, 3, 2W]
    match = (t[:, ROW] != EMPTY) & (t[:, KEY] == hi[:, None]) & (t[:, LO] == lo[:, None])
    found = match.any(axis=1)
    j = jnp.argmax(match, axis=1)
    row = jnp.take_along_axis(t[:, ROW], j[:, None], axis=1)[:, 0]
    row = jnp.where(found, lax.bitcast_convert_type(row, jnp.int32), -1)
    slot = jnp.where(j < BUCKET_WIDTH, b1 * BUCKET_WIDTH + j, b2 * BUCKET_WIDTH + j - BUCKET_WIDTH)
    return found, row, jnp.where(found, slot, -1)


def hits_reference(index, use_count, hi, lo, valid, *, keys, distinct):
    """The reference of the op `id_map_hits` (`embedmesh.device.ops.id_map_hits`): every
    valid id's row, and whether all hit in a state that needs none of the jnp path's
    arithmetic; the distinct hits are the valid positions (`distinct`) or their distinct
    rows (no two live ids share a row)."""
    c = use_count.shape[0]
    n = hi.shape[0]
    found, row, _ = find(index, keys, hi, lo)
    count = use_count[jnp.clip(row, 0, c - 1)]
    sane = found & (row >= 0) & (row < c) & (count >= 0) & (count <= INT32_MAX - n)
    ok = ~jnp.any(valid & ~sane)
    rows = jnp.where(valid & ok, row, -1)
    if distinct:
        hits = valid.sum(dtype=jnp.int32)
    else:
        s = jnp.sort(jnp.where(valid, row, c))
        lead = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]]) & (s < c)
        hits = lead.sum(dtype=jnp.int32)
    status = jnp.stack([ok.astype(jnp.int32), jnp.where(ok, hits, 0)])
    return status, rows
