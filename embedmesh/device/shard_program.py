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

import jax.numpy as jnp

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
