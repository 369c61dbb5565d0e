"""The row exchange over N > 1 devices: each device asks the owners for the rows of its
distinct ids and sends them the gradient sums back (TPUEmbeddingV2's mod sharding,
`row_wise_rows`; any placement whose stack exchanges rows).

Lookup: this device's distinct ids go to the shards that hold them, the owners send the
rows back, and the device combines its pairs (`ops.lookup_from_shards`; in-process CPU
devices read each other's tables in place: no [N, U, D] buffer). Update: the per-id
gradient sums go to the owners with the ids, each owner merges its N lists and applies
the optimizer once per distinct row (`ops.backward_update_sharded`, one fused op where a
kernel takes it); optimizers that move every row get a dense gradient.

Bytes a device sends a step: U ids and U rows in the lookup, U ids and U gradient rows
in the update, to each of its N - 1 peers.
"""

from __future__ import annotations

from embedmesh.device import ops, shard_program
from embedmesh.device.shard_program import ShardBatch
from embedmesh.device.strategies.base import Strategy, register

__all__ = ["RowExchange", "row_bytes", "update"]


def row_bytes(csr, dim: int) -> int:
    """Bytes of one partition's distinct ids and one row (or gradient row) each."""
    return int(csr.unique_ids.shape[-1]) * (4 + 4 * dim)


def update(table, slots: dict, batch: ShardBatch, act_grads, optimizer, step, keep, transport):
    """The owners' update from every device's per-id gradient sums (`transport`'s channel
    at "update"; at "dense" for optimizers that move every row). Returns (new table
    shard, new slots)."""
    if optimizer.touches_all_rows:  # every row moves (non-lazy Adam): a dense gradient
        return shard_program.dense_exchange_update(
            table, slots, batch, act_grads, keep, optimizer, step, transport
        )
    return ops.backward_update_sharded(
        optimizer,
        table,
        slots,
        batch.unique_ids,
        act_grads,
        batch.pair_rows,
        batch.pair_unique,
        batch.pair_gains,
        True if keep is None else keep,
        step,
        transport.at("update"),
    )


@register
class RowExchange(Strategy):
    """Rows to the sources, gradient sums to the owners."""

    name = "rows"

    def exchange_bytes(self, csr, *, carrying: bool = True) -> int:
        rows = row_bytes(csr, self.spec.dim)
        return (self.transport.num_shards - 1) * (rows + rows)

    def lookup(self, table, batch: ShardBatch, *, carry: bool = False) -> tuple:
        act = ops.lookup_from_shards(
            table,
            batch.unique_ids,
            batch.pair_unique,
            batch.pair_gains,
            batch.pair_rows,
            batch.num_rows,
            self.transport.at("lookup"),
            quantization=self.spec.quantization,
            columns=self.spec.lookup_columns,
            dst_order=batch.row_order_hint(),
        )
        return act, None

    def update(
        self, table, slots: dict, batch: ShardBatch, act_grads, *, step, keep=None, view=None
    ) -> tuple:
        return update(table, slots, batch, act_grads, self.optimizer, step, keep, self.transport)
