"""TPU probe: the row moves and pair loops a lookup and update are built from, timed on
the chip in one process (results to $OUT/probe.json after every case).

    python benchmarks/tpu_probe.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import functools
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
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train"))
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


def time_against(rec, key, fn, arg, want):
    """`rec[key + "_ms"]`: fn(arg)'s median milliseconds; `rec[key + "_err"]`: the largest
    distance of its result from `want`."""
    import jax.numpy as jnp

    t, o = timeit(fn, arg)
    rec[f"{key}_ms"] = t * 1e3
    rec[f"{key}_err"] = float(jnp.abs(o - want).max())


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
    ap.add_argument(
        "--only", default="", help="run only the cases whose name starts so (comma-separated)"
    )
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
        if not any(name.startswith(p) for p in args.only.split(",")):
            return
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

    # 1b. 16-bit rows (a TPU interleaves two rows a 32-bit word): XLA's gather and
    # scatter of bfloat16 rows, against the row-pair DMAs (`pallas.gather_pairs_dma`,
    # `ops.tpu.scatter_rows_paired`) and the float32 DMA scatter, the same ids
    def sixteen(w=128):
        from embedmesh.device.ops import tpu as tpu_ops

        rows_w = min(S, (2 << 30) // (w * 2))
        rows_w -= rows_w % 2
        ids = jnp.asarray(np.unique(uniq % rows_w).astype(np.int32))
        n = int(ids.shape[0])
        r16 = np.random.default_rng(2)
        table = jnp.asarray(r16.normal(size=(1024, w)).astype(np.float32))
        table = jnp.tile(table, (rows_w // 1024 + 1, 1))[:rows_w].astype(jnp.bfloat16)
        rows = jnp.asarray(r16.normal(size=(n, w)).astype(np.float32)).astype(jnp.bfloat16)
        rec = {"width": w, "rows": n, "table_rows": rows_w}
        g = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
        rec["xla_gather_ms"] = timeit(g, table, ids)[0] * 1e3
        gp = jax.jit(lambda t, i: tpk.gather_pairs_dma(t, i >> 1))
        rec["dma_gather_pairs_ms"] = timeit(gp, table, ids)[0] * 1e3
        want = table.at[ids].set(rows, unique_indices=True, mode="drop")
        want_bits = jax.lax.bitcast_convert_type(want, jnp.uint16)
        sc = jax.jit(
            lambda t, i, r: t.at[i].set(r, unique_indices=True, mode="drop"), donate_argnums=0
        )
        rec["xla_scatter_ms"] = time_in_place(sc, jnp.array(table), ids, rows)[0] * 1e3
        for partners in ("xla", "dma"):
            tpu_ops.PARTNERS = partners
            pc = jax.jit(tpu_ops.scatter_rows_paired, donate_argnums=0)
            out = pc(jnp.array(table), ids, rows)  # from the table before: = XLA's
            got = jax.lax.bitcast_convert_type(out, jnp.uint16)
            rec[f"paired_{partners}_equal"] = bool(jnp.array_equal(got, want_bits))
            del got
            rec[f"paired_{partners}_ms"] = time_in_place(pc, out, ids, rows)[0] * 1e3
        tpu_ops.PARTNERS = "xla"
        f32 = jnp.zeros((rows_w // 2, w), jnp.float32)  # the same bytes as float32 rows
        ids32 = ids // 2
        ids32 = jnp.asarray(np.unique(np.asarray(ids32)).astype(np.int32))
        r32 = jnp.ones((int(ids32.shape[0]), w), jnp.float32)
        s32 = jax.jit(tpk.scatter_rows_dma, donate_argnums=0)
        rec["f32_dma_scatter_ms"] = time_in_place(s32, f32, ids32, r32)[0] * 1e3
        rec["f32_rows"] = int(ids32.shape[0])
        return rec

    def sixteen_round(w=128):
        """The stochastic rounding of an update's new rows (`device.rounding`: the hash
        of each value's words, then the rounding) against a plain conversion."""
        from embedmesh.device import rounding

        n = int(uniq.size)
        r16 = np.random.default_rng(3)
        vals = jnp.asarray(r16.normal(size=(n, w)).astype(np.float32))
        table_ix = jnp.asarray((uniq // V).astype(np.int32))
        row_ix = jnp.asarray((uniq % V).astype(np.int32))
        fields = jnp.zeros((w,), jnp.int32)
        cols = jnp.arange(w, dtype=jnp.int32)

        def stochastic(x, t, r):
            bits = rounding.random_bits(
                7, jnp.int32(3), fields[None], t[:, None], r[:, None], cols[None]
            )
            return rounding.stochastic_round(x, jnp.bfloat16, bits)

        def bits_only(x, t, r):
            return rounding.random_bits(
                7, jnp.int32(3), fields[None], t[:, None], r[:, None], cols[None]
            )

        rec = {"rows": n, "width": w}
        rec["nearest_ms"] = timeit(jax.jit(lambda x: x.astype(jnp.bfloat16)), vals)[0] * 1e3
        rec["bits_ms"] = timeit(jax.jit(bits_only), vals, table_ix, row_ix)[0] * 1e3
        rec["stochastic_ms"] = timeit(jax.jit(stochastic), vals, table_ix, row_ix)[0] * 1e3
        return rec

    case("sixteen_round", sixteen_round)
    case("sixteen_w128", sixteen)
    case("sixteen_w256", lambda: sixteen(256))

    # 1c. half-byte rows (issue 41: bf16 rows that are self-contained): a bfloat16 row
    # of 128 columns as 64 uint32 words (two columns of the same row a word), moved a
    # DMA a row, against a float32 row of 128 lanes (512 bytes) by XLA and by a DMA.
    # Layouts: "narrow" uint32 [S, 64] (a row its own array row), "halves" uint32
    # [S / 2, 128] (row r in lanes 64 * (r & 1) of array row r >> 1: a half row is 256
    # contiguous bytes of its 128-lane tile row, written without reading its neighbour).
    def half_rows():
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu

        rows_s = S - S % 2
        ids_np = np.unique(uniq % rows_s).astype(np.int32)
        ids = jnp.asarray(ids_np)
        n = int(ids.shape[0])
        tg = 512 if not args.interpret else 128
        rec = {"rows": n, "table_rows": rows_s, "tg": tg}
        rng_h = np.random.default_rng(5)
        pattern = jnp.asarray(rng_h.integers(0, 2**32, size=(1024, 128), dtype=np.uint32))

        def filled(shape):
            reps = -(-shape[0] * shape[1] // (1024 * 128))
            flat = jnp.tile(pattern.reshape(-1), reps)[: shape[0] * shape[1]]
            return flat.reshape(shape)

        def size_of(x):
            try:
                return int(x.on_device_size_in_bytes())
            except Exception:  # noqa: BLE001
                return -1

        def half_gather(table, ids, halves):
            """Rows `ids` (64 words each) DMA'd HBM to HBM (an output of the table's
            tiling: a VMEM block of 64 lanes is tiled otherwise, which Mosaic's DMA
            refuses)."""
            nb = -(-n // tg)
            idp = jnp.pad(ids, (0, nb * tg - n), constant_values=0)
            rows = jax.ShapeDtypeStruct((n, 64 if halves else table.shape[1]), jnp.uint32)

            def kernel(ids_ref, table_ref, out_ref, sem):
                base = pl.program_id(0) * tg

                def start(i, c):
                    r = ids_ref[i]
                    dst = out_ref.at[pl.ds(base + i, 1)]
                    if not halves:
                        pltpu.make_async_copy(table_ref.at[pl.ds(r, 1)], dst, sem).start()
                        return c
                    p = r >> 1
                    for h in (0, 1):

                        @pl.when((r & 1) == h)
                        def _(h=h):
                            pltpu.make_async_copy(
                                table_ref.at[pl.ds(p, 1), pl.ds(64 * h, 64)], dst, sem
                            ).start()

                    return c

                tpk._unrolled(tg, start)
                block = out_ref.at[pl.ds(base, tg)]
                pltpu.make_async_copy(block, block, sem).wait()

            return pl.pallas_call(
                kernel,
                grid=(nb,),
                in_specs=[
                    pl.BlockSpec((tg,), lambda i: (i,), memory_space=pltpu.SMEM),
                    pl.BlockSpec(memory_space=pl.ANY),
                ],
                out_specs=pl.BlockSpec(memory_space=pl.ANY),
                scratch_shapes=[pltpu.SemaphoreType.DMA(())],
                out_shape=jax.ShapeDtypeStruct((nb * tg, rows.shape[1]), jnp.uint32),
                compiler_params=pltpu.CompilerParams(has_side_effects=True),
                interpret=tpk._interpret(),
            )(idp, table)[:n]

        def padded(ids, rows):
            """(blocks, ids padded with -1, rows padded with zeros, [n]) for tg-row blocks."""
            nb = -(-n // tg)
            idp = jnp.pad(ids, (0, nb * tg - n), constant_values=-1)
            rp = jnp.pad(rows, ((0, nb * tg - n), (0, 0)))
            return nb, idp, rp, jnp.full((1,), n, jnp.int32)

        def half_scatter(table, ids, rows, halves):
            """Rows (64 words each) DMA'd from an HBM array into the table in place."""
            nb, idp, rp, meta = padded(ids, rows)

            def kernel(meta_ref, ids_ref, rows_ref, table_in, table_ref, sem):
                del table_in
                base = pl.program_id(0) * tg
                count = jnp.clip(meta_ref[0] - base, 0, tg)

                def start(i, c):
                    r = ids_ref[i]
                    src = rows_ref.at[pl.ds(base + i, 1)]
                    if not halves:
                        pltpu.make_async_copy(src, table_ref.at[pl.ds(r, 1)], sem).start()
                        return c
                    p = r >> 1
                    for h in (0, 1):

                        @pl.when((r & 1) == h)
                        def _(h=h):
                            pltpu.make_async_copy(
                                src, table_ref.at[pl.ds(p, 1), pl.ds(64 * h, 64)], sem
                            ).start()

                    return c

                tpk._unrolled(count, start)

                def w(i, c):
                    one = rows_ref.at[pl.ds(0, 1)]
                    pltpu.make_async_copy(one, one, sem).wait()
                    return c

                jax.lax.fori_loop(0, count, w, 0)

            call = tpk.in_place_rows_call(kernel, table, tg, rows.shape[1], nb, rows_in_hbm=True)
            return call(meta, idp, rp, table)

        def lane_half_scatter(table, ids, rows, in_hbm):
            """Rows r into lanes 64 * (r & 1) of the halves table's row r >> 1, from
            `rows` [n, 128] holding each row's words in that same half (source and
            target both lane slices of 128-lane rows: the same tiling)."""
            nb, idp, rp, meta = padded(ids, rows)

            def kernel(meta_ref, ids_ref, rows_ref, table_in, table_ref, sem):
                del table_in
                base = pl.program_id(0) * tg
                count = jnp.clip(meta_ref[0] - base, 0, tg)
                at = base if in_hbm else 0

                def start(i, c):
                    r = ids_ref[i]
                    p = r >> 1
                    for h in (0, 1):

                        @pl.when((r & 1) == h)
                        def _(h=h):
                            pltpu.make_async_copy(
                                rows_ref.at[pl.ds(at + i, 1), pl.ds(64 * h, 64)],
                                table_ref.at[pl.ds(p, 1), pl.ds(64 * h, 64)],
                                sem,
                            ).start()

                    return c

                tpk._unrolled(count, start)

                def w(i, c):
                    one = rows_ref.at[pl.ds(0, 1), pl.ds(0, 64)]
                    pltpu.make_async_copy(one, one, sem).wait()
                    return c

                jax.lax.fori_loop(0, count, w, 0)

            call = tpk.in_place_rows_call(kernel, table, tg, 128, nb, rows_in_hbm=in_hbm)
            return call(meta, idp, rp, table)

        def lane_halves():
            table = filled((rows_s // 2, 128))
            host = np.asarray(table)
            words = rng_h.integers(0, 2**32, size=(n, 64), dtype=np.uint32)
            rows = jnp.asarray(np.concatenate([words, words], axis=1))
            expect = host.reshape(rows_s, 64).copy()
            expect[ids_np] = words
            for in_hbm in (True, False):
                key = "lane_halves_" + ("hbm" if in_hbm else "vmem") + "_scatter"
                try:
                    sc = jax.jit(
                        functools.partial(lane_half_scatter, in_hbm=in_hbm), donate_argnums=0
                    )
                    t, table = time_in_place(sc, table, ids, rows)
                    rec[f"{key}_ms"] = t * 1e3
                    rec[f"{key}_equal"] = bool(
                        np.array_equal(np.asarray(table).reshape(rows_s, 64), expect)
                    )
                except Exception as e:  # noqa: BLE001
                    rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:600]
                    table = jnp.asarray(host)

        xla_take = jax.jit(lambda t, i: jnp.take(t, i, axis=0))

        # float32 rows of 128 lanes: the fp32 step's rows at dim 64 ([w | acc])
        f32 = jax.lax.bitcast_convert_type(filled((rows_s, 128)), jnp.float32)
        rec["f32_bytes"] = size_of(f32)
        rec["f32_xla_gather_ms"] = timeit(xla_take, f32, ids)[0] * 1e3
        rec["f32_dma_gather_ms"] = timeit(jax.jit(tpk.gather_rows_dma), f32, ids)[0] * 1e3
        r32 = jnp.ones((n, 128), jnp.float32)
        s32 = jax.jit(tpk.scatter_rows_dma, donate_argnums=0)
        rec["f32_dma_scatter_ms"] = time_in_place(s32, f32, ids, r32)[0] * 1e3
        del f32

        # bfloat16 rows of 128 columns as XLA lays them (two rows a word): its gather
        b16 = jnp.full((rows_s, 128), 1.5, jnp.bfloat16)
        rec["bf16_bytes"] = size_of(b16)
        rec["bf16_xla_gather_ms"] = timeit(xla_take, b16, ids)[0] * 1e3
        del b16

        def attempt(key, fn):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:600]

        for layout in ("narrow", "halves", "wide"):  # wide: 128-lane u32 rows, the same DMAs
            halves = layout == "halves"
            width = 128 if layout == "wide" else 64
            shape = (rows_s // 2, 128) if halves else (rows_s, width)
            table = filled(shape)
            rec[f"{layout}_bytes"] = size_of(table)
            host = np.asarray(table)
            want = host.reshape(rows_s, width)[ids_np]
            new_rows = jnp.asarray(rng_h.integers(0, 2**32, size=(n, width), dtype=np.uint32))

            def gather(layout=layout, halves=halves, table=table, want=want):
                g = jax.jit(functools.partial(half_gather, halves=halves))
                t, got = timeit(g, table, ids)
                rec[f"{layout}_dma_gather_ms"] = t * 1e3
                rec[f"{layout}_dma_gather_equal"] = bool(np.array_equal(np.asarray(got), want))

            attempt(f"{layout}_dma_gather", gather)
            if not halves:
                attempt(
                    "narrow_xla_gather",
                    lambda table=table: rec.__setitem__(
                        "narrow_xla_gather_ms", timeit(xla_take, table, ids)[0] * 1e3
                    ),
                )
            else:  # the pair's 128 lanes by XLA, then the half picked
                pick = jax.jit(
                    lambda t, i: jnp.where(
                        (i & 1)[:, None] == 1,
                        jnp.take(t, i >> 1, axis=0)[:, 64:],
                        jnp.take(t, i >> 1, axis=0)[:, :64],
                    )
                )
                attempt(
                    "halves_xla_gather_pick",
                    lambda table=table: rec.__setitem__(
                        "halves_xla_gather_pick_ms", timeit(pick, table, ids)[0] * 1e3
                    ),
                )

            def scatter(
                layout=layout, halves=halves, table=table, host=host, width=width, new_rows=new_rows
            ):
                sc = jax.jit(functools.partial(half_scatter, halves=halves), donate_argnums=0)
                t, out = time_in_place(sc, table, ids, new_rows)
                rec[f"{layout}_dma_scatter_ms"] = t * 1e3
                expect = host.reshape(rows_s, width).copy()
                expect[ids_np] = np.asarray(new_rows)
                rec[f"{layout}_dma_scatter_equal"] = bool(
                    np.array_equal(np.asarray(out).reshape(rows_s, width), expect)
                )

            attempt(f"{layout}_dma_scatter", scatter)
            del table, host, want
        lane_halves()
        return rec

    case("half_rows", half_rows)

    # 2. the pair sums (rows gathered into VMEM, one-hot matmuls) against XLA's take +
    # segment_sum, by dim and block sizes (the scalar pair loops they replace, measured on
    # 2026-12-04: runs/tpu_probe_2026-12-04_b.txt)
    rng = np.random.default_rng(1)

    def xla_pairs(src, read, write, num):
        return jax.ops.segment_sum(jnp.take(src, read, axis=0) * d_g[:, None], write, num)

    def pair_inputs(dim):
        """Random pair sources [U, dim] and activations [R, dim], and XLA's combine of the
        sources and reduce of the activations (what the kernels must give)."""
        src = jnp.asarray(rng.normal(size=(U, dim)).astype(np.float32))
        act = jnp.asarray(rng.normal(size=(R, dim)).astype(np.float32))
        want_c = jax.jit(lambda s: xla_pairs(s, d_pu, d_pr, R))(src)
        want_r = jax.jit(lambda a: xla_pairs(a, d_pr, d_pu, U))(act)
        return src, act, want_c, want_r

    def reduce_kernel(dim, **blocks):
        """The kernels' reduce of activations [R, dim] into [U, dim] (`blocks`: tw, tp, unroll)."""
        return jax.jit(
            lambda a: tpk.reduce_sorted(a, d_pu, d_pr, d_g, num_out=U, **blocks)[0][:, :dim]
        )

    def combine_kernel(**blocks):
        """The kernels' combine of sources [U, dim] into [R, dim] (`blocks`: tw, tp, unroll)."""
        return jax.jit(lambda s: tpk.combine(s, d_pu, d_pr, d_g, R, **blocks))

    blocks_r = ((256, 512), (512, 512))
    blocks_c = ((128, 512), (256, 512))
    if args.interpret:
        blocks_r = blocks_c = ((64, 128),)
    for dim in (64, 128, 256):

        def mxu(dim=dim):
            src, act, want_c, want_r = pair_inputs(dim)
            rec = {"dim": dim}
            rec["xla_combine_ms"] = (
                timeit(jax.jit(lambda s: xla_pairs(s, d_pu, d_pr, R)), src)[0] * 1e3
            )
            rec["xla_reduce_ms"] = (
                timeit(jax.jit(lambda a: xla_pairs(a, d_pr, d_pu, U)), act)[0] * 1e3
            )
            for tw, tp in blocks_r:
                try:
                    r = reduce_kernel(dim, tw=tw, tp=tp)
                    time_against(rec, f"reduce_{tw}_{tp}", r, act, want_r)
                except Exception as e:  # noqa: BLE001
                    rec[f"reduce_{tw}_{tp}_error"] = f"{type(e).__name__}: {e}"[:800]
            for tw, tp in blocks_c:
                try:
                    time_against(
                        rec, f"combine_{tw}_{tp}", combine_kernel(tw=tw, tp=tp), src, want_c
                    )
                except Exception as e:  # noqa: BLE001
                    rec[f"combine_{tw}_{tp}_error"] = f"{type(e).__name__}: {e}"[:800]
            return rec

        case(f"pair_sums_d{dim}", mxu)

    # 2b. the pair loop's unrolling: pair rows gathered into VMEM `unroll` a loop turn
    # (more independent loads in flight, more wasted reads at the items' ends)
    def unrolling():
        src, act, want_c, want_r = pair_inputs(128)
        rec = {}
        for tp, unroll in ((512, 4), (512, 8), (512, 16), (512, 32), (1024, 16), (256, 16)):
            if args.interpret and (tp, unroll) != (512, 8):
                continue
            try:
                r = reduce_kernel(128, tp=tp, unroll=unroll)
                time_against(rec, f"reduce_tp{tp}_u{unroll}", r, act, want_r)
                c = combine_kernel(tp=tp, unroll=unroll)
                time_against(rec, f"combine_tp{tp}_u{unroll}", c, src, want_c)
            except Exception as e:  # noqa: BLE001
                rec[f"tp{tp}_u{unroll}_error"] = f"{type(e).__name__}: {e}"[:800]
        return rec

    case("unroll", unrolling)

    # 3. an Adagrad update over fused [w | acc] rows (dim 64 -> 128 lanes): one gather and
    # one scatter of 117k rows a step where two 128-lane arrays take two of each
    def fused_update():
        table = jnp.ones((S, 128), jnp.float32)
        gsum = jnp.asarray(rng.normal(size=(U, 64)).astype(np.float32))

        def upd(t, i, g):
            rows = jnp.take(t, i, axis=0)
            w, a = rows[:, :64], rows[:, 64:]
            a = a + g * g
            w = w - 0.01 * g * jax.lax.rsqrt(a)
            new = jnp.concatenate([w, a], 1)
            if dma:  # the in-place row update embedmesh uses on a TPU
                return tpk.scatter_rows_dma(t, i, new)
            return t.at[i].set(new, unique_indices=True, mode="drop")

        rec = {}
        for dma in (False, True):
            f = jax.jit(upd, donate_argnums=0)
            t, table = time_in_place(f, table, d_uniq, gsum)
            rec[("dma" if dma else "xla") + "_ms"] = t * 1e3
        return rec

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
                rec = {}
                scatter = jax.jit(
                    lambda t, i, r: tpk.scatter_rows_dma(t, i, r, tg=tg), donate_argnums=0
                )
                tsc, table = time_in_place(scatter, table, ids, rows)
                chk = jnp.take(table, ids, axis=0)
                rec["scatter_ms"] = tsc * 1e3
                rec["scatter_Mrows_s"] = ids.shape[0] / tsc / 1e6
                rec["scatter_err"] = float(jnp.abs(chk - rows).max())
                n = ids.shape[0]
                return rec | {
                    "width": w,
                    "tg": tg,
                    "rows": n,
                    "gather_ms": tg_s * 1e3,
                    "gather_Mrows_s": n / tg_s / 1e6,
                    "gather_err": err,
                }

            case(f"dma_rows_w{w}_tg{tg}", dma)

    # 4b. where a DMA-a-row scatter spends its ~41 ns a row: the branch per id, the wait
    # per row, the loop, the VMEM staging of the rows (variants of `scatter_rows_dma`)
    def scatter_variant(*, branch, waits, unroll, source, tg=512, w=128):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu

        def kernel(nvalid_ref, ids_ref, rows_ref, table_in, table_ref, sem):
            del table_in
            i = pl.program_id(0)
            base = i * tg
            count = jnp.clip(nvalid_ref[0] - base, 0, tg)

            def copy(j, row):
                src = rows_ref.at[pl.ds(base + j, 1) if source == "hbm" else pl.ds(j, 1)]
                return pltpu.make_async_copy(src, table_ref.at[pl.ds(row, 1)], sem)

            def start(j, c):
                row = ids_ref[j]
                if branch:

                    @pl.when((row >= 0) & (row < table_ref.shape[0]))
                    def _():
                        copy(j, row).start()

                else:
                    copy(j, row).start()
                return c

            tpk._unrolled(count, start, unroll)  # (unroll 1: the plain loop)
            if waits == "row":
                jax.lax.fori_loop(0, count, lambda j, c: (copy(0, 0).wait(), c)[1], 0)
            else:  # one wait when the block is full

                @pl.when(count == tg)
                def _():
                    pltpu.make_async_copy(
                        table_ref.at[pl.ds(0, tg)], table_ref.at[pl.ds(0, tg)], sem
                    ).wait()

                @pl.when(count < tg)
                def _():
                    jax.lax.fori_loop(0, count, lambda j, c: (copy(0, 0).wait(), c)[1], 0)

        def run(table, ids, rows):
            n = ids.shape[0]
            nb = -(-n // tg)
            idp = jnp.pad(ids, (0, nb * tg - n), constant_values=-1)
            rp = jnp.pad(rows, ((0, nb * tg - n), (0, 0)))
            nvalid = jnp.full((1,), n, jnp.int32)
            call = tpk.in_place_rows_call(kernel, table, tg, w, nb, rows_in_hbm=source == "hbm")
            return call(nvalid, idp, rp, table)

        return run

    def scatter_variants():
        w = 128
        rows_w = min(S, (4 << 30) // (w * 4))
        ids = jnp.asarray(np.unique(uniq % rows_w))
        table = jnp.zeros((rows_w, w), jnp.float32)
        rows = jnp.asarray(
            np.random.default_rng(1).normal(size=(ids.shape[0], w)).astype(np.float32)
        )
        rec = {"rows": int(ids.shape[0])}
        variants = {
            "base": dict(branch=True, waits="row", unroll=1, source="vmem"),
            "nobranch": dict(branch=False, waits="row", unroll=1, source="vmem"),
            "nobranch_onewait": dict(branch=False, waits="one", unroll=1, source="vmem"),
            "nobranch_onewait_u8": dict(branch=False, waits="one", unroll=8, source="vmem"),
            "hbm_nobranch_onewait_u8": dict(branch=False, waits="one", unroll=8, source="hbm"),
            "hbm_nobranch_rowwait": dict(branch=False, waits="row", unroll=1, source="hbm"),
            "nobranch_onewait_u8_tg2048": dict(
                branch=False, waits="one", unroll=8, source="vmem", tg=2048
            ),
        }
        for name, kw in variants.items():
            try:
                f = jax.jit(scatter_variant(w=w, **kw), donate_argnums=0)
                t, table = time_in_place(f, table, ids, rows)
                err = float(jnp.abs(jnp.take(table, ids, axis=0) - rows).max())
                rec[name] = {"ms": t * 1e3, "Mrows_s": ids.shape[0] / t / 1e6, "err": err}
            except Exception as e:  # noqa: BLE001
                rec[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
            print(name, rec[name], flush=True)
        return rec

    case("scatter_variants", scatter_variants)

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
