"""The id maps of tables of raw 64-bit ids (`TableConfig.id_map`, issue 42) in a checkpoint:
saved beside the rows, verified, and restored as they were (same device count and map
configuration) or rebuilt on their new owners (any other device count or configuration).

Saved: per table of raw ids, the "id_maps" subtree of the embedding item holds each field
of its owners' `IdMapState`s as one `[N, ...]` array (shard j's map at index j, sharded as
in the engine: each process writes its own shards) and "fresh_key", the key data its
fresh rows are initialised from; the table's metadata records the map's configuration
("id_map") and a checksum of every one of those arrays ("id_map.<field>", `CHECKSUM`'s
row hash with row = shard). A shard's map row r is its block's row r of the stored table
(the table is alone in its stack, on every shard), so the stored rows and slots need no
conversion to go with it.

Restored:
- **as it was** when the saving mesh had as many shards as this one, the map's
  configuration is the same and the table's blocks are stored in this plan's layout: every
  shard's map, rows and slots come back bit for bit, so training resumes bit-identically
  (same rows, same assignments, same future evictions, same admissions);
- **rebuilt** otherwise (another device count, another `DynamicIds` configuration, another
  capacity, or a checkpoint of format version 2, whose index has another layout): every
  live id of every saved shard goes to its owner on this mesh (`id_map.owner_of(id, N,
  seed)`, the live configuration's seed), with its row's values,
  its optimizer slots, its last-used step and use count; each owner's ids take rows
  `0, 1, ...` (compacted; in the order of (saved shard, saved row)) and are inserted into
  its index as `map_ids` inserts (the emptier of its two buckets); the rest of its rows are
  free, their values zero (a row given to an id is re-initialised before it is read).
  The admission sketch counts sightings of the ids a shard owns, so it cannot be split by
  id: with the same sketch configuration (width, depth, seed, `admit_after` > 1 on both
  sides) each new shard's sketch is the counter-wise maximum of every saved shard's (its
  sightings count: their maximum), so no pending id's count goes down (an id is never
  admitted later than it would have been) and some may go up (an earlier, false
  admission, as the sketch's own over-counting gives; halvings wear it down); with the
  same device count and seed (only e.g. `evict_batch` or `eviction` changed) each shard
  keeps its own sketch; with another sketch configuration the sketch starts at zero.
- A restore that cannot fit the live ids (more on some new owner than its rows, or, at
  load <= 0.25 never seen, both buckets of an id full) is a ValueError naming the table,
  the shard and the numbers, raised after reading the maps and before reading any table,
  and changes nothing.

A rebuild reads the whole saved map, table and slots on every process (each process then
keeps its own shards): O(table) host memory per process, where a same-layout restore
reads only the process's own rows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from embedmesh.checkpoint import id_map_format
from embedmesh.checkpoint.checksums import logical_checksum
from embedmesh.checkpoint.id_map_format import (
    KEY_FIELD,
    MAP_FIELDS,
    checksum_field,
    flat_hasher,
    live_entries,
)
from embedmesh.checkpoint.leaves import start_leaf, verify_checksum, wait_leaf
from embedmesh.checkpoint.reading import host_buffer
from embedmesh.checkpoint.recut import (
    logical_table,
    same_layout,
    saved_logical_rows,
    stored_shards,
    stored_table,
)
from embedmesh.device import id_map
from embedmesh.device.stack_tables import write_table
from embedmesh.layout.rows import logical_layout, row_layout

_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(id_map.IdMapConfig))
_W = id_map.BUCKET_WIDTH
_TAG, _ROW = id_map_format.TAG, id_map_format.ROW


def config_meta(config: id_map.IdMapConfig) -> dict:
    """The "id_map" entry of a table's metadata: the map's configuration (one shard's)."""
    return {name: getattr(config, name) for name in _CONFIG_FIELDS}


# ---------------------------------------------------------------------------- checksums


# ------------------------------------------------------------------------------- saving


def saved_arrays(core, state, t) -> tuple:
    """`({field: array}, {checksum field: unfetched checksum})` of table `t`'s id maps in
    `state` (the arrays as the engine holds them: nothing is copied)."""
    maps = state.id_maps.get(t.stack)
    if maps is None:
        raise ValueError(
            f"table {t.name} is a table of raw ids, and the state has no id map for it (a "
            f"state from EmbeddingCore.init holds one for every table of raw ids)"
        )
    arrays = {f: getattr(maps["map"], f) for f in MAP_FIELDS}
    arrays[KEY_FIELD] = maps["key"]
    hasher = flat_hasher(core.replicated)
    return arrays, {checksum_field(f): hasher(a) for f, a in arrays.items()}


# ------------------------------------------------------------------------------ reading


def check_kinds(core, by_name: dict) -> None:
    """ValueError, before anything is read, where a table of raw ids would be restored from
    a table of ids in `[0, V)` or the reverse (their rows mean different things), or from
    a table of another dim."""
    for t in core.plan.tables:
        m = by_name.get(t.name)
        if m is None:
            continue
        live = t.stack in core.dynamic
        stored = m.get("id_map") is not None
        if live and not stored:
            raise ValueError(
                f"table {t.name} is a table of raw ids (TableConfig.id_map) here, and a table "
                f"of ids in [0, {m['vocabulary_size']}) in the checkpoint (no id map): its rows "
                f"cannot be given raw ids"
            )
        if stored and not live:
            raise ValueError(
                f"table {t.name} is a table of raw ids in the checkpoint (its rows are placed by "
                f"its id map, not by id) and a table of ids in [0, {t.vocabulary_size}) here: "
                f"restore it into a table with TableConfig(id_map=DynamicIds(...))"
            )
        if live and m["dim"] != t.dim:
            raise ValueError(
                f"table {t.name}: the checkpoint has dim {m['dim']}, the embedding {t.dim}"
            )


def read_maps(reader, m: dict) -> dict:
    """`{field: numpy [N_saved, ...]}` of a stored table's id maps (and its fresh rows'
    key), each checked against its recorded checksum; a ValueError naming the table and
    the array when one is missing, of the wrong shape, unreadable or corrupted."""
    n = int(reader.meta["num_shards"])
    cfg = id_map.IdMapConfig(**m["id_map"])
    c, b = cfg.capacity, cfg.num_buckets
    sketch = (cfg.sketch_depth, cfg.sketch_width) if cfg.admit_after > 1 else (1, 1)
    if int(reader.meta.get("format_version", 0)) < 3:  # (format version 2's index)
        index = (n, 1 << max(0, -(-2 * c // 16) - 1).bit_length(), 3, 16)
    else:
        index = (n, b, 2, _W)
    shapes = {
        "index": index,
        "row_info": (n, c, 4),
        "row_id": (n, c, 2),
        "last_used": (n, c),
        "use_count": (n, c),
        "row_slot": (n, c),
        "free": (n, c),
        "free_head": (n,),
        "num_free": (n,),
        "sketch": (n,) + sketch,
        "sightings": (n,),
    }
    return id_map_format.read_maps(reader, m, shapes)


# -------------------------------------------------------------------------- rebuilding


def _insert(config: id_map.IdMapConfig, pairs: np.ndarray, what: str) -> tuple:
    """(index, row_slot) with `pairs[k]` (uint32 [k, 2]) at row k, each in the emptier of
    its two buckets (the first on a tie) that has no slot of its tag, at that bucket's
    first empty slot (`map_ids`' rule, one id at a time)."""
    index = np.zeros((config.num_buckets, 2, _W), np.uint32)
    index[:, _ROW, :] = id_map.EMPTY
    row_slot = np.full((config.capacity,), -1, np.int32)
    if not len(pairs):
        return index, row_slot
    b1, b2 = (np.asarray(b) for b in id_map.buckets(config, pairs[:, 0], pairs[:, 1]))
    tags = np.asarray(id_map.tags(config, pairs[:, 0], pairs[:, 1]))
    fill = [0] * config.num_buckets

    def room(b, tag):  # empty slots, -1 where a slot has the tag
        return -1 if tag in index[b, _TAG, : fill[b]] else _W - fill[b]

    for k in range(len(pairs)):
        x, y = int(b1[k]), int(b2[k])
        rx, ry = room(x, tags[k]), room(y, tags[k])
        b, r = (y, ry) if ry > rx else (x, rx)
        if r <= 0:
            raise ValueError(
                f"{what}: both index buckets of raw id {int(id_map.join_ids(pairs[k]))} are "
                f"full ({_W} slots each) or hold its tag, so it cannot be placed (a map at "
                f"load <= 0.25 with two choices: vanishingly rare); restore with a larger "
                f"vocabulary_size"
            )
        i = fill[b]
        index[b, _TAG, i], index[b, _ROW, i] = tags[k], k
        row_slot[k] = b * _W + i
        fill[b] = i + 1
    return index, row_slot


def _merged_sketch(
    saved_cfg: dict, config: id_map.IdMapConfig, maps: dict, n_new: int, same_owners: bool
):
    """The sketch and sightings count of every new shard (module docstring);
    `same_owners`: the saved and the new shards own the same ids."""
    keys = ("seed", "sketch_width", "sketch_depth")
    if (
        config.admit_after > 1
        and saved_cfg["admit_after"] > 1
        and all(saved_cfg[k] == getattr(config, k) for k in keys)
    ):
        n_old = maps["sketch"].shape[0]
        if n_old == n_new and same_owners:  # same owners (same seed): each shard its own
            return [maps["sketch"][j] for j in range(n_new)], list(maps["sightings"])
        sketch, sightings = maps["sketch"].max(axis=0), maps["sightings"].max()
        return [sketch] * n_new, [sightings] * n_new
    shape = (config.sketch_depth, config.sketch_width) if config.admit_after > 1 else (1, 1)
    return [np.zeros(shape, np.int32)] * n_new, [np.int32(0)] * n_new


def rebuild(
    name: str,
    saved_cfg: dict,
    maps: dict,
    config,
    n_new: int,
    owners: tuple | None = None,
    same_owners: bool = True,
) -> tuple:
    """The maps of `n_new` shards with `config` holding every live id of the saved `maps`:
    `(fields, sources)`, `fields` `{field: numpy [n_new, ...]}` (an `IdMapState`'s), and
    `sources[j]` = (saved shard, saved row) int64 arrays of shard j's rows `0..k-1`.
    `owners`: `(first, k)`, the new shards owning the ids (`first + owner_of(id, k, seed)`;
    `StackingPlan.id_owners`; None: all `n_new`), the other shards' maps empty; `same_owners`:
    the saved shards owned ids by the same rule (each then keeps its own sketch). A
    ValueError naming the table and the numbers where some owner gets more live ids than
    its rows."""
    live = live_entries(maps)
    n_old = maps["row_slot"].shape[0]
    pairs = id_map.split_ids(live["ids"])
    first, k_own = (0, n_new) if owners is None else owners
    owner = first + np.asarray(id_map.owner_of(pairs, k_own, config.seed)).astype(np.int64)
    counts = np.bincount(owner, minlength=n_new)
    c = config.capacity
    if counts.size and counts.max() > c:
        j = int(np.argmax(counts))
        raise ValueError(
            f"table {name}: its checkpoint holds {live['ids'].size} live ids (on {n_old} "
            f"shards of {saved_cfg['capacity']} rows); on {k_own} shards of {c} rows "
            f"(vocabulary_size {c * k_own}), shard {j} would own {int(counts[j])} of them, more "
            f"than its {c} rows: restore with a larger vocabulary_size (at least "
            f"{int(counts.max()) * k_own}) or onto other devices; nothing was changed"
        )
    sketches, sightings = _merged_sketch(saved_cfg, config, maps, n_new, same_owners)
    out = {f: [] for f in MAP_FIELDS}
    sources = []
    for j in range(n_new):
        mine = np.flatnonzero(owner == j)  # (saved shard, saved row) order
        k = mine.size
        index, row_slot = _insert(config, pairs[mine], f"table {name}, shard {j} of {n_new}")
        row_info = np.zeros((c, 4), np.int32)
        row_info[:, id_map.LAST_USED] = -1
        row_info[:k, :2] = pairs[mine].view(np.int32)
        row_info[:k, id_map.LAST_USED] = live["last_used"][mine]
        row_info[:k, id_map.USE_COUNT] = live["use_count"][mine]
        free = np.zeros((c,), np.int32)
        free[: c - k] = np.arange(k, c, dtype=np.int32)
        for f, v in (
            ("index", index),
            ("row_info", row_info),
            ("row_slot", row_slot),
            ("free", free),
            ("free_head", np.int32(0)),
            ("num_free", np.int32(c - k)),
            ("sketch", np.asarray(sketches[j], np.int32)),
            ("sightings", np.int32(sightings[j])),
        ):
            out[f].append(v)
        sources.append((live["shard"][mine], live["row"][mine]))
    return {f: np.stack(v) for f, v in out.items()}, sources


# ------------------------------------------------------------------------------ restoring


@dataclasses.dataclass
class Plan:
    """How one table of raw ids is restored: `direct` (as it was: its rows and slots by
    the ordinary leaf reads) or rebuilt (`sources`: its rows' saved places), and its maps'
    fields on the host (`[N, ...]`, this mesh's shards)."""

    table: object  # the live TablePlacement
    meta: dict  # the stored table's metadata
    direct: bool
    fields: dict
    key: np.ndarray
    sources: list | None = None


def plan_table(core, reader, t, m: dict) -> Plan:
    """Read and verify table `t`'s saved maps, and decide (and check) how it is restored."""
    maps = read_maps(reader, m)
    _, config = core.dynamic[t.stack]
    n_old, n_new = int(reader.meta["num_shards"]), core.num_shards
    k_old = stored_shards(reader.meta, m)  # the stored blocks: the span's (leaves.py)
    src_layout = row_layout(reader.layout.name, k_old)
    src = stored_table(m, k_old)
    owners = core.plan.id_owners(t.name)
    same_owners = (int(m.get("first_shard", 0)), int(m.get("span", n_old))) == owners
    direct = (
        n_old == n_new
        and id_map_format.current_layout(maps)
        and m["id_map"] == config_meta(config)
        and same_owners
        and same_layout(src_layout, src, core.plan.row_layout, t)
    )
    key = maps.pop(KEY_FIELD)
    if direct:
        return Plan(t, m, True, maps, key)
    fields, sources = rebuild(
        t.name, m["id_map"], maps, config, n_new, owners, same_owners and n_old == n_new
    )
    return Plan(t, m, False, fields, key, sources)


def place_maps(core, plan: Plan, live_key) -> dict:
    """`{"map": IdMapState, "key": key data}` of the plan's maps on the core's mesh."""
    _, config = core.dynamic[plan.table.stack]

    def place(host, sharding):
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    key = np.asarray(plan.key)
    live_shape = None if live_key is None else tuple(live_key.shape)
    if live_key is not None and (key.shape != live_shape or key.dtype != np.dtype(live_key.dtype)):
        raise ValueError(
            f"table {plan.table.name}: the checkpoint's key of fresh rows is {key.dtype} "
            f"{key.shape}, this engine's {np.dtype(live_key.dtype)} {live_shape} (another "
            f"PRNG implementation): it cannot be restored"
        )
    fields = {f: place(np.asarray(plan.fields[f]), core.row_sharding) for f in MAP_FIELDS}
    return {
        "map": id_map.IdMapState(config=config, **fields),
        "key": place(key, core.replicated),
    }


def _local_shards(core, rows: int, width: int) -> list:
    shape = (core.num_shards * rows, width)
    out = []
    for device, index in core.row_sharding.addressable_devices_indices_map(shape).items():
        out.append(((index[0].start or 0) // rows, device))
    return sorted(out, key=lambda x: x[0])


def write_rebuilt(core, reader, plan: Plan, field: str, leaf: tuple, target, donate, column):
    """Table `plan.table`'s `field` (parameters or a slot) read whole into the logical
    layout, verified against its checksum, and its live ids' rows written at their new
    places (the other rows zero) into `target` (the stack array; see `write_table`)."""
    t, m = plan.table, plan.meta
    n_old = int(reader.meta["num_shards"])
    logical_t = logical_table(m)
    dtype = target.dtype
    pending = start_leaf(
        reader, leaf, m, logical_layout(), logical_t, [(0, None)], np.dtype(dtype), field
    )
    wait_leaf(pending)
    table = pending.pieces[0][2]
    verify_checksum(pending, lambda: logical_checksum(table, logical_t))
    width = table.shape[1] if table.ndim > 1 else 1
    arr = table.reshape(table.shape[0], width)
    pieces = []
    for j, device in _local_shards(core, t.rows_per_shard, width):
        shard, row = plan.sources[j]
        logical = saved_logical_rows(reader.layout.name, n_old, m, shard, row)
        piece = host_buffer((t.rows_per_shard, width), np.dtype(dtype))
        piece[:] = 0
        piece[: logical.size] = arr[logical]
        pieces.append(jax.device_put(piece, device))
    del arr
    shape = (core.num_shards * t.rows_per_shard, width)
    whole = jax.make_array_from_single_device_arrays(shape, core.row_sharding, pieces)
    out = write_table(core, target, whole, t, donate, column)
    out.block_until_ready()
    whole.delete()
    return out
