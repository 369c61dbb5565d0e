"""The host tier: rows and slots in host memory behind a device row cache.

Every test trains with the tier forced on and a cache much smaller than the tables (so
rows are evicted at every step) and compares against the same model all on the
devices, bit for bit, and against a plain float64 numpy reference."""

import logging

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meshes import mesh_of
from optimizer_reference import ALL_FUSED, numpy_update_rows

import embedmesh as em
from embedmesh.host.tier import StackTier

V_A, V_B = 1000, 300


def _config(dim_b: int = 8):
    a = em.TableConfig(vocabulary_size=V_A, dim=8, name="a", combiner="sum")
    b = em.TableConfig(vocabulary_size=V_B, dim=dim_b, name="b", combiner="mean")
    return {"x": em.FeatureConfig(a), "y": em.FeatureConfig(b)}


def _batches(steps: int, seed: int = 0, batch: int = 16) -> list:
    """Uniform and Zipf-skewed ids, alternating."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        if i % 2:
            x = np.minimum(rng.zipf(1.3, size=(batch, 4)) - 1, V_A - 1)
        else:
            x = rng.integers(0, V_A, size=(batch, 4))
        out.append({"x": x, "y": rng.integers(0, V_B, size=(batch, 3))})
    return out


def _train(fc, opt, batches, mesh, pipelined=False, **kw):
    emb = em.MeshEmbedding(fc, opt, pipelined, mesh=mesh, seed=3, **kw)
    for feats in batches:
        acts, pre = emb(feats)
        grads = jax.tree_util.tree_map(lambda a: 0.5 * a + 1.0, acts)
        emb.apply_gradients(grads, pre)
    return emb


def _same_variables(a, b) -> None:
    va = {t.name: v for t, v in a.variables.items()}
    vb = {t.name: v for t, v in b.variables.items()}
    assert va.keys() == vb.keys()
    for t in va:
        for field in va[t]:
            assert np.any(va[t][field] != 0), (t, field)
            np.testing.assert_array_equal(va[t][field], vb[t][field], err_msg=f"{t} {field}")


def _config_of(optimizers) -> dict:
    """`_config()` once an optimizer: tables a{k}, b{k} (stacked as a{k}+b{k}) under
    optimizers[k], features x{k}, y{k}, every table sharded "mod"."""
    fc = {}
    for k, opt in enumerate(optimizers):
        for feat, table in zip("xy", _config().values()):
            t = table.table
            fc[f"{feat}{k}"] = em.FeatureConfig(
                em.TableConfig(
                    t.vocabulary_size,
                    t.dim,
                    name=f"{t.name}{k}",
                    combiner=t.combiner,
                    optimizer=opt,
                )
            )
    return fc


def _batches_of(fc, steps: int) -> list:
    """`_batches` for `_config_of`'s features (other ids for each optimizer's pair)."""
    k_max = len(fc) // 2
    per_k = [_batches(steps, seed=k) for k in range(k_max)]
    return [
        {f"{f}{k}": per_k[k][step][f] for k in range(k_max) for f in "xy"} for step in range(steps)
    ]


# every optimizer once, on 1 and 8 devices alternately (each optimizer with two option
# sets, all but SGD and Adagrad, meets both device counts), side by side in one layer
# (a stack each): one layer of five stacks a device count. On 8 devices the tiered layer
# is fed by `prefetch` (batches enqueued ahead in its thread are swapped in at dequeue,
# in order); on 1 by plain calls.
@pytest.mark.parametrize("devices", [1, 8])
def test_every_optimizer_matches_the_all_in_device_run(devices):
    optimizers = ALL_FUSED[0::2] if devices == 1 else ALL_FUSED[1::2]
    assert len(optimizers) == 5
    mesh = mesh_of(devices)
    fc = _config_of(optimizers)
    sharding = {f.table.name: "mod" for f in fc.values()}
    batches = _batches_of(fc, 6)
    want = _train(fc, None, batches, mesh, sharding=sharding)
    cache = 200 if devices == 1 else 40  # of 1300 rows (163 a device on 8)
    kw = dict(sharding=sharding, host_tier="on", host_tier_cache_rows=cache)
    if devices == 1:
        got = _train(_config_of(optimizers), None, batches, mesh, **kw)
    else:
        got = em.MeshEmbedding(_config_of(optimizers), None, mesh=mesh, seed=3, **kw)
        for csr in got.prefetch(iter(batches), buffer_size=3):
            acts, pre = got.dequeue(csr)
            got.apply_gradients(jax.tree_util.tree_map(lambda a: 0.5 * a + 1.0, acts), pre)
    _same_variables(want, got)
    assert sorted(got.core.tier) == [f"a{k}+b{k}" for k in range(5)]
    for tier in got.core.tier.values():
        assert tier.cache_rows == cache and (tier.row_of >= 0).sum() == devices * cache


def test_pipelined_matches():
    """Adam (two slots), pipelined, on one device; pipelined on several devices:
    test_checkpoint_reads_through_and_restores_elsewhere[True] (8, its checkpoint's
    tables and slots against the all-in-device run's) and
    test_evaluation_reads_through_the_tier_and_changes_no_table[True] (2)."""
    opt = em.Adam(0.05)
    batches = _batches(4, seed=1)
    mesh = mesh_of(1)
    want = _train(_config(), opt, batches, mesh, pipelined=True)
    got = _train(_config(), opt, batches, mesh, True, host_tier="on", host_tier_cache_rows=200)
    _same_variables(want, got)


@settings(max_examples=4)
@given(cache=st.sampled_from([120, 200, 1300]), seed=st.integers(0, 100))
def test_any_cache_size_matches_a_float64_reference(cache, seed):
    """Adagrad against float64 numpy, one device, caches from a few batches to all."""
    opt = em.Adagrad(0.1, initial_accumulator_value=0.2)
    fc = _config()
    batches = _batches(4, seed=seed, batch=8)
    emb = em.MeshEmbedding(fc, opt, mesh=mesh_of(1), host_tier="on", host_tier_cache_rows=cache)
    emb.build()
    tables = {t.name: np.asarray(v, np.float64) for t, v in emb.embedding_tables.items()}
    acc = {k: np.full_like(v, 0.2) for k, v in tables.items()}
    for step, feats in enumerate(batches):
        acts, pre = emb(feats)
        grads = jax.tree_util.tree_map(lambda a: 0.5 * np.asarray(a) + 1.0, acts)
        emb.apply_gradients(grads, pre)
        for feat, name in (("x", "a"), ("y", "b")):
            ids = feats[feat]  # dense [B, n] ids: an activation row each
            g = np.zeros_like(tables[name])
            np.add.at(g, ids.ravel(), np.asarray(grads[feat], np.float64).reshape(ids.size, -1))
            touched = np.unique(ids)
            w, s = numpy_update_rows(
                opt, tables[name][touched], {"accumulators": acc[name][touched]}, g[touched], step
            )
            tables[name][touched], acc[name][touched] = w, s["accumulators"]
    got = emb.variables
    for t in got:
        np.testing.assert_allclose(got[t]["parameters"], tables[t.name], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(got[t]["accumulators"], acc[t.name], rtol=2e-5, atol=2e-6)


def test_misses_over_the_cache_raise_and_change_nothing():
    mesh = mesh_of(1)
    emb = _train(
        _config(), em.Adagrad(0.1), _batches(2), mesh, host_tier="on", host_tier_cache_rows=250
    )
    before = emb.variables
    big = {"x": np.arange(V_A).reshape(100, 10), "y": np.zeros((100, 3), np.int64)}
    with pytest.raises(ValueError, match=r"stack a\+b .*cache of 250 rows.*1001 distinct rows"):
        emb(big)
    after = emb.variables
    for t in before:
        for f in before[t]:
            np.testing.assert_array_equal(before[t][f], after[t][f])
    emb(_batches(1, seed=9)[0])  # and it goes on


def test_refused_where_it_would_not_be_exact():
    with pytest.raises(ValueError, match="lazy_adam=False"):
        em.MeshEmbedding(
            _config(), em.Adam(0.1, lazy_adam=False), mesh=mesh_of(1), host_tier="on"
        ).build()
    with pytest.raises(ValueError, match="host_tier must be"):
        em.MeshEmbedding(_config(), em.SGD(0.1), host_tier="yes")
    with pytest.raises(ValueError, match="host_tier_cache_rows"):
        em.MeshEmbedding(_config(), em.SGD(0.1), host_tier_cache_rows=0)


def test_chosen_when_the_model_does_not_fit(caplog):
    mesh = mesh_of(1)
    batches = _batches(4)
    want = _train(_config(), em.Adagrad(0.1), batches, mesh)
    with caplog.at_level(logging.INFO, logger="embedmesh"):
        got = _train(_config(), em.Adagrad(0.1), batches, mesh, memory_limit_bytes=40_000)
    assert "host tier (chosen)" in caplog.text and "over the limit" in caplog.text
    tier = got.core.tier["a+b"]
    assert tier.cache_rows < tier.rows
    _same_variables(want, got)
    with pytest.raises(ValueError):
        em.MeshEmbedding(
            _config(), em.Adagrad(0.1), mesh=mesh, memory_limit_bytes=40_000, host_tier="off"
        ).build()


def test_set_tables_and_shards_read_through():
    mesh = mesh_of(8)
    fc = _config()
    rng = np.random.default_rng(5)
    tables = {
        f.table: rng.normal(size=(f.table.vocabulary_size, 8)).astype(np.float32)
        for f in fc.values()
    }
    slots = {
        t: {"accumulators": rng.uniform(0.1, 1, size=v.shape).astype(np.float32)}
        for t, v in tables.items()
    }
    plain = em.MeshEmbedding(fc, em.Adagrad(0.1), mesh=mesh)
    tiered = em.MeshEmbedding(
        fc, em.Adagrad(0.1), mesh=mesh, host_tier="on", host_tier_cache_rows=30
    )
    for emb in (plain, tiered):
        emb.build()
        emb.set_tables(tables, slots)
        for feats in _batches(3, seed=2):
            acts, pre = emb(feats)
            emb.apply_gradients(jax.tree_util.tree_map(lambda a: a + 1.0, acts), pre)
    _same_variables(plain, tiered)
    a, b = plain.embedding_table_shards, tiered.embedding_table_shards
    for t in a:
        for (d1, s1), (d2, s2) in zip(a[t], b[t]):
            assert d1 == d2
            np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))


def test_stack_tier_directory_clock():
    """The directory alone: hits stay, misses take free then unused rows, never held ones."""
    pad = np.iinfo(np.int32).max
    tier = StackTier("s", ("t",), 1, 50, 5, (((2,), np.float32, 1.5),))
    tier.arrays[0][0] = np.arange(100, dtype=np.float32).reshape(50, 2) + 1
    ids = np.array([[[3, 7, 9, pad]]], np.int32)
    swap = tier.commit(ids, tier.check(ids, pin=False), pin=False)
    assert sorted(tier.row_of[0][tier.row_of[0] >= 0]) == [3, 7, 9]
    np.testing.assert_array_equal(tier.row_of[0, swap.ids[0, 0, :3]], [3, 7, 9])
    assert swap.ids[0, 0, 3] == pad
    np.testing.assert_array_equal(tier.gather(swap, 0)[0, :3], tier.arrays[0][0, [3, 7, 9]])
    ids2 = np.array([[[1, 2, 3, 4]]], np.int32)
    with pytest.raises(ValueError, match="needs 4 distinct rows, 3 of them not cached, and only 2"):
        tier.check(ids2, pin=True)  # 3 and the in-flight 3, 7, 9 held
    swap = tier.commit(ids2, tier.check(ids2, pin=False), pin=False)
    (evicted,) = swap.victims[0][1]
    assert evicted in (7, 9) and set(tier.row_of[0]) == {1, 2, 3, 4, 16 - evicted}
    np.testing.assert_array_equal(tier.row_of[0, swap.ids[0, 0]], [1, 2, 3, 4])
    ids3 = np.array([[[5, 6, pad, pad]]], np.int32)
    with pytest.raises(ValueError, match="2 of them not cached, and only 1"):
        tier.check(ids3, pin=True)
    ids3[0, 0, 1] = pad
    swap = tier.commit(ids3, tier.check(ids3, pin=True), pin=True)
    assert set(tier.row_of[0]) == {1, 2, 3, 4, 5}  # the other of 7, 9 evicted, the held kept


@pytest.mark.parametrize("pipelined", [False, True])
def test_checkpoint_reads_through_and_restores_elsewhere(tmp_path, pipelined):
    """A tiered layer's checkpoint holds its host rows with the cached ones over them
    (checksums verified on reading); it restores onto a layer holding the model on its
    devices (another device count too), and checkpoints restore into tiered layers."""
    from embedmesh import checkpoint as ckpt

    batches = _batches(3, seed=4)
    mesh = mesh_of(8)
    want = _train(_config(), em.Adagrad(0.1), batches, mesh, pipelined)
    tiered = _train(
        _config(),
        em.Adagrad(0.1),
        batches,
        mesh,
        pipelined,
        host_tier="on",
        host_tier_cache_rows=40,
    )
    ckpt.save(tmp_path / "t", tiered)
    loaded = {t.name: v for t, v in ckpt.load_tables(tmp_path / "t").items()}
    for t, v in want.embedding_tables.items():
        np.testing.assert_array_equal(loaded[t.name], v)
    # onto the same device count (pipelined) or another (not: the layer on 2 devices is
    # used again below)
    plain = em.MeshEmbedding(
        _config(), em.Adagrad(0.1), pipelined, mesh=mesh_of(8 if pipelined else 2)
    )
    ckpt.restore(plain, tmp_path / "t")
    _same_variables(want, plain)
    # and back into tiered layers: this one (trained on), one on 2 devices (a plain
    # layer's checkpoint), which then trains as a plain layer restored from it does
    ckpt.save(tmp_path / "p", want)
    other = em.MeshEmbedding(
        _config(),
        em.Adagrad(0.1),
        pipelined,
        mesh=mesh_of(2),
        host_tier="on",
        host_tier_cache_rows=150,
    )
    if pipelined:  # saved with an update pending: not into a tier yet
        for emb, source in ((tiered, "t"), (other, "p")):
            with pytest.raises(NotImplementedError, match="host tier"):
                ckpt.restore(emb, tmp_path / source)
        return
    for emb, source in ((tiered, "t"), (other, "p"), (plain, "p")):
        ckpt.restore(emb, tmp_path / source)
        _same_variables(want, emb)
    for emb in (other, plain):
        for feats in _batches(2, seed=8):
            acts, pre = emb(feats)
            emb.apply_gradients(jax.tree_util.tree_map(lambda a: 0.5 * a + 1.0, acts), pre)
    _same_variables(plain, other)


@pytest.mark.parametrize(
    "sharding",
    [{"a": "table_wise", "b": "row_wise_pooled"}, {"a": "mod", "b": "data_parallel"}],
    ids=["table_wise_and_pooled", "b_data_parallel"],
)
def test_every_placement(sharding):
    """Table-wise and pooled stacks (side by side in one layer) are tiered like mod
    ones; a replicated stack stays on the devices whole."""
    mesh = mesh_of(8)
    batches = _batches(4, seed=7)
    opt = em.Adagrad(0.1)
    want = _train(_config(dim_b=16), opt, batches, mesh, sharding=sharding)
    got = _train(
        _config(dim_b=16),
        opt,
        batches,
        mesh,
        sharding=sharding,
        host_tier="on",
        host_tier_cache_rows=120,
    )
    _same_variables(want, got)
    replicated = {s.name for s in got.plan.stacks if s.replicated}
    assert set(got.core.tier).isdisjoint(replicated) and got.core.tier


@pytest.mark.parametrize("pipelined", [False, True])
def test_evaluation_reads_through_the_tier_and_changes_no_table(pipelined):
    """`training=False` on a tiered layer: the rows it reads are swapped into the cache
    like a training batch's (ids it misses included), its activations equal the
    all-in-device layer's evaluation, and the logical tables and slots stay as they were;
    training then goes on exactly as the all-in-device run's. Pipelined with an update
    held back it is refused (after `flush()` it runs)."""
    opt, mesh = em.Adagrad(0.1), mesh_of(2)
    train, held_out = _batches(4, seed=5), _batches(2, seed=6)
    want = _train(_config(), opt, train[:2], mesh, pipelined=pipelined)
    got = _train(
        _config(), opt, train[:2], mesh, pipelined, host_tier="on", host_tier_cache_rows=100
    )
    before = {t.name: {f: np.array(a) for f, a in v.items()} for t, v in got.variables.items()}
    if pipelined:  # not with an update held back: refused, nothing changed, then flushed
        with pytest.raises(NotImplementedError, match="pipelined layer with a host tier"):
            got(held_out[0], training=False)
        for emb in (want, got):
            emb.flush()
    for feats in held_out:
        acts_want, _ = want(feats, training=False)
        acts_got, _ = got(feats, training=False)
        for name in acts_want:
            assert np.any(np.asarray(acts_want[name]) != 0)
            np.testing.assert_array_equal(np.asarray(acts_got[name]), np.asarray(acts_want[name]))
    after = {t.name: v for t, v in got.variables.items()}
    for t in before:
        for field in before[t]:
            np.testing.assert_array_equal(after[t][field], before[t][field], err_msg=t)
    for feats in train[2:]:  # training goes on as if no evaluation had run
        for emb in (want, got):
            acts, pre = emb(feats)
            emb.apply_gradients(jax.tree_util.tree_map(lambda a: 0.5 * a + 1.0, acts), pre)
    _same_variables(want, got)
