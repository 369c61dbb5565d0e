"""Saving: the embedding item's pytree (tables and slots per table, the "meta" document,
checksums) from a core's state, and its save through orbax."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from embedmesh.checkpoint import id_map_format, id_maps
from embedmesh.checkpoint.checksums import (
    CHECKSUM,
    checksum_hex,
    device_checksum,
    logical_hasher,
)
from embedmesh.checkpoint.format import DEFAULT_ITEM, FORMAT, FORMAT_VERSION, LOOKUP_FIELD
from embedmesh.checkpoint.reading import absolute_path
from embedmesh.checkpoint.recut import stored_row_count
from embedmesh.device.stack_tables import table_block_array
from embedmesh.layout import sharding as mod_sharding

_log = logging.getLogger(__name__)


def _version() -> str:
    # the package's __init__ (the one version source) is loaded: it is this module's parent
    return getattr(sys.modules.get("embedmesh"), "__version__", "unknown")


# ---------------------------------------------------------------------------
# What is stored of a table not on every shard


@functools.cache
def _spreader(mesh, axes, rows: int, span: int, n: int):
    """jit: (table [N*rows, ...] blocks, one per shard; first shard of its span) -> the
    span's blocks one after another, `[stored_row_count(span, rows, N), ...]`, spread evenly
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
    shards of its span only, one after another (`[stored_row_count(...), ...]`, spread over
    all devices); the array itself for a table on every shard."""
    n = core.num_shards
    if t.span == n:
        return arr
    return _spreader(core.mesh, core.axes, t.rows_per_shard, t.span, n)(
        arr, np.int32(t.first_shard)
    )


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


def optimizer_name(opt) -> str | None:
    return None if opt is None else type(opt).__name__


def _tiered_table(core, state, t, lookup: dict, hashes: dict, out: tuple) -> None:
    """Table `t` of a host tier's stack into `out` (`(tables, slots, lookup tables, its
    key)`) as numpy arrays stored as a mesh's are (its span's blocks one after another,
    zero rows to a multiple of the shards), its checksums (`hashes`) the logical
    table's: the host rows with the rows cached on the devices over them."""
    tables, slots, stored_lookup, key = out
    plan = core.full_plan
    first, span = t.first_shard, t.span
    rows = stored_row_count(span, t.rows_per_shard, core.num_shards)

    def stored(st, field):
        blocks = core.host_blocks(st, t, field)
        logical = mod_sharding.shards_to_table(blocks, plan, t)
        arr = np.zeros((rows,) + blocks[first].shape[1:], blocks[first].dtype)
        arr[: span * t.rows_per_shard] = np.concatenate(blocks[first : first + span])
        return arr, logical_hasher()(jax.device_put(logical, _host_cpu()))

    tables[key], hashes.setdefault(t.name, {})["parameters"] = stored(state, "parameters")
    slots[key] = {}
    for name in core.slot_names(t.stack):
        slots[key][name], hashes[t.name][name] = stored(state, name)
    if t.stack in lookup:
        stale = dataclasses.replace(state, tables=dict(state.tables, **{t.stack: lookup[t.stack]}))
        stored_lookup[key], hashes[t.name][LOOKUP_FIELD] = stored(stale, "parameters")


def _host_cpu():
    return jax.local_devices(backend="cpu")[0]


def _metadata(core, state, step: int) -> dict:
    """The "meta" document: everything from the core's plan and optimizers, slot names
    from the state."""
    plan = getattr(core, "full_plan", core.plan)
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
                "optimizer": optimizer_name(opt),
                "optimizer_repr": repr(opt) if opt is not None else None,
                "slots": sorted(core.slot_names(t.stack)),
            }
        )
        if t.stack in core.dynamic:  # a table of raw ids: its map's configuration
            tables[-1]["id_map"] = id_maps.config_meta(core.dynamic[t.stack][1])
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if core.dynamic else 1,
        "embedmesh_version": _version(),
        "num_shards": plan.num_shards,
        "row_layout": plan.row_layout.name,
        "step": int(step),
        "tables": tables,
    }


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
    plan = getattr(core, "full_plan", core.plan)  # (a host tier's: its tables' plan)
    tier = getattr(core, "tier", {})
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
    tables, slots, stored_lookup, stored_maps = {}, {}, {}, {}
    hashes = {}  # computed on the devices holding the arrays, fetched once
    for t in plan.tables:
        key = keys[t.name]
        if t.stack in tier:  # rows in host memory: read through the tier
            _tiered_table(core, state, t, lookup, hashes, (tables, slots, stored_lookup, key))
            continue
        # each array's checksum on the whole mesh (shards outside the table's span count
        # nothing), then only the span's blocks are stored
        block = table_block_array(core, state.tables[t.stack], t)
        hashes[t.name] = {"parameters": device_checksum(core, block, t)}
        tables[key] = _span_array(core, block, t)
        slots[key] = {}
        for name in core.slot_names(t.stack):
            arr, column = core.field_array(state, t.stack, name)
            block = table_block_array(core, arr, t, column, core.field_width(t, name))
            hashes[t.name][name] = device_checksum(core, block, t)
            slots[key][name] = _span_array(core, block, t)
        if t.stack in core.dynamic:  # a table of raw ids: its owners' id maps
            arrays, sums = id_maps.saved_arrays(core, state, t)
            stored_maps[key] = arrays
            hashes[t.name].update(sums)
        if t.stack in lookup:
            block = table_block_array(core, lookup[t.stack], t)
            hashes[t.name][LOOKUP_FIELD] = device_checksum(core, block, t)
            stored_lookup[key] = _span_array(core, block, t)
        del block
    hashes = jax.device_get(hashes)
    meta["checksum"] = CHECKSUM
    for m in meta["tables"]:
        m["checksums"] = {field: checksum_hex(h) for field, h in hashes[m["name"]].items()}
        m["lookup"] = m["key"] in stored_lookup
    blob = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8).copy()
    tree = {"tables": tables, "slots": slots, "step": np.asarray(step, np.int64), "meta": blob}
    if stored_lookup:
        tree["lookup_tables"] = stored_lookup
    if stored_maps:
        tree[id_map_format.SUBTREE] = stored_maps
    return tree


def state_tree(emb) -> dict:
    """The embedding state of `emb` (a `MeshEmbedding`, built if needed) as an orbax-ready
    pytree: `core_state_tree` of its core and `emb.observed_state()` (every accepted
    update), with, in pipelined mode with an update still pending, the parameters
    the next lookup reads as the lookup tables. Saving never changes what the next
    lookup sees."""
    emb.build()
    state, lookup = emb.checkpoint_state()
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
    if not own and not target.directory.is_absolute():
        # orbax's own error comes from its writer thread, after it made a temporary step
        raise ValueError(
            f"the CheckpointManager's directory {str(target.directory)!r} is relative, and "
            f"orbax writes to absolute paths only: open the manager on "
            f"os.path.abspath({str(target.directory)!r}) (or pass the directory itself, "
            f"which is resolved from the working directory); nothing was saved"
        )
    manager = (
        ocp.CheckpointManager(
            absolute_path(target),  # orbax writes to absolute paths only
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        )
        if own
        else target
    )
    try:
        steps = set(manager.all_steps())
        saved = manager.save(int(step), args=ocp.args.Composite(**items))
        if wait or (wait is None and own):
            manager.wait_until_finished()
    finally:
        if own:
            manager.close()
    if not saved:
        _report_skipped(int(step), steps, manager.directory)
    return bool(saved)


def _report_skipped(step: int, steps: set, directory) -> None:
    """Say why orbax did not save `step`: a step it already holds, or one before its
    latest, is a warning (the state was not saved, and a restore of that step reads the
    older save); a skip by the manager's own save policy (its options) is logged."""
    latest = max(steps, default=None)
    if step in steps:
        why = f"step {step} already exists in {directory}"
    elif latest is not None and step < latest:
        why = f"step {step} is before the latest step ({latest}) in {directory}"
    else:
        _log.info("checkpoint step %d not saved in %s: the manager's save policy", step, directory)
        return
    msg = (
        f"checkpoint not saved: {why}, and orbax saves only steps after the latest "
        f"(number saves by your own step counter, or delete the step first)"
    )
    _log.warning(msg)
    warnings.warn(msg, stacklevel=4)


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
      target: an `ocp.CheckpointManager` (saves are async when it is; its
        directory must be absolute, as orbax requires), or a directory (a
        relative one is taken from the working directory), for which a
        synchronous manager is opened and closed.
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
