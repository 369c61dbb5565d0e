"""The serving lookup's side of tables of raw 64-bit ids (`TableConfig.id_map`).

`serving_embedding_lookup`, `export_serving`/`load_serving` take a table of raw ids as its
`RawIdTable` (`embedmesh.layout.by_id`: the live ids sorted, their rows, zero rows after
them) and raw int64 (or uint64, read as their two's complement bits) ids in its features'
inputs. Each id is found by a binary search in the sorted ids (`np.searchsorted`, on the
host; traced with x64 on, `jnp.searchsorted`); an id the table does not hold reads a
**zero row**, as an id pending admission reads in training: it counts in a mean's or
sqrtn's weights like any other id. Everything else (combiners, weights, sequence
features, `output_shape`, TensorFlow's pruning of weights <= 0) is the static tables':
the ids become positions in `RawIdTable.padded` (`[capacity + 1, dim]`) and the ordinary
kernels and fast path run on it, under a served config of `vocabulary_size + 1` rows. A
negative raw id is an id like any other (never pruned).

`export_serving` looks a signature input's raw ids up on the host, before the program
(`HostMapped` inside it); `ServingFunction.apply_increment` swaps in updated tables.
"""

from __future__ import annotations

import dataclasses
import threading

from embedmesh.layout.by_id import RawIdTable, RawIdUpdate, apply_increment

__all__ = ["RawIdTable", "RawIdUpdate", "apply_increment"]


# ---------------------------------------------------------------------------
# The lookup's side: raw ids -> positions in `RawIdTable.padded`

_SERVED_CONFIGS: dict = {}  # id(resolved) -> (resolved, served resolved, raw feature indices)
_LOCK = threading.Lock()


def raw_features(resolved) -> tuple:
    """The indices of the features of `resolved` whose table is a table of raw ids."""
    return tuple(
        i for i, f in enumerate(resolved.features) if getattr(f.table, "id_map", None) is not None
    )


def _served_resolved(resolved):
    """`resolved` with each table of raw ids replaced by a plain table of
    `vocabulary_size + 1` rows (the `RawIdTable.padded` it is served from), and the
    features of such tables, by index (cached per resolved config)."""
    hit = _SERVED_CONFIGS.get(id(resolved))
    if hit is not None and hit[0] is resolved:
        return hit[1], hit[2]
    raw = raw_features(resolved)
    served = {}
    for t in resolved.tables:
        if getattr(t, "id_map", None) is not None:
            v = t.vocabulary_size + 1  # the rows, then a zero row for unknown ids
            served[id(t)] = dataclasses.replace(t, vocabulary_size=v, id_map=None)
    features = tuple(
        dataclasses.replace(f, table=served[id(f.table)]) if id(f.table) in served else f
        for f in resolved.features
    )
    tables = tuple(served.get(id(t), t) for t in resolved.tables)
    out = dataclasses.replace(resolved, features=features, tables=tables)
    with _LOCK:
        if len(_SERVED_CONFIGS) > 64:
            _SERVED_CONFIGS.clear()
        _SERVED_CONFIGS[id(resolved)] = (resolved, out, raw)
    return out, raw


class HostMapped:
    """Inside an exported program (`export_serving`): a table of raw ids whose inputs
    the loaded function turns into positions on the host; `padded` the traced array."""

    def __init__(self, padded):
        self.padded = padded  # an array, or a QuantizedTable of its encoded rows
        self.shape = padded.shape
        self.dtype = getattr(padded, "dtype", None)


# export_serving's trace: {id(values tracer): leaf index}, and the uses found
_EXPORT = threading.local()


def _values(inp):
    from embedmesh.inputs import input_kind

    return inp if input_kind(inp) == "dense" else inp.values


def _with_values(inp, values):
    from embedmesh.inputs import RaggedTensor, SparseTensor, convert_input, input_kind

    kind = input_kind(inp)
    if kind == "dense":
        return values
    inp = convert_input(inp)  # (TensorFlow's tensors, duck typed, as ours)
    if kind == "sparse":
        return SparseTensor(inp.indices, values, tuple(inp.dense_shape))
    return RaggedTensor(values, inp.row_splits)


def _record_use(values, key) -> bool:
    """Under `export_serving`'s trace: record that the input leaf whose ids are `values`
    is looked up in table `key`; whether `values` is such a leaf."""
    ctx = getattr(_EXPORT, "ctx", None)
    if ctx is None:
        return False
    leaf = ctx["leaves"].get(id(values))
    if leaf is None:
        return False
    ctx["uses"].setdefault(leaf, set()).add(key)
    return True


def served_request(resolved, flat_inputs: list, tables: dict):
    """`(served resolved, flat inputs, tables)` for a request with tables of raw ids:
    each such feature's raw ids turned into positions in its `RawIdTable.padded` (a binary
    search on the host; traced: `jnp.searchsorted`, x64 on), its table replaced by that
    array under the served config (`_served_resolved`)."""
    from embedmesh.inputs import is_concrete

    served, raw = _served_resolved(resolved)
    tables = dict(tables)
    flat = list(flat_inputs)
    # static features of an export's trace: note their leaves (a leaf is one table's)
    if getattr(_EXPORT, "ctx", None) is not None:
        for i, (f, inp) in enumerate(zip(resolved.features, flat)):
            if inp is not None and i not in raw:
                _record_use(_values(inp), ("static", id(f.table)))
    for i in raw:
        inp = flat[i]
        cfg = resolved.features[i].table
        scfg = served.features[i].table
        if inp is None:
            continue
        name = resolved.feature_names[i]
        table = tables.get(cfg)
        if isinstance(table, HostMapped):  # export_serving: the host gives positions
            if not _record_use(_values(inp), ("raw", id(cfg))):
                raise ValueError(
                    f"feature {name}: inside export_serving, the ids of a table of raw ids "
                    f"({resolved.table_name(cfg)}) must be an input of the signature, passed "
                    f"to serving_embedding_lookup as it is (the loaded function looks them "
                    f"up on the host, before the program)"
                )
            tables[scfg] = table.padded
            continue
        if not isinstance(table, RawIdTable):
            if table is None:
                continue  # the lookup names the missing table
            raise ValueError(
                f"feature {name}: table {resolved.table_name(cfg)} is a table of raw ids "
                f"(id_map={cfg.id_map!r}); serve it from its RawIdTable (the live ids and "
                f"their rows: MeshEmbedding.embedding_tables, "
                f"embedmesh.raw_id_tables), not a {type(table).__name__}"
            )
        if table.capacity != cfg.vocabulary_size or table.dim != cfg.dim:
            raise ValueError(
                f"tables: the RawIdTable of {resolved.table_name(cfg)} has capacity "
                f"{table.capacity} and dim {table.dim}, expected (vocabulary_size, dim) = "
                f"({cfg.vocabulary_size}, {cfg.dim})"
            )
        values = _values(inp)
        if is_concrete(values):
            pos = table.positions(values)
        else:
            pos = _traced_positions(name, table, values)
        flat[i] = _with_values(inp, pos)
        tables[scfg] = table.lookup_table  # its rows (a quantized table: its QuantizedTable)
    return served, flat, tables


def _traced_positions(name: str, table: RawIdTable, values):
    import jax.numpy as jnp
    from jax import lax

    if values.dtype.itemsize != 8:
        raise ValueError(
            f"feature {name}: traced raw ids of dtype {values.dtype}: a table of raw ids "
            f"takes 64-bit ids, which a traced program has only with jax_enable_x64 on "
            f"(export_serving looks them up on the host instead)"
        )
    ids = jnp.asarray(table.ids)
    x = lax.bitcast_convert_type(values, jnp.int64) if values.dtype == jnp.uint64 else values
    n = table.ids.shape[0]
    if n == 0:
        return jnp.full(x.shape, table.capacity, jnp.int32)
    pos = jnp.searchsorted(ids, x)
    found = ids[jnp.minimum(pos, n - 1)] == x
    return jnp.where(found, pos, table.capacity).astype(jnp.int32)
