"""Saves step 1, then starts saving step 2 and waits to be killed (test_checkpoint.py).

Usage: checkpoint_kill_worker.py ROOT MARKER KILL_AT
KILL_AT "before_commit": step 2 is fully written, then the rename that commits it
blocks; MARKER appears at that point. "while_writing": MARKER appears just before
the save of step 2 starts (a large one); the parent kills the process as soon as
step 2's temporary directory exists.
"""

import sys
import time

import orphan_guard  # noqa: F401  (this worker dies with the test process)

root, marker, kill_at = sys.argv[1], sys.argv[2], sys.argv[3]

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from checkpoint_common import HashInit, make_features, make_tables  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh import checkpoint as ckpt  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402


def touch(path):
    with open(path, "w") as f:
        f.write("now")


def block_forever(*args, **kwargs):
    touch(marker)
    while True:
        time.sleep(60)


tables = make_tables()
feats = make_features(tables)
if kill_at == "while_writing":  # a large table, so that writing step 2 takes a while
    feats["big"] = em.FeatureConfig(
        em.TableConfig(250_000, 64, name="big", initializer=HashInit(9))
    )
emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=Mesh(np.array(jax.devices()), ("x",)))
emb.build()
emb.set_tables({t: v + 1.0 for t, v in emb.embedding_tables.items()}, step=1)
assert ckpt.save(root, emb, step=1)
np.savez(
    marker + ".step1.npz",
    **{
        f"{t.name}.{k}": v
        for t, d in emb.variables.items()
        for k, v in d.items()
        if t.name != "big"
    },
)

emb.set_tables({t: v * 2.0 for t, v in emb.embedding_tables.items()}, step=2)
mngr = ocp.CheckpointManager(
    root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
)
if kill_at == "before_commit":
    atomicity = ocp.path.atomicity
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        cls.finalize = block_forever
else:
    touch(marker)
ckpt.save(mngr, emb, step=2, wait=True)
print("step 2 committed: the kill came too late", flush=True)
while True:
    time.sleep(60)
