"""One-hot features at large batches on one TPU chip: the step, where its time goes, and
plain JAX's steps on the same inputs, in one process.

The workload of every Criteo model: 26 one-hot features, one table each, MLPerf
DLRM-DCNv2's cardinalities capped at `--cap` rows (3 to 1M), sum combiner, Adagrad,
uniform-in-rank Zipf(1.05) ids. At each `--batches` and `--dims`:

- `embedmesh`: the facade's step from enqueued batches (`dequeue` + the loss gradient +
  `apply_gradients`), ids/s;
- `lookup`: `dequeue` alone (the lookup program), and `update` = step - lookup;
- `embedmesh-walk`: the same step with every row range's pass of the pair sums walking
  every pair block (`pallas.SKIP_RANGES = False`, as before the skip);
- `embedmesh-xla`: the same step with the TPU kernels off (XLA's gather, segment sums and
  scatter), which tells whether the Pallas kernels help or hurt on one-hot inputs;
- `jax-dense`: `take` + `jax.grad` to the whole tables + optax.adagrad;
- `jax-sparse`: unique + `take` + the gathered rows' gradient + Adagrad on them + a
  scatter (what a careful JAX user writes).

Each case's record goes to `--out`/tpu_onehot.json as soon as it ends.

    python benchmarks/tpu_onehot.py --out DIR                     # on the chip
    python benchmarks/tpu_onehot.py --smoke --allow-cpu --out DIR  # the plumbing, on CPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu  # benchmarks/tpu.py: its Report and timing

# fmt: off
CARDINALITIES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
# fmt: on
LR = 0.01


def rows_of(cap: int) -> list[int]:
    return [min(c, cap) for c in CARDINALITIES]


def make_ids(rows: list[int], batch: int, n: int = 3) -> list[list[np.ndarray]]:
    """`n` batches: one id a sample a feature, Zipf(1.05) over each table's rows."""
    r = np.random.default_rng(0)
    return [[((r.zipf(1.05, batch) - 1) % v).astype(np.int32) for v in rows] for _ in range(n)]


def warm_then_time(one, inputs, steps):
    """`one` over `inputs` in turn: (seconds of its first 3 calls, compiles included; the
    median seconds of `steps` calls after them)."""
    t0 = time.perf_counter()
    for i in range(3):
        one(inputs[i % len(inputs)])
    first = time.perf_counter() - t0
    calls = itertools.cycle(inputs)
    return first, tpu.timed(lambda: one(next(calls)), steps)


def _skip_ranges(on: bool):
    """`pallas.SKIP_RANGES` set, the pair sums' traces dropped (they read it when traced)."""
    from embedmesh.device.ops.tpu import pallas

    pallas.SKIP_RANGES = on
    pallas.reduce_sorted.clear_cache()


def embedmesh_case(rows, dim, batches, kernels=True, steps=10, skip=True):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import embedmesh as em
    from embedmesh.device.ops import tpu as tpu_ops

    tpu_ops.ENABLED = kernels
    _skip_ranges(skip)
    try:
        const = lambda key, shape, dtype: jnp.full(shape, 0.01, dtype)
        fc = {
            f"f{t}": em.FeatureConfig(
                em.TableConfig(v, dim, initializer=const, combiner="sum", name=f"t{t}")
            )
            for t, v in enumerate(rows)
        }
        device = jax.devices()[0]
        emb = em.MeshEmbedding(fc, em.Adagrad(LR), mesh=Mesh(np.array([device]), ("d",)))
        feats = [{f"f{t}": ids[t] for t in range(len(rows))} for ids in batches]
        csrs = [emb.enqueue(f) for f in feats]
        bsz = len(batches[0][0])
        lossgrad = jax.jit(
            jax.grad(lambda acts: sum(0.5 * (a * a).sum() for a in acts.values()) / bsz)
        )

        def step(c):
            acts, pres = emb.dequeue(c)
            emb.apply_gradients(lossgrad(acts), pres)
            jax.block_until_ready(emb.state)

        first, step_s = warm_then_time(step, csrs, steps)
        _, lookup_s = warm_then_time(
            lambda c: jax.block_until_ready(emb.dequeue(c)[0]), csrs, steps
        )
        ids = bsz * len(rows)
        unique = sum(int(np.unique(x).size) for x in batches[0])
        return {
            "step_ms": step_s * 1e3,
            "lookup_ms": lookup_s * 1e3,
            "update_ms": (step_s - lookup_s) * 1e3,
            "ids_per_s_M": ids / step_s / 1e6,
            "ids": ids,
            "unique": unique,
            "stacks": len(emb.plan.stacks),
            "row_width": emb.plan.stacks[0].width,
            "first_steps_s": first,
        }
    finally:
        tpu_ops.ENABLED = True
        _skip_ranges(True)


def sparse_adagrad(table, acc, ids, rows, g):
    """Adagrad on the gathered `rows` of distinct `ids`, written back by a scatter."""
    import jax
    import jax.numpy as jnp

    a = jnp.take(acc, ids, axis=0, mode="fill", fill_value=1) + g * g
    put = lambda x, v: x.at[ids].set(v, mode="drop", unique_indices=True)
    return put(table, rows - LR * g * jax.lax.rsqrt(a)), put(acc, a)


def plain_case(rows, dim, batches, sparse, steps=10):
    import jax
    import jax.numpy as jnp
    import optax

    bsz, n = len(batches[0][0]), len(rows)
    inputs = [[jnp.asarray(x) for x in ids] for ids in batches]
    tables = [jnp.full((v, dim), 0.01, jnp.float32) for v in rows]

    def loss_of(acts):
        return sum(0.5 * (a * a).sum() for a in acts) / bsz

    if not sparse:
        opt = optax.adagrad(LR, initial_accumulator_value=0.1)
        state = [tables, opt.init(tables)]

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(tables, opt_state, ids):
            g = jax.grad(lambda t: loss_of([jnp.take(t[i], ids[i], axis=0) for i in range(n)]))(
                tables
            )
            updates, opt_state = opt.update(g, opt_state, tables)
            return optax.apply_updates(tables, updates), opt_state

    else:
        state = [tables, [jnp.full((v, dim), 0.1, jnp.float32) for v in rows]]

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(tables, accs, ids):
            uniq, inv, got = [], [], []
            for i in range(n):
                u, k = jnp.unique(ids[i], size=bsz, fill_value=rows[i], return_inverse=True)
                uniq.append(u)
                inv.append(k.reshape(-1))
                got.append(jnp.take(tables[i], u, axis=0, mode="fill", fill_value=0))
            g = jax.grad(lambda r: loss_of([jnp.take(r[i], inv[i], axis=0) for i in range(n)]))(got)
            new = [sparse_adagrad(tables[i], accs[i], uniq[i], got[i], g[i]) for i in range(n)]
            return [t for t, _ in new], [a for _, a in new]

    def one(x):
        state[0], state[1] = step(state[0], state[1], x)
        jax.block_until_ready(state[0])

    first, step_s = warm_then_time(one, inputs, steps)
    state.clear()
    return {
        "step_ms": step_s * 1e3,
        "ids_per_s_M": bsz * n / step_s / 1e6,
        "first_steps_s": first,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ".cache/tpu_onehot"))
    ap.add_argument("--budget", type=float, default=480.0)
    ap.add_argument("--cap", type=int, default=1_000_000)
    ap.add_argument("--batches", default="4096,32768")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--contenders", default="embedmesh,embedmesh-xla,jax-dense,jax-sparse")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the plumbing)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a TPU")
    args = ap.parse_args()
    os.environ.setdefault("EMBEDMESH_CPU_KERNELS", "0")
    import jax

    if jax.default_backend() != "tpu" and not args.allow_cpu:
        print(f"no TPU: the default backend is {jax.default_backend()}", file=sys.stderr)
        raise SystemExit(3)
    rep = tpu.Report(args.out, args.budget)
    rep.data["device"] = str(jax.devices()[0].device_kind)
    rep.data["workload"] = "26 one-hot features, sum, Adagrad, Zipf(1.05)"
    cap = 200 if args.smoke else args.cap
    batch_sizes = [16] if args.smoke else [int(b) for b in args.batches.split(",")]
    steps = 2 if args.smoke else args.steps
    rows = rows_of(cap)
    rep.data["rows"] = rows
    cases = {
        "embedmesh": lambda d, b: embedmesh_case(rows, d, b, steps=steps),
        "embedmesh-walk": lambda d, b: embedmesh_case(rows, d, b, steps=steps, skip=False),
        "embedmesh-xla": lambda d, b: embedmesh_case(rows, d, b, kernels=False, steps=steps),
        "jax-dense": lambda d, b: plain_case(rows, d, b, sparse=False, steps=steps),
        "jax-sparse": lambda d, b: plain_case(rows, d, b, sparse=True, steps=steps),
    }
    for dim in [int(d) for d in args.dims.split(",")]:
        for bsz in batch_sizes:
            batches = make_ids(rows, bsz)
            for name in args.contenders.split(","):
                rep.case(f"{name}/d{dim}/b{bsz}", lambda n=name: cases[n](dim, batches))
    os.replace(os.path.join(args.out, "tpu.json"), os.path.join(args.out, "tpu_onehot.json"))
    os.replace(os.path.join(args.out, "tpu.md"), os.path.join(args.out, "tpu_onehot.md"))


if __name__ == "__main__":
    main()
