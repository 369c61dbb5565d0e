"""Checkpoints of embedding state with orbax-checkpoint, portable across device counts.

Two entry points over one implementation:

- the functional core (`EmbeddingCore` + `EmbeddingState`, e.g. inside a
  user's own jitted train step): `core_state_tree(core, state)`,
  `core_save_args(core, state)`, `core_save(target, core, state)` and
  `core_restore(core, state, source) -> RestoredState` (the restored
  `.state`, the `.step`, and for a pipelined run the `.lookup_tables` its
  next lookup reads). Pure: the given state is never changed or donated.
- the stateful facade (`MeshEmbedding`): `state_tree(emb)`, `save_args(emb)`,
  `save(target, emb)` and `restore(emb, source) -> step`, thin wrappers that
  take the state (and a pending pipelined update's lookup tables) from `emb`
  and install the restored state in it.

Everything a checkpoint records comes from the core and its `StackingPlan`
(tables, stacks, row layout, optimizers, the resolved feature config) and
from the state (slots, step).

Layout. The embedding state is saved as one orbax pytree (the *embedding
item*), stored per table rather than per stack, so that it restores into any
number of devices and any stacking:

    {"tables": {key: [R, dim]},          # sharded jax.Arrays
     "slots":  {key: {slot name: [R, dim]}},
     "step":   int64 scalar,
     "meta":   uint8 [bytes of a JSON document],
     "lookup_tables": {key: [R, dim]}}  # pipelined, update pending

(`R = k * rows_per_shard` rounded up to a multiple of N, `k` the shards of the
table's span: `N * rows_per_shard` for a "mod" table, `V` plus fewer than N
zero rows for a "table_wise" one.)

"tables", "slots" and "step" hold every accepted update. A pipelined run saved
with an update pending (its next lookup reads the tables one update stale)
also stores "lookup_tables": the parameters that next lookup reads, for the
tables of the stacks the pending update touches. A pipelined restore installs
those for one lookup and the saved state right after it, so the run resumes
exactly where it was (bit-identical on the same mesh and stacking); an
unpipelined restore and serving ignore them. Saving never applies the
pending update early.

Block b of a table's array (rows `[b * rows_per_shard, (b+1) * rows_per_shard)`,
b < k) holds the table's block on shard `first_shard + b` of the saving mesh, as
the plan's row layout (`embedmesh.layout.rows`) places it: only the shards of
the table's span, so a table-wise table is stored as its `[V, dim]` rows alone
(no other table's rows, not N times its size). The stored array is the table
in the mod layout over `k` shards (first shard 0): table row `i` is at row
`(shard_of(i) - first_shard) * rows_per_shard + block_row(i)`. A mod table's
blocks are sliced on their own devices out of the stack arrays; a table on
fewer shards is spread evenly over all devices by one all_to_all (orbax
writes no array that lives on one process's devices only), so every process
writes only its own shards. "meta" records the format version, the embedmesh
version, N, the row layout's name ("row_layout": "mod", the only one today; a
checkpoint without the key is "mod", one naming a layout this embedmesh does
not know is refused), the step and per table its name, vocabulary size, dim,
rows per shard, rotation, its placement ("sharding": "mod" or "table_wise",
"first_shard", "span"; absent in older checkpoints: "mod", 0, N), dtype,
combiner, optimizer class and slot names. Re-cutting the stored blocks into
another layout (other device count, other stacking, other placements) goes
through the two layouts (`RowLayout.rows_index`, `shard_of`, `block_row`,
`period`).

The item is an ordinary pytree (`state_tree(emb)`, `core_state_tree(core,
state)`), so it sits beside the user's dense parameters in one orbax
`Composite` checkpoint:

    mngr = ocp.CheckpointManager(path)                  # async by default
    mngr.save(step, args=ocp.args.Composite(
        embedding=embedmesh.checkpoint.save_args(emb),
        params=ocp.args.StandardSave(params)))
    ...
    embedmesh.checkpoint.restore(emb, mngr)             # any mesh, any stacking
    # functional core: args=...(embedding=core_save_args(core, state), ...), then
    # state = embedmesh.checkpoint.core_restore(core, state, mngr).state
    params = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))["params"]

`save_args` writes it uncompressed (`EmbeddingSave`, found by orbax through
its args registry): trained embeddings are close to random bits, and zstd
saves ~9% of the size for half the read and write speed.
`ocp.args.StandardSave(state_tree(emb))` (compressed) restores the same way.

Restoring goes one table (or slot) at a time. This process's shards of the
table in the new layout are allocated on the host (page aligned: on CPU,
`device_put` aliases them) and filled by tensorstore reads issued all at
once: each copies only the stored rows a shard needs (a contiguous block
when the device count is unchanged, strided rows otherwise), straight into
place, in one tensorstore batch, so a stored chunk is read from disk once.
The shards are then checked against the array's checksum and written into
the new state: a stack array is copied on its first write (the live one is
never donated) and written in place afterwards, and the new state is returned
(`emb.state` replaced) only when every leaf was read and verified, so a
failed restore changes nothing. Besides the live state, a restore holds
one more copy of the state (at its end) and at most one table on the host
(its new shards). The on-disk format is orbax's; only the reading bypasses
orbax's per-leaf restore (same tensorstore spec, no whole-table
temporaries). Serving loads only the parameters (`load_tables`,
`EmbeddingForServing`): no mesh, optimizer slots never read. Both read
paths are one: `load_tables` reads a table into the logical layout
(`embedmesh.layout.rows.logical_layout`) as `restore` reads it into a mesh's.

Integrity: "meta" records per table a checksum of its parameters and of
each slot (see `CHECKSUM`: a layout-independent sum over logical rows,
computed at save on the devices holding the arrays), verified by `restore`
and `load_tables`; checkpoints without checksums load unverified.

Crash safety comes from orbax: a step is written under a temporary name and
renamed when complete, and uncommitted steps are never listed, so a save
killed halfway leaves the previous step as the latest one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.sharding import PartitionSpec as P

from embedmesh import _compat, _runtime
from embedmesh.config import TableConfig, resolve_feature_config
from embedmesh.layout.rows import ROW_LAYOUTS, RowLayout, logical_layout, row_layout
from embedmesh.layout.stacking import TablePlacement

__all__ = [
    "CHECKSUM",
    "DEFAULT_ITEM",
    "EmbeddingCheckpointHandler",
    "EmbeddingForServing",
    "EmbeddingRestore",
    "EmbeddingSave",
    "FORMAT_VERSION",
    "RestoredState",
    "core_restore",
    "core_save",
    "core_save_args",
    "core_state_tree",
    "latest_step",
    "load_tables",
    "read_metadata",
    "restore",
    "save",
    "save_args",
    "state_tree",
]

FORMAT = "embedmesh.checkpoint"
FORMAT_VERSION = 1
DEFAULT_ITEM = "embedding"
MISSING_POLICIES = ("error", "keep")
_ALIGN = 4096  # host buffers: page aligned, so CPU device_put aliases them


def _version() -> str:
    # the package's __init__ (the one version source) is loaded: it is this module's parent
    return getattr(sys.modules.get("embedmesh"), "__version__", "unknown")


# ---------------------------------------------------------------------------
# Device-side slicing and in-place writes of one table's block of a stack


@functools.cache
def _slicer(mesh, axes, rows: int, dim: int | None):
    """jit: (stack [N*S, D], lo) -> table [N*rows, dim], each device slicing its own shard.

    `lo` (the table's first local row) is an argument, not a constant, so one
    program serves every table of the same shape (was: one compile per table).
    """

    def body(x, lo):
        if x.ndim == 2:
            return jax.lax.dynamic_slice(x, (lo, 0), (rows, dim))
        return jax.lax.dynamic_slice(x, (lo,), (rows,))

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(axes), check_vma=False)
    )


@functools.cache
def _writer(mesh, axes, donate: bool = True, spanned: bool = False):
    """jit: write a table's [N*rows, dim] blocks into a stack at local row `lo` of every
    shard (`lo` an argument: one compile per shape, not per table). `donate=True` writes
    in place (the stack is consumed); `donate=False` leaves the stack intact and returns a
    new array (restore's first write into a live stack, see `restore`). `spanned`: the
    table has blocks only on shards `[first, first + span)` (two more arguments); the
    other shards keep their rows there (other tables' rows)."""

    def body(stack, piece, lo, first=None, span=None):
        piece = piece.astype(stack.dtype)
        start = (lo, 0) if stack.ndim == 2 else (lo,)
        if spanned:
            j = jax.lax.axis_index(axes)
            inside = (j >= first) & (j < first + span)
            piece = jnp.where(inside, piece, jax.lax.dynamic_slice(stack, start, piece.shape))
        return jax.lax.dynamic_update_slice(stack, piece, start)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(axes), P(axes), P()) + ((P(), P()) if spanned else ()),
            out_specs=P(axes),
            check_vma=False,
        ),
        donate_argnums=0 if donate else (),
    )


def _write_table(core, stack_array, piece, t, donate: bool) -> jax.Array:
    """`stack_array` with table `t`'s `[N * rows_per_shard, ...]` blocks `piece` written at
    its local rows, on the shards of its span only (every shard for a replica)."""
    lo = np.int32(t.local_row_offset)
    if t.span == core.num_shards or t.replicated:
        return _writer(core.mesh, core.axes, donate)(stack_array, piece, lo)
    return _writer(core.mesh, core.axes, donate, True)(
        stack_array, piece, lo, np.int32(t.first_shard), np.int32(t.span)
    )


def _table_block_array(core, stack_array: jax.Array, t) -> jax.Array:
    """The table's `[N * rows_per_shard, dim]` array sliced out of its stack on device."""
    spec = core.plan.stack(t.stack)
    dim = min(t.dim, stack_array.shape[1]) if stack_array.ndim == 2 else None  # a row slot: 1
    if (
        len(spec.tables) == 1
        and t.local_row_offset == 0
        and t.rows_per_shard == spec.rows_per_shard
        and (dim is None or dim == stack_array.shape[1])
    ):
        return stack_array  # the stack is exactly this table: no copy
    return _slicer(core.mesh, core.axes, t.rows_per_shard, dim)(
        stack_array, np.int32(t.local_row_offset)
    )


def _stored_rows(span: int, rows_per_shard: int, num_shards: int) -> int:
    """Rows of a table's stored array: its span's blocks, rounded up to a multiple of the
    saving mesh's shards (`N * rows_per_shard` for a table on every shard)."""
    return -(-span * rows_per_shard // num_shards) * num_shards


@functools.cache
def _spreader(mesh, axes, rows: int, span: int, n: int):
    """jit: (table [N*rows, ...] blocks, one per shard; first shard of its span) -> the
    span's blocks one after another, `[_stored_rows(span, rows, N), ...]`, spread evenly
    over all N devices (zero rows at the end). One all_to_all: shard j sends device p the
    stored rows `[p*c, (p+1)*c)` it holds (`c` rows a device) and p keeps the pieces from
    the span's shards, so no device holds more than ~3 blocks' worth, and every process
    writes its part (orbax refuses an array on one process's devices only in a job of
    several processes)."""
    c = -(-span * rows // n)

    def body(x, first):
        rest = x.shape[1:]
        zeros = (0,) * len(rest)
        me = jax.lax.axis_index(axes)
        b = me - first  # this shard's block in the stored array
        pad = jnp.zeros((c,) + rest, x.dtype)
        xp = jnp.concatenate([pad, x, pad])
        pieces = [
            jax.lax.dynamic_slice(
                xp, (jnp.clip(p * c - b * rows, -c, rows) + c,) + zeros, (c,) + rest
            )
            for p in range(n)
        ]
        got = jax.lax.all_to_all(jnp.stack(pieces), axes, 0, 0)  # got[i]: from shard i
        r = me * c + jnp.arange(c)  # the stored rows of this device
        out = pad
        for i in range(n):
            bi = i - first
            keep = (bi >= 0) & (bi < span) & (r >= bi * rows) & (r < (bi + 1) * rows)
            out = jnp.where(keep.reshape((c,) + (1,) * len(rest)), got[i], out)
        return out

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(axes), check_vma=False)
    )


def _span_array(core, arr: jax.Array, t) -> jax.Array:
    """What is stored of table `t`'s `[N * rows_per_shard, ...]` array: its blocks on the
    shards of its span only, one after another (`[_stored_rows(...), ...]`, spread over
    all devices); the array itself for a table on every shard."""
    n = core.num_shards
    if t.span == n:
        return arr
    return _spreader(core.mesh, core.axes, t.rows_per_shard, t.span, n)(
        arr, np.int32(t.first_shard)
    )


# ---------------------------------------------------------------------------
# Checksums: one per stored array, computed on the devices that hold it
#
# The checksum of a table (or slot) is a sum over its logical rows i < vocabulary_size of
# a hash of (i, column word k, 32-bit word w): two lanes of murmur3's fmix32 mixing of w
# with a seed made from (i, k), each summed mod 2**32 (64 bits in all). A sum over rows
# does not depend on the layout: each device hashes its own shard, padding rows excluded,
# and one all-reduce of two words per array gives the whole array's checksum. So a save
# costs one extra read of the state on the devices (no copy to the host, each process
# hashes only its own shards), and a restore verifies what it has read in its new layout
# (any device count), `load_tables` the logical table. Changing any one word always
# changes the lane sums (fmix32 is a bijection); several changes cancel out with
# probability ~2**-64.

CHECKSUM = "embedmesh-rowsum-fmix32x2-v1"


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """[rows, ...] of any 1/2/4/8-byte dtype -> uint32 [rows, words per row] (bit casts)."""
    size = np.dtype(x.dtype).itemsize
    if size in (4, 8):
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif size == 2:
        w = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif size == 1:
        w = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    else:  # pragma: no cover - no such table dtypes
        raise TypeError(f"no checksum for dtype {x.dtype}")
    return w.reshape(x.shape[0], -1)


def _rows_hash(x, logical_rows, valid):
    """uint32[2]: the two lane sums over the rows `valid` of a block `x` whose row r is
    logical row `logical_rows[r]`."""
    w = _words(x)
    i = logical_rows.astype(jnp.uint32)[:, None]
    k = jnp.arange(w.shape[1], dtype=jnp.uint32)[None, :]
    a = _fmix32(w ^ (i * np.uint32(0x9E3779B1) + k * np.uint32(0x85EBCA77) + np.uint32(0x165667B1)))
    b = _fmix32(
        (w * np.uint32(0x27D4EB2F))
        ^ (i * np.uint32(0xC2B2AE3D) + k * np.uint32(0x61C88647) + np.uint32(0x2545F491))
    )
    mask = valid[:, None]
    zero = jnp.uint32(0)
    return jnp.stack(
        [
            jnp.sum(jnp.where(mask, a, zero), dtype=jnp.uint32),
            jnp.sum(jnp.where(mask, b, zero), dtype=jnp.uint32),
        ]
    )


@functools.cache
def _hasher(mesh, axes, layout: RowLayout):
    """jit: (table [N*rows_per_shard, ...] row-sharded, the layout's `kernel_params` of the
    table, vocabulary size) -> replicated uint32[2], each device hashing its own block
    (its logical rows from the layout) then one all-reduce. The table enters only through
    its arguments: one program serves every table of a shape."""

    def body(x, params, vocab):
        j = jax.lax.axis_index(axes)
        q = jnp.arange(x.shape[0], dtype=jnp.int32)
        i = layout.logical_rows_from_params(params, j, q)
        return jax.lax.psum(_rows_hash(x, i, i < vocab), axes)

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(), P()), out_specs=P(), check_vma=False)
    )


def _checksum(mesh, axes, layout: RowLayout, arr, t):
    """The (unfetched) checksum of table `t`'s `[N * rows_per_shard, ...]` array laid out by
    `layout` on `mesh`."""
    return _hasher(mesh, axes, layout)(
        arr, np.asarray(layout.kernel_params(t), np.int32), np.int32(t.vocabulary_size)
    )


def _device_checksum(core, arr: jax.Array, t):
    """The (unfetched) checksum of table `t`'s array on `core`'s mesh and layout."""
    return _checksum(core.mesh, core.axes, core.plan.row_layout, arr, t)


def _checksum_hex(value) -> str:
    a, b = (int(v) for v in np.asarray(jax.device_get(value)).reshape(-1))
    return f"{a:08x}{b:08x}"


@functools.cache
def _logical_hasher():
    """jit on the host CPU: the checksum of a logical `[vocabulary_size, ...]` table. The
    logical layout maps row i to i, so this is the mesh hasher without its layout
    arithmetic and all-reduce (measured: 0.14 s instead of 0.17-0.19 s for 500k x 64,
    and a cheaper first compile); every `load_tables` test checks it against the checksum
    the mesh hasher recorded at save."""

    def fn(x):
        i = jnp.arange(x.shape[0], dtype=jnp.int32)
        return _rows_hash(x, i, jnp.ones(x.shape[:1], bool))

    return jax.jit(fn)


def _logical_checksum(arr: np.ndarray, t) -> str:
    """The checksum of a logical table `t` (`[vocabulary_size, ...]`) on the host CPU:
    what `load_tables` verifies."""
    if arr.shape[0] != t.vocabulary_size:
        raise ValueError(f"table {t.name}: {arr.shape[0]} rows, expected {t.vocabulary_size}")
    return _checksum_hex(_logical_hasher()(jax.device_put(arr, jax.devices("cpu")[0])))


def _expected_checksum(reader, meta_table: dict, field: str, leaf: tuple, dtype) -> str | None:
    """The recorded checksum of a leaf, or None when it cannot be verified: an older
    checkpoint (none recorded), another algorithm, or a read that casts the stored dtype."""
    if reader.meta.get("checksum") != CHECKSUM:
        return None
    recorded = (meta_table.get("checksums") or {}).get(field)
    if recorded is None or np.dtype(reader.dtype(leaf)) != np.dtype(dtype):
        return None
    return str(recorded)


# ---------------------------------------------------------------------------
# Saving


def _keys(names) -> dict:
    """Path-safe, unique pytree keys for table names (orbax joins key paths with '.')."""
    out, used = {}, set()
    for i, name in enumerate(names):
        key = re.sub(r"[^A-Za-z0-9_-]", "_", name)
        if key in used:
            key = f"{key}_{i}"
        used.add(key)
        out[name] = key
    return out


def _optimizer_name(opt) -> str | None:
    return None if opt is None else type(opt).__name__


def _metadata(core, state, step: int) -> dict:
    """The "meta" document: everything from the core's plan and optimizers, slot names
    from the state."""
    plan = core.plan
    keys = _keys([t.name for t in plan.tables])
    tables = []
    for t in plan.tables:
        cfg = plan.table_config(t)
        opt = core.optimizer_of(t.stack)
        tables.append(
            {
                "name": t.name,
                "key": keys[t.name],
                "vocabulary_size": t.vocabulary_size,
                "dim": t.dim,
                "rows_per_shard": t.rows_per_shard,
                "rotation": t.rotation,
                "sharding": t.sharding,
                "first_shard": t.first_shard,
                "span": t.span,
                "dtype": np.dtype(plan.stack(t.stack).dtype).name,
                "combiner": cfg.combiner,
                "stack": t.stack,
                "optimizer": _optimizer_name(opt),
                "optimizer_repr": repr(opt) if opt is not None else None,
                "slots": sorted(state.slots[t.stack]),
            }
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "embedmesh_version": _version(),
        "num_shards": plan.num_shards,
        "row_layout": plan.row_layout.name,
        "step": int(step),
        "tables": tables,
    }


LOOKUP_FIELD = "lookup_parameters"  # checksum field of a table's "lookup_tables" array


def core_state_tree(core, state, *, lookup_tables: dict | None = None) -> dict:
    """The embedding state `state` of `core` (an `EmbeddingCore`) as an orbax-ready pytree
    (see the module docstring).

    Tables and slots are sharded `jax.Array`s laid out per table; a stack
    that holds exactly one table is passed through without a copy, other
    tables are sliced out of their stacks on their own devices; of a table not on
    every shard (table-wise), only its span's blocks, spread over the devices. `state` holds
    every accepted update (a pipelined run passes the state with its pending
    update applied); `lookup_tables` (`{stack: parameters}`, pipelined with an
    update pending) are the stacks' parameters the next lookup reads, one
    update stale, stored as "lookup_tables" so that a pipelined restore resumes
    the same trajectory. Nothing is changed or donated.
    """
    plan = core.plan
    lookup = dict(lookup_tables or {})
    unknown = sorted(set(lookup) - {s.name for s in plan.stacks})
    if unknown:
        raise ValueError(
            f"lookup_tables names stacks {unknown} this core does not have "
            f"(its stacks: {[s.name for s in plan.stacks]})"
        )
    step = int(jax.device_get(state.step))
    meta = _metadata(core, state, step)
    keys = {m["name"]: m["key"] for m in meta["tables"]}
    tables, slots, stored_lookup = {}, {}, {}
    hashes = {}  # computed on the devices holding the arrays, fetched once
    for t in plan.tables:
        key = keys[t.name]
        # each array's checksum on the whole mesh (shards outside the table's span count
        # nothing), then only the span's blocks are stored
        block = _table_block_array(core, state.tables[t.stack], t)
        hashes[t.name] = {"parameters": _device_checksum(core, block, t)}
        tables[key] = _span_array(core, block, t)
        slots[key] = {}
        for name, arr in state.slots[t.stack].items():
            block = _table_block_array(core, arr, t)
            hashes[t.name][name] = _device_checksum(core, block, t)
            slots[key][name] = _span_array(core, block, t)
        if t.stack in lookup:
            block = _table_block_array(core, lookup[t.stack], t)
            hashes[t.name][LOOKUP_FIELD] = _device_checksum(core, block, t)
            stored_lookup[key] = _span_array(core, block, t)
        del block
    hashes = jax.device_get(hashes)
    meta["checksum"] = CHECKSUM
    for m in meta["tables"]:
        m["checksums"] = {field: _checksum_hex(h) for field, h in hashes[m["name"]].items()}
        m["lookup"] = m["key"] in stored_lookup
    blob = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8).copy()
    tree = {"tables": tables, "slots": slots, "step": np.asarray(step, np.int64), "meta": blob}
    if stored_lookup:
        tree["lookup_tables"] = stored_lookup
    return tree


def state_tree(emb) -> dict:
    """The embedding state of `emb` (a `MeshEmbedding`, built if needed) as an orbax-ready
    pytree: `core_state_tree` of its core and `emb.observed_state()` (every accepted
    update), with, in pipelined mode with an update still pending, the parameters
    the next lookup reads as the lookup tables. Saving never changes what the next
    lookup sees."""
    emb.build()
    state, lookup = emb._checkpoint_states()
    return core_state_tree(emb.core, state, lookup_tables=lookup)


class EmbeddingCheckpointHandler(ocp.PyTreeCheckpointHandler):
    """orbax's PyTree handler, without zstd compression by default.

    Trained embedding values are close to random bits: zstd saves ~9% of the
    size and halves the read and write speed (see benchmarks/checkpoint.py).
    The files are an ordinary orbax pytree either way.
    """

    def __init__(self, *, use_compression: bool = False, **kwargs):
        super().__init__(use_compression=use_compression, **kwargs)


@ocp.args.register_with_handler(EmbeddingCheckpointHandler, for_save=True)
@dataclasses.dataclass
class EmbeddingSave(ocp.args.PyTreeSave):
    """`PyTreeSave` of an embedding state tree, written by `EmbeddingCheckpointHandler`."""


@ocp.args.register_with_handler(EmbeddingCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class EmbeddingRestore(ocp.args.PyTreeRestore):
    """`PyTreeRestore` of the raw state tree (use `restore` / `load_tables` instead)."""


def _save_args_of(tree: dict, compression: bool) -> ocp.args.CheckpointArgs:
    return ocp.args.StandardSave(tree) if compression else EmbeddingSave(tree)


def core_save_args(
    core, state, *, lookup_tables: dict | None = None, compression: bool = False
) -> ocp.args.CheckpointArgs:
    """Save args of `core_state_tree(core, state, lookup_tables=...)` for one item of an
    orbax `Composite` (uncompressed by default, see `save_args`)."""
    return _save_args_of(core_state_tree(core, state, lookup_tables=lookup_tables), compression)


def save_args(emb, *, compression: bool = False) -> ocp.args.CheckpointArgs:
    """Save args of `state_tree(emb)` for one item of an orbax `Composite`.

    Uncompressed by default (`EmbeddingSave`, its handler found through
    orbax's registry); `compression=True` gives `ocp.args.StandardSave`
    (zstd). Either restores with `restore` / `load_tables`, or with orbax.
    """
    return _save_args_of(state_tree(emb), compression)


def _save_items(target, args, step: int, item: str, others: dict | None, wait: bool | None) -> bool:
    """Save the embedding item's `args` and `others` as step `step` of `target`."""
    items = {item: args}
    for name, value in (others or {}).items():
        if name == item:
            raise ValueError(f"others names the embedding item {item!r}")
        items[name] = (
            value if isinstance(value, ocp.args.CheckpointArgs) else ocp.args.StandardSave(value)
        )
    own = not isinstance(target, ocp.CheckpointManager)
    manager = (
        ocp.CheckpointManager(
            epath.Path(target),
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        )
        if own
        else target
    )
    try:
        saved = manager.save(int(step), args=ocp.args.Composite(**items))
        if wait or (wait is None and own):
            manager.wait_until_finished()
    finally:
        if own:
            manager.close()
    return bool(saved)


def core_save(
    target,
    core,
    state,
    step: int | None = None,
    *,
    lookup_tables: dict | None = None,
    item: str = DEFAULT_ITEM,
    others: dict | None = None,
    wait: bool | None = None,
) -> bool:
    """Save `state` of `core` (and `others`) as step `step` (default: `state.step`) of a
    checkpoint directory or manager; the arguments are `save`'s, with `lookup_tables`
    as in `core_state_tree`. Returns whether the manager saved."""
    if step is None:
        step = int(jax.device_get(state.step))
    return _save_items(
        target, core_save_args(core, state, lookup_tables=lookup_tables), step, item, others, wait
    )


def save(
    target,
    emb,
    step: int | None = None,
    *,
    item: str = DEFAULT_ITEM,
    others: dict | None = None,
    wait: bool | None = None,
) -> bool:
    """Save `emb` (and `others`) as step `step` of a checkpoint directory.

    Args:
      target: an `ocp.CheckpointManager` (saves are async when it is), or a
        directory, for which a synchronous manager is opened and closed.
      emb: the `MeshEmbedding`.
      step: the checkpoint step (default: the embedding's update count).
      item: the name of the embedding item in the `Composite`.
      others: more items, `{name: CheckpointArgs or pytree}`; a pytree is
        saved with `ocp.args.StandardSave`.
      wait: block until the save is on disk (default: True for a directory,
        False for a manager).

    Returns whether the manager saved (its save policy may skip a step).
    """
    args = save_args(emb)
    if step is None:
        step = int(jax.device_get(emb.observed_state().step))
    return _save_items(target, args, step, item, others, wait)


# ---------------------------------------------------------------------------
# Locating and reading a checkpoint


def latest_step(directory) -> int | None:
    """The latest committed step under a checkpoint root (None if there is none)."""
    meta = ocp.step.latest_step_metadata(epath.Path(directory), ocp.step.standard_name_format())
    return None if meta is None else int(meta.step)


def _is_item_dir(path: epath.Path) -> bool:
    return (path / "_METADATA").exists()


_TMP = ".orbax-checkpoint-tmp"  # orbax's suffix of a step or item still being written


def _in_progress(root: epath.Path, step: int | None) -> list:
    """Temporary (uncommitted) step directories under `root` (of `step`, if given)."""
    try:
        names = [p.name for p in root.iterdir() if _TMP in p.name]
    except OSError:
        return []
    if step is None:
        return sorted(names)
    pattern = re.compile(rf"(?:.*_)?0*{int(step)}{re.escape(_TMP)}.*")
    return sorted(n for n in names if pattern.fullmatch(n))


def _still_written(what: str, where) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what} is still being written, or its save was interrupted ({where}): orbax "
        f"commits a step by renaming it when the save is complete. Wait for an async save "
        f"to finish (CheckpointManager.wait_until_finished(), or pass the manager, whose "
        f"saves in flight are waited for) before restoring it"
    )


def _item_dir(source, step: int | None, item: str) -> epath.Path:
    """The embedding item's directory from a manager, a root, a step or an item directory.

    A manager's save in flight is waited for first; a step (or item) that is only
    present as orbax's temporary directory raises a FileNotFoundError saying so.
    """
    if isinstance(source, ocp.CheckpointManager):
        source.wait_until_finished()  # an async save in flight: its step becomes readable
        if step is None:
            step = source.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint under {source.directory}")
        finder = getattr(source, "_get_read_step_directory", None)  # honours custom names
        step_dir = (
            finder(step, source.directory) if finder is not None else source.directory / str(step)
        )
        path = epath.Path(step_dir) / item
    else:
        root = epath.Path(source)
        if _TMP in root.name or any(_TMP in p for p in root.parts):
            raise _still_written(f"checkpoint directory {root}", "an orbax temporary directory")
        if _is_item_dir(root):
            if step is not None:
                raise ValueError(f"{root} is an item directory; it has no steps to choose from")
            path = root
        elif _is_item_dir(root / item):
            path = root / item
        else:
            fmt = ocp.step.standard_name_format()
            if step is None:
                meta = ocp.step.latest_step_metadata(root, fmt)
                if meta is None:
                    tmp = _in_progress(root, None)
                    if tmp:
                        raise _still_written(
                            f"no committed checkpoint under {root}: every step", ", ".join(tmp)
                        )
                    raise FileNotFoundError(f"no committed checkpoint under {root}")
                step_dir = meta.path
            else:
                try:
                    step_dir = fmt.find_step(root, int(step)).path
                except ValueError:
                    tmp = _in_progress(root, step)
                    if tmp:
                        raise _still_written(f"step {step} under {root}", ", ".join(tmp)) from None
                    raise FileNotFoundError(f"no committed step {step} under {root}") from None
            path = epath.Path(step_dir) / item
    if not _is_item_dir(path):
        tmp = (
            [p.name for p in path.parent.iterdir() if p.name.startswith(item + _TMP)]
            if path.parent.exists()
            else []
        )
        if tmp:
            raise _still_written(f"checkpoint item {path}", ", ".join(sorted(tmp)))
        raise FileNotFoundError(f"{path} holds no checkpoint item {item!r}")
    return path


_META_KEYS = {"num_shards": int, "step": int, "tables": list}
_META_TABLE_KEYS = {
    "name": str,
    "key": str,
    "vocabulary_size": int,
    "dim": int,
    "rows_per_shard": int,
    "rotation": int,
    "slots": list,
}


def _parse_meta(blob: bytes, where: str) -> dict:
    try:
        meta = json.loads(blob.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
        raise ValueError(f"{where} is not valid UTF-8 JSON: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{where} is not a JSON object (got {type(meta).__name__})")
    return meta


_META_TABLE_OPTIONAL = {"first_shard": int, "span": int}  # absent in older checkpoints


def _check_meta(meta: dict, where: str) -> None:
    """Every key restore and load_tables rely on, with the right type; a clear error if not."""

    def check(d: dict, keys: dict, prefix: str):
        for key, kind in keys.items():
            if key not in d:
                raise ValueError(f"{where} lacks the key {prefix}{key!r}")
            value = d[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(
                    f"{where}: {prefix}{key!r} must be a {kind.__name__}, got {value!r}"
                )

    check(meta, _META_KEYS, "")
    if meta["num_shards"] < 1:
        raise ValueError(f"{where}: 'num_shards' must be >= 1, got {meta['num_shards']}")
    for i, m in enumerate(meta["tables"]):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: tables[{i}] must be an object, got {m!r}")
        check(m, _META_TABLE_KEYS, f"tables[{i}].")
        check(m, {k: v for k, v in _META_TABLE_OPTIONAL.items() if k in m}, f"tables[{i}].")
        first, span = m.get("first_shard", 0), m.get("span", meta["num_shards"])
        if not (span >= 1 and first >= 0 and first + span <= meta["num_shards"]):
            raise ValueError(
                f"{where}: tables[{i}] spans shards [{first}, {first + span}) "
                f"('first_shard', 'span'), not inside the {meta['num_shards']} shards"
            )


@dataclasses.dataclass(frozen=True)
class _StoredLeaf:
    """An array of a saved pytree, as orbax's `_METADATA` lists it (not opened)."""

    path: tuple


# orbax's value types of empty nodes (stored as such, no array)
_EMPTY_NODES: dict[str, Any] = {"Dict": {}, "List": [], "None": None}


def _stored_tree(stored: dict) -> dict:
    """The pytree of an item's `_METADATA` (orbax's `tree_metadata`): `_StoredLeaf`s where
    it stored arrays, empty nodes as such. Read here, not by orbax's `metadata()`, which
    opens every array and keeps its spec: tensorstore 0.1.86's `Spec.to_json` leaks the
    nested values it returns, ~8 objects per array and call, so every restore grew memory
    (issue 24, item 11)."""
    tree: dict = {}
    for entry in stored["tree_metadata"].values():
        keys = tuple(k["key"] for k in entry["key_metadata"])
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        value_type = entry["value_metadata"]["value_type"]
        node[keys[-1]] = (
            copy.copy(_EMPTY_NODES[value_type]) if value_type in _EMPTY_NODES else _StoredLeaf(keys)
        )
    return tree


class _Reader:
    """Reads leaves of one saved pytree: its structure from orbax's `_METADATA` file, small
    leaves through orbax, table arrays straight from tensorstore into caller-provided numpy
    buffers (nothing else is read)."""

    def __init__(self, path: epath.Path):
        self.path = path
        self._stores: dict = {}  # opened tensorstores by leaf path
        file = path / "_METADATA"
        try:
            stored = json.loads(file.read_text())
            self.tree = _stored_tree(stored)
        except Exception as e:  # bad bytes, bad JSON, missing keys
            raise ValueError(
                f"cannot read the checkpoint metadata file {file} "
                f"(orbax's metadata of the item): {type(e).__name__}: {e}"
            ) from e
        self._use_zarr3 = bool(stored.get("use_zarr3", False))
        self._use_ocdbt = bool(ocp.type_handlers.is_ocdbt_checkpoint(path))
        self._context = _ts_context() if self._use_ocdbt else None
        self._handler = ocp.PyTreeCheckpointHandler()
        if not (isinstance(self.tree, dict) and "meta" in self.tree and "tables" in self.tree):
            raise ValueError(f"{path} is not an embedmesh checkpoint item (no tables/meta)")
        where = f"the embedmesh metadata (array 'meta') of checkpoint item {path}"
        try:
            blob = bytes(np.asarray(self.read(("meta",))).astype(np.uint8).reshape(-1))
        except Exception as e:
            raise ValueError(f"cannot read {where}: {type(e).__name__}: {e}") from e
        self.meta = _parse_meta(blob, where)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an embedmesh checkpoint item")
        if int(self.meta.get("format_version", 0)) > FORMAT_VERSION:
            raise ValueError(
                f"{path} has checkpoint format version "
                f"{self.meta['format_version']}; this embedmesh reads up to "
                f"{FORMAT_VERSION}"
            )
        _check_meta(self.meta, where)

    @functools.cached_property
    def layout(self) -> RowLayout:
        """The saving mesh's row layout (a ValueError for one this embedmesh does not know)."""
        return _stored_layout(self.meta, f"checkpoint item {self.path}")

    def _leaf(self, path: tuple):
        leaf = self.tree
        for k in path:
            leaf = leaf[k]
        return leaf

    def has(self, path: tuple) -> bool:
        try:
            self._leaf(path)
        except (KeyError, TypeError, IndexError):
            return False
        return True

    def shape(self, path: tuple) -> tuple:
        return tuple(self.store(path).shape)

    def dtype(self, path: tuple):
        return np.dtype(self.store(path).dtype.numpy_dtype)

    def read(self, path: tuple):
        """One small leaf (metadata, step) as host numpy, through orbax; nothing else is read."""
        item = jax.tree.map(lambda _: ocp.PLACEHOLDER, self.tree)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), self.tree)
        node = item
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = 0
        out = self._handler.restore(
            self.path, args=ocp.args.PyTreeRestore(item=item, restore_args=args)
        )
        for k in path:
            out = out[k]
        return np.asarray(out)

    def store(self, path: tuple):
        """The leaf's tensorstore array, opened once (reading only its small metadata);
        a ValueError naming the array when it cannot be opened.

        The spec is orbax's own read spec for this item (same driver, kvstore,
        OCDBT manifest), so every checkpoint orbax restores opens here too.
        """
        if path not in self._stores:
            name = ".".join(path)  # orbax's parameter name for a key path
            spec = _read_spec(str(self.path), name, self._use_zarr3, self._use_ocdbt)
            try:
                opened = ts.open(spec, open=True, read=True, context=self._context).result()
            except Exception as e:
                raise ValueError(
                    f"cannot open the array '{name}' of checkpoint item {self.path}: {e}"
                ) from e
            self._stores[path] = opened
        return self._stores[path]

    def start_fill(self, path: tuple, copies: list) -> list:
        """Start reading the leaf into numpy buffers: `copies` is a list of
        `(dst, dst_start, dst_step, src_start, src_step, rows)`, filling
        `dst[dst_start::dst_step][:rows]` from stored rows
        `src_start, src_start + src_step, ...` (row strided, all columns).

        The reads go out as one tensorstore batch, so each stored chunk is
        read from disk once even when several destinations need rows of it,
        and each row is copied straight into its destination (no whole-table
        temporary). Returns the futures; `_wait` them.
        """
        store = self.store(path)
        batch = ts.Batch()
        futures = []
        try:
            for dst, d0, dstep, s0, sstep, rows in copies:
                if rows <= 0:
                    continue
                src = store
                if np.dtype(src.dtype.numpy_dtype) != dst.dtype:
                    src = ts.cast(src, dst.dtype)
                target = ts.array(dst, copy=False, write=True)
                futures.append(
                    target[d0 : d0 + dstep * (rows - 1) + 1 : dstep].write(
                        src[s0 : s0 + sstep * (rows - 1) + 1 : sstep], batch=batch
                    )
                )
        finally:
            batch.submit()
        return futures

    def close(self):
        self._stores.clear()
        self._handler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_spec(
    directory: str, name: str, use_zarr3: bool, use_ocdbt: bool, from_orbax: bool = True
) -> dict:
    """The tensorstore spec of one stored array: orbax's when importable, else the
    same spec made here (a test keeps the two equal)."""
    ts_utils = _compat.orbax_tensorstore_utils()  # private: a hand-made spec if it moves
    if from_orbax and ts_utils is not None:
        return ts_utils.ArrayReadSpec(directory, name, use_zarr3, use_ocdbt=use_ocdbt).json
    directory = directory.rstrip("/") + "/"
    if use_ocdbt:
        kvstore = {
            "driver": "ocdbt",
            "base": {
                "driver": "file",
                "path": directory,
                "file_io_locking": {"mode": "non_atomic"},
            },
            "manifest": {"driver": "file", "path": directory},
            "path": name,
            "cache_pool": "cache_pool#ocdbt",
        }
    else:
        kvstore = {"driver": "file", "path": directory + name}
    return {
        "driver": "zarr3" if use_zarr3 else "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": False,
    }


@functools.cache
def _ts_context():
    """One tensorstore context for every read: orbax's OCDBT settings (many file reads in
    flight); no chunk cache, so nothing stays in memory after a read."""
    ts_utils = _compat.orbax_tensorstore_utils()
    if ts_utils is not None:
        return ts_utils.get_ts_context(use_ocdbt=True)
    return ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 0}})  # pragma: no cover


def _wait(futures: list) -> None:
    for f in futures:
        f.result()


def _host_buffer(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised numpy array aligned to 4 KiB: `jax.device_put` on CPU then aliases
    it (no copy); elsewhere it is an ordinary host buffer."""
    return _runtime.aligned_empty(shape, dtype, _ALIGN)


def read_metadata(source, step: int | None = None, *, item: str = DEFAULT_ITEM) -> dict:
    """The JSON metadata of a checkpoint's embedding item (format, N, step, tables)."""
    with _Reader(_item_dir(source, step, item)) as r:
        return r.meta


# ---------------------------------------------------------------------------
# Layout conversions: which stored rows go where (pure index arithmetic)


def _stored_shards(meta: dict, meta_table: dict) -> int:
    """The blocks of a table's stored array: the shards of its span ("span"; every shard
    of the saving mesh in checkpoints without it)."""
    return int(meta_table.get("span", meta["num_shards"]))


def _stored_shape_check(
    shape: tuple, meta_table: dict, n: int, num_shards: int, dim: int | None = None
):
    """`n`: the table's stored blocks (`_stored_shards`); `num_shards`: the saving mesh's."""
    rps = meta_table["rows_per_shard"]
    rows = _stored_rows(n, rps, num_shards)
    if shape[0] != rows:
        padded = f", padded to a multiple of {num_shards}" if rows != n * rps else ""
        raise ValueError(
            f"table {meta_table['name']}: stored array has {shape[0]} rows, "
            f"metadata says {n} x {rps}{padded}"
        )
    if dim is not None and len(shape) == 2 and shape[1] != dim:
        raise ValueError(f"table {meta_table['name']}: stored dim {shape[1]} != {dim}")


def _stored_layout(meta: dict, where) -> RowLayout:
    """The row layout of the saving mesh ("row_layout", "mod" when absent)."""
    name = meta.get("row_layout", "mod")
    if not isinstance(name, str) or name not in ROW_LAYOUTS:
        raise ValueError(
            f"{where} lays its rows out by {name!r} (its 'row_layout'), a row "
            f"layout this embedmesh does not know (it knows "
            f"{sorted(ROW_LAYOUTS)})"
        )
    return row_layout(name, int(meta["num_shards"]))


def _stored_table(meta_table: dict, n: int) -> TablePlacement:
    """A table's stored array as a placement on `n` shards (`_stored_shards`: its span on
    the saving mesh, renumbered from 0): a stack of its own, block b at rows
    `[b * rows_per_shard, (b+1) * rows_per_shard)`."""
    v, rps = meta_table["vocabulary_size"], meta_table["rows_per_shard"]
    return TablePlacement(
        name=meta_table["name"],
        index=0,
        stack=meta_table["name"],
        num_shards=n,
        vocabulary_size=v,
        padded_vocabulary_size=n * rps,
        dim=meta_table["dim"],
        padded_dim=meta_table["dim"],
        row_offset=0,
        rotation=meta_table["rotation"],
    )


def _logical_table(meta_table: dict) -> TablePlacement:
    """The logical `[vocabulary_size, ...]` table as a placement of `logical_layout()`."""
    return _stored_table(
        dict(meta_table, rows_per_shard=meta_table["vocabulary_size"], rotation=0), 1
    )


def _stored_row(layout: RowLayout, t, row: int) -> int:
    """Where logical row `row` of table `t` is in its stored `[k * rows_per_shard, ...]`
    array (`t` a stored placement: first shard 0)."""
    return int(layout.shard_of(t, row)) * t.rows_per_shard + int(layout.block_row(t, row))


def _recut_copies(src_layout: RowLayout, src, dst_layout: RowLayout, dst, shard: int) -> list:
    """[(dst_start, dst_step, src_start, src_step, rows)] filling block rows
    `[0, count_on_shard)` of table `dst`'s block on shard `shard` of `dst_layout` from the
    stored array of table `src` laid out by `src_layout` (block j at rows
    `j * src.rows_per_shard`), as arithmetic progressions: no index arrays.

    The new block's rows are `i = first + step * r` (`dst_layout.rows_index`). The
    stored layout repeats every `P` rows, moving `B` rows down the block
    (`src_layout.period`); with `L = lcm(step, P)`, the rows of phase `p` of `r` (mod
    `L / step`) sit in one stored block, `(L / P) * B` stored rows apart. Same layout
    is one contiguous copy per shard; to the logical table (`logical_layout`, step 1),
    one per stored block.
    """
    count = dst_layout.count_on_shard(dst, shard)
    index = dst_layout.rows_index(dst, shard)
    if not isinstance(index, slice):  # the layout gives no progression: a copy per row
        return [
            (r, 1, _stored_row(src_layout, src, int(i)), 1, 1)
            for r, i in enumerate(np.asarray(index, np.int64)[:count])
        ]
    first, _, step = index.indices(dst.vocabulary_size)
    rows, advance = src_layout.period(src)
    lcm = step * rows // int(np.gcd(step, rows))
    phases, stride = lcm // step, (lcm // rows) * advance
    return [
        (
            p,
            phases,
            _stored_row(src_layout, src, first + step * p),
            stride,
            len(range(p, count, phases)),
        )
        for p in range(min(phases, count))
    ]


def _same_layout(src_layout: RowLayout, src, dst_layout: RowLayout, dst) -> bool:
    """Whether the stored blocks are exactly the new blocks of the table. A table on part
    of the mesh (table-wise) is compared in its stored form: its span renumbered from
    shard 0."""
    k = dst_layout.span(dst)[1]
    if k != dst_layout.num_shards:
        dst = dataclasses.replace(dst, num_shards=k, first_shard=0, span=k, row_offset=0)
        dst_layout = row_layout(dst_layout.name, k) if dst_layout.name in ROW_LAYOUTS else None
        if dst_layout is None:
            return False
    return (
        src_layout == dst_layout
        and src.rows_per_shard == dst.rows_per_shard
        and tuple(src_layout.kernel_params(src)) == tuple(dst_layout.kernel_params(dst))
    )


# ---------------------------------------------------------------------------
# Restoring onto a core or into a MeshEmbedding (any mesh, any stacking)


def _check_compatible(
    name: str, table, meta_table: dict | None, what: str = "the embedding"
) -> None:
    """ValueError unless the stored table (if any) has `table`'s vocabulary size and dim."""
    if meta_table is None:
        return
    if (meta_table["vocabulary_size"], meta_table["dim"]) != (table.vocabulary_size, table.dim):
        raise ValueError(
            f"table {name}: the checkpoint has "
            f"[{meta_table['vocabulary_size']}, {meta_table['dim']}], {what} "
            f"[{table.vocabulary_size}, {table.dim}]"
        )


# Optimizers whose slots hold one value a row ([rows, 1]), by class name
_ROW_SLOT_OPTIMIZERS = frozenset({"RowWiseAdagrad"})


def _check_slot_kinds(name: str, opt, meta_table: dict) -> None:
    """ValueError when the checkpoint's optimizer keeps its slots per row and the live one
    per element, or the reverse (an Adagrad checkpoint into RowWiseAdagrad: both name
    their slot "accumulators", of different shapes); no conversion is made."""
    stored = meta_table.get("optimizer")
    live = _optimizer_name(opt)
    if stored is None or live is None or stored == live:
        return
    if (stored in _ROW_SLOT_OPTIMIZERS) != (live in _ROW_SLOT_OPTIMIZERS):
        raise ValueError(
            f"table {name}: the checkpoint's optimizer is {stored}, this one {live}; their "
            f"slots {sorted(meta_table.get('slots', []))} are not interchangeable (one "
            "value a row against one an element), so they cannot be restored into it (restore "
            "with the checkpoint's optimizer, or load only the tables with load_tables)"
        )


def _field_width(core, t, field: str) -> int:
    """The columns of a table's stored array `field` (its dim; a row slot's: 1)."""
    opt = core.optimizer_of(t.stack)
    if field in ("parameters", LOOKUP_FIELD) or opt is None or field not in opt.slot_names:
        return t.dim
    return opt.slot_width(field, t.dim)


def _local_shards(core, shape: tuple) -> list:
    """[(shard index j, device)] of this process, in shard order, for a row-sharded array."""
    rows = shape[0] // core.num_shards
    out = []
    for device, index in core.row_sharding.addressable_devices_indices_map(shape).items():
        start = index[0].start or 0
        out.append((start // rows if rows else 0, device))
    return sorted(out, key=lambda x: x[0])


def _leaf_name(leaf: tuple) -> str:
    return ".".join(leaf)  # orbax's parameter name for a key path


def _describe(t_name: str, field: str, leaf: tuple) -> str:
    what = "parameters" if field == "parameters" else f"slot {field!r}"
    return f"{what} of table {t_name} (array '{_leaf_name(leaf)}')"


def _check_leaf(reader, leaf: tuple, meta_table: dict, dim: int) -> None:
    """ValueError, before anything is read, when an array the metadata lists is missing or
    has another shape."""
    if reader.has(leaf) is False:
        raise ValueError(
            f"checkpoint item {reader.path} lacks the array "
            f"'{_leaf_name(leaf)}' of table {meta_table['name']} that its "
            f"metadata lists"
        )
    n, num_shards = _stored_shards(reader.meta, meta_table), int(reader.meta["num_shards"])
    _stored_shape_check(reader.shape(leaf), meta_table, n, num_shards, dim)


@dataclasses.dataclass
class _Pending:
    """One leaf being read: the table's new blocks on the host, and the reads."""

    kind: str  # "direct" (stored blocks are these blocks) or "resharded"
    pieces: list  # [(shard j, device or None, numpy [rows_per_shard, ...])]
    futures: list
    what: str = ""  # "slot 'accumulators' of table u (array 'slots.u.accumulators')"
    source: str = ""  # the item directory
    checksum: str | None = None  # expected (None: not verified)


def _start_leaf(
    reader,
    leaf: tuple,
    meta_table: dict,
    layout: RowLayout,
    t,
    shards: list,
    dtype,
    field: str = "parameters",
) -> _Pending:
    """Allocate table `t`'s blocks on `shards` (`[(j, device)]`) of `layout` on the host and
    start reading the stored array `leaf` into them: only the stored rows these blocks
    need, each copied once, straight into place (padding rows are zero).

    `restore` reads into this process's shards of a mesh (`plan.row_layout`),
    `load_tables` into the logical table (`logical_layout()`, one shard)."""
    n_old = _stored_shards(reader.meta, meta_table)
    src_layout = row_layout(reader.layout.name, n_old)
    src = _stored_table(meta_table, n_old)
    stored_shape = reader.shape(leaf)
    width = t.dim if field in ("parameters", LOOKUP_FIELD) else None  # slots: checked before
    _stored_shape_check(stored_shape, meta_table, n_old, int(reader.meta["num_shards"]), width)
    rest = tuple(stored_shape[1:])
    pieces, copies = [], []
    empty = None  # shards outside the table's span: one zero block, never written
    for j, device in shards:
        source = layout.copy_of(t, j)  # a replica reads its canonical block's rows
        if source is None:
            if empty is None:
                empty = _host_buffer((t.rows_per_shard,) + rest, dtype)
                empty[:] = 0
            pieces.append((j, device, empty))
            continue
        piece = _host_buffer((t.rows_per_shard,) + rest, dtype)
        piece[layout.count_on_shard(t, source) :] = 0
        pieces.append((j, device, piece))
        copies += [(piece,) + c for c in _recut_copies(src_layout, src, layout, t, source)]
    kind = "direct" if _same_layout(src_layout, src, layout, t) else "resharded"
    checksum = _expected_checksum(reader, meta_table, field, leaf, dtype)
    what = _describe(t.name, field, leaf)
    try:
        futures = reader.start_fill(leaf, copies)
    except Exception as e:
        raise _read_error(reader.path, what, e) from e
    return _Pending(kind, pieces, futures, what, str(reader.path), checksum)


def _read_error(path, what: str, error: Exception) -> ValueError:
    return ValueError(f"cannot read {what} from checkpoint item {path}: {error}")


def _drain(pending: _Pending | None) -> None:
    """Wait for a leaf's reads, ignoring their errors (an abandoned restore must not leave
    tensorstore writing into buffers that are about to be freed)."""
    if pending is None:
        return
    for f in pending.futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - the restore is failing already
            pass


def _streamed(count: int, start, prefetch: bool):
    """Yield `start(i)` (a `_Pending`) for i in range(count), in order. With `prefetch` the
    reads of leaf i+1 are started before leaf i is handed over (two leaves on the host),
    else after the caller is done with leaf i (one). Use under `contextlib.closing`: if the
    caller fails, every read still in flight is waited for."""
    current = following = None
    try:
        following = start(0) if count else None
        for i in range(count):
            current, following = following, None
            if prefetch and i + 1 < count:
                following = start(i + 1)
            yield current
            current = None
            if following is None and i + 1 < count:
                following = start(i + 1)
    finally:
        _drain(current)
        _drain(following)


def _wait_leaf(pending: _Pending, stats: dict | None = None) -> None:
    """Wait for a leaf's reads; a failed read is a ValueError naming the leaf."""
    try:
        _wait(pending.futures)
    except Exception as e:
        _drain(pending)
        raise _read_error(pending.source, pending.what, e) from e
    if stats is not None:
        stats[pending.kind] = stats.get(pending.kind, 0) + 1


def _verify(pending: _Pending, checksum) -> None:
    """Compare the leaf's recorded checksum (if any) with `checksum()` (computed only then)."""
    if pending.checksum is None:
        return
    got = checksum()
    if got != pending.checksum:
        raise ValueError(
            f"checkpoint item {pending.source}: {pending.what} is corrupted: "
            f"its checksum is {got}, the checkpoint recorded "
            f"{pending.checksum} ({CHECKSUM})"
        )


def _place_leaf(
    core,
    pending: _Pending,
    stack_array: jax.Array,
    t,
    stats: dict | None = None,
    *,
    donate: bool = True,
) -> jax.Array:
    """Wait for a leaf's reads, verify its checksum, then return the stack array with it
    written in: in place (`donate=True`: `stack_array` is consumed), or into a new array
    (`donate=False`: `stack_array` stays intact)."""
    _wait_leaf(pending, stats)
    rest = pending.pieces[0][2].shape[1:] if pending.pieces else stack_array.shape[1:]
    shape = (core.num_shards * t.rows_per_shard,) + tuple(rest)
    # On CPU, device_put aliases the (aligned) buffers: no copy until the write below
    placed = [jax.device_put(piece, device) for _, device, piece in pending.pieces]
    pending.pieces = []
    piece = jax.make_array_from_single_device_arrays(shape, core.row_sharding, placed)
    del placed
    try:
        _verify(pending, lambda: _checksum_hex(_device_checksum(core, piece, t)))
    except ValueError:
        piece.delete()
        raise
    # The first write into a live stack is not donated (`restore` builds the new state
    # beside the live one); later writes into that new array are in place
    out = _write_table(core, stack_array, piece, t, donate)
    # wait, so that this table's buffers are freed before the next table is read
    out.block_until_ready()
    piece.delete()
    return out


def _check_missing(missing: str) -> None:
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")


@dataclasses.dataclass(frozen=True)
class RestoredState:
    """What `core_restore` returns.

    state: the restored `EmbeddingState` (every saved update; the given state
      where missing="keep" kept values).
    step: the restored step count (`int(state.step)`).
    lookup_tables: `{stack: parameters}` the next lookup reads, for a
      pipelined restore (`pipelined=True`) of a checkpoint saved with an
      update pending: the tables one update stale, as the saving run's next
      lookup would have read them; else empty.
    """

    state: Any
    step: int
    lookup_tables: dict

    def lookup_state(self):
        """The state the next lookup reads: `state` with `lookup_tables` in place of those
        stacks' tables and the step before the pending update (just `state` when there
        are none). A pipelined loop runs that lookup on it, then goes on from `state`."""
        if not self.lookup_tables:
            return self.state
        return dataclasses.replace(
            self.state,
            tables=dict(self.state.tables, **self.lookup_tables),
            step=self.state.step - 1,
        )


def core_restore(
    core,
    state,
    source,
    step: int | None = None,
    *,
    item: str = DEFAULT_ITEM,
    missing: str = "error",
    pipelined: bool = False,
    prefetch: bool = False,
    _stats: dict | None = None,
) -> RestoredState:
    """Restore a checkpoint onto `core` (an `EmbeddingCore`): a new state, `state` unchanged.

    The checkpoint may come from any number of devices and any stacking. For
    each table of `core`'s plan, its parameters and then each slot of `state`
    are read from disk one at a time, straight into this process's shards of
    that table in the plan's layout (reading only the stored rows those shards
    need), checked against the checksum recorded at save (checkpoints written
    before checksums existed are not checked), and written into the new
    state's stack arrays. Tables of the checkpoint that the plan lacks are
    ignored.

    Pure and all or nothing: `state` is never changed or donated (each stack
    array of the new state is copied from it on its first write, then written
    in place), so a restore that fails (unreadable or corrupted data, a bad
    checkpoint) raises and `state` is exactly as it was. The price is one
    extra copy of the state at the peak of a restore (plus one table, or two
    with `prefetch`, on the host).

    Args:
      core: the `EmbeddingCore` (its plan and mesh: any device count).
      state: its current `EmbeddingState` (e.g. `core.init(key)`): which slots
        to restore, and what missing="keep" keeps.
      source, step, item, prefetch: see `restore`.
      missing: "error" (default) raises ValueError when a table of the plan,
        or one of its optimizer slots, is not in the checkpoint; "keep" leaves
        those at their values in `state`.
      pipelined: also read the "lookup_tables" of a checkpoint saved with an
        update pending (`RestoredState.lookup_tables`, `lookup_state()`).

    Returns a `RestoredState` (`.state`, `.step`, `.lookup_tables`).

    Raises ValueError before reading anything when a table's vocabulary size
    or dim differs, something is missing under missing="error" or the
    checkpoint's row layout is unknown; and ValueError when a stored array
    cannot be read or does not match its checksum.
    """
    _check_missing(missing)
    path = _item_dir(source, step, item)
    plan = core.plan
    live = state  # what missing="keep" keeps
    with _Reader(path) as reader:
        meta = reader.meta
        reader.layout  # noqa: B018 - an unknown row layout raises before anything is read
        by_name = {m["name"]: m for m in meta["tables"]}
        todo = []  # (placement, meta table, field) in plan order
        problems = []
        for t in plan.tables:
            m = by_name.get(t.name)
            _check_compatible(t.name, t, m)
            if m is None:
                problems.append(f"table {t.name} is not in the checkpoint")
                continue
            todo.append((t, m, "parameters"))
            _check_slot_kinds(t.name, core.optimizer_of(t.stack), m)
            for slot in live.slots[t.stack]:
                if slot in m["slots"]:
                    todo.append((t, m, slot))
                else:
                    problems.append(
                        f"slot {slot!r} of table {t.name} is not in the checkpoint "
                        f"(it has {m['slots']}; optimizer {m['optimizer']})"
                    )
        if problems and missing == "error":
            raise ValueError(
                "cannot restore "
                + str(path)
                + ": "
                + "; ".join(problems)
                + " (pass missing='keep' to keep their current values)"
            )
        if pipelined:  # what the next lookup reads, where an update was pending at save
            todo += [
                (t, by_name[t.name], LOOKUP_FIELD)
                for t in plan.tables
                if by_name.get(t.name, {}).get("lookup")
            ]
        leaves = [
            ("tables", m["key"])
            if field == "parameters"
            else ("lookup_tables", m["key"])
            if field == LOOKUP_FIELD
            else ("slots", m["key"], field)
            for t, m, field in todo
        ]
        for (t, m, field), leaf in zip(todo, leaves):  # before anything is read
            _check_leaf(reader, leaf, m, _field_width(core, t, field))
        # The new state: starts as the live arrays; an array is replaced by a new one on
        # its first write (not donated: the live one stays intact), written in place after
        # (the lookup tables, read last, start as the restored tables of their stack)
        tables = dict(live.tables)
        slots = {s: dict(v) for s, v in live.slots.items()}
        lookup = {}
        fresh = set()  # targets that hold a new array of ours

        def target(i):
            t, _, field = todo[i]
            if field == "parameters":
                return tables[t.stack]
            if field == LOOKUP_FIELD:
                return lookup.get(t.stack, tables[t.stack])
            return slots[t.stack][field]

        def start(i):
            t, m, field = todo[i]
            shape = (core.num_shards * t.rows_per_shard,) + reader.shape(leaves[i])[1:]
            return _start_leaf(
                reader,
                leaves[i],
                m,
                plan.row_layout,
                t,
                _local_shards(core, shape),
                target(i).dtype,
                field,
            )

        with contextlib.closing(_streamed(len(todo), start, prefetch)) as pending:
            for i, current in enumerate(pending):
                t, m, field = todo[i]
                key = (t.stack, field)
                out = _place_leaf(core, current, target(i), t, _stats, donate=key in fresh)
                del current
                fresh.add(key)
                if field == "parameters":
                    tables[t.stack] = out
                elif field == LOOKUP_FIELD:
                    lookup[t.stack] = out
                else:
                    slots[t.stack][field] = out
                del out
        step_count = int(meta["step"])
    new = dataclasses.replace(
        live,
        tables=tables,
        slots=slots,
        step=jax.device_put(jnp.asarray(step_count, jnp.int32), core.replicated),
    )
    return RestoredState(new, step_count, lookup)


def restore(
    emb,
    source,
    step: int | None = None,
    *,
    item: str = DEFAULT_ITEM,
    missing: str = "error",
    prefetch: bool = False,
    _stats: dict | None = None,
) -> int:
    """Restore a checkpoint into `emb` (built if needed) on its own mesh and stacking.

    `core_restore` of `emb`'s core and observed state (see there: any device
    count, any stacking, one table at a time, checksums verified), then the
    restored state replaces `emb`'s. Tables of the checkpoint that `emb`
    lacks are ignored.

    All or nothing: the new state is built beside the live one and replaces
    `emb.state` only once every read and check succeeded. A restore that
    fails (unreadable or corrupted data, a bad checkpoint) raises and leaves
    `emb` exactly as it was. The price is one extra copy of the state at
    the peak of a restore (plus one table, or two with `prefetch`, on the
    host).

    Args:
      emb: a `MeshEmbedding`.
      source: an `ocp.CheckpointManager` (a save in flight is waited for), a
        checkpoint root directory, a step directory or the embedding item's
        directory.
      step: the step (default: the latest committed one).
      item: the embedding item's name in the `Composite`.
      missing: "error" (default) raises ValueError when a table of `emb`, or
        one of its optimizer slots, is not in the checkpoint; "keep" leaves
        those at their current (e.g. initial) values.
      prefetch: start reading the next table while the current one is
        written in (holds two tables on the host instead of one).

    Pipelined `emb` and a checkpoint saved with an update pending: the next
    lookup reads the stored "lookup_tables" (one update stale, as the saving
    run's would have), and the restored state is in place right after it.

    Returns the restored step count (`emb.observed_state().step`).

    Raises ValueError before changing anything when a table's vocabulary
    size or dim differs, or something is missing under missing="error"; and
    ValueError, still changing nothing, when a stored array cannot be read or
    does not match its checksum.
    """
    _check_missing(missing)
    path = _item_dir(source, step, item)
    emb.build()
    # the observed state is what missing="keep" keeps; a pipelined emb is not flushed
    restored = core_restore(
        emb.core,
        emb.observed_state(),
        path,
        item=item,
        missing=missing,
        pipelined=emb.pipelined,
        prefetch=prefetch,
        _stats=_stats,
    )
    emb._install_restored(restored)
    return restored.step


# ---------------------------------------------------------------------------
# Serving: parameters only, on the host, no mesh


def load_tables(
    source, step: int | None = None, *, feature_config: Any = None, item: str = DEFAULT_ITEM
) -> dict:
    """`{TableConfig: [vocabulary_size, dim] numpy array}` of a checkpoint's parameters.

    Reads only the parameters (optimizer slots are never read) on any
    machine: no mesh, no devices needed. Each stored block is read straight
    into its rows of the preallocated output (no temporary copy); the next
    table's reads are issued while the current one completes (the outputs
    are all returned anyway, so this holds nothing extra). With
    `feature_config`, the keys are its `TableConfig`s (matched by name, sizes
    checked) and only its tables are read; without, new `TableConfig`s with
    the saved names, sizes and combiners. Each table is checked against the
    checksum recorded at save (on the host CPU; older checkpoints have none):
    an unreadable or corrupted table raises ValueError naming it.
    """
    with _Reader(_item_dir(source, step, item)) as reader:
        meta = reader.meta
        reader.layout  # noqa: B018 - an unknown row layout raises before anything is read
        by_name = {m["name"]: m for m in meta["tables"]}
        if feature_config is None:
            wanted = [
                (
                    TableConfig(
                        m["vocabulary_size"], m["dim"], combiner=m["combiner"], name=m["name"]
                    ),
                    m,
                )
                for m in meta["tables"]
            ]
        else:
            resolved = resolve_feature_config(feature_config)
            wanted = []
            for cfg, name in zip(resolved.tables, resolved.table_names):
                m = by_name.get(name)
                if m is None:
                    raise ValueError(
                        f"table {name} is not in the checkpoint (it has {sorted(by_name)})"
                    )
                _check_compatible(name, cfg, m, "the feature config")
                wanted.append((cfg, m))
        for _, m in wanted:  # before anything is read
            _check_leaf(reader, ("tables", m["key"]), m, m["dim"])
        layout, logical = logical_layout(), [_logical_table(m) for _, m in wanted]

        def start(i):  # the logical table: one block of the logical layout, on the host
            m = wanted[i][1]
            return _start_leaf(
                reader,
                ("tables", m["key"]),
                m,
                layout,
                logical[i],
                [(0, None)],
                np.dtype(m.get("dtype", "float32")),
            )

        out = {}
        # at most two tables' reads in flight
        with contextlib.closing(_streamed(len(wanted), start, prefetch=True)) as pending:
            for i, current in enumerate(pending):
                _wait_leaf(current)
                arr = current.pieces[0][2]
                _verify(current, lambda: _logical_checksum(arr, logical[i]))
                out[wanted[i][0]] = arr
        return out


class EmbeddingForServing:
    """TensorFlow's `TPUEmbeddingForServing`: a feature config's tables on the host for serving.

    `restore` loads the parameters of a training checkpoint (no mesh, no
    slots); `embedding_lookup` / `__call__` run `serving_embedding_lookup`
    on them. Before `restore` (or `build`), tables come from their
    initializers. `optimizer` is accepted for API compatibility and unused.
    """

    def __init__(self, feature_config: Any, optimizer: Any = None):
        self.feature_config = feature_config
        self._resolved = resolve_feature_config(feature_config)
        self.optimizer = optimizer
        self._tables: dict | None = None
        self.step: int | None = None

    def build(self, seed: int = 0):
        """Initialise every table on the host from its initializer."""
        if self._tables is None:
            key = jax.random.key(seed)
            self._tables = {
                t: np.asarray(t.initialize(jax.random.fold_in(key, i)))
                for i, t in enumerate(self._resolved.tables)
            }

    def restore(self, source, step: int | None = None, *, item: str = DEFAULT_ITEM) -> int:
        """Load the parameters of a checkpoint (see `load_tables`); returns its step."""
        path = _item_dir(source, step, item)
        self._tables = load_tables(path, feature_config=self.feature_config)
        self.step = int(read_metadata(path)["step"])
        return self.step

    @property
    def embedding_tables(self) -> dict:
        """`{TableConfig: [vocabulary_size, dim] numpy array}`."""
        self.build()
        return dict(self._tables)

    def embedding_lookup(self, features: Any, weights: Any | None = None) -> Any:
        from embedmesh.serving.lookup import serving_embedding_lookup

        return serving_embedding_lookup(
            features, weights, self.embedding_tables, self.feature_config
        )

    __call__ = embedding_lookup
