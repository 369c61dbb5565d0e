"""What bounds the dense serving lookup: its time against the machine's write and read speed.

A dense lookup ([batch, 10] ids, no combiner) copies one table row per id into its
output: 84 MB written a call at dim 64 (8 tables, batch 4096). This runs
`serving_embedding_lookup` on benchmarks/serving/serving.py's workload with three id patterns,
on 1 and 2 threads, next to memset-like writes of the same bytes, all in one process,
interleaved round by round (medians over rounds):

- `one row`: every id 0, so the reads hit L1: the output writes alone;
- `sequential`: ids 0, 1, 2, ...: every row read once from memory, in order;
- `zipf`: the workload's ids (Zipf(1.05) over 1M rows): hot rows cached, cold ones not;
- `memset, reused`: libc's memset of one reused buffer of the output's bytes;
- `memset, fresh`: the same into a fresh buffer each time (page faults included: how a
  lookup that allocates its outputs afresh writes; what a pool of buffers saves);
- `numpy fill, reused`: `ndarray.fill` of the reused buffer (numpy's loop, not memset).

    PYTHONPATH=. python benchmarks/serving/serving_dense_bound.py [--dims 16,64,128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import serving as bench

import embedmesh as em
from embedmesh import serving as em_serving


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="16,64,128")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=6, help="timed calls per variant per round")
    bench.each_dim(p.parse_args(), run_dim)


def run_dim(args, dim: int) -> None:
    w = bench.workload_at(dim, args.tables, args.vocab, args.batch)
    batches, names, tabs, fcs = w.batches, w.names, w.by_config, w.features
    shape = batches[0][0]["dense"].shape
    patterns = {
        "one row": [{n: np.zeros(shape, np.int64) for n in names}] * 2,
        "sequential": [
            {
                n: np.arange(k * shape[0] * shape[1], (k + 1) * shape[0] * shape[1]).reshape(shape)
                for n in names
            }
            for k in range(2)
        ],  # fmt: skip
        "zipf": [{n: f["dense"] for n, f in zip(names, feats)} for feats in batches],
    }
    nbytes = args.tables * shape[0] * shape[1] * dim * 4
    reused = np.empty(nbytes // 4, np.float32)

    def lookup(inputs, threads):
        def call(i):
            em_serving.set_host_threads(threads)
            out = em.serving_embedding_lookup(inputs[i % 2], None, tabs, fcs)
            for v in out.values():
                v.block_until_ready()

        return call

    variants = {}
    for threads in (1, 2):
        for name, inputs in patterns.items():
            variants[f"{name}, {threads}t"] = lookup(inputs, threads)
    variants["memset, reused"] = lambda i: ctypes.memset(reused.ctypes.data, i, nbytes)

    def memset_fresh(i):
        fresh = np.empty(nbytes // 4, np.float32)  # held while memset writes it
        ctypes.memset(fresh.ctypes.data, i, nbytes)

    variants["memset, fresh"] = memset_fresh
    variants["numpy fill, reused"] = lambda i: reused.fill(i)
    for fn in variants.values():  # warm: pools, pages, code
        fn(0)
        fn(1)
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            fn = variants[name]
            times = []
            for i in range(args.calls):
                t0 = time.perf_counter()
                fn(i)
                times.append(time.perf_counter() - t0)
            per_round[name].append(statistics.median(times))
    print(f"\n== dim {dim}: {nbytes / 1e6:.0f} MB written a call ({args.tables} x {shape})")
    for name, ts in per_round.items():
        t = statistics.median(ts)
        print(f"  {name:18s} {t * 1e3:8.2f} ms   {nbytes / t / 1e9:6.1f} GB/s written")


if __name__ == "__main__":
    main()
