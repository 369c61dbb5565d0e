"""What the first lookup's compile costs on the chip, by variant: one fresh process per
variant (JAX's persistent cache off), `train_step.py`'s workload (`tpu.py`'s step at dim
64), the lookup program lowered and compiled alone, its XLA backend compile seconds
reported with the count of Mosaic kernels in its optimized HLO.

Variants (`--variants`, comma-separated): `default`; `xla` (the TPU kernels off: XLA's
ops); `unrollN` (`pallas.UNROLL = N`); `tpN` (`pallas.TP = N` pairs a block);
`nofinite` (the MXU sums without their XLA fallback branch for non-finite rows).
With `--trace`, each compile runs under JAX's profiler and the events it records (the
compiler's passes) are summed by name.

    python benchmarks/tpu_compile_probe.py --out DIR --variants default,xla,unroll1  # chip
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(variant: str) -> dict:
    import jax

    from embedmesh.device.ops import tpu as tpu_ops
    from embedmesh.device.ops.tpu import pallas

    if variant == "xla":
        tpu_ops.ENABLED = False
    elif variant.startswith("unroll"):
        pallas.UNROLL = int(variant[len("unroll") :])
    elif variant.startswith("tp"):
        pallas.TP = int(variant[len("tp") :])
    elif variant == "nofinite":
        tpu_ops._finite_or_reference = lambda kernel, *args, **kw: kernel()
    sys.path.insert(0, HERE)
    import tpu

    vocab = int(os.environ.get("PROBE_VOCAB", 1_000_000))
    batches = tpu.make_batches(vocab, tpu.B, 1)
    emb, feats = tpu.step_embedding(64, vocab, batches, "adagrad", False, False, "float32")
    job = emb.job
    c = job.placed(emb.enqueue(feats[0]), "dequeue")
    t = time.perf_counter()
    lowered = job.programs.lookup.lower(emb.state, c)
    lower_s = time.perf_counter() - t
    trace_dir = os.environ.get("PROBE_TRACE")
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    top = stop_and_summarise(trace_dir) if trace_dir else None
    hlo = compiled.as_text()
    if os.environ.get("PROBE_HLO_DIR"):  # the optimized HLO, to read
        with open(os.path.join(os.environ["PROBE_HLO_DIR"], f"{variant}.hlo.txt"), "w") as f:
            f.write(hlo)
    return {
        "variant": variant,
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
        "mosaic_calls": hlo.count('custom_call_target="tpu_custom_call"'),
        "hlo_lines": hlo.count("\n"),
        "sorts": hlo.count(" sort("),
        "conditionals": hlo.count(" conditional("),
        "device": str(jax.devices()[0].device_kind),
        "trace_top": top,
    }


def stop_and_summarise(trace_dir: str, top: int = 70) -> list:
    """The profiler's events during the compile, summed by name (seconds), largest first:
    XLA's and the TPU compiler's own annotations of their passes."""
    import glob

    import jax
    from jax._src.profiler import ProfileData

    jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    totals: dict = {}
    data = ProfileData.from_file(paths[-1])
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                key = f"{plane.name[:20]}|{ev.name[:80]}"
                totals[key] = totals.get(key, 0.0) + ev.duration_ns / 1e9
    return sorted(((round(v, 3), k) for k, v in totals.items()), reverse=True)[:top]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="default,xla,unroll1,nofinite")
    ap.add_argument("--trace", action="store_true", help="profile each compile")
    ap.add_argument("--hlo", action="store_true", help="write each optimized HLO to --out")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return
    sys.path.insert(0, HERE)
    import tpu

    results = []
    for variant in args.variants.split(","):
        extra_env = {}
        if args.hlo and args.out:
            os.makedirs(args.out, exist_ok=True)
            extra_env["PROBE_HLO_DIR"] = os.path.abspath(args.out)
        if args.trace:
            extra_env["PROBE_TRACE"] = tempfile.mkdtemp(prefix=f"probe-{variant}-")
        rec = tpu.run_child(__file__, [variant], "0", 300, {"variant": variant}, extra_env)
        results.append(rec)
        print(json.dumps(rec), flush=True)
        tpu.save_json(args.out, "compile_probe.json", results)


if __name__ == "__main__":
    main()
