"""Resident memory over many checkpoint save + restore cycles (issue 24, item 11).

Each cycle trains one step of a small MeshEmbedding (2 tables, Adagrad, 4 virtual CPU
devices), saves it as the next step of one orbax CheckpointManager (max_to_keep=2; or,
with --directory, through a fresh synchronous manager per save, `save(path, emb)`), and
restores it (`restore(emb, mngr)`). After cycle 1 (compiles, orbax's and tensorstore's
pools) and every --every cycles it prints the RSS (/proc/self/status VmRSS after
gc.collect()), its growth since cycle 1 and the growth of the objects the garbage
collector tracks (a leak of Python objects shows there first).

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint/checkpoint_rss.py \\
        [--cycles 300] [--directory]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--async-save", action="store_true", help="an async manager (waited for)")
    p.add_argument(
        "--directory", action="store_true", help="save to a path: a new manager per save"
    )
    return p.parse_args()


ARGS = parse_args()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={ARGS.devices}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh import checkpoint as ckpt  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402


def rss_mb() -> tuple[float, int]:
    """(VmRSS in MB, objects the garbage collector tracks), after a collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(gc.get_objects())


def main():
    t1 = em.TableConfig(ARGS.rows, 16, name="t1")
    t2 = em.TableConfig(ARGS.rows // 4, 8, combiner="mean", name="t2")
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
    mesh = Mesh(np.array(jax.devices()[: ARGS.devices]), ("x",))
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh)
    rng = np.random.default_rng(0)
    batch = 8 * ARGS.devices
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))

    root = tempfile.mkdtemp(prefix="embedmesh_ckpt_rss_")
    mngr = None
    if not ARGS.directory:
        mngr = ocp.CheckpointManager(
            root,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2, enable_async_checkpointing=ARGS.async_save
            ),
        )
    print(
        f"# {ARGS.cycles} cycles of train + save + restore; tables {ARGS.rows}x16 and "
        f"{ARGS.rows // 4}x8, Adagrad, {ARGS.devices} devices; "
        f"{'a manager per save (directory)' if ARGS.directory else 'one manager'}"
        f"{', async' if ARGS.async_save else ''}; jax {jax.__version__}, orbax "
        f"{getattr(ocp, '__version__', '?')}",
        flush=True,
    )
    first = None
    t0 = time.perf_counter()
    for cycle in range(ARGS.cycles + 1):
        if cycle % ARGS.every == 0 or cycle == 1:
            rss, objects = rss_mb()
            if cycle == 1:
                first = rss, objects
            since = first or (rss, objects)
            print(
                f"cycle {cycle:4d}: rss {rss:8.1f} MB  ({rss - since[0]:+7.1f} MB, "
                f"{objects - since[1]:+7d} objects since cycle 1)  "
                f"{time.perf_counter() - t0:6.1f} s",
                flush=True,
            )
        if cycle == ARGS.cycles:
            break
        ids = {
            "a": rng.integers(0, ARGS.rows, (batch, 2)),
            "b": rng.integers(0, ARGS.rows // 4, batch),
        }
        acts, pre = emb(ids)
        emb.apply_gradients(grad_fn(acts), pre)
        step = cycle + 1
        if ARGS.directory:
            path = os.path.join(root, str(step % 3))
            shutil.rmtree(path, ignore_errors=True)
            ckpt.save(path, emb, step)
            assert ckpt.restore(emb, path) == step
        else:
            ckpt.save(mngr, emb, step, wait=True)
            assert ckpt.restore(emb, mngr) == step
    if mngr is not None:
        mngr.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
