"""Restoring a checkpoint into a layer whose rows live in host memory (a host tier,
`embedmesh.device.host_tier`): the tiered tables' stored blocks read on the host,
verified against the logical checksums recorded at save, and written into the host rows
once every one was read and verified (a failed read changes nothing); the other stacks
through the devices as everywhere. Costs one extra copy of the tiered tables on the host
at the peak."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import jax
import numpy as np

from embedmesh.checkpoint.checksums import logical_checksum
from embedmesh.checkpoint.format import LOOKUP_FIELD
from embedmesh.checkpoint.leaves import start_leaf, streamed_leaves, verify_checksum, wait_leaf
from embedmesh.layout import sharding as mod_sharding

__all__ = ["restore_tiered"]

_log = logging.getLogger(__name__)


def restore_tiered(core, reader, todo: list, leaves: list, prefetch: bool) -> list:
    """`[(table, field, blocks a shard)]`: the tiered tables' leaves of `todo` read and
    verified (nothing written yet)."""
    if not todo:
        return []
    plan = core.full_plan
    if any(field == LOOKUP_FIELD for _, _, field in todo):
        raise NotImplementedError(
            "a pipelined restore of a checkpoint saved with an update pending into a layer "
            "whose rows live in host memory (a host tier) is not supported: restore it "
            "unpipelined"
        )
    shards = [(j, None) for j in range(core.num_shards)]

    def start(i):
        t, m, field = todo[i]
        dtype = core.tier[t.stack].arrays[core.tier_field(t.stack, field)[0]].dtype
        return start_leaf(reader, leaves[i], m, plan.row_layout, t, shards, dtype, field)

    staged = []
    with contextlib.closing(streamed_leaves(len(todo), start, prefetch)) as pending:
        for i, current in enumerate(pending):
            t, _, field = todo[i]
            wait_leaf(current)
            blocks = [np.asarray(p) for _, _, p in sorted(current.pieces, key=lambda x: x[0])]
            logical = mod_sharding.shards_to_table(blocks, plan, t)
            verify_checksum(current, lambda logical=logical, t=t: logical_checksum(logical, t))
            staged.append((t, field, blocks))
            _log.info("restore: read %s of table %s (host tier)", field, t.name)
    return staged


def install(core, live, new_tables: dict, new_slots: dict, staged: list, step: int):
    """The restored state of a tiered core: `staged` written into the host rows (the
    live state's cached rows first written back, so what was not restored keeps its
    values), the caches emptied, the other stacks' arrays `new_tables` / `new_slots`."""
    core.settle(live)
    for t, field, blocks in staged:
        core.write_blocks(t, field, blocks)
    return dataclasses.replace(
        live,
        tables=new_tables,
        slots=new_slots,
        step=jax.make_array_from_callback(
            (), core.replicated, lambda _: np.asarray(step, np.int32)
        ),
    )
