"""What sparse input costs over ragged input: the lookup's extra time against reading its indices.

A 2-D SparseTensor request carries its bags as COO indices, 16 bytes an id (int64 row and
column), which the lookup must read to find (and check) the bags: 5.2 MB a call on
benchmarks/serving/serving.py's workload, where ragged row_splits are 33 KB a feature. torch's
`embedding_bag` handed the bag offsets for free (serving.py's `torch` contender for
sparse input) reads none of it. This runs, in one process, 1 thread, interleaved call
by call in a shuffled order (medians over rounds of the per-round medians):

- `sparse`: `serving_embedding_lookup` on the SparseTensor request;
- `ragged`: the same ids as a RaggedTensor request;
- `offsets pass`: `kernels.sparse_offsets` on the 8 features' indices (the pass alone,
  from Python: ~5-10 us a feature of call overhead included);
- `read indices`: numpy's sum over the same int64 indices (a plain read of the bytes);
- `torch[1t]` (when importable): `embedding_bag` given the offsets, as serving.py runs it.

    PYTHONPATH=. python benchmarks/serving/serving_sparse_bound.py [--dims 16,64] [--rounds 9]
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

import serving as bench

import embedmesh as em
from embedmesh import serving as em_serving
from embedmesh.serving import kernels

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="16,64")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=8, help="timed calls per contender per round")
    bench.each_dim(p.parse_args(), run_dim)


def run_dim(args, dim: int) -> None:
    w = bench.workload_at(dim, combiner="sum")
    tables, batches, names, tabs, fcs = w.tables, w.batches, w.names, w.by_config, w.features
    shape = (batches[0][0]["lengths"].size, w.max_len)  # [batch, longest bag]
    indices = [[bench.sparse_indices(f) for f in feats] for feats in batches]
    sparse = [
        {n: em.SparseTensor(ix, f["ids"], shape) for n, f, ix in zip(names, feats, ixs)}
        for feats, ixs in zip(batches, indices)
    ]
    ragged = [
        {n: em.RaggedTensor(f["ids"], f["splits"]) for n, f in zip(names, feats)}
        for feats in batches
    ]

    def lookup(requests):
        def call(i):
            em_serving.set_host_threads(1)
            out = em.serving_embedding_lookup(requests[i % 2], None, tabs, fcs)
            for v in out.values():
                v.block_until_ready()

        return call

    def offsets_pass(i):
        for ix in indices[i % 2]:
            kernels.sparse_offsets(ix, shape)

    def read_indices(i):
        for ix in indices[i % 2]:
            ix.sum()

    contenders = {
        "sparse": lookup(sparse),
        "ragged": lookup(ragged),
        "offsets pass": offsets_pass,
        "read indices": read_indices,
    }
    if torch is not None:
        weights = [torch.from_numpy(t) for t in tables]
        ins = [
            [(torch.from_numpy(f["ids"]), torch.from_numpy(f["splits"][:-1].copy())) for f in fs]
            for fs in batches
        ]

        def torch_call(i):
            torch.set_num_threads(1)
            with torch.inference_mode():
                for (x, o), w in zip(ins[i % 2], weights):
                    F.embedding_bag(x, w, o, mode="sum")

        contenders["torch[1t]"] = torch_call
    for fn in contenders.values():  # warm: pools, pages, code
        fn(0)
        fn(1)
    per_round: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        times: dict[str, list[float]] = {k: [] for k in contenders}
        order = list(contenders)
        shuffle = random.Random(r)
        for i in range(args.calls):
            shuffle.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                contenders[name](i)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            per_round[name].append(statistics.median(ts))
    med = {k: statistics.median(v) for k, v in per_round.items()}
    extra = statistics.median(a - b for a, b in zip(per_round["sparse"], per_round["ragged"]))
    mb = sum(ix.nbytes for ix in indices[0]) / 1e6
    print(f"\n== dim {dim}, sum, 1 thread: {mb:.1f} MB of indices a call")
    for name, t in med.items():
        print(f"  {name:14s} {t * 1e3:7.3f} ms")
    print(
        f"  sparse - ragged {extra * 1e3:7.3f} ms; reading the indices "
        f"{med['read indices'] * 1e3:.3f} ms ({mb / med['read indices'] / 1e3:.1f} GB/s)"
    )


if __name__ == "__main__":
    main()
