"""One device: the whole stack is local, nothing crosses.

Every placement is this one on a mesh of one device (each table's rows all on shard 0,
a replica is the table itself). The lookup combines the pairs straight from the table;
the update is one fused backward + update (`ops.backward_update`: no [U, D] gradient
buffer), or for optimizers that move every row, the per-id sums scattered into a dense
gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

from embedmesh._runtime import PAD_ID
from embedmesh.device import ops, shard_program
from embedmesh.device.shard_program import ShardBatch
from embedmesh.device.strategies.base import Strategy, register

__all__ = ["SingleDevice"]


@register
class SingleDevice(Strategy):
    """Every stack of a one-device mesh."""

    name = "single_device"

    def exchange_bytes(self, csr, *, carrying: bool = True) -> int:
        return 0

    def lookup(self, table, batch: ShardBatch, *, carry: bool = False) -> tuple:
        return shard_program.lookup_local(
            table, batch, self.spec.quantization, self.spec.lookup_columns
        ), None

    def update(
        self, table, slots: dict, batch: ShardBatch, act_grads, *, step, keep=None, view=None
    ) -> tuple:
        opt = self.optimizer
        if opt.touches_all_rows:
            return shard_program.dense_exchange_update(
                table, slots, batch, act_grads, keep, opt, step, self.transport
            )
        ids = batch.unique_ids if keep is None else jnp.where(keep, batch.unique_ids, PAD_ID)
        return ops.backward_update(
            opt,
            table,
            slots,
            ids,
            act_grads,
            batch.pair_rows,
            batch.pair_unique,
            batch.pair_gains,
            step,
            dst_order=batch.order_by_unique(),
        )
