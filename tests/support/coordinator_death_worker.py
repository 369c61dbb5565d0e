"""One of two processes (2 CPU devices each, gloo) that train, commit a checkpoint, then
start the next save, during which the parent kills one of them (test_coordinator_death.py).

Usage: coordinator_death_worker.py PROCESS_ID PORT ROOT OUT_DIR AFTER [HEARTBEAT_S]

Three training steps, then step 3 is saved and committed; OUT_DIR/saved.npz (written by
process 1 before that save) holds the variables step 3 holds. One more training step,
then step 4's save starts (async). In process 0 the commit of step 4 (orbax's rename of
its temporary directory, which only the primary process does) blocks after writing
OUT_DIR/marker: the parent kills a process there, so step 4 is fully written but never
committed. AFTER says what both processes do meanwhile: "wait" blocks in
`mngr.wait_until_finished()`, "train" keeps training (collectives with the peer).
HEARTBEAT_S is `jax.distributed.initialize(heartbeat_timeout_seconds=...)` (jax's
default 100).
"""

import os
import sys
import time

import orphan_guard  # noqa: F401  (this worker dies with the test process)

process_id, port, root, out_dir, after = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    sys.argv[3],
    sys.argv[4],
    sys.argv[5],
)
heartbeat = int(sys.argv[6]) if len(sys.argv) > 6 else 100
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + os.environ.get(
    "EMBEDMESH_TEST_XLA_FLAGS", ""
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    heartbeat_timeout_seconds=heartbeat,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from checkpoint_common import make_batch, make_features, make_tables  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh import checkpoint as ckpt  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402

grad_fn = jax.jit(lambda acts: jax.tree_util.tree_map(lambda a: jnp.sin(3.0 * a) + 0.1, acts))


def log(msg):
    print(f"[process {process_id}] {msg}", flush=True)


def train_step(emb, feats, seed):
    """One lookup + update on this process's part of the global batch."""
    acts, preserved = emb(make_batch(feats, 2 * seed + process_id, batch=12))
    emb.apply_gradients(grad_fn(acts), preserved)


def block_forever(*args, **kwargs):
    with open(os.path.join(out_dir, "marker"), "w") as f:
        f.write("committing step 4")
    log("blocked in the commit of step 4")
    while True:
        time.sleep(60)


mesh = Mesh(np.array(jax.devices()), ("x",))
assert mesh.size == 4 and len(jax.local_devices()) == 2
feats = make_features(make_tables())
emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh)
emb.build()
for seed in range(3):
    train_step(emb, feats, seed)
saved = {f"{t.name}.{k}": v for t, d in emb.variables.items() for k, v in d.items()}
if process_id == 1:
    np.savez(os.path.join(out_dir, "saved.npz"), **saved)

mngr = ocp.CheckpointManager(
    root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
)
assert ckpt.save(mngr, emb, step=3, wait=True)
log(f"step 3 committed; steps {mngr.all_steps()}")

train_step(emb, feats, 3)
if process_id == 0:
    atomicity = ocp.path.atomicity
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        cls.finalize = block_forever
ckpt.save(mngr, emb, step=4)  # async: returns while step 4 is being written
log("step 4 save started")
if after == "train":
    seed = 4
    while True:
        train_step(emb, feats, seed)
        seed += 1
mngr.wait_until_finished()
log("step 4 committed: the kill came too late")
while True:
    time.sleep(60)
