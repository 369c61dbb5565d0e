"""Every Python block of README.md runs verbatim, in order, in one namespace."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_blocks_run_verbatim(tmp_path, monkeypatch):
    blocks = readme_blocks()
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)  # the blocks write ckpt/ and export/
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i}", "exec"), namespace)
    # what the blocks promise
    assert tuple(namespace["out"]["watched"].shape) == (2, 8)
    assert tuple(namespace["out"]["recent"].shape) == (2, 3, 8)
    scores = np.asarray(namespace["scores"])
    assert scores.shape == (2,) and np.isfinite(scores).all()
