"""Export a serving function (embedding lookups + the user's model) for a CPU server.

The seed's flow, in JAX: a serving function calls `serving_embedding_lookup`
on the trained tables and feeds the activations to the model;
`export_serving` turns it into a directory that a server loads with
`load_serving`, in a fresh process that imports only embedmesh and numpy
(and jax): none of the training or model code.

    def serve(inputs, tables, params):
        acts = embedmesh.serving_embedding_lookup(inputs, None, tables, feature_config)
        return model_apply(params, acts)

    export_serving(serve, "export/", tables=emb.embedding_tables, params=params,
                   input_signature={"watched": Ragged(nnz_per_example=16),
                                    "recent": Sparse(shape=(5,)),
                                    "user": Dense()},
                   batch_sizes=(1, 16, 128))
    ...
    server = load_serving("export/")                # fresh process
    scores = server({"watched": RaggedTensor(...), "recent": SparseTensor(...),
                     "user": np.array([...])})

Directory: `manifest.json`, one serialized `jax.export` program per batch
bucket (`program_<b>.bin`), and the tables and parameters as `.npy` files.
Tables and parameters are *arguments* of the programs, never constants baked
into them, so the programs stay small whatever the tables' size; the loader
maps each file once and keeps it on the device between calls.

Variable sizes: padded buckets. `serving_embedding_lookup` needs static
shapes inside a traced program (a sparse input's `dense_shape` is static, and
the lookup plans are sized at trace time), so symbolic shapes cannot be used.
Instead one program is exported per batch size in `batch_sizes`, with a fixed
capacity of ids per sparse/ragged input (`nnz_per_example` times the batch
size). A call picks the smallest bucket that holds its batch and ids, pads
the inputs (dense rows with zeros; padding ids go to one extra, hidden row
past the batch, so no real row sees them), runs the program and cuts the
outputs back to the batch; a batch larger than the largest bucket is split
into chunks. This requires a model that treats examples independently (no
cross-batch operations) and outputs whose leading axis is the batch; both
hold for usual ranking models, and `export_serving` checks the outputs'
shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from embedmesh import _compat
from embedmesh.serving import raw_ids
from embedmesh.serving.quantized import QuantizedRawIdTable, QuantizedTable
from embedmesh.serving.raw_ids import RawIdTable, RawIdUpdate

__all__ = ["Dense", "Ragged", "ServingFunction", "Sparse", "export_serving", "load_serving"]

FORMAT = "embedmesh.serving"
FORMAT_VERSION = 3  # 2: quantized tables, 3: tables of raw ids (each only where one is)
MANIFEST = "manifest.json"


# ---------------------------------------------------------------------------
# Input specs


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class Dense:
    """A dense input: `[batch, *shape]` of `dtype` (ids, or any dense feature)."""

    shape: tuple = ()
    dtype: Any = np.int32

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class Sparse:
    """A `SparseTensor` of dense shape `[batch, *shape]`; `dtype` of its values.

    `nnz_per_example`: the ids capacity per example (default: all of
    `prod(shape)`); a call whose inputs hold more ids than a bucket's
    capacity uses a larger bucket, or more chunks.
    """

    shape: tuple
    dtype: Any = np.int32
    nnz_per_example: int | None = None
    index_dtype: Any = np.int32

    def __post_init__(self):
        shape = tuple(int(d) for d in self.shape)
        if not shape or min(shape) < 1:
            raise ValueError(
                f"Sparse.shape must be the per-example dense shape (at least one "
                f"dim >= 1), got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        npe = self.nnz_per_example
        npe = int(np.prod(shape)) if npe is None else int(npe)
        if npe < 1:
            raise ValueError(f"Sparse.nnz_per_example must be >= 1, got {self.nnz_per_example}")
        object.__setattr__(self, "nnz_per_example", npe)
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "index_dtype", np.dtype(self.index_dtype))


@dataclasses.dataclass(frozen=True)
class Ragged:
    """A rank-2 `RaggedTensor` with `nnz_per_example` ids capacity per example."""

    nnz_per_example: int
    dtype: Any = np.int32
    splits_dtype: Any = np.int32

    def __post_init__(self):
        if int(self.nnz_per_example) < 1:
            raise ValueError(f"Ragged.nnz_per_example must be >= 1, got {self.nnz_per_example}")
        object.__setattr__(self, "nnz_per_example", int(self.nnz_per_example))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "splits_dtype", np.dtype(self.splits_dtype))


_SPECS = (Dense, Sparse, Ragged)


def _spec_to_json(spec) -> dict:
    if isinstance(spec, Dense):
        return {"kind": "dense", "shape": list(spec.shape), "dtype": _dtype_name(spec.dtype)}
    if isinstance(spec, Sparse):
        return {
            "kind": "sparse",
            "shape": list(spec.shape),
            "dtype": _dtype_name(spec.dtype),
            "nnz_per_example": spec.nnz_per_example,
            "index_dtype": _dtype_name(spec.index_dtype),
        }
    return {
        "kind": "ragged",
        "dtype": _dtype_name(spec.dtype),
        "nnz_per_example": spec.nnz_per_example,
        "splits_dtype": _dtype_name(spec.splits_dtype),
    }


def _spec_from_json(d: dict):
    if d["kind"] == "dense":
        return Dense(tuple(d["shape"]), d["dtype"])
    if d["kind"] == "sparse":
        return Sparse(tuple(d["shape"]), d["dtype"], d["nnz_per_example"], d["index_dtype"])
    return Ragged(d["nnz_per_example"], d["dtype"], d["splits_dtype"])


# ---------------------------------------------------------------------------
# Structures (dict / list / tuple / None) as JSON, walked the same way on both sides


def _encode(tree, leaf_fn, what: str):
    if tree is None:
        return {"t": "none"}
    if isinstance(tree, dict):
        keys = list(tree)
        for k in keys:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{what}: dict keys must be str or int, got {k!r}")
        try:
            keys = sorted(keys)
        except TypeError:
            raise TypeError(f"{what}: dict keys must be all str or all int, got {keys}") from None
        return {"t": "dict", "k": keys, "v": [_encode(tree[k], leaf_fn, what) for k in keys]}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return {"t": type(tree).__name__, "v": [_encode(x, leaf_fn, what) for x in tree]}
    return leaf_fn(tree)


def _leaves(structure: dict, tree, where: str = "inputs") -> list:
    """Leaves of `tree` in `structure`'s order; raises ValueError naming a mismatch."""
    t = structure["t"]
    if t == "none":
        if tree is not None:
            raise ValueError(f"{where}: expected None, got {type(tree).__name__}")
        return []
    if t == "dict":
        if not isinstance(tree, dict):
            raise ValueError(f"{where}: expected a dict, got {type(tree).__name__}")
        if set(tree) != set(structure["k"]):
            raise ValueError(
                f"{where}: expected keys {structure['k']}, got {sorted(tree, key=str)}"
            )
        out = []
        for k, sub in zip(structure["k"], structure["v"]):
            out += _leaves(sub, tree[k], f"{where}[{k!r}]")
        return out
    if t in ("list", "tuple"):
        if not isinstance(tree, (list, tuple)) or len(tree) != len(structure["v"]):
            raise ValueError(
                f"{where}: expected a {t} of {len(structure['v'])}, got {type(tree).__name__}"
            )
        out = []
        for i, sub in enumerate(structure["v"]):
            out += _leaves(sub, tree[i], f"{where}[{i}]")
        return out
    return [(where, structure, tree)]


def _rebuild_structure(structure: dict, leaves: Iterator):
    t = structure["t"]
    if t == "none":
        return None
    if t == "dict":
        return {
            k: _rebuild_structure(sub, leaves) for k, sub in zip(structure["k"], structure["v"])
        }
    if t in ("list", "tuple"):
        items = [_rebuild_structure(sub, leaves) for sub in structure["v"]]
        return items if t == "list" else tuple(items)
    return next(leaves)


# ---------------------------------------------------------------------------
# Export


def _bucket_args(spec, b: int, pb: int):
    """Abstract arrays of one input leaf for bucket b (program batch pb)."""
    import jax

    if isinstance(spec, Dense):
        return [jax.ShapeDtypeStruct((pb,) + spec.shape, spec.dtype)]
    cap = b * spec.nnz_per_example
    if isinstance(spec, Sparse):
        return [
            jax.ShapeDtypeStruct((cap, 1 + len(spec.shape)), spec.index_dtype),
            jax.ShapeDtypeStruct((cap,), spec.dtype),
        ]
    return [
        jax.ShapeDtypeStruct((cap,), spec.dtype),
        jax.ShapeDtypeStruct((pb + 1,), spec.splits_dtype),
    ]


def _rebuild_leaf(spec, arrays: Iterator, pb: int):
    from embedmesh.inputs import RaggedTensor, SparseTensor

    if isinstance(spec, Dense):
        return next(arrays)
    if isinstance(spec, Sparse):
        indices, values = next(arrays), next(arrays)
        return SparseTensor(indices, values, (pb,) + spec.shape)
    values, splits = next(arrays), next(arrays)
    return RaggedTensor(values, splits)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _canonical(spec):
    """The spec with dtypes as jax will use them (int64 -> int32 without x64)."""
    import jax

    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    for k, v in fields.items():
        if k.endswith("dtype"):
            fields[k] = np.dtype(jax.dtypes.canonicalize_dtype(v))
    return type(spec)(**fields)


def export_serving(
    fn: Callable,
    directory,
    *,
    tables: dict,
    input_signature: Any,
    params: Any = None,
    batch_sizes: Sequence[int] = (1, 8, 64, 512),
    feature_config: Any = None,
    platforms: Sequence[str] = ("cpu",),
) -> dict:
    """Export `fn` with its tables (and parameters) to `directory` for `load_serving`.

    Args:
      fn: `fn(inputs, tables)` or, with `params`, `fn(inputs, tables, params)`;
        `inputs` has the structure of `input_signature` (with `SparseTensor` /
        `RaggedTensor` / arrays for its leaves), `tables` is `{TableConfig:
        array}` with the keys of `tables`. Returns a pytree (dict / list /
        tuple) of arrays whose leading axis is the batch.
      directory: created if needed; existing export files are replaced.
      tables: `{TableConfig: [vocabulary_size, dim] array}`, e.g.
        `MeshEmbedding.embedding_tables` or `checkpoint.load_tables(...)`; a table of
        raw ids as its `RawIdTable` (its ids: signature inputs given to the lookup as
        they are; docs/dynamic-ids.md#serving-tables-of-raw-ids).
      input_signature: a structure of dicts / lists / tuples / None whose
        leaves are `Dense`, `Sparse` or `Ragged`; every leaf is batched.
      params: optional pytree of arrays passed to `fn` as arguments (the dense
        model's weights); anything `fn` closes over is baked into the program.
      batch_sizes: the batch buckets, one program each.
      feature_config: optional, names the table files after its table names.
      platforms: lowering platforms of the programs.

    Returns the manifest (also written to `directory/manifest.json`).
    """
    # About 100 lines as one function on purpose: its steps (the signature encoded, the
    # traced `program`, one export per bucket, the files and manifest) share the closure
    # `program` and what tracing records in it (`raw_uses`, the output structure), which
    # the manifest then reads; split, a dozen values would travel between the phases. Its
    # pieces are already helpers (`_encode`, `_table_arrays`, `_export_bucket`,
    # `_save_arrays`, `_raw_inputs`).
    import jax

    buckets = sorted({int(b) for b in batch_sizes})
    if not buckets or buckets[0] < 1:
        raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
    spec_leaves = []

    def leaf(x):
        if not isinstance(x, _SPECS):
            raise TypeError(
                f"input_signature leaves must be Dense, Sparse or Ragged, got {type(x).__name__}"
            )
        x = _canonical(x)
        spec_leaves.append(x)
        return {"t": "leaf", "spec": _spec_to_json(x)}

    in_structure = _encode(input_signature, leaf, "input_signature")
    if not spec_leaves:
        raise ValueError("input_signature has no inputs")
    extra = int(any(not isinstance(s, Dense) for s in spec_leaves))

    configs = list(tables)  # in a fixed order
    table_entries = _table_files(configs, feature_config)
    table_arrays, table_parts = _table_arrays(tables, configs)
    raw_tables = {i: tables[c] for i, c in enumerate(configs) if isinstance(tables[c], RawIdTable)}
    raw_uses: dict = {}  # input leaf -> {(kind, table)}: which leaves go to tables of raw ids
    param_leaves, param_treedef = jax.tree_util.tree_flatten(params)
    param_arrays = [np.asarray(p) for p in param_leaves]

    def program(flat_inputs, table_list, param_list, pb):
        it = iter(flat_inputs)
        rebuilt = iter([_rebuild_leaf(s, it, pb) for s in spec_leaves])
        inputs = _rebuild_structure(in_structure, rebuilt)
        tabs = _rebuild_tables(configs, table_parts, table_list, raw_tables)
        with _noting_raw_uses(raw_tables, spec_leaves, flat_inputs, raw_uses):
            if params is None:
                out = fn(inputs, tabs)
            else:
                out = fn(inputs, tabs, jax.tree_util.tree_unflatten(param_treedef, param_list))
        out_leaves = []

        def out_leaf(x):
            out_leaves.append(x)
            return {"t": "leaf"}

        structure = _encode(out, out_leaf, "the serving function's output")
        return out_leaves, structure

    os.makedirs(directory, exist_ok=True)
    programs, out_structure = {}, None
    table_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in table_arrays]
    param_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in param_arrays]
    for b in buckets:
        in_specs = [a for s in spec_leaves for a in _bucket_args(s, b, b + extra)]
        exported, structure = _export_bucket(
            program, b, b + extra, (in_specs, table_specs, param_specs), platforms
        )
        if out_structure is None:
            out_structure = structure
        elif structure != out_structure:
            raise ValueError("the serving function's output structure depends on the batch size")
        programs[b] = f"program_{b}.bin"
        with open(os.path.join(directory, programs[b]), "wb") as f:
            f.write(exported.serialize())

    raw_inputs = _raw_inputs(raw_uses, configs, raw_tables, spec_leaves, table_entries)
    param_entries = _save_arrays(directory, table_entries, table_arrays, param_arrays, table_parts)
    _save_raw_ids(directory, table_entries, raw_tables)
    # the package's __init__ (the one version source) is loaded: it is this module's parent
    version = getattr(sys.modules.get("embedmesh"), "__version__", "unknown")
    manifest = {
        "format": FORMAT,
        # 2 where a table is quantized, 3 where one is of raw ids: others stay readable by
        # older loaders
        "format_version": 3 if raw_tables else 2 if any(m for _, m in table_parts) else 1,
        "embedmesh_version": version,
        "jax_version": jax.__version__,
        "platforms": list(platforms),
        "batch_sizes": buckets,
        "extra_row": extra,
        "programs": {str(b): p for b, p in programs.items()},
        "inputs": in_structure,
        "outputs": out_structure,
        "tables": table_entries,
        "params": param_entries,
    }
    if raw_tables:
        manifest["raw_id_inputs"] = raw_inputs
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _export_bucket(program, b: int, pb: int, specs: tuple, platforms):
    """`program` exported for bucket `b` (`pb` rows: the batch and its extra row), and
    its output structure; every output leaf must lead with the batch."""
    import jax

    captured = {}

    def flat_fn(flat_inputs, table_list, param_list):
        leaves, captured["structure"] = program(flat_inputs, table_list, param_list, pb)
        return leaves

    exported = jax.export.export(jax.jit(flat_fn), platforms=tuple(platforms))(*specs)
    for i, aval in enumerate(exported.out_avals):
        if len(aval.shape) == 0 or aval.shape[0] != pb:
            raise ValueError(
                f"output leaf {i} has shape {aval.shape}: every output needs "
                f"the batch ({pb} in bucket {b}) as its leading axis"
            )
    return exported, captured["structure"]


def _table_files(configs: list, feature_config) -> list[dict]:
    """Each table's name (the feature config's, the config's, else `table_<i>`) and
    the file it is saved to, one distinct file each."""
    from embedmesh.config import resolve_feature_config

    names = {}
    if feature_config is not None:
        resolved = resolve_feature_config(feature_config)
        names = {id(t): n for t, n in zip(resolved.tables, resolved.table_names)}
    table_entries, used = [], set()
    for i, cfg in enumerate(configs):
        name = names.get(id(cfg)) or getattr(cfg, "name", None) or f"table_{i}"
        file = f"tables/{_safe(name)}.npy"
        if file in used:
            file = f"tables/{i}_{_safe(name)}.npy"
        used.add(file)
        table_entries.append({"name": name, "file": file})
    return table_entries


def _table_arrays(tables: dict, configs: list) -> tuple[list, list]:
    """The tables' arrays in order, flat (a `QuantizedTable` gives its arrays: rows, then
    the codes' values), and per table (how many arrays, its `meta()` or None)."""
    arrays, parts = [], []
    for c in configs:
        t = tables[c]
        if isinstance(t, QuantizedTable):
            got = [np.asarray(a) for a in t.arrays()]
            arrays += got
            parts.append((len(got), t.meta()))
        elif isinstance(t, RawIdTable):  # its rows in id order, zero rows after them
            arrays.append(t.padded)  # a quantized one's encoded rows: one array
            parts.append((1, t.quantized.meta() if isinstance(t, QuantizedRawIdTable) else None))
        else:
            arrays.append(np.asarray(t))
            parts.append((1, None))
    return arrays, parts


def _rebuild_tables(configs: list, parts: list, flat: list, raw: dict) -> dict:
    """`{TableConfig: table}` from the flat arrays of `_table_arrays` (inside the program:
    quantized tables rebuilt around their traced arrays; a table of raw ids (index in
    `raw`) as `raw_ids.HostMapped`: its inputs arrive as positions)."""
    tabs, i = {}, 0
    for k, (c, (n, meta)) in enumerate(zip(configs, parts)):
        table = flat[i] if meta is None else QuantizedTable.from_arrays(meta, flat[i : i + n])
        tabs[c] = raw_ids.HostMapped(table) if k in raw else table
        i += n
    return tabs


@contextlib.contextmanager
def _noting_raw_uses(raw_tables: dict, spec_leaves: list, flat_inputs: list, uses: dict):
    """While the serving function is traced: `raw_ids.served_request` notes in `uses`
    which input leaves the lookups take (by their ids arrays), for the tables of raw ids."""
    if not raw_tables:
        yield
        return
    raw_ids._EXPORT.ctx = {"leaves": _value_leaves(spec_leaves, flat_inputs), "uses": uses}
    try:
        yield
    finally:
        raw_ids._EXPORT.ctx = None


def _save_raw_ids(directory, table_entries: list, raw_tables: dict) -> None:
    """Each table of raw ids' sorted ids beside its rows (its entry's `raw_ids`)."""
    for i, t in raw_tables.items():
        stem = table_entries[i]["file"][: -len(".npy")]
        table_entries[i]["raw_ids"] = {
            "ids": _save_array(directory, f"{stem}.ids.npy", np.asarray(t.ids)),
            "capacity": t.capacity,
            "step": t.step,
        }


def _value_leaves(spec_leaves: list, flat_inputs: list) -> dict:
    """{id(ids array): input leaf index}: the array holding each leaf's ids (a dense
    leaf itself, a sparse or ragged leaf's values) among the program's flat inputs."""
    out, k = {}, 0
    for li, spec in enumerate(spec_leaves):
        at = k + 1 if isinstance(spec, Sparse) else k
        out[id(flat_inputs[at])] = li
        k += 1 if isinstance(spec, Dense) else 2
    return out


def _raw_inputs(uses: dict, configs: list, raw: dict, spec_leaves: list, entries: list) -> list:
    """[[input leaf, table index]] of the leaves looked up in tables of raw ids; a leaf
    given to a table of raw ids and to any other table is refused (its ids become
    positions in that one table's rows on the host)."""
    index = {id(configs[i]): i for i in raw}
    out = []
    for leaf, keys in sorted(uses.items()):
        raw_keys = [k for k in keys if k[0] == "raw"]
        if not raw_keys:
            continue
        if len(keys) > 1:
            names = sorted(
                entries[index[k[1]]]["name"] if k[0] == "raw" else "a plain table" for k in keys
            )
            raise ValueError(
                f"input leaf {leaf} ({type(spec_leaves[leaf]).__name__}) is looked up in a table "
                f"of raw ids and in another table ({names}): the loaded function turns its "
                f"ids into rows of one table of raw ids; give each table its own input"
            )
        out.append([leaf, index[raw_keys[0][1]]])
    return out


def _save_array(directory, file: str, arr: np.ndarray) -> dict:
    """`arr` saved to `directory/file` (bfloat16 as its uint16 bits: numpy cannot read a
    saved bfloat16 back); its manifest fields."""
    dtype = _dtype_name(arr.dtype)
    np.save(os.path.join(directory, file), arr.view(np.uint16) if dtype == "bfloat16" else arr)
    return {"file": file, "shape": list(arr.shape), "dtype": dtype}


def _load_array(directory, entry: dict) -> np.ndarray:
    """An array `_save_array` saved (memory-mapped)."""
    arr = np.load(os.path.join(directory, entry["file"]), mmap_mode="r")
    if entry.get("dtype") == "bfloat16":
        arr = arr.view(ml_dtypes.bfloat16)
    return arr


def _save_arrays(
    directory, table_entries: list, table_arrays: list, param_arrays: list, table_parts: list
) -> list:
    """Save the tables (their entries gain shape and dtype; a quantized table's, its
    `quantized` meta and its further arrays) and the parameters under `directory`;
    returns the parameters' manifest entries."""
    os.makedirs(os.path.join(directory, "tables"), exist_ok=True)
    it = iter(table_arrays)
    for entry, (n, meta) in zip(table_entries, table_parts):
        entry.update(_save_array(directory, entry["file"], next(it)))
        if meta is not None:
            entry["quantized"] = dict(meta)
            stem = entry["file"][: -len(".npy")]
            entry["more"] = [
                _save_array(directory, f"{stem}.{j}.npy", next(it)) for j in range(1, n)
            ]
    param_entries = []
    if param_arrays:
        os.makedirs(os.path.join(directory, "params"), exist_ok=True)
    for i, arr in enumerate(param_arrays):
        file = f"params/{i}.npy"
        np.save(os.path.join(directory, file), arr)
        param_entries.append(
            {"file": file, "shape": list(arr.shape), "dtype": _dtype_name(arr.dtype)}
        )
    return param_entries


# ---------------------------------------------------------------------------
# Loading and calling


def _as_input(where: str, spec, x):
    """Normalise one call-time input leaf to numpy parts; returns (batch, parts)."""
    from embedmesh.inputs import RaggedTensor, SparseTensor, convert_input

    x = convert_input(x)
    if isinstance(spec, Dense):
        if isinstance(x, (SparseTensor, RaggedTensor)):
            raise ValueError(f"{where}: expected a dense array, got {type(x).__name__}")
        x = np.asarray(x)
        if x.ndim != 1 + len(spec.shape) or tuple(x.shape[1:]) != spec.shape:
            raise ValueError(
                f"{where}: expected shape [batch, {', '.join(map(str, spec.shape))}"
                f"], got {list(x.shape)}"
            )
        return x.shape[0], (x,)
    if isinstance(spec, Sparse):
        if not isinstance(x, SparseTensor):
            raise ValueError(f"{where}: expected a SparseTensor, got {type(x).__name__}")
        if tuple(x.dense_shape[1:]) != spec.shape:
            raise ValueError(
                f"{where}: expected dense_shape [batch, "
                f"{', '.join(map(str, spec.shape))}], got {list(x.dense_shape)}"
            )
        idx = np.asarray(x.indices).reshape(-1, 1 + len(spec.shape))
        return x.dense_shape[0], (idx, np.asarray(x.values).reshape(-1))
    if not isinstance(x, RaggedTensor):
        raise ValueError(f"{where}: expected a RaggedTensor, got {type(x).__name__}")
    splits = np.asarray(x.row_splits).reshape(-1)
    return splits.shape[0] - 1, (np.asarray(x.values).reshape(-1), splits)


def _counts(spec, parts, n: int) -> np.ndarray | None:
    """Ids per example of a sparse/ragged input (None for dense)."""
    if isinstance(spec, Dense):
        return None
    if isinstance(spec, Sparse):
        return np.bincount(parts[0][:, 0].astype(np.int64), minlength=n)[:n]
    return np.diff(parts[1].astype(np.int64))


def _slice(spec, parts, lo: int, hi: int):
    if isinstance(spec, Dense):
        return (parts[0][lo:hi],)
    if isinstance(spec, Sparse):
        idx, vals = parts
        rows = idx[:, 0]
        sel = (rows >= lo) & (rows < hi)
        sub = idx[sel].copy()
        sub[:, 0] -= lo
        return sub, vals[sel]
    vals, splits = parts
    s = splits[lo : hi + 1]
    return vals[s[0] : s[-1]], s - s[0]


def _pad(spec, parts, n: int, b: int, pb: int) -> list:
    if isinstance(spec, Dense):
        out = np.zeros((pb,) + spec.shape, spec.dtype)
        out[:n] = parts[0]
        return [out]
    cap = b * spec.nnz_per_example
    if isinstance(spec, Sparse):
        idx, vals = parts
        nnz = idx.shape[0]
        out_idx = np.zeros((cap, idx.shape[1]), spec.index_dtype)
        out_idx[:nnz] = idx
        out_idx[nnz:, 0] = pb - 1  # padding ids land in the hidden row past the batch
        out_vals = np.zeros((cap,), spec.dtype)
        out_vals[:nnz] = vals
        return [out_idx, out_vals]
    vals, splits = parts
    nnz = vals.shape[0]
    out_vals = np.zeros((cap,), spec.dtype)
    out_vals[:nnz] = vals
    out_splits = np.empty((pb + 1,), spec.splits_dtype)
    out_splits[: n + 1] = splits
    out_splits[n + 1 : pb] = nnz
    out_splits[pb] = cap  # the hidden row holds the padding ids
    return [out_vals, out_splits]


# ---------------------------------------------------------------------------
# Forked children (pre-forking servers)
#
# XLA's runtime does not survive os.fork: the CPU client's worker threads and MLIR's
# thread pool exist only in the parent, so in a child a compiled program never finishes
# and a compile (or even deserializing an export) waits forever for threads that are
# not there. A ServingFunction used in a child it was not loaded in therefore first
# replaces jax's runtime in that child (a new MLIR thread pool, new backend clients,
# jax's caches cleared) and then reloads its tables, parameters and programs from the
# export directory. The parent's clients and buffers are left alone (destroying them
# would wait for the missing threads too): their memory stays as the fork shared it.
# XLA cannot compile in such a child either (its compiler's global locks may be held by
# parent threads that do not exist there), so right before a fork (os.register_at_fork)
# every loaded ServingFunction compiles its buckets and serializes the executables; the
# child deserializes them (no compile). The re-initialisation is process-wide: jax arrays
# made in the parent are unusable in the child anyway. A ServingFunction cannot be
# *loaded* in such a child (that would compile): load it in the parent before forking,
# or start children with 'spawn' / 'forkserver'.

_FORK_LEFTOVERS: list = []  # the parent's runtime objects, kept from being destroyed
_REINIT_PID: int | None = None
_FORKED_FROM_JAX = False  # this process was forked from one with a live jax runtime
_LIVE: weakref.WeakSet = weakref.WeakSet()  # loaded ServingFunctions of this process


def _before_fork() -> None:
    global _RUNTIME_AT_FORK
    _RUNTIME_AT_FORK = False
    try:
        _RUNTIME_AT_FORK = bool(_compat.backends_are_initialized())
    except Exception:  # noqa: BLE001 - never break a fork
        pass
    for fn in list(_LIVE):
        try:
            fn._prepare_for_fork()
        except Exception:  # noqa: BLE001 - the child then raises a clear error
            pass


def _after_fork_in_child() -> None:
    global _FORKED_FROM_JAX
    _FORKED_FROM_JAX = _FORKED_FROM_JAX or _RUNTIME_AT_FORK


_RUNTIME_AT_FORK = False
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _reinit_jax_after_fork() -> None:
    """Give this (forked) process a working jax runtime of its own; once per process."""
    global _REINIT_PID
    pid = os.getpid()
    if pid == _REINIT_PID:
        return
    _compat.reinit_backends_after_fork(_FORK_LEFTOVERS)
    _REINIT_PID = pid


class ServingFunction:
    """A loaded export: call it with inputs of the exported signature; numpy outputs.

    Attributes: `batch_sizes` (the buckets), `manifest` (the JSON manifest),
    `tables` (`{name: device array}`; a table of raw ids: its current `RawIdTable`).
    """

    def __init__(self, directory, *, precompile: bool = True):

        self.directory = os.fspath(directory)
        with open(os.path.join(self.directory, MANIFEST)) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{self.directory} is not an embedmesh serving export")
        if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
            raise ValueError(
                f"{self.directory} has export format version "
                f"{manifest['format_version']}; this embedmesh reads up to "
                f"{FORMAT_VERSION}"
            )
        self.manifest = manifest
        self.batch_sizes = list(manifest["batch_sizes"])
        self._extra = int(manifest["extra_row"])
        self._in = manifest["inputs"]
        self._out = manifest["outputs"]

        if _FORKED_FROM_JAX:
            raise RuntimeError(
                f"cannot load serving export {self.directory} in this process: it was forked "
                f"from a process that had started jax's runtime, which does not survive a "
                f"fork (and XLA cannot compile here). Call load_serving in the parent before "
                f"forking (its loaded functions work in the children), or start children "
                f"with multiprocessing's 'spawn' or 'forkserver'"
            )
        self._serialized: dict = {}  # bucket -> serialized executable (for forked children)
        self._compile_lock = threading.Lock()
        self._update_lock = threading.Lock()  # apply_increment: one writer at a time
        self._raw_applied: dict = {}  # name -> RawIdTable updated in memory (apply_increment)
        self._forked = False
        self._load_arrays()
        _LIVE.add(self)
        if precompile:  # no cold start: the first request runs a compiled, warm program
            self._warm_up()

    def __repr__(self) -> str:
        tables = ", ".join(
            f"{name}: " + (" x ".join(map(str, t.shape)) if hasattr(t, "shape") else "raw ids")
            for name, t in self.tables.items()
        )
        return (
            f"ServingFunction({self.directory!r}, batch_sizes={self.batch_sizes}, "
            f"tables {{{tables}}})"
        )

    def _load_arrays(self):
        """Tables and parameters onto the device; programs compiled afresh on first use."""
        import jax

        def load(entry):  # mapped from disk, copied once into a device buffer
            return jax.device_put(np.asarray(_load_array(self.directory, entry)))

        self._pid = os.getpid()
        self._tables, self.tables = [], {}
        raw = {}  # name -> (flat index of its array, RawIdTable)
        for e in self.manifest["tables"]:  # a quantized table: its rows, then its values
            r = e.get("raw_ids")
            if r is not None:  # a table of raw ids: its sorted ids on the host
                t = self._raw_applied.get(e["name"])
                if t is None:
                    ids = np.array(_load_array(self.directory, r["ids"]))
                    rows = np.asarray(_load_array(self.directory, e))
                    meta = e.get("quantized")
                    t = (
                        RawIdTable._of_sorted(ids, rows, r["capacity"], r["step"])
                        if meta is None
                        else QuantizedRawIdTable._make(
                            ids, rows, r["capacity"], r["step"], meta["kind"], meta["dim"]
                        )
                    )
                raw[e["name"]] = (len(self._tables), t)
                self._tables.append(jax.device_put(np.asarray(t.padded)))
                self.tables[e["name"]] = t
                continue
            arrays = [load(e)] + [load(m) for m in e.get("more", ())]
            self._tables += arrays
            meta = e.get("quantized")
            self.tables[e["name"]] = (
                arrays[0] if meta is None else QuantizedTable.from_arrays(meta, arrays)
            )
        self._params = [load(e) for e in self.manifest["params"]]
        self._programs: dict = {}
        # (input leaf, table name) of the leaves whose raw ids the host looks up
        names = [e["name"] for e in self.manifest["tables"]]
        self._raw_inputs = [(leaf, names[i]) for leaf, i in self.manifest.get("raw_id_inputs", [])]
        self._raw_index = {name: at for name, (at, _) in raw.items()}
        # what a call reads, swapped whole by apply_increment: (table arrays, raw tables)
        self._live = (list(self._tables), {name: t for name, (_, t) in raw.items()})

    def apply_increment(self, updates: dict) -> None:
        """Apply `RawIdUpdate`s (`embedmesh.serving.export_increment`) to this function's
        tables of raw ids: `{table name or TableConfig: RawIdUpdate}`, each made against
        the table's current step (`tables[name].step`). The new rows are put on the
        device, then swapped in with the ids at once: calls running meanwhile (any
        thread) use the tables before or after, never a mix. In memory only: the export
        directory is not changed (a process that loads it again starts from the export;
        a child forked later keeps the updates)."""
        with self._update_lock:
            arrays, raw = self._live
            arrays, raw = list(arrays), dict(raw)
            for key, update in updates.items():
                name = key if isinstance(key, str) else getattr(key, "name", None)
                if name not in raw:
                    raise KeyError(
                        f"{key!r} is not a table of raw ids of this export (those: {sorted(raw)})"
                    )
                if not isinstance(update, RawIdUpdate):
                    raise TypeError(f"updates[{name!r}] must be a RawIdUpdate")
                raw[name] = raw[name].apply(update)
            import jax

            for name, t in raw.items():
                if t is not self._live[1][name]:
                    arrays[self._raw_index[name]] = jax.device_put(np.asarray(t.padded))
            self._raw_applied.update(raw)
            self._tables = arrays
            self.tables = {**self.tables, **raw}
            self._live = (arrays, raw)

    def _after_fork(self):
        """In a forked child: jax's runtime re-initialised, the tables and parameters
        reloaded, the executables serialized by the parent before the fork loaded."""
        from jax.experimental import serialize_executable

        old = (self._tables, self._params, self._programs)
        _reinit_jax_after_fork()
        _FORK_LEFTOVERS.append(old)  # the parent's buffers: never touched again
        self._load_arrays()
        self._forked = True
        for b, blob in self._serialized.items():
            self._programs[b] = serialize_executable.deserialize_and_load(*blob)

    def _program(self, b: int):
        """Bucket b's program, compiled ahead of time for the loaded tables' devices."""
        fn = self._programs.get(b)
        if fn is not None:
            return fn
        with self._compile_lock:  # threads racing to a bucket's first use compile it once
            return self._compile(b)

    def _compile(self, b: int):
        fn = self._programs.get(b)
        if fn is None:
            if self._forked:
                raise RuntimeError(
                    f"serving export {self.directory}: bucket {b}'s program was not "
                    f"prepared before this process was forked, and XLA cannot compile in "
                    f"a child forked from a process that used it; start children with "
                    f"multiprocessing's 'spawn' or 'forkserver', or fork before jax is used"
                )
            import jax

            with open(os.path.join(self.directory, self.manifest["programs"][str(b)]), "rb") as f:
                exported = jax.export.deserialize(bytearray(f.read()))
            k = len(exported.in_avals) - len(self._tables) - len(self._params)
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals[:k]]
            fn = self._programs[b] = (
                jax.jit(exported.call).lower(specs, self._tables, self._params).compile()
            )
        return fn

    def _warm_up(self):
        """Compile every bucket's program and run each once (zeros), and one empty call
        through `__call__`: the first request then pays no compile and no first-run
        cost (the program's first execution, numpy's first use of a function)."""
        from embedmesh.inputs import RaggedTensor, SparseTensor

        for b in self.batch_sizes:
            self._program(b)
        empty = []
        for spec in _spec_leaves(self._in):
            if isinstance(spec, Dense):
                empty.append(np.zeros((0,) + spec.shape, spec.dtype))
            elif isinstance(spec, Sparse):
                idx = np.zeros((0, 1 + len(spec.shape)), spec.index_dtype)
                empty.append(SparseTensor(idx, np.zeros(0, spec.dtype), (0,) + spec.shape))
            else:
                empty.append(RaggedTensor(np.zeros(0, spec.dtype), np.zeros(1, spec.splits_dtype)))
        # the smallest bucket end to end, a few times: a call's first runs are slower
        # (malloc growing its heap for the padded inputs, caches, the executable's state)
        for _ in range(3):
            self(_rebuild_structure(self._in, iter(empty)))
        for b in self.batch_sizes:
            self._run_zeros(b)
            self._run_zeros(b)
        # the garbage of loading and compiling, collected now rather than by a request
        gc.collect()

    def _run_zeros(self, b: int):
        """Run bucket b's program once on zero inputs (its first execution)."""
        pb = b + self._extra
        flat = []
        for spec in _spec_leaves(self._in):
            if isinstance(spec, Dense):
                flat.append(np.zeros((pb,) + spec.shape, spec.dtype))
            elif isinstance(spec, Sparse):
                cap = b * int(spec.nnz_per_example or 0)
                flat += [
                    np.zeros((cap, 1 + len(spec.shape)), spec.index_dtype),
                    np.zeros(cap, spec.dtype),
                ]
            else:
                cap = b * spec.nnz_per_example
                flat += [np.zeros(cap, spec.dtype), np.zeros(pb + 1, spec.splits_dtype)]
        for r in self._program(b)(flat, self._tables, self._params):
            np.asarray(r)

    def _prepare_for_fork(self):
        """Before a fork (in the parent): every bucket compiled and serialized, so that a
        child can load the executables without compiling (see `_after_fork`)."""
        if os.getpid() != self._pid:
            return
        from jax.experimental import serialize_executable

        for b in self.batch_sizes:
            if b not in self._serialized:
                self._serialized[b] = serialize_executable.serialize(self._program(b))

    def _chunks(self, n: int, counts: list) -> list:
        """[(lo, hi)] example ranges, each fitting the largest bucket."""
        bmax = self.batch_sizes[-1]
        caps = [
            (c, spec.nnz_per_example * bmax, where) for where, spec, c in counts if c is not None
        ]
        if n <= bmax and all(c.sum() <= cap for c, cap, _ in caps):
            return [(0, n)]
        cums = [(np.concatenate([[0], np.cumsum(c)]), cap, where) for c, cap, where in caps]
        out, lo = [], 0
        while lo < n:
            hi = min(lo + bmax, n)
            for cum, cap, where in cums:
                fit = int(np.searchsorted(cum, cum[lo] + cap, side="right")) - 1
                if fit <= lo:
                    raise ValueError(
                        f"{where}: example {lo} has {int(cum[lo + 1] - cum[lo])} "
                        f"ids, more than the export holds per batch "
                        f"({cap} in the largest bucket, {bmax})"
                    )
                hi = min(hi, fit)
            out.append((lo, hi))
            lo = hi
        return out

    def _bucket(self, n: int, nnz: list) -> int:
        for b in self.batch_sizes:
            if b >= n and all(k <= b * spec.nnz_per_example for spec, k in nnz):
                return b
        raise AssertionError("no bucket fits a planned chunk")  # _chunks prevents this

    def __call__(self, inputs: Any) -> Any:
        if os.getpid() != self._pid:  # a forked child: the parent's runtime does not work
            self._after_fork()
        tables, raw = self._live  # one snapshot for the whole call (apply_increment)
        leaves = _leaves(self._in, inputs)
        specs = [(where, _spec_from_json(s["spec"]), x) for where, s, x in leaves]
        parts, batch = [], None
        for where, spec, x in specs:
            n, p = _as_input(where, spec, x)
            if batch is None:
                batch = n
            elif n != batch:
                raise ValueError(f"{where}: batch size {n}, but {specs[0][0]} has {batch}")
            parts.append(p)
        for leaf, name in self._raw_inputs:  # raw ids -> rows of the table's sorted ids
            parts[leaf] = _positions(specs[leaf][1], parts[leaf], raw[name])
        counts = [
            (where, spec, _counts(spec, p, batch)) for (where, spec, _), p in zip(specs, parts)
        ]
        outputs = []
        for lo, hi in self._chunks(batch, counts):
            n = hi - lo
            sub = [
                p if (lo, hi) == (0, batch) else _slice(spec, p, lo, hi)
                for (_, spec, _), p in zip(specs, parts)
            ]
            nnz = [
                (spec, int(s[1].shape[0] if isinstance(spec, Sparse) else s[0].shape[0]))
                for (_, spec, _), s in zip(specs, sub)
                if not isinstance(spec, Dense)
            ]
            b = self._bucket(n, nnz)
            pb = b + self._extra
            flat = [a for (_, spec, _), s in zip(specs, sub) for a in _pad(spec, s, n, b, pb)]
            result = self._program(b)(flat, tables, self._params)
            outputs.append([np.asarray(r)[:n] for r in result])
        flat_out = [
            np.concatenate(parts_, axis=0) if len(outputs) > 1 else parts_[0]
            for parts_ in zip(*outputs)
        ]
        return _rebuild_structure(self._out, iter(flat_out))


def _positions(spec, parts, table: RawIdTable) -> tuple:
    """A leaf's numpy parts with its raw ids replaced by their rows in `table.padded`."""
    if isinstance(spec, Dense):
        return (table.positions(parts[0]),)
    if isinstance(spec, Sparse):
        return parts[0], table.positions(parts[1])
    return table.positions(parts[0]), parts[1]


def _spec_leaves(structure: dict) -> list:
    """The input specs of a manifest structure, in its leaves' order."""
    t = structure["t"]
    if t == "leaf":
        return [_spec_from_json(structure["spec"])]
    if t == "none":
        return []
    return [x for sub in structure["v"] for x in _spec_leaves(sub)]


def load_serving(directory, *, precompile: bool = True) -> ServingFunction:
    """Load an export of `export_serving`: a callable taking numpy / SparseTensor /
    RaggedTensor inputs in the exported structure and returning numpy outputs.

    With `precompile` (the default) every batch bucket's program is compiled here,
    so the first call runs as fast as later ones; `precompile=False` compiles each
    bucket at its first use instead (a faster load, a slow first call per bucket)."""
    return ServingFunction(directory, precompile=precompile)
