"""Two real processes on 127.0.0.1 (2 CPU devices each, gloo) train like one with 4 devices."""

import os
import socket
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


def test_two_processes_match_one_process_with_four_devices(tmp_path):
    single = tmp_path / "single.npz"
    multi = tmp_path / "multi.npz"
    subprocess.run([sys.executable, WORKER, "0", "1", "0", str(single)], env=_env(), check=True,
                   timeout=300)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), "2", str(port), str(multi)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
        outputs.append(out.decode(errors="replace"))
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    a, b = np.load(single), np.load(multi)
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 4
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # training happened: the tables moved away from their initial values
    assert np.abs(a["t1.accumulators"] - 0.1).max() > 1e-3
