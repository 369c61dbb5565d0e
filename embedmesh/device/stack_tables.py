"""Stack <-> table arrays on the devices: the one home of the conversion.

A stack array is `[N * rows_per_shard, dim]`, row-sharded over the mesh; table `t`'s
block on shard j sits at local rows `[t.local_row_offset, t.local_row_offset +
t.rows_per_shard)`, its rows placed by the plan's `RowLayout` (`embedmesh.layout.sharding`
does the same arithmetic on the host, in numpy, and computes the pieces here).

- `make_stack_array`: a stack array built shard by shard from tables' pieces
  (`EmbeddingCore.init`, `state_from_tables`);
- `read_table`: one table's logical `[V, dim]` rows on the host (`EmbeddingCore.read_table`:
  `embedding_tables`, `variables`, ...);
- `table_block_array` / `write_table`: a table's `[N * rows_per_shard, ...]` blocks sliced
  out of, or written into, a stack on its own devices (checkpoints save and restore through
  them).

`core` is an `EmbeddingCore` (its plan, mesh, axes and shardings).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from embedmesh.device import ops
from embedmesh.layout import sharding as mod_sharding

__all__ = [
    "logical_rows",
    "make_stack_array",
    "read_table",
    "table_block_array",
    "write_table",
]


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buf, rows, offset, column):
    """`buf` with `rows` written at row `offset`, column `column` (in place: donated)."""
    return jax.lax.dynamic_update_slice(buf, rows, (offset, column))


def make_stack_array(
    core, stack: str, default, pieces, width: int | None = None, dtype=None
) -> jax.Array:
    """Global stack array of `core`: each local shard j starts as `default` (a value, or
    one a column) on its device and receives `pieces(j, device)`, an iterable of `(row
    offset, [rows, dim_t] array)` or `(row offset, rows, first column)`, written in place
    one at a time.

    A shard of `ops.HUGE_PAGE_MIN_BYTES` or more is built on its device: building it
    holds the shard plus one table's piece of it, not a host copy of the whole shard as
    well (2x less peak memory), and big CPU shards are on transparent huge pages (random
    row access 1.2x faster here) in buffers XLA owns, so the first donated step updates
    in place. A smaller shard is assembled on the host and sent once: on the devices, its
    fill and each write were small programs compiled for every device (an 8-device
    engine's build compiled them 8 times over).
    `width`: the columns of the array (default the stack's table array's, `spec.width`;
    a slot's: its own); `dtype`: its type (default the stack's table dtype, `spec.dtype`;
    a slot's: `spec.slots_dtype`).
    """
    spec = core.plan.stack(stack)
    dtype = spec.dtype if dtype is None else dtype
    S = spec.rows_per_shard
    pack = spec.pack if width is None else 1  # packed narrow rows: the table array's
    width = spec.width if width is None else int(width)
    shape = (spec.num_rows // pack, width * pack)
    # packed: the logical shard built on the host, then stored as its reshape (no copy)
    on_host = pack > 1 or S * width * np.dtype(dtype).itemsize < ops.HUGE_PAGE_MIN_BYTES
    # a value a column (slots in the rows) is broadcast by XLA: the kernels fill scalars
    min_bytes = {} if np.ndim(default) == 0 else {"min_bytes": float("inf")}
    datas = []
    for device, index in core.row_sharding.addressable_devices_indices_map(shape).items():
        j = (index[0].start or 0) // (S // pack)  # stored rows a shard
        if on_host:
            host = _host_shard((S, width), default, dtype, pieces(j, device))
            datas.append(jax.device_put(host.reshape(S // pack, width * pack), device))
            continue
        buf = ops.full((S, width), default, dtype, device, **min_bytes)
        for offset, rows, *column in pieces(j, device):
            rows = jax.device_put(rows, device)
            col = jnp.int32(column[0] if column else 0)
            buf = _write_rows(buf, rows.astype(dtype), jnp.int32(offset), col)
        datas.append(buf)
    return jax.make_array_from_single_device_arrays(shape, core.row_sharding, datas)


def _host_shard(shape, default, dtype, pieces) -> np.ndarray:
    """One shard as `make_stack_array` builds it on a device, in numpy: `default`
    broadcast, then each piece (converted to `dtype` as XLA converts: round to nearest
    even) at its row offset and column; a piece past the shard's end is refused (XLA's
    update would clamp it into place)."""
    out = np.empty(shape, dtype)
    out[...] = np.asarray(default, dtype)
    for offset, rows, *column in pieces:
        rows = np.asarray(rows).astype(dtype)
        col = int(column[0]) if column else 0
        end, stop = int(offset) + rows.shape[0], col + rows.shape[1]
        if offset < 0 or col < 0 or end > shape[0] or stop > shape[1]:
            raise ValueError(
                f"a piece of rows [{offset}, {end}) x columns [{col}, {stop}) "
                f"does not fit a shard of {shape}"
            )
        out[offset:end, col:stop] = rows
    return out


def read_table(
    core, stack_array: jax.Array, table, column: int = 0, width: int | None = None
) -> np.ndarray:
    """The logical `[V, width]` numpy array of one table from a stack array of `core`: its
    columns `[column, column + width)` (default: from 0, the table's dim or what the
    array has)."""
    plan = core.plan
    t = plan.table(table)
    cols = slice(column, column + (t.dim if width is None else width))
    arr = stack_array
    if not arr.is_fully_addressable:
        arr = jax.jit(lambda a: a, out_shardings=core.replicated)(arr)
    spec = plan.stack(t.stack)
    S = spec.rows_per_shard // spec.pack  # stored rows a shard
    shards = [None] * core.num_shards
    seen = set()
    for shard in arr.addressable_shards:
        start = shard.index[0].start or 0
        j = start // S if shard.data.shape[0] == S else None
        if j is None:  # replicated: the whole stack on one device
            full = logical_rows(spec, np.asarray(shard.data))
            S = spec.rows_per_shard
            for jj in range(core.num_shards):
                shards[jj] = full[
                    jj * S + t.local_row_offset : jj * S + t.local_row_offset + t.rows_per_shard,
                    cols,
                ]
            break
        if j in seen:
            continue
        seen.add(j)
        shards[j] = logical_rows(spec, np.asarray(shard.data))[
            t.local_row_offset : t.local_row_offset + t.rows_per_shard, cols
        ]
    return mod_sharding.shards_to_table(shards, plan, t)


def logical_rows(spec, x):
    """A stack's (shard of its) table array `x` as its logical rows `[rows, spec.width]`:
    packed narrow rows unpacked (a reshape: free in numpy, a copy in XLA), else `x`."""
    if spec.pack == 1 or x.ndim != 2:
        return x
    return x.reshape(x.shape[0] * spec.pack, x.shape[1] // spec.pack)


@functools.cache
def _slicer(mesh, axes, rows: int, dim: int | None, pack: int = 1):
    """jit: (stack [N*S, D], lo) -> table [N*rows, dim], each device slicing its own shard.

    `lo` (the table's first local row) is an argument, not a constant, so one
    program serves every table of the same shape (was: one compile per table).
    """

    def body(x, lo, col):
        if x.ndim == 2:
            x = x.reshape(x.shape[0] * pack, x.shape[1] // pack)  # packed: its logical rows
            return jax.lax.dynamic_slice(x, (lo, col), (rows, dim))
        return jax.lax.dynamic_slice(x, (lo,), (rows,))

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(axes), P(), P()), out_specs=P(axes), check_vma=False
        )
    )


@functools.cache
def _writer(mesh, axes, donate: bool = True, spanned: bool = False, pack: int = 1):
    """jit: write a table's [N*rows, dim] blocks into a stack at local row `lo` of every
    shard (`lo` an argument: one compile per shape, not per table). `donate=True` writes
    in place (the stack is consumed); `donate=False` leaves the stack intact and returns a
    new array (restore's first write into a live stack, see
    `embedmesh.checkpoint.core_restore`). `spanned`: the
    table has blocks only on shards `[first, first + span)` (two more arguments); the
    other shards keep their rows there (other tables' rows)."""

    def body(stack, piece, lo, col, first=None, span=None):
        if pack > 1:  # packed narrow rows: written as logical rows, stored packed again
            rows, lanes = stack.shape
            logical = stack.reshape(rows * pack, lanes // pack)
            return write(logical, piece, lo, col, first, span).reshape(rows, lanes)
        return write(stack, piece, lo, col, first, span)

    def write(stack, piece, lo, col, first, span):
        piece = piece.astype(stack.dtype)
        start = (lo, col) if stack.ndim == 2 else (lo,)
        if spanned:
            j = jax.lax.axis_index(axes)
            inside = (j >= first) & (j < first + span)
            piece = jnp.where(inside, piece, jax.lax.dynamic_slice(stack, start, piece.shape))
        return jax.lax.dynamic_update_slice(stack, piece, start)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(axes), P(axes), P(), P()) + ((P(), P()) if spanned else ()),
            out_specs=P(axes),
            check_vma=False,
        ),
        donate_argnums=0 if donate else (),
    )


def write_table(core, stack_array, piece, t, donate: bool, column: int = 0) -> jax.Array:
    """`stack_array` with table `t`'s `[N * rows_per_shard, ...]` blocks `piece` written at
    its local rows from column `column` (a slot kept in the rows: its first), on the
    shards of its span only (every shard for a replica)."""
    lo, col = np.int32(t.local_row_offset), np.int32(column)
    pack = _pack_of(core, stack_array, t)
    if t.span == core.num_shards or t.replicated:
        return _writer(core.mesh, core.axes, donate, False, pack)(stack_array, piece, lo, col)
    return _writer(core.mesh, core.axes, donate, True, pack)(
        stack_array, piece, lo, col, np.int32(t.first_shard), np.int32(t.span)
    )


def table_block_array(
    core, stack_array: jax.Array, t, column: int = 0, width: int | None = None
) -> jax.Array:
    """The table's `[N * rows_per_shard, width]` array (default width: its dim, or what
    the array has) sliced out of its stack on device, from column `column`."""
    spec = core.plan.stack(t.stack)
    pack = _pack_of(core, stack_array, t)
    if stack_array.ndim == 2:
        dim = min(t.dim if width is None else width, stack_array.shape[1] // pack - column)
    else:
        dim = None
    if (
        pack == 1
        and len(spec.tables) == 1
        and t.local_row_offset == 0
        and t.rows_per_shard == spec.rows_per_shard
        and column == 0
        and (dim is None or dim == stack_array.shape[1])
    ):
        return stack_array  # the stack is exactly this table: no copy
    return _slicer(core.mesh, core.axes, t.rows_per_shard, dim, pack)(
        stack_array, np.int32(t.local_row_offset), np.int32(column)
    )


def _pack_of(core, stack_array, t) -> int:
    """The logical rows a stored row of `stack_array` holds: the stack's `pack` for its
    table array (packed narrow rows), 1 for a slot's array."""
    spec = core.plan.stack(t.stack)
    packed = stack_array.ndim == 2 and stack_array.shape[0] * spec.pack == spec.num_rows
    return spec.pack if packed else 1
