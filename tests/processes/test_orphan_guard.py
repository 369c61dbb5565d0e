"""Worker processes die with the test process that started them (tests/support/orphan_guard.py):
a killed pytest must not leave multi-process workers running."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from paths import SUPPORT as HERE  # orphan_guard and the child scripts

# A parent that starts a guarded child, prints its pid, then waits forever.
PARENT = """
import subprocess, sys
child = subprocess.Popen(
    [sys.executable, "-c", "import orphan_guard, time; print('up', flush=True); time.sleep(600)"],
    cwd=sys.argv[1], stdout=subprocess.PIPE, text=True,
)
assert child.stdout.readline().strip() == "up"
print(child.pid, flush=True)
import time; time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_guarded_child_dies_with_its_parent():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, HERE], stdout=subprocess.PIPE, text=True, cwd=HERE
    )
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30  # a bound on waiting, not a timing
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"worker {child} outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_every_worker_script_is_guarded():
    scripts = glob.glob(os.path.join(HERE, "*_worker.py")) + glob.glob(
        os.path.join(HERE, "*_check.py")
    )
    assert len(scripts) >= 8
    for script in scripts:
        with open(script) as f:
            assert "import orphan_guard" in f.read(), f"{script} does not import orphan_guard"
