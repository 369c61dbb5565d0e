"""Where a training process's memory goes: embedmesh against FBGEMM, phase by phase.

The workload of `train_step.py` (8 tables x --vocab rows x 64, batch 4096, row-wise
Adagrad by default). Each peer runs in its own child process and reports, after each
phase, its RSS and peak RSS (VmHWM), glibc malloc's totals (`mallinfo2`: bytes in use,
bytes free but kept, bytes in mmapped chunks), the live jax arrays (embedmesh), and at
the end of the steps the resident pages by mapping (`/proc/self/smaps`: the libraries'
code, the heap, anonymous memory). No timing: see train_step.py for speed.

    PYTHONPATH=$PWD /tmp/benchenv/bin/python benchmarks/train/train_memory.py --vocab 250000
    ... --vocab 1000          # the runtime alone (tables of 2 MB): the fixed overhead
    ... --optimizer adagrad   # embedmesh's Adagrad (FBGEMM: EXACT_ADAGRAD)
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def snapshot(tag: str, out: list, extra: dict | None = None) -> None:
    import train_step as ts

    hwm, rss = ts.rss_status()
    row = dict(phase=tag, hwm=hwm / MB, rss=rss / MB)
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
        row.update(
            malloc_in_use=m.uordblks / MB, malloc_free=m.fordblks / MB, malloc_mmapped=m.hblkhd / MB
        )
    except (OSError, AttributeError):
        pass
    row.update(extra or {})
    out.append(row)


def smaps_by_mapping(top: int = 8) -> list:
    """[(mapping, resident MB)] largest first: libraries by file name, '[heap]', '[anon]'."""
    agg: collections.Counter = collections.Counter()
    cur = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split(None, 5)
                cur = os.path.basename(parts[5].strip()) if len(parts) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                agg[cur] += int(line.split()[1]) / 1024
    return [(k, round(v, 1)) for k, v in agg.most_common(top)]


def child_embedmesh(args) -> dict:
    import train_step as ts

    out: list = []
    snapshot("start", out)
    batches = ts.make_batches(0)
    snapshot("raw batches", out)
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    snapshot("import jax, CPU backend", out)
    import embedmesh  # noqa: F401
    from embedmesh.device.ops import cpu

    cpu.ready()
    snapshot("import embedmesh, C++ kernels loaded", out)

    def live():
        # a global array and its per-device arrays share buffers: count each buffer once
        seen = {}
        for a in jax.live_arrays():
            for s in a.addressable_shards:
                seen[s.data.unsafe_buffer_pointer()] = s.data.nbytes
        return dict(live_arrays=sum(seen.values()) / MB)

    emb, feats, caps = ts.embedmesh_setup(batches)
    snapshot("build (numba, planner, tables)", out, live())
    lossgrad = jax.jit(jax.grad(lambda acts: ts.loss_of(list(acts.values()))))

    def step(csr):
        acts, pres = emb.dequeue(csr)
        emb.apply_gradients(lossgrad(acts), pres)

    csrs = [emb.enqueue(f) for f in feats]
    snapshot("4 batches enqueued", out, live())
    for i in range(args.warmup):
        step(csrs[i % len(csrs)])
    jax.block_until_ready(emb.state)
    snapshot("warm-up steps (programs compiled)", out, live())
    ts.reset_peak()
    for i in range(args.steps):
        step(csrs[i % len(csrs)])
    snapshot("device steps", out, live())
    maps = smaps_by_mapping()
    ts.reset_peak()
    from embedmesh.inputs import RaggedTensor

    src = (
        {f"f{t}": RaggedTensor.from_row_lengths(*batches[i % len(batches)][t]) for t in range(ts.T)}
        for i in range(args.steps)
    )
    for csr in emb.prefetch(src):
        step(csr)
    jax.block_until_ready(emb.state)
    snapshot("end to end with prefetch", out, live())
    return dict(phases=out, smaps_after_steps=maps)


def child_fbgemm(args) -> dict:
    import train_step as ts

    out: list = []
    snapshot("start", out)
    batches = ts.make_batches(0)
    snapshot("raw batches", out)
    import logging

    logging.disable(logging.WARNING)
    import numpy as np
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    snapshot("import torch, fbgemm_gpu", out)
    optim = getattr(EmbOptimType, ts.FBGEMM_OPTIM[args.optimizer])
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(ts.V, ts.D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * ts.T,
        optimizer=optim,
        learning_rate=ts.LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32,
        device=torch.device("cpu"),
    )
    snapshot("tables + slots", out)

    def host_prep(b):
        ids = torch.from_numpy(np.concatenate([v for v, _ in b]).astype(np.int64))
        lengths = np.concatenate([l for _, l in b])
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return ids, torch.from_numpy(offsets)

    def step(x):
        o = tbe(x[0], x[1])
        (0.5 * (o * o).sum() / ts.B).backward()

    inputs = [host_prep(b) for b in batches]
    snapshot("4 batches prepared", out)
    for i in range(args.warmup):
        step(inputs[i % len(inputs)])
    snapshot("warm-up steps", out)
    ts.reset_peak()
    for i in range(args.steps):
        step(inputs[i % len(inputs)])
    snapshot("device steps", out)
    maps = smaps_by_mapping()
    ts.reset_peak()
    for x in ts.thread_prefetch(host_prep, (batches[i % len(batches)] for i in range(args.steps))):
        step(x)
    snapshot("end to end with prefetch", out)
    return dict(phases=out, smaps_after_steps=maps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=250_000)
    ap.add_argument(
        "--optimizer", default="rowwise_adagrad", choices=("rowwise_adagrad", "adagrad")
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peers", default="embedmesh,fbgemm")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = (child_embedmesh if args.child == "embedmesh" else child_fbgemm)(args)
        print("RESULT " + json.dumps(res), flush=True)
        return
    env = dict(os.environ)
    env["EMBEDMESH_BENCH_VOCAB"] = str(args.vocab)
    env["EMBEDMESH_BENCH_OPTIMIZER"] = args.optimizer
    env["EMBEDMESH_BENCH_SHARDING"] = "auto"
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    results = {}
    for peer in args.peers.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", peer]
        cmd += ["--vocab", str(args.vocab), "--optimizer", args.optimizer]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{peer} failed:\n{(r.stderr or r.stdout)[-1500:]}")
            continue
        results[peer] = res = json.loads(line[7:])
        print(f"\n{peer} ({args.optimizer}, 8 x {args.vocab} x 64), MB:")
        print(
            f"  {'after':38s} {'peak':>7s} {'RSS':>7s} {'malloc used':>11s} "
            f"{'free kept':>9s} {'mmapped':>8s} {'jax arrays':>10s}"
        )
        for p in res["phases"]:
            print(
                f"  {p['phase']:38s} {p['hwm']:7.1f} {p['rss']:7.1f} "
                f"{p.get('malloc_in_use', 0):11.1f} {p.get('malloc_free', 0):9.1f} "
                f"{p.get('malloc_mmapped', 0):8.1f} "
                + (f"{p['live_arrays']:10.1f}" if "live_arrays" in p else f"{'':>10s}")
            )
        print(
            "  resident after the device steps, by mapping: "
            + ", ".join(f"{k} {v}" for k, v in res["smaps_after_steps"])
        )
    if len(results) == 2:
        peak = {p: {r["phase"]: r["hwm"] for r in results[p]["phases"]} for p in results}
        for phase in ("device steps", "end to end with prefetch"):
            e, f = peak["embedmesh"][phase], peak["fbgemm"][phase]
            print(f"peak RSS, {phase}: embedmesh {e:.0f} MB, FBGEMM {f:.0f} MB: {e / f:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
