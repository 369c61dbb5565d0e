"""embedmesh.flax: the nnx and linen modules train to the same tables and activations as
MeshEmbedding on the same batches (every sharding strategy, 1 and 4 devices), to a float64
numpy reference for SGD, and their checkpoints restore on another device count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import training_reference as ref
from hypothesis import example, given, settings
from hypothesis import strategies as st
from meshes import mesh_of

import embedmesh as em
from embedmesh import checkpoint as em_ckpt

pytest.importorskip("flax")
from flax import nnx

from embedmesh.flax import linen as em_linen
from embedmesh.flax import nnx as em_nnx

STEPS = 3
BATCH = 8


def features():
    t1 = em.TableConfig(40, 8, combiner="mean", name="t1")
    t2 = em.TableConfig(25, 4, combiner="sqrtn", name="t2")
    return {
        "a": em.FeatureConfig(t1),
        "b": em.FeatureConfig(t2),
        "r": em.FeatureConfig(t2),
        "s": em.FeatureConfig(t1, max_sequence_length=2),
    }


def batches(seed, steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 4, batch)
        idx = np.array([[b, p] for b in range(batch) for p in range(int(rng.integers(0, 3)))])
        idx = idx.reshape(-1, 2)
        out.append(
            {
                "a": rng.integers(0, 40, (batch, 2)),
                "b": rng.integers(0, 25, batch),
                "r": em.RaggedTensor.from_row_lengths(
                    rng.integers(0, 25, int(lengths.sum())), lengths
                ),
                "s": em.SparseTensor(idx, rng.integers(0, 40, len(idx)), (batch, 3)),
            }
        )
    return out


def grad_of(acts):
    """d loss / d activations: a fixed nonlinear function of the activations."""
    return jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, acts)


def linen_train_step(lin):
    """A jitted training step of the linen module `lin`, `(variables, csr) -> (variables,
    activations)`: the batch's raw ids mapped, the lookup, the update from `grad_of` the
    activations (pipelined: deferred to the next step's lookup)."""

    @jax.jit
    def step(variables, csr):
        csr, variables = lin.apply(variables, csr, method="map_ids", mutable=["embedding"])
        acts, variables = lin.apply(variables, csr, mutable=["embedding"])
        _, variables = lin.apply(
            variables, grad_of(acts), csr, method="apply_gradients", mutable=["embedding"]
        )
        return variables, acts

    return step


def layer(n, opt, sharding="mod", seed=0):
    return em.MeshEmbedding(features(), opt, mesh=mesh_of(n), sharding=sharding, seed=seed)


def train_facade(n, opt, data, sharding):
    emb = layer(n, opt, sharding)
    acts_seen = []
    for batch in data:
        acts, pre = emb(batch)
        acts_seen.append(jax.tree_util.tree_map(np.asarray, acts))
        emb.apply_gradients(grad_of(acts), pre)
    return emb.variables, acts_seen


def train_nnx(n, opt, data, sharding):
    embed = em_nnx.Embed(layer(n, opt, sharding))

    @nnx.jit
    def step(embed, csr):
        acts = embed(csr)
        embed.apply_gradients(grad_of(acts), csr)
        return acts

    acts_seen = [jax.tree_util.tree_map(np.asarray, step(embed, embed.enqueue(b))) for b in data]
    return embed.variables, acts_seen, embed


def linen_steps(embed, data) -> tuple:
    """`(variables, activations)` of a linen `Embed` trained on `data` (the batch mapped
    first: `map_ids` gives a batch without raw ids back as it is)."""
    variables = embed.init(jax.random.key(0), embed.enqueue(data[0]))

    @jax.jit
    def step(variables, csr):
        csr, variables = embed.apply(variables, csr, method="map_ids", mutable=["embedding"])
        acts = embed.apply(variables, csr)
        _, variables = embed.apply(
            variables, grad_of(acts), csr, method="apply_gradients", mutable=["embedding"]
        )
        return variables, acts

    acts_seen = []
    for b in data:
        variables, acts = step(variables, embed.enqueue(b))
        acts_seen.append(jax.tree_util.tree_map(np.asarray, acts))
    return variables, acts_seen


def train_linen(n, opt, data, sharding):
    embed = em_linen.Embed(layer(n, opt, sharding))
    variables, acts_seen = linen_steps(embed, data)
    state = em_linen.state_of(variables)
    job = embed.layer.job
    out = {
        t: {
            f: job.read_table(state, t, f)
            for f in ["parameters", *state.slots[job.plan.stack_of(t).name]]
        }
        for t in job.tables
    }
    return out, acts_seen


def assert_same(a_vars, a_acts, b_vars, b_acts):
    by_name = {t.name: d for t, d in b_vars.items()}
    for t, d in a_vars.items():
        for k, v in d.items():
            np.testing.assert_allclose(v, by_name[t.name][k], rtol=1e-5, atol=1e-6, err_msg=k)
    for x, y in zip(a_acts, b_acts):
        for k in x:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize(
    "n, sharding",
    # (mod on 4 devices: the SGD reference, the linen batch-size and the checkpoint tests;
    # pooled and replicated side by side: one layer, a program set, for both)
    [(1, "mod"), (4, {"t1": "row_wise_pooled", "t2": "data_parallel"}), (4, "table_wise")],
    ids=["1-mod", "4-pooled_and_data_parallel", "4-table_wise"],
)
def test_nnx_and_linen_train_like_mesh_embedding(n, sharding):
    data = batches(n)
    opt = em.Adagrad(0.3, initial_accumulator_value=0.2)
    want_vars, want_acts = train_facade(n, opt, data, sharding)
    got_vars, got_acts, _ = train_nnx(n, opt, data, sharding)
    assert_same(got_vars, got_acts, want_vars, want_acts)
    if sharding in ("mod", "table_wise"):
        got_vars, got_acts = train_linen(n, opt, data, sharding)
        assert_same(got_vars, got_acts, want_vars, want_acts)


def test_nnx_sgd_matches_float64_reference():
    feats = features()
    data = batches(11)
    lr = 0.25
    embed = em_nnx.Embed(em.MeshEmbedding(feats, em.SGD(lr), mesh=mesh_of(4)))
    tables = {t.name: v.astype(np.float64) for t, v in embed.embedding_tables.items()}

    @nnx.jit
    def step(embed, csr):
        acts = embed(csr)
        embed.apply_gradients(grad_of(acts), csr)
        return acts

    for batch in data:
        acts = step(embed, embed.enqueue(batch))
        lays = {n: ref.layout(f, batch[n], None) for n, f in feats.items()}
        for n, f in feats.items():  # the module's activations, from the float64 tables
            want = ref.activation(tables[f.table.name], lays[n])
            np.testing.assert_allclose(np.asarray(acts[n]), want, rtol=1e-5, atol=1e-6)
        dacts = {
            n: np.sin(3.0 * ref.activation(tables[f.table.name], lays[n])) + 0.1
            for n, f in feats.items()
        }
        grads = ref.row_gradients([(n, f.table.name, lays[n]) for n, f in feats.items()], dacts)
        for t, rows in grads.items():
            for i, g in rows.items():
                tables[t][i] -= lr * g
    for t, v in embed.embedding_tables.items():
        np.testing.assert_allclose(v, tables[t.name], rtol=1e-5, atol=1e-5, err_msg=t.name)
    # what the facade shows, the module shows: its plan and the latest batch's statistics
    assert embed.plan is embed.layer.plan
    assert all(f.table.name in str(embed.plan) for f in feats.values())
    stats = embed.last_stats
    assert stats is embed.layer.last_stats
    assert set(stats.stacks) == {s.name for s in embed.plan.stacks}


def test_flax_checkpoint_restores_on_another_device_count(tmp_path):
    data = batches(5, steps=2)
    opt = em.Adagrad(0.3)
    _, _, embed4 = train_nnx(4, opt, data, "mod")
    import orbax.checkpoint as ocp

    path = tmp_path / "ckpt"
    with ocp.CheckpointManager(path) as mngr:
        # saved as orbax step 7 after 2 updates: a restore returns the update count
        mngr.save(7, args=ocp.args.Composite(embedding=embed4.save_args()))
        mngr.wait_until_finished()
    # a MeshEmbedding, an nnx module on 1 device and a linen module on 2 read it back
    want = {t.name: d for t, d in embed4.variables.items()}
    embed1 = em_nnx.Embed(layer(1, opt, seed=3))
    assert embed1.restore(str(path)) == 2  # as checkpoint.restore returns it
    assert int(embed1.step.get_value()) == 2
    lin = em_linen.Embed(layer(2, opt, "table_wise", seed=4))
    v = lin.init(jax.random.key(0), lin.enqueue(data[0]))
    v = lin.restore(v, str(path))
    emb = layer(2, opt)
    assert em_ckpt.restore(emb, str(path)) == 2
    for got in (
        embed1.variables,
        {t: {"parameters": a} for t, a in lin.embedding_tables(v).items()},
        emb.variables,
    ):
        for t, d in got.items():
            for k, a in d.items():
                np.testing.assert_array_equal(a, want[t.name][k], err_msg=f"{t.name} {k}")


def test_bad_gradient_names_the_feature():
    embed = em_nnx.Embed(layer(1, em.SGD(0.1)))
    csr = embed.enqueue(batches(0, steps=1)[0])
    acts = embed(csr)
    grads = dict(acts, b=jnp.zeros((3, 4)))
    with pytest.raises(ValueError, match="feature b"):
        embed.apply_gradients(grads, csr)


def test_nnx_param_filters_do_not_see_the_tables():
    embed = em_nnx.Embed(layer(1, em.Adagrad(0.1)))
    assert not jax.tree_util.tree_leaves(nnx.state(embed, nnx.Param))
    leaves = jax.tree_util.tree_leaves(nnx.state(embed, em_nnx.EmbeddingVariable))
    stacks = len(embed.layer.plan.stacks)
    assert len(leaves) == 2 * stacks + 1  # each stack's table and accumulators, the step
    assert {a.shape for a in leaves if a.ndim} == {
        embed.core.stack_shape(s.name) for s in embed.layer.plan.stacks
    }
    specs = jax.tree_util.tree_leaves(nnx.get_partition_spec(nnx.state(embed.tables)))
    assert len(specs) == stacks  # rows over the mesh axis, columns whole
    assert all(tuple(p)[0] in ("x", ("x",)) and set(tuple(p)[1:]) <= {None} for p in specs)


def test_nnx_two_processes_train_like_one(tmp_path):
    """Two jax.distributed processes of 2 CPU devices each train the nnx module to the
    tables MeshEmbedding reaches in one process of 4 devices (this one's)."""
    import os
    import sys

    from flax_multiprocess_model import train_facade
    from process_helpers import HERE, free_port, run_together, worker_env

    worker = os.path.join(HERE, "flax_multiprocess_worker.py")
    multi = tmp_path / "multi.npz"
    port = free_port()
    run_together(
        [[sys.executable, worker, str(i), "2", str(port), str(multi)] for i in range(2)],
        env=worker_env(),
    )
    want = {f"{t.name}.{k}": v for t, d in train_facade(mesh_of(4)).items() for k, v in d.items()}
    got = np.load(multi)
    assert sorted(want) == sorted(got.files) and want
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_clear_errors_for_what_the_modules_do_not_take():
    with pytest.raises(TypeError, match="MeshEmbedding"):
        em_nnx.Embed(features())
    lin = em_linen.Embed(layer(1, em.SGD(0.1)))
    csr = lin.enqueue(batches(0, steps=1)[0])
    with pytest.raises(ValueError, match="'embedding' collection is missing"):
        lin.apply({}, csr)


def test_nnx_jit_with_donation_updates_the_tables_in_place():
    embed = em_nnx.Embed(layer(2, em.Adagrad(0.1)))

    @nnx.jit(donate_argnums=0)
    def step(embed, csr):
        embed.apply_gradients(grad_of(embed(csr)), csr)

    def pointers():
        arrays = [v.get_value() for v in embed.tables.values()]
        return [s.data.unsafe_buffer_pointer() for a in arrays for s in a.addressable_shards]

    data = batches(2, steps=2)
    step(embed, embed.enqueue(data[0]))
    before, tables = pointers(), embed.embedding_tables
    step(embed, embed.enqueue(data[1]))
    assert pointers() == before  # the same buffers, written in place
    assert any((embed.embedding_tables[t] != a).any() for t, a in tables.items())


def test_linen_inside_a_model_gives_activation_gradients_through_perturbations():
    """`Embed` marks its activations as a perturbation: jax.grad over the
    "perturbations" collection of a larger linen model is d loss / d activations, which
    `apply_gradients` takes; here loss = sum(acts^2) / 2, whose gradient is acts. The
    perturbations are per batch: `init` makes none for `Embed` (the model's own
    perturbation is its business), an `apply` with the collection mutable does."""
    import flax.linen as nn

    emb_layer = layer(2, em.SGD(0.5))
    embed = em_linen.Embed(emb_layer)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, csr):
            acts = em_linen.Embed(emb_layer, name="embed")(csr)
            total = sum(jnp.sum(jnp.square(a)) for a in jax.tree_util.tree_leaves(acts)) / 2
            return self.perturb("total", total), acts

    model = Model()
    data = batches(9, steps=1)
    csr = embed.enqueue(data[0])
    variables = model.init(jax.random.key(0), csr)
    assert set(variables) == {"embedding", "perturbations"}
    assert set(variables["perturbations"]) == {"total"}  # the model's, not Embed's
    acts = model.apply(variables, csr)[1]  # a collection without Embed's: no perturbation
    _, perturbations = model.apply(variables, csr, mutable=["perturbations"])
    assert set(perturbations["perturbations"]) == {"total", "embed"}

    def loss(perturbations):
        return model.apply({**variables, **perturbations}, csr)[0]

    grads = jax.grad(loss)(perturbations)["perturbations"]["embed"]["activations"]
    for k in acts:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(acts[k]), rtol=1e-6)
    before = embed.embedding_tables({"embedding": variables["embedding"]["embed"]})
    _, new = embed.apply(
        {"embedding": variables["embedding"]["embed"]},
        grads,
        csr,
        method="apply_gradients",
        mutable=["embedding"],
    )
    after = embed.embedding_tables(new)
    assert any((after[t] != before[t]).any() for t in before)  # the tables moved
    facade = layer(2, em.SGD(0.5))  # the same update through MeshEmbedding
    a, pre = facade(data[0])
    facade.apply_gradients(a, pre)
    want = {t.name: v for t, v in facade.embedding_tables.items()}
    for t, v in after.items():
        np.testing.assert_allclose(v, want[t.name], rtol=1e-5, atol=1e-6, err_msg=t.name)


def test_linen_init_on_one_batch_size_applies_and_trains_on_another():
    """Issue #40: `init` returns only the "embedding" collection (the perturbations of
    the activations are shaped by a batch, so they are made per batch, never by
    `init`): initialized on a batch of 8, the module looks up and trains on batches of
    12 as MeshEmbedding does, d loss / d activations taken through perturbations made
    for the batch of 12; perturbations made for another batch are a clear error."""
    opt = em.Adagrad(0.3, initial_accumulator_value=0.2)
    embed = em_linen.Embed(layer(4, opt))
    small, big = batches(12, steps=1, batch=8)[0], batches(13, steps=2, batch=12)
    variables = embed.init(jax.random.key(0), embed.enqueue(small))
    only_embedding = set(variables) == {"embedding"}  # checked last: first, the batch of 12

    def loss(perturbations, variables, csr):  # d loss / d acts = grad_of(acts)
        acts = embed.apply({**variables, **perturbations}, csr)
        return sum(jnp.sum(-jnp.cos(3.0 * a) / 3.0 + 0.1 * a) for a in jax.tree.leaves(acts))

    @jax.jit
    def step(variables, csr):
        acts, perturbations = embed.apply(variables, csr, mutable=["perturbations"])
        g_acts = jax.grad(loss)(perturbations, variables, csr)["perturbations"]["activations"]
        _, variables = embed.apply(
            variables, g_acts, csr, method="apply_gradients", mutable=["embedding"]
        )
        return variables, acts

    facade = layer(4, opt)
    for b in big:
        csr = embed.enqueue(b)
        want, pre = facade(b)
        got = [embed.apply(variables, csr)] if b is big[0] else []  # outside a jit too
        variables, acts = step(variables, csr)
        assert set(variables) == {"embedding"}
        facade.apply_gradients(grad_of(want), pre)
        for k, x in [(k, x) for a in (acts, *got) for k, x in a.items()]:
            np.testing.assert_allclose(np.asarray(x), want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    want = {t.name: v for t, v in facade.embedding_tables.items()}
    for t, v in embed.embedding_tables(variables).items():
        np.testing.assert_allclose(v, want[t.name], rtol=1e-5, atol=1e-6, err_msg=t.name)
    assert only_embedding  # what init returned
    _, of_small = embed.apply(variables, embed.enqueue(small), mutable=["perturbations"])
    with pytest.raises(ValueError, match="perturbations.*another batch"):
        embed.apply({**variables, **of_small}, embed.enqueue(big[0]))


# names that are attributes of a mapping, an nnx container or the module, or odd strings
AWKWARD_NAMES = [
    "items", "keys", "values", "get", "pop", "update", "__class__", "__init__", "__dict__",
    "__getattr__", "_pytree__nodes", "_pytree__state", "tables", "slots", "step", "layer",
    "state", "a.b", "a-b", "a/b", "a b", "ü表", "0",
]  # fmt: skip


@settings(max_examples=1, deadline=None)
@given(
    st.lists(
        st.sampled_from(AWKWARD_NAMES) | st.text(min_size=1, max_size=6),
        min_size=2,
        max_size=2,
        unique=True,
    )
)
@example(["items", "b"])  # issue #40's name, then one a Python object has
@example(["__class__", "a.b"])
def test_nnx_takes_any_table_name(names):
    """Issue #40: the nnx module's tables and slots are keyed by stack name, which is the
    user's table name; no name collides with the container's methods or attributes
    (`items` once hid `.items()`). A lookup and an Adagrad step under `nnx.jit` match
    MeshEmbedding on the same tables."""
    t1 = em.TableConfig(30, 8, combiner="mean", name=names[0])
    t2 = em.TableConfig(20, 16, combiner="sum", name=names[1])  # a stack each
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
    rng = np.random.default_rng(0)
    batch = {"a": rng.integers(0, 30, (BATCH, 2)), "b": rng.integers(0, 20, BATCH)}
    opt = em.Adagrad(0.3, initial_accumulator_value=0.2)
    embed = em_nnx.Embed(em.MeshEmbedding(feats, opt, mesh=mesh_of(2)))
    facade = em.MeshEmbedding(feats, opt, mesh=mesh_of(2))
    stacks = {s.name for s in embed.layer.plan.stacks}
    assert stacks == set(names)
    assert set(embed.tables) == set(embed.slots) == stacks
    assert set(embed.state.tables) == stacks

    @nnx.jit
    def step(embed, csr):
        acts = embed(csr)
        embed.apply_gradients(grad_of(acts), csr)
        return acts

    acts = step(embed, embed.enqueue(batch))
    want, pre = facade(batch)
    facade.apply_gradients(grad_of(want), pre)
    assert_same(embed.variables, [acts], facade.variables, [want])
    assert int(embed.step.get_value()) == 1
    state = nnx.state(embed, em_nnx.EmbeddingVariable)
    assert set(state["tables"]) == stacks


def test_tables_of_raw_ids_train_like_mesh_embedding():
    """A table of raw ids (`TableConfig.id_map`, 4 rows a shard: the stream evicts) beside a
    static one: nnx and linen, the batch mapped by the module's `map_ids` inside the
    jitted step, give the facade's activations, rows by id and slots; the forward pass
    refuses a batch still carrying raw ids."""
    pool = np.array([0, -1, 2**63 - 1, -(2**63), 2**40, 7, 8, 16, 123456789012, -8], np.int64)
    rng = np.random.default_rng(3)
    data = [
        {"raw": rng.choice(pool, (BATCH, 2)), "plain": rng.integers(0, 25, BATCH)} for _ in range(4)
    ]

    def raw_layer():
        dyn = em.TableConfig(8, 4, combiner="mean", name="dyn", id_map=em.DynamicIds("lfu"))
        plain = em.TableConfig(25, 4, name="plain")
        fc = {"raw": em.FeatureConfig(dyn), "plain": em.FeatureConfig(plain)}
        return em.MeshEmbedding(fc, em.Adagrad(0.2), mesh=mesh_of(2), seed=1)

    emb = raw_layer()
    want, evictions = [], 0
    for b in data:
        acts, pre = emb(b)
        want.append(jax.tree_util.tree_map(np.asarray, acts))
        emb.apply_gradients(grad_of(acts), pre)
        evictions += emb.last_stats["dyn"].id_map["evictions"]
    assert evictions > 0
    want_tables = emb.embedding_tables

    nnx_embed = em_nnx.Embed(raw_layer())
    with pytest.raises(ValueError, match=r"stacks \['dyn'\] of this batch still carry raw ids"):
        nnx_embed(nnx_embed.enqueue(data[0]))

    got_nnx = [raw_id_step(nnx_embed, nnx_embed.enqueue(b)) for b in data]

    lin = em_linen.Embed(raw_layer())
    variables, got_linen = linen_steps(lin, data)  # (init leaves the maps empty)
    for got, tables in (
        (got_nnx, nnx_embed.embedding_tables),
        (got_linen, lin.embedding_tables(variables)),
    ):
        for x, y in zip(got, want):
            for k in y:
                np.testing.assert_allclose(np.asarray(x[k]), y[k], rtol=1e-5, atol=1e-6)
        by_name = {t.name: v for t, v in tables.items()}
        for t, v in want_tables.items():
            if t.name == "dyn":
                np.testing.assert_array_equal(by_name["dyn"].ids, v.ids)
                np.testing.assert_allclose(by_name["dyn"].rows, v.rows, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_allclose(by_name[t.name], v, rtol=1e-5, atol=1e-6)


def _pipelined_layer(raw: bool, n: int = 2):
    """A pipelined layer; with `raw`, a table of raw ids (4 rows a shard: the stream
    evicts) beside the static tables."""
    fc = features()
    if raw:
        dyn = em.TableConfig(8, 4, combiner="mean", name="dyn", id_map=em.DynamicIds("lru"))
        fc["raw"] = em.FeatureConfig(dyn)
    opt = em.Adagrad(0.3, initial_accumulator_value=0.2)
    return em.MeshEmbedding(fc, opt, True, mesh=mesh_of(n), seed=2)


def _pipelined_data(raw: bool, steps: int = 5) -> list:
    data = batches(7, steps=steps)
    pool = np.array([3, -1, 2**62, -(2**63), 2**40, 7, 11, 16, 123456789012, -8], np.int64)
    rng = np.random.default_rng(8)
    for b in data:
        if raw:
            b["raw"] = rng.choice(pool, (BATCH, 2))
    return data


@nnx.jit
def raw_id_step(embed, csr):
    """One nnx training step of a module that may hold tables of raw ids: map, look up,
    update."""
    csr = embed.map_ids(csr)
    acts = embed(csr)
    embed.apply_gradients(grad_of(acts), csr)
    return acts


def _assert_tables(got: dict, want: dict) -> None:
    by_name = {t.name: v for t, v in got.items()}
    assert sorted(by_name) == sorted(t.name for t in want)
    for t, v in want.items():
        if hasattr(v, "ids"):  # a table of raw ids: its live ids and their rows
            np.testing.assert_array_equal(by_name[t.name].ids, v.ids)
            np.testing.assert_allclose(by_name[t.name].rows, v.rows, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_allclose(by_name[t.name], v, rtol=1e-5, atol=1e-6, err_msg=t.name)


@pytest.mark.parametrize("raw", [False, True])
def test_pipelined_modules_train_like_the_pipelined_facade(raw):
    """pipeline_execution_with_tensor_core=True: nnx and linen defer each update to the
    next forward pass, whose lookup reads the tables one update stale, through the job's
    step functions; after N steps they hold the pipelined facade's tables (and, with a
    table of raw ids, its live ids and rows) and saw its activations at every step."""
    data = _pipelined_data(raw)
    emb = _pipelined_layer(raw)
    want_acts = []
    for b in data:
        acts, pre = emb(b)
        want_acts.append(jax.tree_util.tree_map(np.asarray, acts))
        emb.apply_gradients(grad_of(acts), pre)
    want = emb.embedding_tables

    embed = em_nnx.Embed(_pipelined_layer(raw))

    got = [jax.tree_util.tree_map(np.asarray, raw_id_step(embed, embed.enqueue(b))) for b in data]
    assert embed.pending is not None  # the last update still deferred
    _assert_tables(embed.embedding_tables, want)
    for x, y in zip(got, want_acts):
        for k in y:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-6, err_msg=k)
    embed.flush()
    assert embed.pending is None
    _assert_tables(embed.embedding_tables, want)

    lin = em_linen.Embed(_pipelined_layer(raw))
    variables = lin.init(jax.random.key(0), lin.enqueue(data[0]))

    linen_step = linen_train_step(lin)
    for b, y in zip(data, want_acts):
        variables, acts = linen_step(variables, lin.enqueue(b))
        for k in y:
            np.testing.assert_allclose(np.asarray(acts[k]), y[k], rtol=1e-5, atol=1e-6)
    _assert_tables(lin.embedding_tables(variables), want)
