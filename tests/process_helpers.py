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
