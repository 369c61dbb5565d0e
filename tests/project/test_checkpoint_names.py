"""The checkpoint package's modules share no private names: what one module uses of
another is that module's public name, so each module's private helpers can change without
a search through its neighbours (the package's own API is `embedmesh.checkpoint`)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "embedmesh" / "checkpoint"
PREFIX = "embedmesh.checkpoint"


def crossings(package: pathlib.Path = PACKAGE) -> list[str]:
    """`module: name` for each private name (`_x`, not dunder) that a checkpoint module
    imports from, or reads as an attribute of, another checkpoint module."""
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = set()  # names bound to a sibling module: `from embedmesh.checkpoint import x`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PREFIX:
                    aliases |= {a.asname or a.name for a in node.names if a.name in modules}
                elif node.module.startswith(PREFIX + "."):
                    found += [
                        f"{path.name}: {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    ]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{path.name}: {node.value.id}.{node.attr}")
    return sorted(set(found))


def test_checkpoint_modules_share_no_private_names():
    assert crossings() == []


def test_the_scan_sees_a_crossing(tmp_path):
    """The rule can fail: a module importing a sibling's private name, or reading one
    off a sibling module, is found."""
    for p in PACKAGE.glob("*.py"):
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / "extra.py").write_text(
        "from embedmesh.checkpoint.reading import _secret\n"
        "from embedmesh.checkpoint import recut\n"
        "x = recut._hidden\n"
    )
    got = crossings(tmp_path)
    assert "extra.py: embedmesh.checkpoint.reading._secret" in got
    assert "extra.py: recut._hidden" in got
