"""setup.py's install progress: pip shows a build's own output only with `pip -v`, so the
C++ build's lines go where pip's output goes (a terminal or a pipe), and nowhere more
under `pip -q` or `PIP_QUIET`, or where pip writes to a file (our write would not move
pip's offset: pip's next line would overwrite it). A stand-in `pip` runs a child that
calls setup.py's `_progress` as pip runs a build: output captured. No build, no network."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from paths import ROOT

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux's /proc")

LINE = "embedmesh: built the device kernels (test)"

# the child: setup.py's two functions, taken from its source (importing setup.py would
# run setup())
CHILD = textwrap.dedent(
    f"""
    import ast, os, re, stat, sys
    tree = ast.parse(open({os.path.join(ROOT, "setup.py")!r}).read())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name in ("_pip_stdout", "_progress")]
    assert len(found) == 2, [n.name for n in found]
    namespace = {{"os": os, "re": re, "stat": stat, "sys": sys}}
    exec(compile(ast.Module(found, []), "setup.py", "exec"), namespace)
    namespace["_progress"]({LINE!r})
    """
)

# the stand-in pip: its child's output captured, as pip captures a build's
PIP = textwrap.dedent(
    """
    import subprocess, sys
    print("pip: building", flush=True)
    child = subprocess.run([sys.executable, sys.argv[-1]], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [sys.argv[-2]], child.stdout  # stdout, for pip -v
    print("pip: done", flush=True)
    """
)


def run_pip(tmp_path, args, env=None, to_file=False) -> str:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    pip = tmp_path / "pip"  # the name the build's parent is recognised by
    pip.write_text(PIP)
    command = [sys.executable, str(pip), "install", *args, LINE, str(child)]
    env = {**{k: v for k, v in os.environ.items() if k != "PIP_QUIET"}, **(env or {})}
    if not to_file:
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, check=True)
        return out.stdout
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        subprocess.run(command, stdout=f, env=env, check=True)
    return log.read_text()


def test_progress_lines_reach_pips_pipe(tmp_path):
    assert run_pip(tmp_path, ["-e", "."]).splitlines() == ["pip: building", LINE, "pip: done"]


@pytest.mark.parametrize(
    "args, env",
    [(["-q", "-e", "."], None), (["-qe", "."], None), (["-e", "."], {"PIP_QUIET": "1"})],
)
def test_quiet_pip_stays_quiet(tmp_path, args, env):
    assert run_pip(tmp_path, args, env).splitlines() == ["pip: building", "pip: done"]


def test_a_file_keeps_pips_lines_whole(tmp_path):
    """Written beside pip into a file, the line would be overwritten in part by pip's next."""
    log = run_pip(tmp_path, ["-e", "."], to_file=True)
    assert log.splitlines() == ["pip: building", "pip: done"]
