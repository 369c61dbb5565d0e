"""Launching real worker processes for the multi-process tests (127.0.0.1 only)."""

import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_collect(commands, env, timeout=300):
    """Start every command at once, wait for all (killing any still running after
    `timeout` seconds: a hang fails the caller, it does not stall it);
    `(return codes, outputs)`, a killed process's code negative."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd in commands
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n[killed after {timeout} s]".encode()
        finally:
            if p.poll() is None:
                p.kill()
        outputs.append(out.decode(errors="replace"))
    return [p.returncode for p in procs], outputs


def run_together(commands, env, timeout=300):
    """Start every command at once, wait for all; assert each exits 0 (showing its output)."""
    codes, outputs = run_collect(commands, env, timeout)
    for code, out in zip(codes, outputs):
        assert code == 0, out[-3000:]
    return outputs


def train_one_and_two_processes(tmp_path, single_sharding: str, multi_sharding: str):
    """`multiprocess_worker.py` once as one process with 4 devices under
    `single_sharding`, and as two processes of 2 devices under `multi_sharding`; the
    two saved results (`np.load`), the single one first."""
    import os
    import sys

    import numpy as np

    here = os.path.dirname(os.path.abspath(__file__))
    worker = os.path.join(here, "multiprocess_worker.py")
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    single, multi = tmp_path / "single.npz", tmp_path / "multi.npz"
    subprocess.run(
        [sys.executable, worker, "0", "1", "0", str(single), single_sharding],
        env=env,
        check=True,
        timeout=300,
    )
    port = free_port()
    run_together(
        [
            [sys.executable, worker, str(i), "2", str(port), str(multi), multi_sharding]
            for i in range(2)
        ],
        env=env,
    )
    return np.load(single), np.load(multi)
