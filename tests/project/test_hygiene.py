"""Project habits (issue #13 part 6): one version source, py.typed shipped, the changelog,
benchmark logs under benchmarks/runs/, the linters in .ci/run, and benchmarks/ab.py's
parsers on the stored benchmark logs. Reads files only: no build, no subprocess."""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib.util
import io
import os
import re
import tomllib

import pytest
from paths import ROOT

RUNS = os.path.join(ROOT, "benchmarks", "runs")


def read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(read("pyproject.toml"))


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab", os.path.join(ROOT, "benchmarks", "ab.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def static_version() -> str:
    """`__version__ = "..."` in embedmesh/__init__.py, read as setuptools reads it."""
    tree = ast.parse(read("embedmesh", "__init__.py"))
    found = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    assert len(found) == 1, "embedmesh/__init__.py needs one literal __version__ = '...'"
    return found[0]


def test_one_version_source(pyproject):
    project = pyproject["project"]
    assert "version" not in project
    assert "version" in project["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "embedmesh.__version__"
    }
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", static_version())


def test_py_typed_is_package_data(pyproject):
    assert os.path.isfile(os.path.join(ROOT, "embedmesh", "py.typed"))
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["embedmesh"]


def test_changelog_has_this_version():
    text = read("CHANGELOG.md")
    headings = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
    assert headings and headings[0] == "Unreleased"
    version = static_version()
    if ".dev" not in version:
        assert version in headings, f"CHANGELOG.md has no section for {version}"


def test_lint_extra_in_test_extra(pyproject):
    extras = pyproject["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0] for r in extras["lint"]}
    assert {"ruff", "mypy"} <= names
    assert any(r.startswith("embedmesh[") and "lint" in r for r in extras["test"])


def test_ci_runs_the_linters_between_install_and_tests():
    lines = [x.strip() for x in read(".ci", "run").splitlines()]
    lines = [x for x in lines if x and not x.startswith("#")]

    def at(fragment: str) -> int:
        hits = [i for i, x in enumerate(lines) if fragment in x]
        assert hits, f".ci/run has no line with {fragment!r}"
        return hits[0]

    install = at("pip install -e '.[test]'")
    assert "python3 -m venv .venv" in lines[install]
    checks = [at(".venv/bin/ruff check"), at(".venv/bin/ruff format --check"), at(".venv/bin/mypy")]
    # the suite: README's command itself (a warm-up before it runs a few tests too)
    assert ".venv/bin/python -m pytest" in lines, ".venv/bin/python -m pytest"
    assert install < min(checks) and max(checks) < lines.index(".venv/bin/python -m pytest")


def test_benchmark_logs_live_in_runs():
    stray = [
        path
        for path in glob.glob(os.path.join(ROOT, "benchmarks", "**", "*_run_*.txt"), recursive=True)
        if os.path.dirname(path) != RUNS
    ]
    assert not stray, f"move these to benchmarks/runs/: {stray}"
    pages = glob.glob(os.path.join(ROOT, "benchmarks", "**", "RESULTS*.md"), recursive=True)
    pages += glob.glob(os.path.join(RUNS, "*-history.md"))
    assert pages
    for md in pages:
        with open(md) as f:
            for name in re.findall(r"`(?:\.\./)?runs/([\w.-]+\.(?:txt|json))`", f.read()):
                assert os.path.isfile(os.path.join(RUNS, name)), f"{md} cites runs/{name}"


# ---------------------------------------------------------------------------
# benchmarks/ab.py


def test_ab_parses_train_step_log(ab):
    got = ab.parse_train_step(read("benchmarks", "runs", "train_run_2026-11-29_b.txt"))
    assert got["embedmesh device step"] == (22.8, "ms")
    assert got["embedmesh host prep"] == (5.5, "ms")
    assert got["embedmesh end-to-end (prefetch)"] == (28.2, "ms")
    assert got["embedmesh peak RSS, steps"] == (4.37, "GB")
    assert "embedmesh-core device step" in got
    assert all(k.startswith("embedmesh") for k in got)  # no fbgemm / plain-jax figures


def test_ab_parses_train_step_table_with_the_end_to_end_peak(ab):
    """train_step.py's table since 2026-12-03: a fourth size, the end-to-end peak ("-" for
    a peer without an end-to-end run)."""
    text = (
        "  peer            host prep    device  M ids/s      best  M ids/s e2e prefetch  "
        "M ids/s tables+slots peak setup peak steps   peak e2e\n"
        "  embedmesh          9.3 ms  192.4 ms     1.70   40.4 ms     8.12      59.3 ms     "
        "5.52      3.81 GB    4.26 GB    4.28 GB    4.29 GB\n"
        "  embedmesh-2dev     9.0 ms   30.0 ms    10.90   28.0 ms    11.70            -        "
        "-      3.81 GB    4.20 GB    4.30 GB          -\n"
        "  fbgemm-rowwise     0.1 ms   25.4 ms    12.88   23.5 ms    13.95            -        "
        "-      1.91 GB    2.28 GB    2.29 GB          -\n"
    )
    got = ab.parse_train_step(text)
    assert got["embedmesh device step"] == (192.4, "ms")
    assert got["embedmesh end-to-end (prefetch)"] == (59.3, "ms")
    assert got["embedmesh peak RSS, steps"] == (4.28, "GB")
    assert got["embedmesh peak RSS, end to end"] == (4.29, "GB")
    assert got["embedmesh-2dev device step, best"] == (28.0, "ms")
    assert "embedmesh-2dev end-to-end (prefetch)" not in got
    assert "embedmesh-2dev peak RSS, end to end" not in got
    assert all(k.startswith("embedmesh") for k in got)


def test_ab_parses_serving_log(ab):
    got = ab.parse_serving(read("benchmarks", "runs", "serving_run_2026-11-30_d.txt"))
    value, unit = got["ragged/sum embedmesh[numba]"]
    assert unit == "ms" and value == pytest.approx(7.96, abs=0.01)
    assert "dense embedmesh[numba-2t]" in got and "sparse/mean embedmesh[numpy]" in got
    assert all(" embedmesh[" in k for k in got)  # no tf / torch figures


def test_ab_parses_serving_online_log(ab):
    got = ab.parse_serving_online(read("benchmarks", "runs", "serving_online_2026-12-06_h43.txt"))
    assert got["em-numpy batch 1, 1 client p50"] == (11.0, "us")
    assert got["em-numpy batch 1, 2 clients p99"] == (23.0, "us")
    value, unit = got["em-np-own batch 1, 4 clients us a request (all clients)"]
    assert unit == "us" and value == pytest.approx(1e6 / 46632)
    assert "em-np-noplan batch 1, 1 client p50" in got  # names longer than the column
    assert not any(k.startswith(("torch", "tf ")) for k in got)


def test_ab_parses_checkpoint_log(ab):
    got = ab.parse_checkpoint(read("benchmarks", "runs", "checkpoint_run_2026-11-29_unstacked.txt"))
    assert got["restore into 8 devices (same layout), median"] == (5.01, "s")
    assert got["load_tables (serving: parameters only, host), first"] == (1.06, "s")
    assert got["save (sync) + fsync, first"][0] == pytest.approx(8.52)
    assert got["async save, written"] == (1.32, "s")
    assert not any(k.startswith("dd") for k in got)


def test_ab_parses_preprocess_output(ab):
    text = (
        "cores: 2, numba: True, jax-tpu-embedding: yes\n\n"
        "ragged: 8.52 M ids per step; medians of 5 interleaved rounds; wall time, and CPU "
        "time of all threads\n"
        "  numba 1T, stacked            wall   180.2 ms   47.3 M ids/s (best  50.1)   cpu "
        "  170.0 ms   50.1 M ids/cpu-s\n"
        "  jax-tpu-embedding            wall   300.0 ms   28.4 M ids/s (best  30.0)   cpu "
        "  500.0 ms   17.0 M ids/cpu-s\n"
        "  numba 1T, stacked vs jax-tpu-embedding: wall 1.66x, cpu 2.94x\n"
    )
    assert ab.parse_preprocess(text) == {
        "ragged numba 1T, stacked wall": (180.2, "ms"),
        "ragged numba 1T, stacked cpu": (170.0, "ms"),
    }


def test_ab_summary_ratio_is_baseline_over_new(ab):
    rounds = [({"t": (2.0, "ms")}, {"t": (1.0, "ms")}), ({"t": (3.0, "ms")}, {"t": (2.0, "ms")})]
    (line,) = ab.summarize(rounds, 0.97)[1:]
    assert "1.750" in line and "[1.500, 2.000]" in line and "below" not in line
    slower = [({"t": (1.0, "ms")}, {"t": (2.0, "ms")})]
    assert "below 0.97" in ab.summarize(slower, 0.97)[1]


def test_ab_dry_run_runs_each_trees_own_script(ab):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            ab.main(
                [
                    "--baseline",
                    ROOT,
                    "--new",
                    ROOT,
                    "--only",
                    "serving",
                    "--dry-run",
                    "--args",
                    "serving=--rounds 2",
                ]
            )
            == 0
        )
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    script = ab.script_path(ROOT, "serving")
    assert script and os.path.isfile(script)
    for line in lines:
        assert f"PYTHONPATH={ROOT}" in line
        assert script in line
        assert line.endswith("--rounds 2")


def test_ab_finds_scripts_by_area_or_flat(ab, tmp_path):
    """A tree from before the areas (benchmarks/train_step.py) still runs as a baseline."""
    assert ab.script_path(ROOT, "train_step") == os.path.join(
        ROOT, "benchmarks", "train", "train_step.py"
    )
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "train_step.py").write_text("")
    assert ab.script_path(str(tmp_path), "train_step") == str(
        tmp_path / "benchmarks" / "train_step.py"
    )
    assert ab.script_path(str(tmp_path), "checkpoint") is None


def test_ab_env_goes_to_one_side(ab):
    """--baseline . --new . with an environment variable on one side: an A/B of a setting
    (what the one-off benchmarks/isa.py did for EMBEDMESH_CPU_ISA)."""
    out = io.StringIO()
    argv = ["--baseline", ROOT, "--new", ROOT, "--only", "train_step", "--dry-run"]
    with contextlib.redirect_stdout(out):
        assert ab.main([*argv, "--baseline-env", "EMBEDMESH_CPU_ISA=x86-64-v3"]) == 0
    base, new = out.getvalue().splitlines()
    assert base.startswith("baseline") and "EMBEDMESH_CPU_ISA=x86-64-v3" in base
    assert new.startswith("new") and "EMBEDMESH_CPU_ISA" not in new
    with pytest.raises(SystemExit):
        ab.main([*argv, "--new-env", "no-equals-sign"])


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from `def` to its end (nested functions included), less its
    docstring's."""
    size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    if ast.get_docstring(node, clean=False) is not None:
        first = node.body[0]
        size -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return size


def test_code_lines_leave_out_the_docstring():
    tree = ast.parse('def f(x):\n    """Doc,\n    two lines."""\n    y = x\n    return y\n')
    assert code_lines(tree.body[0]) == 3  # type: ignore[arg-type]


def test_no_function_over_120_lines_without_a_reason():
    """Issue 39: no function of embedmesh/ has more than 120 lines of code (from `def` to
    its end, its docstring left out) unless its docstring says why it is one piece: by
    convention it contains the words "one function" or "Over 120 lines", next to the
    reason."""
    long = []
    for path in sorted(glob.glob(os.path.join(ROOT, "embedmesh", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for node in ast.walk(ast.parse(read(rel), rel)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            size = code_lines(node)
            doc = (ast.get_docstring(node) or "").lower()
            if size <= 120 or "one function" in doc or "over 120 lines" in doc:
                continue
            long.append(f"{rel}:{node.lineno} {node.name} ({size} lines)")
    assert not long, long
