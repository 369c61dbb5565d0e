"""Where the first training step of `train_step.py`'s workload spends its time: one fresh
process per case, reporting the seconds from its start to each phase (import, the chip's
opening, the batches, `build()`, the first lookup, the loss gradient, the first update)
and every program compiled (its name and seconds, from JAX's monitoring events), then
the steady step (median of 12). "fresh" and "cached" share one persistent compilation
cache folder (run "fresh" first); every other case starts with an empty one: "serial"
(the update programs compiled when first called, not in threads at the first lookup),
"threads" (the lookup and update programs compiled at once in threads, then stop),
"effortM1" (XLA's `exec_time_optimization_effort` -1, up to the first update); a case
named `CASE-nofinite` runs CASE with the MXU pair sums' XLA fallback branch (for
non-finite rows) left out of the programs: what that branch costs the compile;
`CASE-nodedupsort`, CASE with one partition's `dedup_sum` taking the host's ascending ids
as they are (no by-sort branch): what that branch costs.

    python benchmarks/tpu_first_step_profile.py --out DIR --cases fresh,cached,serial  # chip
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))


def child(case):
    import jax

    spans = []

    def on_span(event, start, end, **kw):
        spans.append(
            {
                "event": event.rsplit("/", 1)[-1],
                "fun": str(kw.get("fun_name", ""))[:60],
                "s": round(end - start, 3),
                "end": round(time.perf_counter() - T0, 2),
            }
        )

    jax.monitoring.register_event_time_span_listener(on_span)
    hits = []
    jax.monitoring.register_event_listener(
        lambda ev, **kw: hits.append(ev) if "cache_hits" in ev else None
    )
    if case.get("effort") is not None:
        jax.config.update("jax_exec_time_optimization_effort", float(case["effort"]))
    phases = {}

    def mark(name):
        phases[name] = round(time.perf_counter() - T0, 2)

    import embedmesh  # noqa: F401
    from embedmesh.job import steps

    if case["name"] == "serial":  # the update programs compiled when first called
        steps.BACKGROUND_COMPILE = False
    if case.get("patch") == "nofinite":  # experiment: the MXU sums without their XLA fallback
        from embedmesh.device.ops import tpu as tpu_ops

        tpu_ops._finite_or_reference = lambda kernel, *args, **kw: kernel()
    if case.get("patch") == "nodedupsort":  # experiment: one partition's merge without its sort
        import jax.numpy as jnp

        from embedmesh.device import ops
        from embedmesh.device.ops import reference

        def as_is(ids, grads, *, sorted_hint=False):
            if ids.shape[0] != 1:
                return reference.dedup_sum_by_sort(ids, grads, sorted_hint=sorted_hint)
            flat = ids.reshape(-1)
            return flat, jnp.where((flat == reference.PAD_ID)[:, None], 0, grads)

        ops._REFERENCES["dedup_sum"] = as_is
    mark("import")
    sys.path.insert(0, HERE)
    import tpu

    vocab = int(os.environ.get("FIRST_STEP_VOCAB", 1_000_000))
    batches = tpu.make_batches(vocab, tpu.B, 2)
    mark("batches")
    jax.devices()
    mark("devices")
    emb, feats = tpu.step_embedding(64, vocab, batches, "adagrad", False, False, "float32")
    mark("build")
    bsz = tpu.B
    lossgrad = jax.jit(jax.grad(lambda acts: sum(0.5 * (a * a).sum() for a in acts.values()) / bsz))
    csr = emb.enqueue(feats[0])
    mark("enqueue")
    if case["name"] == "threads":
        rec_threads = compile_in_threads(emb, csr)
        mark("threads")
        print("RESULT " + json.dumps({"case": case, "phases": phases, "threads": rec_threads}))
        return
    acts, preserved = emb.dequeue(csr)
    jax.block_until_ready(acts)
    mark("lookup")
    g = lossgrad(acts)
    jax.block_until_ready(g)
    mark("lossgrad")
    emb.apply_gradients(g, preserved)
    jax.block_until_ready(emb.state)
    mark("first_update")
    if case.get("short"):
        print("RESULT " + json.dumps({"case": case, "phases": phases, "compiles": spans}))
        return
    csr2 = emb.enqueue(feats[1])
    acts, preserved = emb.dequeue(csr2)
    emb.apply_gradients(lossgrad(acts), preserved)
    acts, preserved = emb.dequeue(csr)
    jax.block_until_ready(acts)
    mark("second_step")
    steps = []
    for i in range(12):
        t = time.perf_counter()
        emb.apply_gradients(lossgrad(acts), preserved)
        acts, preserved = emb.dequeue(csr if i % 2 else csr2)
        jax.block_until_ready(acts)
        steps.append(time.perf_counter() - t)
    steps.sort()
    rec = {
        "case": case,
        "phases": phases,
        "step_ms": round(1e3 * steps[len(steps) // 2], 2),
        "compiles": [s for s in spans if s["s"] >= 0.05],
        "cache_hits": len(hits),
        "device": str(jax.devices()[0].device_kind),
    }
    if case["name"] == "threads":
        rec["threads"] = rec_threads
    print("RESULT " + json.dumps(rec), flush=True)


def compile_in_threads(emb, csr):
    """Seconds to compile the lookup, the update and the update-then-lookup programs
    each alone in one thread, then all three at once in three threads."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    job = emb.job
    p = job.programs
    st = emb.state
    c = job.placed(csr, "dequeue")
    acts, view = jax.eval_shape(p.lookup, st, c)
    progs = {
        "lookup": (p.lookup, (st, c)),
        "apply": (p.apply, (st, acts, c, view)),
        "apply_lookup": (p.apply_lookup, (st, acts, c, view, c)),
    }

    def comp(name):
        f, a = progs[name]
        t = time.perf_counter()
        f.lower(*a).compile()
        return round(time.perf_counter() - t, 2)

    out = {}
    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(3) as ex:
            futs = {n: ex.submit(comp, n) for n in progs}
            out["each_in_parallel"] = {n: f.result() for n, f in futs.items()}
        out["parallel_wall"] = round(time.perf_counter() - t, 2)
    except Exception as e:  # noqa: BLE001 - the probe's failure is its result
        out["error"] = f"{type(e).__name__}: {e}"[:1500]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="fresh,cached,serial")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    sys.path.insert(0, HERE)
    import tpu

    cache = tempfile.mkdtemp(prefix="embedmesh-first-step-")
    results = []
    for name in args.cases.split(","):
        name, _, patch = name.partition("-")  # threads-nofinite: a case with an experiment
        case = {"name": name, "patch": patch or None}
        if name.startswith("effort"):  # effortM1: exec_time_optimization_effort -1
            case["effort"] = -float(name[len("effortM") :])
            case["short"] = True
        case_cache = cache if name in ("fresh", "cached") and not patch else tempfile.mkdtemp()
        rec = tpu.run_child(__file__, [json.dumps(case)], case_cache, 400, {"case": case})
        results.append(rec)
        print(json.dumps(rec), flush=True)
        tpu.save_json(args.out, "first_step_profile.json", results)


if __name__ == "__main__":
    main()
