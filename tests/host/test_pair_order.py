"""`embedmesh.host.pair_order` against a stable argsort written here."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.host import pair_order as po


def _expected(rows, unique, num_rows, cap_u):
    d = rows.shape[0]
    rows, unique = rows.reshape(d, -1).astype(np.int64), unique.reshape(d, -1).astype(np.int64)
    valid = (rows >= 0) & (rows < num_rows) & (unique >= 0) & (unique < cap_u)
    key = np.where(valid, rows, num_rows + 1)  # any key past every row
    return np.stack([np.argsort(k, kind="stable") for k in key])


@st.composite
def _batches(draw):
    d, n, p = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    num_rows, cap_u = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    rows = rng.integers(-2, num_rows + 3, (d, n, p)).astype(np.int32)
    unique = rng.integers(-2, cap_u + 2, (d, n, p)).astype(np.int32)
    pad = rng.random((d, n, p)) < 0.3  # the batch's padding: row R, id position 0
    rows[pad], unique[pad] = num_rows, 0
    return rows, unique, num_rows, cap_u


@settings(max_examples=20, deadline=None)
@given(batch=_batches())
def test_pair_order_is_a_stable_sort_by_row(batch):
    rows, unique, num_rows, cap_u = batch
    got = po.pair_order(rows, unique, num_rows, cap_u)
    assert got.shape == rows.shape and got.dtype == np.int32
    np.testing.assert_array_equal(
        got.reshape(rows.shape[0], -1), _expected(rows, unique, num_rows, cap_u)
    )


def test_pair_order_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="pair_rows"):
        po.pair_order(np.zeros((1, 2, 3), np.int32), np.zeros((1, 2, 4), np.int32), 4, 4)


def _expected_by_row(rows, unique, gains, num_rows, cap_u):
    """Each device's pairs as (slot, gain, row), valid ones by (row, position), then the
    invalid ones as (N * U, 0, num_rows) in position order: plain loops."""
    d, n, p = rows.shape
    out = [np.zeros((d, n * p), t) for t in (np.int64, np.float64, np.int64)]
    for dev in range(d):
        valid, invalid = [], []
        for j in range(n):
            for q in range(p):
                r, u = int(rows[dev, j, q]), int(unique[dev, j, q])
                if 0 <= r < num_rows and 0 <= u < cap_u:
                    valid.append((r, j * p + q, (j * cap_u + u, float(gains[dev, j, q]), r)))
                else:
                    invalid.append((n * cap_u, 0.0, num_rows))
        ordered = [v for _, _, v in sorted(valid)] + invalid
        for k, triple in enumerate(ordered):
            for a, x in zip(out, triple):
                a[dev, k] = x
    return out


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@settings(max_examples=20, deadline=None)
@given(batch=_batches(), seed=st.integers(0, 2**31 - 1))
def test_pairs_by_row_are_the_pairs_in_row_order(backend, batch, seed):
    rows, unique, num_rows, cap_u = batch
    gains = np.random.default_rng(seed).normal(size=rows.shape).astype(np.float32)
    real = po._kernel
    if backend == "numpy":
        po._kernel = lambda: None
    elif real() is None:
        pytest.skip("numba not available")
    try:
        got = po.pairs_by_row(rows, unique, gains, num_rows, cap_u)
    finally:
        po._kernel = real
    want = _expected_by_row(rows, unique, gains, num_rows, cap_u)
    for g, w, dtype in zip(got, want, (np.int32, np.float32, np.int32), strict=True):
        assert g.shape == rows.shape and g.dtype == dtype
        np.testing.assert_array_equal(g.reshape(rows.shape[0], -1), w)


def test_pairs_by_row_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="pair_gains"):
        po.pairs_by_row(
            np.zeros((1, 2, 3), np.int32), np.zeros((1, 2, 3), np.int32), np.zeros(3), 4, 4
        )
