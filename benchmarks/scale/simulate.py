"""Scaling simulator (issue 15, item 5): predicted step time and bytes per device for
N = 1, 2, 4, ..., 1024 devices under each sharding strategy and the planner's mix, from
the cost model `embedmesh.layout.cost_model` (no jax, no devices: a model).

Shapes:
  train   the training benchmark (`benchmarks/train/train_step.py`): 8 tables x 1M rows x 64
          float32, Poisson(10) ids per sample Zipf(1.05), sum, Adagrad; global batch
          4096 as measured (strong scaling: 4096 / N samples per device).
  dlrm    MLPerf DLRM-DCNv2 (Criteo 1TB multi-hot): 26 tables of the MLPerf reference
          sizes (40M .. 3), multi-hot sizes 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,
          27,10,3,1,1 (214 ids per sample), dim 128 float32, Adagrad; global batch
          55,296 (strong scaling; the reference's is 65,536). Ids: each one-hot id,
          Zipf(1.05) over the table (an ASSUMPTION: Criteo's true frequencies are not
          modelled), expands to `multi_hot_size` ids fixed by it (`hot_group`).

Machines: `Machine.this_cpu()` (calibrated here) for the measured in-process points,
`Machine.h100_cluster()` (a datasheet projection) for N past this machine.

    PYTHONPATH=. .venv/bin/python benchmarks/scale/simulate.py             # tables + plot
    ... --calibrate        # fit the CPU overhead constants to the measured points
    ... --measure          # a few seconds of numpy row-read/write microbenchmarks
    ... --measured FILE    # more measured points (JSON list, see MEASURED_FORMAT)
    ... --markdown OUT.md  # write the tables as markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from embedmesh.layout import cost_model as cm  # noqa: E402
from embedmesh.layout.cost_model import Machine, TableStats  # noqa: E402

NS = [2**i for i in range(11)]  # 1 .. 1024
RUN_FILE = os.path.join(os.path.dirname(HERE), "runs", "train_run_2026-12-01_ndev.txt")
TRAIN_GLOBAL_BATCH = 4096
DLRM_GLOBAL_BATCH = 55_296
DLRM_VOCAB = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
DLRM_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
# DCNv2 dense part per sample, forward: bottom MLP 13-512-256-128 (0.17 M MACs), 3
# low-rank (512) cross layers on 27 x 128 = 3456 inputs (10.6 M), top MLP
# 3456-1024-1024-512-256-1 (5.2 M): ~16 M MACs = 32 MFLOP; forward + backward ~3x.
DLRM_DENSE_FLOPS_PER_SAMPLE = 3 * 2 * 16.0e6
MLPERF = {"n": 128, "samples_per_s": 65e6, "label": "MLPerf HugeCTR, 16 DGX H100"}
MEASURED_FORMAT = """[{"shape": "train", "n": 2, "step_ms": 40.0, "transport": "gloo",
  "label": "2 processes, gloo"}, ...]   (transport: shm | xla | gloo)"""


def train_tables():
    return [
        TableStats(f"t{i}", 1_000_000, 64, slots=1, ids_per_sample=10, zipf_a=1.05)
        for i in range(8)
    ]


def dlrm_tables():
    assert sum(DLRM_HOT) == 214 and len(DLRM_VOCAB) == 26
    return [
        TableStats(f"c{i}", v, 128, slots=1, ids_per_sample=h, zipf_a=1.05, hot_group=h)
        for i, (v, h) in enumerate(zip(DLRM_VOCAB, DLRM_HOT))
    ]


SHAPES = {
    "train": (train_tables, TRAIN_GLOBAL_BATCH),
    "dlrm": (dlrm_tables, DLRM_GLOBAL_BATCH),
}


def measured_points(extra_file=None):
    """The in-process points of RUN_FILE (device-step medians), plus `extra_file`'s."""
    pts = []
    if os.path.exists(RUN_FILE):
        pat = re.compile(r"^\s+embedmesh(?:-(\d)dev)?\s+\S+ ms\s+(\S+) ms")
        for line in open(RUN_FILE):
            mt = pat.match(line)
            if mt:
                n = int(mt.group(1) or 1)
                pts.append(
                    {
                        "shape": "train",
                        "n": n,
                        "step_ms": float(mt.group(2)),
                        "transport": "shm",
                        "label": f"measured, {n} in-process CPU device(s)",
                    }
                )
    if extra_file:
        with open(extra_file) as f:
            pts.extend(json.load(f))
    return pts


def predict(shape, machine, n, strategy):
    """(step seconds, max bytes per device, feasible) of `shape` on n devices under one
    strategy for every table ("plan": the planner's mix)."""
    make, global_batch = SHAPES[shape]
    tables = make()
    b = global_batch // n
    if b < 1:
        return None
    if strategy == "plan":
        try:
            plan = cm.plan_tables(tables, n, machine, batch_per_device=b)
        except ValueError:
            return None
        return plan.step_time_s, plan.max_bytes_per_device, True, plan
    items = [(t, cm.strategy_cost(strategy, t, n, b, machine)) for t in tables]
    total, d = cm.plan_step_time(items, machine, return_detail=True)
    fits = float(d["memory"].max()) <= machine.memory_per_device
    return total, float(d["bytes"].max()), fits, None


def sensitivity(gpu, n=128):
    """The DLRM prediction at n devices when one assumption changes."""
    b = DLRM_GLOBAL_BATCH // n
    base_tables = dlrm_tables()
    fp16 = [dataclasses.replace(t, bytes_per_element=2) for t in base_tables]
    skew = [dataclasses.replace(t, zipf_a=1.2) for t in base_tables]
    ib = dataclasses.replace(gpu.inter, bandwidth=50e9)
    nvl = dataclasses.replace(gpu.intra, bandwidth=450e9)
    full_links = dataclasses.replace(gpu, inter=ib, intra=nvl)
    cases = [
        ("as above (fp32 rows, Zipf 1.05, IB 40 GB/s/GPU, NVLink 315 GB/s)", base_tables, gpu),
        ("links at datasheet peak (IB 50, NVLink 450 GB/s)", base_tables, full_links),
        ("fp16 tables and messages", fp16, gpu),
        ("ids more skewed: Zipf 1.2", skew, gpu),
        ("all three", [dataclasses.replace(t, bytes_per_element=2) for t in skew], full_links),
    ]
    lines = [
        "| assumption | embedding ms | step ms | M samples/s | per GPU |",
        "|---|---|---|---|---|",
    ]
    for label, tables, m in cases:
        plan = cm.plan_tables(tables, n, m, batch_per_device=b)
        t = plan.step_time_s + dense_time(b, m)
        lines.append(
            f"| {label} | {plan.step_time_s * 1e3:.3g} | {t * 1e3:.3g} | "
            f"{DLRM_GLOBAL_BATCH / t / 1e6:.3g} | {DLRM_GLOBAL_BATCH / t / n / 1e3:.0f} K |"
        )
    return "\n".join(lines)


def dense_time(n_samples, machine):
    return n_samples * DLRM_DENSE_FLOPS_PER_SAMPLE / machine.dense_flops


def sweep(shape, machine, strategies=cm.STRATEGIES + ("plan",)):
    rows = {}
    for s in strategies:
        for n in NS:
            r = predict(shape, machine, n, s)
            if r is not None:
                rows[(s, n)] = r
    return rows


# ---------------------------------------------------------------------------
# calibration against this machine's measured points


def _cpu_row_wise(n, machine):
    tables = train_tables()
    b = TRAIN_GLOBAL_BATCH // n
    items = [(t, cm.strategy_cost("row_wise_rows", t, n, b, machine)) for t in tables]
    return cm.plan_step_time(items, machine, return_detail=True)


def calibrate(points, verbose=True):
    """Fit step_overhead_s (per device program: N of them share the 2 cores) and the
    shm rendezvous's per_peer_s (4 collectives a step) to the measured in-process
    points by non-negative least squares; the compute constants stay as measured
    (runs/train-history.md, table 3), not fitted."""
    pts = [p for p in points if p["shape"] == "train" and p["transport"] == "shm"]
    base = Machine.this_cpu(step_overhead_s=0.0)
    base = Machine.this_cpu(
        step_overhead_s=0.0,
        intra=cm.Link(base.intra.name, base.intra.bandwidth, 0.0, 0.0, zero_copy=True),
        inter=cm.Link(base.intra.name, base.intra.bandwidth, 0.0, 0.0, zero_copy=True),
    )
    y, a = [], []
    for p in pts:
        n = p["n"]
        t0, _ = _cpu_row_wise(n, base)
        colls = 4 if n > 1 else 0
        y.append(p["step_ms"] * 1e-3 - t0)
        a.append([n, colls * (n - 1)])
    y, a = np.asarray(y), np.asarray(a, dtype=np.float64)
    best = None
    for mask in ((1, 1), (1, 0), (0, 1)):  # NNLS over two unknowns: try the faces
        cols = [i for i in range(2) if mask[i]]
        x = np.zeros(2)
        sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (sol < 0).any():
            continue
        x[cols] = sol
        err = float(((a @ x - y) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, x)
    overhead, per_peer = best[1]
    if verbose:
        print(
            f"calibration on {len(pts)} points: compute from runs/train-history.md, table 3 "
            f"(N=1 kernels alone: {_cpu_row_wise(1, base)[0] * 1e3:.2f} ms); fitted "
            f"step_overhead_s = {overhead * 1e6:.0f} us per device program, shm "
            f"per_peer_s = {per_peer * 1e6:.0f} us per collective per extra device"
        )
    return overhead, per_peer


def compare_measured(points, machine_for):
    lines = ["| measured point | measured | model | model / measured |", "|---|---|---|---|"]
    for p in points:
        m = machine_for(p["transport"])
        t, _ = _cpu_row_wise(p["n"], m)
        lines.append(
            f"| {p['label']} | {p['step_ms']:.1f} ms | {t * 1e3:.1f} ms | "
            f"{t * 1e3 / p['step_ms']:.2f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# microbenchmark (--measure): a few seconds of numpy, for comparison only


def measure():
    rng = np.random.default_rng(0)
    rows, d = 1 << 20, 64  # 256 MB of 256-byte rows
    table = np.ones((rows, d), np.float32)
    ids = rng.integers(0, rows, 1 << 20)
    out = np.empty((ids.size, d), np.float32)
    np.take(table, ids[:1000], axis=0, out=out[:1000])
    best = min(_timed(lambda: np.take(table, ids, axis=0, out=out)) for _ in range(3))
    print(f"numpy random 256-byte row gather, 256 MB table: {best / ids.size * 1e9:.1f} ns/row")
    big = np.empty(table.size, np.float32)
    best = min(_timed(lambda: big.fill(1.0)) for _ in range(3))
    print(f"sequential write (fill) of 256 MB: {table.nbytes / best / 1e9:.1f} GB/s")
    print("(numpy's loop is not the C++ kernels'; the model keeps table 3's kernel figures)")


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


# ---------------------------------------------------------------------------
# output


LABELS = {
    "data_parallel": "data parallel",
    "table_wise": "table-wise",
    "row_wise_rows": "row-wise, rows back (today)",
    "row_wise_pooled": "row-wise, pooled partials",
    "column_wise": "column-wise",
    "table_row_wise": "table-row-wise",
    "plan": "planner's mix",
}


def markdown_table(shape, machine, rows, dense=False):
    global_batch = SHAPES[shape][1]
    strategies = list(LABELS)
    head = "| N | b/device | " + " | ".join(LABELS[s] for s in strategies) + " |"
    lines = [
        f"{shape} on {machine.name}: predicted step ms (M samples/s); bytes per device "
        "sent + received per step, MB. `OOM`: over the memory per device.",
        "",
        head,
        "|" + "---|" * (len(strategies) + 2),
    ]
    for n in NS:
        if (strategies[0], n) not in rows:
            continue
        cells = []
        for s in strategies:
            r = rows.get((s, n))
            if r is None:
                cells.append("-")
                continue
            t, by, fits, _ = r
            if dense:
                t = t + dense_time(global_batch // n, machine)
            cell = f"{t * 1e3:.3g} ({global_batch / t / 1e6:.3g}); {by / 1e6:.3g} MB"
            cells.append(cell if fits else f"OOM ({cell})")
        lines.append(f"| {n} | {global_batch // n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plan_summary(shape, machine, rows):
    out = []
    for n in NS:
        r = rows.get(("plan", n))
        if r is None or r[3] is None:
            continue
        counts = {}
        for s in r[3].strategies.values():
            counts[s] = counts.get(s, 0) + 1
        mix = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        out.append(f"N={n}: {mix}")
    return f"planner's mix ({shape}, {machine.name}): " + "; ".join(out)


def plot(path, sims, points, cpu_machines):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    colors = dict(zip(LABELS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for row, shape in enumerate(("train", "dlrm")):
        machine, rows = sims[shape]
        gb = SHAPES[shape][1]
        ax_t, ax_b = axes[row]
        for s in LABELS:
            ns = [n for n in NS if (s, n) in rows]
            if not ns:
                continue
            fits = [rows[(s, n)][2] for n in ns]
            sps = [gb / rows[(s, n)][0] for n in ns]
            nb = [n for n in ns if n > 1]  # one device moves nothing
            by = [rows[(s, n)][1] for n in nb]
            style = dict(color=colors[s], lw=2.5 if s == "plan" else 1.3, label=LABELS[s])
            ax_t.plot(ns, sps, "-", **style)
            over = [(n, v) for n, v, f in zip(ns, sps, fits) if not f]
            if over:
                ax_t.plot(*zip(*over), "x", color=colors[s], ms=7)
            ax_b.plot(nb, by, "-", **style)
        if shape == "dlrm":
            ns = [n for n in NS if ("plan", n) in rows]
            dense = [gb / (rows[("plan", n)][0] + dense_time(gb // n, machine)) for n in ns]
            ax_t.plot(ns, dense, "--", color=colors["plan"], label="planner's mix + dense DCNv2")
            label = MLPERF["label"] + " (65 M samples/s)"
            ax_t.plot([MLPERF["n"]], [MLPERF["samples_per_s"]], "*", ms=16, color="k", label=label)
        if shape == "train":
            for transport, cpu in cpu_machines.items():
                ns = [1, 2, 4, 8, 16]
                sps = [gb / _cpu_row_wise(n, cpu)[0] for n in ns]
                label = f"CPU model, this machine ({transport}), row-wise rows"
                ax_t.plot(ns, sps, ":", marker=".", lw=1.8, label=label)
            for p in points:
                if p["shape"] == "train":
                    color = "k" if p["transport"] == "shm" else "r"
                    sps = gb / (p["step_ms"] * 1e-3)
                    ax_t.plot([p["n"]], [sps], "o", ms=8, mfc="none", color=color)
            ax_t.plot([], [], "o", mfc="none", color="k", label="measured, this machine (shm)")
            if any(p["transport"] != "shm" for p in points if p["shape"] == "train"):
                ax_t.plot([], [], "o", mfc="none", color="r", label="measured (--measured)")
        title = {
            "train": "training benchmark: 8 x 1M x 64, 10 ids/sample, global batch 4096",
            "dlrm": "MLPerf DLRM-DCNv2: 26 tables, 214 ids/sample, dim 128, global batch 55,296",
        }[shape]
        ax_t.set_title(f"{title}\n{machine.name}: samples/s (x: over memory)", fontsize=9)
        ax_b.set_title(f"{shape}: bytes sent + received per device per step", fontsize=9)
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("devices N")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_ylabel("samples / s (predicted)")
        ax_b.set_ylabel("bytes / device / step")
        ax_t.legend(fontsize=7)
    fig.suptitle("embedmesh cost model (embedmesh/layout/cost_model.py): a model, not measurements")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--measured", help="JSON file of more measured points")
    ap.add_argument("--markdown", help="write the tables here")
    ap.add_argument("--plot", default=os.path.join(HERE, "scaling.png"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    if args.measure:
        measure()
        return
    points = measured_points(args.measured)
    if args.calibrate:
        overhead, per_peer = calibrate(points)
        d = Machine.this_cpu()
        print(
            f"Machine.this_cpu() holds step_overhead_s = {d.step_overhead_s * 1e6:.0f} us, "
            f"per_peer_s = {d.intra.per_peer_s * 1e6:.0f} us"
        )
        return

    def cpu(transport):
        return Machine.this_cpu(transport)

    out = []
    out.append("### Calibration: this machine, the training benchmark, row-wise rows\n")
    overhead, per_peer = calibrate(points, verbose=False)
    out.append(
        "Compute constants from runs/train-history.md, table 3 (not fitted); fitted to the "
        f"points below: step_overhead_s = {overhead * 1e6:.0f} us, shm per_peer_s = "
        f"{per_peer * 1e6:.0f} us per collective per extra device.\n"
    )
    out.append(compare_measured(points, cpu))
    gpu = Machine.h100_cluster()
    sims = {}
    for shape in ("train", "dlrm"):
        rows = sweep(shape, gpu)
        sims[shape] = (gpu, rows)
        out.append(f"\n### {shape}: embedding step only\n")
        out.append(markdown_table(shape, gpu, rows))
        out.append("\n" + plan_summary(shape, gpu, rows))
    _, rows = sims["dlrm"]
    out.append("\n### dlrm: the planner's mix + the dense DCNv2 part (400 TFLOP/s per GPU)\n")
    out.append("| N | b/device | embedding ms | dense ms | step ms | M samples/s | per GPU |")
    out.append("|---|---|---|---|---|---|---|")
    for n in NS:
        r = rows.get(("plan", n))
        if r is None:
            continue
        b = DLRM_GLOBAL_BATCH // n
        tdense = dense_time(b, gpu)
        t = r[0] + tdense
        out.append(
            f"| {n} | {b} | {r[0] * 1e3:.3g} | {tdense * 1e3:.3g} | {t * 1e3:.3g} | "
            f"{DLRM_GLOBAL_BATCH / t / 1e6:.3g} | {DLRM_GLOBAL_BATCH / t / n / 1e3:.0f} K |"
        )
    out.append("\n### dlrm at N=128: what moves the prediction (planner's mix + dense)\n")
    out.append(sensitivity(gpu))
    plan128 = rows[("plan", 128)][3]
    out.append(
        "\nplanner at N=128 (DLRM, H100 projection):\n\n```\n" + plan128.describe() + "\n```"
    )
    text = "\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if not args.no_plot:
        machines = {"shm": cpu("shm"), "host_shm": cpu("host_shm"), "gloo": cpu("gloo")}
        plot(args.plot, sims, points, machines)


if __name__ == "__main__":
    main()
