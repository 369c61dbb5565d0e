"""The facade's map program (`MeshEmbedding.dequeue` on a batch of raw ids, issue 42):
it returns the state, the mapped stacks' rows and the counts, never the batch itself,
whose unchanged arrays a program returning them would copy out every step; the batch
`dequeue` hands back is the one it took with those rows in place of the raw ids, its
other arrays the very same objects."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from meshes import mesh_of

import embedmesh as em


def _init(key, shape, dtype):  # never zero
    return jax.random.uniform(key, shape, dtype, 0.5, 1.5)


def test_the_map_program_returns_rows_not_the_batch():
    dyn = em.TableConfig(8, 4, initializer=_init, name="dyn", id_map=em.DynamicIds())
    static = em.TableConfig(16, 4, initializer=_init, combiner="sum", name="static")
    features = {"raw": em.FeatureConfig(dyn, name="raw"), "plain": em.FeatureConfig(static)}
    emb = em.MeshEmbedding(features, em.Adagrad(0.1), mesh=mesh_of(1), seed=3)
    raw = em.RaggedTensor(np.array([-(2**63), 5, 2**62, 5], np.int64), np.array([0, 2, 4]))
    plain = em.RaggedTensor(np.array([1, 2, 3], np.int64), np.array([0, 1, 3]))
    csr = emb.enqueue({"raw": raw, "plain": plain})
    (dyn_stack,) = [s for s, c in csr.items() if c.unique_raw_ids is not None]

    # what the program returns: the state, {stack of raw ids: rows}, the counts
    state_shape, rows, stats = jax.eval_shape(emb._map_fn, emb.state, csr)
    assert set(rows) == {dyn_stack} == set(stats)
    assert rows[dyn_stack].shape == csr[dyn_stack].unique_ids.shape
    assert len(jax.tree_util.tree_leaves(state_shape)) == len(jax.tree_util.tree_leaves(emb.state))

    _, out = emb.dequeue(csr)
    for s, c in csr.items():
        for f in dataclasses.fields(c):
            if s == dyn_stack and f.name in ("unique_ids", "unique_raw_ids"):
                continue
            assert getattr(out[s], f.name) is getattr(c, f.name), (s, f.name)
    d = out[dyn_stack]
    assert d.unique_raw_ids is None
    ids = np.asarray(d.unique_ids)[0, 0, : int(np.asarray(d.unique_counts)[0, 0])]
    assert sorted(ids.tolist()) == [0, 1, 2]  # three distinct raw ids, three fresh rows
