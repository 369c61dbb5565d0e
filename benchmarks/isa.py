"""What each ISA variant of the CPU kernels costs: a kernel-heavy step per variant.

The step (one jitted program, table and accumulators donated): the forward lookup
(`ops.segment_gather_sum` reading the unique rows of a table through `src_map`) and
the fused backward + Adagrad update (`ops.backward_update`), on one table of
V x D float32, batch B with ~10 Zipf(1.05) ids per sample, sum combiner. Each variant
runs in its own child process (`EMBEDMESH_CPU_ISA`: the library is chosen once per
process), in interleaved rounds (the order rotates each round); medians over rounds of
each round's ratio to the `native` build (`-march=native`, built into the cache at first
use), and each variant's median step time.

    PYTHONPATH=$PWD python benchmarks/isa.py                     # native, v4, v3, baseline
    ... --variants native,x86-64-v4,x86-64-v3 --rounds 7 --steps 30
    ... --op update --shape 50000,64,0     # the fused Adagrad update of every row alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
from embedmesh import _native
from embedmesh.device import ops
from embedmesh.device.ops import cpu
from embedmesh.optimizers import Adagrad

V, D, B, steps = map(int, sys.argv[1:5])  # argv[5]: step | update
assert cpu.ready(), cpu.unavailable_reason()
rng = np.random.default_rng(0)
table = jnp.asarray(rng.standard_normal((V, D), dtype=np.float32))
acc = jnp.full((V, D), 0.1, jnp.float32)
lengths = rng.poisson(10, B)
P = int(lengths.sum())
ranks = np.minimum(rng.zipf(1.05, P), V) - 1
ids = rng.permutation(V)[ranks].astype(np.int32)
uniq, inverse = np.unique(ids, return_inverse=True)
U = len(uniq)
samples = np.repeat(np.arange(B), lengths).astype(np.int32)
args = [jnp.asarray(a) for a in (uniq.astype(np.int32), inverse.astype(np.int32),
                                 np.ones(P, np.float32), samples)]
opt = Adagrad(0.01)

def step(table, acc, uniq, inverse, gains, samples):
    act = ops.segment_gather_sum(table, inverse, gains, samples, B, src_map=uniq)
    g = act * (1.0 / B)
    table, slots = ops.backward_update(opt, table, {"accumulators": acc}, uniq, g,
                                       samples, inverse, gains, 0)
    return table, slots["accumulators"], act.sum()

if sys.argv[5] == "update":  # the fused Adagrad update alone, of every row (compute-bound)
    every = jnp.arange(V, dtype=jnp.int32)
    grads = jnp.asarray(rng.standard_normal((V, D), dtype=np.float32))
    def step(table, acc, *unused):
        table, slots = ops.sparse_update(opt, table, {"accumulators": acc}, every, grads, 0)
        return table, slots["accumulators"], table[0, 0]

f = jax.jit(step, donate_argnums=(0, 1))
for _ in range(3):
    table, acc, s = f(table, acc, *args)
jax.block_until_ready(table)
times = []
for _ in range(steps):
    t = time.perf_counter()
    table, acc, s = f(table, acc, *args)
    jax.block_until_ready((table, acc))
    times.append(time.perf_counter() - t)
print(json.dumps({"variant": _native.selected_variant(), "library": cpu.library_path(),
                  "ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(np.min(times)),
                  "unique": U, "pairs": P}))
"""


def run(variant: str, shape: list, threads: int = 0) -> dict:
    env = dict(os.environ, EMBEDMESH_CPU_ISA=variant, JAX_PLATFORMS="cpu")
    if threads:
        env["EMBEDMESH_CPU_THREADS"] = str(threads)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, shape)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise SystemExit(f"{variant}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_line() -> str:
    from embedmesh import _native

    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    flags = _native.cpu_flags()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "amx_tile") if f in flags]
    best = _native.choose_variant(flags)
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(isa)}; best variant {best}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default="native,x86-64-v4,x86-64-v3,x86-64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shape", default="500000,64,4096", help="V,D,B")
    p.add_argument(
        "--op",
        choices=("step", "update"),
        default="step",
        help="step: lookup + fused backward/Adagrad of a batch; update: Adagrad of every row",
    )
    p.add_argument("--threads", type=int, default=0, help="EMBEDMESH_CPU_THREADS (0: default)")
    p.add_argument(
        "--stat",
        choices=("ms", "min_ms"),
        default="ms",
        help="each child's step time: median (ms) or fastest (min_ms: on a loaded machine)",
    )
    args = p.parse_args()
    variants = args.variants.split(",")
    shape = [*map(int, args.shape.split(",")), args.steps, args.op]
    print(cpu_line(), flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for v in variants:  # builds what is not built (native: into the cache), untimed
        r = run(v, [1000, shape[1], 64, 1, args.op])
        print(f"warm {v}: {r['library']}", flush=True)
    ms: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.rounds):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        got = {v: run(v, shape, args.threads) for v in order}
        for v in variants:
            ms[v].append(got[v][args.stat])
            ratios[v].append(got[v][args.stat] / got[variants[0]][args.stat])
        print(
            f"round {i}: "
            + "  ".join(f"{v} {got[v][args.stat]:.2f} ms" for v in variants)
            + f"  (U={got[variants[0]]['unique']}, pairs={got[variants[0]]['pairs']})",
            flush=True,
        )
    print(f"load average at end: {os.getloadavg()}")
    print(
        f"\nstep time ({args.stat}, threads {args.threads or 'default'}) / {variants[0]}'s "
        "(median of per-round ratios), median step ms:"
    )
    for v in variants:
        print(f"  {v:10s} {statistics.median(ratios[v]):.3f}x  {statistics.median(ms[v]):.2f} ms")


if __name__ == "__main__":
    t = time.time()
    main()
    print(f"({time.time() - t:.0f} s)")
