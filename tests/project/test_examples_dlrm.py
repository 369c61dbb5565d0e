"""examples/dlrm.py at its --quick sizes: a whole DLRM (26 tables, one of raw ids, one in
bfloat16, 13 dense features, flax nnx) trains with evaluation between epochs, checkpoints,
resumes where it stopped, and is served by a TensorFlow-only process from a SavedModel with
the evaluation's scores (`run` asserts that itself; here again, and the resume)."""

import math

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("tensorflow")

from examples import dlrm


def test_dlrm_trains_evaluates_resumes_and_serves(tmp_path, capsys):
    first = dlrm.run(str(tmp_path), quick=True)
    out = capsys.readouterr().out
    assert "epoch 1:" in out and "epoch 2:" in out and "resumed" not in out
    np.testing.assert_allclose(first["served"], first["scores"], rtol=2e-5, atol=2e-6)
    assert first["scores"].std() > 0  # scores that depend on the inputs, not a constant

    second = dlrm.run(str(tmp_path), quick=True)  # the same workdir: resumes after epoch 2
    out = capsys.readouterr().out
    assert "resumed after epoch 2 (6 embedding updates)" in out
    assert "epoch 3:" in out and "epoch 4:" in out and "epoch 1:" not in out
    np.testing.assert_allclose(second["served"], second["scores"], rtol=2e-5, atol=2e-6)
    assert not np.allclose(second["scores"], first["scores"])  # trained on: it moved
    assert math.isfinite(second["eval_loss"]) and second["eval_loss"] < math.log(2) + 0.05
