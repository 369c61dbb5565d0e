"""The numba path of tables of raw ids (`host.numba_dynamic`) against the numpy path,
the oracle (itself pinned by tests/engine/test_dynamic_ids.py): bit-identical arrays
and statistics on any ids, weights, features sharing a table, devices, capacities."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedmesh as em
from embedmesh.host import dynamic_ids
from embedmesh.host.preprocess import numba_available, preprocess_batch
from embedmesh.inputs import RaggedTensor
from embedmesh.layout.stacking import plan_stacking

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba not available")

I64 = np.iinfo(np.int64)
POOL = [0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1, 2**32, -(2**32), 2**40 + 3, 7, 8]
FIELDS = ("unique_ids", "unique_counts", "pair_rows", "pair_unique", "pair_gains", "pair_counts")

ids_strategy = st.one_of(
    st.sampled_from(POOL),  # extremes and duplicates
    st.integers(I64.min, I64.max),
    st.integers(-20, 20),
    st.integers(0, 31).map(lambda k: k * 2**32),  # strided: equal low words
)


def _kernels():
    from embedmesh.host import numba_dynamic

    return numba_dynamic


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_numba_path_is_the_numpy_path(data):
    n = data.draw(st.sampled_from([1, 2, 4]), "shards")
    d_local = data.draw(st.sampled_from(sorted({1, n})), "local devices")
    nfeat = data.draw(st.integers(1, 3), "features sharing the table")
    combiner = data.draw(st.sampled_from(["sum", "mean", "sqrtn"]), "combiner")
    seed = data.draw(st.integers(0, 2**32 - 1), "hash seed")
    dyn = em.TableConfig(4 * n, 4, name="dyn", combiner=combiner, id_map=em.DynamicIds(seed=seed))
    static = em.TableConfig(16, 4, name="s")  # a static stack alongside
    fc = {f"f{i}": em.FeatureConfig(dyn, name=f"f{i}") for i in range(nfeat)}
    fc["s"] = em.FeatureConfig(static, name="s")
    plan = plan_stacking(fc, n)
    batch = 2 * d_local
    feats, weights = {}, {}
    for i in range(nfeat):
        lengths = data.draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
        ids = data.draw(st.lists(ids_strategy, min_size=sum(lengths), max_size=sum(lengths)))
        feats[f"f{i}"] = RaggedTensor.from_row_lengths(np.array(ids, np.int64), lengths)
        weighted = data.draw(st.booleans(), "weighted")
        w = data.draw(
            st.lists(
                st.sampled_from([0.0, 0.5, 1.0, -2.0, 3.25]),
                min_size=sum(lengths),
                max_size=sum(lengths),
            )
        )
        weights[f"f{i}"] = (
            RaggedTensor.from_row_lengths(np.array(w, np.float32), lengths) if weighted else None
        )
    feats["s"] = np.arange(batch, dtype=np.int64).reshape(batch, 1) % 16
    weights["s"] = None
    cap = data.draw(
        st.sampled_from([None, em.Capacity(2, 1), em.Capacity(4, 3), em.Capacity(64, 64)]),
        "capacity",
    )
    overflow = "error" if cap is None else data.draw(st.sampled_from(["drop", "grow"]))
    got = {}
    for backend in ("numba", "numpy"):
        got[backend] = preprocess_batch(
            feats,
            weights,
            plan,
            num_devices_local=d_local,
            capacities=cap,
            overflow=overflow,
            backend=backend,
            num_threads=data.draw(st.sampled_from([1, 2]), "threads"),
        )
    (fast, fast_stats), (slow, slow_stats) = got["numba"], got["numpy"]
    assert fast.keys() == slow.keys()
    for name in slow:
        a, b = fast[name], slow[name]
        for f in FIELDS + (("unique_raw_ids",) if name == "dyn" else ()):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and x.shape == y.shape, (name, f)
            np.testing.assert_array_equal(x, y, err_msg=f"{name}.{f}")
    for name, st_slow in slow_stats.stacks.items():
        st_fast = fast_stats.stacks[name]
        for f in ("ids_per_partition", "unique_ids_per_partition"):
            np.testing.assert_array_equal(getattr(st_fast, f), getattr(st_slow, f))
        assert (st_fast.num_ids, st_fast.dropped_ids, st_fast.capacity, st_fast.grown) == (
            st_slow.num_ids,
            st_slow.dropped_ids,
            st_slow.capacity,
            st_slow.grown,
        )


def test_numba_path_runs_the_kernels(monkeypatch):
    """`backend="auto"` with numba takes the kernels for a stack of raw ids."""
    k = _kernels()
    calls = []
    real = k.raw_codes
    monkeypatch.setattr(k, "raw_codes", lambda *a: calls.append(1) or real(*a))
    dyn = em.TableConfig(4, 4, name="dyn", id_map=em.DynamicIds())
    plan = plan_stacking({"a": em.FeatureConfig(dyn, name="a")}, 1)
    preprocess_batch({"a": np.array([[I64.min], [5]], np.int64)}, None, plan)
    assert calls == [1]


def _reference_codes(ids: list, splits: list, rows_per_device: list, devices: int):
    """Plain Python: each entry's code (a list a feature) and the distinct ids by code,
    codes given device by device, each device's entries in order (features in order,
    each over the device's rows) at an id's first sighting on the device."""
    codes = [[None] * len(f) for f in ids]
    by_code = []
    for d in range(devices):
        seen = {}
        for f, (s, rpd) in enumerate(zip(splits, rows_per_device)):
            for e in range(s[d * rpd], s[(d + 1) * rpd]):
                i = int(ids[f][e])
                if i not in seen:
                    seen[i] = len(by_code)
                    by_code.append(i)
                codes[f][e] = seen[i]
    return codes, by_code


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_raw_codes_against_a_reference(data):
    """`raw_codes`' keys (`owner * K + code`) and distinct ids, and the numpy path's codes
    (`dynamic_ids.first_sighting_codes`), against the plain reference: drawn ids
    (extremes, negatives, equal low words, runs equal modulo a power of two) on 1-3
    devices, 1-3 features of several rows a device, 1, 3 or 4 shards."""
    devices = data.draw(st.integers(1, 3), "devices")
    n = data.draw(st.sampled_from([1, 3, 4]), "shards")
    spread = data.draw(st.sampled_from([1, 2**20, 2**40, 2**64 - 1]), "spread")
    ids, splits, rpds = [], [], []
    for _ in range(data.draw(st.integers(1, 3), "features")):
        rpd = data.draw(st.integers(1, 3), "rows a device")
        lengths = data.draw(
            st.lists(st.integers(0, 6), min_size=rpd * devices, max_size=rpd * devices)
        )
        drawn = data.draw(st.lists(ids_strategy, min_size=sum(lengths), max_size=sum(lengths)))
        run = (np.arange(len(drawn), dtype=np.uint64) * np.uint64(spread)).view(np.int64)
        pick = np.array(
            data.draw(st.lists(st.booleans(), min_size=len(drawn), max_size=len(drawn))), bool
        )
        ids.append(np.where(pick, run, np.array(drawn, np.int64)).astype(np.int64))
        splits.append(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        rpds.append(rpd)
    want_codes, want_uniq = _reference_codes(ids, splits, rpds, devices)
    seed = data.draw(st.integers(0, 2**32 - 1), "hash seed")
    owner = {i: int(dynamic_ids.owner_of(np.array([i], np.int64), n, seed)[0]) for i in want_uniq}
    k = len(want_uniq)

    flat = np.concatenate(ids)
    bases = np.cumsum([0] + [len(s) for s in splits])[:-1]  # each feature's first split
    starts = np.cumsum([0] + [len(f) for f in ids])[:-1]  # ... and first entry
    fmeta = np.array([[b, r, 0, 0] for b, r in zip(bases, rpds)], np.int64)
    flat_splits = np.concatenate([s + st_ for s, st_ in zip(splits, starts)])
    keys, uniq = _kernels().raw_codes(
        flat, flat_splits, fmeta, devices, n, *dynamic_ids.owner_words(seed)
    )
    assert uniq.tolist() == want_uniq
    want_keys = [owner[want_uniq[c]] * k + c for f in want_codes for c in f]
    assert keys.tolist() == want_keys

    codes, uniq = dynamic_ids.first_sighting_codes(ids, devices, rpds, splits)
    assert uniq.tolist() == want_uniq
    assert [c.tolist() for c in codes] == want_codes
