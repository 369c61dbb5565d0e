"""Input forms of a feature and their canonical host form.

A feature's input is a dense integer array (`[batch]` or `[batch, n]`, every
entry an id), a `SparseTensor` or a `RaggedTensor`; TensorFlow's
`tf.SparseTensor`/`tf.RaggedTensor` are accepted by duck typing (TensorFlow is
never imported). Both containers are JAX pytrees, so they can be passed
through `jax.jit` and `jax.export` (the sparse `dense_shape` is static).

How an input becomes activation rows is decided in one place,
`feature_layout` (TensorFlow's serving rules), for training and serving
alike; `to_csr` turns a concrete input into bags under those rules, the host
form the preprocessing kernels take. All conversions are vectorised.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from embedmesh import sparse_index


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class SparseTensor:
    """COO sparse tensor: `indices [nnz, rank]`, `values [nnz]`, static `dense_shape`.

    Indices are expected in row-major order, as `tf.SparseTensor` requires.
    """

    indices: Any
    values: Any
    dense_shape: tuple

    def __post_init__(self):
        shape = self.dense_shape
        if not isinstance(shape, tuple):
            shape = tuple(int(d) for d in np.asarray(shape).reshape(-1))
        object.__setattr__(self, "dense_shape", tuple(int(d) for d in shape))

    @property
    def shape(self) -> tuple:
        return self.dense_shape

    def tree_flatten(self):
        return (self.indices, self.values), self.dense_shape

    @classmethod
    def tree_unflatten(cls, dense_shape, children):
        obj = object.__new__(cls)
        object.__setattr__(obj, "indices", children[0])
        object.__setattr__(obj, "values", children[1])
        object.__setattr__(obj, "dense_shape", dense_shape)
        return obj


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class RaggedTensor:
    """Rank-2 ragged tensor: row `i` holds `values[row_splits[i]:row_splits[i+1]]`."""

    values: Any
    row_splits: Any

    @property
    def nrows(self) -> int:
        return int(np.shape(self.row_splits)[0]) - 1

    @property
    def shape(self) -> tuple:
        return (self.nrows, None)

    def tree_flatten(self):
        return (self.values, self.row_splits), None

    @classmethod
    def tree_unflatten(cls, _, children):
        obj = object.__new__(cls)
        object.__setattr__(obj, "values", children[0])
        object.__setattr__(obj, "row_splits", children[1])
        return obj

    @classmethod
    def from_row_lengths(cls, values, row_lengths) -> RaggedTensor:
        lengths = np.asarray(row_lengths, dtype=np.int64)
        splits = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=splits[1:])
        return cls(np.asarray(values), splits)


def _to_numpy(x):
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x


def convert_input(x):
    """Map TensorFlow's sparse/ragged tensors (duck typed) onto ours; others unchanged."""
    if x is None or isinstance(x, (SparseTensor, RaggedTensor)):
        return x
    if all(hasattr(x, a) for a in ("indices", "values", "dense_shape")):
        return SparseTensor(
            np.asarray(_to_numpy(x.indices)),
            np.asarray(_to_numpy(x.values)),
            tuple(int(d) for d in np.asarray(_to_numpy(x.dense_shape))),
        )
    if all(hasattr(x, a) for a in ("values", "row_splits", "flat_values")):
        if getattr(x, "ragged_rank", 1) != 1:
            raise ValueError(
                f"only rank-2 ragged tensors are supported, got ragged_rank {x.ragged_rank}"
            )
        return RaggedTensor(np.asarray(_to_numpy(x.values)), np.asarray(_to_numpy(x.row_splits)))
    return _to_numpy(x)


def input_kind(x) -> str:
    """ "sparse", "ragged" or "dense" (anything array-like)."""
    if isinstance(x, SparseTensor):
        return "sparse"
    if isinstance(x, RaggedTensor):
        return "ragged"
    return "dense"


def is_concrete(x) -> bool:
    """True when every array in `x` holds values (not a JAX tracer)."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


# ---------------------------------------------------------------------------
# Validation of concrete inputs (host side)


_NOT_NUMERIC = frozenset("OUSVM")  # object, str, bytes, void, datetime: not a tensor of numbers
# np.issubdtype(dtype, np.integer) by dtype kind (timedelta64 too, as numpy has it), ~20x
# cheaper: the serving lookup checks every feature's arrays on every call
_INTEGER_KINDS = frozenset("ium")


def _not_numbers(name: str, kind: str, x, arr: np.ndarray) -> ValueError:
    """TensorFlow's ValueError for `kind` ("ids" or "weights") that are no tensor of
    numbers: a scalar string or object is no tensor at all; an array (or list) of them
    is one of the wrong dtype, which the message names with its first entry."""
    if arr.ndim == 0:
        return ValueError(
            f"feature {name}: the {'input' if kind == 'ids' else 'weight'} must be a Tensor "
            f"(array), SparseTensor or RaggedTensor, got {type(x).__name__}"
            + (f" ({x!r:.40})" if isinstance(x, (str, bytes)) else "")
        )
    return ValueError(
        f"feature {name}: {kind} must be {'integers' if kind == 'ids' else 'numeric'}, "
        f"got an array of dtype {arr.dtype}"
        + (f" (first entry {arr.reshape(-1)[0]!r:.40})" if arr.size else "")
    )


def _check_int_ids(name: str, ids) -> np.ndarray:
    src = ids
    ids = np.asarray(ids)
    if ids.dtype.kind in _NOT_NUMERIC:  # TensorFlow: a ValueError (not a tensor type)
        raise _not_numbers(name, "ids", src, ids)
    if ids.dtype.kind not in _INTEGER_KINDS:
        raise TypeError(f"feature {name}: ids must be integers, got dtype {ids.dtype}")
    return ids


def _check_float_weights(name: str, w) -> np.ndarray:
    src = w
    w = np.asarray(w)
    if w.dtype.kind in _NOT_NUMERIC:
        raise _not_numbers(name, "weights", src, w)
    if w.dtype.kind not in _INTEGER_KINDS and w.dtype.kind != "f":  # floating or integer
        raise TypeError(f"feature {name}: weights must be numeric, got dtype {w.dtype}")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():  # one vectorised pass; NaN/Inf would poison rows and slots
        flat = w.reshape(-1)
        bad = int(np.argmin(np.isfinite(flat)))
        raise ValueError(f"feature {name}: weights must be finite, got {flat[bad]} at entry {bad}")
    return w


def validate_input(name: str, inp, weight=None) -> None:
    """Raise a clear error (naming the feature) for malformed concrete inputs.

    Checks types, integer ids, sparse index shape and row-major order, ragged
    row_splits, and that weights match their input in type and layout.
    """
    validate_structure(name, inp, weight)
    if input_kind(inp) == "sparse":
        sparse_row_offsets(name, inp)


def sparse_row_offsets(name: str, inp: SparseTensor) -> np.ndarray:
    """Entry offsets of each row of a structurally valid SparseTensor, its leading
    dimensions flattened (`prod(dense_shape[:-1]) + 1` values), after checking
    every index lies in `dense_shape` and indices are sorted row-major without
    repeats. One pass (`embedmesh.sparse_index.sparse_offsets`: the serving
    kernels' backend in use, C++ by default).
    """
    idx = np.asarray(inp.indices)
    shape = tuple(inp.dense_shape)
    offsets, bad = sparse_index.sparse_offsets(idx, shape)
    if offsets is not None:
        return offsets
    raise sparse_index_error(name, inp, bad)


def sparse_index_error(name: str, inp: SparseTensor, bad: int) -> ValueError:
    """The ValueError for entry `bad`, the first index of `inp` outside its
    dense_shape or not after the previous one in row-major order."""
    idx = np.asarray(inp.indices)
    shape = tuple(inp.dense_shape)
    entry = idx[bad]
    if np.any(entry < 0) or np.any(entry >= np.asarray(shape)):
        return ValueError(
            f"feature {name}: SparseTensor index {entry.tolist()} is outside dense_shape {shape}"
        )
    return ValueError(
        f"feature {name}: SparseTensor indices must be sorted in row-major order "
        f"without repeats; entry {bad} {entry.tolist()} follows "
        f"{idx[bad - 1].tolist()}"
    )


def validate_structure(name: str, inp, weight=None) -> None:
    """`validate_input` without the O(nnz) check of sparse indices (see
    `sparse_row_offsets`, which does that check while computing row offsets)."""
    kind = input_kind(inp)
    if weight is not None and input_kind(weight) != kind:
        raise ValueError(
            f"feature {name}: weight is of type {type(weight).__name__} but the "
            f"input is {type(inp).__name__}; they must match"
        )
    if kind == "dense":
        ids = _check_int_ids(name, inp)
        if ids.ndim < 1:
            raise ValueError(
                f"feature {name}: a dense input must be [batch, ...] ids, got shape {ids.shape}"
            )
        if weight is not None:
            w = _check_float_weights(name, weight)
            if w.shape != ids.shape:
                raise ValueError(
                    f"feature {name}: weight shape {w.shape} != input shape {ids.shape}"
                )
        return
    if kind == "sparse":
        ids = _check_int_ids(name, inp.values)
        idx = np.asarray(inp.indices)
        rank = len(inp.dense_shape)
        if rank < 2:
            raise ValueError(
                f"feature {name}: a SparseTensor must have rank >= 2, got "
                f"dense_shape {inp.dense_shape}"
            )
        if idx.ndim != 2 or idx.shape[1] != rank or idx.shape[0] != ids.shape[0] or ids.ndim != 1:
            raise ValueError(
                f"feature {name}: SparseTensor indices {idx.shape} and values "
                f"{ids.shape} do not fit dense_shape {inp.dense_shape}"
            )
        if idx.dtype.kind not in _INTEGER_KINDS:
            raise TypeError(
                f"feature {name}: SparseTensor indices must be integers, got {idx.dtype}"
            )
        if weight is not None:
            w = _check_float_weights(name, weight.values)
            if w.shape != ids.shape or tuple(weight.dense_shape) != tuple(inp.dense_shape):
                raise ValueError(
                    f"feature {name}: weight SparseTensor (values {w.shape}, "
                    f"dense_shape {weight.dense_shape}) does not match the input "
                    f"(values {ids.shape}, dense_shape {inp.dense_shape})"
                )
        return
    ids = _check_int_ids(name, inp.values)
    splits = np.asarray(inp.row_splits)
    if ids.ndim != 1:
        raise ValueError(
            f"feature {name}: RaggedTensor values must be 1-D (rank-2 ragged), "
            f"got shape {ids.shape}"
        )
    if (
        splits.ndim != 1
        or splits.shape[0] < 1
        or splits.dtype.kind not in _INTEGER_KINDS
        or splits[0] != 0
        or splits[-1] != ids.shape[0]
        or (splits[1:] < splits[:-1]).any()
    ):
        raise ValueError(
            f"feature {name}: bad row_splits ({_bad_split(splits, ids.shape[0])}): "
            f"they must be integers starting at 0, non-decreasing, ending at "
            f"len(values) = {ids.shape[0]}"
        )
    if weight is not None:
        w = _check_float_weights(name, weight.values)
        if w.shape != ids.shape or not np.array_equal(np.asarray(weight.row_splits), splits):
            raise ValueError(
                f"feature {name}: weight RaggedTensor (values {w.shape}) must have "
                f"the input's row_splits and number of values ({ids.shape[0]})"
            )


def _bad_split(splits: np.ndarray, n: int) -> str:
    """Where row_splits first break the rules, with the offending value."""
    if splits.ndim != 1 or splits.shape[0] < 1:
        return f"shape {splits.shape}, expected 1-D of nrows + 1 >= 1 entries"
    if not np.issubdtype(splits.dtype, np.integer):
        return f"dtype {splits.dtype}, expected integers"
    if splits[0] != 0:
        return f"row_splits[0] = {splits[0]}, expected 0"
    dec = np.nonzero(splits[1:] < splits[:-1])[0]
    if dec.size:
        k = int(dec[0]) + 1
        return f"row_splits[{k}] = {splits[k]} < row_splits[{k - 1}] = {splits[k - 1]}"
    k = splits.shape[0] - 1
    return f"row_splits[{k}] = {splits[k]}, expected len(values) = {n}"


# ---------------------------------------------------------------------------
# Canonical host form


def ragged_row_ids(row_splits: np.ndarray) -> np.ndarray:
    """Row index of every value of a ragged tensor (vectorised)."""
    splits = np.asarray(row_splits, dtype=np.int64)
    lengths = np.diff(splits)
    return np.repeat(np.arange(lengths.shape[0], dtype=np.int32), lengths)


def ragged_positions(row_splits: np.ndarray) -> np.ndarray:
    """Position of every value within its row (vectorised)."""
    splits = np.asarray(row_splits, dtype=np.int64)
    n = int(splits[-1]) if splits.size else 0
    rows = ragged_row_ids(splits)
    return (np.arange(n, dtype=np.int64) - splits[:-1][rows]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """How one feature's input becomes activation rows: TensorFlow's serving rules,
    shared by training (`to_csr`, host preprocessing) and serving, so a model sees
    the same activations in both.

    kind: "lookup" (dense ids: one row per id, `ids.shape + [dim]`), "combined"
      (one combined row per bag: sparse rows of `dense_shape[:-1]`, ragged rows)
      or "sequence" (one row per position `< length`, zeros past the end).
    batch: samples, the leading dimension of the output (this process's).
    sample_shape: output dimensions of one sample before `dim`;
      rows_per_sample is their product.
    combiner: the table's combiner for "combined", else None (one id per row).
    prune_ids / prune_weights: TensorFlow's "safe" sparse lookup drops entries
      with ids < 0 / weights <= 0 before combining.
    use_weights: False where TensorFlow ignores weights (ragged sequence
      through `output_shape`).
    output_shape: the activation's final shape without `dim` where
      `FeatureConfig.output_shape` reshapes it, else None.
    """

    kind: str
    batch: int
    sample_shape: tuple
    combiner: str | None
    prune_ids: bool = False
    prune_weights: bool = False
    use_weights: bool = True
    output_shape: tuple | None = None

    @property
    def rows_per_sample(self) -> int:
        n = 1
        for d in self.sample_shape:
            n *= int(d)
        return n

    @property
    def num_rows(self) -> int:
        return self.batch * self.rows_per_sample

    @property
    def length(self) -> int:
        """Positions per sample of a "sequence" layout."""
        return int(self.sample_shape[0]) if self.kind == "sequence" else 0

    def activation_shape(self, dim: int, batch: int | None = None) -> tuple:
        """The activation's shape for `batch` samples (default: this batch)."""
        if self.output_shape is not None:
            return tuple(self.output_shape) + (dim,)
        b = self.batch if batch is None else batch
        return (b,) + tuple(self.sample_shape) + (dim,)


def feature_layout(name: str, feature, inp, weight=None, *, batch_scale: int = 1) -> FeatureLayout:
    """The layout of one feature's input under TensorFlow's serving rules.

    Needs only static information (input kind, shapes, the feature config), so
    it works on traced inputs too. Raises TensorFlow's `ValueError`s for
    weights that do not fit the input or feature, a dense input for a sequence
    feature, and an `output_shape` that does not fit the batch.

    `batch_scale`: global samples per local sample (training on several
    processes: `output_shape` is global, see `FeatureConfig`).
    """
    kind = input_kind(inp)
    L = feature.max_sequence_length
    combiner = feature.table.combiner
    if weight is not None:
        if kind == "dense":
            raise ValueError(f"Weight specified for {name}, but input is dense.")
        if input_kind(weight) != kind:
            raise ValueError(
                f"Weight for {name} is of type {type(weight).__name__} but it does "
                f"not match type of the input which is {type(inp).__name__}."
            )
        if L > 0:
            raise ValueError(f"Weight specified for {name}, but this is a sequence feature.")
    if kind == "dense":
        if L > 0:
            raise ValueError(f"Feature {name} is a sequence feature but a dense tensor was passed.")
        shape = tuple(int(d) for d in np.shape(inp))
        if not shape:
            raise ValueError(f"feature {name}: a dense input needs a batch dimension, got a scalar")
        return FeatureLayout("lookup", shape[0], shape[1:], None)
    if kind == "sparse":
        shape = tuple(inp.dense_shape)
        if len(shape) < 2:
            raise ValueError(
                f"feature {name}: a SparseTensor must have rank >= 2, got dense_shape {shape}"
            )
        if not feature.output_shape and L > 0 and len(shape) == 2:
            return FeatureLayout("sequence", shape[0], (L,), None)
        prune = feature.validate_weights_and_indices or len(shape) > 2  # TF's "safe" lookup
        return FeatureLayout(
            "combined",
            shape[0],
            shape[1:-1],
            combiner,
            # a table of raw ids (`TableConfig.id_map`): a negative id is an id
            prune_ids=prune and getattr(feature.table, "id_map", None) is None,
            prune_weights=prune and combiner != "sum",
        )
    b = inp.nrows
    if feature.output_shape:
        p = int(np.prod(feature.output_shape))
        gb = b * batch_scale
        out = tuple(feature.output_shape)
        if p == gb:
            return FeatureLayout("combined", b, (), combiner, output_shape=out)
        if p > gb and gb > 0 and p % gb == 0:
            return FeatureLayout(
                "sequence", b, (p // gb,), None, use_weights=False, output_shape=out
            )
        hint = ""
        if 0 < p < gb and gb % p == 0:  # TensorFlow's per-replica shape, by its look
            scaled = [out[0] * (gb // p), *out[1:]]
            hint = (
                f"; embedmesh's output_shape is global (the whole batch of {gb} samples "
                f"over all devices and processes), not per replica as in TensorFlow: "
                f"{scaled} here"
            )
        raise ValueError(
            f"Output shape set in the FeatureConfig should be the factor of the "
            f"input data batch size. But instead got output shape "
            f"{list(feature.output_shape)}, input data batch size {gb} "
            f"(feature {name}){hint}"
        )
    if L > 0:
        return FeatureLayout("sequence", b, (L,), None)
    return FeatureLayout("combined", b, (), combiner)


@dataclasses.dataclass(frozen=True)
class Csr:
    """One feature's batch as bags, the one host form of a batch: entries
    `splits[r]:splits[r+1]` add into output row r (no per-entry row array). Rows
    are in sample-major order: row `s * rows_per_sample + k` (see `FeatureLayout`).
    Host preprocessing and the serving lookup both take it (from `to_csr`).

    `prune_ids` / `prune_weights`: entries TensorFlow's "safe" sparse lookup
    drops (ids < 0 / weights <= 0) that are still here, left for the consumer's
    kernel to skip (`to_csr(prune=False)`); both False when the entries are
    exactly the ones that count.
    """

    ids: np.ndarray  # [nnz] integer ids, as given
    splits: np.ndarray  # int64 [num_rows + 1]
    weights: np.ndarray | None  # float32 [nnz], or None for all ones
    layout: FeatureLayout
    prune_ids: bool = False
    prune_weights: bool = False

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    @property
    def batch_size(self) -> int:
        return self.layout.batch


def to_csr(
    name: str,
    feature,
    inp,
    weight=None,
    *,
    batch_scale: int = 1,
    prune: bool = True,
    layout: FeatureLayout | None = None,
) -> Csr:
    """One concrete input as bags under `feature_layout`'s rules, checked on the way.

    The input's structure is checked (`validate_structure`), then its layout
    taken, unless the caller passes the `layout` it has taken already (the
    serving lookup does, first, so that misfit weights raise TensorFlow's
    errors). Sparse row offsets come from the one-pass `sparse_row_offsets`,
    which also checks the sparse indices, so nothing is checked twice. Errors
    name `name`. Ragged row_splits and dense strides are used as they are;
    entries keep their order.

    `prune`: leave out the entries TensorFlow's "safe" sparse lookup drops (and
    range-check the kept ids); with False they stay, flagged in the result's
    `prune_ids` / `prune_weights` for a kernel that skips them in its own pass
    (the serving lookup).
    """
    validate_structure(name, inp, weight)
    if layout is None:
        layout = feature_layout(name, feature, inp, weight, batch_scale=batch_scale)
    kind = input_kind(inp)
    if kind == "dense":
        ids = np.asarray(inp).reshape(-1)
        return Csr(ids, _identity_splits(ids.shape[0]), None, layout)
    w = None if weight is None or not layout.use_weights else np.asarray(weight.values, np.float32)
    ids = np.asarray(inp.values)
    if layout.kind == "sequence":
        L = layout.length
        if kind == "ragged":
            splits = np.asarray(inp.row_splits).astype(np.int64, copy=False)
            lengths = np.diff(splits)
            if lengths.size and lengths.max() > L:  # drop positions >= L
                ids = ids[ragged_positions(splits) < L]
                lengths = np.minimum(lengths, L)
            counts = (np.arange(L)[None, :] < lengths[:, None]).reshape(-1).astype(np.int64)
            return Csr(ids, _splits_of_counts(counts), None, layout)
        sparse_row_offsets(name, inp)  # checks the indices
        idx = np.asarray(inp.indices, dtype=np.int64)
        pos = idx[:, 1]
        keep = pos < L
        rows = idx[keep, 0] * L + pos[keep]
        counts = np.bincount(rows, minlength=layout.num_rows).astype(np.int64)
        return Csr(ids[keep], _splits_of_counts(counts), None, layout)
    if kind == "ragged":
        splits = np.asarray(inp.row_splits).astype(np.int64, copy=False)
    else:
        splits = sparse_row_offsets(name, inp)
    prune_ids = layout.prune_ids and ids.dtype.kind != "u"  # unsigned ids are never < 0
    prune_weights = layout.prune_weights and w is not None
    if not prune:
        return Csr(ids, splits, w, layout, prune_ids, prune_weights)
    if prune_ids or prune_weights:
        keep = ids >= 0 if prune_ids else np.ones(ids.shape, bool)
        if prune_weights and w is not None:
            keep &= w > 0
        if not keep.all():
            # range-check what is kept now, so an error names the entry as given
            vocab = feature.table.vocabulary_size
            out = keep & (ids >= vocab)
            if out.any() and getattr(feature.table, "id_map", None) is None:  # (raw ids: any)
                bad = int(np.flatnonzero(out)[0])
                raise id_range_error(name, ids[bad], bad, vocab)
            kept = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
            splits = kept[splits]
            ids = ids[keep]
            w = None if w is None else w[keep]
    return Csr(ids, splits, w, layout)


_IDENTITY_SPLITS: dict = {}  # n -> read-only arange(n + 1): dense inputs' splits, reused


def _identity_splits(n: int) -> np.ndarray:
    """`arange(n + 1)` (int64, read-only): one entry per row."""
    splits = _IDENTITY_SPLITS.get(n)
    if splits is None:
        if len(_IDENTITY_SPLITS) >= 64:
            _IDENTITY_SPLITS.clear()
        splits = np.arange(n + 1, dtype=np.int64)
        splits.flags.writeable = False
        _IDENTITY_SPLITS[n] = splits
    return splits


def _splits_of_counts(counts: np.ndarray) -> np.ndarray:
    splits = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=splits[1:])
    return splits


def id_range_error(name: str, id_, entry: int, vocabulary_size: int) -> ValueError:
    """The error for feature `name`'s entry `entry`, whose id is outside the table."""
    return ValueError(
        f"feature {name}: id {int(id_)} (entry {int(entry)}) is outside the "
        f"table's range [0, {vocabulary_size})"
    )


def check_id_range(name: str, ids: np.ndarray, vocabulary_size: int) -> None:
    """ValueError naming the feature and the first id outside [0, vocabulary_size)."""
    if ids.size == 0:
        return
    lo, hi = ids.min(), ids.max()
    if int(lo) < 0 or int(hi) >= vocabulary_size:  # Python ints: no uint64/int64 mixing
        if ids.dtype.kind == "u":
            bad = np.nonzero(ids >= np.asarray(vocabulary_size, ids.dtype))[0][0]
        else:
            bad = np.nonzero((ids < 0) | (ids >= vocabulary_size))[0][0]
        raise id_range_error(name, ids[bad], bad, vocabulary_size)


def flatten_inputs_like(
    resolved, inputs, what: str = "features", *, every_feature: bool = False
) -> list[Any | None]:
    """Inputs flattened in the feature config's order; a feature left out is None.

    Inputs may be a subset of the feature structure (dict keys may be
    missing). As TensorFlow's nest checks: a different kind of sequence (a
    list for a dict, a tuple for a list) is a TypeError; extra keys, a
    sequence of another length or a leaf where the config nests are
    ValueErrors. Any dict matches a dict. With `every_feature` (gradients, which
    TensorFlow checks against the whole structure), a dict that leaves a feature's key
    out is a ValueError naming the features (and any keys the config lacks); only an
    explicit None, for a feature or a subtree, stands for none.
    """
    if type(inputs) is dict:
        flat = _flat_dict_keys(resolved)
        if flat is not None and flat[1].issuperset(inputs):
            # a flat dict of features (the common serving request): no walk
            if every_feature and len(inputs) < len(flat[0]):
                left_out = [flat[2][k] for k in flat[0] if k not in inputs]
                _raise_left_out(resolved, left_out, [], what)
            return [None if (x := inputs.get(k)) is None else convert_input(x) for k in flat[0]]
    out: list[Any | None] = []
    gaps: tuple[list, list] | None = ([], []) if every_feature else None
    # a module-level walker: a nested one refers to itself through its closure, a
    # reference cycle that kept `out` (a step's converted inputs or gradients) alive until
    # the cyclic GC ran (8 MB a step of the training benchmark's gradients, ~100 MB)
    _flatten_walk(resolved_structure(resolved), inputs, "", out, what, gaps)
    if gaps is not None and (gaps[0] or gaps[1]):
        _raise_left_out(resolved, *gaps, what)
    return out


def _raise_left_out(resolved, left_out: list, extra: list, what: str):
    """The ValueError of `every_feature`: the features (positions in the flat order) a
    dict left out, by name, and the keys (paths) the config lacks."""
    if not left_out:
        raise ValueError(f"{what}: keys {sorted(extra)} are not in the feature config")
    names = [resolved.feature_names[i] for i in sorted(left_out)]
    message = (
        f"{what} lack feature(s) {names}: the {what} must have the feature config's "
        f"structure (pass None for a feature that has none)"
    )
    if extra:
        message += f"; and keys {sorted(extra)} are not in the feature config"
    raise ValueError(message)


def unflatten_flat_dict(resolved, inputs, flat_outputs: list) -> dict | None:
    """`flatten_inputs_like`'s inverse for a flat dict of features: the outputs (one per
    feature, in the structure's order) as a dict with `inputs`' keys in their order, or
    None for any other structure (the caller unflattens the tree)."""
    if type(inputs) is not dict:
        return None
    flat = _flat_dict_keys(resolved)
    if flat is None or not flat[1].issuperset(inputs):
        return None
    position = flat[2]
    return {k: flat_outputs[position[k]] for k in inputs}


_FLAT_DICT_KEYS: dict = {}  # id(resolved) -> (resolved, (sorted keys, key set, positions) or None)


def _flat_dict_keys(resolved) -> tuple | None:
    """(sorted keys, key set, key -> position) when the feature structure is one dict of
    FeatureConfigs with str keys, else None; remembered per resolved structure (the walk
    costs 15-25 us of a serving request)."""
    hit = _FLAT_DICT_KEYS.get(id(resolved))
    if hit is not None and hit[0] is resolved:
        return hit[1]
    from embedmesh.config import FeatureConfig

    cfg = resolved_structure(resolved)
    flat = None
    if type(cfg) is dict and all(
        type(k) is str and isinstance(v, FeatureConfig) for k, v in cfg.items()
    ):
        keys = tuple(sorted(cfg))
        flat = (keys, frozenset(cfg), {k: i for i, k in enumerate(keys)})
    if len(_FLAT_DICT_KEYS) >= 64:
        _FLAT_DICT_KEYS.clear()
    _FLAT_DICT_KEYS[id(resolved)] = (resolved, flat)
    return flat


def _is_leaf(x) -> bool:
    return (
        x is None
        or isinstance(x, (SparseTensor, RaggedTensor))
        or not isinstance(x, (dict, list, tuple))
    )


def _flatten_walk(cfg, inp, path: str, out: list, what: str, gaps=None) -> None:
    """Append the inputs of `cfg`'s features to `out`; `gaps` (`every_feature`): lists
    that collect the positions of features whose dict key is left out, and the paths of
    keys the config lacks, instead of reading the first as None and raising on the
    second."""
    from embedmesh.config import FeatureConfig

    if isinstance(cfg, FeatureConfig):
        out.append(None if inp is None else convert_input(inp))
        return
    if inp is None:
        out.extend(None for _ in jax.tree_util.tree_leaves(cfg))
        return
    if isinstance(cfg, dict):
        if not isinstance(inp, dict):
            # TensorFlow's nest checks: another kind of sequence is a TypeError,
            # a leaf where the config nests is a ValueError
            err = TypeError if _is_sequence(inp) else ValueError
            raise err(
                f"{what} at {path or '<root>'}: expected a dict like the "
                f"feature config, got {type(inp).__name__}"
            )
        extra = set(inp) - set(cfg)
        if extra and gaps is not None:
            gaps[1].extend(f"{path}/{k}" if path else str(k) for k in extra)
        elif extra:
            raise ValueError(
                f"{what} at {path or '<root>'}: keys {sorted(map(str, extra))} "
                f"are not in the feature config"
            )
        for k in sorted(cfg):
            if gaps is not None and k not in inp:
                start = len(out)
                out.extend(None for _ in jax.tree_util.tree_leaves(cfg[k]))
                gaps[0].extend(range(start, len(out)))
                continue
            _flatten_walk(cfg[k], inp.get(k), f"{path}/{k}" if path else str(k), out, what, gaps)
        return
    if isinstance(cfg, (list, tuple)):
        kind = type(cfg).__name__
        if _is_sequence(inp) and type(inp) is not type(cfg):
            raise TypeError(
                f"{what} at {path or '<root>'}: expected a {kind} like the "
                f"feature config, got {type(inp).__name__}"
            )
        if _is_leaf(inp) or len(inp) != len(cfg):
            raise ValueError(
                f"{what} at {path or '<root>'}: expected a {kind} (a "
                f"sequence of {len(cfg)}) like the feature config, got "
                f"{type(inp).__name__}" + (f" of {len(inp)}" if _is_sequence(inp) else "")
            )
        for i, (c, x) in enumerate(zip(cfg, inp)):
            _flatten_walk(c, x, f"{path}/{i}" if path else str(i), out, what, gaps)
        return
    raise ValueError(f"unsupported feature config node {type(cfg).__name__} at {path}")


def _is_sequence(x) -> bool:
    """A structure node (dict, list, tuple, namedtuple), not a leaf input."""
    return isinstance(x, (dict, list, tuple)) and not isinstance(x, (SparseTensor, RaggedTensor))


def resolved_structure(resolved):
    return jax.tree_util.tree_unflatten(resolved.treedef, list(resolved.features))
