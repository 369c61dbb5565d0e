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


@pytest.mark.parametrize("n", [1, 3, 4])
def test_raw_codes_against_numpy(n):
    """Each entry's key `owner * K + rank` and the distinct ids, against `np.unique` and
    the numpy routing (`owner_of`, the device's hash: tests/engine/test_dynamic_ids.py);
    ids clustered in one bucket of the range sort by the radix fallback."""
    rng = np.random.default_rng(n)
    cases = [
        np.zeros(0, np.int64),
        np.array(POOL * 3, np.int64),
        rng.integers(I64.min, I64.max, 5000, dtype=np.int64, endpoint=True),
        rng.integers(0, 300, 5000).astype(np.int64),
        np.concatenate([rng.integers(0, 1000, 2000), [I64.max, I64.min]]).astype(np.int64),
        np.arange(0, 3000, dtype=np.int64) * 2**40,
    ]
    for seed, ids in enumerate(cases):
        words = dynamic_ids.owner_words(seed)
        keys, uniq = _kernels().raw_codes(ids, n, *words)
        want, inverse = np.unique(ids, return_inverse=True)
        np.testing.assert_array_equal(uniq, want)
        owner = dynamic_ids.owner_of(want, n, seed)
        np.testing.assert_array_equal(keys, (owner * want.size + np.arange(want.size))[inverse])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(ids_strategy, max_size=300),
    spread=st.sampled_from([0, 1, 2**20, 2**40, 2**64 - 1]),
    copies=st.integers(0, 200),
    n=st.sampled_from([1, 2, 3]),
)
def test_raw_codes_sort_against_numpy(ids, spread, copies, n):
    """The sort of the distinct ids (`numba_dynamic._sorted`: buckets over the range,
    one insertion pass, the radix fallback past 64 a bucket), against `np.unique`:
    drawn ids (extremes, negatives, equal low words) with `copies` runs of ids equal
    modulo a power of two (`spread` apart, wrapping: a crowded bucket past 64 takes the
    fallback, one at 64 or below the insertion pass)."""
    base = np.array(ids, np.int64)
    run = (np.arange(copies, dtype=np.uint64) * np.uint64(spread)).view(np.int64)
    arr = np.concatenate([base, run, base[::-1]])
    words = dynamic_ids.owner_words(7)
    keys, uniq = _kernels().raw_codes(arr, n, *words)
    want, inverse = np.unique(arr, return_inverse=True)
    np.testing.assert_array_equal(uniq, want)
    owner = dynamic_ids.owner_of(want, n, 7)
    np.testing.assert_array_equal(keys, (owner * want.size + np.arange(want.size))[inverse])
