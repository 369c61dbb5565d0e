"""The device side of a host tier: tables bigger than the devices, trained exactly.

A tiered stack's rows and slots live in host memory (`embedmesh.host.tier.StackTier`);
each device holds a cache of `C` rows of its shard in the stack's own device layout
(its rows with their slots, as the step stores them), so the step programs run
unchanged on the cache as if it were the table. `TieredCore` is an `EmbeddingCore`
whose plan gives each tiered stack `C` rows a shard and no tables (nothing of a table
is built on a device); it holds the full plan and the host side, and

- `swap_in(state, csr, pending)`: before a batch's lookup, its misses gathered on the
  host and written into the cache by one small program (`_swap_program`), which hands
  back the rows it replaces (written to the host one batch later), and the batch's rows
  mapped to cache rows, placed on the mesh. Unpipelined, the job applies a pending
  update first (on the devices while the host swaps); pipelined, the rows of the update
  still pending (the batch in flight) are never replaced, so the swap commutes with it
  and the fused step program runs as it is;
- `init`, `state_from_tables`, `read_field` (tables, variables, checkpoints) and
  `host_blocks` read and write the host rows, overlaid with the cached rows of a state.

Exact: every optimizer that updates only the rows a batch touches gives the tables of
the all-in-device run (a row is updated only while cached, by the same programs); one
that moves every row each step (Adam with `lazy_adam=False`) is refused, as are
bfloat16 / float16 stacks (their rounding is keyed by rows of the table), tables of raw
ids and jobs of several processes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from embedmesh.device import slots_in_rows
from embedmesh.device.core import EmbeddingCore, EmbeddingState
from embedmesh.layout import sharding as mod_sharding

__all__ = ["HOST_TIER_MODES", "TieredCore", "core_for", "tiered_stacks"]

_log = logging.getLogger("embedmesh")

HOST_TIER_MODES = ("auto", "on", "off")
# the share of a device's memory limit its caches may take (the rest: the step's batch
# and buffers, the other stacks)
CACHE_FRACTION = 0.75


def tiered_stacks(plan) -> list:
    """The stacks a host tier holds: every one not replicated on every device."""
    return [s for s in plan.stacks if not s.replicated]


def _check_tierable(plan, optimizer_of, mesh) -> None:
    if len({d.process_index for d in mesh.devices.flat}) > 1:
        raise NotImplementedError("a host tier runs in one process (its mesh spans several)")
    for s in tiered_stacks(plan):
        opt = optimizer_of(s)
        names = list(s.tables)
        if opt is not None and opt.touches_all_rows:
            raise ValueError(
                f"host tier: tables {names} use {type(opt).__name__} with lazy_adam=False, "
                f"which moves every row each step: a host tier holds rows the step does "
                f"not see. Use lazy_adam=True or host_tier='off'"
            )
        if np.dtype(s.dtype) != np.float32 or s.slots_dtype != np.float32:
            raise ValueError(
                f"host tier: tables {names} are {np.dtype(s.dtype).name} (slots "
                f"{s.slots_dtype.name}): a host tier holds float32 stacks only"
            )
        if any(getattr(plan.table_config(t), "id_map", None) is not None for t in s.tables):
            raise ValueError(f"host tier: tables {names} map raw ids (TableConfig.id_map)")


def _cache_rows(plan, given: int | None, limit: float | None) -> dict:
    """`{stack: cache rows a device}`: `given`, else the stacks' share of `limit`'s
    `CACHE_FRACTION` less the other stacks' bytes (the stack's own rows without limit)."""
    stacks = tiered_stacks(plan)
    if given is not None:
        return {s.name: min(int(given), s.rows_per_shard) for s in stacks}
    if limit is None:
        return {s.name: s.rows_per_shard for s in stacks}
    others = sum(plan.row_bytes(s.name) * s.rows_per_shard for s in plan.stacks if s.replicated)
    budget = CACHE_FRACTION * float(limit) - others
    full = sum(plan.row_bytes(s.name) * s.rows_per_shard for s in stacks)
    out = {}
    for s in stacks:
        share = budget * plan.row_bytes(s.name) * s.rows_per_shard / max(full, 1)
        out[s.name] = max(1, min(s.rows_per_shard, int(share // plan.row_bytes(s.name))))
    return out


def core_for(
    plan,
    mesh,
    optimizer,
    exchange,
    *,
    rounding_seed: int,
    mode: str = "auto",
    cache_rows: int | None = None,
    memory_limit: float | None = None,
    make_tier=None,
):
    """The core of a job: a `TieredCore` where `mode` is "on", or "auto" and the plan's
    bytes a device exceed `memory_limit` (said in the log, INFO), else an `EmbeddingCore`.
    `make_tier`: the host side's class (`embedmesh.host.tier.StackTier`: the job layer
    hands it over, the device layer imports nothing of the host's)."""
    over = memory_limit is not None and max(plan.bytes_per_device, default=0) > memory_limit
    if mode == "off" or (mode == "auto" and not over):
        return EmbeddingCore(plan, mesh, optimizer, exchange, rounding_seed=rounding_seed)
    rows = _cache_rows(plan, cache_rows, memory_limit)
    core = TieredCore(
        plan, rows, mesh, optimizer, exchange, rounding_seed=rounding_seed, make_tier=make_tier
    )
    gb = max(plan.bytes_per_device, default=0) / 1e9
    _log.info(
        "host tier (%s): tables and slots need %.2f GB a device%s; stacks %s keep their rows "
        "in host memory, the devices a cache of %s rows each",
        "requested" if mode == "on" else "chosen",
        gb,
        f", over the limit of {memory_limit / 1e9:.2f} GB" if over and memory_limit else "",
        sorted(rows),
        {k: v for k, v in sorted(rows.items())},
    )
    return core


@functools.cache
def _swap_program(mesh, axes, count: int):
    """jit: (cache arrays, each `[N*C, ...]`; slots `[N, M]`; rows, one a cache array,
    `[N, M, ...]`) -> (the arrays with `rows` written at `slots`, the rows they held
    there): each device its own shard, in place (the arrays donated)."""

    def body(arrays, slots, rows):
        idx = slots[0]
        old = tuple(a.at[idx].get(mode="fill", fill_value=0)[None] for a in arrays)
        new = tuple(a.at[idx].set(r[0].astype(a.dtype), mode="drop") for a, r in zip(arrays, rows))
        return new, old

    spec = (P(axes),) * count
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, P(axes), spec),
            out_specs=(spec, spec),
            check_vma=False,
        ),
        donate_argnums=0,
    )


def _cache_plan(plan, rows: dict):
    """`plan` with each stack of `rows` holding `rows[stack]` rows a shard and no table
    (the programs see the cache as the stack; nothing of a table is built on it)."""
    stacks = tuple(
        dataclasses.replace(s, num_rows=s.num_shards * rows[s.name], tables=())
        if s.name in rows
        else s
        for s in plan.stacks
    )
    return dataclasses.replace(plan, stacks=stacks)


class TieredCore(EmbeddingCore):
    """An `EmbeddingCore` whose tiered stacks are device caches of host rows (see the
    module). `full_plan`: the job's plan; `tier`: `{stack: make_tier(name, tables,
    shards, rows a shard, cache rows, fields)}` (`embedmesh.host.tier.StackTier`)."""

    def __init__(
        self,
        plan,
        cache_rows: dict,
        mesh,
        optimizer=None,
        exchange="rows",
        *,
        rounding_seed: int = 0,
        make_tier=None,
    ):
        super().__init__(
            _cache_plan(plan, cache_rows), mesh, optimizer, exchange, rounding_seed=rounding_seed
        )
        self.full_plan = plan
        _check_tierable(plan, lambda s: self.optimizer_of(s.name), mesh)
        self.tier = {}
        for s in tiered_stacks(plan):
            opt = self.optimizer_of(s.name)
            fields = [((s.width,), s.dtype, slots_in_rows.initial_row(s, opt))]
            if opt is not None and not s.slot_columns:
                fields += [
                    ((opt.slot_width(k, s.dim),), s.slots_dtype, v)
                    for k, v in opt.slot_initial_values.items()
                ]
            self.tier[s.name] = make_tier(
                s.name,
                s.tables,
                s.num_shards,
                s.rows_per_shard,
                cache_rows[s.name],
                tuple(fields),
            )

    # -- fields ---------------------------------------------------------------------

    def _fields(self, stack: str) -> tuple:
        """The field names of a tiered stack, in its `StackTier.arrays` order."""
        opt = self.optimizer_of(stack)
        apart = (
            ()
            if opt is None or self.plan.stack(stack).slot_columns
            else tuple(opt.slot_initial_values)
        )
        return ("parameters",) + apart

    def _arrays(self, state: EmbeddingState, stack: str) -> tuple:
        return (state.tables[stack],) + tuple(
            state.slots[stack][k] for k in self._fields(stack)[1:]
        )

    def _with_arrays(self, state: EmbeddingState, stack: str, arrays) -> EmbeddingState:
        names = self._fields(stack)[1:]
        slots = dict(
            state.slots, **{stack: dict(state.slots[stack], **dict(zip(names, arrays[1:])))}
        )
        return dataclasses.replace(
            state, tables=dict(state.tables, **{stack: arrays[0]}), slots=slots
        )

    # -- state ------------------------------------------------------------------------

    def init(self, key) -> EmbeddingState:
        """The caches (empty) and the other stacks on the devices; each tiered table's
        rows made on the host as `EmbeddingCore.init` makes them on a device (the same
        keys, so the same values)."""
        state = super().init(key)
        cpu = _host_device()
        for stack, tier in self.tier.items():
            tier.reset()
            spec = self.full_plan.stack(stack)
            for j in range(spec.num_shards):
                for name in spec.tables:
                    t = self.full_plan.table(name)
                    source = self.full_plan.row_layout.copy_of(t, j)
                    if source is None:
                        continue
                    rows = mod_sharding.table_rows_on_shard(self.full_plan, t, source)
                    if rows.size == 0:
                        continue
                    cfg = self.full_plan.table_config(t)
                    row_init = getattr(cfg.initializer, "rows", None)
                    if row_init is not None:
                        vals = row_init(rows, t.dim, spec.dtype)
                    else:
                        k = jax.random.fold_in(jax.random.fold_in(key, t.index), source)
                        with jax.default_device(cpu):
                            vals = cfg.initialize(k, (rows.size, t.dim), spec.dtype)
                    off = t.local_row_offset
                    tier.arrays[0][j, off : off + rows.size, : t.dim] = np.asarray(vals)
        return state

    def state_from_tables(self, values: dict, slot_values: dict | None = None, step: int = 0):
        """As `EmbeddingCore.state_from_tables`; the tiered tables' rows into host memory
        (the caches emptied)."""
        state = super().state_from_tables(values, slot_values, step)
        slot_values = slot_values or {}
        plan = self.full_plan
        for stack, tier in self.tier.items():
            tier.reset()
            spec = plan.stack(stack)
            fields = self._fields(stack)
            for arr, field in zip(tier.arrays, fields):
                arr[...] = np.asarray(
                    tier_initial(spec, self.optimizer_of(stack), field), arr.dtype
                )
            for name in spec.tables:
                t = plan.table(name)
                given = [("parameters", values.get(name))]
                given += [(k, v) for k, v in slot_values.get(name, {}).items()]
                for field, value in given:
                    if value is None:
                        continue
                    i, col = self._where(stack, field)
                    for j in range(spec.num_shards):
                        rows = mod_sharding.table_shard(value, plan, t, j)
                        rows = rows.reshape(rows.shape[0], -1)
                        tier.arrays[i][
                            j,
                            t.local_row_offset : t.local_row_offset + rows.shape[0],
                            col : col + rows.shape[1],
                        ] = rows
        return state

    def _where(self, stack: str, field: str) -> tuple:
        """`(index in the tier's arrays, first column)` of `field` of a tiered stack."""
        spec = self.plan.stack(stack)
        if field == "parameters":
            return 0, 0
        if spec.slot_columns:
            return 0, spec.columns_of(field)[0]
        return self._fields(stack).index(field), 0

    def tier_field(self, stack: str, field: str) -> tuple:
        """`(index in the stack tier's arrays, first column)` of `field`."""
        return self._where(stack, field)

    def settle(self, state: EmbeddingState) -> None:
        """The rows cached in `state` written into the host rows, the caches emptied
        (a restore writes the host rows next)."""
        for stack, tier in self.tier.items():
            tier.write_back()
            arrays = [np.asarray(jax.device_get(a)) for a in self._arrays(state, stack)]
            for j in range(tier.num_shards):
                slots, rows = tier.cached(j)
                for host, cache in zip(tier.arrays, arrays):
                    c = cache.reshape((tier.num_shards, tier.cache_rows) + cache.shape[1:])
                    host[j, rows] = c[j, slots]
            tier.reset()

    def write_blocks(self, table, field: str, blocks: list) -> None:
        """Table `table`'s `field` from its per-shard blocks (`host_blocks`' form) into
        the host rows (the table's rows must not be cached: after `settle`)."""
        t = self.full_plan.table(table)
        tier = self.tier[t.stack]
        i, col = self._where(t.stack, field)
        for j, block in enumerate(blocks):
            if not self.full_plan.row_layout.holds(t, j):
                continue
            block = np.asarray(block).reshape(block.shape[0], -1)
            off = t.local_row_offset
            tier.arrays[i][j, off : off + block.shape[0], col : col + block.shape[1]] = block

    def host_blocks(self, state: EmbeddingState, table, field: str = "parameters") -> list:
        """Table `table`'s `field` per shard, `[rows_per_shard, width]` blocks in the
        stack's local row order (`[0, width]` off its span): the host's rows with the
        rows cached in `state` over them."""
        plan = self.full_plan
        t = plan.table(table)
        tier = self.tier[t.stack]
        tier.write_back()
        i, col = self._where(t.stack, field)
        width = self.field_width(t, field)
        arr, _ = self.field_array(state, t.stack, field)
        cache = np.asarray(jax.device_get(arr)).reshape((tier.num_shards, tier.cache_rows, -1))
        lo, hi = t.local_row_offset, t.local_row_offset + t.rows_per_shard
        out = []
        for j in range(tier.num_shards):
            if not plan.row_layout.holds(t, j):
                out.append(np.zeros((0, width), tier.arrays[i].dtype))
                continue
            block = tier.arrays[i][j, lo:hi, col : col + width].copy()
            slots, rows = tier.cached(j)
            inside = (rows >= lo) & (rows < hi)
            block[rows[inside] - lo] = cache[j, slots[inside], col : col + width]
            out.append(block)
        return out

    def read_field(self, state: EmbeddingState, table, field: str = "parameters") -> np.ndarray:
        t = self.full_plan.table(table)
        if t.stack not in self.tier:
            return super().read_field(state, table, field)
        return mod_sharding.shards_to_table(self.host_blocks(state, t, field), self.full_plan, t)

    # -- a batch ------------------------------------------------------------------------

    def swap_in(
        self, state: EmbeddingState, csr: dict, pending_csr: dict | None, last: dict | None
    ) -> tuple:
        """`(state, csr placed)`: the host batch `csr`'s misses swapped into the caches and
        its rows mapped to cache rows. `pending_csr`: the batch of an update not yet
        applied (its rows stay cached: it must be `last`, the batch swapped in before);
        a batch that does not fit raises before anything changes."""
        pin = pending_csr is not None
        if pin and pending_csr is not last:
            raise ValueError(
                "host tier: the pending update is not of the batch dequeued last; with a "
                "host tier, apply each batch's gradients before dequeuing the next"
            )
        tiered = [s for s in csr if s in self.tier]
        needed = {s: self.tier[s].check(csr[s].unique_ids, pin) for s in tiered}
        mapped = dict(csr)
        for s in tiered:
            tier = self.tier[s]
            swap = tier.commit(csr[s].unique_ids, needed[s], pin)
            tier.write_back()  # the last swap's victims: before this swap's rows are read
            mapped[s] = dataclasses.replace(csr[s], unique_ids=swap.ids)
            if not any(rows.size for rows in swap.rows):  # every row cached: nothing moves
                tier.pending(swap, ())
                continue
            arrays = self._arrays(state, s)
            rows = tuple(
                jax.device_put(tier.gather(swap, i), self.row_sharding) for i in range(len(arrays))
            )
            slots = jax.device_put(swap.slots, self.row_sharding)
            arrays, old = _swap_program(self.mesh, self.axes, len(arrays))(arrays, slots, rows)
            for a in old:  # the victims' rows on their way to the host as soon as they are read
                a.copy_to_host_async()
            tier.pending(swap, old)
            state = self._with_arrays(state, s, arrays)
        return state, self.put(mapped, copy=False)


def tier_initial(spec, optimizer, field: str):
    """The value a tiered stack's `field` array starts at (a row's, or a slot's)."""
    if field == "parameters":
        return slots_in_rows.initial_row(spec, optimizer)
    return optimizer.slot_initial_values[field]


def _host_device():
    """A CPU device for the host rows' initializers (the default device without one)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None
