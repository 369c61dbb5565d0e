"""The model of test_flax.py's two-process test, written once: its worker processes
(flax_multiprocess_worker.py, the nnx module) and the test's one-process reference
(MeshEmbedding on 4 of its devices) build and train it alike."""

import jax
import jax.numpy as jnp
from checkpoint_common import HashInit
from process_helpers import global_batches, local_slice

import embedmesh as em
from embedmesh.host.preprocess import Capacity


def grad_of(acts):
    return jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, acts)


def layer(mesh) -> em.MeshEmbedding:
    t1 = em.TableConfig(50, 8, combiner="mean", name="t1", initializer=HashInit(1.0))
    t2 = em.TableConfig(30, 4, combiner="sqrtn", name="t2", initializer=HashInit(2.0))
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2), "ragged": em.FeatureConfig(t2)}
    return em.MeshEmbedding(feats, em.Adagrad(0.2), mesh=mesh, capacities=Capacity(64, 64))


def batches(process_id: int, num_processes: int) -> list:
    """This process's share of the 3 global batches of 16 samples."""
    return [local_slice(b, process_id, num_processes) for b in global_batches(3, 16)]


def train_facade(mesh) -> dict:
    """MeshEmbedding's variables after the 3 steps on `mesh` (one process): the reference."""
    emb = layer(mesh)
    for batch in batches(0, 1):
        acts, pre = emb(batch)
        emb.apply_gradients(grad_of(acts), pre)
    return emb.variables
