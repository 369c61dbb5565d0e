"""The stored form of the id maps of tables of raw 64-bit ids in a checkpoint, and its
verified reading: the arrays' names, how a live id is found in them, the checksums. Numpy
and jax's CPU only, no device code: serving reads a checkpoint's tables of raw ids through
`load_tables` (`embedmesh.checkpoint.loading`) with no mesh; `id_maps` saves, restores and
rebuilds the maps on one.

The stored arrays of a table (subtree `SUBTREE`, then the table's key) are its owners'
`embedmesh.device.id_map.IdMapState` fields (`MAP_FIELDS`, one `[N, ...]` array each: shard
j's at index j) and `KEY_FIELD`. An index slot is two uint32 words `[tag, row]` (`TAG`,
`ROW`) of a bucket of `index.shape[-1]` slots; row r of shard j is live when its
`row_slot` names a slot whose row word is r; its raw id is `row_info[j, r, :2]` (high, low
words, int32 bit for bit), its last-used step and use count `row_info[j, r, 2:]`.

Checkpoint format version 2 (embedmesh before 2026-12-06 xiii) stored the fields
`MAP_FIELDS_V2`: an index slot of three words `[hi, lo, row]` in buckets of 16, and the
rows' ids, last-used steps and use counts apart. `read_maps` reads either and gives the
version 2 maps' rows as a `row_info`, their index as stored (its row word is the last word
of a slot in both layouts): `live_entries` reads both, and a restore rebuilds such maps
(`id_maps`), never places their index as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.checkpoint.checksums import CHECKSUM, checksum_hex, rows_hash
from embedmesh.checkpoint.reading import host_buffer, wait_all

SUBTREE = "id_maps"  # the embedding item's subtree of the maps
KEY_FIELD = "fresh_key"  # the key data a table's fresh rows are initialised from
# `IdMapState`'s array fields, in its order (checked against it by `id_maps`' tests)
MAP_FIELDS = (
    "index",
    "row_info",
    "row_slot",
    "free",
    "free_head",
    "num_free",
    "sketch",
    "sightings",
)
FIELDS = MAP_FIELDS + (KEY_FIELD,)
TAG, ROW = 0, 1  # the words of an index slot
# checkpoint format version 2's fields (module docstring)
MAP_FIELDS_V2 = (
    "index",
    "row_id",
    "row_slot",
    "last_used",
    "use_count",
    "free",
    "free_head",
    "num_free",
    "sketch",
    "sightings",
)


def current_layout(maps: dict) -> bool:
    """Whether read maps are in this version's layout (else format version 2's: rebuilt,
    never placed as they are)."""
    return maps["index"].shape[-2] == 2


def checksum_field(field: str) -> str:
    """The name of a map array's checksum in the table's "checksums"."""
    return f"id_map.{field}"


@functools.cache
def flat_hasher(out_sharding=None):
    """jit: the checksum (uint32[2]) of an array seen as rows of its first axis (a map
    field `[N, ...]`: a row a shard): `CHECKSUM`'s row hash with row i = index i. The same
    function hashes the sharded arrays at save (the result replicated on the mesh:
    `out_sharding`, so every process fetches it) and the host arrays a restore read."""

    def fn(x):
        rows = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
        i = jnp.arange(rows.shape[0], dtype=jnp.int32)
        return rows_hash(rows, i, jnp.ones(rows.shape[:1], bool))

    return jax.jit(fn, out_shardings=out_sharding)


def host_checksum(arr: np.ndarray) -> str:
    host = jax.local_devices(backend="cpu")[0]  # this process's: each process verifies
    return checksum_hex(flat_hasher()(jax.device_put(arr, host)))


def _read_whole(reader, leaf: tuple, what: str) -> np.ndarray:
    shape, dtype = reader.shape(leaf), reader.dtype(leaf)
    buf = host_buffer(shape, dtype)
    try:
        if len(shape):
            wait_all(reader.start_fill(leaf, [(buf, 0, 1, 0, 1, shape[0])]))
        else:  # pragma: no cover - every map array has a shard axis
            buf[...] = reader.read(leaf)
    except Exception as e:
        raise ValueError(f"cannot read {what} from checkpoint item {reader.path}: {e}") from e
    return buf


def read_maps(reader, m: dict, shapes: dict | None = None) -> dict:
    """`{field: numpy [N_saved, ...]}` of a stored table's id maps (and its fresh rows'
    key), each checked against its recorded checksum (and against `shapes`, `{field:
    shape}`, where given); a ValueError naming the table and the array when one is
    missing, of the wrong shape, unreadable or corrupted. Format version 2's maps
    (module docstring) come with `row_info` made of their rows' arrays."""
    verify = reader.meta.get("checksum") == CHECKSUM
    sums = m.get("checksums") or {}
    v2 = int(reader.meta.get("format_version", 0)) < 3
    out = {}
    for field in (MAP_FIELDS_V2 if v2 else MAP_FIELDS) + (KEY_FIELD,):
        leaf = (SUBTREE, m["key"], field)
        what = f"the id map's array {field!r} of table {m['name']} (array '{'.'.join(leaf)}')"
        if not reader.has(leaf):
            raise ValueError(
                f"checkpoint item {reader.path} lacks {what}, which a table of raw ids has"
            )
        shape = reader.shape(leaf)
        if shapes is not None and field in shapes and shape != shapes[field]:
            raise ValueError(
                f"checkpoint item {reader.path}: {what} has shape {shape}, its metadata says "
                f"{shapes[field]}"
            )
        arr = _read_whole(reader, leaf, what)
        recorded = sums.get(checksum_field(field))
        if verify and recorded is not None:
            got = host_checksum(arr)
            if got != recorded:
                raise ValueError(
                    f"checkpoint item {reader.path}: {what} is corrupted: its checksum is "
                    f"{got}, the checkpoint recorded {recorded} ({CHECKSUM})"
                )
        elif verify:
            raise ValueError(
                f"checkpoint item {reader.path}: no checksum of {what} is recorded "
                f"(a table of raw ids is never restored unverified)"
            )
        out[field] = arr
    if v2:
        ids = out.pop("row_id").astype(np.uint32).view(np.int32)
        counts = (out.pop("last_used"), out.pop("use_count"))
        out["row_info"] = np.concatenate(
            [ids] + [x.astype(np.int32)[..., None] for x in counts], -1
        )
    return out


def live_entries(maps: dict) -> dict:
    """The live ids of saved maps (`read_maps`'), in (shard, row) order: `{"ids": int64,
    "shard", "row", "last_used", "use_count"}` arrays (a row is live when its slot's row
    word names it)."""
    n, c = maps["row_slot"].shape
    w = maps["index"].shape[-1]  # slots a bucket
    num_slots = maps["index"].shape[1] * w
    row_word = maps["index"].shape[-2] - 1  # a slot's last word (both layouts)
    shards, rows = [], []
    for j in range(n):
        slot = maps["row_slot"][j]
        s = np.clip(slot, 0, num_slots - 1)
        word = maps["index"][j][s // w, row_word, s % w]
        live = (slot >= 0) & (word == np.arange(c, dtype=np.uint32))
        r = np.flatnonzero(live)
        shards.append(np.full(r.shape, j, np.int64))
        rows.append(r.astype(np.int64))
    shard, row = np.concatenate(shards), np.concatenate(rows)
    info = maps["row_info"][shard, row]
    return {
        "ids": join_ids(info[:, :2].view(np.uint32)),
        "shard": shard,
        "row": row,
        "last_used": info[:, 2].astype(np.int32),
        "use_count": info[:, 3].astype(np.int32),
    }


def join_ids(pairs) -> np.ndarray:
    """uint32 `[..., 2]` (high, low) word pairs -> int64 raw ids."""
    p = np.asarray(pairs).astype(np.uint32).astype(np.uint64)
    return ((p[..., 0] << np.uint64(32)) | p[..., 1]).view(np.int64)
