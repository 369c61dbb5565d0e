"""A/B of two builds of the CPU device library's fused sparse update, in one process.

Each build (a `embedmesh_device-*.so`: the installed one, a cache's, one built from
another tree) is loaded with ctypes and its FFI targets registered under a prefix of
its own (`a_...`, `b_...`), so the two run the same jitted program shape on the same
arrays, alternately: per round and per case (rule x dim) each side runs `--calls`
updates, the side going first alternating between rounds; each round's figure is
the median of its calls, and the ratio a / b (> 1: b is faster) is taken per round.
Printed: per case the medians of both sides over the rounds and the median, min and
max of the per-round ratios. Noise: run with --a and --b the same file (A/A).

    python benchmarks/cpu_update_ab.py --a OLD.so --b NEW.so [--rounds 7] [--dims 8,64,256]

(CPU only; the library's thread count as embedmesh sets it: EMBEDMESH_CPU_THREADS.)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import embedmesh as em
from embedmesh import _runtime
from embedmesh.device.ops.cpu import kernels, library


def register(path: str, prefix: str) -> None:
    lib = ctypes.CDLL(path)
    lib.EmbedmeshSetThreads.argtypes = [ctypes.c_int64]
    lib.EmbedmeshSetThreads(_runtime.cpu_threads() or 0)
    for name, address in library._listed_handlers(lib).items():
        jax.ffi.register_ffi_target(prefix + name, jax.ffi.pycapsule(address), platform="cpu")


OPTIMIZERS = {
    "sgd": lambda: em.SGD(0.1),
    "adagrad": lambda: em.Adagrad(0.1),
    "adam": lambda: em.Adam(0.01),
    "rowwise_adagrad": lambda: em.RowWiseAdagrad(0.1),
}


def case(name: str, d: int, rows: int, u: int, seed: int):
    """The jitted update of each side and its (donated) state."""
    opt = OPTIMIZERS[name]()
    r = np.random.default_rng(seed)
    table = r.standard_normal((rows, d)).astype(np.float32)
    slots = {
        k: np.full((rows, opt.slot_width(k, d)), v, np.float32)
        for k, v in opt.slot_initial_values.items()
    }
    ids = jnp.asarray(np.sort(r.choice(rows, u, replace=False)).astype(np.int32))
    grads = jnp.asarray(r.standard_normal((u, d)).astype(np.float32))

    def side(prefix):
        def f(t, s, i, g):
            return kernels._update(
                prefix + "embedmesh_sparse_{}",
                t,
                s,
                (i, g, kernels._LR),
                optimizer=opt,
                step=1,
            )

        return jax.jit(f, donate_argnums=(0, 1))

    state = {p: [jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}] for p in "ab"}
    return {p: side(p + "_") for p in "ab"}, state, ids, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the baseline library (.so)")
    ap.add_argument("--b", required=True, help="the library compared with it (.so)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--rules", default=",".join(OPTIMIZERS))
    ap.add_argument("--dims", default="8,64,256")
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args()
    register(os.path.abspath(args.a), "a_")
    register(os.path.abspath(args.b), "b_")
    cases = {}
    for name in args.rules.split(","):
        for d in map(int, args.dims.split(",")):
            fns, state, ids, grads = case(name, d, args.rows, args.ids, seed=d)
            for p in "ab":  # compile and warm
                state[p] = list(fns[p](*state[p], ids, grads))
                jax.block_until_ready(state[p][0])
            a0, b0 = np.asarray(state["a"][0]), np.asarray(state["b"][0])
            if not np.array_equal(a0.view(np.uint32), b0.view(np.uint32)):
                sys.exit(f"{name} d={d}: the two builds' results differ")
            cases[f"{name}/d{d}"] = (fns, state, ids, grads)
    per_round = {k: {"a": [], "b": [], "ratio": []} for k in cases}
    for rnd in range(args.rounds):
        order = "ab" if rnd % 2 == 0 else "ba"
        for key, (fns, state, ids, grads) in cases.items():
            figure = {}
            for p in order:
                ts = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    state[p] = list(fns[p](*state[p], ids, grads))
                    jax.block_until_ready(state[p][0])
                    ts.append(time.perf_counter() - t0)
                figure[p] = statistics.median(ts) * 1e3
            per_round[key]["a"].append(figure["a"])
            per_round[key]["b"].append(figure["b"])
            per_round[key]["ratio"].append(figure["a"] / figure["b"])
    print(f"{'case':<22} {'a ms':>8} {'b ms':>8} {'a/b med':>8} {'min':>6} {'max':>6}")
    summary = {}
    for key, v in per_round.items():
        s = {
            "a_ms": statistics.median(v["a"]),
            "b_ms": statistics.median(v["b"]),
            "ratio": statistics.median(v["ratio"]),
            "min": min(v["ratio"]),
            "max": max(v["ratio"]),
        }
        summary[key] = s
        print(
            f"{key:<22} {s['a_ms']:8.3f} {s['b_ms']:8.3f} {s['ratio']:8.3f} "
            f"{s['min']:6.3f} {s['max']:6.3f}"
        )
    print(f"load average {os.getloadavg()[0]:.1f}, {args.rounds} rounds x {args.calls} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": per_round, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
