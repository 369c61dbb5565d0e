"""Bytes a device sends per training step, per sharding strategy (issue 15's bytes goal).

The training benchmark's workload (`train_step.py`: 8 tables x 1M x 64, Poisson(10)
Zipf(1.05) ids a sample, sum combiner, Adagrad), each device its own batch of 4096,
on N = 2, 4, 8 CPU devices of one process (virtual: the counts do not depend on
where the devices are). For each strategy, `EmbeddingCore.exchange_bytes` counts the
blocks of the step's all-to-alls a device sends the others, at the capacities the
batch compiled (what crosses between processes; in-process devices read each
other's memory instead). "planned" is the planner's choice for N processes of one
host (`Machine.this_cpu("host_shm")`), measured the same way.

    .venv/bin/python benchmarks/scale/exchange_bytes.py [--devices 2,4,8] [--json out.json]

Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "train"))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import train_step as ts  # noqa: E402  (the workload)

STRATEGIES = ("mod", "row_wise_pooled", "table_wise")


def measure(num_devices: int, sharding, batches):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import embedmesh as em
    from embedmesh.inputs import RaggedTensor

    def const_init(key, shape, dtype):
        return jnp.full(shape, 0.01, dtype)

    fc = {
        f"f{t}": em.FeatureConfig(
            em.TableConfig(ts.V, ts.D, initializer=const_init, combiner="sum", name=f"t{t}")
        )
        for t in range(ts.T)
    }
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
    emb = em.MeshEmbedding(fc, em.Adagrad(ts.LR), mesh=mesh, sharding=sharding)
    # one global batch: each device its own batch of B (the per-process streams)
    feats = {}
    for t in range(ts.T):
        values = np.concatenate([b[t][0] for b in batches[:num_devices]])
        lengths = np.concatenate([b[t][1] for b in batches[:num_devices]])
        feats[f"f{t}"] = RaggedTensor.from_row_lengths(values, lengths)
    csr = emb.enqueue(feats)
    per_stack = emb.core.exchange_bytes(csr)
    return sum(per_stack.values()), emb


def planned_strategies(num_devices: int, batches):
    """The planner's choice for `num_devices` processes on this host."""
    import embedmesh as em
    from embedmesh.config import resolve_feature_config
    from embedmesh.inputs import RaggedTensor, flatten_inputs_like, to_csr
    from embedmesh.layout import planner
    from embedmesh.layout.cost_model import Machine

    fc = {f"f{t}": em.FeatureConfig(em.TableConfig(ts.V, ts.D, name=f"t{t}")) for t in range(ts.T)}
    resolved = resolve_feature_config(fc)
    feats = {f"f{t}": RaggedTensor.from_row_lengths(*batches[0][t]) for t in range(ts.T)}
    flat = flatten_inputs_like(resolved, feats)
    csrs = [to_csr(n, f, x) for n, f, x in zip(resolved.feature_names, resolved.features, flat)]
    opt = em.Adagrad(ts.LR)
    stats = planner.table_stats(resolved, {t: opt for t in resolved.table_names}, csrs)
    chosen, result = planner.plan(
        stats,
        {t: "auto" for t in resolved.table_names},
        num_devices,
        ts.B,
        Machine.this_cpu("host_shm"),
    )
    return chosen, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="2,4,8")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    batches = [ts.make_batches(0, stream=s)[0] for s in range(8)]
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        got = {}
        for s in STRATEGIES:
            got[s], _ = measure(n, s, batches)
        chosen, result = planned_strategies(n, batches)
        got["planned"], _ = measure(n, chosen, batches)
        picks = sorted(set(chosen.values()))
        rows.append(dict(devices=n, bytes=got, planned=chosen))
        print(
            f"N={n}: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in got.items())
            + f"; planned = {'+'.join(picks)}: {got['mod'] / max(got['planned'], 1):.2f}x fewer "
            f"bytes than the row exchange (mod)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
