"""benchmarks/gpu/gpu.py, the GPU machine's one prepared script, on CPU.

The parent's plan (order, budget skips, the report rewritten as children save, exit
status, the pre-flight) runs in-process with stand-in children on a fake clock; the
script itself runs end to end once as `--smoke --allow-cpu --budget-s 40` (tiny sizes,
on whatever this machine's load leaves of a minute: no timing is checked, only that
what ran is right and what did not is listed), and once without `--allow-cpu`, where
its pre-flight must stop it at once.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from paths import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "gpu.py")

OPTIMIZERS = {"SGD", "Adagrad", "AdagradMomentum", "Adam(lazy)", "Adam(non-lazy)", "FTRL"}
COMBINERS = {"sum", "mean", "sqrtn"}
CHECKS = ("lookup", "table", "serving_host", "serving_device")


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env():
    env = dict(os.environ)
    # one CPU device, as on the GPU machine (one device); the suite's fast-compile flags
    env["XLA_FLAGS"] = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _run(out, *args):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--out", str(out), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    with open(out / "gpu.json") as f:
        report = json.load(f)
    md = (out / "gpu.md").read_text()
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith(md.rstrip()), "gpu.md is printed last on stdout"
    assert report["exit_status"] == proc.returncode, log
    return report, md, log


def _cases(passed=True, incomplete=None):
    err = dict.fromkeys(CHECKS, 1e-7) | {"slots": 1e-7}
    return [
        dict(optimizer=o, combiner=c, passed=passed, rel_err=err)
        | ({"incomplete": incomplete} if incomplete else {})
        for o in sorted(OPTIMIZERS)
        for c in sorted(COMBINERS)
    ]


def test_plan_order_skips_and_incremental_report(gpu, tmp_path, monkeypatch):
    """The full run's order, on a fake clock: correctness of xla and pallas, scale xla,
    torch, scale pallas, reference last; the budget cuts from the end; gpu.json is
    rewritten while a child runs (marked running) and after each; a correctness child cut
    short keeps its cases as partial (exit status 2, not a failure)."""
    clock = [1000.0]
    monkeypatch.setattr(gpu.time, "time", lambda: clock[0])
    monkeypatch.setattr(gpu, "make_batches", lambda cfg, path: [dict(ids=10, unique_rows=5)])
    took = dict(preflight=5, correctness=60, jax_scale=100, torch=100)
    ran, seen_running = [], []

    def child(kind, variant, cfg, tmp, deadline, cap_s, log, progress=None):
        ran.append((kind, variant))
        data = {"sections": {}, "skipped": [], "errors": [], "status": "ok"}
        if kind == "preflight":
            data.update(backend="gpu", devices=["NVIDIA H200 (gpu)"], jax="0.11.2")
        elif kind == "correctness":
            cut = variant == "pallas"  # as if killed at its cap after one step
            data["cases"] = _cases(None, "lookups of 1 of 3 steps checked") if cut else _cases()
            progress(dict(data, status="running"))
            with open(tmp_path / "gpu.json") as f:
                seen_running.append(json.load(f))
        clock[0] += took[kind]
        return dict(data, wall_s=took[kind])

    monkeypatch.setattr(gpu, "run_child", child)
    status = gpu.main(["--out", str(tmp_path), "--budget-s", "400"])
    assert ran == [
        ("preflight", None),
        ("correctness", "xla"),
        ("correctness", "pallas"),
        ("jax_scale", "xla"),
        ("torch", None),
        # scale [pallas]: 75 s left, needs ~110 (what scale [xla] took, +10%): skipped
        ("correctness", "reference"),
    ]
    report = json.loads((tmp_path / "gpu.json").read_text())
    md = (tmp_path / "gpu.md").read_text()
    assert status == report["exit_status"] == 2  # pallas's correctness is incomplete
    assert report["state"] == "finished" and "Incomplete" not in md
    assert report["summary"]["incomplete_variants"] == ["pallas"]
    assert not report["summary"]["failed"]
    assert "partial, worst 1.0e-07 (lookups of 1 of 3 steps checked)" in md
    for label in ("scale [pallas]", "scale [reference]"):
        (note,) = [n for n in report["skipped"] if n.startswith(label)]
        assert f"- {note}" in md
    assert [r["state"] for r in seen_running] == [
        "running: correctness [xla]",
        "running: correctness [pallas]",
        "running: correctness [reference]",
    ]
    assert seen_running[0]["correctness"]["xla"]["status"] == "running"
    assert len(seen_running[0]["correctness"]["xla"]["cases"]) == 18

    # the second call: no correctness; scale runs in the same order
    ran.clear()
    assert gpu.main(["--out", str(tmp_path), "--skip-correctness", "--budget-s", "330"]) == 0
    assert ran[1:] == [("jax_scale", "xla"), ("torch", None), ("jax_scale", "pallas")]


def test_gpu_script_smoke_on_cpu(tmp_path):
    """25 s of budget: every child that ran is right, every one that did not is
    listed as skipped or cut short by the budget; nothing crashed."""
    report, md, log = _run(tmp_path, "--allow-cpu", "--budget-s", "25")
    assert report["state"] == "finished", log
    assert report["preflight"]["backend"] == "cpu" and report["preflight"]["status"] == "ok"
    assert report["exit_status"] in (0, 2), log  # 2: something did not fit the minute
    children = [*report["correctness"].values(), *report["scale"].values()]
    for child in children + [report["torch"] or {}]:
        for e in child.get("errors", []):
            assert e.startswith("child killed: ran past its share of the budget"), e
    for res in report["correctness"].values():
        for c in res.get("cases", []):
            assert (c["optimizer"], c["combiner"]) in {
                (o, b) for o in OPTIMIZERS for b in COMBINERS
            }
            assert c["passed"] is not False, c
            for k, v in c["rel_err"].items():
                assert v is None or 0 <= v < 1e-5, (c, k)
            if c["passed"]:
                assert all(c["rel_err"][k] is not None for k in CHECKS), c
                assert (c["rel_err"]["slots"] is None) == (c["optimizer"] == "SGD"), c
    for res in report["scale"].values():
        for name in ("copy_bandwidth", "build_and_preprocess", "forward", "step", "serving_jit"):
            listed = name in res["sections"] or any(n.startswith(name) for n in res["skipped"])
            assert listed or res["status"] != "ok", (name, res)
    done = {f"correctness [{v}]" for v in report["correctness"]}
    done |= {f"scale [{v}]" for v in report["scale"]} | ({"torch"} if report["torch"] else set())
    for name in ("correctness [xla]", "scale [xla]", "torch"):  # --smoke's plan
        assert name in done or any(n.startswith(name) for n in report["skipped"]), (name, md)
    torch = report["torch"]
    if torch is not None and torch.get("torch") == "not installed":
        assert "torch not installed" in md


def test_gpu_script_preflight_stops_without_a_gpu(tmp_path):
    # the budget leaves the pre-flight child its whole cap: on a loaded CI machine (four test
    # processes on two cores) importing jax and the Pallas kernels took over 75 s
    report, md, log = _run(tmp_path, "--budget-s", "240")
    assert report["exit_status"] == 3, log
    assert "JAX's default backend is 'cpu', not 'gpu'" in report["aborted"]
    assert "**Aborted**" in md and "--allow-cpu" in md
    assert not report["correctness"] and not report["scale"] and report["torch"] is None
