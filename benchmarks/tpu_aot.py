"""embedmesh's training step compiled ahead of time for a mesh of chips that are not here.

`jax.experimental.topologies.get_topology_desc("v5e:2x2", "tpu")` describes a TPU slice
(its devices exist only as descriptions); a `Mesh` over them and `jax.jit(...).lower(...)`
of `ShapeDtypeStruct`s carrying `NamedSharding`s build the real program for the slice
(the Pallas kernels, the all-to-alls over ICI) without an array anywhere. The facade
allocates its state when it builds, so this module builds what the facade builds, minus
the state: the resolved features, the stacking plan (the mesh's platform's row layout),
the `EmbeddingCore`, and the state's and a batch's shapes. The batch's shapes come from
preprocessing a real host batch (numpy only) for all N devices, as one process of N
devices would.

    from tpu_aot import abstract_step, compile_step, topology_mesh
    mesh = topology_mesh("v5e:2x4")
    step = abstract_step(features, batch, embedmesh.Adagrad(0.1), mesh, "mod")
    report = compile_step(step)          # memory_analysis, collectives and their bytes

Used by `benchmarks/tpu_scale.py` and `tests/device/test_tpu_topologies.py`; on CPU it
compiles for a mesh of CPU devices the same way (the plumbing, in CI).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from embedmesh.config import resolve_feature_config
from embedmesh.device.core import EmbeddingCore, EmbeddingState
from embedmesh.host import preprocess as pre
from embedmesh.layout import planner
from embedmesh.layout.stacking import dim_multiple_for, slots_in_rows_for
from embedmesh.layout.step_memory import shapes_from_csr, step_memory

COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip


def topology_mesh(name: str, axis: str = "x") -> Mesh:
    """A 1-D mesh over the chips of TPU topology `name` ("v5e:2x2", ...), none of which
    needs to exist: the devices are the topology's descriptions."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(name, "tpu")
    return Mesh(np.array(topo.devices).reshape(-1), (axis,))


@dataclasses.dataclass
class AbstractStep:
    """One training step's pieces, shapes only: `core`, `plan`, `state` and `csr` (pytrees
    of ShapeDtypeStruct with their shardings), `grads` (the activations' shapes)."""

    core: EmbeddingCore
    state: EmbeddingState
    csr: dict
    grads: dict
    strategies: dict
    pipelined: bool

    @property
    def plan(self):
        return self.core.plan


def _sds(x, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)


def abstract_state(core: EmbeddingCore) -> EmbeddingState:
    """The shapes `core.init` would allocate, as ShapeDtypeStructs (nothing allocated)."""
    tables, slots = {}, {}
    for spec in core.plan.stacks:
        tables[spec.name] = jax.ShapeDtypeStruct(
            (spec.num_rows, spec.width), np.dtype(spec.dtype), sharding=core.row_sharding
        )
        slots[spec.name] = {}
        opt = core.optimizer_of(spec.name)
        if opt is not None and not spec.slot_columns:
            for slot in opt.slot_initial_values:
                slots[spec.name][slot] = jax.ShapeDtypeStruct(
                    (spec.num_rows, opt.slot_width(slot, spec.dim)),
                    spec.slots_dtype,
                    sharding=core.row_sharding,
                )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=core.replicated)
    return EmbeddingState(tables, slots, step, {})


def abstract_batch(core: EmbeddingCore, csr: dict) -> dict:
    """Host batch `csr` (all N devices' partitions) as `core.put` would place it, shapes
    only: each leaf sharded on its leading axis; the counts left on the host."""
    out = {}
    for name, c in csr.items():
        c = dataclasses.replace(c, unique_counts=None, pair_counts=None)
        out[name] = jax.tree_util.tree_map(lambda x: _sds(x, core.row_sharding), c)
    return out


def abstract_step(
    feature_config,
    features,
    optimizer,
    mesh: Mesh,
    sharding: str | Mapping = "mod",
    *,
    capacities=None,
    pipelined: bool = False,
    platform: str | None = None,
) -> AbstractStep:
    """The step's pieces for `feature_config` on `mesh` under `sharding` (one strategy of
    `planner.STRATEGY_FORMS` or `{table: strategy}`), its batch shaped like host batch
    `features` (the global batch, numpy) at `capacities` (default: this batch's need)."""
    resolved = resolve_feature_config(feature_config)
    n = mesh.size
    platform = platform or mesh.devices.flat[0].platform
    strategies = planner.resolve_strategies(resolved, sharding)
    if "auto" in strategies.values():
        raise ValueError("abstract_step takes explicit strategies (plan 'auto' first)")
    plan = planner.stacking_for(
        resolved,
        n,
        strategies,
        default_optimizer=optimizer,
        dim_multiple=dim_multiple_for(platform),
        slots_in_rows=slots_in_rows_for(platform),
    )
    plan = dataclasses.replace(
        plan, strategies=tuple((t, strategies[t]) for t in resolved.table_names)
    )
    exchanges = {t: planner.STRATEGY_FORMS[s][1] for t, s in strategies.items()}
    core = EmbeddingCore(plan, mesh, optimizer, exchanges)
    host, _ = pre.preprocess_batch(features, None, plan, num_devices_local=n, capacities=capacities)
    csr = abstract_batch(core, host)
    state = abstract_state(core)
    acts = jax.eval_shape(lambda st, c: core.lookup(st, c), state, csr)
    grads = {
        k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=core.row_sharding)
        for k, a in acts.items()
    }
    return AbstractStep(core, state, csr, grads, strategies, pipelined)


def step_function(step: AbstractStep):
    """`(fn, args)`: the training step jitted with the state donated. Not pipelined: the
    lookup (carrying the owners' view), the gradients (the activations scaled: a stand-in
    for the dense model's), the update. Pipelined (the facade's form): the next batch's
    lookup and the previous batch's update in one program."""
    core = step.core
    if not step.pipelined:

        def fn(state, csr):
            acts, view = core.lookup(state, csr, carrying=True)
            grads = {k: 0.5 * a for k, a in acts.items()}
            state, _ = core.apply_gradients(state, grads, csr, check_finite=False, view=view)
            return state, acts

        return jax.jit(fn, donate_argnums=0), (step.state, step.csr)

    view = jax.eval_shape(lambda st, c: core.lookup(st, c, carrying=True)[1], step.state, step.csr)
    view = jax.tree_util.tree_map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=core.row_sharding), view
    )

    def pipelined(state, grads, csr_prev, view, csr_next):
        acts, state, _, next_view = core.lookup_then_apply_gradients(
            state, grads, csr_prev, csr_next, check_finite=False, view=view, carrying=True
        )
        return state, acts, next_view

    return jax.jit(pipelined, donate_argnums=0), (
        step.state,
        step.grads,
        step.csr,
        view,
        step.csr,
    )


_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _DTYPE_BYTES.get(dtype, 4)
    return total


def collectives(hlo: str) -> dict:
    """`{kind: [count, bytes]}` of the collectives in compiled HLO text: a collective's
    bytes are its result's (one device's, as the per-device program states them; an
    async pair counted once, at its start)."""
    out: dict = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([\w\-]+)\(", line)
        if not m:
            continue
        result, op = m.groups()
        kind = op.removesuffix("-start")
        if kind not in COLLECTIVES or op.endswith("-done"):
            continue
        if op.endswith("-start"):  # ((operands), result) tuples: count the result half
            inner = result.strip("()")
            parts = _SHAPE.findall(inner)
            result = "".join(f"{d}[{s}]" for d, s in parts[len(parts) // 2 :])
        count, nbytes = out.get(kind, (0, 0))
        out[kind] = (count + 1, nbytes + _shape_bytes(result))
    return out


def estimated_memory(step: AbstractStep):
    """The layout's estimate of the bytes a device needs for `step` (a `StepMemory`: the
    state, and the step's own at its batch's capacities, by term)."""
    exchanges = {t: planner.STRATEGY_FORMS[s][1] for t, s in step.strategies.items()}
    shapes = shapes_from_csr(step.plan, step.csr)
    lanes = dim_multiple_for(step.core.mesh.devices.flat[0].platform)
    batches = 2 if step.pipelined else 1
    return step_memory(step.plan, exchanges, shapes, batches=batches, lanes=lanes)


def compile_step(step: AbstractStep) -> dict:
    """Lower and compile `step`; its per-device bytes (`memory_analysis`), the planner's
    estimate of the state's and of the whole step's (`estimated_memory`, by term), the
    collectives in the HLO and the cost model's bytes."""
    fn, args = step_function(step)
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    n = step.core.num_shards
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes")  # fmt: skip
    memory = {
        f.removesuffix("_in_bytes").removesuffix("_size"): int(getattr(mem, f, 0) or 0)
        for f in fields
    }
    state_bytes = sum(
        int(np.prod(x.shape)) * x.dtype.itemsize // n
        for x in jax.tree_util.tree_leaves((step.state.tables, step.state.slots))
    )
    estimate = estimated_memory(step)
    return {
        "memory": memory,
        "per_chip_bytes": memory["argument"] + memory["output"] - memory["alias"] + memory["temp"],
        "state_bytes": state_bytes,
        "planned_bytes": max(step.plan.bytes_per_device),
        "estimated_bytes": estimate.total,
        "estimate": dataclasses.asdict(estimate),
        "held_bytes": step.core.memory_held(),
        "collectives": collectives(hlo),
        "exchange_bytes": sum(step.core.exchange_bytes(step.csr).values()),
        "hlo_chars": len(hlo),
    }


def sent_bytes(found: dict, n: int) -> float:
    """Bytes one chip sends over ICI in the collectives `found` (`collectives`' counts),
    as a ring or a direct exchange moves them: an all-to-all's blocks but its own
    ((n-1)/n of its result), an all-gather's and an all-reduce's ring ((n-1)/n and
    2(n-1)/n of the result), a reduce-scatter's (n-1 blocks of its result), a
    collective permute's whole result."""
    share = {
        "all-to-all": (n - 1) / n,
        "all-gather": (n - 1) / n,
        "all-reduce": 2 * (n - 1) / n,
        "reduce-scatter": n - 1,
        "collective-permute": 1.0,
    }
    return sum(share[k] * b for k, (_, b) in found.items())
