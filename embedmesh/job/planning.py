"""Planning a job: which strategy each table takes, how tables stack, what a device may
hold, and, with several processes, their agreement on the whole job and on the plan.

Pure functions of a `JobSpec` and a mesh (the collectives aside: one small all-gather
to agree on the job, one broadcast of process 0's "auto" choices), so the facade and
code of one's own plan the same job the same way (`EmbeddingJob.build`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils

from embedmesh import _runtime
from embedmesh.device import host_tier as _host_tier
from embedmesh.device import peers as _peers
from embedmesh.device.core import EmbeddingState
from embedmesh.host import fingerprint as _fingerprint
from embedmesh.host.tier import StackTier
from embedmesh.inputs import flatten_inputs_like, to_csr
from embedmesh.job.spec import JobSpec
from embedmesh.layout import planner as _planner
from embedmesh.layout.stacking import dim_multiple_for, pack_lanes_for, slots_in_rows_for

__all__ = ["build", "planner_sample"]


def build(spec: JobSpec, mesh, sample: list | None = None) -> tuple:
    """`(plan, core, initial state)` of `spec` on `mesh`; `sample`: the first batch's
    `Csr`s (`planner_sample`) that "auto" tables are planned from.

    With a mesh over several processes, every process must build the same job: a
    ValueError on every process names the first field that differs (`agree_on_job`),
    before any other collective."""
    if len({d.process_index for d in mesh.devices.flat}) > 1:
        agree_on_job(spec, mesh)  # first: before any other collective
    strategies, predicted, planned_batch, step_memory = plan_strategies(spec, mesh, sample)
    exchanges = {t: _planner.STRATEGY_FORMS[s][1] for t, s in strategies.items()}
    plan = _planner.stacking_for(spec.resolved, mesh.size, strategies, **stacking(spec, mesh))
    plan = dataclasses.replace(
        plan,
        strategies=tuple((t, strategies[t]) for t in spec.resolved.table_names),
        predicted=predicted,
        planned_batch=planned_batch,
    )
    plan = dataclasses.replace(plan, step_memory=step_memory(plan))
    core = _host_tier.core_for(
        plan,
        mesh,
        spec.optimizer,
        exchanges,
        rounding_seed=spec.seed,
        mode=spec.host_tier if may_tier(spec, _peers.mesh_on_cpu(mesh)) else "off",
        cache_rows=spec.host_tier_cache_rows,
        memory_limit=memory_limit_of(spec, mesh, _peers.mesh_on_cpu(mesh)),
        make_tier=StackTier,
    )
    devices = list(mesh.devices.flat)
    local = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if local != list(range(local[0], local[0] + len(local))):
        raise ValueError("this process's devices must be contiguous in mesh order")
    state: EmbeddingState = core.init(jax.random.key(spec.seed))
    plan = dataclasses.replace(plan, measured_bytes_per_device=core.bytes_per_device(state))
    return plan, core, state


def planner_sample(spec: JobSpec, features, weights) -> list:
    """Every feature's `Csr` of a batch, for the planner's statistics."""
    resolved = spec.resolved
    flat = flatten_inputs_like(resolved, features, "features")
    flat_w = (
        [None] * len(flat) if weights is None else flatten_inputs_like(resolved, weights, "weights")
    )
    return [
        to_csr(name, f, x, w)
        for name, f, x, w in zip(resolved.feature_names, resolved.features, flat, flat_w)
    ]


def agree_on_job(spec: JobSpec, mesh) -> None:
    """ValueError on every process unless all processes build the same job
    (`embedmesh.host.fingerprint`): one all-gather of two int32 when they agree;
    when not, a second one carrying every process's fields, to name the first
    that differs. Runs before any other collective of the job (the planner's
    broadcast, `same_host_job`, the steps), which would hang or abort on a
    mismatch."""
    options = {
        "stack_tables": spec.stack_tables,
        "max_stack_rows": spec.max_stack_rows,
        "capacities": spec.capacities,
        "overflow": spec.overflow,
        "check_finite": spec.check_finite,
        "pipeline_execution_with_tensor_core": spec.pipelined,
        "seed": spec.seed,
        "batch_size": spec.batch_size,
        "mesh axis names": mesh.axis_names,
        "mesh shape": mesh.devices.shape,
        "mesh devices (id, process)": [(d.id, d.process_index) for d in mesh.devices.flat],
        "EMBEDMESH_HOST_EXCHANGE": "on" if _runtime.host_exchange_enabled() else "off (0)",
        "jax version": jax.__version__,
    }
    blob = _fingerprint.encode(
        _fingerprint.job_fields(spec.resolved, spec.optimizer, dict(spec.strategies), options)
    )
    headers = np.asarray(multihost_utils.process_allgather(_fingerprint.header(blob)))
    if _fingerprint.differs(headers):  # seen by every process: all gather the fields
        fields = _fingerprint.padded(blob, headers)
        raise _fingerprint.mismatch(np.asarray(multihost_utils.process_allgather(fields)), headers)


def stacking(spec: JobSpec, mesh) -> dict:
    """`plan_stacking`'s options of a job (the planner's memory rule uses them); the dim
    multiple and where slots are kept are the mesh's platform's (on a TPU: whole
    128-lane rows, the slots in them)."""
    platform = mesh.devices.flat[0].platform if mesh is not None else "cpu"
    options = dict(
        stack_tables=spec.stack_tables,
        max_stack_rows=spec.max_stack_rows,
        default_optimizer=spec.optimizer,
        dim_multiple=dim_multiple_for(platform),
        slots_in_rows=slots_in_rows_for(platform),
        pack_lanes=0,
    )
    if pack_lanes_for(platform):  # narrow rows packed where the padded ones do not fit
        limit = memory_limit_of(spec, mesh, _peers.mesh_on_cpu(mesh))
        memory = _planner.layout_memory(spec.resolved, mesh.size, **options)
        held = memory(dict.fromkeys(spec.resolved.table_names, "mod"))
        options["pack_lanes"] = pack_lanes_for(platform, limit is not None and max(held) > limit)
    return options


def memory_limit_of(spec: JobSpec, mesh, on_cpu: bool) -> float | None:
    """Bytes a device may hold: `memory_limit_bytes`, else a GPU's own limit (the least
    of this process's devices), else on CPU `planner.cpu_memory_limit`; None (the cost
    model's machine) where a GPU does not tell."""
    if spec.memory_limit_bytes is not None:
        return float(spec.memory_limit_bytes)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if on_cpu:
        return _planner.cpu_memory_limit(len(local))
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    known = [float(x) for x in limits if x]
    return min(known) if known and len(known) == len(limits) else None


def may_tier(spec: JobSpec, on_cpu: bool) -> bool:
    """Whether a model over the memory limit may keep its rows in host memory: "on", or
    "auto" with a limit that is not the host's own (an accelerator's, or one given)."""
    if spec.host_tier == "on":
        return True
    return spec.host_tier == "auto" and (spec.memory_limit_bytes is not None or not on_cpu)


def _planned_batch(spec: JobSpec, mesh, sample: list | None) -> tuple:
    """`(samples a device, the batch planned for in words)`: `batch_size`'s, else the
    first batch's, else the default."""
    local = max(1, sum(d.process_index == jax.process_index() for d in mesh.devices.flat))
    if spec.batch_size is not None:
        batch = -(-int(spec.batch_size) // mesh.size)
        return batch, f"batch_size={spec.batch_size}: {batch} samples a device"
    if sample:
        batch = sample[0].batch_size // local
        return batch, (
            f"the first batch: {sample[0].batch_size} samples on this process, "
            f"{batch} a device (no batch_size= given)"
        )
    batch = _planner.DEFAULT_BATCH_PER_DEVICE
    return batch, f"{batch} samples a device (the default: no batch_size=, no batch)"


def plan_strategies(spec: JobSpec, mesh, sample: list | None) -> tuple:
    """`({table: strategy}, the cost model's Plan, the batch planned for in words, the
    step's memory of a stacking plan)`: the "auto" tables planned (from `sample`, the
    first batch, when one was given before building) for `batch_size` (else the first
    batch's, else the default), every plan's state and step bytes within the memory
    limit. With several processes every process takes process 0's plan (each saw its
    own batch; they must compile the same programs)."""
    resolved = spec.resolved
    names = resolved.table_names
    optimizers = {
        t: (c.optimizer if c.optimizer is not None else spec.optimizer)
        for t, c in zip(names, resolved.tables)
    }
    stats = _planner.table_stats(resolved, optimizers, sample)
    batch, planned_batch = _planned_batch(spec, mesh, sample)
    on_cpu = _peers.mesh_on_cpu(mesh)
    limit = memory_limit_of(spec, mesh, on_cpu)
    options = dict(
        # the state and the step's own bytes (the batch planned for) on each device
        memory_of=_planner.layout_memory(
            resolved,
            mesh.size,
            stats=stats,
            batch_per_device=batch,
            pipelined=spec.pipelined,
            **stacking(spec, mesh),
        ),
        # a table of raw ids cannot be replicated (its id map: `core._dynamic_stacks`)
        excluded={
            t: ("data_parallel",)
            for t, c in zip(names, resolved.tables)
            if getattr(c, "id_map", None) is not None
        },
    )
    machine = _planner.machine_for(mesh, on_cpu)
    try:
        chosen, predicted = _planner.plan(
            stats, dict(spec.strategies), mesh.size, batch, machine, memory_limit=limit, **options
        )
    except ValueError:
        if not may_tier(spec, on_cpu) or "data_parallel" in spec.strategies.values():
            raise
        # over the memory limit: a host tier holds the rows (`core_for` says so), the
        # plan then unbounded, no table replicated (a replica is never tiered)
        options["excluded"] = {t: ("data_parallel",) for t in names}
        chosen, predicted = _planner.plan(
            stats,
            dict(spec.strategies),
            mesh.size,
            batch,
            machine,
            memory_limit=float("inf"),
            **options,
        )
    if spec.plans_from_a_batch and jax.process_count() > 1:
        codes = np.array(
            [
                _planner.PLANNED.index("row_wise_rows" if chosen[t] == "mod" else chosen[t])
                for t in names
            ],
            np.int32,
        )
        codes = np.asarray(multihost_utils.broadcast_one_to_all(codes))
        agreed = {t: _planner.PLANNED[int(c)] for t, c in zip(names, codes)}
        chosen = {t: (chosen[t] if spec.strategies[t] != "auto" else agreed[t]) for t in names}

    def step_memory(plan):
        lanes = stacking(spec, mesh)["dim_multiple"]
        return _planner.step_memory_for(
            plan, chosen, stats, batch, pipelined=spec.pipelined, lanes=lanes
        )

    return chosen, predicted, planned_batch, step_memory
