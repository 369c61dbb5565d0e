"""Export trained tables and a JAX model as a TensorFlow SavedModel, for TF Serving.

    export_saved_model(model, "saved/", tables=tables, params=params,
                       feature_config=features,  # {"watched": ..., "user": ...}
                       input_signature={"watched": Ragged(8), "user": Dense(),
                                        "dense": Dense((13,), np.float32)})

    # anywhere TensorFlow runs (TF Serving, or Python without embedmesh):
    served = tf.saved_model.load("saved/").signatures["serving_default"]
    served(watched_values=rt.values, watched_row_splits=rt.row_splits, user=...,
           dense=...)["score"]

The SavedModel holds each table as a `tf.Variable` (`[vocabulary_size, dim]`, logical
row order) and each dense parameter as one too. Its `serving_default` signature runs
TensorFlow's own `tf.tpu.experimental.embedding.serving_embedding_lookup` on the
tables (so TF's exact semantics: combiners, sequence features, `output_shape`,
validation), then the model, converted with `jax2tf` (native serialization: the
model's StableHLO in an `XlaCallModule` op, the parameters passed in as the variables).

Inputs (one flat signature, since TF Serving's signatures take tensors, not composite
tensors; `<f>` is the feature's name with characters outside `[A-Za-z0-9_]` made `_`):
- `Dense(shape, dtype)`: `<f>`, `[batch, *shape]` ids;
- `Ragged(...)`: `<f>_values` `[nnz]` and `<f>_row_splits` `[batch + 1]` int64, the
  components of a `tf.RaggedTensor` (`rt.values`, `rt.row_splits`; int64 is its
  row splits' default dtype, `tf.cast` others);
- `Sparse(shape, ...)`: `<f>_indices` `[nnz, 1 + len(shape)]` int64,
  `<f>_values` `[nnz]` and `<f>_dense_shape` `[1 + len(shape)]` int64, a
  `tf.SparseTensor`'s components.
With `weighted=` (feature names), a Ragged or Sparse feature also takes `<f>_weights`
`[nnz]` float32, its ids' weights (TF's `weights` argument; the others weigh 1).
An entry of `input_signature` at a path where the feature config has no feature is
another input of the model (a DLRM's dense features), a `Dense(shape, dtype)` spec:
the signature input `<path>` (`"dense"`, `"a/0"` -> `a_0`), `[batch, *shape]`, handed to
the model as it is, in its place in the signature's structure, as `export_serving`
hands its function every input of its signature.
The batch is any size: the signature's batch axis is `None` and the model is exported
with a symbolic batch, so there are no buckets and no padding (`nnz_per_example` and
`splits_dtype` of the specs are not used). The model must work for any batch size (usual
ranking models do); features with a fixed `output_shape` fix the batch to that shape's.

A table of raw ids (`TableConfig.id_map`) is given as its `RawIdTable` (`raw_id_tables`,
`export_increment`'s tables): the SavedModel holds its rows and a zero row
(`RawIdTable.padded`, `[capacity + 1, dim]`) and its live ids, sorted (int64 variable
`<table>_raw_ids`); the signature takes the raw ids (int64; uint64 read as their two's
complement bits) and the graph finds each one's row by a binary search
(`tf.searchsorted`) before TensorFlow's lookup, an id it does not hold reading the zero
row (counted in a mean's or sqrtn's weights), as `serving_embedding_lookup` does. A
SavedModel is a snapshot: fresher rows are a new export (a new version for TF Serving);
`export_serving`'s functions take increments in place.

TensorFlow is needed to export (the `embedmesh[tf]` extra) and is imported only here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from embedmesh.config import _path_str, resolve_feature_config
from embedmesh.layout.by_id import RawIdTable
from embedmesh.serving.export import Dense, Ragged, Sparse
from embedmesh.serving.quantized import QuantizedTable

__all__ = ["export_saved_model", "signature_names"]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def signature_names(feature_config, input_signature, weighted=()) -> dict:
    """`{feature name: {component: signature input name}}` (components: "ids" for
    Dense; "values", "row_splits" for Ragged; "indices", "values", "dense_shape" for
    Sparse; and "weights" for the features in `weighted`), then `{name: {"array":
    signature input name}}` for each input that is not a feature (named by its path in
    the signature, like `"dense"` or `"a/0"`)."""
    resolved = resolve_feature_config(feature_config)
    split = _split_signature(resolved, input_signature)
    weighted = _weighted(resolved, split.specs, weighted)
    out: dict = {}
    for name, spec in zip(resolved.feature_names, split.specs):
        f = _safe(name)
        if isinstance(spec, Dense):
            out[name] = {"ids": f}
        elif isinstance(spec, Ragged):
            out[name] = {"values": f"{f}_values", "row_splits": f"{f}_row_splits"}
        else:
            out[name] = {
                "indices": f"{f}_indices",
                "values": f"{f}_values",
                "dense_shape": f"{f}_dense_shape",
            }
        if name in weighted:
            out[name]["weights"] = f"{f}_weights"
    for name, _ in split.extras:
        if name in out:
            raise ValueError(
                f"input_signature entry {name} (not a feature) has the name of a feature: "
                f"rename the feature (FeatureConfig.name) or move the entry"
            )
        out[name] = {"array": _safe(name)}
    owner: dict = {}
    for name, comps in out.items():
        for input_name in comps.values():
            if input_name in owner:
                raise ValueError(
                    f"the signature input {input_name} would serve both {owner[input_name]} "
                    f"and {name} (names outside [A-Za-z0-9_] become _): rename one"
                )
            owner[input_name] = name
    return out


def _weighted(resolved, specs, weighted) -> set:
    """The names in `weighted`, checked: features of the config with Ragged / Sparse specs."""
    if isinstance(weighted, str):
        weighted = (weighted,)
    kinds = dict(zip(resolved.feature_names, specs))
    for name in weighted:
        if name not in kinds:
            raise ValueError(
                f"weighted names {name!r}, which is not a feature of the config "
                f"(features: {list(kinds)})"
            )
        if isinstance(kinds[name], Dense):
            raise ValueError(
                f"weighted names feature {name}, a Dense input: dense ids take no weights "
                f"(TensorFlow's rule); only Ragged and Sparse features do"
            )
    return set(weighted)


@dataclasses.dataclass(frozen=True)
class _Split:
    """The input signature split into features and the model's other inputs.

    `specs`: each feature's spec, in the feature config's order; `extras`: `[(name,
    Dense)]`, the inputs that are not features, in the signature's order; `leaves`:
    for each leaf of the signature, ("feature", i) or ("extra", i); `treedef`: the
    signature's structure, which the model's input has."""

    specs: list
    extras: list
    leaves: list
    treedef: Any


def _split_signature(resolved, input_signature) -> _Split:
    """The signature's leaves matched to the feature config's features by their path in
    the structure; a leaf at a path that is no feature's is an extra input, passed to
    the model as it is (a DLRM's dense features), and must be `Dense`."""
    import jax

    feature_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(_feature_tree(resolved))[0]]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(input_signature)
    by_path = {tuple(p): (p, spec) for p, spec in leaves}
    for name, path in zip(resolved.feature_names, feature_paths):
        if tuple(path) not in by_path:
            raise ValueError(
                f"input_signature has no spec for feature {name} (at "
                f"{_path_str(path) or '<root>'}): it must hold the feature config's "
                f"structure, the model's other inputs beside it"
            )
        spec = by_path[tuple(path)][1]
        if not isinstance(spec, (Dense, Ragged, Sparse)):
            raise ValueError(
                f"input_signature for feature {name} must be Dense, Ragged or Sparse, got {spec!r}"
            )
    index = {tuple(p): i for i, p in enumerate(feature_paths)}
    specs = [by_path[tuple(p)][1] for p in feature_paths]
    extras: list = []
    kinds: list = []
    for path, spec in leaves:
        if tuple(path) in index:
            kinds.append(("feature", index[tuple(path)]))
            continue
        name = _path_str(path)
        if not isinstance(spec, Dense):
            raise ValueError(
                f"input_signature entry {name} is not a feature of the config, so it is "
                f"passed to the model as it is and must be a Dense spec (an array "
                f"[batch, *shape]), got {spec!r}"
            )
        kinds.append(("extra", len(extras)))
        extras.append((name, spec))
    return _Split(specs, extras, kinds, treedef)


def _feature_tree(resolved):
    """The feature config's structure with its features as leaves (paths as the user's)."""
    return resolved.treedef.unflatten(list(resolved.features))


def _tf_feature_config(resolved, tf):
    """TF's FeatureConfig structure (flat, in resolved order) over TF TableConfigs."""
    emb = tf.tpu.experimental.embedding
    tf_tables = {}
    for t, n in zip(resolved.tables, resolved.table_names):
        tf_tables[n] = emb.TableConfig(  # a table of raw ids: its rows, then the zero row
            vocabulary_size=t.vocabulary_size + (t.id_map is not None),
            dim=t.dim,
            initializer=tf.zeros_initializer(),
            combiner=t.combiner,
            name=n,
        )
    feats = []
    for f, name in zip(resolved.features, resolved.feature_names):
        feats.append(
            emb.FeatureConfig(
                table=tf_tables[resolved.table_name(f.table)],
                max_sequence_length=f.max_sequence_length,
                validate_weights_and_indices=f.validate_weights_and_indices,
                output_shape=list(f.output_shape) if f.output_shape else None,
                name=_safe(name),
            )
        )
    return tf_tables, feats


def export_saved_model(
    model: Callable,
    directory,
    *,
    tables: dict,
    feature_config: Any,
    input_signature: Any,
    params: Any = None,
    weighted: Any = (),
) -> dict:
    """Write a TensorFlow SavedModel serving `model` on the lookups of `tables`.

    Args:
      model: `model(params, inputs)` (or `model(inputs)` without `params`), a JAX
        function; `inputs` has the structure of `input_signature`, each feature's spec
        replaced by its activation (as `serving_embedding_lookup` returns them) and each
        other entry by its input array. Returns an array (signature output "output_0"),
        or a dict of arrays (its keys), or a list / tuple ("output_0", "output_1", ...).
      directory: the SavedModel directory (created; replaced if it exists).
      tables: `{TableConfig: [vocabulary_size, dim] array}` (`embedding_tables`,
        `checkpoint.load_tables(...)`); for a table of raw ids its `RawIdTable`.
      feature_config: the feature structure of the tables.
      input_signature: the feature structure with a `Dense`, `Ragged` or `Sparse`
        spec per feature, and beside the features any other inputs of the model as
        `Dense(shape, dtype)` specs (a DLRM's dense features: `{"item": Ragged(8),
        "dense": Dense((13,), np.float32)}`), as `export_serving` takes them (see the
        module doc for the signature's inputs).
      params: the model's parameters, any JAX pytree of arrays (stored as variables).
      weighted: names of Ragged / Sparse features that take weights (`<f>_weights`).

    Returns `signature_names(feature_config, input_signature, weighted)`.

    A table of raw ids is served by a binary search over its sorted live ids in the
    graph (module doc).
    """
    import jax
    import tensorflow as tf
    from jax.experimental import jax2tf

    resolved = resolve_feature_config(feature_config)
    split = _split_signature(resolved, input_signature)
    names = signature_names(feature_config, input_signature, weighted)
    by_name, raw_ids = _tables_by_name(resolved, tables)
    _check_raw_id_dtypes(resolved, split.specs, raw_ids)
    tf_tables, tf_feats = _tf_feature_config(resolved, tf)

    param_leaves, param_tree = jax.tree_util.tree_flatten(params)

    def dense(param_leaves, act_leaves, extra_leaves):
        if split.extras:  # the signature's structure: activations and the other inputs
            given = {"feature": act_leaves, "extra": extra_leaves}
            x = split.treedef.unflatten([given[kind][i] for kind, i in split.leaves])
        else:  # the feature config's own structure, as serving_embedding_lookup's
            x = jax.tree_util.tree_unflatten(resolved.treedef, act_leaves)
        p = jax.tree_util.tree_unflatten(param_tree, param_leaves)
        return model(p, x) if params is not None else model(x)

    converted = jax2tf.convert(
        dense,
        polymorphic_shapes=[
            None,
            ["(b, ...)"] * len(resolved.features),
            ["(b, ...)"] * len(split.extras),
        ],
        with_gradient=False,
        native_serialization_platforms=("cpu",),
    )

    module = tf.Module()
    module.tables = {n: tf.Variable(a, name=n, trainable=False) for n, a in by_name.items()}
    module.raw_ids = {
        n: tf.Variable(ids, name=f"{n}_raw_ids", trainable=False) for n, ids in raw_ids.items()
    }
    module.params = [
        tf.Variable(np.asarray(x), name=f"param_{i}", trainable=False)
        for i, x in enumerate(param_leaves)
    ]

    tensor_specs, keys = _signature_specs(resolved, split, names, tf)

    def ids(x, table):  # a table of raw ids: raw ids -> rows of its variable
        if table not in module.raw_ids:
            return x
        capacity = by_name[table].shape[0] - 1
        return _raw_ids_to_rows(tf, x, module.raw_ids[table], capacity)

    def serve(**kw):
        inputs, weights = _tf_inputs(resolved, split.specs, names, kw, ids, tf)
        table_vars = {tf_tables[t]: module.tables[t] for t in by_name}
        acts = tf.tpu.experimental.embedding.serving_embedding_lookup(
            inputs, weights if any(w is not None for w in weights) else None, table_vars, tf_feats
        )
        extras = [kw[names[name]["array"]] for name, _ in split.extras]
        out = converted([v.read_value() for v in module.params], list(acts), extras)
        if isinstance(out, dict):
            return {str(k): v for k, v in out.items()}
        if isinstance(out, (list, tuple)):
            return {f"output_{i}": v for i, v in enumerate(out)}
        return {"output_0": out}

    def signature(*args):
        return serve(**dict(zip(keys, args)))

    fn = tf.function(signature, input_signature=tensor_specs, autograph=False)
    module.serve = fn
    directory = os.fspath(directory)
    tf.saved_model.save(module, directory, signatures={"serving_default": fn})
    return names


def _tf_inputs(resolved, specs, names: dict, kw: dict, ids, tf) -> tuple[list, list]:
    """The features' TensorFlow inputs and weights (None where a feature has none) from
    the signature's tensors `kw`; `ids(x, table)` maps a table of raw ids' ids to rows."""
    inputs, weights = [], []
    for name, spec, f in zip(resolved.feature_names, specs, resolved.features):
        n = names[name]
        w = kw.get(n.get("weights", ""))
        table = resolved.table_name(f.table)
        if isinstance(spec, Dense):
            inputs.append(ids(kw[n["ids"]], table))
        elif isinstance(spec, Ragged):
            splits = kw[n["row_splits"]]
            inputs.append(tf.RaggedTensor.from_row_splits(ids(kw[n["values"]], table), splits))
            if w is not None:
                w = tf.RaggedTensor.from_row_splits(w, splits)
        else:
            inputs.append(
                tf.SparseTensor(kw[n["indices"]], ids(kw[n["values"]], table), kw[n["dense_shape"]])
            )
            if w is not None:
                w = tf.SparseTensor(kw[n["indices"]], w, kw[n["dense_shape"]])
        weights.append(w)
    return inputs, weights


def _raw_ids_to_rows(tf, x, sorted_ids, capacity: int):
    """Each raw id of `x` (any shape; int64, or uint64 read as its bits) -> its row: its
    place in `sorted_ids` (int64, ascending), `capacity` (the zero row) where absent."""
    x = tf.bitcast(x, tf.int64) if x.dtype == tf.uint64 else tf.cast(x, tf.int64)
    flat = tf.reshape(x, [-1])
    known = sorted_ids.read_value()
    if known.shape[0] == 0:  # nothing live: every id reads the zero row
        rows = tf.fill(tf.shape(flat), tf.constant(capacity, tf.int64))
    else:
        pos = tf.searchsorted(known, flat, side="left", out_type=tf.int64)
        at = tf.minimum(pos, known.shape[0] - 1)
        rows = tf.where(tf.gather(known, at) == flat, pos, tf.constant(capacity, tf.int64))
    return tf.reshape(rows, tf.shape(x))


def _check_raw_id_dtypes(resolved, specs: list, raw_ids: dict) -> None:
    """A feature of a table of raw ids takes 64-bit ids in the signature: with `Dense()`'s
    default int32 a client's int64 ids would be refused, or cut to 32 bits where a client
    casts to the signature's type, and no raw id over 32 bits could be served."""
    table_name = {id(t): n for t, n in zip(resolved.tables, resolved.table_names)}
    for name, feature, spec in zip(resolved.feature_names, resolved.features, specs):
        table, dtype = table_name[id(feature.table)], np.dtype(spec.dtype)
        if table in raw_ids and not (dtype.kind in "iu" and dtype.itemsize == 8):
            raise ValueError(
                f"input_signature for feature {name}: its table {table} holds raw 64-bit "
                f"ids, so its spec takes int64 or uint64 ids (e.g. Dense(dtype=np.int64), "
                f"Ragged(n, np.int64)), got {dtype}"
            )


def _tables_by_name(resolved, tables: dict) -> tuple[dict, dict]:
    """`{table name: float32 array}` for the feature config's tables, each checked, and
    `{table name: sorted int64 raw ids}` for its tables of raw ids (their arrays the
    `RawIdTable.padded` rows: `[capacity + 1, dim]`, the last rows zero).

    A `QuantizedTable` is decoded here, at export: the SavedModel holds its float32
    values (TensorFlow's lookup sums them in float32, as embedmesh's kernels sum the
    decoded rows), so it serves the same values, without the memory saving (a lookup
    decoding inside TensorFlow's graph is not built)."""
    by_name, raw_ids = {}, {}
    for t, n in zip(resolved.tables, resolved.table_names):
        match = [v for k, v in tables.items() if k is t]
        if not match:
            raise ValueError(f"tables has no array for table {n}")
        value = match[0]
        if (t.id_map is not None) != isinstance(value, RawIdTable):
            raise ValueError(
                f"table {n}: "
                + (
                    f"a table of raw ids (TableConfig.id_map) takes its RawIdTable "
                    f"(embedmesh.raw_id_tables), got {type(value).__name__}"
                    if t.id_map is not None
                    else "a RawIdTable is for a table of raw ids (TableConfig.id_map)"
                )
            )
        if isinstance(value, RawIdTable):
            if (value.capacity, value.dim) != (t.vocabulary_size, t.dim):
                raise ValueError(
                    f"table {n}: its RawIdTable has capacity {value.capacity} and dim "
                    f"{value.dim}, expected {t.vocabulary_size} and {t.dim}"
                )
            raw_ids[n] = np.asarray(value.ids, np.int64)
            rows = value.lookup_table  # a quantized table's: decoded here, as below
            rows = rows.dequantize() if isinstance(rows, QuantizedTable) else rows
            by_name[n] = np.asarray(rows, np.float32)
            continue
        if isinstance(value, QuantizedTable):
            value = value.dequantize()
        arr = np.asarray(value, np.float32)
        if arr.shape != (t.vocabulary_size, t.dim):
            raise ValueError(
                f"table {n} has shape {arr.shape}, expected ({t.vocabulary_size}, {t.dim})"
            )
        by_name[n] = arr
    return by_name, raw_ids


def _signature_specs(resolved, split: _Split, names: dict, tf) -> tuple[list, list]:
    """The signature's `tf.TensorSpec`s, feature by feature, then the other inputs, and
    their input names. A Ragged feature's row splits are int64, a `tf.RaggedTensor`'s
    (`Ragged.splits_dtype` is `export_serving`'s host dtype)."""
    tensor_specs = []
    keys = []
    for name, spec in zip(resolved.feature_names, split.specs):
        n = names[name]
        if isinstance(spec, Dense):
            tensor_specs.append(
                tf.TensorSpec((None, *spec.shape), tf.as_dtype(spec.dtype), n["ids"])
            )
            keys.append(n["ids"])
        elif isinstance(spec, Ragged):
            tensor_specs += [
                tf.TensorSpec((None,), tf.as_dtype(spec.dtype), n["values"]),
                tf.TensorSpec((None,), tf.int64, n["row_splits"]),
            ]
            keys += [n["values"], n["row_splits"]]
        else:
            rank = 1 + len(spec.shape)
            tensor_specs += [
                tf.TensorSpec((None, rank), tf.int64, n["indices"]),
                tf.TensorSpec((None,), tf.as_dtype(spec.dtype), n["values"]),
                tf.TensorSpec((rank,), tf.int64, n["dense_shape"]),
            ]
            keys += [n["indices"], n["values"], n["dense_shape"]]
        if "weights" in n:
            tensor_specs.append(tf.TensorSpec((None,), tf.float32, n["weights"]))
            keys.append(n["weights"])
    for name, spec in split.extras:
        key = names[name]["array"]
        tensor_specs.append(tf.TensorSpec((None, *spec.shape), tf.as_dtype(spec.dtype), key))
        keys.append(key)
    return tensor_specs, keys
