"""A/B harness: this tree's embedmesh against a baseline tree, benchmark by benchmark.

For issue #13's "No speed lost": each of `train/train_step.py`, `serving/serving.py`,
`train/preprocess.py` and `checkpoint/checkpoint.py` runs against a baseline tree (a git
worktree of the commit before the redesign), both trees in the same invocation of this
script, interleaved. The same harness compares two settings of one tree: `--baseline .
--new .` with `--baseline-env` / `--new-env` (an environment variable set on one side
only): e.g. the C++ kernels' ISA variants (`EMBEDMESH_CPU_ISA`, what the one-off
benchmarks/isa.py measured) or the shared-memory exchange against gloo
(`EMBEDMESH_HOST_EXCHANGE=0`) in train_step's scale-out rows.

Method. Every run is a fresh process running the tree's OWN copy of the script,
`<tree>/benchmarks/<area>/<script>.py <args>` (or `<tree>/benchmarks/<script>.py`, where
the tree predates the areas), with cwd=<tree> and PYTHONPATH=<tree>, so each imports its
own embedmesh (checked before the first round: `embedmesh.__file__` must lie in the tree)
and each keeps the import paths of its own layout. A round runs the script
once in each tree, the baseline first in even rounds and the new tree first in odd ones
(ABBA...), so slow drift of the machine's load and a predecessor effect (page cache,
thermal, allocator) fall on both sides alike. From each run's output a per-script parser
takes embedmesh's own figures (never the peers'), each a time or a size where lower is
better; for each metric and round the ratio is

    ratio = baseline / new        (> 1: the new tree is faster, or smaller)

and the summary prints per metric the median of the baseline's and of the new tree's
figures, the median of the per-round ratios and their min and max over the rounds. A
metric whose median ratio is below --threshold (0.97) is marked. The noise of a run is
best judged by an A/A run (--baseline and --new the same tree) on the same machine.

Each script gets ab.py's default arguments first (embedmesh's contenders only: the peers
cost time and are not what the A/B compares), then with --quick a tiny size (to test the
harness; its figures mean nothing), then the user's (`--args SCRIPT=ARGS`; argparse lets
a later option win, so they override). What is printed goes to the log,
benchmarks/runs/ab_<date>_<time>[_<tag>].txt; beside it, _raw.txt holds every run's full
output and .json every round's figures.

Usage (from the new tree's root; the baseline worktree made once with
`git -C <main checkout> worktree add ../wt-base pre-redesign`):

    python benchmarks/ab.py --baseline ../wt-base                   # all four, 3 rounds
    python benchmarks/ab.py --baseline ../wt-base --rounds 5 --only serving,preprocess \\
        --args "serving=--rounds 3 --kinds ragged,dense" --tag serving
    python benchmarks/ab.py --baseline ../wt-base --quick --rounds 2  # harness check
    python benchmarks/ab.py --baseline . --new . --only train_step    # A/A: the noise
    python benchmarks/ab.py --baseline . --new . --only train_step \\
        --baseline-env EMBEDMESH_CPU_ISA=x86-64-v3 --args "train_step=--peers embedmesh"

Options: --baseline PATH (required), --new PATH (default: the tree holding this file),
--rounds R (3), --warmup N (untimed rounds first, default 0), --only a,b,
--args SCRIPT=ARGS (repeatable), --quick, --python (default: this interpreter),
--baseline-env VAR=VALUE and --new-env VAR=VALUE (repeatable), --timeout S per run,
--threshold, --tag, --log PATH, --json PATH, --dry-run.
Exit status 1 when a run failed or timed out, 0 otherwise (ratios are reported, not
judged).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = ("train_step", "serving", "serving_online", "preprocess", "checkpoint")
# Where each script lies under a tree's benchmarks/: by area, else (older trees) flat.
LOCATIONS: dict[str, tuple[str, ...]] = {
    "train_step": ("train/train_step.py", "train_step.py"),
    "serving": ("serving/serving.py", "serving.py"),
    "serving_online": ("serving/serving_online.py", "serving_online.py"),
    "preprocess": ("train/preprocess.py", "preprocess.py"),
    "checkpoint": ("checkpoint/checkpoint.py", "checkpoint.py"),
}

# Passed first: embedmesh's contenders only.
DEFAULT_ARGS: dict[str, str] = {
    "train_step": "--peers embedmesh,embedmesh-pipelined,embedmesh-core,embedmesh-2dev",
    "serving": "--contenders embedmesh[native],embedmesh[native-Nt],embedmesh[numpy]",
    "serving_online": "--contenders embedmesh,em-numpy --no-busy",
    "preprocess": "",
    "checkpoint": "",
}
# --quick: the smallest sizes the scripts take (train_step and preprocess have a fixed
# workload: only their rounds and steps shrink).
QUICK_ARGS: dict[str, str] = {
    "train_step": "--peers embedmesh --rounds 1 --steps 2 --warmup 1",
    "serving": "--tables 2 --vocab 10000 --dim 16 --batch 256 --batches 1 --rounds 1 "
    "--reps 1 --kinds ragged --combiners sum",
    "serving_online": "--rounds 1 --seconds 0.1 --batches 1,64 --clients 1,2",
    "preprocess": "--rounds 1 --variants ragged",
    "checkpoint": "--tables 2 --rows 10000 --dim 16 --devices 2 --restore-devices 1 "
    "--dd-gb 0.02 --repeats 1",
}

Metrics = dict[str, tuple[float, str]]  # name -> (value, unit); lower is better
_NUM = r"([0-9]+(?:\.[0-9]*)?)"


# ---------------------------------------------------------------------------
# Parsers: one per script, from what its main() prints.


def parse_train_step(text: str) -> Metrics:
    """The summary table: per embedmesh peer host prep, device step (median and best),
    end to end with prefetch (ms) and peak RSS (setup, steps; GB). Since 2026-12-03 the
    table ends in a fourth size, the peak of the end-to-end run (a size or "-"); older
    logs (and baseline trees) have three."""
    row = re.compile(
        rf"^\s+(embedmesh\S*)\s+{_NUM} ms\s+{_NUM} ms\s+{_NUM}\s+{_NUM} ms\s+{_NUM}\s+"
        rf"(?:{_NUM} ms|-)\s+(?:{_NUM}|-)\s+{_NUM} GB\s+{_NUM} GB\s+{_NUM} GB"
        rf"(?:\s+(?:{_NUM} GB|-))?\s*$"
    )
    out: Metrics = {}
    for line in text.splitlines():
        m = row.match(line)
        if not m:
            continue
        peer = m[1]
        out[f"{peer} host prep"] = (float(m[2]), "ms")
        out[f"{peer} device step"] = (float(m[3]), "ms")
        out[f"{peer} device step, best"] = (float(m[5]), "ms")
        if m[7] is not None:
            out[f"{peer} end-to-end (prefetch)"] = (float(m[7]), "ms")
        out[f"{peer} peak RSS, setup"] = (float(m[10]), "GB")
        out[f"{peer} peak RSS, steps"] = (float(m[11]), "GB")
        if m[12] is not None:
            out[f"{peer} peak RSS, end to end"] = (float(m[12]), "GB")
    return out


def parse_serving(text: str) -> Metrics:
    """Per input form and embedmesh contender: ms per call (median over the script's
    rounds), from ids per call / ids/s (4 digits; the printed ms/call has 2 decimals)."""
    head = re.compile(r"^== (.+?): ([0-9]+) ids per call")
    row = re.compile(rf"^\s+(embedmesh\[[^\]]+\])\s+{_NUM} M ids/s\s+\(\s*{_NUM} ms/call\)")
    out: Metrics = {}
    label, ids = None, 0
    for line in text.splitlines():
        if m := head.match(line):
            label, ids = m[1], int(m[2])
        elif label and (m := row.match(line)):
            rate = float(m[2]) * 1e6
            out[f"{label} {m[1]}"] = (ids / rate * 1e3 if rate > 0 else float(m[3]), "ms")
    return out


def parse_serving_online(text: str) -> Metrics:
    """Per embedmesh contender, batch and client count (1, 2, 4 or "busy"): p50 and p99
    latency (us) and the time a request takes at its requests/s over all clients
    (1e6 / req/s, us: lower is better, as every metric here). Torch's and TensorFlow's
    rows are the peers', not compared."""
    row = re.compile(rf"^(\S+)\s+([0-9]+)\s+(\S+)\s+{_NUM}\s+{_NUM}\s+{_NUM}\s+{_NUM}\s+{_NUM}$")
    out: Metrics = {}
    for line in text.splitlines():
        m = row.match(line.strip())
        if not m or m[1] in ("torch", "tf"):
            continue
        cell = f"{m[1]} batch {m[2]}, {m[3]} client{'s' if m[3] != '1' else ''}"
        out[f"{cell} p50"] = (float(m[4]), "us")
        out[f"{cell} p99"] = (float(m[5]), "us")
        if float(m[7]) > 0:
            out[f"{cell} us a request (all clients)"] = (1e6 / float(m[7]), "us")
    return out


def parse_preprocess(text: str) -> Metrics:
    """Per variant and embedmesh runner (numba/numpy, threads, stacking): wall and CPU
    time of one step (ms)."""
    head = re.compile(r"^(\w+): [0-9.]+ M ids per step")
    row = re.compile(rf"^\s+(.+?)\s+wall\s+{_NUM} ms\s+{_NUM} M ids/s.*?cpu\s+{_NUM} ms")
    out: Metrics = {}
    variant = None
    for line in text.splitlines():
        if m := head.match(line):
            variant = m[1]
        elif variant and (m := row.match(line)) and m[1] != "jax-tpu-embedding":
            out[f"{variant} {m[1]} wall"] = (float(m[2]), "ms")
            out[f"{variant} {m[1]} cpu"] = (float(m[4]), "ms")
    return out


def parse_checkpoint(text: str) -> Metrics:
    """Build, sync and async save, every restore and load_tables (first and median) (s);
    peak RSS after each phase (GB). The dd figures are the disk's, not embedmesh's."""
    lines: list[tuple[re.Pattern, Callable[[re.Match], Metrics]]] = [
        (
            re.compile(rf"^built and randomized the source state in {_NUM} s"),
            lambda m: {"build + randomize": (float(m[1]), "s")},
        ),
        (
            re.compile(rf"^save \(sync manager\): {_NUM} s, then fsync {_NUM} s"),
            lambda m: {"save (sync) + fsync, first": (float(m[1]) + float(m[2]), "s")},
        ),
        (
            re.compile(rf"^save again \(warm process\) \+ fsync: {_NUM} s"),
            lambda m: {"save (sync) + fsync, again": (float(m[1]), "s")},
        ),
        (
            re.compile(rf"^async save: training blocked {_NUM} s, written after {_NUM} s"),
            lambda m: {
                "async save, blocked": (float(m[1]), "s"),
                "async save, written": (float(m[2]), "s"),
            },
        ),
        (
            re.compile(rf"^\s+\[memory after (.+?): rss {_NUM} GB, peak {_NUM} GB\]"),
            lambda m: {f"peak RSS after {m[1]}": (float(m[3]), "GB")},
        ),
        (
            re.compile(rf"^\| ((?:restore|load_tables) .+?) \| {_NUM} \| {_NUM} \|"),
            lambda m: {f"{m[1]}, first": (float(m[2]), "s"), f"{m[1]}, median": (float(m[3]), "s")},
        ),
    ]
    out: Metrics = {}
    for line in text.splitlines():
        for pat, take in lines:
            if m := pat.match(line):
                out.update(take(m))
                break
    return out


PARSERS: dict[str, Callable[[str], Metrics]] = {
    "train_step": parse_train_step,
    "serving": parse_serving,
    "serving_online": parse_serving_online,
    "preprocess": parse_preprocess,
    "checkpoint": parse_checkpoint,
}


# ---------------------------------------------------------------------------
# Runs


def script_path(tree: str, script: str) -> str | None:
    """The tree's own copy of a script: the first of LOCATIONS that exists, or None."""
    for rel in LOCATIONS[script]:
        path = os.path.join(tree, "benchmarks", rel)
        if os.path.isfile(path):
            return path
    return None


def tree_env(tree: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = tree  # only the tree: nothing else's embedmesh comes first
    env.update(extra or {})
    return env


def run(
    cmd: list[str], tree: str, timeout: float, extra_env: dict[str, str] | None = None
) -> tuple[int | str, str, float]:
    """(return code or "timeout", stdout+stderr, seconds). The run gets its own process
    group, killed whole on timeout (train_step starts children)."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=tree,
        env=tree_env(tree, extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
    return rc, out or "", time.perf_counter() - t


def check_tree(tree: str, python: str) -> str:
    """Where the tree's embedmesh is imported from (must be inside the tree)."""
    rc, out, _ = run([python, "-c", "import embedmesh; print(embedmesh.__file__)"], tree, 300)
    where = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not os.path.realpath(where).startswith(os.path.realpath(tree) + os.sep):
        sys.exit(
            f"ab.py: in {tree}, `import embedmesh` gives {where or out!r} (rc {rc}), "
            "not the tree's own package"
        )
    return where


def describe(tree: str) -> str:
    def git(*a: str) -> str:
        p = subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else "?"

    dirty = "+uncommitted" if git("status", "--porcelain", "--untracked-files=no") else ""
    return (
        f"{tree} ({git('rev-parse', '--abbrev-ref', 'HEAD')} "
        f"{git('rev-parse', '--short', 'HEAD')}{dirty})"
    )


# ---------------------------------------------------------------------------
# Summary


def fmt(v: float) -> str:
    """Four significant digits or so, without exponents for benchmark-sized figures."""
    for limit, spec in ((1000, ".0f"), (100, ".1f"), (10, ".2f"), (1, ".3f")):
        if abs(v) >= limit:
            return f"{v:{spec}}"
    return f"{v:.4f}"


def summarize(rounds: list[tuple[Metrics, Metrics]], threshold: float) -> list[str]:
    """One line per metric: unit, medians of baseline and new, median [min, max] of the
    per-round ratios baseline/new, rounds counted."""
    names = list(dict.fromkeys(k for base, new in rounds for k in [*base, *new]))
    if not names:
        return ["  (no figures: every run failed or printed none)"]
    width = max([len(n) for n in names] + [6])
    lines = [
        f"  {'metric':{width}s} {'unit':4s} {'baseline':>9s} {'new':>9s} "
        f"{'ratio':>6s}  {'[min, max]':13s} rounds"
    ]
    for name in names:
        pairs = [(b[name][0], n[name][0]) for b, n in rounds if name in b and name in n]
        unit = next(m[name][1] for r in rounds for m in r if name in m)
        ratios = [b / n for b, n in pairs if b > 0 and n > 0]
        base = [b for b, _ in pairs]
        new = [n for _, n in pairs]
        if not ratios:
            why = "no round with both" if not pairs else "zero figures"
            med_b = f"{fmt(statistics.median(base)):>9s}" if base else f"{'-':>9s}"
            med_n = f"{fmt(statistics.median(new)):>9s}" if new else f"{'-':>9s}"
            lines.append(f"  {name:{width}s} {unit:4s} {med_b} {med_n} {'-':>6s}  ({why})")
            continue
        med = statistics.median(ratios)
        mark = f"  <- below {threshold:g}" if med < threshold else ""
        lines.append(
            f"  {name:{width}s} {unit:4s} {fmt(statistics.median(base)):>9s} "
            f"{fmt(statistics.median(new)):>9s} {med:6.3f}  "
            f"[{min(ratios):.3f}, {max(ratios):.3f}] {len(ratios):3d}{mark}"
        )
    return lines


# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", required=True, help="the baseline tree (a git worktree)")
    ap.add_argument("--new", default=ROOT, help="the tree under test (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per script")
    ap.add_argument("--warmup", type=int, default=0, help="untimed rounds per script first")
    ap.add_argument("--only", default=",".join(SCRIPTS), help="scripts, comma-separated")
    ap.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="SCRIPT=ARGS",
        help="extra arguments for one script (repeatable), e.g. "
        "'serving=--rounds 3 --kinds ragged'",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes (checks the harness; the figures mean nothing)",
    )
    for side in ("baseline", "new"):
        ap.add_argument(
            f"--{side}-env",
            action="append",
            default=[],
            metavar="VAR=VALUE",
            help=f"an environment variable for the {side}'s runs only (repeatable)",
        )
    ap.add_argument("--python", default=sys.executable, help="interpreter for every run")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--threshold", type=float, default=0.97, help="mark median ratios below this")
    ap.add_argument("--tag", default="", help="appended to the log's name")
    ap.add_argument("--log", help="log path (default: benchmarks/runs/ab_<date>_<time>.txt)")
    ap.add_argument("--json", help="every round's figures (default: the log's name, .json)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    return ap


class Plan:
    """What the arguments ask for: the scripts, each one's arguments, the two trees, each
    side's environment and each tree's copy of each script (errors through `ap.error`)."""

    def __init__(self, ap: argparse.ArgumentParser, args: argparse.Namespace):
        self.args = args
        self.scripts = [s for s in args.only.split(",") if s]
        if unknown := [s for s in self.scripts if s not in SCRIPTS]:
            ap.error(f"unknown script(s) {unknown}; choose from {list(SCRIPTS)}")
        extra: dict[str, list[str]] = {s: [] for s in SCRIPTS}
        for item in args.args:
            name, sep, rest = item.partition("=")
            if not sep or name not in SCRIPTS:
                ap.error(f"--args wants SCRIPT=ARGS with SCRIPT one of {list(SCRIPTS)}: {item!r}")
            extra[name] += shlex.split(rest)
        self.trees = {"baseline": os.path.abspath(args.baseline), "new": os.path.abspath(args.new)}
        self.envs: dict[str, dict[str, str]] = {}
        for side in self.trees:
            self.envs[side] = {}
            for item in getattr(args, f"{side}_env"):
                var, sep, value = item.partition("=")
                if not sep or not var:
                    ap.error(f"--{side}-env wants VAR=VALUE: {item!r}")
                self.envs[side][var] = value
        self.paths: dict[tuple[str, str], str] = {}
        for tree in self.trees.values():
            for s in self.scripts:
                path = script_path(tree, s)
                if path is None:
                    sys.exit(
                        f"ab.py: {tree} has none of {['benchmarks/' + p for p in LOCATIONS[s]]}"
                    )
                self.paths[tree, s] = path
        self.argvs = {
            s: shlex.split(DEFAULT_ARGS[s])
            + shlex.split(QUICK_ARGS[s] if args.quick else "")
            + extra[s]
            for s in self.scripts
        }

    def command(self, tree: str, s: str) -> list[str]:
        return [self.args.python, self.paths[tree, s], *self.argvs[s]]

    def env_words(self, side: str) -> str:
        return "".join(f", {k}={v}" for k, v in self.envs[side].items())


def _header(say: Callable[[str], None], plan: Plan, stamp: str, raw_path: str) -> None:
    """The log's first lines: the trees, their environments, the machine, the command."""
    args, trees = plan.args, plan.trees
    quick = "; --quick: sizes for a harness check, figures mean nothing" if args.quick else ""
    say(f"A/B {stamp}: ratio = baseline / new per round (> 1: new is faster or smaller)")
    say(f"  new:      {describe(trees['new'])}")
    say(f"  baseline: {describe(trees['baseline'])}")
    for side in trees:
        if plan.envs[side]:
            say(f"  {side} runs with{plan.env_words(side)[1:]}")
    say(
        f"  python {args.python}; {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; "
        f"rounds {args.rounds} (+{args.warmup} warm-up), baseline first in even rounds" + quick
    )
    say(f"  command: {shlex.join([sys.executable, *sys.argv])}")
    for side, tree in trees.items():
        say(f"  {side} imports {check_tree(tree, args.python)}")
    say(f"  raw output: {raw_path}")


def _rounds(
    say: Callable[[str], None], raw, plan: Plan, s: str
) -> tuple[list[tuple[Metrics, Metrics]], bool]:
    """Script `s`'s warm-up and timed rounds, both trees each, in ABBA order: the timed
    rounds' (baseline, new) figures, and whether a run failed."""
    args, trees = plan.args, plan.trees
    failed = False
    rounds: list[tuple[Metrics, Metrics]] = []
    for r in range(-args.warmup, args.rounds):
        label = f"warm-up {r + args.warmup}" if r < 0 else f"round {r}"
        got: dict[str, Metrics] = {}
        for side in ("baseline", "new") if r % 2 == 0 else ("new", "baseline"):
            cmd = plan.command(trees[side], s)
            rc, out, secs = run(cmd, trees[side], args.timeout, plan.envs[side])
            raw.write(
                f"\n######## {s} {label} {side} (rc {rc}, {secs:.0f} s): {shlex.join(cmd)}\n{out}"
            )
            raw.flush()
            got[side] = PARSERS[s](out) if rc == 0 else {}
            if rc != 0:
                failed = True
                tail = "\n".join("      " + x for x in out.strip().splitlines()[-8:])
                say(f"  {label}: {side} FAILED (rc {rc}) after {secs:.0f} s:\n{tail}")
            elif not got[side]:
                say(f"  {label}: {side}: no figures parsed from its output (see raw)")
            else:
                say(
                    f"  {label}: {side:8s} {secs:5.0f} s, {len(got[side])} figures, "
                    f"load {os.getloadavg()[0]:.1f}"
                )
        if r >= 0:
            rounds.append((got["baseline"], got["new"]))
    return rounds, failed


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    plan = Plan(ap, args)
    scripts, trees, envs, argvs = plan.scripts, plan.trees, plan.envs, plan.argvs

    if args.dry_run:
        for s in scripts:
            for side, tree in trees.items():
                print(
                    f"{side:8s} (cwd {tree}, PYTHONPATH={tree}{plan.env_words(side)}): "
                    f"{shlex.join(plan.command(tree, s))}"
                )
        return 0

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    name = f"ab_{stamp}" + (f"_{args.tag}" if args.tag else "")
    log_path = args.log or os.path.join(HERE, "runs", name + ".txt")
    stem = os.path.splitext(log_path)[0]
    raw_path, json_path = stem + "_raw.txt", args.json or stem + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log, open(raw_path, "w") as raw:

        def say(line: str = "") -> None:
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()

        _header(say, plan, stamp, raw_path)
        failed = False
        record: dict[str, dict] = {}
        for s in scripts:
            say(f"\n== {s}: {shlex.join(argvs[s])}")
            rounds, failed_s = _rounds(say, raw, plan, s)
            failed = failed or failed_s
            say(f"-- {s}: per metric, medians over rounds")
            for line in summarize(rounds, args.threshold):
                say(line)
            record[s] = {"args": argvs[s], "rounds": [{"baseline": b, "new": n} for b, n in rounds]}
        say(f"\nlog: {log_path}; figures: {json_path}")
    with open(json_path, "w") as f:
        json.dump(
            {"trees": trees, "env": envs, "rounds": args.rounds, "scripts": record}, f, indent=1
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
