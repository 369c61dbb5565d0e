"""docs/flax.md's nnx model places its dense state on the embedding's mesh up front, so its
train step compiles once: the second step (and every later one) reuses the first step's
program. Runs the page's own block up to its loop, then steps it, counting XLA compiles.

The same block shows a whole model's checkpoint and resume; test_readme runs it (its
asserts: both halves restored, the next step's loss the trained model's), and a test here
checks that it shows each part a porting user needs."""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flax")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "project"))
from test_readme import page_blocks

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "flax.md"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILES: list = []  # one listener for the module (jax keeps listeners for the process)
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILES.append(name) if name == COMPILE_EVENT else None
)


def _doc_model_without_its_loop() -> str:
    code = dict((s, c) for s, c, _ in page_blocks(DOC))["An nnx model"]
    return code[: code.index("rng = np.random.default_rng(0)")]


@pytest.mark.parametrize("place_up_front", [True, False])
def test_the_second_step_compiles_nothing(place_up_front, tmp_path, monkeypatch):
    code = _doc_model_without_its_loop()
    if not place_up_front:  # the test can fail: without the placement, step 2 compiles
        code = code.replace("for part in (model.dense, optimizer):", "for part in ():")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    model, optimizer, train_step, em = (
        scope[k] for k in ("model", "optimizer", "train_step", "em")
    )
    rng = np.random.default_rng(0)
    per_step = []
    for _ in range(3):
        batch = {
            "watched": em.RaggedTensor.from_row_lengths(rng.integers(0, 1000, 24), [3] * 8),
            "user": rng.integers(0, 100, 8),
        }
        csr = model.embed.enqueue(batch)
        before = len(COMPILES)
        labels = jax.numpy.asarray(rng.integers(0, 2, 8), jax.numpy.float32)
        jax.block_until_ready(train_step(model, optimizer, csr, labels))
        per_step.append(len(COMPILES) - before)
    assert per_step[0] > 0  # the listener sees compiles
    if place_up_front:
        assert per_step[1:] == [0, 0], per_step
    else:
        assert per_step[1] > 0, per_step


def test_the_page_saves_restores_and_resumes_a_whole_model():
    """Read, not run (test_readme runs the block): what the page's model shows."""
    code = dict((s, c) for s, c, _ in page_blocks(DOC))["An nnx model"]
    train_step = code[code.index("def train_step") : code.index("return loss")]
    assert "csr = model.embed.map_ids(csr)" in train_step  # the raw-id step, in the step
    save, resume = code.split("# resume", 1)
    for half in ("model.embed.save_args()", "ocp.args.StandardSave", "nnx.OptState"):
        assert half in save, half
    # the embedding and the dense state from the checkpoint's own step; the update count
    # the restore returns kept apart from it; the dense state put on the new mesh; and
    # training goes on
    for part in (
        "step = mngr.latest_step()",
        "updates = resumed.embed.restore(mngr, step)",
        "mngr.restore(step,",
        "ocp.args.StandardRestore",
        "nnx.update(resumed.dense,",
        "nnx.update(resumed_opt,",
        "for part in (resumed.dense, resumed_opt):",
        "train_step(resumed, resumed_opt,",
    ):
        assert part in resume, part
