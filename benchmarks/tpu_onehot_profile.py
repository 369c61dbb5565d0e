"""Where a one-hot step's time goes on one TPU chip as the batch grows: the pieces of
the lookup and of the update timed one by one on the batch's own pairs, each pair-sum
kernel with its row-range skip on and off (`pallas.SKIP_RANGES`).

The batch is `tpu_onehot.py`'s (26 one-hot features, Zipf(1.05), MLPerf's cardinalities
capped at `--cap`), enqueued by the facade; its one stack's distinct rows and pairs then
feed:

- `gather`: XLA's gather of the distinct rows (whole rows of the stack's width);
- `sort`: the device sort of the pairs by output row (`combine` does it first);
- `combine`: the lookup's pair sums (the sort included), resident side the distinct rows;
- `reduce`: the backward's pair sums (pairs in the host's order), resident side the
  activation gradients;
- `scatter`: the update's write of the distinct rows (`scatter_rows_dma`, in place).

`--count` runs no kernel (any machine): for each pair sum, the work its row-range
passes do with the skip on and off, counted from the same pairs (the kernels' work
items that read pairs, and the pair rows they read from VMEM: the cost that bounds
them, `pallas`'s docstring).

    python benchmarks/tpu_onehot_profile.py --out DIR   # on the chip
    python benchmarks/tpu_onehot_profile.py --count --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu  # benchmarks/tpu.py: its timing
import tpu_onehot


def pairs_of(rows, bsz):
    """The facade's batch of one stack: (unique ids, pair rows, pair unique, pair
    gains, activation rows) as numpy; of a dim-8 model (the pairs are every dim's, its
    state the smallest)."""
    import gc

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import embedmesh as em

    const = lambda key, shape, dtype: jnp.full(shape, 0.01, dtype)
    fc = {
        f"f{t}": em.FeatureConfig(
            em.TableConfig(v, 8, initializer=const, combiner="sum", name=f"t{t}")
        )
        for t, v in enumerate(rows)
    }
    mesh = Mesh(np.array([jax.devices()[0]]), ("d",))
    emb = em.MeshEmbedding(fc, em.Adagrad(0.01), mesh=mesh)
    ids = tpu_onehot.make_ids(rows, bsz, n=1)[0]
    csr = next(iter(emb.enqueue({f"f{t}": ids[t] for t in range(len(rows))}).values()))
    get = lambda a: np.asarray(a).reshape(-1)
    out = (
        get(csr.unique_ids),
        get(csr.pair_rows),
        get(csr.pair_unique),
        get(csr.pair_gains),
        int(csr.rows_per_device),
    )
    del emb, csr
    gc.collect()
    return out


def profile(rows, dim, bsz, steps):
    import jax
    import jax.numpy as jnp

    from embedmesh.device.ops.tpu import pallas

    uniq, prow, puniq, pgain, num_out = pairs_of(rows, bsz)
    width = -(-2 * dim // 128) * 128  # [w | acc] in whole 128-lane vregs
    valid_u = int(np.sum(uniq < sum(rows)))
    valid_p = int(np.sum(prow < num_out))
    rec = {
        "batch": bsz,
        "dim": dim,
        "width": width,
        "unique": valid_u,
        "unique_capacity": int(uniq.size),
        "pairs": valid_p,
        "pair_capacity": int(prow.size),
        "out_rows": num_out,
        # the output rows of a pair block of the host's order: how far apart they lie
        "pair_block_dst_spread_median": float(
            np.median(np.ptp(prow[: valid_p // 512 * 512].reshape(-1, 512), axis=1))
        ),
    }
    total = sum(rows)
    r = np.random.default_rng(1)
    table = jax.random.normal(jax.random.key(0), (total, width), jnp.float32)
    uniq_d, prow_d = jnp.asarray(uniq), jnp.asarray(prow)
    puniq_d, pgain_d = jnp.asarray(puniq), jnp.asarray(pgain)
    grads = jnp.asarray(r.standard_normal((num_out, dim), np.float32))
    nu = uniq.size

    gather = jax.jit(lambda t, u: jnp.take(t, u, axis=0, mode="fill", fill_value=0))
    got = gather(table, uniq_d)
    rec["gather_ms"] = 1e3 * tpu.timed(lambda: jax.block_until_ready(gather(table, uniq_d)), steps)
    rows_d = jax.block_until_ready(got[:, :dim])
    sort = jax.jit(lambda d, k, g: pallas._sort_by(d, k, g, num_out, nu))
    rec["sort_ms"] = 1e3 * tpu.timed(
        lambda: jax.block_until_ready(sort(prow_d, puniq_d, pgain_d)), steps
    )
    want_c = want_r = None
    for skip in (True, False):
        pallas.SKIP_RANGES = skip
        pallas.reduce_sorted.clear_cache()
        comb = jax.jit(lambda s, k, d, g: pallas.combine(s, k, d, g, num_out))
        red = jax.jit(lambda s, k, d, g: pallas.reduce(s, k, d, g, nu))
        c = jax.block_until_ready(comb(rows_d, puniq_d, prow_d, pgain_d))
        g = jax.block_until_ready(red(grads, puniq_d, prow_d, pgain_d))
        tag = "skip" if skip else "walk"
        rec[f"combine_{tag}_ms"] = 1e3 * tpu.timed(
            lambda: jax.block_until_ready(comb(rows_d, puniq_d, prow_d, pgain_d)), steps
        )
        rec[f"reduce_{tag}_ms"] = 1e3 * tpu.timed(
            lambda: jax.block_until_ready(red(grads, puniq_d, prow_d, pgain_d)), steps
        )
        if want_c is None:
            want_c, want_r = np.asarray(c), np.asarray(g)
        else:  # the same sums both ways
            rec["combine_max_diff"] = float(np.max(np.abs(np.asarray(c) - want_c)))
            rec["reduce_max_diff"] = float(np.max(np.abs(np.asarray(g) - want_r)))
    pallas.SKIP_RANGES = True
    pallas.reduce_sorted.clear_cache()
    new = jnp.asarray(r.standard_normal((nu, width), np.float32))
    scat = jax.jit(pallas.scatter_rows_dma, donate_argnums=(0,))
    state = [table]

    def one():
        state[0] = scat(state[0], uniq_d, new)
        jax.block_until_ready(state[0])

    one()
    rec["scatter_ms"] = 1e3 * tpu.timed(one, steps)
    state.clear()
    return rec


def count(rows, dim, bsz):
    """The passes' work of the lookup's and the backward's pair sums (see the module)."""
    import jax.numpy as jnp

    from embedmesh.device.ops.tpu import lane_width, pallas

    uniq, prow, puniq, pgain, num_out = pairs_of(rows, bsz)
    nu, dc = uniq.size, lane_width(dim)
    by_dst = [np.asarray(a) for a in pallas._sort_by(prow, puniq, pgain, num_out, nu)]
    rec = {"batch": bsz, "dim": dim, "pairs": int(np.sum(prow < num_out)), "unique_capacity": nu}
    sides = {  # op: (keys, dsts, gains, num_keys, resident rows)
        "combine": (*by_dst, num_out, nu),
        "reduce": (puniq, prow, pgain, nu, num_out),
    }
    for op, (key, dst, gains, num_keys, num_src) in sides.items():
        sched, _ = pallas.schedule(
            jnp.asarray(key), jnp.asarray(dst), jnp.asarray(gains), num_keys, num_src
        )
        ranges = [c for c in pallas._chunks(num_src, dc) if c[2] == 0]
        lo, hi = np.asarray(sched.lo), np.asarray(sched.hi)
        work = {"walk": [0, 0], "skip": [0, 0]}
        for r0, n, _, _ in ranges:
            work["walk"][0] += int(np.sum(hi > lo))
            work["walk"][1] += int(np.sum(hi - lo))
            s = pallas._in_range(sched, r0, n, pallas.TW, pallas.TP) if len(ranges) > 1 else None
            slo, shi = (lo, hi) if s is None else (np.asarray(s[2]), np.asarray(s[3]))
            work["skip"][0] += int(np.sum(shi > slo))
            work["skip"][1] += int(np.sum(shi - slo))
        rec[f"{op}_ranges"] = len(ranges)
        for how, (items, reads) in work.items():
            rec[f"{op}_{how}_items"], rec[f"{op}_{how}_pair_reads"] = items, reads
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ".cache/tpu_onehot_profile"))
    ap.add_argument("--cap", type=int, default=1_000_000)
    ap.add_argument("--batches", default="4096,16384,32768")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--count", action="store_true", help="count the passes' work, no kernel")
    args = ap.parse_args()
    os.environ.setdefault("EMBEDMESH_CPU_KERNELS", "0")
    os.makedirs(args.out, exist_ok=True)
    rows = tpu_onehot.rows_of(args.cap)
    recs = []
    for dim in [int(d) for d in args.dims.split(",")]:
        for bsz in [int(b) for b in args.batches.split(",")]:
            try:
                one = count if args.count else functools.partial(profile, steps=args.steps)
                recs.append(one(rows, dim, bsz))
            except Exception as e:  # noqa: BLE001 - recorded, the next case runs
                recs.append({"batch": bsz, "dim": dim, "error": repr(e)[:2000]})
            print(json.dumps(recs[-1]), flush=True)
            name = "tpu_onehot_count.json" if args.count else "tpu_onehot_profile.json"
            with open(os.path.join(args.out, name), "w") as f:
                json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
