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


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--interpret", action="store_true")  # CPU check of the script
    ap.add_argument(
        "--only", default="", help="run only the cases whose name starts so (comma-separated)"
    )
    return ap.parse_args()


def configure(args):
    """--quick: 20k rows a table; --interpret (a CPU check of the script): also batch 16,
    the Pallas kernels interpreted and one timed run a figure."""
    from embedmesh.device.ops.tpu import pallas as tpk

    global V, B, TIMED_RUNS
    if args.quick or args.interpret:
        V = 20000
        if args.interpret:
            B = 16
            tpk.INTERPRET = True
            TIMED_RUNS = 1


class Probe:
    """What the cases read (the arguments, the workload on the host and on the device) and
    the results so far; `case` runs one case and saves them all."""

    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        self.args = args
        self.results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "cases": []}
        self.path = os.path.join(args.out, "probe.json")
        self.uniq, pu, pr, gains, nids = workload()
        self.U, self.P, self.R = self.uniq.size, pu.size, T * B
        self.results.update(U=int(self.U), P=int(self.P), R=self.R, ids=nids)
        print("U", self.U, "P", self.P, "ids", nids, flush=True)
        self.d_uniq = jnp.asarray(self.uniq)
        self.d_pu, self.d_pr, self.d_g = jnp.asarray(pu), jnp.asarray(pr), jnp.asarray(gains)
        self.S = T * V
        self.rng = np.random.default_rng(1)  # the pair cases' and the fused update's draws

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.results, f, indent=1)

    def case(self, name, fn):
        """`fn()`'s record (or its error) as case `name`, unless --only leaves it out."""
        if not any(name.startswith(p) for p in self.args.only.split(",")):
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
        self.results["cases"].append(rec)
        self.save()


# 1. XLA gather / scatter of U distinct rows, by row width
def xla_gather_scatter(p, w):
    import jax
    import jax.numpy as jnp

    rows_w = min(p.S, (4 << 30) // (w * 4))  # tables of at most 4 GB
    ids = jnp.asarray(np.unique(p.uniq % rows_w))
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


# 1b. 16-bit rows (a TPU interleaves two rows a 32-bit word): XLA's gather and
# scatter of bfloat16 rows, against the row-pair DMAs (`pallas.gather_pairs_dma`,
# `ops.tpu.scatter_rows_paired`) and the float32 DMA scatter, the same ids
def sixteen(p, w=128):
    import jax
    import jax.numpy as jnp

    from embedmesh.device.ops import tpu as tpu_ops
    from embedmesh.device.ops.tpu import pallas as tpk

    rows_w = min(p.S, (2 << 30) // (w * 2))
    rows_w -= rows_w % 2
    ids = jnp.asarray(np.unique(p.uniq % rows_w).astype(np.int32))
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
    sc = jax.jit(lambda t, i, r: t.at[i].set(r, unique_indices=True, mode="drop"), donate_argnums=0)
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


def sixteen_round(p, w=128):
    """The stochastic rounding of an update's new rows (`device.rounding`: the hash
    of each value's words, then the rounding) against a plain conversion."""
    import jax
    import jax.numpy as jnp

    from embedmesh.device import rounding

    n = int(p.uniq.size)
    r16 = np.random.default_rng(3)
    vals = jnp.asarray(r16.normal(size=(n, w)).astype(np.float32))
    table_ix = jnp.asarray((p.uniq // V).astype(np.int32))
    row_ix = jnp.asarray((p.uniq % V).astype(np.int32))
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


# 1c. half-byte rows (issue 41: bf16 rows that are self-contained): a bfloat16 row
# of 128 columns as 64 uint32 words (two columns of the same row a word), moved a
# DMA a row, against a float32 row of 128 lanes (512 bytes) by XLA and by a DMA.
# Layouts: "narrow" uint32 [S, 64] (a row its own array row), "halves" uint32
# [S / 2, 128] (row r in lanes 64 * (r & 1) of array row r >> 1: a half row is 256
# contiguous bytes of its 128-lane tile row, written without reading its neighbour).


def size_of(x):
    try:
        return int(x.on_device_size_in_bytes())
    except Exception:  # noqa: BLE001
        return -1


def padded(ids, rows, tg):
    """(blocks, ids padded with -1, rows padded with zeros, [n]) for tg-row blocks."""
    import jax.numpy as jnp

    n = ids.shape[0]
    nb = -(-n // tg)
    idp = jnp.pad(ids, (0, nb * tg - n), constant_values=-1)
    rp = jnp.pad(rows, ((0, nb * tg - n), (0, 0)))
    return nb, idp, rp, jnp.full((1,), n, jnp.int32)


def start_by_half(r, copy):
    """Start `copy(h)` for h = r & 1, the half of a 128-lane array row that row r is in
    (one branch a half: a copy's lane slice is static)."""
    from jax.experimental import pallas as pl

    for h in (0, 1):

        @pl.when((r & 1) == h)
        def _(h=h):
            copy(h).start()


def wait_each(count, one, sem):
    """Wait for `count` row copies on `sem`, each as large as the ref `one()`."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    def w(i, c):
        pltpu.make_async_copy(one(), one(), sem).wait()
        return c

    jax.lax.fori_loop(0, count, w, 0)


def half_gather(table, ids, tg, halves):
    """Rows `ids` (64 words each) DMA'd HBM to HBM (an output of the table's
    tiling: a VMEM block of 64 lanes is tiled otherwise, which Mosaic's DMA
    refuses)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from embedmesh.device.ops.tpu import pallas as tpk

    n = ids.shape[0]
    nb = -(-n // tg)
    idp = jnp.pad(ids, (0, nb * tg - n), constant_values=0)
    width = 64 if halves else table.shape[1]

    def kernel(ids_ref, table_ref, out_ref, sem):
        base = pl.program_id(0) * tg

        def start(i, c):
            r = ids_ref[i]
            dst = out_ref.at[pl.ds(base + i, 1)]
            if not halves:
                pltpu.make_async_copy(table_ref.at[pl.ds(r, 1)], dst, sem).start()
                return c
            p = r >> 1
            start_by_half(
                r,
                lambda h: pltpu.make_async_copy(
                    table_ref.at[pl.ds(p, 1), pl.ds(64 * h, 64)], dst, sem
                ),
            )
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
        out_shape=jax.ShapeDtypeStruct((nb * tg, width), jnp.uint32),
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        interpret=tpk._interpret(),
    )(idp, table)[:n]


def half_scatter(table, ids, rows, tg, halves):
    """Rows (64 words each) DMA'd from an HBM array into the table in place."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from embedmesh.device.ops.tpu import pallas as tpk

    nb, idp, rp, meta = padded(ids, rows, tg)

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
            start_by_half(
                r,
                lambda h: pltpu.make_async_copy(
                    src, table_ref.at[pl.ds(p, 1), pl.ds(64 * h, 64)], sem
                ),
            )
            return c

        tpk._unrolled(count, start)
        wait_each(count, lambda: rows_ref.at[pl.ds(0, 1)], sem)

    call = tpk.in_place_rows_call(kernel, table, tg, rows.shape[1], nb, rows_in_hbm=True)
    return call(meta, idp, rp, table)


def lane_half_scatter(table, ids, rows, tg, in_hbm):
    """Rows r into lanes 64 * (r & 1) of the halves table's row r >> 1, from
    `rows` [n, 128] holding each row's words in that same half (source and
    target both lane slices of 128-lane rows: the same tiling)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from embedmesh.device.ops.tpu import pallas as tpk

    nb, idp, rp, meta = padded(ids, rows, tg)

    def kernel(meta_ref, ids_ref, rows_ref, table_in, table_ref, sem):
        del table_in
        base = pl.program_id(0) * tg
        count = jnp.clip(meta_ref[0] - base, 0, tg)
        at = base if in_hbm else 0

        def start(i, c):
            r = ids_ref[i]
            p = r >> 1
            start_by_half(
                r,
                lambda h: pltpu.make_async_copy(
                    rows_ref.at[pl.ds(at + i, 1), pl.ds(64 * h, 64)],
                    table_ref.at[pl.ds(p, 1), pl.ds(64 * h, 64)],
                    sem,
                ),
            )
            return c

        tpk._unrolled(count, start)
        wait_each(count, lambda: rows_ref.at[pl.ds(0, 1), pl.ds(0, 64)], sem)

    call = tpk.in_place_rows_call(kernel, table, tg, 128, nb, rows_in_hbm=in_hbm)
    return call(meta, idp, rp, table)


class HalfRows:
    """The half_rows case: the float32 and bfloat16 baselines, then each layout's DMA
    gather and scatter (checked against numpy), then the lane-halves scatter; `rec`
    collects the figures, an error of one part as `<part>_error`."""

    def __init__(self, p):
        import jax
        import jax.numpy as jnp

        self.rows_s = p.S - p.S % 2
        self.ids_np = np.unique(p.uniq % self.rows_s).astype(np.int32)
        self.ids = jnp.asarray(self.ids_np)
        self.n = int(self.ids.shape[0])
        self.tg = 512 if not p.args.interpret else 128
        self.rec = {"rows": self.n, "table_rows": self.rows_s, "tg": self.tg}
        self.rng = np.random.default_rng(5)
        self.pattern = jnp.asarray(self.rng.integers(0, 2**32, size=(1024, 128), dtype=np.uint32))
        self.xla_take = jax.jit(lambda t, i: jnp.take(t, i, axis=0))

    def run(self):
        self.baselines()
        for layout in ("narrow", "halves", "wide"):  # wide: 128-lane u32 rows, the same DMAs
            self.layout(layout)
        self.lane_halves()
        return self.rec

    def filled(self, shape):
        import jax.numpy as jnp

        reps = -(-shape[0] * shape[1] // (1024 * 128))
        flat = jnp.tile(self.pattern.reshape(-1), reps)[: shape[0] * shape[1]]
        return flat.reshape(shape)

    def attempt(self, key, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self.rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:600]

    def baselines(self):
        """float32 rows of 128 lanes (the fp32 step's rows at dim 64, [w | acc]): XLA's
        gather, the DMA gather and scatter; bfloat16 rows of 128 columns as XLA lays them
        (two rows a word): its gather."""
        import jax
        import jax.numpy as jnp

        from embedmesh.device.ops.tpu import pallas as tpk

        rec, ids, n = self.rec, self.ids, self.n
        f32 = jax.lax.bitcast_convert_type(self.filled((self.rows_s, 128)), jnp.float32)
        rec["f32_bytes"] = size_of(f32)
        rec["f32_xla_gather_ms"] = timeit(self.xla_take, f32, ids)[0] * 1e3
        rec["f32_dma_gather_ms"] = timeit(jax.jit(tpk.gather_rows_dma), f32, ids)[0] * 1e3
        r32 = jnp.ones((n, 128), jnp.float32)
        s32 = jax.jit(tpk.scatter_rows_dma, donate_argnums=0)
        rec["f32_dma_scatter_ms"] = time_in_place(s32, f32, ids, r32)[0] * 1e3
        del f32

        b16 = jnp.full((self.rows_s, 128), 1.5, jnp.bfloat16)
        rec["bf16_bytes"] = size_of(b16)
        rec["bf16_xla_gather_ms"] = timeit(self.xla_take, b16, ids)[0] * 1e3
        del b16

    def layout(self, layout):
        """One layout's DMA gather and in-place scatter, each against numpy, and XLA's
        gather of the same rows (of a halves table: the pair's 128 lanes, then the half)."""
        import jax
        import jax.numpy as jnp

        rec, ids, rows_s = self.rec, self.ids, self.rows_s
        halves = layout == "halves"
        width = 128 if layout == "wide" else 64
        shape = (rows_s // 2, 128) if halves else (rows_s, width)
        table = self.filled(shape)
        rec[f"{layout}_bytes"] = size_of(table)
        host = np.asarray(table)
        want = host.reshape(rows_s, width)[self.ids_np]
        new_rows = jnp.asarray(self.rng.integers(0, 2**32, size=(self.n, width), dtype=np.uint32))

        def gather():
            g = jax.jit(functools.partial(half_gather, tg=self.tg, halves=halves))
            t, got = timeit(g, table, ids)
            rec[f"{layout}_dma_gather_ms"] = t * 1e3
            rec[f"{layout}_dma_gather_equal"] = bool(np.array_equal(np.asarray(got), want))

        self.attempt(f"{layout}_dma_gather", gather)
        if not halves:
            self.attempt(
                "narrow_xla_gather",
                lambda: rec.__setitem__(
                    "narrow_xla_gather_ms", timeit(self.xla_take, table, ids)[0] * 1e3
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
            self.attempt(
                "halves_xla_gather_pick",
                lambda: rec.__setitem__(
                    "halves_xla_gather_pick_ms", timeit(pick, table, ids)[0] * 1e3
                ),
            )

        def scatter():
            sc = jax.jit(
                functools.partial(half_scatter, tg=self.tg, halves=halves), donate_argnums=0
            )
            t, out = time_in_place(sc, table, ids, new_rows)
            rec[f"{layout}_dma_scatter_ms"] = t * 1e3
            expect = host.reshape(rows_s, width).copy()
            expect[self.ids_np] = np.asarray(new_rows)
            rec[f"{layout}_dma_scatter_equal"] = bool(
                np.array_equal(np.asarray(out).reshape(rows_s, width), expect)
            )

        self.attempt(f"{layout}_dma_scatter", scatter)

    def lane_halves(self):
        """`lane_half_scatter` with its rows in HBM and in VMEM, against numpy."""
        import jax
        import jax.numpy as jnp

        rec, ids, rows_s = self.rec, self.ids, self.rows_s
        table = self.filled((rows_s // 2, 128))
        host = np.asarray(table)
        words = self.rng.integers(0, 2**32, size=(self.n, 64), dtype=np.uint32)
        rows = jnp.asarray(np.concatenate([words, words], axis=1))
        expect = host.reshape(rows_s, 64).copy()
        expect[self.ids_np] = words
        for in_hbm in (True, False):
            key = "lane_halves_" + ("hbm" if in_hbm else "vmem") + "_scatter"
            try:
                sc = jax.jit(
                    functools.partial(lane_half_scatter, tg=self.tg, in_hbm=in_hbm),
                    donate_argnums=0,
                )
                t, table = time_in_place(sc, table, ids, rows)
                rec[f"{key}_ms"] = t * 1e3
                rec[f"{key}_equal"] = bool(
                    np.array_equal(np.asarray(table).reshape(rows_s, 64), expect)
                )
            except Exception as e:  # noqa: BLE001
                rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:600]
                table = jnp.asarray(host)


# 2. the pair sums (rows gathered into VMEM, one-hot matmuls) against XLA's take +
# segment_sum, by dim and block sizes (the scalar pair loops they replace, measured on
# 2026-12-04: runs/tpu_probe_2026-12-04_b.txt)


def xla_pairs(p, src, read, write, num):
    import jax
    import jax.numpy as jnp

    return jax.ops.segment_sum(jnp.take(src, read, axis=0) * p.d_g[:, None], write, num)


def pair_inputs(p, dim):
    """Random pair sources [U, dim] and activations [R, dim], and XLA's combine of the
    sources and reduce of the activations (what the kernels must give)."""
    import jax
    import jax.numpy as jnp

    src = jnp.asarray(p.rng.normal(size=(p.U, dim)).astype(np.float32))
    act = jnp.asarray(p.rng.normal(size=(p.R, dim)).astype(np.float32))
    want_c = jax.jit(lambda s: xla_pairs(p, s, p.d_pu, p.d_pr, p.R))(src)
    want_r = jax.jit(lambda a: xla_pairs(p, a, p.d_pr, p.d_pu, p.U))(act)
    return src, act, want_c, want_r


def reduce_kernel(p, dim, **blocks):
    """The kernels' reduce of activations [R, dim] into [U, dim] (`blocks`: tw, tp, unroll)."""
    import jax

    from embedmesh.device.ops.tpu import pallas as tpk

    return jax.jit(
        lambda a: tpk.reduce_sorted(a, p.d_pu, p.d_pr, p.d_g, num_out=p.U, **blocks)[0][:, :dim]
    )


def combine_kernel(p, **blocks):
    """The kernels' combine of sources [U, dim] into [R, dim] (`blocks`: tw, tp, unroll)."""
    import jax

    from embedmesh.device.ops.tpu import pallas as tpk

    return jax.jit(lambda s: tpk.combine(s, p.d_pu, p.d_pr, p.d_g, p.R, **blocks))


def pair_sums(p, dim, blocks_r, blocks_c):
    import jax

    src, act, want_c, want_r = pair_inputs(p, dim)
    rec = {"dim": dim}
    rec["xla_combine_ms"] = (
        timeit(jax.jit(lambda s: xla_pairs(p, s, p.d_pu, p.d_pr, p.R)), src)[0] * 1e3
    )
    rec["xla_reduce_ms"] = (
        timeit(jax.jit(lambda a: xla_pairs(p, a, p.d_pr, p.d_pu, p.U)), act)[0] * 1e3
    )
    for tw, tp in blocks_r:
        try:
            r = reduce_kernel(p, dim, tw=tw, tp=tp)
            time_against(rec, f"reduce_{tw}_{tp}", r, act, want_r)
        except Exception as e:  # noqa: BLE001
            rec[f"reduce_{tw}_{tp}_error"] = f"{type(e).__name__}: {e}"[:800]
    for tw, tp in blocks_c:
        try:
            time_against(rec, f"combine_{tw}_{tp}", combine_kernel(p, tw=tw, tp=tp), src, want_c)
        except Exception as e:  # noqa: BLE001
            rec[f"combine_{tw}_{tp}_error"] = f"{type(e).__name__}: {e}"[:800]
    return rec


# 2b. the pair loop's unrolling: pair rows gathered into VMEM `unroll` a loop turn
# (more independent loads in flight, more wasted reads at the items' ends)
def unrolling(p):
    src, act, want_c, want_r = pair_inputs(p, 128)
    rec = {}
    for tp, unroll in ((512, 4), (512, 8), (512, 16), (512, 32), (1024, 16), (256, 16)):
        if p.args.interpret and (tp, unroll) != (512, 8):
            continue
        try:
            r = reduce_kernel(p, 128, tp=tp, unroll=unroll)
            time_against(rec, f"reduce_tp{tp}_u{unroll}", r, act, want_r)
            c = combine_kernel(p, tp=tp, unroll=unroll)
            time_against(rec, f"combine_tp{tp}_u{unroll}", c, src, want_c)
        except Exception as e:  # noqa: BLE001
            rec[f"tp{tp}_u{unroll}_error"] = f"{type(e).__name__}: {e}"[:800]
    return rec


# 3. an Adagrad update over fused [w | acc] rows (dim 64 -> 128 lanes): one gather and
# one scatter of 117k rows a step where two 128-lane arrays take two of each
def fused_update(p):
    import jax
    import jax.numpy as jnp

    from embedmesh.device.ops.tpu import pallas as tpk

    table = jnp.ones((p.S, 128), jnp.float32)
    gsum = jnp.asarray(p.rng.normal(size=(p.U, 64)).astype(np.float32))

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
        t, table = time_in_place(f, table, p.d_uniq, gsum)
        rec[("dma" if dma else "xla") + "_ms"] = t * 1e3
    return rec


# 4. a DMA a row: gather and in-place scatter, by width and block
def dma_rows(p, w, tg):
    import jax
    import jax.numpy as jnp

    from embedmesh.device.ops.tpu import pallas as tpk

    rows_w = min(p.S, (4 << 30) // (w * 4))
    ids = jnp.asarray(np.unique(p.uniq % rows_w))
    table = jnp.asarray(np.arange(rows_w, dtype=np.float32)[:, None] * np.ones((1, w), np.float32))
    g = jax.jit(lambda t, i: tpk.gather_rows_dma(t, i, tg=tg))
    tg_s, rows = timeit(g, table, ids)
    err = float(jnp.abs(rows[:, 0] - ids.astype(jnp.float32)).max())
    rec = {}
    scatter = jax.jit(lambda t, i, r: tpk.scatter_rows_dma(t, i, r, tg=tg), donate_argnums=0)
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


# 4b. where a DMA-a-row scatter spends its ~41 ns a row: the branch per id, the wait
# per row, the loop, the VMEM staging of the rows (variants of `scatter_rows_dma`)
def scatter_variant(*, branch, waits, unroll, source, tg=512, w=128):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from embedmesh.device.ops.tpu import pallas as tpk

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
        nb, idp, rp, nvalid = padded(ids, rows, tg)
        call = tpk.in_place_rows_call(kernel, table, tg, w, nb, rows_in_hbm=source == "hbm")
        return call(nvalid, idp, rp, table)

    return run


def scatter_variants(p):
    import jax
    import jax.numpy as jnp

    w = 128
    rows_w = min(p.S, (4 << 30) // (w * 4))
    ids = jnp.asarray(np.unique(p.uniq % rows_w))
    table = jnp.zeros((rows_w, w), jnp.float32)
    rows = jnp.asarray(np.random.default_rng(1).normal(size=(ids.shape[0], w)).astype(np.float32))
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


# 5. sorting the pairs on the device (by output row)
def sorts(p):
    import jax
    import jax.numpy as jnp

    key = p.d_pr * jnp.int32(1)
    f = jax.jit(lambda k: jnp.argsort(k, stable=True))
    t1, _ = timeit(f, key)
    f2 = jax.jit(lambda k: jax.lax.sort((k, jnp.arange(k.shape[0], dtype=jnp.int32)), num_keys=1))
    t2, _ = timeit(f2, key)
    return {"argsort_ms": t1 * 1e3, "sort_pair_ms": t2 * 1e3}


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    configure(args)
    p = Probe(args)
    for w in (128, 512):
        p.case(f"xla_gather_scatter_w{w}", lambda w=w: xla_gather_scatter(p, w))
    p.case("sixteen_round", lambda: sixteen_round(p))
    p.case("sixteen_w128", lambda: sixteen(p))
    p.case("sixteen_w256", lambda: sixteen(p, 256))
    p.case("half_rows", lambda: HalfRows(p).run())
    blocks_r = ((256, 512), (512, 512))
    blocks_c = ((128, 512), (256, 512))
    if args.interpret:
        blocks_r = blocks_c = ((64, 128),)
    for dim in (64, 128, 256):
        p.case(f"pair_sums_d{dim}", lambda dim=dim: pair_sums(p, dim, blocks_r, blocks_c))
    p.case("unroll", lambda: unrolling(p))
    p.case("xla_fused_adagrad_update_d64", lambda: fused_update(p))
    for w in (128, 512):
        for tg in (256, 1024):
            p.case(f"dma_rows_w{w}_tg{tg}", lambda w=w, tg=tg: dma_rows(p, w, tg))
    p.case("scatter_variants", lambda: scatter_variants(p))
    p.case("device_sort_pairs", lambda: sorts(p))
    print("done", flush=True)


if __name__ == "__main__":
    main()
