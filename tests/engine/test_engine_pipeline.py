"""Pipelining, capacity growth, prefetching and memory of the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import mesh_of

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, TableConfig
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity


def _features():
    t1 = TableConfig(40, 4, combiner="sum", name="t1")
    t2 = TableConfig(25, 8, combiner="mean", name="t2")
    return {
        "a": FeatureConfig(t1),
        "b": FeatureConfig(t2),
        "s": FeatureConfig(t1, max_sequence_length=3),
    }


def _built(feats, opt, num_devices, *pipelined):
    """An engine of `feats` and `opt` on `num_devices` devices (capacities 64, 64) for each
    flag of `pipelined` (pipelined or not), built."""
    out = []
    for p in pipelined:
        emb = MeshEmbedding(feats, opt, p, mesh=mesh_of(num_devices), capacities=Capacity(64, 64))
        emb.build()
        out.append(emb)
    return out


def _batch(rng, batch=8, max_len=4):
    lengths = rng.integers(0, max_len + 1, batch)
    return {
        "a": rng.integers(0, 40, (batch, 2)),
        "b": RaggedTensor.from_row_lengths(rng.integers(0, 25, lengths.sum()), lengths),
        "s": RaggedTensor.from_row_lengths(rng.integers(0, 40, lengths.sum()), lengths),
    }


@pytest.mark.parametrize("num_devices", [1, 4])
def test_pipelined_lookups_see_tables_one_update_stale(num_devices):
    feats = _features()
    piped, lagged = _built(feats, em.Adagrad(0.3), num_devices, True, False)
    rng = np.random.default_rng(0)
    previous = None
    for step in range(5):
        batch = _batch(rng)
        acts, pre = piped(batch)
        want, ref_pre = lagged(batch)  # lagged holds updates 0..step-2
        for k in acts:
            np.testing.assert_allclose(
                np.asarray(acts[k]),
                np.asarray(want[k]),
                rtol=1e-6,
                atol=1e-6,
                err_msg=f"{k} at step {step}",
            )
        grads = {
            k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) for k, v in acts.items()
        }
        piped.apply_gradients(grads, pre)
        if previous is not None:
            lagged.apply_gradients(*previous)
        previous = (grads, ref_pre)
    lagged.apply_gradients(*previous)
    got, want = piped.variables, lagged.variables  # reads see the pending update applied
    for t in got:
        for k in got[t]:
            np.testing.assert_allclose(got[t][k], want[t][k], rtol=1e-6, atol=1e-6)
    assert int(piped.observed_state().step) == 5
    assert int(piped.state.step) == 4  # the next lookup still reads one update stale


def test_pipelined_update_is_not_applied_before_next_lookup():
    feats = _features()
    piped = MeshEmbedding(feats, em.SGD(1.0), True, mesh=mesh_of(2))
    piped.build()
    rng = np.random.default_rng(1)
    acts, pre = piped(_batch(rng))
    piped.apply_gradients({k: jnp.ones_like(v) for k, v in acts.items()}, pre)
    assert int(piped.state.step) == 0  # deferred
    piped(_batch(rng))
    assert int(piped.state.step) == 1  # applied in the fused program


@pytest.mark.parametrize("num_devices", [1, 2])
def test_unpipelined_update_rides_with_the_next_lookup_but_is_never_stale(num_devices):
    """apply_gradients defers the update to the next lookup's program; every
    lookup and every read still sees all updates (compared with flushing
    each update at once), including two updates with no lookup between."""
    feats = _features()
    opt = em.Adagrad(0.3, weight_decay_factor=0.01)
    lazy, eager = _built(feats, opt, num_devices, False, False)
    rng = np.random.default_rng(11)
    for step in range(4):
        batch = _batch(rng)
        acts, pre = lazy(batch)
        want, ref_pre = eager(batch)
        for k in acts:
            np.testing.assert_array_equal(
                np.asarray(acts[k]), np.asarray(want[k]), err_msg=f"{k} at step {step}"
            )
        repeats = 2 if step == 2 else 1  # step 2: a second update before any lookup
        for _ in range(repeats):
            grads = {
                k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) for k, v in acts.items()
            }
            lazy.apply_gradients(grads, pre)
            eager.apply_gradients(grads, ref_pre)
            eager.flush()
        assert int(lazy.state.step) == int(eager.state.step)  # reading state applies it
    got, want = lazy.variables, eager.variables
    for t in got:
        for k in got[t]:
            np.testing.assert_array_equal(got[t][k], want[t][k])


def test_unpipelined_non_finite_gradient_raises_at_apply_and_keeps_the_previous_update():
    feats = _features()
    emb = MeshEmbedding(feats, em.SGD(0.5), mesh=mesh_of(2), capacities=Capacity(64, 64))
    emb.build()
    rng = np.random.default_rng(12)
    acts, pre = emb(_batch(rng))
    emb.apply_gradients({k: jnp.ones_like(v) for k, v in acts.items()}, pre)  # deferred
    bad = {k: jnp.ones_like(v) for k, v in acts.items()}
    bad["b"] = bad["b"].at[0, 0].set(jnp.nan)
    with pytest.raises(FloatingPointError, match="b"):
        emb.apply_gradients(bad, pre)
    assert int(emb.state.step) == 1
    after_first = emb.variables
    emb2 = MeshEmbedding(feats, em.SGD(0.5), mesh=mesh_of(2), capacities=Capacity(64, 64))
    emb2.build()
    acts2, pre2 = emb2(_batch(np.random.default_rng(12)))
    emb2.apply_gradients({k: jnp.ones_like(v) for k, v in acts2.items()}, pre2)
    for t, v in emb2.variables.items():
        np.testing.assert_array_equal(after_first[t]["parameters"], v["parameters"])


def test_pipelined_non_finite_gradient_raises_at_apply_and_tables_stay():
    feats = _features()
    piped, eager = _built(feats, em.SGD(0.5), 2, True, False)
    batch = _batch(np.random.default_rng(13))
    acts, pre = piped(batch)
    acts_e, pre_e = eager(batch)
    good = {k: jnp.full_like(v, 0.25) for k, v in acts.items()}
    piped.apply_gradients(good, pre)  # pending until the next lookup
    eager.apply_gradients(good, pre_e)
    bad = dict(good, a=good["a"].at[1, 0].set(jnp.inf))
    with pytest.raises(FloatingPointError, match="a"):
        piped.apply_gradients(bad, pre)
    got, want = piped.variables, eager.variables  # the good update only
    for t in got:
        for k in got[t]:
            np.testing.assert_array_equal(got[t][k], want[t][k])
    assert int(piped.observed_state().step) == 1  # the good update, still pending
    assert int(piped.state.step) == 0


def test_grow_recompiles_once_and_loses_nothing():
    feats = _features()
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))  # capacities sized automatically
    emb.build()
    rng = np.random.default_rng(2)
    small = _batch(rng, max_len=1)
    emb(small)
    caps_before = dict(emb._capacities)
    big = _batch(rng, max_len=12)
    acts, _ = emb(big)
    assert emb.last_stats.grown, "the larger batch must grow the capacity"
    assert emb.last_stats.dropped_ids == {k: 0 for k in emb.last_stats.dropped_ids}
    grown = emb._capacities
    assert any(grown[k] != caps_before[k] for k in grown)
    served = em.serving_embedding_lookup(
        {"b": big["b"], "s": big["s"]}, None, emb.embedding_tables, feats
    )
    np.testing.assert_allclose(np.asarray(acts["b"]), np.asarray(served["b"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acts["s"]), np.asarray(served["s"]), rtol=1e-5, atol=1e-6)
    compiles = emb._lookup_fn._cache_size()
    emb(_batch(rng, max_len=12))  # fits the grown capacity: no new compilation
    assert emb._lookup_fn._cache_size() == compiles


def test_explicit_capacity_overflow_is_an_error_naming_the_stack():
    feats = _features()
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2), capacities=Capacity(8, 8))
    emb.build()
    with pytest.raises(ValueError, match="capacity"):
        emb(_batch(np.random.default_rng(3), batch=16, max_len=8))


def test_prefetch_matches_enqueue_and_surfaces_errors():
    feats = _features()
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2), capacities=Capacity(64, 64))
    emb.build()
    rng = np.random.default_rng(4)
    batches = [_batch(rng) for _ in range(4)]
    for got, batch in zip(emb.prefetch(iter(batches), buffer_size=2), batches):
        a, _ = emb.dequeue(got)
        b, _ = emb(batch)
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))

    def bad():
        yield batches[0]
        raise KeyError("broken input pipeline")

    it = emb.prefetch(bad())
    next(it)
    with pytest.raises(KeyError, match="broken input pipeline"):
        next(it)


def test_update_step_allocates_nothing_of_table_size():
    """The compiled update's scratch memory is far below one table (no dense gradient)."""
    rows, dim = 200_000, 16
    t = TableConfig(rows, dim, name="big", initializer=lambda k, s, d: jnp.ones(s, d))
    feats = {"x": FeatureConfig(t)}
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(2), capacities=Capacity(256, 256))
    emb.build()
    ids = np.random.default_rng(5).integers(0, rows, (64, 4))
    acts, pre = emb({"x": ids})
    grads = {"x": jnp.ones_like(acts["x"])}
    table_bytes = rows * dim * 4
    update = jax.jit(emb.core.apply_gradients, donate_argnums=0)  # with its finite check
    compiled = update.lower(emb.state, grads, pre).compile()
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes < table_bytes // 20, (mem.temp_size_in_bytes, table_bytes)
    lookup = emb._lookup_fn.lower(emb.state, pre).compile().memory_analysis()
    assert lookup.temp_size_in_bytes < table_bytes // 20


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_pipelined_step_updates_in_place(n, kernels, monkeypatch):
    """The fused lookup + update program does not copy the table (it did: a
    whole-table copy each step, because the lookup and the in-place update
    were unordered for XLA)."""
    from embedmesh import _runtime
    from embedmesh.device.ops import cpu

    if not kernels:
        monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: False)
    elif not cpu.ready():
        pytest.skip(cpu.unavailable_reason())
    rows, dim = 200_000, 16
    t = TableConfig(rows, dim, name="big", initializer=lambda k, s, d: jnp.ones(s, d))
    emb = MeshEmbedding(
        {"x": FeatureConfig(t)},
        em.Adagrad(0.1),
        True,
        mesh=mesh_of(n),
        capacities=Capacity(256, 256),
    )
    emb.build()
    ids = np.random.default_rng(6).integers(0, rows, 64 * 4)
    pre = emb.enqueue({"x": RaggedTensor.from_row_lengths(ids, [4] * 64)})
    grads = {"x": jnp.ones((64, dim), jnp.float32)}
    table_bytes = rows * dim * 4
    mem = emb._fused_fn.lower(emb.state, grads, pre, {}, pre).compile().memory_analysis()
    assert mem.temp_size_in_bytes < table_bytes // n // 20, (mem.temp_size_in_bytes, table_bytes)
    # the unpipelined facade's program: the previous update, then the lookup
    mem = emb._apply_lookup_fn.lower(emb.state, grads, pre, {}, pre).compile().memory_analysis()
    assert mem.temp_size_in_bytes < table_bytes // n // 20, (mem.temp_size_in_bytes, table_bytes)


def test_background_map_stops_its_thread_when_the_consumer_stops_early():
    import threading

    from embedmesh.host.prefetch import background_map

    produced = []

    def items():
        for i in range(100):
            produced.append(i)
            yield i

    before = threading.active_count()
    it = background_map(lambda x: x * 2, items(), buffer_size=1, name="bg-test")
    assert next(it) == 0
    it.close()  # the producer may be blocked on the full queue: it must be released
    assert not any(t.name == "bg-test" and t.is_alive() for t in threading.enumerate())
    assert threading.active_count() <= before
    assert len(produced) < 100


@pytest.mark.parametrize(
    "num_devices, opt",
    # an optimizer without slots on one device, one with slots sharded over four
    [(1, em.SGD(0.5)), (4, em.Adagrad(0.3))],
    ids=["SGD-1", "Adagrad-4"],
)
def test_pipelined_reads_never_change_the_trajectory(num_devices, opt):
    """Reading tables, variables or shards between steps of a pipelined run leaves
    every later lookup bit-identical to the run that never looked; what is read
    is the state with every accepted update applied (an eager run's)."""
    feats = _features()
    quiet, watched, eager = _built(feats, opt, num_devices, True, True, False)
    rng = np.random.default_rng(3)
    for step in range(5):
        batch = _batch(rng)
        a_quiet, p_quiet = quiet(batch)
        a_watched, p_watched = watched(batch)
        _, p_eager = eager(batch)
        for k in a_quiet:
            np.testing.assert_array_equal(
                np.asarray(a_watched[k]), np.asarray(a_quiet[k]), err_msg=f"{k} at step {step}"
            )
        grads = {
            k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) for k, v in a_quiet.items()
        }
        quiet.apply_gradients(grads, p_quiet)
        watched.apply_gradients(grads, p_watched)
        eager.apply_gradients(grads, p_eager)
        seen, want = watched.variables, eager.variables
        for t in want:
            for k in want[t]:
                np.testing.assert_allclose(
                    seen[t][k],
                    want[t][k],
                    rtol=1e-6,
                    atol=1e-7,
                    err_msg=f"{t.name}.{k} read after step {step}",
                )
        tables = watched.embedding_tables
        for t, v in tables.items():
            np.testing.assert_array_equal(v, seen[t]["parameters"])
        watched.embedding_table_shards  # noqa: B018 - a read, like the others
    for t, v in quiet.variables.items():
        for k in v:
            np.testing.assert_array_equal(watched.variables[t][k], v[k])
