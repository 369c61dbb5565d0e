"""One process of the two-process training test (run by test_multiprocess.py).

Usage: multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_FILE [SHARDING]
(NUM_PROCESSES 1 runs the single-process reference on 4 devices; SHARDING, default
"mod", is MeshEmbedding's `sharding`.)
"""

import os
import sys

import orphan_guard  # noqa: F401  (this worker dies with the test process)

process_id, num_processes, port, out_file = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
)
sharding = sys.argv[5] if len(sys.argv) > 5 else "mod"
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={4 // num_processes} "
    + os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# row-aware initial values: the same tables under every placement and device count
from checkpoint_common import HashInit  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402
from embedmesh.host.preprocess import Capacity  # noqa: E402


def global_batches(steps, batch):
    rng = np.random.default_rng(7)
    for _ in range(steps):
        lengths = rng.integers(0, 5, batch)
        yield {
            "a": rng.integers(0, 50, (batch, 3)),
            "b": rng.integers(0, 30, (batch,)),
            "ragged": (rng.integers(0, 30, int(lengths.sum())), lengths),
        }


def local_slice(batch, pid, nproc):
    out = {}
    for k, v in batch.items():
        if k == "ragged":
            values, lengths = v
            per = len(lengths) // nproc
            splits = np.concatenate([[0], np.cumsum(lengths)])
            lo, hi = splits[pid * per], splits[(pid + 1) * per]
            out[k] = em.RaggedTensor.from_row_lengths(
                values[lo:hi], lengths[pid * per : (pid + 1) * per]
            )
        else:
            per = v.shape[0] // nproc
            out[k] = v[pid * per : (pid + 1) * per]
    return out


def main():
    q = em.QuantizationConfig(9, -0.3, 0.3)  # its lookups quantized (in both processes)
    t1 = em.TableConfig(
        50, 8, combiner="mean", name="t1", initializer=HashInit(1.0), quantization_config=q
    )
    t2 = em.TableConfig(30, 4, combiner="sqrtn", name="t2", initializer=HashInit(2.0))
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2), "ragged": em.FeatureConfig(t2)}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    assert mesh.size == 4, mesh
    emb = MeshEmbedding(
        feats, em.Adagrad(0.2), mesh=mesh, capacities=Capacity(64, 64), sharding=sharding
    )
    emb.build()
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))
    for batch in global_batches(3, 16):
        acts, pre = emb(local_slice(batch, process_id, num_processes))
        emb.apply_gradients(grad_fn(acts), pre)
    tables = emb.variables
    if process_id == 0:
        np.savez(out_file, **{f"{t.name}.{k}": v for t, d in tables.items() for k, v in d.items()})
    if num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
