"""The functional core inside a user's own jitted train step; the seed-named facade."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import embedmesh as em
from embedmesh import tpu as embedding
from embedmesh.host.preprocess import Capacity


def _setup(num_devices):
    t_user = em.TableConfig(30, 8, combiner="sum", name="user")
    t_item = em.TableConfig(50, 8, combiner="mean", name="item")
    feats = {"user": em.FeatureConfig(t_user), "items": em.FeatureConfig(t_item)}
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
    return feats, mesh


def _batches(steps, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        lengths = rng.integers(1, 4, batch)
        yield (
            {
                "user": rng.integers(0, 30, batch),
                "items": em.RaggedTensor.from_row_lengths(
                    rng.integers(0, 50, lengths.sum()), lengths
                ),
            },
            rng.integers(0, 2, batch).astype(np.float32),
        )


def _loss(params, acts, labels):
    x = jnp.concatenate([acts["user"], acts["items"]], axis=-1)
    logits = x @ params["w"] + params["b"]
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def test_user_jit_train_step_matches_facade():
    feats, mesh = _setup(4)
    opt = em.Adagrad(0.5)
    caps = Capacity(64, 64)
    facade = em.MeshEmbedding(feats, opt, mesh=mesh, capacities=caps)
    facade.build()
    core = facade.core
    state = core.init(jax.random.key(0))  # the same seed as the facade's default
    params = {"w": jnp.linspace(-1, 1, 16), "b": jnp.float32(0.1)}
    dense_opt = optax.sgd(0.1)

    @jax.jit
    def train_step(state, params, dense_state, csr, labels):
        acts = core.lookup(state, csr)
        loss, (g_params, g_acts) = jax.value_and_grad(_loss, argnums=(0, 1))(params, acts, labels)
        updates, dense_state = dense_opt.update(g_params, dense_state)
        state, ok = core.apply_gradients(state, g_acts, csr)
        return state, optax.apply_updates(params, updates), dense_state, loss, ok

    dense_state = dense_opt.init(params)
    f_params, f_dense = params, dense_opt.init(params)
    for features, labels in _batches(4):
        csr = facade.enqueue(features)
        state, params, dense_state, loss, ok = train_step(state, params, dense_state, csr, labels)
        assert bool(ok)
        # the same step through the stateful facade
        acts, pre = facade.dequeue(csr)
        f_loss, (g_p, g_a) = jax.value_and_grad(_loss, argnums=(0, 1))(f_params, acts, labels)
        upd, f_dense = dense_opt.update(g_p, f_dense)
        f_params = optax.apply_updates(f_params, upd)
        facade.apply_gradients(g_a, pre)
        np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-5)
    for t in facade.embedding_tables:
        name = facade.plan.table(t)
        np.testing.assert_allclose(
            core.read_table(state.tables[name.stack], t),
            facade.embedding_tables[t],
            rtol=1e-5,
            atol=1e-6,
        )
    assert int(state.step) == 4


def test_seed_style_code_ports_by_changing_the_import():
    table = embedding.TableConfig(vocabulary_size=20, dim=4, name="video")
    feature_config = {"watched": embedding.FeatureConfig(table=table)}
    mid_level = embedding.TPUEmbeddingV2(
        feature_config=feature_config, optimizer=embedding.SGD(learning_rate=0.5)
    )
    mid_level.build()
    features = {
        "watched": em.SparseTensor(
            np.array([[0, 0], [0, 1], [1, 0]]), np.array([3, 4, 3]), (mid_level.mesh.size * 2, 2)
        )
    }
    if mid_level.mesh.size > 1:  # one sample per device at least
        features = {
            "watched": em.SparseTensor(
                np.array([[0, 0], [0, 1], [1, 0]]), np.array([3, 4, 3]), (mid_level.mesh.size, 2)
            )
        }
    before = mid_level.embedding_tables[table]
    activations, preserved = mid_level(features)
    grads = {"watched": jnp.ones_like(activations["watched"])}
    mid_level.apply_gradients(grads, preserved)
    after = mid_level.embedding_tables[table]
    # mean combiner: sample 0 has ids 3, 4 (gain 1/2 each), sample 1 has id 3 (gain 1)
    np.testing.assert_allclose(after[3], before[3] - 0.5 * 1.5, rtol=1e-6)
    np.testing.assert_allclose(after[4], before[4] - 0.5 * 0.5, rtol=1e-6)
    untouched = [i for i in range(20) if i not in (3, 4)]
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert set(mid_level.variables[table]) == {"parameters"}


REJECT_OPTIMIZERS = {
    "sgd_wd": em.SGD(0.3, weight_decay_factor=0.1),
    "adagrad": em.Adagrad(0.3),
    "adam": em.Adam(0.1),
    "adam_dense": em.Adam(0.1, lazy_adam=False),
    "ftrl": em.FTRL(0.2),
}
# A pairwise covering set of optimizer x devices x kernels: each optimizer on 1 and on 2
# devices, once with the CPU kernels and once without; each (devices, kernels) pair met.
REJECT_CASES = [
    pytest.param(opt, devices, kernels, id=f"{name}-{devices}-{kernels}")
    for i, (name, opt) in enumerate(REJECT_OPTIMIZERS.items())
    for devices, kernels in (((1, i % 2 == 0), (2, i % 2 == 1)))
]


@pytest.mark.parametrize("opt, num_devices, kernels", REJECT_CASES)
def test_rejected_update_leaves_state_bit_identical(opt, num_devices, kernels, monkeypatch):
    """A non-finite gradient inside a user's jit: `ok` is False and tables, slots and the
    step count are unchanged (sparse rules get no rows; non-lazy Adam goes through a cond),
    while a finite one changes them."""
    from embedmesh import _runtime

    if not kernels:
        monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: False)
    feats, mesh = _setup(num_devices)
    emb = em.MeshEmbedding(feats, opt, mesh=mesh, capacities=Capacity(32, 32))
    emb.build()
    ((batch, _),) = _batches(1, seed=3)
    csr = emb.enqueue(batch)
    core = emb.core
    step = jax.jit(core.apply_gradients, donate_argnums=0)
    acts = jax.jit(core.lookup)(emb.state, csr)
    before = jax.tree_util.tree_map(np.asarray, emb.state)
    bad = {k: jnp.full_like(v, 0.5) for k, v in acts.items()}
    bad["items"] = bad["items"].at[2, 1].set(jnp.nan)
    state, ok = step(emb.state, bad, csr)
    assert not bool(ok)
    after = jax.tree_util.tree_map(np.asarray, state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, after, before)
    good = {k: jnp.full_like(v, 0.5) for k, v in acts.items()}
    state, ok = step(state, good, csr)
    assert bool(ok) and int(state.step) == 1
    moved = jax.tree_util.tree_map(
        lambda a, b: not np.array_equal(np.asarray(a), b), state.tables, before.tables
    )
    assert all(jax.tree_util.tree_leaves(moved))


def test_an_eager_core_call_is_one_program_and_matches_the_jitted_one():
    """The core's programs called outside any jit (as linen's `init` does) compile as one
    program each, not one per op of their shard_map body (an eager `shard_map` compiles
    each op anew on every call: 193 programs for one raw-id table's map_ids once), and
    give what the same call inside a jit gives."""
    feats, mesh = _setup(2)
    facade = em.MeshEmbedding(feats, em.Adagrad(0.5), mesh=mesh, capacities=Capacity(64, 64))
    facade.build()
    core = facade.core
    state = core.init(jax.random.key(3))
    csr = facade.enqueue(next(_batches(1, seed=5))[0])
    compiles = []

    def count(event, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        eager = jax.block_until_ready(core.lookup(state, csr))
        first = len(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    jitted = jax.jit(core.lookup)(state, csr)
    assert 1 <= first <= 2, first  # the program (and at most one transfer's)
    for name in feats:
        np.testing.assert_array_equal(np.asarray(eager[name]), np.asarray(jitted[name]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_small_shards_built_on_the_host_equal_the_device_built_ones(dtype, monkeypatch):
    """`make_stack_array` assembles a shard under `ops.HUGE_PAGE_MIN_BYTES` in numpy: the
    same bits as the device path (fill, then each piece converted by XLA and written),
    a default a column too; a piece that does not fit its shard is refused."""
    from embedmesh.device import ops, stack_tables

    feats, mesh = _setup(4)
    facade = em.MeshEmbedding(feats, em.Adagrad(0.5), mesh=mesh)
    facade.build()
    core = facade.core
    spec = core.plan.stacks[0]
    rows, width = spec.rows_per_shard, spec.width
    rng = np.random.default_rng(11)
    # float32 values whose conversion rounds (ties and carries among them)
    values = {
        j: [
            (int(o), rng.normal(size=(n, c)).astype(np.float32) * 3.0 ** rng.integers(-3, 4), k)
            for o, n, k, c in [(0, 2, 0, width), (rows - 3, 3, 1, width - 1), (1, 1, 2, 2)]
        ]
        for j in range(4)
    }
    default = rng.uniform(0.1, 1.0, width).astype(np.float32)

    def pieces(j, device):
        return iter(values[j])

    host = stack_tables.make_stack_array(core, spec.name, default, pieces, dtype=dtype)
    monkeypatch.setattr(ops, "HUGE_PAGE_MIN_BYTES", 0)  # every shard on its device
    device = stack_tables.make_stack_array(core, spec.name, default, pieces, dtype=dtype)
    assert host.sharding == device.sharding and host.dtype == device.dtype == np.dtype(dtype)
    for a, b in zip(host.addressable_shards, device.addressable_shards):
        assert a.device == b.device
        np.testing.assert_array_equal(
            np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)
        )
    # and what a plain numpy build of shard 2 with XLA's conversion holds
    want = np.broadcast_to(np.asarray(jnp.asarray(default, dtype)), (rows, width)).copy()
    for o, x, k in values[2]:
        want[o : o + x.shape[0], k : k + x.shape[1]] = np.asarray(jnp.asarray(x, dtype))
    got = np.asarray(host)[2 * rows : 3 * rows]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"does not fit a shard"):
        stack_tables.make_stack_array(
            core, spec.name, 0.0, lambda j, d: iter([(rows - 1, np.ones((2, width)), 0)])
        )
