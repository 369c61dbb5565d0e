"""One process of the flax two-process test (run by test_flax.py, which trains the
reference, MeshEmbedding on 4 devices of its own process): the nnx module trains
flax_multiprocess_model's model on a mesh of 4 CPU devices, as two processes of 2.

Usage: flax_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_FILE
"""

import sys

import orphan_guard  # noqa: F401  (this worker dies with the test process)
from process_helpers import save_and_leave, start_cpu_process

process_id, num_processes, port, out_file = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
)
start_cpu_process(process_id, num_processes, port)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from flax_multiprocess_model import batches, grad_of, layer  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from embedmesh.flax import nnx as em_nnx  # noqa: E402


def main():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    assert mesh.size == 4, mesh
    embed = em_nnx.Embed(layer(mesh))

    @nnx.jit
    def step(embed, csr):
        embed.apply_gradients(grad_of(embed(csr)), csr)

    for batch in batches(process_id, num_processes):
        step(embed, embed.enqueue(batch))
    save_and_leave(out_file, embed.variables, process_id, num_processes)


if __name__ == "__main__":
    main()
