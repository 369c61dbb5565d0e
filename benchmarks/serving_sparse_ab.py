"""Sparse input, same process: the one-pass sparse kernel against offsets-then-bag and torch.

benchmarks/serving.py's workload (8 tables x 1M x dim, batch 4096, Poisson(10) Zipf(1.05)
ids, 2 batches), sparse input, 1 thread each. Contenders, interleaved call by call in a
shuffled order, 11 rounds: torch[1t] `embedding_bag` (given the bag offsets), the lookup
with the one-pass kernel (`kernels.prepare_sparse_bag_combine`), and the lookup with it
turned off (the offsets pass, then the bag kernel). Prints medians of per-call ratios.

    PYTHONPATH=. python benchmarks/serving_sparse_ab.py DIM [sum|mean] [thread|wall]

Times are the calling thread's CPU time (`thread`, the default since 2026-12-03: with 1
thread both systems run on it, and time spent descheduled by other processes on a
loaded machine is left out) or wall-clock time (`wall`).
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import serving as bench
import torch

from embedmesh.serving import kernels

torch.set_num_threads(1)
dim = int(sys.argv[1])
comb = sys.argv[2] if len(sys.argv) > 2 else "sum"
clock = time.perf_counter if len(sys.argv) > 3 and sys.argv[3] == "wall" else time.thread_time
args = argparse.Namespace(
    tables=8, vocab=1_000_000, dim=dim, batch=4096, ids_per_sample=10, zipf=1.05, batches=2
)
tables, batches, max_len = bench.make_workload(args, np.random.default_rng(0))
kernels.set_backend("native")
tor = bench.torch_contender(tables, batches, max_len, args, 1)("sparse", comb)
tor.setup()
serve = bench.embedmesh_contender(tables, batches, max_len, args, "native", 1)("sparse", comb)
serve.setup()
real = kernels.prepare_sparse_bag_combine


def var(on):
    def mk(c):
        def f():
            kernels.prepare_sparse_bag_combine = real if on else (lambda *a, **k: None)
            limit = kernels.SPARSE_ONE_PASS_MAX_DIM
            kernels.SPARSE_ONE_PASS_MAX_DIM = 1 << 30  # whatever the lookup's rule
            try:
                return c()
            finally:
                kernels.prepare_sparse_bag_combine = real
                kernels.SPARSE_ONE_PASS_MAX_DIM = limit

        return f

    return [mk(c) for c in serve]


C = {"torch": tor, "one_pass": var(1), "offsets_then_bag": var(0)}
for c in C.values():
    for f in c:
        f()
res = {k: [] for k in C}
ab = []
for rnd in range(11):
    for i in range(len(batches)):
        order = list(C)
        np.random.default_rng(rnd * 7 + i).shuffle(order)
        t = {}
        for k in order:
            t0 = clock()
            out = C[k][i]()
            t[k] = clock() - t0
            del out
        for k in C:
            res[k].append(t["torch"] / t[k])
        ab.append(t["offsets_then_bag"] / t["one_pass"])
for k in list(C)[1:]:
    print(f"dim {dim} sparse/{comb} {k}: em/torch speed {statistics.median(res[k]):.2f}")
print(
    f"dim {dim} sparse/{comb} one_pass speed over offsets_then_bag: "
    f"{statistics.median(ab):.2f} (rounds {min(ab):.2f}-{max(ab):.2f})"
)
