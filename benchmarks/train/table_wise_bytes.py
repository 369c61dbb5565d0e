"""Bytes a device holds under table-wise placement, against its largest owner's own bytes.

A stacked array is evenly sharded, so every device holds every stack's block: its
fullest shard's rows at the stack's width. Under table-wise placement each table has an
owner, and the bytes a device holds would ideally be its owner's own: its tables' rows at
their own dims, parameters and optimizer slots. This prints, for several mixes of tables
and device counts, the plan's bytes a device (`StackingPlan.bytes_per_device`, what the
built arrays' shards measure) and the largest owner's own bytes (the rows each shard holds
of each table, at the table's own dim), and their ratio. Pure planning: no device, no
timing.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/train/table_wise_bytes.py
    ... --check 1.25     # exit 1 where a mix holds more than 1.25x its largest owner's
    ... --built          # also build the first mixes on virtual CPU devices: per device,
                         # the arrays' shards' bytes against its own and the largest
                         # owner's, every table whole (before spreading) and as planned
"""

from __future__ import annotations

import argparse
import os
import sys

# --built places tables on virtual CPU devices: more of them than any mix uses
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

from embedmesh.config import FeatureConfig, TableConfig
from embedmesh.layout import stacking
from embedmesh.layout.stacking import plan_stacking
from embedmesh.optimizers import SGD, Adagrad, Adam

# (name, [(vocabulary size, dim), ...], devices, optimizer)
MIXES = [
    ("issue: dims 32/16/48/8", [(100000, 32), (100000, 16), (24000, 48), (52000, 8)], 4, "adagrad"),
    (
        "dims 32/16/48/8, equal rows",
        [(50000, 32), (50000, 16), (50000, 48), (50000, 8)],
        4,
        "adagrad",
    ),
    (
        "rows 1M..1k, dims 64/64/128/32",
        [(1000000, 64), (100000, 64), (1000, 128), (30000, 32)],
        4,
        "adagrad",
    ),
    ("2 devices, 3 tables", [(200000, 32), (150000, 32), (20000, 64)], 2, "adagrad"),
    ("2 devices, wide small table", [(300000, 16), (10000, 128)], 2, "sgd"),
    (
        "8 devices, 10 tables",
        [
            (500000, 64),
            (400000, 32),
            (300000, 16),
            (250000, 64),
            (100000, 128),
            (80000, 8),
            (60000, 48),
            (20000, 256),
            (5000, 64),
            (1000, 32),
        ],
        8,
        "adagrad",
    ),
    (
        "8 devices, 4 tables (fewer than devices)",
        [(100000, 64), (50000, 128), (10000, 256), (2000, 16)],
        8,
        "adam",
    ),
    ("8 devices, 12 equal tables", [(100000, 32)] * 12, 8, "adagrad"),
    (
        "8 devices, 10 tables of 8 widths",
        [
            (113089, 40),
            (116518, 184),
            (12086, 56),
            (19601, 240),
            (602950, 16),
            (339, 152),
            (64973, 40),
            (10063, 32),
            (37787, 208),
            (239, 152),
        ],
        8,
        "adagrad",
    ),
    (
        "6 devices, 11 tables of 10 widths",
        [
            (509856, 136),
            (121058, 248),
            (216, 144),
            (7495, 248),
            (664698, 16),
            (152, 160),
            (538, 56),
            (278625, 184),
            (80204, 240),
            (259264, 8),
            (381520, 72),
        ],
        6,
        "sgd",
    ),
]

OPTIMIZERS = {"sgd": lambda: SGD(0.1), "adagrad": lambda: Adagrad(0.1), "adam": lambda: Adam(0.01)}


def config(shapes, optimizer: str) -> dict:
    opt = OPTIMIZERS[optimizer]()
    return {
        f"f{i}": FeatureConfig(TableConfig(v, d, optimizer=opt, name=f"t{i}"))
        for i, (v, d) in enumerate(shapes)
    }


def own_row_bytes(t, optimizer) -> int:
    """Bytes of one of table `t`'s rows at its own dim: parameters and slots (float32)."""
    slots = getattr(optimizer, "slot_names", ()) or ()
    return 4 * (t.dim + sum(optimizer.slot_width(k, t.dim) for k in slots))


def owner_bytes(plan) -> list:
    """Each shard's own bytes: the rows it holds of each table at the table's own dim."""
    out = [0] * plan.num_shards
    for t in plan.tables:
        opt = plan.table_config(t.name).optimizer
        for j in range(plan.num_shards):
            out[j] += plan.row_layout.count_on_shard(t, j) * own_row_bytes(t, opt)
    return out


def measure(shapes, n: int, optimizer: str) -> dict:
    plan = plan_stacking(config(shapes, optimizer), n, sharding="table_wise")
    owners = owner_bytes(plan)
    held = max(plan.bytes_per_device)
    spans = {t.name: t.span for t in plan.tables if t.span > 1}
    return {
        "held": held,
        "largest_owner": max(owners),
        "ratio": held / max(owners),
        "stacks": [s.tables for s in plan.stacks],
        "spread": spans,
        "ideal": max(max(owners), int(np.ceil(sum(owners) / n))),
    }


def random_mixes(n: int, count: int = 20, tables: int = 8, seed: int = 0) -> dict:
    """`count` mixes of `tables` tables (dims 8-128 in steps of 8, 1k-1M rows log-uniform,
    Adagrad) on n devices: the median of held / largest owner, how many are within 1.25x,
    and the median of held / the least possible (the largest table's own bytes, or all
    the tables' over n devices, whichever is more)."""
    rng = np.random.default_rng(seed)
    ratios, least = [], []
    for _ in range(count):
        shapes = [
            (int(10 ** rng.uniform(3, 6)), int(rng.integers(1, 17)) * 8) for _ in range(tables)
        ]
        m = measure(shapes, n, "adagrad")
        ratios.append(m["ratio"])
        own = [v * d * 8 for v, d in shapes]
        least.append(m["held"] / max(max(own), sum(own) / n))
    return {
        "median": float(np.median(ratios)),
        "within": sum(r <= 1.25 for r in ratios),
        "least": float(np.median(least)),
        "count": count,
    }


def held_bytes(emb) -> list:
    """Bytes of tables and optimizer slots each device of the mesh holds, read from the
    built arrays' shards."""
    import jax

    held: dict = {}
    for arr in jax.tree_util.tree_leaves((emb.state.tables, emb.state.slots)):
        for shard in arr.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return [held.get(d, 0) for d in emb.mesh.devices.flat]


def built(shapes, n: int, optimizer: str, whole: bool) -> dict:
    """The mix built by a `MeshEmbedding` on n virtual CPU devices, every table whole
    (`whole`: no table spread, the placement before spreading) or as planned: per device
    the arrays' bytes, the plan's estimate and the device's own bytes."""
    import jax
    from jax.sharding import Mesh

    from embedmesh import MeshEmbedding

    bound = stacking.TABLE_WISE_MAX_OVERHEAD
    if whole:
        stacking.TABLE_WISE_MAX_OVERHEAD = float("inf")  # nothing ever spreads
    try:
        mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
        emb = MeshEmbedding(config(shapes, optimizer), mesh=mesh, sharding="table_wise")
        emb.build()
    finally:
        stacking.TABLE_WISE_MAX_OVERHEAD = bound
    return {
        "held": held_bytes(emb),
        "plan": list(emb.plan.bytes_per_device),
        "own": owner_bytes(emb.plan),
        "spread": {t.name: t.span for t in emb.plan.tables if t.span > 1},
    }


def print_built(mixes) -> None:
    """Per device of each mix: bytes held (the built arrays' shards), the plan's
    estimate, its own bytes and held / the largest owner's, before and after."""
    print(
        "\n| mix | placement | device | held (MB) | plan's estimate (MB) | own (MB) "
        "| held / largest owner |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, shapes, n, opt in mixes:
        for whole in (True, False):
            m = built(shapes, n, opt, whole)
            spread = ", ".join(f"{k} ({v})" for k, v in m["spread"].items())
            label = "every table whole" if whole else f"as planned (spread: {spread or 'none'})"
            top = max(m["own"])
            for j in range(n):
                print(
                    f"| {name} | {label} | {j} | {m['held'][j] / 1e6:.2f} "
                    f"| {m['plan'][j] / 1e6:.2f} | {m['own'][j] / 1e6:.2f} "
                    f"| {m['held'][j] / top:.2f} |"
                )
            assert m["held"] == m["plan"], (name, m["held"], m["plan"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=float, default=None, help="fail above this ratio")
    ap.add_argument(
        "--built",
        type=int,
        nargs="?",
        const=2,
        default=0,
        help="also build the first BUILT mixes (default 2) on virtual CPU devices",
    )
    args = ap.parse_args(argv)
    print(
        "| mix | devices | optimizer | held a device (MB) | largest owner (MB) | ratio | stacks "
        "| spread tables (span) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, shapes, n, opt in MIXES:
        m = measure(shapes, n, opt)
        worst = max(worst, m["ratio"])
        stacks = "; ".join("+".join(s) for s in m["stacks"])
        spread = ", ".join(f"{k} ({v})" for k, v in m["spread"].items()) or "none"
        print(
            f"| {name} | {n} | {opt} | {m['held'] / 1e6:.2f} | {m['largest_owner'] / 1e6:.2f} "
            f"| **{m['ratio']:.2f}** | {stacks} | {spread} |"
        )
    print(f"\nworst ratio {worst:.2f}\n")
    print(
        "| 8 tables, dims 8-128, 1k-1M rows, 20 random mixes | devices | held / largest owner "
        "(median) | within 1.25x | held / least possible (median) |"
    )
    print("|---|---|---|---|---|")
    for n in (2, 4, 8):
        r = random_mixes(n)
        within = f"{r['within']} of {r['count']}"
        print(f"| Adagrad | {n} | {r['median']:.2f} | {within} | {r['least']:.2f} |")
    if args.built:
        print_built(MIXES[: args.built])
    if args.check is not None and worst > args.check:
        print(f"FAIL: above {args.check}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
