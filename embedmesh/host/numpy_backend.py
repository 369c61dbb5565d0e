"""The numpy backend of host preprocessing: one composite-key sort per table.

Bit-identical to the numba backend (`embedmesh.host.numba_backend`), always
available, and the one that takes any `RowLayout`: where an id goes is asked
of the plan's layout (`shard_of`, `block_row`), never re-derived here.

`sort_table` does the capacity-independent work of one table (sort, merge
duplicates, rank within partitions); `fill` writes a stack's arrays at one
capacity from its tables' sorts, so a stack re-run at a grown capacity sorts
nothing again.
"""

from __future__ import annotations

import numpy as np

from embedmesh._runtime import PAD_ID
from embedmesh.inputs import check_id_range

__all__ = ["bits_needed", "fill", "sort_table"]


def bits_needed(x: int) -> int:
    """Bits of the unsigned value max(x, 0)."""
    return int(max(x, 0)).bit_length()


def sort_table(members: list, table, row_layout, D: int, N: int) -> dict | None:
    """One table's entries sorted by (partition, row, entry order), merged into pairs.

    `members`: `(feature name, Csr, FeatureSegment)` of the table's features.
    Capacity-independent; ranks are within this table's part of each partition.
    """
    if not members:
        return None
    keys, orows, gains = [], [], []
    S = table.rows_per_shard
    for name, c, seg in members:
        check_id_range(name, c.ids, table.vocabulary_size)
        rows_total = c.splits.shape[0] - 1
        lengths = np.diff(c.splits)
        row_of = np.repeat(np.arange(rows_total, dtype=np.int64), lengths)
        rpd = seg.num_rows
        d = row_of // rpd if rpd else row_of
        orows.append(seg.row_offset + row_of - d * rpd)
        w = None if c.weights is None else c.weights.astype(np.float64)
        combiner = c.layout.combiner
        if combiner in ("mean", "sqrtn"):
            if w is None:
                den = lengths.astype(np.float64)
            else:
                den = np.bincount(
                    row_of, weights=w if combiner == "mean" else w * w, minlength=rows_total
                ).astype(np.float64, copy=False)
            if combiner == "sqrtn":
                den = np.sqrt(den)
            scale = np.divide(1.0, den, out=np.zeros_like(den), where=den != 0)
            gains.append(scale[row_of] if w is None else w * scale[row_of])
        else:
            gains.append(np.ones(row_of.shape[0]) if w is None else w)
        ids = c.ids.astype(np.int64)
        shard = row_layout.shard_of(table, ids)
        keys.append((d * N + shard) * S + row_layout.block_row(table, ids))
    key, orow, gain = (x[0] if len(x) == 1 else np.concatenate(x) for x in (keys, orows, gains))
    n = key.shape[0]
    ibits = bits_needed(n - 1)
    if bits_needed(D * N * S - 1) + ibits <= 63:
        packed = (key << ibits) | np.arange(n, dtype=np.int64)
        packed.sort()
        idx = packed & ((1 << ibits) - 1)
        key = packed >> ibits
    else:
        idx = np.argsort(key, kind="stable")
        key = key[idx]
    orow = orow[idx]
    gain = gain[idx]
    new_u = np.ones(n, bool)
    new_u[1:] = key[1:] != key[:-1]
    new_p = new_u.copy()
    new_p[1:] |= orow[1:] != orow[:-1]
    pstart = np.flatnonzero(new_p)
    DN = D * N
    pair_key = key[pstart]
    ukey = key[new_u]
    u_part = ukey // S
    p_part = pair_key // S
    u_cnt = np.bincount(u_part, minlength=DN)
    p_cnt = np.bincount(p_part, minlength=DN)
    u_first = np.cumsum(u_cnt) - u_cnt
    p_first = np.cumsum(p_cnt) - p_cnt
    return dict(
        u_part=u_part,
        u_row=table.local_row_offset + ukey - u_part * S,
        u_rank=np.arange(ukey.shape[0]) - u_first[u_part],
        p_part=p_part,
        p_rank=np.arange(pstart.shape[0]) - p_first[p_part],
        p_urank=np.cumsum(new_u)[pstart] - 1 - u_first[p_part],
        p_first=new_u[pstart],
        p_orow=orow[pstart],
        p_gain=np.add.reduceat(gain, pstart) if n else np.zeros(0),
        p_entries=np.diff(np.append(pstart, n)),
        u_cnt=u_cnt,
        p_cnt=p_cnt,
    )


def fill(D: int, N: int, cap, rows_per_device: int, sorted_tables: list):
    """One stack's arrays at capacity `cap` from its tables' `sort_table` results
    (in stack row order; None for a table without features).

    Returns `(arrays, unique totals [D, N], pair totals [D, N], dropped entries)`,
    `arrays` in `PartitionedCsrFormatTensor` field order.
    """
    U, P = cap.max_unique_ids_per_partition, cap.max_ids_per_partition
    DN = D * N
    unique_ids = np.full((DN, U), PAD_ID, np.int32)
    pair_rows = np.full((DN, P), rows_per_device, np.int32)
    pair_unique = np.zeros((DN, P), np.int32)
    pair_gains = np.zeros((DN, P), np.float32)
    u_tot = np.zeros(DN, np.int64)
    p_tot = np.zeros(DN, np.int64)
    u_kept = np.zeros(DN, np.int64)
    p_kept = np.zeros(DN, np.int64)
    dropped = 0
    for tt in sorted_tables:
        if tt is None:
            continue
        u_ord = u_tot[tt["u_part"]] + tt["u_rank"]
        q_ord = p_tot[tt["p_part"]] + tt["p_rank"]
        pu_ord = u_tot[tt["p_part"]] + tt["p_urank"]
        keep_p = (pu_ord < U) & (q_ord < P)
        keep_u = (u_ord < U) & (q_ord[tt["p_first"]] < P)
        dropped += int(tt["p_entries"][~keep_p].sum())
        up, uo = tt["u_part"][keep_u], u_ord[keep_u]
        unique_ids[up, uo] = tt["u_row"][keep_u]
        kp, kq = tt["p_part"][keep_p], q_ord[keep_p]
        pair_rows[kp, kq] = tt["p_orow"][keep_p]
        pair_unique[kp, kq] = pu_ord[keep_p]
        pair_gains[kp, kq] = tt["p_gain"][keep_p]
        u_kept += np.bincount(up, minlength=DN)
        p_kept += np.bincount(kp, minlength=DN)
        u_tot += tt["u_cnt"]
        p_tot += tt["p_cnt"]
    arrays = (
        unique_ids.reshape(D, N, U),
        u_kept.astype(np.int32).reshape(D, N),
        pair_rows.reshape(D, N, P),
        pair_unique.reshape(D, N, P),
        pair_gains.reshape(D, N, P),
        p_kept.astype(np.int32).reshape(D, N),
    )
    return arrays, u_tot.reshape(D, N), p_tot.reshape(D, N), dropped
