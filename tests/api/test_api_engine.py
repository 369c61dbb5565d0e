"""Facade API items of issue #12: exception types (6), dequeue's seed tuple (7),
facade under jax.jit (9), read-only reads (11), bad preserved outputs (19),
set_tables shapes (20), empty batches (18); issue #24: plan / core / last_stats before
build (12), arrays of strings as ids (13)."""

import pydoc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import mesh_of

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, TableConfig
from embedmesh.facade import MeshEmbedding


def small(n=2, opt=None, **kw):
    t = TableConfig(10, 4, name="t")
    feats = {"x": FeatureConfig(t), "y": FeatureConfig(t)}
    emb = MeshEmbedding(feats, opt or em.Adagrad(0.1), mesh=mesh_of(n), **kw)
    emb.build()
    return t, feats, emb


BATCH = {"x": np.array([1, 2, 3, 4]), "y": np.array([5, 6, 7, 8])}


def snapshot(emb):
    v = emb.variables
    return {t: {k: np.array(a) for k, a in d.items()} for t, d in v.items()}, int(emb.state.step)


def assert_same(emb, snap):
    v, step = snapshot(emb)
    assert step == snap[1]
    for t in snap[0]:
        for k in snap[0][t]:
            assert np.array_equal(v[t][k], snap[0][t][k]), (t.name, k)


# -- item 6: exception types --------------------------------------------------


@pytest.mark.parametrize("bad", ["abc", object()])
def test_non_tensor_gradient_is_value_error(bad):
    t, feats, emb = small()
    acts, pre = emb(BATCH)
    snap = snapshot(emb)
    with pytest.raises(ValueError, match="feature x"):
        emb.apply_gradients({"x": bad, "y": None}, pre)
    assert_same(emb, snap)


@pytest.mark.parametrize("bad", ["abc", object(), b"12"])
def test_non_tensor_feature_input_is_value_error(bad):
    t, feats, emb = small()
    snap = snapshot(emb)
    with pytest.raises(ValueError, match="feature x"):
        emb({"x": bad, "y": BATCH["y"]})
    with pytest.raises(ValueError, match="feature x"):
        em.serving_embedding_lookup({"x": bad}, None, emb.embedding_tables, feats)
    assert_same(emb, snap)


@pytest.mark.parametrize(
    "bad", [np.array(list("abcd")), np.array([b"1", b"2", b"3", b"4"]), np.arange(4).astype(object)]
)
def test_array_of_non_numbers_says_ids_must_be_integers(bad):
    """#24 item 13: an array of strings, bytes or objects is not "not a Tensor"."""
    t, feats, emb = small()
    snap = snapshot(emb)
    want = rf"feature x: ids must be integers, got an array of dtype {bad.dtype}"
    with pytest.raises(ValueError, match=want):
        emb({"x": bad, "y": BATCH["y"]})
    with pytest.raises(ValueError, match=want):
        em.serving_embedding_lookup({"x": bad}, None, emb.embedding_tables, feats)
    want = rf"feature x: weights must be numeric, got an array of dtype {bad.dtype}"
    with pytest.raises(ValueError, match=want):
        emb({"x": BATCH["x"], "y": BATCH["y"]}, {"x": bad, "y": None})
    assert_same(emb, snap)


def test_list_for_dict_config_is_type_error():
    t, feats, emb = small()
    acts, pre = emb(BATCH)
    snap = snapshot(emb)
    with pytest.raises(TypeError, match="features"):
        emb([BATCH["x"], BATCH["y"]])
    with pytest.raises(TypeError, match="weights"):
        emb(BATCH, [None, None])
    with pytest.raises(TypeError, match="gradients"):
        emb.apply_gradients([jnp.ones((4, 4)), jnp.ones((4, 4))], pre)
    assert_same(emb, snap)


def test_tuple_for_list_config_is_type_error():
    t = TableConfig(10, 4, name="t")
    feats = [FeatureConfig(t, name="a"), FeatureConfig(t, name="b")]
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))
    emb.build()
    x = np.array([1, 2, 3, 4])
    acts, pre = emb([x, x])
    assert isinstance(acts, list)
    snap = snapshot(emb)
    with pytest.raises(TypeError, match="list"):
        emb((x, x))
    with pytest.raises(TypeError, match="list"):
        emb.apply_gradients((jnp.ones((4, 4)), jnp.ones((4, 4))), pre)
    with pytest.raises(TypeError, match="list"):
        em.serving_embedding_lookup((x, x), None, emb.embedding_tables, feats)
    # a sequence of the wrong length stays a ValueError
    with pytest.raises(ValueError, match="sequence of 2"):
        emb([x])
    assert_same(emb, snap)


# -- item 7: dequeue takes the seed's (dict, int, int) -------------------------


def test_dequeue_accepts_seed_tuple():
    t, feats, emb = small()
    enq = emb.enqueue(BATCH)
    acts_dict, _ = emb.dequeue(enq)
    acts_tuple, pre = emb.dequeue((enq, 0, 0))
    for k in acts_dict:
        np.testing.assert_array_equal(np.asarray(acts_dict[k]), np.asarray(acts_tuple[k]))
    assert isinstance(pre, dict) and set(pre) == set(enq)
    emb.apply_gradients({"x": jnp.ones((4, 4)), "y": None}, pre)
    with pytest.raises(ValueError, match="dequeue"):
        emb.dequeue((enq, "a", 0))


# -- item 9: facade inside jax.jit ---------------------------------------------


def test_facade_inside_jit_is_one_clear_error():
    t, feats, emb = small()
    acts, pre = emb(BATCH)
    snap = snapshot(emb)
    calls = {
        "enqueue": lambda x: emb.enqueue({"x": x, "y": x}),
        "embedding_lookup": lambda x: emb.embedding_lookup({"x": x, "y": x}),
        "__call__": lambda x: emb({"x": x, "y": x}),
        "dequeue": lambda x: emb.dequeue(pre),
        "apply_gradients": lambda x: emb.apply_gradients(
            {"x": jnp.ones((4, 4)) * x[0], "y": None}, pre
        ),
        "embedding_tables": lambda x: emb.embedding_tables,
        "variables": lambda x: emb.variables,
        "build": lambda x: emb.build(),
    }
    for what, fn in calls.items():
        with pytest.raises(RuntimeError, match=r"stateful.*emb\.core") as info:
            jax.jit(fn)(jnp.asarray(BATCH["x"]))
        assert what.strip("_") in str(info.value), what
    assert_same(emb, snap)
    # and the pointed-to functional path works under jit
    out = jax.jit(emb.core.lookup)(emb.state, emb.enqueue(BATCH))
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(acts["x"]))


# -- item 11: read-only reads --------------------------------------------------


def test_embedding_tables_and_variables_are_read_only():
    t, feats, emb = small()
    tab = emb.embedding_tables[t]
    with pytest.raises(ValueError, match="read-only"):
        tab[0, 0] = 5.0
    var = emb.variables[t]
    for _k, a in var.items():
        with pytest.raises(ValueError, match="read-only"):
            a[...] = 1.0
    # the documented way to load rows
    new = np.array(tab)
    new[3] = 7.0
    emb.set_tables({t: new})
    np.testing.assert_array_equal(emb.embedding_tables[t][3], np.full(4, 7.0, np.float32))


# -- item 19: bad preserved_outputs --------------------------------------------


def test_bad_preserved_outputs_are_value_errors_state_untouched():
    t, feats, emb = small()
    acts, pre = emb(BATCH)
    snap = snapshot(emb)
    g = {"x": jnp.ones((4, 4)), "y": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match="preserved_outputs"):
        emb.apply_gradients(g, None)
    renamed = {"not_a_stack": v for v in pre.values()}  # noqa: B035 - one renamed key on purpose
    with pytest.raises(ValueError, match="not_a_stack"):
        emb.apply_gradients(g, renamed)
    with pytest.raises(ValueError, match="preserved_outputs"):
        emb.apply_gradients(g, {k: "junk" for k in pre})
    # from another layer with another feature config (same stack name)
    t2 = TableConfig(10, 4, name="t")
    other = MeshEmbedding(
        {"x": FeatureConfig(t2), "z": FeatureConfig(t2)}, em.Adagrad(0.1), mesh=mesh_of(2)
    )
    other.build()
    _, other_pre = other({"x": BATCH["x"], "z": BATCH["y"]})
    assert set(other_pre) == set(pre)
    with pytest.raises(ValueError, match="preserved_outputs"):
        emb.apply_gradients(g, other_pre)
    emb.flush()
    assert_same(emb, snap)
    emb.apply_gradients(g, pre)  # the right ones still work
    assert int(emb.state.step) == 1


# -- item 20: set_tables checks shapes -----------------------------------------


def test_set_tables_checks_shape():
    t, feats, emb = small()
    snap = snapshot(emb)
    with pytest.raises(ValueError, match=r"table t.*\(10, 16\).*\(10, 4\)"):
        emb.set_tables({t: np.zeros((10, 16), np.float32)})
    with pytest.raises(ValueError, match=r"table t.*\(10, 2\).*\(10, 4\)"):
        emb.set_tables({t: np.zeros((10, 2), np.float32)})
    with pytest.raises(ValueError, match=r"table t.*accumulators.*\(10, 8\)"):
        emb.set_tables(
            {t: np.zeros((10, 4), np.float32)},
            slots={t: {"accumulators": np.zeros((10, 8), np.float32)}},
        )
    assert_same(emb, snap)


# -- item 18: empty batches ----------------------------------------------------


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("pipelined", [False, True])
def test_empty_batch_full_cycle(n, pipelined):
    t = TableConfig(12, 4, name="t")
    u = TableConfig(7, 8, name="u", combiner="sum")
    feats = {
        "x": FeatureConfig(t),
        "r": FeatureConfig(u),
        "s": FeatureConfig(t, max_sequence_length=3),
    }
    emb = MeshEmbedding(feats, em.Adagrad(0.1), pipelined, mesh=mesh_of(n))
    emb.build()
    ref = MeshEmbedding(feats, em.Adagrad(0.1), pipelined, mesh=mesh_of(n))
    ref.build()
    empty = {
        "x": np.zeros((0,), np.int64),
        "r": RaggedTensor.from_row_lengths(np.zeros(0, np.int64), np.zeros(0, np.int64)),
        "s": RaggedTensor.from_row_lengths(np.zeros(0, np.int64), np.zeros(0, np.int64)),
    }
    acts, pre = emb(empty)
    assert acts["x"].shape == (0, 4) and acts["r"].shape == (0, 8)
    assert acts["s"].shape == (0, 3, 4)
    emb.apply_gradients({k: jnp.zeros(v.shape, jnp.float32) for k, v in acts.items()}, pre)
    tabs = emb.embedding_tables  # the read that used to crash
    np.testing.assert_array_equal(tabs[t], ref.embedding_tables[t])
    emb.flush()
    assert int(emb.state.step) == 1  # a no-op update still counts a step
    # a normal step afterwards matches a layer that never saw the empty batch,
    # up to the step count (Adagrad with a constant rate ignores it)
    batch = {
        "x": np.arange(8) % 12,
        "r": RaggedTensor.from_row_lengths(np.arange(12) % 7, np.array([1, 2, 0, 3, 1, 2, 1, 2])),
        "s": RaggedTensor.from_row_lengths(np.arange(12) % 12, np.array([1, 2, 0, 3, 1, 2, 1, 2])),
    }
    a1, p1 = emb(batch)
    a2, p2 = ref(batch)
    for k in a1:
        np.testing.assert_allclose(np.asarray(a1[k]), np.asarray(a2[k]), rtol=1e-6)
    g = {k: jnp.ones(v.shape, jnp.float32) for k, v in a1.items()}
    emb.apply_gradients(g, p1)
    ref.apply_gradients(g, p2)
    v1, v2 = emb.variables, ref.variables
    for tab in v1:
        for k in v1[tab]:
            np.testing.assert_allclose(v1[tab][k], v2[tab][k], rtol=1e-6)
    assert int(emb.observed_state().step) == 2 and int(ref.observed_state().step) == 1
    # an empty lookup right after a normal update (pending, fused with it)
    acts, pre = emb(empty)
    ref.flush()
    assert acts["x"].shape == (0, 4)
    v1, v2 = emb.variables, ref.variables
    for tab in v1:
        for k in v1[tab]:
            np.testing.assert_allclose(v1[tab][k], v2[tab][k], rtol=1e-6)


# -- issue #24 item 12: plan, core, state, last_stats before build ---------------------


def test_plan_core_last_stats_before_build():
    """Documented properties: built on first access, except under sharding="auto"
    before any batch (a RuntimeError: auto plans from the first batch)."""
    t = TableConfig(10, 4, name="t")
    feats = {"x": FeatureConfig(t), "y": FeatureConfig(t)}
    emb = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2))
    assert emb.last_stats is None
    assert int(emb.state.step) == 0  # builds
    assert "mod" in str(emb.plan)
    # the facade's plan is the core's with the bytes measured on the built arrays
    assert emb.core.plan.stacks == emb.plan.stacks and emb.plan.measured_bytes_per_device
    emb(BATCH)
    assert emb.last_stats.stacks["t"].num_ids == 8

    auto = MeshEmbedding(feats, em.SGD(0.1), mesh=mesh_of(2), sharding="auto")
    for attr in ("plan", "core", "state"):
        with pytest.raises(RuntimeError, match=r"enqueue a batch first .*or call emb.build\(\)"):
            getattr(auto, attr)
    auto(BATCH)  # planned from this batch
    assert auto.core.plan.stacks == auto.plan.stacks and dict(auto.plan.strategies)["t"] != "auto"

    text = pydoc.plaintext.document(MeshEmbedding)
    for name in ("plan", "core", "last_stats"):
        assert getattr(MeshEmbedding, name).__doc__, name
        assert f"\n |  {name}\n |      " in text, name  # help() lists it with its doc


# -- issue #40: a feature missing from the gradients ----------------------------------


def test_missing_gradient_feature_is_value_error_state_untouched():
    """TensorFlow asserts the gradients' structure is the feature config's: a feature
    left out of the gradients is an error naming it (not a silent zero update), and an
    unknown name given with it is named too; only an explicit None is a zero gradient."""
    t, feats, emb = small()
    acts, pre = emb(BATCH)
    snap = snapshot(emb)
    with pytest.raises(ValueError, match=r"gradients lack feature\(s\) \['y'\]") as e:
        emb.apply_gradients({"x": jnp.ones((4, 4))}, pre)
    assert "None" in str(e.value)  # says how to give a zero gradient
    assert_same(emb, snap)
    with pytest.raises(ValueError, match=r"\['x', 'y'\]") as e:
        emb.apply_gradients({}, pre)
    assert_same(emb, snap)
    with pytest.raises(ValueError, match=r"lack feature\(s\) \['y'\]") as e:
        emb.apply_gradients({"x": jnp.ones((4, 4)), "why": jnp.ones((4, 4))}, pre)
    assert "['why']" in str(e.value) and "not in the feature config" in str(e.value)
    assert_same(emb, snap)
    # the same outputs still take a well-formed update; an explicit None is zero
    emb.apply_gradients({"x": jnp.ones((4, 4)), "y": None}, pre)
    assert int(emb.state.step) == 1
    changed = np.nonzero(np.abs(emb.embedding_tables[t] - snap[0][t]["parameters"]).sum(1))[0]
    assert changed.tolist() == [1, 2, 3, 4]


def test_missing_gradient_in_a_nested_structure_names_its_path():
    t = TableConfig(10, 4, name="t")
    feats = {
        "a": {"x": FeatureConfig(t), "y": FeatureConfig(t, name="named_y")},
        "b": [FeatureConfig(t), FeatureConfig(t)],
    }
    emb = MeshEmbedding(feats, em.SGD(0.5), mesh=mesh_of(2))
    emb.build()
    x = np.array([1, 2, 3, 4])
    acts, pre = emb({"a": {"x": x, "y": x}, "b": [x, x]})
    snap = snapshot(emb)
    g = jnp.ones((4, 4))
    with pytest.raises(ValueError, match=r"lack feature\(s\) \['named_y'\]"):
        emb.apply_gradients({"a": {"x": g}, "b": [g, g]}, pre)
    with pytest.raises(ValueError, match=r"lack feature\(s\) \['a/x', 'named_y'\]"):
        emb.apply_gradients({"b": [g, g]}, pre)
    assert_same(emb, snap)
    # explicit None, for a leaf or a whole subtree, is a zero gradient
    emb.apply_gradients({"a": None, "b": [g, None]}, pre)
    emb.apply_gradients({"a": {"x": None, "y": g}, "b": [None, None]}, pre)
    assert int(emb.state.step) == 2


# -- misuse caught where it happens ---------------------------------------------------


@pytest.mark.parametrize("pipelined", [False, True])
def test_apply_gradients_without_an_optimizer_fails_at_once(pipelined):
    """A layer built without an optimizer (lookups only) refuses an update when it is
    asked for, not at the next lookup with the update lost."""
    t = TableConfig(10, 4, name="t")
    emb = MeshEmbedding({"x": FeatureConfig(t)}, None, pipelined, mesh=mesh_of(2))
    emb.build()
    _, pre = emb({"x": BATCH["x"]})
    snap = snapshot(emb)
    with pytest.raises(ValueError, match=r"table\(s\) \['t'\].*no optimizer"):
        emb.apply_gradients({"x": jnp.ones((4, 4))}, pre)
    emb({"x": BATCH["x"]})  # nothing was left pending: the next lookup works
    assert_same(emb, snap)


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_same_preserved_outputs_applied_again_warn(pipelined):
    """A second update of one batch is allowed (two updates without a lookup between
    them), but says so: most often it is a loop that kept an old batch's outputs."""
    t, feats, emb = small(pipeline_execution_with_tensor_core=pipelined)
    _, pre = emb(BATCH)
    g = {"x": jnp.ones((4, 4)), "y": jnp.ones((4, 4))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb.apply_gradients(g, pre)  # the first: no warning
    with pytest.warns(UserWarning, match="applied by the previous update too"):
        emb.apply_gradients(g, pre)
    _, pre2 = emb(BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb.apply_gradients(g, pre2)  # the next batch's outputs: no warning
    emb.flush()  # pipelined: the state the next lookup reads is one update stale
    assert int(emb.state.step) == 3
