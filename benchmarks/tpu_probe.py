"""TPU probe: the row moves and pair loops a lookup and update are built from, timed on
the chip in one process (results to $OUT/probe.json after every case).

    python benchmarks/tpu_probe.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T, B, V = 8, 4096, 1_000_000  # train_step.py's workload


def workload():
    """The train_step workload (its first batch) as one stack's CSR: unique ids
    ascending, pairs by (unique, row) with summed gains (sum combiner)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_step

    batch = train_step.make_batches(vocab=V, batch=B, num=1)[0]
    ids = np.concatenate([vals.astype(np.int64) + t * V for t, (vals, _) in enumerate(batch)])
    rows = np.concatenate(
        [np.repeat(np.arange(B) + t * B, lengths) for t, (_, lengths) in enumerate(batch)]
    )
    uniq, inv = np.unique(ids, return_inverse=True)
    pair_key = inv.astype(np.int64) * (T * B) + rows
    pk, counts = np.unique(pair_key, return_counts=True)
    pu = (pk // (T * B)).astype(np.int32)
    pr = (pk % (T * B)).astype(np.int32)
    return uniq.astype(np.int32), pu, pr, counts.astype(np.float32), int(ids.size)


TIMED_RUNS = 10


def timeit(fn, *args, n=None):
    n = TIMED_RUNS if n is None else n
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def time_in_place(update, table, *args):
    """Median seconds of `table = update(table, *args)` (the table donated, updated in
    place), after one untimed call."""
    import jax

    box = [update(table, *args)]
    jax.block_until_ready(box[0])
    ts = []
    for _ in range(TIMED_RUNS):
        t = time.perf_counter()
        box[0] = update(box[0], *args)
        jax.block_until_ready(box[0])
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), box.pop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--interpret", action="store_true")  # CPU check of the script
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax
    import jax.numpy as jnp

    from embedmesh.device.ops.tpu import pallas as tpk

    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "cases": []}
    path = os.path.join(args.out, "probe.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    def case(name, fn):
        t0 = time.perf_counter()
        try:
            rec = fn()
            rec["name"] = name
        except Exception as e:  # noqa: BLE001
            rec = {
                "name": name,
                "error": f"{type(e).__name__}: {e}"[:3000],
                "tb": traceback.format_exc()[-3000:],
            }
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(rec)[:600], flush=True)
        results["cases"].append(rec)
        save()

    if args.quick or args.interpret:
        global V, B
        V = 20000
        if args.interpret:
            B = 16
            tpk.INTERPRET = True
            global TIMED_RUNS
            TIMED_RUNS = 1
    uniq, pu, pr, gains, nids = workload()
    U, P, R = uniq.size, pu.size, T * B
    results.update(U=int(U), P=int(P), R=R, ids=nids)
    print("U", U, "P", P, "ids", nids, flush=True)
    d_uniq = jnp.asarray(uniq)
    d_pu, d_pr, d_g = jnp.asarray(pu), jnp.asarray(pr), jnp.asarray(gains)
    S = T * V

    # 1. XLA gather / scatter of U distinct rows, by row width
    for w in (128, 512):

        def gs(w=w):
            rows_w = min(S, (4 << 30) // (w * 4))  # tables of at most 4 GB
            ids = jnp.asarray(np.unique(uniq % rows_w))
            table = jnp.ones((rows_w, w), jnp.float32)
            g = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
            tg, rows = timeit(g, table, ids)
            sc = jax.jit(
                lambda t, i, r: t.at[i].set(r, unique_indices=True, mode="drop"),
                donate_argnums=0,
            )
            tsc, _ = time_in_place(sc, table, ids, rows)
            n = ids.shape[0]
            return {
                "width": w,
                "rows": n,
                "table_rows": rows_w,
                "gather_ms": tg * 1e3,
                "gather_Mrows_s": n / tg / 1e6,
                "scatter_ms": tsc * 1e3,
                "scatter_Mrows_s": n / tsc / 1e6,
            }

        case(f"xla_gather_scatter_w{w}", gs)

    # 2. the pair loops against XLA's take + segment_sum, dims 64 and 256 (the loop forms
    # measured on 2026-12-04, all within 3%: runs/tpu_probe_2026-12-04_b.txt)
    rng = np.random.default_rng(1)

    def xla_pairs(src, read, write, num):
        return jax.ops.segment_sum(jnp.take(src, read, axis=0) * d_g[:, None], write, num)

    for dim in (64, 256):
        src = jnp.asarray(rng.normal(size=(U, dim)).astype(np.float32))
        act = jnp.asarray(rng.normal(size=(R, dim)).astype(np.float32))
        xla_c = jax.jit(lambda s: xla_pairs(s, d_pu, d_pr, R))
        want_c = xla_c(src)
        want_r = jax.jit(lambda a: xla_pairs(a, d_pr, d_pu, U))(act)
        case(f"xla_segment_combine_d{dim}", lambda: {"ms": timeit(xla_c, src)[0] * 1e3})

        def run(dim=dim, src=src, act=act, want_c=want_c, want_r=want_r):
            c = jax.jit(lambda s: tpk.combine_sorted(s, d_pu, d_pr, d_g, num_dst=R)[0][:, :dim])
            r = jax.jit(lambda a: tpk.reduce_sorted(a, d_pu, d_pr, d_g, num_out=U)[0][:, :dim])
            tc, oc = timeit(c, src)
            tr, orr = timeit(r, act)
            return {
                "dim": dim,
                "combine_ms": tc * 1e3,
                "combine_Mpairs_s": P / tc / 1e6,
                "combine_err": float(jnp.abs(oc - want_c).max()),
                "reduce_ms": tr * 1e3,
                "reduce_Mpairs_s": P / tr / 1e6,
                "reduce_err": float(jnp.abs(orr - want_r).max()),
            }

        case(f"pallas_pairs_d{dim}", run)

    # 3. an XLA Adagrad update over fused [w | acc] rows (dim 64 -> 128 lanes)
    def fused_update():
        table = jnp.ones((S, 128), jnp.float32)
        gsum = jnp.asarray(rng.normal(size=(U, 64)).astype(np.float32))

        def upd(t, i, g):
            rows = jnp.take(t, i, axis=0)
            w, a = rows[:, :64], rows[:, 64:]
            a = a + g * g
            w = w - 0.01 * g * jax.lax.rsqrt(a)
            return t.at[i].set(jnp.concatenate([w, a], 1), unique_indices=True, mode="drop")

        t, _ = time_in_place(jax.jit(upd, donate_argnums=0), table, d_uniq, gsum)
        return {"ms": t * 1e3}

    case("xla_fused_adagrad_update_d64", fused_update)

    # 4. a DMA a row: gather and in-place scatter, by width and block
    for w in (128, 512):
        for tg in (256, 1024):

            def dma(w=w, tg=tg):
                rows_w = min(S, (4 << 30) // (w * 4))
                ids = jnp.asarray(np.unique(uniq % rows_w))
                table = jnp.asarray(
                    np.arange(rows_w, dtype=np.float32)[:, None] * np.ones((1, w), np.float32)
                )
                g = jax.jit(lambda t, i: tpk.gather_rows_dma(t, i, tg=tg))
                tg_s, rows = timeit(g, table, ids)
                err = float(jnp.abs(rows[:, 0] - ids.astype(jnp.float32)).max())
                scatter = jax.jit(
                    lambda t, i, r: tpk.scatter_rows_dma(t, i, r, tg=tg), donate_argnums=0
                )
                tsc, out = time_in_place(scatter, table, ids, rows)
                chk = jnp.take(out, ids, axis=0)
                err2 = float(jnp.abs(chk - rows).max())
                n = ids.shape[0]
                return {
                    "width": w,
                    "tg": tg,
                    "rows": n,
                    "gather_ms": tg_s * 1e3,
                    "gather_Mrows_s": n / tg_s / 1e6,
                    "gather_err": err,
                    "scatter_ms": tsc * 1e3,
                    "scatter_Mrows_s": n / tsc / 1e6,
                    "scatter_err": err2,
                }

            case(f"dma_rows_w{w}_tg{tg}", dma)

    # 6. where a pair loop's ~26 ns go: the combine's loop with parts of its body removed
    def loop_parts():
        from jax.experimental import pallas as pl

        dim = 128
        src = jnp.asarray(rng.normal(size=(U, dim)).astype(np.float32))
        tw, tp = tpk.TW, tpk.TP
        sched, _ = tpk.schedule(d_pu, d_pr, d_g, U, R, tw, tp)
        nkb = sched.num_blocks
        padded = jnp.zeros((nkb * tw, dim), jnp.float32).at[:U].set(src)
        out = {}
        for body in ("scalar", "read", "rmw_same_row", "rmw"):

            def kernel(
                b_ref,
                pb_ref,
                lo_ref,
                hi_ref,
                first_ref,
                pk_ref,
                pd_ref,
                pg_ref,
                src_ref,
                out_ref,
                body=body,
            ):
                j = pl.program_id(0)

                @pl.when(j == 0)
                def _():
                    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

                base = b_ref[j] * tw

                def step(p, carry):
                    r, u, g = pd_ref[p], pk_ref[p] - base, pg_ref[p]
                    if body == "scalar":
                        return carry + (r + u).astype(jnp.float32) * g
                    if body == "read":
                        return carry + g * src_ref[pl.ds(u, 1), :]
                    row = 0 if body == "rmw_same_row" else r
                    out_ref[pl.ds(row, 1), :] = (
                        out_ref[pl.ds(row, 1), :] + g * src_ref[pl.ds(u, 1), :]
                    )
                    return carry

                init = jnp.float32(0) if body == "scalar" else jnp.zeros((1, dim), jnp.float32)
                acc = jax.lax.fori_loop(lo_ref[j], hi_ref[j], step, init)
                if body in ("scalar", "read"):
                    out_ref[pl.ds(1, 1), :] = out_ref[pl.ds(1, 1), :] + acc

            specs = tpk._pair_specs(tp) + [tpk._rows_spec(tw, dim, lambda j, b, *_: b[j])]
            out_spec = tpk._rows_spec(R, dim, lambda j, *_: 0)
            shape = jax.ShapeDtypeStruct((R, dim), jnp.float32)
            grid = sched.block.shape[0]
            f = jax.jit(
                lambda kernel=kernel: tpk._call(
                    kernel, sched, grid, specs, out_spec, shape, (padded,)
                )
            )
            t, _ = timeit(f)
            out[f"{body}_ms"] = t * 1e3
            out[f"{body}_ns_a_pair"] = t / P * 1e9
        return out

    case("pair_loop_parts_d128", loop_parts)

    # 5. sorting the pairs on the device (by output row)
    def sorts():
        key = d_pr * jnp.int32(1)
        f = jax.jit(lambda k: jnp.argsort(k, stable=True))
        t1, _ = timeit(f, key)
        f2 = jax.jit(
            lambda k: jax.lax.sort((k, jnp.arange(k.shape[0], dtype=jnp.int32)), num_keys=1)
        )
        t2, _ = timeit(f2, key)
        return {"argsort_ms": t1 * 1e3, "sort_pair_ms": t2 * 1e3}

    case("device_sort_pairs", sorts)
    print("done", flush=True)


if __name__ == "__main__":
    main()
