"""Checkpoints of a `MeshEmbedding` with orbax-checkpoint, portable across device counts.

Layout. The embedding state is saved as one orbax pytree (the *embedding
item*), stored per table rather than per stack, so that it restores into any
number of devices and any stacking:

    {"tables": {key: [N * rows_per_shard, dim]},          # sharded jax.Arrays
     "slots":  {key: {slot name: [N * rows_per_shard, dim]}},
     "step":   int64 scalar,
     "meta":   uint8 [bytes of a JSON document]}

Block j of a table's array (rows `[j * rows_per_shard, (j+1) * rows_per_shard)`)
holds the table's rows on shard j of the saving mesh: table row `i` is at row
`((i % N + rotation) % N) * rows_per_shard + i // N` (see `embedmesh.stacking`).
Each block is sliced on its own device out of the stack arrays, so every
process writes only its own shards. "meta" records the format version, the
embedmesh version, N, the step and per table its name, vocabulary size, dim,
rows per shard, rotation, dtype, combiner, optimizer class and slot names.

The item is an ordinary pytree (`state_tree(emb)`), so it sits beside the
user's dense parameters in one orbax `Composite` checkpoint:

    mngr = ocp.CheckpointManager(path)                  # async by default
    mngr.save(step, args=ocp.args.Composite(
        embedding=embedmesh.checkpoint.save_args(emb),
        params=ocp.args.StandardSave(params)))
    ...
    embedmesh.checkpoint.restore(emb, mngr)             # any mesh, any stacking
    params = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))["params"]

`save_args` writes it uncompressed (`EmbeddingSave`, found by orbax through
its args registry): trained embeddings are close to random bits, and zstd
saves ~9% of the size for half the read and write speed.
`ocp.args.StandardSave(state_tree(emb))` (compressed) restores the same way.

Restoring goes one table (or slot) at a time. When the checkpoint's blocks
are exactly this mesh's shards (same device count), each is read straight
onto its device. Otherwise the table is read into host memory, re-cut into
the new mesh's shards by strided copies, one device shard at a time, and
written in place into the existing stack array (donated): besides the table
being read, the host holds at most that table's new shards (on CPU, these
are the device buffers themselves). Serving loads only the parameters
(`load_tables`, `EmbeddingForServing`): no mesh, optimizer slots never read.

Crash safety comes from orbax: a step is written under a temporary name and
renamed when complete, and uncommitted steps are never listed, so a save
killed halfway leaves the previous step as the latest one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import PartitionSpec as P

import orbax.checkpoint as ocp

from embedmesh.config import TableConfig, resolve_feature_config

__all__ = ["DEFAULT_ITEM", "EmbeddingCheckpointHandler", "EmbeddingForServing",
           "EmbeddingRestore", "EmbeddingSave", "FORMAT_VERSION", "latest_step", "load_tables",
           "read_metadata", "restore", "save", "save_args", "state_tree"]

FORMAT = "embedmesh.checkpoint"
FORMAT_VERSION = 1
DEFAULT_ITEM = "embedding"
MISSING_POLICIES = ("error", "keep")


def _version() -> str:
    import embedmesh
    return getattr(embedmesh, "__version__", "unknown")


# ---------------------------------------------------------------------------
# Device-side slicing and in-place writes of one table's block of a stack


@functools.lru_cache(maxsize=None)
def _slicer(mesh, axes, lo: int, rows: int, dim: Optional[int]):
    """jit: stack [N*S, D] -> table [N*rows, dim], each device slicing its own shard."""

    def body(x):
        x = x[lo:lo + rows]
        return x[:, :dim] if x.ndim == 2 else x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                                 check_vma=False))


@functools.lru_cache(maxsize=None)
def _writer(mesh, axes, lo: int, rows: int, dim: Optional[int]):
    """jit (stack donated): write a table's [N*rows, dim] blocks into a stack in place."""

    def body(stack, piece):
        piece = piece.astype(stack.dtype)
        if stack.ndim == 2:
            return stack.at[lo:lo + rows, :dim].set(piece)
        return stack.at[lo:lo + rows].set(piece)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(axes)),
                                 out_specs=P(axes), check_vma=False), donate_argnums=0)


def _table_block_array(core, stack_array: jax.Array, t) -> jax.Array:
    """The table's `[N * rows_per_shard, dim]` array sliced out of its stack on device."""
    spec = core.plan.stack(t.stack)
    dim = t.dim if stack_array.ndim == 2 else None
    if (len(spec.tables) == 1 and t.local_row_offset == 0
            and t.rows_per_shard == spec.rows_per_shard
            and (dim is None or dim == stack_array.shape[1])):
        return stack_array  # the stack is exactly this table: no copy
    return _slicer(core.mesh, core.axes, t.local_row_offset, t.rows_per_shard, dim)(stack_array)


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


def _optimizer_name(opt) -> Optional[str]:
    return None if opt is None else type(opt).__name__


def _metadata(emb, step: int) -> dict:
    plan, core = emb.plan, emb.core
    keys = _keys([t.name for t in plan.tables])
    tables = []
    for t in plan.tables:
        cfg = plan.table_config(t)
        opt = core.optimizer_of(t.stack)
        tables.append({
            "name": t.name, "key": keys[t.name], "vocabulary_size": t.vocabulary_size,
            "dim": t.dim, "rows_per_shard": t.rows_per_shard, "rotation": t.rotation,
            "dtype": np.dtype(plan.stack(t.stack).dtype).name, "combiner": cfg.combiner,
            "stack": t.stack, "optimizer": _optimizer_name(opt),
            "optimizer_repr": repr(opt) if opt is not None else None,
            "slots": sorted(emb.state.slots[t.stack]),
        })
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "embedmesh_version": _version(),
            "num_shards": plan.num_shards, "step": int(step), "tables": tables}


def state_tree(emb) -> dict:
    """The embedding state of `emb` as an orbax-ready pytree (see the module docstring).

    Tables and slots are sharded `jax.Array`s laid out per table; a stack
    that holds exactly one table is passed through without a copy, other
    tables are sliced out of their stacks on their own devices. Pending
    pipelined updates are applied first.
    """
    emb.build()
    emb.flush()
    plan, core, state = emb.plan, emb.core, emb.state
    step = int(jax.device_get(state.step))
    meta = _metadata(emb, step)
    keys = {m["name"]: m["key"] for m in meta["tables"]}
    tables, slots = {}, {}
    for t in plan.tables:
        key = keys[t.name]
        tables[key] = _table_block_array(core, state.tables[t.stack], t)
        slots[key] = {name: _table_block_array(core, arr, t)
                      for name, arr in state.slots[t.stack].items()}
    blob = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8).copy()
    return {"tables": tables, "slots": slots, "step": np.asarray(step, np.int64), "meta": blob}


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


def save_args(emb, *, compression: bool = False) -> "ocp.args.CheckpointArgs":
    """Save args of `state_tree(emb)` for one item of an orbax `Composite`.

    Uncompressed by default (`EmbeddingSave`, its handler found through
    orbax's registry); `compression=True` gives `ocp.args.StandardSave`
    (zstd). Either restores with `restore` / `load_tables`, or with orbax.
    """
    tree = state_tree(emb)
    return ocp.args.StandardSave(tree) if compression else EmbeddingSave(tree)


def save(target, emb, step: Optional[int] = None, *, item: str = DEFAULT_ITEM,
         others: Optional[dict] = None, wait: Optional[bool] = None) -> bool:
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
    items = {item: save_args(emb)}
    for name, value in (others or {}).items():
        if name == item:
            raise ValueError(f"others names the embedding item {item!r}")
        items[name] = (value if isinstance(value, ocp.args.CheckpointArgs)
                       else ocp.args.StandardSave(value))
    if step is None:
        step = int(jax.device_get(emb.state.step))
    own = not isinstance(target, ocp.CheckpointManager)
    manager = (ocp.CheckpointManager(
        epath.Path(target), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
        if own else target)
    try:
        saved = manager.save(int(step), args=ocp.args.Composite(**items))
        if wait or (wait is None and own):
            manager.wait_until_finished()
    finally:
        if own:
            manager.close()
    return bool(saved)


# ---------------------------------------------------------------------------
# Locating and reading a checkpoint


def latest_step(directory) -> Optional[int]:
    """The latest committed step under a checkpoint root (None if there is none)."""
    meta = ocp.step.latest_step_metadata(epath.Path(directory), ocp.step.standard_name_format())
    return None if meta is None else int(meta.step)


def _is_item_dir(path: epath.Path) -> bool:
    return (path / "_METADATA").exists()


def _item_dir(source, step: Optional[int], item: str) -> epath.Path:
    """The embedding item's directory from a manager, a root, a step or an item directory."""
    if isinstance(source, ocp.CheckpointManager):
        if step is None:
            step = source.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint under {source.directory}")
        finder = getattr(source, "_get_read_step_directory", None)  # honours custom names
        step_dir = (finder(step, source.directory) if finder is not None
                    else source.directory / str(step))
        path = epath.Path(step_dir) / item
    else:
        root = epath.Path(source)
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
                    raise FileNotFoundError(f"no committed checkpoint under {root}")
                step_dir = meta.path
            else:
                try:
                    step_dir = fmt.find_step(root, int(step)).path
                except ValueError:
                    raise FileNotFoundError(f"no committed step {step} under {root}") from None
            path = epath.Path(step_dir) / item
    if not _is_item_dir(path):
        raise FileNotFoundError(f"{path} holds no checkpoint item {item!r}")
    return path


class _Reader:
    """Reads single leaves of one saved pytree as host numpy arrays (nothing else is read)."""

    def __init__(self, path: epath.Path):
        self.path = path
        self._handler = ocp.PyTreeCheckpointHandler()
        self.tree = self._handler.metadata(path).tree
        if not (isinstance(self.tree, dict) and "meta" in self.tree and "tables" in self.tree):
            raise ValueError(f"{path} is not an embedmesh checkpoint item (no tables/meta)")
        self.meta = json.loads(bytes(self.read(("meta",))).decode())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an embedmesh checkpoint item")
        if int(self.meta.get("format_version", 0)) > FORMAT_VERSION:
            raise ValueError(f"{path} has checkpoint format version "
                             f"{self.meta['format_version']}; this embedmesh reads up to "
                             f"{FORMAT_VERSION}")

    def shape(self, path: tuple) -> tuple:
        leaf = self.tree
        for k in path:
            leaf = leaf[k]
        return tuple(leaf.shape)

    def read(self, path: tuple, sharding=None):
        """One leaf; every other leaf is a placeholder and is not read.

        Host numpy by default; with `sharding`, a `jax.Array` read shard by
        shard straight onto its devices (each process reads its own shards).
        """
        item = jax.tree.map(lambda _: ocp.PLACEHOLDER, self.tree)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), self.tree)
        node, arg = item, args
        for k in path[:-1]:
            node, arg = node[k], arg[k]
        node[path[-1]] = 0
        if sharding is not None:
            arg[path[-1]] = ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=sharding,
                                                 global_shape=self.shape(path))
        out = self._handler.restore(self.path, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args))
        for k in path:
            out = out[k]
        return out if sharding is not None else np.asarray(out)

    def close(self):
        self._handler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metadata(source, step: Optional[int] = None, *, item: str = DEFAULT_ITEM) -> dict:
    """The JSON metadata of a checkpoint's embedding item (format, N, step, tables)."""
    with _Reader(_item_dir(source, step, item)) as r:
        return r.meta


# ---------------------------------------------------------------------------
# Layout conversions (numpy, one table at a time)


def _stored_to_logical(stored: np.ndarray, meta_table: dict, n: int) -> np.ndarray:
    """The logical `[vocabulary_size, ...]` table from its stored block layout."""
    v, rps, rot = meta_table["vocabulary_size"], meta_table["rows_per_shard"], \
        meta_table["rotation"]
    if stored.shape[0] != n * rps:
        raise ValueError(f"table {meta_table['name']}: stored array has {stored.shape[0]} rows, "
                         f"metadata says {n} x {rps}")
    if n == 1:
        return stored[:v]  # one shard: already in logical order
    out = np.empty((v,) + stored.shape[1:], stored.dtype)
    for j in range(n):
        first = (j - rot) % n
        count = len(range(first, v, n))
        out[first::n] = stored[j * rps:j * rps + count]
    return out


# ---------------------------------------------------------------------------
# Restoring into a MeshEmbedding (any mesh, any stacking)


def _check_compatible(plan_table, meta_table: Optional[dict]):
    if meta_table is None:
        return
    if (meta_table["vocabulary_size"], meta_table["dim"]) != (plan_table.vocabulary_size,
                                                              plan_table.dim):
        raise ValueError(f"table {plan_table.name}: the checkpoint has "
                         f"[{meta_table['vocabulary_size']}, {meta_table['dim']}], the embedding "
                         f"[{plan_table.vocabulary_size}, {plan_table.dim}]")


def _local_shards(core, shape: tuple) -> list:
    """[(shard index j, device)] of this process, in shard order, for a row-sharded array."""
    rows = shape[0] // core.num_shards
    out = []
    for device, index in core.row_sharding.addressable_devices_indices_map(shape).items():
        start = index[0].start or 0
        out.append((start // rows if rows else 0, device))
    return sorted(out, key=lambda x: x[0])


def _reshard_rows(stored: np.ndarray, meta_table: dict, n_old: int, m: int, rotation: int,
                  shard: int, out: np.ndarray) -> None:
    """Fill `out[:count]` with the table's rows on new shard `shard` of `m`, from the stored
    blocks of `n_old` shards, by strided copies (no index arrays).

    New shard rows are `i = first + m * r`. With `L = lcm(m, n_old)`, `i % n_old` repeats
    with period `L / m` in r, so each phase p of r reads one stored block, at local rows
    `(first + m * p) // n_old + (L / n_old) * q`: an arithmetic progression.
    """
    v, rps_old, rot_old = (meta_table["vocabulary_size"], meta_table["rows_per_shard"],
                           meta_table["rotation"])
    first = (shard - rotation) % m
    count = len(range(first, v, m))
    lcm = m * n_old // np.gcd(m, n_old)
    period, stride = lcm // m, lcm // n_old
    for p in range(min(period, count)):
        i0 = first + m * p
        block = (i0 % n_old + rot_old) % n_old
        n_rows = len(range(p, count, period))
        src = stored[block * rps_old + i0 // n_old:(block + 1) * rps_old:stride][:n_rows]
        out[p:count:period] = src


def _pieces_from_stored(core, stored: np.ndarray, meta_table: dict, n_old: int, t) -> Iterator:
    """Yield (j, [rows_per_shard, ...]) for this process's shards of table `t` (new layout)."""
    m, rps = core.num_shards, t.rows_per_shard
    shape = (m * rps,) + stored.shape[1:]
    for j, _ in _local_shards(core, shape):
        piece = np.empty((rps,) + stored.shape[1:], stored.dtype)
        count = len(range((j - t.rotation) % m, t.vocabulary_size, m))
        piece[count:] = 0
        _reshard_rows(stored, meta_table, n_old, m, t.rotation, j, piece)
        yield j, piece


def _same_layout(core, meta_table: dict, n_old: int, t) -> bool:
    """Whether the stored blocks are exactly this table's shards on `core`'s mesh."""
    return (n_old == core.num_shards and meta_table["rotation"] == t.rotation
            and meta_table["rows_per_shard"] == t.rows_per_shard)


def _is_whole_stack(core, stack_array: jax.Array, t) -> bool:
    spec = core.plan.stack(t.stack)
    return (len(spec.tables) == 1 and t.local_row_offset == 0
            and t.rows_per_shard == spec.rows_per_shard
            and (stack_array.ndim == 1 or stack_array.shape[1] == t.dim))


def _place_from_host(core, stored: np.ndarray, meta_table: dict, n_old: int, t,
                     dtype) -> jax.Array:
    """The table's `[M * rows_per_shard, ...]` array on `core`'s mesh, built one device
    shard at a time from the stored (host) array."""
    shape = (core.num_shards * t.rows_per_shard,) + stored.shape[1:]
    devices = dict(_local_shards(core, shape))
    placed = []
    for j, piece in _pieces_from_stored(core, stored, meta_table, n_old, t):
        placed.append(jax.device_put(np.ascontiguousarray(piece, dtype=dtype), devices[j]))
        del piece
    return jax.make_array_from_single_device_arrays(shape, core.row_sharding, placed)


def _fetch_leaf(core, reader, leaf: tuple, meta_table: dict, n_old: int, t):
    """Read one stored leaf: onto the devices when the layout is this mesh's, else to host."""
    if _same_layout(core, meta_table, n_old, t):
        # the stored blocks are this mesh's shards: read each straight onto its device
        return "device", reader.read(leaf, sharding=core.row_sharding)
    return "host", reader.read(leaf)


def _place_leaf(core, fetched, stack_array: jax.Array, meta_table: dict, n_old: int, t,
                stats: Optional[dict] = None) -> jax.Array:
    """The stack array with one fetched table leaf (parameters or a slot) written in."""
    kind, data = fetched
    if stats is not None:
        stats[kind] = stats.get(kind, 0) + 1
    if kind == "device":
        piece = data
    else:
        if stack_array.ndim == 2 and data.ndim == 2 and data.shape[1] != t.dim:
            raise ValueError(f"table {t.name}: stored dim {data.shape[1]} != {t.dim}")
        piece = _place_from_host(core, data, meta_table, n_old, t, stack_array.dtype)
    del fetched, data
    if piece.dtype != stack_array.dtype:
        piece = piece.astype(stack_array.dtype)
    if _is_whole_stack(core, stack_array, t) and piece.shape == stack_array.shape:
        stack_array.delete()  # replaced wholesale: no copy
        return piece
    dim = t.dim if stack_array.ndim == 2 else None
    out = _writer(core.mesh, core.axes, t.local_row_offset, t.rows_per_shard, dim)(
        stack_array, piece)
    # wait, so that this table's shards are freed before the next table is read
    out.block_until_ready()
    piece.delete()
    return out


def _fetched(core, reader, jobs: list, prefetch: bool) -> Iterator:
    """Yield each job's fetched leaf; with `prefetch`, read the next one meanwhile."""
    if not prefetch:
        for leaf, t, m in jobs:
            yield _fetch_leaf(core, reader, leaf, m, reader.meta["num_shards"], t)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1, thread_name_prefix="embedmesh-restore") as pool:
        submit = lambda job: pool.submit(  # noqa: E731
            _fetch_leaf, core, reader, job[0], job[2], reader.meta["num_shards"], job[1])
        future = submit(jobs[0]) if jobs else None
        for i in range(len(jobs)):
            result = future.result()
            future = submit(jobs[i + 1]) if i + 1 < len(jobs) else None
            yield result
            del result


def restore(emb, source, step: Optional[int] = None, *, item: str = DEFAULT_ITEM,
            missing: str = "error", prefetch: bool = False,
            _stats: Optional[dict] = None) -> int:
    """Restore a checkpoint into `emb` (built if needed) on its own mesh and stacking.

    The checkpoint may come from any number of devices and any stacking. For
    each table of `emb`, its parameters and then each slot are read from disk
    one at a time, cut into `emb`'s shards and written in place into the
    stack arrays. Tables of the checkpoint that `emb` lacks are ignored.

    Args:
      emb: a `MeshEmbedding`.
      source: an `ocp.CheckpointManager`, a checkpoint root directory, a
        step directory or the embedding item's directory.
      step: the step (default: the latest committed one).
      item: the embedding item's name in the `Composite`.
      missing: "error" (default) raises ValueError when a table of `emb`, or
        one of its optimizer slots, is not in the checkpoint; "keep" leaves
        those at their current (e.g. initial) values.
      prefetch: read the next table while the current one is placed (faster
        when reads and placing overlap; holds two tables on the host instead
        of one).

    Returns the restored step count (also set as `emb.state.step`).

    Raises ValueError before changing anything when a table's vocabulary
    size or dim differs, or something is missing under missing="error".
    """
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")
    path = _item_dir(source, step, item)
    emb.build()
    emb.flush()
    plan, core = emb.plan, emb.core
    with _Reader(path) as reader:
        meta = reader.meta
        by_name = {m["name"]: m for m in meta["tables"]}
        n_old = int(meta["num_shards"])
        todo = []  # (placement, meta table, field) in plan order
        problems = []
        for t in plan.tables:
            m = by_name.get(t.name)
            _check_compatible(t, m)
            if m is None:
                problems.append(f"table {t.name} is not in the checkpoint")
                continue
            todo.append((t, m, "parameters"))
            for slot in emb.state.slots[t.stack]:
                if slot in m["slots"]:
                    todo.append((t, m, slot))
                else:
                    problems.append(f"slot {slot!r} of table {t.name} is not in the checkpoint "
                                    f"(it has {m['slots']}; optimizer {m['optimizer']})")
        if problems and missing == "error":
            raise ValueError("cannot restore " + str(path) + ": " + "; ".join(problems) +
                             " (pass missing='keep' to keep their current values)")
        tables = dict(emb.state.tables)
        slots = {s: dict(v) for s, v in emb.state.slots.items()}
        jobs = [(("tables", m["key"]) if field == "parameters" else ("slots", m["key"], field),
                 t, m) for t, m, field in todo]
        for (t, m, field), fetched in zip(todo, _fetched(core, reader, jobs, prefetch)):
            if field == "parameters":
                tables[t.stack] = _place_leaf(core, fetched, tables[t.stack], m, n_old, t,
                                              _stats)
            else:
                slots[t.stack][field] = _place_leaf(core, fetched, slots[t.stack][field], m,
                                                    n_old, t, _stats)
            del fetched
        step_count = int(meta["step"])
    emb.state = type(emb.state)(tables, slots, jax.device_put(
        jnp.asarray(step_count, jnp.int32), core.replicated))
    return step_count


# ---------------------------------------------------------------------------
# Serving: parameters only, on the host, no mesh


def load_tables(source, step: Optional[int] = None, *, feature_config: Any = None,
                item: str = DEFAULT_ITEM) -> dict:
    """`{TableConfig: [vocabulary_size, dim] numpy array}` of a checkpoint's parameters.

    Reads only the parameters (optimizer slots are never read) into host
    memory, one table at a time, on any machine: no mesh, no devices needed.
    With `feature_config`, the keys are its `TableConfig`s (matched by name,
    sizes checked) and only its tables are read; without, new `TableConfig`s
    with the saved names, sizes and combiners.
    """
    with _Reader(_item_dir(source, step, item)) as reader:
        meta = reader.meta
        n = int(meta["num_shards"])
        by_name = {m["name"]: m for m in meta["tables"]}
        if feature_config is None:
            wanted = [(TableConfig(m["vocabulary_size"], m["dim"], combiner=m["combiner"],
                                   name=m["name"]), m) for m in meta["tables"]]
        else:
            resolved = resolve_feature_config(feature_config)
            wanted = []
            for cfg, name in zip(resolved.tables, resolved.table_names):
                m = by_name.get(name)
                if m is None:
                    raise ValueError(f"table {name} is not in the checkpoint (it has "
                                     f"{sorted(by_name)})")
                if (m["vocabulary_size"], m["dim"]) != (cfg.vocabulary_size, cfg.dim):
                    raise ValueError(f"table {name}: the checkpoint has [{m['vocabulary_size']}, "
                                     f"{m['dim']}], the feature config "
                                     f"[{cfg.vocabulary_size}, {cfg.dim}]")
                wanted.append((cfg, m))
        out = {}
        for cfg, m in wanted:
            out[cfg] = _stored_to_logical(reader.read(("tables", m["key"])), m, n)
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
        self._tables: Optional[dict] = None
        self.step: Optional[int] = None

    def build(self, seed: int = 0):
        """Initialise every table on the host from its initializer."""
        if self._tables is None:
            key = jax.random.key(seed)
            self._tables = {t: np.asarray(t.initialize(jax.random.fold_in(key, i)))
                            for i, t in enumerate(self._resolved.tables)}

    def restore(self, source, step: Optional[int] = None, *, item: str = DEFAULT_ITEM) -> int:
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

    def embedding_lookup(self, features: Any, weights: Optional[Any] = None) -> Any:
        from embedmesh.serving import serving_embedding_lookup
        return serving_embedding_lookup(features, weights, self.embedding_tables,
                                        self.feature_config)

    __call__ = embedding_lookup
