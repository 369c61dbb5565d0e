"""The serving bag kernel alone, several builds of it against torch's `embedding_bag`.

Same process, same arrays: benchmarks/serving/serving.py's workload (tables x vocab x dim float32,
batch 4096, Poisson(10) lengths, Zipf(1.05) ids, `--batches` batches), ragged input
(ids + offsets, which is what both kernels take), 1 thread each. Each contender is one
build of `embedmesh/serving/cpu/serving.cc` (or another source), compiled here with the
package's flags plus the variant's `-D` macros, called through ctypes
(`EmServingBagF32`) on preallocated
outputs; torch[1t] is `F.embedding_bag(ids, table, offsets, mode=...)` per table.
Rounds: every contender runs one pass over the batches in a shuffled order; the ratio
torch time / contender time is taken per round; the medians over rounds are printed
(with the range). Table rows are filled with (row % 97) / 100 (the kernels' speed does not depend
on the values; builds fast).

    PYTHONPATH=. python benchmarks/serving/serving_kernel_ab.py --dim 64 \\
        --variant base= --variant pf16=-DEM_PF_ENTRIES=16 [--variant x=/tmp/x.cc:-DFOO]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from embedmesh import _native
from embedmesh.serving import native, pool

SRC = os.path.join(os.path.dirname(os.path.abspath(native.__file__)), "cpu", "serving.cc")


def build(name: str, spec: str, out_dir: str) -> ctypes.CDLL:
    """`[path.cc]:-DA -DB[@prefetch,row_lines]` or `-DA -DB`: the serving library, with the
    folder's file of path's name (e.g. serving.cc) replaced by path, built with the flags
    -> the loaded library (its own copy: its prefetch settings are its own)."""
    spec, _, runtime = spec.partition("@")
    src, defs = None, spec
    if spec.split(":")[0].endswith(".cc"):
        src, _, defs = spec.partition(":")
    flags = [*_native.FLAGS, *_native.variant_flags(_native.selected_variant()), *defs.split()]
    inc = os.path.dirname(SRC)
    # one translation unit of the folder's sources, as the package builds them
    # (serving_quantized.cc uses serving.cc's vector types)
    sources = [os.path.join(inc, f) for f in sorted(os.listdir(inc)) if f.endswith(".cc")]
    if src:
        sources = [src if os.path.basename(f) == os.path.basename(src) else f for f in sources]
    text = "".join(open(f).read() for f in sources)
    key = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
    built = os.path.join(out_dir, f"{key}.so")
    if not os.path.exists(built):
        os.makedirs(out_dir, exist_ok=True)
        unity = os.path.join(out_dir, f"{key}.cc")
        with open(unity, "w") as f:
            f.write("".join(f'#include "{os.path.abspath(s)}"\n' for s in sources))
        cmd = [_native.compiler() or "c++", *flags, f"-I{inc}", unity, "-o", built + ".tmp"]
        subprocess.run(cmd, check=True)
        os.replace(built + ".tmp", built)
    so = os.path.join(out_dir, f"{name}-{key}.so")
    shutil.copyfile(built, so)
    lib = native.declare(ctypes.CDLL(so))
    if runtime:
        pf, _, rl = runtime.partition(",")
        lib.EmServingSetPrefetch(int(pf))
        if rl:
            lib.EmServingSetRowLines(int(rl))
    return lib


def build_variants(variants: list[str], out_dir: str) -> dict:
    """`name=spec` each (`build`'s specs; none: the package's source as "base") -> the
    loaded libraries by name."""
    libs = {}
    for v in variants or ["base="]:
        name, _, spec = v.partition("=")
        libs[name] = build(name, spec, out_dir)
    return libs


def zipf_draw(rng, vocab: int):
    """`draw(n)`: n ids of [0, vocab) from Zipf(1.05) by rank, from `rng`."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.05)
    cdf /= cdf[-1]

    def draw(n):
        return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), vocab - 1)

    return draw


def interleaved_rounds(contenders: dict, rounds: int, batches: int, clock) -> dict:
    """Each contender's time a call (`contenders[name](batch)`) in each of `rounds`
    rounds after a warm-up round; within a round the batches run in turn and the
    contenders in a shuffled order for each batch (seeded)."""
    per_call: dict[str, list[float]] = {n: [] for n in contenders}
    for rnd in range(rounds + 1):
        spent = dict.fromkeys(contenders, 0.0)
        for b in range(batches):
            order = list(contenders)
            np.random.default_rng(rnd * 1000 + b).shuffle(order)
            for n in order:
                t0 = clock()
                contenders[n](b)
                spent[n] += clock() - t0
        if rnd:  # round 0 warms up
            for n in contenders:
                per_call[n].append(spent[n] / batches)
    return per_call


def workload_parser(dim: int) -> argparse.ArgumentParser:
    """The options the kernel A/B scripts share: the tables, the batches, the rounds and
    the variants (`--variant name=spec`, specs as `build` takes them)."""
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--combiner", default="sum")
    p.add_argument("--variant", action="append", default=[], help="name=spec")
    return p


def main() -> None:
    p = workload_parser(dim=64)
    p.add_argument("--out", default="/tmp/serving_kernel_ab")
    p.add_argument(
        "--clock",
        default="thread",
        choices=("thread", "wall"),
        help="thread: the calling thread's CPU time (both kernels run on it with 1 thread; "
        "time spent descheduled by other processes is left out), wall: perf_counter",
    )
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    libs = build_variants(args.variant, args.out)
    rng = np.random.default_rng(0)
    draw = zipf_draw(rng, args.vocab)
    tables = []
    for _ in range(args.tables):
        t = np.empty((args.vocab, args.dim), np.float32)
        t[:] = (np.arange(args.vocab, dtype=np.float32) % 97 * 0.01)[:, None]
        tables.append(t)
    batches = []
    for _ in range(args.batches):
        feats = []
        for _t in range(args.tables):
            lengths = rng.poisson(10, args.batch)
            splits = np.zeros(args.batch + 1, np.int64)
            np.cumsum(lengths, out=splits[1:])
            ids = rng.permutation(args.vocab)[draw(int(splits[-1]))].astype(np.int64)
            feats.append((ids, splits))
        batches.append(feats)
    mode = {"sum": 0, "mean": 1, "sqrtn": 2}[args.combiner]
    outs = [pool.output_empty((args.batch, args.dim), np.float32) for _ in range(args.tables)]
    tw = [torch.from_numpy(t) for t in tables]
    tin = [
        [(torch.from_numpy(ids), torch.from_numpy(sp[:-1].copy())) for ids, sp in b]
        for b in batches
    ]

    def em_call(lib, b):
        for t, (ids, splits) in enumerate(batches[b]):
            table = (tables[t].ctypes.data, args.vocab, args.dim, args.dim, ids.ctypes.data, 1)
            rest = (None, mode, 0, 0, outs[t].ctypes.data, args.dim)  # no weights, no pruning
            r = lib.EmServingBagF32(*table, splits.ctypes.data, args.batch, *rest)
            assert r == -1, r

    def torch_call(b):
        with torch.inference_mode():
            return [F.embedding_bag(x, w, o, mode=args.combiner) for (x, o), w in zip(tin[b], tw)]

    # correctness, once
    for lib in libs.values():
        em_call(lib, 0)
        ref = torch_call(0)
        for t in range(args.tables):
            np.testing.assert_allclose(outs[t], ref[t].numpy(), rtol=1e-5, atol=1e-5)
    contenders = {"torch": torch_call} | {
        n: (lambda b, lib=lib: em_call(lib, b)) for n, lib in libs.items()
    }
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    per_call = interleaved_rounds(contenders, args.rounds, args.batches, clock)
    ratios = {n: [t / s for t, s in zip(per_call["torch"], per_call[n])] for n in libs}
    nids = sum(f[0].size for f in batches[0])
    print(
        f"dim {args.dim} ragged/{args.combiner}, {args.tables} x {args.vocab}, "
        f"{nids} ids a call, {args.rounds} rounds, {args.clock} clock, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"  torch[1t]  {statistics.median(per_call['torch']) * 1e3:7.2f} ms/call")
    for n in libs:
        r = ratios[n]
        print(
            f"  {n:10s} {statistics.median(per_call[n]) * 1e3:7.2f} ms/call  "
            f"speed / torch {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})"
        )


if __name__ == "__main__":
    main()
