"""benchmarks/gpu.py --smoke: the GPU machine's one prepared script still runs (on CPU here).

Checks that it exits 0, writes gpu.json and gpu.md, and that its correctness section ran
and passed every optimizer x combiner case. Timings are not checked (smoke sizes, CPU).
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")

OPTIMIZERS = {"SGD", "Adagrad", "AdagradMomentum", "Adam(lazy)", "Adam(non-lazy)", "FTRL"}
COMBINERS = {"sum", "mean", "sqrtn"}


def test_gpu_script_smoke(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as on the GPU machine (one device)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    with open(tmp_path / "gpu.json") as f:
        report = json.load(f)
    md = (tmp_path / "gpu.md").read_text()
    assert md.strip() and md.strip() in proc.stdout, "gpu.md is printed last on stdout"
    assert proc.stdout.rstrip().endswith(md.rstrip())
    assert report["exit_status"] == 0
    assert report["correctness"], out
    for variant, res in report["correctness"].items():
        cases = res["cases"]
        assert {(c["optimizer"], c["combiner"]) for c in cases} == {
            (o, c) for o in OPTIMIZERS for c in COMBINERS
        }, variant
        assert len(cases) == len(OPTIMIZERS) * len(COMBINERS)
        bad = [c for c in cases if not c["passed"]]
        assert not bad, bad
        for c in cases:  # every check ran and gave a finite error below the tolerance
            errs = c["rel_err"]
            for k in ("lookup", "table", "serving_host", "serving_device"):
                assert errs[k] is not None and 0 <= errs[k] < 1e-5, (c, k)
            if c["optimizer"] == "SGD":
                assert errs["slots"] is None, c  # no slots
            else:
                assert errs["slots"] is not None and 0 <= errs["slots"] < 1e-5, c
        assert "float64" in res["reference"]
    # every scale section ran (or says why not); torch is absent here or ran
    for variant, res in report["scale"].items():
        assert not res["errors"], res["errors"]
        for name in ("copy_bandwidth", "build_and_preprocess", "forward", "step", "serving_jit"):
            assert name in res["sections"], (variant, name)
    torch = report["torch"]
    assert torch is not None
    assert torch.get("torch") == "not installed" or "sparse_adagrad" in torch["sections"]
    if torch.get("torch") == "not installed":
        assert "torch not installed" in md
