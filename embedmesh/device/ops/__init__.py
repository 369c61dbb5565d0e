"""The device ops of the per-shard program, and the one place that picks their kernels.

Each op has exactly one reference implementation (pure JAX, in `reference`; for
the composite ops, their definition below in terms of the other ops) and
optional per-platform kernels registered here by platform name ("cpu" from
`embedmesh.device.ops.cpu`, "gpu" from `embedmesh.device.ops.gpu`, "tpu" from
`embedmesh.device.ops.tpu`). A kernel may also be registered for one lowering platform of a
device platform ("cuda" of "gpu"), where it replaces that platform's: the
Pallas Triton kernels are CUDA only, so ROCm keeps the "gpu" ones. A call stages the
kernel of every platform whose kernel is ready and takes the call, and the
reference for the rest, through `jax.lax.platform_dependent`: the platform of
the computation (where its arrays are) chooses at lowering. `full`, which
makes a buffer on a given device, picks by that device's platform.

    register_kernel(op, platform, kernel, ready=..., supports=...)  # add a kernel
    kernel_for(op, platform, *args, **params)  # what a call there would run
    reference_of(op)                           # the op's reference

All ids are int32 and non-negative (negative ids wrap in `jnp.take`, so the
kernels and the references may differ there); `PAD_ID` and other ids past the
end are padding.

- `gather_rows(table, ids)`: `table[ids]`, zeros for ids `>= rows`.
- `scatter_rows(table, ids, rows)`: `table.at[ids].set(rows, mode="drop")`, in
  place (the table is aliased to the result; donate it to avoid a copy).
  Ids must be distinct (or duplicates carry equal rows).
- `segment_gather_sum(src, src_idx, gains, dst_idx, num_segments)`:
  `segment_sum(src[src_idx] * gains[:, None], dst_idx, num_segments)`, pairs
  with an out-of-range `src_idx` or `dst_idx` skipped; sums in pair order.
  With `src_map`, the op `segment_gather_sum_mapped` (rows `src[src_map]`).
  The lookup ops (this one, `lookup_from_shards`, `pooled_partials`,
  `exchange_pooled_partials`) take `quantization=(num_buckets, lower, upper)`, a
  table's `QuantizationConfig`: each row read is `reference.quantize`d before it is
  weighted; no kernel applies it, so such a call runs the op's reference. They take
  `columns=D` too, for a stack keeping its optimizer slots in its rows
  (`embedmesh.device.slots_in_rows`): only each row's first D columns are parameters;
  the TPU's lookup applies it, elsewhere such a call runs the reference. The updates
  need nothing: such a stack has no slot arrays and its optimizer, `SlotsInRows`,
  updates whole rows. `segment_gather_sum` and `lookup_from_shards` take a hint,
  `dst_order`: the same pairs in output-row order (the batch's `pairs_by_row`), summed
  in their place; the TPU's kernels then sort nothing.
- `dedup_sum(ids, grads)`: the distinct ids of `ids` ascending (padded with
  `PAD_ID`, ids equal to `PAD_ID` dropped) and the sum of the `grads` rows of
  each, in input order. Linear when every row of `ids` [N, U] is ascending (an
  N-way merge; the host preprocessing guarantees it), a sort otherwise.
- `sparse_update(optimizer, table, slots, ids, grads, step)`: the owner's
  update of the rows `ids`, in place. Reference: `gather_rows`, the
  optimizer's `update_rows`, `scatter_rows`. The CPU kernel fuses it in one
  pass over the rows for the optimizers that name it (`Optimizer.fused_kernel`:
  all six built in; `Adam(lazy_adam=False)` moves every row, densely). A
  bfloat16 or float16 stack runs `device.rounding.Rounded(optimizer)` (float32
  arithmetic, stochastic rounding to the storage type): the CPU kernel fuses it too
  (its optimizer's kernel, given `Rounded.rounding_words`); the reference gives
  its `update_rows` the row ids.
- `backward_update(...)`: one shard's backward (pairs -> per-row gradient
  sums) and update, as one op. Reference: `segment_gather_sum`, `dedup_sum`,
  `sparse_update`. The CPU kernel fuses them for the same optimizers: no
  [U, D] gradient buffer.
- `exchange(x, transport)`: inside `shard_map`, block j of axis 0 goes to
  device j, block s of the result came from device s (`all_to_all`, tiled).
  The `Transport` (`ops/transport.py`: axis name, device count, in-process or
  host job, channel) is one immutable value every op that crosses devices
  takes. The CPU kernel copies through shared memory when every device of the
  mesh is in this process (`transport.in_process`): XLA's CPU all_to_all moves
  ~1.4 GB/s here, a memcpy ~10x more. When the mesh spans processes that are
  all on this host (`transport.host_job`, the job's key from
  `embedmesh.device.peers`), through POSIX shared-memory segments named by the
  job and the call's `transport.channel` (`cpu/transport.h`: each cross-device
  kernel is one template over its two transports, in-process and shared memory),
  where XLA's goes through gloo's TCP (~0.2 GB/s). On those segments
  `lookup_from_shards` and `backward_update_sharded` have host kernels too:
  each owner gathers the rows asked of it into its segment and each device
  sums them in place; each owner applies the update from its sources' batches
  read there. A channel pairs the processes' calls: the same in every process,
  one per call site (a program tracing one twice is a `ValueError`); a peer
  that does not arrive fails the call after `EMBEDMESH_EXCHANGE_TIMEOUT_S`
  (default 60 s), sooner when its process exited.
- `lookup_from_shards(table_shard, unique_ids, pair_unique, pair_gains,
  pair_rows, num_rows, transport)`: inside `shard_map` over N > 1 shards, this
  device's activations [R, D] from the rows `unique_ids[s]` [N, U] of every
  shard s. Reference: `exchange` the ids, `gather_rows` on the owners,
  `exchange` the rows [N, U, D], `segment_gather_sum`. The CPU kernel, for
  in-process devices, reads each shard's table directly: no [N, U, D] buffer.
- `backward_update_sharded(...)`: `backward_update` over N > 1 shards inside
  `shard_map`: each device's per-unique gradient sums for every shard
  (`segment_gather_sum`), `exchange`d to the owners with the ids, merged
  (`dedup_sum`) and applied (`sparse_update`). The CPU kernel, for in-process
  devices and the fused optimizers, has each owner read its sources' pairs
  and activation gradients directly: no [N, U, D] buffer, no exchange.
- `pack_pooled_pairs(...)`, `pooled_partials(table, served)`,
  `pooled_backward_update(optimizer, table, slots, served, grads, keep, step)`:
  pooling on the owners (`strategies.pooled.lookup`). A source packs, per owner,
  the ids it asks and its pairs (position, row among the owner's, gain) into one int32
  message; an owner combines its sources' messages into partial sums, or applies their
  rows' gradients as one fused backward + update. References: unpacking
  (`unpack_pooled_pairs`), `segment_gather_sum`, `dedup_sum`, `sparse_update`; the
  CPU kernels do each in one pass (pooled.cc, update.cc).
- `exchange_pooled_pairs`, `exchange_pooled_partials`,
  `exchange_pooled_backward_update`: each of those with the exchange that carries
  its message (reference: the two ops). Between devices of one process and between
  processes of one host the CPU kernels write the message straight into its
  receiver's buffer (the shared segment across processes) and the owner's
  backward reads its sources' gradients there in place: no exchanged copy, no
  fresh buffer for the message.
- On GPU (`EMBEDMESH_GPU_KERNELS`, see `embedmesh.device.ops.gpu`): XLA
  variants that sort instead of contending on atomics (the default), or Pallas
  kernels fusing both updates for all five optimizers.
- On TPU (see `embedmesh.device.ops.tpu`): the in-place scatter a DMA a row, and
  Pallas pair loops for the lookup's combine and the backward's per-unique sums where
  rows are 256 lanes or more; stacks there are padded to whole 128-lane rows.
- `id_map_step(state, words, valid, step, ...)`: a whole call of the id map (hits, the
  admission sketch, a sweep, admissions), the state updated in place. Reference: the
  caller's jnp path (`fallback`, `id_map._map_ids`); the CPU kernel is that path bit for
  bit, and `map_ids` runs it wherever the CPU kernels are in use.
- `huge_page_copy(x)`, `full(shape, value, dtype, device)`: a copy, or a
  constant array made on a device; the CPU kernels put the buffer on
  transparent huge pages (see `embedmesh.device.ops.cpu.memory`).
  `EmbeddingCore` builds its tables and slots with `full`.

Where no kernel runs (another platform, no C++ compiler, a failed build,
`EMBEDMESH_CPU_KERNELS=0`, or a default backend other than CPU without
`EMBEDMESH_CPU_KERNELS=1`; see `embedmesh.device.ops.cpu`), every op runs its
reference, with the same semantics.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh._runtime import PAD_ID, pooled_pair_fields
from embedmesh.device.ops import cpu, gpu, packed, reference, staging, tpu
from embedmesh.device.ops.staging import shard_map_in_order as shard_map_in_order
from embedmesh.device.ops.transport import Transport

__all__ = [
    "HUGE_PAGE_MIN_BYTES",
    "Kernel",
    "PAD_ID",
    "Transport",
    "backward_update",
    "backward_update_sharded",
    "dedup_sum",
    "exchange",
    "exchange_pooled_backward_update",
    "exchange_pooled_pairs",
    "exchange_pooled_partials",
    "full",
    "gather_rows",
    "huge_page_copy",
    "id_map_step",
    "id_map_step_native",
    "kernel_for",
    "lookup_from_shards",
    "on_accelerators",
    "op_names",
    "pack_pooled_pairs",
    "pooled_backward_update",
    "pooled_pair_fields",
    "pooled_partials",
    "reads_pairs_by_row",
    "reference_of",
    "register_kernel",
    "scatter_rows",
    "segment_gather_sum",
    "slot_index",
    "sparse_update",
    "unpack_pooled_pairs",
]


# ---------------------------------------------------------------------------
# The registry


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One platform's kernel of an op.

    fn: called like the op's reference, `fn(*args, **params)`.
    ready: whether the kernel may be used in this process (may build it, once).
    supports: whether it takes a call, from the call's `(*args, **params)`
      (their shapes, dtypes, static parameters); None: every call.
    """

    fn: Callable
    ready: Callable[[], bool]
    supports: Callable[..., bool] | None = None
    # the optional row-read parameters it applies itself ("columns"); a call with another
    # set (`_ROW_READ`) runs the reference; and the hints it reads (`_HINTS`), which the
    # kernels that do not read them (and the references) are called without
    params: frozenset = frozenset()


_REFERENCES: dict[str, Callable] = {}
_REFERENCE_HINTS: dict[str, frozenset] = {}  # the hints (`_HINTS`) a reference passes on
_PLATFORM_KERNELS: dict[str, dict[str, Kernel]] = {}

# Platform names of `jax.Device.platform` -> those of `jax.lax.platform_dependent`.
_LOWERING_PLATFORMS = {"gpu": ("cuda", "rocm")}
# A lowering platform -> its device platform, whose kernel it runs unless it has its own.
_DEVICE_PLATFORM = {name: device for device, names in _LOWERING_PLATFORMS.items() for name in names}


def _define(op: str, ref: Callable, hints: tuple = ()) -> None:
    _REFERENCES[op] = ref
    _REFERENCE_HINTS[op] = frozenset(hints)
    _PLATFORM_KERNELS[op] = {}


def register_kernel(
    op: str,
    platform: str,
    fn: Callable,
    *,
    ready: Callable[[], bool] = lambda: True,
    supports: Callable[..., bool] | None = None,
    params: frozenset = frozenset(),
) -> None:
    """Make `fn` the kernel of `op` on `platform` ("cpu", "gpu", "tpu", or a lowering
    platform of one, "cuda" or "rocm", which then takes precedence there), replacing any.
    `params`: the row-read parameters (`_ROW_READ`) it takes."""
    if op not in _REFERENCES:
        raise KeyError(f"unknown op {op!r}; ops: {sorted(_REFERENCES)}")
    _PLATFORM_KERNELS[op][platform] = Kernel(fn, ready, supports, frozenset(params))


def on_accelerators(mesh) -> bool:
    """Whether `mesh`'s devices are accelerators, not the host's CPUs: XLA then compiles
    on host cores the step leaves idle (`embedmesh.job.steps.BACKGROUND_COMPILE`)."""
    return mesh.devices.flat[0].platform != "cpu"


def reference_of(op: str) -> Callable:
    """The reference implementation of `op`."""
    return _REFERENCES[op]


def reads_pairs_by_row(mesh) -> bool:
    """Whether the lookups on `mesh` read a batch's `pairs_by_row` (their `dst_order`
    hint): the TPU kernels', when they are on (`tpu.ready`). Elsewhere computing it
    would cost the host for nothing."""
    return staging.platform_of(mesh) == "tpu" and tpu.ready()


# The lookups' optional row-read parameters: `quantization` (no kernel applies it) and
# `columns` (a stack keeping its slots in its rows: only the first columns are parameters)
_ROW_READ = ("quantization", "columns")


# The ops' optional hints: arrays a kernel may read to skip work, the result the same
# without them: `dst_order` (`segment_gather_sum`'s).
_HINTS = ("dst_order",)


def _with_hints(fn, names: tuple, reads: frozenset):
    """`fn` taking `len(names)` more arguments, the last: passed on by name where `fn`
    reads them (`reads`), else dropped."""
    n = len(names)
    if not n:
        return fn
    return lambda *a, **kw: fn(*a[:-n], **kw, **{h: x for h, x in zip(names, a[-n:]) if h in reads})


def _reads_as(kernel: Kernel, params) -> bool:
    """Whether `kernel` applies every row-read parameter the call sets."""
    return all(params.get(p) is None or p in kernel.params for p in _ROW_READ)


def _takes(kernel: Kernel, args, params) -> bool:
    if not _reads_as(kernel, params):
        return False
    return kernel.ready() and (kernel.supports is None or kernel.supports(*args, **params))


def kernel_for(op: str, platform: str, *args, **params) -> Callable:
    """What a call of `op` on `platform` runs: its kernel there when one is registered,
    ready, and (given the call's arguments) takes them; else the reference."""
    for name in (platform, _DEVICE_PLATFORM.get(platform)):  # "cuda": then "gpu"'s
        kernel = _PLATFORM_KERNELS[op].get(name) if name else None
        if (
            kernel is not None
            and kernel.ready()
            and _reads_as(kernel, params)
            and (
                not (args or params) or kernel.supports is None or kernel.supports(*args, **params)
            )
        ):
            return kernel.fn
    return _REFERENCES[op]


def _dispatch(op: str, *args, **params):
    """`op(*args, **params)`: each platform's kernel where it takes the call, else the
    reference, chosen by the platform the computation is lowered for. A kernel of an op
    that crosses devices (a `transport`) also gets `after=`, the output of the last such
    call staged into the same program, and waits for it (`staging.crossing_order`)."""
    hints = {h: params[h] for h in _HINTS if params.get(h) is not None}
    params = {k: v for k, v in params.items() if k not in _HINTS}
    ref = functools.partial(_REFERENCES[op], **params)
    branches = {}
    # device platforms first: a lowering platform's own kernel replaces theirs
    registered = sorted(_PLATFORM_KERNELS[op].items(), key=lambda pk: pk[0] in _DEVICE_PLATFORM)
    for platform, kernel in registered:
        if _takes(kernel, args, params):
            fn = functools.partial(kernel.fn, **params)
            if hints:
                fn = _with_hints(fn, tuple(hints), kernel.params)
            for name in _LOWERING_PLATFORMS.get(platform, (platform,)):
                branches[name] = fn
    if not branches or any(isinstance(a, packed.PackedRows) for a in args):
        # packed rows: the references, composed of the ops that read them
        return _with_hints(ref, tuple(hints), _REFERENCE_HINTS[op])(*args, *hints.values())
    if hints:  # more arguments, the last: the kernels that read them get them
        ref = _with_hints(ref, tuple(hints), _REFERENCE_HINTS[op])
        args = (*args, *hints.values())
    crossing = "transport" in params
    previous = staging.crossing_order.last() if crossing else None
    default = ref
    if previous is not None:  # one more argument, the last: the kernels wait for it
        branches = {name: _waiting(fn) for name, fn in branches.items()}
        default = _waiting(ref, pass_on=False)
        args = (*args, previous)
    out = _on_lowering_platform(args, default, branches)
    if crossing:
        staging.crossing_order.called(out)
    return out


def _on_lowering_platform(args: tuple, default, branches: dict):
    """`jax.lax.platform_dependent(*args, default=default, **branches)`, tracing only
    what the program can run: inside a core's device program on a mesh of one platform,
    that platform's branch (or the default) alone. `platform_dependent` traces every
    branch it is given, and every platform's kernels are registered wherever embedmesh
    runs: each op of a CPU program traced the GPU and TPU kernels too (a quarter of a
    flax evaluation's trace time, 2026-12-07), and a TPU program the CPU's."""
    platform = staging.mesh_platform.name
    if platform is None:
        return jax.lax.platform_dependent(*args, default=default, **branches)
    names = _LOWERING_PLATFORMS.get(platform)
    if names is None:  # one lowering platform (cpu, tpu): its kernel, else the default
        return branches.get(platform, default)(*args)
    mine = {name: fn for name, fn in branches.items() if name in names}
    return jax.lax.platform_dependent(*args, default=default, **mine)


def _waiting(fn, pass_on: bool = True):
    """`fn` taking one more argument, the last: passed on as `after=` (a kernel), or
    dropped (a reference, whose XLA collectives XLA orders itself)."""
    if pass_on:
        return lambda *a: fn(*a[:-1], after=a[-1])
    return lambda *a: fn(*a[:-1])


def _dispatch_on(device, op: str, *args, **params):
    """`op(*args, **params)` with the kernel of `device`'s platform, if it takes the call."""
    kernel = _PLATFORM_KERNELS[op].get(device.platform)
    if kernel is not None and _takes(kernel, args, params):
        return kernel.fn(*args, **params)
    return _REFERENCES[op](*args, **params)


# ---------------------------------------------------------------------------
# The ops


def gather_rows(table, ids):
    """`table[ids]` for int32 `ids` of shape [n]; zero rows for ids outside the table
    (a `packed.PackedRows`: its logical rows)."""
    if isinstance(table, packed.PackedRows):
        return packed.gather(table, ids)
    return _dispatch("gather_rows", table, ids.astype(jnp.int32))


def scatter_rows(table, ids, rows):
    """`table.at[ids].set(rows, mode="drop")` in place; `ids` [n] distinct (PAD_ID allowed)."""
    if isinstance(table, packed.PackedRows):
        return packed.scatter(table, ids, rows)
    return _dispatch("scatter_rows", table, ids.astype(jnp.int32), rows.astype(table.dtype))


def _row_read(quantization, columns) -> dict:
    """The row-read parameters of a lookup op's call, only those set (a kernel that does
    not apply one leaves the call to the op's reference, `_takes`)."""
    out = {}
    if quantization is not None:
        out["quantization"] = tuple(quantization)
    if columns is not None:
        out["columns"] = int(columns)
    return out


def segment_gather_sum(
    src,
    src_idx,
    gains,
    dst_idx,
    num_segments: int,
    *,
    src_map=None,
    quantization=None,
    columns=None,
    dst_order=None,
):
    """`segment_sum(src[rows] * gains[:, None], dst_idx, num_segments)` in float32.

    src [M, D]; src_idx, gains, dst_idx [P]; `rows = src_idx`, or
    `src_map[src_idx]` with a `src_map` (then `src` can be a whole table and
    `src_map` the ids to read: no intermediate [len(src_map), D] buffer). Pairs
    whose index (or mapped row) is out of range, or whose `dst_idx` is outside
    `[0, num_segments)`, contribute nothing. Each segment sums in pair order.
    `quantization` `(num_buckets, lower, upper)`: the rows are `reference.quantize`d
    before they are weighted and summed (a lookup of a table with a QuantizationConfig).
    `columns` (with `src_map`): only each row's first `columns` columns are read and
    summed (a stack keeping its slots in its rows: its parameters).
    `dst_order`, a hint: empty (the pairs come by `dst_idx`, invalid last) or the same
    pairs so (`(src_idx, gains, dst_idx)`, summed instead): the TPU's kernels sort nothing."""
    if isinstance(dst_order, tuple):
        src_idx, gains, dst_idx = dst_order
        dst_order = jnp.zeros((0,), jnp.int32)
    src_idx = src_idx.astype(jnp.int32)
    gains = gains.astype(jnp.float32)
    dst_idx = dst_idx.astype(jnp.int32)
    if isinstance(src, packed.PackedRows):  # the mapped rows read, then summed as rows
        if src_map is None:  # each pair's row read: then the pairs index their own rows
            src_map, src_idx = src_idx, jnp.arange(src_idx.shape[0], dtype=jnp.int32)
        return segment_gather_sum(
            gather_rows(src, src_map),
            src_idx,
            gains,
            dst_idx,
            num_segments,
            quantization=quantization,
            columns=columns,
            dst_order=dst_order,
        )
    if src_map is None:
        src = (src if columns is None else src[:, :columns]).astype(jnp.float32)
        if quantization is not None:
            src = reference.quantize(src, quantization)
        return _dispatch(
            "segment_gather_sum",
            src,
            src_idx,
            gains,
            dst_idx,
            num_segments=num_segments,
            dst_order=dst_order,
        )
    return _dispatch(
        "segment_gather_sum_mapped",
        src,
        src_map.astype(jnp.int32),
        src_idx,
        gains,
        dst_idx,
        num_segments=num_segments,
        dst_order=dst_order,
        **_row_read(quantization, columns),
    )


def dedup_sum(ids, grads):
    """(distinct ids ascending, PAD_ID padded; their summed grads) for ids [N, U], grads [N*U, D].

    Ids equal to PAD_ID are dropped. Each row of `ids` ascending makes it a
    linear merge (in place when N == 1: donate-free, `grads` is dead after);
    any order is correct.
    """
    ids = ids.astype(jnp.int32)
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids.reshape(ids.shape[0], -1)
    return _dispatch("dedup_sum", ids, grads.astype(jnp.float32))


def sparse_update(optimizer, table, slots: dict, ids, grads, step):
    """Apply `optimizer` to the rows `ids` (distinct; PAD_ID skipped) of `table` and `slots`.

    Returns `(new table, new slots)`, updated in place when the caller donates
    them. The reference gathers the rows, calls `optimizer.update_rows` and
    scatters them back; a fused kernel (`optimizer.fused_kernel`) does the
    same float32 arithmetic in the same order, in one pass.
    """
    return _dispatch(
        "sparse_update",
        table,
        dict(slots),
        ids.astype(jnp.int32),
        grads,
        optimizer=optimizer,
        step=step,
    )


def _sparse_update_reference(table, slots, ids, grads, *, optimizer, step):
    """Gather the rows and slots, `optimizer.update_rows`, scatter them back (any optimizer;
    packed rows: their stored rows moved once, `packed.sparse_update`)."""
    if isinstance(table, packed.PackedRows):
        return packed.sparse_update(optimizer, table, slots, ids, grads, step=step)
    rows = gather_rows(table, ids)
    old = {k: gather_rows(v, ids) for k, v in slots.items()}
    if getattr(optimizer, "takes_ids", False):  # stochastic rounding (`device.rounding`)
        new_rows, new_slots = optimizer.update_rows(rows, old, grads, step, ids=ids)
    else:
        new_rows, new_slots = optimizer.update_rows(rows, old, grads, step)
    return (
        scatter_rows(table, ids, new_rows),
        {k: scatter_rows(v, ids, new_slots[k]) for k, v in slots.items()},
    )


def backward_update(
    optimizer,
    table,
    slots: dict,
    ids,
    act_grads,
    pair_rows,
    pair_unique,
    pair_gains,
    step,
    *,
    dst_order=None,
):
    """One shard's whole backward + update: `sparse_update` of the rows `ids` [U] with
    `dedup_sum(ids, segment_gather_sum(act_grads, pair_rows, pair_gains, pair_unique, U))`.

    A fused kernel does it in one pass over the unique rows (no [U, D]
    gradient buffer): the same sums in the same order, so the same result.
    `dst_order`: `segment_gather_sum`'s hint, the pairs' order by `pair_unique`.
    """
    return _dispatch(
        "backward_update",
        table,
        dict(slots),
        ids.reshape(-1).astype(jnp.int32),
        act_grads.astype(jnp.float32),
        pair_rows.reshape(-1).astype(jnp.int32),
        pair_unique.reshape(-1).astype(jnp.int32),
        pair_gains.reshape(-1).astype(jnp.float32),
        optimizer=optimizer,
        step=step,
        dst_order=dst_order,
    )


def _backward_update_reference(
    table,
    slots,
    ids,
    act_grads,
    pair_rows,
    pair_unique,
    pair_gains,
    *,
    optimizer,
    step,
    dst_order=None,
):
    """The backward (`segment_gather_sum`, `dedup_sum`), then `sparse_update`."""
    per_unique = segment_gather_sum(
        act_grads, pair_rows, pair_gains, pair_unique, ids.shape[0], dst_order=dst_order
    )
    uniq, grads = dedup_sum(ids.reshape(1, -1), per_unique)
    return sparse_update(optimizer, table, slots, uniq, grads, step)


def exchange(x, transport: Transport):
    """Block j of axis 0 to device j of the transport's axis (inside `shard_map`).

    `transport`: where the devices are and the call's channel (`Transport`: in one
    process they can read each other's buffers; processes of one host exchange
    through shared memory; the processes' calls pair up by the channel)."""
    if transport.num_shards == 1:
        return x
    return _dispatch("exchange", x, transport=transport)


def slot_index(pair_unique, unique_capacity: int):
    """Flat [N * P] positions of the pairs' ids in the N stacked [U] unique lists (block s
    is `s * U + pair_unique[s]`); a position outside [0, U) becomes N * U, which segment
    sums drop, rather than naming another block's row."""
    n = pair_unique.shape[0]
    valid = (pair_unique >= 0) & (pair_unique < unique_capacity)
    flat = jnp.arange(n, dtype=jnp.int32)[:, None] * unique_capacity + pair_unique
    return jnp.where(valid, flat, n * unique_capacity).reshape(-1).astype(jnp.int32)


def lookup_from_shards(
    table_shard,
    unique_ids,
    pair_unique,
    pair_gains,
    pair_rows,
    num_rows: int,
    transport: Transport,
    quantization=None,
    columns=None,
    dst_order=None,
):
    """Activations [num_rows, D] (float32) of this device: `sum gains * shard_s[ids]` over
    its pairs (`pair_*` [N, P]) into the rows of every shard s (`unique_ids` [N, U]).
    Pairs with `pair_unique` outside [0, U), a padding id or `pair_rows` outside
    [0, num_rows) contribute nothing. `quantization`, `columns`, `dst_order` (its pairs'
    `src_idx`: `slot_index`'s): as `segment_gather_sum`'s (the owners quantize the rows
    they send, only their columns)."""
    return _dispatch(
        "lookup_from_shards",
        table_shard,
        unique_ids.astype(jnp.int32),
        pair_unique.astype(jnp.int32),
        pair_gains.astype(jnp.float32),
        pair_rows.astype(jnp.int32),
        num_rows=num_rows,
        transport=transport,
        dst_order=dst_order,
        **_row_read(quantization, columns),
    )


def _lookup_from_shards_reference(
    table,
    unique_ids,
    pair_unique,
    pair_gains,
    pair_rows,
    *,
    num_rows,
    transport,
    quantization=None,
    columns=None,
    dst_order=None,
):
    """Send the ids to their owners, gather there, send the rows back, combine."""
    served = exchange(unique_ids, transport.at("ids"))
    rows = gather_rows(table, served.reshape(-1)).reshape(served.shape + table.shape[1:])
    if columns is not None:
        rows = rows[..., :columns]
    if quantization is not None:
        rows = reference.quantize(rows, quantization)
    rows = exchange(rows, transport.at("rows"))
    n, u, d = rows.shape
    return segment_gather_sum(
        rows.reshape(n * u, d),
        slot_index(pair_unique, u),
        pair_gains.reshape(-1),
        pair_rows.reshape(-1),
        num_rows,
        dst_order=dst_order,
    )


def backward_update_sharded(
    optimizer,
    table,
    slots: dict,
    unique_ids,
    act_grads,
    pair_rows,
    pair_unique,
    pair_gains,
    keep,
    step,
    transport: Transport,
    *,
    replicated: bool = False,
):
    """This shard's update from every device's batch (inside `shard_map`, N > 1):
    `unique_ids`, `pair_*` [N, ...] and `act_grads` [R, D] are this device's, as for
    `lookup_from_shards`; `keep` (traced bool) False moves no row. Returns (table, slots).

    `replicated`: every device holds the whole table (data_parallel) and `unique_ids`,
    `pair_*` are [1, ...], its one partition: each replica applies every device's
    partition, merged in device order (the same rows, sums and order on every replica,
    so the replicas stay bitwise equal)."""
    return _dispatch(
        "backward_update_sharded",
        table,
        dict(slots),
        unique_ids.astype(jnp.int32),
        act_grads.astype(jnp.float32),
        pair_rows.astype(jnp.int32),
        pair_unique.astype(jnp.int32),
        pair_gains.astype(jnp.float32),
        jnp.asarray(keep, bool),
        optimizer=optimizer,
        step=step,
        transport=transport,
        replicated=replicated,
    )


def _backward_update_sharded_reference(
    table, slots, unique_ids, act_grads, *pairs, optimizer, step, transport, replicated=False
):
    """Per-unique sums for every shard, sent with the ids to the owners, merged, applied.
    Replicated: this device's per-unique sums and ids to every device (one message, the
    ids' bits in a column of their own), merged and applied by every replica. `pairs`:
    the op's (pair_rows, pair_unique, pair_gains, keep)."""
    pair_rows, pair_unique, pair_gains, keep = pairs
    n, u = unique_ids.shape  # N partitions; a replica's one
    per_unique = segment_gather_sum(
        act_grads, pair_rows.reshape(-1), pair_gains.reshape(-1), slot_index(pair_unique, u), n * u
    )
    if replicated:
        n = transport.num_shards
        ids_bits = jax.lax.bitcast_convert_type(unique_ids.reshape(u, 1), jnp.float32)
        message = jnp.concatenate([ids_bits, per_unique], axis=1)  # [U, 1 + D]
        got = exchange(
            jnp.broadcast_to(message[None], (n,) + message.shape), transport.at("gathered")
        )
        served = jax.lax.bitcast_convert_type(got[..., 0], jnp.int32)  # [N, U], device order
        grads = got[..., 1:]
    else:
        grads = exchange(per_unique.reshape(n, u, -1), transport.at("grads"))
        served = exchange(unique_ids, transport.at("ids"))
    served = jnp.where(keep, served, PAD_ID)
    uniq, g_sum = dedup_sum(served, grads.reshape(n * u, -1))
    return sparse_update(optimizer, table, slots, uniq, g_sum, step)


# ---------------------------------------------------------------------------
# Pooling on the owner (`shard_program.lookup_pooled`): a source's pairs as one message


def pack_pooled_pairs(unique_ids, pair_rows, pair_unique, pair_gains, compact, *, width: int):
    """The int32 message [N, U + P * k] a source sends its owners when they pool.

    Block o: the ids it asks of shard o (`unique_ids[o]`, [U]), then per pair its id's
    position (U: none), its row among the `width` (Rc) rows shard o feeds (Rc: none)
    and its gain's float32 bits (`pooled_pair_fields`: k = 2 or 3 words). A row is
    `compact[o][pair_rows]` (`compact` [N, R + 1], `PooledRows.compact`), or with
    `compact` of shape [N, 0] the row itself (every shard feeds every row: Rc = R).
    Positions and rows out of range become "none"."""
    args = _pooled_pairs_args(unique_ids, pair_rows, pair_unique, pair_gains, compact)
    return _dispatch("pack_pooled_pairs", *args, width=width)


def _pooled_pairs_args(unique_ids, pair_rows, pair_unique, pair_gains, compact) -> tuple:
    """A source's pooled-pair arrays in the dtypes the ops take (gains float32)."""
    i32 = (x.astype(jnp.int32) for x in (unique_ids, pair_rows, pair_unique))
    return (*i32, pair_gains.astype(jnp.float32), compact.astype(jnp.int32))


def _pack_pooled_pairs_reference(unique_ids, pair_rows, pair_unique, pair_gains, compact, *, width):
    n, u = unique_ids.shape
    p = pair_rows.shape[1]

    def none_past(x, last):  # x outside [0, last): last
        return jnp.where((x < 0) | (x > last), last, x)

    if compact.shape[1]:  # compact[R] is "none"
        rows = jnp.take_along_axis(compact, none_past(pair_rows, compact.shape[1] - 1), axis=1)
    else:
        rows = pair_rows
    rows = none_past(rows, width)  # in [0, Rc]: Rc is "none"
    position = none_past(pair_unique, u)  # in [0, U]: U is "none"
    gains = jax.lax.bitcast_convert_type(pair_gains, jnp.int32)
    k = pooled_pair_fields(u, width)
    fields = [position * (width + 1) + rows] if k == 2 else [position, rows]
    pairs = jnp.stack(fields + [gains], axis=-1).reshape(n, p * k)
    return jnp.concatenate([unique_ids, pairs], axis=1)


def unpack_pooled_pairs(served, *, unique_capacity: int, width: int):
    """What an owner reads of the messages `served` [N, U + P * k] from its N sources:
    (ids [N, U], each pair's slot [N * P] in the stacked id lists (none: N * U), its
    row [N * P] in the sources' stacked Rc-row blocks (none: N * Rc), its gain [N * P])."""
    n, u, rc = served.shape[0], unique_capacity, width
    k = pooled_pair_fields(u, rc)
    p = (served.shape[1] - u) // k
    ids = served[:, :u]
    pairs = served[:, u : u + p * k].reshape(n, p, k)
    if k == 2:
        position, src = pairs[..., 0] // (rc + 1), pairs[..., 0] % (rc + 1)
    else:
        position, src = pairs[..., 0], pairs[..., 1]
    slot = slot_index(position, u)
    valid = (src >= 0) & (src < rc)
    row = jnp.where(valid, jnp.arange(n, dtype=jnp.int32)[:, None] * rc + src, n * rc)
    gains = jax.lax.bitcast_convert_type(pairs[..., -1], jnp.float32)
    return ids, slot, row.reshape(-1).astype(jnp.int32), gains.reshape(-1)


def pooled_partials(
    table, served, *, unique_capacity: int, width: int, quantization=None, columns=None
):
    """An owner's partial sums [N * Rc, D] (float32) for its N sources' messages
    (`pack_pooled_pairs`): block s row j sums gain * table[id] over source s's pairs
    of row j, in pair order (`quantization`, `columns`: as `segment_gather_sum`'s)."""
    pooled = dict(unique_capacity=unique_capacity, width=width)
    served = served.astype(jnp.int32)
    return _dispatch("pooled_partials", table, served, **pooled, **_row_read(quantization, columns))


def _pooled_partials_reference(
    table, served, *, unique_capacity, width, quantization=None, columns=None
):
    ids, slot, row, gains = unpack_pooled_pairs(
        served, unique_capacity=unique_capacity, width=width
    )
    n = served.shape[0]
    return segment_gather_sum(
        table,
        slot,
        gains,
        row,
        n * width,
        src_map=ids.reshape(-1),
        quantization=quantization,
        columns=columns,
    )


def pooled_backward_update(
    optimizer, table, slots: dict, served, grads, keep, step, *, unique_capacity: int, width: int
):
    """An owner's backward + update from its N sources' messages `served` (as for
    `pooled_partials`) and the gradients `grads` [N * Rc, D] of their rows: per
    distinct id, the sum over sources (in order) of each source's pair-order sum, then
    one update of its row; `keep` (traced bool) False moves no row. Returns (table,
    slots). Reference: `segment_gather_sum`, `dedup_sum`, `sparse_update`; the CPU
    kernel fuses them for every optimizer that names a fused kernel (no [N * U, D]
    buffer)."""
    args = _owner_update_args(table, slots, served, grads, keep)
    pooled = dict(unique_capacity=unique_capacity, width=width)
    return _dispatch("pooled_backward_update", *args, optimizer=optimizer, step=step, **pooled)


def _owner_update_args(table, slots, served, grads, keep) -> tuple:
    """An owner's update arrays (`pooled_backward_update`'s) in the dtypes the ops take."""
    served, grads = served.astype(jnp.int32), grads.astype(jnp.float32)
    return table, dict(slots), served, grads, jnp.asarray(keep, bool)


def _pooled_backward_update_reference(
    table, slots, served, grads, keep, *, optimizer, step, unique_capacity, width
):
    ids, slot, row, gains = unpack_pooled_pairs(
        served, unique_capacity=unique_capacity, width=width
    )
    n = served.shape[0]
    per_unique = segment_gather_sum(grads, row, gains, slot, n * unique_capacity)
    uniq, g_sum = dedup_sum(jnp.where(keep, ids, PAD_ID), per_unique)
    return sparse_update(optimizer, table, slots, uniq, g_sum, step)


# The same, each fused with its exchange: between processes of one host the CPU kernels
# write the message straight into the shared segment and read the peers' in place.


def exchange_pooled_pairs(
    unique_ids,
    pair_rows,
    pair_unique,
    pair_gains,
    compact,
    *,
    width: int,
    transport: Transport,
):
    """The owners' view of this device's batch: `exchange(pack_pooled_pairs(...))`, block
    s the message [U + P * k] source s sent this owner."""
    args = _pooled_pairs_args(unique_ids, pair_rows, pair_unique, pair_gains, compact)
    return _dispatch("exchange_pooled_pairs", *args, width=width, transport=transport)


def _exchange_pooled_pairs_reference(
    unique_ids, pair_rows, pair_unique, pair_gains, compact, *, width, transport
):
    message = pack_pooled_pairs(
        unique_ids, pair_rows, pair_unique, pair_gains, compact, width=width
    )
    return exchange(message, transport)


def exchange_pooled_partials(
    table,
    served,
    *,
    unique_capacity: int,
    width: int,
    transport: Transport,
    quantization=None,
    columns=None,
):
    """This device's partial activations from every owner [N * Rc, D]:
    `exchange(pooled_partials(table, served))`, block s the partials owner s summed for
    this device's rows."""
    pooled = dict(unique_capacity=unique_capacity, width=width, transport=transport)
    served = served.astype(jnp.int32)
    return _dispatch(
        "exchange_pooled_partials", table, served, **pooled, **_row_read(quantization, columns)
    )


def _exchange_pooled_partials_reference(
    table, served, *, unique_capacity, width, transport, quantization=None, columns=None
):
    n, d = served.shape[0], table.shape[-1] if columns is None else columns
    partial = pooled_partials(
        table,
        served,
        unique_capacity=unique_capacity,
        width=width,
        quantization=quantization,
        columns=columns,
    )
    back = exchange(partial.reshape(n, width, d), transport)
    return back.reshape(n * width, d)


def exchange_pooled_backward_update(
    optimizer,
    table,
    slots: dict,
    served,
    grads,
    keep,
    step,
    *,
    unique_capacity: int,
    width: int,
    transport: Transport,
    blocks=None,
):
    """`pooled_backward_update` of this owner from the gradients every source sends it:
    `grads` [N, Rc, D] block o are this device's gradients of the rows owner o feeds
    (`exchange`d, then applied over `served`). Returns (table, slots).

    `blocks`: `grads` is instead a sequence of float32 arrays of rows (e.g. slices of the
    activation gradients, one a feature), and `blocks[o]` the `(part, first row, count)`
    segments that make block o, in order (zero rows past them up to `width`): the CPU
    kernel reads the rows where they are, with no concatenation into [N, Rc, D] first."""
    if blocks is not None:
        parts = tuple(jnp.asarray(g, jnp.float32) for g in grads)
        blocks = tuple(tuple((int(p), int(f), int(c)) for p, f, c in b) for b in blocks)
        _check_blocks(parts, blocks, width)
        args = _owner_update_args(table, slots, served, jnp.zeros((0,), jnp.float32), keep)
        args = (*args[:3], parts, args[4])
    else:
        args = _owner_update_args(table, slots, served, grads, keep)
    pooled = dict(unique_capacity=unique_capacity, width=width, transport=transport)
    if blocks is not None:
        pooled["blocks"] = blocks
    return _dispatch(
        "exchange_pooled_backward_update", *args, optimizer=optimizer, step=step, **pooled
    )


def _check_blocks(parts, blocks, width: int) -> None:
    """ValueError naming the segment when `blocks` does not fit `parts` and `width`."""
    for o, segments in enumerate(blocks):
        total = 0
        for p, first, count in segments:
            rows = parts[p].shape[0] if 0 <= p < len(parts) else None
            if rows is None or first < 0 or count < 0 or first + count > rows:
                raise ValueError(
                    f"exchange_pooled_backward_update: block {o}'s segment (part {p}, first "
                    f"{first}, count {count}) is outside the parts' rows"
                )
            total += count
        if total > width:
            raise ValueError(
                f"exchange_pooled_backward_update: block {o} has {total} rows, over width {width}"
            )


def _blocks_of_parts(parts, blocks, width: int):
    """The [N, width, D] gradients `blocks` of `parts` make (zeros past each block's rows)."""
    d = parts[0].shape[-1] if parts else 0
    out = []
    for segments in blocks:
        rows = [parts[p][first : first + count] for p, first, count in segments]
        fill = width - sum(count for _, _, count in segments)
        out.append(jnp.concatenate(rows + [jnp.zeros((fill, d), jnp.float32)], axis=0))
    return jnp.stack(out)


def _exchange_pooled_backward_update_reference(
    table, slots, served, grads, keep, *, optimizer, step, transport, blocks=None, **pooled
):
    if blocks is not None:
        grads = _blocks_of_parts(grads, blocks, pooled["width"])
    n, rc, d = grads.shape
    received = exchange(grads, transport).reshape(n * rc, d)
    return pooled_backward_update(optimizer, table, slots, served, received, keep, step, **pooled)


def huge_page_copy(x):
    """A copy of `x` in a buffer advised to use transparent huge pages (CPU); `x` elsewhere."""
    return _dispatch("huge_page_copy", x)


HUGE_PAGE_MIN_BYTES = 64 << 20


def full(shape, value, dtype, device, min_bytes: int = HUGE_PAGE_MIN_BYTES):
    """`jnp.full(shape, value, dtype)` made on `device`. A buffer of at least
    `min_bytes` comes from the `full` kernel of the device's platform when it
    has one (CPU: on transparent huge pages); a smaller one from the reference."""
    shape = tuple(int(x) for x in shape)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    value = jax.device_put(np.asarray(value, dtype), device)
    if nbytes < min_bytes:
        return reference.full(shape, value, dtype, device)
    return _dispatch_on(device, "full", shape, value, dtype, device)


def id_map_step_native() -> bool:
    """Whether `id_map_step` runs a kernel in this process (the CPU kernels in use; not
    under `EMBEDMESH_CPU_KERNELS=0`, nor with another default backend). `map_ids` calls
    the op only then: elsewhere its reference is the jnp path itself."""
    return kernel_for("id_map_step", "cpu") is not _REFERENCES["id_map_step"]


def id_map_step(
    state: tuple,
    words,
    valid,
    step,
    *,
    keys,
    lfu: bool,
    admit_after: int,
    evict_batch: int,
    halve_every: int,
    distinct: bool,
    fallback,
):
    """A whole call of the id map (`embedmesh.device.id_map.map_ids`): `state` its eight
    arrays (`IdMapState`'s fields in order), `words` uint32 [n, 2] the raw ids' (high,
    low) words, `valid` bool [n], `step` int32; `keys` the two bucket hashes' and the tag's seed
    words then each sketch row's (3 each); the config's `lfu`, `admit_after`, `evict_batch`,
    `halve_every`; `distinct`: no valid id occurs twice. Returns the new state's eight
    arrays, `rows` int32 [n], `fresh` bool [n] and `stats` int32 [6] (`id_map.ID_STATS`'
    order: hits, admissions, evictions, pending, refused, occupancy).

    The reference is `fallback` (the caller's jnp path, `id_map._map_ids`, called with the
    same positional arguments: the ops know no id map); the CPU kernel (cpu/id_map.cc)
    is that path bit for bit on a consistent state (a row word of a live slot below the
    capacity, counters not negative), with the state updated in place."""
    return _dispatch(
        "id_map_step",
        *state,
        words.reshape(-1, 2).astype(jnp.uint32),
        valid.reshape(-1).astype(bool),
        jnp.asarray(step, jnp.int32),
        keys=tuple(int(k) for k in keys),
        lfu=bool(lfu),
        admit_after=int(admit_after),
        evict_batch=int(evict_batch),
        halve_every=int(halve_every),
        distinct=bool(distinct),
        fallback=fallback,
    )


def _id_map_step_reference(*args, fallback, **params):
    return fallback(*args)


_define("gather_rows", reference.gather_rows)
_define("scatter_rows", reference.scatter_rows)
_define("segment_gather_sum", reference.segment_gather_sum)
_define("segment_gather_sum_mapped", reference.segment_gather_sum_mapped)
_define("dedup_sum", reference.dedup_sum)
_define("sparse_update", _sparse_update_reference)
_define("backward_update", _backward_update_reference, hints=_HINTS)
_define("exchange", reference.exchange)
_define("lookup_from_shards", _lookup_from_shards_reference, hints=_HINTS)
_define("backward_update_sharded", _backward_update_sharded_reference)
_define("pack_pooled_pairs", _pack_pooled_pairs_reference)
_define("pooled_partials", _pooled_partials_reference)
_define("pooled_backward_update", _pooled_backward_update_reference)
_define("exchange_pooled_pairs", _exchange_pooled_pairs_reference)
_define("exchange_pooled_partials", _exchange_pooled_partials_reference)
_define("exchange_pooled_backward_update", _exchange_pooled_backward_update_reference)
_define("huge_page_copy", reference.huge_page_copy)
_define("full", reference.full)
_define("id_map_step", _id_map_step_reference)

for _op, (_fn, _supports) in cpu.KERNELS.items():
    register_kernel(_op, "cpu", _fn, ready=cpu.ready, supports=_supports)
for _platform, _table in (("gpu", gpu.KERNELS), ("cuda", gpu.CUDA_KERNELS)):
    for _op, (_fn, _supports) in _table.items():
        register_kernel(_op, _platform, _fn, ready=gpu.ready, supports=_supports)
for _op, (_fn, _supports) in tpu.KERNELS.items():
    register_kernel(
        _op,
        "tpu",
        _fn,
        ready=tpu.ready,
        supports=_supports,
        params=tpu.ROW_READ.get(_op, ()) + tpu.HINTS.get(_op, ()),
    )
del _op, _fn, _supports, _platform, _table


def op_names() -> tuple[str, ...]:
    """The names of the ops, in definition order."""
    return tuple(_REFERENCES)
