"""Two real processes on 127.0.0.1 (2 CPU devices each, gloo) train like one with 4 devices,
a bfloat16 table among theirs."""

import os
import subprocess
import sys

import numpy as np
from process_helpers import free_port, run_together, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")


def test_two_processes_match_one_process_with_four_devices(tmp_path):
    single = tmp_path / "single.npz"
    multi = tmp_path / "multi.npz"
    subprocess.run(
        [sys.executable, WORKER, "0", "1", "0", str(single)],
        env=worker_env(),
        check=True,
        timeout=300,
    )
    port = free_port()
    run_together(
        [[sys.executable, WORKER, str(i), "2", str(port), str(multi)] for i in range(2)],
        env=worker_env(),
    )
    a, b = np.load(single), np.load(multi)
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 6
    for k in a.files:
        if k == "t3.parameters":  # bfloat16, stochastically rounded: the same bits
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
        else:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # training happened: the tables moved away from their initial values
    assert np.abs(a["t1.accumulators"] - 0.1).max() > 1e-3
    assert np.abs(a["t3.accumulators"] - 0.1).max() > 1e-3
