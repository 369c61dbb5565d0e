"""The link between processes of one host: `ops.exchange` through shared memory, timed.

What `Machine.this_cpu("host_shm")` (layout/cost_model.py) charges an exchange between
processes: a latency per collective and bytes at a bandwidth. Two processes on
127.0.0.1 (jax.distributed, gloo), each pinned to its own core with one CPU device, run
a jitted `shard_map` of `ops.exchange(x, Transport(host_job=...))` over [2, rows, 64] float32
blocks (each process sends the other one block), `--iters` times per size after a
warm-up; each process reports the median time of a call, and the slower process's
median counts. The fit over the sizes up to `--fit-max-kb` (least squares, time =
latency + bytes sent / bandwidth) gives the link's two constants: a step's messages are
at most a few MB a block, and bigger ones slow down (the fresh output's page faults).

    .venv/bin/python benchmarks/scale/host_link.py [--sizes-kb 4,256,1024,4096,16384] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
D = 64


def worker(args) -> None:
    usable = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {usable[args.proc_id % len(usable)]})
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2, process_id=args.proc_id
    )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from embedmesh.device import ops, peers

    mesh = Mesh(np.array(jax.devices()), ("x",))
    job = peers.same_host_job(mesh)
    assert job, "the two processes are not found on one host"
    out = {}
    for kb in args.sizes_kb:
        rows = max(1, kb * 1024 // (4 * D))
        sharding = NamedSharding(mesh, P("x"))
        shape = (2 * 2 * rows, D)  # per device [2 blocks, rows, D]
        x = jax.make_array_from_callback(
            shape, sharding, lambda index: np.ones((2 * rows, D), np.float32)
        )

        def body(v, rows=rows, kb=kb):
            blocks = v.reshape(2, rows, D)
            link = ops.Transport("x", 2, host_job=job, channel=f"link/{kb}")
            return ops.exchange(blocks, link).reshape(2 * rows, D)

        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        )
        for _ in range(3):
            jax.block_until_ready(fn(x))
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t)
        out[kb] = dict(sent_bytes=rows * D * 4, median_s=statistics.median(times))
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def fit(points):
    """(latency s, bandwidth B/s) of time = latency + bytes / bandwidth, least squares."""
    xs = [b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), 1.0 / slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kb", default="4,64,256,1024,2048,4096,8192,16384")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--fit-max-kb", type=int, default=4096, help="largest size in the fit")
    ap.add_argument("--json")
    ap.add_argument("--proc-id", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes_kb = [int(s) for s in str(args.sizes_kb).split(",")]
    if args.proc_id >= 0:
        return worker(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--port", str(port)]
    cmd += ["--sizes-kb", ",".join(map(str, args.sizes_kb)), "--iters", str(args.iters)]
    procs = [
        subprocess.Popen(cmd + ["--proc-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"a process failed (exit {p.returncode})")
        results.append(json.loads(line[7:]))
    print(f"ops.exchange between 2 processes of one host, {args.iters} calls a size, pinned")
    print(f"  {'sent a process':>15s} {'call (slower process)':>22s} {'GB/s':>7s}")
    points = []
    for kb in map(str, args.sizes_kb):
        sent = results[0][kb]["sent_bytes"]
        t = max(r[kb]["median_s"] for r in results)
        points.append((sent, t))
        print(f"  {sent / 1e6:12.3f} MB {t * 1e6:19.1f} us {sent / t / 1e9:7.2f}")
    latency, bandwidth = fit([pt for kb, pt in zip(args.sizes_kb, points) if kb <= args.fit_max_kb])
    fitted = f"latency {latency * 1e6:.1f} us, bandwidth {bandwidth / 1e9:.2f} GB/s"
    print(f"fit up to {args.fit_max_kb} KB: {fitted}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(points=points, latency_s=latency, bandwidth=bandwidth), f, indent=1)


if __name__ == "__main__":
    main()
