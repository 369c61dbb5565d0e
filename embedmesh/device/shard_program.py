"""The per-device sparse program's shared pieces; each strategy's own are in `strategies/`.

The programs run inside `shard_map` over the mesh axis that shards the tables (or
plainly on one device). Each device owns one shard of the stacked table and is the
source of one slice of the batch. Shapes (N shards, U unique ids per partition, P ids
per partition, R activation rows per device, D dim), a `ShardBatch`:

    unique_ids [N, U]   rows this device needs from each shard (pad: PAD_ID)
    pair_rows  [N, P]   output row of each (row, id) pair (pad: R)
    pair_unique[N, P]   position of its id in unique_ids[j]
    pair_gains [N, P]   combiner weight of the pair (pad: 0)

Padding is inert by construction: PAD_ID is out of range for every shard, so
gathers read zeros (`mode="fill"`) and scatters skip it (`mode="drop"`); pad
pairs point at row R, which `segment_sum` drops. No array of a table's size is
created: only [N*U, D] and [R, D] buffers.

How a stack's lookup and update cross the devices is its sharding strategy's
(`embedmesh.device.strategies`: one device, the row exchange, pooling on the owners,
replicas); the pieces here are what several of them share: the lookup from a
device's own rows, the ordering of one program's exchanges (`after`), and the dense
update of optimizers that move every row.

The row moves (gathers, gather-scale-segment-sums, the owner's dedup, the
in-place update, and on one shard the whole backward + update as one op) are
the ops of `embedmesh.device.ops`, which picks a kernel for each (the C++
kernels on CPU, 3-8x faster than XLA's own gather and scatter) or runs its
pure-JAX reference, with the same semantics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from embedmesh._runtime import PAD_ID
from embedmesh.device import ops

__all__ = [
    "ShardBatch",
    "after",
    "dense_exchange_update",
    "lookup_local",
    "merge_and_apply",
    "per_unique_sums",
]


class ShardBatch(NamedTuple):
    """One device's batch of one stack inside `shard_map` (the module's shapes):
    `unique_ids` [N, U], `pair_rows`, `pair_unique`, `pair_gains` [N, P]; static:
    `num_rows` (R), the activation rows it fills, and `features`, the feature segments
    filling them (`FeatureSegment`s: which rows each feature's are); `pairs_by_row`
    `(slots, gains, rows)` [N, P] each, or None: the batch's
    (`PartitionedCsrFormatTensor.pairs_by_row`), its pairs again in output-row order, a
    hint of the lookups."""

    unique_ids: Any
    pair_rows: Any
    pair_unique: Any
    pair_gains: Any
    num_rows: int
    features: tuple = ()
    pairs_by_row: Any = None

    @property
    def unique_capacity(self) -> int:
        """U, the distinct ids a partition holds at most."""
        return int(self.unique_ids.shape[-1])

    def first_partition(self) -> ShardBatch:
        """The batch's partition 0 alone ([1, ...] arrays; no `pairs_by_row`: it orders
        every partition's pairs together)."""
        return self._replace(
            unique_ids=self.unique_ids[:1],
            pair_rows=self.pair_rows[:1],
            pair_unique=self.pair_unique[:1],
            pair_gains=self.pair_gains[:1],
            pairs_by_row=None if self.pair_rows.shape[0] > 1 else self.pairs_by_row,
        )

    def row_order_hint(self):
        """The lookups' `dst_order` hint: `pairs_by_row` over the flattened [N * P] pairs
        (`(slots, gains, rows)`), or None."""
        return (
            None if self.pairs_by_row is None else tuple(a.reshape(-1) for a in self.pairs_by_row)
        )

    def order_by_unique(self):
        """The pairs' order by their id's position (the `dst_order` hint of the sums keyed
        by distinct id, a backward's), or None: in one partition the host's order already,
        its padding last, so the empty order (the pairs as they come: nothing gathered);
        several partitions' pairs, flattened, have each one's padding amid the next one's
        pairs."""
        return jnp.zeros((0,), jnp.int32) if self.pair_rows.shape[0] == 1 else None


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


def lookup_local(table_shard, batch: ShardBatch, quantization=None, columns=None):
    """Activation rows [R, D] (float32) combined straight from this device's own rows
    (every id of `batch` is one of them): no [U, D] buffer (`quantization`: the stack's,
    applied to each row read; `columns`: the parameters' where the rows hold slots too)."""
    return ops.segment_gather_sum(
        table_shard,
        batch.pair_unique.reshape(-1),
        batch.pair_gains.reshape(-1),
        batch.pair_rows.reshape(-1),
        batch.num_rows,
        src_map=batch.unique_ids.reshape(-1),
        quantization=quantization,
        columns=columns,
        dst_order=batch.row_order_hint(),
    )


def per_unique_sums(act_grads, batch: ShardBatch):
    """[N * U, D]: the gradient sums of the distinct ids of each of the batch's N
    partitions."""
    pair_rows, unique_capacity = batch.pair_rows, batch.unique_capacity
    return ops.segment_gather_sum(
        act_grads.astype(jnp.float32),
        pair_rows.reshape(-1),
        batch.pair_gains.reshape(-1),
        ops.slot_index(batch.pair_unique, unique_capacity),
        pair_rows.shape[0] * unique_capacity,
        dst_order=batch.order_by_unique(),
    )


def dense_exchange_update(
    table_shard, slots, batch: ShardBatch, act_grads, keep, optimizer, step, transport
):
    """The update when every row moves (non-lazy Adam): the per-unique sums of `batch`
    and its ids sent to their owners (`transport`'s channel at "dense/grads",
    "dense/ids"; on one device nothing crosses), merged there, scattered into a dense
    gradient and applied to every row."""
    n, u = batch.pair_rows.shape[0], batch.unique_capacity
    per_unique = per_unique_sums(act_grads, batch)
    grads = ops.exchange(per_unique.reshape(n, u, -1), transport.at("dense", "grads"))
    served_ids = ops.exchange(batch.unique_ids, transport.at("dense", "ids"))
    return merge_and_apply(table_shard, slots, served_ids, grads, keep, optimizer, step)


def merge_and_apply(table_shard, slots, ids, grads, keep, optimizer, step):
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
    """Every row moves (non-lazy Adam): O(shard) work, by the user's choice. Only valid
    ids reach XLA's scatter (a padding id adds an exact zero row to row 0): on the v5e
    chip XLA's scatter-add put rows of ids past the end into row 0."""
    valid = (uniq >= 0) & (uniq < table_shard.shape[0])
    g_sum = jnp.where(valid[:, None], g_sum.astype(jnp.float32), 0.0)
    shape = (table_shard.shape[0], g_sum.shape[1])  # the parameters' (slots may be in rows)
    dense_g = jnp.zeros(shape, jnp.float32).at[jnp.where(valid, uniq, 0)].add(g_sum)
    if getattr(optimizer, "takes_ids", False):  # stochastic rounding: every row's id
        ids = jnp.arange(table_shard.shape[0], dtype=jnp.int32)
        new_rows, new_slots = optimizer.update_rows(
            table_shard, dict(slots), dense_g, step, ids=ids
        )
    else:
        new_rows, new_slots = optimizer.update_rows(table_shard, dict(slots), dense_g, step)
    return (
        new_rows.astype(table_shard.dtype),
        {k: new_slots[k].astype(v.dtype) for k, v in slots.items()},
    )
