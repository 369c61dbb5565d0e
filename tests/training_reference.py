"""Plain float64 reference of a training step (loops and dicts, written for clarity).

Training semantics (the SparseCore's): every entry of an input is an id (no
pruning); a combined feature's activation for sample b is
sum_k gain_k * table[id_k] with gain_k = w_k * scale_b, scale_b = 1 (sum),
1/sum(w) (mean), 1/sqrt(sum(w^2)) (sqrtn), zero when the sum is zero; a
sequence feature (L > 0) gives row (b, p) = w * table[id] for positions p < L.
The gradient of a row is the sum over all entries of gain_k * dact[row of k];
every row that appears in the batch is updated once.
"""

import collections

import numpy as np

from embedmesh import RaggedTensor, SparseTensor


def entries(inp, weight):
    """Per sample: a list of (position, id, weight)."""
    if isinstance(inp, RaggedTensor):
        splits = np.asarray(inp.row_splits).tolist()
        vals = np.asarray(inp.values).tolist()
        ws = None if weight is None else np.asarray(weight.values).tolist()
        return [[(p, vals[k], 1.0 if ws is None else ws[k])
                 for p, k in enumerate(range(splits[b], splits[b + 1]))]
                for b in range(len(splits) - 1)]
    if isinstance(inp, SparseTensor):
        out = [[] for _ in range(inp.dense_shape[0])]
        ws = None if weight is None else np.asarray(weight.values).tolist()
        for k, (idx, i) in enumerate(zip(np.asarray(inp.indices).tolist(),
                                         np.asarray(inp.values).tolist())):
            out[idx[0]].append((idx[1], i, 1.0 if ws is None else ws[k]))
        return out
    ids = np.asarray(inp)
    ids = ids.reshape(ids.shape[0], -1)
    w = None if weight is None else np.asarray(weight).reshape(ids.shape)
    return [[(p, int(ids[b, p]), 1.0 if w is None else float(w[b, p]))
             for p in range(ids.shape[1])] for b in range(ids.shape[0])]


def gains(feature, per_sample):
    """[(output row index, id, gain)] for one feature; row is b or (b, p)."""
    out = []
    L = feature.max_sequence_length
    for b, ents in enumerate(per_sample):
        if L > 0:
            out += [((b, p), i, w) for p, i, w in ents if p < L]
            continue
        ws = [w for _, _, w in ents]
        comb = feature.table.combiner
        if comb == "sum":
            scale = 1.0
        elif comb == "mean":
            scale = 1.0 / sum(ws) if sum(ws) != 0 else 0.0
        else:
            s2 = sum(w * w for w in ws)
            scale = 1.0 / np.sqrt(s2) if s2 != 0 else 0.0
        out += [(b, i, w * scale) for _, i, w in ents]
    return out


def activation(feature, table, gain_list, batch):
    dim = table.shape[1]
    L = feature.max_sequence_length
    out = np.zeros((batch, L, dim) if L > 0 else (batch, dim))
    for row, i, g in gain_list:
        out[row] += g * table[i]
    return out


def row_gradients(features_and_gains, dacts):
    """{table name: {id: gradient}} summed over all features of each table."""
    grads = collections.defaultdict(dict)
    for (name, feature, table_name, gain_list) in features_and_gains:
        d = dacts[name]
        for row, i, g in gain_list:
            acc = grads[table_name].setdefault(i, np.zeros(d.shape[-1]))
            if d is not None:
                acc += g * np.asarray(d[row], np.float64)
    return grads
