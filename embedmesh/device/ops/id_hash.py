"""The id map's keyed hash and two-bucket probe (`embedmesh.device.id_map`, issue 42), in
plain `jax.numpy`.

They live with the ops because the op `id_map_step`'s reference path hashes and probes with
them and the ops import nothing of the device layer above them; `id_map` hashes and probes
with these same functions, so the CPU kernel (cpu/id_map.cc) and the map agree by
construction. The layouts are `id_map`'s: the index `[num_buckets, 2, BUCKET_WIDTH]`
uint32, a slot's words `[tag, row]` (`EMPTY` the row word of an empty slot; the tag a keyed
32-bit hash of the id, no two live slots of a bucket with one tag), and the rows' words
`row_info` int32 `[capacity, 4]`: `[id high word, id low word, last used, use count]`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from embedmesh._runtime import fmix32, fmix32_int  # (and this module's names)

BUCKET_WIDTH = 8  # slots a bucket (its tags and row words: one 64-byte line)
EMPTY = np.uint32(0xFFFFFFFF)  # the row word of an empty slot
TAG, ROW = 0, 1  # the words of a slot: [tag, row]
ID_HI, ID_LO, LAST_USED, USE_COUNT = 0, 1, 2, 3  # the words of a row's `row_info`
INT32_MAX = np.iinfo(np.int32).max


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
    """The two buckets (int32) of each id: `keys` the two bucket hashes' seed words (3
    each; the tag's may follow)."""
    mask = jnp.uint32(num_buckets - 1)
    return tuple(
        (hash_keyed(hi, lo, keys[3 * i : 3 * i + 3]) & mask).astype(jnp.int32) for i in (0, 1)
    )


def tags(keys, hi, lo):
    """The tag (uint32) of each id: the third keyed hash of `keys` (words 6-8)."""
    return hash_keyed(hi, lo, keys[6:9])


def owns(row_info, row, hi, lo):
    """Whether row `row` (any int32; out of `[0, capacity)`: False) holds the id (hi, lo)."""
    c = row_info.shape[0]
    info = row_info[jnp.clip(row, 0, c - 1)]
    words = lax.bitcast_convert_type(info[..., :2], jnp.uint32)
    return (row >= 0) & (row < c) & (words[..., ID_HI] == hi) & (words[..., ID_LO] == lo)


def find(index, row_info, keys, hi, lo):
    """(found, row, flat slot) of 1-D id words: one gather of both buckets, the row of
    the live slot with the id's tag in each (at most one a bucket), and one gather of
    both rows' ids from `row_info` (a tag is 32 bits of a hash: another id may share
    it), the first bucket's first."""
    w = BUCKET_WIDTH
    n = hi.shape[0]
    b1, b2 = buckets(index.shape[0], keys, hi, lo)
    tag = tags(keys, hi, lo)
    b = jnp.concatenate([b1, b2])
    t = index[b]  # [2n, 2, W]
    match = (t[:, ROW] != EMPTY) & (t[:, TAG] == jnp.tile(tag, 2)[:, None])
    j = jnp.argmax(match, axis=1).astype(jnp.int32)
    word = jnp.take_along_axis(t[:, ROW], j[:, None], axis=1)[:, 0]
    row = lax.bitcast_convert_type(word, jnp.int32)
    ok = match.any(axis=1) & owns(row_info, row, jnp.tile(hi, 2), jnp.tile(lo, 2))
    slot = b * w + j
    ok1, ok2 = ok[:n], ok[n:]
    found = ok1 | ok2
    row = jnp.where(ok1, row[:n], jnp.where(ok2, row[n:], -1))
    slot = jnp.where(ok1, slot[:n], jnp.where(ok2, slot[n:], -1))
    return found, row, slot
