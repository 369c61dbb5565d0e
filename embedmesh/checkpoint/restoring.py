"""Restoring onto a core or into a `MeshEmbedding` (any mesh, any stacking): each leaf
read into this process's shards of the new layout, verified, and written into a new
state built beside the live one."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from embedmesh.checkpoint import id_maps
from embedmesh.checkpoint import tiered as _tiered
from embedmesh.checkpoint.checksums import checksum_hex, device_checksum
from embedmesh.checkpoint.format import DEFAULT_ITEM, LOOKUP_FIELD
from embedmesh.checkpoint.leaves import (
    PendingLeaf,
    check_compatible,
    check_leaf,
    start_leaf,
    streamed_leaves,
    verify_checksum,
    wait_leaf,
)
from embedmesh.checkpoint.reading import TreeReader, item_directory
from embedmesh.checkpoint.saving import optimizer_name
from embedmesh.device.stack_tables import write_table

_log = logging.getLogger(__name__)

MISSING_POLICIES = ("error", "keep")
_DIRECT = id_maps.Plan(None, {}, True, {}, None)  # a table restored by its leaves alone


# Optimizers whose slots hold one value a row ([rows, 1]), by class name
_ROW_SLOT_OPTIMIZERS = frozenset({"RowWiseAdagrad"})


def _check_slot_kinds(name: str, opt, meta_table: dict) -> None:
    """ValueError when the checkpoint's optimizer keeps its slots per row and the live one
    per element, or the reverse (an Adagrad checkpoint into RowWiseAdagrad: both name
    their slot "accumulators", of different shapes); no conversion is made."""
    stored = meta_table.get("optimizer")
    live = optimizer_name(opt)
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
    return t.dim if field == LOOKUP_FIELD else core.field_width(t, field)


def _local_shards(core, shape: tuple) -> list:
    """[(shard index j, device)] of this process, in shard order, for a row-sharded array."""
    rows = shape[0] // core.num_shards
    out = []
    for device, index in core.row_sharding.addressable_devices_indices_map(shape).items():
        start = index[0].start or 0
        out.append((start // rows if rows else 0, device))
    return sorted(out, key=lambda x: x[0])


def _place_leaf(
    core,
    pending: PendingLeaf,
    stack_array: jax.Array,
    t,
    *,
    donate: bool = True,
    column: int = 0,
) -> jax.Array:
    """Wait for a leaf's reads, verify its checksum, then return the stack array with it
    written in from column `column` (a slot kept in the rows: its first): in place
    (`donate=True`: `stack_array` is consumed), or into a new array (`donate=False`:
    `stack_array` stays intact)."""
    wait_leaf(pending)
    rest = pending.pieces[0][2].shape[1:] if pending.pieces else stack_array.shape[1:]
    shape = (core.num_shards * t.rows_per_shard,) + tuple(rest)
    # On CPU, device_put aliases the (aligned) buffers: no copy until the write below
    placed = [jax.device_put(piece, device) for _, device, piece in pending.pieces]
    pending.pieces = []
    piece = jax.make_array_from_single_device_arrays(shape, core.row_sharding, placed)
    del placed
    try:
        verify_checksum(pending, lambda: checksum_hex(device_checksum(core, piece, t)))
    except ValueError:
        piece.delete()
        raise
    # The first write into a live stack is not donated (`restore` builds the new state
    # beside the live one); later writes into that new array are in place
    out = write_table(core, stack_array, piece, t, donate, column)
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


def _leaves_to_read(core, by_name: dict, pipelined: bool) -> tuple:
    """`(todo, problems)` for a checkpoint whose tables are `by_name`: `todo`, the
    `(placement, meta table, field)` to read in plan order (each table's parameters, then
    its slots; with `pipelined` the stored lookup tables last), `problems`, what it lacks.
    A ValueError, before anything is read, where a table or its slots cannot be restored."""
    todo, problems = [], []
    for t in core.plan.tables:
        m = by_name.get(t.name)
        if t.stack not in core.dynamic:  # a table of raw ids may change its capacity
            check_compatible(t.name, t, m)
        if m is None:
            problems.append(f"table {t.name} is not in the checkpoint")
            continue
        todo.append((t, m, "parameters"))
        _check_slot_kinds(t.name, core.optimizer_of(t.stack), m)
        for slot in core.slot_names(t.stack):
            if slot in m["slots"]:
                todo.append((t, m, slot))
            else:
                problems.append(
                    f"slot {slot!r} of table {t.name} is not in the checkpoint "
                    f"(it has {m['slots']}; optimizer {m['optimizer']})"
                )
    if pipelined:  # what the next lookup reads, where an update was pending at save
        todo += [
            (t, by_name[t.name], LOOKUP_FIELD)
            for t in core.plan.tables
            if by_name.get(t.name, {}).get("lookup")
        ]
    return todo, problems


def _leaf_key(m: dict, field: str) -> tuple:
    """The stored leaf of a table's `field` (`m`: the table's meta)."""
    if field == "parameters":
        return ("tables", m["key"])
    if field == LOOKUP_FIELD:
        return ("lookup_tables", m["key"])
    return ("slots", m["key"], field)


class _NewState:
    """The restored state's arrays as they are written. Each starts as the live one and is
    replaced by a new array on its first write (not donated: the live one stays intact),
    then written in place; the lookup tables, read last, start as the restored tables of
    their stack. A slot kept in its table's rows is written into the table's array."""

    def __init__(self, live, plan):
        self.plan = plan
        self.tables = dict(live.tables)
        self.slots = {s: dict(v) for s, v in live.slots.items()}
        self.lookup: dict = {}
        self.fresh: set = set()  # (stack, array) that hold a new array of ours
        self.in_rows = {s.name for s in plan.stacks if s.slot_columns}

    def array_of(self, t, field: str) -> tuple:
        """`(stack, array)`: the array of `t`'s stack that `field` is written into."""
        if field == LOOKUP_FIELD or (field != "parameters" and t.stack not in self.in_rows):
            return t.stack, field
        return t.stack, "parameters"

    def target(self, t, field: str):
        """The array `field` of table `t` is written into, as it is now."""
        _, key = self.array_of(t, field)
        if key == "parameters":
            return self.tables[t.stack]
        if key == LOOKUP_FIELD:
            return self.lookup.get(t.stack, self.tables[t.stack])
        return self.slots[t.stack][field]

    def column(self, t, field: str) -> int:
        """The first column `field` is written at (a slot in the rows: its own; else 0)."""
        if self.array_of(t, field)[1] == "parameters" and field != "parameters":
            return self.plan.stack(t.stack).columns_of(field)[0]
        return 0

    def put(self, t, field: str, out) -> None:
        """`out` (the target with `field` written in) in place of the target."""
        key = self.array_of(t, field)
        self.fresh.add(key)
        if key[1] == "parameters":
            self.tables[t.stack] = out
        elif field == LOOKUP_FIELD:
            self.lookup[t.stack] = out
        else:
            self.slots[t.stack][field] = out


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
) -> RestoredState:
    """Restore a checkpoint onto `core` (an `EmbeddingCore`): a new state, `state` unchanged.

    The checkpoint may come from any number of devices and any stacking. For
    each table of `core`'s plan, its parameters and then each slot of `state`
    are read from disk one at a time, straight into this process's shards of
    that table in the plan's layout (reading only the stored rows those shards
    need), checked against the checksum recorded at save (checkpoints written
    before checksums existed are not checked), and written into the new
    state's stack arrays. Tables of the checkpoint that the plan lacks are
    ignored. A table of raw ids (`TableConfig.id_map`) brings its id maps: as saved
    on the same device count and map configuration (bit-identical resume), else
    rebuilt on their new owners (`embedmesh.checkpoint.id_maps`; its capacity may
    differ from the checkpoint's, and a ValueError says where the live ids do not fit).

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
    path = item_directory(source, step, item)
    live = state  # what missing="keep" keeps
    with TreeReader(path) as reader:
        meta = reader.meta
        reader.layout  # noqa: B018 - an unknown row layout raises before anything is read
        todo, leaves, dynamic, rebuilt_todo = _plan_reads(core, reader, path, missing, pipelined)
        _log.info(
            "restoring %s (update count %s) onto %d devices: %d arrays to read (%d of "
            "them rebuilt for tables of raw ids)",
            path,
            meta["step"],
            core.num_shards,
            len(todo) + len(rebuilt_todo),
            len(rebuilt_todo),
        )
        new = _NewState(live, core.plan)
        tiered = getattr(core, "tier", {})  # a host tier's tables: read on the host
        staged = _tiered.restore_tiered(
            core,
            reader,
            [x for x in todo if x[0].stack in tiered],
            [leaf for x, leaf in zip(todo, leaves) if x[0].stack in tiered],
            prefetch,
        )
        leaves = [leaf for x, leaf in zip(todo, leaves) if x[0].stack not in tiered]
        todo = [x for x in todo if x[0].stack not in tiered]
        _read_direct(core, reader, new, todo, leaves, prefetch)
        _write_rebuilt(core, reader, new, dynamic, rebuilt_todo)
        maps = dict(live.id_maps)
        for p in dynamic.values():
            live_key = (live.id_maps.get(p.table.stack) or {}).get("key")
            maps[p.table.stack] = id_maps.place_maps(core, p, live_key)
        step_count = int(meta["step"])
        _log.info("restored %s (update count %d)", path, step_count)
    if tiered:  # every leaf read and verified: now the host rows
        state = _tiered.install(core, live, new.tables, new.slots, staged, step_count)
        return RestoredState(state, step_count, new.lookup)
    restored = dataclasses.replace(
        live,
        tables=new.tables,
        slots=new.slots,
        # from host data: device_put of a (local) jax array onto a sharding of several
        # processes' devices gives an array whose shards cannot be read
        step=jax.make_array_from_callback(
            (), core.replicated, lambda _: np.asarray(step_count, np.int32)
        ),
        id_maps=maps,
    )
    return RestoredState(restored, step_count, new.lookup)


def _plan_reads(core, reader, path, missing: str, pipelined: bool):
    """Everything checked before any array is read (what is missing, each leaf's shape,
    tables of raw ids planned): `(todo, leaves, {table: id map plan}, rebuilt_todo)`,
    the leaves read straight into place and, apart, those of rebuilt tables of raw ids."""
    plan = core.plan
    by_name = {m["name"]: m for m in reader.meta["tables"]}
    id_maps.check_kinds(core, by_name)
    todo, problems = _leaves_to_read(core, by_name, pipelined)
    if problems and missing == "error":
        raise ValueError(
            "cannot restore "
            + str(path)
            + ": "
            + "; ".join(problems)
            + " (pass missing='keep' to keep their current values)"
        )
    leaves = [_leaf_key(m, field) for _, m, field in todo]
    for (t, m, field), leaf in zip(todo, leaves):  # before anything is read
        check_leaf(reader, leaf, m, _field_width(core, t, field))
    # tables of raw ids: their maps read and verified, and where the mesh or the map
    # changed, rebuilt on their new owners (a ValueError where the live ids do not
    # fit), before any table is read; a rebuilt table's rows and slots are read last
    dynamic = {
        t.name: id_maps.plan_table(core, reader, t, by_name[t.name])
        for t in plan.tables
        if t.stack in core.dynamic and t.name in by_name
    }
    rebuilt = [i for i, (t, _, _) in enumerate(todo) if not dynamic.get(t.name, _DIRECT).direct]
    for name in dynamic:  # (missing="keep": the problems did not raise)
        mine = [q for q in problems if f" of table {name} " in q]
        if mine:
            raise ValueError(
                f"cannot restore {path}: table {name} is a table of raw ids, whose rows "
                f"and slots belong to the ids of its restored id map, so what the "
                f"checkpoint lacks cannot be kept from another state: " + "; ".join(mine)
            )
    rebuilt_todo = [(todo[i], leaves[i]) for i in rebuilt]
    todo = [x for i, x in enumerate(todo) if i not in rebuilt]
    leaves = [x for i, x in enumerate(leaves) if i not in rebuilt]
    return todo, leaves, dynamic, rebuilt_todo


def _read_direct(core, reader, new: _NewState, todo, leaves, prefetch: bool) -> None:
    """The leaves read straight into this process's shards, one at a time (the next one
    read ahead with `prefetch`), each written into `new`."""
    plan = core.plan

    def start(i):
        t, m, field = todo[i]
        shape = (core.num_shards * t.rows_per_shard,) + reader.shape(leaves[i])[1:]
        return start_leaf(
            reader,
            leaves[i],
            m,
            plan.row_layout,
            t,
            _local_shards(core, shape),
            new.target(t, field).dtype,
            field,
        )

    with contextlib.closing(streamed_leaves(len(todo), start, prefetch)) as pending:
        for i, current in enumerate(pending):
            t, _, field = todo[i]
            out = _place_leaf(
                core,
                current,
                new.target(t, field),
                t,
                donate=new.array_of(t, field) in new.fresh,
                column=new.column(t, field),
            )
            del current
            new.put(t, field, out)
            del out
            _log.info("restore: read %s of table %s (%d of %d)", field, t.name, i + 1, len(todo))


def _write_rebuilt(core, reader, new: _NewState, dynamic: dict, rebuilt_todo) -> None:
    """The rows and slots of tables of raw ids whose maps were rebuilt on new owners,
    read last (`id_maps.write_rebuilt`), each written into `new`."""
    for (t, _, field), leaf in rebuilt_todo:
        out = id_maps.write_rebuilt(
            core,
            reader,
            dynamic[t.name],
            field,
            leaf,
            new.target(t, field),
            new.array_of(t, field) in new.fresh,
            new.column(t, field),
        )
        new.put(t, field, out)
        del out


def restore(
    emb,
    source,
    step: int | None = None,
    *,
    item: str = DEFAULT_ITEM,
    missing: str = "error",
    prefetch: bool = False,
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
        directory (a relative one is taken from the working directory).
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
    path = item_directory(source, step, item)
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
    )
    emb.install_restored(restored)
    return restored.step
