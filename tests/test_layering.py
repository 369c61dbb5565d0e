"""The package's layering, enforced (README "Layout"): data flows
declare -> layout -> host -> device -> facade/checkpoint -> serving, and no
layer imports one that comes after it (serving reads checkpoints and the
declared configs, never the device side). Imports are read from the source
(every import statement, also those inside functions)."""

import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "embedmesh"

# what each layer may import from embedmesh (besides itself and the always-allowed)
ALWAYS = {
    "embedmesh._native",  # the C++ libraries' loader: standard library only (test_native)
    "embedmesh._runtime",
    "embedmesh._compat",
    "embedmesh.config",
    "embedmesh.optimizers",
    "embedmesh.initializers",
    "embedmesh.inputs",
    "embedmesh.batch",
}
LAYERS = {
    # inputs checks sparse indices with the host kernels' one-pass check (imported at
    # first use): the one edge from the declared layer to a later one
    "declare": (
        [
            "config",
            "optimizers",
            "initializers",
            "inputs",
            "batch",
            "_runtime",
            "_compat",
            "_gpu_guard",
            "_native",
        ],
        {"embedmesh.serving.kernels"},
    ),
    "layout": (["layout"], set()),
    "host": (["host"], {"embedmesh.layout"}),
    "device": (["device"], {"embedmesh.layout"}),
    "facade": (["facade"], {"embedmesh.layout", "embedmesh.host", "embedmesh.device"}),
    "checkpoint": (["checkpoint"], {"embedmesh.layout", "embedmesh.device", "embedmesh.serving"}),
    "serving": (["serving"], {"embedmesh.layout", "embedmesh.host"}),
}


def _modules(prefixes):
    for p in prefixes:
        path = PKG / p
        files = sorted(path.rglob("*.py")) if path.is_dir() else [PKG / f"{p}.py"]
        yield from files


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = (
                    pkg.split(".")[: -node.level]
                    if path.name != "__init__.py"
                    else pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                )
                mod = ".".join(base + ([mod] if mod else []))
            for a in node.names:  # a submodule or a name of `mod`: judged as mod.name
                yield f"{mod}.{a.name}"


def _allowed(name: str, own: list, extra: set) -> bool:
    if not name.startswith("embedmesh"):
        return True
    if name in ALWAYS or any(name == a or name.startswith(a + ".") for a in ALWAYS):
        return True
    for p in own:
        if name == f"embedmesh.{p}" or name.startswith(f"embedmesh.{p}."):
            return True
    return any(name == e or name.startswith(e + ".") for e in extra)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_layer_imports_a_later_one(layer):
    own, extra = LAYERS[layer]
    bad = []
    for path in _modules(own):
        for name in _imports(path):
            if not _allowed(name, own, extra):
                bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_platform_dispatch_only_in_the_ops_layer():
    """Which kernel runs on which platform is decided in embedmesh/device/ops only."""
    needles = (
        "default_backend(",
        "cpu_ops",
        "ops.available(",
        ".platform ==",
        ".platform !=",
        "EMBEDMESH_CPU_KERNELS",
    )
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[:2] == ("device", "ops") or rel.name in ("_runtime.py", "_compat.py"):
            continue
        text = path.read_text()
        bad += [f"{rel}: {n}" for n in needles if n in text]
    assert not bad, "\n".join(bad)


def test_import_embedmesh_loads_no_numba_and_builds_nothing(tmp_path):
    code = (
        "import sys, embedmesh; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numba', 'llvmlite', 'orbax', 'tensorstore')))"
    )
    env = {"EMBEDMESH_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=str(PKG.parent),
    ).stdout.strip()
    assert out == "[]"
    assert not (tmp_path / "cache").exists()  # no kernel was built


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or through others (every import
    statement counts, also those inside functions)."""
    graph: dict[str, set[str]] = {}
    modules = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            while imported and imported not in modules:  # `mod.name`: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                deps.add(imported)  # a package's __init__ is not a cycle of its modules
        graph[name] = deps

    def reaches(start, goal, seen):
        for d in graph.get(start, ()):
            if d == goal or (d not in seen and (seen.add(d) or reaches(d, goal, seen))):
                return True
        return False

    names = sorted(graph)
    cycles = [f"{a} <-> {b}" for a in names for b in graph[a] if reaches(b, a, set())]
    assert not cycles, cycles
