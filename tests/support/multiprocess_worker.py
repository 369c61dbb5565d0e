"""One process of the two-process training tests (process_helpers.py's
`train_one_and_two_processes`: test_multiprocess.py and the layouts' tests).

Usage: multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_FILE [SHARDINGS]
(NUM_PROCESSES 1 runs the single-process reference on 4 devices; SHARDINGS, default
"mod", is MeshEmbedding's `sharding`, or several comma-separated: each trained in turn
by the same processes (one start, one job), OUT_FILE's "{sharding}" replaced by each.)
"""

import sys

import orphan_guard  # noqa: F401  (this worker dies with the test process)
from process_helpers import (
    global_batches,
    job_args,
    local_slice,
    save_and_leave,
    start_cpu_process,
)

process_id, num_processes, port = job_args()
out_file = sys.argv[4]
shardings = (sys.argv[5] if len(sys.argv) > 5 else "mod").split(",")
start_cpu_process(process_id, num_processes, port)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# row-aware initial values: the same tables under every placement and device count
from checkpoint_common import HashInit  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402
from embedmesh.host.preprocess import Capacity  # noqa: E402


def train(sharding: str) -> dict:
    """The tables after 3 steps under `sharding`: {TableConfig: {field: float32 array}}."""
    q = em.QuantizationConfig(9, -0.3, 0.3)  # its lookups quantized (in both processes)
    t1 = em.TableConfig(
        50, 8, combiner="mean", name="t1", initializer=HashInit(1.0), quantization_config=q
    )
    t2 = em.TableConfig(30, 4, combiner="sqrtn", name="t2", initializer=HashInit(2.0))
    # bfloat16 rows (float32 slots), stochastically rounded: the same bits on any layout
    t3 = em.TableConfig(30, 8, name="t3", initializer=HashInit(3.0), dtype=jnp.bfloat16)
    feats = {
        "a": em.FeatureConfig(t1),
        "b": em.FeatureConfig(t2),
        "ragged": em.FeatureConfig(t2),
        "c": em.FeatureConfig(t3),
    }
    mesh = Mesh(np.array(jax.devices()), ("x",))
    assert mesh.size == 4, mesh
    emb = MeshEmbedding(
        feats, em.Adagrad(0.2), mesh=mesh, capacities=Capacity(64, 64), sharding=sharding
    )
    emb.build()
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))
    for batch in global_batches(3, 16):
        batch["c"] = (batch["b"] * 7 + 3) % 30
        acts, pre = emb(local_slice(batch, process_id, num_processes))
        emb.apply_gradients(grad_fn(acts), pre)
    assert emb.variables[t3]["parameters"].dtype == jnp.bfloat16
    return {
        t: {k: np.asarray(v, np.float32) for k, v in d.items()} for t, d in emb.variables.items()
    }


if __name__ == "__main__":
    for i, sharding in enumerate(shardings):
        last = i == len(shardings) - 1
        out = out_file.replace("{sharding}", sharding)
        save_and_leave(out, train(sharding), process_id, num_processes, leave=last)
