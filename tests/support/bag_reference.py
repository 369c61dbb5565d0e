"""The float64 reference of the serving bag kernels, shared by tests/device/test_kernels.py
(every backend) and tests/serving/test_serving_native.py (the C++ kernels)."""

from __future__ import annotations

import numpy as np


def reference(table, ids, offsets, weights, combiner, prune_ids, prune_weights):
    """float64 loops over the bags, TensorFlow's pruning rules: sum, then normalise;
    a zero denominator gives a zero row. Also each row's sum |w x| and its number of
    kept entries (they set the tolerance): (out, scale, counts)."""
    num_rows, dim = len(offsets) - 1, table.shape[1]
    tab = np.asarray(table, dtype=np.float64)
    out = np.zeros((num_rows, dim))
    scale = np.zeros(num_rows)
    counts = np.zeros(num_rows, np.int64)
    for r in range(num_rows):
        den = 0.0
        for k in range(offsets[r], offsets[r + 1]):
            w = 1.0 if weights is None else float(weights[k])
            if (prune_ids and ids[k] < 0) or (prune_weights and not w > 0):
                continue
            out[r] += w * tab[ids[k]]
            scale[r] += abs(w) * np.abs(tab[ids[k]]).max()
            counts[r] += 1
            den += w if combiner == "mean" else w * w
        if combiner in ("mean", "sqrtn"):
            den = np.sqrt(den) if combiner == "sqrtn" else den
            if den == 0:
                out[r], scale[r] = 0.0, 0.0
            else:
                out[r] /= den
                scale[r] /= abs(den)
    return out, scale, counts
