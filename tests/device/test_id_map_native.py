"""The id map's native paths against its jnp path: `map_ids` with the CPU kernels runs
each call as one op (`ops.id_map_step`, cpu/id_map.cc: hits, the sketch, sweeps,
admissions, the state updated in place) and gives bit for bit the state, rows, fresh
flags and stats of `map_ids` without them (the jnp path, the op's reference), over random
mixes of calls of hits only and calls with misses, admissions and evictions, on one
device and on several (one map a device inside `shard_map`, as the engine runs it), and
on "tag twins": ids whose index tags are equal (a 32-bit hash: found by search), whose
probes find each other's slot, which the map must tell apart by the rows' ids."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from embedmesh import _runtime
from embedmesh.device import id_map as im
from embedmesh.device import ops
from embedmesh.device.ops import cpu
from embedmesh.optimizers import Adagrad

pytestmark = pytest.mark.skipif(not cpu.ready(), reason="the CPU kernels are not built here")

BATCH = 24
FIRST_STEP = 1000  # never zero: a step written where it should not be shows
CONFIGS = {
    "lru": im.IdMapConfig(capacity=20, eviction="lru", evict_batch=3, seed=5),
    "lfu-admit2": im.IdMapConfig(
        capacity=20, eviction="lfu", admit_after=2, evict_batch=2, seed=9, sketch_width=64
    ),
}


def tag_twins(config: im.IdMapConfig, count: int, same_first: bool) -> list:
    """A fresh list of `_tag_twins` (searched once a process: the search is most of the
    tests' cost that use it)."""
    return list(_tag_twins(config, count, same_first))


@functools.cache
def _tag_twins(config: im.IdMapConfig, count: int, same_first: bool) -> tuple:
    """`count` pairs of ids with one tag under `config` that share a bucket (`same_first`:
    their first buckets, so that, admitted together into an empty map, both choose it,
    and the second's second bucket is neither's first nor the first's second),
    searched among random ids (a 32-bit tag: ~2^20 ids give ~2^7 pairs)."""
    rng = np.random.default_rng((config.seed, same_first))
    out = []
    while len(out) < count:
        ids = rng.integers(-(2**63), 2**63 - 1, 1 << 20, dtype=np.int64)
        p = im.split_ids(ids)
        tag = np.asarray(im.tags(config, p[:, 0], p[:, 1]))
        b1, b2 = (np.asarray(b) for b in im.buckets(config, p[:, 0], p[:, 1]))
        order = np.argsort(tag, kind="stable")
        for k in np.flatnonzero(tag[order][1:] == tag[order][:-1]):
            x, y = order[k], order[k + 1]
            if same_first:  # (and the later has another bucket to go to)
                shared = b1[x] == b1[y] and b2[y] not in (b1[y], b1[x], b2[x])
            else:
                shared = {b1[x], b2[x]} & {b1[y], b2[y]}
            if shared and len(out) < count:
                out.append((int(ids[x]), int(ids[y])))
    return tuple(out)


# a pool of ids, adversarial members among them (int64 extremes, equal low or high words)
# and tag twins of the two configs (one tag, a shared bucket: `tag_twins`)
POOL = np.concatenate(
    [
        np.array([-(2**63), 2**63 - 1, -1, 0, 1 << 32, (1 << 32) + 1, 7, -7], np.int64),
        np.array([i for c in CONFIGS.values() for p in tag_twins(c, 2, False) for i in p]),
        np.random.default_rng(3).integers(-(2**63), 2**63 - 1, 24, dtype=np.int64),
    ]
)


def _jnp_path(state, raw, valid, step, *, distinct):
    hi, lo = raw[..., 0].reshape(-1), raw[..., 1].reshape(-1)
    return im._map_ids(state, hi, lo, valid.reshape(-1), step, distinct, valid.shape)


@functools.cache
def _fns(distinct: bool):
    """(native map_ids, jnp path), jitted with the state donated, as the engine runs it
    (one pair a process: each config compiles once; the jnp path's compilation is most
    of these tests' time)."""
    native = jax.jit(functools.partial(im.map_ids, distinct=distinct), donate_argnums=0)
    plain = jax.jit(functools.partial(_jnp_path, distinct=distinct), donate_argnums=0)
    return native, plain


def _call(distinct: bool):
    window = st.integers(4, len(POOL))
    if distinct:
        ids = window.flatmap(
            lambda w: st.lists(st.integers(0, w - 1), max_size=16, unique=True).map(
                lambda ix: (w, ix)
            )
        )
    else:
        ids = window.flatmap(
            lambda w: st.lists(st.integers(0, w - 1), max_size=BATCH).map(lambda ix: (w, ix))
        )
    return st.tuples(ids, st.lists(st.booleans(), min_size=BATCH, max_size=BATCH))


def _batch(call):
    (_, ix), valid = call
    ids = np.full(BATCH, 12345, np.int64)  # padding positions: an id, masked off
    ids[: len(ix)] = POOL[np.asarray(ix, np.int64)]
    mask = np.zeros(BATCH, bool)
    mask[: len(ix)] = np.asarray(valid[: len(ix)], bool) | (np.arange(len(ix)) % 3 == 0)
    return jnp.asarray(im.split_ids(ids)), jnp.asarray(mask)


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _all_hit(stats):
    return stats["admissions"] == 0 and stats["pending"] == 0 and stats["refused"] == 0


@pytest.mark.parametrize(
    "name,distinct", [("lru", False), ("lfu-admit2", True)], ids=["lru-repeats", "lfu-admit2"]
)
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_native_hits_match_the_jnp_path(name, distinct, data):
    native, plain = _fns(distinct)
    a = im.init(CONFIGS[name])
    b = jax.tree_util.tree_map(jnp.copy, a)
    calls = data.draw(st.lists(_call(distinct), min_size=3, max_size=6))
    # the last call repeated until it must be all hits: its ids seen (admit_after=2), then
    # admitted (or refused: a tag twin admitted with it, or no row free of this step's
    # use), then admitted at a step of its own, then hits
    calls = calls + calls[-1:] * 4
    hits_only = 0
    for k, call in enumerate(calls):
        raw, valid = _batch(call)
        step = jnp.int32(FIRST_STEP + k // 2)  # two calls a step: "used at this step" rows
        a, rows_a, fresh_a, stats_a = native(a, raw, valid, step)
        b, rows_b, fresh_b, stats_b = plain(b, raw, valid, step)
        _same((a, rows_a, fresh_a, stats_a), (b, rows_b, fresh_b, stats_b))
        hits_only += bool(_all_hit({k: int(v) for k, v in stats_a.items()}))
    assert hits_only >= 1


def test_native_call_past_the_kept_buffer():
    """A call of more than 2**20 positions (`id_map_step` then takes a buffer of its own,
    not the one its thread keeps) maps and admits as the jnp path does, before and after
    a small call (which takes the kept buffer again)."""
    native, plain = _fns(False)
    a = im.init(CONFIGS["lru"])
    b = jax.tree_util.tree_map(jnp.copy, a)
    big = (1 << 20) + 5
    for k, n in enumerate([BATCH, big, BATCH, big]):
        ids = np.full(n, 12345, np.int64)
        at = np.random.default_rng(k).choice(n, 8, replace=False)  # 8 valid, spread out
        ids[at] = POOL[k : k + 8]
        mask = np.zeros(n, bool)
        mask[at] = True
        raw, valid = jnp.asarray(im.split_ids(ids)), jnp.asarray(mask)
        if n == big:  # (the jnp path's sorts over 2**20 positions: on the valid ones only)
            small = jnp.asarray(im.split_ids(ids[np.sort(at)])), jnp.ones(8, bool)
            a, rows_a, fresh_a, stats_a = native(a, raw, valid, jnp.int32(FIRST_STEP + k))
            b, rows_b, fresh_b, stats_b = plain(b, *small, jnp.int32(FIRST_STEP + k))
            order = np.sort(at)
            _same((a, stats_a), (b, stats_b))
            np.testing.assert_array_equal(np.asarray(rows_a)[order], np.asarray(rows_b))
            np.testing.assert_array_equal(np.asarray(fresh_a)[order], np.asarray(fresh_b))
            assert (np.asarray(rows_a)[~mask] == -1).all() and not np.asarray(fresh_a)[~mask].any()
        else:
            a, *out_a = native(a, raw, valid, jnp.int32(FIRST_STEP + k))
            b, *out_b = plain(b, raw, valid, jnp.int32(FIRST_STEP + k))
            _same((a, out_a), (b, out_b))


def test_native_hits_on_several_devices():
    """One map a device inside `shard_map` (each device's kernel call at once, repeats in
    its ids, as an owner receives them from several sources), against the jnp path."""
    n = 2
    config = CONFIGS["lru"]
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

    def sharded(fn, block=False):
        # `block`: the shard's block of the map passed as it is ([1, ...], as the engine
        # passes it), else squeezed
        def body(state, raw, valid, step):
            lift = functools.partial(jax.tree_util.tree_map, lambda x: x[None])
            if not block:
                state = jax.tree_util.tree_map(lambda x: x[0], state)
            state, rows, fresh, stats = fn(state, raw[0], valid[0], step)
            return state if block else lift(state), rows[None], fresh[None], lift(stats)

        spec = P("x")
        return jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec, check_vma=False
            ),
            donate_argnums=0,
        )

    native = sharded(functools.partial(im.map_ids, distinct=False), block=True)
    plain = sharded(functools.partial(_jnp_path, distinct=False))
    one = im.init(config)
    a = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), one)
    b = jax.tree_util.tree_map(jnp.copy, a)
    rng = np.random.default_rng(11)
    hits_only = 0
    for k in range(7):
        # device d draws from its own window; new ids arrive every third call
        ids = np.stack(
            [rng.choice(POOL[d * 8 : d * 8 + 12 + (k // 3) * 4], BATCH) for d in range(n)]
        )
        valid = rng.random((n, BATCH)) < 0.8
        raw, valid = jnp.asarray(im.split_ids(ids)), jnp.asarray(valid)
        step = jnp.int32(FIRST_STEP + k)
        a, rows_a, fresh_a, stats_a = native(a, raw, valid, step)
        b, rows_b, fresh_b, stats_b = plain(b, raw, valid, step)
        _same((a, rows_a, fresh_a, stats_a), (b, rows_b, fresh_b, stats_b))
        per_device = [{s: int(v[d]) for s, v in stats_a.items()} for d in range(n)]
        hits_only += sum(_all_hit(s) for s in per_device)
    assert hits_only >= 2


def _invariants(state):
    """No two live ids share a row; each is found at its row; a bucket's live tags are
    distinct."""
    live = im.live_ids(state)
    assert len(set(live.values())) == len(live)
    if not live:
        return
    ids = np.array(list(live), np.int64)
    rows = np.asarray(jax.jit(im.lookup)(state, jnp.asarray(im.split_ids(ids))))
    assert rows.tolist() == list(live.values())
    index = np.asarray(state.index)
    live_slot = index[:, im.ROW_WORD] != im.EMPTY
    for b in np.flatnonzero(live_slot.any(axis=1)):
        tags = index[b, 0][live_slot[b]]
        assert len(set(tags.tolist())) == tags.size, b


@pytest.mark.parametrize("distinct", [False, True], ids=["repeats", "distinct"])
def test_tag_twins_get_rows_of_their_own_natively_as_in_the_jnp_path(distinct):
    """Twins (one tag, a shared bucket): given in one call into an empty map, both choose
    their common first bucket, and the later one (by first position; with repeats, by
    the ids' words) is refused there
    (its slot's tag would repeat in the bucket), counted in `refused`; at the next call
    it takes its other bucket. A twin looked up while the other lives finds the other's
    slot by tag and is told apart by the row's id: a miss, admitted, never the other's
    row. The kernel and the jnp path alike, state, rows and stats, bit for bit."""
    config = STEP_CONFIGS["lru"]
    native, plain = _fns(distinct)
    first = tag_twins(config, 2, same_first=True)
    twins = first + tag_twins(config, 2, same_first=False)
    a = im.init(config)
    b = jax.tree_util.tree_map(jnp.copy, a)

    def call(ids, k, check=None):
        nonlocal a, b
        ids = np.asarray(ids, np.int64)
        raw = np.full((BATCH, 2), 7, np.uint32)
        raw[: ids.size] = im.split_ids(ids)
        valid = np.arange(BATCH) < ids.size
        step = jnp.int32(FIRST_STEP + k)
        a, rows_a, fresh_a, stats_a = native(a, jnp.asarray(raw), jnp.asarray(valid), step)
        b, rows_b, fresh_b, stats_b = plain(b, jnp.asarray(raw), jnp.asarray(valid), step)
        _same((a, rows_a, fresh_a, stats_a), (b, rows_b, fresh_b, stats_b))
        _invariants(a)
        return np.asarray(rows_a)[: ids.size], {s: int(v) for s, v in stats_a.items()}

    (x, y), (v, w) = first
    if not distinct and im.split_ids(np.int64(y)).tolist() < im.split_ids(np.int64(x)).tolist():
        x, y = y, x  # (repeats: the admission's order within a bucket is the ids' words')
    rows, stats = call([x, y, v], 0)  # y: x's twin, both in x's first bucket
    assert rows[0] >= 0 and rows[1] == -1 and rows[2] >= 0 and stats["refused"] == 1
    rows, stats = call([y, x], 1)  # y now finds x's slot by tag: not its row; admitted
    assert rows[0] >= 0 and rows[0] != rows[1] and stats["admissions"] == 1
    rows, _ = call([w], 2)  # v lives: w is told apart from it
    assert rows[0] >= 0 and rows[0] != im.live_ids(a)[v]
    # every twin, again and again, among other ids, under eviction (16 rows)
    pool = np.unique(np.r_[np.array(twins, np.int64).ravel(), POOL[:12]])
    rng = np.random.default_rng(1)
    for k in range(3, 12):
        ids = rng.permutation(pool)[:BATCH] if distinct else rng.choice(pool, BATCH)
        call(ids, k // 2)
    live = im.live_ids(a)
    assert sum(t in live for t in np.array(twins).ravel()) >= 4


def test_without_the_kernels_map_ids_is_the_jnp_path(monkeypatch):
    """`EMBEDMESH_CPU_KERNELS=0`, or another default backend (GPU, TPU): no native op in
    the program, the jnp path alone."""
    config = CONFIGS["lru"]
    args = (im.init(config), jnp.zeros((BATCH, 2), jnp.uint32), jnp.ones(BATCH, bool), 0)
    assert im.native_step()
    assert "embedmesh_id_map_step" in str(jax.make_jaxpr(lambda *a: im.map_ids(*a))(*args))
    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: False)
    assert not im.native_step()
    jaxpr = str(jax.make_jaxpr(lambda *a: im.map_ids(*a))(*args))
    assert "embedmesh_id_map" not in jaxpr
    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: None)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert not im.native_step()


STEP_CONFIGS = {
    "lru": im.IdMapConfig(capacity=16, eviction="lru", evict_batch=1, seed=2),
    "lru-batch5": im.IdMapConfig(capacity=16, eviction="lru", evict_batch=5, seed=3),
    "lfu-admit2": im.IdMapConfig(
        capacity=16,
        eviction="lfu",
        admit_after=2,
        evict_batch=3,
        seed=4,
        sketch_width=64,
        sketch_depth=3,
        sketch_halve_every=40,
    ),
}


@pytest.mark.parametrize(
    "name,distinct",
    # each compiles the jnp path anew (~2.5 s): the kernel's branches in 4 of the 6
    # pairs, ids repeated and distinct under LRU and LFU, sweeps of one row (lru) and
    # of several (lru-batch5), the sketch (lfu-admit2) with both
    [("lru", False), ("lru-batch5", True), ("lfu-admit2", False), ("lfu-admit2", True)],
    ids=["lru-repeats", "lru-batch5-distinct", "lfu-admit2-repeats", "lfu-admit2-distinct"],
)
def test_native_step_under_eviction_matches_the_jnp_path(name, distinct):
    """`ops.id_map_step`'s kernel against the jnp path on a stream that keeps the map
    full: a pool twice the capacity, new ids every call, sweeps of one row and of
    several, the sketch's halvings, two calls a step (rows used at this step are not
    evicted: refusals), the state poisoned nowhere but compared whole after each call."""
    config = STEP_CONFIGS[name]
    native, plain = _fns(distinct)
    a = im.init(config)
    b = jax.tree_util.tree_map(jnp.copy, a)
    rng = np.random.default_rng(len(name) + distinct)
    seen = collections.Counter()
    for k in range(14):
        if distinct:
            ids = rng.permutation(POOL)[:BATCH]
        else:
            ids = rng.choice(POOL[: 8 + 2 * k], BATCH)
        valid = rng.random(BATCH) < 0.85
        raw, valid = jnp.asarray(im.split_ids(ids)), jnp.asarray(valid)
        step = jnp.int32(FIRST_STEP + k // 2)
        a, rows_a, fresh_a, stats_a = native(a, raw, valid, step)
        b, rows_b, fresh_b, stats_b = plain(b, raw, valid, step)
        _same((a, rows_a, fresh_a, stats_a), (b, rows_b, fresh_b, stats_b))
        seen.update({s: int(v) > 0 for s, v in stats_a.items()})
    assert seen["evictions"] and seen["admissions"] and seen["hits"], seen
    if config.admit_after > 1:
        assert seen["pending"]


def _sort_mapped_numpy(rows, prow, puniq, gain, r):
    """`id_map.sort_mapped` in plain numpy, a block at a time: the slots by row (stable),
    the valid pairs by their slot's new position (stable), the others after them."""
    out = [np.empty_like(x) for x in (rows, prow, puniq, gain)]
    u = rows.shape[-1]
    for b in np.ndindex(rows.shape[:-1]):
        perm = np.argsort(rows[b], kind="stable")
        at = np.empty(u, np.int64)
        at[perm] = np.arange(u)
        ok = (prow[b] >= 0) & (prow[b] < r) & (puniq[b] >= 0) & (puniq[b] < u)
        slot = np.where(ok, at[np.clip(puniq[b], 0, u - 1)], puniq[b])
        order = np.argsort(np.where(ok, slot, u), kind="stable")
        out[0][b], out[1][b] = rows[b][perm], prow[b][order]
        out[2][b], out[3][b] = slot[order], gain[b][order]
    return out


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    blocks=st.integers(1, 3),
    u=st.integers(1, 40),
    p=st.integers(1, 90),
    r=st.integers(1, 9),
    hosts_order=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_sort_mapped_kernel_and_reference_match_numpy(blocks, u, p, r, hosts_order, seed):
    """The mapped batch's reorder (`id_map.sort_mapped`, `sort_mapped_many`): the kernels
    (cpu/sort_mapped.cc, their fast path on pairs in the host's order, their counting sort
    otherwise) and the jnp reference against plain numpy, with PAD rows, repeated and
    negative rows, and pairs out of range on either side."""
    rng = np.random.default_rng(seed)
    pad = np.iinfo(np.int32).max
    rows = np.stack([rng.permutation(5000)[:u] for _ in range(blocks)]).astype(np.int32)
    rows[rng.random(rows.shape) < 0.2] = pad
    rows[rng.random(rows.shape) < 0.1] = -3  # repeated and negative: a stable order
    prow = rng.integers(-2, r + 2, (blocks, p)).astype(np.int32)
    puniq = rng.integers(-2, u + 2, (blocks, p)).astype(np.int32)
    gain = rng.uniform(0.5, 1.5, (blocks, p)).astype(np.float32)
    if hosts_order:  # the valid pairs first, by slot, as the host preprocessing makes them
        for b in range(blocks):
            ok = (prow[b] >= 0) & (prow[b] < r) & (puniq[b] >= 0) & (puniq[b] < u)
            o = np.lexsort((np.arange(p), np.where(ok, puniq[b], u + 9)))
            prow[b], puniq[b], gain[b] = prow[b][o], puniq[b][o], gain[b][o]
    want = _sort_mapped_numpy(rows, prow, puniq, gain, r)
    args = tuple(jnp.asarray(x) for x in (rows, prow, puniq, gain))
    kernel = jax.jit(functools.partial(im.sort_mapped, num_rows=r))(*args)
    reference = im._sort_mapped_reference(*args, num_rows=r)
    # several stacks in one call (the engine's): this one and the same with r + 1
    other = _sort_mapped_numpy(rows, prow, puniq, gain, r + 1)
    many = jax.jit(lambda *a: im.sort_mapped_many([a, a], [r, r + 1]))(*args)
    for w, k, f, m, o, m2 in zip(want, kernel, reference, many[0], other, many[1]):
        np.testing.assert_array_equal(np.asarray(k), w)
        np.testing.assert_array_equal(np.asarray(f), w)
        np.testing.assert_array_equal(np.asarray(m), w)
        np.testing.assert_array_equal(np.asarray(m2), o)


def _adagrad_numpy(table, acc, ids, act, prow, puniq, gain, lr):
    """A block's backward + Adagrad update in float64: each row's gradient the sum over
    every slot holding it (PAD and rows out of range skipped) of its pairs' gain * act."""
    t, a = table.astype(np.float64), acc.astype(np.float64)
    g = np.zeros_like(t)
    u, nr = ids.shape[0], act.shape[0]
    for q in range(prow.shape[0]):
        s, ar = puniq[q], prow[q]
        if 0 <= s < u and 0 <= ar < nr and 0 <= ids[s] < t.shape[0]:
            g[ids[s]] += np.float64(gain[q]) * act[ar].astype(np.float64)
    hit = np.unique([r for r in ids if 0 <= r < t.shape[0]])
    a[hit] += g[hit] ** 2
    t[hit] -= lr * g[hit] / np.sqrt(a[hit])
    return t, a


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(u=st.integers(2, 300), dup=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_backward_update_on_a_block_in_raw_id_order(u, dup, seed):
    """A mapped block as `map_ids` leaves it on one shard under the CPU kernels (rows in
    raw-id order, PAD among them, no reorder: `EmbeddingCore._mapped_order_kept`): the
    fused backward + update (its parallel path, which GroupPairs allows on distinct rows
    in any order) equals the float64 reference, and equals bit for bit the same batch
    reordered by `sort_mapped` (ascending rows, the host's order). With a row repeated
    (not a map's block: `dup`) the kernel must see it and sum both slots first."""
    rng = np.random.default_rng(seed)
    pad = np.iinfo(np.int32).max
    rows_n, d, nr, lr = 5000, 8, 64, 0.1
    ids = rng.permutation(rows_n)[:u].astype(np.int32)
    ids[rng.random(u) < 0.2] = pad
    if dup:
        ids[0] = ids[-1] = 11  # one row twice, in the first and last slots
    p = 3 * u
    puniq = np.sort(rng.integers(0, u, p)).astype(np.int32)  # the host's slot order
    prow = rng.integers(0, nr, p).astype(np.int32)
    prow[rng.random(p) < 0.05] = nr  # padding pairs among them
    gain = rng.uniform(0.5, 1.5, p).astype(np.float32)
    act = rng.standard_normal((nr, d)).astype(np.float32)
    table = rng.standard_normal((rows_n, d)).astype(np.float32)
    acc = rng.uniform(0.1, 1.0, (rows_n, d)).astype(np.float32)
    opt = Adagrad(lr)

    @jax.jit
    def update(i, pr, pu, pg):
        t, s = ops.backward_update(
            opt,
            jnp.asarray(table),
            {"accumulators": jnp.asarray(acc)},
            i,
            jnp.asarray(act),
            pr,
            pu,
            pg,
            jnp.int32(1),
        )
        return t, s["accumulators"]

    got_t, got_a = update(*(jnp.asarray(x) for x in (ids, prow, puniq, gain)))
    want_t, want_a = _adagrad_numpy(table, acc, ids, act, prow, puniq, gain, lr)
    np.testing.assert_allclose(np.asarray(got_t), want_t, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_a), want_a, rtol=1e-5, atol=1e-5)
    if not dup:  # the reordered block: the same sums in the same order, the same bits
        s = im.sort_mapped(*(jnp.asarray(x) for x in (ids, prow, puniq, gain)), num_rows=nr)
        ref_t, ref_a = update(*s)
        np.testing.assert_array_equal(np.asarray(got_t), np.asarray(ref_t))
        np.testing.assert_array_equal(np.asarray(got_a), np.asarray(ref_a))
