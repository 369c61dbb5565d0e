"""Replicas (data_parallel) over N > 1 devices: every device holds the whole stack.

Preprocessing sends a replicated table's ids to its canonical shard (0), so a device's
batch is all in partition 0 of its arrays, as local rows: the lookup reads the device's
own replica (no exchange), and the update sends every device's distinct ids and their
gradient sums to every other, where each replica merges the N lists (in device order,
the same on every device) and applies the result: each row updated once with its sum
over the global batch, as the row exchange does, and the replicas stay equal
(`ops.backward_update_sharded(replicated=True)`, one fused op where a kernel takes it;
for optimizers that move every row, a dense gradient).

Bytes a device sends a step: nothing in the lookup; U ids and U gradient rows to each
of its N - 1 peers in the update. (The cost model's dense all-reduce variant is not
built.)
"""

from __future__ import annotations

import jax.numpy as jnp

from embedmesh.device import ops, shard_program
from embedmesh.device.shard_program import ShardBatch
from embedmesh.device.strategies import rows
from embedmesh.device.strategies.base import Strategy, register

__all__ = ["DataParallel"]


@register
class DataParallel(Strategy):
    """A replica on every device, looked up in place, updated from every device's ids."""

    name = "data_parallel"
    holds_raw_ids = False  # every replica would need every id's row: not built

    def exchange_bytes(self, csr, *, carrying: bool = True) -> int:
        return (self.transport.num_shards - 1) * rows.row_bytes(csr, self.spec.dim)

    def lookup(self, table, batch: ShardBatch, *, carry: bool = False) -> tuple:
        return shard_program.lookup_local(
            table, batch.first_partition(), self.spec.quantization, self.spec.lookup_columns
        ), None

    def update(
        self, table, slots: dict, batch: ShardBatch, act_grads, *, step, keep=None, view=None
    ) -> tuple:
        """The per-id gradient sums [U, D] of this device's partition 0 and its ids go to
        every device (an all-gather); each replica merges them in device order and
        applies the optimizer to the distinct rows (every row, for optimizers that move
        them all). `keep` False: no row moves."""
        opt, transport = self.optimizer, self.transport.at("update", "replicated")
        if not opt.touches_all_rows:
            first = batch.first_partition()
            return ops.backward_update_sharded(
                opt,
                table,
                slots,
                first.unique_ids,
                act_grads,
                first.pair_rows,
                first.pair_unique,
                first.pair_gains,
                True if keep is None else keep,
                step,
                transport,
                replicated=True,
            )
        n, u = transport.num_shards, batch.unique_capacity
        part = batch._replace(
            pair_rows=batch.pair_rows[:1],
            pair_unique=batch.pair_unique[:1],
            pair_gains=batch.pair_gains[:1],
            pairs_by_row=None,
        )
        per_unique = shard_program.per_unique_sums(act_grads, part)
        all_ids = ops.exchange(jnp.broadcast_to(batch.unique_ids[:1], (n, u)), transport.at("ids"))
        gathered = jnp.broadcast_to(per_unique[None], (n,) + per_unique.shape)
        grads = ops.exchange(shard_program.after(gathered, all_ids), transport.at("grads"))
        return shard_program.merge_and_apply(table, slots, all_ids, grads, keep, opt, step)
