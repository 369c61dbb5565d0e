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


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@settings(max_examples=20, deadline=None)
@given(batch=_batches())
def test_pair_order_is_a_stable_sort_by_row(backend, batch):
    if backend == "numpy":
        kernel = None
    else:
        kernel = po._kernel()
        if kernel is None:
            pytest.skip("numba not available")
    rows, unique, num_rows, cap_u = batch
    got_kernel = po._kernel
    try:
        po._kernel = lambda: kernel
        got = po.pair_order(rows, unique, num_rows, cap_u)
    finally:
        po._kernel = got_kernel
    assert got.shape == rows.shape and got.dtype == np.int32
    np.testing.assert_array_equal(
        got.reshape(rows.shape[0], -1), _expected(rows, unique, num_rows, cap_u)
    )


def test_pair_order_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="pair_rows"):
        po.pair_order(np.zeros((1, 2, 3), np.int32), np.zeros((1, 2, 4), np.int32), 4, 4)
