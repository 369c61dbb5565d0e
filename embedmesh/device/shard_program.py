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
    per_unique = _per_unique_sums(act_grads, pair_rows, pair_unique, pair_gains, unique_capacity)
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
    return _merge_and_apply(table_shard, slots, served_ids, grads, keep, optimizer, step)


def _per_unique_sums(act_grads, pair_rows, pair_unique, pair_gains, unique_capacity: int):
    """[N * U, D]: the gradient sums of the distinct ids of each of the N partitions."""
    return ops.segment_gather_sum(
        act_grads.astype(jnp.float32),
        pair_rows.reshape(-1),
        pair_gains.reshape(-1),
        ops.slot_index(pair_unique, unique_capacity),
        pair_rows.shape[0] * unique_capacity,
    )


def _merge_and_apply(table_shard, slots, ids, grads, keep, optimizer, step):
    """Merge the received lists (`ids` [N, U], `grads` [N, U, D]; `keep` False: none)
    and apply the optimizer once per distinct row (every row for optimizers that move
    them all)."""
    if keep is not None:
        ids = jnp.where(keep, ids, PAD_ID)
    uniq, g_sum = ops.dedup_sum(ids, grads.reshape(ids.size, -1))
    if optimizer.touches_all_rows:
        return _dense_update(table_shard, slots, uniq, g_sum, optimizer, step)
    return ops.sparse_update(optimizer, table_shard, slots, uniq, g_sum, step)


def _dense_update(table_shard, slots, uniq, g_sum, optimizer, step):
    """Every row moves (non-lazy Adam): O(shard) work, by the user's choice."""
    dense_g = jnp.zeros(table_shard.shape, jnp.float32).at[uniq].add(g_sum, mode="drop")
    new_rows, new_slots = optimizer.update_rows(table_shard, dict(slots), dense_g, step)
    return (
        new_rows.astype(table_shard.dtype),
        {k: new_slots[k].astype(v.dtype) for k, v in slots.items()},
    )


# ---------------------------------------------------------------------------
# Replicated tables (data_parallel): every device holds the whole table
#
# Preprocessing sends a replicated table's ids to its canonical shard (0), so a
# device's batch is all in partition 0 of its arrays, as local rows: the lookup reads
# the device's own replica (no exchange), and the update sends every device's
# distinct ids and their gradient sums to every other, where each replica merges
# the N lists (in device order, the same on every device) and applies the result:
# each row updated once with its sum over the global batch, as mod sharding does,
# and the replicas stay equal.


def lookup_replicated(
    table_shard, unique_ids, pair_rows, pair_unique, pair_gains, *, num_rows, **_peers
):
    """Activation rows [R, D] (float32) of this device from its own replica."""
    return lookup(
        table_shard,
        unique_ids[:1],
        pair_rows[:1],
        pair_unique[:1],
        pair_gains[:1],
        num_rows=num_rows,
    )


def update_replicated(
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
    axis_name,
    num_shards: int,
    keep=None,
    in_process: bool = False,
    host_job: int = 0,
    channel: str = "",
):
    """The update of this device's replica from every device's batch: the per-id
    gradient sums [U, D] of this device's partition 0 and its ids go to every device
    (an all-gather), each replica merges them in device order and applies the optimizer
    to the distinct rows: `ops.backward_update_sharded(replicated=True)`, one fused op
    where a kernel takes it (every row, for optimizers that move them all). `keep`
    False: no row moves."""
    n, u = num_shards, unique_capacity
    peers = dict(in_process=in_process, host_job=host_job)
    if not optimizer.touches_all_rows:
        return ops.backward_update_sharded(
            optimizer,
            table_shard,
            slots,
            unique_ids[:1],
            act_grads,
            pair_rows[:1],
            pair_unique[:1],
            pair_gains[:1],
            True if keep is None else keep,
            step,
            axis_name,
            n,
            channel=channel + "/update/replicated",
            replicated=True,
            **peers,
        )
    per_unique = _per_unique_sums(act_grads, pair_rows[:1], pair_unique[:1], pair_gains[:1], u)
    exchange_to = _exchanger(axis_name, n, in_process, host_job, channel + "/update/replicated")
    all_ids = exchange_to(jnp.broadcast_to(unique_ids[:1], (n, u)), "ids")
    grads = exchange_to(
        after(jnp.broadcast_to(per_unique[None], (n,) + per_unique.shape), all_ids), "grads"
    )
    return _merge_and_apply(table_shard, slots, all_ids, grads, keep, optimizer, step)


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


class PooledRows:
    """Which activation rows of a source's [R, D] buffer each shard's tables feed.

    Static for a stack's batch layout: `rows[o]` [Rc] the rows shard o feeds
    (padded with R), `compact[o]` [R + 1] each row's position among them (Rc where
    o feeds none; at position R, the pad row, too). `None` maps: every shard feeds
    every row (mod placement of big tables), so Rc = R and no row is picked.
    `runs[o]`: the same rows as `(first row, count)` runs in block order, so a block is
    a concatenation of slices (no gather); `one_owner`: every row is fed by exactly
    one shard (table-wise placement), so the activations are the blocks' slices.
    """

    def __init__(self, num_rows: int, owners_of_segments, num_shards: int):
        """`owners_of_segments`: `[(first row, rows, shards feeding them), ...]`."""
        n, r = int(num_shards), int(num_rows)
        per_owner: list = [[] for _ in range(n)]
        self.runs: list = [[] for _ in range(n)]
        feeders = np.zeros(r + 1, np.int64)
        for first, count, owners in owners_of_segments:
            feeders[first : first + count] += len(owners)
            for o in owners:
                per_owner[o].append(np.arange(first, first + count))
                if count:
                    self.runs[o].append((int(first), int(count)))
        self.one_owner = bool(np.all(feeders[:r] == 1))
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


def after(x, previous):
    """`x`, made to depend on `previous` without changing it: two exchanges of one program
    then run in one order on every device. Independent exchanges can start in different
    orders on different devices (XLA's CPU runtime runs ready work as it comes), and each
    blocks until its peers arrive at the same one. The test is true unless `previous`'s
    first element has one particular bit pattern no conversion or arithmetic produces."""
    if previous is None or previous.size == 0:
        return x
    first = previous.reshape(-1)[0].astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(first, jnp.int32)
    return jnp.where(bits == jnp.int32(-1), x + 1, x)


def serve_pairs(unique_ids, pair_rows, pair_unique, pair_gains, pooled, channel, **peers):
    """The owners' view of a batch: the messages [N, U + P * k] of every source for this
    owner (`ops.exchange_pooled_pairs`: the ids each asks of it, and its pairs, each with
    its id's position, its row among the `pooled.width` rows this owner feeds, its gain;
    8 bytes a pair where position and row fit one int32, else 12). `peers`: where the
    devices are (`ops.exchange`'s arguments)."""
    n = unique_ids.shape[0]
    compact = (
        jnp.asarray(pooled.compact) if pooled.compact is not None else jnp.zeros((n, 0), jnp.int32)
    )
    return ops.exchange_pooled_pairs(
        unique_ids,
        pair_rows,
        pair_unique,
        pair_gains,
        compact,
        width=pooled.width,
        channel=channel,
        **peers,
    )


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
    carry: bool = False,
):
    """Activation rows [R, D] (float32) of this device, pooled on the owners: each owner
    combines every source's pairs from its rows into [Rc, D] partial sums
    (`ops.exchange_pooled_partials`), which come back and are summed per row (in shard
    order).
    With `carry`, also the owners' view this device received (`serve_pairs`), which
    `update_shard_pooled` takes instead of sending the pairs again."""
    n = num_shards
    rc, d = pooled.width, table_shard.shape[-1]
    u = unique_ids.shape[1]
    peers = dict(axis_name=axis_name, num_shards=n, in_process=in_process, host_job=host_job)
    at = channel + "/lookup/pooled"
    served = serve_pairs(
        unique_ids, pair_rows, pair_unique, pair_gains, pooled, at + "/pairs", **peers
    )
    back = ops.exchange_pooled_partials(
        table_shard, served, unique_capacity=u, width=rc, channel=at + "/partials", **peers
    )
    if pooled.rows is None:
        act = jnp.sum(back.reshape(n, rc, d), axis=0)
    elif pooled.one_owner:  # each row from its one owner's block: slices, no sums
        pieces = []
        for o, runs in enumerate(pooled.runs):
            at = o * rc
            for first, count in runs:
                pieces.append((first, back[at : at + count]))
                at += count
        pieces.sort(key=lambda piece: piece[0])
        act = jnp.concatenate([x for _, x in pieces], axis=0)
    else:
        act = ops.segment_gather_sum(
            back,
            jnp.arange(n * rc, dtype=jnp.int32),
            jnp.ones((n * rc,), jnp.float32),
            jnp.asarray(pooled.rows).reshape(-1),
            pooled.num_rows,
        )
    return (act, served) if carry else act


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
    served=None,
):
    """`update_shard` with the backward on the owners: each source sends every owner the
    gradients of the [Rc] rows it feeds, and each owner applies them over its sources'
    pairs as one fused backward + update (`ops.exchange_pooled_backward_update`). `served`: the
    owners' view carried from this batch's `lookup_pooled(carry=True)`; without it the
    pairs travel again first. Sparse optimizers only."""
    n = num_shards
    rc, d = pooled.width, act_grads.shape[-1]
    u = unique_ids.shape[1]
    peers = dict(axis_name=axis_name, num_shards=n, in_process=in_process, host_job=host_job)
    at = channel + "/update/pooled"
    g = act_grads.astype(jnp.float32)
    if pooled.rows is None:
        g = jnp.broadcast_to(g[None], (n,) + g.shape)
    else:  # each owner's rows: slices of the gradients, zeros past them
        blocks = []
        for runs in pooled.runs:
            parts = [g[first : first + count] for first, count in runs]
            fill = rc - sum(count for _, count in runs)
            blocks.append(jnp.concatenate(parts + [jnp.zeros((fill, d), g.dtype)], axis=0))
        g = jnp.stack(blocks)
    # (the order of exchanges made on the message itself, so that it fuses into its copy)
    if served is None:
        served = serve_pairs(
            unique_ids, pair_rows, pair_unique, pair_gains, pooled, at + "/pairs", **peers
        )
        g = after(g, served)  # the pairs' exchange first, on every device
    else:  # after what `unique_ids` waits for (the caller's previous exchanges)
        g = after(g, unique_ids)
    return ops.exchange_pooled_backward_update(
        optimizer,
        table_shard,
        slots,
        served,
        g,
        True if keep is None else keep,
        step,
        unique_capacity=u,
        width=rc,
        channel=at + "/grads",
        **peers,
    )
