"""How a serving request uses the C++ pool, A/B against torch's `embedding_bag`, each
system alone in its turn (as a server running only it would be), same process.

Variants of `embedmesh.serving_embedding_lookup` on serving.py's workload (tables x 1M x
dim float32, batch `--batch`, Poisson(10) lengths, Zipf(1.05) ids, ragged or sparse
input, sum), named by what they set:
- `1t`: one thread (against torch[1t]);
- `call`: 2 threads, the request's tasks in one C++ call once all are made;
- `hand`: 2 threads, each task handed to the pool as it is made (the fast path's way
  for requests large enough for two threads);
- `-spinN`: the pool's threads poll N microseconds for the next request before they
  sleep (`EmServingSetPoolSpin`; without it: 0, they sleep at once).
torch[2t] and torch[1t] are the peers. A round runs every contender in a shuffled order:
two untimed calls, then `--calls` timed ones back to back; the ratio peer / variant is
taken per round and the median over `--rounds` rounds printed.

    PYTHONPATH=. python benchmarks/serving_pool_ab.py --dim 16 \\
        --variants call,hand,call-spin300,hand-spin300
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import serving as S
import torch
import torch.nn.functional as F

import embedmesh as em
from embedmesh.serving import kernels, native
from embedmesh.serving import lookup as L


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--kind", choices=("ragged", "sparse"), default="ragged")
    p.add_argument("--variants", default="call,hand,call-spin300,hand-spin300")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=8)
    args = p.parse_args(argv)
    work = argparse.Namespace(
        tables=args.tables, vocab=1_000_000, dim=args.dim, batch=args.batch,
        ids_per_sample=10, zipf=1.05, batches=2, seed=0,
    )  # fmt: skip
    tables, batches, max_len = S.make_workload(work, np.random.default_rng(0))
    names = [f"f{i}" for i in range(args.tables)]
    tcs = [em.TableConfig(work.vocab, args.dim, combiner="sum", name=f"t{i}") for i in names]
    fcs = {n: em.FeatureConfig(tc, name=n) for n, tc in zip(names, tcs)}
    tabs = dict(zip(tcs, tables))
    if args.kind == "ragged":
        ins = [
            {n: em.RaggedTensor(f["ids"], f["splits"]) for n, f in zip(names, b)} for b in batches
        ]
    else:
        ins = [
            {n: em.SparseTensor(S.sparse_indices(f), f["ids"], (args.batch, max_len))
             for n, f in zip(names, b)}
            for b in batches
        ]  # fmt: skip
    weights = [torch.from_numpy(t) for t in tables]
    torch_ins = [
        [(torch.from_numpy(f["ids"]), torch.from_numpy(f["splits"][:-1].copy())) for f in b]
        for b in batches
    ]
    em.serving_embedding_lookup(ins[0], None, tabs, fcs)  # loads the library
    lib, threads_for = native.library(), kernels.threads_for_entries

    def variant(name):
        threads = 1 if name == "1t" else 2
        hand = name.startswith("hand")
        spin = int(name.split("spin")[1]) if "spin" in name else 0

        def setup():
            L.set_host_threads(threads)
            kernels.threads_for_entries = threads_for if hand else (lambda entries, n: 1)
            lib.EmServingSetPoolSpin(spin)

        def call(b):
            for x in em.serving_embedding_lookup(ins[b], None, tabs, fcs).values():
                x.block_until_ready()

        return setup, call

    def torch_on(threads):
        def call(b):
            with torch.inference_mode():
                for (x, o), w in zip(torch_ins[b], weights):
                    F.embedding_bag(x, w, o, mode="sum")

        return (lambda: torch.set_num_threads(threads)), call

    contenders = {v: variant(v) for v in args.variants.split(",")}
    contenders.update({"torch[2t]": torch_on(2), "torch[1t]": torch_on(1)})
    times: dict = {k: [] for k in contenders}
    for r in range(args.rounds):
        order = list(contenders)
        random.Random(r).shuffle(order)
        for k in order:
            setup, call = contenders[k]
            setup()
            call(0)
            call(1)
            ts = []
            for i in range(args.calls):
                t0 = time.perf_counter()
                call(i % 2)
                ts.append(time.perf_counter() - t0)
            times[k].append(statistics.median(ts))
    kernels.threads_for_entries = threads_for
    print(
        f"{args.kind}/sum dim {args.dim} batch {args.batch}, {args.tables} tables: ms/call "
        + " ".join(f"{k}={statistics.median(v) * 1e3:.3f}" for k, v in times.items())
    )
    for v in args.variants.split(","):
        peer = "torch[1t]" if v == "1t" else "torch[2t]"
        ratio = statistics.median(b / a for a, b in zip(times[v], times[peer]))
        print(f"  {peer} / {v} = {ratio:.3f}")


if __name__ == "__main__":
    main()
