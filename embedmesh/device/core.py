"""The functional core: embedding state on a mesh, lookup, and the fused update.

Everything here is pure (state in, new state out) and traceable, so it runs
inside a user's own `jax.jit` train step:

    core = EmbeddingCore(plan, mesh, optimizer)
    state = core.init(jax.random.key(0))
    ...
    @jax.jit
    def train_step(state, params, csr, labels):
        acts = core.lookup(state, csr)
        (loss, (g_params, g_acts)) = ...value_and_grad over (params, acts)...
        state, ok = core.apply_gradients(state, g_acts, csr)
        return state, params, loss

`csr` is `{stack: PartitionedCsrFormatTensor}` placed on the mesh (see
`EmbeddingCore.put`). Tables and slots are stacked and row-sharded: each
stack is one global array `[N * rows_per_shard, padded_dim]` whose block j
(rows `[j*S, (j+1)*S)`) is shard j, on device j of the mesh (all mesh axes
flattened, in mesh order). Activations come out as global arrays sharded on
the batch axis over the same devices: the layout a data-parallel dense model
expects.

How each stack's lookup and update cross the devices is its sharding strategy's
(`embedmesh.device.strategies`, one object a stack, chosen once when the core is
made); the core sequences the stacks of one program and never asks which strategy
a stack has. Where the devices are is one `ops.Transport` (`self.transport`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedmesh import _compat
from embedmesh.batch import PartitionedCsrFormatTensor
from embedmesh.device import (
    id_map,
    ops,
    peers,
    rounding,
    slots_in_rows,
    stack_tables,
    strategies,
)
from embedmesh.device.shard_program import ShardBatch, after
from embedmesh.layout import sharding as mod_sharding
from embedmesh.layout.stacking import StackingPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmbeddingState:
    """All trainable embedding state: a pytree of global arrays.

    tables: {stack: [N*S, dim]}; slots: {stack: {slot name: [N*S, dim]}};
    step: int32 scalar, the number of updates applied (schedules read it);
    id_maps: the id maps of the stacks of raw ids (`EmbeddingCore.map_ids`), each shard's
    own, and the key their fresh rows are initialised from.
    """

    tables: dict
    slots: dict
    step: Any
    # {stack: {"map": IdMapState (arrays [N, ...], one map a shard), "key": key data}}
    # for the stacks of raw 64-bit ids (`TableConfig.id_map`); empty otherwise
    id_maps: dict = dataclasses.field(default_factory=dict)


# Pieces up to this many elements are initialised on one device and copied to theirs:
# XLA compiles a program per device, so a mesh of 8 compiled each initializer (threefry,
# erfinv) 8 times per shape, ~0.4 s each (the test suite's largest compile cost). Bigger
# pieces are made where they live: no transient copy on another device.
_SHARED_INIT_MAX_ELEMENTS = 1 << 22


def _init_device(device, home, elements: int):
    """Where a piece of `elements` values for `device` is initialised: `home` (this
    process's first device of the mesh) up to _SHARED_INIT_MAX_ELEMENTS, else `device`."""
    return device if elements > _SHARED_INIT_MAX_ELEMENTS else home


# the fresh rows' key: `fold_in(init key, _FRESH_SALT)`, then the table's index, then the
# raw id's two words (so a row's initial values depend on its id only, not on the shards)
_FRESH_SALT = 0x1D5
# what `map_ids` counts, per stack (`id_map.map_ids`'s stats, summed over the shards)
ID_STATS = ("hits", "admissions", "evictions", "pending", "refused", "occupancy")


def _dynamic_stacks(plan, num_shards: int, by_stack: dict) -> dict:
    """`{stack: (TablePlacement, IdMapConfig)}` for the tables of raw ids
    (`TableConfig.id_map`), each checked to be one the strategies can hold: alone in
    its stack, not replicated, its capacity a multiple of the shards of its span (every
    shard: mod / row-wise, rows or pooled exchange; one: table-wise), its slots in arrays
    of their own. Each shard of the span holds a map of `vocabulary_size / span` rows
    (`StackingPlan.id_owners`); the shards outside it hold an empty one, never given an id."""
    out = {}
    for spec in plan.stacks:
        configs = [plan.table_config(t) for t in spec.tables]
        if not any(getattr(c, "id_map", None) is not None for c in configs):
            continue
        t, cfg = plan.table(spec.tables[0]), configs[0]
        if len(spec.tables) != 1:
            raise ValueError(
                f"stack {spec.name}: a table of raw ids (TableConfig.id_map) must be alone in "
                f"its stack, it holds {list(spec.tables)}"
            )
        strategy = by_stack[spec.name]
        _, k = plan.row_layout.span(t)
        # the table's span, not the strategy: over every shard, or whole on one owner
        every_shard, one_owner = k == num_shards, k == 1
        if not strategy.holds_raw_ids or not (every_shard or one_owner):
            raise NotImplementedError(
                f"table {t.name}: a table of raw ids (TableConfig.id_map) is row-sharded over "
                f"every device (sharding 'mod', 'row_wise_rows' or 'row_wise_pooled') or "
                f"placed whole on one ('table_wise'); its strategy here ({strategy.name}, over "
                f"{k} of {num_shards} shards) cannot hold it yet"
            )
        v = cfg.vocabulary_size
        if v % k:
            raise ValueError(
                f"table {t.name}: vocabulary_size {v}, the capacity of a table of raw ids, "
                f"must be a multiple of the {k} shards (each holds an equal share)"
            )
        # DynamicIds holds every field of IdMapConfig but the capacity, under its name
        config = id_map.IdMapConfig(capacity=v // k, **dataclasses.asdict(cfg.id_map))
        out[spec.name] = (t, config)
    return out


def _row_initializer(init):
    """Row-aware initialisers (`init.rows(row_ids, dim, dtype)`) get the logical row ids."""
    return getattr(init, "rows", None)


def _fits(shape: tuple, dtype) -> bool:
    """Whether `EmbeddingCore.put`'s batched put takes a leaf of `shape` and `dtype`: jax
    keeps its dtype as it is (int64 without x64: no), and it is not empty (jaxlib's put
    of empty shards on several devices raises `bad_function_call`)."""
    return 0 not in shape and jax.dtypes.canonicalize_dtype(dtype) == dtype


class EmbeddingCore:
    """Static description of one embedding layer on one mesh; builds pure functions.

    Args:
      plan: the `StackingPlan` (its num_shards must equal the mesh size).
      mesh: a `jax.sharding.Mesh`; tables shard over all of its axes.
      optimizer: the default optimizer of tables without one (None: lookups
        only; `apply_gradients` then raises).
      exchange: each stack's exchange form, "rows" or "pooled" (one for every stack,
        or `{stack or table name: form}`; see `embedmesh.device.strategies`).
      rounding_seed: the seed of the stochastic rounding of bfloat16 and float16 tables'
        updates (`embedmesh.device.rounding`; the facade passes its `seed`).
    """

    def __init__(
        self, plan: StackingPlan, mesh, optimizer=None, exchange="rows", *, rounding_seed: int = 0
    ):
        if plan.num_shards != mesh.size:
            raise ValueError(
                f"the plan has {plan.num_shards} shards but the mesh has {mesh.size} devices"
            )
        self.plan = plan
        self.mesh = mesh
        self.axes = tuple(mesh.axis_names)
        self.num_shards = mesh.size
        # every device of the mesh in this process: exchanges may go through shared memory;
        # several processes, all on this host: through the host's (`host_job`)
        in_process = all(d.process_index == jax.process_index() for d in mesh.devices.flat)
        self.transport = ops.Transport(
            axis_name=self.axes,
            num_shards=mesh.size,
            in_process=in_process,
            host_job=0 if in_process else peers.same_host_job(mesh),
        )
        self.default_optimizer = optimizer
        self.row_sharding = NamedSharding(mesh, P(self.axes))
        self.replicated = NamedSharding(mesh, P())
        self._stack_optimizer = {
            s.name: (s.optimizer if s.optimizer is not None else optimizer) for s in plan.stacks
        }
        self.exchange = strategies.exchange_forms(plan, exchange)
        self.rounding_seed = int(rounding_seed)
        # {stack: its sharding strategy}, chosen here once (`strategies.strategy_name`);
        # a stack with its slots in its rows runs its optimizer on whole rows (`SlotsInRows`),
        # a bfloat16 / float16 one in float32, rounded stochastically (`rounding.Rounded`)
        self.strategies = {
            s.name: strategies.strategy_for(
                plan,
                s.name,
                self.exchange[s.name],
                rounding.device_optimizer(
                    plan,
                    s,
                    slots_in_rows.device_optimizer(s, self._stack_optimizer[s.name]),
                    self.axes,
                    self.rounding_seed,
                ),
                self.transport,
            )
            for s in plan.stacks
        }
        # {stack: (TablePlacement, IdMapConfig)}: the stacks of raw 64-bit ids
        self.dynamic = _dynamic_stacks(plan, mesh.size, self.strategies)

    @property
    def in_process(self) -> bool:
        """Whether every device of the mesh is in this process (`transport.in_process`)."""
        return self.transport.in_process

    @property
    def host_job(self) -> int:
        """The job's shared-memory key when the mesh spans processes of this host only,
        else 0 (`transport.host_job`)."""
        return self.transport.host_job

    def exchange_bytes(self, csr: dict, *, carrying: bool = True) -> dict:
        """`{stack: bytes}` one device sends the others in one training step (lookup and
        update) of a batch shaped like `csr`, at its compiled capacities: the blocks
        of the all-to-alls it does not keep (each stack's strategy counts them:
        `Strategy.exchange_bytes`; `carrying` False: an update not given the lookup's
        view, see `lookup`). In-process CPU devices run the row form by reading each
        other's memory: the same bytes cross, nothing is copied."""
        return {s: self.strategies[s].exchange_bytes(c, carrying=carrying) for s, c in csr.items()}

    def memory_held(self) -> int:
        """Bytes of tables and slots each device holds, from the strategies
        (`Strategy.memory_held`); `bytes_per_device` measures the built arrays."""
        return sum(st.memory_held() for st in self.strategies.values())

    # -- state ----------------------------------------------------------------

    def optimizer_of(self, stack: str):
        return self._stack_optimizer[stack]

    def slot_names(self, stack: str) -> tuple:
        """The optimizer slots of `stack` (arrays of their own, or columns of its rows)."""
        opt = self._stack_optimizer[stack]
        return tuple(opt.slot_names) if opt is not None else ()

    def field_array(self, state: EmbeddingState, stack: str, field: str) -> tuple:
        """`(array, first column)` holding `field` ("parameters" or a slot name) of
        `stack` in `state`: a slot's own array from column 0, or where the stack keeps its
        slots in its rows, the table array from the slot's first column."""
        spec = self.plan.stack(stack)
        if field == "parameters":
            return state.tables[stack], 0
        if spec.slot_columns:
            return state.tables[stack], spec.columns_of(field)[0]
        return state.slots[stack][field], 0

    def stack_shape(self, stack: str) -> tuple:
        s = self.plan.stack(stack)  # packed narrow rows: `pack` a stored row
        return (s.num_rows // s.pack, s.width * s.pack)

    def _make_stack_array(
        self, stack: str, default: float, pieces, width: int | None = None, dtype=None
    ) -> jax.Array:
        """Global stack array, each local shard built from `pieces` (see
        `stack_tables.make_stack_array`); `width` its columns (default the stack's dim; a
        row slot's: 1); `dtype` its type (default the stack's table dtype)."""
        return stack_tables.make_stack_array(self, stack, default, pieces, width, dtype)

    def init(self, key) -> EmbeddingState:
        """Fresh state, built shard by shard: no host or device ever holds a whole table.

        Table t's rows on shard j come from its initializer called with
        `fold_in(fold_in(key, t), j)`, so random values depend on the number
        of shards (row-aware initialisers such as `row_id_initializer` do not);
        a replica is made as its canonical block is (the same values).
        """
        plan = self.plan
        tables, slots = {}, {}
        me = jax.process_index()
        home = next(d for d in self.mesh.devices.flat if d.process_index == me)
        for spec in plan.stacks:
            placed = [plan.table(n) for n in spec.tables]

            def pieces(j, device, spec=spec, placed=placed):
                for t in placed:
                    cfg = plan.table_config(t)
                    source = plan.row_layout.copy_of(t, j)  # a replica: the canonical rows
                    if source is None:
                        continue
                    rows = mod_sharding.table_rows_on_shard(plan, t, source)
                    if rows.size == 0:
                        continue
                    row_init = _row_initializer(cfg.initializer)
                    if row_init is not None:
                        vals = row_init(rows, t.dim, spec.dtype)
                    else:
                        k = jax.random.fold_in(jax.random.fold_in(key, t.index), source)
                        with jax.default_device(_init_device(device, home, rows.size * t.dim)):
                            vals = cfg.initialize(k, (rows.size, t.dim), spec.dtype)
                    yield t.local_row_offset, vals

            opt = self.optimizer_of(spec.name)
            tables[spec.name] = self._make_stack_array(
                spec.name, slots_in_rows.initial_row(spec, opt), pieces
            )
            slots[spec.name] = {}
            if opt is not None and not spec.slot_columns:
                for slot, value in opt.slot_initial_values.items():
                    slots[spec.name][slot] = self._make_stack_array(
                        spec.name,
                        value,
                        lambda j, device: (),
                        opt.slot_width(slot, spec.dim),
                        spec.slots_dtype,
                    )
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        return EmbeddingState(tables, slots, step, self._init_id_maps(key))

    def _init_id_maps(self, key) -> dict:
        """Empty id maps of the dynamic stacks, one a shard, and their fresh rows' key."""
        out = {}
        for stack, (_, config) in self.dynamic.items():
            empty = jax.tree_util.tree_map(np.asarray, id_map.init(config))
            n = self.num_shards

            def place(x, n=n):
                full = np.broadcast_to(x[None], (n,) + x.shape)
                return id_map.on_huge_pages(
                    jax.make_array_from_callback(
                        full.shape, self.row_sharding, lambda idx, full=full: full[idx]
                    )
                )

            data = np.asarray(jax.random.key_data(jax.random.fold_in(key, _FRESH_SALT)))
            out[stack] = {
                "map": jax.tree_util.tree_map(place, empty),
                "key": jax.make_array_from_callback(
                    data.shape, self.replicated, lambda idx, data=data: data[idx]
                ),
            }
        return out

    def bytes_per_device(self, state: EmbeddingState) -> tuple:
        """Bytes of tables and slots each device of the mesh holds, measured from the
        arrays' addressable shards (None for another process's devices)."""
        index = {d: j for j, d in enumerate(self.mesh.devices.flat)}
        out: list = [None] * self.mesh.size
        for arr in jax.tree_util.tree_leaves((state.tables, state.slots)):
            for shard in arr.addressable_shards:
                j = index[shard.device]
                out[j] = (out[j] or 0) + int(shard.data.nbytes)
        return tuple(out)

    def state_from_tables(
        self, values: dict, slot_values: dict | None = None, step: int = 0
    ) -> EmbeddingState:
        """State from logical arrays `{table name: [V, dim]}` (and `{table: {slot: [V, dim]}}`).

        Shard j is assembled from each table's rows on j, one table at a time;
        tables not given are zero, slots not given take their initial value.
        """
        plan = self.plan
        slot_values = slot_values or {}
        tables, slots = {}, {}
        for spec in plan.stacks:
            placed = [plan.table(n) for n in spec.tables]

            def pieces(j, device, placed=placed, sources=()):
                # `sources`: ((table name -> array or None, first column), ...)
                for source, column in sources:
                    for t in placed:
                        arr = source(t.name)
                        if arr is not None:
                            rows = mod_sharding.table_shard(arr, plan, t, j)[:, : t.dim]
                            yield t.local_row_offset, rows, column

            def slot_source(slot):
                return lambda n: slot_values.get(n, {}).get(slot)

            opt = self.optimizer_of(spec.name)
            in_rows = opt is not None and bool(spec.slot_columns)
            sources = [(values.get, 0)]  # with the slots in the rows: theirs too
            if in_rows:
                sources += [(slot_source(k), spec.columns_of(k)[0]) for k in opt.slot_names]
            tables[spec.name] = self._make_stack_array(
                spec.name,
                slots_in_rows.initial_row(spec, opt),
                functools.partial(pieces, sources=sources),
            )
            slots[spec.name] = {}
            if opt is not None and not in_rows:
                for slot, init in opt.slot_initial_values.items():
                    slots[spec.name][slot] = self._make_stack_array(
                        spec.name,
                        init,
                        functools.partial(pieces, sources=[(slot_source(slot), 0)]),
                        opt.slot_width(slot, spec.dim),
                        spec.slots_dtype,
                    )
        if self.dynamic:
            raise NotImplementedError(
                f"state_from_tables of tables of raw ids "
                f"({', '.join(self.dynamic_table_names)}): their id maps cannot be set from "
                f"logical arrays yet (issue 42)"
            )
        return EmbeddingState(
            tables, slots, jax.device_put(jnp.asarray(step, jnp.int32), self.replicated)
        )

    @property
    def dynamic_table_names(self) -> tuple:
        """The names of the tables of raw ids (`TableConfig.id_map`), in stack order."""
        return tuple(t.name for t, _ in self.dynamic.values())

    def read_table(self, stack_array: jax.Array, table) -> np.ndarray:
        """The logical `[V, dim]` numpy array of one table from a stack array (a field of
        a stack that keeps its slots in its rows: `read_field`)."""
        return stack_tables.read_table(self, stack_array, table)

    def read_field(self, state: EmbeddingState, table, field: str = "parameters") -> np.ndarray:
        """Table `table`'s `field` ("parameters" or a slot name) of `state`, `[V, dim]`
        (a row slot: `[V, 1]`) in logical row order, on the host."""
        t = self.plan.table(table)
        arr, column = self.field_array(state, t.stack, field)
        return stack_tables.read_table(self, arr, t, column, self.field_width(t, field))

    def field_width(self, t, field: str) -> int:
        """The columns of a table's `field`: its dim, a row slot's 1."""
        opt = self.optimizer_of(t.stack)
        if field == "parameters" or opt is None:
            return t.dim
        return opt.slot_width(field, t.dim)

    # -- inputs ---------------------------------------------------------------

    def put(self, csr: dict, *, copy: bool = True) -> dict:
        """Place this process's preprocessed arrays on its devices as global arrays.

        One process: a leaf by jaxlib's batched put of its per-device slices, the
        arrays `jax.device_put` gives (dtype, sharding, committed) for ~3x less time
        (56 leaves of the train benchmark: 56 calls of 40-140 us of Python each), and
        copies (`force_copy`): `jax.device_put` zero-copies 64-byte-aligned numpy
        buffers on CPU and reads the others after it returns, so a host buffer written
        after this call could change the step's input. `jax.device_put` where the hook
        is gone, jax converts the dtype (int64 without x64) or the leaf is empty;
        `make_array_from_process_local_data` across processes.

        `copy=False`: the caller's arrays are its own and never written again (the
        facade's enqueue, on what preprocessing just made): a 64-byte-aligned one is
        aliased, not copied (the train benchmark's static stack: 0.12-0.18 ms a batch
        against 0.43-0.51); jax keeps it alive.

        A stack's `unique_counts` and `pair_counts` stay on the host (None in the placed
        batch): no device program reads them (padding ends a partition), and a leaf costs
        its put and an argument of every program (16 of the 56 leaves of 8 stacks of raw
        ids in benchmarks/train/dynamic_ids.py)."""
        batched, aval = _compat.batched_device_put(), _compat.shaped_array()
        one_process = jax.process_count() == 1
        x64 = bool(jax.config.jax_enable_x64)  # which dtypes jax keeps
        out = {}
        for name, c in csr.items():
            if isinstance(c, PartitionedCsrFormatTensor):
                c = dataclasses.replace(c, unique_counts=None, pair_counts=None)
            leaves, treedef = jax.tree_util.tree_flatten(c)
            placed = []
            for leaf in leaves:
                leaf = np.asarray(leaf)
                how = None
                if one_process and batched is not None and aval is not None:
                    how = self._put_plan(leaf.shape, leaf.dtype, x64, aval)
                if how is not None:
                    a, devices, slices = how
                    shards = [leaf[i] for i in slices]
                    placed.append(batched(a, self.row_sharding, shards, devices, True, copy))
                elif one_process:
                    placed.append(jax.device_put(leaf, self.row_sharding))
                else:
                    global_shape = (leaf.shape[0] * jax.process_count(),) + leaf.shape[1:]
                    placed.append(
                        jax.make_array_from_process_local_data(
                            self.row_sharding, leaf, global_shape
                        )
                    )
            out[name] = jax.tree_util.tree_unflatten(treedef, placed)
        return out

    def _put_plan(self, shape: tuple, dtype, x64: bool, aval) -> tuple | None:
        """`(aval, devices, index a device)` of a leaf of `shape` and `dtype` under
        `row_sharding` (jax's map, which raises on a batch the devices do not divide),
        or None where the batched put does not take it (`_fits`); kept a shape, dtype
        and `x64` (`jax_enable_x64`, which decides the dtypes jax keeps): a batch's leaves
        repeat them, and the aval and the map cost ~2 us a leaf each (the transfer of
        the 56 leaves of 8 stacks of raw ids: 0.84x, benchmarks/train/dynamic_ids.py)."""
        cache = self.__dict__.setdefault("_put_plans", {})
        key = (shape, dtype, x64, aval)
        if key in cache:
            return cache[key]
        if len(cache) > 256:  # shapes that keep changing (capacities from each batch)
            cache.clear()
        got = None
        if _fits(shape, dtype):
            index = self.row_sharding.addressable_devices_indices_map(shape)
            got = (aval(shape, dtype), list(index), list(index.values()))
        cache[key] = got
        return got

    # -- tables of raw ids ----------------------------------------------------

    def _reinit_fresh(self, stack: str, key_data, table, slots: dict, rows, fresh, raw):
        """Rows given to an id in this step (`fresh` [M], the map's `rows` [M], their ids
        `raw` [M, 2]): the table's initializer keyed by the id, the slots' initial
        values; the other rows as they were."""
        t, _ = self.dynamic[stack]
        cfg = self.plan.table_config(t.name)
        base = jax.random.fold_in(jax.random.wrap_key_data(key_data), t.index)

        def one(pair):
            k = jax.random.fold_in(jax.random.fold_in(base, pair[0]), pair[1])
            return cfg.initialize(k, (1, t.dim), jnp.float32)[0]

        fresh = fresh & (rows >= 0)
        m = raw.shape[0]
        few = max(1, m // 16)
        opt = self.optimizer_of(stack)
        # the row a fresh id starts from: the padding 0 and, where the stack keeps its
        # slots in its rows (a TPU's layout), each slot's initial value in its columns
        start = slots_in_rows.initial_row(self.plan.stack(stack), opt)
        start = jnp.broadcast_to(jnp.asarray(start, jnp.float32), (few, table.shape[1]))
        chunks = -(-m // few)
        # the fresh positions first, in `few`-long chunks: the initializer and the writes
        # run on the fresh entries only, a chunk a loop step (a step of hits runs none,
        # and materialises no [m, dim] array); the loop carries the table and slots,
        # updated in place
        count = fresh.sum(dtype=jnp.int32)
        # (a step with nothing fresh, the steady state, skips the nonzero's cumsums)
        order = jax.lax.cond(
            count > 0,
            lambda f: jnp.nonzero(f, size=chunks * few, fill_value=m)[0].astype(jnp.int32),
            lambda f: jnp.full((chunks * few,), m, jnp.int32),
            fresh,
        )
        initial = opt.slot_initial_values.items() if opt is not None else ()

        def chunk(k, carried):
            table, slots = carried
            pos = jax.lax.dynamic_slice(order, (k * few,), (few,))
            at_m = jnp.minimum(pos, m - 1)
            values = start.at[:, : t.dim].set(jax.vmap(one)(raw[at_m])).astype(table.dtype)
            at = jnp.where(pos < m, rows[at_m] + t.local_row_offset, table.shape[0])
            table = table.at[at].set(values, mode="drop")
            slots = dict(slots)
            for name, value in initial:
                if name not in slots:  # in the rows: set above
                    continue
                arr = slots[name]
                slots[name] = arr.at[at].set(jnp.asarray(value, arr.dtype), mode="drop")
            return table, slots

        return jax.lax.fori_loop(0, (count + few - 1) // few, chunk, (table, dict(slots)))

    def _last_updated(self, csr_prev: dict | None) -> str | None:
        """The stack whose table an `apply_gradients` of `csr_prev` writes last (its
        stacks' writes chain in plan order): a program that runs more writes after that
        update starts them after this one's (`map_ids`, `reinit_fresh_rows`)."""
        if csr_prev is None:
            return None
        return next((s.name for s in reversed(self.plan.stacks) if s.name in csr_prev), None)

    def _leading(self, state: EmbeddingState, stack: str | None) -> dict:
        """`{stack: its table}` for a program's writes to follow (`_after`); none where
        nothing is ordered (`Transport.crosses`)."""
        if stack is None or not self.transport.crosses:
            return {}
        return {stack: state.tables[stack]}

    def _mappable(self, state: EmbeddingState, csr: dict) -> list:
        """`csr`'s stacks of raw ids, in plan order; ValueError naming a stack whose batch
        has no raw ids (mapped already) or whose id map the state lacks."""
        stacks = [s.name for s in self.plan.stacks if s.name in csr and s.name in self.dynamic]
        for s in stacks:
            if csr[s].unique_raw_ids is None:
                raise ValueError(
                    f"stack {s}: the batch has no raw ids (map_ids was run on it already, or it "
                    f"was not preprocessed for this plan)"
                )
            if s not in state.id_maps:
                raise ValueError(
                    f"stack {s}: the state has no id map (a state from EmbeddingCore.init holds "
                    f"one for every table of raw ids)"
                )
        return stacks

    def map_ids(
        self,
        state: EmbeddingState,
        csr: dict,
        *,
        keep_fresh: bool = False,
        after_update: dict | None = None,
    ):
        """The raw ids of the stacks of raw ids (`TableConfig.id_map`) mapped to rows:
        `(new state, csr, stats)`. Run it on a batch before `lookup` and
        `apply_gradients` (which refuse a batch with raw ids still in it), once a batch.

        Each device sends its distinct raw ids to their owners (the host routed them
        there: `host.dynamic_ids.owner_of`); each owner maps them with its id map
        (`id_map.map_ids`, at `state.step`), re-initialises the rows given to an id in
        this call (the table's initializer keyed by the id, the optimizer slots' initial
        values) and sends the rows back: the batch returned has rows in `unique_ids`
        (`PAD_ID` for an id pending admission or refused: a zero row, no update) and no
        raw ids, its pairs grouped by slot in slot order; on CPU each block's rows in the
        host's order of its raw ids (first sighting on the source; the fused update takes
        distinct rows in any order: 1.3 ms a step of 8 tables' reorder saved), elsewhere
        ascending, as the host orders a table of rows (`id_map.sort_mapped`). Other stacks
        pass through unchanged. `stats`: `{stack: {name: int32}}`, `ID_STATS` summed over
        the owners. Pure: jit it, donate the state.

        `after_update`: the batch of an `apply_gradients` that `state` comes from in the
        same program: the map starts after that update's last write. Each stack's update
        reads the table the previous one wrote (`shard_program.after`); unless the map's
        in-place writes follow those reads in data, XLA copies the tables (14 whole-table
        copies a step of 8 tables, 100 ms at 10^6 rows x dim 8).

        With `keep_fresh`, returns `(state, csr, stats, fresh)` too: `fresh`, what each
        owner re-initialised (its received ids' rows, fresh flags and raw ids), for
        `reinit_fresh_rows` to do again after an update that ran late (pipelining: the
        previous batch's update, which may write a row this call gave to another id)."""
        stacks = self._mappable(state, csr)
        if not stacks:
            return (state, csr, {}, {}) if keep_fresh else (state, csr, {})
        tables = {s: state.tables[s] for s in stacks}
        slots = {s: state.slots[s] for s in stacks}
        maps = {s: state.id_maps[s]["map"] for s in stacks}
        keys = {s: state.id_maps[s]["key"] for s in stacks}
        ids = {s: csr[s].unique_ids for s in stacks}
        raws = {s: csr[s].unique_raw_ids for s in stacks}
        pairs = {s: (csr[s].pair_rows, csr[s].pair_unique, csr[s].pair_gains) for s in stacks}

        lead = self._leading(state, self._last_updated(after_update))

        def body(tables, slots, maps, keys, step, ids, raws, pairs, lead):
            out_t, out_s, out_m, out_rows, out_stats, kept = {}, {}, {}, {}, {}, {}
            out_pairs = {}
            previous = next(iter(lead.values()), None)
            for s in stacks:
                m = maps[s]  # this shard's block, [1, ...] (id_map.map_ids takes it so)

                def reinit(table, sl, rows, fresh, raw, s=s):
                    kept[s] = (rows[None], fresh[None], raw[None])
                    return self._reinit_fresh(s, keys[s], table, sl, rows, fresh, raw)

                table, sl, m, rows, stats = self.strategies[s].map_ids(
                    tables[s],
                    slots[s],
                    m,
                    self._after(ids[s][0], previous),
                    raws[s][0],
                    step,
                    reinit,
                )
                previous = rows
                out_t[s], out_s[s], out_rows[s] = table, sl, rows
                out_m[s] = m
                out_stats[s] = jnp.stack([stats[k] for k in ID_STATS])[None]
            if as_is:  # the CPU kernels: the blocks as the maps gave them, pairs unmoved
                rows = {s: r[None] for s, r in out_rows.items()}
                return out_t, out_s, out_m, rows, (out_stats, kept, None)
            # this source's blocks in the host's order for a table of rows, every stack's
            # in one call (its threads share them out)
            ordered = id_map.sort_mapped_many(
                [(out_rows[s], *(x[0] for x in pairs[s])) for s in stacks],
                [csr[s].rows_per_device for s in stacks],
            )
            for s, (rows, *moved) in zip(stacks, ordered):
                out_rows[s] = rows[None]
                out_pairs[s] = tuple(x[None] for x in moved)
            return out_t, out_s, out_m, out_rows, (out_stats, kept, out_pairs)

        # Blocks left as the maps gave them (`id_map.blocks_as_mapped`): the pairs are not
        # outputs of the program (returned unchanged, they cost a copy each: 24 of ~30 us
        # a step of 8 tables, beside the first map's call); else sorted as the host orders
        # a table of rows.
        as_is = id_map.blocks_as_mapped()
        fn = self._shard_map(
            body,
            in_specs=(
                self._specs(tables),
                self._specs(slots),
                self._specs(maps),
                P(),
                P(),
                self._specs(ids),
                self._specs(raws),
                self._specs(pairs),
                self._specs(lead),
            ),
            out_specs=(
                self._specs(tables),
                self._specs(slots),
                self._specs(maps),
                self._specs(ids),
                (
                    self._specs(ids),
                    {s: (P(self.axes),) * 3 for s in stacks},
                    None if as_is else self._specs(pairs),
                ),
            ),
        )
        new_t, new_s, new_m, rows, (counts, kept, moved) = fn(
            tables, slots, maps, keys, state.step, ids, raws, pairs, lead
        )
        state = dataclasses.replace(
            state,
            tables=dict(state.tables, **new_t),
            slots=dict(state.slots, **new_s),
            id_maps=dict(state.id_maps, **{s: {"map": new_m[s], "key": keys[s]} for s in stacks}),
        )
        csr = dict(csr)
        for s in stacks:
            pairs = (csr[s].pair_rows, csr[s].pair_unique, csr[s].pair_gains)
            csr[s] = _with_rows(csr[s], rows[s], pairs if as_is else moved[s])
        stats = {s: {k: counts[s][:, i].sum() for i, k in enumerate(ID_STATS)} for s in stacks}
        return (state, csr, stats, kept) if keep_fresh else (state, csr, stats)

    def find_rows(self, state: EmbeddingState, csr: dict) -> dict:
        """`map_ids` read-only, for an evaluation lookup: the batch with the rows the id
        maps hold for its raw ids (`PAD_ID`, a zero row, for an id they do not hold, as
        serving reads it) and no raw ids; the state is only read (no admission, eviction,
        count, last-used step or fresh row). Other stacks pass through unchanged. The
        rows and pairs come in the order `map_ids` gives them, so `lookup` reads what
        it would read after a `map_ids` that admitted nothing. Pure: jit it (nothing to
        donate). A stack mapped already (no raw ids) passes through too."""
        raw = {s: c for s, c in csr.items() if getattr(c, "unique_raw_ids", None) is not None}
        stacks = self._mappable(state, raw)
        if not stacks:
            return csr
        maps = {s: state.id_maps[s]["map"] for s in stacks}
        ids = {s: csr[s].unique_ids for s in stacks}
        raws = {s: csr[s].unique_raw_ids for s in stacks}
        pairs = {s: (csr[s].pair_rows, csr[s].pair_unique, csr[s].pair_gains) for s in stacks}
        as_is = id_map.blocks_as_mapped()

        def body(maps, ids, raws, pairs):
            found, previous = {}, None
            for s in stacks:
                found[s] = self.strategies[s].find_ids(
                    maps[s], self._after(ids[s][0], previous), raws[s][0]
                )
                previous = found[s]
            if as_is:  # (see `map_ids`)
                return {s: r[None] for s, r in found.items()}, None
            ordered = id_map.sort_mapped_many(
                [(found[s], *(x[0] for x in pairs[s])) for s in stacks],
                [csr[s].rows_per_device for s in stacks],
            )
            rows = {s: r[None] for s, (r, *_) in zip(stacks, ordered)}
            return rows, {
                s: tuple(x[None] for x in moved) for s, (_, *moved) in zip(stacks, ordered)
            }

        fn = self._shard_map(
            body,
            in_specs=(
                self._specs(maps),
                self._specs(ids),
                self._specs(raws),
                self._specs(pairs),
            ),
            out_specs=(self._specs(ids), None if as_is else self._specs(pairs)),
        )
        rows, moved = fn(maps, ids, raws, pairs)
        out = dict(csr)
        for s in stacks:
            out[s] = _with_rows(csr[s], rows[s], pairs[s] if as_is else moved[s])
        return out

    def reinit_fresh_rows(
        self, state: EmbeddingState, fresh: dict, *, after_update: dict | None = None
    ) -> EmbeddingState:
        """The rows a `map_ids(keep_fresh=True)` call gave to an id, re-initialised again
        (the same values: keyed by the id; the slots' initial values), the other rows
        as they are: after an update of an earlier batch that ran after that call
        (pipelining), whose gradient of an evicted id would otherwise land on the row
        of the id that took it. Pure: jit it, donate the state. `after_update`: as
        `map_ids`'s (the update of that batch ran before, in the same program)."""
        stacks = [s for s in fresh if s in self.dynamic]
        if not stacks:
            return state
        tables = {s: state.tables[s] for s in stacks}
        slots = {s: state.slots[s] for s in stacks}
        keys = {s: state.id_maps[s]["key"] for s in stacks}
        kept = {s: fresh[s] for s in stacks}
        lead = self._leading(state, self._last_updated(after_update))

        def body(tables, slots, keys, kept, lead):
            out_t, out_s = {}, {}
            previous = next(iter(lead.values()), None)
            for s in stacks:
                rows, flags, raw = (x[0] for x in kept[s])
                rows = self._after(rows, previous)  # its writes after the update's reads
                out_t[s], out_s[s] = self._reinit_fresh(
                    s, keys[s], tables[s], slots[s], rows, flags, raw
                )
                previous = out_t[s]
            return out_t, out_s

        fn = self._shard_map(
            body,
            in_specs=(
                self._specs(tables),
                self._specs(slots),
                P(),
                self._specs(kept),
                self._specs(lead),
            ),
            out_specs=(self._specs(tables), self._specs(slots)),
        )
        new_t, new_s = fn(tables, slots, keys, kept, lead)
        return dataclasses.replace(
            state, tables=dict(state.tables, **new_t), slots=dict(state.slots, **new_s)
        )

    def read_dynamic(self, state: EmbeddingState, table, field: str = "parameters") -> dict:
        """A table of raw ids on the host: `{raw id (int): (shard, row in the shard's map,
        values)}` for its live ids (`field`: "parameters" or a slot name)."""
        t = self.plan.table(table)
        if t.stack not in self.dynamic:
            raise ValueError(f"table {t.name} is not a table of raw ids (TableConfig.id_map)")
        _, config = self.dynamic[t.stack]
        arr, column = self.field_array(state, t.stack, field)
        width = self.field_width(t, field)
        host = np.asarray(jax.device_get(arr))
        maps = jax.device_get(state.id_maps[t.stack]["map"])
        per_shard = host.shape[0] // self.num_shards
        out = {}
        for j in range(self.num_shards):
            m = jax.tree_util.tree_map(lambda x, j=j: np.asarray(x)[j], maps)
            for raw, row in id_map.live_ids(m).items():
                at = j * per_shard + t.local_row_offset + row
                out[raw] = (j, row, host[at, column : column + width].copy())
        return out

    def _refuse_raw(self, csr: dict, what: str) -> None:
        raw = [s for s, c in csr.items() if getattr(c, "unique_raw_ids", None) is not None]
        if raw:
            raise ValueError(
                f"{what}: stacks {sorted(raw)} still carry raw ids: run map_ids(state, csr) on "
                f"the batch first and pass the batch it returns"
            )

    # -- the device programs --------------------------------------------------

    def _specs(self, tree):
        return jax.tree_util.tree_map(lambda _: P(self.axes), tree)

    def _shard_map(self, body, in_specs, out_specs):
        """`body` as a per-shard program on this core's mesh (every device program of
        the core: unchecked varying-manual-axes, as its bodies mix replicated and
        sharded values), its cross-device calls in one order with the program's others
        (`ops.shard_map_in_order`)."""
        return ops.shard_map_in_order(
            body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, axes=self.axes
        )

    def carries_view(self, stack: str, c=None) -> bool:
        """Whether `stack`'s update can take the owners' view of its batch from the lookup
        (`lookup(carrying=True)`): its strategy's answer (pooled on the owners with a
        sparse optimizer)."""
        return self.strategies[stack].carries_view()

    def _after(self, x, previous):
        """`shard_program.after(x, previous)` where something crosses between devices
        (`Transport.crosses`); else `x`: nothing to order, and each `after` is a select
        over its array (16 thunks, ~0.15 ms a CPU step of 8 tables of raw ids)."""
        return after(x, previous) if self.transport.crosses else x

    def _shard_batch(self, c, previous) -> ShardBatch:
        """This device's block of `c` inside `shard_map`, its exchanges after `previous`."""
        return ShardBatch(
            self._after(c.unique_ids[0], previous),
            c.pair_rows[0],
            c.pair_unique[0],
            c.pair_gains[0],
            c.rows_per_device,
            c.features,
        )

    def lookup(self, state: EmbeddingState, csr: dict, *, carrying: bool = False):
        """Activations `{feature name: global array}` for preprocessed `csr`.

        Shapes: `[B, *sample_shape, dim]` (see `FeatureSegment`: `[B, dim]`
        combined, `[B, L, dim]` sequences, `ids.shape + [dim]` dense ids);
        sharded on the batch axis. (The facade restores the feature structure
        and applies `output_shape`.)

        With `carrying`, returns `(activations, view)`: `view` is `{stack: the
        owners' view of the batch}` for the stacks pooled on their owners (the ids
        and pairs each owner received, `strategies.pooled.serve_pairs`). Passed to
        `apply_gradients` with the same `csr`, the update sends only the
        activation gradients instead of the pairs a second time.
        """
        self._refuse_raw(csr, "lookup")
        axes = self.axes
        stacks = [s.name for s in self.plan.stacks if s.name in csr]
        tables = {s: state.tables[s] for s in stacks}
        csr = {s: csr[s] for s in stacks}

        viewed = [s for s in stacks if carrying and self.carries_view(s)]

        def body(tables, csr):
            acts, view = {}, {}
            # after the table of the last stack: where an update of these tables runs in
            # the same program, its exchanges come first on every device
            previous = tables[stacks[-1]] if stacks else None
            for s in stacks:
                c = csr[s]
                act, carried = self.strategies[s].lookup(
                    ops.packed.view(tables[s], self.plan.stack(s).pack),
                    self._shard_batch(c, previous),
                    carry=s in viewed,
                )
                if s in viewed:
                    view[s] = carried
                previous = act
                for feature in c.features:
                    a = act[
                        feature.row_offset : feature.row_offset + feature.num_rows, : feature.dim
                    ]
                    # float32 whatever the table's dtype: rows are summed in float32
                    acts[feature.name] = a.reshape(feature.local_shape()).astype(jnp.float32)
            return acts, view

        out_names = [feature.name for s in stacks for feature in csr[s].features]
        fn = self._shard_map(
            body,
            in_specs=(self._specs(tables), self._specs(csr)),
            out_specs=({n: P(axes) for n in out_names}, {s: P(axes) for s in viewed}),
        )
        acts, view = fn(tables, csr)
        return (acts, view) if carrying else acts

    def lookup_then_apply_gradients(
        self,
        state: EmbeddingState,
        gradients: dict,
        csr_prev: dict,
        csr_next: dict,
        *,
        check_finite: bool = True,
        view=None,
        carrying: bool = False,
    ):
        """Pipelined step: activations for `csr_next` from the current tables, then
        the update for the previous step's `csr_prev`.

        Returns `(activations, new state, applied)`, and with `carrying` the owners'
        view of `csr_next` after them (see `lookup`); `view`: that of `csr_prev`. The
        lookup sees the tables exactly one update stale, and both run in one program
        so XLA can overlap them with the dense model. The update still runs in
        place (its tables ordered after the lookup's reads).
        """
        acts, next_view = self.lookup(state, csr_next, carrying=True)
        tables = self._ordered_after(state.tables, acts, csr_next)
        state = dataclasses.replace(state, tables=tables)
        new_state, ok = self.apply_gradients(
            state, gradients, csr_prev, check_finite=check_finite, view=view
        )
        return (acts, new_state, ok, next_view) if carrying else (acts, new_state, ok)

    def _ordered_after(self, tables: dict, acts: dict, csr: dict) -> dict:
        """The tables, made data-dependent on the lookup that read them.

        XLA orders instructions only by data dependence when it decides
        whether an in-place update may overwrite a buffer another op reads;
        the lookup and the update of one stack are otherwise unordered, so
        XLA would copy the whole table every step to keep the lookup's
        input alive. Threading each table through a `cond` whose predicate
        reads the lookup's output orders them at O(1) cost. The predicate is
        true unless an activation's first element has one particular NaN
        bit pattern; the other branch is then taken and returns the same
        values (`+ 0` only turns -0.0 into +0.0); it exists because XLA
        removes a `cond` whose branches are identical, and the barrier
        `lax.optimization_barrier` is dropped before copy insertion on CPU.
        """
        first_act = {}
        for s, c in csr.items():
            for feature in c.features:
                first_act.setdefault(s, feature.name)
        stacks = [s for s in first_act if s in tables]
        if not stacks:
            return tables

        def body(tabs, deps):
            out = {}
            for s in stacks:
                d = deps[s].reshape(-1)
                if d.size == 0:
                    out[s] = tabs[s]
                    continue
                bits = jax.lax.bitcast_convert_type(d[0].astype(jnp.float32), jnp.int32)
                keep = bits != jnp.int32(-1)  # 0xFFFFFFFF: a NaN no arithmetic produces
                out[s] = jax.lax.cond(
                    keep, lambda t: t, lambda t: t + jnp.zeros((), t.dtype), tabs[s]
                )
            return out

        tabs = {s: tables[s] for s in stacks}
        deps = {s: acts[first_act[s]] for s in stacks}
        fn = self._shard_map(
            body,
            in_specs=(self._specs(tabs), self._specs(deps)),
            out_specs=self._specs(tabs),
        )
        return dict(tables, **fn(tabs, deps))

    def step_check(self, gradients: dict, batch_number=None):
        """`[all gradients finite (0/1), lowest batch number, highest]` int32, the same
        on every device, from one exchange of each device's flag and batch number
        (`ops.exchange`: processes of one host agree through shared memory, where
        XLA's all-reduce over processes goes through gloo's TCP: 1-7 ms a step here).

        `gradients`: `{feature: array sharded on the batch axis}` (empty: finite);
        `batch_number`: a batch's `PartitionedCsrFormatTensor.batch_number` (global
        `[N]` int32) or None (then -1, -1). The facade refuses a step whose lowest
        and highest numbers differ (a process skipped or repeated a batch); your own
        train step on this core can do the same.
        """
        grads = {k: g for k, g in gradients.items() if g is not None and g.size}
        if not grads and batch_number is None:  # (an empty batch: nothing to check)
            return jnp.asarray([1, -1, -1], jnp.int32)
        n = self.num_shards
        transport = self.transport.on("finite")

        def body(grads, batch_number):
            finite = (
                jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()]))
                if grads
                else jnp.asarray(True)
            )
            number = batch_number[0] if batch_number is not None else jnp.int32(-1)
            row = jnp.stack([finite.astype(jnp.int32), number.astype(jnp.int32)])
            got = ops.exchange(jnp.broadcast_to(row, (n, 2)), transport)
            return jnp.stack(
                [jnp.all(got[:, 0] != 0).astype(jnp.int32), got[:, 1].min(), got[:, 1].max()]
            )

        fn = self._shard_map(
            body,
            in_specs=(self._specs(grads), self._specs(batch_number)),
            out_specs=P(),
        )
        return fn(grads, batch_number)

    def apply_gradients(
        self,
        state: EmbeddingState,
        gradients: dict,
        csr: dict,
        *,
        check_finite: bool = True,
        view: dict | None = None,
    ):
        """New state after one fused sparse update; and whether it was applied.

        `gradients` is `{feature name: array shaped like its activation, or
        None}` (None counts as zero). Unlike the facade's `apply_gradients`, which
        checks the gradients against the feature structure (a feature left out is a
        ValueError there), this takes a partial dict: a feature name left out counts
        as zero too, and names of no feature of `csr` are ignored (the dict is a
        traced argument; the facade passes only its non-None gradients). Each
        touched row is updated exactly once with the sum of its gradients over the
        global batch. With `check_finite`, a non-finite gradient anywhere leaves
        the state unchanged and the returned flag False. `view`: the owners' view of this
        same `csr` from `lookup(carrying=True)` (stacks it lacks send their pairs
        again).
        """
        self._refuse_raw(csr, "apply_gradients")
        stacks = [s.name for s in self.plan.stacks if s.name in csr]
        for s in stacks:
            if self.optimizer_of(s) is None:
                raise ValueError(
                    f"stack {s} has no optimizer: give MeshEmbedding an optimizer "
                    f"or set TableConfig.optimizer"
                )
        grads = {}
        for s in stacks:
            for feature in csr[s].features:
                g = gradients.get(feature.name)
                if g is not None:
                    grads[feature.name] = g

        view = {s: v for s, v in (view or {}).items() if s in stacks and self.carries_view(s)}

        def update(state, ok=None):
            tables = {s: state.tables[s] for s in stacks}
            slots = {s: state.slots[s] for s in stacks}

            def body(tables, slots, step, grads, csr, ok, view):
                new_tables, new_slots = {}, {}
                # after the first stack's table: where a lookup of these tables runs first
                # in the same program (`lookup_then_apply_gradients`), its exchanges come
                # first on every device
                previous = tables[stacks[0]] if stacks else None
                for s in stacks:
                    c = csr[s]
                    spec = self.plan.stack(s)
                    parts = []
                    for feature in c.features:
                        g = grads.get(feature.name)
                        if g is None:
                            g = jnp.zeros((feature.num_rows, spec.dim), jnp.float32)
                        else:
                            g = g.reshape(feature.num_rows, feature.dim).astype(jnp.float32)
                            if feature.dim < spec.dim:
                                g = jnp.pad(g, ((0, 0), (0, spec.dim - feature.dim)))
                        parts.append(g)
                    buf = (
                        jnp.concatenate(parts, axis=0)
                        if parts
                        else jnp.zeros((0, spec.dim), jnp.float32)
                    )
                    # ok False (rejected): every id becomes padding, no row moves
                    new_tables[s], new_slots[s] = self.strategies[s].update(
                        ops.packed.view(tables[s], spec.pack),
                        slots[s],
                        self._shard_batch(c, previous),
                        buf,
                        step=step,
                        keep=ok,
                        view=view.get(s),
                    )
                    new_tables[s] = ops.packed.stored(new_tables[s])
                    previous = new_tables[s]
                return new_tables, new_slots

            fn = self._shard_map(
                body,
                in_specs=(
                    self._specs(tables),
                    self._specs(slots),
                    P(),
                    self._specs(grads),
                    self._specs(csr),
                    P(),
                    self._specs(view),
                ),
                out_specs=(self._specs(tables), self._specs(slots)),
            )
            new_tables, new_slots = fn(tables, slots, state.step, grads, csr, ok, view)
            all_tables = dict(state.tables, **new_tables)
            all_slots = dict(state.slots, **new_slots)
            advance = 1 if ok is None else ok.astype(state.step.dtype)
            return EmbeddingState(all_tables, all_slots, state.step + advance, state.id_maps)

        if not check_finite or not grads:
            return update(state), jnp.asarray(True)
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()]))
        if any(self.optimizer_of(s).touches_all_rows for s in stacks):
            return jax.lax.cond(ok, update, lambda st: st, state), ok
        # Sparse rules move only the rows they are given: a rejected update
        # hands them none (no `cond`, which costs 2-10 ms a step on CPU).
        return update(state, ok), ok


def _with_rows(c, rows, pairs):
    """The batch `c` of one stack with its raw ids replaced by the rows they map to, and
    its pairs `(rows, unique, gains)` (moved to the owners' order where they were moved)."""
    pr, pu, pg = pairs
    return dataclasses.replace(
        c, unique_ids=rows, unique_raw_ids=None, pair_rows=pr, pair_unique=pu, pair_gains=pg
    )
