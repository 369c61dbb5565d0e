"""Quantized serving tables: `quantize_tables` and `QuantizedTable`.

A `QuantizedTable` stands in for a float32 `[vocabulary_size, dim]` table in the
`tables` dict of `serving_embedding_lookup`, `export_serving` / `load_serving` and
`export_saved_model`. Lookups dequantize each row inside the bag kernel and sum in
float32 (the C++ kernels, the numba and numpy fallbacks, and the traced jax path all
decode the same way); outputs are float32. The kinds (`dtype=` of `quantize_tables`):

- ``"int8"``: FBGEMM's fused 8-bit row-wise layout (`FloatToFused8BitRowwiseQuantized`,
  what torch's `embedding_bag_byte_rowwise_offsets` reads): each row is `dim` unsigned
  bytes `q`, then its float32 `scale`, then its float32 `bias` (little-endian), one
  `uint8 [vocabulary_size, dim + 8]` array. `bias = min(row)`, `scale = (max(row) -
  min(row)) / 255` (float32), `q = round((x - bias) / scale)` (float64, clipped to [0,
  255]); a constant row has scale 0 and is exact. Decoded value `x_hat = q * scale +
  bias`, computed in float32 (a product, then a sum: no FMA on the host; the traced
  path leaves that to XLA). Error bound, per element: `|x - x_hat| <= scale / 2` for
  the exactly computed `q * scale + bias`, plus the float32 rounding of that
  expression (at most `2**-23 * (|bias| + 255 * scale)`). The decode runs in float32,
  so a row whose range (`max - min`) or decoded values overflow float32 cannot meet the
  bound: it is a ValueError naming its row, column and value. dim + 8 bytes a row.
- ``"fp16"`` / ``"bf16"``: the rows rounded to nearest-even float16 / bfloat16 (`[V,
  dim]` of that dtype): `|x - x_hat| <= 2**-11 |x|` (float16, normal range; below
  2**-14 the absolute error is at most 2**-25; a value beyond float16's range is a
  ValueError) and `<= 2**-8 |x|` (bfloat16; a value beyond its largest finite, about
  3.39e38, is a ValueError too). 2 * dim bytes a row. A bfloat16 or float16 table (one
  trained in that dtype) quantizes as its float32 values, which it holds exactly.
- ``"codes"``: for a table whose `TableConfig.quantization_config` has at most 256
  buckets: one byte a value, the index of its level, and a table of the `num_buckets`
  level values (float32, ascending); a value decodes to `values[code]`. Both come from
  training's own formula (`floor((clip(x, lower, upper) - lower) / quantum + 0.5) *
  quantum + lower`, `embedmesh.device.ops.reference.quantize`) run by XLA on the CPU,
  so a served row is bit for bit the row training's lookup saw on the CPU. (Not numpy's
  float32 arithmetic: XLA's CPU code contracts `k * quantum + lower` into one FMA and
  divides by the quantum its own way, so numpy's levels differ in the last bit and a
  value on a half-way point can land one bucket apart.) `uint8 [V, dim]` + `float32
  [num_buckets]`: dim bytes a row.

TensorFlow: `tf.tpu.experimental.embedding.serving_embedding_lookup`
(`tensorflow/python/tpu/tpu_embedding_for_serving.py`, `cpu_embedding_lookup`,
read at commit 0595e766c598) never reads `TableConfig.quantization_config`: it looks
rows up with `embedding_lookup_v2`, `embedding_lookup_sparse_v2` /
`safe_embedding_lookup_sparse_v2` and `embedding_lookup_ragged` on the float table
variables as they are, so TensorFlow serves the unquantized rows. embedmesh's
`serving_embedding_lookup` does the same for plain float tables; the `"codes"` kind
here is the way to serve the values training's lookup saw (and a 4x smaller table).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from embedmesh.config import is_float_table_dtype
from embedmesh.layout.by_id import RawIdTable

__all__ = [
    "KINDS",
    "QuantizedRawIdTable",
    "QuantizedTable",
    "load_tables",
    "quantize_table",
    "quantize_tables",
]

KINDS = ("int8", "fp16", "bf16", "codes")
_ALIASES = {
    "int8": "int8",
    "uint8": "int8",
    "int8_rowwise": "int8",
    "fp16": "fp16",
    "float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "codes": "codes",
    "bucket_codes": "codes",
    "fp32": None,
    "float32": None,
}
# the C++ kernels' row format codes (EmServingBagQ in serving.h)
FORMAT_CODES = {"fp16": 1, "bf16": 2, "int8": 3, "codes": 4}
_STORAGE = {"int8": np.uint8, "fp16": np.float16, "bf16": ml_dtypes.bfloat16, "codes": np.uint8}
# a half kind's storage type and largest finite value: a value beyond it is refused
_HALF = {
    "fp16": (np.float16, float(np.finfo(np.float16).max)),
    "bf16": (ml_dtypes.bfloat16, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
}
_HALF_HINT = {"fp16": "use 'bf16' or 'int8'", "bf16": "keep the table float32"}
MAX_CODE_BUCKETS = 256


@jax.tree_util.register_pytree_node_class
class QuantizedTable:
    """A quantized serving table (see the module's docstring for the kinds and layouts).

    Attributes: `kind` ("int8", "fp16", "bf16" or "codes"), `data` (the rows: `uint8
    [V, dim + 8]` for int8, `float16` / `bfloat16 [V, dim]`, `uint8 [V, dim]` codes),
    `values` (codes only: the float32 value of each code), `dim`; `shape` is the float
    table's `(vocabulary_size, dim)`. A jax pytree (its arrays are the leaves), so it
    goes through `jax.jit` and `jax.export` as a table argument.
    """

    __slots__ = ("kind", "data", "values", "dim")

    def __init__(self, kind: str, data, dim: int, values=None):
        if kind not in KINDS:
            raise ValueError(f"unknown quantized table kind {kind!r}: expected one of {KINDS}")
        self.kind, self.data, self.dim, self.values = kind, data, int(dim), values

    # -- jax pytree
    def tree_flatten(self):
        leaves = (self.data,) if self.values is None else (self.data, self.values)
        return leaves, (self.kind, self.dim)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        kind, dim = aux
        return cls(kind, leaves[0], dim, leaves[1] if len(leaves) > 1 else None)

    def arrays(self) -> list:
        """Its arrays in order (what `export_serving` saves): data, then values (codes)."""
        return self.tree_flatten()[0]

    def meta(self) -> dict:
        """What rebuilds it from `arrays()` (with `from_arrays`): JSON-able."""
        return {"kind": self.kind, "dim": self.dim}

    @classmethod
    def from_arrays(cls, meta: dict, arrays) -> QuantizedTable:
        return cls.tree_unflatten((meta["kind"], meta["dim"]), list(arrays))

    # -- what the lookup reads
    @property
    def shape(self) -> tuple:
        return (int(self.data.shape[0]), self.dim)

    @property
    def vocabulary_size(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in self.arrays())

    @property
    def bytes_per_row(self) -> int:
        return int(self.data.shape[1]) * np.dtype(self.data.dtype).itemsize

    def __repr__(self) -> str:
        return f"QuantizedTable({self.kind}, shape={self.shape}, {self.nbytes} bytes)"

    def host(self) -> QuantizedTable:
        """The same table with numpy arrays (C-contiguous rows), for the host kernels."""
        arrays = [np.ascontiguousarray(np.asarray(a)) for a in self.arrays()]
        if all(a is b for a, b in zip(arrays, self.arrays())):
            return self
        return QuantizedTable.tree_unflatten((self.kind, self.dim), arrays)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Decoded float32 rows `[len(ids), dim]` for ids in range (numpy; the numpy and
        numba backends' form, the same values as the C++ kernels, bit for bit)."""
        data = np.asarray(self.data)
        got = np.take(data, ids, axis=0)
        return _decode_numpy(self.kind, got, self.dim, self.values)

    def dequantize(self) -> np.ndarray:
        """The whole table decoded: float32 `[vocabulary_size, dim]`."""
        return _decode_numpy(self.kind, np.asarray(self.data), self.dim, self.values)

    def take(self, ids) -> jax.Array:
        """Decoded float32 rows for jax ids (the traced path): ids outside the table
        read as zero rows, as the float tables' traced lookup has them."""
        data = jnp.asarray(self.data)
        ids = jnp.asarray(ids).astype(jnp.int32)
        valid = (ids >= 0) & (ids < data.shape[0])
        got = jnp.take(data, jnp.where(valid, ids, 0), axis=0)
        if self.kind in ("fp16", "bf16"):
            rows = got.astype(jnp.float32)
        elif self.kind == "codes":
            rows = jnp.take(jnp.asarray(self.values), got.astype(jnp.int32), axis=0)
        else:
            q = got[:, : self.dim].astype(jnp.float32)
            sb = jax.lax.bitcast_convert_type(
                got[:, self.dim : self.dim + 8].reshape(got.shape[0], 2, 4), jnp.float32
            )
            rows = q * sb[:, 0:1] + sb[:, 1:2]
        return jnp.where(valid[:, None], rows, jnp.float32(0))


def _decode_numpy(kind: str, got: np.ndarray, dim: int, values) -> np.ndarray:
    """Rows of `data` decoded to float32 (float32 arithmetic: q * scale, then + bias)."""
    if kind in ("fp16", "bf16"):
        return got.astype(np.float32)
    if kind == "codes":
        return np.asarray(values, np.float32)[got]
    q = got[:, :dim].astype(np.float32)
    sb = np.ascontiguousarray(got[:, dim : dim + 8]).view(np.float32)  # [n, 2]
    out = q * sb[:, 0:1]
    out += sb[:, 1:2]
    return out


# ---------------------------------------------------------------------------
# Quantizing


def _kind_of(dtype, where: str) -> str | None:
    """The kind a `dtype=` value names (None: left float32); ValueError naming `where`."""
    if dtype is None:
        return None
    key = dtype if isinstance(dtype, str) else None
    if key is None:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = None
    if key is None or key.lower() not in _ALIASES:
        raise ValueError(
            f"{where}: unknown serving dtype {dtype!r}: expected one of "
            f"'int8', 'fp16', 'bf16', 'codes' or 'float32'"
        )
    return _ALIASES[key.lower()]


def quantize_table(table, dtype, *, config=None, name: str = "table") -> QuantizedTable | Any:
    """One `[vocabulary_size, dim]` table quantized to `dtype` ("int8", "fp16", "bf16",
    "codes", or "float32" / None: returned as a float32 numpy array). "codes" needs
    `config`, the table's `TableConfig`, with a `quantization_config` of at most 256
    buckets. Errors are ValueErrors naming the table (`name`)."""
    kind = _kind_of(dtype, f"table {name}")
    if isinstance(table, RawIdTable):
        return _quantized_raw_ids(table, kind, name)
    x = np.asarray(table)
    if x.ndim != 2:
        raise ValueError(f"table {name}: expected a [vocabulary_size, dim] array, got {x.shape}")
    if not is_float_table_dtype(x.dtype):
        raise ValueError(
            f"table {name}: expected a float table (float32, bfloat16, float16 or float64), "
            f"got {x.dtype}"
        )
    if kind is None:  # kept as it is, in float32
        return np.ascontiguousarray(x, dtype=np.float32)
    x = _as_float32(x, name)
    if kind in ("fp16", "bf16"):
        storage, top = _HALF[kind]
        _refuse_beyond(
            x, top, name, f"{np.dtype(storage).name}'s range (+-{top})", _HALF_HINT[kind]
        )
        return QuantizedTable(kind, x.astype(storage), x.shape[1])
    if kind == "int8":
        return QuantizedTable("int8", _rowwise_int8(x, name), x.shape[1])
    return _codes(x, config, name)


class QuantizedRawIdTable(RawIdTable):
    """A table of raw ids served from quantized rows (`quantize_table(raw_id_table,
    kind)`, kind "int8", "fp16" or "bf16"): `ids`, `capacity` and `step` as its
    `RawIdTable`'s; `padded` (and `rows`, its first `len(ids)` rows) hold the rows encoded
    as a `QuantizedTable` of that `kind` holds them (`quantized`, what the lookups read;
    `get` decodes). The zero rows of unknown ids encode to zero bytes, which decode to
    zeros in every kind ("codes" cannot: its code 0 is the lowest bucket's value, so it is
    refused). `apply` encodes an update's rows the same way, each row alone (every kind
    encodes a row independently of the others), so applying increments to the quantized
    table gives the quantized table of the increments applied in float32, bit for bit."""

    kind: str

    @classmethod
    def _make(cls, ids, padded, capacity, step, kind: str, dim: int) -> QuantizedRawIdTable:
        obj = cls._of_sorted(ids, padded, capacity, step)
        object.__setattr__(obj, "kind", kind)
        object.__setattr__(obj, "_dim", int(dim))
        return obj

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def quantized(self) -> QuantizedTable:
        """The encoded rows as a `QuantizedTable` (`[capacity + 1, dim]`)."""
        return QuantizedTable(self.kind, self.padded, self._dim)

    @property
    def lookup_table(self) -> QuantizedTable:
        return self.quantized

    def get(self, raw_ids) -> np.ndarray:
        pos = self.positions(raw_ids)
        got = _decode_numpy(self.kind, self.padded[pos.reshape(-1)], self._dim, None)
        return got.reshape(pos.shape + (self._dim,))

    def _stored_rows(self, rows: np.ndarray) -> np.ndarray:
        return quantize_table(rows, self.kind, name="of the update").data

    def _like(self, ids, padded, step) -> QuantizedRawIdTable:
        return QuantizedRawIdTable._make(ids, padded, self.capacity, step, self.kind, self._dim)

    def __repr__(self) -> str:
        return (
            f"QuantizedRawIdTable({len(self)} ids of {self.capacity}, dim={self.dim}, "
            f"{self.kind}, step={self.step})"
        )


def _quantized_raw_ids(table: RawIdTable, kind: str | None, name: str) -> RawIdTable:
    """A table of raw ids quantized to `kind` (None: as it is, float32 rows)."""
    if isinstance(table, QuantizedRawIdTable):
        if kind in (None, table.kind):
            return table
        raise ValueError(
            f"table {name}: already quantized ({table.kind}); quantize its float32 "
            f"RawIdTable to {kind} instead"
        )
    if kind is None:
        return table
    if kind == "codes":
        raise ValueError(
            f"table {name}: a table of raw ids cannot be served as bucket codes: an unknown "
            f"id reads a zero row, which no code holds; use 'int8', 'fp16' or 'bf16'"
        )
    q = quantize_table(np.asarray(table.padded), kind, name=name)
    return QuantizedRawIdTable._make(table.ids, q.data, table.capacity, table.step, kind, q.dim)


def _as_float32(x: np.ndarray, name: str) -> np.ndarray:
    """`x` as C-contiguous float32 to quantize (exact from bfloat16 / float16); a
    non-finite value, or a float64 one beyond float32's range, is a ValueError naming its
    row and column."""
    finite = np.isfinite(x.astype(np.float32, copy=False) if x.dtype.kind == "V" else x)
    if not finite.all():
        r, c = np.argwhere(~finite)[0]
        raise ValueError(
            f"table {name}: cannot quantize a non-finite value ({x[r, c]!s} at row {r}, column {c})"
        )
    out = np.ascontiguousarray(x, dtype=np.float32)
    if x.dtype == np.float64:
        _refuse_beyond(x, float(np.finfo(np.float32).max), name, "float32's range", "")
    return out


def _refuse_beyond(x: np.ndarray, top: float, name: str, what: str, hint: str) -> None:
    """A ValueError naming the first value of `x` whose magnitude is above `top`."""
    big = np.abs(x) > top
    if big.any():
        r, c = np.argwhere(big)[0]
        raise ValueError(
            f"table {name}: value {x[r, c]!s} at row {r}, column {c} is outside {what}"
            + (f"; {hint}" if hint else "")
        )


def _rowwise_int8(x: np.ndarray, name: str, chunk: int = 1 << 16) -> np.ndarray:
    """FBGEMM's fused 8-bit row-wise rows of float32 `x` (see the module's docstring); a
    row its float32 decode cannot serve within the bound is refused (`_refuse_int8`)."""
    vocab, dim = x.shape
    out = np.empty((vocab, dim + 8), np.uint8)
    for lo in range(0, vocab, chunk):
        rows = x[lo : lo + chunk]
        if dim == 0:
            mn = np.zeros(rows.shape[0], np.float32)
            mx = mn
        else:
            mn, mx = rows.min(axis=1), rows.max(axis=1)
        with np.errstate(over="ignore"):  # an overflowing range is refused below
            scale = ((mx - mn) / np.float32(255)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)
        q = np.rint((rows.astype(np.float64) - mn.astype(np.float64)[:, None]) / safe[:, None])
        q = np.clip(q, 0, 255)
        q[scale == 0] = 0
        part = out[lo : lo + chunk]
        part[:, :dim] = q.astype(np.uint8)
        part[:, dim:] = np.stack([scale, mn.astype(np.float32)], axis=1).view(np.uint8)
        _refuse_int8(rows, part, lo, scale, mn, name)
    return out


def _refuse_int8(rows: np.ndarray, part: np.ndarray, lo: int, scale, mn, name: str) -> None:
    """A ValueError for the first of `rows` (table rows `lo`...) whose encoded row `part`
    does not decode within the stated bound. The decode `q * scale + bias` runs in
    float32, so a row whose range (max - min) overflows float32 (scale inf: every value
    would serve NaN), or whose decoded values do, cannot be served. Only rows near
    float32's limit are decoded here (`|bias| + 255 * scale >= 2**127`); below it the
    bound holds by construction."""
    reach = np.abs(mn.astype(np.float64)) + 255.0 * scale.astype(np.float64)
    for i in np.flatnonzero(~(reach < 2.0**127)):
        row, dim = rows[i].astype(np.float64), rows.shape[1]
        if not np.isfinite(scale[i]):
            c = int(np.argmax(row))
            why = f"the row's range ({rows[i].min()!s} to {rows[i].max()!s}) overflows float32"
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                got = _decode_numpy("int8", part[i : i + 1], dim, None)[0].astype(np.float64)
                s64, b64 = np.float64(scale[i]), np.float64(mn[i])
                bound = s64 / 2 + 2.0**-23 * (abs(b64) + 255 * s64)
                bad = ~(np.abs(got - row) <= bound)
            if not bad.any():
                continue
            c = int(np.flatnonzero(bad)[0])
            why = f"its float32 decode gives {np.float32(got[c])!s}"
        raise ValueError(
            f"table {name}: value {rows[i, c]!s} at row {lo + i}, column {c} cannot be "
            f"encoded as int8 within its bound: {why}; keep the table float32 or use 'bf16'"
        )


def _codes(x: np.ndarray, config, name: str) -> QuantizedTable:
    """Bucket codes of training's `QuantizationConfig` formula, and their values."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise ValueError(
            f"table {name}: dtype 'codes' needs a TableConfig with a quantization_config "
            f"(the buckets training's lookups used); this table has none"
        )
    buckets = int(qc.num_buckets)
    if buckets > MAX_CODE_BUCKETS:
        raise ValueError(
            f"table {name}: dtype 'codes' stores one byte a value, at most "
            f"{MAX_CODE_BUCKETS} buckets; its quantization_config has {buckets} "
            f"(use 'int8', 'fp16' or 'bf16')"
        )
    quantization = (buckets, float(qc.lower), float(qc.upper))
    values = _code_values(*quantization)
    seen = _on_cpu(x, quantization)  # what training's formula gives each value
    codes = np.searchsorted(values, seen).clip(0, buckets - 1).astype(np.uint8)
    if not np.array_equal(values[codes], seen):  # pragma: no cover - XLA changed its mind
        raise ValueError(
            f"table {name}: training's formula gave values outside its {buckets} levels; "
            f"cannot serve it as codes (use 'int8', 'fp16' or 'bf16')"
        )
    return QuantizedTable("codes", codes, x.shape[1], values)


def _code_values(buckets: int, lower: float, upper: float) -> np.ndarray:
    """The float32 value of each bucket, ascending, as training's formula computes it on
    XLA's CPU backend (`k * quantum + lower`: one FMA there), applied to a value in the
    middle of each bucket."""
    lo, hi = np.float32(lower), np.float32(upper)
    quantum = (hi - lo) / np.float32(buckets - 1)
    inside = (np.arange(buckets, dtype=np.float32) * quantum + lo).astype(np.float32)
    values = _on_cpu(inside, (buckets, lower, upper))
    if not (np.diff(values) > 0).all():  # pragma: no cover - levels closer than float32
        raise ValueError(f"{buckets} buckets in [{lower}, {upper}] are not distinct in float32")
    return values


def _on_cpu(x: np.ndarray, quantization: tuple, chunk: int = 1 << 20) -> np.ndarray:
    """Training's formula (`embedmesh.device.ops.reference.quantize`, the same program;
    serving does not import the device layer) over `x`, by XLA on the CPU, in chunks of
    one compiled shape. Bucket indices are not computed with numpy: XLA's CPU code
    divides by the quantum another way (a half-way value can land one bucket apart)."""
    cpu = jax.local_devices(backend="cpu")[0]
    flat = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.empty_like(flat)
    size = min(chunk, max(flat.size, 1))
    with jax.default_device(cpu):
        for start in range(0, flat.size, size):
            part = flat[start : start + size]
            padded = np.zeros(size, np.float32)
            padded[: part.size] = part
            got = np.asarray(_training_formula(jnp.asarray(padded), quantization))
            out[start : start + part.size] = got[: part.size]
    return out.reshape(x.shape)


@functools.partial(jax.jit, static_argnums=1)
def _training_formula(rows, quantization):
    buckets, lower, upper = quantization
    lo, hi = jnp.float32(lower), jnp.float32(upper)
    quantum = (hi - lo) / jnp.float32(buckets - 1)
    x = jnp.clip(rows.astype(jnp.float32), lo, hi)
    return jnp.floor((x - lo) / quantum + jnp.float32(0.5)) * quantum + lo


def quantize_tables(tables: dict, dtype, *, feature_config: Any = None) -> dict:
    """`{TableConfig: array}` -> the same keys with quantized tables (`QuantizedTable`s).

    `dtype`: one of "int8", "fp16", "bf16", "codes" (see this module's docstring: the
    layouts and error bounds) for every table, "float32" / None to keep them float32,
    or a dict from `TableConfig` or table name to one of those (tables it leaves out
    stay float32). "codes" needs the table's `quantization_config` with at most 256
    buckets. `feature_config` (optional) names the tables as it resolves them (else
    `TableConfig.name`, else `table_<i>`), for the errors: an unknown dtype, too many
    buckets, a table without a quantization config, non-finite values, a value beyond
    float16's or bfloat16's range, an int8 row whose range overflows float32 are
    ValueErrors naming the table (and the row, column and value). Tables may be float32,
    bfloat16, float16 (as trained in those dtypes) or float64."""
    configs = list(tables)
    names = _names(configs, feature_config)
    _check_dtype_keys(dtype, configs, names)
    return {
        cfg: quantize_table(
            tables[cfg], _dtype_for(dtype, cfg, names[id(cfg)]), config=cfg, name=names[id(cfg)]
        )
        for cfg in configs
    }


def _check_dtype_keys(dtype, configs: list, names: dict) -> None:
    """A per-table `dtype` dict names only tables there are (a config or a name)."""
    if isinstance(dtype, dict):
        known = set(names.values())
        for key in dtype:
            if not any(key is c or key == c for c in configs) and key not in known:
                raise ValueError(f"dtype names table {key!r}, which is not in tables")


def _dtype_for(dtype, cfg, name: str):
    """The dtype `dtype` (one for all, or a per-table dict) gives table `cfg` / `name`."""
    if not isinstance(dtype, dict):
        return dtype
    if _hashable(cfg) and cfg in dtype:
        return dtype[cfg]
    return dtype.get(name)


def load_tables(
    source, step: int | None = None, *, feature_config: Any = None, item=None, dtype=None
) -> dict:
    """`embedmesh.checkpoint.load_tables` with `dtype=`: a checkpoint's parameters for
    serving, quantized (`dtype` as `quantize_tables` takes it; None: float32, as the
    checkpoint's function returns them). With a `feature_config` whose tables are all
    named, the tables are read and quantized one at a time, so the float32 tables are
    never all in memory at once (one table at most, beside the quantized ones); else
    they are read together, then quantized. Quantizing lives here, in the serving layer:
    the checkpoint layer does not import serving."""
    from embedmesh.checkpoint import loading
    from embedmesh.config import FeatureConfig, resolve_feature_config

    kw = {} if item is None else {"item": item}
    if dtype is None:
        return loading.load_tables(source, step, feature_config=feature_config, **kw)
    if feature_config is None or any(
        t.name is None for t in resolve_feature_config(feature_config).tables
    ):
        tables = loading.load_tables(source, step, feature_config=feature_config, **kw)
        return quantize_tables(tables, dtype, feature_config=feature_config)
    resolved = resolve_feature_config(feature_config)
    names = {id(t): n for t, n in zip(resolved.tables, resolved.table_names)}
    _check_dtype_keys(dtype, list(resolved.tables), names)
    out = {}
    for cfg, name in zip(resolved.tables, resolved.table_names):
        one = loading.load_tables(source, step, feature_config={name: FeatureConfig(cfg)}, **kw)
        out[cfg] = quantize_table(one[cfg], _dtype_for(dtype, cfg, name), config=cfg, name=name)
        del one
    return out


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _names(configs: list, feature_config) -> dict:
    """id(TableConfig) -> its name (the feature config's, its own, else `table_<i>`)."""
    names = {}
    if feature_config is not None:
        from embedmesh.config import resolve_feature_config

        resolved = resolve_feature_config(feature_config)
        names = {id(t): n for t, n in zip(resolved.tables, resolved.table_names)}
    return {
        id(c): names.get(id(c)) or getattr(c, "name", None) or f"table_{i}"
        for i, c in enumerate(configs)
    }


def is_quantized(table) -> bool:
    """Whether `table` is a `QuantizedTable`."""
    return isinstance(table, QuantizedTable)
