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
the caches (the kernel's own arithmetic without the memory); `--same-perm`: serving.py's
ids (the same hot rows every batch). `--threads 2`: each call's
bags in two halves of about equal ids, one per thread (the caller and one pool thread;
the kernel releases the GIL), torch on 2 threads, wall clock. `--stride B`: also each
build over a copy of the int8 tables whose rows sit B bytes apart (`name@B`).
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

from embedmesh import _native, _runtime
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


# The calls of a contender's call, in C (`run_one`); on two threads (`--threads 2`,
# `run_pair`) as the package's runner does it: a
# helper thread polls (with `pause`) for up to 300 us after each call, then sleeps; the
# caller runs part 0 while the helper runs part 1. Each part is a list of EmServingBagQ
# calls, 15 int64 words each.
PAIR_SRC = r"""
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
typedef int64_t (*BagQ)(const void*, int64_t, int64_t, int64_t, const void*, int32_t,
                        const int64_t*, int64_t, const float*, int32_t, int32_t, int32_t,
                        float*, int64_t, const int64_t*);
namespace {
struct Job { BagQ fn; const int64_t* w; int64_t n; };
std::atomic<uint64_t> posted{0}, done{0};
Job job;
// never destroyed: the detached helper may wait on them while the process exits
std::mutex& m = *new std::mutex;
std::condition_variable& cv = *new std::condition_variable;
std::once_flag started;
int64_t run_part(BagQ fn, const int64_t* w, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i, w += 15) {
    const int64_t r = fn((const void*)w[0], w[1], w[2], w[3], (const void*)w[4], (int32_t)w[5],
                         (const int64_t*)w[6], w[7], (const float*)w[8], (int32_t)w[9],
                         (int32_t)w[10], (int32_t)w[11], (float*)w[12], w[13],
                         (const int64_t*)w[14]);
    if (r != -1) bad = 1;
  }
  return bad;
}
void helper() {
  uint64_t seen = 0;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    while (posted.load(std::memory_order_acquire) == seen) {
      __builtin_ia32_pause();
      if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(300)) {
        std::unique_lock<std::mutex> lk(m);
        cv.wait(lk, [&] { return posted.load(std::memory_order_acquire) != seen; });
      }
    }
    seen = posted.load(std::memory_order_acquire);
    run_part(job.fn, job.w, job.n);
    done.store(seen, std::memory_order_release);
  }
}
}  // namespace
extern "C" int64_t run_one(void* fn, const int64_t* w, int64_t n) {
  return run_part((BagQ)fn, w, n);
}
extern "C" int64_t run_pair(void* fn, const int64_t* w0, int64_t n0, const int64_t* w1,
                            int64_t n1) {
  std::call_once(started, [] { std::thread(helper).detach(); });
  job = Job{(BagQ)fn, w1, n1};
  uint64_t g;
  {
    std::lock_guard<std::mutex> lk(m);
    g = posted.load() + 1;
    posted.store(g, std::memory_order_release);
  }
  cv.notify_one();
  const int64_t bad = run_part((BagQ)fn, w0, n0);
  while (done.load(std::memory_order_acquire) != g) __builtin_ia32_pause();
  return bad;
}
"""


def _compiled(out_dir: str, name: str, source: str, *flags: str) -> ctypes.CDLL:
    """`source` compiled into `out_dir`/`name`.so and loaded."""
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(out_dir, f"{name}.cc")
    with open(src, "w") as f:
        f.write(source)
    so = os.path.join(out_dir, f"{name}.so")
    cmd = [_native.compiler() or "c++", "-O2", "-shared", "-fPIC", *flags, src, "-o", so]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(so)


def build_pair(out_dir: str) -> ctypes.CDLL:
    lib = _compiled(out_dir, "pair", PAIR_SRC, "-pthread")
    lib.run_pair.restype = lib.run_one.restype = ctypes.c_int64
    lib.run_one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.run_pair.argtypes = lib.run_one.argtypes + [ctypes.c_void_p, ctypes.c_int64]
    return lib


def build_touch(out_dir: str) -> ctypes.CDLL:
    lib = _compiled(out_dir, "touch", TOUCH_SRC)
    for fn, n in (("touch_rows", 4), ("touch_rows_pf", 5)):
        getattr(lib, fn).restype = ctypes.c_int64
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [
            ctypes.c_int64
        ] * (n - 3)
    return lib


def parse_args():
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
    p.add_argument("--threads", type=int, default=1, choices=(1, 2))
    p.add_argument("--fixed-len", type=int, default=0, help="every bag this long (not Poisson)")
    p.add_argument(
        "--same-perm",
        action="store_true",
        help="one rank-to-id permutation a table for every batch (serving.py's workload: "
        "the same hot rows in each batch); else a new one a batch",
    )
    p.add_argument("--stride", type=int, default=0, help="int8 rows this many bytes apart too")
    p.add_argument("--out", default="/tmp/serving_quantized_ab")
    return p.parse_args()


class Workload:
    """The float32 tables and their quantized rows, the batches as (ids, splits) a table
    with their weights (None unweighted), the outputs the builds write, and each batch's
    bags split into `args.threads` parts of about equal ids (table, first bag, bags)."""

    def __init__(self, args):
        self.args = args
        rng = np.random.default_rng(0)
        draw = zipf_draw(rng, args.vocab)
        self.tables, self.qtables = [], []
        for _ in range(args.tables):
            t = rng.standard_normal((args.vocab, args.dim), dtype=np.float32)
            self.tables.append(t)
            self.qtables.append(quantize_table(t, args.dtype))
        perms = (
            [rng.permutation(args.vocab) for _ in range(args.tables)] if args.same_perm else None
        )
        self.batches = []
        for _ in range(args.batches):
            feats = []
            for _t in range(args.tables):
                lengths = rng.poisson(10, args.batch)
                if args.fixed_len:  # every bag as long: the bag loop's exit predictable
                    lengths = np.full(args.batch, args.fixed_len)
                splits = np.zeros(args.batch + 1, np.int64)
                np.cumsum(lengths, out=splits[1:])
                perm = perms[_t] if perms is not None else rng.permutation(args.vocab)
                ids = perm[draw(int(splits[-1]))].astype(np.int64)
                feats.append((ids, splits))
            self.batches.append(feats)
        self.mode = {"sum": 0, "mean": 1}[args.combiner]
        self.weights = [
            [np.full(ids.shape, 0.5, np.float32) if args.weighted else None for ids, _ in b]
            for b in self.batches
        ]
        self.outs = [
            pool.output_empty((args.batch, args.dim), np.float32) for _ in range(args.tables)
        ]
        self.fmt = np.array([FORMAT_CODES[args.dtype], 0], np.int64)
        self.parts: list[list[list]] = []
        for feats in self.batches:
            per: list[list] = [[] for _ in range(args.threads)]
            for t, (_ids, splits) in enumerate(feats):
                cut = (
                    int(np.searchsorted(splits, splits[-1] // 2))
                    if args.threads == 2
                    else args.batch
                )
                per[0].append((t, 0, cut))
                if args.threads == 2:
                    per[1].append((t, cut, args.batch - cut))
            self.parts.append(per)

    def strided(self):
        """With --stride: a copy of the int8 tables whose rows sit `stride` bytes apart."""
        args, strided = self.args, []
        if args.stride:
            for q in self.qtables:
                rows = np.asarray(q.data)
                assert args.stride >= rows.shape[1], "--stride below the row's bytes"
                buf = _runtime.aligned_empty((rows.shape[0], args.stride), np.uint8, 64)
                buf[:, : rows.shape[1]] = rows  # rows on 64-byte lines where 64 % stride == 0
                buf[:, rows.shape[1] :] = 0
                strided.append(buf[:, : rows.shape[1]])
        return strided


class EmCalls:
    """A build's EmServingBagQ over one batch, its calls' words made once and run by the
    C loop (`pair`: one thread, or two with --threads 2)."""

    def __init__(self, work: Workload, pair):
        self.work, self.pair = work, pair
        self.calls: dict = {}  # (lib name, data name, batch) -> the parts' words

    def part_words(self, lib, b, part, data):
        """The EmServingBagQ calls of one part, 15 int64 words each."""
        work, args = self.work, self.work.args
        words = []
        for t, lo, count in part:
            ids, splits = work.batches[b][t]
            q = data[t]
            w = work.weights[b][t]
            words += [
                q.ctypes.data,
                args.vocab,
                args.dim,
                q.strides[0],
                ids.ctypes.data,
                1,
                splits.ctypes.data + 8 * lo,
                count,
                0 if w is None else w.ctypes.data,
                work.mode,
                0,
                0,
                work.outs[t].ctypes.data + 4 * args.dim * lo,
                args.dim,
                work.fmt.ctypes.data,
            ]
        return np.array(words, np.int64)

    def __call__(self, lib, b, data=None):
        key = (id(lib), data is None, b)
        if key not in self.calls:
            d = data or [q.data for q in self.work.qtables]
            self.calls[key] = [self.part_words(lib, b, part, d) for part in self.work.parts[b]]
        words = self.calls[key]
        fn = ctypes.cast(lib.EmServingBagQ, ctypes.c_void_p).value
        if len(words) == 1:
            assert self.pair.run_one(fn, words[0].ctypes.data, words[0].size // 15) == 0
            return
        r = self.pair.run_pair(fn, words[0].ctypes.data, words[0].size // 15,
                               words[1].ctypes.data, words[1].size // 15)  # fmt: skip
        assert r == 0, r


class TorchPeers:
    """torch's float32 `embedding_bag` and its 8-bit op over the same batches, and the
    8-bit op's sums of the decoded rows as the builds' reference."""

    def __init__(self, work: Workload, torch):
        import torch.nn.functional as F

        self.work, self.torch, self.F = work, torch, F
        self.tw = [torch.from_numpy(t) for t in work.tables]
        self.qw = [torch.from_numpy(np.asarray(q.data)) for q in work.qtables]
        self.tin = [
            [(torch.from_numpy(ids), torch.from_numpy(sp[:-1].copy())) for ids, sp in b]
            for b in work.batches
        ]
        self.twt = [[None if w is None else torch.from_numpy(w) for w in b] for b in work.weights]

    def f32(self, b):
        with self.torch.inference_mode():
            return [
                self.F.embedding_bag(x, w, o, mode=self.work.args.combiner, per_sample_weights=pw)
                for (x, o), w, pw in zip(self.tin[b], self.tw, self.twt[b])
            ]

    def q8(self, b):
        torch = self.torch
        with torch.inference_mode():
            return [
                torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                    w, x, o, False, self.work.mode, False, pw, None, False
                )
                for (x, o), w, pw in zip(self.tin[b], self.qw, self.twt[b])
            ]

    def reference(self):
        """Batch 0's sums a table (int8 rows; None for fp16): torch-q8's sums of the decoded
        rows (its mean mode is not TF's: a mean is the sum over the bag's count, or its
        weights' sum)."""
        work = self.work

        def one(x, o, w, pw, sp, wt):
            got = self.torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                w, x, o, False, 0, False, pw, None, False
            ).numpy()
            if work.args.combiner == "mean":
                each = np.ones(sp[-1], np.float64) if wt is None else wt.astype(np.float64)
                total = np.add.reduceat(np.append(each, 0.0), sp[:-1]) * (np.diff(sp) > 0)
                got = got / np.where(total == 0, 1.0, total)[:, None]
            return got

        return [
            one(x, o, w, pw, sp, wt) if work.args.dtype == "int8" else None
            for (x, o), w, pw, (_, sp), wt in zip(
                self.tin[0], self.qw, self.twt[0], work.batches[0], work.weights[0]
            )
        ]


def touch_contender(work: Workload):
    """`touch`: one byte of each entry's row summed, prefetched (no decode)."""
    tl = build_touch(work.args.out)

    def touch_call(b):
        for t, (ids, _) in enumerate(work.batches[b]):
            q = work.qtables[t].data
            tl.touch_rows_pf(q.ctypes.data, q.strides[0], ids.ctypes.data, ids.size, 32)

    return touch_call


def api_contender(work: Workload):
    """`api`: serving_embedding_lookup on the same quantized tables, one thread."""
    import embedmesh as em
    from embedmesh import serving as em_serving

    args = work.args
    em_serving.set_host_threads(1)
    tcs = [em.TableConfig(args.vocab, args.dim, combiner=args.combiner) for _ in work.qtables]
    fcs = {f"f{i}": em.FeatureConfig(tc, name=f"f{i}") for i, tc in enumerate(tcs)}
    tabs = dict(zip(tcs, work.qtables))
    api_in = [
        {
            f"f{i}": em.RaggedTensor(ids, sp)
            if w is None
            else em.RaggedTensor(ids, sp)  # weights: not through the api here
            for i, ((ids, sp), w) in enumerate(zip(b, wb))
        }
        for b, wb in zip(work.batches, work.weights)
    ]

    def api_call(b):
        out = em.serving_embedding_lookup(api_in[b], None, tabs, fcs)
        for v in out.values():
            v.block_until_ready()

    return api_call


def check_builds(work: Workload, libs, em_call, strided, ref):
    """Every build (and its strided run) on batch 0 against `ref`, once."""
    for lib in libs.values():
        for data in [None] + ([strided] if strided else []):
            for o in work.outs:
                o[:] = np.nan
            em_call(lib, 0, data)
            for i, want in enumerate(ref):
                if want is not None:
                    np.testing.assert_allclose(work.outs[i], want, rtol=1e-4, atol=1e-4)


def report(args, work: Workload, contenders, per_call):
    """Each contender's time a call and its speed over torch f32's, per round."""
    ratios = {
        n: [t / s for t, s in zip(per_call["torch"], per_call[n])]
        for n in contenders
        if n != "torch"
    }
    nids = sum(f[0].size for f in work.batches[0])
    print(
        f"dim {args.dim} {args.dtype} ragged/{args.combiner}{' weighted' if args.weighted else ''}"
        f", {args.tables} x {args.vocab}, {nids} ids a call, {args.rounds} rounds, "
        f"{args.threads} thread(s), {'thread' if args.threads == 1 else 'wall'} clock, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"  torch[{args.threads}t]  {statistics.median(per_call['torch']) * 1e3:7.3f} ms/call")
    for n in ratios:
        r = ratios[n]
        print(
            f"  {n:10s} {statistics.median(per_call[n]) * 1e3:7.3f} ms/call  "
            f"speed / torch f32 {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})"
        )


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    pair = build_pair(args.out)  # the calls' loop in C (and the two threads)
    libs = build_variants(args.variant, args.out)
    work = Workload(args)
    peers = TorchPeers(work, torch)
    strided = work.strided()
    em_call = EmCalls(work, pair)

    contenders = {"torch": peers.f32}
    if args.dtype == "int8" and not args.no_q8:
        contenders["torch-q8"] = peers.q8
    if args.touch:
        contenders["touch"] = touch_contender(work)
    if args.api:
        contenders["api"] = api_contender(work)
    contenders |= {n: (lambda b, lib=lib: em_call(lib, b)) for n, lib in libs.items()}
    if strided:
        contenders |= {
            f"{n}@{args.stride}": (lambda b, lib=lib: em_call(lib, b, strided))
            for n, lib in libs.items()
        }
    check_builds(work, libs, em_call, strided, peers.reference())
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    per_call = interleaved_rounds(contenders, args.rounds, args.batches, clock)
    report(args, work, contenders, per_call)


if __name__ == "__main__":
    main()
