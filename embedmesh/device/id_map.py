"""A device-side map from raw 64-bit ids to the rows of a fixed-capacity table (issue 42).

The building block of dynamic vocabularies: the owner shard of a table keeps one
`IdMapState` next to its rows and calls `map_ids` inside its device program on the raw ids
it received; every live raw id has its own row (no two live ids ever share one), misses
are admitted into free rows or into rows evicted by the policy. Pure and functional (state
in, state out), fixed shapes, compiled once per batch shape, no host work; plain
`jax.numpy`/`lax` (the "jnp path"), so it runs unchanged on CPU, GPU and TPU, plus, where
the CPU kernels are in use, a native hit path (below).

Raw ids
-------
JAX runs with 64-bit types off by default, so a raw id travels as two 32-bit halves: an
array of shape `[..., 2]` and dtype `uint32` (or `int32`, read bit for bit), `[..., 0]` the
high word and `[..., 1]` the low word of the id's two's-complement 64 bits.
`split_ids(int64 array) -> uint32 [..., 2]` and `join_ids` convert on the host (numpy)
or, with `jax_enable_x64` on, on the device. Where x64 is on, `map_ids`, `lookup` and
`owner_of` also take `int64`/`uint64` arrays of ids directly (the dtype says which form it
is: 32-bit dtypes are pairs, 64-bit dtypes are ids). Every 64-bit value is an id, negative
ones and the extremes included: no value is reserved as a marker.

Routing: `owner_of(ids, num_shards, seed)` is the shard that owns each id: a keyed hash of
both halves (each half through a seeded 32-bit finaliser, then combined and finalised
again), reduced modulo the shard count; not `id % N`, so strided ids, ids sharing their
low or high word, and ids all equal modulo N or modulo the capacity spread evenly. Ids that
differ in one half only never collide in the 32-bit hash. It is not a cryptographic hash:
someone who knows the function and the seed can still choose colliding ids (that costs
balance or, in the table, refusals, never a shared row).

The algorithm
-------------
- Index: an open-addressing hash table of `num_buckets` buckets of `BUCKET_WIDTH` (8)
  slots, at least `4 * capacity` slots in all (load factor <= 0.25). A slot holds a tag
  (a third keyed hash of the id, 32 bits) and the id's row; a bucket's 8 tags and 8 row
  words are one 64-byte line. An id lives in one of its two buckets (two independent keyed
  hashes; a new id goes to the emptier one, the first on a tie). A lookup reads both
  buckets (one vectorized round, no probing loop): in each, the live slot with the id's
  tag, whose row is the id's when that row's raw id (`row_info`) is the id's; another id
  may share the tag, never a bucket's live slot of it: a new id does not go into a bucket
  holding a live slot of its tag (the other then, or none), nor two new ids of one tag
  into one bucket in one call (the later gets none there). A deletion empties its slot (no
  tombstones: a lookup reads the whole buckets anyway). A new id with no such bucket with
  room is refused (rows -1, counted in `stats["refused"]`; sighted again, it is admitted
  at a later call that has room); at load <= 0.25 with two choices a full bucket is
  vanishingly rare, a bucket with a live slot of the new id's tag (the other bucket is
  taken then) about 2^-28 an admission, both about 2^-58, and none of it ever gives a
  shared row. Measured (2026-12-06, CPU): 2^19 rows (2^18 buckets), 300 calls of 8192
  new random ids (4.7 turnovers of the table, LRU): the fullest bucket held 6 of 8 (at
  the end 325 buckets held 5, 12,888 held 4, 68,520 held 3), no refusal.
  The layout is the hit's cost: a hit reads one line of the index and one 16-byte
  record of its row (2 cache lines; the layout before, a slot's id words and row apart in
  buckets of 16 and the row's last-used step and use count in arrays of their own, read
  5): the train benchmark's map program of 8 tables (dim 16, traced) 4.3-4.9 ms a step
  against 5.6-6.1. The jnp path gathers both buckets' 16 words and both rows' ids (on
  the TPU chip, where a gather costs by its rows, a call of 14,700 ids 6.1 ms against
  5.8 for the 48 words of the layout before: `benchmarks/id_map_chip.py`).
- Rows: `capacity` rows. Free rows are taken lowest-numbered first. A row's raw id, its
  last-used step and its use count (occurrences, saturating at 2^31 - 1) are kept per row,
  in one record (`row_info`).
- Admission (`admit_after` > 1): an unknown id is admitted at its `admit_after`-th
  sighting; a sighting is a call in which the id occurs (once per call however many times
  it occurs). Sightings of not-yet-admitted ids are counted in a count-min sketch
  (`sketch_depth` rows of `sketch_width` int32 counters, one keyed hash a row, conservative
  update: each of the id's counters is raised to at most its estimate + 1, with the
  estimates read before the call). The estimate is the minimum of the id's counters, so it
  never under-counts between two halvings: no id is admitted late because of the sketch.
  It can over-count (false admission): an id whose every counter was raised by other ids
  to at least `admit_after - 1` is admitted at an earlier sighting; the chance for a new
  id is about `f ** sketch_depth`, `f` the fraction of counters at or above
  `admit_after - 1`. Aging: once `sketch_halve_every` sightings have been recorded, every
  counter is halved (rounding down): old sightings count half, so an id must be seen
  about `admit_after` times within a halving period. A pending id's rows are -1: the caller
  reads a zero row for it and gives it no update. The sketch counts the sightings of
  admitted ids too, so an evicted id seen again is admitted again at once until halvings
  wear its counters down.
- Eviction, in batches: when a call has more ids to admit than free rows, one sweep
  evicts `max(evict_batch, needed - free)` rows (fewer if fewer are evictable) in the
  policy's order and puts them on the free list; the next calls take free rows until they
  run out again. Evictable: a live row whose last-used step is not this call's `step` (so
  no row used in this call, or in an earlier call at the same step, is evicted). Order
  (total, so deterministic): LRU by (last-used step, row) ascending; LFU by (use count,
  last-used step, row) ascending. `evict_batch=1` is exact LRU/LFU, one eviction per
  admission; a larger batch frees rows ahead of need (the least valuable ones) and spreads
  the sweep's cost. Steps must not decrease from call to call for LRU to mean "least
  recently used".
- A call (`map_ids`): the valid ids are deduplicated (duplicates map to one row and count
  as one sighting, their occurrences add to the use count); hits refresh their row's
  last-used step and count; misses are sighted (sketch), and those due for admission
  ("candidates") take free rows in the order of their first position in the batch, after
  a sweep if there are too few. Candidates beyond the free rows a sweep could make (every
  live row used at this step) are refused: rows -1, `stats["refused"]`, never dropped
  silently; they are sighted again (and admitted) at a later call that has room.
- `fresh`: True where the row was given to its id in this call (a new id, or an evicted
  row reused): the caller re-initialises that row and resets its optimizer slots before
  reading it, at every position the id occurs.

Cost per call, batch `n` (slots of ids; `c` the capacity): two sorts of `n` entries (the
dedup, four operands, skipped where the caller says the ids are distinct,
`map_ids(distinct=True)`; the new ids by bucket, one operand where `(num_buckets + 1) * n`
fits 32 bits: XLA's CPU sort of several operands costs several times one's), the
admission order by a count, two gathers of 2 buckets
(`2 * 2 * 8` words) and of 2 rows' ids per distinct id (the lookup, and the new ids'
buckets after a sweep),
and scatters of O(n) words into the index, the row arrays and the sketch (`sketch_depth`
counters an id). Nothing of size `c` is read or written, except:
a sweep, a sort of `c` keys and a rebuild of the free list, O(c log c), only in a call
that runs out of free rows, which frees at least `evict_batch` rows (amortised
O(c log c / evict_batch) an admission; default `evict_batch` = c / 64); and a halving of
the sketch, O(sketch_depth * sketch_width), once every `sketch_halve_every` sightings.
Both are `lax.cond` branches: skipped, not computed and discarded (under `vmap` a
`lax.cond` runs both branches: call `map_ids` per shard inside `shard_map`, not under
`vmap`). With the state donated, XLA updates it in place: the compiled program copies no
array of the capacity's size (tests/device/test_id_map.py reads the compiled HLO for copies).

The native path (CPU): where the CPU kernels are in use (`ops.id_map_step_native()`;
not on GPU or TPU), `map_ids` is one op, `ops.id_map_step` (cpu/id_map.cc), whose
reference is the jnp path: the whole call in C++ (both buckets of each id probed with
prefetch on every CPU, the hits touched there; a hash of the call's ids where they may
repeat; the sketch, a sweep by a partial selection instead of a sort, the admissions),
the state's arrays aliased to its results and updated in place, bit for bit the jnp
path's state, rows, fresh flags and stats on a consistent state
(tests/device/test_id_map_native.py). An engine passes each shard's block of its map as
it is (`[1, ...]` arrays inside `shard_map`: a squeeze before an aliased operand made
XLA copy every state array before the op). In a training step the index is cold in the
cache (the tables' rows stream through it between two calls): each probe misses the
cache and, on 4 KiB pages, the TLB too; `on_huge_pages` puts the state's big arrays on
transparent huge pages where the engine makes them (`EmbeddingCore.init`).

Memory: the index 8 bytes a slot (at least 32 bytes a row), the row arrays 24 bytes a
row (`row_info` 16, `row_slot` and `free` 4 each), the sketch `4 * sketch_depth *
sketch_width` bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from embedmesh.config import DynamicIds
from embedmesh.device import ops
from embedmesh.device.ops import id_hash

__all__ = [
    "BUCKET_WIDTH",
    "IdMapConfig",
    "IdMapState",
    "init",
    "join_ids",
    "live_ids",
    "lookup",
    "map_ids",
    "on_huge_pages",
    "owner_of",
    "sketch_columns",
    "sort_mapped",
    "sort_mapped_many",
    "split_ids",
]

BUCKET_WIDTH = id_hash.BUCKET_WIDTH  # 8 slots a bucket (one line): one lookup reads 2
EMPTY = id_hash.EMPTY  # the row word of an empty slot
_INT32_MAX = np.iinfo(np.int32).max
_TAG, _ROW = id_hash.TAG, id_hash.ROW  # the words of a slot: [tag, row]
ROW_WORD = _ROW  # (public: readers of a state's live rows)
# the words of a row's `row_info`: its id's two words, its last-used step, its use count
ID_HI, ID_LO, LAST_USED, USE_COUNT = (
    id_hash.ID_HI,
    id_hash.ID_LO,
    id_hash.LAST_USED,
    id_hash.USE_COUNT,
)

# salts of the keyed hashes, one a purpose (fixed: part of the checkpointed layout)
_SALT_OWNER = 0x6A09E667
_SALT_BUCKET = (0xBB67AE85, 0x3C6EF372)
_SALT_TAG = 0x510E527F
_SALT_SKETCH = 0xA54FF53A


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class IdMapConfig(DynamicIds):
    """One shard's id map: a table's `DynamicIds` (the one declared configuration, its
    fields and checks) with the shard's rows, `capacity`, and the defaults resolved
    (immutable, hashable, validated; a `ValueError` names the bad field).

    Args (beside `DynamicIds`' own, by name):
      capacity: rows of the table (ids live at once).
      eviction: `"lru"` or `"lfu"` (module docstring: the order, ties included).
      evict_batch: rows one sweep evicts at least (None: `max(1, capacity // 64)`).
      sketch_width: counters in each row of the admission sketch, a power of two (None:
        the power of two at or above `capacity`, at least 64). Unused when
        `admit_after == 1`.
      sketch_halve_every: sightings after which every counter is halved (None:
        `8 * sketch_width`).
    """

    capacity: int = dataclasses.field(kw_only=True)

    def __post_init__(self):
        c = self.capacity
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise ValueError(f"IdMapConfig.capacity must be an int, got {c!r}")
        if not 1 <= c <= _INT32_MAX // 2:
            raise ValueError(f"IdMapConfig.capacity must be in [1, {_INT32_MAX // 2}], got {c}")
        super().__post_init__()

        def given(name, default):
            v = getattr(self, name)
            return default if v is None else v

        width = given("sketch_width", max(64, _pow2_at_least(c)))
        resolved = {
            "evict_batch": given("evict_batch", max(1, c // 64)),
            "sketch_width": width,
            "sketch_halve_every": given("sketch_halve_every", 8 * width),
        }
        for f in dataclasses.fields(self):  # plain ints (numpy's hash and print apart)
            v = resolved.get(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, v if isinstance(v, str) else int(v))

    @classmethod
    def of(cls, ids: DynamicIds, capacity: int) -> IdMapConfig:
        """The map of a shard of `capacity` rows of a table declared with `ids`."""
        return cls(capacity=capacity, **dataclasses.asdict(ids))

    @property
    def num_buckets(self) -> int:
        """Buckets of the index: a power of two, `>= 4 * capacity / BUCKET_WIDTH`."""
        return _pow2_at_least(-(-4 * self.capacity // BUCKET_WIDTH))

    @property
    def num_slots(self) -> int:
        return self.num_buckets * BUCKET_WIDTH


@dataclasses.dataclass(frozen=True)
class IdMapState:
    """An id map's state: a pytree of fixed-size arrays (the config is its static part).

    - `index` uint32 `[num_buckets, 2, BUCKET_WIDTH]`: each slot's tag (a keyed hash of
      its id) and row (`EMPTY` = 0xFFFFFFFF: an empty slot, whose tag means nothing); no
      two live slots of a bucket have one tag;
    - `row_info` int32 `[capacity, 4]`: each row's raw id (high word, low word, bit for
      bit; meaningful for live rows only), last-used step and use count (occurrences):
      the words a hit reads and writes, in one 16-byte record (properties `row_id`,
      `last_used`, `use_count` read them apart);
    - `row_slot` int32 `[capacity]`: the row's slot in the index (`bucket * 8 + i`), -1
      for a row never used; a row is live iff its slot's row word names it (an evicted
      row keeps its old slot number: a sweep writes no row array, so XLA updates the
      state in place, no copy of it);
    - `free` int32 `[capacity]`: `free[free_head : free_head + num_free]` are the free
      rows, ascending;
    - `free_head`, `num_free`: int32 scalars;
    - `sketch` int32 `[sketch_depth, sketch_width]` (`[1, 1]` when `admit_after == 1`)
      and `sightings` int32: sightings recorded since the last halving.
    """

    config: IdMapConfig
    index: jax.Array
    row_info: jax.Array
    row_slot: jax.Array
    free: jax.Array
    free_head: jax.Array
    num_free: jax.Array
    sketch: jax.Array
    sightings: jax.Array

    @property
    def row_id(self) -> jax.Array:
        """uint32 `[..., capacity, 2]`: each row's raw id (high word, low word)."""
        return lax.bitcast_convert_type(self.row_info[..., :2], jnp.uint32)

    @property
    def last_used(self) -> jax.Array:
        """int32 `[..., capacity]`: each row's last-used step."""
        return self.row_info[..., LAST_USED]

    @property
    def use_count(self) -> jax.Array:
        """int32 `[..., capacity]`: each row's use count."""
        return self.row_info[..., USE_COUNT]


jax.tree_util.register_dataclass(
    IdMapState,
    data_fields=[f.name for f in dataclasses.fields(IdMapState) if f.name != "config"],
    meta_fields=["config"],
)


def init(config: IdMapConfig) -> IdMapState:
    """An empty map: every row free, every slot empty, the sketch at zero."""
    c = config.capacity
    index = jnp.zeros((config.num_buckets, 2, BUCKET_WIDTH), jnp.uint32)
    index = index.at[:, _ROW, :].set(EMPTY)
    sketch_shape = (config.sketch_depth, config.sketch_width) if config.admit_after > 1 else (1, 1)
    return IdMapState(
        config=config,
        index=index,
        row_info=jnp.zeros((c, 4), jnp.int32).at[:, LAST_USED].set(-1),
        row_slot=jnp.full((c,), -1, jnp.int32),
        free=jnp.arange(c, dtype=jnp.int32),
        free_head=jnp.int32(0),
        num_free=jnp.int32(c),
        sketch=jnp.zeros(sketch_shape, jnp.int32),
        sightings=jnp.int32(0),
    )


HUGE_PAGE_MIN_BYTES = 1 << 20  # a state array's shard at least this big: huge pages


def on_huge_pages(array: jax.Array) -> jax.Array:
    """`array` (a global array of a map's state, one shard a device) with each shard of
    at least `HUGE_PAGE_MIN_BYTES` copied into a buffer on transparent huge pages
    (`ops.huge_page_copy`; CPU only, elsewhere as is). The map reads its index and row
    arrays at random: with 4 KiB pages nearly every probe also misses the TLB (measured
    on a step of hits with a cold cache, capacity 1M: the hit path 16% faster).
    A donated map program updates them in place, so they stay there."""
    shards = array.addressable_shards
    if not shards or shards[0].data.nbytes < HUGE_PAGE_MIN_BYTES:
        return array
    datas = [ops.huge_page_copy(s.data) for s in shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, datas)


def sort_mapped(rows, pair_rows, pair_unique, pair_gains, *, num_rows: int) -> tuple:
    """A mapped batch's block(s) in the order the host gives a table of rows: `(rows,
    pair_rows, pair_unique, pair_gains)` with each block's slots (`rows` [..., U], the
    map's rows of the batch's distinct raw ids, in the batch's order) by row, ascending and
    stable (`PAD_ID`, an id pending or refused, last), and its valid pairs (`pair_rows` in
    [0, num_rows), `pair_unique` in [0, U); [..., P]) grouped by their slot's new
    position, in pair order within a slot (so every row's gradient and every sample's
    activation sums in the same order as for a static table given these rows), the other
    pairs after them as they were. The engine's map program sorts so on the platforms
    other than CPU; the CPU's fused backward + update takes distinct rows in any order
    (the map program leaves the blocks as they are there). `sort_mapped_many` of one
    stack: where the CPU kernels are in use cpu/sort_mapped.cc's `SortMappedMany` (a radix
    sort of the rows, a counting sort of the pairs); elsewhere its reference,
    `_sort_mapped_reference`."""
    (out,) = sort_mapped_many([(rows, pair_rows, pair_unique, pair_gains)], [num_rows])
    return out


def sort_mapped_many(blocks: list, num_rows: list) -> list:
    """`sort_mapped` of several stacks' `(rows, pair_rows, pair_unique, pair_gains)`
    (each with its `num_rows`), in one call where the CPU kernels are in use (the
    stacks' blocks shared out over the threads), a list of the four each."""
    blocks = [
        (
            jnp.asarray(r, jnp.int32),
            jnp.asarray(q, jnp.int32),
            jnp.asarray(u, jnp.int32),
            jnp.asarray(g, jnp.float32),
        )
        for r, q, u, g in blocks
    ]
    if not blocks:
        return []

    def ref(*flat):
        return [
            x
            for i, n in enumerate(num_rows)
            for x in _sort_mapped_reference(*flat[4 * i : 4 * i + 4], num_rows=n)
        ]

    def kernel(*flat):
        outs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat)
        rs = jnp.asarray(np.asarray(num_rows, np.int32))
        return list(jax.ffi.ffi_call("embedmesh_sort_mapped_many", outs)(rs, *flat))

    flat = [x for b in blocks for x in b]
    out = ref(*flat) if not ops.id_map_step_native() else None
    if out is None:
        out = lax.platform_dependent(*flat, cpu=kernel, default=ref)
    return [tuple(out[4 * i : 4 * i + 4]) for i in range(len(blocks))]


def _sort_mapped_reference(rows, pair_rows, pair_unique, pair_gains, *, num_rows: int) -> tuple:
    """`sort_mapped` by stable argsorts (any platform)."""
    u = rows.shape[-1]
    perm = jnp.argsort(rows, axis=-1, stable=True)
    at = jnp.argsort(perm, axis=-1).astype(jnp.int32)  # a slot's new position
    valid = (pair_rows >= 0) & (pair_rows < num_rows) & (pair_unique >= 0) & (pair_unique < u)
    moved = jnp.take_along_axis(at, jnp.clip(pair_unique, 0, u - 1), axis=-1)
    slot = jnp.where(valid, moved, pair_unique)
    order = jnp.argsort(jnp.where(valid, slot, u), axis=-1, stable=True)

    def take(x):
        return jnp.take_along_axis(x, order, axis=-1)

    return (
        jnp.take_along_axis(rows, perm, axis=-1),
        take(pair_rows),
        take(slot),
        take(pair_gains),
    )


# ---------------------------------------------------------------------------- raw ids


def split_ids(ids) -> Any:
    """64-bit ids -> uint32 `[..., 2]` (high word, low word). numpy in, numpy out (any
    integer dtype, negative ids as their two's complement); a jax array needs x64 on."""
    if isinstance(ids, jax.Array):
        if ids.dtype.itemsize != 8:
            raise ValueError(f"split_ids takes 64-bit ids (x64 on), got {ids.dtype}")
        u = lax.bitcast_convert_type(ids, jnp.uint64) if ids.dtype == jnp.int64 else ids
        return jnp.stack([(u >> 32).astype(jnp.uint32), u.astype(jnp.uint32)], axis=-1)
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise ValueError(f"split_ids takes integer ids, got {a.dtype}")
    u = a.astype(np.int64).view(np.uint64) if a.dtype.kind == "i" else a.astype(np.uint64)
    return np.stack([(u >> np.uint64(32)).astype(np.uint32), u.astype(np.uint32)], axis=-1)


def join_ids(pairs) -> np.ndarray:
    """uint32 `[..., 2]` pairs -> int64 ids (host, numpy)."""
    p = np.asarray(pairs)
    p = (p.view(np.uint32) if p.dtype == np.int32 else p.astype(np.uint32)).astype(np.uint64)
    return ((p[..., 0] << np.uint64(32)) | p[..., 1]).view(np.int64)


def _pairs(raw_ids) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) uint32 arrays of the ids' shape, from pairs or (x64) 64-bit ids."""
    p = _words(raw_ids)
    return p[..., 0], p[..., 1]


def _words(raw_ids) -> jax.Array:
    """uint32 `[..., 2]` (hi, lo) pairs of the ids, from pairs or (x64) 64-bit ids."""
    raw_ids = jnp.asarray(raw_ids)
    if raw_ids.dtype.itemsize == 8:
        p = split_ids(raw_ids)
    elif raw_ids.dtype in (jnp.uint32, jnp.int32):
        if raw_ids.ndim == 0 or raw_ids.shape[-1] != 2:
            raise ValueError(f"32-bit raw ids are pairs [..., 2], got shape {raw_ids.shape}")
        p = lax.bitcast_convert_type(raw_ids, jnp.uint32)
    else:
        raise ValueError(f"raw ids are uint32/int32 pairs or 64-bit ids, got {raw_ids.dtype}")
    return p


# ----------------------------------------------------------------------------- hashing


_hash_words = id_hash.hash_words
_hash_keyed = id_hash.hash_keyed


def _hash(hi, lo, seed: int, salt: int):
    """A keyed 32-bit hash of (hi, lo): each half through its own seeded finaliser (a
    bijection of the half), combined, finalised again."""
    return _hash_keyed(hi, lo, _hash_words(seed, salt))


def owner_of(raw_ids, num_shards: int, seed: int = 0) -> jax.Array:
    """The shard (int32 in `[0, num_shards)`) that owns each raw id: a keyed hash of the
    id modulo `num_shards` (module docstring). `raw_ids`: uint32/int32 pairs `[..., 2]`,
    or 64-bit ids with x64 on; result of the ids' shape. Jit-able, any platform."""
    if not 1 <= int(num_shards) <= _INT32_MAX:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    hi, lo = _pairs(raw_ids)
    return (_hash(hi, lo, int(seed), _SALT_OWNER) % jnp.uint32(num_shards)).astype(jnp.int32)


def bucket_keys(config: IdMapConfig) -> tuple[int, ...]:
    """The seed words of the two bucket hashes and of the tag (3 each): what the CPU
    kernel (`ops.id_map_step`) hashes with."""
    salts = _SALT_BUCKET + (_SALT_TAG,)
    return tuple(w for salt in salts for w in _hash_words(config.seed, salt))


_buckets_keyed = id_hash.buckets


def buckets(config: IdMapConfig, hi, lo):
    """The two buckets (int32) of each id given as its words `hi`, `lo` (what a rebuild of
    the map, `embedmesh.checkpoint.id_maps`, inserts by)."""
    return _buckets_keyed(config.num_buckets, bucket_keys(config), hi, lo)


def tags(config: IdMapConfig, hi, lo):
    """Each id's tag (uint32) in the index, given as its words `hi`, `lo`."""
    return id_hash.tags(bucket_keys(config), hi, lo)


def sketch_columns(config: IdMapConfig, raw_ids) -> jax.Array:
    """int32 `[sketch_depth, ...]`: each id's counter in each row of the admission sketch
    (what a reference model needs to count as the sketch does)."""
    hi, lo = _pairs(raw_ids)
    mask = jnp.uint32(config.sketch_width - 1)
    return jnp.stack(
        [
            (_hash(hi, lo, config.seed, _SALT_SKETCH + 0x1000193 * d) & mask).astype(jnp.int32)
            for d in range(config.sketch_depth)
        ]
    )


# ------------------------------------------------------------------------------ lookup


def _find(state: IdMapState, hi, lo):
    """(found, row, flat slot) for 1-D id words; one gather of both buckets."""
    return _find_keyed(state.index, state.row_info, bucket_keys(state.config), hi, lo)


_find_keyed = id_hash.find


def lookup(state: IdMapState, raw_ids, valid_mask=None) -> jax.Array:
    """Read-only: each id's row, -1 for an unknown id or an invalid position (serving: a
    zero row). No state changes, no sketch sighting. Cost: one gather of 2 buckets an id."""
    hi, lo = _pairs(raw_ids)
    shape = hi.shape
    found, row, _ = _find(state, hi.reshape(-1), lo.reshape(-1))
    if valid_mask is not None:
        found = found & jnp.asarray(valid_mask, bool).reshape(-1)
    return jnp.where(found, row, -1).reshape(shape)


def _live(config: IdMapConfig, index, row_slot):
    """bool `[capacity]`: the live rows (their slot's row word names them)."""
    s = jnp.clip(row_slot, 0, config.num_slots - 1)
    word = index[s // BUCKET_WIDTH, _ROW, s % BUCKET_WIDTH]
    rows = jnp.arange(config.capacity, dtype=jnp.uint32)
    return (row_slot >= 0) & (word == rows)


def live_ids(state: IdMapState) -> dict[int, int]:
    """{raw id (int64): row} of the live rows, on the host (tests, debugging; O(capacity))."""
    rows = np.flatnonzero(np.asarray(_live(state.config, state.index, state.row_slot)))
    ids = join_ids(np.asarray(state.row_id)[rows])
    return {int(i): int(r) for i, r in zip(ids, rows)}


# ----------------------------------------------------------------------------- map_ids


def _first_position_order(u_first, u_valid):
    """The u in the order of their first positions (the valid ones, whose first positions
    are distinct, in [0, n)), then the others by index: the permutation a stable sort of
    `where(u_valid, u_first, n)` gives, by scatters and a count instead of XLA's
    two-operand sort (several times a one-operand sort's cost on CPU)."""
    n = u_first.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    at = jnp.where(u_valid, u_first, n)
    held = jnp.zeros((n,), jnp.int32).at[at].set(1, mode="drop")  # a valid u starts here
    before = jnp.cumsum(held, dtype=jnp.int32) - held  # valid u starting earlier
    others = jnp.cumsum(~u_valid, dtype=jnp.int32) - 1
    num_valid = u_valid.sum(dtype=jnp.int32)
    rank = jnp.where(u_valid, before[jnp.minimum(at, n - 1)], num_valid + others)
    return jnp.zeros((n,), jnp.int32).at[rank].set(pos)


def _sweep(config: IdMapConfig, step, needed, row_slot, last_used, use_count, carried):
    """Evict `max(evict_batch, needed - num_free)` rows (at most the evictable ones) in the
    policy's order, empty their slots, rebuild the free list. O(capacity log capacity).
    Writes the index and the free list only (the rows' arrays are read): with a branch
    that reads an array and writes it too, XLA copies the state around the `lax.cond`."""
    index, free, free_head, num_free = carried
    c = config.capacity
    live = _live(config, index, row_slot)
    evictable = live & (last_used != step)
    n_ev = jnp.minimum(
        jnp.maximum(config.evict_batch, needed - num_free), evictable.sum(dtype=jnp.int32)
    )
    rows = jnp.arange(c, dtype=jnp.int32)
    excluded = (~evictable).astype(jnp.int32)
    if config.eviction == "lru":
        order = lax.sort((excluded, last_used, rows), num_keys=3)[-1]
    else:
        order = lax.sort((excluded, use_count, last_used, rows), num_keys=4)[-1]
    victim = rows < n_ev
    slot = jnp.where(victim, row_slot[order], config.num_slots)  # out of range: dropped
    is_victim = jnp.zeros((c,), bool).at[jnp.where(victim, order, c)].set(True, mode="drop")
    index = index.at[slot // BUCKET_WIDTH, _ROW, slot % BUCKET_WIDTH].set(EMPTY, mode="drop")
    is_free = ~live | is_victim
    free = jnp.nonzero(is_free, size=c, fill_value=0)[0].astype(jnp.int32)
    return (index, free, jnp.int32(0), is_free.sum(dtype=jnp.int32)), n_ev


def _sketch_sight(config: IdMapConfig, sketch, sightings, hi, lo, sighted):
    """Record one sighting of each `sighted` id (conservative update from the estimates
    before the call); returns (sketch, sightings, estimate after this sighting)."""
    cols = sketch_columns(config, jnp.stack([hi, lo], axis=-1))  # [depth, n]
    depth = config.sketch_depth
    est = sketch[jnp.arange(depth)[:, None], cols].min(axis=0) + 1
    est = jnp.minimum(est, _INT32_MAX)  # (est was at most the max already)
    target = jnp.where(sighted[None, :], est[None, :], 0)
    sketch = sketch.at[jnp.arange(depth)[:, None], cols].max(target)
    sightings = sightings + sighted.sum(dtype=jnp.int32)
    halve = sightings >= config.sketch_halve_every
    sketch, sightings = lax.cond(
        halve,
        lambda s, k: (s >> 1, jnp.int32(0)),
        lambda s, k: (s, k),
        sketch,
        sightings,
    )
    return sketch, sightings, est


def _distinct_by_sort(hi, lo, valid, pos):
    """The valid ids' distinct values (step 1 of `map_ids`): sorted by (invalid, hi, lo,
    position); `u` = a distinct id at its group's index in [0, n) (entries of `u` past
    the distinct count are unused). Returns (u_hi, u_lo, u_first, u_valid, u_occ,
    inverse, order): each u's first position, validity, occurrences, each position's u,
    and the u in the order of their first position (the admission order)."""
    n = hi.shape[0]
    inv_key = (~valid).astype(jnp.uint32)
    s_inv, s_hi, s_lo, s_pos = lax.sort((inv_key, hi, lo, pos), num_keys=4)
    lead = jnp.ones((n,), bool)
    if n > 1:
        same = (s_inv[1:] == s_inv[:-1]) & (s_hi[1:] == s_hi[:-1]) & (s_lo[1:] == s_lo[:-1])
        lead = lead.at[1:].set(~same)
    seg = jnp.cumsum(lead, dtype=jnp.int32) - 1
    at_lead = jnp.where(lead, seg, n)
    u_hi = jnp.zeros((n,), jnp.uint32).at[at_lead].set(s_hi, mode="drop")
    u_lo = jnp.zeros((n,), jnp.uint32).at[at_lead].set(s_lo, mode="drop")
    u_first = jnp.full((n,), n, jnp.int32).at[at_lead].set(s_pos, mode="drop")
    u_valid = jnp.zeros((n,), bool).at[at_lead].set(s_inv == 0, mode="drop")
    u_occ = jnp.zeros((n,), jnp.int32).at[seg].add((s_inv == 0).astype(jnp.int32))
    inverse = jnp.zeros((n,), jnp.int32).at[s_pos].set(seg)
    order = _first_position_order(u_first, u_valid)
    return u_hi, u_lo, u_first, u_valid, u_occ, inverse, order


def _distinct_as_given(hi, lo, valid, pos):
    """`_distinct_by_sort` for valid ids known to be distinct: each position its own u,
    in place; the admission order (the valid positions, then the others) by a count, not
    a sort."""
    n = hi.shape[0]
    ones = valid.astype(jnp.int32)
    num_valid = ones.sum(dtype=jnp.int32)
    rank = jnp.where(valid, jnp.cumsum(ones) - 1, num_valid + jnp.cumsum(1 - ones) - 1)
    order = jnp.zeros((n,), jnp.int32).at[rank].set(pos)
    return hi, lo, jnp.where(valid, pos, n), valid, ones, pos, order


def map_ids(state: IdMapState, raw_ids, valid_mask, step, *, distinct: bool = False):
    """Map raw ids to rows, admitting and evicting as the config says (module docstring:
    the algorithm, its order and its cost).

    Args:
      state: the map (`init`), or one shard's block of an engine's map (each array with
        a leading dimension of 1, as `shard_map` gives it: the native op updates it as
        it is, where a squeeze before the op would cost XLA a copy of every array).
      raw_ids: uint32/int32 pairs `[..., 2]` (or, x64 on, int64/uint64 ids `[...]`).
      valid_mask: bool of the ids' shape; invalid positions are ignored (row -1).
      step: int32 scalar, the training step; must not decrease between calls.
      distinct: the caller guarantees that no valid id occurs twice (a host's distinct
        ids): the deduplication's and the admission order's sorts are skipped, the same
        result (an id given twice then is not deduplicated: two rows, a collision).

    Returns:
      `(state, rows, fresh, stats)`: `rows` int32 of the ids' shape, each id's row, -1
      where invalid, pending (fewer than `admit_after` sightings) or refused; `fresh` bool,
      True where the row was given to the id in this call (re-initialise it, reset its
      optimizer slots); `stats` int32 scalars over the distinct valid ids of the call:
      `hits`, `admissions`, `evictions` (rows freed by a sweep in this call), `pending`,
      `refused` (no row: every live row used at this step, or both hash buckets full
      or holding a live slot of the id's tag, or an earlier id of the call took its
      bucket's tag),
      `occupancy` (live rows after the call).
    """
    if state.index.ndim == 4 and not native_step():  # one shard's block: squeezed
        one = jax.tree_util.tree_map(lambda x: x[0], state)
        one, rows, fresh, stats = map_ids(one, raw_ids, valid_mask, step, distinct=distinct)
        return jax.tree_util.tree_map(lambda x: x[None], one), rows, fresh, stats
    words = _words(raw_ids)
    shape = words.shape[:-1]
    words = words.reshape(-1, 2)
    valid = jnp.broadcast_to(jnp.asarray(valid_mask, bool), shape).reshape(-1)
    step = jnp.asarray(step, jnp.int32)
    if native_step():  # (the op takes the pairs: split by XLA they cost a thunk a word)
        return _map_ids_native(state, words, valid, step, distinct, shape)
    return _map_ids(state, words[:, 0], words[:, 1], valid, step, distinct, shape)


STAT_NAMES = ("hits", "admissions", "evictions", "pending", "refused", "occupancy")
_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(IdMapState) if f.name != "config")


def blocks_as_mapped() -> bool:
    """Whether the engine's map program leaves each mapped block as the maps gave it
    (rows in the batch's order, the pairs as they came): where the CPU kernels run the
    maps (`native_step`), whose fused update takes a block's distinct rows in any order
    (`update_forms.h`'s `GroupPairs`); elsewhere `sort_mapped_many` orders them as the
    host orders a table of rows."""
    return native_step()


def native_step() -> bool:
    """Whether `map_ids` runs each call as one native op (`ops.id_map_step`: the CPU
    kernels are in use in this process), the jnp path being its reference."""
    return ops.id_map_step_native()


def sketch_keys(config: IdMapConfig) -> tuple[int, ...]:
    """The seed words of the sketch rows' hashes (3 a row; none when `admit_after` is 1)."""
    if config.admit_after == 1:
        return ()
    return tuple(
        w
        for d in range(config.sketch_depth)
        for w in _hash_words(config.seed, _SALT_SKETCH + 0x1000193 * d)
    )


def _map_ids_native(state: IdMapState, words, valid, step, distinct: bool, shape):
    """`map_ids` as the op `ops.id_map_step` (its CPU kernel: the whole call, the state
    updated in place), whose reference is `_map_ids` on the same arguments (`words`
    [n, 2] split into hi, lo)."""
    config = state.config
    n = words.shape[0]

    blocked = state.index.ndim == 4

    def jnp_path(*args):
        arrays = [x[0] for x in args[:8]] if blocked else args[:8]
        st = IdMapState(config, *arrays)
        w, v, at = args[8:]
        st, rows, fresh, stats = _map_ids(st, w[:, 0], w[:, 1], v, at, distinct, (n,))
        stats = jnp.stack([stats[k] for k in STAT_NAMES])
        arrays = [getattr(st, f) for f in _STATE_FIELDS]
        return (*(x[None] if blocked else x for x in arrays), rows, fresh, stats)

    out = ops.id_map_step(
        tuple(getattr(state, f) for f in _STATE_FIELDS),
        words,
        valid,
        step,
        keys=bucket_keys(config) + sketch_keys(config),
        lfu=config.eviction == "lfu",
        admit_after=config.admit_after,
        evict_batch=config.evict_batch,
        halve_every=config.sketch_halve_every,
        distinct=distinct,
        fallback=jnp_path,
    )
    new_state = IdMapState(config, *out[:8])
    rows, fresh, stats = out[8:]
    stats = {k: stats[i] for i, k in enumerate(STAT_NAMES)}
    return new_state, rows.reshape(shape), fresh.reshape(shape), stats


def _touch(row_info, at, occ, step):
    """The rows `at` (capacity: none) used at `step`, their use counts `occ` more
    (saturating)."""
    c = row_info.shape[0]
    info = row_info[jnp.minimum(at, c - 1)]  # (one gather, then one scatter: in place)
    cnt = info[:, USE_COUNT]
    info = info.at[:, LAST_USED].set(step)
    info = info.at[:, USE_COUNT].set(cnt + jnp.minimum(occ, _INT32_MAX - cnt))
    return row_info.at[at].set(info, mode="drop")


def _sort_by_bucket(key_b, num_buckets: int):
    """(sorted keys, the u in that order) of `key_b` [n] in [0, num_buckets], ties by u:
    one one-operand sort of `key * n + u` where that fits 32 bits (2^17 buckets and 16,384
    slots do), XLA's CPU sort of two operands costing several times one's."""
    n = key_b.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    if (num_buckets + 1) * n > 2**32:
        return lax.sort((key_b, pos), num_keys=1, is_stable=True)
    packed = jnp.sort(key_b.astype(jnp.uint32) * jnp.uint32(n) + pos.astype(jnp.uint32))
    return (packed // jnp.uint32(n)).astype(jnp.int32), (packed % jnp.uint32(n)).astype(jnp.int32)


def _admitted(config, keys, index, free, pos, cand, order, u_hi, u_lo, free_head, num_free):
    """Steps 5-7 of `_map_ids`: which candidates take a row, their index slots, rows and
    tags (`(admit, slot, new_row, tag)` a distinct id)."""
    n = pos.shape[0]
    c = config.capacity

    # 5. the first `num_free` candidates (first-position order) may take a row
    def rank_of(mask):  # rank of each u among the masked, in admission order
        r = jnp.cumsum(mask[order], dtype=jnp.int32) - 1
        return jnp.zeros((n,), jnp.int32).at[order].set(r)

    fits = cand & (rank_of(cand) < num_free)

    # 6. a slot in the emptier of the two buckets (first on a tie) that has no live slot
    #    of the id's tag (neither: none), the k-th empty slot for the k-th id (in u
    #    order) choosing that bucket; an id whose tag an earlier one of them has gets
    #    none (its k-th slot stays empty): a bucket's live tags stay distinct
    b1, b2 = _buckets_keyed(config.num_buckets, keys, u_hi, u_lo)
    tag = id_hash.tags(keys, u_hi, u_lo)
    t1, t2 = index[b1], index[b2]  # [n, 2, W]
    empty1, empty2 = t1[:, _ROW] == EMPTY, t2[:, _ROW] == EMPTY
    clash1 = (~empty1 & (t1[:, _TAG] == tag[:, None])).any(axis=1)
    clash2 = (~empty2 & (t2[:, _TAG] == tag[:, None])).any(axis=1)
    room1 = jnp.where(clash1, -1, empty1.sum(axis=1, dtype=jnp.int32))
    room2 = jnp.where(clash2, -1, empty2.sum(axis=1, dtype=jnp.int32))
    use2 = room2 > room1
    bucket = jnp.where(use2, b2, b1)
    empty = jnp.where(use2[:, None], empty2, empty1)
    clash = jnp.where(use2, clash2, clash1)
    key_b = jnp.where(fits, bucket, config.num_buckets)
    s_b, s_u = _sort_by_bucket(key_b, config.num_buckets)  # by bucket, then u
    starts = jnp.where(jnp.concatenate([jnp.ones((1,), bool), s_b[1:] != s_b[:-1]]), pos, 0)
    in_bucket = jnp.zeros((n,), jnp.int32).at[s_u].set(pos - lax.cummax(starts))
    s_tag = tag[s_u]
    twin = jnp.zeros((n,), bool)  # an earlier id of its bucket has its tag
    for d in range(1, min(BUCKET_WIDTH, n)):  # (only the first W of a bucket get a slot)
        same = (s_b[d:] == s_b[:-d]) & (s_tag[d:] == s_tag[:-d])
        twin = twin.at[d:].set(twin[d:] | same)
    twin = jnp.zeros((n,), bool).at[s_u].set(twin)
    k_th = (jnp.cumsum(empty, axis=1, dtype=jnp.int32) == (in_bucket + 1)[:, None]) & empty
    slotted = k_th.any(axis=1) & ~clash & ~twin
    slot = bucket * BUCKET_WIDTH + jnp.argmax(k_th, axis=1).astype(jnp.int32)
    admit = fits & slotted

    # 7. rows, lowest free first, in admission order
    new_row = free[jnp.minimum(free_head + rank_of(admit), c - 1)]
    return admit, slot, new_row, tag


def _map_ids(state: IdMapState, hi, lo, valid, step, distinct: bool, shape):
    """`map_ids`'s jnp path: any call, hits, misses, admissions and evictions."""
    config = state.config
    c = config.capacity
    n = hi.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    keys = bucket_keys(config)

    # 1, 2: the distinct valid ids, lookup, hits
    distinct_ids = _distinct_as_given if distinct else _distinct_by_sort
    u_hi, u_lo, _, u_valid, u_occ, inverse, order = distinct_ids(hi, lo, valid, pos)
    found, row, _ = _find_keyed(state.index, state.row_info, keys, u_hi, u_lo)
    hit = u_valid & found
    row_info = _touch(state.row_info, jnp.where(hit, row, c), u_occ, step)

    # 3. sightings, candidates
    miss = u_valid & ~found
    sketch, sightings = state.sketch, state.sightings
    if config.admit_after > 1:
        sketch, sightings, est = _sketch_sight(config, sketch, sightings, u_hi, u_lo, miss)
        cand = miss & (est >= config.admit_after)
    else:
        cand = miss
    pending = miss & ~cand
    needed = cand.sum(dtype=jnp.int32)

    # 4. a sweep when the candidates outnumber the free rows
    carried = (state.index, state.free, state.free_head, state.num_free)
    row_slot = state.row_slot
    last_used, cnt = row_info[:, LAST_USED], row_info[:, USE_COUNT]
    carried, evictions = lax.cond(
        needed > state.num_free,
        lambda carried: _sweep(config, step, needed, row_slot, last_used, cnt, carried),
        lambda carried: (carried, jnp.int32(0)),
        carried,
    )
    index, free, free_head, num_free = carried

    admit, slot, new_row, tag = _admitted(
        config, keys, index, free, pos, cand, order, u_hi, u_lo, free_head, num_free
    )
    taken = admit.sum(dtype=jnp.int32)
    at_row = jnp.where(admit, new_row, c)
    at_slot = jnp.where(admit, slot, config.num_slots)
    sb, si = at_slot // BUCKET_WIDTH, at_slot % BUCKET_WIDTH
    index = index.at[sb, _TAG, si].set(tag, mode="drop")
    index = index.at[sb, _ROW, si].set(new_row.astype(jnp.uint32), mode="drop")
    words = lax.bitcast_convert_type(jnp.stack([u_hi, u_lo], axis=-1), jnp.int32)
    info = jnp.concatenate(
        [words, jnp.broadcast_to(step, (n, 1)).astype(jnp.int32), u_occ[:, None]], axis=-1
    )
    row_info = row_info.at[at_row].set(info, mode="drop")
    row_slot = row_slot.at[at_row].set(slot, mode="drop")
    num_free = num_free - taken

    # 8. per position
    u_row = jnp.where(hit, row, jnp.where(admit, new_row, -1))
    rows = jnp.where(valid, u_row[inverse], -1).reshape(shape)
    fresh = (valid & admit[inverse]).reshape(shape)
    stats = {
        "hits": hit.sum(dtype=jnp.int32),
        "admissions": taken,
        "evictions": evictions,
        "pending": pending.sum(dtype=jnp.int32),
        "refused": needed - taken,
        "occupancy": jnp.int32(c) - num_free,
    }
    new_state = IdMapState(
        config=config,
        index=index,
        row_info=row_info,
        row_slot=row_slot,
        free=free,
        free_head=free_head + taken,
        num_free=num_free,
        sketch=sketch,
        sightings=sightings,
    )
    return new_state, rows, fresh, stats
