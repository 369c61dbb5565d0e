"""`serving_embedding_lookup`: TensorFlow's CPU serving lookup, in JAX.

Semantics follow `tf.tpu.experimental.embedding.serving_embedding_lookup`
exactly (see README, "Serving semantics"). Every feature is reduced to one
*plan*: parallel arrays (output row, id, weight, keep) plus how rows are
normalised and shaped. One kernel then computes

    out[row] = sum_k weight_k * table[id_k]          (kept entries only)
    out[row] /= sum_k w_k  (mean)  or  sqrt(sum_k w_k^2)  (sqrtn);  0/0 = 0

With concrete (numpy) inputs the kernel runs on the host over the table's
memory, and ids are range checked (a `ValueError` naming the feature).
Dense inputs and combined ragged/sparse inputs skip the plan: the input's
own row_splits / sparse row offsets are the kernel's bags, and pruning
happens inside the kernel (`_prepare_host_direct`); sequence outputs build
the plan and prune it on the host. A call checks every feature and takes its
output buffer first, then runs the kernels back to back, spread over one
thread per core (`set_host_threads`). Inside `jax.jit`/`jax.export` (traced
inputs) the same plan is built with masks at static shapes and computed with
jax.numpy; ids out of range cannot raise there and read as zero rows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.config import FeatureConfig, resolve_feature_config
from embedmesh.inputs import (check_id_range, feature_layout, flatten_inputs_like, input_kind,
                              is_concrete,
                              ragged_positions, ragged_row_ids, sparse_row_offsets,
                              validate_input, validate_structure)
from embedmesh.serving import kernels


@dataclasses.dataclass
class LookupPlan:
    """What one feature's lookup computes; arrays are numpy or jax.numpy."""

    rows: Any  # [nnz] output row of each entry
    ids: Any  # [nnz]
    weights: Any  # [nnz] float32
    keep: Any  # [nnz] bool, or None when every entry is kept
    num_rows: int
    combiner: Optional[str]  # None: no normalisation (plain or sequence lookup)
    out_shape: tuple  # final shape without the trailing dim


def _xp(concrete: bool):
    return np if concrete else jnp


def _sequence_plan(xp, b, positions, rows_of_entry, ids, length, out_shape):
    keep = (positions >= 0) & (positions < length)
    rows = rows_of_entry * length + positions
    ones = xp.ones(ids.shape, xp.float32)
    return LookupPlan(rows, ids, ones, keep, b * length, None, out_shape)


def _ragged_rows_positions(xp, row_splits, nnz):
    splits = xp.asarray(row_splits)
    idx = xp.arange(nnz)
    rows = xp.searchsorted(splits, idx, side="right") - 1
    rows = xp.clip(rows, 0, max(int(splits.shape[0]) - 2, 0))
    return rows.astype(xp.int32), (idx - splits[rows]).astype(xp.int32)


def plan_feature(name: str, feature: FeatureConfig, inp, weight, concrete: bool) -> LookupPlan:
    """The lookup plan for one feature under TensorFlow's serving rules
    (`inputs.feature_layout`, which training follows too)."""
    xp = _xp(concrete)
    kind = input_kind(inp)
    layout = feature_layout(name, feature, inp, weight)
    if concrete:
        validate_input(name, inp, weight)
    if layout.kind == "lookup":
        ids = xp.asarray(inp)
        flat = ids.reshape(-1)
        n = int(flat.shape[0])
        return LookupPlan(xp.arange(n, dtype=xp.int32), flat, xp.ones((n,), xp.float32), None,
                          n, None, tuple(ids.shape))
    b = layout.batch
    ids = xp.asarray(inp.values)
    if kind == "sparse":
        idx = xp.asarray(inp.indices)
        if layout.kind == "sequence":
            L = layout.length
            return _sequence_plan(xp, b, idx[:, 1].astype(xp.int32), idx[:, 0].astype(xp.int32),
                                  ids, L, (b, L))
        lead = tuple(inp.dense_shape[:-1])
        strides = np.cumprod((1,) + tuple(lead[::-1]))[:-1][::-1]
        rows = sum(idx[:, k].astype(xp.int32) * int(strides[k]) for k in range(len(lead)))
        rows = xp.asarray(rows, dtype=xp.int32)
        w = (xp.ones(ids.shape, xp.float32) if weight is None
             else xp.asarray(weight.values).astype(xp.float32))
        keep = None
        if layout.prune_ids:
            keep = ids >= 0
        if layout.prune_weights:
            keep = (w > 0) if keep is None else keep & (w > 0)
        return LookupPlan(rows, ids, w, keep, layout.num_rows, layout.combiner, lead)
    nnz = int(ids.shape[0])
    if concrete:
        rows = ragged_row_ids(inp.row_splits)
        positions = (ragged_positions(inp.row_splits) if layout.kind == "sequence" else None)
    else:
        rows, positions = _ragged_rows_positions(xp, inp.row_splits, nnz)
    if layout.kind == "sequence":
        L = layout.length
        plan = _sequence_plan(xp, b, positions, rows, ids, L, (b, L))
        if layout.output_shape is not None:
            plan.out_shape = tuple(layout.output_shape)
        return plan
    w = (xp.ones(ids.shape, xp.float32) if weight is None
         else xp.asarray(weight.values).astype(xp.float32))
    return LookupPlan(rows, ids, w, None, b, layout.combiner, layout.output_shape or (b,))


def _compact(plan: LookupPlan) -> LookupPlan:
    if plan.keep is None or plan.keep.all():
        return plan
    k = plan.keep
    return dataclasses.replace(plan, rows=plan.rows[k], ids=plan.ids[k], weights=plan.weights[k],
                               keep=None)


def _lookup_host(name: str, plan: LookupPlan, table) -> np.ndarray:
    plan = _compact(plan)
    table_np = np.asarray(table)
    ids = np.asarray(plan.ids)
    check_id_range(name, ids, table_np.shape[0])
    out = kernels.weighted_segment_sum(table_np, ids, np.asarray(plan.rows),
                                       np.asarray(plan.weights, np.float32), plan.num_rows,
                                       plan.combiner)
    return out.reshape(plan.out_shape + (table_np.shape[1],))


def _lookup_host_direct(name: str, feature: FeatureConfig, inp, weight, table):
    """The host lookup straight from the input's own layout, or None for sequence outputs."""
    run = _prepare_host_direct(name, feature, inp, weight, table)
    return None if run is None else run()


def _prepare_host_direct(name: str, feature: FeatureConfig, inp, weight, table):
    """Check the input now; return a function computing its host lookup, or None
    for sequence outputs.

    Dense input is a checked gather; ragged row_splits and sparse row offsets
    are the kernel's bag boundaries, so no per-entry row array, keep mask or
    compacted copy is built. TensorFlow's pruning (ids < 0; weights <= 0 for
    mean/sqrtn) and the id range check happen inside the kernel's one pass.
    Same results and errors as the plan path (`plan_feature` + `_lookup_host`).
    """
    kind = input_kind(inp)
    layout = feature_layout(name, feature, inp, weight)
    if layout.kind == "sequence":
        return None
    if kind == "dense":
        validate_structure(name, inp)
        ids = np.asarray(inp)
        table_np = np.asarray(table)
        return _named(name, kernels.prepare_gather(table_np, ids.reshape(-1)),
                      ids.shape + (table_np.shape[1],))
    validate_structure(name, inp, weight)
    table_np = np.asarray(table)
    if kind == "sparse":
        offsets = sparse_row_offsets(name, inp)
        return _named(name, kernels.prepare_bag_combine(
            table_np, np.asarray(inp.values), offsets,
            None if weight is None else np.asarray(weight.values), layout.combiner,
            prune_ids=layout.prune_ids, prune_weights=layout.prune_weights,
            offsets_checked=True),
            tuple(inp.dense_shape[:-1]) + (table_np.shape[1],))
    out_shape = layout.output_shape or (inp.nrows,)
    return _named(name, kernels.prepare_bag_combine(
        table_np, np.asarray(inp.values), np.asarray(inp.row_splits),
        None if weight is None else np.asarray(weight.values), layout.combiner,
        offsets_checked=True),  # validate_structure checked the row_splits
        tuple(out_shape) + (table_np.shape[1],))


class _named:
    """A prepared kernel `run` whose output is reshaped to `shape`, a bad id
    reported as a ValueError naming the feature."""

    __slots__ = ("name", "run", "shape")

    def __init__(self, name: str, run, shape):
        self.name, self.run, self.shape = name, run, tuple(shape)

    def __call__(self) -> np.ndarray:
        try:
            return self.run().reshape(self.shape)
        except kernels.IdOutOfRange as e:
            raise ValueError(f"feature {self.name}: id {e.id} (entry {e.entry}) is outside the "
                             f"table's range [0, {e.vocabulary_size})") from None


def _host_to_jax(outs: list) -> list:
    """The host kernel's outputs as jax.Arrays; they are 64-byte aligned, so XLA's
    CPU client wraps them without a copy (uncommitted, like any device_put).

    `jax.device_put` spends ~18 us of Python per array warm and 60-100 us inside
    a serving call; where the result would be a plain uncommitted CPU array
    anyway, jaxlib's `batched_device_put` is called directly (~4 us per array,
    same arrays). Anything unusual (a default device set, a non-CPU default
    backend, dtypes JAX would canonicalise, a jaxlib without that function)
    takes `jax.device_put`.
    """
    if not outs:
        return []
    target = _plain_cpu_target()
    if target is not None and all(_canonical_dtype(x.dtype) for x in outs):
        device, sharding = target
        try:
            return [_BATCHED_DEVICE_PUT(_aval(x), sharding, [x], [device], False) for x in outs]
        except Exception:  # pragma: no cover - a jaxlib whose signature moved
            _disable_fast_put()
    return jax.device_put(outs, may_alias=True)


def _private_device_put():
    """jaxlib's batched_device_put and jax's ShapedArray, or (None, None)."""
    try:
        from jax._src import core as jax_core
        from jax._src.lib import xla_client
        return xla_client.batched_device_put, jax_core.ShapedArray
    except Exception:  # pragma: no cover - private modules moved
        return None, None


_BATCHED_DEVICE_PUT, _ShapedArray = _private_device_put()
_cpu_target: Optional[tuple] = None  # (device, SingleDeviceSharding) of device_put's default
_canonical: dict = {}  # numpy dtype -> whether JAX keeps it as it is


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


def _canonical_dtype(dtype) -> bool:
    ok = _canonical.get(dtype)
    if ok is None:
        ok = _canonical[dtype] = jax.dtypes.canonicalize_dtype(dtype) == dtype
    return ok


def _plain_cpu_target() -> Optional[tuple]:
    """(device, sharding) where `jax.device_put(x)` puts a numpy array when that is
    this process's first local CPU device and no default device is set; else None."""
    global _cpu_target
    if _BATCHED_DEVICE_PUT is None or _default_device_set():
        return None
    if _cpu_target is None:
        device = jax.local_devices()[0]
        if device.platform != "cpu":
            return None
        _cpu_target = (device, jax.sharding.SingleDeviceSharding(device))
    return _cpu_target


def _default_device_set() -> bool:
    try:
        return _JAX_CONFIG.default_device.value is not None
    except Exception:  # pragma: no cover - private module moved
        return True


try:
    from jax._src import config as _JAX_CONFIG
except Exception:  # pragma: no cover - private module moved
    _JAX_CONFIG = None


def _release_dead_jax_references() -> None:
    """Let jaxlib drop the numpy arrays of deleted jax.Arrays now.

    jaxlib defers those decrefs to its gc callback (`collect_garbage`), so an
    output buffer stays referenced after its jax.Array is gone until Python's
    garbage collector next runs; `kernels`' output pool calls this before it
    allocates a fresh buffer. A private jaxlib function: without it the pool
    simply reuses less.
    """
    _JAX_COLLECT_GARBAGE()


_JAX_COLLECT_GARBAGE = getattr(getattr(getattr(jax, "_src", None), "lib", None), "_jax", None)
_JAX_COLLECT_GARBAGE = getattr(_JAX_COLLECT_GARBAGE, "collect_garbage", None)
if _JAX_COLLECT_GARBAGE is not None:
    kernels.set_release_hook(_release_dead_jax_references)


def _lookup_traced(plan: LookupPlan, table) -> jax.Array:
    table = jnp.asarray(table)
    dim = table.shape[1]
    ids = jnp.asarray(plan.ids).astype(jnp.int32)
    w = jnp.asarray(plan.weights, jnp.float32)
    rows = jnp.asarray(plan.rows, jnp.int32)
    if plan.keep is not None:
        w = jnp.where(plan.keep, w, 0.0)
        rows = jnp.where(plan.keep, rows, plan.num_rows)  # out of range: dropped by segment_sum
    gathered = jnp.take(table, ids, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    if plan.combiner is None and plan.keep is None and plan.num_rows == ids.shape[0]:
        out = gathered  # plain dense lookup: rows are 0..n-1
    else:
        out = jax.ops.segment_sum(gathered * w[:, None], rows, num_segments=plan.num_rows)
        if plan.combiner in ("mean", "sqrtn"):
            wd = w if plan.combiner == "mean" else w * w
            den = jax.ops.segment_sum(wd, rows, num_segments=plan.num_rows)
            if plan.combiner == "sqrtn":
                den = jnp.sqrt(den)
            out = jnp.where(den[:, None] == 0, 0.0, out / jnp.where(den == 0, 1.0, den)[:, None])
    return out.astype(table.dtype).reshape(plan.out_shape + (dim,))


def serving_embedding_lookup(inputs: Any, weights: Optional[Any], tables: dict,
                             feature_config: Any) -> Any:
    """Look up and combine `inputs` in `tables` as TensorFlow's CPU serving path does.

    `inputs` has the structure of `feature_config` or a subset of it (dict
    keys may be left out); `weights` is None or matches `inputs`, with None
    entries allowed. `tables` maps each `TableConfig` to a `[vocabulary_size,
    dim]` array (another shape is a ValueError naming the table). Concrete
    weights must be finite (a NaN/Inf weight is a ValueError naming the
    feature and the entry; traced weights are not checked). Returns activations in the structure of `inputs`.
    Works on concrete arrays (host kernel, errors for bad ids) and inside
    `jax.jit`/`jax.export` (pure jax.numpy).
    """
    resolved = resolve_feature_config(feature_config)
    flat_inputs = flatten_inputs_like(resolved, inputs, "features")
    if weights is None:
        flat_weights = [None] * len(flat_inputs)
    else:
        flat_weights = flatten_inputs_like(resolved, weights, "weights")
        for name, x, w in zip(resolved.feature_names, flat_inputs, flat_weights):
            if x is None and w is not None:
                raise ValueError(f"weights given for {name}, which has no input")
    outputs = []
    host = []  # (position, name, feature, input, weight, table) of host lookups
    for name, feature, inp, w in zip(resolved.feature_names, resolved.features, flat_inputs,
                                     flat_weights):
        if inp is None:
            outputs.append(None)
            continue
        if feature.table not in tables:
            raise ValueError(f"tables has no entry for the table of feature {name} "
                             f"({resolved.table_name(feature.table)})")
        table = tables[feature.table]
        shape = getattr(table, "shape", None)
        if shape is None:
            shape = np.shape(table)
        if tuple(shape) != (feature.table.vocabulary_size, feature.table.dim):
            _raise_table_shape(resolved.table_name(feature.table), shape, feature.table)
        if is_concrete((inp, w, table)):
            outputs.append(None)
            host.append((len(outputs) - 1, name, feature, inp, w, table))
        else:
            outputs.append(_lookup_traced(plan_feature(name, feature, inp, w, False), table))
    if host and _JAX_COLLECT_GARBAGE is not None:
        _JAX_COLLECT_GARBAGE()  # free the buffers of dropped results before reusing them
    # every input checked and every output buffer taken first, then the kernels
    # back to back: 6-9% faster than one feature after the other (see
    # kernels._KernelCall)
    runs = [_prepare_host_one(*task[1:]) for task in host]
    if _host_threads > 1 and len(runs) > 1:
        results = _run_on_threads(runs, min(_host_threads, len(runs)))
    else:
        results = [run() for run in runs]
    for task, arr in zip(host, _host_to_jax(results)):
        outputs[task[0]] = arr
    return _pack_like_inputs(resolved, inputs, outputs)


def _raise_table_shape(name: str, shape, table) -> None:
    raise ValueError(f"tables: table {name} has shape {tuple(shape)}, expected "
                     f"(vocabulary_size, dim) = ({table.vocabulary_size}, {table.dim})")


def _prepare_host_one(name, feature, inp, w, table):
    run = _prepare_host_direct(name, feature, inp, w, table)
    if run is None:  # sequence outputs: the plan path, planned now
        plan = plan_feature(name, feature, inp, w, True)
        return lambda: _lookup_host(name, plan, table)
    return run


def _default_threads() -> int:
    """EMBEDMESH_SERVING_THREADS, else one per usable core up to 8 (TensorFlow and
    torch also use every core by default): on the serving benchmark 2 threads
    ran 1.6-1.7x faster than 1 with the other core free."""
    env = os.environ.get("EMBEDMESH_SERVING_THREADS", "").strip()
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


_host_threads = _default_threads()
_executors: dict = {}  # pool thread count -> ThreadPoolExecutor, made on first use
_executors_pid = os.getpid()  # the process the executors' threads belong to
_executors_lock = threading.Lock()


def set_host_threads(n: int) -> int:
    """Threads the host path spreads features over, the caller's included (1: the
    caller's thread only; the default is one per core, up to 8); returns the
    previous value. Each feature's kernel runs on one thread; a server running
    many lookups at once may prefer 1 (or EMBEDMESH_SERVING_THREADS=1)."""
    global _host_threads
    if int(n) < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    previous, _host_threads = _host_threads, int(n)
    return previous


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
            except BaseException as e:  # noqa: BLE001 - re-raised below, in feature order
                errors[i] = e

    pool = _executor(threads - 1)
    helpers = [pool.submit(work) for _ in range(threads - 1)]
    work()
    for h in helpers:
        if not h.cancel():  # one that never started has nothing left to do
            h.result()
    for e in errors:
        if e is not None:
            raise e
    return results


def _executor(n: int) -> concurrent.futures.ThreadPoolExecutor:
    global _executors_pid
    with _executors_lock:
        if _executors_pid != os.getpid():  # a forked child: the parent's threads are gone
            _executors.clear()
            _executors_pid = os.getpid()
        if n not in _executors:
            _executors[n] = concurrent.futures.ThreadPoolExecutor(
                n, thread_name_prefix="embedmesh-serving")
        return _executors[n]


def _pack_like_inputs(resolved, inputs, flat_outputs):
    full = jax.tree_util.tree_unflatten(resolved.treedef, flat_outputs)

    def prune(cfg_out, inp):
        if isinstance(inp, dict):
            return {k: prune(cfg_out[k], v) for k, v in inp.items()}
        if isinstance(inp, (list, tuple)) and isinstance(cfg_out, (list, tuple)):
            return type(inp)(prune(c, x) for c, x in zip(cfg_out, inp)) if not hasattr(
                inp, "_fields") else type(inp)(*(prune(c, x) for c, x in zip(cfg_out, inp)))
        return cfg_out

    return prune(full, inputs)
