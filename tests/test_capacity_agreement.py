"""Two real processes fed DIFFERENT batches agree on capacities and batch shapes.

Automatic capacities and overflow="grow" are decided from every process's
needs (issue #15 item 0): the job trains like one process over the union of the
batches; capacities that differ per process raise a clear error on every
process before any collective (no gloo size mismatch, no hang).
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from process_helpers import free_port, run_collect

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "capacity_worker.py")
TIMEOUT = 60  # a hang in a collective fails the test instead of stalling it


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


def _pair(prefix, modes):
    port = free_port()
    return run_collect(
        [[sys.executable, WORKER, str(i), "2", str(port), str(prefix), modes] for i in range(2)],
        env=_env(),
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`{mode: (single-process reference, process 0's, process 1's results)}`."""
    d = tmp_path_factory.mktemp("capacity")
    subprocess.run(
        [sys.executable, WORKER, "0", "1", "0", str(d / "single"), "auto,grow"],
        env=_env(),
        check=True,
        timeout=TIMEOUT,
    )
    codes, outs = _pair(d / "multi", "auto,grow")
    for code, out in zip(codes, outs):
        assert code == 0, out[-3000:]
    return {
        m: tuple(
            np.load(d / f"{p}.{m}.{i}.npz") for p, i in (("single", 0), ("multi", 0), ("multi", 1))
        )
        for m in ("auto", "grow")
    }


@pytest.mark.parametrize("mode", ["auto", "grow"])
def test_different_batches_train_like_one_process(trained, mode):
    single, p0, p1 = trained[mode]
    # every process uses the capacities one process over the union would choose
    np.testing.assert_array_equal(p0["capacities"], single["capacities"])
    np.testing.assert_array_equal(p1["capacities"], single["capacities"])
    if mode == "grow":  # it grew at step 2, from process 1's batch alone
        caps = single["capacities"]
        assert (caps[2] > caps[1]).all(), caps
        assert (p0["needs"][2] <= caps[1]).all() and (p1["needs"][2] > caps[1]).any()
    keys = [k for k in single.files if k not in ("capacities", "needs")]
    assert len(keys) == 4
    for k in keys:
        np.testing.assert_allclose(p0[k], single[k], rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(p1[k], single[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert np.abs(single["t1.accumulators"] - 0.1).max() > 1e-3  # it trained


def _caught(out, mode):
    return next(x for x in out.splitlines() if x.startswith(f"CAUGHT {mode} "))


def test_errors_reach_every_process_before_any_mismatched_collective(tmp_path):
    codes, outs = _pair(tmp_path / "errors", "mismatch,first_error,late_error")
    assert codes == [3, 3], "\n=====\n".join(o[-3000:] for o in outs)
    for out in outs:
        # capacities that differ per process: the same clear error on every process
        line = _caught(out, "mismatch")
        assert "ValueError: stack t1+t2:" in line and "max_ids_per_partition" in line, line
        assert "process 0 has 64, process 1 has 32" in line, line
    # an overflow in one process's first batch (the agreement): its own error there,
    # and the others learn of it in the agreement instead of waiting in a collective
    line = _caught(outs[1], "first_error")
    assert re.search(r"ValueError: stack t1\+t2: device [23] .* needs \d+ unique ids", line), line
    assert "max_unique_ids_per_partition=6" in line, line
    line = _caught(outs[0], "first_error")
    assert "RuntimeError: process(es) [1] could not preprocess their batch" in line, line
    # overflow in a later batch with fixed capacities (no per-step collective): the
    # overflowing process raises before any collective; the other, already in the
    # step's collective, gets the runtime's error when that process exits
    line = _caught(outs[1], "late_error")
    assert re.search(r"ValueError: stack t1\+t2: device [23] .* over the capacity", line), line
    assert "JaxRuntimeError" in _caught(outs[0], "late_error")
