"""What a user porting TensorFlow / Keras code writes by habit: TF-style optimizer
argument names, `f(shape, dtype)` initializers, a save onto a step a checkpoint already
holds. Each gets an error or a warning that names embedmesh's form, where it happens."""

from __future__ import annotations

import logging
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import embedmesh as em

OPTIMIZERS = [em.SGD, em.Adagrad, em.AdagradMomentum, em.Adam, em.FTRL, em.RowWiseAdagrad]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_tf_spelled_optimizer_arguments_name_embedmeshs(cls):
    with pytest.raises(TypeError, match=rf"{cls.__name__} got lr=; .* spells it learning_rate="):
        cls(lr=0.1)
    with pytest.raises(TypeError, match=r"clip_gradient_min=; .* clipvalue=\(min, max\)"):
        cls(clip_gradient_min=-1.0)
    with pytest.raises(TypeError, match=r"clip_gradient_max=; .* clipvalue=\(min, max\)"):
        cls(clip_gradient_max=1.0)
    with pytest.raises(TypeError, match=rf"{cls.__name__} got bogus=; .*Its arguments: "):
        cls(bogus=1)


def test_argument_spellings_of_tf_keras_and_tpu_embedding_v1():
    with pytest.raises(TypeError, match=r"Adam got beta1=; .* spells it beta_1="):
        em.Adam(beta1=0.8)
    with pytest.raises(TypeError, match=r"Adam got beta2=; .* spells it beta_2="):
        em.Adam(beta2=0.99)
    with pytest.raises(TypeError, match=r"Adam got eps=; .* spells it epsilon="):
        em.Adam(eps=1e-8)
    with pytest.raises(TypeError, match=r"SGD got beta1=; SGD has no beta_1= \(taken by Adam\)"):
        em.SGD(beta1=0.8)
    with pytest.raises(TypeError, match=r"Adagrad has no epsilon= \(taken by .*Adam"):
        em.Adagrad(epsilon=1e-7)  # Keras's Adagrad has one; TPUEmbedding's has none
    with pytest.raises(TypeError, match=r"initial_accumulator=; .* initial_accumulator_value="):
        em.Adagrad(initial_accumulator=0.1)  # TPUEmbedding v1's AdagradParameters
    with pytest.raises(TypeError, match=r"nesterov=; .* spells it use_nesterov="):
        em.AdagradMomentum(nesterov=True)
    with pytest.raises(TypeError, match=r"weight_decay=; .* weight_decay_factor="):
        em.SGD(weight_decay=0.01)
    # embedmesh's own names, positional arguments, copies and replace are unchanged
    adam = em.Adam(0.1, 0.8, epsilon=1e-6)
    assert (adam.learning_rate, adam.beta_1, adam.epsilon) == (0.1, 0.8, 1e-6)
    import copy
    import dataclasses
    import pickle

    assert copy.copy(adam) == adam == pickle.loads(pickle.dumps(adam))
    assert dataclasses.replace(adam, beta_2=0.9).beta_2 == 0.9


class KerasStyle:
    """A Keras initializer: `__call__(shape, dtype=None, **kwargs)`."""

    def __call__(self, shape, dtype=None, **kwargs):
        return np.full(shape, 0.5, dtype or np.float32)


class TF1Style:
    """A TF1 initializer: three positional arguments, the first `shape`."""

    def __call__(self, shape, dtype=None, partition_info=None):
        return np.full(shape, 0.5, dtype or np.float32)


@pytest.mark.parametrize(
    "init", [KerasStyle(), TF1Style(), lambda shape, dtype=None: np.ones(shape), np.zeros]
)
def test_shape_first_initializers_are_refused_naming_the_jax_form(init):
    with pytest.raises(ValueError, match=r"TableConfig t: initializer .*f\(key, shape, dtype\)"):
        em.TableConfig(8, 4, initializer=init, name="t")


@pytest.mark.parametrize(
    "init",
    [
        jax.nn.initializers.truncated_normal(0.1),
        jax.nn.initializers.zeros,
        em.row_id_initializer(2.0),
        lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
        lambda *args: jax.random.uniform(args[0], args[1], args[2]),
    ],
)
def test_jax_form_initializers_are_accepted_and_used(init):
    t = em.TableConfig(8, 4, initializer=init, name="t")
    got = np.asarray(t.initialize(jax.random.key(3)))
    want = np.asarray(init(jax.random.key(3), (8, 4), np.float32))
    np.testing.assert_array_equal(got, want)


def test_a_save_onto_an_existing_step_warns_naming_step_and_directory(tmp_path, caplog):
    from embedmesh import checkpoint as ckpt

    t = em.TableConfig(8, 4, name="a")
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    emb = em.MeshEmbedding({"f": em.FeatureConfig(t)}, em.SGD(0.1), mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.save(tmp_path, emb, step=5)
    with caplog.at_level(logging.WARNING, logger="embedmesh"):
        with pytest.warns(UserWarning, match=rf"step 5 already exists in {tmp_path}"):
            assert not ckpt.save(tmp_path, emb, step=5)
        with pytest.warns(UserWarning, match=r"step 3 is before the latest step \(5\)"):
            assert not ckpt.save(tmp_path, emb, step=3)
    skipped = [r for r in caplog.records if r.name == "embedmesh.checkpoint.saving"]
    assert [r.levelno for r in skipped] == [logging.WARNING] * 2
    assert "step 5 already exists" in skipped[0].getMessage()


# ---------------------------------------------------------------------------
# logging.getLogger("embedmesh"): silent by default, INFO on plan, growth and restore


def test_the_embedmesh_logger_is_silent_by_default():
    """A NullHandler on "embedmesh": a library's records reach no stderr of its own (the
    application's logging configuration decides)."""
    import subprocess
    import sys

    code = (  # a fresh process: what an application sees at import, whatever ran before
        "import logging, embedmesh\n"
        "root = logging.getLogger('embedmesh')\n"
        "print(any(isinstance(h, logging.NullHandler) for h in root.handlers),"
        " root.level == logging.NOTSET, root.propagate)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"], out  # the application's to set


def test_plan_growth_and_restore_are_logged(tmp_path, caplog, capfd):
    from embedmesh import checkpoint as ckpt

    devices = np.array(jax.devices()[:2] if len(jax.devices()) > 1 else jax.devices()[:1])
    mesh = Mesh(devices, ("x",))
    ta, tb = em.TableConfig(64, 4, name="a"), em.TableConfig(32, 4, name="b")
    feats = {"fa": em.FeatureConfig(ta), "fb": em.FeatureConfig(tb)}
    r = np.random.default_rng(2)
    with caplog.at_level(logging.INFO, logger="embedmesh"):
        emb = em.MeshEmbedding(feats, em.SGD(0.1), mesh=mesh, sharding="auto")
        small = {"fa": r.integers(0, 4, (8, 1)), "fb": r.integers(0, 4, (8, 1))}
        acts, keep = emb(small)  # the first batch sizes the capacities (and the plan)
        emb.apply_gradients({k: np.ones(v.shape, np.float32) for k, v in acts.items()}, keep)
        big = {"fa": r.permutation(64)[:48].reshape(8, 6), "fb": r.integers(0, 32, (8, 6))}
        acts, keep = emb(big)  # more distinct ids a partition: the capacity grows
        emb.apply_gradients({k: np.ones(v.shape, np.float32) for k, v in acts.items()}, keep)
        ckpt.save(tmp_path, emb)
        ckpt.restore(emb, tmp_path)
    text = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    plans = [m for n, lv, m in text if n == "embedmesh.layout.planner"]
    assert sorted(m.split(" -> ")[0] for m in plans) == ["plan: table a", "plan: table b"]
    grown = [m for n, _, m in text if n == "embedmesh.host.preprocess" and "grown" in m]
    assert grown and all("compiles again" in m for m in grown)
    restores = [m for n, _, m in text if n == "embedmesh.checkpoint.restoring"]
    assert restores[0].startswith("restoring ") and "update count 2" in restores[-1]
    assert any("read parameters of table a" in m for m in restores)
    assert all(lv == logging.INFO for _, lv, _ in text if _ != "embedmesh.checkpoint.saving")
    out, err = capfd.readouterr()
    assert "plan: table" not in out + err and "capacity grown" not in out + err


def test_a_per_replica_output_shape_on_one_process_names_the_global_shape():
    """TensorFlow's `output_shape` is per replica; embedmesh's is the global batch. One
    process with 8 devices and a batch of 64 given TF's per-replica (8,): the error says
    the shape is global and which one to pass."""
    table = em.TableConfig(16, 4, name="t")
    fc = {"f": em.FeatureConfig(table, output_shape=(8,))}
    emb = em.MeshEmbedding(fc, em.SGD(0.1))
    ids = em.RaggedTensor.from_row_lengths(np.arange(64) % 16, [1] * 64)
    with pytest.raises(ValueError, match=r"feature f.*global.*not per replica.*\[64\]"):
        emb({"f": ids})
