"""`EmbeddingCore.put` on one process: jaxlib's batched put a leaf (`embedmesh._compat`)
gives the arrays `jax.device_put` gives (values, dtype, sharding, committed), copies
that never alias the host's numpy buffers; without the hook, `jax.device_put` itself."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import embedmesh as em
from embedmesh import _compat


def _engine(n, raw_ids):
    """A built engine on n devices: a table of raw ids (or a static one) and a static
    one; and one batch's preprocessed host arrays (`{stack: csr}` of numpy leaves)."""
    dyn = em.TableConfig(
        64 * n,
        8,
        combiner="sum",
        name="dyn",
        id_map=em.DynamicIds(eviction="lru") if raw_ids else None,
    )
    static = em.TableConfig(40, 8, combiner="mean", name="static")
    features = {"a": em.FeatureConfig(dyn, name="a"), "b": em.FeatureConfig(static, name="b")}
    b = 8 * n
    emb = em.MeshEmbedding(
        features,
        em.Adagrad(0.1),
        mesh=Mesh(np.array(jax.devices()[:n]), ("data",)),
        capacities=em.Capacity(b * 4, b * 4),
    )
    rng = np.random.default_rng(n)
    lengths = rng.integers(1, 4, b)
    ids = rng.integers(0, 2**40, lengths.sum()) if raw_ids else rng.integers(0, 64, lengths.sum())
    batch = {
        "a": em.RaggedTensor.from_row_lengths(ids, lengths),
        "b": rng.integers(0, 40, b),
    }
    emb.build()
    csr, _ = emb._preprocess(batch, None, emb._capacities, emb._overflow)
    return emb, csr


def _reference(core, csr):
    """The arrays `put` gave before the batched put (and gives without the hook), less
    a stack's counts, which stay on the host."""
    return {
        name: jax.tree_util.tree_map(
            lambda x: jax.device_put(np.asarray(x), core.row_sharding), _without_counts(c)
        )
        for name, c in csr.items()
    }


def _without_counts(c):
    if isinstance(c, em.PartitionedCsrFormatTensor):
        return dataclasses.replace(c, unique_counts=None, pair_counts=None)
    return c


def _same(got, want):
    g, gt = jax.tree_util.tree_flatten(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt and len(g) == len(w) > 0
    for a, b in zip(g, w):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        assert a.dtype == b.dtype and a.shape == b.shape and a.weak_type == b.weak_type
        assert a.committed == b.committed
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert [s.device for s in a.addressable_shards] == [s.device for s in b.addressable_shards]
        for sa, sb in zip(a.addressable_shards, b.addressable_shards):
            np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))


def test_the_hook_resolves():
    """Else the tests below would test the fallback twice (test_compat says so too)."""
    assert _compat.batched_device_put() is not None and _compat.shaped_array() is not None


@pytest.mark.parametrize("raw_ids", [True, False])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_put_gives_device_puts_arrays(n, raw_ids):
    emb, csr = _engine(n, raw_ids)
    got = emb.core.put(csr)
    _same(got, _reference(emb.core, csr))
    for leaf in jax.tree_util.tree_leaves(got):
        assert leaf.sharding == emb.core.row_sharding


@pytest.mark.parametrize("raw_ids", [True, False])
def test_put_leaves_the_counts_on_the_host(raw_ids):
    """A stack's `unique_counts` and `pair_counts` are not sent (no device program reads
    them: padding marks the end of a partition): None in the placed batch, every other
    field placed, and the host batch untouched; a step on the placed batch runs."""
    emb, csr = _engine(2, raw_ids)
    host = {k: dataclasses.replace(c) for k, c in csr.items()}
    got = emb.core.put(csr)
    for name, c in got.items():
        assert c.unique_counts is None and c.pair_counts is None, name
        assert isinstance(c.unique_ids, jax.Array) and isinstance(c.pair_gains, jax.Array)
        assert isinstance(csr[name].unique_counts, np.ndarray)
        np.testing.assert_array_equal(csr[name].pair_counts, host[name].pair_counts)
    acts, pres = emb.dequeue(got)
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, pres)
    assert all(np.isfinite(np.asarray(v)).all() for v in acts.values())


@pytest.mark.parametrize("raw_ids", [True, False])
@pytest.mark.parametrize("n", [1, 8])
def test_put_copies_the_host_buffers(n, raw_ids):
    """Writing the host arrays right after `put` (not waited on) changes no device array:
    `jax.device_put` zero-copies 64-byte-aligned numpy buffers on CPU and reads the others
    after it returns, so the old put did not promise this."""
    emb, csr = _engine(n, raw_ids)
    want = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), csr)
    for _ in range(5):  # a buffer's alignment varies from run to run
        host = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), csr)
        got = emb.core.put(host)
        for x in jax.tree_util.tree_leaves(host):
            x[...] = 7 if x.dtype != bool else ~x
        _same(got, _reference(emb.core, want))


@pytest.mark.parametrize("raw_ids", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_put_without_copy_aliases_preprocessings_arrays(n, raw_ids):
    """Preprocessing's arrays start on 64-byte boundaries, and `put(copy=False)` (the
    facade's enqueue) aliases them where a device's slice does: the same values as
    `jax.device_put`'s, the device buffer at the host array's address."""
    emb, csr = _engine(n, raw_ids)
    host = [x for c in csr.values() for x in jax.tree_util.tree_leaves(_without_counts(c))]
    assert host and all(x.ctypes.data % 64 == 0 for x in host)
    got = emb.core.put(csr, copy=False)
    _same(got, _reference(emb.core, csr))
    aliased = 0
    for x, y in zip(host, [y for c in got.values() for y in jax.tree_util.tree_leaves(c)]):
        for d, shard in enumerate(y.addressable_shards):
            if x[d].ctypes.data % 64 == 0:
                assert shard.data.unsafe_buffer_pointer() == x[d].ctypes.data
                aliased += 1
    assert aliased >= len(host)


@pytest.mark.parametrize("n", [1, 8])
def test_put_of_plain_arrays_large_and_canonicalised(n):
    """Leaves of any shape and dtype: large ones (a transfer that takes a while), ones
    jax converts (int64 and float64 without x64: `jax.device_put`'s dtypes), empty ones."""
    emb, _ = _engine(n, False)
    rng = np.random.default_rng(0)
    host = {
        "big": rng.integers(0, 1000, (n * 65536, 3), dtype=np.int32),
        "wide": {"i64": np.arange(n * 4, dtype=np.int64), "f64": np.ones(n * 2)},
        "empty": np.zeros((n * 2, 0), np.float32),
        "bools": np.arange(n * 8) % 3 == 0,
    }
    want = _reference(emb.core, host)
    got = emb.core.put(jax.tree_util.tree_map(lambda x: np.array(x, copy=True), host))
    _same(got, want)
    assert got["wide"]["i64"].dtype == jax.dtypes.canonicalize_dtype(np.int64)


@pytest.mark.parametrize("n", [1, 8])
def test_put_without_the_hook_is_device_put(n, monkeypatch):
    emb, csr = _engine(n, True)
    monkeypatch.setattr(_compat, "batched_device_put", lambda: None)
    _same(emb.core.put(csr), _reference(emb.core, csr))


def test_put_of_an_indivisible_batch_raises_as_device_put():
    emb, _ = _engine(8, False)
    with pytest.raises(ValueError, match="evenly divide"):
        jax.device_put(np.zeros(6), emb.core.row_sharding)
    with pytest.raises(ValueError, match="evenly divide"):
        emb.core.put({"x": np.zeros(6)})


@pytest.mark.parametrize("n", [1, 2])
def test_put_again_of_the_same_shapes_gives_each_batchs_values(n):
    """`put` keeps what it works out a leaf shape and dtype (the aval, the per-device
    slices): later batches of the same shapes, other values, come out as theirs; an
    int64 leaf follows `jax_enable_x64` as it is at each call; a hook gone since the
    last call gives `jax.device_put`'s arrays."""
    emb, csr = _engine(n, True)
    rng = np.random.default_rng(1)
    for _ in range(3):
        host = jax.tree_util.tree_map(
            lambda x: (
                (rng.random(x.shape) < 0.5)
                if x.dtype == bool
                else rng.integers(-50, 50, x.shape).astype(x.dtype)
            ),
            csr,
        )
        _same(emb.core.put(host), _reference(emb.core, host))
    wide = {"i64": np.arange(n * 4, dtype=np.int64) - 2**40}
    _same(emb.core.put(wide), _reference(emb.core, wide))
    assert emb.core.put(wide)["i64"].dtype == np.int32
    with jax.enable_x64(True):
        got = emb.core.put(wide)
        assert got["i64"].dtype == np.int64
        np.testing.assert_array_equal(np.asarray(got["i64"]), wide["i64"])
    assert emb.core.put(wide)["i64"].dtype == np.int32


def test_put_after_the_hook_is_gone_is_device_put(monkeypatch):
    emb, csr = _engine(2, True)
    _same(emb.core.put(csr), _reference(emb.core, csr))
    monkeypatch.setattr(_compat, "batched_device_put", lambda: None)
    _same(emb.core.put(csr), _reference(emb.core, csr))
