"""A worker of tests/processes/test_dynamic_ids_multiprocess.py: a table of raw ids trained
for a few steps on a mesh of 2 CPU devices, as one process or as one of two (1 device each);
prints `RESULT {raw id: [shard, row, parameters]}` of the live ids on this process's
devices. Args: process_id num_processes port [checkpoint directory: saved there at the
end, every process writing its own shards of the rows and id maps, then restored by these
processes as it was (checked bit for bit here) and into a table of twice the capacity
(the maps rebuilt): `REBUILT {raw id: parameters}` of its live ids on this process]."""

import json
import sys

import orphan_guard  # noqa: F401  (this worker dies with the test process)
from process_helpers import start_cpu_process

pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
save_to = sys.argv[4] if len(sys.argv) > 4 else None
jax = start_cpu_process(pid, nproc, port, devices=2)

import dynamic_ids_model  # noqa: E402
import numpy as np  # noqa: E402
from dynamic_ids_model import local  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh.device import id_map  # noqa: E402

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
emb = dynamic_ids_model.train(mesh, pid, nproc)
state = emb.state
out = dynamic_ids_model.live_rows(emb, mesh)
print("RESULT", json.dumps(out))
if save_to is not None:
    em.checkpoint.save(save_to, emb)
    before = [[np.asarray(s.data) for s in x.addressable_shards] for x in jax.tree.leaves(state)]
    em.checkpoint.restore(emb, save_to)  # as it was: bit for bit
    after = [[np.asarray(s.data) for s in x.addressable_shards] for x in jax.tree.leaves(emb.state)]
    assert all(a.tobytes() == b.tobytes() for x, y in zip(before, after) for a, b in zip(x, y))
    big = em.TableConfig(16, 4, name="dyn", combiner="sum", id_map=em.DynamicIds(evict_batch=1))
    emb = em.MeshEmbedding({"a": em.FeatureConfig(big, name="a")}, em.Adagrad(0.3), mesh=mesh)
    em.checkpoint.restore(emb, save_to)  # the maps rebuilt
    rebuilt = {}
    for shard in emb.state.tables["dyn"].addressable_shards:
        maps = emb.state.id_maps["dyn"]["map"]
        m = jax.tree_util.tree_map(lambda x: local(x, shard.device)[0], maps)
        values = np.asarray(shard.data)
        for raw, row in id_map.live_ids(m).items():
            rebuilt[str(raw)] = values[row, :4].tolist()
    print("REBUILT", json.dumps(rebuilt))
if nproc > 1:
    jax.distributed.shutdown()
