"""The package's layering, enforced (README "Layout"): data flows
declare -> layout -> host -> device -> facade/checkpoint -> serving, and no
layer imports one that comes after it (serving reads checkpoints through their
host-side readers and the declared configs, never the device side; the checkpoint
package names the serving side's `EmbeddingForServing` only to keep its old import
path). Imports are read from the source (every import statement, also those inside
functions)."""

import ast
import pathlib

import pytest
from process_helpers import run_python

PKG = pathlib.Path(__file__).resolve().parents[2] / "embedmesh"

# what each layer may import from embedmesh (besides itself and the always-allowed)
ALWAYS = {
    "embedmesh._native",  # the C++ libraries' loader: standard library only (test_native)
    "embedmesh._runtime",
    "embedmesh._compat",
    "embedmesh._lazy",  # a module `__getattr__` loading a name on use: standard library only
    "embedmesh.config",
    "embedmesh.optimizers",
    "embedmesh.initializers",
    "embedmesh.inputs",
    "embedmesh.batch",
    "embedmesh.sparse_index",  # the check of COO indices, below inputs (imports no embedmesh)
}
# the checkpoint modules serving may import: the host-side readers (no mesh, no device)
CHECKPOINT_READERS = {
    "embedmesh.checkpoint.format",
    "embedmesh.checkpoint.reading",
    "embedmesh.checkpoint.loading",
}
LAYERS = {
    "declare": (
        [
            "config",
            "optimizers",
            "initializers",
            "inputs",
            "sparse_index",
            "batch",
            "_runtime",
            "_compat",
            "_gpu_guard",
            "_native",
            "_lazy",
        ],
        set(),
    ),
    "layout": (["layout"], set()),
    "host": (["host"], {"embedmesh.layout"}),
    "device": (["device"], {"embedmesh.layout"}),
    # the job, the functional middle layer: planning, batches, the step programs
    "job": (["job"], {"embedmesh.layout", "embedmesh.host", "embedmesh.device"}),
    # the stateful facade: TensorFlow's names over the job, and nothing below it
    "facade": (["facade"], {"embedmesh.job"}),
    "checkpoint": (["checkpoint"], {"embedmesh.layout", "embedmesh.device"}),
    "serving": (["serving"], {"embedmesh.layout", "embedmesh.host"} | CHECKPOINT_READERS),
    # the flax modules: over the job (its steps, host preprocessing) and checkpoints;
    # nothing imports them
    "flax": (["flax"], {"embedmesh.job", "embedmesh.checkpoint"}),
}
# single edges allowed beside the layers: (module, imported name)
EXCEPTIONS = {
    # `embedmesh.checkpoint.EmbeddingForServing`, the old import path, resolved on use
    ("embedmesh/checkpoint/__init__.py", "embedmesh.serving.for_serving.EmbeddingForServing"),
}

# optional extras: each imported by its own modules only (`embedmesh[flax]`, `embedmesh[tf]`)
EXTRAS = {
    "flax": ("embedmesh/flax/",),
    "tensorflow": ("embedmesh/serving/saved_model.py",),
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
        rel = path.relative_to(PKG.parent).as_posix()
        for name in _imports(path):
            if not _allowed(name, own, extra) and (rel, name) not in EXCEPTIONS:
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_facade_and_flax_reach_the_layers_below_through_the_job_only():
    """The rule itself, beside the table above: the facade imports the job and no
    device, host or layout module; the flax modules import only the job and
    checkpoints (a change of these lines is a change of the architecture)."""
    for layer, below in (
        ("facade", ("device", "host", "layout", "checkpoint")),
        ("flax", ("device", "host", "layout", "facade")),
    ):
        for path in _modules(LAYERS[layer][0]):
            names = [n for n in _imports(path) if n.startswith("embedmesh.")]
            bad = [n for n in names if n.split(".")[1] in below]
            assert not bad, f"{path.name} imports {bad}"
    assert any(n.startswith("embedmesh.job") for n in _imports(PKG / "facade.py"))


def _names_of_upper_layers(path: pathlib.Path) -> list[str]:
    """Where a module names a layer above the device: an import of the job, the facade,
    flax or checkpoints, the name `MeshEmbedding` in code, or a private attribute of an
    object that is not `self`/`cls` (an engine passed down and reached into)."""
    bad = []
    upper = ("embedmesh.job", "embedmesh.facade", "embedmesh.flax", "embedmesh.checkpoint")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(upper):
            bad.append(f"{path.name}:{node.lineno} imports {node.module}")
        if isinstance(node, ast.Import):
            bad += [f"{path.name} imports {a.name}" for a in node.names if a.name.startswith(upper)]
        if isinstance(node, ast.Name) and node.id == "MeshEmbedding":
            bad.append(f"{path.name}:{node.lineno} MeshEmbedding")
        if private_attribute(node, {"engine", "layer", "emb", "facade", "embedding"}):
            bad.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return bad


def private_attribute(node, of: set | None = None) -> bool:
    """Whether `node` reads a private attribute (`x._name`, not a dunder) of a name in
    `of` (None: of anything)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and (of is None or (isinstance(node.value, ast.Name) and node.value.id in of))
    )


def test_no_device_module_names_the_facade():
    """The device layer is handed a core and its state, never the facade: it imports no
    layer above it and reaches into no engine's private names."""
    bad = [b for p in sorted((PKG / "device").rglob("*.py")) for b in _names_of_upper_layers(p)]
    assert not bad, bad


def test_the_scan_finds_a_device_module_naming_the_facade(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from embedmesh.facade import MeshEmbedding\n"
        "def f(engine):\n    engine._maybe_build()\n    return MeshEmbedding\n"
    )
    assert len(_names_of_upper_layers(f)) == 3


def _module_of(name: str) -> str | None:
    """The embedmesh module an imported name lives in (`a.b.c` -> `a.b` when `c` is a name
    of module `a.b`), None outside embedmesh."""
    parts = name.split(".")
    while parts and parts[0] == "embedmesh":
        path = PKG.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def _source(module: str) -> pathlib.Path:
    path = PKG.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


SERVING = list(_modules(["serving"]))


def test_serving_reaches_no_device_code_through_checkpoints():
    """What serving imports, followed through every module it names (not through the
    parents' `__init__`s, which only re-export), reaches no device, facade, saving or
    restoring code: loading a checkpoint for serving needs no mesh."""
    todo = [".".join(p.relative_to(PKG.parent).with_suffix("").parts) for p in SERVING]
    seen: set = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imports(_source(module)):
            found = _module_of(name)
            if found is not None and found not in seen:
                todo.append(found)
    reached = sorted(
        m
        for m in seen
        if m.startswith(("embedmesh.device", "embedmesh.facade"))
        or m in ("embedmesh.checkpoint.saving", "embedmesh.checkpoint.restoring")
    )
    assert "embedmesh.checkpoint.loading" in seen  # the walk does reach the readers
    assert not reached, reached


def test_checkpoint_modules_stay_small():
    """Issue 25: the checkpoint package split along its seams, no module over ~600 lines."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PKG / "checkpoint").glob("*.py")}
    assert len(sizes) >= 8, sizes
    assert max(sizes.values()) <= 650, sizes


def test_optional_extras_are_imported_only_where_they_belong():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG.parent))
        for name in _imports(path):
            top = name.split(".")[0]
            if top in EXTRAS and not rel.startswith(EXTRAS[top]):
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


# Inside the device layer, in data-flow order: the ops (and their kernels, the transport),
# the per-shard program's shared pieces, one module per sharding strategy, then the core
# and its helpers. (module prefix, what it may import from embedmesh.device besides itself)
DEVICE_LAYERS = [
    ("embedmesh.device.ops", set()),
    # plain jax, and the ops' id hash and probe (`ops.id_hash`) and map step (`ops.id_map_step`)
    ("embedmesh.device.id_map", {"embedmesh.device.ops"}),
    ("embedmesh.device.shard_program", {"embedmesh.device.ops"}),
    (
        "embedmesh.device.strategies",
        {"embedmesh.device.ops", "embedmesh.device.shard_program", "embedmesh.device.id_map"},
    ),
]


@pytest.mark.parametrize("prefix,allowed", DEVICE_LAYERS, ids=[p for p, _ in DEVICE_LAYERS])
def test_device_sublayers_import_only_earlier_ones(prefix, allowed):
    """The ops know no strategy, shard_program no strategy, a strategy no core: the
    transport and the strategies are passed down, never looked up from above."""
    path = PKG.parent.joinpath(*prefix.split("."))
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    assert files, prefix
    bad = []
    for f in files:
        for name in _imports(f):
            if not name.startswith("embedmesh.device") or name.startswith(prefix):
                continue
            if name in ("embedmesh.device.ops", "embedmesh.device.shard_program"):
                target = name  # `from embedmesh.device import ops`
            else:
                target = _module_of(name) or name
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                bad.append(f"{f.relative_to(PKG.parent).as_posix()} imports {name}")
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
    """Nor TensorFlow or flax (optional extras), where they are installed."""
    code = (
        "import sys, embedmesh; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numba', 'llvmlite', 'orbax', 'tensorstore', 'tensorflow', 'flax')))"
    )
    env = {"EMBEDMESH_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    out = run_python(code, env, str(PKG.parent)).strip()
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
