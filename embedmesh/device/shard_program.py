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


def exchange(x, axis_name, num_shards: int, in_process: bool = False):
    """Block j of axis 0 goes to device j; block s of the result came from device s.
    `in_process`: every device of the mesh is in this process (`ops.exchange`)."""
    return ops.exchange(x, axis_name, num_shards, in_process=in_process)


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
):
    """Activation rows [R, D] (float32) of this device."""
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
):
    """The whole training update of this shard from this device's activation gradients.

    `unique_ids`, `pair_*` are this device's batch (as for `lookup`),
    `act_grads` [R, D] the gradients of its activation rows. The gradients
    are summed per unique id (`backward`), sent to the owners with the ids
    (`exchange`), and each owner updates its distinct rows once
    (`owner_update`); unless the optimizer moves every row, that is one op,
    `ops.backward_update` on a single shard and `ops.backward_update_sharded`
    on N (fused where a kernel can: no [U, D] or [N, U, D] gradient buffer).
    `keep`: a traced bool, False turns every served id into padding, so no row
    moves. Returns (new table shard, new slots).
    """
    if num_shards > 1 and not optimizer.touches_all_rows:
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
        )
    one_op = num_shards == 1 and not optimizer.touches_all_rows
    if not one_op:
        grads = backward(
            act_grads,
            pair_rows,
            pair_unique,
            pair_gains,
            unique_capacity=unique_capacity,
            axis_name=axis_name,
            num_shards=num_shards,
            in_process=in_process,
        )
    served_ids = exchange(unique_ids, axis_name, num_shards, in_process)
    if keep is not None:
        served_ids = jnp.where(keep, served_ids, PAD_ID)
    if one_op:
        return ops.backward_update(
            optimizer,
            table_shard,
            slots,
            served_ids,
            act_grads,
            pair_rows,
            pair_unique,
            pair_gains,
            step,
        )
    return owner_update(table_shard, slots, served_ids, grads, optimizer, step)


def backward(
    act_grads,
    pair_rows,
    pair_unique,
    pair_gains,
    *,
    unique_capacity: int,
    axis_name=None,
    num_shards: int = 1,
    in_process: bool = False,
):
    """Gradients of this device's activations, summed per unique id and sent to
    the owners: returns [N, U, D], block s holding what source s sends this shard.
    """
    n, _ = pair_rows.shape
    flat_index = (jnp.arange(n, dtype=jnp.int32)[:, None] * unique_capacity + pair_unique).reshape(
        -1
    )
    per_unique = ops.segment_gather_sum(
        act_grads.astype(jnp.float32),
        pair_rows.reshape(-1),
        pair_gains.reshape(-1),
        flat_index,
        n * unique_capacity,
    )
    per_unique = per_unique.reshape(n, unique_capacity, -1)
    return exchange(per_unique, axis_name, num_shards, in_process)


def owner_update(table_shard, slots: dict, served_ids, grads, optimizer, step):
    """Sum the gradients of each distinct row over all sources, update it once.

    served_ids [N, U] and grads [N, U, D] are what this shard received.
    Returns (new table shard, new slots); the table and slots are updated in
    place when the caller donates them. The host sends each list ascending and
    distinct, so the owner merges N sorted lists (and, for N == 1, only checks
    the order) instead of sorting; any order stays correct, only slower.
    """
    ids = served_ids.reshape(served_ids.shape[0], -1)
    g = grads.reshape(ids.size, -1)
    uniq, g_sum = ops.dedup_sum(ids, g)
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
