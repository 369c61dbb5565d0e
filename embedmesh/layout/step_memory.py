"""The bytes a device needs for one training step: the state it holds and the step's own.

The stacking plan counts the state (`StackingPlan.bytes_per_device`: every stack's
table and optimizer slots). A step needs more: the batch placed on the device, the
activations it returns and their gradients, the buffers its all-to-alls send and
receive, and the owners' update of the rows they were sent. This module models those
from shapes alone, each term named and derived from the plan and the batch's shape, so
that the planner's memory rule ("does it fit") uses what a compiled step needs.

Per device, for a stack of `N` shards, capacities `U` (distinct ids a partition) and `P`
(pairs a partition), `R` activation rows, `D` the stack's dim (the columns a lookup
reads), `W` a row's columns with its slots (both rounded up to the device's lanes in
the temporaries: a TPU lays a row block out in whole 128-lane rows), ids and gains 4
bytes, rows float32:

  batch        the placed batch: unique ids [N, U], pair rows, ids and gains [N, P] each:
               4 N (U + 3 P) (a stack of raw 64-bit ids: + 8 N U, their raw ids); twice
               where pipelined (a program updates from one batch, looks the next up);
  activations  the lookup's outputs, every feature's [rows, dim] float32;
  gradients    their gradients, the update's input: the same bytes;
  temporaries  the largest phase of any stack (XLA reuses a phase's buffers in the
               next, so the step's peak is one phase's, not their sum):
               rows (row-wise) lookup: ids sent and received 2 * 4 N U, rows gathered
                 and received 2 * 4 N U D; update: per-id gradient sums sent and
                 received 2 * 4 N U D (the owner's merged sums then take the sent
                 block's place) and the rows it reads with their slots 4 N U W;
               pooled (row-wise pooled, table-wise) lookup: the pairs' messages sent
                 and received 2 * 4 N (U + k P) (k: 2 or 3 words a pair), partial sums
                 sent and received 2 * 4 N Rc D (Rc: the rows an owner feeds); update:
                 the gradients sent and received 2 * 4 N Rc D, the per-id sums and the
                 merged sums 2 * 4 N U D, the rows read 4 N U W;
               data-parallel: the lookup reads in place (its gathered rows 4 U D); the
                 update sends its ids and sums 4 U (1 + D), receives every device's
                 4 N U (1 + D), merges 4 N U D and reads 4 N U W;
               one device: the gathered rows 4 U D; update: sums, merged, rows read.

On CPU devices of one process the kernels read each other's memory in place, so the
compiled step's temporaries stay below the model's; on a TPU the all-to-alls and the
reference update's buffers are real. Not counted: the compiled program's code and
buffers below a few percent of these (scalars, flags, sort scratch, and on a TPU the
batch's pairs a second time in output-row order, 4 N * 3 P).

The batch's shape comes from a placed batch (`shapes_from_csr`: its capacities, exact)
or, before any batch, from the planner's table statistics (`estimated_shapes`: the
expected pairs and distinct ids of a partition, rounded up to the capacity buckets
preprocessing uses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from embedmesh._runtime import pooled_pair_fields
from embedmesh.batch import capacity_bucket
from embedmesh.layout.cost_model import expected_unique

__all__ = [
    "StackShape",
    "StepMemory",
    "estimated_shapes",
    "shapes_from_csr",
    "step_memory",
    "table_loads",
]

_WORD = 4  # bytes of an id, a gain, a float32 row element


def _bucket(n: float) -> int:
    """Preprocessing's capacity for `n` ids (`capacity_bucket`: 8, 12, 16, 24, ...)."""
    return capacity_bucket(int(np.ceil(n)))


@dataclasses.dataclass(frozen=True)
class StackShape:
    """One stack's batch on a device: capacities `unique` (U) and `pairs` (P) of each of
    its N partitions, its features' activation blocks `((rows, dim), ...)`, the rows an
    owner feeds in a pooled exchange (`fed`: Rc), and whether it carries raw ids."""

    unique: int
    pairs: int
    features: tuple
    fed: int
    raw_ids: bool = False


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes a device needs for a step, by term (see the module docstring): `state`
    (tables and slots), `batch`, `activations`, `gradients`, `temporaries` (the largest
    phase, `phase` naming it)."""

    state: int
    batch: int
    activations: int
    gradients: int
    temporaries: int
    phase: str = ""

    @property
    def step(self) -> int:
        """The step's own bytes: all but the state."""
        return self.batch + self.activations + self.gradients + self.temporaries

    @property
    def total(self) -> int:
        return self.state + self.step

    def describe(self) -> str:
        def mb(x) -> str:
            return f"{x / 1e6:,.1f}"

        return (
            f"state {mb(self.state)} + step {mb(self.step)} MB (batch {mb(self.batch)}, "
            f"activations {mb(self.activations)}, gradients {mb(self.gradients)}, "
            f"temporaries {mb(self.temporaries)}: {self.phase})"
        )


def _lanes(columns: int, lanes: int) -> int:
    return -(-int(columns) // max(1, int(lanes))) * max(1, int(lanes))


def _phases(spec, form: str, n: int, s: StackShape, lanes: int) -> dict:
    """`{phase: bytes}` of one stack's lookup and update temporaries (module docstring)."""
    u, d, w = s.unique, _lanes(spec.dim, lanes), _lanes(spec.row_columns, lanes)
    rows = _WORD * u * d  # one [U, D] float32 block
    if n == 1:
        return {"lookup": rows, "update": 2 * rows + _WORD * u * w}
    if spec.replicated:
        gathered = _WORD * n * u * (1 + d)
        return {
            "lookup": rows,
            "update": _WORD * u * (1 + d) + gathered + n * rows + _WORD * n * u * w,
        }
    if form == "pooled":
        k = pooled_pair_fields(u, s.fed)
        partials = _WORD * n * s.fed * d
        return {
            "lookup": 2 * _WORD * n * (u + k * s.pairs) + 2 * partials,
            "update": 2 * partials + 2 * n * rows + _WORD * n * u * w,
        }
    return {
        "lookup": 2 * _WORD * n * u + 2 * n * rows,
        "update": 2 * n * rows + _WORD * n * u * w,
    }


def step_memory(
    plan,
    exchanges: Mapping[str, str],
    shapes: Mapping[str, StackShape],
    *,
    state: int | None = None,
    batches: int = 1,
    lanes: int = 1,
) -> StepMemory:
    """The bytes a device needs for one step of `plan` (a `StackingPlan`) with each
    stack's batch shaped `shapes[stack]`; `exchanges`: `{table: "rows" or "pooled"}` (the
    planner's `STRATEGY_FORMS`' forms; tables not named: "rows"); `state`: the state's
    bytes (default: the plan's most on any device); `batches`: the batches on the device
    at once (2 when pipelined: one program updates from a batch and looks the next up);
    `lanes`: the multiple a row block's columns take in the device's memory (a TPU's
    128 lanes, the plan's dim multiple there: a [U, 64] block takes [U, 128])."""
    n = plan.num_shards
    batch = acts = 0
    worst, phase = 0, ""
    for spec in plan.stacks:
        s = shapes[spec.name]
        batch += _WORD * n * (s.unique + 3 * s.pairs) + (
            2 * _WORD * n * s.unique if s.raw_ids else 0
        )
        acts += sum(_WORD * r * dim for r, dim in s.features)
        form = exchanges.get(spec.tables[0], "rows")
        for name, b in _phases(spec, form, n, s, lanes).items():
            if b > worst:
                worst, phase = b, f"{spec.name}'s {name}"
    held = max(plan.bytes_per_device, default=0) if state is None else state
    return StepMemory(int(held), int(batch) * batches, int(acts), int(acts), int(worst), phase)


def _shards(plan, placed) -> range | tuple:
    """The shards holding rows of table placement `placed`: its span (where it has at
    least a row for each; else, a tiny table, the layout's count)."""
    first, k = plan.row_layout.span(placed)
    if placed.vocabulary_size >= k:
        return range(first, first + k)
    return plan.row_layout.shards_of(placed)


def _fed(plan, rows_of: Mapping[str, int]) -> int:
    """Rc: the most activation rows one shard feeds in a pooled exchange (the rows of the
    features whose table it holds a block of), from `{feature: rows}`."""
    fed = np.zeros(plan.num_shards, np.int64)
    for f, r in rows_of.items():
        first, k = plan.row_layout.span(plan.table(plan.feature(f).table))
        fed[first : first + k] += r
    return max(1, int(fed.max(initial=0)))


def shapes_from_csr(plan, csr: Mapping) -> dict:
    """`{stack: StackShape}` of a placed (or host) batch `{stack:
    PartitionedCsrFormatTensor}`: its capacities and feature blocks, exact."""
    out = {}
    for name, c in csr.items():
        rows_of = {f.name: f.num_rows for f in c.features}
        out[name] = StackShape(
            unique=int(np.shape(c.unique_ids)[-1]),
            pairs=int(np.shape(c.pair_rows)[-1]),
            features=tuple((f.num_rows, f.dim) for f in c.features),
            fed=_fed(plan, rows_of),
            raw_ids=c.unique_raw_ids is not None,
        )
    return out


def table_loads(stats: Sequence, batch_per_device: int) -> dict:
    """`{table: (ids a device, their expected distinct ids)}` for `batch_per_device`
    samples a device, from the planner's `TableStats` (`cost_model.expected_unique`)."""
    b = max(1, int(batch_per_device))
    return {t.name: (b * t.ids_per_sample, expected_unique(t, b * t.ids_per_sample)) for t in stats}


def estimated_shapes(plan, loads: Mapping[str, tuple], batch_per_device: int) -> dict:
    """`{stack: StackShape}` before any batch, for `batch_per_device` samples a device:
    each table's ids a device and their expected distinct ids (`loads`, `table_loads`;
    a table not in it: one id a sample, all distinct) split evenly over the shards
    holding its rows (all of them in partition 0 for a replica), summed per partition
    over the stack's tables, the fullest partition rounded up to preprocessing's
    capacity bucket."""
    b = max(1, int(batch_per_device))
    out = {}
    for spec in plan.stacks:
        n = plan.num_shards
        pairs, unique = np.zeros(n), np.zeros(n)
        for name in spec.tables:
            ids, distinct = loads.get(name, (b, b))
            shards = (0,) if spec.replicated else _shards(plan, plan.table(name)) or (0,)
            for j in shards:
                pairs[j] += ids / len(shards)
                unique[j] += distinct / len(shards)
        rows_of = {f.name: b * f.rows_per_sample for f in plan.features if f.stack == spec.name}
        out[spec.name] = StackShape(
            unique=_bucket(unique.max()),
            pairs=_bucket(pairs.max()),
            features=tuple((rows_of[f.name], f.dim) for f in plan.features if f.stack == spec.name),
            fed=_fed(plan, rows_of),
            raw_ids=any(
                getattr(plan.table_config(t), "id_map", None) is not None for t in spec.tables
            ),
        )
    return out
