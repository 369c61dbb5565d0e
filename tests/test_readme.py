"""Every Python block of README.md runs as the README presents it: alone, in a fresh
namespace, or, where the text before it says it is `continuing the "<section>" block`,
after that section's block (and whatever that one continues)."""

import importlib.util
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
CONTINUES = re.compile(r'continuing the "([^"]+)" block', re.I)


def readme_blocks() -> dict[str, tuple[str, str | None]]:
    """`{section heading: (code, heading of the block it continues, or None)}` of every
    ```python block, one per section."""
    parts = re.split(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    blocks: dict[str, tuple[str, str | None]] = {}
    section = ""
    for text, code in zip(parts[0::2], parts[1::2]):  # each block after its text
        section = ([section] + re.findall(r"^#+ (.+)$", text, flags=re.M))[-1]
        assert section not in blocks, f"two python blocks in README section {section!r}"
        paragraph = text.rstrip().rsplit("\n\n", 1)[-1]  # the text just before the block
        m = CONTINUES.search(" ".join(paragraph.split()))
        blocks[section] = (code, m.group(1) if m else None)
    return blocks


def test_readme_blocks_run_as_documented(tmp_path, monkeypatch):
    blocks = readme_blocks()
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)  # the blocks write ckpt/ and export/
    fresh: dict[str, dict] = {}  # a block's namespace no continuation has used yet

    def run(section: str) -> dict:
        code, continues = blocks[section]
        if continues is None:
            namespace: dict = {"__name__": "readme"}
        else:
            assert continues in blocks, f"{section!r} continues {continues!r}: no such block"
            namespace = fresh.pop(continues, None) or run(continues)  # rerun if used
        exec(compile(code, f"README.md, block of {section!r}", "exec"), namespace)
        return namespace

    def needs_missing(section: str) -> bool:
        """A block of an optional extra (flax, TensorFlow) where that is not installed."""
        code, continues = blocks[section]
        missing = [
            m
            for m in ("flax", "tensorflow")
            if re.search(rf"^(from|import) {m}\b", code, re.M) and not importlib.util.find_spec(m)
        ]
        return bool(missing) or (continues is not None and needs_missing(continues))

    results = {}
    for section in blocks:
        if not needs_missing(section):
            results[section] = fresh[section] = run(section)
    assert [s for s, (_, c) in blocks.items() if c] == [
        "Reading and loading tables",
        "Train → checkpoint → serve",
        "TF Serving: a SavedModel",
    ]
    # what the blocks promise
    out = results["Example"]["out"]
    assert tuple(out["watched"].shape) == (2, 8) and tuple(out["recent"].shape) == (2, 3, 8)
    scores = np.asarray(results["Train → checkpoint → serve"]["scores"])
    assert scores.shape == (2,) and np.isfinite(scores).all()
