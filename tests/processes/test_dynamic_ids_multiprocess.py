"""A table of raw ids (`TableConfig.id_map`) trained by two real processes (1 CPU device
each, the host's shared-memory exchanges) ends as it does with 2 devices in one process (this
one): the same ids on the same shards and rows, the same values; their checkpoint (each
process writing its own shards of the rows and id maps) restores in those processes (as
it was, bit for bit; into a larger table, the maps rebuilt) and onto one device with
every live id's values."""

import json
import os
import sys

import dynamic_ids_model
import numpy as np
from meshes import mesh_of
from paths import SUPPORT
from process_helpers import free_port, run_together, worker_env

import embedmesh as em

WORKER = os.path.join(SUPPORT, "dynamic_ids_worker.py")


def _result(output: str, what: str = "RESULT") -> dict:
    line = next(x for x in output.splitlines() if x.startswith(what + " "))
    return json.loads(line[len(what) + 1 :])


def _one_process() -> dict:
    """The workers' training (dynamic_ids_model.py) run here on 2 of this process's
    devices, not in a process of its own (a start, jax's import, its compiles):
    `{raw id: [shard, row, parameters]}` of the live ids."""
    mesh = mesh_of(2)
    return json.loads(json.dumps(dynamic_ids_model.live_rows(dynamic_ids_model.train(mesh), mesh)))


def test_two_processes_match_one_process_with_two_devices(tmp_path):
    port = free_port()
    saved = str(tmp_path / "ckpt")
    two = run_together(
        [[sys.executable, WORKER, str(i), "2", str(port), saved] for i in range(2)],
        env=worker_env(),
        timeout=600,  # a hang fails the test; a loaded 2-core machine is slow, not hung
    )
    single = _one_process()
    multi = {**_result(two[0]), **_result(two[1])}
    assert len(single) == 7  # 8 rows, 10 ids: evictions happened
    assert {k: v[:2] for k, v in multi.items()} == {k: v[:2] for k, v in single.items()}
    for k, v in single.items():
        np.testing.assert_allclose(multi[k][2], v[2], rtol=1e-6, err_msg=k)
    # the two processes restored their checkpoint into a table of twice the capacity
    rebuilt = {**_result(two[0], "REBUILT"), **_result(two[1], "REBUILT")}
    assert rebuilt == {k: v[2] for k, v in multi.items()}
    # and it restores onto one device (the id maps rebuilt)
    dyn = em.TableConfig(8, 4, name="dyn", combiner="sum", id_map=em.DynamicIds(evict_batch=1))
    emb = em.MeshEmbedding(
        {"a": em.FeatureConfig(dyn, name="a")}, em.Adagrad(0.3), mesh=mesh_of(1), seed=3
    )
    assert em.checkpoint.restore(emb, saved) == 4
    restored = emb.core.read_dynamic(emb.state, "dyn")
    assert set(restored) == {int(k) for k in multi}
    for k, v in multi.items():
        np.testing.assert_array_equal(restored[int(k)][2], np.float32(v[2]), err_msg=k)
