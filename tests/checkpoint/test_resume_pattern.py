"""The resume pattern of `examples/train_checkpoint_serve.py` (its `resume`): the
checkpoint's own step and the embedding's update count kept apart. Checkpoints here are
numbered by another counter than the updates (1 update saved as step 3, 3 updates as
step 100), so reading the dense model at the update count would read step 3's."""

from __future__ import annotations

import importlib.util
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from paths import ROOT

import embedmesh as em
from embedmesh import checkpoint as em_ckpt


def _example():
    path = os.path.join(ROOT, "examples", "train_checkpoint_serve.py")
    spec = importlib.util.spec_from_file_location("train_checkpoint_serve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine(features):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    return em.MeshEmbedding(features, em.Adagrad(0.1), mesh=mesh)


def test_resume_keeps_checkpoint_step_and_update_count_apart(tmp_path):
    example = _example()
    table = em.TableConfig(40, 4, name="t")
    features = {"f": em.FeatureConfig(table)}
    emb = _engine(features)
    r = np.random.default_rng(7)
    params = {"w": np.asarray(r.normal(size=(4, 3)), np.float32)}
    opt = optax.adam(0.1)
    opt_state = opt.init(params)
    mngr = ocp.CheckpointManager(str(tmp_path))
    saved = {}
    for update, step in [(1, 3), (2, None), (3, 100)]:
        acts, keep = emb({"f": r.integers(0, 40, (6, 2))})
        emb.apply_gradients({"f": np.asarray(r.normal(size=acts["f"].shape), np.float32)}, keep)
        grads = {"w": np.full((4, 3), float(update), np.float32)}
        updates, opt_state = opt.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        if step is not None:
            mngr.save(
                step,
                args=ocp.args.Composite(
                    embedding=em_ckpt.save_args(emb),
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                ),
            )
            mngr.wait_until_finished()
            saved[step] = (np.asarray(emb.embedding_tables[table]), np.asarray(params["w"]))
    mngr.close()

    fresh = _engine(features)
    template = {"w": np.zeros((4, 3), np.float32)}
    mngr = ocp.CheckpointManager(str(tmp_path))
    step, count, got_params, got_state = example.resume(fresh, mngr, template, opt.init(template))
    mngr.close()
    assert (step, count) == (100, 3)  # the checkpoint's number, the updates it holds
    np.testing.assert_array_equal(np.asarray(fresh.embedding_tables[table]), saved[100][0])
    np.testing.assert_array_equal(np.asarray(got_params["w"]), saved[100][1])
    assert not np.array_equal(saved[3][1], saved[100][1])  # step 3 is another state
    want_state = jax.tree.leaves(opt_state)
    for a, b in zip(jax.tree.leaves(got_state), want_state):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
