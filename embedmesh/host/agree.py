"""Capacities and batch shapes agreed by every process of a multi-process job.

Each process preprocesses its own batch, but the compiled step exchanges arrays
whose sizes are the stacks' capacities and batch shapes: processes that chose
them alone (automatic capacities, overflow="grow") compile different programs,
and the job dies in the collective (gloo: "Received data size doesn't match")
or hangs. So each process states its needs and shapes in one small int32
vector (`local_vector`), the facade gathers the vectors of all processes (one
collective), and every process derives the same answer from the same gathered
array (`decide`): the elementwise max of the needs, rounded to buckets exactly
as one process over the union of the batches would round them, or one clear
error, raised on every process, when shapes or given capacities differ or a
process could not preprocess its batch. Pure numpy: the collective is the
caller's.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np

from embedmesh.batch import Capacity, PreprocessStats, capacity_bucket
from embedmesh.layout.stacking import StackingPlan

__all__ = [
    "BatchFailedElsewhere",
    "check_unchanged",
    "decide",
    "failed_vector",
    "local_vector",
    "shapes_of",
]


class BatchFailedElsewhere(RuntimeError, ValueError):
    """Another process could not preprocess its part of this batch (its own error, a
    ValueError for an overflow or a bad id, says why), so no process runs it.

    A RuntimeError, and a ValueError too: a training loop that skips a batch on
    `except ValueError` skips it on every process alike (the failing one with its own
    error, the others with this one), and the processes stay on the same batch; one that
    only caught the failing process's error would leave this one to end the others."""


_HEADER = 2  # [status (0 ok, 1 this process's preprocessing failed), number of stacks]
# per stack: the needs, then what must be equal on every process
_NEEDS = ("ids per partition needed", "unique ids per partition needed")
_SHAPES = (
    "max_ids_per_partition",  # -1: automatic (sized from the batches)
    "max_unique_ids_per_partition",
    "rows_per_device",
    "samples per device",
    "feature layout (a hash of its features' sample shapes)",
    "local devices",
)
_WIDTH = len(_NEEDS) + len(_SHAPES)


def _layout_hash(segments) -> int:
    key = repr(
        [(s.name, s.samples, tuple(s.sample_shape), s.dim, s.output_shape) for s in segments]
    )
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def local_vector(
    plan: StackingPlan,
    csr: Mapping,
    stats: PreprocessStats,
    before: Mapping[str, Capacity | None],
) -> np.ndarray:
    """This process's needs and shapes, `[2 + 8 * stacks]` int32.

    `before`: each stack's capacity before this batch (given, or agreed
    earlier), None while automatic.
    """
    out = [0, len(plan.stacks)]
    for s in plan.stacks:
        st, c, cap = stats[s.name], csr[s.name], before[s.name]
        out += [st.max_ids_per_partition, st.max_unique_ids_per_partition]
        out += (
            [-1, -1]
            if cap is None
            else [cap.max_ids_per_partition, cap.max_unique_ids_per_partition]
        )
        samples = c.features[0].samples if c.features else 0
        out += [c.rows_per_device, samples, _layout_hash(c.features), c.num_devices]
    return np.array(out, np.int32)


def failed_vector(plan: StackingPlan) -> np.ndarray:
    """The vector of a process whose preprocessing raised (the others then raise too)."""
    out = np.zeros(_HEADER + _WIDTH * len(plan.stacks), np.int32)
    out[:2] = 1, len(plan.stacks)
    return out


def _per_stack(vec: np.ndarray) -> np.ndarray:
    """`[..., stacks, 8]` view of one vector or a gathered `[processes, ...]` array."""
    return vec[..., _HEADER:].reshape(vec.shape[:-1] + (-1, _WIDTH))


def shapes_of(vec: np.ndarray, caps: Mapping[str, Capacity], plan: StackingPlan) -> np.ndarray:
    """The shape part of a local vector with the capacities of the compiled batch
    (what `check_unchanged` compares later batches with)."""
    shapes = _per_stack(vec)[:, len(_NEEDS) :].copy()
    for i, s in enumerate(plan.stacks):
        shapes[i, :2] = (
            caps[s.name].max_ids_per_partition,
            caps[s.name].max_unique_ids_per_partition,
        )
    return shapes


def _show(field: int, value: int) -> str:
    return "automatic" if field < 2 and value < 0 else str(value)


def decide(
    gathered: np.ndarray,
    plan: StackingPlan,
    before: Mapping[str, Capacity | None],
    overflow: str,
) -> dict:
    """`{stack: Capacity}` every process compiles for, from the gathered
    `[processes, 2 + 8 * stacks]` vectors; the same on every process.

    Automatic stacks take the bucketed max need; with overflow="grow" a stack
    whose max need exceeds its capacity grows as `preprocess_batch` grows it;
    otherwise the capacity stays. Raises `BatchFailedElsewhere` (a RuntimeError and a
    ValueError) when a process could not preprocess its batch, ValueError naming the
    stack, the field and each process's value when shapes or given capacities differ.
    """
    failed = [int(p) for p in np.flatnonzero(gathered[:, 0])]
    if failed:
        raise BatchFailedElsewhere(
            f"process(es) {failed} could not preprocess their batch (their own error says "
            f"why); every process stops here, before any step runs (a loop that skips the "
            f"batch on ValueError skips it on every process)"
        )
    per = _per_stack(gathered)
    agreed = {}
    for i, s in enumerate(plan.stacks):
        for f, what in enumerate(_SHAPES):
            col = per[:, i, len(_NEEDS) + f]
            if (col != col[0]).any():
                values = ", ".join(f"process {p} has {_show(f, int(v))}" for p, v in enumerate(col))
                raise ValueError(
                    f"stack {s.name}: the processes' batches disagree on {what}: {values}; "
                    f"every process must compile the same program (same capacities, same "
                    f"per-process batch size and feature shapes), so no step was run"
                )
        need_p, need_u = (int(x) for x in per[:, i, : len(_NEEDS)].max(axis=0))
        cap = before[s.name]
        if cap is None:
            cap = Capacity(capacity_bucket(need_p), capacity_bucket(need_u))
        elif overflow == "grow" and (
            need_p > cap.max_ids_per_partition or need_u > cap.max_unique_ids_per_partition
        ):
            cap = Capacity(
                max(cap.max_ids_per_partition, capacity_bucket(need_p)),
                max(cap.max_unique_ids_per_partition, capacity_bucket(need_u)),
            )
        agreed[s.name] = cap
    return agreed


def check_unchanged(
    agreed: np.ndarray, vec: np.ndarray, plan: StackingPlan, process_index: int
) -> None:
    """ValueError unless a later batch keeps the shapes agreed at the first one.

    With fixed capacities (overflow "error"/"drop") the processes agree once, at
    their first batch, and run no collective per step: a batch of other shapes
    on one process would meet the others in mismatched collectives, so it is
    refused here, on the process that has it, before anything runs.
    """
    now = _per_stack(vec)[:, len(_NEEDS) :]
    bad = np.argwhere(now != agreed)
    if bad.size:
        i, f = (int(x) for x in bad[0])
        raise ValueError(
            f"stack {plan.stacks[i].name}: process {process_index}'s batch has "
            f"{_SHAPES[f]} {_show(f, int(now[i, f]))}, but the processes agreed on "
            f"{_show(f, int(agreed[i, f]))} at their first batch; with fixed capacities "
            f"(overflow 'error' or 'drop') every later batch of a multi-process job must "
            f"keep those shapes (no collective checks them per step); overflow='grow' "
            f"checks every batch"
        )
