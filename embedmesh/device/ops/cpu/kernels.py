"""The CPU kernel of each device op: a `jax.ffi.ffi_call` of the library's handler.

Each takes the arguments of the op's reference (already normalised by the op)
and returns the same; `KERNELS` maps op names to `(kernel, supports)`, where
`supports(*args, **params)` says whether the kernel takes that call (None: every
call). `embedmesh.device.ops` registers them for the "cpu" platform; each op's
docstring there says what they compute (the same as the reference, each sum in
the documented order).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh import _runtime
from embedmesh.device.ops.cpu import library, memory

__all__ = ["KERNELS"]


def gather_rows(table, ids):
    out = jax.ShapeDtypeStruct((ids.shape[0],) + table.shape[1:], table.dtype)
    return jax.ffi.ffi_call("embedmesh_gather_rows", out)(table, ids)


def scatter_rows(table, ids, rows):
    out = jax.ShapeDtypeStruct(table.shape, table.dtype)
    return jax.ffi.ffi_call("embedmesh_scatter_rows", out, input_output_aliases={0: 0})(
        table, ids, rows
    )


def segment_gather_sum(src, src_idx, gains, dst_idx, *, num_segments: int):
    out = jax.ShapeDtypeStruct((num_segments,) + src.shape[1:], jnp.float32)
    return jax.ffi.ffi_call("embedmesh_segment_gather_sum", out)(src, src_idx, gains, dst_idx)


def segment_gather_sum_mapped(src, src_map, src_idx, gains, dst_idx, *, num_segments: int):
    out = jax.ShapeDtypeStruct((num_segments,) + src.shape[1:], jnp.float32)
    return jax.ffi.ffi_call("embedmesh_segment_gather_sum_mapped", out)(
        src, src_map, src_idx, gains, dst_idx
    )


# The storage types the lookup kernels read (storage.h: each widened to float32 exactly,
# summed in float32), one template each.
_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _storage_source(src, *args, **params) -> bool:
    return jnp.dtype(src.dtype) in _STORAGE


def dedup_sum(ids, grads):
    m = ids.size
    outs = (
        jax.ShapeDtypeStruct((m,), jnp.int32),
        jax.ShapeDtypeStruct((m,) + grads.shape[1:], jnp.float32),
    )
    return tuple(
        jax.ffi.ffi_call("embedmesh_dedup_sum", outs, input_output_aliases={1: 1})(ids, grads)
    )


def fused_kinds() -> frozenset:
    """The optimizers the update kernels fuse (`Optimizer.fused_kernel` names): the rules
    update.cc lists a sparse update of (`library.targets()`; empty until loaded). The
    slots a rule reads are the optimizer's `slot_names`, in that order."""
    prefix = "embedmesh_sparse_"
    return frozenset(t[len(prefix) :] for t in library.targets() if t.startswith(prefix))


_LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _fused(table, slots, *args, optimizer, step) -> bool:
    """Whether the fused update kernels take this optimizer, table and slots: float32
    arrays, or (a `device.rounding.Rounded` optimizer, rounding stochastically) a bfloat16
    or float16 table whose slots are all float32 or all of its type."""
    if optimizer.fused_kernel not in fused_kinds() or set(slots) != set(optimizer.slot_names):
        return False
    kinds = {jnp.dtype(v.dtype) for v in slots.values()}
    if getattr(optimizer, "rounding_words", None) is None:
        return table.dtype == jnp.float32 and kinds <= {jnp.dtype(jnp.float32)}
    return jnp.dtype(table.dtype) in _LOW and (
        kinds <= {jnp.dtype(jnp.float32)} or kinds == {jnp.dtype(table.dtype)}
    )


def _ffi_scalar(value):
    """An FFI attribute of a fused kernel: bool -> int32, int -> int64, else float32."""
    if isinstance(value, (bool, np.bool_)):
        return np.int32(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    return np.float32(value)


def _update(target, table, slots, args, *, optimizer, step, **attrs):
    """The fused update `target` ("embedmesh_sparse_{}", ...: formatted with the
    optimizer's `fused_kernel`) of `table` and its slots: the call's fixed `args` (the
    learning rate's place marked by `_LR`), then the table and the slots (aliased to the
    results), and as attributes the optimizer's scalars (`fused_attrs`, `fused_rule_attrs`)
    plus `attrs`; a `Rounded` optimizer's `rounding_words` go between the fixed arguments
    and the state (update.cc's `WithUpdater`). Returns (new table, new slots)."""
    scalars = optimizer.fused_attrs(step)
    lr = scalars.pop("learning_rate").reshape(1)
    scalars.update(optimizer.fused_rule_attrs())
    names = tuple(optimizer.slot_names)
    state = (table, *(slots[k] for k in names))
    fixed = tuple(lr if a is _LR else a for a in args)
    if getattr(optimizer, "rounding_words", None) is not None:
        fixed = (*fixed, optimizer.rounding_words(step))
    outs = jax.ffi.ffi_call(
        target.format(optimizer.fused_kernel),
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state),
        input_output_aliases={len(fixed) + i: i for i in range(len(state))},
    )(*fixed, *state, **{k: _ffi_scalar(v) for k, v in scalars.items()}, **attrs)
    return outs[0], dict(zip(names, outs[1:]))


_LR = object()  # the place of the learning rate [1] among a fused update's arguments


def sparse_update(table, slots, ids, grads, *, optimizer, step):
    args = (ids, grads.astype(jnp.float32), _LR)
    return _update("embedmesh_sparse_{}", table, slots, args, optimizer=optimizer, step=step)


def backward_update(
    table, slots, ids, act_grads, pair_rows, pair_unique, pair_gains, *, optimizer, step
):
    args = (ids, act_grads, pair_rows, pair_unique, pair_gains, _LR)
    return _update("embedmesh_backward_{}", table, slots, args, optimizer=optimizer, step=step)


_exchange_tags = itertools.count(1)


def _transport(transport, in_process: str, host: str, after=None):
    """(the target, this device's rank [1], the FFI attributes of its transport
    (transport.h)) of a cross-device kernel: `in_process` between the devices of this
    process (a tag of its own per traced call, the device count), else `host` between
    processes of one host (the job's key, the channel's tag, the device count, the
    timeout, the channel). `after`: the output of the program's previous cross-device call
    (`ops.staging.crossing_order`), which the rank is made to wait for (`embedmesh_after`,
    exchange.cc)."""
    rank = jax.lax.axis_index(transport.axis_name).astype(jnp.int32).reshape(1)
    if after is not None:
        rank = jax.ffi.ffi_call("embedmesh_after", jax.ShapeDtypeStruct((1,), jnp.int32))(
            rank, after
        )
    n = np.int64(transport.num_shards)
    if transport.in_process:
        return in_process, rank, dict(tag=np.int64(next(_exchange_tags)), n=n)
    library.release_host_exchanges_at_exit()
    attrs = dict(
        job=np.int64(transport.host_job),
        tag=np.int64(channel_tag(transport.channel)),
        n=n,
        timeout_ms=np.int64(_timeout_ms(_runtime.exchange_timeout_s())),
        channel=str(transport.channel),
    )
    return host, rank, attrs


def exchange(x, *, transport, after=None):
    """The all-to-all through shared memory: block j to device j (exchange.cc).

    In one process each traced call gets its own tag, which pairs up the calls of the
    devices; between the processes of one host (`host_job`) the call's tag is a stable
    hash of its channel, the same in every process."""
    target, rank, attrs = _transport(
        transport, "embedmesh_exchange", "embedmesh_host_exchange", after
    )
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call(target, out)(x, rank, **attrs)


def _timeout_ms(seconds: float) -> int:
    """The kernels' timeout attribute: milliseconds, at least 1; -1 (no deadline) for inf
    and anything past 10^9 s (the deadline must fit the kernels' clock)."""
    return -1 if seconds > 1e9 else max(1, round(seconds * 1000))


def channel_tag(channel: str) -> int:
    """The 63-bit tag of a host exchange's channel: a hash that every process computes
    the same (not Python's `hash`, which is salted per process)."""
    digest = hashlib.blake2b(str(channel).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


# The channels of host exchanges traced so far in each trace (a program, or one of its
# loop bodies): two calls of one channel in one trace could run in different orders in
# different processes, or at once, and pair up wrongly.
_traced_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_traced_lock = threading.Lock()


def _claim_channel(channel: str) -> None:
    """Record that the current trace exchanges through `channel`; a ValueError when it
    already does."""
    try:
        from jax._src import core as jax_core

        trace = jax_core.trace_ctx.trace
        if isinstance(trace, jax_core.EvalTrace):  # eager: calls run one after another
            return
        with _traced_lock:
            seen = _traced_channels.setdefault(trace, set())
            duplicate = channel in seen
            seen.add(channel)
    except (ImportError, AttributeError, TypeError):  # another JAX: no check
        return
    if duplicate:
        raise ValueError(
            f"ops.exchange: channel {channel!r} is used twice in one program; the "
            "processes' exchanges pair up by channel, so each call needs its own"
        )


def _in_process(x, *, transport) -> bool:
    """The devices of this process share memory; so do the processes of one host
    (`host_job`; the call claims its channel); a mesh over hosts uses XLA's."""
    return x.shape[0] % transport.num_shards == 0 and _crosses_shared_memory(x, transport)


def _crosses_shared_memory(x, transport) -> bool:
    """Whether a call crosses devices that share memory: in this process, or in processes
    of one host (then it claims its channel in the current trace)."""
    return transport.num_shards > 1 and (transport.in_process or _host_call(x, transport))


def _host_call(x, transport) -> bool:
    """Whether a call that is not in-process takes a host kernel: when the processes are
    on one host (`host_job`); claims its channel in the current trace."""
    if not transport.host_job:
        return False
    if isinstance(x, jax.core.Tracer):
        _claim_channel(transport.channel)
    return True


def lookup_from_shards(table, *pairs, num_rows, transport, after=None):
    """This device's activations read straight from every shard's table (exchange.cc);
    between processes of one host, from the rows each owner gathered into its shared
    memory (two rounds, the ids then the rows: channels "<channel>/ids" and "/rows").
    `pairs`: the op's (unique_ids, pair_unique, pair_gains, pair_rows), passed on."""
    out = jax.ShapeDtypeStruct((num_rows,) + table.shape[1:], jnp.float32)
    args = (table, *pairs)
    target, rank, attrs = _transport(
        transport.at("ids"), "embedmesh_lookup_from_shards", "embedmesh_host_lookup", after
    )
    if not transport.in_process:
        attrs["rows_tag"] = np.int64(channel_tag(transport.at("rows").channel))
    return jax.ffi.ffi_call(target, out)(*args, rank, **attrs)


def _lookup_in_process(table, *args, transport, **params) -> bool:
    return _storage_source(table) and _crosses_shared_memory(table, transport)


def backward_update_sharded(
    table, slots, *batch, optimizer, step, transport, replicated=False, after=None
):
    """Each owner reads its sources' pairs and activation gradients directly (update.cc);
    `replicated`: each device a replica, applying every source's one partition. `batch`:
    the op's (unique_ids, act_grads, pair_rows, pair_unique, pair_gains, keep), passed on."""
    *pairs, keep = batch
    target, rank, attrs = _transport(
        transport.at("sources"),
        "embedmesh_backward_{}_from_sources",
        "embedmesh_backward_{}_from_host_sources",
        after,
    )
    args = (*pairs, _LR, keep.astype(jnp.int32).reshape(1), rank)
    attrs = dict(replica=np.int64(bool(replicated)), **attrs)
    return _update(target, table, slots, args, optimizer=optimizer, step=step, **attrs)


def _fused_in_process(table, slots, *args, optimizer, step, transport, **params):
    return _fused(table, slots, optimizer=optimizer, step=step) and _crosses_shared_memory(
        table, transport
    )


def _pooled_words(unique_capacity: int, width: int) -> np.int64:
    return np.int64(_runtime.pooled_pair_fields(unique_capacity, width))


def _pooled_attrs(unique_capacity: int, width: int) -> dict:
    """The attributes of an owner's kernel reading pooled messages (pooled.h)."""
    return dict(
        u=np.int64(unique_capacity), rc=np.int64(width), k=_pooled_words(unique_capacity, width)
    )


def pack_pooled_pairs(unique_ids, pair_rows, pair_unique, pair_gains, compact, *, width):
    n, u = unique_ids.shape
    k = _pooled_words(u, width)
    out = jax.ShapeDtypeStruct((n, u + pair_rows.shape[1] * int(k)), jnp.int32)
    return jax.ffi.ffi_call("embedmesh_pack_pooled_pairs", out)(
        unique_ids, pair_rows, pair_unique, pair_gains, compact, rc=np.int64(width), k=k
    )


def pooled_partials(table, served, *, unique_capacity, width):
    out = jax.ShapeDtypeStruct((served.shape[0] * width,) + table.shape[1:], jnp.float32)
    return jax.ffi.ffi_call("embedmesh_pooled_partials", out)(
        table,
        served,
        **_pooled_attrs(unique_capacity, width),
    )


def pooled_backward_update(
    table, slots, served, grads, keep, *, optimizer, step, unique_capacity, width
):
    args = (served, grads, _LR, keep.astype(jnp.int32).reshape(1))
    return _update(
        "embedmesh_pooled_backward_{}",
        table,
        slots,
        args,
        optimizer=optimizer,
        step=step,
        **_pooled_attrs(unique_capacity, width),
    )


def _fused_pooled(table, slots, served, grads, keep, *, optimizer, step, **params) -> bool:
    return _fused(table, slots, optimizer=optimizer, step=step)


# Pooling fused with its exchange (pooled.cc, update.cc): each message written straight
# into where its receiver reads it, the gradients read in place where they were sent.


def exchange_pooled_pairs(
    unique_ids, pair_rows, pair_unique, pair_gains, compact, *, width, transport, after=None
):
    n, u = unique_ids.shape
    k = _pooled_words(u, width)
    target, rank, attrs = _transport(
        transport, "embedmesh_exchange_pooled_pairs", "embedmesh_host_pack_pooled_pairs", after
    )
    out = jax.ShapeDtypeStruct((n, u + pair_rows.shape[1] * int(k)), jnp.int32)
    return jax.ffi.ffi_call(target, out)(
        unique_ids,
        pair_rows,
        pair_unique,
        pair_gains,
        compact,
        rank,
        rc=np.int64(width),
        k=k,
        **attrs,
    )


def exchange_pooled_partials(table, served, *, unique_capacity, width, transport, after=None):
    n = served.shape[0]
    target, rank, attrs = _transport(
        transport, "embedmesh_exchange_pooled_partials", "embedmesh_host_pooled_partials", after
    )
    out = jax.ShapeDtypeStruct((n * width,) + table.shape[1:], jnp.float32)
    return jax.ffi.ffi_call(target, out)(
        table,
        served,
        rank,
        **_pooled_attrs(unique_capacity, width),
        **attrs,
    )


def exchange_pooled_backward_update(
    table,
    slots,
    served,
    grads,
    keep,
    *,
    optimizer,
    step,
    transport,
    after=None,
    blocks=None,
    **pooled,
):
    """`pooled`: unique_capacity, width."""
    target, rank, attrs = _transport(
        transport,
        "embedmesh_exchange_pooled_backward_{}",
        "embedmesh_host_pooled_backward_{}",
        after,
    )
    attrs = {**_pooled_attrs(**pooled), **attrs}
    parts = ()
    if blocks is not None:  # the parts' rows read where they are (update_forms.h's PartRows)
        parts, grads = tuple(grads), jnp.zeros((0,), jnp.float32)
        attrs.update(parts=np.int64(len(parts)), segments=_segments(blocks))
    args = (served, grads, _LR, keep.astype(jnp.int32).reshape(1), rank, *parts)
    return _update(target, table, slots, args, optimizer=optimizer, step=step, **attrs)


def _segments(blocks) -> np.ndarray:
    """`blocks` (`ops.exchange_pooled_backward_update`'s) as the kernel's flat int64
    (owner, part, first row, count) quads."""
    quads = [(o, p, first, count) for o, segs in enumerate(blocks) for p, first, count in segs]
    return np.asarray(quads, np.int64).reshape(-1)


def _pooled_pairs_kernel(unique_ids, *args, width, transport) -> bool:
    return _crosses_shared_memory(unique_ids, transport)


def _pooled_partials_kernel(table, served, *, unique_capacity, width, transport) -> bool:
    return _storage_source(table) and _crosses_shared_memory(table, transport)


def _pooled_backward_kernel(table, slots, *args, optimizer, step, transport, **params) -> bool:
    return _fused(table, slots, optimizer=optimizer, step=step) and _crosses_shared_memory(
        table, transport
    )


def id_map_step(*args, keys, lfu, admit_after, evict_batch, halve_every, distinct, fallback):
    """id_map.cc: a whole `map_ids` call, the state's eight arrays updated in place
    (aliased); `fallback` (the jnp path: the op's reference) is not run here."""
    state, (ids, valid, step) = args[:8], args[8:]
    outs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state) + (
        jax.ShapeDtypeStruct(valid.shape, jnp.int32),
        jax.ShapeDtypeStruct(valid.shape, jnp.bool_),
        jax.ShapeDtypeStruct((6,), jnp.int32),
    )
    words = jnp.asarray(np.asarray(keys, np.uint32).reshape(-1, 3))
    return jax.ffi.ffi_call(
        "embedmesh_id_map_step", outs, input_output_aliases={i: i for i in range(8)}
    )(
        *state,
        ids,
        valid,
        jnp.asarray(step, jnp.int32).reshape(1),
        words,
        lfu=np.int64(bool(lfu)),
        admit_after=np.int64(admit_after),
        evict_batch=np.int64(evict_batch),
        halve_every=np.int64(halve_every),
        distinct=np.int64(bool(distinct)),
    )


def _id_map_step_state(index, row_info, row_slot, *args, **params) -> bool:
    return (
        index.dtype == jnp.uint32
        and index.ndim in (3, 4)
        and row_info.dtype == jnp.int32
        and row_slot.dtype == jnp.int32
    )


# op name -> (kernel, supports or None)
KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., bool] | None]] = {
    "gather_rows": (gather_rows, None),
    "scatter_rows": (scatter_rows, None),
    "segment_gather_sum": (segment_gather_sum, _storage_source),
    "segment_gather_sum_mapped": (segment_gather_sum_mapped, _storage_source),
    "dedup_sum": (dedup_sum, None),
    "sparse_update": (sparse_update, _fused),
    "backward_update": (backward_update, _fused),
    "exchange": (exchange, _in_process),
    "lookup_from_shards": (lookup_from_shards, _lookup_in_process),
    "backward_update_sharded": (backward_update_sharded, _fused_in_process),
    "pack_pooled_pairs": (pack_pooled_pairs, None),
    "pooled_partials": (pooled_partials, _storage_source),
    "pooled_backward_update": (pooled_backward_update, _fused_pooled),
    "exchange_pooled_pairs": (exchange_pooled_pairs, _pooled_pairs_kernel),
    "exchange_pooled_partials": (exchange_pooled_partials, _pooled_partials_kernel),
    "exchange_pooled_backward_update": (exchange_pooled_backward_update, _pooled_backward_kernel),
    "huge_page_copy": (memory.huge_page_copy, None),
    "full": (memory.full, None),
    "id_map_step": (id_map_step, _id_map_step_state),
}
