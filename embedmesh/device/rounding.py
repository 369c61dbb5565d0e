"""Low-precision training tables: updates in float32, stored with stochastic rounding.

A table whose `TableConfig.dtype` is bfloat16 or float16 keeps its rows in that type
(and its optimizer slots too where `TableConfig.slot_dtype` says so). Its stack's device
programs run `Rounded(optimizer, ...)`: its `update_rows` takes the touched rows and
slots, converts them to float32, applies the optimizer there (`Optimizer.update_rows`,
all float32), and rounds each new value to its array's dtype *stochastically*: a value
`x` between the two neighbouring representable values `lo < x < hi` becomes `hi` with
probability `(x - lo) / (hi - lo)`, else `lo` (values already representable, NaN and
infinities are kept; a value past the type's largest finite one rounds as the nearest
rounding does). So `E[round(x)] = x`: small updates are not lost to rounding on average,
where the nearest rounding would drop every update smaller than half a unit in the last
place.

The generator (`random_bits`): a counter-based hash, no state. Each value's 32 random
bits are `lowbias32` (Chris Wellons' integer mixer, a bijection of uint32) absorbed over
the words `(seed, step, field, table, row, column)`: the engine's seed
(`EmbeddingCore(rounding_seed=)`, `MeshEmbedding(seed=)`), the update's step count,
the array (0: the parameters, 1 + i: the optimizer's i-th slot), the table's index in
the resolved config, the row's logical id in its table and the column in that array (a
slot kept in the table's rows, `slots_in_rows`, counts as its own array: the same bits
in either layout). The row and table are logical (the layout's inverse,
`RowLayout.logical_rows_from_params`, applied on the device to the local rows it
updates), so a given seed rounds the same values the same way
on any number of devices and under every sharding strategy; a data-parallel table's
replicas all take the canonical copy's rows, and stay bit-equal. The uniform in [0, 1)
compared with the probability is the hash's top 24 bits times 2^-24.

Where it runs: the ops' references (`ops.sparse_update`'s reference passes the row ids
to `update_rows`; the dense update of optimizers that move every row passes every row),
and on CPU the fused C++ updates (`cpu/update.cc`, `Updater<Rule, T, S>`): a `Rounded`'s
`fused_kernel` is its optimizer's (slots apart, the mod layout), and the kernel is given
`rounding_words(step)` (the seed, step, shard and each table's index, local offset and
layout parameters), from which it computes the same logical rows and the same bits and
rounds the same way (tests/device/test_low_precision.py checks it bit for bit). The kernel's
float32 arithmetic before the rounding is the float32 kernel's: the same operations as
`update_rows`, but XLA's CPU code contracts multiply-adds into FMAs and takes an
approximate `rsqrt`, so the two can differ in the last float32 bit (as for float32
tables), and a rounding then rarely differs by one spacing. The GPU and TPU run the
references; lookups run their references where a platform's kernel reads float32 tables
only (the CPU's); rows cross devices in the storage type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Rounded", "device_optimizer", "random_bits", "stochastic_round"]

# Odd constants that tell the absorbed words apart (the golden ratio's, and others')
_WORD_KEYS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)


def _mix(h):
    """lowbias32: a bijection of uint32 with strong avalanche (Wellons, 2018)."""
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> jnp.uint32(15))
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> jnp.uint32(16))


def _u32(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.uint32:
        return x
    return jax.lax.convert_element_type(x.astype(jnp.int32), jnp.uint32)


def random_bits(seed: int, step, field, table, row, column):
    """uint32 random bits for each value, broadcast over the arguments' shapes: the hash
    of `(seed, step, field, table, row, column)` (the module docstring); every word an
    integer (the seed's low and high 32 bits both count)."""
    seed = int(seed)
    h = _mix(jnp.uint32(seed & 0xFFFFFFFF) ^ _mix(jnp.uint32((seed >> 32) & 0xFFFFFFFF)))
    for key, word in zip(_WORD_KEYS[1:], (step, field, table, row, column)):
        h = _mix(h ^ _mix(_u32(word) + jnp.uint32(key)))
    return h


def stochastic_round(x, dtype, bits):
    """`x` (float32) rounded to `dtype` (bfloat16 or float16; float32: `x` itself) up or
    down at random: to the neighbour farther from `x` with probability `|x - near| /
    |other - near|`, chosen by the uniform `(bits >> 8) * 2^-24` (`bits` uint32, shaped
    like `x` or broadcasting to it)."""
    dtype = jnp.dtype(dtype)
    x = jnp.asarray(x, jnp.float32)
    if dtype == jnp.float32:
        return x
    if dtype.itemsize != 2:
        raise ValueError(f"stochastic rounding to {dtype} is not supported (bfloat16, float16)")
    near = x.astype(dtype)
    near_f = near.astype(jnp.float32)
    # the other neighbour: one step away from `near` on x's side (the encodings of one
    # sign are monotonic in magnitude; from +-0 the step is to x's sign's smallest value)
    up = jnp.abs(near_f) < jnp.abs(x)
    code = jax.lax.bitcast_convert_type(near, jnp.int16)
    other = jax.lax.bitcast_convert_type(code + jnp.where(up, jnp.int16(1), jnp.int16(-1)), dtype)
    other_f = other.astype(jnp.float32)
    p = jnp.abs(x - near_f) / jnp.abs(other_f - near_f)
    u = (jnp.broadcast_to(bits, x.shape) >> jnp.uint32(8)).astype(jnp.float32) * (2.0**-24)
    keep = (near_f == x) | ~jnp.isfinite(x) | ~jnp.isfinite(near_f) | ~jnp.isfinite(other_f)
    return jnp.where(keep | (u >= p), near, other)


@dataclasses.dataclass(frozen=True)
class Rounded:
    """`optimizer` (a device optimizer: an `Optimizer` or `SlotsInRows`) applied in float32
    to a stack stored in a low-precision dtype, each new value stochastically rounded to
    its array's dtype (the module docstring).

    Hashable (a static parameter of the ops). `tables`: `((table index, local row offset,
    rows per shard, the layout's kernel params, replicated), ...)` of the stack's tables,
    from which the local rows an update touches are mapped back to logical rows;
    `axis_name`: the mesh axes (the shard's index inside `shard_map`), None on one shard.
    `fused_kernel`: the optimizer's (the CPU's fused updates round as `update_rows`, given
    `rounding_words`), None for slots kept in the rows or a layout other than "mod"."""

    optimizer: Any
    seed: int
    tables: tuple
    layout: Any
    axis_name: Any = None

    takes_ids: ClassVar[bool] = True  # `update_rows` wants the rows' ids (`ops.sparse_update`)

    @property
    def fused_kernel(self) -> str | None:
        """The optimizer's fused kernel (`SlotsInRows` has none), where the kernels can
        compute the layout's logical rows (the mod rule, `cpu/updater.h`'s `Rounding`)."""
        if getattr(self.layout, "name", None) != "mod":
            return None
        return getattr(self.optimizer, "fused_kernel", None)

    def fused_attrs(self, step) -> dict:
        return self.optimizer.fused_attrs(step)

    def fused_rule_attrs(self) -> dict:
        return self.optimizer.fused_rule_attrs()

    def rounding_words(self, step):
        """int32 [5 + 8 * tables]: what a fused kernel rounds by (`cpu/updater.h`'s
        `Rounding`): `[step, shard, seed low 32 bits, seed high 32 bits, tables]`, then per
        table `(index, local row offset, rows per shard, replicated, k, rotation, first,
        vocabulary size)` (the mod layout's kernel params, `logical_rows`' arguments)."""
        seed = int(self.seed)
        words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, len(self.tables)]
        for index, offset, rows, params, replicated in self.tables:
            words += [index, offset, rows, int(bool(replicated)), *params]
        static = np.asarray(words, np.int64).astype(np.uint32).view(np.int32)
        shard = jnp.int32(0) if self.axis_name is None else jax.lax.axis_index(self.axis_name)
        return jnp.concatenate(
            [
                jnp.asarray(step, jnp.int32).reshape(1),
                jnp.asarray(shard, jnp.int32).reshape(1),
                jnp.asarray(static),
            ]
        )

    @property
    def slot_names(self) -> tuple:
        return tuple(self.optimizer.slot_names)

    @property
    def touches_all_rows(self) -> bool:
        return self.optimizer.touches_all_rows

    @property
    def slot_initial_values(self):
        return self.optimizer.slot_initial_values

    def slot_width(self, slot: str, dim: int) -> int:
        return self.optimizer.slot_width(slot, dim)

    def learning_rate_at(self, step):
        return self.optimizer.learning_rate_at(step)

    def logical_rows(self, ids):
        """`(table index, logical row)` int32 of this shard's local rows `ids` (-1, -1 for
        rows of no table: padding)."""
        ids = ids.astype(jnp.int32)
        shard = jnp.int32(0) if self.axis_name is None else jax.lax.axis_index(self.axis_name)
        table = jnp.full(ids.shape, -1, jnp.int32)
        row = jnp.full(ids.shape, -1, jnp.int32)
        for index, offset, rows, params, replicated in self.tables:
            block = ids - jnp.int32(offset)
            inside = (block >= 0) & (block < rows)
            at = jnp.int32(params[2]) if replicated else shard  # replicas: the canonical copy
            logical = self.layout.logical_rows_from_params(
                tuple(jnp.int32(p) for p in params), at, block
            )
            mine = inside & (logical < params[3])
            table = jnp.where(mine, jnp.int32(index), table)
            row = jnp.where(mine, logical.astype(jnp.int32), row)
        return table, row

    def _slot_order(self) -> tuple:
        """The optimizer's slots in order (a `SlotsInRows`' optimizer's)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return tuple(inner.slot_names)

    def _words(self, field: int, width: int) -> tuple:
        """(field [width], column [width]) of each column of an array: `field` and the
        columns themselves, or where the slots are in the rows (`SlotsInRows`), each slot's
        columns as its own array's (1 + its index, from 0): the same bits as with the
        slots apart."""
        fields = np.full(width, field, np.int32)
        columns = np.arange(width, dtype=np.int32)
        order = self._slot_order()
        for k, a, w in getattr(self.optimizer, "slot_columns", ()):
            fields[a : a + w] = 1 + order.index(k)
            columns[a : a + w] = np.arange(w)
        return jnp.asarray(fields), jnp.asarray(columns)

    def round(self, values, dtype, step, field: int, table, row):
        """`values` [n, w] (float32) stochastically rounded to `dtype`, row i being logical
        row `row[i]` of table `table[i]` (`field`: 0 the parameters, 1 + i slot i)."""
        if jnp.dtype(dtype) == jnp.float32:
            return values.astype(jnp.float32)
        fields, columns = self._words(field, values.shape[-1])
        bits = random_bits(
            self.seed, step, fields[None, :], table[..., None], row[..., None], columns[None, :]
        )
        return stochastic_round(values, dtype, bits)

    def update_rows(self, rows, slots, grads, step, ids=None):
        """The optimizer's update of `rows` (and `slots`) in float32, the results rounded
        stochastically to the arrays' dtypes; `ids`: the local rows `rows` are (required)."""
        if ids is None:
            raise ValueError("Rounded.update_rows needs the rows' ids (ops.sparse_update)")
        names = self._slot_order()
        new_rows, new_slots = self.optimizer.update_rows(
            rows.astype(jnp.float32),
            {k: v.astype(jnp.float32) for k, v in slots.items()},
            grads,
            step,
        )
        table, row = self.logical_rows(ids)
        step = jnp.asarray(step, jnp.int32)
        out_rows = self.round(new_rows, rows.dtype, step, 0, table, row)
        out_slots = {
            k: self.round(new_slots[k], slots[k].dtype, step, 1 + names.index(k), table, row)
            for k in slots
        }
        return out_rows, out_slots


def device_optimizer(plan, spec, optimizer, axis_name, seed: int):
    """What stack `spec`'s device programs run for `optimizer` (already its
    `slots_in_rows.device_optimizer`): `Rounded` of it where the stack's rows or slots
    are not float32, else `optimizer` itself. `axis_name`: the mesh axes (None or one
    shard: shard 0)."""
    if optimizer is None:
        return None
    if np.dtype(spec.dtype) == np.float32 and spec.slots_dtype == np.float32:
        return optimizer
    layout = plan.row_layout
    tables = []
    for name in spec.tables:
        t = plan.table(name)
        params = tuple(int(p) for p in layout.kernel_params(t))
        tables.append((t.index, t.local_row_offset, t.rows_per_shard, params, t.replicated))
    return Rounded(
        optimizer,
        int(seed),
        tuple(tables),
        layout,
        axis_name if plan.num_shards > 1 else None,
    )
