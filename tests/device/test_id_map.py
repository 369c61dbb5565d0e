"""The device-side id map (`embedmesh.device.id_map`, issue 42) against a plain Python
reference: a dict from raw id to row plus LRU/LFU bookkeeping, written for clarity below.

Every call of the jitted `map_ids` is compared with the reference: the rows, `fresh`, the
stats, the live mapping (row by row), each row's last-used step and use count. Between
calls every field of the state that must not matter (the tags of empty slots, the raw
id, step and count of free rows, the free list outside its live part) is overwritten
with random junk or with the tags and ids of the stream's ids, so a map that reads one
gives a wrong answer. Ids are drawn from
adversarial sets (int64 extremes, negatives, all equal modulo the capacity and modulo
2**32, strided) plus random ones, never only zeros.

The admission sketch is modelled exactly: the reference asks the module for each id's
counter in each sketch row (`sketch_columns`, a hash) and counts as the docstring says.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh.device import id_map as im

I32_MAX = 2**31 - 1


class Reference:
    """The id map's specification, in plain Python (module docstring of id_map)."""

    def __init__(self, cfg: im.IdMapConfig, sketch_cols=None):
        self.cfg = cfg
        self.row_of = {}  # raw id -> row
        self.id_of = {}  # row -> raw id
        self.last = {}  # row -> last-used step
        self.count = {}  # row -> occurrences
        self.sketch = [[0] * cfg.sketch_width for _ in range(cfg.sketch_depth)]
        self.sightings = 0
        self.cols = sketch_cols  # raw id -> [its counter in each sketch row]

    def _evict_order(self, step):
        rows = [r for r in self.id_of if self.last[r] != step]
        if self.cfg.eviction == "lru":
            return sorted(rows, key=lambda r: (self.last[r], r))
        return sorted(rows, key=lambda r: (self.count[r], self.last[r], r))

    def call(self, ids, valid, step):
        cfg = self.cfg
        occ = collections.Counter(i for i, v in zip(ids, valid) if v)
        first = {}
        for p, (i, v) in enumerate(zip(ids, valid)):
            if v:
                first.setdefault(i, p)
        distinct = sorted(first, key=first.get)  # first-position order
        hits = [i for i in distinct if i in self.row_of]
        for i in hits:
            r = self.row_of[i]
            self.last[r] = step
            self.count[r] = min(self.count[r] + occ[i], I32_MAX)
        misses = [i for i in distinct if i not in self.row_of]
        if cfg.admit_after > 1:
            est = {
                i: min(self.sketch[d][self.cols[i][d]] for d in range(cfg.sketch_depth)) + 1
                for i in misses
            }
            for i in misses:
                for d in range(cfg.sketch_depth):
                    c = self.cols[i][d]
                    self.sketch[d][c] = max(self.sketch[d][c], est[i])
            self.sightings += len(misses)
            if self.sightings >= cfg.sketch_halve_every:
                self.sketch = [[x // 2 for x in row] for row in self.sketch]
                self.sightings = 0
            cands = [i for i in misses if est[i] >= cfg.admit_after]
        else:
            cands = misses
        free = sorted(set(range(cfg.capacity)) - set(self.id_of))
        evictions = 0
        if len(cands) > len(free):
            order = self._evict_order(step)
            evictions = min(max(cfg.evict_batch, len(cands) - len(free)), len(order))
            for r in order[:evictions]:
                del self.row_of[self.id_of.pop(r)]
            free = sorted(set(range(cfg.capacity)) - set(self.id_of))
        admitted = cands[: len(free)]
        for i, r in zip(admitted, free):
            self.row_of[i], self.id_of[r] = r, i
            self.last[r], self.count[r] = step, occ[i]
        new = set(admitted)
        rows = [self.row_of.get(i, -1) if v else -1 for i, v in zip(ids, valid)]
        fresh = [bool(v) and i in new for i, v in zip(ids, valid)]
        stats = {
            "hits": len(hits),
            "admissions": len(admitted),
            "evictions": evictions,
            "pending": len(misses) - len(cands),
            "refused": len(cands) - len(admitted),
            "occupancy": len(self.row_of),
        }
        return rows, fresh, stats


# The stream tests' host-side reads, each one compiled program: run eagerly, every op of
# `im.tags`, `im.sketch_columns`, `im.live_ids`' mask and `im.init` was dispatched alone
# (and compiled anew for each new length), most of those tests' time
_TAGS = jax.jit(im.tags, static_argnums=0)
_LIVE = jax.jit(im._live, static_argnums=0)
_ROW_IDS = jax.jit(lambda state: state.row_id)
_SKETCH_COLUMNS = jax.jit(im.sketch_columns, static_argnums=0)
INIT = jax.jit(im.init, static_argnums=0)


def padded(words) -> np.ndarray:
    """uint32 words `[k, 2]` padded with zeros to a power of two (at least 16) rows: the
    element-wise hashes below compile for a few lengths, not for every k."""
    k = len(words)
    out = np.zeros((max(16, 1 << max(k - 1, 0).bit_length()), 2), np.uint32)
    out[:k] = words
    return out


def tags_of(config: im.IdMapConfig, words) -> np.ndarray:
    """`im.tags` of uint32 words `[k, 2]`, computed on them `padded`."""
    p = padded(words)
    return np.asarray(_TAGS(config, p[:, 0], p[:, 1]))[: len(words)]


def sketch_columns_of(config: im.IdMapConfig, words) -> np.ndarray:
    """`im.sketch_columns` of uint32 words `[k, 2]` (`[sketch_depth, k]`), on them padded."""
    return np.asarray(_SKETCH_COLUMNS(config, padded(words)))[:, : len(words)]


def live_ids(state: im.IdMapState) -> dict:
    """`im.live_ids(state)`, its mask and row ids computed by compiled programs (each
    stream checks it against `im.live_ids` itself at its end)."""
    rows = np.flatnonzero(np.asarray(_LIVE(state.config, state.index, state.row_slot)))
    ids = im.join_ids(np.asarray(_ROW_IDS(state))[rows])
    return {int(i): int(r) for i, r in zip(ids, rows)}


def poison(state: im.IdMapState, rng, plant) -> im.IdMapState:
    """The state with every field that must not matter overwritten by junk: random words,
    or the words (tags) of ids the stream uses (`plant`, uint32 [k, 2]), so that a map
    reading an empty slot's tag or a free row's data finds a plausible id there."""

    def junk(k):
        words = rng.integers(0, 2**32, size=(k, 2), dtype=np.uint64).astype(np.uint32)
        planted = plant[rng.integers(0, len(plant), k)]
        return np.where(rng.random((k, 1)) < 0.5, planted, words)

    index = np.array(state.index)
    empty = index[:, im.ROW_WORD, :] == im.EMPTY
    words = junk(int(empty.sum()))
    index[:, 0, :][empty] = tags_of(state.config, words)
    c = state.config.capacity
    free = np.ones(c, bool)
    free[list(live_ids(state).values())] = False
    # a free row's slot number: never used (-1), or any slot (a live row's, an empty one)
    row_slot = np.array(state.row_slot)
    row_slot[free] = rng.integers(-1, state.config.num_slots, int(free.sum()))
    info = np.array(state.row_info)
    info[free, :2] = junk(int(free.sum())).view(np.int32)
    info[free, 2:] = rng.integers(-(2**31), 2**31, (int(free.sum()), 2))
    head, nf = int(state.free_head), int(state.num_free)
    fl = np.array(state.free)
    outside = (np.arange(c) < head) | (np.arange(c) >= head + nf)
    fl[outside] = rng.integers(-(2**31), 2**31, int(outside.sum()))
    return dataclasses.replace(
        state,
        index=jnp.asarray(index),
        row_info=jnp.asarray(info.astype(np.int32)),
        row_slot=jnp.asarray(row_slot.astype(np.int32)),
        free=jnp.asarray(fl.astype(np.int32)),
    )


def check_state(state: im.IdMapState, ref: Reference):
    """The live mapping is the reference's (so injective: one row an id, one id a row),
    the index finds exactly it, and each live row's step and count are the reference's."""
    live = live_ids(state)
    assert live == ref.row_of
    assert len(set(live.values())) == len(live)
    assert int(state.num_free) == state.config.capacity - len(live)
    head, nf = int(state.free_head), int(state.num_free)
    assert list(np.asarray(state.free)[head : head + nf]) == sorted(
        set(range(state.config.capacity)) - set(live.values())
    )
    index = np.asarray(state.index)
    words = index[:, im.ROW_WORD, :]
    rows_in_index = words[words != im.EMPTY]
    assert sorted(rows_in_index.tolist()) == sorted(live.values())
    # each live id's slot holds its tag, and no bucket holds a tag twice
    ids = np.array(list(live), np.int64)
    if ids.size:
        tags = tags_of(state.config, im.split_ids(ids))
        slots = np.asarray(state.row_slot)[list(live.values())]
        w = im.BUCKET_WIDTH
        assert (index[slots // w, 0, slots % w] == tags).all()
        assert len(set(zip((slots // w).tolist(), tags.tolist()))) == len(live)
    last, count = np.asarray(state.last_used), np.asarray(state.use_count)
    for r in live.values():
        assert (last[r], count[r]) == (ref.last[r], ref.count[r]), r


# ------------------------------------------------------------------ the stream tests

BATCH = 8
CONFIGS = {
    "lru": im.IdMapConfig(capacity=5, eviction="lru", evict_batch=1, seed=7),
    "lfu-batch2": im.IdMapConfig(capacity=6, eviction="lfu", evict_batch=2, seed=3),
    # small sketches: collisions (false admissions) and halvings do happen
    "lru-admit3": im.IdMapConfig(
        capacity=5, eviction="lru", admit_after=3, evict_batch=2, sketch_width=8,
        sketch_halve_every=24,
    ),
    "lfu-admit3": im.IdMapConfig(
        capacity=4, eviction="lfu", admit_after=3, evict_batch=1, sketch_width=4,
        sketch_depth=2, sketch_halve_every=10,
    ),
}  # fmt: skip
TRACES = collections.Counter()
JITTED = {}
LOOKUP = jax.jit(im.lookup)


def jitted(name, distinct=False):
    key = (name, distinct)
    if key not in JITTED:

        def body(state, ids, valid, step):
            TRACES[key] += 1
            return im.map_ids(state, ids, valid, step, distinct=distinct)

        JITTED[key] = jax.jit(body)
    return JITTED[key]


ADVERSARIAL = [
    -(2**63), 2**63 - 1, -1, 0, 1, 2**32, -(2**32), 2**32 - 1, 2**31, -(2**31) - 1,
    5 * 2**32, 7 * 2**32 + 5, 12, 24, 36, 48, 60, 1 << 40, (1 << 40) + 12,
]  # fmt: skip
ID = st.one_of(
    st.sampled_from(ADVERSARIAL),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**20), 2**20).map(lambda k: k * 2**32),  # equal low words
    st.integers(0, 2**20).map(lambda k: k * 1024 + 3),  # equal modulo capacity, N, 1024
)


@st.composite
def streams(draw):
    universe = draw(st.lists(ID, min_size=3, max_size=16, unique=True))
    calls, step = [], 0
    for _ in range(draw(st.integers(1, 14))):
        ids = draw(st.lists(st.sampled_from(universe), min_size=BATCH, max_size=BATCH))
        all_valid = st.just([True] * BATCH)
        valid = draw(st.one_of(all_valid, st.lists(st.booleans(), min_size=BATCH, max_size=BATCH)))
        step += draw(st.sampled_from([0, 1, 1, 2]))  # repeated steps protect rows too
        calls.append((ids, valid, step))
    return universe, calls


def run_stream(name, universe, calls, seed, distinct=False):
    cfg = CONFIGS[name]
    fn = jitted(name, distinct)
    cols = None
    if cfg.admit_after > 1:
        c = sketch_columns_of(cfg, im.split_ids(np.array(universe, np.int64)))
        cols = {i: list(c[:, k]) for k, i in enumerate(universe)}
    ref = Reference(cfg, cols)
    state = INIT(cfg)
    rng = np.random.default_rng(seed)
    plant = im.split_ids(np.array(universe, np.int64))
    for ids, valid, step in calls:
        state = poison(state, rng, plant)
        pairs = im.split_ids(np.array(ids, np.int64))
        state, rows, fresh, stats = fn(state, pairs, np.array(valid), jnp.int32(step))
        want_rows, want_fresh, want_stats = ref.call(ids, valid, step)
        assert np.asarray(rows).tolist() == want_rows, (ids, valid, step)
        assert np.asarray(fresh).tolist() == want_fresh
        assert {k: int(v) for k, v in stats.items()} == want_stats
        check_state(state, ref)
        # the read-only lookup agrees, and finds nothing else
        assert np.asarray(LOOKUP(state, pairs)).tolist() == [ref.row_of.get(i, -1) for i in ids]
    assert im.live_ids(state) == ref.row_of  # the library's own host-side read
    return state


# the stream tests' settings: the same examples every run, however slow a stream
STREAMS = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("name", CONFIGS)
@settings(STREAMS, max_examples=20)
@given(stream=streams(), seed=st.integers(0, 2**32 - 1))
def test_map_ids_matches_the_reference(name, stream, seed):
    universe, calls = stream
    run_stream(name, universe, calls, seed)
    assert TRACES[(name, False)] == 1  # one compilation for the batch shape, whatever the stream


@st.composite
def distinct_streams(draw):
    """Calls whose valid ids are distinct (a host's distinct ids), the invalid slots
    anywhere, holding any id (a duplicate of a valid one too)."""
    universe = draw(st.lists(ID, min_size=3, max_size=16, unique=True))
    calls, step = [], 0
    for _ in range(draw(st.integers(1, 10))):
        k = draw(st.integers(0, min(BATCH, len(universe))))
        chosen = draw(st.permutations(universe))[:k]
        fill = draw(st.lists(st.sampled_from(universe), min_size=BATCH - k, max_size=BATCH - k))
        where = draw(st.permutations(range(BATCH)))
        ids, valid = [0] * BATCH, [False] * BATCH
        for slot, i in zip(where, chosen + fill):
            ids[slot] = i
        for slot in where[:k]:
            valid[slot] = True
        step += draw(st.sampled_from([0, 1, 1, 2]))
        calls.append((ids, valid, step))
    return universe, calls


@pytest.mark.parametrize("name", ["lru", "lfu-admit3"])
@settings(STREAMS, max_examples=10)
@given(stream=distinct_streams(), seed=st.integers(0, 2**32 - 1))
def test_map_ids_of_distinct_ids_skips_the_sorts_alike(name, stream, seed):
    """`distinct=True` (no deduplication, the admission order counted): the reference's
    rows, fresh rows, stats and state on streams whose valid ids are distinct."""
    universe, calls = stream
    run_stream(name, universe, calls, seed, distinct=True)
    assert TRACES[(name, True)] == 1


def test_capacity_pressure_refuses_and_counts():
    """More distinct new ids than rows, all in one step: the first `capacity` (by first
    position) are admitted, the others refused with -1 and counted; nothing used at this
    step is evicted, at the next step the refused ones get rows by eviction."""
    name = "lru"
    cfg = CONFIGS[name]
    ids = [11, -3, 11, 2**40, 7, -(2**63), 99, 2**63 - 1]
    state = INIT(cfg)
    pairs = im.split_ids(np.array(ids, np.int64))
    state, rows, fresh, stats = jitted(name)(state, pairs, np.ones(BATCH, bool), jnp.int32(4))
    assert np.asarray(rows).tolist() == [0, 1, 0, 2, 3, 4, -1, -1]
    assert np.asarray(fresh).tolist() == [True] * 6 + [False] * 2
    assert int(stats["refused"]) == 2 and int(stats["admissions"]) == 5
    ids2 = [99, 2**63 - 1] + ids[:6]  # same step: still no row for the refused ones
    pairs2 = im.split_ids(np.array(ids2, np.int64))
    state, rows, _, stats = jitted(name)(state, pairs2, np.ones(BATCH, bool), jnp.int32(4))
    assert np.asarray(rows).tolist()[:2] == [-1, -1] and int(stats["evictions"]) == 0
    only_new = np.array([True, True] + [False] * 6)
    state, rows, fresh, stats = jitted(name)(state, pairs2, only_new, jnp.int32(5))
    assert np.asarray(rows).tolist() == [0, 1] + [-1] * 6  # LRU ties: lowest rows first
    assert int(stats["evictions"]) == 2 and np.asarray(fresh).tolist()[:2] == [True, True]
    assert TRACES[(name, False)] == 1


def test_empty_map_finds_nothing_even_id_zero():
    """A fresh index has zero id words in its empty slots: the id 0 (zero words) is still
    unknown, and is admitted as a new id."""
    ids = [0, -1, 0, 2**63 - 1, 0, 1, 2, 3]
    pairs = im.split_ids(np.array(ids, np.int64))
    state = INIT(CONFIGS["lru"])
    assert np.asarray(LOOKUP(state, pairs)).tolist() == [-1] * BATCH
    state, rows, fresh, stats = jitted("lru")(state, pairs, np.ones(BATCH, bool), jnp.int32(0))
    assert np.asarray(rows).tolist() == [0, 1, 0, 2, 0, 3, 4, -1]
    assert np.asarray(fresh).tolist() == [True] * 7 + [False]
    assert (int(stats["hits"]), int(stats["admissions"])) == (0, 5)


# 500 rows (256 buckets of 8 slots), batches of 256, admission after 2 sightings
SCALE = im.IdMapConfig(capacity=500, eviction="lfu", admit_after=2, evict_batch=24, seed=11)
SCALE_BATCH = 256
SCALE_FN = jax.jit(im.map_ids, donate_argnums=0)


def test_adversarial_ids_at_scale_match_the_reference_and_never_overflow_buckets():
    """Batches of ids all equal modulo 2**32, modulo 1024 and modulo 8, negative and
    random, churning through the table: the reference's rows, admissions and evictions,
    no id refused for a full bucket."""
    rng = np.random.default_rng(5)
    pool = np.concatenate(
        [
            np.arange(1, 1200, dtype=np.int64) << 32,  # low words all zero
            -(np.arange(1, 1200, dtype=np.int64) << 32),
            np.arange(1200, dtype=np.int64) * 8192 + 77,  # equal modulo 1024 and 8
            rng.integers(-(2**63), 2**63 - 1, 1200, dtype=np.int64),
        ]
    )
    cols = np.asarray(_SKETCH_COLUMNS(SCALE, im.split_ids(pool)))
    ref = Reference(SCALE, {int(i): list(cols[:, k]) for k, i in enumerate(pool)})
    state = INIT(SCALE)
    total = collections.Counter()
    for step in range(20):
        # a drifting window of the pool, Zipf-ish repeats inside a batch
        window = pool[(step * 97 + np.arange(700)) % pool.size]
        ids = window[np.minimum(rng.zipf(1.2, SCALE_BATCH) - 1, 699)]
        valid = rng.random(SCALE_BATCH) < 0.95
        state, rows, fresh, stats = SCALE_FN(state, im.split_ids(ids), valid, jnp.int32(step))
        want_rows, want_fresh, want_stats = ref.call(ids.tolist(), valid.tolist(), step)
        assert np.asarray(rows).tolist() == want_rows
        assert np.asarray(fresh).tolist() == want_fresh
        assert {k: int(v) for k, v in stats.items()} == want_stats
        total.update(want_stats)
    check_state(state, ref)
    assert min(total["evictions"], total["hits"]) > 50 and total["pending"] > 300
    load = (np.asarray(state.index)[:, im.ROW_WORD, :] != im.EMPTY).sum(axis=1)
    assert load.max() < im.BUCKET_WIDTH


def test_no_capacity_sized_copy_in_the_compiled_program():
    """The project's rule, no O(table) work a step: with the state donated, XLA updates
    it in place; the program copies no array of the capacity's size (a branch that both
    read and wrote a row array made XLA copy the state around the sweep's `lax.cond`)."""
    args = (INIT(SCALE), jnp.zeros((SCALE_BATCH, 2), jnp.uint32), jnp.ones(SCALE_BATCH, bool))
    pairs = args[1]
    jnp_path = jax.jit(
        lambda st, ids, valid, step: im._map_ids(
            st, ids[:, 0], ids[:, 1], valid, step, False, valid.shape
        ),
        donate_argnums=0,
    )
    programs = {"jnp path": jnp_path.lower(INIT(SCALE), pairs, args[2], jnp.int32(0))}
    programs["map_ids"] = SCALE_FN.lower(*args, jnp.int32(0))
    big = {"500", "500,4", "256,2,8", "2,512"}  # row arrays, the index, the sketch
    for what, lowered in programs.items():
        hlo = lowered.compile().as_text()
        copies = re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} copy\(", hlo)
        assert not [s for s in copies if s in big], (what, copies)
        if what == "jnp path":
            assert "conditional" in hlo  # the sweep and the halving are branches, not selects
        elif im.native_step():  # the whole call one op, the state aliased
            assert "embedmesh_id_map_step" in hlo


def test_on_huge_pages_keeps_values_and_sharding(monkeypatch):
    """`on_huge_pages`: the same values, shape and sharding (a shard of at least
    `HUGE_PAGE_MIN_BYTES` copied, a smaller array returned as is)."""
    state = im.init(im.IdMapConfig(capacity=300))
    x = jax.device_put(state.index[None])
    assert im.on_huge_pages(x) is x  # 6 KiB: below the threshold
    monkeypatch.setattr(im, "HUGE_PAGE_MIN_BYTES", 1)
    y = im.on_huge_pages(x)
    assert y is not x and y.sharding == x.sharding and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(state.index[None]))


# --------------------------------------------------------------------- routing, ids


@pytest.mark.parametrize("num_shards", [2, 3, 8, 64])
def test_owner_of_spreads_strided_and_structured_ids(num_shards):
    k = np.arange(1 << 14, dtype=np.int64)
    families = {
        "stride N": k * num_shards,
        "stride 2**32": k << 32,
        "stride 2**40 negative": -(k << 40) - 1,
        "stride 1024": k * 1024 + 5,
        "consecutive": k - 8000,
    }
    mean = k.size / num_shards
    for fam, ids in families.items():
        owner = np.asarray(im.owner_of(im.split_ids(ids), num_shards, seed=42))
        assert owner.min() >= 0 and owner.max() < num_shards
        counts = np.bincount(owner, minlength=num_shards)
        # binomial spread: within 6 standard deviations of the mean on every shard
        assert np.abs(counts - mean).max() < 6 * np.sqrt(mean) + 1, (fam, counts)
    ids = im.split_ids(k * num_shards)
    a = np.asarray(im.owner_of(ids, num_shards, seed=42))
    assert (np.asarray(jax.jit(im.owner_of, static_argnums=(1, 2))(ids, num_shards, 42)) == a).all()
    assert (np.asarray(im.owner_of(ids, num_shards, seed=43)) != a).mean() > 0.3


def test_ids_and_their_forms():
    ids = np.array([-(2**63), 2**63 - 1, -1, 0, 1, 2**32, -(2**32) + 7, 12], np.int64)
    pairs = im.split_ids(ids)
    assert pairs.dtype == np.uint32 and pairs.shape == (BATCH, 2)
    assert pairs[2].tolist() == [2**32 - 1, 2**32 - 1] and pairs[5].tolist() == [1, 0]
    assert (im.join_ids(pairs) == ids).all()
    assert (im.join_ids(pairs.view(np.int32)) == ids).all()
    state = INIT(CONFIGS["lru"])
    state, rows, _, _ = jitted("lru")(state, pairs, np.ones(BATCH, bool), jnp.int32(0))
    assert np.asarray(rows).tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    # int32 pairs are read bit for bit; x64 on: int64 ids directly, same rows and owners
    assert np.asarray(LOOKUP(state, pairs.view(np.int32))).tolist() == np.asarray(rows).tolist()
    with jax.enable_x64(True):  # (jitted: op by op, each op compiled for itself)
        ids64 = jnp.asarray(ids)
        assert np.asarray(LOOKUP(state, ids64)).tolist() == [0, 1, 2, 3, 4] + [-1] * 3
        assert (np.asarray(jax.jit(im.split_ids)(ids64)) == pairs).all()
        owners64 = np.asarray(jax.jit(im.owner_of, static_argnums=(1, 2))(ids64, 5, 1))
    assert (owners64 == np.asarray(im.owner_of(pairs, 5, 1))).all()
    with pytest.raises(ValueError, match="pairs"):
        im.lookup(state, np.zeros((3, 3), np.uint32))


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 4, "eviction": "fifo"}, "eviction"),
        ({"capacity": 4, "admit_after": 0}, "admit_after"),
        ({"capacity": 4, "seed": -1}, "seed"),
        ({"capacity": 4, "evict_batch": 0}, "evict_batch"),
        ({"capacity": 4, "sketch_width": 12}, "sketch_width"),
        ({"capacity": 2.5}, "capacity"),
    ],
)
def test_config_is_validated(kw, field):
    with pytest.raises(ValueError, match=f"IdMapConfig.{field}"):
        im.IdMapConfig(**kw)


def test_config_defaults_and_sizes():
    cfg = im.IdMapConfig(capacity=1000)
    assert cfg.evict_batch == 15 and cfg.sketch_width == 1024
    assert cfg.num_slots >= 4 * cfg.capacity and cfg.num_buckets & (cfg.num_buckets - 1) == 0
    assert hash(cfg) == hash(im.IdMapConfig(capacity=1000))
    state = im.init(cfg)
    assert state.sketch.shape == (1, 1)  # no sketch without admission
    leaves = jax.tree_util.tree_leaves(state)
    assert all(isinstance(x, jax.Array) for x in leaves) and len(leaves) == 8
