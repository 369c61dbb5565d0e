"""embedmesh on v5e slices it has never run on: the step compiled ahead of time for each
topology, and the step the cost model predicts there.

Sections, in order, all in one process on the one v5e chip the project is lent:

1. calibrate: the single-chip row costs the model takes, measured on the chip in this
   run (XLA's gather and in-place scatter of `train_step.py`'s distinct rows, 128-lane
   rows with the Adagrad slot: 256 floats; the pair sums of its pairs), median of 10.
2. for `train_step.py`'s workload (8 tables x 1M x 64, global batch 4096, Poisson(10)
   Zipf(1.05) ids, Adagrad) and MLPerf DLRM-DCNv2's embedding (26 tables, the Criteo 1TB
   cardinalities capped at 40M, dim 128, its multi-hot sizes, global batch 65536, Adagrad:
   `DLRM_CARDINALITIES`, `DLRM_MULTI_HOT`), on each topology (`--topologies`):
   - the plan `sharding="auto"` makes there (`planner.plan` over `Machine.tpu_v5e` of the
     slice with the calibrated row costs), the bytes a chip needs under it (the state the
     built layout holds and the step's own, `embedmesh.layout.step_memory`, by term) and
     the step it predicts; or that it does not fit in 15.7 GiB a chip;
   - the step compiled for the slice (`tpu_aot`: abstract devices, no arrays): per-chip
     bytes from `memory_analysis()` beside the estimate's terms at the compiled batch's
     capacities, the collectives in the HLO and the bytes a chip
     sends over ICI in them, against the cost model's.
3. the number of v5e chips DLRM-DCNv2's embedding fits on by the planner's memory rule
   (the smallest slice with a plan), and its predicted step there (run right after 1,
   before any compile: a compiler abort ends the process).

    python benchmarks/tpu_scale.py --out DIR                 # on the chip (docs/tpu.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "train"))
sys.path.insert(0, os.path.dirname(HERE))

GIB = 2**30
TOPOLOGIES = ("2x2", "2x4", "4x4", "8x8")
# MLPerf training's DLRM-DCNv2 (recommendation_v2, TorchRec reference): the Criteo 1TB
# cardinalities with the 40M cap applied, and each feature's multi-hot size
DLRM_CARDINALITIES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
DLRM_MULTI_HOT = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
DLRM_BATCH, DLRM_DIM = 65536, 128


def median_s(fn, n=10):
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate() -> dict:
    """Row costs on this chip: gather / scatter of U distinct 256-float rows of a 1M-row
    table, P pairs summed into R rows of 128 floats (train_step's U, P, R)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    v, u, p, r = 1_000_000, 117_295, 308_894, 8 * 4096
    table = jnp.asarray(rng.standard_normal((v, 256), np.float32))
    ids = jnp.asarray(np.sort(rng.choice(v, u, replace=False)).astype(np.int32))
    rows = jnp.asarray(rng.standard_normal((u, 256), np.float32))
    src = jnp.asarray(rng.standard_normal((u, 128), np.float32))
    pair_src = jnp.asarray(rng.integers(0, u, p).astype(np.int32))
    pair_dst = jnp.asarray(np.sort(rng.integers(0, r, p)).astype(np.int32))
    gains = jnp.asarray(rng.random(p, np.float32))
    gather = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
    scatter = jax.jit(
        lambda t, i, x: t.at[i].set(x, unique_indices=True, indices_are_sorted=True),
        donate_argnums=0,
    )
    pairs = jax.jit(
        lambda s, a, b, g: jax.ops.segment_sum(s[a] * g[:, None], b, r, indices_are_sorted=True)
    )
    t_gather = median_s(lambda: gather(table, ids))
    state = {"t": table}

    def one_scatter():
        state["t"] = scatter(state["t"], ids, rows)
        return state["t"]

    t_scatter = median_s(one_scatter)
    t_pairs = median_s(lambda: pairs(src, pair_src, pair_dst, gains))
    return {
        "gather_rows_per_s": u / t_gather,
        "scatter_rows_per_s": u / t_scatter,
        "pair_ns": t_pairs / p * 1e9,
        "read_row_s": t_gather / u,
        "update_row_s": (t_gather + t_scatter) / u / 2,  # a [w | acc] row: 2 arrays
        "pair_row_s": t_pairs / p,
    }


def train_step_workload():
    """(feature config, global batch as host inputs, table stats for the model, batch)."""
    import train_step

    import embedmesh as em
    from embedmesh.inputs import RaggedTensor
    from embedmesh.layout.cost_model import TableStats

    batch = 4096
    (feats,) = train_step.make_batches(vocab=1_000_000, batch=batch, num=1)
    fc = {
        f"f{t}": em.FeatureConfig(em.TableConfig(1_000_000, 64, combiner="sum", name=f"t{t}"))
        for t in range(8)
    }
    inputs = {f"f{t}": RaggedTensor.from_row_lengths(*feats[t]) for t in range(8)}
    stats = [
        TableStats(f"t{t}", 1_000_000, 64, 4, 1, float(train_step.VALENCY), 1.05) for t in range(8)
    ]
    return fc, inputs, stats, batch


def dlrm_ids(rng, v: int, m: int, b: int) -> np.ndarray:
    """[b, m] ids as MLPerf's synthetic multi-hot: a Zipf(~1) draw a sample (rank
    `v ** u`, scattered over the table by a multiplicative hash), expanded to `m` ids
    by fixed offsets."""
    ranks = np.minimum(np.floor(np.power(float(v), rng.random(b))).astype(np.int64) - 1, v - 1)
    base = (ranks * 2654435761) % v
    offsets = rng.integers(0, v, m) if m > 1 else np.zeros(1, np.int64)
    return ((base[:, None] + offsets[None, :]) % v).astype(np.int32)


def dlrm_workload(with_inputs: bool = True):
    import embedmesh as em
    from embedmesh.layout.cost_model import TableStats

    rng = np.random.default_rng(0)
    fc, inputs, stats = {}, {}, []
    for t, (v, m) in enumerate(zip(DLRM_CARDINALITIES, DLRM_MULTI_HOT)):
        fc[f"f{t}"] = em.FeatureConfig(em.TableConfig(v, DLRM_DIM, combiner="sum", name=f"t{t}"))
        if with_inputs:  # multi-hot, pooled (sum): ragged rows of m ids, as MLPerf's model
            ids = dlrm_ids(rng, v, m, DLRM_BATCH)
            lengths = np.full(DLRM_BATCH, m, np.int64)
            inputs[f"f{t}"] = em.RaggedTensor.from_row_lengths(ids.reshape(-1), lengths)
        stats.append(TableStats(f"t{t}", v, DLRM_DIM, 4, 1, float(m), 1.05, hot_group=m))
    return fc, inputs, stats, DLRM_BATCH


def plan_on(fc, stats, n, batch, machine, requested="auto"):
    """(strategies, Plan, the bytes a chip needs by term: a `StepMemory`) of `requested`
    on n chips, or the error. The memory rule is the planner's: the state and the step's
    own bytes (`embedmesh.layout.step_memory`, the batch estimated from `stats`)."""
    import embedmesh as em
    from embedmesh.config import resolve_feature_config
    from embedmesh.layout import planner
    from embedmesh.layout.stacking import dim_multiple_for, slots_in_rows_for

    resolved = resolve_feature_config(fc)
    stacking = dict(
        default_optimizer=em.Adagrad(0.01),
        dim_multiple=dim_multiple_for("tpu"),
        slots_in_rows=slots_in_rows_for("tpu"),
    )
    b = -(-batch // n)
    memory_of = planner.layout_memory(resolved, n, stats=stats, batch_per_device=b, **stacking)
    chosen, plan = planner.plan(
        stats,
        {t: requested for t in resolved.table_names},
        n,
        b,
        machine,
        memory_limit=machine.memory_per_device,
        memory_of=memory_of,
    )
    layout = planner.stacking_for(resolved, n, chosen, **stacking)
    needs = planner.step_memory_for(layout, chosen, stats, b, lanes=stacking["dim_multiple"])
    assert needs.total == max(memory_of(chosen))
    return chosen, plan, needs


def case(fc, inputs, stats, batch, topo, costs, compile_it, sharding="auto"):
    import tpu_aot

    import embedmesh as em
    from embedmesh.layout import planner
    from embedmesh.layout.cost_model import Machine

    mesh = tpu_aot.topology_mesh(f"v5e:{topo}")
    n = mesh.size
    shape = planner.tpu_slice_shape(list(mesh.devices.flat))
    machine = Machine.tpu_v5e(shape, **costs)
    rec = {"topology": topo, "chips": n, "slice": shape, "ici_GBps": machine.intra.bandwidth / 1e9}
    try:
        chosen, plan, needs = plan_on(fc, stats, n, batch, machine, sharding)
    except ValueError as e:
        rec["fits"] = False
        rec["plan_error"] = str(e)[:600]
        return rec
    rec.update(
        fits=True,
        strategies=sorted(set(chosen.values())),
        planned_bytes_per_chip=needs.state,  # the state a chip holds
        planned_step_bytes_per_chip=needs.step,  # the step's own, from the statistics
        planned_terms=dataclasses.asdict(needs),
        predicted_step_ms=plan.step_time_s * 1e3,
        model_bytes_per_chip_moved=plan.max_bytes_per_device,
    )
    if compile_it:
        t0 = time.perf_counter()
        step = tpu_aot.abstract_step(fc, inputs, em.Adagrad(0.01), mesh, chosen)
        got = tpu_aot.compile_step(step)
        sent = tpu_aot.sent_bytes(got["collectives"], n)
        rec.update(
            compile_s=time.perf_counter() - t0,
            memory=got["memory"],
            per_chip_bytes=got["per_chip_bytes"],
            state_bytes=got["state_bytes"],
            # the estimate at the compiled batch's capacities, by term, and the ratio
            estimated_bytes=got["estimated_bytes"],
            estimate=got["estimate"],
            compiled_over_estimated=got["per_chip_bytes"] / got["estimated_bytes"],
            compiled_over_state=got["per_chip_bytes"] / got["state_bytes"],
            collectives=got["collectives"],
            hlo_bytes_sent_per_chip=sent,
            core_exchange_bytes=got["exchange_bytes"],
            ici_ms_at_hlo_bytes=sent / machine.intra.bandwidth * 1e3,
        )
    return rec


def memory_line(rec: dict) -> str:
    """A compiled case's bytes a chip beside the estimate's terms (GB)."""
    e, gb = rec["estimate"], 1e9
    return (
        f"{rec['workload']} {rec['topology']}: compiled {rec['per_chip_bytes'] / gb:.3f} GB "
        f"(temp {rec['memory']['temp'] / gb:.3f}); estimated {rec['estimated_bytes'] / gb:.3f}"
        f" = state {e['state'] / gb:.3f} + batch {e['batch'] / gb:.4f} + activations "
        f"{e['activations'] / gb:.4f} + gradients {e['gradients'] / gb:.4f} + temporaries "
        f"{e['temporaries'] / gb:.3f} ({e['phase']}); compiled / estimated "
        f"{rec['compiled_over_estimated']:.3f} (/ state {rec['compiled_over_state']:.3f})"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument(
        "--dlrm-compile",
        default="4x4,4x8,8x8",
        help="topologies to compile DLRM for (the smallest slice it fits on is planned "
        "first, before any compile)",
    )
    ap.add_argument("--workloads", default="train_step,dlrm_dcnv2")
    ap.add_argument(
        "--train-step-topologies",
        default=None,
        help="topologies for train_step's workload (default: --topologies)",
    )
    ap.add_argument("--budget", type=float, default=500.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget
    import jax

    os.makedirs(args.out, exist_ok=True)
    data = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "cases": []}
    path = os.path.join(args.out, "tpu_scale.json")

    def save():
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)

    data["calibration"] = cal = calibrate() if jax.devices()[0].platform == "tpu" else {}
    print(json.dumps(cal), flush=True)
    costs = {k: cal[k] for k in ("read_row_s", "update_row_s", "pair_row_s") if k in cal}
    # DLRM: the smallest slice it fits on
    from embedmesh.layout.cost_model import Machine

    fc, _, stats, batch = dlrm_workload(with_inputs=False)
    for shape in ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)):
        n = shape[0] * shape[1]
        try:
            chosen, plan, needs = plan_on(fc, stats, n, batch, Machine.tpu_v5e(shape, **costs))
        except ValueError:
            continue
        data["dlrm_fits"] = {
            "slice": shape,
            "chips": n,
            "bytes_per_chip": needs.total,
            "terms": dataclasses.asdict(needs),
            "predicted_step_ms": plan.step_time_s * 1e3,
            "strategies": {t: s for t, s in chosen.items()},
        }
        break
    save()
    print(json.dumps(data.get("dlrm_fits")), flush=True)
    topologies = args.topologies.split(",")
    workloads = (("train_step", train_step_workload), ("dlrm_dcnv2", dlrm_workload))
    for name, make in workloads:
        if name not in args.workloads.split(","):
            continue
        fc, inputs, stats, batch = make()
        chosen_topologies = topologies
        if name == "train_step" and args.train_step_topologies:
            chosen_topologies = args.train_step_topologies.split(",")
        for topo in chosen_topologies:
            compile_it = name == "train_step" or topo in args.dlrm_compile.split(",")
            if time.monotonic() > deadline:
                compile_it = False
            try:
                rec = case(fc, inputs, stats, batch, topo, costs, compile_it)
            except Exception as e:  # noqa: BLE001 - a case's failure is its result
                rec = {"topology": topo, "error": f"{type(e).__name__}: {e}"[:1500]}
                rec["traceback"] = traceback.format_exc()[-2000:]
            rec["workload"] = name
            data["cases"].append(rec)
            save()
            print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
            if "estimated_bytes" in rec:
                print(memory_line(rec), flush=True)


if __name__ == "__main__":
    main()
