"""A table of raw ids read from a training state for serving (issue 42): its live ids
and their rows (`raw_id_tables`, `MeshEmbedding.embedding_tables`), and the changes since
an earlier read (`export_increment`), as `embedmesh.layout.by_id`'s `RawIdTable` /
`RawIdUpdate`.

Live rows: a row is live iff its slot in the index names it (`id_map.IdMapState`); an
increment since step `s` holds the live rows whose last-used step is `>= s` (a row's
values change only in a step that looks it up, so uses it, or admits an id into it), and
as removed the ids of the earlier table that are no longer live. Only the needed rows are
read from the devices (one gather). One process: the maps and rows are read with
`jax.device_get`.
"""

from __future__ import annotations

import jax
import numpy as np

from embedmesh.device import id_map
from embedmesh.layout.by_id import RawIdTable, RawIdUpdate, _isin_sorted

__all__ = ["export_increment", "raw_id_tables"]


def _engine(engine, state):
    """(core, state) from an engine that holds both (its public `core` and
    `observed_state()`, the state every accepted update applied) or an `EmbeddingCore`
    (with `state`)."""
    if hasattr(engine, "observed_state"):
        return engine.core, engine.observed_state() if state is None else state
    if state is None:
        raise ValueError("an EmbeddingCore needs its state: pass state=")
    return engine, state


def _dynamic_table(core, table):
    t = core.plan.table(table)
    if t.stack not in core.dynamic:
        raise ValueError(f"table {t.name} is not a table of raw ids (TableConfig.id_map)")
    return t


def _live(core, state, t):
    """(shard, local row, raw id, last used) of each live row of table `t`, numpy."""
    _, config = core.dynamic[t.stack]
    m = state.id_maps[t.stack]["map"]
    index, row_slot, row_id, last_used = jax.device_get(
        (m.index, m.row_slot, m.row_id, m.last_used)
    )
    index, row_slot = np.asarray(index), np.asarray(row_slot)
    n = row_slot.shape[0]
    words = index[:, :, id_map.ROW_WORD, :].reshape(n, -1)  # each slot's row word
    s = np.clip(row_slot, 0, words.shape[1] - 1)
    word = np.take_along_axis(words, s, axis=1)
    live = (row_slot >= 0) & (word == np.arange(config.capacity, dtype=np.uint32)[None, :])
    shard, row = np.nonzero(live)
    ids = id_map.join_ids(np.asarray(row_id)[shard, row])
    return shard, row, ids, np.asarray(last_used)[shard, row]


def _rows(core, state, t, shard, row) -> np.ndarray:
    """The parameters of the given (shard, local row) pairs of table `t`, `[k, dim]`;
    only those rows are read from the devices."""
    import jax.numpy as jnp

    arr, column = core.field_array(state, t.stack, "parameters")
    width = core.field_width(t, "parameters")
    per_shard = arr.shape[0] // core.num_shards
    at = shard.astype(np.int64) * per_shard + t.local_row_offset + row
    if at.size == 0:
        return np.zeros((0, width), arr.dtype)
    # padded to a power of two (repeating a row): one gather program per size class, not
    # one per count of rows
    size = max(8, 1 << (int(at.size) - 1).bit_length())
    idx = np.concatenate([at, np.full(size - at.size, at[0], at.dtype)]).astype(np.int32)
    got = np.asarray(jax.device_get(_gather(arr, jnp.asarray(idx))))[: at.size]
    return got[:, column : column + width]


@jax.jit
def _gather(arr, idx):
    return arr[idx]


def _one_table(core, state, table) -> RawIdTable:
    t = _dynamic_table(core, table)
    shard, row, ids, _ = _live(core, state, t)
    order = np.argsort(ids, kind="stable")
    rows = _rows(core, state, t, shard[order], row[order])
    capacity = core.plan.table_config(t).vocabulary_size
    padded = np.zeros((capacity + 1, rows.shape[1]), rows.dtype)
    padded[: ids.shape[0]] = rows
    return RawIdTable._of_sorted(ids[order], padded, capacity, int(state.step))


def raw_id_tables(engine, state=None) -> dict:
    """`{TableConfig: RawIdTable}` of every table of raw ids, from a `MeshEmbedding` (its
    observed state, as `embedding_tables` reads) or an `EmbeddingCore` and its `state`:
    the live ids, sorted, and their rows, at `state.step`. One process (the id maps and
    rows are read with `jax.device_get`)."""
    core, state = _engine(engine, state)
    out = {}
    for t, _ in core.dynamic.values():
        out[core.plan.table_config(t)] = _one_table(core, state, t.name)
    return out


def export_increment(engine, since: dict, state=None) -> dict:
    """`{TableConfig: RawIdUpdate}`: for each table of `since` (`{TableConfig: RawIdTable}`,
    the tables the servers hold, e.g. an earlier `raw_id_tables` or the result of applying
    the earlier increments), the changes from `since[table].step` to the state's step
    (`RawIdUpdate`). Reads the id maps (O(capacity) integers) and only the changed rows.
    `engine`: a `MeshEmbedding` or an `EmbeddingCore` with `state`."""
    core, state = _engine(engine, state)
    step = int(state.step)
    out = {}
    for cfg, base in since.items():
        if not isinstance(base, RawIdTable):
            raise TypeError(
                f"since[{getattr(cfg, 'name', cfg)!r}] must be a RawIdTable, got "
                f"{type(base).__name__}"
            )
        if base.step is None:
            raise ValueError(
                f"since[{getattr(cfg, 'name', cfg)!r}] has no step (a table made by hand): "
                f"an increment needs the step it was read at"
            )
        if base.step > step:
            raise ValueError(
                f"since[{getattr(cfg, 'name', cfg)!r}] is at step {base.step}, after the "
                f"state's step {step}"
            )
        t = _dynamic_table(core, cfg)
        shard, row, ids, last_used = _live(core, state, t)
        changed = last_used >= base.step
        order = np.argsort(ids[changed], kind="stable")
        rows = _rows(core, state, t, shard[changed][order], row[changed][order])
        removed = base.ids[~_isin_sorted(base.ids, np.sort(ids))]
        out[cfg] = RawIdUpdate(ids[changed][order], rows, removed, base.step, step)
    return out
