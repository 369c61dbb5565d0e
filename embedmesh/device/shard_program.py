"""Per-device sparse programs for one stack: lookup, gradient, fused update.

These run inside `shard_map` over the mesh axis that shards the tables (or
plainly on one device). Each device owns one shard of the stacked table and
is the source of one slice of the batch. Shapes (N shards, U unique ids per
partition, P ids per partition, R activation rows per device, D dim):

    unique_ids [N, U]   rows this device needs from each shard (pad: PAD_ID)
    pair_rows  [N, P]   output row of each (row, id) pair (pad: R)
    pair_unique[N, P]   position of its id in unique_ids[j]
    pair_gains [N, P]   combiner weight of the pair (pad: 0)

Padding is inert by construction: PAD_ID is out of range for every shard, so
gathers read zeros (`mode="fill"`) and scatters skip it (`mode="drop"`); pad
pairs point at row R, which `segment_sum` drops. No array of a table's size is
created: only [N*U, D] and [R, D] buffers.

The row moves (gathers, gather-scale-segment-sums, the owner's dedup, the
in-place update, and on one shard the whole backward + update as one op) are
the ops of `embedmesh.device.ops`, which picks a kernel for each (the C++
kernels on CPU, 3-8x faster than XLA's own gather and scatter) or runs its
pure-JAX reference, with the same semantics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh._runtime import PAD_ID
from embedmesh.device import ops


def exchange(x, axis_name, num_shards: int, in_process: bool = False, host_job=0, channel=""):
    """Block j of axis 0 goes to device j; block s of the result came from device s.
    `in_process`, `host_job`, `channel`: where the devices are and the call's name
    (`ops.exchange`)."""
    return ops.exchange(
        x, axis_name, num_shards, in_process=in_process, host_job=host_job, channel=channel
    )


def gather_shard_rows(table_shard, ids):
    """Rows of this shard for `ids` of any shape (PAD_ID reads zeros)."""
    flat = ops.gather_rows(table_shard, ids.reshape(-1))
    return flat.reshape(ids.shape + (table_shard.shape[-1],))


def lookup(
    table_shard,
    unique_ids,
    pair_rows,
    pair_unique,
    pair_gains,
    *,
    num_rows: int,
    axis_name=None,
    num_shards: int = 1,
    in_process: bool = False,
    host_job: int = 0,
    channel: str = "",
):
    """Activation rows [R, D] (float32) of this device. `channel`: this call's name,
    the same in every process (the stack's), for exchanges between processes."""
    if num_shards == 1:  # combine straight from the table: no [U, D] buffer
        return ops.segment_gather_sum(
            table_shard,
            pair_unique.reshape(-1),
            pair_gains.reshape(-1),
            pair_rows.reshape(-1),
            num_rows,
            src_map=unique_ids.reshape(-1),
        )
    return ops.lookup_from_shards(
        table_shard,
        unique_ids,
        pair_unique,
        pair_gains,
        pair_rows,
        num_rows,
        axis_name,
        num_shards,
        in_process=in_process,
        host_job=host_job,
        channel=channel + "/lookup",
    )


def update_shard(
    table_shard,
    slots: dict,
    unique_ids,
    act_grads,
    pair_rows,
    pair_unique,
    pair_gains,
    optimizer,
    step,
    *,
    unique_capacity: int,
    axis_name=None,
    num_shards: int = 1,
    keep=None,
    in_process: bool = False,
    host_job: int = 0,
    channel: str = "",
):
    """The whole training update of this shard from this device's activation gradients.

    `unique_ids`, `pair_*` are this device's batch (as for `lookup`),
    `act_grads` [R, D] the gradients of its activation rows. Unless the
    optimizer moves every row, that is one op: `ops.backward_update` on a single
    shard, `ops.backward_update_sharded` on N (per-unique gradient sums sent to
    the owners with the ids, merged, applied once per row; fused where a kernel
    can: no [U, D] or [N, U, D] gradient buffer). `keep`: a traced bool, False
    turns every id into padding, so no row moves. Returns (new table shard, new
    slots).
    """
    if not optimizer.touches_all_rows:
        if num_shards == 1:
            ids = unique_ids if keep is None else jnp.where(keep, unique_ids, PAD_ID)
            return ops.backward_update(
                optimizer,
                table_shard,
                slots,
                ids,
                act_grads,
                pair_rows,
                pair_unique,
                pair_gains,
                step,
            )
        return ops.backward_update_sharded(
            optimizer,
            table_shard,
            slots,
            unique_ids,
            act_grads,
            pair_rows,
            pair_unique,
            pair_gains,
            True if keep is None else keep,
            step,
            axis_name,
            num_shards,
            in_process=in_process,
            host_job=host_job,
            channel=channel + "/update",
        )
    # Every row moves (non-lazy Adam): the per-unique sums, merged on the owner, scattered
    # into a dense gradient.
    n = pair_rows.shape[0]
    per_unique = ops.segment_gather_sum(
        act_grads.astype(jnp.float32),
        pair_rows.reshape(-1),
        pair_gains.reshape(-1),
        ops.slot_index(pair_unique, unique_capacity),
        n * unique_capacity,
    )
    peers = dict(in_process=in_process, host_job=host_job)
    grads = exchange(
        per_unique.reshape(n, unique_capacity, -1),
        axis_name,
        num_shards,
        channel=channel + "/dense/grads",
        **peers,
    )
    served_ids = exchange(
        unique_ids, axis_name, num_shards, channel=channel + "/dense/ids", **peers
    )
    if keep is not None:
        served_ids = jnp.where(keep, served_ids, PAD_ID)
    uniq, g_sum = ops.dedup_sum(served_ids, grads.reshape(served_ids.size, -1))
    return _dense_update(table_shard, slots, uniq, g_sum, optimizer, step)


def _dense_update(table_shard, slots, uniq, g_sum, optimizer, step):
    """Every row moves (non-lazy Adam): O(shard) work, by the user's choice."""
    dense_g = jnp.zeros(table_shard.shape, jnp.float32).at[uniq].add(g_sum, mode="drop")
    new_rows, new_slots = optimizer.update_rows(table_shard, dict(slots), dense_g, step)
    return (
        new_rows.astype(table_shard.dtype),
        {k: new_slots[k].astype(v.dtype) for k, v in slots.items()},
    )


# ---------------------------------------------------------------------------
# Pooling on the owner: exchange partial sums of activations, not rows
#
# Each owner combines, for every source device, the pairs whose ids it holds into
# partial activations of that source's rows and sends those back, where the row
# exchange sends one row per distinct id. It moves fewer bytes when the rows of a
# source that an owner feeds (`Rc` of them) are fewer than its distinct ids there
# (`U`): multi-hot features, and table-wise placement, where an owner feeds only
# the rows of its own tables' features (`PooledRows`). The owner needs the
# sources' pairs for it (8 bytes a pair: its id's slot and its compact row, its gain).


PACK_LIMIT = 2**31  # a pair's position and row share one int32 below this


class PooledRows:
    """Which activation rows of a source's [R, D] buffer each shard's tables feed.

    Static for a stack's batch layout: `rows[o]` [Rc] the rows shard o feeds
    (padded with R), `compact[o]` [R + 1] each row's position among them (Rc where
    o feeds none; at position R, the pad row, too). `None` maps: every shard feeds
    every row (mod placement of big tables), so Rc = R and no row is picked.
    """

    def __init__(self, num_rows: int, owners_of_segments, num_shards: int):
        """`owners_of_segments`: `[(first row, rows, shards feeding them), ...]`."""
        n, r = int(num_shards), int(num_rows)
        per_owner: list = [[] for _ in range(n)]
        for first, count, owners in owners_of_segments:
            for o in owners:
                per_owner[o].append(np.arange(first, first + count))
        self.num_rows = r
        self.rows: np.ndarray | None = None
        self.compact: np.ndarray | None = None
        self.width = r
        if all(sum(len(a) for a in p) == r for p in per_owner):
            return
        lists = [np.concatenate(p) if p else np.zeros(0, np.int64) for p in per_owner]
        width = max(1, max(len(x) for x in lists))
        rows = np.full((n, width), r, np.int32)
        compact = np.full((n, r + 1), width, np.int32)
        for o, x in enumerate(lists):
            rows[o, : len(x)] = x
            compact[o, x] = np.arange(len(x))
        self.rows, self.compact, self.width = rows, compact, width


def _serve_pairs(unique_ids, pair_rows, pair_unique, pair_gains, pooled, exchange_to, extra=None):
    """Every source's pairs for this owner: (ids [N, U], each pair's slot [N*P] in them,
    its row [N*P] in the sources' stacked Rc-row blocks (invalid: N * Rc), gains [N*P],
    and `extra` [N, ...] float32 as received, or None).

    One exchange carries the ids, the pairs and `extra` (one message a peer, so that
    every device's exchanges come in one order: two independent exchanges of one
    program may start in different orders on different devices, and block each
    other). A pair travels as 8 bytes (its id's position and its row in one int32,
    exact while (U + 1) * (Rc + 1) < 2**31, and its gain), else 12."""
    n, u = unique_ids.shape
    p = pair_rows.shape[1]
    rc = pooled.width
    rows = jnp.clip(pair_rows, 0, pooled.num_rows)
    if pooled.compact is not None:
        rows = jnp.take_along_axis(jnp.asarray(pooled.compact), rows, axis=1)
    rows = rows.astype(jnp.int32)  # in [0, Rc]: Rc is "none"
    position = jnp.clip(pair_unique, 0, u).astype(jnp.int32)  # in [0, U]: U is "none"
    gains = jax.lax.bitcast_convert_type(pair_gains.astype(jnp.float32), jnp.int32)
    packs = (u + 1) * (rc + 1) < PACK_LIMIT
    fields = [position * (rc + 1) + rows] if packs else [position, rows]
    k = len(fields) + 1
    parts = [unique_ids.astype(jnp.int32), jnp.stack(fields + [gains], axis=-1).reshape(n, p * k)]
    if extra is not None:
        parts.append(
            jax.lax.bitcast_convert_type(extra.astype(jnp.float32), jnp.int32).reshape(n, -1)
        )
    served = exchange_to(jnp.concatenate(parts, axis=1), "pairs")
    ids = served[:, :u]
    pairs = served[:, u : u + p * k].reshape(n, p, k)
    got = None
    if extra is not None:
        got = jax.lax.bitcast_convert_type(served[:, u + p * k :], jnp.float32)
        got = got.reshape(extra.shape)
    if packs:
        position, src = pairs[..., 0] // (rc + 1), pairs[..., 0] % (rc + 1)
    else:
        position, src = pairs[..., 0], pairs[..., 1]
    slot = ops.slot_index(position, u)
    row = jnp.where(src < rc, jnp.arange(n, dtype=jnp.int32)[:, None] * rc + src, n * rc)
    gains = jax.lax.bitcast_convert_type(pairs[..., -1], jnp.float32)
    return ids, slot, row.reshape(-1), gains.reshape(-1), got


def _exchanger(axis_name, num_shards, in_process, host_job, channel):
    def exchange_to(x, what):
        return exchange(x, axis_name, num_shards, in_process, host_job, f"{channel}/{what}")

    return exchange_to


def lookup_pooled(
    table_shard,
    unique_ids,
    pair_rows,
    pair_unique,
    pair_gains,
    pooled: PooledRows,
    *,
    axis_name,
    num_shards: int,
    in_process: bool = False,
    host_job: int = 0,
    channel: str = "",
):
    """Activation rows [R, D] (float32) of this device, pooled on the owners: each owner
    combines every source's pairs from its rows into [Rc, D] partial sums, which come
    back and are summed per row (in shard order)."""
    n = num_shards
    rc, d = pooled.width, table_shard.shape[-1]
    exchange_to = _exchanger(axis_name, n, in_process, host_job, channel + "/lookup/pooled")
    ids, slot, row, gains, _ = _serve_pairs(
        unique_ids, pair_rows, pair_unique, pair_gains, pooled, exchange_to
    )
    partial = ops.segment_gather_sum(table_shard, slot, gains, row, n * rc, src_map=ids.reshape(-1))
    back = exchange_to(partial.reshape(n, rc, d), "partials")
    if pooled.rows is None:
        return jnp.sum(back, axis=0)
    out = jnp.zeros((pooled.num_rows + 1, d), jnp.float32)
    out = out.at[jnp.asarray(pooled.rows).reshape(-1)].add(back.reshape(n * rc, d))
    return out[: pooled.num_rows]


def update_shard_pooled(
    table_shard,
    slots: dict,
    unique_ids,
    act_grads,
    pair_rows,
    pair_unique,
    pair_gains,
    pooled: PooledRows,
    optimizer,
    step,
    *,
    axis_name,
    num_shards: int,
    keep=None,
    in_process: bool = False,
    host_job: int = 0,
    channel: str = "",
):
    """`update_shard` with the backward on the owners: each source sends every owner the
    gradients of the [Rc] rows it feeds, the owner sums them per distinct id over every
    source's pairs (`segment_gather_sum`), merges the sources (`dedup_sum`) and applies
    the optimizer (`sparse_update`). Sparse optimizers only."""
    n = num_shards
    rc, d = pooled.width, act_grads.shape[-1]
    u = unique_ids.shape[1]
    exchange_to = _exchanger(axis_name, n, in_process, host_job, channel + "/update/pooled")
    g = act_grads.astype(jnp.float32)
    if pooled.rows is None:
        g = jnp.broadcast_to(g[None], (n,) + g.shape)
    else:
        g = jnp.concatenate([g, jnp.zeros((1, d), jnp.float32)])[jnp.asarray(pooled.rows)]
    ids, slot, row, gains, received = _serve_pairs(
        unique_ids, pair_rows, pair_unique, pair_gains, pooled, exchange_to, extra=g
    )
    received = received.reshape(n * rc, d)
    per_unique = ops.segment_gather_sum(received, row, gains, slot, n * u)
    if keep is not None:
        ids = jnp.where(keep, ids, PAD_ID)
    uniq, g_sum = ops.dedup_sum(ids, per_unique)
    return ops.sparse_update(optimizer, table_shard, slots, uniq, g_sum, step)
