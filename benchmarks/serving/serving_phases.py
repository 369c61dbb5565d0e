"""Where a serving call's time goes: the phases of one `serving_embedding_lookup` call.

Runs benchmarks/serving/serving.py's workload (8 tables x 1M x dim, batch 4096, Poisson(10)
Zipf(1.05) ids) on the host path and splits each call into: prepare (checks, layouts,
the bag offsets, output buffers: `lookup._prepare_host`), kernels (the host kernels:
the C++ runner's wait for a request's handed-over tasks, `NativeRequest.close`, else per
feature on the caller's thread with 1 thread, the whole thread runner with more),
wrap (the outputs as jax.Arrays: `lookup._host_to_jax`) and the rest (config and
structure glue). Medians over the calls. No peers: this times one system's phases.
Common inputs (float32 tables, int ids: this workload) on the C++ backend take the
compiled request rules (`embedmesh.serving.request`) instead: one call into the compiled
checks and the runner that this script cannot split, all of it counted as the rest; the
phases above are the general path's (another backend, e.g. `numpy`).

    PYTHONPATH=. python benchmarks/serving/serving_phases.py ragged sum 1 [dim] [backend]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import serving as bench

from embedmesh.serving import kernels, lookup
from embedmesh.serving.backends import native as native_backend


def main() -> None:
    kind, combiner, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dim = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    backend = sys.argv[5] if len(sys.argv) > 5 else kernels.get_backend()
    args = argparse.Namespace(
        tables=8, vocab=1_000_000, dim=dim, batch=4096, ids_per_sample=10, zipf=1.05, batches=3
    )
    tables, batches, max_len = bench.make_workload(args, np.random.default_rng(0))
    calls = bench.embedmesh_contender(tables, batches, max_len, args, backend, threads)(
        kind, combiner
    )
    calls.setup()
    phase = dict.fromkeys(("prepare", "kernels", "wrap"), 0.0)

    def timed(name, fn):
        def wrapper(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                phase[name] += time.perf_counter() - t0

        return wrapper

    lookup._prepare_host = timed("prepare", lookup._prepare_host)
    lookup._host_to_jax = timed("wrap", lookup._host_to_jax)
    # the C++ kernels: handed over as prepared, waited for at close; other backends per feature
    native_backend.NativeRequest.close = timed("kernels", native_backend.NativeRequest.close)
    if threads == 1:
        lookup._named.__call__ = timed("kernels", lookup._named.__call__)
    else:
        lookup._run_on_threads = timed("kernels", lookup._run_on_threads)
    for c in calls:
        c()
    totals, per = [], {k: [] for k in phase}
    for _ in range(15):
        for c in calls:
            for k in phase:
                phase[k] = 0.0
            t0 = time.perf_counter()
            c()
            totals.append(time.perf_counter() - t0)
            for k in phase:
                per[k].append(phase[k])
    total = statistics.median(totals) * 1e3
    med = {k: statistics.median(v) * 1e3 for k, v in per.items()}
    print(
        f"{kind}/{combiner} {threads}t dim {dim} [{backend}]: call {total:.2f} ms = prepare "
        f"{med['prepare']:.2f} + kernels {med['kernels']:.2f} + wrap {med['wrap']:.2f} + rest "
        f"{total - sum(med.values()):.2f}"
    )


if __name__ == "__main__":
    main()
