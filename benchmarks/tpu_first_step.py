"""The first training step of `train_step.py`'s workload (8 x 1M x 64, batch 4096, Adagrad)
in a fresh process, twice: the first with JAX's persistent compilation cache empty, the
second reading what the first wrote (embedmesh's default cache, pointed at a new
temporary folder through EMBEDMESH_COMPILATION_CACHE). Each child reports the seconds
from its start to `import embedmesh` done, to `build()` done, and to the first step's
update done (enqueue, lookup, the loss gradient, apply_gradients).

    python benchmarks/tpu_first_step.py --out DIR      # on the chip
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


def child():
    import jax

    import embedmesh  # noqa: F401 - its import is the first phase

    t_import = time.perf_counter() - T0
    sys.path.insert(0, HERE)
    import tpu

    batches = tpu.make_batches(1_000_000, tpu.B, 1)
    emb, feats = tpu.step_embedding(64, 1_000_000, batches, "adagrad", False, False, "float32")
    t_build = time.perf_counter() - T0
    bsz = tpu.B
    lossgrad = jax.jit(jax.grad(lambda acts: sum(0.5 * (a * a).sum() for a in acts.values()) / bsz))
    acts, preserved = emb.dequeue(emb.enqueue(feats[0]))
    emb.apply_gradients(lossgrad(acts), preserved)
    jax.block_until_ready(emb.state)
    t_step = time.perf_counter() - T0
    print(
        "RESULT "
        + json.dumps(
            {
                "import_s": round(t_import, 2),
                "build_s": round(t_build, 2),
                "first_step_s": round(t_step, 2),
                "cache": jax.config.jax_compilation_cache_dir,
                "device": str(jax.devices()[0].device_kind),
            }
        ),
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    sys.path.insert(0, HERE)
    import tpu

    cache = tempfile.mkdtemp(prefix="embedmesh-first-step-")
    results = {}
    for name in ("fresh", "cached"):
        rec = tpu.run_child(__file__, [], cache, 600, {})
        results[name] = rec
        print(name, json.dumps(rec), flush=True)
    entries = sum(len(files) for _, _, files in os.walk(cache))
    results["cache_files"] = entries
    tpu.save_json(args.out, "first_step.json", results)


if __name__ == "__main__":
    main()
