"""examples/dlrm.py at its --quick sizes, run as a user runs it (a process of its own: a
crash is reported with its output, and TensorFlow is imported away from the tests'
process): a whole DLRM (26 tables, one of raw ids, one in bfloat16, 13 dense features,
flax nnx) trains with evaluation between epochs, checkpoints, and is served by a
TensorFlow-only process from a SavedModel with the evaluation's scores (`run` asserts that
itself; here again); run again on the same workdir (`main` called a second time in the
same process, its model built anew) it resumes where it stopped."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The example's `main` run twice in one process, as a user runs it twice on one workdir:
# the second run builds its model anew and resumes from the checkpoint on disk (nothing of
# the first run's model is reused); the process's start, its imports and the jitted
# steps' traces are paid once.
TWICE = """
import sys
sys.path.insert(0, sys.argv[1])
import dlrm
workdir, summary = sys.argv[2], sys.argv[3]
print("=== first run", flush=True)
dlrm.main(["--quick", workdir, "--summary", summary + ".1"])
print("=== second run", flush=True)
dlrm.main(["--quick", workdir, "--summary", summary + ".2", "--no-serve"])
"""


def _run_example_twice(tmp_path) -> list[tuple[str, dict]]:
    """`[(stdout, summary)]` of the first run and of the second (`--no-serve`), one
    workdir."""
    summary = str(tmp_path / "summary.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    # two CPU devices (the tables sharded over both): smaller programs than the suite's 8
    flags = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {flags}"
    env["JAX_PLATFORMS"] = "cpu"
    examples = os.path.join(ROOT, "examples")
    proc = subprocess.run(
        [sys.executable, "-c", TWICE, examples, str(tmp_path / "work"), summary],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    _, first, second = proc.stdout.split("=== ")
    assert first.startswith("first run") and second.startswith("second run"), proc.stdout
    runs = []
    for i, out in enumerate((first, second), start=1):
        with open(f"{summary}.{i}") as f:
            result = json.load(f)
        runs.append((out, {k: None if v is None else np.asarray(v) for k, v in result.items()}))
    return runs


def test_dlrm_trains_evaluates_resumes_and_serves(tmp_path):
    (out, first), second_run = _run_example_twice(tmp_path)
    assert "epoch 1:" in out and "epoch 2:" in out and "resumed" not in out
    assert "scores equal" in out
    np.testing.assert_allclose(first["served"], first["scores"], rtol=2e-5, atol=2e-6)
    assert first["scores"].std() > 0  # scores that depend on the inputs, not a constant

    # the same workdir: resumes after epoch 2 (served once above: not again)
    out, second = second_run
    assert "resumed after epoch 2 (6 embedding updates)" in out
    assert "epoch 3:" in out and "epoch 4:" in out and "epoch 1:" not in out
    assert second["served"] is None and "scores equal" not in out
    assert not np.allclose(second["scores"], first["scores"])  # trained on: it moved
    assert math.isfinite(second["eval_loss"]) and second["eval_loss"] < math.log(2) + 0.05
