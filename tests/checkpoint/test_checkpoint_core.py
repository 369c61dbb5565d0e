"""Checkpoints on the functional core (issue #13 part 3): a user of `EmbeddingCore` in a
jitted train step of their own saves and restores without a facade; the facade's calls
are wrappers of the same functions. And the row layout a checkpoint records."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from checkpoint_common import HashInit, save_edited, variables_by_name
from meshes import mesh_of

import embedmesh as em
from embedmesh import checkpoint as ckpt
from embedmesh.device.core import EmbeddingCore
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity, preprocess_features
from embedmesh.layout.stacking import plan_stacking

CAPS = Capacity(64, 64)
LR, ACC0 = 0.3, 0.1
OPT = em.Adagrad(LR, initial_accumulator_value=ACC0)
# u and w stack (dims pad to 8), z has a stack of its own; row-aware initialisers, so the
# initial tables do not depend on the device count
TABLES = {
    "u": em.TableConfig(37, 8, combiner="sum", name="u", initializer=HashInit(1)),
    "w": em.TableConfig(53, 4, combiner="sum", name="w", initializer=HashInit(2)),
    "z": em.TableConfig(20, 16, combiner="sum", name="z", initializer=HashInit(3)),
}
FEATS = {
    "fu": em.FeatureConfig(TABLES["u"]),
    "fw": em.FeatureConfig(TABLES["w"]),
    "fz": em.FeatureConfig(TABLES["z"]),
}
BATCH = 12  # a multiple of every device count used here


def batch(step):
    """Dense ids (one plain lookup per id: activation ids.shape + [dim]) and the fixed
    cotangents of the loss sum(acts * targets) (so the gradient of the activations)."""
    rng = np.random.default_rng(100 + step)
    ids = {
        "fu": rng.integers(0, 37, BATCH),
        "fw": rng.integers(0, 53, BATCH),
        "fz": rng.integers(0, 20, (BATCH, 2)),
    }
    dims = {"fu": 8, "fw": 4, "fz": 16}
    targets = {k: rng.normal(size=v.shape + (dims[k],)).astype(np.float32) for k, v in ids.items()}
    return ids, targets


def reference(steps):
    """float64 Adagrad on the logical tables, loops written for clarity: the gradient of
    a row is the sum of the targets of every lookup of it; each row seen is updated once."""
    feature_table = {"fu": "u", "fw": "w", "fz": "z"}
    params = {
        n: t.initializer(None, (t.vocabulary_size, t.dim), np.float32).astype(np.float64)
        for n, t in TABLES.items()
    }
    acc = {n: np.full_like(p, ACC0) for n, p in params.items()}
    for step in range(steps):
        ids, targets = batch(step)
        grads = {n: {} for n in TABLES}
        for f, table in feature_table.items():
            flat_ids = ids[f].reshape(-1)
            flat_t = targets[f].reshape(len(flat_ids), -1).astype(np.float64)
            for i, g in zip(flat_ids, flat_t):
                grads[table][int(i)] = grads[table].get(int(i), 0.0) + g
        for table, rows in grads.items():
            for i, g in rows.items():
                acc[table][i] += g * g
                params[table][i] -= LR * g / np.sqrt(acc[table][i])
    return {n: {"parameters": params[n], "accumulators": acc[n]} for n in TABLES}


class FunctionalUser:
    """What a user of the functional core writes: a plan, a core, a state and their own
    jitted train step (`core.lookup` + `core.apply_gradients`), no `MeshEmbedding`."""

    def __init__(self, n):
        self.plan = plan_stacking(FEATS, n, default_optimizer=OPT)
        self.core = EmbeddingCore(self.plan, mesh_of(n), OPT)
        self.state = self.core.init(jax.random.key(0))
        self.n = n
        core = self.core

        def loss(acts, targets):
            return sum(jnp.sum(acts[k] * targets[k]) for k in targets)

        @jax.jit
        def train_step(state, csr, targets):
            acts = core.lookup(state, csr)
            g_acts = jax.grad(loss)(acts, targets)
            state, ok = core.apply_gradients(state, g_acts, csr)
            return state, ok

        self.train_step = train_step

    def step(self, step):
        ids, targets = batch(step)
        csr, _ = preprocess_features(
            ids, None, self.plan, num_devices_local=self.n, capacities=CAPS
        )
        self.state, ok = self.train_step(self.state, self.core.put(csr), targets)
        assert bool(ok)

    def variables(self, state=None):
        return variables_of(self.core, self.state if state is None else state)


def variables_of(core, state):
    """`{table: {"parameters": ..., slot: ...}}` of a state, logical rows (numpy)."""
    return {
        t.name: {
            "parameters": core.read_table(state.tables[t.stack], t),
            **{k: core.read_table(a, t) for k, a in state.slots[t.stack].items()},
        }
        for t in core.plan.tables
    }


def assert_bit_identical(got, want):
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]), name
        for k in want[name]:
            a, b = np.asarray(got[name][k]), np.asarray(want[name][k])
            assert a.dtype == b.dtype and a.shape == b.shape, (name, k)
            assert a.tobytes() == b.tobytes(), f"{name}.{k}"


def assert_close_to(got, want, msg=""):
    for name in want:
        for k in want[name]:
            np.testing.assert_allclose(
                got[name][k], want[name][k], rtol=2e-5, atol=2e-6, err_msg=f"{msg} {name}.{k}"
            )


@pytest.mark.parametrize("n_from,n_to", [(4, 3)])
def test_functional_core_checkpoint_across_device_counts(tmp_path, n_from, n_to):
    user = FunctionalUser(n_from)
    for s in range(3):
        user.step(s)
    saved = user.variables()
    assert_close_to(saved, reference(3), "trained")
    # saved with orbax beside the user's dense parameters, from the core and its state
    dense = {"w": np.arange(6.0).reshape(2, 3)}
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")  # async saves
    mngr.save(
        3,
        args=ocp.args.Composite(
            embedding=ckpt.core_save_args(user.core, user.state),
            params=ocp.args.StandardSave(dense),
        ),
    )
    mngr.wait_until_finished()
    meta = ckpt.read_metadata(mngr)
    assert (meta["step"], meta["num_shards"], meta["row_layout"]) == (3, n_from, "mod")
    # ... and with the functional save into a directory
    assert ckpt.core_save(tmp_path / "dir", user.core, user.state)
    assert ckpt.read_metadata(tmp_path / "dir")["step"] == 3

    # restored onto a core of another device count: a new state, the given one unchanged
    other = FunctionalUser(n_to)
    initial = other.variables()
    restored = ckpt.core_restore(other.core, other.state, mngr)
    assert isinstance(restored, ckpt.RestoredState)
    assert restored.step == 3 and int(restored.state.step) == 3
    assert restored.lookup_tables == {} and restored.lookup_state() is restored.state
    assert_bit_identical(other.variables(), initial)  # not donated, not changed
    assert_bit_identical(other.variables(restored.state), saved)
    assert_bit_identical(
        other.variables(ckpt.core_restore(other.core, other.state, tmp_path / "dir").state), saved
    )
    # the same tables as a facade restore on that device count
    facade = MeshEmbedding(FEATS, OPT, mesh=mesh_of(n_to), capacities=CAPS)
    assert ckpt.restore(facade, mngr) == 3
    assert_bit_identical(variables_by_name(facade), saved)
    params = mngr.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore(dense)))[
        "params"
    ]
    np.testing.assert_array_equal(params["w"], dense["w"])
    mngr.close()

    # the restored state trains on in the user's own step like the uninterrupted run
    other.state = restored.state
    other.step(3)
    assert int(other.state.step) == 4
    assert_close_to(other.variables(), reference(4), "resumed")


def test_pipelined_core_restore_is_what_the_facade_installs(tmp_path):
    """A checkpoint of a pipelined facade saved with an update pending: core_restore with
    pipelined=True gives the tables the next lookup reads (`lookup_state()`) and the state
    after it, the two states a pipelined facade restore installs; unpipelined, none."""
    piped = MeshEmbedding(FEATS, OPT, True, mesh=mesh_of(2), capacities=CAPS)
    for s in range(2):
        ids, targets = batch(s)
        _, pre = piped(ids)
        piped.apply_gradients(targets, pre)  # pending: the next lookup applies it
    ckpt.save(tmp_path, piped)
    assert {m["name"] for m in ckpt.read_metadata(tmp_path)["tables"] if m["lookup"]} == set(TABLES)
    facade = MeshEmbedding(FEATS, OPT, True, mesh=mesh_of(3), capacities=CAPS)
    assert ckpt.restore(facade, tmp_path) == 2
    core = facade.core
    fresh = core.init(jax.random.key(1))
    got = ckpt.core_restore(core, fresh, tmp_path, pipelined=True)
    assert got.step == 2 and set(got.lookup_tables) == {s.name for s in core.plan.stacks}

    def tables(state):
        return {t.name: core.read_table(state.tables[t.stack], t) for t in core.plan.tables}

    for mine, theirs in ((got.lookup_state(), facade.state), (got.state, facade.observed_state())):
        assert int(mine.step) == int(theirs.step)
        assert_bit_identical({"t": tables(mine)}, {"t": tables(theirs)})
    assert_bit_identical(variables_by_name(facade), variables_of(core, got.state))
    plain = ckpt.core_restore(core, fresh, tmp_path)  # not pipelined: no lookup tables
    assert plain.lookup_tables == {}
    assert_bit_identical({"t": tables(plain.state)}, {"t": tables(got.state)})


def _save_with_layout(root, emb, layout):
    """A checkpoint of `emb` whose metadata names row layout `layout` (None: no key, as
    checkpoints written before the key existed)."""

    def edit(meta):
        assert meta["row_layout"] == "mod"
        if layout is None:
            del meta["row_layout"]
        else:
            meta["row_layout"] = layout

    save_edited(root, emb, 1, edit)


def test_row_layout_recorded_defaulted_and_unknown_refused(tmp_path):
    rng = np.random.default_rng(0)
    emb = MeshEmbedding(FEATS, OPT, mesh=mesh_of(4), capacities=CAPS, sharding="mod")
    emb.set_tables(
        {
            t: rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32)
            for t in TABLES.values()
        },
        step=1,
    )
    values = variables_by_name(emb)
    _save_with_layout(tmp_path / "old", emb, None)  # no key: the mod layout
    target = MeshEmbedding(FEATS, OPT, mesh=mesh_of(2), capacities=CAPS)
    assert ckpt.restore(target, tmp_path / "old") == 1
    assert_bit_identical(variables_by_name(target), values)
    loaded = {t.name: v for t, v in ckpt.load_tables(tmp_path / "old").items()}
    assert_bit_identical(
        {n: {"parameters": v} for n, v in loaded.items()},
        {n: {"parameters": d["parameters"]} for n, d in values.items()},
    )

    for bad in ("tablewise", 3):
        root = tmp_path / f"bad_{bad}"
        _save_with_layout(root, emb, bad)
        other = MeshEmbedding(FEATS, OPT, mesh=mesh_of(2), capacities=CAPS)
        other.build()
        before = variables_by_name(other)
        pattern = (
            rf"checkpoint item {re.escape(str(root))}/1/embedding lays its rows out "
            rf"by {bad!r} .*row layout this embedmesh does not know \(it knows "
            rf"\['mod'\]\)"
        )
        with pytest.raises(ValueError, match=pattern):
            ckpt.restore(other, root)
        with pytest.raises(ValueError, match=pattern):
            ckpt.core_restore(other.core, other.state, root)
        with pytest.raises(ValueError, match=pattern):
            ckpt.load_tables(root)
        assert_bit_identical(variables_by_name(other), before)
        assert ckpt.read_metadata(root)["row_layout"] == bad  # still readable as metadata


def test_sharding_argument_names_the_valid_layouts():
    emb = MeshEmbedding(FEATS, OPT, mesh=mesh_of(2), sharding="mod")
    emb.build()
    assert emb.plan.row_layout.name == "mod" and emb.plan.row_layout.num_shards == 2
    for bad in ("tablewise", None, 1):
        with pytest.raises(
            ValueError,
            match=r"sharding must be one of \['mod', .*'table_wise', 'data_parallel', 'auto'\]",
        ):
            MeshEmbedding(FEATS, OPT, mesh=mesh_of(2), sharding=bad)
