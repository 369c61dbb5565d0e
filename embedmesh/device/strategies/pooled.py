"""Pooling on the owners over N > 1 devices: exchange partial sums of activations, not
rows (`row_wise_pooled`: TorchRec's row-wise; `table_wise`: one owner a table).

Each owner combines, for every source device, the pairs whose ids it holds into partial
activations of that source's rows and sends those back, where the row exchange sends one
row per distinct id. It moves fewer bytes when the rows of a source that an owner feeds
(`Rc` of them) are fewer than its distinct ids there (`U`): multi-hot features, and
table-wise placement, where an owner feeds only the rows of its own tables' features
(`PooledRows`). The owner needs the sources' pairs for it (8 bytes a pair: its id's slot
and its compact row, its gain). The update sends each owner the gradients of the rows it
feeds, and the owner applies them over the pairs it kept from the lookup (the view the
lookup carries) as one fused backward + update; optimizers that move every row take the
row exchange's update (`rows.update`).

Bytes a device sends a step: U ids, its pairs and [Rc, D] partial sums in the lookup,
[Rc, D] gradients in the update (the ids and pairs again without the lookup's view), to
each of its N - 1 peers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from embedmesh._runtime import pooled_pair_fields
from embedmesh.device import ops
from embedmesh.device.shard_program import ShardBatch, after
from embedmesh.device.strategies import rows
from embedmesh.device.strategies.base import Strategy, register

__all__ = ["PooledOnOwners", "PooledRows", "gradient_blocks", "serve_pairs"]


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


def serve_pairs(batch: ShardBatch, pooled: PooledRows, transport):
    """The owners' view of a batch: the messages [N, U + P * k] of every source for this
    owner (`ops.exchange_pooled_pairs`: the ids each asks of it, and its pairs, each with
    its id's position, its row among the `pooled.width` rows this owner feeds, its gain;
    8 bytes a pair where position and row fit one int32, else 12)."""
    n = batch.unique_ids.shape[0]
    compact = (
        jnp.asarray(pooled.compact) if pooled.compact is not None else jnp.zeros((n, 0), jnp.int32)
    )
    return ops.exchange_pooled_pairs(
        batch.unique_ids,
        batch.pair_rows,
        batch.pair_unique,
        batch.pair_gains,
        compact,
        width=pooled.width,
        transport=transport,
    )


def gradient_blocks(g, pooled: PooledRows, n: int) -> tuple:
    """`(parts, blocks)` of `ops.exchange_pooled_backward_update`: the gradients [Rc, D]
    each of the `n` owners is sent, as slices of this device's activation gradients `g`
    [R, D] (one a run of rows, `pooled.runs`: a feature's; the kernel reads them where
    they are, so XLA passes the features' gradients themselves, no concatenation) and the
    segments of them that make each owner's block."""
    if pooled.rows is None:  # every owner feeds every row
        return (g,), tuple(((0, 0, pooled.num_rows),) for _ in range(n))
    index: dict = {}  # (first row, count) -> its part
    blocks = []
    for runs in pooled.runs:
        blocks.append(tuple((index.setdefault(run, len(index)), 0, run[1]) for run in runs))
    return tuple(g[first : first + count] for first, count in index), tuple(blocks)


@register
class PooledOnOwners(Strategy):
    """Partial sums to the sources, activation gradients to the owners."""

    name = "pooled"

    def pooled_rows(self, features, num_rows: int) -> PooledRows:
        """The rows each shard feeds for a batch of these feature segments (`features`,
        `num_rows`: a `PartitionedCsrFormatTensor`'s or a `ShardBatch`'s)."""
        plan = self.plan
        layout = plan.row_layout
        segments = [
            (f.row_offset, f.num_rows, layout.shards_of(plan.table(plan.feature(f.name).table)))
            for f in features
        ]
        return PooledRows(num_rows, segments, self.transport.num_shards)

    def carries_view(self) -> bool:
        opt = self.optimizer
        return opt is not None and not opt.touches_all_rows

    def exchange_bytes(self, csr, *, carrying: bool = True) -> int:
        d = self.spec.dim
        u, p = int(csr.unique_ids.shape[-1]), int(csr.pair_rows.shape[-1])
        width = self.pooled_rows(csr.features, csr.rows_per_device).width
        pair = 4 * pooled_pair_fields(u, width)
        forward = 4 * u + pair * p + 4 * d * width
        if not self.carries_view():
            backward = rows.row_bytes(csr, d)  # the row exchange's update (or no optimizer)
        elif not carrying:
            backward = forward
        else:
            backward = 4 * d * width
        return (self.transport.num_shards - 1) * (forward + backward)

    def lookup(self, table, batch: ShardBatch, *, carry: bool = False) -> tuple:
        """Each owner combines every source's pairs from its rows into [Rc, D] partial
        sums (`ops.exchange_pooled_partials`), which come back and are summed per row (in
        shard order). With `carry`, also the owners' view this device received
        (`serve_pairs`), which `update` takes instead of sending the pairs again."""
        pooled = self.pooled_rows(batch.features, batch.num_rows)
        n = self.transport.num_shards
        rc, d = pooled.width, self.spec.dim  # the parameters' columns (not slots in rows)
        at = self.transport.at("lookup", "pooled")
        served = serve_pairs(batch, pooled, at.at("pairs"))
        back = ops.exchange_pooled_partials(
            table,
            served,
            unique_capacity=batch.unique_capacity,
            width=rc,
            transport=at.at("partials"),
            quantization=self.spec.quantization,
            columns=self.spec.lookup_columns,
        )
        if pooled.rows is None:
            act = jnp.sum(back.reshape(n, rc, d), axis=0)
        elif pooled.one_owner:  # each row from its one owner's block: slices, no sums
            pieces = []
            for o, runs in enumerate(pooled.runs):
                start = o * rc
                for first, count in runs:
                    pieces.append((first, back[start : start + count]))
                    start += count
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
        return act, (served if carry else None)

    def update(
        self, table, slots: dict, batch: ShardBatch, act_grads, *, step, keep=None, view=None
    ) -> tuple:
        """The backward on the owners: each source sends every owner the gradients of the
        [Rc] rows it feeds, and each owner applies them over its sources' pairs as one
        fused backward + update (`ops.exchange_pooled_backward_update`). `view`: the
        owners' view carried from this batch's `lookup(carry=True)`; without it the pairs
        travel again first. Optimizers that move every row: the row exchange's update."""
        opt = self.optimizer
        if opt.touches_all_rows:
            return rows.update(table, slots, batch, act_grads, opt, step, keep, self.transport)
        pooled = self.pooled_rows(batch.features, batch.num_rows)
        n = self.transport.num_shards
        rc = pooled.width
        at = self.transport.at("update", "pooled")
        parts, blocks = gradient_blocks(act_grads.astype(jnp.float32), pooled, n)
        # The order of exchanges, made on the one-element keep flag: on the gradients it
        # cost a pass over them of its own, ~8 MB a step at issue 39's shapes
        keep = jnp.asarray(True if keep is None else keep, bool).reshape(())
        served = view
        if served is None:
            served = serve_pairs(batch, pooled, at.at("pairs"))
            keep = after(keep, served).astype(bool)  # the pairs' exchange first, everywhere
        else:  # after what `unique_ids` waits for (the caller's previous exchanges)
            keep = after(keep, batch.unique_ids).astype(bool)
        return ops.exchange_pooled_backward_update(
            opt,
            table,
            slots,
            served,
            parts,
            keep,
            step,
            unique_capacity=batch.unique_capacity,
            width=rc,
            transport=at.at("grads"),
            blocks=blocks,
        )
