"""Preparing a batch: host preprocessing at the job's capacities, the processes'
agreement on capacities and shapes, and placing the batch on the mesh.

`Feed` is the host side's whole state between batches (the capacities batches were
compiled for, the agreed shapes, the count of attempts), a frozen value: each function
takes one and returns the next, so the facade, a prefetch thread and code of one's own
prepare batches the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from embedmesh.batch import PartitionedCsrFormatTensor
from embedmesh.device import ops
from embedmesh.host import agree as _agree
from embedmesh.host import pair_order as _pair_order
from embedmesh.host import preprocess as _pre
from embedmesh.host.prefetch import background_map

__all__ = [
    "Feed",
    "agreed_put",
    "enqueue",
    "prefetched",
    "prepare",
    "preprocess",
    "with_pairs_by_row",
]


@dataclasses.dataclass(frozen=True)
class Feed:
    """The host side's state between batches: `capacities` (`{stack: Capacity}`, one
    `Capacity` or None: sized from the first batch), `agreed_shapes` (several
    processes: the shapes agreed at the first batch) and `attempts` (several
    processes: enqueue attempts, failed ones included, which number the batches)."""

    capacities: Any = None
    agreed_shapes: np.ndarray | None = None
    attempts: int = 0

    def attempted(self) -> Feed:
        """This feed with one more attempt counted: a caller counts an attempt before
        `agreed_put`, so that one that fails counts too."""
        return dataclasses.replace(self, attempts=self.attempts + 1)


def preprocess(job, features, weights, capacities, overflow: str | None = None) -> tuple:
    """`(csr, stats)`: this process's batch preprocessed on the host at `capacities`
    (with its pairs' order by output row where the mesh's lookups read it)."""
    csr, stats = _pre.preprocess_batch(
        features,
        weights,
        job.plan,
        num_devices_local=job.num_local_devices,
        capacities=capacities,
        overflow=job.spec.overflow if overflow is None else overflow,
        process_index=jax.process_index(),
    )
    return with_pairs_by_row(job, csr), stats


def with_pairs_by_row(job, csr: dict) -> dict:
    """`csr` with each stack's `pairs_by_row` (`embedmesh.host.pair_order`) where the
    job's mesh runs lookups that read it (a TPU's kernels: the lookup then neither sorts
    nor gathers its pairs on the device), else as it is. A stack of raw ids gets none
    (mapping its ids moves its pairs)."""
    if not ops.reads_pairs_by_row(job.core.mesh):
        return csr
    return {
        name: (
            dataclasses.replace(
                c,
                pairs_by_row=_pair_order.pairs_by_row(
                    c.pair_rows,
                    c.pair_unique,
                    c.pair_gains,
                    c.rows_per_device,
                    c.capacity.max_unique_ids_per_partition,
                ),
            )
            if isinstance(c, PartitionedCsrFormatTensor) and c.unique_raw_ids is None
            else c
        )
        for name, c in csr.items()
    }


def recorded(job, feed: Feed, stats) -> Feed:
    """`feed` keeping the capacities a batch was compiled for (automatic, grown)."""
    given = feed.capacities
    if given is None or stats.grown or isinstance(given, dict):
        caps = dict(given) if isinstance(given, dict) else {}
        caps.update(stats.capacities)
        return dataclasses.replace(feed, capacities=caps)
    return feed


def enqueue(job, feed: Feed, features, weights) -> tuple:
    """One process: `(csr placed on the mesh, stats, next feed)`."""
    csr, stats = preprocess(job, features, weights, feed.capacities)
    if getattr(job.core, "tier", None):  # a host tier maps its rows at dequeue
        return csr, stats, recorded(job, feed, stats)
    # its arrays, just made: aliased where aligned
    return job.core.put(csr, copy=False), stats, recorded(job, feed, stats)


def prepare(job, capacities, features, weights) -> tuple:
    """Several processes: this process's preprocessing at `capacities`, `(features,
    weights, (csr, stats) or None, its exception or None)`; may run ahead in a prefetch
    thread (`agreed_put` refills stale capacities)."""
    try:
        result = preprocess(job, features, weights, capacities)
    except Exception as e:  # noqa: BLE001 - announced to the others, then re-raised
        return features, weights, None, e
    return features, weights, result, None


def agreed_put(job, feed: Feed, prepared: tuple) -> tuple:
    """A `prepare`d batch of a multi-process job, with capacities and shapes agreed
    among the processes, placed on the mesh: `(csr, stats, next feed)`.

    Every process must compile the same program, so capacities are chosen from
    every process's needs (`embedmesh.host.agree`): one all-gather of a small
    int32 vector at the first batch and, with overflow="grow" (whether to grow
    depends on every process's batch), at every batch. With fixed capacities
    (overflow "error"/"drop") later batches run no collective: their shapes
    are checked here against the agreed ones. A process whose preprocessing
    failed during an agreement announces it, so the others raise too instead
    of waiting in the collective. Runs in the consumer's thread: from the
    prefetch thread the gather could meet another process's step. The batch carries
    `feed.attempts` (`PartitionedCsrFormatTensor.batch_number`): the caller counts
    each attempt first, failed ones included (`EmbeddingJob.check_step`).
    """
    features, weights, result, error = prepared
    plan, overflow = job.plan, job.spec.overflow
    number = feed.attempts  # counted by the caller (`Feed.attempted`), failed ones too
    before = {s.name: _pre._capacity_for(feed.capacities, plan, s.name) for s in plan.stacks}
    agree_now = overflow == "grow" or feed.agreed_shapes is None
    if error is not None:
        if agree_now:  # the others are about to gather: let them raise too
            multihost_utils.process_allgather(_agree.failed_vector(plan))
        raise error
    csr, stats = result
    local = _agree.local_vector(plan, csr, stats, before)
    if agree_now:
        gathered = np.asarray(multihost_utils.process_allgather(local))
        target = _agree.decide(gathered, plan, before, overflow)
        feed = dataclasses.replace(feed, agreed_shapes=_agree.shapes_of(local, target, plan))
    else:
        assert feed.agreed_shapes is not None
        _agree.check_unchanged(feed.agreed_shapes, local, plan, jax.process_index())
        target = {name: cap for name, cap in before.items() if cap is not None}
    if target != stats.capacities:  # another process needed more, or prepared ahead
        csr, stats = preprocess(job, features, weights, target)
    stats = _pre.PreprocessStats(
        {
            name: dataclasses.replace(
                st, grown=before[name] is not None and target[name] != before[name]
            )
            for name, st in stats.stacks.items()
        }
    )
    mark = np.full(job.num_local_devices, number, np.int32)
    csr = job.core.put({k: dataclasses.replace(c, batch_number=mark) for k, c in csr.items()})
    return csr, stats, recorded(job, feed, stats)


def split_item(item) -> tuple:
    """`(features, weights)` of an item of a prefetched iterable: `features`, or a pair
    `(features, weights)`."""
    return item if isinstance(item, tuple) and len(item) == 2 else (item, None)


def peek(items) -> tuple:
    """`(the first item or None when there is none, an iterator of all the items)`."""
    items = iter(items)
    first = next(items, None)
    return first, items if first is None else itertools.chain([first], items)


def prefetched(items, buffer_size: int, local, agreed=None):
    """`local(item)` for each item, computed `buffer_size` ahead in a background thread
    (an error there re-raised in the consumer's loop); with `agreed`, each result then
    passes through `agreed` in the consumer's thread (several processes: a collective
    from the prefetch thread could meet another process's step)."""
    ahead = background_map(local, items, buffer_size)
    if agreed is None:
        return ahead

    def in_order():
        try:
            for p in ahead:
                yield agreed(p)
        finally:
            ahead.close()

    return in_order()
