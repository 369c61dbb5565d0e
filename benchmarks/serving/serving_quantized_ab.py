"""The quantized serving bag kernel alone (`EmServingBagQ`, int8 or fp16 rows), several
builds of it against torch's float32 `embedding_bag` and torch's own 8-bit op.

serving_kernel_ab.py's workload and rounds (tables x vocab x dim, batch 4096, Poisson(10)
lengths, Zipf(1.05) ids, ragged input, 1 thread each, the calling thread's CPU time, a
shuffled order per round, medians of per-round ratios): torch[1t] is
`F.embedding_bag(ids, table, offsets)` on the float32 tables, torch-q8[1t]
`torch.ops.quantized.embedding_bag_byte_rowwise_offsets` on the int8 rows (FBGEMM's fused
8-bit row-wise layout, the same bytes the embedmesh builds read). Each variant is one
build of the serving library with `serving_quantized.cc` (or `serving.cc`) replaced by
another file and/or `-D` macros:

    PYTHONPATH=. python benchmarks/serving/serving_quantized_ab.py --dim 16 \\
        --variant base= --variant x=/tmp/serving_quantized.cc:-DFOO

`--touch` adds `touch`: one byte of each entry's row summed (the same walk of ids, no
decode, no prefetch): what reading the rows alone costs. `--vocab` small: the tables in
the caches (the kernel's own arithmetic without the memory).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from serving_kernel_ab import build_variants, interleaved_rounds, workload_parser, zipf_draw

from embedmesh import _native
from embedmesh.serving import pool
from embedmesh.serving.quantized import FORMAT_CODES, quantize_table

TOUCH_SRC = r"""
#include <cstdint>
extern "C" int64_t touch_rows(const uint8_t* table, int64_t stride, const int64_t* ids,
                              int64_t n) {
  int64_t s = 0;
  for (int64_t k = 0; k < n; ++k) s += table[ids[k] * stride];
  return s;
}
extern "C" int64_t touch_rows_pf(const uint8_t* table, int64_t stride, const int64_t* ids,
                                 int64_t n, int64_t ahead) {
  int64_t s = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t j = k + ahead < n ? k + ahead : n - 1;
    const uint8_t* p = table + ids[j] * stride;
    asm volatile("prefetcht0 %0" : : "m"(*p));
    asm volatile("prefetcht0 %0" : : "m"(*(p + stride - 1)));
    s += table[ids[k] * stride];
  }
  return s;
}
"""


def build_touch(out_dir: str) -> ctypes.CDLL:
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(out_dir, "touch.cc")
    with open(src, "w") as f:
        f.write(TOUCH_SRC)
    so = os.path.join(out_dir, "touch.so")
    subprocess.run(
        [_native.compiler() or "c++", "-O2", "-shared", "-fPIC", src, "-o", so], check=True
    )
    lib = ctypes.CDLL(so)
    for fn, n in (("touch_rows", 4), ("touch_rows_pf", 5)):
        getattr(lib, fn).restype = ctypes.c_int64
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [
            ctypes.c_int64
        ] * (n - 3)
    return lib


def main() -> None:
    p = workload_parser(dim=16)
    p.add_argument("--dtype", default="int8", choices=("int8", "fp16"))
    p.add_argument("--weighted", action="store_true", help="per-id weights (all 0.5)")
    p.add_argument("--touch", action="store_true")
    p.add_argument("--no-q8", action="store_true", help="leave torch-q8 out")
    p.add_argument(
        "--api",
        action="store_true",
        help="add api: serving_embedding_lookup on the same quantized tables (1 thread, "
        "the package's own build), as serving.py's embedmesh[native:int8]",
    )
    p.add_argument("--out", default="/tmp/serving_quantized_ab")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    libs = build_variants(args.variant, args.out)
    rng = np.random.default_rng(0)
    draw = zipf_draw(rng, args.vocab)
    tables, qtables = [], []
    for _ in range(args.tables):
        t = rng.standard_normal((args.vocab, args.dim), dtype=np.float32)
        tables.append(t)
        qtables.append(quantize_table(t, args.dtype))
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
    mode = {"sum": 0, "mean": 1}[args.combiner]
    weights = [
        [np.full(ids.shape, 0.5, np.float32) if args.weighted else None for ids, _ in b]
        for b in batches
    ]
    outs = [pool.output_empty((args.batch, args.dim), np.float32) for _ in range(args.tables)]
    fmt = np.array([FORMAT_CODES[args.dtype], 0], np.int64)
    tw = [torch.from_numpy(t) for t in tables]
    qw = [torch.from_numpy(np.asarray(q.data)) for q in qtables]
    tin = [
        [(torch.from_numpy(ids), torch.from_numpy(sp[:-1].copy())) for ids, sp in b]
        for b in batches
    ]
    twt = [[None if w is None else torch.from_numpy(w) for w in b] for b in weights]

    def em_call(lib, b):
        for t, (ids, splits) in enumerate(batches[b]):
            q = qtables[t].data
            w = weights[b][t]
            r = lib.EmServingBagQ(
                q.ctypes.data,
                args.vocab,
                args.dim,
                q.strides[0],
                ids.ctypes.data,
                1,
                splits.ctypes.data,
                args.batch,
                None if w is None else w.ctypes.data,
                mode,
                0,
                0,
                outs[t].ctypes.data,
                args.dim,
                fmt.ctypes.data,
            )  # fmt: ignore
            assert r == -1, r

    def torch_call(b):
        with torch.inference_mode():
            return [
                F.embedding_bag(x, w, o, mode=args.combiner, per_sample_weights=pw)
                for (x, o), w, pw in zip(tin[b], tw, twt[b])
            ]

    def q8_call(b):
        with torch.inference_mode():
            return [
                torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                    w, x, o, False, mode, False, pw, None, False
                )
                for (x, o), w, pw in zip(tin[b], qw, twt[b])
            ]

    contenders = {"torch": torch_call}
    if args.dtype == "int8" and not args.no_q8:
        contenders["torch-q8"] = q8_call
    if args.touch:
        tl = build_touch(args.out)

        def touch_call(b):
            for t, (ids, _) in enumerate(batches[b]):
                q = qtables[t].data
                tl.touch_rows_pf(q.ctypes.data, q.strides[0], ids.ctypes.data, ids.size, 32)

        contenders["touch"] = touch_call
    if args.api:
        import embedmesh as em
        from embedmesh import serving as em_serving

        em_serving.set_host_threads(1)
        tcs = [em.TableConfig(args.vocab, args.dim, combiner=args.combiner) for _ in qtables]
        fcs = {f"f{i}": em.FeatureConfig(tc, name=f"f{i}") for i, tc in enumerate(tcs)}
        tabs = dict(zip(tcs, qtables))
        api_in = [
            {
                f"f{i}": em.RaggedTensor(ids, sp)
                if w is None
                else em.RaggedTensor(ids, sp)  # weights: not through the api here
                for i, ((ids, sp), w) in enumerate(zip(b, wb))
            }
            for b, wb in zip(batches, weights)
        ]

        def api_call(b):
            out = em.serving_embedding_lookup(api_in[b], None, tabs, fcs)
            for v in out.values():
                v.block_until_ready()

        contenders["api"] = api_call
    contenders |= {n: (lambda b, lib=lib: em_call(lib, b)) for n, lib in libs.items()}

    # correctness, once: every build against the float64 sums of the decoded rows
    ref = [
        torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
            w, x, o, False, mode, False, pw, None, False
        ).numpy()
        if args.dtype == "int8"
        else None
        for (x, o), w, pw in zip(tin[0], qw, twt[0])
    ]
    for lib in libs.values():
        em_call(lib, 0)
        for i, want in enumerate(ref):
            if want is not None:
                np.testing.assert_allclose(outs[i], want, rtol=1e-4, atol=1e-4)
    per_call = interleaved_rounds(contenders, args.rounds, args.batches, time.thread_time)
    ratios = {
        n: [t / s for t, s in zip(per_call["torch"], per_call[n])]
        for n in contenders
        if n != "torch"
    }
    nids = sum(f[0].size for f in batches[0])
    print(
        f"dim {args.dim} {args.dtype} ragged/{args.combiner}{' weighted' if args.weighted else ''}"
        f", {args.tables} x {args.vocab}, {nids} ids a call, {args.rounds} rounds, thread "
        f"clock, load {os.getloadavg()[0]:.1f}"
    )
    print(f"  torch[1t]  {statistics.median(per_call['torch']) * 1e3:7.3f} ms/call")
    for n in ratios:
        r = ratios[n]
        print(
            f"  {n:10s} {statistics.median(per_call[n]) * 1e3:7.3f} ms/call  "
            f"speed / torch f32 {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})"
        )


if __name__ == "__main__":
    main()
