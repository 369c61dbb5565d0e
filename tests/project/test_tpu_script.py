"""`benchmarks/tpu.py` on CPU at tiny sizes (`--smoke --allow-cpu`): its plumbing, so that
the one run a chip is lent for does not fail on the script (the kernels themselves are
tested in `tests/device/test_tpu_ops.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import ROOT


def test_smoke_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", EMBEDMESH_CPU_KERNELS="0")
    # one CPU device, as on the chip's host; the suite's fast-compile flags
    env["XLA_FLAGS"] = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "tpu.py"),
        "--smoke",
        "--allow-cpu",
        "--dims",
        "64",
        "--optimizers",
        "adagrad",
        "--apart-dims",
        "",  # slots apart: the same program on CPU (no slots in rows there)
        "--sections",  # the kernels-off, pipelined and optimizer cases: the same function
        "correctness,step,bound",
        "--bound-rows",  # one block of 8 rows: the Pallas interpreter unrolls a block
        "8",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads((tmp_path / "tpu.json").read_text())["cases"]
    names = [c["name"] for c in cases]
    assert names == [
        "correct/adagrad",
        "step/embedmesh/d64",
        "step/jax-dense/d64",
        "step/jax-sparse/d64",
        "bound/w128",
    ]
    errors = {c["name"]: c.get("error") for c in cases if "error" in c or "skipped" in c}
    assert not errors, errors
    # on one CPU the "chip" is the CPU too: the same program, the same tables
    assert cases[0]["table_max_abs_diff"] == 0.0
    assert (tmp_path / "tpu.md").read_text().startswith("# benchmarks/tpu.py")
    # the step's rows moved against the bound of the same run: a lookup gather, the
    # update's gather and scatter of the table and its accumulator (slots apart on CPU)
    step = cases[1]
    moved = json.loads((tmp_path / "tpu.json").read_text())["rows_moved"]["step/embedmesh/d64"]
    assert moved["rows"] == step["unique"] * 5 > 0
    assert 0 < moved["at_best_movers_ms"] <= moved["at_dma_bound_ms"]
    assert moved["of_step_dma_bound"] == pytest.approx(moved["at_dma_bound_ms"] / step["step_ms"])
