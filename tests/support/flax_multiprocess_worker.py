"""One process of the flax two-process test (run by test_flax.py): the nnx module trains
on a mesh of 4 CPU devices, as two processes of 2 devices (NUM_PROCESSES 2) or as one
process of 4 (NUM_PROCESSES 1, MODE "facade": MeshEmbedding, the reference).

Usage: flax_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_FILE MODE
"""

import sys

import orphan_guard  # noqa: F401  (this worker dies with the test process)
from process_helpers import global_batches, local_slice, save_and_leave, start_cpu_process

process_id, num_processes, port, out_file, mode = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
start_cpu_process(process_id, num_processes, port)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from checkpoint_common import HashInit  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh.host.preprocess import Capacity  # noqa: E402


def grad_of(acts):
    return jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, acts)


def main():
    t1 = em.TableConfig(50, 8, combiner="mean", name="t1", initializer=HashInit(1.0))
    t2 = em.TableConfig(30, 4, combiner="sqrtn", name="t2", initializer=HashInit(2.0))
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2), "ragged": em.FeatureConfig(t2)}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    assert mesh.size == 4, mesh
    emb = em.MeshEmbedding(feats, em.Adagrad(0.2), mesh=mesh, capacities=Capacity(64, 64))
    batches = [local_slice(b, process_id, num_processes) for b in global_batches(3, 16)]
    if mode == "facade":
        for batch in batches:
            acts, pre = emb(batch)
            emb.apply_gradients(grad_of(acts), pre)
        tables = emb.variables
    else:
        from flax import nnx

        from embedmesh.flax import nnx as em_nnx

        embed = em_nnx.Embed(emb)

        @nnx.jit
        def step(embed, csr):
            embed.apply_gradients(grad_of(embed(csr)), csr)

        for batch in batches:
            step(embed, embed.enqueue(batch))
        tables = embed.variables
    save_and_leave(out_file, tables, process_id, num_processes)


if __name__ == "__main__":
    main()
