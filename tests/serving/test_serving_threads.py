"""One loaded model called from many threads at once gives what one thread gives.

`serving_embedding_lookup` on a table dict (float32 and int8 tables), an
`EmbeddingForServing`, and a `load_serving` export: each request is answered once
in this thread, then every request several times from 4 threads at once (each
thread in its own order, so different shapes overlap), and each concurrent answer
must equal the single-thread one bit for bit. Outputs are checked while other
threads still run, and held across requests, so an output buffer handed to two
requests, or scratch state shared by two, shows as a wrong value. No timing.
"""

import threading
import time

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, SparseTensor, TableConfig
from embedmesh.serving import (
    EmbeddingForServing,
    Ragged,
    export_serving,
    load_serving,
    quantize_tables,
)

THREADS = 4
REPEATS = 3

A = TableConfig(vocabulary_size=300, dim=16, combiner="sum", name="a")
B = TableConfig(vocabulary_size=200, dim=8, combiner="mean", name="b")
C = TableConfig(vocabulary_size=100, dim=32, combiner="sqrtn", name="c")
FEATURES = {"fa": FeatureConfig(A), "fb": FeatureConfig(B), "fc": FeatureConfig(C)}


def _tables():
    rng = np.random.default_rng(7)
    return {t: rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32) for t in (A, B, C)}


TABLES = _tables()
TABLES_INT8 = quantize_tables(TABLES, "int8")


def _ragged(rng, batch, vocab, max_len):
    lengths = rng.integers(0, max_len + 1, size=batch)
    ids = rng.integers(0, vocab, size=int(lengths.sum())).astype(np.int64)
    return RaggedTensor.from_row_lengths(ids, lengths)


def _sparse(rng, batch, vocab, max_len):
    idx, vals = [], []
    for r in range(batch):
        cols = np.sort(rng.choice(max_len, size=rng.integers(0, max_len + 1), replace=False))
        idx += [(r, int(c)) for c in cols]
        vals += list(rng.integers(0, vocab, size=len(cols)))
    indices = np.array(idx, np.int64).reshape(-1, 2)
    return SparseTensor(indices, np.array(vals, np.int64), (batch, max_len))


def _request(seed, batch, max_len, tables=(A, B, C)):
    """fa ragged, fb 2-D sparse, fc dense ids [batch] (of `tables`' vocabularies)."""
    rng = np.random.default_rng(seed)
    return {
        "fa": _ragged(rng, batch, tables[0].vocabulary_size, max_len),
        "fb": _sparse(rng, batch, tables[1].vocabulary_size, max_len),
        "fc": rng.integers(0, tables[2].vocabulary_size, size=batch).astype(np.int64),
    }


def _same(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def _concurrently(call, requests, expected):
    """Every request REPEATS times from THREADS threads, each in its own order; every
    output checked against `expected` (the one-thread answers) with the thread's
    previous outputs still held."""
    errors, start = [], threading.Barrier(THREADS)

    def worker(t):
        try:
            order = np.random.default_rng(t).permutation(len(requests) * REPEATS)
            start.wait()
            held = []
            for j in order:
                i = int(j) % len(requests)
                out = call(requests[i])
                _same(out, expected[i])
                held = [*held[-2:], (i, out)]  # older outputs stay referenced, then freed
                for k, old in held:
                    _same(old, expected[k])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


shapes = st.lists(
    st.tuples(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 8, 64]), st.integers(1, 12)),
    min_size=2,
    max_size=5,
)
SETTINGS = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(params=["alone", "release", "hold", "pool", "numpy"])
def pool(request):
    """release: every request releases the GIL while its kernels run (by default small
    ones keep it while no other thread is in a lookup or entered one lately); hold: a
    request keeps it unless others are serving, whatever its size; pool: every request
    asks the C++ pool for 4 threads (one entry a thread is enough), so requests find it
    busy or take it while others run; numpy: outputs are the output pool's buffers
    themselves (`set_numpy_outputs`)."""
    from embedmesh.serving import settings as serving_settings

    if request.param == "alone":
        yield
        return
    if request.param == "numpy":
        previous = serving_settings.set_numpy_outputs(True)
        yield
        serving_settings.set_numpy_outputs(previous)
        return
    if request.param in ("release", "hold"):
        previous = serving_settings.set_hold_gil_below(0 if request.param == "release" else 2**62)
        yield
        if previous is not None:
            serving_settings.set_hold_gil_below(previous)
        return
    from embedmesh.serving import native, set_host_threads

    lib = native.library()
    if lib is None:
        pytest.skip(native.reason())
    previous_threads = set_host_threads(4)
    previous_min = lib.EmServingSetMinEntriesPerThread(1)
    yield
    lib.EmServingSetMinEntriesPerThread(previous_min)
    set_host_threads(previous_threads)


@pytest.mark.parametrize("tables", [TABLES, TABLES_INT8], ids=["float32", "int8"])
@SETTINGS
@given(shapes=shapes)
def test_lookup_from_threads(pool, tables, shapes):
    requests = [_request(*s) for s in shapes]

    def call(r):
        return em.serving_embedding_lookup(r, None, tables, FEATURES)

    expected = [call(r) for r in requests]
    _concurrently(call, requests, expected)


def test_in_flight_count_returns_to_zero():
    """The GIL policy's count of threads inside a lookup: back to 0 after threads, after
    a request that raised, and after a traced one."""
    from embedmesh.serving import request as serving_request

    requests = [_request(s, b, 6) for s, b in enumerate((1, 8, 64))]
    expected = [em.serving_embedding_lookup(r, None, TABLES, FEATURES) for r in requests]
    _concurrently(
        lambda r: em.serving_embedding_lookup(r, None, TABLES, FEATURES), requests, expected
    )
    assert serving_request.in_flight() == 0
    bad = {"fa": em.RaggedTensor(np.array([A.vocabulary_size]), np.array([0, 1]))}
    with pytest.raises(ValueError):
        em.serving_embedding_lookup(bad, None, TABLES, FEATURES)
    assert serving_request.in_flight() == 0
    traced = jax.jit(lambda ids: em.serving_embedding_lookup({"fa": ids}, None, TABLES, FEATURES))
    traced(np.zeros((2, 3), np.int32))
    assert serving_request.in_flight() == 0


def test_gil_stats_count_requests():
    """The compiled path's counters: every fast request counted, and with every request
    releasing the GIL (hold_gil_below(0)) each one counted as released, its kernels'
    time without the GIL not negative; the thread then holds the GIL again."""
    from embedmesh.serving import request as serving_request
    from embedmesh.serving import settings as serving_settings

    if serving_request.compiled is None:
        pytest.skip("the compiled request path was not built")
    requests = [_request(s, b, 6) for s, b in enumerate((1, 8, 64))]
    previous = serving_settings.set_hold_gil_below(0)
    try:
        before = serving_settings.gil_stats()
        for r in requests:
            em.serving_embedding_lookup(r, None, TABLES, FEATURES)
        after = serving_settings.gil_stats()
    finally:
        serving_settings.set_hold_gil_below(previous)
    assert after[0] - before[0] == len(requests)
    assert after[1] - before[1] == len(requests)
    assert after[2] >= before[2]
    assert serving_request.in_flight() == 0


def test_gil_setting_returns_previous_values():
    from embedmesh.serving import request as serving_request
    from embedmesh.serving import settings as serving_settings

    if serving_request.compiled is None:
        assert serving_settings.set_hold_gil_below(5) is None
        return
    previous = serving_settings.set_hold_gil_below(11)
    assert serving_settings.set_hold_gil_below(-1) == 11  # negatives are 0
    assert serving_settings.set_hold_gil_below(previous) == 0


@pytest.mark.parametrize("tables", [TABLES, TABLES_INT8], ids=["float32", "int8"])
def test_numpy_outputs_equal_jax_outputs(tables):
    from embedmesh.serving.lookup import set_numpy_outputs

    requests = [_request(s, b, 7) for s, b in enumerate((1, 8, 64))]
    requests.append({"fa": requests[0]["fa"]})  # a subset of the features
    want = [em.serving_embedding_lookup(r, None, tables, FEATURES) for r in requests]
    previous = set_numpy_outputs(True)
    try:
        got = [em.serving_embedding_lookup(r, None, tables, FEATURES) for r in requests]
        # the general path too (a float64 table is converted there, never fast)
        general = None
        if tables is TABLES:
            t64 = {**tables, C: TABLES[C].astype(np.float64)}
            with pytest.warns(UserWarning, match="float64"):
                general = em.serving_embedding_lookup(requests[0], None, t64, FEATURES)
    finally:
        set_numpy_outputs(previous)
    for g, w in zip(got, want):
        assert all(type(x) is np.ndarray and x.dtype == np.float32 for x in g.values())
        assert not any(type(x) is np.ndarray for x in w.values())
        _same(g, w)
    if general:
        assert all(type(x) is np.ndarray for x in general.values())
        _same(general, want[0])


@SETTINGS
@given(shapes=shapes)
def test_embedding_for_serving_from_threads(shapes):
    serving = EmbeddingForServing(FEATURES)
    serving.build()
    requests = [_request(*s) for s in shapes]
    expected = [serving(r) for r in requests]
    _concurrently(serving, requests, expected)


def test_embedding_for_serving_first_use_from_threads():
    """Tables built lazily by the first call: threads racing to it see one set."""
    serving = EmbeddingForServing(FEATURES)
    requests = [_request(s, 8, 5) for s in range(3)]
    reference = EmbeddingForServing(FEATURES)
    expected = [reference(r) for r in requests]
    _concurrently(serving, requests, expected)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("threads_export")
    feats = {"fa": FEATURES["fa"], "fb": FEATURES["fb"]}
    tables = {A: TABLES[A], B: TABLES[B]}
    params = {"w": np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)}

    def serve(inputs, tables, params):
        acts = em.serving_embedding_lookup(inputs, None, tables, feats)
        return {"score": acts["fa"] @ params["w"], "b": acts["fb"]}

    export_serving(
        serve,
        directory,
        tables=tables,
        params=params,
        input_signature={"fa": Ragged(nnz_per_example=12), "fb": Ragged(nnz_per_example=12)},
        batch_sizes=(2, 8),
    )
    return load_serving(directory, precompile=False)  # buckets compiled by racing threads


@SETTINGS
@given(shapes=shapes)
def test_load_serving_from_threads(loaded, shapes):
    requests = []
    for seed, batch, max_len in shapes:
        rng = np.random.default_rng(seed)
        requests.append(
            {
                "fa": _ragged(rng, min(batch, 12), A.vocabulary_size, max_len),
                "fb": _ragged(rng, min(batch, 12), B.vocabulary_size, max_len),
            }
        )
    expected = [loaded(r) for r in requests]
    _concurrently(loaded, requests, expected)


HAMMER_THREADS = 16
HAMMER_REQUESTS = 64  # a thread's requests, back to back
WATCHDOG_S = 120.0  # never reached by a run that works (< 1 s here): only a hang ends there


D = TableConfig(vocabulary_size=50, dim=4, combiner="sum", name="d")
# another model: its own plans (dims, combiners, tables) for the kept plans to switch to
OTHER_FEATURES = {"fa": FeatureConfig(D), "fb": FeatureConfig(A), "fc": FeatureConfig(B)}
OTHER_TABLES = {**TABLES, D: np.random.default_rng(8).normal(size=(50, 4)).astype(np.float32)}


def _other_request(seed, batch, max_len):
    """OTHER_FEATURES' request: fa ragged in D, fb sparse in A, fc dense ids in B."""
    return _request(seed, batch, max_len, (D, A, B))


@pytest.mark.parametrize("numpy_outputs", [False, True], ids=["jax", "numpy"])
@SETTINGS
@given(shapes=shapes)
def test_two_models_alternating_from_threads(numpy_outputs, shapes):
    """Two models of different plans (dims, combiners, tables under the same keys) called
    in turn from 4 threads, every request releasing the GIL: the compiled form keeps the
    plans it read last (`plan_cache`), so requests switch them back and forth while other
    threads' requests of the other model are in their kernels; every answer must equal
    one thread's, and the float64 reference of the sum/mean."""
    from embedmesh.serving import settings as serving_settings
    from embedmesh.serving.lookup import set_numpy_outputs

    models = [(FEATURES, TABLES, _request), (OTHER_FEATURES, OTHER_TABLES, _other_request)]
    requests = [(m, make(*s)) for s in shapes for m, (_, _, make) in enumerate(models)]

    def call(r):
        features, tables, _ = models[r[0]]
        return em.serving_embedding_lookup(r[1], None, tables, features)

    previous = serving_settings.set_hold_gil_below(0)
    numpy_before = set_numpy_outputs(numpy_outputs)
    try:
        expected = [call(r) for r in requests]
        for (m, req), out in zip(requests, expected):  # fa: a ragged sum, float64
            table = models[m][1][models[m][0]["fa"].table].astype(np.float64)
            splits, ids = req["fa"].row_splits, req["fa"].values
            want = np.stack([table[ids[a:b]].sum(0) for a, b in zip(splits[:-1], splits[1:])])
            np.testing.assert_allclose(np.asarray(out["fa"]), want, rtol=1e-5, atol=1e-5)
        _concurrently(call, requests, expected)
    finally:
        set_numpy_outputs(numpy_before)
        if previous is not None:
            serving_settings.set_hold_gil_below(previous)


def test_many_threads_hammering_one_model_finish_and_agree():
    """The GIL policy's tickets under load: 16 threads send small requests back to back
    to one model (float32 and int8 tables), every request releasing the GIL for its
    kernels (`set_hold_gil_below(0)`), so each one takes a ticket to get it back while 15
    others are in line. Every thread must finish and every answer equal one thread's.
    No timing: a watchdog fails the test instead of hanging. A thread still running
    after WATCHDOG_S fails it; a thread hung holding the GIL (the main thread could not
    even look) makes faulthandler print every stack and end the process."""
    import faulthandler

    from embedmesh.serving import request as serving_request
    from embedmesh.serving import settings as serving_settings

    if serving_request.compiled is None:
        pytest.skip("the compiled request path was not built")
    settings_ = [(serving_settings.set_hold_gil_below, 0)]
    models = [TABLES, TABLES_INT8]
    requests = [_request(seed, batch, 5) for seed, batch in enumerate((1, 1, 2, 8, 1, 3))]
    # int8 tables: no dense feature (a gather of int8 rows is the general path's)
    by_model = [requests, [{k: v for k, v in r.items() if k != "fc"} for r in requests]]
    previous = [set_(value) for set_, value in settings_]
    faulthandler.dump_traceback_later(WATCHDOG_S + 30, exit=True)
    try:
        expected = [
            [em.serving_embedding_lookup(r, None, t, FEATURES) for r in rs]
            for t, rs in zip(models, by_model)
        ]
        before = serving_settings.gil_stats()
        errors: list = []
        done = [0] * HAMMER_THREADS

        def worker(t):
            try:
                for k in range(HAMMER_REQUESTS):
                    m, i = (t + k) % len(models), (t * 7 + k) % len(requests)
                    got = em.serving_embedding_lookup(by_model[m][i], None, models[m], FEATURES)
                    _same(got, expected[m][i])
                    done[t] += 1
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [
            threading.Thread(target=worker, args=(t,), daemon=True) for t in range(HAMMER_THREADS)
        ]
        for th in threads:
            th.start()
        deadline = time.monotonic() + WATCHDOG_S
        for th in threads:
            th.join(max(deadline - time.monotonic(), 0.0))
        stuck = [t for t, th in enumerate(threads) if th.is_alive()]
        assert not stuck, f"threads {stuck} never finished (requests done: {done})"
        if errors:
            raise errors[0]
        after = serving_settings.gil_stats()
    finally:
        faulthandler.cancel_dump_traceback_later()
        for (set_, _), old in zip(settings_, previous):
            if old is not None:
                set_(old)
    assert done == [HAMMER_REQUESTS] * HAMMER_THREADS
    # every request took the compiled path and released the GIL: each took a ticket
    hammered = HAMMER_THREADS * HAMMER_REQUESTS
    assert after[0] - before[0] >= hammered
    assert after[1] - before[1] >= hammered
    assert serving_request.in_flight() == 0
