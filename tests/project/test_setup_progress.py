"""setup.py's install progress: pip shows a build's own output only with `pip -v`, so the
C++ build's lines go where pip's output goes (a terminal or a pipe), and nowhere more
under `pip -q` or `PIP_QUIET`, or where pip writes to a file (our write would not move
pip's offset: pip's next line would overwrite it). A stand-in `pip` runs a child that
calls setup.py's `_progress` as pip runs a build: output captured. No build, no network."""

from __future__ import annotations

import concurrent.futures
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


def test_build_ext_inplace_builds_into_the_checkout(tmp_path):
    """`python setup.py build_ext --inplace` builds the libraries into the checkout's
    embedmesh/_libs: setuptools' build_ext.run clears `inplace` while it runs (it copies
    the extension into the tree afterwards), and it runs beside the libraries' build, so
    where they go is read before it starts. Its class run with stand-ins (no compiler):
    the extension's thread is under way before the libraries' build begins."""
    import ast
    import threading
    import types

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BuildNative"]
    assert len(found) == 1
    started, building = threading.Event(), threading.Event()
    built = []

    class Extensions:  # setuptools' build_ext, as far as BuildNative uses it
        inplace = 1
        build_lib = str(tmp_path / "build")

        def run(self):
            old, self.inplace = self.inplace, 0  # as setuptools' run does
            started.set()
            building.wait(10)  # compiling the extension while the libraries build
            self.inplace = old

    class Pool:  # a thread pool whose submit returns once the thread got going
        def __init__(self, n):
            self.pool = concurrent.futures.ThreadPoolExecutor(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.pool.shutdown()

        def submit(self, fn):
            future = self.pool.submit(fn)
            assert started.wait(10)
            return future

    native = types.SimpleNamespace(
        LIB_DIR_NAME="_libs",
        LIBRARIES={},
        editable_variants=lambda: ["x"],
        install_variants=lambda: ["x", "y"],
        build_all=lambda out, **kw: (built.append((out, kw["variants"])), building.set()),
    )
    namespace = {
        "build_ext": Extensions,
        "os": os,
        "concurrent": types.SimpleNamespace(futures=types.SimpleNamespace(ThreadPoolExecutor=Pool)),
        "_native": lambda: native,
        "_progress": lambda message: None,
        "ROOT": str(tmp_path),
    }
    exec(compile(ast.Module(found, []), "setup.py", "exec"), namespace)
    namespace["BuildNative"]().run()
    assert built == [(os.path.join(str(tmp_path), "embedmesh", "_libs"), ["x"])]
