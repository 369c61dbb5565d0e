"""Plain float64 reference of a training step (loops and dicts, written for clarity).

Layout (TensorFlow's serving rules, which training follows too, so a model
sees the same activations trained and served):
- dense ids: a plain lookup per id, activation `ids.shape + [dim]`;
- sparse, rank 2, `max_sequence_length = L > 0`, no `output_shape`: row (b, p)
  = table[id] for positions p < L, activation `[B, L, dim]`;
- sparse otherwise: one combined row per index of `dense_shape[:-1]`; with
  `validate_weights_and_indices` (or rank > 2) ids < 0 are left out, and for
  mean/sqrtn weights <= 0 too;
- ragged with `output_shape` of product P: P == B combined, P = k * B a
  sequence of length k (weights ignored), reshaped to `output_shape`;
- ragged with L > 0: a sequence `[B, L, dim]`; else combined `[B, dim]`.
A combined row is sum_k gain_k * table[id_k] with gain_k = w_k * scale,
scale = 1 (sum), 1/sum(w) (mean), 1/sqrt(sum(w^2)) (sqrtn), zero when the sum
is zero. The gradient of a table row is the sum over all entries of
gain_k * dact[row of k]; every row that appears in the batch is updated once.
"""

import collections
import itertools

import numpy as np

from embedmesh import RaggedTensor, SparseTensor


def _combine(comb, bag):
    """[(id, gain)] of one combined row."""
    ws = [w for _, w in bag]
    if comb == "sum":
        scale = 1.0
    elif comb == "mean":
        scale = 1.0 / sum(ws) if sum(ws) != 0 else 0.0
    else:
        s2 = sum(w * w for w in ws)
        scale = 1.0 / np.sqrt(s2) if s2 != 0 else 0.0
    return [(i, w * scale) for i, w in bag]


def layout(feature, inp, weight, global_batch=None):
    """(shape without dim, [(row index tuple, id, gain)], final output_shape or None)."""
    comb = feature.table.combiner
    L = feature.max_sequence_length
    if isinstance(inp, SparseTensor):
        shape = tuple(inp.dense_shape)
        idx = np.asarray(inp.indices).tolist()
        vals = np.asarray(inp.values).tolist()
        ws = [1.0] * len(vals) if weight is None else np.asarray(weight.values).tolist()
        if L > 0 and len(shape) == 2 and not feature.output_shape:
            return (
                (shape[0], L),
                [((ix[0], ix[1]), v, 1.0) for ix, v in zip(idx, vals) if ix[1] < L],
                None,
            )
        prune = feature.validate_weights_and_indices or len(shape) > 2
        bags = collections.defaultdict(list)
        for ix, v, w in zip(idx, vals, ws):
            if prune and (v < 0 or (comb != "sum" and w <= 0)):
                continue
            bags[tuple(ix[:-1])].append((v, w))
        out = [(row, i, g) for row, bag in bags.items() for i, g in _combine(comb, bag)]
        return shape[:-1], out, None
    if isinstance(inp, RaggedTensor):
        splits = np.asarray(inp.row_splits).tolist()
        vals = np.asarray(inp.values).tolist()
        ws = [1.0] * len(vals) if weight is None else np.asarray(weight.values).tolist()
        B = len(splits) - 1
        rows = [[(vals[k], ws[k]) for k in range(splits[b], splits[b + 1])] for b in range(B)]
        gb = B if global_batch is None else global_batch
        seq_len, final = L, None
        if feature.output_shape:
            P = int(np.prod(feature.output_shape))
            final = tuple(feature.output_shape)
            seq_len = 0 if gb == P else P // gb
        if seq_len > 0:
            return (
                (B, seq_len),
                [
                    ((b, p), i, 1.0)
                    for b, row in enumerate(rows)
                    for p, (i, _) in enumerate(row)
                    if p < seq_len
                ],
                final,
            )
        return (
            (B,),
            [((b,), i, g) for b, row in enumerate(rows) for i, g in _combine(comb, row)],
            final,
        )
    ids = np.asarray(inp)
    out = [(ix, int(ids[ix]), 1.0) for ix in itertools.product(*map(range, ids.shape))]
    return ids.shape, out, None


def activation(table, lay):
    shape, gain_list, final = lay
    out = np.zeros(tuple(shape) + (table.shape[1],))
    for row, i, g in gain_list:
        out[row] += g * table[i]
    return out if final is None else out.reshape(final + (table.shape[1],))


def row_gradients(features_and_layouts, dacts):
    """{table name: {id: gradient}} summed over all features of each table."""
    grads = collections.defaultdict(dict)
    for name, table_name, lay in features_and_layouts:
        shape, gain_list, _ = lay
        d = dacts[name]
        if d is not None:
            d = np.asarray(d, np.float64).reshape(tuple(shape) + (d.shape[-1],))
        for row, i, g in gain_list:
            acc = grads[table_name].setdefault(i, np.zeros(d.shape[-1]))
            if d is not None:
                acc += g * d[row]
    return grads
