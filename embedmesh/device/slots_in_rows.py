"""An optimizer applied to a stack that keeps its slots in its table's rows.

Where the plan keeps a stack's slots in its rows (`StackSpec.slot_columns`, a TPU's
layout: `layout.stacking`), its table array is `[rows, width]` with each row
`[parameters | slot ... | zero]` and the stack has no slot arrays. The device programs
and ops see that array as a table with no slots and run `SlotsInRows(optimizer, spec)`:
its `update_rows` takes the whole rows, applies the optimizer to the parameter columns
with its slots read from their columns, and returns whole rows. So every op that
updates rows (a gather, `update_rows`, a scatter: `ops.sparse_update`'s reference) moves
each touched row once, not once per array, and nothing else changes: the strategies,
the exchanges and the ops are the same code for both layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

__all__ = ["SlotsInRows", "device_optimizer", "initial_row"]


@dataclasses.dataclass(frozen=True)
class SlotsInRows:
    """`optimizer` over rows `[dim parameters | slots at slot_columns | zero]` of `width`.

    Hashable (a static parameter of the ops). `slot_names` is empty (the stack has no slot
    arrays) and `fused_kernel` None (the CPU kernels take separate arrays: such a call
    runs the ops' reference)."""

    optimizer: Any
    dim: int
    width: int
    slot_columns: tuple  # ((slot, first column, width), ...)

    slot_names: tuple = ()
    fused_kernel: None = None

    @property
    def touches_all_rows(self) -> bool:
        return self.optimizer.touches_all_rows

    def learning_rate_at(self, step):
        return self.optimizer.learning_rate_at(step)

    def split(self, rows):
        """`(parameters [..., dim], {slot: [..., its width]})` of whole rows."""
        slots = {k: rows[..., a : a + n] for k, a, n in self.slot_columns}
        return rows[..., : self.dim], slots

    def join(self, params, slots: dict, rows):
        """Whole rows: `params` and `slots` in their columns, `rows`' other columns kept."""
        parts, at = [params.astype(rows.dtype)], self.dim
        for k, a, n in self.slot_columns:
            if a > at:
                parts.append(rows[..., at:a])
            parts.append(slots[k].astype(rows.dtype))
            at = a + n
        if at < rows.shape[-1]:
            parts.append(rows[..., at:])
        return jnp.concatenate(parts, axis=-1)

    def update_rows(self, rows, slots, grads, step):
        """`optimizer.update_rows` on the parameter and slot columns of `rows`
        [..., width]; `grads` [..., dim] (or wider: its first `dim` columns, the dense
        update's). Returns `(new rows, {})`."""
        if slots:
            raise ValueError(f"slots are in the rows here; got slot arrays {sorted(slots)}")
        grads = grads[..., : self.dim]
        params, kept = self.split(rows)
        new_params, new_slots = self.optimizer.update_rows(params, kept, grads, step)
        return self.join(new_params, new_slots, rows), {}

    def update_rows_at_lr(self, rows, slots, grads, lr):
        params, kept = self.split(rows)
        new_params, new_slots = self.optimizer.update_rows_at_lr(
            params, kept, grads[..., : self.dim], lr
        )
        return self.join(new_params, new_slots, rows), {}


def device_optimizer(spec, optimizer):
    """What the device programs of stack `spec` run: `optimizer`, or where the stack keeps
    its slots in its rows, `SlotsInRows` of it."""
    if optimizer is None or not spec.slot_columns:
        return optimizer
    return SlotsInRows(optimizer, spec.dim, spec.width, tuple(spec.slot_columns))


def initial_row(spec, optimizer):
    """The value each column of a row starts at: 0 for the parameters and the padding,
    each slot's initial value in its columns (a float where the stack keeps its slots
    apart: 0)."""
    if not spec.slot_columns:
        return 0.0
    row = [0.0] * spec.width
    for k, a, n in spec.slot_columns:
        row[a : a + n] = [float(optimizer.slot_initial_values[k])] * n
    return row
