"""Checkpoint size and save/restore time against the machine's sequential disk bandwidth.

Workload (issue 5): 8 tables x 1M rows x dim 64 float32 with Adagrad (parameters plus
one accumulator per table: 4.1 GB of raw arrays), on a MeshEmbedding over N virtual
CPU devices (default 8, all tables stacked in one array), with random parameters and
accumulators (random bits do not compress: a fair size and bandwidth test).

Measured, in one run, on the file system of --dir:
- dd: sequential write (oflag=direct, conv=fsync) and read (iflag=direct) bandwidth of a
  --dd-gb file;
- save: `embedmesh.checkpoint.save` (synchronous orbax CheckpointManager), then `sync`;
  and an async save (the time the training loop is blocked, then the time to finish);
- size on disk against the raw size of the arrays;
- restore, with the checkpoint's pages evicted from the page cache first (posix_fadvise
  DONTNEED after fsync; the dd read uses O_DIRECT): into an N-device engine (same
  layout), into an M-device engine (--restore-devices, resharded), and `load_tables`
  (serving: parameters only, host numpy, no mesh);
- restore bandwidth = checkpoint bytes read / restore time, as a fraction of dd's read
  bandwidth (goal: >= 50%).

Run from the repo root (needs ~12 GB of free memory at the default size):

    PYTHONPATH=. /tmp/venv/bin/python benchmarks/checkpoint/checkpoint.py \\
        [--rows 1000000] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--restore-devices", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    p.add_argument("--dd-gb", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3, help="restores of each kind (median)")
    p.add_argument(
        "--stack",
        action="store_true",
        help="stack the tables (one array; saving then slices each table out on "
        "device, a transient copy); default: one array per table",
    )
    p.add_argument(
        "--compression",
        action="store_true",
        help="save with zstd (ocp.args.StandardSave) instead of uncompressed",
    )
    return p.parse_args()


ARGS = parse_args()
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={max(ARGS.devices, ARGS.restore_devices)}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh import checkpoint as ckpt  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402


class RandomRows:
    """Row-aware initializer: standard normal rows, cheap (numpy), shard-count independent."""

    def __init__(self, seed):
        self.seed = seed

    def rows(self, row_ids, dim, dtype):
        rng = np.random.default_rng([self.seed, int(row_ids[0]) if len(row_ids) else 0])
        return rng.standard_normal((len(row_ids), dim), dtype=np.float32).astype(dtype)

    def __call__(self, key, shape, dtype=np.float32):
        return self.rows(np.arange(shape[0]), int(np.prod(shape[1:])), dtype).reshape(shape)


def features():
    tables = [
        em.TableConfig(ARGS.rows, ARGS.dim, name=f"t{i}", initializer=RandomRows(i))
        for i in range(ARGS.tables)
    ]
    return {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tables)}


def mesh_of(n):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def build(feats, n):
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(n), stack_tables=ARGS.stack)
    emb.build()
    return emb


def randomize_slots(emb):
    """Accumulators of random positive values (a trained state, not a constant)."""
    core = emb.core
    for _s, d in emb.state.slots.items():
        for name in list(d):
            shape = d[name].shape
            rows = shape[0] // core.num_shards
            d[name].delete()  # one slot array at a time: no second copy of the state

            def cb(index, rows=rows, shape=shape):
                j = (index[0].start or 0) // rows
                rng = np.random.default_rng([99, j])
                return rng.uniform(0.1, 5.0, (rows,) + shape[1:]).astype(np.float32)

            d[name] = jax.make_array_from_callback(shape, core.row_sharding, cb)


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def evict(path):
    """fsync then drop the page cache of every file under `path` (no root needed)."""
    paths = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    )
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_bandwidth(directory, gb):
    """(write, read) bytes/s of dd with direct I/O on `directory`'s file system."""
    f = os.path.join(directory, "dd.bin")
    count = max(1, int(gb * 1024 / 64))

    def run(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
        return int(m.group(1)) / float(m.group(2))

    w = run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"]
    )
    evict(f)
    r = run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"])
    os.remove(f)
    return w, r


def rss_gb():
    """(current, peak) resident memory of this process in GB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v
    return (
        int(fields["VmRSS"].split()[0]) * 1024 / 1e9,
        int(fields["VmHWM"].split()[0]) * 1024 / 1e9,
    )


def mem(label):
    cur, peak = rss_gb()
    print(f"  [memory after {label}: rss {cur:.2f} GB, peak {peak:.2f} GB]", flush=True)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def check_equal(a, b, rows=(0, 1, 12345 % ARGS.rows, ARGS.rows - 1)):
    for t in a:
        key = next(k for k in b if k.name == t.name)
        np.testing.assert_array_equal(np.asarray(a[t])[list(rows)], np.asarray(b[key])[list(rows)])


def save_sync(emb, root):
    """`emb` saved to `root` as step 1 by a synchronous manager (zstd with --compression)."""
    if ARGS.compression:
        mngr = ocp.CheckpointManager(
            root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
        )
        mngr.save(1, args=ocp.args.Composite(embedding=ckpt.save_args(emb, compression=True)))
        mngr.close()
    else:
        ckpt.save(root, emb, step=1)


def measure_saves(emb, work, raw):
    """The synchronous save (first in the process, then again) and the async one, with
    their fsync; returns (checkpoint root, its size, save + fsync s, again + fsync s)."""
    gb = 1e9
    root = os.path.join(work, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    t_save, _ = timed(lambda: save_sync(emb, root))
    t_sync, _ = timed(lambda: evict(root))
    size = dir_bytes(os.path.join(root, "1"))
    print(
        f"save (sync manager): {t_save:.2f} s, then fsync {t_sync:.2f} s -> "
        f"{raw / (t_save + t_sync) / gb:.3f} GB/s of raw arrays"
    )
    print(f"size on disk: {size / gb:.3f} GB = {size / raw:.3f} x raw")
    mem("sync save")
    root2 = os.path.join(work, "ckpt_again")
    shutil.rmtree(root2, ignore_errors=True)
    t_save2, _ = timed(lambda: (save_sync(emb, root2), evict(root2)))
    shutil.rmtree(root2, ignore_errors=True)
    print(f"save again (warm process) + fsync: {t_save2:.2f} s -> {raw / t_save2 / gb:.3f} GB/s")

    mngr = ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    t_block, _ = timed(
        lambda: mngr.save(
            2,
            args=ocp.args.Composite(embedding=ckpt.save_args(emb, compression=ARGS.compression)),
        )
    )
    t_rest, _ = timed(mngr.wait_until_finished)
    mngr.close()
    print(f"async save: training blocked {t_block:.2f} s, written after {t_block + t_rest:.2f} s")
    shutil.rmtree(os.path.join(root, "2"), ignore_errors=True)
    mem("async save")
    return root, size, t_save + t_sync, t_save2


def restore_into(feats, root, probe, n, prefetch=False):
    """(first, median) restore times into a fresh n-device engine: the first restore
    of a process is the resume case (cold allocator); later ones reuse its memory."""
    dst = build(feats, n)
    times = []
    for _ in range(ARGS.repeats):
        evict(root)
        t, _ = timed(lambda: ckpt.restore(dst, root, step=1, prefetch=prefetch))  # noqa: F821 - bound before the del below
        jax.block_until_ready(dst.state)
        times.append(t)
    first = dst.plan.resolved.tables[0]
    got = {first: dst.core.read_table(dst.state.tables[dst.plan.table(first).stack], first)}
    check_equal(probe, got)
    del dst, got
    gc.collect()
    mem(f"restore into {n}, prefetch={prefetch}")
    return times[0], sorted(times)[len(times) // 2]


def measure_restores(feats, root, probe, size):
    """Restores into engines of each layout and `load_tables`, each checked against
    `probe`: rows of (label, first s, median s, bytes read)."""
    results = []
    for n, label, prefetch in (
        (ARGS.devices, "same layout", False),
        (ARGS.restore_devices, "resharded", False),
        (ARGS.restore_devices, "resharded, prefetch=True", True),
    ):
        first_t, med = restore_into(feats, root, probe, n, prefetch)
        results.append((f"restore into {n} devices ({label})", first_t, med, size))
    times = []
    for _ in range(ARGS.repeats):
        evict(root)
        t, loaded = timed(lambda: ckpt.load_tables(root, step=1))
        times.append(t)
        check_equal(probe, loaded)
        del loaded
    params_bytes = size / 2  # parameters are half of the checkpoint (one accumulator each)
    results.append(
        (
            "load_tables (serving: parameters only, host)",
            times[0],
            sorted(times)[len(times) // 2],
            params_bytes,
        )
    )
    return results


def print_table(results, saves, size, dd_w, dd_r):
    """The markdown table: each restore against dd's read, each save against its write."""
    gb = 1e9
    print(
        f"\n| operation | first (s) | median of {ARGS.repeats} (s) | bytes (GB) | GB/s "
        f"(first / median) | vs dd (first / median) |"
    )
    print("|---|---|---|---|---|---|")
    for label, t0, t, nbytes in results:
        print(
            f"| {label} | {t0:.2f} | {t:.2f} | {nbytes / gb:.3f} read | "
            f"{nbytes / t0 / gb:.3f} / {nbytes / t / gb:.3f} | "
            f"{nbytes / t0 / dd_r:.0%} / {nbytes / t / dd_r:.0%} of dd read |"
        )
    for label, t in saves:
        print(
            f"| {label} | {t:.2f} | | {size / gb:.3f} written | {size / t / gb:.3f} | "
            f"{size / t / dd_w:.0%} of dd write |"
        )


def main():
    work = ARGS.dir or tempfile.mkdtemp(prefix="embedmesh_ckpt_bench_", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    raw = ARGS.tables * ARGS.rows * ARGS.dim * 4 * 2  # parameters + accumulators
    gb = 1e9
    print(
        f"# {ARGS.tables} tables x {ARGS.rows} rows x dim {ARGS.dim}, Adagrad, "
        f"{ARGS.devices} devices (restore also into {ARGS.restore_devices}), "
        f"{'stacked' if ARGS.stack else 'one array per table'}, "
        f"{'zstd' if ARGS.compression else 'uncompressed'}; dir {work}"
    )
    print(
        f"cpus: {os.cpu_count()}, jax {jax.__version__}, orbax "
        f"{getattr(ocp, '__version__', '?')}, raw arrays {raw / gb:.3f} GB"
    )

    dd_w, dd_r = dd_bandwidth(work, ARGS.dd_gb)
    print(f"dd: write {dd_w / gb:.3f} GB/s (direct, fsync), read {dd_r / gb:.3f} GB/s (direct)")

    feats = features()
    t_build, emb = timed(lambda: build(feats, ARGS.devices))
    randomize_slots(emb)
    jax.block_until_ready(emb.state)
    print(f"built and randomized the source state in {t_build:.1f} s")
    mem("build")
    root, size, t_save, t_save2 = measure_saves(emb, work, raw)

    first = emb.plan.resolved.tables[0]  # kept to check the restores
    probe = {first: emb.core.read_table(emb.state.tables[emb.plan.table(first).stack], first)}
    del emb
    gc.collect()  # the engine holds reference cycles (its jitted closures)
    results = measure_restores(feats, root, probe, size)
    saves = (
        ("save (sync) + fsync, first in the process", t_save),
        ("save (sync) + fsync, again", t_save2),
    )
    print_table(results, saves, size, dd_w, dd_r)
    if not ARGS.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
