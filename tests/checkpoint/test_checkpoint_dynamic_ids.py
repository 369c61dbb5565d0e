"""Checkpoints of tables of raw 64-bit ids (issue 42, item 3): the id maps are state.

Saved with their rows and checksummed; restored on the same device count and map
configuration bit for bit (training resumes bit-identically: same rows, same
assignments, same evictions and admissions); on another device count rebuilt, every live
raw id with its row, its optimizer slots and its LRU/LFU bookkeeping moved to its owner
there (`id_map.owner_of`); a damaged map, or a table too small for the ids some new owner
gets, fails the restore and leaves the engine exactly as it was.

The uninterrupted run is the reference: its `{raw id: (values, slots, last-used step, use
count)}` at the save, and its activations and tables when training goes on.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshes import mesh_of

import embedmesh as em
from embedmesh import checkpoint as ckpt
from embedmesh.device import id_map
from embedmesh.layout import stacking

DIM = 4
CAPACITY = 16  # rows of the table in all (a multiple of 1, 2 and 4 shards)
SAMPLES = 8  # a batch: 8 samples of 2 ids, on any device count
HASH_SEED = 11
OPT = em.Adagrad(0.3, initial_accumulator_value=0.2)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# more ids than rows (evictions), adversarial members: equal modulo the shard counts and the
# capacity, the int64 extremes, negative ids
POOL = [
    0,
    16,
    32,
    64,
    4096,
    -1,
    -16,
    INT64_MIN,
    INT64_MAX,
    INT64_MIN + 16,
    INT64_MAX - 15,
]
POOL += [2**32, 2**33, 123456789012, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]


def _init(key, shape, dtype):  # key-dependent, never zero: a swapped or stale row shows
    return jax.random.uniform(key, shape, dtype, 0.5, 1.5)


_ENGINES: dict = {}


def _engine(n: int, eviction: str = "lru", admit_after: int = 1, capacity: int = CAPACITY):
    """One engine a configuration (compiled once), at a fresh state each call."""
    in_rows = stacking.PLATFORM_SLOTS_IN_ROWS.get("cpu")  # a TPU's layout, forced in a test
    key = (n, eviction, admit_after, capacity, in_rows)
    if key not in _ENGINES:
        dyn = em.TableConfig(
            capacity,
            DIM,
            initializer=_init,
            name="dyn",
            id_map=em.DynamicIds(
                eviction=eviction,
                admit_after=admit_after,
                seed=HASH_SEED,
                evict_batch=1,
            ),
        )
        emb = em.MeshEmbedding(
            {"raw": em.FeatureConfig(dyn, name="raw")},
            OPT,
            mesh=mesh_of(n),
            seed=7,
            capacities=em.Capacity(2 * SAMPLES, 2 * SAMPLES),
        )
        emb.build()
        _ENGINES[key] = emb
    emb = _ENGINES[key]
    emb.state = emb.job.init_state()
    return emb


def _step(emb, ids: np.ndarray, seed: int, train: bool = True) -> tuple:
    """One lookup (and update) of `ids` [SAMPLES, k]: (activations, id map stats)."""
    splits = np.arange(0, ids.size + 1, ids.shape[1])
    acts, preserved = emb({"raw": em.RaggedTensor(ids.reshape(-1), splits)})
    acts = np.asarray(acts["raw"])
    if train:
        grads = np.random.default_rng(seed).normal(size=acts.shape).astype(np.float32)
        emb.apply_gradients({"raw": jnp.asarray(grads)}, preserved)
    return acts, emb.last_stats["dyn"].id_map


def _leaves(emb) -> list:
    """Every array of the state, id maps included, as host numpy."""
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(emb.state))]


def _assert_same_state(a: list, b: list):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _by_id(emb) -> dict:
    """{raw id: (values, accumulators, last-used step, use count)} of the live ids."""
    values = emb.core.read_dynamic(emb.state, "dyn")
    acc = emb.core.read_dynamic(emb.state, "dyn", "accumulators")
    stack = emb.plan.table("dyn").stack
    maps = jax.device_get(emb.state.id_maps[stack]["map"])
    out = {}
    for j in range(emb.core.num_shards):
        m = jax.tree.map(lambda x, j=j: np.asarray(x)[j], maps)
        for raw, row in id_map.live_ids(m).items():
            assert values[raw][:2] == (j, row)
            out[raw] = (
                values[raw][2],
                acc[raw][2],
                int(m.last_used[row]),
                int(m.use_count[row]),
            )
    return out


def _assert_same_ids(got: dict, want: dict, bookkeeping: bool = True):
    assert set(got) == set(want)
    for i, (values, acc, last, uses) in want.items():
        assert got[i][0].tobytes() == values.tobytes(), i
        assert got[i][1].tobytes() == acc.tobytes(), i
        if bookkeeping:
            assert got[i][2:] == (last, uses), i


def _batches(rng, count: int, pool=POOL, width: int = 2) -> list:
    return [rng.choice(np.array(pool, np.int64), size=(SAMPLES, width)) for _ in range(count)]


POLICIES = [("lru", 1), ("lfu", 1), ("lru", 2), ("lfu", 2)]


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**16),
)
def test_same_device_count_resumes_bit_identically(tmp_path_factory, n, policy, seed):
    """Train, save, train on (the reference); restore into the engine and train the same
    steps again: the same state at the save (maps, rows, slots, key, step), then the same
    activations, stats (admissions, evictions, pending) and state, bit for bit."""
    emb = _engine(n, *policy)
    rng = np.random.default_rng(seed)
    before, after = _batches(rng, 4), _batches(rng, 3)
    for k, ids in enumerate(before):
        _step(emb, ids, k)
    path = tmp_path_factory.mktemp("ckpt")
    assert ckpt.save(path, emb)
    saved = _leaves(emb)
    want = [_step(emb, ids, 10 + k) for k, ids in enumerate(after)]
    assert sum(s["evictions"] for _, s in want) > 0 or policy[1] == 2  # the map is full
    final = _leaves(emb)
    emb.state = emb.job.init_state()  # (a restore into a fresh state as well)
    assert ckpt.restore(emb, path) == len(before)
    _assert_same_state(_leaves(emb), saved)
    for k, ids in enumerate(after):
        acts, stats = _step(emb, ids, 10 + k)
        assert acts.tobytes() == want[k][0].tobytes()
        assert stats == want[k][1]
    _assert_same_state(_leaves(emb), final)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    counts=st.sampled_from([(4, 2), (1, 4), (2, 1), (4, 1), (2, 4)]),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**16),
)
def test_another_device_count_moves_every_live_id(tmp_path_factory, counts, policy, seed):
    """Saved on n_old devices, restored on n_new: the same {raw id: values, slots, last-used
    step, use count}, each id on its owner (`owner_of`, checked by `read_dynamic`'s places),
    the same lookups; training on over the live ids (hits only: the two meshes' owners
    evict differently) keeps the tables equal to the uninterrupted run's."""
    n_old, n_new = counts
    old = _engine(n_old, *policy)
    rng = np.random.default_rng(seed)
    # as many distinct ids as a shard of 4 devices has rows: they fit any owner
    pool = list(rng.choice(np.array(POOL, np.int64), size=4, replace=False))
    for k, ids in enumerate(_batches(rng, 3, pool)):
        _step(old, ids, k)
    path = tmp_path_factory.mktemp("ckpt")
    assert ckpt.save(path, old)
    want = _by_id(old)
    assert want  # ids were admitted
    new = _engine(n_new, *policy)
    _step(new, rng.integers(10**12, 10**13, size=(SAMPLES, 2)), 99)  # ids that must go
    assert ckpt.restore(new, path) == 3
    got = _by_id(new)
    _assert_same_ids(got, want)
    live = np.array(sorted(want), np.int64)
    owners = np.asarray(id_map.owner_of(id_map.split_ids(live), n_new, HASH_SEED))
    places = new.core.read_dynamic(new.state, "dyn")
    assert [places[int(i)][0] for i in live] == list(owners)
    # each shard's rows compacted: 0, 1, ... in use
    for j in range(n_new):
        rows = sorted(places[int(i)][1] for i in live[owners == j])
        assert rows == list(range(len(rows)))
    # lookups of every live id (one a sample: the activation is its row), then training on
    ids = np.resize(live, SAMPLES)[:, None]
    a, sa = _step(old, ids, 20, train=False)
    b, sb = _step(new, ids, 20, train=False)
    assert a.tobytes() == b.tobytes()
    assert (sa["hits"], sa["admissions"], sa["evictions"]) == (sb["hits"], 0, 0)
    for k in range(2):
        ids = rng.choice(live, size=(SAMPLES, 2))
        a, _ = _step(old, ids, 30 + k)
        b, _ = _step(new, ids, 30 + k)
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    got, want = _by_id(new), _by_id(old)
    assert set(got) == set(want)
    for i in want:
        np.testing.assert_allclose(got[i][0], want[i][0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[i][1], want[i][1], rtol=1e-6, atol=1e-6)


def test_recut_keeps_the_lru_order_and_the_pending_sightings(tmp_path):
    """4 devices -> 1: a full table evicts, at the next miss, the least recently used id
    of all four saved shards; an id sighted once (admit_after=2) before the save is
    admitted at its first sighting after it (the sketch merged, never under-counting)."""
    old = _engine(4, "lru", 2)
    ids = [np.array(POOL[k : k + 16], np.int64).reshape(SAMPLES, 2) for k in range(2)]
    for k in range(2):  # every id sighted twice: admitted at its second step
        for b in ids[:2]:
            _step(old, b, k)
    pending = np.array([2**50 + 3], np.int64)
    _step(
        old,
        np.resize(np.concatenate([pending, ids[0].reshape(-1)[:3]]), (SAMPLES, 2)),
        9,
    )
    assert pending[0] not in _by_id(old)  # sighted once: pending
    ckpt.save(tmp_path, old)
    want = _by_id(old)
    steps = {w[2] for w in want.values()}
    assert len(want) > 4 and len(steps) > 1  # ids of several shards and steps
    new = _engine(1, "lru", 2, capacity=len(want))  # full once restored
    ckpt.restore(new, tmp_path)
    _assert_same_ids(_by_id(new), want)
    _, stats = _step(new, np.resize(pending, (SAMPLES, 1)), 10)
    assert (stats["admissions"], stats["evictions"]) == (1, 1)  # at its second sighting
    got = _by_id(new)
    assert pending[0] in got
    gone = set(want) - set(got)  # the least recently used id made room
    assert len(gone) == 1 and want[gone.pop()][2] == min(steps)


def _train(n: int, seed: int, steps: int = 3, capacity: int = CAPACITY):
    emb = _engine(n, capacity=capacity)
    for k, ids in enumerate(_batches(np.random.default_rng(seed), steps)):
        _step(emb, ids, k)
    return emb


def _flip_a_byte(item, key: str):
    """Flip one bit of a stored chunk in the middle (the maps' chunks are small: stored
    inline in OCDBT's b-tree, so they are rewritten through its key-value store)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    value = bytearray(kv.read(key).result().value)
    value[len(value) // 2] ^= 0x10
    kv.write(key, bytes(value)).result()


def test_a_damaged_id_map_leaves_the_engine_untouched(tmp_path):
    """Flipped bytes in a stored map array fail its checksum, on the same device count and
    on another one, and nothing of the engine changes; the intact checkpoint restores."""
    emb = _train(2, 1)
    ckpt.save(tmp_path / "good", emb)
    ckpt.save(tmp_path / "bad", emb)
    _flip_a_byte(tmp_path / "bad" / "3" / "embedding", "id_maps.dyn.index/1.0.0.0")
    for n, capacity in ((2, CAPACITY), (4, 2 * CAPACITY)):  # as saved; rebuilt
        target = _train(n, 2, steps=2, capacity=capacity)  # another state
        before = _leaves(target)
        with pytest.raises(
            ValueError, match=r"the id map's array 'index' of table dyn .* is corrupted"
        ):
            ckpt.restore(target, tmp_path / "bad")
        _assert_same_state(_leaves(target), before)
        ckpt.restore(target, tmp_path / "good")
        _assert_same_ids(_by_id(target), _by_id(emb))


def test_a_table_too_small_for_the_live_ids_leaves_the_engine_untouched(tmp_path):
    """A full table of 1 device restored onto 4 (owners never exactly balanced here) or into
    a smaller capacity: a ValueError naming the table and the numbers, nothing changed;
    a larger capacity takes every id."""
    emb = _train(1, 3, steps=4)
    want = _by_id(emb)
    assert len(want) == CAPACITY
    ckpt.save(tmp_path, emb)
    owners = np.bincount(
        np.asarray(id_map.owner_of(id_map.split_ids(np.array(sorted(want))), 4, HASH_SEED)),
        minlength=4,
    )
    assert owners.max() > CAPACITY // 4
    for n, capacity in ((4, CAPACITY), (1, CAPACITY // 2)):
        target = _train(n, 4, steps=2) if capacity == CAPACITY else _engine(n, capacity=capacity)
        before = _leaves(target)
        with pytest.raises(
            ValueError,
            match=r"table dyn: its checkpoint holds 16 live ids \(on 1 shards of 16 rows\); "
            r"on \d shards of \d+ rows .* shard \d would own \d+ of them, more than its \d+ rows",
        ):
            ckpt.restore(target, tmp_path)
        _assert_same_state(_leaves(target), before)
    bigger = _engine(4, capacity=4 * CAPACITY)
    ckpt.restore(bigger, tmp_path)
    _assert_same_ids(_by_id(bigger), want)


@pytest.mark.parametrize("n", [1, 4])
def test_load_tables_gives_each_live_id_with_its_row(tmp_path, n):
    """`load_tables` of a table of raw ids: its `RawIdTable` (the live ids of every
    shard's saved map, each with its row; the checkpoint's step), with or without the
    feature config, equal to the engine's rows by id."""
    emb = _train(n, 20 + n)
    ckpt.save(tmp_path, emb)
    want = _by_id(emb)
    (dyn,) = emb.embedding_tables  # the engine's TableConfig
    for features in (None, {"raw": em.FeatureConfig(dyn, name="raw")}):
        ((cfg, table),) = ckpt.load_tables(tmp_path, feature_config=features).items()
        assert isinstance(table, em.RawIdTable) and cfg.id_map is not None, table
        assert cfg.id_map.seed == HASH_SEED and cfg.name == "dyn"
        assert (table.capacity, table.dim, table.step) == (CAPACITY, DIM, 3)
        assert sorted(table.ids.tolist()) == sorted(want) and len(want) > 4
        for i, row in zip(table.ids.tolist(), table.rows):
            assert row.tobytes() == want[i][0].tobytes(), i
        assert not table.padded[len(table) :].any()


def test_raw_ids_and_plain_tables_do_not_mix(tmp_path):
    """A table of raw ids is never restored from or into a table of ids in [0, V), nor
    loaded as one by load_tables."""
    emb = _train(1, 5, steps=1)
    ckpt.save(tmp_path / "dyn", emb)
    plain_features = {"raw": em.FeatureConfig(em.TableConfig(CAPACITY, DIM, name="dyn"))}
    (dyn,) = emb.embedding_tables
    plain = em.MeshEmbedding(
        plain_features,
        OPT,
        mesh=mesh_of(1),
    )
    with pytest.raises(ValueError, match="table dyn is a table of raw ids in the checkpoint"):
        ckpt.restore(plain, tmp_path / "dyn")
    ckpt.save(tmp_path / "plain", plain)
    # version 3 where a table of raw ids is (an embedmesh without id maps, or with the
    # layout of version 2's, refuses it)
    assert ckpt.read_metadata(tmp_path / "dyn")["format_version"] == 3
    assert ckpt.read_metadata(tmp_path / "plain")["format_version"] == 1
    with pytest.raises(ValueError, match="table dyn is a table of raw ids .* here"):
        ckpt.restore(emb, tmp_path / "plain")
    for item, features, message in [
        ("dyn", plain_features, "checkpoint's is a table of raw ids .* config's is not"),
        ("plain", {"raw": em.FeatureConfig(dyn)}, "checkpoint's is not a table of raw .* is"),
    ]:
        with pytest.raises(ValueError, match=f"table dyn: the {message}"):
            ckpt.load_tables(tmp_path / item, feature_config=features)


def test_the_functional_core_restores_the_maps_and_keeps_the_given_state(tmp_path):
    """`core_save` / `core_restore`: the restored state is the saved one bit for bit (maps,
    key, rows, slots, step); the state given to `core_restore` is not changed."""
    emb = _train(2, 6)
    saved = _leaves(emb)
    ckpt.core_save(tmp_path, emb.core, emb.state)
    fresh = emb.job.init_state()
    before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(fresh))]
    restored = ckpt.core_restore(emb.core, fresh, tmp_path)
    assert restored.step == 3
    _assert_same_state(
        [np.asarray(x) for x in jax.tree.leaves(jax.device_get(restored.state))], saved
    )
    _assert_same_state([np.asarray(x) for x in jax.tree.leaves(jax.device_get(fresh))], before)


def test_slots_kept_in_the_rows_are_rebuilt_with_their_ids(tmp_path, monkeypatch):
    """Into a TPU's layout (the accumulators in the rows, `[w | acc]`) on another device
    count: every id's values and accumulators in its new row's columns."""
    emb = _train(2, 8)
    want = _by_id(emb)
    ckpt.save(tmp_path, emb)
    monkeypatch.setitem(stacking.PLATFORM_SLOTS_IN_ROWS, "cpu", 128)
    target = _engine(1)
    assert target.plan.stack(target.plan.table("dyn").stack).slot_columns  # in the rows
    ckpt.restore(target, tmp_path)
    _assert_same_ids(_by_id(target), want)


def test_the_stored_form_names_the_maps_fields_and_words():
    """`id_map_format` (device-free, for serving) describes the engine's maps: the
    fields of `IdMapState`, the words of a slot, the raw id of a pair of words."""
    import dataclasses

    from embedmesh.checkpoint import id_map_format as fmt
    from embedmesh.device.ops import id_hash

    fields = tuple(f.name for f in dataclasses.fields(id_map.IdMapState) if f.name != "config")
    assert fields == fmt.MAP_FIELDS
    assert (fmt.TAG, fmt.ROW) == (id_hash.TAG, id_hash.ROW) == (0, id_map.ROW_WORD)
    ids = np.array(POOL + [INT64_MIN + 1, -(2**31), 2**31], np.int64)
    pairs = np.asarray(id_map.split_ids(ids))
    assert fmt.join_ids(pairs).tolist() == ids.tolist() == id_map.join_ids(pairs).tolist()


V2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "raw_ids_v2")


@pytest.mark.parametrize("n", [2, 1])
def test_a_checkpoint_of_format_version_2_is_rebuilt_into_this_layout(n, tmp_path):
    """A checkpoint of the maps' layout before this one (format version 2, written by
    bdf052f: `support/make_checkpoint_v2.py`, 2 devices, LFU): restored on 2 devices (as
    saved) and on 1, every live id comes back with the values, accumulators, last-used
    step and use count its writer recorded (`expected.npz`), found by this layout's
    index; training goes on; serving's `load_tables` reads it alike."""
    want = np.load(os.path.join(V2, "expected.npz"))
    path = os.path.join(V2, "checkpoint")
    assert ckpt.read_metadata(path)["format_version"] == 2
    emb = _engine(n, "lfu")
    assert ckpt.restore(emb, path) == 5
    got = _by_id(emb)
    assert sorted(got) == want["ids"].tolist()
    for k, i in enumerate(want["ids"].tolist()):
        assert got[i][0].tobytes() == want["values"][k].tobytes(), i
        assert got[i][1].tobytes() == want["accumulators"][k].tobytes(), i
        assert got[i][2:] == (want["last_used"][k], want["use_count"][k]), i
    acts, stats = _step(emb, np.resize(want["ids"], (SAMPLES, 2)), 0)  # hits only
    assert stats["hits"] > 0 and stats["admissions"] == 0
    rows = {int(i): got[int(i)][0] for i in want["ids"]}
    first = np.resize(want["ids"], (SAMPLES, 2))
    assert np.allclose(acts, [(rows[a] + rows[b]) / 2 for a, b in first])  # the mean combiner
    # saved again: this layout's format, restored as it is
    assert ckpt.save(tmp_path, emb)
    assert ckpt.read_metadata(tmp_path)["format_version"] == 3
    ((cfg, table),) = ckpt.load_tables(path).items()
    assert isinstance(table, em.RawIdTable) and cfg.id_map is not None and table.step == 5
    assert table.ids.tolist() == want["ids"].tolist()  # (sorted)
    for k, row in enumerate(table.rows):
        assert row.tobytes() == want["values"][k].tobytes()
