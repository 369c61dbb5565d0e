"""Checksums of stored arrays (`CHECKSUM`), computed on the devices that hold them at
save and verified where a restore or `load_tables` reads them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from embedmesh._runtime import fmix32
from embedmesh.layout.rows import RowLayout

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

#: The name of the checksum a checkpoint stores for each table and slot: a sum over
#: logical rows that does not depend on the device count, verified at every restore and
#: by `load_tables`.
CHECKSUM = "embedmesh-rowsum-fmix32x2-v1"


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


def rows_hash(x, logical_rows, valid):
    """uint32[2]: the two lane sums over the rows `valid` of a block `x` whose row r is
    logical row `logical_rows[r]`."""
    w = _words(x)
    i = logical_rows.astype(jnp.uint32)[:, None]
    k = jnp.arange(w.shape[1], dtype=jnp.uint32)[None, :]
    a = fmix32(w ^ (i * np.uint32(0x9E3779B1) + k * np.uint32(0x85EBCA77) + np.uint32(0x165667B1)))
    b = fmix32(
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
        return jax.lax.psum(rows_hash(x, i, i < vocab), axes)

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(), P()), out_specs=P(), check_vma=False)
    )


def _checksum(mesh, axes, layout: RowLayout, arr, t):
    """The (unfetched) checksum of table `t`'s `[N * rows_per_shard, ...]` array laid out by
    `layout` on `mesh`."""
    return _hasher(mesh, axes, layout)(
        arr, np.asarray(layout.kernel_params(t), np.int32), np.int32(t.vocabulary_size)
    )


def device_checksum(core, arr: jax.Array, t):
    """The (unfetched) checksum of table `t`'s array on `core`'s mesh and layout."""
    return _checksum(core.mesh, core.axes, core.plan.row_layout, arr, t)


def checksum_hex(value) -> str:
    a, b = (int(v) for v in np.asarray(jax.device_get(value)).reshape(-1))
    return f"{a:08x}{b:08x}"


@functools.cache
def logical_hasher():
    """jit on the host CPU: the checksum of a logical `[vocabulary_size, ...]` table. The
    logical layout maps row i to i, so this is the mesh hasher without its layout
    arithmetic and all-reduce (measured: 0.14 s instead of 0.17-0.19 s for 500k x 64,
    and a cheaper first compile); every `load_tables` test checks it against the checksum
    the mesh hasher recorded at save."""

    def fn(x):
        i = jnp.arange(x.shape[0], dtype=jnp.int32)
        return rows_hash(x, i, jnp.ones(x.shape[:1], bool))

    return jax.jit(fn)


def logical_checksum(arr: np.ndarray, t) -> str:
    """The checksum of a logical table `t` (`[vocabulary_size, ...]`) on the host CPU:
    what `load_tables` verifies."""
    if arr.shape[0] != t.vocabulary_size:
        raise ValueError(f"table {t.name}: {arr.shape[0]} rows, expected {t.vocabulary_size}")
    host = jax.local_devices(backend="cpu")[0]  # this process's: any process may verify
    return checksum_hex(logical_hasher()(jax.device_put(arr, host)))


def expected_checksum(reader, meta_table: dict, field: str, leaf: tuple, dtype) -> str | None:
    """The recorded checksum of a leaf, or None when it cannot be verified: an older
    checkpoint (none recorded), another algorithm, or a read that casts the stored dtype."""
    if reader.meta.get("checksum") != CHECKSUM:
        return None
    recorded = (meta_table.get("checksums") or {}).get(field)
    if recorded is None or np.dtype(reader.dtype(leaf)) != np.dtype(dtype):
        return None
    return str(recorded)
