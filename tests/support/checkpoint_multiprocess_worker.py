"""One of two processes (2 CPU devices each, gloo) that save a checkpoint of a 4-device
MeshEmbedding, each writing its own shards, then restore it (process_helpers.py's
`two_processes_save_and_restore`: test_checkpoint.py, test_table_wise.py).

Usage: checkpoint_multiprocess_worker.py PROCESS_ID PORT ROOT [SHARDINGS]
Process 0 also writes ROOT/../expected.npz with the saved variables. SHARDINGS (default
"mod") is the `sharding` of both engines (the restoring one is unstacked), or several
comma-separated: each saved and restored in turn by the same processes, ROOT's
"{sharding}" replaced by each.
"""

import os
import sys

import orphan_guard  # noqa: F401  (this worker dies with the test process)

process_id, port, roots = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
shardings = (sys.argv[4] if len(sys.argv) > 4 else "mod").split(",")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + os.environ.get(
    "EMBEDMESH_TEST_XLA_FLAGS", ""
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
)

import numpy as np  # noqa: E402
from checkpoint_common import make_features, make_tables  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh import checkpoint as ckpt  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("x",))
assert mesh.size == 4 and len(jax.local_devices()) == 2
feats = make_features(make_tables())


def save_and_restore(sharding: str, root: str) -> None:
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh, sharding=sharding)
    emb.build()
    rng = np.random.default_rng(3)  # same values in both processes
    values, slots = {}, {}
    for t in emb.plan.resolved.tables:
        values[t] = rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32)
        opt_slots = emb.state.slots[emb.plan.stack_of(t).name]
        slots[t] = {
            k: rng.uniform(0.1, 1, (t.vocabulary_size, t.dim)).astype(np.float32) for k in opt_slots
        }
    emb.set_tables(values, slots, step=3)
    assert ckpt.save(root, emb)
    if process_id == 0:
        out = {f"{t.name}.parameters": v for t, v in values.items()}
        out.update({f"{t.name}.{k}": v for t, d in slots.items() for k, v in d.items()})
        np.savez(os.path.join(os.path.dirname(root), "expected.npz"), **out)

    # restore into a fresh 4-device engine spread over both processes
    fresh = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh, stack_tables=False, sharding=sharding)
    assert ckpt.restore(fresh, root) == 3
    for t, d in fresh.variables.items():
        np.testing.assert_array_equal(d["parameters"], values[t])
        for k, v in slots[t].items():
            np.testing.assert_array_equal(d[k], v)
    print(f"restored ok ({sharding})", flush=True)


for sharding in shardings:
    save_and_restore(sharding, roots.replace("{sharding}", sharding))
