"""Input containers, validation, and the canonical (row, id, weight) form."""

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

from embedmesh import FeatureConfig, RaggedTensor, SparseTensor, TableConfig
from embedmesh.config import resolve_feature_config
from embedmesh.inputs import (
    flatten_inputs_like,
    ragged_positions,
    ragged_row_ids,
    to_csr,
    validate_input,
)


@st.composite
def batches(draw):
    """(input, weight, per-sample list of (position, id, weight))."""
    kind = draw(st.sampled_from(["dense1", "dense2", "sparse", "ragged"]))
    B = draw(st.integers(1, 5))
    weighted = draw(st.booleans())
    if kind.startswith("dense"):
        n = 1 if kind == "dense1" else draw(st.integers(1, 4))
        ids = np.array(draw(st.lists(st.integers(0, 50), min_size=B * n, max_size=B * n)))
        ids = ids.reshape(B) if kind == "dense1" else ids.reshape(B, n)
        w = np.array(
            draw(st.lists(st.floats(-3, 3, width=32), min_size=B * n, max_size=B * n)), np.float32
        ).reshape(ids.shape)
        per = [
            [
                (j, int(ids.reshape(B, n)[b, j]), float(w.reshape(B, n)[b, j]) if weighted else 1.0)
                for j in range(n)
            ]
            for b in range(B)
        ]
        return ids, (w if weighted else None), per
    per = []
    for _ in range(B):
        cols = sorted(draw(st.lists(st.integers(0, 7), max_size=5, unique=True)))
        if kind == "ragged":
            cols = list(range(len(cols)))
        per.append(
            [
                (c, draw(st.integers(0, 50)), draw(st.floats(-3, 3, width=32)) if weighted else 1.0)
                for c in cols
            ]
        )
    ids = np.array([e[1] for row in per for e in row], np.int64)
    w = np.array([e[2] for row in per for e in row], np.float32)
    if kind == "ragged":
        splits = np.concatenate([[0], np.cumsum([len(r) for r in per])])
        return RaggedTensor(ids, splits), (RaggedTensor(w, splits) if weighted else None), per
    idx = np.array([[b, e[0]] for b, row in enumerate(per) for e in row], np.int64).reshape(-1, 2)
    return (SparseTensor(idx, ids, (B, 8)), SparseTensor(idx, w, (B, 8)) if weighted else None, per)


@settings(max_examples=300, deadline=None)
@given(
    batches(), st.sampled_from([0, 1, 3]), st.sampled_from(["sum", "mean", "sqrtn"]), st.booleans()
)
def test_to_csr_matches_plain_loops(batch, L, combiner, validate):
    """Entries per output row under TensorFlow's serving rules, by plain loops."""
    inp, weight, per = batch
    dense = not isinstance(inp, (RaggedTensor, SparseTensor))
    if dense:
        weight, L = None, 0  # dense ids: plain lookups, no weights, no sequences
    if L > 0:
        weight = None  # sequence features take no weights
    feature = FeatureConfig(
        TableConfig(51, 2, combiner=combiner),
        max_sequence_length=L,
        validate_weights_and_indices=validate,
    )
    validate_input("f", inp, weight)
    csr = to_csr("f", feature, inp, weight)
    B = len(per)
    expected = []
    for b, row in enumerate(per):
        for pos, i, w in row:
            w = 1.0 if weight is None else w
            if dense:
                expected.append((b * len(row) + pos, i, np.float32(1.0)))
            elif L == 0:
                if isinstance(inp, SparseTensor) and validate and combiner != "sum" and w <= 0:
                    continue  # TensorFlow's safe sparse lookup prunes weights <= 0
                expected.append((b, i, np.float32(w)))
            elif pos < L:
                expected.append((b * L + pos, i, np.float32(1.0)))
    assert csr.splits.dtype == np.int64 and csr.splits.shape == (csr.num_rows + 1,)
    rows = np.repeat(np.arange(csr.num_rows), np.diff(csr.splits))
    ws = np.ones(rows.shape) if csr.weights is None else csr.weights
    got = sorted(zip(rows.tolist(), np.asarray(csr.ids).tolist(), np.asarray(ws).tolist()))
    assert got == sorted((r, i, float(w)) for r, i, w in expected)
    width = np.shape(inp)[1] if dense and np.ndim(inp) == 2 else 1
    assert csr.batch_size == B
    assert csr.num_rows == (B * width if dense else B * L if L else B)


def test_to_csr_checks_sparse_indices_naming_the_feature():
    bad = SparseTensor(np.array([[1, 0], [0, 0]]), np.array([1, 2]), (2, 3))
    with pytest.raises(ValueError, match="feature my_feature: SparseTensor indices must be sorted"):
        to_csr("my_feature", FeatureConfig(TableConfig(9, 2)), bad)


def test_ragged_helpers():
    splits = np.array([0, 2, 2, 5])
    np.testing.assert_array_equal(ragged_row_ids(splits), [0, 0, 2, 2, 2])
    np.testing.assert_array_equal(ragged_positions(splits), [0, 1, 0, 1, 2])
    r = RaggedTensor.from_row_lengths([4, 5, 6], [1, 0, 2])
    np.testing.assert_array_equal(r.row_splits, [0, 1, 1, 3])
    assert r.nrows == 3


def test_containers_are_pytrees_with_static_dense_shape():
    sp = SparseTensor(np.array([[0, 1]]), np.array([3]), np.array([2, 4]))
    assert sp.dense_shape == (2, 4)
    leaves, treedef = jax.tree_util.tree_flatten(sp)
    assert len(leaves) == 2
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.dense_shape == (2, 4)
    rg = RaggedTensor(np.array([1, 2]), np.array([0, 2]))
    out = jax.jit(lambda r: r.values * 2)(rg)
    np.testing.assert_array_equal(out, [2, 4])


@pytest.mark.parametrize(
    "inp,weight,match",
    [
        (np.array(1), None, r"must be \[batch, \.\.\.\] ids"),  # rank >= 1: ids.shape + [dim]
        (np.array([1.5]), None, "ids must be integers"),
        (np.array([1, 2]), np.array([1.0]), "weight shape"),
        (SparseTensor(np.array([[0]]), np.array([1]), (2,)), None, "rank >= 2"),
        (SparseTensor(np.array([[0, 1], [0, 1]]), np.array([1, 2]), (2, 3)), None, "sorted"),
        (SparseTensor(np.array([[0, 5]]), np.array([1]), (2, 3)), None, "outside dense_shape"),
        (SparseTensor(np.array([[0, 1]]), np.array([1, 2]), (2, 3)), None, "do not fit"),
        (RaggedTensor(np.array([1, 2]), np.array([1, 2])), None, "bad row_splits"),
        (RaggedTensor(np.array([1, 2]), np.array([0, 1])), None, "bad row_splits"),
        (
            RaggedTensor(np.array([1, 2]), np.array([0, 2])),
            RaggedTensor(np.array([1.0, 2.0]), np.array([0, 1, 2])),
            "row_splits",
        ),
        (
            RaggedTensor(np.array([1, 2]), np.array([0, 2])),
            SparseTensor(np.array([[0, 0]]), np.array([1.0]), (1, 2)),
            "must match",
        ),
    ],
)
def test_validation_errors_name_the_feature(inp, weight, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        validate_input("my_feature", inp, weight)
    assert "my_feature" in str(info.value)


def test_flatten_inputs_like_allows_dict_subsets_only():
    t = TableConfig(5, 2)
    fc = {"a": FeatureConfig(t), "b": [FeatureConfig(t), FeatureConfig(t)]}
    r = resolve_feature_config(fc)
    flat = flatten_inputs_like(r, {"b": [np.array([1]), np.array([2])]})
    assert flat[0] is None and flat[1].tolist() == [1] and flat[2].tolist() == [2]
    with pytest.raises(ValueError, match="sequence of 2"):
        flatten_inputs_like(r, {"b": [np.array([1])]})
    with pytest.raises(ValueError, match="not in the feature config"):
        flatten_inputs_like(r, {"c": np.array([1])})


@given(
    names=st.lists(st.text("abAB_1", min_size=1, max_size=3), min_size=1, max_size=6, unique=True),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_flat_dict_requests_flatten_as_the_walk_does(names, data):
    """A flat dict of features (the serving shortcut): the same list as the general walk,
    for any subset of keys in any order, and an extra key the walk's error."""
    from embedmesh.inputs import _flatten_walk, resolved_structure

    t = TableConfig(5, 2)
    fc = {n: FeatureConfig(t) for n in names}
    r = resolve_feature_config(fc)
    given_names = data.draw(st.lists(st.sampled_from(names), unique=True))
    inputs = {n: np.array([i]) for i, n in enumerate(given_names)}
    want: list = []
    _flatten_walk(resolved_structure(r), inputs, "", want, "features")
    got = flatten_inputs_like(r, inputs)
    assert [None if x is None else x.tolist() for x in got] == [
        None if x is None else x.tolist() for x in want
    ]
    with pytest.raises(ValueError, match="not in the feature config"):
        flatten_inputs_like(r, dict(inputs, zzzz=np.array([0])))
    # and back: the outputs packed as the inputs are, as jax's unflatten and a prune do
    from embedmesh.inputs import unflatten_flat_dict

    outs = [object() for _ in names]  # one distinct output per feature, in config order
    full = jax.tree_util.tree_unflatten(r.treedef, outs)
    packed = unflatten_flat_dict(r, inputs, outs)
    assert list(packed) == list(inputs)  # the inputs' keys, in their order
    assert all(packed[k] is full[k] for k in inputs)
    assert unflatten_flat_dict(r, dict(inputs, zzzz=1), outs) is None
    assert unflatten_flat_dict(r, [inputs], outs) is None


def test_integer_kinds_are_numpys_integer_dtypes():
    """The input checks test dtypes by kind (`_INTEGER_KINDS`, cheap on every serving
    call); that must be np.issubdtype's answer for every dtype users may pass."""
    import ml_dtypes

    from embedmesh.inputs import _INTEGER_KINDS

    for dt in [
        np.int8,
        np.int32,
        np.int64,
        np.uint8,
        np.uint64,
        np.bool_,
        np.float16,
        np.float32,
        np.float64,
        np.longdouble,
        ml_dtypes.bfloat16,
        np.complex64,
        np.object_,
        np.str_,
        np.bytes_,
        np.datetime64,
        np.timedelta64,
    ]:
        d = np.dtype(dt)
        assert (d.kind in _INTEGER_KINDS) == np.issubdtype(d, np.integer), d
