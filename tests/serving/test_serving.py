"""serving_embedding_lookup against a plain float64 reference of TensorFlow's rules."""

import collections
import os
import re

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, SparseTensor, TableConfig

# ---------------------------------------------------------------------------
# Reference: TensorFlow's serving lookup, written for clarity (loops, float64).


def _combine(entries, table, combiner, scale=False):
    """entries: list of (id, weight) for one output row.

    With `scale` (and `table` holding |x|): a bound on |result| times the
    condition number, sum|w||x| / |den| * (1 + sum|w| / |den|) for mean.
    Mean weights that nearly cancel make any float32 computation, TF's
    included, differ from float64 by far more than a fixed tolerance.
    """
    total = np.zeros(table.shape[1])
    for i, w in entries:
        total += (abs(w) if scale else w) * table[i]
    if combiner == "sum":
        return total
    den = (
        sum(w for _, w in entries)
        if combiner == "mean"
        else np.sqrt(sum(w * w for _, w in entries))
    )
    if den == 0:
        return np.zeros_like(total)
    if scale:
        return total / abs(den) * (1 + sum(abs(w) for _, w in entries) / abs(den))
    return total / den


def reference_lookup(feature, inp, weight, table, scale=False):
    """The float64 result; with `scale`, the per-element size its float32 error scales with."""
    table = np.asarray(table, np.float64)
    if scale:
        table = np.abs(table)
    dim = table.shape[1]
    combiner = feature.table.combiner
    L = feature.max_sequence_length
    if isinstance(inp, np.ndarray):
        out = np.zeros(inp.shape + (dim,))
        for pos in np.ndindex(*inp.shape):
            out[pos] = table[inp[pos]]
        return out
    if isinstance(inp, SparseTensor):
        shape = inp.dense_shape
        if not feature.output_shape and L > 0 and len(shape) == 2:
            out = np.zeros((shape[0], L, dim))
            for (b, p), i in zip(inp.indices.tolist(), inp.values.tolist()):
                if p < L:
                    out[b, p] += table[i]
            return out
        prune = feature.validate_weights_and_indices or len(shape) > 2
        groups = collections.defaultdict(list)
        for k, (idx, i) in enumerate(zip(inp.indices.tolist(), inp.values.tolist())):
            w = 1.0 if weight is None else float(weight.values[k])
            if prune and (i < 0 or (combiner != "sum" and w <= 0)):
                continue
            groups[tuple(idx[:-1])].append((i, w))
        out = np.zeros(tuple(shape[:-1]) + (dim,))
        for key, entries in groups.items():
            out[key] = _combine(entries, table, combiner, scale)
        return out
    splits = inp.row_splits.tolist()
    B = len(splits) - 1
    rows = [inp.values[splits[b] : splits[b + 1]].tolist() for b in range(B)]
    wrows = [
        ([1.0] * len(r)) if weight is None else weight.values[splits[b] : splits[b + 1]].tolist()
        for b, r in enumerate(rows)
    ]

    def sequence(length):
        out = np.zeros((B, length, dim))
        for b, r in enumerate(rows):
            for p, i in enumerate(r[:length]):
                out[b, p] = table[i]
        return out

    def combined():
        return (
            np.stack(
                [
                    _combine(list(zip(r, w)), table, combiner, scale) if r else np.zeros(dim)
                    for r, w in zip(rows, wrows)
                ]
            )
            if B
            else np.zeros((0, dim))
        )

    if feature.output_shape:
        P = int(np.prod(feature.output_shape))
        if P == B:
            return combined().reshape(feature.output_shape + (dim,))
        if P > B and P % B == 0:
            return sequence(P // B).reshape(feature.output_shape + (dim,))
        raise AssertionError("test generated an invalid output_shape")
    if L > 0:
        return sequence(L)
    return combined()


# ---------------------------------------------------------------------------
# Input generation


@st.composite
def feature_cases(draw):
    vocab = draw(st.integers(1, 30))
    dim = draw(st.integers(1, 6))
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    kind = draw(st.sampled_from(["dense", "sparse", "ragged"]))
    B = draw(st.integers(1, 6))
    validate = draw(st.booleans())
    L = 0
    output_shape = None
    weighted = False
    if kind != "dense":
        L = draw(st.sampled_from([0, 0, 1, 3]))
        weighted = L == 0 and draw(st.booleans())
    if kind == "ragged" and L == 0 and draw(st.booleans()):
        factor = draw(st.sampled_from([1, 2, 3]))
        output_shape = (B * factor,) if draw(st.booleans()) else (B, factor)
        weighted = weighted and factor == 1
    table_cfg = TableConfig(vocab, dim, combiner=combiner, name="t")
    feature = FeatureConfig(
        table_cfg,
        max_sequence_length=L,
        validate_weights_and_indices=validate,
        output_shape=output_shape,
        name="f",
    )
    ids_st = st.integers(0, vocab - 1)
    # float32 weights; magnitudes below 1e-3 (other than 0) would underflow w*w in float32
    weight_st = st.floats(-2, 3, allow_nan=False, width=32).filter(
        lambda w: w == 0 or abs(w) > 1e-3
    )
    if kind == "dense":
        shape = (B,) if draw(st.booleans()) else (B, draw(st.integers(1, 4)))
        inp = np.array(
            draw(st.lists(ids_st, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
            np.int64,
        ).reshape(shape)
        return feature, inp, None
    lengths = draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
    n = sum(lengths)
    # sparse inputs may carry negative ids where TF prunes them
    allow_neg = kind == "sparse" and validate and L == 0
    ids = np.array(
        draw(st.lists(st.integers(-2 if allow_neg else 0, vocab - 1), min_size=n, max_size=n)),
        np.int64,
    )
    w = np.array(draw(st.lists(weight_st, min_size=n, max_size=n)), np.float32)
    if kind == "ragged":
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        inp = RaggedTensor(ids, splits)
        return feature, inp, RaggedTensor(w, splits) if weighted else None
    width = 6
    rank3 = L == 0 and draw(st.booleans())
    idx = []
    for b, length in enumerate(lengths):
        cols = sorted(
            draw(st.lists(st.integers(0, width - 1), min_size=length, max_size=length, unique=True))
        )
        idx += [[b, c] for c in cols]
    idx = np.array(idx, np.int64).reshape(-1, 2)
    shape = (B, width)
    if rank3:  # fold the batch into [B1, B2, width]
        b2 = 2
        idx = np.concatenate([idx[:, :1] // b2, idx[:, :1] % b2, idx[:, 1:]], axis=1)
        shape = ((B + b2 - 1) // b2, b2, width)
        order = np.lexsort(idx.T[::-1])
        idx, ids, w = idx[order], ids[order], w[order]
    inp = SparseTensor(idx, ids, shape)
    return feature, inp, SparseTensor(idx, w, shape) if weighted else None


def assert_matches_reference(got, feature, inp, weight, table):
    """Close to the float64 reference, to within float32 rounding of a sum of <= 6
    entries relative to its condition (see `_combine`)."""
    want = reference_lookup(feature, inp, weight, table)
    scale = reference_lookup(feature, inp, weight, table, scale=True)
    got = np.asarray(got)
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want)
    bound = 2e-5 * (1 + np.abs(want)) + 16 * 2.0**-24 * scale
    assert np.all(err <= bound), (err - bound).max()


def _table(feature, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(feature.table.vocabulary_size, feature.table.dim)).astype(np.float32)


@settings(max_examples=300, deadline=None)
@given(feature_cases(), st.integers(0, 2**31 - 1))
def test_host_path_matches_reference(case, seed):
    feature, inp, weight = case
    table = _table(feature, seed)
    got = em.serving_embedding_lookup(
        {"f": inp},
        None if weight is None else {"f": weight},
        {feature.table: table},
        {"f": feature},
    )["f"]
    assert isinstance(got, jax.Array)
    assert_matches_reference(got, feature, inp, weight, table)


@settings(max_examples=60, deadline=None)
@given(feature_cases(), st.integers(0, 2**31 - 1))
def test_traced_path_matches_reference(case, seed):
    feature, inp, weight = case
    table = _table(feature, seed)
    fn = jax.jit(lambda x, w, t: em.serving_embedding_lookup(x, w, {feature.table: t}, feature))
    got = fn(inp, weight, table)
    assert_matches_reference(got, feature, inp, weight, table)


# ---------------------------------------------------------------------------
# Structures and errors


def _setup():
    t1 = TableConfig(10, 4, combiner="mean", name="a")
    t2 = TableConfig(20, 3, combiner="sum")
    fc = {
        "x": FeatureConfig(t1),
        "y": FeatureConfig(t2),
        "z": FeatureConfig(t2, max_sequence_length=3),
    }
    rng = np.random.default_rng(0)
    tables = {
        t1: rng.normal(size=(10, 4)).astype(np.float32),
        t2: rng.normal(size=(20, 3)).astype(np.float32),
    }
    return t1, t2, fc, tables


def test_nested_structure_and_subset():
    t1, t2, fc, tables = _setup()
    nested = {"group": [fc["x"], (fc["y"],)], "z": fc["z"]}
    inp = {
        "group": [np.array([1, 2]), (RaggedTensor(np.array([3, 4, 5]), np.array([0, 1, 3])),)],
        "z": SparseTensor(np.array([[0, 0], [1, 2]]), np.array([1, 2]), (2, 5)),
    }
    out = em.serving_embedding_lookup(inp, None, tables, nested)
    assert out["group"][0].shape == (2, 4)
    assert out["group"][1][0].shape == (2, 3)
    assert out["z"].shape == (2, 3, 3)
    np.testing.assert_allclose(out["group"][1][0][1], tables[t2][4] + tables[t2][5], rtol=1e-6)
    only = em.serving_embedding_lookup({"z": inp["z"]}, None, tables, nested)
    assert set(only) == {"z"}
    np.testing.assert_allclose(only["z"], out["z"])


def test_single_feature_not_nested():
    t1, _, fc, tables = _setup()
    out = em.serving_embedding_lookup(np.array([[1, 2], [3, 4]]), None, tables, fc["x"])
    np.testing.assert_allclose(out, tables[t1][np.array([[1, 2], [3, 4]])])


def test_tensorflow_style_duck_typed_inputs():
    t1, t2, fc, tables = _setup()

    class FakeTfSparse:  # the attributes tf.SparseTensor has
        def __init__(self, i, v, s):
            self.indices, self.values, self.dense_shape = i, v, s

    class FakeTfRagged:
        def __init__(self, v, s):
            self.values, self.row_splits, self.flat_values, self.ragged_rank = v, s, v, 1

    sp = FakeTfSparse(np.array([[0, 0], [1, 1]]), np.array([3, 4]), np.array([2, 4]))
    rg = FakeTfRagged(np.array([3, 4]), np.array([0, 1, 2]))
    a = em.serving_embedding_lookup({"y": sp}, None, tables, fc)["y"]
    b = em.serving_embedding_lookup({"y": rg}, None, tables, fc)["y"]
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, tables[t2][[3, 4]], rtol=1e-6)


@pytest.mark.parametrize(
    "case,match",
    [
        ("dense_weight", "input is dense"),
        ("type_mismatch", "does not match type"),
        ("seq_weight", "sequence feature"),
        ("seq_dense", "sequence feature but a dense"),
        ("not_subset", "not in the feature config"),
        ("bad_output_shape", "factor of the input data batch size"),
        ("id_too_big", "feature x: id 10"),
        ("negative_ragged", "feature y: id -1"),
        ("unsorted", "sorted in row-major order"),
        ("bad_splits", "bad row_splits"),
        ("float_ids", "ids must be integers"),
    ],
)
def test_errors_name_the_feature(case, match):
    t1, t2, fc, tables = _setup()
    rag = RaggedTensor(np.array([1, 2, 3]), np.array([0, 1, 3]))
    rag_w = RaggedTensor(np.array([1.0, 2.0, 3.0], np.float32), np.array([0, 1, 3]))
    sp = SparseTensor(np.array([[0, 0], [1, 0]]), np.array([1, 2]), (2, 3))
    sp_w = SparseTensor(np.array([[0, 0], [1, 0]]), np.array([1.0, 2.0], np.float32), (2, 3))
    inputs, weights, cfg = None, None, fc
    if case == "dense_weight":
        inputs, weights = {"x": np.array([1, 2])}, {"x": np.array([1.0, 1.0])}
    elif case == "type_mismatch":
        inputs, weights = {"y": rag}, {"y": sp_w}
    elif case == "seq_weight":
        inputs, weights = {"z": rag}, {"z": rag_w}
    elif case == "seq_dense":
        inputs = {"z": np.array([1, 2])}
    elif case == "not_subset":
        inputs = {"x": np.array([1]), "nope": np.array([1])}
    elif case == "bad_output_shape":
        cfg = {"y": FeatureConfig(t2, output_shape=(3,))}
        inputs = {"y": rag}
    elif case == "id_too_big":
        inputs = {"x": np.array([1, 10])}
    elif case == "negative_ragged":
        inputs = {"y": RaggedTensor(np.array([1, -1]), np.array([0, 1, 2]))}
    elif case == "unsorted":
        inputs = {"y": SparseTensor(np.array([[1, 0], [0, 0]]), np.array([1, 2]), (2, 3))}
    elif case == "bad_splits":
        inputs = {"y": RaggedTensor(np.array([1, 2]), np.array([0, 3, 2]))}
    elif case == "float_ids":
        inputs = {"x": np.array([1.0, 2.0])}
    with pytest.raises((ValueError, TypeError), match=match):
        em.serving_embedding_lookup(inputs, weights, tables, cfg)
    _ = sp


def test_weights_prune_rules_for_sparse():
    """validate=True prunes ids < 0 and, except for sum, weights <= 0; False prunes nothing."""
    t = TableConfig(5, 2, combiner="mean", name="t")
    table = np.arange(10, dtype=np.float32).reshape(5, 2) + 1
    idx = np.array([[0, 0], [0, 1], [0, 2]])
    ids = np.array([1, 2, 3])
    w = np.array([2.0, -1.0, 0.0], np.float32)
    sp, spw = SparseTensor(idx, ids, (1, 3)), SparseTensor(idx, w, (1, 3))
    pruned = em.serving_embedding_lookup(sp, spw, {t: table}, FeatureConfig(t))
    np.testing.assert_allclose(pruned[0], table[1], rtol=1e-6)
    kept = em.serving_embedding_lookup(
        sp, spw, {t: table}, FeatureConfig(t, validate_weights_and_indices=False)
    )
    np.testing.assert_allclose(kept[0], (2 * table[1] - table[2]) / 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------
# The host path against a per-entry segment sum; output buffers reused


def _per_entry_reference(name, feature, inp, weight, table):
    """TensorFlow's rules as per-entry arrays (output row, id, weight, kept), summed
    by the kernels (bags from the sorted per-entry rows, a plain lookup gathered): the
    form the serving path had before it took bags (`inputs.to_csr`) for every output
    kind."""
    from embedmesh.inputs import (
        check_id_range,
        feature_layout,
        ragged_positions,
        ragged_row_ids,
        validate_input,
    )
    from embedmesh.serving import kernels

    layout = feature_layout(name, feature, inp, weight)
    validate_input(name, inp, weight)
    table = np.asarray(table)
    if layout.kind == "lookup":
        ids = np.asarray(inp).reshape(-1)
        rows, w, keep = np.arange(ids.shape[0]), np.ones(ids.shape, np.float32), None
    else:
        ids = np.asarray(inp.values)
        w = (
            np.ones(ids.shape, np.float32)
            if weight is None or not layout.use_weights
            else np.asarray(weight.values, np.float32)
        )
        keep = None
        if isinstance(inp, SparseTensor):
            idx = np.asarray(inp.indices, np.int64)
            if layout.kind == "sequence":
                rows, keep = idx[:, 0] * layout.length + idx[:, 1], idx[:, 1] < layout.length
            else:
                rows = (
                    np.ravel_multi_index(idx[:, :-1].T, inp.dense_shape[:-1])
                    if len(idx)
                    else np.zeros(0, np.int64)
                )
                if layout.prune_ids:
                    keep = ids >= 0
                if layout.prune_weights:
                    keep = (w > 0) if keep is None else keep & (w > 0)
        else:
            rows = ragged_row_ids(inp.row_splits).astype(np.int64)
            if layout.kind == "sequence":
                pos = ragged_positions(inp.row_splits)
                rows, keep = rows * layout.length + pos, pos < layout.length
    if keep is not None:
        ids, rows, w = ids[keep], rows[keep], w[keep]
    check_id_range(name, ids, table.shape[0])
    if layout.kind == "lookup":
        out = kernels.gather(table, ids)
    else:  # rows non-decreasing (validated indices, row-major)
        offsets = np.searchsorted(rows, np.arange(layout.num_rows + 1), side="left")
        out = kernels.bag_combine(table, ids, offsets, w, layout.combiner)
    return out.reshape(layout.activation_shape(table.shape[1]))


@settings(max_examples=200, deadline=None)
@given(feature_cases(), st.integers(0, 2**31 - 1))
def test_host_path_equals_per_entry_segment_sum(case, seed):
    """Same entries added in the same order: bit-equal for every output kind
    (plain lookups, combined bags, sequences); errors alike."""
    from embedmesh.serving import lookup as serving

    feature, inp, weight = case
    table = _table(feature, seed)
    try:
        want = _per_entry_reference("f", feature, inp, weight, table)
    except ValueError as e:  # the host path must refuse alike
        with pytest.raises(ValueError, match=re.escape(str(e)[:20])):
            serving._prepare_host("f", feature, inp, weight, table)()
        return
    got = serving._prepare_host("f", feature, inp, weight, table)()
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_outputs_survive_later_lookups():
    """Reused output buffers are never ones a live result still uses."""
    t = TableConfig(100, 64, combiner="mean", name="t")
    fc = {"r": FeatureConfig(t), "s": FeatureConfig(t), "d": FeatureConfig(t)}
    rng = np.random.default_rng(0)
    table = rng.normal(size=(100, 64)).astype(np.float32)

    def batch(seed):
        r = np.random.default_rng(seed)
        ids = r.integers(0, 100, 40)
        splits = np.array([0, 10, 25, 25, 40])
        idx = np.stack(
            [
                np.repeat(np.arange(4), np.diff(splits)),
                np.concatenate([np.arange(n) for n in np.diff(splits)]),
            ],
            axis=1,
        )
        return {
            "r": RaggedTensor(ids, splits),
            "s": SparseTensor(idx, ids, (4, 20)),
            "d": ids.reshape(4, 10),
        }

    first = em.serving_embedding_lookup(batch(1), None, {t: table}, fc)
    kept = {k: np.array(v) for k, v in first.items()}
    as_numpy = np.asarray(first["d"])  # a numpy view of a jax output
    for seed in range(2, 8):
        later = em.serving_embedding_lookup(batch(seed), None, {t: table}, fc)
        del later
    for k, v in first.items():
        np.testing.assert_array_equal(np.asarray(v), kept[k])
    np.testing.assert_array_equal(as_numpy, kept["d"])
    del first
    again = em.serving_embedding_lookup(batch(1), None, {t: table}, fc)
    for k, v in again.items():
        np.testing.assert_array_equal(np.asarray(v), kept[k])


def test_host_threads_give_the_same_results_and_first_error():
    from embedmesh.serving import lookup as serving

    t = TableConfig(50, 20, combiner="sqrtn", name="t")
    fc = {f"f{i}": FeatureConfig(t) for i in range(6)}
    rng = np.random.default_rng(5)
    table = rng.normal(size=(50, 20)).astype(np.float32)
    inputs = {k: RaggedTensor(rng.integers(0, 50, 30), np.array([0, 7, 7, 30])) for k in fc}
    one = em.serving_embedding_lookup(inputs, None, {t: table}, fc)
    previous = serving.set_host_threads(3)
    try:
        many = em.serving_embedding_lookup(inputs, None, {t: table}, fc)
        for k in fc:
            np.testing.assert_array_equal(np.asarray(many[k]), np.asarray(one[k]))
        bad = dict(
            inputs,
            f2=RaggedTensor(np.array([1, 99]), np.array([0, 1, 2])),
            f4=RaggedTensor(np.array([1, 98]), np.array([0, 1, 2])),
        )
        with pytest.raises(ValueError, match="feature f2: id 99"):
            em.serving_embedding_lookup(bad, None, {t: table}, fc)
        with pytest.raises(ValueError, match=">= 1"):
            serving.set_host_threads(0)
    finally:
        serving.set_host_threads(previous)


@pytest.mark.parametrize("fast", [True, False])
def test_host_outputs_become_uncommitted_jax_arrays_without_a_copy(fast, monkeypatch):
    """The host path's jax.Arrays: what `jax.device_put` gives (uncommitted, on the
    default device, x64 rules), aliasing the kernel's aligned buffers on CPU;
    jaxlib's direct call (fast) and `jax.device_put` agree."""
    from embedmesh._runtime import aligned_empty
    from embedmesh.serving import lookup as serving

    if not fast:
        monkeypatch.setattr(serving, "_BATCHED_DEVICE_PUT", None)
    rng = np.random.default_rng(0)
    outs = []
    for shape, dtype in [((5, 16), np.float32), ((3, 2, 8), np.float16), ((0, 4), np.float32)]:
        a = aligned_empty(shape, dtype)
        a[...] = rng.normal(size=shape)
        outs.append(a)
    got = serving._host_to_jax(outs)
    for a, g in zip(outs, got):
        assert isinstance(g, jax.Array) and not g.committed
        assert g.dtype == a.dtype and g.shape == a.shape
        assert g.devices() == {jax.local_devices()[0]}
        np.testing.assert_array_equal(np.asarray(g), a)
        if a.size:
            assert g.unsafe_buffer_pointer() == a.ctypes.data  # no copy
    wide = aligned_empty((2, 3), np.float64)
    wide[...] = 1.5
    (g,) = serving._host_to_jax([wide])  # canonicalised as jax.device_put does
    assert g.dtype == jax.device_put(wide).dtype
    other = jax.devices()[-1]
    with jax.default_device(other):
        (g,) = serving._host_to_jax([outs[0]])
    assert g.devices() == {other} and not g.committed
    np.testing.assert_array_equal(np.asarray(g), outs[0])


def test_results_on_another_default_device_and_after_a_failed_lookup():
    """Outputs through jaxlib's direct call (the plain CPU case) and through
    jax.device_put (a default device set) hold the same values; a lookup failing
    midway (its outputs already taken from the pool) leaves later lookups right."""
    t = TableConfig(60, 32, combiner="sum", name="t")
    fc = {"a": FeatureConfig(t), "b": FeatureConfig(t), "c": FeatureConfig(t)}
    rng = np.random.default_rng(2)
    table = rng.normal(size=(60, 32)).astype(np.float32)
    inputs = {
        "a": RaggedTensor(rng.integers(0, 60, 9), np.array([0, 4, 9])),
        "b": rng.integers(0, 60, (2, 3)),
        "c": SparseTensor(np.array([[0, 0], [1, 2]]), np.array([5, 7]), (2, 4)),
    }
    want = {k: reference_lookup(fc[k], inputs[k], None, table) for k in fc}
    plain = em.serving_embedding_lookup(inputs, None, {t: table}, fc)
    other = jax.devices()[-1]
    with jax.default_device(other):
        moved = em.serving_embedding_lookup(inputs, None, {t: table}, fc)
    for k in fc:
        np.testing.assert_allclose(np.asarray(plain[k]), want[k], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(moved[k]), np.asarray(plain[k]))
        assert moved[k].devices() == {other}
    bad = dict(inputs, b=np.array([[1, 2, 60], [0, 0, 0]]))
    with pytest.raises(ValueError, match="feature b: id 60"):
        em.serving_embedding_lookup(bad, None, {t: table}, fc)
    again = em.serving_embedding_lookup(inputs, None, {t: table}, fc)
    for k in fc:
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(plain[k]))


def test_thread_runner_runs_everything_and_raises_the_first_error_in_order():
    """The caller's thread works too; every run runs once even after an error;
    the error raised is the first in feature order, not in time."""
    import threading
    import time

    from embedmesh.serving import lookup as serving

    calls = []
    late_error = threading.Event()

    def ok(i):
        def run():
            calls.append((i, threading.current_thread().name))
            time.sleep(0.002)
            return i

        return run

    assert serving._run_on_threads([ok(i) for i in range(12)], 3) == list(range(12))
    assert sorted(i for i, _ in calls) == list(range(12))
    assert threading.main_thread().name in {name for _, name in calls}

    def fails_late():
        late_error.wait(2.0)  # raises only after the later feature has raised
        raise ValueError("first")

    def fails_early():
        try:
            raise ValueError("second")
        finally:
            late_error.set()

    calls.clear()
    with pytest.raises(ValueError, match="first"):
        serving._run_on_threads([ok(0), fails_late, ok(2), fails_early, ok(4)], 2)
    assert sorted(i for i, _ in calls) == [0, 2, 4]


def test_default_thread_count(monkeypatch):
    from embedmesh import _runtime
    from embedmesh.serving import settings as serving

    monkeypatch.setattr(serving, "host_threads", None)  # set_host_threads not called
    try:  # switches are read once: reset() makes them read the environment again
        monkeypatch.setenv("EMBEDMESH_SERVING_THREADS", "3")
        _runtime.reset()
        assert serving.threads() == 3
        monkeypatch.setenv("EMBEDMESH_SERVING_THREADS", "0")
        _runtime.reset()
        assert serving.threads() == 1
        monkeypatch.delenv("EMBEDMESH_SERVING_THREADS")
        _runtime.reset()
        assert 1 <= serving.threads() <= min(8, os.cpu_count() or 1)
    finally:
        monkeypatch.undo()
        _runtime.reset()


_FORK_CHILD_SCRIPT = """
import os, sys, threading, time
from embedmesh.serving import lookup as serving

def task():
    time.sleep(0.05)
    return threading.current_thread().name

serving._run_on_threads([task] * 4, 2)  # the parent's pool exists now
pid = os.fork()
if pid == 0:  # child: exit 0 only if a pool thread ran a task
    names = serving._run_on_threads([task] * 4, 2)
    os._exit(0 if any(n != threading.main_thread().name for n in names) else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_thread_runner_uses_threads_again_in_a_forked_child():
    """A child forked after a lookup (a pre-forking server) gets fresh pool threads.
    In a fresh process that never starts a JAX backend, so the fork is safe."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD_SCRIPT], timeout=120, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_tables_keyed_by_name_get_an_error_that_says_the_keys_are_table_configs():
    """A newcomer's `{"video": array}`: the error names the feature and table, says the
    keys are `TableConfig`s and shows how to map names to them."""
    video = em.TableConfig(vocabulary_size=10, dim=4, name="video")
    features = {"watched": em.FeatureConfig(video)}
    table = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="watched") as err:
        em.serving_embedding_lookup({"watched": np.array([1, 2])}, None, {"video": table}, features)
    message = str(err.value)
    assert "TableConfig" in message and "'video'" in message and "f.table.name" in message
    # keyed by the configs, the same call works
    out = em.serving_embedding_lookup({"watched": np.array([1, 2])}, None, {video: table}, features)
    np.testing.assert_allclose(out["watched"], table[[1, 2]], rtol=1e-6)


def test_a_float64_table_is_served_in_float32_with_a_warning_once(monkeypatch):
    """JAX (and the kernels) serve float32: a float64 table's outputs are float32, which
    TensorFlow's would not be; said once a table and process, naming the table."""
    from embedmesh.serving import lookup

    monkeypatch.setattr(lookup, "_NARROWED_WARNED", set())
    wide = em.TableConfig(vocabulary_size=10, dim=4, name="wide")
    features = {"a": em.FeatureConfig(wide)}
    table = np.random.default_rng(1).normal(size=(10, 4))  # float64
    with pytest.warns(UserWarning, match="table wide is float64"):
        out = em.serving_embedding_lookup({"a": np.array([1, 2])}, None, {wide: table}, features)
    assert np.asarray(out["a"]).dtype == np.float32
    np.testing.assert_allclose(out["a"], table[[1, 2]], rtol=1e-6)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call: no second warning
        em.serving_embedding_lookup({"a": np.array([3])}, None, {wide: table}, features)
    # a float32 table: no warning at all
    monkeypatch.setattr(lookup, "_NARROWED_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        em.serving_embedding_lookup(
            {"a": np.array([3])}, None, {wide: table.astype(np.float32)}, features
        )
