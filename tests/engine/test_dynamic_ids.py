"""Tables of raw 64-bit ids (`TableConfig.id_map`, issue 42) through the engine, against a
host reference written for clarity: a plain dict from id to row per owner shard with
LRU/LFU bookkeeping (and the admission sketch, counted as `id_map` documents it), and
float64 numpy rows and optimizer slots per id.

What the reference pins (`embedmesh.config.DynamicIds`, `embedmesh.device.id_map`):
- routing: an id's owner is `owner_of(id, N, seed)`; each source device sends each owner
  its distinct ids of the owner in order of first sighting in the source's samples (sample
  by sample); the owner sees them in source order;
- the map: hits refresh (last step, use count += the sources that sent the id); misses
  are sighted, the due ones ("candidates", first-position order) take the lowest free rows,
  after a sweep (when they outnumber the free rows) that frees max(evict_batch, needed -
  free) of the rows not used at this step, in LRU (last step, row) or LFU (uses, last
  step, row) order; candidates beyond the free rows are refused;
- rows: a row given to an id takes the table's initializer keyed by the id, its slots
  their initial values, before it is read; ids without a row read zeros, get no update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshes import mesh_of
from optimizer_reference import numpy_update_rows

import embedmesh as em
from embedmesh.device import core as core_module
from embedmesh.device import id_map
from embedmesh.host import dynamic_ids
from embedmesh.layout import stacking

CAP_PER_SHARD = 4  # rows of each shard's map: small, so steps evict
SAMPLES_PER_DEVICE = 3
IDS_PER_SAMPLE = 2
DIM = 4
SEED = 7  # the engine's seed: the fresh rows' key
HASH_SEED = 11
OPT = em.Adagrad(0.3, initial_accumulator_value=0.2)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _init(key, shape, dtype):  # key-dependent, never zero: a swapped or stale row shows
    return jax.random.uniform(key, shape, dtype, 0.5, 1.5)


# -------------------------------------------------------------------------- reference


class RefShard:
    """One owner's id map, as the docstrings say it works."""

    def __init__(self, config: id_map.IdMapConfig):
        self.config = config
        self.row_of = {}  # raw id -> row
        self.last_used = [-1] * config.capacity
        self.uses = [0] * config.capacity
        self.free = set(range(config.capacity))
        self.sketch = np.zeros((config.sketch_depth, config.sketch_width), np.int64)
        self.sightings = 0

    def map(self, received: list, step: int) -> tuple:
        """`received`: the ids sources sent, in source order (an id once a source).
        Returns ({id: row} of this call, fresh ids, stats)."""
        c = self.config
        order = list(dict.fromkeys(received))  # distinct, first-position order
        occurrences = {i: received.count(i) for i in order}
        stats = dict.fromkeys(core_module.ID_STATS, 0)
        rows = {}
        misses = []
        for i in order:
            if i in self.row_of:
                r = self.row_of[i]
                self.last_used[r] = step
                self.uses[r] += occurrences[i]
                rows[i] = r
                stats["hits"] += 1
            else:
                misses.append(i)
        if c.admit_after > 1 and misses:
            cols = np.asarray(id_map.sketch_columns(c, dynamic_ids.split_ids(np.array(misses))))
            depth = np.arange(c.sketch_depth)[:, None]
            est = self.sketch[depth, cols].min(axis=0) + 1
            np.maximum.at(self.sketch, (np.broadcast_to(depth, cols.shape), cols), est[None, :])
            self.sightings += len(misses)
            if self.sightings >= c.sketch_halve_every:
                self.sketch >>= 1
                self.sightings = 0
            candidates = [i for i, e in zip(misses, est) if e >= c.admit_after]
        else:
            candidates = misses
        stats["pending"] = len(misses) - len(candidates)
        if len(candidates) > len(self.free):
            live = sorted(self.row_of.items(), key=lambda kv: kv[1])
            evictable = [(i, r) for i, r in live if self.last_used[r] != step]
            if c.eviction == "lru":
                evictable.sort(key=lambda ir: (self.last_used[ir[1]], ir[1]))
            else:
                evictable.sort(key=lambda ir: (self.uses[ir[1]], self.last_used[ir[1]], ir[1]))
            n = min(max(c.evict_batch, len(candidates) - len(self.free)), len(evictable))
            for i, r in evictable[:n]:
                del self.row_of[i]
                self.free.add(r)
            stats["evictions"] = n
        fresh = []
        for i in candidates:
            if not self.free:
                stats["refused"] += 1
                continue
            r = min(self.free)
            self.free.remove(r)
            self.row_of[i] = r
            self.last_used[r] = step
            self.uses[r] = occurrences[i]
            rows[i] = r
            fresh.append(i)
        stats["admissions"] = len(fresh)
        stats["occupancy"] = len(self.row_of)
        return rows, fresh, stats


class Reference:
    """The engine's table of raw ids, in plain Python and float64 numpy."""

    def __init__(self, n: int, config: id_map.IdMapConfig, table_index: int, owners=None):
        self.n = n
        # (first, k): the shards owning the ids, `first + owner_of(id, k)` (plan.id_owners)
        self.owners = (0, n) if owners is None else owners
        self.shards = [RefShard(config) for _ in range(n)]
        self.values = {}  # raw id -> float64 [DIM]
        self.slots = {}  # raw id -> {slot: float64 [DIM]}
        key = jax.random.fold_in(jax.random.key(SEED), core_module._FRESH_SALT)
        self.key = jax.random.fold_in(key, table_index)
        self.step = 0

    def fresh_values(self, raw: int) -> np.ndarray:
        hi, lo = (int(x) for x in dynamic_ids.split_ids(np.array(raw)))
        k = jax.random.fold_in(jax.random.fold_in(self.key, np.uint32(hi)), np.uint32(lo))
        return np.asarray(_init(k, (1, DIM), jnp.float32)[0], np.float64)

    @staticmethod
    def gains(weights: np.ndarray, combiner: str) -> np.ndarray:
        """[B, k] gains of the entries: the combiner's scale over all of a sample's
        entries (those without a row too: the host cannot know them) times the weight."""
        w = weights.astype(np.float64)
        if combiner == "sum":
            return w
        den = w.sum(axis=1) if combiner == "mean" else np.sqrt((w * w).sum(axis=1))
        return w / den[:, None]

    def lookup(self, ids: np.ndarray, gains: np.ndarray, step: int | None = None) -> tuple:
        """ids [B, k] -> (activations [B, DIM], {id: (shard, row)}, stats), mapped at
        `step` (default: the updates applied)."""
        step = self.step if step is None else step
        b = ids.shape[0] // self.n
        first, k = self.owners
        owner = first + dynamic_ids.owner_of(ids, k, HASH_SEED)
        stats = dict.fromkeys(core_module.ID_STATS, 0)
        has_row = {}
        for j, shard in enumerate(self.shards):
            received = []  # source order; per source its distinct ids of j, first seen first
            for d in range(self.n):
                mine = ids[d * b : (d + 1) * b][owner[d * b : (d + 1) * b] == j]
                received += list(dict.fromkeys(int(i) for i in mine))
            rows, fresh, s = shard.map(received, step)
            for i in fresh:
                self.values[i] = self.fresh_values(i)
                self.slots[i] = {
                    k: np.full(DIM, v, np.float64) for k, v in OPT.slot_initial_values.items()
                }
            for i, r in rows.items():
                has_row[i] = (j, r)
            for k in stats:
                stats[k] += s[k]
        acts = np.zeros((ids.shape[0], DIM))
        for s_, row in enumerate(ids):
            for i, gain in zip(row, gains[s_]):
                if int(i) in has_row:  # no row (pending, refused): a zero row
                    acts[s_] += gain * self.values[int(i)]
        return acts, has_row, stats

    def update(self, ids: np.ndarray, gains: np.ndarray, grads: np.ndarray, has_row: dict):
        per_id = {}
        for s_, row in enumerate(ids):
            for i, gain in zip(row, gains[s_]):
                if int(i) in has_row:  # no row: no update
                    g = gain * grads[s_].astype(np.float64)
                    per_id[int(i)] = per_id.get(int(i), 0.0) + g
        for i, g in per_id.items():
            w, slots = numpy_update_rows(
                OPT,
                self.values[i][None],
                {k: v[None] for k, v in self.slots[i].items()},
                g[None],
                self.step,
            )
            self.values[i] = w[0]
            self.slots[i] = {k: v[0] for k, v in slots.items()}
        self.step += 1

    def live(self) -> dict:
        return {i: (j, r) for j, s in enumerate(self.shards) for i, r in s.row_of.items()}


# ----------------------------------------------------------------------------- engine

_ENGINES: dict = {}


def _engine(
    n: int,
    eviction: str,
    admit_after: int,
    evict_batch: int,
    sharding: str = "mod",
    combiner: str = "sum",
    pipelined: bool = False,
    static_sharding: str = "mod",
    capacity: int | None = None,
):
    """One engine a configuration (compiled once; each example starts from a fresh state).
    `capacity`: the table of raw ids' `vocabulary_size` (default `CAP_PER_SHARD * n`)."""
    in_rows = stacking.PLATFORM_SLOTS_IN_ROWS.get("cpu")  # a TPU's layout, forced in a test
    key = (n, eviction, admit_after, evict_batch, sharding, combiner, pipelined, in_rows)
    key += (static_sharding, capacity)
    if key not in _ENGINES:
        dyn = em.TableConfig(
            CAP_PER_SHARD * n if capacity is None else capacity,
            DIM,
            initializer=_init,
            combiner=combiner,
            name="dyn",
            id_map=em.DynamicIds(
                eviction=eviction, admit_after=admit_after, seed=HASH_SEED, evict_batch=evict_batch
            ),
        )
        static = em.TableConfig(16, DIM, combiner="sum", name="static")
        features = {
            "raw": em.FeatureConfig(dyn, name="raw"),
            "plain": em.FeatureConfig(static, name="plain"),
        }
        b = SAMPLES_PER_DEVICE * n
        emb = em.MeshEmbedding(
            features,
            OPT,
            pipelined,
            mesh=mesh_of(n),
            seed=SEED,
            sharding={"dyn": sharding, "static": static_sharding},
            capacities=em.Capacity(b * IDS_PER_SAMPLE, b * IDS_PER_SAMPLE),
        )
        emb.build()
        _ENGINES[key] = emb
    emb = _ENGINES[key]
    emb.flush()  # (a pipelined run's last update)
    emb.state = emb.job.init_state()
    return emb


def _run(n: int, policy: tuple, batches: list) -> None:
    """The engine against the reference, batch by batch. Pipelined (`policy`'s 7th
    field): each lookup reads the tables before the previous batch's update, its ids
    mapped at the step that update brings (the map as unpipelined); the previous
    update then applies to its own ids (an id evicted meanwhile: to its discarded
    values, never to the row's new id)."""
    emb = _engine(n, *policy)
    pipelined = emb.pipelined
    combiner = emb.plan.table_config("dyn").combiner
    t = emb.plan.table("dyn")
    owners = emb.plan.id_owners("dyn")
    ref = Reference(n, emb.core.dynamic[t.stack][1], t.index, owners)
    pending = None
    rng = np.random.default_rng(len(batches))
    for ids in batches:
        ids = np.asarray(ids, np.int64)
        plain = rng.integers(0, 16, size=(ids.shape[0], 1))
        weights = rng.uniform(0.5, 2.0, size=ids.shape).astype(np.float32)
        if combiner == "sum":  # (and unweighted)
            weights[:] = 1.0
        gains = ref.gains(weights, combiner)
        splits = np.arange(0, ids.size + 1, IDS_PER_SAMPLE)
        raw = em.RaggedTensor(ids.reshape(-1), splits)
        w = None if combiner == "sum" else em.RaggedTensor(weights.reshape(-1), splits)
        acts, preserved = emb({"raw": raw, "plain": plain}, {"raw": w, "plain": None})
        step = ref.step + (pending is not None)
        want_acts, has_row, want_stats = ref.lookup(ids, gains, step)
        np.testing.assert_allclose(np.asarray(acts["raw"]), want_acts, rtol=2e-6, atol=1e-6)
        assert emb.last_stats["dyn"].id_map == want_stats
        if pending is not None:
            ref.update(*pending)
        grads = rng.normal(size=(ids.shape[0], DIM)).astype(np.float32)
        emb.apply_gradients({"raw": jnp.asarray(grads), "plain": None}, preserved)
        pending = (ids, gains, grads, has_row)
        if not pipelined:
            ref.update(*pending)
            pending = None
        _check_state(emb, ref)  # (pipelined: the state the next lookup reads)
    if pending is not None:
        emb.flush()
        ref.update(*pending)
        _check_state(emb, ref)


def _check_state(emb, ref) -> None:
    got = emb.core.read_dynamic(emb.state, "dyn")
    assert {i: v[:2] for i, v in got.items()} == ref.live()  # the rows, the evictions
    places = [v[:2] for v in got.values()]
    assert len(set(places)) == len(places)  # no two live ids share a row
    for i, (_, _, values) in got.items():
        np.testing.assert_allclose(values, ref.values[i], rtol=2e-6, atol=1e-6)
    acc = emb.core.read_dynamic(emb.state, "dyn", "accumulators")
    for i, (_, _, values) in acc.items():
        np.testing.assert_allclose(values, ref.slots[i]["accumulators"], rtol=2e-6)


# ids from a small pool (hits, evictions) with adversarial members: equal modulo the
# shard counts and the capacities, the int64 extremes, negative ids
POOL = [
    0,
    8,
    16,
    24,
    4096,
    -1,
    -8,
    INT64_MIN,
    INT64_MAX,
    INT64_MIN + 8,
    INT64_MAX - 7,
    2**32,
    2**33,
    123456789012,
]
# (eviction, admit_after, evict_batch): one compiled engine each and device count
# (and the 2-device one a weighted mean, the 4-device one pooled with a weighted sqrtn)
POLICIES = [("lru", 1, 1, "mod", "mean"), ("lfu", 1, 2), ("lru", 2, 1)]


def _batches(n: int):
    ids = st.lists(
        st.lists(st.sampled_from(POOL), min_size=IDS_PER_SAMPLE, max_size=IDS_PER_SAMPLE),
        min_size=SAMPLES_PER_DEVICE * n,
        max_size=SAMPLES_PER_DEVICE * n,
    )
    return st.lists(ids, min_size=2, max_size=3)


@pytest.mark.parametrize("n", [1, 2])
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_engine_matches_the_reference(n, data):
    # (LFU with a sweep of 2 on one device: test_slots_in_the_rows_match_the_reference)
    policy = data.draw(st.sampled_from(POLICIES[2:] if n == 1 else POLICIES[:1]))
    _run(n, policy, data.draw(_batches(n)))


def test_slots_in_the_rows_match_the_reference(monkeypatch):
    """A TPU keeps a stack's optimizer slots in its rows (`[w | acc]`): a fresh id's row
    starts from the initializer and the slot's initial value in its columns. Pipelined
    (one device; two: `test_pipelined_matches_the_reference`): the rows the map gave
    away while an update was pending start fresh after it, slots included."""
    monkeypatch.setitem(stacking.PLATFORM_SLOTS_IN_ROWS, "cpu", 128)
    rng = np.random.default_rng(12)
    batches = [rng.choice(POOL, size=(SAMPLES_PER_DEVICE, IDS_PER_SAMPLE)) for _ in range(5)]
    policy = ("lfu", 1, 2, "mod", "sum", True)
    _run(1, policy, batches)
    emb = _engine(1, *policy)
    assert emb.plan.stack(emb.plan.table("dyn").stack).slot_columns  # in the rows indeed


def test_pipelined_matches_the_reference(tmp_path):
    """Pipelining: lookups one update stale, the map as unpipelined, and no pending
    update of an evicted id on the row its successor took (LFU with a sweep of 2 on 4
    rows a shard evicts the previous batch's rows; the reference keeps values by id).
    One device: `test_slots_in_the_rows_match_the_reference`. Then a restore mid-pipeline
    resumes the same run."""
    rng = np.random.default_rng(13)
    batches = [rng.choice(POOL, size=(SAMPLES_PER_DEVICE * 2, IDS_PER_SAMPLE)) for _ in range(5)]
    _run(2, ("lfu", 1, 2, "mod", "mean", True), batches)
    _pipelined_restore_resumes_the_same_run(tmp_path)  # (on the same compiled engine)


def _pipelined_restore_resumes_the_same_run(tmp_path):
    """A checkpoint saved with an update pending, restored (same device count): the
    lookups and the tables after it are the uninterrupted run's, bit for bit."""
    from embedmesh import checkpoint as em_ckpt

    emb = _engine(2, "lfu", 1, 2, "mod", "mean", True)
    rng = np.random.default_rng(14)
    batches = [rng.choice(POOL, size=(SAMPLES_PER_DEVICE * 2, IDS_PER_SAMPLE)) for _ in range(5)]
    grads = [rng.normal(size=(SAMPLES_PER_DEVICE * 2, DIM)).astype(np.float32) for _ in batches]

    def steps(todo):
        out = []
        for ids, g in todo:
            raw = em.RaggedTensor(ids.reshape(-1), np.arange(0, ids.size + 1, IDS_PER_SAMPLE))
            acts, preserved = emb({"raw": raw, "plain": np.zeros((ids.shape[0], 1), np.int64)})
            emb.apply_gradients({"raw": jnp.asarray(g), "plain": None}, preserved)
            out.append(np.asarray(acts["raw"]))
        return out

    steps(list(zip(batches, grads))[:2])
    em_ckpt.save(tmp_path / "c", emb)  # the second update pending
    want = steps(list(zip(batches, grads))[2:])
    want_rows = emb.core.read_dynamic(emb.observed_state(), "dyn")
    em_ckpt.restore(emb, tmp_path / "c")
    got = steps(list(zip(batches, grads))[2:])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    got_rows = emb.core.read_dynamic(emb.observed_state(), "dyn")
    assert got_rows.keys() == want_rows.keys()
    for i, (j, r, v) in got_rows.items():
        assert (j, r) == want_rows[i][:2]
        np.testing.assert_array_equal(v, want_rows[i][2])


def test_four_devices_pooled_match_the_reference():
    rng = np.random.default_rng(3)
    batches = [rng.choice(POOL, size=(SAMPLES_PER_DEVICE * 4, IDS_PER_SAMPLE)) for _ in range(3)]
    _run(4, ("lfu", 1, 1, "row_wise_pooled", "sqrtn"), batches)


@st.composite
def _family(draw):
    """Ids built to collide under a naive map: equal modulo N and modulo the capacity
    (multiples of a large power of two, plus one offset), sharing a half, at the int64
    extremes, negative."""
    kind = draw(st.sampled_from(["stride", "low_word", "high_word", "extremes", "negative"]))
    k = draw(st.integers(0, 2**20))
    if kind == "stride":
        stride = 2 ** draw(st.integers(1, 62))
        return [(k + j * stride) % 2**64 - 2**63 for j in range(6)]
    if kind == "low_word":
        return [(j << 32) | (k & 0xFFFFFFFF) for j in range(6)]
    if kind == "high_word":
        return [((k & 0x7FFFFFFF) << 32) | j for j in range(6)]
    if kind == "extremes":
        return [INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, -1, 0]
    return [-(k + 1) - j * 2**40 for j in range(6)]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_adversarial_ids_never_share_a_row(data):
    ids = data.draw(_family())
    rng = np.random.default_rng(len(ids))
    batches = [rng.permutation(np.array(ids * 2, np.int64)).reshape(6, 2) for _ in range(2)]
    _run(2, POLICIES[0], batches)


def test_host_routing_is_the_device_hash():
    ids = np.array(POOL + [2**40 + 3, -(2**62), 99], np.int64)
    for n, seed in ((1, 0), (2, HASH_SEED), (3, 1), (8, 2**32 - 1)):
        want = np.asarray(id_map.owner_of(dynamic_ids.split_ids(ids), n, seed))
        np.testing.assert_array_equal(dynamic_ids.owner_of(ids, n, seed), want)
    # uint64 ids are read bit for bit
    u = np.array([2**64 - 1, 2**63], np.uint64)
    np.testing.assert_array_equal(dynamic_ids.split_ids(u), dynamic_ids.split_ids(u.view(np.int64)))


def test_config_is_validated_and_immutable():
    with pytest.raises(ValueError, match="DynamicIds.eviction"):
        em.DynamicIds(eviction="fifo")
    with pytest.raises(ValueError, match="DynamicIds.admit_after"):
        em.DynamicIds(admit_after=0)
    with pytest.raises(ValueError, match="DynamicIds.sketch_width"):
        em.DynamicIds(sketch_width=100)
    with pytest.raises(ValueError, match="TableConfig.id_map"):
        em.TableConfig(8, 4, id_map="lru")
    d = em.DynamicIds(eviction="lfu")
    assert d == em.DynamicIds(eviction="lfu") and hash(d) == hash(em.DynamicIds(eviction="lfu"))
    with pytest.raises(AttributeError):
        d.eviction = "lru"


def _core(n, sharding="mod", vocabulary_size=8):
    from embedmesh.device.core import EmbeddingCore
    from embedmesh.layout.stacking import plan_stacking

    dyn = em.TableConfig(vocabulary_size, DIM, name="dyn", id_map=em.DynamicIds())
    other = em.TableConfig(8, DIM, name="other")
    fc = {"a": em.FeatureConfig(dyn), "b": em.FeatureConfig(other)}
    plan = plan_stacking(fc, n, sharding={"dyn": sharding})
    return plan, EmbeddingCore(plan, mesh_of(n), OPT)


def test_what_refuses_a_table_of_raw_ids():
    plan, _ = _core(2)
    assert [s.tables for s in plan.stacks] == [("dyn",), ("other",)]  # alone in its stack
    with pytest.raises(NotImplementedError, match="table dyn: a table of raw ids"):
        _core(2, "data_parallel")  # (table_wise: tests/engine/test_dynamic_ids_table_wise.py)
    with pytest.raises(ValueError, match="multiple of the 2 shards"):
        _core(2, vocabulary_size=9)


def test_the_core_refuses_a_batch_with_raw_ids():
    emb = _engine(2, *POLICIES[0])  # (the engine of the 2-device tests)
    ids = np.array([[INT64_MIN, 5]] * SAMPLES_PER_DEVICE * 2, np.int64)
    csr = emb.enqueue(
        {
            "raw": em.RaggedTensor(ids.reshape(-1), np.arange(0, ids.size + 1, 2)),
            "plain": np.zeros((ids.shape[0], 1), np.int64),
        }
    )
    with pytest.raises(ValueError, match="still carry raw ids: run map_ids"):
        emb.core.lookup(emb.state, csr)
    with pytest.raises(ValueError, match="still carry raw ids: pass the preserved_outputs"):
        emb.apply_gradients(None, csr)


def test_host_batch_of_raw_ids():
    """The host's arrays of a stack of raw ids: each partition (device d, owner j) lists
    the distinct ids of d's samples that j owns, in order of first sighting (sample by
    sample), as uint32 pairs, and the pairs point at them; overflow policies work as for
    any stack."""
    from embedmesh._runtime import PAD_ID
    from embedmesh.host.preprocess import preprocess_batch
    from embedmesh.layout.stacking import plan_stacking

    n, d_local = 4, 2  # this process drives 2 of 4 devices
    dyn = em.TableConfig(8, DIM, name="dyn", combiner="sum", id_map=em.DynamicIds(seed=HASH_SEED))
    plan = plan_stacking({"a": em.FeatureConfig(dyn, name="a")}, n)
    ids = np.array(
        [[INT64_MAX, -1], [INT64_MIN, INT64_MAX], [2**40, 2**40], [0, -(2**33)]], np.int64
    )
    feats = {"a": em.RaggedTensor(ids.reshape(-1), np.arange(0, ids.size + 1, 2))}
    csr, stats = preprocess_batch(feats, None, plan, num_devices_local=d_local, backend="numpy")
    descending = 0  # partitions whose first-sighting order is not ascending
    c = csr["dyn"]
    assert c.unique_raw_ids.shape == c.unique_ids.shape + (2,)
    owner = dynamic_ids.owner_of(ids, n, HASH_SEED)
    for d in range(d_local):
        mine, own = ids[2 * d : 2 * d + 2], owner[2 * d : 2 * d + 2]
        for j in range(n):
            k = int(c.unique_counts[d, j])
            got = id_map.join_ids(c.unique_raw_ids[d, j, :k])
            assert got.tolist() == list(dict.fromkeys(mine[own == j].tolist()))
            descending += got.tolist() != sorted(got.tolist())
            assert (c.unique_ids[d, j, k:] == PAD_ID).all()
            p = int(c.pair_counts[d, j])
            ids_of_pairs = got[c.pair_unique[d, j, :p]]
            rows = c.pair_rows[d, j, :p]
            for r, i, g in zip(rows, ids_of_pairs, c.pair_gains[d, j, :p]):
                assert g == np.count_nonzero(mine[r] == i)  # duplicates merged, gains added
    assert descending  # (the ids tell first sighting from ascending order)
    with pytest.raises(ValueError, match="stack dyn: device"):
        preprocess_batch(feats, None, plan, num_devices_local=d_local, capacities=em.Capacity(1, 1))
    _, grown = preprocess_batch(
        feats, None, plan, num_devices_local=d_local, capacities=em.Capacity(1, 1), overflow="grow"
    )
    assert grown["dyn"].grown


def test_sparse_inputs_keep_negative_and_huge_ids():
    """TensorFlow's "safe" sparse lookup drops negative ids: for a table of raw ids they are
    ids. Entries with weights <= 0 are still dropped (mean), with no range check."""
    from embedmesh.host.preprocess import preprocess_batch
    from embedmesh.layout.stacking import plan_stacking

    dyn = em.TableConfig(8, DIM, name="dyn", combiner="mean", id_map=em.DynamicIds())
    plan = plan_stacking({"a": em.FeatureConfig(dyn, name="a")}, 1)
    idx = np.array([[0, 0], [0, 1], [1, 0], [1, 1]])
    values = np.array([2**62, -5, INT64_MAX, -7], np.int64)
    sp = em.SparseTensor(indices=idx, values=values, dense_shape=(2, 3))
    w = em.SparseTensor(indices=idx, values=np.array([1, 0, 2, 1], np.float32), dense_shape=(2, 3))
    csr, _ = preprocess_batch({"a": sp}, {"a": w}, plan)  # (no numba: never needed here)
    c = csr["dyn"]
    got = id_map.join_ids(c.unique_raw_ids[0, 0, : int(c.unique_counts[0, 0])])
    assert got.tolist() == [2**62, INT64_MAX, -7]  # first seen first; -5: weight 0, dropped


def test_sequence_and_dense_features_read_their_ids_rows():
    """A sequence feature and dense ids on one table of raw ids: each position reads its
    id's row (as `read_dynamic` has it before the update), zeros where the id has none
    (refused: 5 distinct ids, 4 rows) and past a sequence's end."""
    dyn = em.TableConfig(4, DIM, initializer=_init, name="dyn", id_map=em.DynamicIds())
    features = {
        "seq": em.FeatureConfig(dyn, max_sequence_length=3, name="seq"),
        "dense": em.FeatureConfig(dyn, name="dense"),
    }
    emb = em.MeshEmbedding(features, OPT, mesh=mesh_of(1), seed=SEED)
    seq_ids = np.array([INT64_MIN, -3, INT64_MAX, -3, 9], np.int64)
    dense = np.array([[9, 2**50], [INT64_MAX, 9]], np.int64)
    seq = em.RaggedTensor(seq_ids, np.array([0, 3, 5]))
    acts, _ = emb({"seq": seq, "dense": dense})
    rows = {i: v[2] for i, v in emb.core.read_dynamic(emb.state, "dyn").items()}
    assert len(rows) == 4 and emb.last_stats["dyn"].id_map["refused"] == 1

    def row(i):
        return rows.get(int(i), np.zeros(DIM))

    want_seq = np.zeros((2, 3, DIM))
    for s_, (a, b) in enumerate([(0, 3), (3, 5)]):
        for p, i in enumerate(seq_ids[a:b]):
            want_seq[s_, p] = row(i)
    np.testing.assert_allclose(np.asarray(acts["seq"]), want_seq, rtol=1e-6)
    want_dense = np.stack([[row(i) for i in r] for r in dense])
    np.testing.assert_allclose(np.asarray(acts["dense"]), want_dense, rtol=1e-6)
