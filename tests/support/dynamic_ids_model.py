"""The model of tests/processes/test_dynamic_ids_multiprocess.py, written once: its worker
processes and the test's one-process reference train and read it alike."""

import jax
import numpy as np

import embedmesh as em
from embedmesh.device import id_map


def train(mesh, pid: int = 0, nproc: int = 1):
    """A table of raw ids (capacity 8, so ids are evicted) trained 4 steps on `mesh`; with
    `nproc` 2, this process feeds its half of each global batch of 4 samples."""
    dyn = em.TableConfig(8, 4, name="dyn", combiner="sum", id_map=em.DynamicIds(evict_batch=1))
    emb = em.MeshEmbedding(
        {"a": em.FeatureConfig(dyn, name="a")},
        em.Adagrad(0.3),
        mesh=mesh,
        seed=3,
        capacities=em.Capacity(16, 16),
    )
    rng = np.random.default_rng(0)
    pool = np.array([0, 8, -1, 2**63 - 1, -(2**63), 17, 2**40, 5, 6, 7], np.int64)
    for _ in range(4):
        ids = rng.choice(pool, size=(4, 2))  # the global batch: 4 samples
        if nproc > 1:
            ids = ids[pid * 2 : pid * 2 + 2]  # this process's half
        ragged = em.RaggedTensor(ids.reshape(-1), np.arange(0, ids.size + 1, 2))
        acts, preserved = emb({"a": ragged})
        emb.apply_gradients(jax.tree.map(lambda a: a * 0 + 1.0, acts), preserved)
    return emb


def local(x, device):
    """`x`'s shard on `device`, as numpy."""
    return np.asarray(next(s.data for s in x.addressable_shards if s.device == device))


def live_rows(emb, mesh) -> dict:
    """`{raw id: [shard, row, parameters]}` of the live ids on this process's devices."""
    devices = list(mesh.devices.flat)
    out = {}
    for shard in emb.state.tables["dyn"].addressable_shards:
        maps = emb.state.id_maps["dyn"]["map"]
        m = jax.tree_util.tree_map(lambda x, d=shard.device: local(x, d)[0], maps)
        values = np.asarray(shard.data)
        for raw, row in id_map.live_ids(m).items():
            out[str(raw)] = [devices.index(shard.device), row, values[row, :4].tolist()]
    return out
