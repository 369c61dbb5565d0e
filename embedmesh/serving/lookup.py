"""`serving_embedding_lookup`: TensorFlow's CPU serving lookup, in JAX.

Semantics follow `tf.tpu.experimental.embedding.serving_embedding_lookup`
exactly (see docs/inputs.md). Every feature's output rows come
from `inputs.feature_layout`, the rules training follows too:

    out[row] = sum_k weight_k * table[id_k]          (kept entries only)
    out[row] /= sum_k w_k  (mean)  or  sqrt(sum_k w_k^2)  (sqrtn);  0/0 = 0

A request on concrete inputs whose features are all common cases (ragged, 2-D sparse or
dense int32/int64 numpy ids, finite float32 weights or none, float32 numpy tables, or
int8, fp16 or codes tables for ragged and sparse ids, no sequence features or
output_shape) runs in one call of the compiled request rules
(`embedmesh.serving.request`: `_request.serve` for a model configured as one dict of
features under str keys asked with a dict and no weights, `_request.lookup` for any other
structure): its features checked and handed to the C++ runner, its outputs taken,
wrapped as jax arrays (aliasing their buffers) before the kernels fill them, and packed.
Anything else, and any error there, takes the general host path below, which raises
TensorFlow's errors.

The general host path serves every concrete request, for every output kind (plain
lookups, combined bags, sequences): the feature becomes an `inputs.Csr`
(`to_csr`, the form host preprocessing takes too; TensorFlow's pruning left to
the kernel's one pass) and a host kernel (`embedmesh.serving.kernels`) runs
over the table's memory, range checking ids (a `ValueError` naming the
feature). A call checks every feature and takes its output buffer first, then
runs the kernels back to back (2-D sparse indices are checked when the kernels run:
`kernels.prepare_sparse_bag_combine`). The C++ kernels split
every feature into chunks of whole bags over threads (`set_host_threads`,
`EMBEDMESH_SERVING_THREADS`), each feature handed to the runner as soon as it is
prepared (`native_backend.NativeRequest`); other backends spread whole features over Python
threads. Inside `jax.jit`/`jax.export` (traced inputs)
`_traced_lookup` builds per-entry rows from the same layout with masks at
static shapes and computes with jax.numpy; ids out of range cannot raise there
and read as zero rows.

Quantized tables (`embedmesh.serving.quantized.QuantizedTable`: int8 rows, fp16, bf16,
bucket codes): their rows are decoded inside the bag kernels (a plain lookup is one
bag a row) and summed in float32; traced, `QuantizedTable.take` decodes the gathered
rows. Outputs are float32.

Tables of raw ids (`TableConfig.id_map`) are given as their `RawIdTable`: before anything
else, `raw_ids.served_request` turns their features' raw ids into positions in the
table's `padded` rows (a binary search in its sorted ids; unknown ids: the zero row at
`capacity`) under a served config of `vocabulary_size + 1` rows, and the request runs as
any other (compiled rules included). Requests without such a table pay one dict lookup.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - imported now, not in the first call's pool
import itertools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh import _compat, _runtime
from embedmesh.config import FeatureConfig, resolve_feature_config
from embedmesh.inputs import (
    feature_layout,
    flatten_inputs_like,
    id_range_error,
    input_kind,
    is_concrete,
    sparse_index_error,
    to_csr,
    unflatten_flat_dict,
    validate_structure,
)
from embedmesh.serving import (
    kernels,
    native,  # noqa: F401 - its loader, imported now
    pool,
    raw_ids,
    settings,
)
from embedmesh.serving import request as _request
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.quantized import QuantizedTable
from embedmesh.serving.settings import set_host_threads, set_numpy_outputs

__all__ = ["serving_embedding_lookup", "set_host_threads", "set_numpy_outputs"]


# ---------------------------------------------------------------------------
# The host path (concrete inputs)


def _prepare_host(name: str, feature: FeatureConfig, inp, weight, table) -> _named:
    """Check one feature's input now and take its output buffer; return a function
    running its host kernel.

    The input becomes bags (`to_csr`: ragged row_splits, sparse row offsets,
    sequence positions; nothing per entry for dense ids), pruning left to the
    kernel, whose one pass also range checks the ids: a plain lookup is a
    checked gather, anything else a bag combine (sequences: one id a bag).
    """
    layout = feature_layout(name, feature, inp, weight)  # TensorFlow's errors first
    if layout.kind == "combined" and input_kind(inp) == "sparse":
        run = _prepare_sparse(name, feature, inp, weight, table, layout)
        if run is not None:
            return run
    csr = to_csr(name, feature, inp, weight, prune=False, layout=layout)
    table_np = _host_table(table)
    shape = layout.activation_shape(table_np.shape[1])
    if layout.kind == "lookup":
        return _named(name, kernels.prepare_gather(table_np, csr.ids), shape)
    return _named(
        name,
        kernels.prepare_bag_combine(
            table_np,
            csr.ids,
            csr.splits,
            csr.weights,
            layout.combiner,
            prune_ids=csr.prune_ids,
            prune_weights=csr.prune_weights,
            offsets_checked=True,
        ),  # to_csr's splits: checked ragged splits or derived offsets
        shape,
    )


def _prepare_sparse(name, feature, inp, weight, table, layout) -> _named | None:
    """A 2-D sparse feature's bag combine with its indices checked in the kernel's
    pass (`kernels.prepare_sparse_bag_combine`), or None where that kernel does not
    apply. Same checks, errors and values as `to_csr` + `prepare_bag_combine`."""
    validate_structure(name, inp, weight)
    ids = np.asarray(inp.values)
    w = None if weight is None or not layout.use_weights else np.asarray(weight.values, np.float32)
    table_np = _host_table(table)
    run = kernels.prepare_sparse_bag_combine(
        table_np,
        ids,
        inp.indices,
        tuple(inp.dense_shape),
        w,
        layout.combiner,
        prune_ids=layout.prune_ids and ids.dtype.kind != "u",
        prune_weights=layout.prune_weights and w is not None,
    )
    if run is None:
        return None
    return _named(name, run, layout.activation_shape(table_np.shape[1]), inp)


def _host_table(table):
    """The table for the host kernels: a numpy array, or a `QuantizedTable` of numpy
    arrays (decoded inside the kernels)."""
    if isinstance(table, QuantizedTable):
        return table.host()
    return np.asarray(table)


class _named:
    """A prepared kernel `run` whose output is reshaped to `shape`, a bad id
    reported as a ValueError naming the feature."""

    __slots__ = ("name", "run", "shape", "inp")

    def __init__(self, name: str, run, shape, inp=None):
        self.name, self.run, self.shape, self.inp = name, run, tuple(shape), inp

    def __call__(self) -> np.ndarray:
        return self.finish(self.run)

    def finish(self, result) -> np.ndarray:
        """The output of `result()` (the run itself, or a finished native call's result)."""
        try:
            return result().reshape(self.shape)
        except kernels.IdOutOfRange as e:
            raise id_range_error(self.name, e.id, e.entry, e.vocabulary_size) from None
        except kernels.BadSparseIndex as e:  # inp: the SparseTensor its kernel checks
            raise sparse_index_error(self.name, self.inp, e.entry) from None


def _host_to_jax(outs: list) -> list:
    """The host kernel's outputs as jax.Arrays (see `_host_to_jax_via`), or as they are
    under `set_numpy_outputs(True)`."""
    if settings.numpy_outputs:
        return list(outs)
    return _host_to_jax_via(outs)[0]


def _host_to_jax_via(outs: list) -> tuple[list, bool]:
    """The host kernel's outputs as jax.Arrays, and whether jaxlib's batched put made
    them; they are 64-byte aligned, so XLA's CPU client wraps them without a copy
    (uncommitted, like any device_put).

    `jax.device_put` spends ~18 us of Python per array warm and 60-100 us inside
    a serving call; where the result would be a plain uncommitted CPU array
    anyway, jaxlib's `batched_device_put` is called directly (~4 us per array,
    same arrays). Anything unusual (a default device set, a non-CPU default
    backend, dtypes JAX would canonicalise, a jaxlib without that function)
    takes `jax.device_put`.
    """
    if not outs:
        return [], False
    target = _plain_cpu_target()
    if target is not None and all(_dtype_kept_by_jax(x.dtype) for x in outs):
        device, sharding = target
        try:
            put = [_BATCHED_DEVICE_PUT(_aval(x), sharding, [x], [device], False) for x in outs]
            return put, True
        except Exception:  # pragma: no cover - a jaxlib whose signature moved
            _disable_fast_put()
    return jax.device_put(outs, may_alias=True), False


_BATCHED_DEVICE_PUT = _compat.batched_device_put()
_ShapedArray = _compat.shaped_array()
_dtype_kept: dict = {}  # numpy dtype -> whether JAX keeps it as it is


def _aval(x: np.ndarray):
    """The (immutable) ShapedArray of x, reused: serving returns the same few shapes."""
    key = (x.shape, x.dtype)
    aval = _avals.get(key)
    if aval is None:
        if len(_avals) > 1024:
            _avals.clear()
        aval = _avals[key] = _ShapedArray(x.shape, x.dtype)
    return aval


_avals: dict = {}


def _disable_fast_put() -> None:
    global _BATCHED_DEVICE_PUT
    _BATCHED_DEVICE_PUT = None


def _dtype_kept_by_jax(dtype) -> bool:
    ok = _dtype_kept.get(dtype)
    if ok is None:
        ok = _dtype_kept[dtype] = jax.dtypes.canonicalize_dtype(dtype) == dtype
    return ok


def _plain_cpu_target() -> tuple | None:
    """(device, sharding) where `jax.device_put(x)` puts a numpy array, when that is
    a plain CPU device (see `_compat.plain_cpu_put_target`); else None."""
    if _BATCHED_DEVICE_PUT is None:
        return None
    return _compat.plain_cpu_put_target()


# jaxlib defers dropping the numpy arrays of deleted jax.Arrays to its gc callback, so an
# output buffer stays referenced after its jax.Array is gone until Python's garbage
# collector next runs: the output pool calls jaxlib's flush (a private function: without
# it the pool simply reuses less) before it allocates a fresh buffer, and a request with
# jax outputs calls it first.
_JAX_COLLECT_GARBAGE = _compat.collect_garbage()
if _JAX_COLLECT_GARBAGE is not None:
    pool.set_release_hook(_JAX_COLLECT_GARBAGE)

# ---------------------------------------------------------------------------
# The traced path (inside jax.jit / jax.export)


def _traced_lookup(name: str, feature: FeatureConfig, inp, weight, table) -> jax.Array:
    """One feature's lookup on traced inputs, in jax.numpy at static shapes.

    The output rows follow `feature_layout`, as on the host; each entry gets its
    output row from the input's indices or row_splits, entries the layout drops
    (positions >= L, TensorFlow's pruning) get weight 0 and an out-of-range row.
    Ids outside the table read as zero rows (nothing can raise under a trace).
    """
    layout = feature_layout(name, feature, inp, weight)
    if isinstance(table, QuantizedTable):  # rows decoded to float32 as they are read
        take, dim, out_dtype = table.take, table.dim, jnp.float32
    else:
        table = jnp.asarray(table)
        dim, out_dtype = table.shape[1], table.dtype

        def take(ids):
            return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)

    if layout.kind == "lookup":
        ids = jnp.asarray(inp).reshape(-1).astype(jnp.int32)
        return take(ids).reshape(layout.activation_shape(dim))
    ids = jnp.asarray(inp.values)
    num_rows = layout.num_rows
    w = (
        jnp.asarray(weight.values).astype(jnp.float32)
        if weight is not None and layout.use_weights
        else jnp.ones(ids.shape, jnp.float32)
    )
    keep = None
    if input_kind(inp) == "sparse":
        idx = jnp.asarray(inp.indices)
        if layout.kind == "sequence":
            pos = idx[:, 1].astype(jnp.int32)
            rows = idx[:, 0].astype(jnp.int32) * layout.length + pos
            keep = (pos >= 0) & (pos < layout.length)
        else:
            lead = tuple(inp.dense_shape[:-1])
            strides = np.cumprod((1,) + lead[::-1])[:-1][::-1]
            rows = sum(idx[:, k].astype(jnp.int32) * int(strides[k]) for k in range(len(lead)))
            rows = jnp.asarray(rows, dtype=jnp.int32)
            if layout.prune_ids:
                keep = ids >= 0
            if layout.prune_weights:
                keep = (w > 0) if keep is None else keep & (w > 0)
    else:  # ragged
        splits = jnp.asarray(inp.row_splits)
        entry = jnp.arange(ids.shape[0])
        row_of = jnp.searchsorted(splits, entry, side="right") - 1
        row_of = jnp.clip(row_of, 0, max(int(splits.shape[0]) - 2, 0)).astype(jnp.int32)
        if layout.kind == "sequence":
            pos = (entry - splits[row_of]).astype(jnp.int32)
            rows = row_of * layout.length + pos
            keep = pos < layout.length
        else:
            rows = row_of
    if keep is not None:
        w = jnp.where(keep, w, 0.0)
        # weight 0 and a valid row: no id past the end reaches XLA's segment sum (on the
        # v5e chip it added such rows into row 0)
        rows = jnp.where(keep, rows, 0)
    gathered = take(ids.astype(jnp.int32)).astype(jnp.float32)
    contrib = gathered * w[:, None]
    if keep is not None:
        contrib = jnp.where(keep[:, None], contrib, 0.0)
    out = jax.ops.segment_sum(contrib, rows, num_segments=num_rows)
    if layout.combiner in ("mean", "sqrtn"):
        wd = w if layout.combiner == "mean" else w * w
        den = jax.ops.segment_sum(wd, rows, num_segments=num_rows)
        if layout.combiner == "sqrtn":
            den = jnp.sqrt(den)
        out = jnp.where(den[:, None] == 0, 0.0, out / jnp.where(den == 0, 1.0, den)[:, None])
    return out.astype(out_dtype).reshape(layout.activation_shape(dim))


# ---------------------------------------------------------------------------
# The lookup


_NARROWED_WARNED: set = set()


def _warn_if_narrowed(table_name: str, table) -> None:
    """A float64 table is served in float32 (JAX's default, and the kernels'), where
    TensorFlow would return float64: say so once a table and process."""
    dtype = getattr(table, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.float64 or table_name in _NARROWED_WARNED:
        return
    _NARROWED_WARNED.add(table_name)
    warnings.warn(
        f"serving_embedding_lookup: table {table_name} is float64; it is served in float32 "
        f"(outputs float32; TensorFlow would return float64). Cast it once with "
        f"np.asarray(table, np.float32) to serve it without the conversion each call.",
        UserWarning,
        stacklevel=6,  # _general, _lookup, _entered, serving_embedding_lookup
    )


def _missing_table_message(tables, feature_name, resolved, table) -> str:
    """The error of a feature whose table `tables` lacks: its keys are `TableConfig`s."""
    table_name = resolved.table_name(table)
    msg = (
        f"tables has no entry for the table of feature {feature_name} ({table_name}): "
        f"tables maps each TableConfig (the objects of the feature config, "
        f"`feature.table`) to its array"
    )
    names = [k for k in tables if isinstance(k, str)]
    if names:
        msg += (
            f", not table names (got {sorted(names)[:5]}); for tables keyed by name, pass "
            f"{{f.table: tables[f.table.name] for f in your feature configs}}"
        )
    return msg


def serving_embedding_lookup(
    inputs: Any, weights: Any | None, tables: dict, feature_config: Any
) -> Any:
    """Look up and combine `inputs` in `tables` as TensorFlow's CPU serving path does.

    `inputs` has the structure of `feature_config` or a subset of it (dict
    keys may be left out); `weights` is None or matches `inputs`, with None
    entries allowed. `tables` maps each `TableConfig` to a `[vocabulary_size,
    dim]` array (another shape is a ValueError naming the table) or a
    `QuantizedTable` (`embedmesh.serving.quantize_tables`: decoded in the kernels,
    float32 sums and outputs), or for a table of raw ids (`TableConfig.id_map`) its
    `RawIdTable`, looked up by raw int64 id (unknown ids: zero rows). Concrete
    weights must be finite (a NaN/Inf weight is a ValueError naming the
    feature and the entry; traced weights are not checked). Returns
    activations in the structure of `inputs`. Works on concrete arrays (host
    kernels, errors for bad ids) and inside `jax.jit`/`jax.export` (pure
    jax.numpy).

    May be called from many threads at once (docs/serving.md#serving-from-many-threads).
    """
    if weights is None and type(inputs) is dict and type(tables) is dict:
        served = _request.served  # the dict model served last: one compiled call
        if served is None or served[0] is not feature_config:
            known_no = _request.unserved.get(id(feature_config)) is feature_config
            served = None if known_no else _dict_served(feature_config)
        if served is not None:
            out = _serve(served[1], inputs, tables)  # enter and leave inside
            if type(out) is dict:
                return out
            if out is not NotImplemented:  # NotImplemented: not a request of its form
                _request.forget_served()  # False: the config changed; None: see below
                if out is None:  # not common, or an error: the general path raises it
                    return _entered(inputs, None, tables, feature_config, False)
    return _entered(inputs, weights, tables, feature_config, True)


_serve = _request.compiled.serve if _request.compiled is not None else None
_enter, _leave = _request.enter_and_leave()


def _dict_served(feature_config):
    """`request.dict_served` for this request's settings: the numpy outputs as they are,
    or wrapped as jax arrays (`_finish_dict`) after jaxlib's flush of deleted arrays."""
    if _serve is None:
        return None
    threads = settings.host_threads or _runtime.serving_threads()
    if settings.numpy_outputs:
        return _request.dict_served(feature_config, threads, None, None)
    return _request.dict_served(feature_config, threads, _finish_dict, _JAX_COLLECT_GARBAGE)


def _entered(inputs, weights, tables, feature_config, compiled: bool):
    """`_lookup` counted as a thread inside a lookup (the compiled GIL policy's count)."""
    _enter()
    try:
        return _lookup(inputs, weights, tables, feature_config, compiled)
    finally:
        _leave()


# resolved configs (by id, kept alive here): whether some table is a table of raw ids
_RAW_ID_CONFIGS: dict[int, tuple] = {}


def _has_raw_id_tables(resolved) -> bool:
    """Whether a table of `resolved` is a table of raw ids (`TableConfig(id_map=...)`):
    its features' raw ids are looked up in its `RawIdTable` (`raw_ids.served_request`)."""
    hit = _RAW_ID_CONFIGS.get(id(resolved))
    if hit is not None and hit[0] is resolved:
        return hit[1]
    raw = bool(raw_ids.raw_features(resolved))
    if len(_RAW_ID_CONFIGS) > 64:
        _RAW_ID_CONFIGS.clear()
    _RAW_ID_CONFIGS[id(resolved)] = (resolved, raw)
    return raw


def _lookup(inputs: Any, weights: Any | None, tables: dict, feature_config: Any, compiled: bool):
    """`serving_embedding_lookup`'s work: the compiled request rules (`compiled`: False
    where they have just said no to this request), else the general path."""
    resolved = resolve_feature_config(feature_config)
    flat_inputs = flatten_inputs_like(resolved, inputs, "features")
    if weights is None:
        flat_weights = [None] * len(flat_inputs)
    else:
        flat_weights = flatten_inputs_like(resolved, weights, "weights")
        for name, x, w in zip(resolved.feature_names, flat_inputs, flat_weights):
            if x is None and w is not None:
                raise ValueError(f"weights given for {name}, which has no input")
    if _has_raw_id_tables(resolved):  # raw ids -> positions in their RawIdTable's rows
        resolved, flat_inputs, tables = raw_ids.served_request(resolved, flat_inputs, tables)
    threads = settings.host_threads or _runtime.serving_threads()
    if _JAX_COLLECT_GARBAGE is not None:
        _JAX_COLLECT_GARBAGE()  # free the buffers of dropped results before reusing them
    plans = _request.plans_of(resolved.features) if compiled and type(tables) is dict else None
    if plans is not None:
        out = _request.compiled.lookup(
            plans,
            flat_inputs,
            flat_weights,
            tables,
            _request.TYPES,
            pool.output_float32_at,
            lambda outs, before_run: _finish_common(resolved, inputs, outs, before_run),
            threads,
        )
        if out is not None:  # every feature a common case, and no error
            return out
    return _general(resolved, inputs, flat_inputs, flat_weights, tables, threads)


def _general(resolved, inputs, flat_inputs: list, flat_weights: list, tables, threads: int):
    """The general path: every feature checked (TensorFlow's errors) and its output
    buffer taken, traced features computed in jax.numpy, then the host kernels."""
    outputs = []
    host = []  # (position, name, feature, input, weight, table) of host lookups
    for name, feature, inp, w in zip(
        resolved.feature_names, resolved.features, flat_inputs, flat_weights
    ):
        if inp is None:
            outputs.append(None)
            continue
        if feature.table not in tables:
            raise ValueError(_missing_table_message(tables, name, resolved, feature.table))
        table = tables[feature.table]
        _warn_if_narrowed(resolved.table_name(feature.table), table)
        shape = getattr(table, "shape", None)
        if shape is None:
            shape = np.shape(table)
        if tuple(shape) != (feature.table.vocabulary_size, feature.table.dim):
            _raise_table_shape(resolved.table_name(feature.table), shape, feature.table)
        if is_concrete((inp, w, table)):
            outputs.append(None)
            host.append((len(outputs) - 1, name, feature, inp, w, table))
        else:
            outputs.append(_traced_lookup(name, feature, inp, w, table))
    # every input checked and every output buffer taken first, then the kernels
    # back to back: 6-9% faster than one feature after the other (see
    # backends.numba._KernelCall)
    if host and kernels.native_in_use():
        results = _run_handed_over(host, threads)
    else:
        runs = [_prepare_host(*task[1:]) for task in host]
        if threads > 1 and len(runs) > 1:
            results = _run_on_threads(runs, min(threads, len(runs)))
        else:
            results = [run() for run in runs]
    for task, arr in zip(host, _host_to_jax(results)):
        outputs[task[0]] = arr
    return _pack_like_inputs(resolved, inputs, outputs)


def _run_handed_over(host: list, threads: int) -> list:
    """The host lookups with the C++ kernels on `threads` threads, each feature's kernel
    handed to the runner as soon as it is prepared (`native_backend.NativeRequest`): on
    several threads the pool sums the first features while this thread checks and
    prepares the next. Features after one that is not a C++ kernel run here afterwards,
    in order."""
    request = native_backend.NativeRequest(len(host), threads)
    runs = []
    try:
        for task in host:
            run = _prepare_host(*task[1:])
            runs.append(run)
            if len(request.calls) == len(runs) - 1 and native_backend.is_native_call(run.run):
                request.add(run.run)
    finally:
        codes = request.close()  # also on an error: the kernels write buffers we hold
    handed = len(codes)
    done = _finish_all(runs[:handed], codes)
    rest = runs[handed:]
    if len(rest) > 1 and threads > 1:
        return done + _run_on_threads(rest, min(threads, len(rest)))
    return done + [run() for run in rest]


def _finish_all(runs: list, codes: list) -> list:
    """Each run's output from its native kernel's result; the first error in feature
    order is raised (as `_run_on_threads` raises it)."""
    return [r.finish(lambda r=r, c=c: r.run.finish(c)) for r, c in zip(runs, codes)]


def _raise_table_shape(name: str, shape, table) -> None:
    raise ValueError(
        f"tables: table {name} has shape {tuple(shape)}, expected "
        f"(vocabulary_size, dim) = ({table.vocabulary_size}, {table.dim})"
    )


# ---------------------------------------------------------------------------
# Threads and results


def _run_on_threads(runs: list, threads: int) -> list:
    """Every `run()`, on the caller's thread and `threads - 1` pool threads.

    The kernels release the GIL. Each thread takes the next feature when it is
    done with one, so a thread the OS deschedules delays only the feature it
    holds, and the caller never sits idle waiting for a pool thread to start.
    The first error in feature order is raised once all have run.
    """
    n = len(runs)
    results: list = [None] * n
    errors: list = [None] * n
    order = itertools.count()  # next() is atomic under the GIL

    def work():
        for i in iter(order.__next__, None):
            if i >= n:
                return
            try:
                results[i] = runs[i]()
            except BaseException as e:
                errors[i] = e

    pool = _runtime.thread_pool(threads - 1)
    helpers = [pool.submit(work) for _ in range(threads - 1)]
    work()
    for h in helpers:
        if not h.cancel():  # one that never started has nothing left to do
            h.result()
    for e in errors:
        if e is not None:
            raise e
    return results


def _finish_common(resolved, inputs, outs: list, before_run: bool):
    """The compiled request's result from its output buffers (None where a feature has
    no input): jax arrays in the structure of `inputs`. `before_run`: made before the
    kernels fill the buffers, so only where every array aliases its buffer (else None:
    the compiled side calls again once they ran).

    Why before: after the kernels have streamed megabytes of rows through the caches,
    wrapping and packing take ~100 us of cold-cache Python (11 us an array, against
    ~4 warm), which a second thread cannot share. Same process, interleaved, 8 x 1M
    tables (benchmarks/runs/serving-history.md, sixth session): 1.4-2.3% faster a call at
    batch 4096 on one thread, 2.0-5.1% on two, 7-14% at batch 64.
    """
    done = [x for x in outs if x is not None]
    if settings.numpy_outputs:  # the buffers themselves (set_numpy_outputs)
        arrays = done
    else:
        arrays, batched = _host_to_jax_via(done)
        if before_run and not _aliases(arrays, done, batched):
            return None
    it = iter(arrays)
    return _pack_like_inputs(resolved, inputs, [None if x is None else next(it) for x in outs])


def _finish_dict(outs: dict, before_run: bool) -> dict | None:
    """`_finish_common` for a dict request (`_request.serve`): its numpy outputs, a dict
    in the inputs' key order, as jax arrays under the same keys."""
    buffers = list(outs.values())
    arrays, batched = _host_to_jax_via(buffers)
    if before_run and not _aliases(arrays, buffers, batched):
        return None
    return dict(zip(outs, arrays))


def _aliases(arrays: list, buffers: list, batched: bool) -> bool:
    """Whether the jax arrays read their numpy buffers' memory (not copies of them).

    The first non-empty one is asked (~15 us for a fresh array): a request's buffers
    all come from one pool (64-byte aligned, C order) through one put, which aliases
    all of them or none. jaxlib's `batched_device_put` to the plain CPU device is asked
    once a process; `jax.device_put` (another default device) every time."""
    global _batched_put_aliases
    if batched and _batched_put_aliases:
        return True
    for a, b in zip(arrays, buffers):
        if b.size:
            try:
                ok = a.unsafe_buffer_pointer() == b.__array_interface__["data"][0]
            except Exception:  # pragma: no cover - an array type without a buffer pointer
                return False
            if batched and ok:
                _batched_put_aliases = True
            return ok
    return True


_batched_put_aliases = False  # seen once: jaxlib's CPU put wraps our buffers, never copies


def _pack_like_inputs(resolved, inputs, flat_outputs):
    packed = unflatten_flat_dict(resolved, inputs, flat_outputs)  # the common request
    if packed is not None:
        return packed
    full = jax.tree_util.tree_unflatten(resolved.treedef, flat_outputs)

    def prune(cfg_out, inp):
        if isinstance(inp, dict):
            return {k: prune(cfg_out[k], v) for k, v in inp.items()}
        if isinstance(inp, (list, tuple)) and isinstance(cfg_out, (list, tuple)):
            return (
                type(inp)(prune(c, x) for c, x in zip(cfg_out, inp))
                if not hasattr(inp, "_fields")
                else type(inp)(*(prune(c, x) for c, x in zip(cfg_out, inp)))
            )
        return cfg_out

    return prune(full, inputs)
