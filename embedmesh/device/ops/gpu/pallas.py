"""Pallas (Triton) kernels of the device ops: one program per output row, no atomics.

Every kernel here reads the pairs of a row through a CSR view made in XLA
outside it (`csr_pairs`: a stable argsort of the pairs by destination, the
segment starts by `searchsorted`), so each output row is owned by exactly one
program, which loops over its pairs (`fori_loop` with dynamic bounds), loads
each source row (`ref[pl.ds(row, 1), :]`), accumulates in float32 and stores
the row once. No atomics: the result is deterministic, and each row sums in
pair order, as the op's docstring says.

- `segment_gather_sum(_mapped)`: one program per segment;
- `backward_update`: one program per unique row: its gradient from its pairs,
  then the optimizer on the table and slot rows at `ids[u]`, stored in place
  (`input_output_aliases`); no [U, D] gradient buffer;
- `sparse_update`: one program per row, `grads[u]` and the rows at `ids[u]`.

The optimizer arithmetic is `Optimizer.update_rows_at_lr` on the loaded [1, D]
rows; the learning rate is computed outside (it may be a schedule or a host
callback) and passed as a one-element array. Whole arrays are passed
unblocked: Pallas computes a ref's element offsets in 32 bits, or in 64 bits
for an array over 4 GiB, such as the GPU benchmark's 16M x 128 stacked table
(8.2 GB; `tests/device/test_gpu_ops.py` lowers the kernels at its shapes).
`supports` asks for float32, a power-of-two dim (a Triton block) and fewer
than 2**31 elements an array (row indices are int32; nothing larger has been
lowered).

Since jax 0.11 Pallas's Triton backend is deprecated (a `DeprecationWarning`
at lowering; Mosaic GPU is its successor), and its lowering takes the GPU
model from the default device or an abstract mesh's device (the tests lower
for an H200 on CPU that way).

`INTERPRET = True` runs every kernel through Pallas's interpreter (on CPU:
what the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from embedmesh._runtime import PAD_ID
from embedmesh.device.ops.gpu import xla
from embedmesh.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, RowWiseAdagrad

__all__ = [
    "INTERPRET",
    "KERNELS",
    "backward_update",
    "csr_pairs",
    "segment_gather_sum",
    "segment_gather_sum_mapped",
    "sparse_update",
]

INTERPRET = False  # run the kernels in Pallas's interpreter (any backend)

# The optimizers whose `update_rows_at_lr` is known to lower to Triton (elementwise
# jax.numpy only); a subclass may change the rule, so it takes the XLA path.
_OPTIMIZERS = (SGD, Adagrad, AdagradMomentum, Adam, FTRL, RowWiseAdagrad)

_MAX_ELEMENTS = 2**31  # an array's elements (int32 row indices)


def _num_warps(dim: int) -> int:
    """Warps of a program that moves [1, dim] rows: one per 256 floats, 1 to 8."""
    return max(1, min(8, dim // 256))


def _call(kernel, out_shape, grid: int, dim: int, aliases=None):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(grid,),
        input_output_aliases=aliases or {},
        interpret=INTERPRET,
        compiler_params=plt.CompilerParams(num_warps=_num_warps(dim)),
    )


def csr_pairs(valid, dst_idx, rows, gains, num_segments: int):
    """The pairs sorted (stably) by destination, as CSR: (starts [S + 1], rows, gains).

    Segment s owns the pairs `starts[s]:starts[s + 1]` of the sorted `rows`
    (clamped to 0 where invalid) and `gains`; invalid pairs sort last, past
    `starts[S]`. The arrays have at least one element (a kernel cannot take an
    empty one).
    """
    key = jnp.where(valid, dst_idx, num_segments).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    starts = jnp.searchsorted(
        key[order], jnp.arange(num_segments + 1, dtype=jnp.int32), side="left"
    ).astype(jnp.int32)
    rows = jnp.where(valid, rows, 0).astype(jnp.int32)[order]
    gains = jnp.where(valid, gains, 0.0).astype(jnp.float32)[order]
    if rows.shape[0] == 0:
        rows, gains = jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.float32)
    return starts, rows, gains


def _segment_row(starts_ref, rows_ref, gains_ref, src_ref, s, dim: int):
    """The float32 [1, dim] sum of segment `s`'s pairs, in pair order."""

    def add(p, acc):
        row = rows_ref[p]
        return acc + src_ref[pl.ds(row, 1), :].astype(jnp.float32) * gains_ref[p]

    zero = jnp.zeros((1, dim), jnp.float32)
    return jax.lax.fori_loop(starts_ref[s], starts_ref[s + 1], add, zero)


def _segment_kernel(starts_ref, rows_ref, gains_ref, src_ref, out_ref):
    s = pl.program_id(0)
    out_ref[pl.ds(s, 1), :] = _segment_row(
        starts_ref, rows_ref, gains_ref, src_ref, s, out_ref.shape[1]
    )


def _segment_sum(src, rows, gains, valid, dst_idx, num_segments: int):
    dim = src.shape[1]
    if num_segments == 0:
        return jnp.zeros((0, dim), jnp.float32)
    starts, rows, gains = csr_pairs(valid, dst_idx, rows, gains, num_segments)
    out = jax.ShapeDtypeStruct((num_segments, dim), jnp.float32)
    return _call(_segment_kernel, out, num_segments, dim)(starts, rows, gains, src)


# the reference's sums, one program per segment
segment_gather_sum, segment_gather_sum_mapped = xla.segment_sums(_segment_sum)


def _update_row(optimizer, names, lr_ref, target, grad, table_ref, slot_refs, outs):
    """Apply `optimizer` to the table and slot rows at `target` with `grad`, in place."""
    rows = pl.ds(target, 1)
    slots = {k: ref[rows, :] for k, ref in zip(names, slot_refs, strict=True)}
    new_w, new_slots = optimizer.update_rows_at_lr(table_ref[rows, :], slots, grad, lr_ref[0])
    outs[0][rows, :] = new_w
    for k, ref in zip(names, outs[1:], strict=True):
        ref[rows, :] = new_slots[k]


def _sparse_update_kernel(optimizer, names, targets_ref, grads_ref, lr_ref, table_ref, *refs):
    slot_refs, outs = refs[: len(names)], refs[len(names) :]
    u = pl.program_id(0)
    target = targets_ref[u]

    @pl.when(target >= 0)
    def _():
        grad = grads_ref[pl.ds(u, 1), :].astype(jnp.float32)
        _update_row(optimizer, names, lr_ref, target, grad, table_ref, slot_refs, outs)


def _backward_update_kernel(
    optimizer,
    names,
    starts_ref,
    rows_ref,
    gains_ref,
    act_ref,
    targets_ref,
    lr_ref,
    table_ref,
    *refs,
):
    slot_refs, outs = refs[: len(names)], refs[len(names) :]
    u = pl.program_id(0)
    target = targets_ref[u]

    @pl.when(target >= 0)
    def _():
        grad = _segment_row(starts_ref, rows_ref, gains_ref, act_ref, u, table_ref.shape[1])
        _update_row(optimizer, names, lr_ref, target, grad, table_ref, slot_refs, outs)


def _targets(ids, num_rows: int, canonical=None):
    """The row each program updates: `ids[u]`, or -1 to skip (PAD_ID, out of range, or
    not the first occurrence of a repeated id when `canonical` is given)."""
    ok = xla.in_range(ids, num_rows) & (ids != PAD_ID)
    if canonical is not None:
        ok &= canonical == jnp.arange(ids.shape[0], dtype=jnp.int32)
    return jnp.where(ok, ids, -1).astype(jnp.int32)


def _first_occurrence(ids):
    """For each position u, the first position holding the same id as `ids[u]`."""
    n = ids.shape[0]
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    group_start = jax.lax.cummax(jnp.where(starts, jnp.arange(n, dtype=jnp.int32), 0))
    first = order[group_start].astype(jnp.int32)
    return jnp.zeros((n,), jnp.int32).at[order].set(first, unique_indices=True)


def _in_place(table, slots, names, kernel, grid: int, leading: tuple):
    """Run `kernel(*leading, table, *slots, -> table, *slots)` with the table and
    slots aliased to the outputs; returns (table, slots)."""
    dim = table.shape[1]
    shapes = [jax.ShapeDtypeStruct(table.shape, table.dtype)] + [
        jax.ShapeDtypeStruct(slots[k].shape, slots[k].dtype) for k in names
    ]
    first = len(leading)
    aliases = {first + i: i for i in range(len(shapes))}
    outs = _call(kernel, shapes, grid, dim, aliases)(*leading, table, *(slots[k] for k in names))
    return outs[0], dict(zip(names, outs[1:], strict=True))


def sparse_update(table, slots, ids, grads, *, optimizer, step):
    """`sparse_update` fused: one program per row of `ids` (distinct), in place."""
    names = tuple(optimizer.slot_names)
    if ids.shape[0] == 0:
        return table, dict(slots)
    lr = optimizer.learning_rate_at(step).reshape(1)
    kernel = functools.partial(_sparse_update_kernel, optimizer, names)
    leading = (_targets(ids, table.shape[0]), grads.astype(jnp.float32), lr)
    return _in_place(table, slots, names, kernel, ids.shape[0], leading)


def backward_update(
    table, slots, ids, act_grads, pair_rows, pair_unique, pair_gains, *, optimizer, step
):
    """`backward_update` fused: one program per unique row, its gradient summed from its
    pairs (repeated ids: their pairs go to the first occurrence), then updated in place."""
    names = tuple(optimizer.slot_names)
    num_unique = ids.shape[0]
    if num_unique == 0:
        return table, dict(slots)
    first = _first_occurrence(ids)
    valid = xla.in_range(pair_rows, act_grads.shape[0]) & xla.in_range(pair_unique, num_unique)
    dst = jnp.take(first, jnp.where(valid, pair_unique, 0), mode="clip")
    starts, rows, gains = csr_pairs(valid, dst, pair_rows, pair_gains, num_unique)
    lr = optimizer.learning_rate_at(step).reshape(1)
    kernel = functools.partial(_backward_update_kernel, optimizer, names)
    leading = (starts, rows, gains, act_grads, _targets(ids, table.shape[0], first), lr)
    return _in_place(table, slots, names, kernel, num_unique, leading)


# ---------------------------------------------------------------------------
# Which calls the kernels take


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fits(*arrays) -> bool:
    """float32 [n >= 1, power-of-two dim] arrays of fewer than 2**31 elements."""
    return all(
        a.ndim == 2
        and a.dtype == jnp.float32
        and a.shape[0] >= 1
        and _power_of_two(a.shape[1])
        and a.size < _MAX_ELEMENTS
        for a in arrays
    )


def _takes_segment_sum(src, *args, num_segments: int) -> bool:
    """float32 `src` and output [num_segments, D] as `_fits` says."""
    return _fits(src) and num_segments * src.shape[1] < _MAX_ELEMENTS


def _takes_update(table, slots, ids, *args, optimizer, step) -> bool:
    """One of the six optimizers, its slots (each [rows, its slot_width]: the table's
    dim, or 1 for a row slot), all float32 as `_fits` says (and the [U, D] gradients of
    `sparse_update` too)."""
    slot_arrays = list(slots.values())
    rows, dim = table.shape
    return (
        type(optimizer) in _OPTIMIZERS
        and ids.shape[0] * table.shape[-1] < _MAX_ELEMENTS
        and set(slots) == set(optimizer.slot_names)
        and all(v.shape == (rows, optimizer.slot_width(k, dim)) for k, v in slots.items())
        and _fits(table, *slot_arrays)
    )


def _takes_backward_update(table, slots, ids, act_grads, *args, optimizer, step) -> bool:
    return (
        _takes_update(table, slots, ids, optimizer=optimizer, step=step)
        and act_grads.shape[1:] == table.shape[1:]
        and _fits(act_grads)
    )


KERNELS = {
    "segment_gather_sum": (segment_gather_sum, _takes_segment_sum),
    "segment_gather_sum_mapped": (segment_gather_sum_mapped, _takes_segment_sum),
    "sparse_update": (sparse_update, _takes_update),
    "backward_update": (backward_update, _takes_backward_update),
}
