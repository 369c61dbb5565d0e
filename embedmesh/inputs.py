"""Input forms of a feature and their canonical host form.

A feature's input is a dense integer array (`[batch]` or `[batch, n]`, every
entry an id), a `SparseTensor` or a `RaggedTensor`; TensorFlow's
`tf.SparseTensor`/`tf.RaggedTensor` are accepted by duck typing (TensorFlow is
never imported). Both containers are JAX pytrees, so they can be passed
through `jax.jit` and `jax.export` (the sparse `dense_shape` is static).

Every consumer (the serving lookup, the host preprocessing) reduces an input
to a `Coo`: parallel arrays (output row, id, weight) plus the number of output
rows. That is the one canonical host form; all conversions are vectorised.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from embedmesh import kernels


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
    def from_row_lengths(cls, values, row_lengths) -> "RaggedTensor":
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
        return SparseTensor(np.asarray(_to_numpy(x.indices)), np.asarray(_to_numpy(x.values)),
                            tuple(int(d) for d in np.asarray(_to_numpy(x.dense_shape))))
    if all(hasattr(x, a) for a in ("values", "row_splits", "flat_values")):
        if getattr(x, "ragged_rank", 1) != 1:
            raise ValueError(f"only rank-2 ragged tensors are supported, got ragged_rank "
                             f"{x.ragged_rank}")
        return RaggedTensor(np.asarray(_to_numpy(x.values)),
                            np.asarray(_to_numpy(x.row_splits)))
    return _to_numpy(x)


def input_kind(x) -> str:
    """"sparse", "ragged" or "dense" (anything array-like)."""
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


def _not_a_tensor(name: str, what: str, x, arr: np.ndarray) -> ValueError:
    return ValueError(f"feature {name}: {what} must be a Tensor (array), SparseTensor or "
                      f"RaggedTensor, got {type(x).__name__}"
                      + (f" ({x!r:.40})" if isinstance(x, (str, bytes)) else "")
                      + (f" (dtype {arr.dtype})" if isinstance(x, np.ndarray) else ""))


def _check_int_ids(name: str, ids) -> np.ndarray:
    src = ids
    ids = np.asarray(ids)
    if ids.dtype.kind in _NOT_NUMERIC:  # TensorFlow: a ValueError (not a tensor type)
        raise _not_a_tensor(name, "the input", src, ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"feature {name}: ids must be integers, got dtype {ids.dtype}")
    return ids


def _check_float_weights(name: str, w) -> np.ndarray:
    src = w
    w = np.asarray(w)
    if w.dtype.kind in _NOT_NUMERIC:
        raise _not_a_tensor(name, "the weight", src, w)
    if not (np.issubdtype(w.dtype, np.floating) or np.issubdtype(w.dtype, np.integer)):
        raise TypeError(f"feature {name}: weights must be numeric, got dtype {w.dtype}")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():  # one vectorised pass; NaN/Inf would poison rows and slots
        flat = w.reshape(-1)
        bad = int(np.argmin(np.isfinite(flat)))
        raise ValueError(f"feature {name}: weights must be finite, got {flat[bad]} at entry "
                         f"{bad}")
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
    repeats. One compiled pass when numba is present (kernels.sparse_offsets).
    """
    idx = np.asarray(inp.indices)
    shape = tuple(inp.dense_shape)
    offsets, bad = kernels.sparse_offsets(idx, shape)
    if bad < 0:
        return offsets
    entry = idx[bad]
    if np.any(entry < 0) or np.any(entry >= np.asarray(shape)):
        raise ValueError(f"feature {name}: SparseTensor index {entry.tolist()} is outside "
                         f"dense_shape {shape}")
    raise ValueError(f"feature {name}: SparseTensor indices must be sorted in row-major order "
                     f"without repeats; entry {bad} {entry.tolist()} follows "
                     f"{idx[bad - 1].tolist()}")


def validate_structure(name: str, inp, weight=None) -> None:
    """`validate_input` without the O(nnz) check of sparse indices (see
    `sparse_row_offsets`, which does that check while computing row offsets)."""
    kind = input_kind(inp)
    if weight is not None and input_kind(weight) != kind:
        raise ValueError(f"feature {name}: weight is of type {type(weight).__name__} but the "
                         f"input is {type(inp).__name__}; they must match")
    if kind == "dense":
        ids = _check_int_ids(name, inp)
        if ids.ndim not in (1, 2):
            raise ValueError(f"feature {name}: a dense input must be [batch] or [batch, n], "
                             f"got shape {ids.shape}")
        if weight is not None:
            w = _check_float_weights(name, weight)
            if w.shape != ids.shape:
                raise ValueError(f"feature {name}: weight shape {w.shape} != input shape "
                                 f"{ids.shape}")
        return
    if kind == "sparse":
        ids = _check_int_ids(name, inp.values)
        idx = np.asarray(inp.indices)
        rank = len(inp.dense_shape)
        if rank < 2:
            raise ValueError(f"feature {name}: a SparseTensor must have rank >= 2, got "
                             f"dense_shape {inp.dense_shape}")
        if idx.ndim != 2 or idx.shape[1] != rank or idx.shape[0] != ids.shape[0] or ids.ndim != 1:
            raise ValueError(f"feature {name}: SparseTensor indices {idx.shape} and values "
                             f"{ids.shape} do not fit dense_shape {inp.dense_shape}")
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"feature {name}: SparseTensor indices must be integers, got "
                            f"{idx.dtype}")
        if weight is not None:
            w = _check_float_weights(name, weight.values)
            if w.shape != ids.shape or tuple(weight.dense_shape) != tuple(inp.dense_shape):
                raise ValueError(f"feature {name}: weight SparseTensor (values {w.shape}, "
                                 f"dense_shape {weight.dense_shape}) does not match the input "
                                 f"(values {ids.shape}, dense_shape {inp.dense_shape})")
        return
    ids = _check_int_ids(name, inp.values)
    splits = np.asarray(inp.row_splits)
    if ids.ndim != 1:
        raise ValueError(f"feature {name}: RaggedTensor values must be 1-D (rank-2 ragged), "
                         f"got shape {ids.shape}")
    if (splits.ndim != 1 or splits.shape[0] < 1 or not np.issubdtype(splits.dtype, np.integer)
            or splits[0] != 0 or splits[-1] != ids.shape[0] or (splits[1:] < splits[:-1]).any()):
        raise ValueError(f"feature {name}: bad row_splits ({_bad_split(splits, ids.shape[0])}): "
                         f"they must be integers starting at 0, non-decreasing, ending at "
                         f"len(values) = {ids.shape[0]}")
    if weight is not None:
        w = _check_float_weights(name, weight.values)
        if w.shape != ids.shape or not np.array_equal(np.asarray(weight.row_splits), splits):
            raise ValueError(f"feature {name}: weight RaggedTensor (values {w.shape}) must have "
                             f"the input's row_splits and number of values ({ids.shape[0]})")


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


@dataclasses.dataclass(frozen=True)
class Coo:
    """One feature's batch as parallel arrays: output row, id, weight.

    `rows[k]` is the output row entry k adds into (a sample, or
    `sample * L + position` for sequence features); `num_rows` is the number
    of output rows, `batch_size` the number of samples.
    """

    rows: np.ndarray  # int32 [nnz]
    ids: np.ndarray  # int64 [nnz]
    weights: np.ndarray  # float32 [nnz]
    num_rows: int
    batch_size: int


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


def to_coo(inp, weight=None, max_sequence_length: int = 0) -> Coo:
    """Canonical (row, id, weight) form of a validated concrete input.

    Training semantics (as the SparseCore input pipeline): every entry is an
    id (dense arrays included; nothing is pruned here); a dense `[batch, n]`
    or a sparse/ragged row combines its ids into one output row per sample,
    unless `max_sequence_length = L > 0`, which gives one output row per
    (sample, position) with positions >= L dropped. Sparse inputs of rank > 2
    fold their leading dimensions into the batch.
    """
    kind = input_kind(inp)
    L = max_sequence_length
    if kind == "dense":
        ids = np.asarray(inp)
        ids2 = ids.reshape(ids.shape[0], int(np.prod(ids.shape[1:])))
        b, n = ids2.shape
        w = (np.ones(ids2.shape, np.float32) if weight is None
             else np.asarray(weight, np.float32).reshape(b, n))
        sample = np.repeat(np.arange(b, dtype=np.int32), n)
        pos = np.tile(np.arange(n, dtype=np.int32), b)
        ids_flat, w_flat = ids2.reshape(-1).astype(np.int64), w.reshape(-1)
    elif kind == "sparse":
        idx = np.asarray(inp.indices, dtype=np.int64)
        shape = inp.dense_shape
        b = int(np.prod(shape[:-1]))
        sample = (np.ravel_multi_index(tuple(idx[:, :-1].T), shape[:-1]).astype(np.int32)
                  if idx.shape[0] else np.zeros(0, np.int32))
        pos = idx[:, -1].astype(np.int32)
        ids_flat = np.asarray(inp.values).astype(np.int64)
        w_flat = (np.ones(ids_flat.shape, np.float32) if weight is None
                  else np.asarray(weight.values, np.float32))
    else:
        splits = np.asarray(inp.row_splits)
        b = splits.shape[0] - 1
        sample = ragged_row_ids(splits)
        pos = ragged_positions(splits)
        ids_flat = np.asarray(inp.values).astype(np.int64)
        w_flat = (np.ones(ids_flat.shape, np.float32) if weight is None
                  else np.asarray(weight.values, np.float32))
    if L > 0:
        keep = pos < L
        if not keep.all():
            sample, pos, ids_flat, w_flat = sample[keep], pos[keep], ids_flat[keep], w_flat[keep]
        return Coo(sample * np.int32(L) + pos, ids_flat, w_flat, b * L, b)
    return Coo(sample, ids_flat, w_flat, b, b)


@dataclasses.dataclass(frozen=True)
class Csr:
    """One feature's batch as bags: entries `splits[r]:splits[r+1]` add into output
    row r (the form the kernels take: no per-entry row array)."""

    ids: np.ndarray  # [nnz] integer ids, as given
    splits: np.ndarray  # int64 [num_rows + 1]
    weights: Optional[np.ndarray]  # float32 [nnz], or None for all ones
    num_rows: int
    batch_size: int


def to_csr(inp, weight=None, max_sequence_length: int = 0, name: str = "<input>") -> Csr:
    """`to_coo`'s entries and training semantics, as bags (see `Csr`).

    Ragged row_splits and dense `[batch, n]` strides are used as they are;
    sparse row offsets come from the one-pass `sparse_row_offsets`, which
    also checks the sparse indices (errors name `name`), so after
    `validate_structure` nothing needs checking twice. Entries keep their
    order: `to_coo(...).rows` is `np.repeat(arange(num_rows), diff(splits))`.
    """
    kind = input_kind(inp)
    L = max_sequence_length
    if kind == "dense":
        ids = np.asarray(inp)
        b = ids.shape[0]
        n = int(np.prod(ids.shape[1:]))  # not reshape(b, -1): b may be 0
        ids2 = ids.reshape(b, n)
        w2 = None if weight is None else np.asarray(weight, np.float32).reshape(b, n)
        if L == 0:
            splits = (np.arange(0, b * n + 1, n, dtype=np.int64) if n else
                      np.zeros(b + 1, np.int64))
            return Csr(ids2.reshape(-1), splits, None if w2 is None else w2.reshape(-1), b, b)
        k = min(n, L)
        counts = np.tile((np.arange(L) < k).astype(np.int64), b)
        return Csr(ids2[:, :k].reshape(-1), _splits_of_counts(counts),
                   None if w2 is None else w2[:, :k].reshape(-1), b * L, b)
    w = None if weight is None else np.asarray(weight.values, np.float32)
    ids = np.asarray(inp.values)
    if kind == "ragged":
        splits = np.asarray(inp.row_splits).astype(np.int64, copy=False)
        b = splits.shape[0] - 1
        if L == 0:
            return Csr(ids, splits, w, b, b)
        lengths = np.diff(splits)
        if lengths.size and lengths.max() > L:  # drop positions >= L
            keep = ragged_positions(splits) < L
            ids, w = ids[keep], None if w is None else w[keep]
            lengths = np.minimum(lengths, L)
        counts = (np.arange(L)[None, :] < lengths[:, None]).reshape(-1).astype(np.int64)
        return Csr(ids, _splits_of_counts(counts), w, b * L, b)
    shape = inp.dense_shape
    b = int(np.prod(shape[:-1]))
    if L == 0:
        return Csr(ids, sparse_row_offsets(name, inp), w, b, b)
    coo = to_coo(inp, weight, L)
    counts = np.bincount(coo.rows, minlength=coo.num_rows)
    return Csr(coo.ids, _splits_of_counts(counts), None if w is None else coo.weights,
               coo.num_rows, b)


def _splits_of_counts(counts: np.ndarray) -> np.ndarray:
    splits = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=splits[1:])
    return splits


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
        raise ValueError(f"feature {name}: id {int(ids[bad])} (entry {int(bad)}) is outside the "
                         f"table's range [0, {vocabulary_size})")


def flatten_inputs_like(resolved, inputs, what: str = "features") -> list[Optional[Any]]:
    """Inputs flattened in the feature config's order; a feature left out is None.

    Inputs may be a subset of the feature structure (dict keys may be
    missing). As TensorFlow's nest checks: a different kind of sequence (a
    list for a dict, a tuple for a list) is a TypeError; extra keys, a
    sequence of another length or a leaf where the config nests are
    ValueErrors. Any dict matches a dict.
    """
    from embedmesh.config import FeatureConfig

    def is_leaf(x):
        return x is None or isinstance(x, (SparseTensor, RaggedTensor)) or not isinstance(
            x, (dict, list, tuple))

    out = []

    def walk(cfg, inp, path):
        if isinstance(cfg, FeatureConfig):
            out.append(None if inp is None else convert_input(inp))
            return
        if inp is None:
            for leaf in jax.tree_util.tree_leaves(cfg):
                out.append(None)
            return
        if isinstance(cfg, dict):
            if not isinstance(inp, dict):
                # TensorFlow's nest checks: another kind of sequence is a TypeError,
                # a leaf where the config nests is a ValueError
                err = TypeError if _is_sequence(inp) else ValueError
                raise err(f"{what} at {path or '<root>'}: expected a dict like the "
                          f"feature config, got {type(inp).__name__}")
            extra = set(inp) - set(cfg)
            if extra:
                raise ValueError(f"{what} at {path or '<root>'}: keys {sorted(map(str, extra))} "
                                 f"are not in the feature config")
            for k in sorted(cfg):
                walk(cfg[k], inp.get(k), f"{path}/{k}" if path else str(k))
            return
        if isinstance(cfg, (list, tuple)):
            kind = type(cfg).__name__
            if _is_sequence(inp) and type(inp) is not type(cfg):
                raise TypeError(f"{what} at {path or '<root>'}: expected a {kind} like the "
                                f"feature config, got {type(inp).__name__}")
            if is_leaf(inp) or len(inp) != len(cfg):
                raise ValueError(f"{what} at {path or '<root>'}: expected a {kind} (a "
                                 f"sequence of {len(cfg)}) like the feature config, got "
                                 f"{type(inp).__name__}"
                                 + (f" of {len(inp)}" if _is_sequence(inp) else ""))
            for i, (c, x) in enumerate(zip(cfg, inp)):
                walk(c, x, f"{path}/{i}" if path else str(i))
            return
        raise ValueError(f"unsupported feature config node {type(cfg).__name__} at {path}")

    walk(resolved_structure(resolved), inputs, "")
    return out


def _is_sequence(x) -> bool:
    """A structure node (dict, list, tuple, namedtuple), not a leaf input."""
    return isinstance(x, (dict, list, tuple)) and not isinstance(x, (SparseTensor, RaggedTensor))


def resolved_structure(resolved):
    return jax.tree_util.tree_unflatten(resolved.treedef, list(resolved.features))
