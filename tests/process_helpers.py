"""Launching real worker processes for the multi-process tests (127.0.0.1 only)."""

import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands, env, timeout=300):
    """Start every command at once, wait for all; assert each exits 0 (showing its output)."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd in commands
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
        outputs.append(out.decode(errors="replace"))
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs
