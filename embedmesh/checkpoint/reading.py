"""Locating a checkpoint's embedding item (a manager, a root, a step or an item directory)
and reading it: its metadata, small leaves through orbax, table arrays straight from
tensorstore into caller-provided host buffers."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from embedmesh import _compat, _runtime
from embedmesh.checkpoint.format import DEFAULT_ITEM, FORMAT, FORMAT_VERSION
from embedmesh.checkpoint.recut import stored_layout
from embedmesh.layout.rows import RowLayout

_ALIGN = 4096  # host buffers: page aligned, so CPU device_put aliases them


def absolute_path(path) -> epath.Path:
    """`path` as an absolute `epath.Path`: a relative local directory is taken from the
    working directory now (orbax's tensorstore specs take absolute paths only); an
    absolute path, or a remote one (`gs://...`, absolute to epath), is kept as it is."""
    path = epath.Path(path)
    return path if path.is_absolute() else path.absolute()


def latest_step(directory) -> int | None:
    """The latest committed step under a checkpoint root (None if there is none)."""
    meta = ocp.step.latest_step_metadata(absolute_path(directory), ocp.step.standard_name_format())
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


def item_directory(source, step: int | None, item: str) -> epath.Path:
    """The embedding item's directory from a manager, a root, a step or an item directory.

    A manager's save in flight is waited for first; a step (or item) that is only
    present as orbax's temporary directory raises a FileNotFoundError saying so. A
    relative directory is taken from the working directory (`absolute_path`).
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
        path = absolute_path(step_dir) / item
    else:
        root = absolute_path(source)
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


class TreeReader:
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
        return stored_layout(self.meta, f"checkpoint item {self.path}")

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
        temporary). Returns the futures; `wait_all` them.
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


def wait_all(futures: list) -> None:
    for f in futures:
        f.result()


def host_buffer(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised numpy array aligned to 4 KiB: `jax.device_put` on CPU then aliases
    it (no copy); elsewhere it is an ordinary host buffer."""
    return _runtime.aligned_empty(shape, dtype, _ALIGN)


def read_metadata(source, step: int | None = None, *, item: str = DEFAULT_ITEM) -> dict:
    """The JSON metadata of a checkpoint's embedding item (format, N, step, tables)."""
    with TreeReader(item_directory(source, step, item)) as r:
        return r.meta
