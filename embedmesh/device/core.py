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

from embedmesh.device import (
    ops,
    peers,
    placing,
    raw_ids,
    rounding,
    shard_program,
    slots_in_rows,
    stack_tables,
    strategies,
)
from embedmesh.device.shard_program import ShardBatch
from embedmesh.layout import sharding as mod_sharding
from embedmesh.layout.stacking import StackingPlan

# (names of the tables of raw ids' module the core's users read here)
ID_STATS, _FRESH_SALT = raw_ids.ID_STATS, raw_ids.FRESH_SALT


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


def _row_initializer(init):
    """Row-aware initialisers (`init.rows(row_ids, dim, dtype)`) get the logical row ids."""
    return getattr(init, "rows", None)


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
        self.placer = placing.BatchPlacer(self.row_sharding)  # `put`
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
        # the tables of raw 64-bit ids, composed (`raw_ids.RawIdTables`); `dynamic`:
        # {stack: (TablePlacement, IdMapConfig)}, the stacks that are such tables
        self.raw_ids = raw_ids.RawIdTables(self)
        self.dynamic = self.raw_ids.stacks

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
        return EmbeddingState(tables, slots, step, self.raw_ids.init(key))

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
        """Place this process's preprocessed arrays on its devices as global arrays,
        row-sharded (`placing.BatchPlacer.put`: how, and what `copy=False` may alias)."""
        return self.placer.put(csr, copy=copy)

    # -- tables of raw ids (`raw_ids.RawIdTables`, composed: `self.raw_ids`) ----------

    @property
    def dynamic_table_names(self) -> tuple:
        """The names of the tables of raw ids (`TableConfig.id_map`), in stack order."""
        return self.raw_ids.table_names

    def map_ids(self, state: EmbeddingState, csr: dict, *, keep_fresh=False, after_update=None):
        """The raw ids of the stacks of raw ids (`TableConfig.id_map`) mapped to rows:
        `(new state, csr, stats)` (with `keep_fresh`, and `fresh` for `reinit_fresh_rows`).
        Run it on a batch before `lookup` and `apply_gradients` (which refuse a batch with
        raw ids still in it), once a batch. Pure: jit it, donate the state
        (`raw_ids.RawIdTables.map_ids` says what each owner does)."""
        return self.raw_ids.map_ids(state, csr, keep_fresh=keep_fresh, after_update=after_update)

    def find_rows(self, state: EmbeddingState, csr: dict) -> dict:
        """`map_ids` read-only, for an evaluation lookup: the batch with the rows the id
        maps hold for its raw ids (`PAD_ID`, a zero row, for an id they do not hold); the
        state is only read. Pure: jit it."""
        return self.raw_ids.find_rows(state, csr)

    def reinit_fresh_rows(
        self, state: EmbeddingState, fresh: dict, *, after_update: dict | None = None
    ) -> EmbeddingState:
        """The rows a `map_ids(keep_fresh=True)` call gave to an id, re-initialised again,
        after an update of an earlier batch that ran after that call (pipelining). Pure:
        jit it, donate the state."""
        return self.raw_ids.reinit_fresh_rows(state, fresh, after_update=after_update)

    def read_dynamic(self, state: EmbeddingState, table, field: str = "parameters") -> dict:
        """A table of raw ids on the host: `{raw id (int): (shard, row in the shard's map,
        values)}` for its live ids (`field`: "parameters" or a slot name)."""
        return self.raw_ids.read(state, table, field)

    # -- the device programs --------------------------------------------------

    def specs(self, *trees):
        """A per-shard program's specs of its arguments `trees`: each tree's leaves sharded
        on the mesh's axes, a `PartitionSpec` as it is (`P()`: a replicated argument); one
        tree, its specs, else a tuple."""
        out = tuple(
            t if isinstance(t, P) else jax.tree_util.tree_map(lambda _: P(self.axes), t)
            for t in trees
        )
        return out[0] if len(trees) == 1 else out

    def shard_program(self, body, in_specs, out_specs):
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

    def after(self, x, previous):
        """`shard_program.after(x, previous)` where something crosses between devices
        (`Transport.crosses`); else `x`: nothing to order, and each `after` is a select
        over its array (16 thunks, ~0.15 ms a CPU step of 8 tables of raw ids)."""
        return shard_program.after(x, previous) if self.transport.crosses else x

    def _shard_batch(self, c, previous) -> ShardBatch:
        """This device's block of `c` inside `shard_map`, its exchanges after `previous`."""
        return ShardBatch(
            self.after(c.unique_ids[0], previous),
            c.pair_rows[0],
            c.pair_unique[0],
            c.pair_gains[0],
            c.rows_per_device,
            c.features,
            None if c.pairs_by_row is None else tuple(a[0] for a in c.pairs_by_row),
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
        raw_ids.refuse_raw(csr, "lookup")
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
        fn = self.shard_program(
            body,
            in_specs=self.specs(tables, csr),
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
        tables = _ordered_after(self, state.tables, acts, csr_next)
        state = dataclasses.replace(state, tables=tables)
        new_state, ok = self.apply_gradients(
            state, gradients, csr_prev, check_finite=check_finite, view=view
        )
        return (acts, new_state, ok, next_view) if carrying else (acts, new_state, ok)

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

        fn = self.shard_program(
            body,
            in_specs=self.specs(grads, batch_number),
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
        raw_ids.refuse_raw(csr, "apply_gradients")
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

            fn = self.shard_program(
                body,
                in_specs=self.specs(tables, slots, P(), grads, csr, P(), view),
                out_specs=self.specs(tables, slots),
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


def _ordered_after(core: EmbeddingCore, tables: dict, acts: dict, csr: dict) -> dict:
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
            out[s] = jax.lax.cond(keep, lambda t: t, lambda t: t + jnp.zeros((), t.dtype), tabs[s])
        return out

    tabs = {s: tables[s] for s in stacks}
    deps = {s: acts[first_act[s]] for s in stacks}
    fn = core.shard_program(
        body,
        in_specs=core.specs(tabs, deps),
        out_specs=core.specs(tabs),
    )
    return dict(tables, **fn(tabs, deps))
