"""Serving lookup against torch's embedding_bag over a grid, one process: ratios per cell.

Cells: table mix x input kind (ragged, sparse, dense) x combiner (sum, mean, sqrtn; dense
input is a plain lookup, one cell) x dim x batch size x threads (1, 2). In each cell
`embedmesh.serving_embedding_lookup` (the host path, kernel backend `--backend`) and
torch's `F.embedding_bag` (dense: `F.embedding`) serve the same batches on the same
tables (torch's share the numpy tables' memory) in the same `--rounds` rounds (1 thread:
interleaved call by call, order shuffled per batch; more: in turns, see "Timing" below);
the figure is the median over rounds of the ratio within a round, torch's seconds a call
over embedmesh's (> 1: embedmesh faster). Outputs are
checked against torch's (allclose 1e-5) before timing; a cell whose outputs differ is
marked and the script exits with status 1.

Workload, as `serving.py` makes it (its `zipf_sampler`, `make_tables`, `make_batches`,
contenders and rounds are reused here): per table Poisson(ids a sample) bag lengths,
Zipf(`--zipf`) ranks mapped to ids by a random permutation; sparse input is the same
batch as a [batch, max_len] SparseTensor (torch is handed the bag offsets); dense input
is [batch, ids a sample]. A table mix (`--mixes`, comma-separated, each `[name=]` then
`COUNTxVOCABxDIM` joined by `+`, then `@IDS_A_SAMPLE`) with a dim of `D` runs once per
`--dims` value; one with fixed dims runs once. Defaults: `issue=4x500000x32+2x100000x128@20`
(6 tables: 4 x 500k x 32, 2 x 100k x 128, Poisson(20) ids a sample) and
`uniform=8x1000000xD@10` (8 x 1M x dim, Poisson(10): `serving.py`'s).

Fairness choices:
- sqrtn: torch has no such mode; it runs its sum mode with per_sample_weights =
  1/sqrt(bag length), derived from the offsets inside each call (`--sqrtn-weights call`,
  as a torch user must; embedmesh's scaling counts in its call too), or handed over
  ready-made before timing (`given`: torch's weighted sum alone, the stricter bar).
- Threads: each thread count is its own interleaved group (embedmesh on N threads against
  torch on N): a change of `set_host_threads` makes embedmesh's next request plan anew
  (~30 us, a first request's cost), and a server sets it once. Each row also gives what
  the second thread adds to each system (1-thread time over N-thread time; those medians
  come from different groups, not interleaved).
- Timing (`--timing`): one thread, interleaved call by call; more, by default each
  system alone for its turn of a round (`serving.time_round`'s blocks: an untimed pass,
  then its timed ones, as a server running only that system would), the turn starting
  `--settle-ms` after the other system's last call. Interleaved, torch's OpenMP worker
  (libgomp spins 300,000 times, GOMP_SPINCOUNT, before it sleeps, unless OMP_WAIT_POLICY
  says otherwise) spins on the second core through embedmesh's next call: after each
  2-thread call of the 6-table mix at batch 2048 the process burned 6-11 ms of CPU while
  its caller slept, against 0.1 ms after embedmesh's (its pool polls 300 us), 2026-12-07,
  the 2-core AMD EPYC machine (CPU time, not speed: the load did not matter).
  `--timing interleaved` interleaves every group, `blocks` none.
- Small batches take microseconds a call: `--round-ms` raises the passes over the
  batches a round (to at most 200) so that a round lasts about that long.

Every printed row and the JSON carry the machine: its vector ISA (AVX-512 or AVX2, from
/proc/cpuinfo), CPU model and cores, the ISA variant of embedmesh's kernels and whether
requests take the compiled request path, torch's CPU capability, versions, the load
average when the cell ran, the thread count. The table at the end lists the worst cells
first. `--max-seconds` stops starting cells past it (the cells not run are listed).

Run from the repository root, in the peer environment (requirements-serving.txt):

    PYTHONPATH=. /tmp/benchenv/bin/python benchmarks/serving/serving_torch_sweep.py \\
        [--quick] [--json out.json]

The full default grid (490 cells) is sized for at most 20 minutes on a quiet 2-core
machine, an estimate from its calls' sizes, not yet timed (8 x 1M x 256 tables: 8 GB; a
mix whose tables exceed `--max-table-gb` is skipped, and listed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from typing import NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__" and "tensorflow" not in sys.modules:
    sys.modules["tensorflow"] = None  # not a peer here: serving.py need not import it

import numpy as np
import serving as bench

from embedmesh import _native
from embedmesh.serving import kernels, request
from embedmesh.serving.settings import set_numpy_outputs

DEFAULTS = dict(
    mixes="issue=4x500000x32+2x100000x128@20,uniform=8x1000000xD@10",
    dims="8,16,32,64,128,256",
    batch_sizes="1,16,256,1024,4096",
    rounds=7,
    round_ms=100.0,
    distinct=2,
)
QUICK = dict(
    mixes="issue=4x20000x32+2x5000x128@20,uniform=2x20000xD@10",
    dims="16,64",
    batch_sizes="16,256",
    rounds=2,
    round_ms=10.0,
    distinct=1,
)
# The cells the >= 1x bar is set for: dims of at least BAR[0], batches BAR[1]-BAR[2].
BAR = (16, 256, 4096)
KINDS = (("ragged", "sum"), ("ragged", "mean"), ("ragged", "sqrtn"))
KINDS += (("sparse", "sum"), ("sparse", "mean"), ("sparse", "sqrtn"), ("dense", "-"))


class Mix(NamedTuple):
    """A table mix: groups of (count, vocab, dim or None: the swept dim), ids a sample."""

    name: str
    groups: tuple
    ids_per_sample: int


def parse_mix(text: str) -> Mix:
    """`[name=]COUNTxVOCABxDIM[+...]@IDS` (DIM may be D: each of --dims)."""
    name, _, spec = text.rpartition("=")
    tables, at, ids = spec.partition("@")
    try:
        groups = []
        for part in tables.split("+"):
            count, vocab, dim = part.lower().split("x")
            groups.append((int(count), int(vocab), None if dim == "d" else int(dim)))
        ids_per_sample = int(ids) if at else 10
    except ValueError:
        raise SystemExit(f"--mixes: {text!r} is not [name=]COUNTxVOCABxDIM[+...][@IDS]") from None
    if ids_per_sample < 1 or any(c < 1 or v < 1 or (d or 1) < 1 for c, v, d in groups):
        raise SystemExit(f"--mixes: {text!r}: counts, sizes and ids a sample must be >= 1")
    return Mix(name or spec, tuple(groups), ids_per_sample)


def machine(backend: str) -> dict:
    """What a figure depends on besides the code: the record every row carries."""
    import torch

    model, flags = bench.cpu_model_and_flags()
    native = kernels.HAVE_NATIVE
    return {
        "isa": bench.isa_name(flags),
        "cpu": model,
        "cpus": os.cpu_count(),
        "kernels": backend,
        "kernels_isa": _native.selected_variant() if native else None,
        "kernels_vectors": bench.native_line() if native else None,
        "request_path": "compiled" if request.compiled is not None else "general",
        "torch": torch.__version__,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_default_threads": bench.TORCH_THREADS,
        "numpy": np.__version__,
        "numba": importlib.metadata.version("numba") if kernels.HAVE_NUMBA else None,
        "python": platform.python_version(),
        "env": {
            k: os.environ[k]
            for k in (
                "OMP_NUM_THREADS",
                "OMP_WAIT_POLICY",
                "GOMP_SPINCOUNT",
                "ATEN_CPU_CAPABILITY",
                "EMBEDMESH_CPU_ISA",
                "EMBEDMESH_SERVING_THREADS",
            )
            if k in os.environ
        },
    }


def tag(m: dict) -> str:
    """The machine record, short, for the end of every printed row."""
    return (
        f"[{m['isa']} | {m['cpu']} x{m['cpus']} | em {m['kernels']} {m['kernels_isa']} "
        f"{m['request_path']} | torch {m['torch']} {m['torch_capability']} | "
        f"numpy {m['numpy']}]"
    )


def build_tables(mix: Mix, dim: int | None, args) -> list:
    """Per group of the mix: (its argparse-like shape, Zipf draw, id permutations, tables)."""
    rng = np.random.default_rng(args.seed)
    groups = []
    for count, vocab, fixed in mix.groups:
        shape = argparse.Namespace(tables=count, vocab=vocab, dim=fixed or dim)
        shape.aligned, shape.ids_per_sample = args.aligned, mix.ids_per_sample
        draw = bench.zipf_sampler(vocab, args.zipf, rng)
        perms = [rng.permutation(vocab) for _ in range(count)]
        groups.append((shape, draw, perms, bench.make_tables(shape, rng)))
    return groups


def build_batches(groups: list, batch: int, args) -> tuple[list, int]:
    """`args.distinct` batches of `batch` samples over every table of the mix, and the
    longest bag (a sparse input's dense_shape[1])."""
    rng = np.random.default_rng([args.seed, batch])
    batches = [[] for _ in range(args.distinct)]
    for shape, draw, perms, _ in groups:
        size = argparse.Namespace(batches=args.distinct, batch=batch)
        size.ids_per_sample = shape.ids_per_sample
        for i, feats in enumerate(bench.make_batches(size, rng, draw, perms)):
            batches[i] += feats
    return batches, max(1, max(int(f["lengths"].max()) for b in batches for f in b))


def table_bytes(mix: Mix, dim: int | None) -> int:
    return sum(c * v * (d or dim) * 4 for c, v, d in mix.groups)


def available_gb() -> float:
    """MemAvailable of /proc/meminfo (GB); inf where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def settle(calls: dict, seconds: float) -> None:
    """Each contender's setup (untimed) first waits `seconds` when another one ran last:
    the other system's threads have stopped spinning when its turn starts."""
    last = [None]
    for name, cs in calls.items():

        def setup(name=name, inner=cs.setup):
            if last[0] not in (None, name):
                time.sleep(seconds)
            last[0] = name
            if inner is not None:
                inner()

        cs.setup = setup


def run_cell(groups, batches, max_len, kind, combiner, threads, args) -> dict:
    """One (kind, combiner) at one thread count: embedmesh against torch, in the same
    rounds (interleaved, or in turns: see --timing)."""
    tables = [t for g in groups for t in g[3]]
    shapes = [t.shape for t in tables]
    shape = argparse.Namespace(batch=len(batches[0][0]["lengths"]))
    em = f"embedmesh[{threads}t]"
    peer = f"torch[{threads}t]"
    contenders = {
        em: bench.embedmesh_contender(
            tables, batches, max_len, shape, args.backend, threads, shapes=shapes
        ),
        peer: bench.torch_contender(
            tables, batches, max_len, shape, threads, sqrtn=args.sqrtn_weights
        ),
    }
    prep_combiner = "sum" if kind == "dense" else combiner
    calls = {name: prep(kind, prep_combiner) for name, prep in contenders.items()}
    blocks = args.timing == "blocks" or (args.timing == "auto" and threads > 1)
    if blocks and args.settle_ms > 0:
        settle(calls, args.settle_ms / 1e3)
    got = bench.measure(
        calls, args.rounds, args.reps, blocks, refs=(peer,), round_s=args.round_ms / 1e3
    )
    return {
        "kind": kind,
        "combiner": combiner,
        "threads": threads,
        "timing": f"blocks, {args.settle_ms:g} ms settle" if blocks else "interleaved",
        "ratio": bench.median_ratio(got.per_round, em, peer),
        "ratio_by_round": [b / a for a, b in zip(got.per_round[em], got.per_round[peer])],
        "embedmesh_ms": statistics.median(got.per_round[em]) * 1e3,
        "torch_ms": statistics.median(got.per_round[peer]) * 1e3,
        "ids_per_call": statistics.mean(bench.ids_in(kind, b) for b in batches),
        "calls_a_round": got.reps * len(batches),
        "max_abs_diff": got.diffs[em],
        "allclose": got.diffs[em + " allclose"],
        "load": os.getloadavg()[0],
    }


def label(row: dict) -> str:
    kind = row["kind"] if row["kind"] == "dense" else f"{row['kind']}/{row['combiner']}"
    dims = "+".join(str(d) for d in row["dims"])
    return f"{row['mix']:8s} {kind:13s} d{dims:7s} b{row['batch']:<5d} {row['threads']}t"


def line(row: dict, m: dict) -> str:
    gain = row.get("gain_vs_1t")
    gains = ""
    if gain:  # what the threads past the first add: 1-thread time over this row's
        gains = f"  1t/{row['threads']}t: em {gain['embedmesh']:.2f} torch {gain['torch']:.2f}"
    bad = "" if row["allclose"] else f"  OUTPUTS DIFFER (max |diff| {row['max_abs_diff']:.3g})"
    return (
        f"{row['ratio']:6.2f}x  {label(row)}  em {row['embedmesh_ms']:8.3f} ms  torch "
        f"{row['torch_ms']:8.3f} ms{gains}  load {row['load']:.2f}  {tag(m)}{bad}"
    )


def sweep(args, m: dict) -> tuple[list, list]:
    """Every cell in order (mix, dim, batch, kind, threads) until --max-seconds: (rows,
    cells not run with why)."""
    start = time.perf_counter()
    rows, not_run = [], []
    for mix in (parse_mix(t) for t in args.mixes.split(",")):
        swept = any(d is None for _, _, d in mix.groups)
        for dim in [int(d) for d in args.dims.split(",")] if swept else [None]:
            dims = sorted({d or dim for _, _, d in mix.groups})
            where = f"{mix.name} d{'+'.join(map(str, dims))}"
            need = table_bytes(mix, dim) / 2**30
            if time.perf_counter() - start > args.max_seconds:
                not_run.append(f"{where}: past --max-seconds")
                continue
            if need > args.max_table_gb:
                not_run.append(f"{where}: tables {need:.3g} GB > --max-table-gb")
                print(f"\n#### {where}: skipped, tables {need:.3g} GB > --max-table-gb")
                continue
            t0 = time.perf_counter()
            groups = build_tables(mix, dim, args)
            print(f"\n#### {where}: {need:.2f} GB of tables in {time.perf_counter() - t0:.1f}s")
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                batches, max_len = build_batches(groups, batch, args)
                for kind, combiner in KINDS:
                    if kind not in args.kinds or combiner not in args.combiners + ["-"]:
                        continue
                    if time.perf_counter() - start > args.max_seconds:
                        not_run.append(f"{where} b{batch} {kind}/{combiner}: past --max-seconds")
                        continue
                    cell = {}
                    for threads in args.threads:
                        row = run_cell(groups, batches, max_len, kind, combiner, threads, args)
                        row.update(mix=mix.name, dims=dims, batch=batch, machine=m)
                        cell[threads] = row
                        if 1 in cell and threads != 1:
                            row["gain_vs_1t"] = {
                                "embedmesh": cell[1]["embedmesh_ms"] / row["embedmesh_ms"],
                                "torch": cell[1]["torch_ms"] / row["torch_ms"],
                            }
                        rows.append(row)
                        print(line(row, m), flush=True)
            del groups
    return rows, not_run


def report(rows: list, not_run: list, m: dict) -> None:
    """The ratios, worst first; per thread count the cells under 1x, of all and of those
    the bar is set for (BAR); then the cells not run."""
    if rows:
        print(f"\n#### embedmesh / torch (torch's s a call over embedmesh's), worst first {tag(m)}")
    for row in sorted(rows, key=lambda r: r["ratio"]):
        print(line(row, m))
    bar = f"dims >= {BAR[0]}, batches {BAR[1]}-{BAR[2]}"
    for t in sorted({r["threads"] for r in rows}):
        mine = [r for r in rows if r["threads"] == t]
        barred = [r for r in mine if min(r["dims"]) >= BAR[0] and BAR[1] <= r["batch"] <= BAR[2]]
        for where, some in (("all", mine), (bar, barred)):
            if some:
                worst, under = min(r["ratio"] for r in some), sum(r["ratio"] < 1 for r in some)
                print(f"{t}t, {where}: {len(some)} cells, {under} under 1x, worst {worst:.2f}x")
    for item in not_run:
        print(f"not run: {item}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a small grid: {QUICK}")
    p.add_argument("--mixes", help=f"default {DEFAULTS['mixes']}")
    p.add_argument("--dims", help=f"for mixes with dim D; default {DEFAULTS['dims']}")
    p.add_argument("--batch-sizes", help=f"default {DEFAULTS['batch_sizes']}")
    p.add_argument("--kinds", default="ragged,sparse,dense")
    p.add_argument("--combiners", default="sum,mean,sqrtn")
    p.add_argument("--threads", default="1,2", help="thread counts, each its own group")
    p.add_argument("--rounds", type=int, help=f"default {DEFAULTS['rounds']}")
    p.add_argument("--reps", type=int, default=1, help="passes over the batches a round, least")
    p.add_argument(
        "--round-ms", type=float, help=f"reps raised to fill a round; {DEFAULTS['round_ms']}"
    )
    p.add_argument("--distinct", type=int, help=f"distinct batches; {DEFAULTS['distinct']}")
    p.add_argument("--max-seconds", type=float, default=1500.0, help="no cell starts after")
    p.add_argument("--max-table-gb", type=float, default=0.75 * available_gb())
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="native", choices=("native", "numba", "numpy"))
    p.add_argument("--sqrtn-weights", default="call", choices=("call", "given"))
    p.add_argument(
        "--timing",
        default="auto",
        choices=("auto", "interleaved", "blocks"),
        help="auto: 1 thread interleaved, more in turns (see the docstring)",
    )
    p.add_argument("--settle-ms", type=float, default=50.0, help="before a turn (blocks)")
    p.add_argument("--aligned", action="store_true", help="tables on 64-byte lines")
    p.add_argument("--numpy-outputs", action="store_true", help="set_numpy_outputs(True)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kinds = args.kinds.split(",")
    args.combiners = args.combiners.split(",")
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    unknown = set(args.kinds) - {k for k, _ in KINDS}
    unknown |= set(args.combiners) - {c for _, c in KINDS if c != "-"}
    if unknown:
        p.error(f"unknown kinds or combiners: {sorted(unknown)}")
    sizes = [int(x) for x in f"{args.dims},{args.batch_sizes}".split(",")]
    if min(args.threads + sizes) < 1 or args.rounds < 1 or args.distinct < 1:
        p.error("--threads, --dims, --batch-sizes, --rounds and --distinct must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if bench.torch is None:
        print("torch is not importable: see requirements-serving.txt", file=sys.stderr)
        return 2
    if args.numpy_outputs:
        set_numpy_outputs(True)
    m = machine(args.backend)
    print(f"machine: {json.dumps(m)}")
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(f"load average {load[0]:.2f} on {os.cpu_count()} cpus: timings unreliable")
    if m["request_path"] != "compiled":
        print("the compiled request path is not built here: figures are not a user's")
    rows, not_run = sweep(args, m)
    report(rows, not_run, m)
    differ = [label(r) for r in rows if not r["allclose"]]
    if args.json:
        with open(args.json, "w") as fh:
            doc = {"machine": m, "args": vars(args), "rows": rows, "not_run": not_run}
            json.dump({**doc, "outputs_differ": differ}, fh, indent=1, default=str)
    for d in differ:
        print(f"OUTPUTS DIFFER: {d}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
