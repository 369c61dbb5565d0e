"""Cold start: the Training guide's first block (docs/training.md) up to the first lookup's result,
in a fresh process with empty caches (`EMBEDMESH_CACHE_DIR` and `NUMBA_CACHE_DIR` new temporary
folders), as a user runs it right after `pip install`. Phases: `import embedmesh`,
`MeshEmbedding(...).build()`, the first lookup (host preprocessing, numba compiling its kernels
at first use where it runs, XLA compiling the program, the C++ kernels loaded), and the first
update. Interleaved rounds of: empty caches (preprocessing on its C++ kernels, the default:
no numba imported); `EMBEDMESH_PREPROCESS_NATIVE=0` (numba's kernels) with numba's cache
empty, then warm (what numba's compile costs); `EMBEDMESH_NUMBA=0` (no numba at all).

    python benchmarks/train/cold_start.py --rounds 3    # the interpreter whose embedmesh to time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
import embedmesh as em
t1 = time.perf_counter()
video = em.TableConfig(vocabulary_size=1000, dim=16, combiner="mean", name="video")
user = em.TableConfig(vocabulary_size=100, dim=16, combiner="sum", name="user")
features = {"watched": em.FeatureConfig(video), "user": em.FeatureConfig(user)}
emb = em.MeshEmbedding(features, optimizer=em.Adagrad(learning_rate=0.1))
emb.build()
t2 = time.perf_counter()
batch = {"watched": em.RaggedTensor.from_row_lengths(np.arange(24) % 1000, [3] * 8),
         "user": np.arange(8)}
activations, preserved = emb(batch)
jax.block_until_ready(activations)
t3 = time.perf_counter()
grads = jax.tree_util.tree_map(jnp.ones_like, activations)
emb.apply_gradients(grads, preserved)
jax.block_until_ready(emb.embedding_tables)
t4 = time.perf_counter()
from embedmesh.device.ops import cpu
print(json.dumps({"import": t1 - t0, "build": t2 - t1, "first_lookup": t3 - t2,
                  "to_lookup": t3 - t0, "to_update": t4 - t0, "library": cpu.library_path(),
                  "numba": any(m.split(".")[0] == "numba" for m in sys.modules)}))
"""


def child(env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    if out.stderr.strip():
        print("  stderr:", out.stderr.strip()[-500:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"{sys.executable}; load average at start {os.getloadavg()}")
    keys = ("import", "build", "first_lookup", "to_lookup", "to_update")
    results: dict[str, list[dict]] = {
        "cold": [],
        "numba cold": [],
        "numba warm": [],
        "numba off": [],
    }
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            base = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDMESH_")}
            base.update(
                EMBEDMESH_CACHE_DIR=os.path.join(tmp, "embedmesh"),
                NUMBA_CACHE_DIR=os.path.join(tmp, "numba"),
                JAX_PLATFORMS="cpu",
            )
            results["cold"].append(child(base))
            numba = dict(base, EMBEDMESH_PREPROCESS_NATIVE="0")  # numba's kernels
            results["numba cold"].append(child(numba))  # numba's cache still empty
            results["numba warm"].append(child(numba))  # numba's cache now holds the kernels
            results["numba off"].append(child(dict(base, EMBEDMESH_NUMBA="0")))
            built = os.path.exists(os.path.join(tmp, "embedmesh"))
        for name, runs in results.items():
            r = runs[-1]
            print(
                f"round {i} {name:10s} "
                + "  ".join(f"{k} {r[k]:.2f}s" for k in keys)
                + f"  numba imported: {r.get('numba')}"
            )
        print(f"  library {results['cold'][-1]['library']}; built into the cache: {built}")
    print(f"load average at end {os.getloadavg()}\nmedians:")
    for name, runs in results.items():
        print(
            f"  {name:10s} "
            + "  ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}s" for k in keys)
        )


if __name__ == "__main__":
    main()
