"""What the serving backends share: the errors their kernels raise and the
helpers every form of an op uses the same way (signed ids, TensorFlow's pruning
in numpy, float32 sums cast to the table's dtype, the widened bag for tables
that are not float32)."""

from __future__ import annotations

import numpy as np

from embedmesh.serving import pool

__all__ = [
    "BadSparseIndex",
    "IdOutOfRange",
    "decoded_bag",
    "drop_pruned",
    "finish",
    "signed_ids",
    "widened_bag",
]


class BadSparseIndex(ValueError):
    """A sparse index outside dense_shape or out of row-major order; `entry` is its
    position in the indices (see `kernels.prepare_sparse_bag_combine`)."""

    def __init__(self, entry: int):
        self.entry = int(entry)
        super().__init__(f"bad sparse index at entry {self.entry}")


class IdOutOfRange(ValueError):
    """An id outside [0, vocabulary_size); `entry` is its position in the ids."""

    def __init__(self, entry: int, id_: int, vocabulary_size: int):
        self.entry, self.id, self.vocabulary_size = int(entry), int(id_), int(vocabulary_size)
        super().__init__(
            f"ids must lie in [0, {self.vocabulary_size}), got id {self.id} at entry {self.entry}"
        )


def signed_ids(ids: np.ndarray) -> tuple[np.ndarray, bool]:
    """ids as a signed integer array, and whether negative ids can be real.

    Unsigned ids are viewed as int64 (huge ones turn negative and then fail
    the range check), so the kernels never mix signed and unsigned compares.
    """
    if ids.dtype.kind == "u":
        return ids.astype(np.int64), False
    return ids, True


def finish(out32: np.ndarray, dtype) -> np.ndarray:
    """The float32 accumulator as `dtype` (aligned; no copy for float32)."""
    if out32.dtype == dtype:
        return out32
    out = pool.output_empty(out32.shape, dtype)
    out[...] = out32
    return out


def drop_pruned(ids, offsets, weights, vocab, prune_ids, prune_w):
    """Drop pruned entries (ids, offsets, weights renumbered); IdOutOfRange for the
    first kept id outside [0, vocab)."""
    keep = ids >= 0 if prune_ids else None
    if prune_w and weights is not None:
        keep = weights > 0 if keep is None else keep & (weights > 0)
    bad = (ids < 0) | (ids >= vocab)
    if keep is not None:
        bad &= keep
    if ids.size and bad.any():
        k = int(np.argmax(bad))
        raise IdOutOfRange(k, ids[k], vocab)
    if keep is None or keep.all():
        return ids, offsets, weights
    kept_before = np.zeros(ids.shape[0] + 1, np.int64)
    np.cumsum(keep, out=kept_before[1:])
    return ids[keep], kept_before[offsets], None if weights is None else weights[keep]


def widened_bag(gather, bag, table, ids, offsets, weights, mode, prune_ids, prune_w):
    """A bag kernel for a table of another dtype than float32 (float16, bfloat16: no
    arithmetic of theirs in the kernels) or a `QuantizedTable` (`decoded_bag`): when
    run, prune, `gather` the rows, widen them to float32, then reduce them with the
    float32 `bag` kernel of the same backend."""

    def run():
        c_ids, c_offsets, c_w = drop_pruned(
            ids, offsets, weights, table.shape[0], prune_ids, prune_w
        )
        wide = gather(table, c_ids).astype(np.float32)
        return bag(
            wide, np.arange(c_ids.shape[0], dtype=np.int64), c_offsets, c_w, mode, False, False
        )

    return run


def decoded_bag(bag, table, ids, offsets, weights, mode, prune_ids, prune_w):
    """A bag kernel for a `QuantizedTable` (numpy and numba backends): when run, prune,
    decode the kept rows to float32 (`QuantizedTable.rows`: the C++ kernel's decode,
    bit for bit), then reduce them with the float32 `bag` kernel of the same backend."""
    return widened_bag(
        lambda t, i: t.rows(i), bag, table, ids, offsets, weights, mode, prune_ids, prune_w
    )
