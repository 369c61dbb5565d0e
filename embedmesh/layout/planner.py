"""The planner: a sharding strategy per table, from the cost model and a sample batch.

`MeshEmbedding(sharding="auto")` (or a mapping with "auto" for some tables) plans
here when it builds: `table_stats` measures each table's ids per sample and how
its distinct ids grow with the batch on a sample batch (the first one given to
`enqueue`; from the config alone, one id per sample and every id distinct, when
`build()` comes before any batch), `machine_for` picks the cost model's constants
for the mesh (this CPU's kernels and links, a TPU v5e slice's measured row costs and
its ICI, or a GPU cluster's datasheet projection), and `plan` runs
`cost_model.plan_tables` over the strategies embedmesh implements, keeping the user's
choices as overrides.

Memory is one rule for every strategy, explicit or planned: the bytes each device
needs are the state the built layout holds (`stacking_for(...).bytes_per_device`:
every stack's block on every device, padding included) plus the step's own bytes
(`step_memory_for`: the batch on the device, the activations and their gradients, the
exchanges' and the update's largest temporaries, from the batch the plan is made for),
and no plan over the per-device limit (`memory_limit`) is chosen; when none fits, a
ValueError names the tables, the bytes and the limit before anything is allocated.

A strategy is a placement (`embedmesh.layout.rows`: which shard holds a row) and
an exchange form (`EmbeddingCore`'s `exchange`: what crosses between devices):

  row_wise_rows    mod placement, the owners send rows ("mod" is its TPU name)
  row_wise_pooled  mod placement, the owners pool and send partial sums
  table_wise       one owner per table, which pools and sends the activations
  data_parallel    a replica on every device, looked up in place; the devices send
                   each other their distinct ids and gradient sums (the cost model's
                   "sparse" variant; its dense all-reduce is not built)
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from embedmesh.layout import cost_model
from embedmesh.layout.cost_model import Machine, Plan, TableStats
from embedmesh.layout.stacking import StackingPlan, plan_stacking, table_shardings
from embedmesh.layout.step_memory import StepMemory, estimated_shapes, step_memory, table_loads

_log = logging.getLogger(__name__)

__all__ = [
    "PLANNED",
    "STRATEGY_FORMS",
    "cpu_memory_limit",
    "layout_memory",
    "machine_for",
    "plan",
    "resolve_strategies",
    "stacking_for",
    "step_memory_for",
    "table_stats",
    "tpu_slice_shape",
]

# strategy -> (placement, exchange form)
STRATEGY_FORMS = {
    "mod": ("mod", "rows"),
    "row_wise_rows": ("mod", "rows"),
    "row_wise_pooled": ("mod", "pooled"),
    "table_wise": ("table_wise", "pooled"),
    "data_parallel": ("data_parallel", "rows"),  # (the form is unused: nothing is looked up)
}
# what "auto" picks from
PLANNED = ("row_wise_rows", "row_wise_pooled", "table_wise", "data_parallel")
# the cost model's options for what embedmesh builds of a strategy
BUILT_OPTIONS = {"data_parallel": {"variant": "sparse"}}
CHOICES = tuple(STRATEGY_FORMS) + ("auto",)
DEFAULT_BATCH_PER_DEVICE = 256  # the planner's batch when it has not seen one
CPU_MEMORY_FRACTION = 0.8  # of the host's physical memory, shared by its CPU devices


def cpu_memory_limit(local_devices: int) -> float:
    """The default per-device limit of CPU devices: `CPU_MEMORY_FRACTION` of the host's
    physical memory over the process's devices (they share it); unlimited where the
    host does not tell."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return float("inf")
    return CPU_MEMORY_FRACTION * physical / max(1, int(local_devices))


def stacking_for(
    resolved, num_devices: int, strategies: Mapping[str, str], **stacking
) -> StackingPlan:
    """The `StackingPlan` of `{table: strategy}` (`STRATEGY_FORMS`' placements; on several
    devices one exchange form a stack), `stacking`: `plan_stacking`'s other options."""
    placements = {t: STRATEGY_FORMS[s][0] for t, s in strategies.items()}
    exchanges = {t: STRATEGY_FORMS[s][1] for t, s in strategies.items()}
    return plan_stacking(
        resolved,
        num_devices,
        sharding=placements,
        stack_keys=exchanges if num_devices > 1 else None,
        **stacking,
    )


def layout_memory(
    resolved,
    num_devices: int,
    *,
    stats: Sequence[TableStats] | None = None,
    batch_per_device: int | None = None,
    pipelined: bool = False,
    **stacking,
) -> Callable[[Mapping[str, str]], tuple]:
    """`{table: strategy}` -> the bytes each device needs under it, for
    `cost_model.plan_tables`' `memory_of`; cached (the search revisits assignments).

    The state each device holds (`stacking_for`'s `bytes_per_device`), plus, given the
    tables' `stats` and `batch_per_device`, the step's own bytes on the device that
    needs the most (`step_memory_for`: the batch, two where `pipelined`, the
    activations and their gradients, the largest phase's temporaries), so that a plan
    that fits fits once compiled."""

    loads = (
        None if stats is None or batch_per_device is None else table_loads(stats, batch_per_device)
    )

    @functools.lru_cache(maxsize=4096)
    def of(chosen: tuple) -> tuple:
        strategies = dict(zip(resolved.table_names, chosen))
        plan = stacking_for(resolved, num_devices, strategies, **stacking)
        if loads is None:
            return plan.bytes_per_device
        lanes = stacking.get("dim_multiple", 1)
        step = step_memory_for(
            plan, strategies, loads, batch_per_device, pipelined=pipelined, lanes=lanes
        ).step
        return tuple(x + step for x in plan.bytes_per_device)

    return lambda assign: of(tuple(assign[t] for t in resolved.table_names))


def step_memory_for(
    plan: StackingPlan,
    strategies: Mapping[str, str],
    stats: Sequence[TableStats] | Mapping[str, tuple],
    batch_per_device: int,
    *,
    pipelined: bool = False,
    lanes: int = 1,
) -> StepMemory:
    """The bytes a device needs for one step of `plan` under `{table: strategy}`, its
    batch estimated from the tables' `stats` (or their `step_memory.table_loads`) for
    `batch_per_device` samples a device (`embedmesh.layout.step_memory`); `pipelined`:
    two batches on the device at once; `lanes`: the columns a row block is rounded to
    there (the stacking's dim multiple)."""
    exchanges = {t: STRATEGY_FORMS[s][1] for t, s in strategies.items()}
    loads = stats if isinstance(stats, Mapping) else table_loads(stats, batch_per_device)
    shapes = estimated_shapes(plan, loads, batch_per_device)
    batches = 2 if pipelined else 1
    return step_memory(plan, exchanges, shapes, batches=batches, lanes=max(1, int(lanes)))


def resolve_strategies(resolved, sharding) -> dict:
    """`{table: strategy or "auto"}` from `MeshEmbedding`'s `sharding` argument: one
    of `CHOICES` for every table, or a mapping from table names (or `TableConfig`s)
    to one (tables it leaves out: "mod"); `stacking.table_shardings`' checks."""
    return dict(zip(resolved.table_names, table_shardings(sharding, resolved, CHOICES)))


def _distinct(ids: np.ndarray) -> int:
    return int(np.unique(ids).size) if ids.size else 0


def table_stats(resolved, optimizers: Mapping[str, object], csrs: Sequence | None = None) -> list:
    """A `TableStats` per table of `resolved` (a `ResolvedFeatures`).

    `csrs`: every feature's `inputs.Csr` of a sample batch, in config order. Its ids
    per sample, and its distinct ids on the whole batch and on its first half give
    `unique_fn(n) = distinct * (n / ids) ** alpha` (alpha from the two, in [0, 1],
    capped at the table's rows by the model). Without a sample: one id per sample
    (a sequence feature: its length), every id distinct. `optimizers`: each table's
    optimizer (its slots count)."""
    stats = []
    for t_index, (tname, table) in enumerate(zip(resolved.table_names, resolved.tables)):
        feats = [
            (k, f) for k, f in enumerate(resolved.features) if f.table is resolved.tables[t_index]
        ]
        opt = optimizers.get(tname)
        slots = len(opt.slot_names) if opt is not None else 0
        pooled = all(f.max_sequence_length == 0 for _, f in feats)
        outputs = sum(1 if f.max_sequence_length == 0 else f.max_sequence_length for _, f in feats)
        if csrs is None:
            per_sample = float(outputs)
            unique_fn = None
            zipf_a = 0.0
        else:
            ids = [np.asarray(csrs[k].ids).reshape(-1) for k, _ in feats]
            batch = max(1, csrs[feats[0][0]].batch_size) if feats else 1
            n_all = sum(x.size for x in ids)
            per_sample = n_all / batch
            half = [x[: x.size // 2] for x in ids]
            u_all = _distinct(np.concatenate(ids)) if ids else 0
            u_half = _distinct(np.concatenate(half)) if half else 0
            alpha = 1.0
            if u_half > 0 and u_all > u_half:
                alpha = float(np.clip(np.log(u_all / u_half) / np.log(2.0), 0.0, 1.0))
            elif u_half > 0:
                alpha = 0.0

            def unique_fn(n, u_all=u_all, n_all=n_all, alpha=alpha):
                return u_all * (n / n_all) ** alpha if n_all else 0.0

            zipf_a = 0.0
        stats.append(
            TableStats(
                name=tname,
                rows=int(table.vocabulary_size),
                dim=int(table.dim),
                bytes_per_element=int(np.dtype(table.dtype).itemsize),
                slots=slots,
                ids_per_sample=float(per_sample),
                zipf_a=zipf_a,
                unique_fn=unique_fn if csrs is not None else (lambda n: n),
                pooled=pooled,
                outputs_per_sample=float(outputs),
            )
        )
    return stats


def machine_for(mesh, on_cpu: bool) -> Machine:
    """The cost model's constants for `mesh` (`on_cpu`: its devices are CPUs, as the
    ops layer tells): this CPU's (in-process devices read each other's memory;
    processes of one host copy through shared memory), a TPU slice's (`Machine.tpu_v5e`
    of its chips' extent, `tpu_slice_shape`), or the GPU cluster projection (H200 or
    H100)."""
    devices = list(mesh.devices.flat)
    processes = {d.process_index for d in devices}
    if not on_cpu:
        kind = str(getattr(devices[0], "device_kind", ""))
        if kind.upper().startswith("TPU"):  # "TPU v5 lite", "TPU v5e"
            return Machine.tpu_v5e(tpu_slice_shape(devices))
        return Machine.h200() if "H200" in kind else Machine.h100_cluster()
    if len(processes) == 1:
        return Machine.this_cpu("shm")
    return Machine.this_cpu("host_shm")


def tpu_slice_shape(devices) -> tuple:
    """The chips along each ICI axis of TPU `devices` (their `coords`' extents; one axis
    of len(devices) where the devices do not tell)."""
    coords = [tuple(getattr(d, "coords", ()) or ()) for d in devices]
    if not coords or not all(coords) or len({len(c) for c in coords}) != 1:
        return (len(devices),)
    return tuple(len({c[k] for c in coords}) for k in range(len(coords[0])))


def plan(
    stats: Sequence[TableStats],
    requested: Mapping[str, str],
    num_devices: int,
    batch_per_device: int,
    machine: Machine,
    *,
    memory_limit: float | None = None,
    memory_of: Callable[[Mapping[str, str]], Sequence[float]] | None = None,
    excluded: Mapping[str, Sequence[str]] | None = None,
) -> tuple[dict, Plan]:
    """`({table: strategy}, the cost model's Plan)`: "auto" tables planned over
    `PLANNED`, the others kept (as the planner's overrides, "mod" as row_wise_rows),
    every device's bytes (`memory_of`, e.g. `layout_memory`) within `memory_limit`
    (default: the machine's); `excluded`: `{table: strategies it cannot take}` (the
    cost model's); a ValueError when no plan fits."""
    overrides = {
        name: ("row_wise_rows" if s == "mod" else s) for name, s in requested.items() if s != "auto"
    }
    result = cost_model.plan_tables(
        stats,
        num_devices,
        machine,
        overrides,
        batch_per_device=max(1, int(batch_per_device)),
        strategies=PLANNED,
        strategy_options=BUILT_OPTIONS,
        memory_limit=memory_limit,
        memory_of=memory_of,
        excluded=excluded,
    )
    chosen = {
        name: requested[name] if requested[name] != "auto" else result.strategy_of(name)
        for name in requested
    }
    for name in requested:
        _log.info(
            "plan: table %s -> %s (%s)",
            name,
            chosen[name],
            "planned" if requested[name] == "auto" else "requested",
        )
    return chosen, result
