"""Item 12: QuantizationConfig is accepted and ignored, and says so (docstring + one warning)."""

import warnings

import numpy as np
import pytest

from embedmesh import FeatureConfig, QuantizationConfig, TableConfig, serving_embedding_lookup
from embedmesh import config as cfg


def test_docstrings_say_ignored():
    assert "IGNORED" in QuantizationConfig.__doc__
    assert "ignored" in TableConfig.__doc__.lower() and "quantization" in TableConfig.__doc__


def test_one_time_warning(monkeypatch):
    monkeypatch.setattr(cfg, "_QUANTIZATION_WARNED", False)
    q = QuantizationConfig(4, -1.0, 1.0)
    with pytest.warns(UserWarning, match="quantization_config is accepted but ignored"):
        TableConfig(4, 2, quantization_config=q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = TableConfig(4, 2, quantization_config=q)  # once only
        TableConfig(4, 2)
    # and it is indeed ignored: serving returns the unquantized rows
    table = np.array([[0.1, 0.2], [0.3, 0.45], [0.0, 0.0], [0.9, 0.7]], np.float32)
    out = serving_embedding_lookup(
        {"f": np.array([1, 3])}, None, {t: table}, {"f": FeatureConfig(t)}
    )
    np.testing.assert_array_equal(np.asarray(out["f"]), table[[1, 3]])
