"""Every Python block of README.md and of the guides in docs/ runs as the page presents
it: alone, in a fresh namespace, or, where the text before it says it is `continuing the
"<section>" block`, after that section's block (and whatever that one continues), which
may be on another page. Section headings that hold a block are unique over all pages.

Each block runs once: a chain of continuations runs its blocks in order in one namespace
(a second continuation of one block would run that block again: CI time)."""

import collections
import importlib.util
import logging
import os
import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONTINUES = re.compile(r'continuing the "([^"]+)" block', re.I)
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)


def page_blocks(page: pathlib.Path) -> list[tuple[str, str, str | None]]:
    """`[(section heading, code, heading of the block it continues, or None)]` of every
    ```python block of one page, one per section."""
    blocks = []
    text, section, end = page.read_text(), "", 0
    for m in FENCE.finditer(text):
        before = text[end : m.start()]
        end = m.end()
        section = ([section] + re.findall(r"^#+ (.+)$", before, flags=re.M))[-1]
        if m.group(1) != "python":
            continue
        paragraph = before.rstrip().rsplit("\n\n", 1)[-1]  # the text just before the block
        c = CONTINUES.search(" ".join(paragraph.split()))
        blocks.append((section, m.group(2), c.group(1) if c else None))
    return blocks


def all_blocks() -> dict[str, tuple[str, str, str | None]]:
    """`{section heading: (page, code, continued section or None)}` over every page."""
    blocks: dict[str, tuple[str, str, str | None]] = {}
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for section, code, continues in page_blocks(page):
            assert section not in blocks, (
                f"two python blocks in sections named {section!r} ({blocks[section][0]}, {name})"
            )
            blocks[section] = (name, code, continues)
    return blocks


def test_doc_blocks_run_as_documented(tmp_path, monkeypatch):
    blocks = all_blocks()
    assert len(blocks) >= 8
    monkeypatch.chdir(tmp_path)  # the blocks write ckpt/, export/, ...
    fresh: dict[str, dict] = {}  # a block's namespace no continuation has used yet
    results: dict[str, dict] = {}
    runs: collections.Counter = collections.Counter()

    def run(section: str) -> None:
        page, code, continues = blocks[section]
        if continues is None:
            namespace: dict = {"__name__": "readme"}
        else:
            assert continues in blocks, f"{section!r} continues {continues!r}: no such block"
            if continues not in fresh:
                run(continues)
            namespace = fresh.pop(continues)
        environ = dict(os.environ)  # a block may set XLA_FLAGS for a fresh process
        # and logging as an application does (environment.md: "embedmesh" at INFO, a root
        # handler): put back, or the rest of the suite's process logs and captures records
        ours, root = logging.getLogger("embedmesh"), logging.getLogger()
        levels, handlers = (ours.level, root.level), list(root.handlers)
        try:
            exec(compile(code, f"{page}, block of {section!r}", "exec"), namespace)
        finally:
            os.environ.clear()
            os.environ.update(environ)
            ours.setLevel(levels[0])
            root.setLevel(levels[1])
            root.handlers[:] = handlers
        runs[section] += 1
        results[section] = fresh[section] = namespace

    def needs_missing(section: str) -> bool:
        """A block of an optional extra (flax, TensorFlow) where that is not installed."""
        _, code, continues = blocks[section]
        missing = [
            m
            for m in ("flax", "tensorflow")
            if re.search(rf"^(from|import) {m}\b", code, re.M) and not importlib.util.find_spec(m)
        ]
        return bool(missing) or (continues is not None and needs_missing(continues))

    for section in blocks:
        if section not in runs and not needs_missing(section):
            run(section)
    twice = [s for s, n in runs.items() if n > 1]
    assert not twice, f"blocks run twice (continue the chain's last block instead): {twice}"
    assert {s: c for s, (_, _, c) in blocks.items() if c} == {
        "Your own jitted step": "A first training step",
        "Reading and loading tables": "Your own jitted step",
        "Saving and restoring on any device count": "Reading and loading tables",
        "Serving from a checkpoint": "Saving and restoring on any device count",
        "TF Serving: a SavedModel": "Serving from a checkpoint",
    }
    # what the blocks promise
    out = results["Example"]["out"]
    assert tuple(out["watched"].shape) == (2, 8) and tuple(out["recent"].shape) == (2, 3, 8)
    assert np.isfinite(float(results["Your own jitted step"]["loss"]))
    scores = np.asarray(results["Serving from a checkpoint"]["scores"])
    assert scores.shape == (2,) and np.isfinite(scores).all()
