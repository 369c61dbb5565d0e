"""`MeshEmbedding`: the stateful facade with TPUEmbeddingV2's constructor and methods.

A thin layer over the functional core (`embedmesh.device.core`): it owns the state,
preprocesses inputs on the host (`enqueue`), runs the jitted lookup
(`dequeue`, `embedding_lookup`, `__call__`) and the fused update
(`apply_gradients`, tables and slots donated), and reads tables back in
logical order (`embedding_tables`, `variables`, `embedding_table_shards`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from embedmesh import _compat, _runtime
from embedmesh.config import resolve_feature_config
from embedmesh.device import peers as _peers
from embedmesh.device.core import ID_STATS, EmbeddingCore, EmbeddingState
from embedmesh.host import agree as _agree
from embedmesh.host import fingerprint as _fingerprint
from embedmesh.host import preprocess as _pre
from embedmesh.host.prefetch import background_map
from embedmesh.inputs import flatten_inputs_like, to_csr
from embedmesh.job import EmbeddingJob
from embedmesh.layout import planner as _planner
from embedmesh.layout.stacking import StackingPlan, dim_multiple_for, slots_in_rows_for
from embedmesh.optimizers import Optimizer, optimizer_class_names


def _check_not_traced(what: str, *args) -> None:
    """RuntimeError when a facade method runs under a jax trace (inside `jax.jit`).

    The facade is stateful (it owns the state, preprocesses on the host and
    dispatches its own programs), so it cannot be traced; jax's own errors
    there are obscure. Cost: one trace-state query (or, without it, a scan of
    the arguments' leaves for tracers).
    """
    clean = _compat.trace_state_clean()  # 0.2 us; None: the private hook moved
    if clean is not None:
        if clean:
            return
    elif not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
        return
    raise RuntimeError(
        f"MeshEmbedding.{what} was called inside jax.jit (or another jax transformation). "
        f"The MeshEmbedding facade is stateful and runs outside jit: call emb.enqueue(...) "
        f"outside the jitted function and pass its result in, and inside jit use the "
        f"functional core, emb.core.lookup(state, csr) and emb.core.apply_gradients(state, "
        f"gradients, csr), with emb.state as an argument (see embedmesh.device.core)."
    )


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False  # a copy: writes would be lost; use set_tables
    return arr


def _return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`).

    Building a layer (table pieces, the planner's statistics) and compiling its
    programs (XLA's LLVM) free tens of MB into malloc's arenas, which glibc keeps
    resident (benchmarks/runs/train-history.md, 2026-12-03: 30-40 MB less peak RSS in
    training). The facade calls this twice a layer: after `build`, after its first
    update program compiles. A no-op off glibc."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
            _MALLOC_TRIM.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc
            pass
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None  # None: not looked up yet; False: unavailable (not glibc)


_MAPPED_FIELDS = ("unique_ids", "pair_rows", "pair_unique", "pair_gains")


def _mapped_rows(csr: dict, state, mapped: dict, stats: dict, *rest) -> tuple:
    """`EmbeddingCore.map_ids`'s `(state, csr, stats[, fresh])` with the batch reduced to
    what the map changed, `{stack: (rows, pair_rows, pair_unique, pair_gains)}` (the
    stacks whose raw ids became rows: their rows, and their pairs in the rows' order;
    None for an array the map left as it was, the pairs where the CPU kernels run it),
    for a program to return in place of the batch, whose unchanged arrays it would copy
    (24 copies of ~30 us a step of 8 tables of benchmarks/train/dynamic_ids.py); and the
    counts as one int32 array `[stacks, len(ID_STATS)]`, the stacks sorted (`_id_counts`
    reads it): a program's every output costs its dispatch 3-4 us on CPU, and the counts
    were 6 a stack."""
    rows = {
        s: tuple(
            None if getattr(c, f) is getattr(csr[s], f) else getattr(c, f) for f in _MAPPED_FIELDS
        )
        for s, c in mapped.items()
        if c.unique_raw_ids is None and getattr(csr[s], "unique_raw_ids", None) is not None
    }
    counts = (
        jnp.stack([jnp.stack([stats[s][k] for k in ID_STATS]) for s in sorted(stats)])
        if stats
        else None
    )
    return (state, rows, counts, *rest)


def _id_counts(rows: dict, counts) -> tuple:
    """What `dequeue` keeps of a map's counts for `last_stats`: `(stacks, counts)`."""
    return (tuple(sorted(rows)), counts) if counts is not None else ()


def _with_rows(csr: dict, rows: dict) -> dict:
    """The batch `EmbeddingCore.map_ids` returns, from the batch it took and what
    `_mapped_rows` kept: each mapped stack with its rows, its reordered pairs (or the
    pairs it had) and no raw ids, the others as they are (the same arrays)."""
    return {
        s: (
            dataclasses.replace(
                c,
                unique_raw_ids=None,
                **{f: x for f, x in zip(_MAPPED_FIELDS, rows[s]) if x is not None},
            )
            if s in rows
            else c
        )
        for s, c in csr.items()
    }


def default_mesh() -> Mesh:
    """The mesh set by `jax.set_mesh` if any, else all devices on one axis."""
    current = jax.sharding.get_mesh()
    if current is not None and not current.empty:
        return current
    return Mesh(np.array(jax.devices()), ("devices",))


class MeshEmbedding:
    """TPUEmbeddingV2's mid-level API on a JAX mesh (`embedmesh.tpu.TPUEmbeddingV2`).

    Args:
      feature_config: a nested structure of `FeatureConfig`.
      optimizer: default optimizer for tables without one; None builds no
        slots (serving/export only).
      pipeline_execution_with_tensor_core: if True, `apply_gradients` is
        deferred and fused with the next lookup in one program, so sparse and
        dense work can overlap; lookups then see tables one update stale.
        If False, lookups see every update; the update is still dispatched
        with the next lookup, as one program (`apply_gradients` checks the
        gradients and returns; the next `dequeue`, or any read of the state,
        applies it first): 20-30% less step time on CPU than two programs.
      mesh: the device mesh (default: see `default_mesh`).
      stack_tables, max_stack_rows: see `plan_stacking`.
      sharding: how each table is spread over the N devices, and what crosses
        between them (`embedmesh.layout.planner`): "mod" (the default, also
        named "row_wise_rows") spreads its rows over all N shards, row `i` on
        shard `(i % N + rotation) % N` as TPUEmbeddingV2 does, and the owners
        send the rows of each source's distinct ids; "row_wise_pooled" places
        the rows the same way, and the owners pool each source's ids into
        partial sums and send those (fewer bytes for multi-hot features);
        "table_wise" puts each whole table on one shard (tables bin-packed,
        largest first onto the least loaded), which pools and sends the
        activations; "data_parallel" keeps a replica of the table on every
        device: lookups read it in place, and each step every device sends the
        others its distinct ids and their summed gradients, which every
        replica applies (for small tables read by many ids); "auto" lets the
        planner pick per table from its cost model, fed by the first batch
        (`emb.plan` shows the choice; an explicit `build()` before any batch
        plans from the config alone); or a mapping `{table name or
        TableConfig: one of these}` (tables not named: "mod"), where "auto"
        tables are planned around the others. Unknown tables or strategies
        raise a ValueError. Every strategy gives the same results, to float32
        rounding; on one device they are one.
      batch_size: the global batch a training step takes (all devices, all
        processes), which the planner plans for (`batch_size / N` samples a
        device). Default: the first batch's size (its samples on this process
        over the process's devices), or 256 a device when `build()` comes
        before any batch. `emb.plan` says which it used.
      memory_limit_bytes: the bytes of tables and optimizer slots a device may
        hold (every plan, explicit or "auto": a plan over it is a ValueError
        naming the tables, the bytes and the limit, raised by `build()` before
        anything is allocated; "auto" picks among the plans that fit). Default:
        an accelerator's own limit (a GPU's or a TPU's `device.memory_stats()["bytes_limit"]`,
        counting a TPU's rows padded to 128 lanes); on CPU 80%
        of the host's physical memory over this process's devices.
      capacities: `{stack: Capacity}` or one `Capacity` (see
        `compute_sparse_core_stats`); default: sized from the first batch.
      overflow: "error", "drop" or "grow". Default: "error" when capacities
        are given, "grow" when they are sized automatically (a larger batch
        then costs one recompilation and loses nothing). With several
        processes, automatic and grown capacities are agreed among them (see
        `enqueue`).
      check_finite: a non-finite gradient raises and leaves tables untouched.
      seed: the initialisation seed, and that of the stochastic rounding of bfloat16 and
        float16 tables' updates (`TableConfig.dtype`).

    Properties beside the methods: `plan` (what lives where, `print(emb.plan)`),
    `core` (the functional core for a jitted step of one's own), `state`, `mesh` and
    `last_stats` (the latest batch's preprocessing). `plan`, `core`, `state` and `mesh`
    build the layer on first access; with sharding="auto", `plan`, `core` and `state`
    raise a RuntimeError until the first batch (or `build()`), since "auto" plans from
    it.
    """

    def __init__(
        self,
        feature_config: Any,
        optimizer: Optimizer | None = None,
        pipeline_execution_with_tensor_core: bool = False,
        *,
        mesh: Mesh | None = None,
        stack_tables: bool = True,
        max_stack_rows: int | None = None,
        sharding: str | Mapping[Any, str] = "mod",
        capacities: Any = None,
        overflow: str | None = None,
        check_finite: bool = True,
        seed: int = 0,
        batch_size: int | None = None,
        memory_limit_bytes: float | None = None,
    ):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(
                f"optimizer must be None or an instance of one of embedmesh's optimizers "
                f"({optimizer_class_names()}), e.g. em.Adagrad(learning_rate=0.1); got "
                f"{optimizer!r}"
            )
        self._feature_config = feature_config
        self._resolved = resolve_feature_config(feature_config)
        self._optimizer = optimizer
        self._pipelined = bool(pipeline_execution_with_tensor_core)
        self._mesh = mesh
        self._stack_tables = stack_tables
        self._max_stack_rows = max_stack_rows
        # a ValueError naming a bad table or strategy before build: {table: strategy}
        self._strategies = _planner.resolve_strategies(self._resolved, sharding)
        self._sample_csrs: list | None = None  # the first batch, for "auto" (see build)
        if batch_size is not None and not (
            isinstance(batch_size, (int, np.integer))
            and not isinstance(batch_size, bool)
            and batch_size >= 1
        ):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
        self._batch_size = batch_size
        if memory_limit_bytes is not None and not (
            isinstance(memory_limit_bytes, (int, float, np.integer, np.floating))
            and not isinstance(memory_limit_bytes, bool)
            and memory_limit_bytes > 0
        ):
            raise ValueError(
                f"memory_limit_bytes must be None or a number > 0, got {memory_limit_bytes!r}"
            )
        self._memory_limit = memory_limit_bytes
        self._capacities = capacities
        if overflow is None:
            overflow = "grow" if capacities is None else "error"
        if overflow not in _pre.OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {_pre.OVERFLOW_POLICIES}, got {overflow!r}")
        self._overflow = overflow
        self._check_finite = check_finite
        self._seed = seed
        self._built = False
        self._trimmed = False  # the free heap returned after the first update compiled
        self._pending: tuple | None = None  # (checked gradients, csr, view): the next update
        # (the last dequeue's outputs, the owners' view of them: `EmbeddingCore.lookup`)
        self._view: tuple | None = None
        self._observed: tuple | None = None  # (pending, state with it applied), cached
        # pipelined, after a restore of a checkpoint saved with an update pending: the
        # state to install after the next lookup (which reads `_state`, one update stale)
        self._after_lookup: EmbeddingState | None = None
        self._plan: StackingPlan | None = None  # set by build(): see the properties
        self._core: EmbeddingCore | None = None
        self._job: EmbeddingJob | None = None  # `job`, made again when plan or core change
        self._last_stats: _pre.PreprocessStats | None = None
        # the latest map's counts (`_id_counts`: stacks, [stacks, 6] array), by last_stats
        self._id_stats: tuple = ()
        self._agreed_shapes: np.ndarray | None = None  # several processes: see enqueue
        self._attempts = 0  # several processes: enqueue attempts, failed ones included

    # -- build ------------------------------------------------------------------

    def build(self):
        """Create tables and slots on the mesh, shard by shard.

        With a mesh over several processes, every process must build the same job:
        a ValueError on every process names the first field that differs
        (`_agree_on_job`), before any other collective."""
        _check_not_traced("build")
        if self._built:
            return
        mesh = self._mesh if self._mesh is not None else default_mesh()
        if len({d.process_index for d in mesh.devices.flat}) > 1:
            self._agree_on_job(mesh)  # first: before any other collective
        self._mesh = mesh
        strategies, predicted, planned_batch = self._plan_strategies(mesh)
        exchanges = {t: _planner.STRATEGY_FORMS[s][1] for t, s in strategies.items()}
        plan = _planner.stacking_for(self._resolved, mesh.size, strategies, **self._stacking())
        plan = dataclasses.replace(
            plan,
            strategies=tuple((t, strategies[t]) for t in self._resolved.table_names),
            predicted=predicted,
            planned_batch=planned_batch,
        )
        core = EmbeddingCore(plan, mesh, self._optimizer, exchanges, rounding_seed=self._seed)
        self.core = core
        devices = list(mesh.devices.flat)
        local = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
        if local != list(range(local[0], local[0] + len(local))):
            raise ValueError("this process's devices must be contiguous in mesh order")
        self._num_local_devices = len(local)
        # the mesh spans several processes: capacities and shapes are agreed among them
        self._multiprocess = len({d.process_index for d in devices}) > 1
        self._state = self.core.init(jax.random.key(self._seed))
        self.plan = dataclasses.replace(
            plan, measured_bytes_per_device=self.core.bytes_per_device(self._state)
        )
        core = self.core  # no reference to self: no cycle
        # Every lookup also returns the owners' view of its batch (`core.lookup`'s
        # `carrying`), which that batch's update takes: the pairs cross once a step.
        self._lookup_fn = jax.jit(lambda st, c: core.lookup(st, c, carrying=True))

        # gradients are checked on the host side (`_step_check_fn`) before either
        # deferred program runs: an in-program `cond` costs 2-10 ms a step on CPU
        def lookup_then_apply(st, g, c_prev, view, c_next):
            acts, st, _, next_view = core.lookup_then_apply_gradients(
                st, g, c_prev, c_next, check_finite=False, view=view, carrying=True
            )
            return (acts, next_view), st

        self._fused_fn = jax.jit(lookup_then_apply, donate_argnums=0)
        self._apply_fn = jax.jit(
            lambda st, g, c, view: core.apply_gradients(st, g, c, check_finite=False, view=view)[0],
            donate_argnums=0,
        )

        def apply_then_lookup(st, g, c_prev, view, c_next):
            st, _ = core.apply_gradients(st, g, c_prev, check_finite=False, view=view)
            return core.lookup(st, c_next, carrying=True), st

        self._apply_lookup_fn = jax.jit(apply_then_lookup, donate_argnums=0)
        # pipelined reads: the pending update applied into new buffers, the live
        # state (what the next lookup reads) left as it is
        self._apply_copy_fn = jax.jit(
            lambda st, g, c, view: core.apply_gradients(st, g, c, check_finite=False, view=view)[0]
        )
        self._step_check_fn = jax.jit(core.step_check)

        # tables of raw ids: their ids become rows before the lookup (`core.map_ids`).
        # The map's programs return the new rows and pairs only (`_mapped_rows`), the batch
        # made around them here (`_with_rows`): a program returning the whole batch
        # copies its unchanged arrays out (~0.8 ms a step on the dynamic_ids benchmark)
        def map_ids(st, c, c_prev=None):  # (named: the program's name in traces)
            return _mapped_rows(c, *core.map_ids(st, c, after_update=c_prev))

        self._map_fn = jax.jit(map_ids, donate_argnums=0)

        # unpipelined, the same three steps as one program each step: the pending update,
        # the map (after it: the map may give that update's rows to other ids), the
        # lookup. One dispatch instead of three of the whole state (each 0.4-1.1 ms of
        # the host's CPU a step on the dynamic_ids benchmark, which the CPU device shares)
        def apply_map_lookup(st, g, c_prev, view, c_next):
            st, _ = core.apply_gradients(st, g, c_prev, check_finite=False, view=view)
            return map_lookup(st, c_next, c_prev)

        def map_lookup(st, c, c_prev=None):
            st, rows, stats = map_ids(st, c, c_prev)
            return core.lookup(st, _with_rows(c, rows), carrying=True), st, rows, stats

        self._apply_map_lookup_fn = jax.jit(apply_map_lookup, donate_argnums=0)
        self._map_lookup_fn = jax.jit(map_lookup, donate_argnums=0)

        # pipelined, an update pending: the next batch's ids are mapped first, at the
        # step that update brings (the map's decisions are the unpipelined run's), and
        # the rows it gave to an id are re-initialised again after that update (whose
        # gradient of an id evicted meanwhile may land on one): see `_map_ahead`
        def map_ahead(st, c):
            ahead = dataclasses.replace(st, step=st.step + 1)
            ahead, rows, stats, fresh = _mapped_rows(c, *core.map_ids(ahead, c, keep_fresh=True))
            return dataclasses.replace(ahead, step=st.step), rows, stats, fresh

        self._map_ahead_fn = jax.jit(map_ahead, donate_argnums=0)

        def lookup_apply_refresh(st, g, c_prev, view, c_next, fresh):
            out, st = lookup_then_apply(st, g, c_prev, view, c_next)
            return out, core.reinit_fresh_rows(st, fresh, after_update=c_prev)

        self._fused_refresh_fn = jax.jit(lookup_apply_refresh, donate_argnums=0)
        # (restored mid-pipeline: `_map_restored`; once, so nothing donated)
        self._map_keep_fn = jax.jit(
            lambda st, c: _mapped_rows(c, *core.map_ids(st, c, keep_fresh=True))
        )
        self._reinit_fn = jax.jit(core.reinit_fresh_rows)
        self._built = True
        _return_free_heap()  # the build's temporaries

    def _agree_on_job(self, mesh) -> None:
        """ValueError on every process unless all processes build the same job
        (`embedmesh.host.fingerprint`): one all-gather of two int32 when they agree;
        when not, a second one carrying every process's fields, to name the first
        that differs. Runs before any other collective of the job (the planner's
        broadcast, `same_host_job`, the steps), which would hang or abort on a
        mismatch."""
        options = {
            "stack_tables": self._stack_tables,
            "max_stack_rows": self._max_stack_rows,
            "capacities": self._capacities,
            "overflow": self._overflow,
            "check_finite": self._check_finite,
            "pipeline_execution_with_tensor_core": self._pipelined,
            "seed": self._seed,
            "batch_size": self._batch_size,
            "mesh axis names": mesh.axis_names,
            "mesh shape": mesh.devices.shape,
            "mesh devices (id, process)": [(d.id, d.process_index) for d in mesh.devices.flat],
            "EMBEDMESH_HOST_EXCHANGE": "on" if _runtime.host_exchange_enabled() else "off (0)",
            "jax version": jax.__version__,
        }
        blob = _fingerprint.encode(
            _fingerprint.job_fields(self._resolved, self._optimizer, self._strategies, options)
        )
        headers = np.asarray(multihost_utils.process_allgather(_fingerprint.header(blob)))
        if _fingerprint.differs(headers):  # seen by every process: all gather the fields
            fields = _fingerprint.padded(blob, headers)
            raise _fingerprint.mismatch(
                np.asarray(multihost_utils.process_allgather(fields)), headers
            )

    def observed_state(self) -> EmbeddingState:
        """The state with every accepted update applied, without changing what the
        next lookup sees: what `embedding_tables`, `variables`,
        `embedding_table_shards` and checkpoints read.

        Unpipelined, that is the state itself (lookups see every update). In
        pipelined mode the next lookup must still read the tables one update
        stale, so a pending update is applied into new arrays (one extra copy of
        the touched stacks on the devices while they are held) and the live
        state stays as it is: observing never changes the trajectory.
        """
        if self._after_lookup is not None:
            return self._after_lookup
        if self._pending is None:
            return self._state
        if not self._pipelined:
            self.flush()
            return self._state
        if self._observed is None or self._observed[0] is not self._pending:
            grads, csr, view = self._pending
            self._observed = (self._pending, self._apply_copy_fn(self._state, grads, csr, view))
        return self._observed[1]

    @property
    def state(self) -> EmbeddingState:
        """The embedding state (`EmbeddingState`) the next lookup reads: every
        accepted update applied, except, in pipelined mode, the one the next
        lookup applies after it reads (see `observed_state`). Built on first access as
        `plan` is (a RuntimeError with sharding="auto" before the first batch)."""
        self._build_for("state")
        if not self._pipelined:
            self.flush()
        return self._state

    @state.setter
    def state(self, value: EmbeddingState):
        if not self._pipelined:
            self.flush()
        self._after_lookup = None
        self._state = value

    @property
    def pipelined(self) -> bool:
        """Whether lookups read the tables one update stale (TPU pipelining)."""
        return self._pipelined

    def checkpoint_state(self) -> tuple:
        """`(observed state, {stack: parameters the next lookup reads})`: what a checkpoint
        of this layer stores (`embedmesh.checkpoint.state_tree` saves it with
        `core_state_tree(emb.core, state, lookup_tables=...)`). The second is empty
        unless pipelined with an update pending, and then holds only the stacks that
        update touches (the others read the observed tables). Never changes what the next
        lookup reads."""
        state = self.observed_state()
        if not self._pipelined:
            return state, {}
        if self._after_lookup is not None:
            return state, {s: a for s, a in self._state.tables.items() if a is not state.tables[s]}
        if self._pending is None:
            return state, {}
        _, csr, _ = self._pending
        return state, {s: self._state.tables[s] for s in csr}

    def install_restored(self, restored) -> None:
        """Install an `embedmesh.checkpoint.RestoredState` (what `core_restore` of this
        layer's core returns; `embedmesh.checkpoint.restore` calls this). Pipelined with
        lookup tables, the next lookup reads `restored.lookup_state()` and
        `restored.state` is installed right after it; otherwise `restored.state` is
        installed now. A pending update is dropped: the restored state replaces it."""
        self._pending = None
        self._observed = None
        self._after_lookup = None
        if self._pipelined and restored.lookup_tables:
            self._state = restored.lookup_state()
            self._after_lookup = restored.state
        else:
            self._state = restored.state

    def _require_built(self, what: str):
        if not self._built:
            raise RuntimeError(f"{what} needs build() first")

    def _stacking(self) -> dict:
        """`plan_stacking`'s options of this layer (the planner's memory rule uses them);
        the dim multiple and where slots are kept are the mesh's platform's (on a TPU:
        whole 128-lane rows, the slots in them)."""
        platform = self._mesh.devices.flat[0].platform if self._mesh is not None else "cpu"
        return dict(
            stack_tables=self._stack_tables,
            max_stack_rows=self._max_stack_rows,
            default_optimizer=self._optimizer,
            dim_multiple=dim_multiple_for(platform),
            slots_in_rows=slots_in_rows_for(platform),
        )

    def _memory_limit_of(self, mesh, on_cpu: bool) -> float | None:
        """Bytes a device may hold: `memory_limit_bytes`, else a GPU's own limit (the
        least of this process's devices), else on CPU `planner.cpu_memory_limit`; None
        (the cost model's machine) where a GPU does not tell."""
        if self._memory_limit is not None:
            return float(self._memory_limit)
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        if on_cpu:
            return _planner.cpu_memory_limit(len(local))
        limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
        known = [float(x) for x in limits if x]
        return min(known) if known and len(known) == len(limits) else None

    def _plan_strategies(self, mesh) -> tuple:
        """`({table: strategy}, the cost model's Plan, the batch planned for in words)`:
        the "auto" tables planned (from the first batch when one was given before
        building) for `batch_size` (else the first batch's, else the default), every
        plan within the memory limit. With several processes every process takes
        process 0's plan (each saw its own batch; they must compile the same programs)."""
        names = self._resolved.table_names
        optimizers = {
            t: (c.optimizer if c.optimizer is not None else self._optimizer)
            for t, c in zip(names, self._resolved.tables)
        }
        csrs = self._sample_csrs
        stats = _planner.table_stats(self._resolved, optimizers, csrs)
        local = max(1, sum(d.process_index == jax.process_index() for d in mesh.devices.flat))
        if self._batch_size is not None:
            batch = -(-int(self._batch_size) // mesh.size)
            planned_batch = f"batch_size={self._batch_size}: {batch} samples a device"
        elif csrs:
            batch = csrs[0].batch_size // local
            planned_batch = (
                f"the first batch: {csrs[0].batch_size} samples on this process, "
                f"{batch} a device (no batch_size= given)"
            )
        else:
            batch = _planner.DEFAULT_BATCH_PER_DEVICE
            planned_batch = f"{batch} samples a device (the default: no batch_size=, no batch)"
        on_cpu = _peers.mesh_on_cpu(mesh)
        chosen, predicted = _planner.plan(
            stats,
            self._strategies,
            mesh.size,
            batch,
            _planner.machine_for(mesh, on_cpu),
            memory_limit=self._memory_limit_of(mesh, on_cpu),
            memory_of=_planner.layout_memory(self._resolved, mesh.size, **self._stacking()),
            # a table of raw ids cannot be replicated (its id map: `core._dynamic_stacks`)
            excluded={
                t: ("data_parallel",)
                for t, c in zip(names, self._resolved.tables)
                if getattr(c, "id_map", None) is not None
            },
        )
        if "auto" in self._strategies.values() and jax.process_count() > 1:
            codes = np.array(
                [
                    _planner.PLANNED.index("row_wise_rows" if chosen[t] == "mod" else chosen[t])
                    for t in names
                ],
                np.int32,
            )
            codes = np.asarray(multihost_utils.broadcast_one_to_all(codes))
            agreed = {t: _planner.PLANNED[int(c)] for t, c in zip(names, codes)}
            chosen = {t: (chosen[t] if self._strategies[t] != "auto" else agreed[t]) for t in names}
        self._sample_csrs = None
        return chosen, predicted, planned_batch

    def _maybe_build(self, features=None, weights=None):
        if not self._built:
            if features is not None and "auto" in self._strategies.values():
                self._sample_csrs = _planner_sample(self._resolved, features, weights)
            self.build()

    @property
    def mesh(self) -> Mesh:
        """The device mesh the tables live on (builds on first access)."""
        self._maybe_build()
        assert self._mesh is not None  # built
        return self._mesh

    def _build_for(self, what: str) -> None:
        """Build on first access to `what`, except under sharding="auto" before any batch:
        building then would plan without the batch statistics "auto" plans from."""
        if self._built:
            return
        if "auto" in self._strategies.values():
            raise RuntimeError(
                f"MeshEmbedding.{what} is not planned yet: sharding='auto' plans from the "
                f"first batch, so enqueue a batch first (emb.enqueue, emb(...), "
                f"emb.prefetch), or call emb.build() to plan from the config alone"
            )
        self.build()

    @property
    def plan(self) -> StackingPlan:
        """The `StackingPlan`: per table its strategy, stack, devices and MB held there,
        with the cost model's prediction (`print(emb.plan)`). Builds on first access,
        except with sharding="auto" before the first batch or `build()`: a
        RuntimeError, since "auto" plans from the first batch."""
        if self._plan is None:  # (build() sets it before it reads it)
            self._build_for("plan")
        assert self._plan is not None  # built
        return self._plan

    @plan.setter
    def plan(self, value: StackingPlan) -> None:
        """Set by `build()`."""
        self._plan = value

    @property
    def core(self) -> EmbeddingCore:
        """The functional core (`EmbeddingCore`) for a jitted train step of one's own:
        `core.lookup(emb.state, csr)`, `core.apply_gradients(...)`. Built on first access
        as `plan` is (a RuntimeError with sharding="auto" before the first batch)."""
        if self._core is None:
            self._build_for("core")
        assert self._core is not None  # built
        return self._core

    @core.setter
    def core(self, value: EmbeddingCore) -> None:
        """Set by `build()`."""
        self._core = value

    @property
    def job(self) -> EmbeddingJob:
        """This layer without its state (`EmbeddingJob`: the resolved features, `plan`,
        `core`, the seed, and the checks and shape work around the core), for code that
        keeps the state elsewhere (the flax modules). Built on first access as `plan`
        is."""
        job = self._job
        if job is None or job.plan is not self.plan or job.core is not self.core:
            job = self._job = EmbeddingJob(self._resolved, self.plan, self.core, self._seed)
        return job

    def release_state(self) -> EmbeddingState:
        """Hand the state over to a new owner (a flax module): this layer keeps no
        reference to it (one copy of the tables, not two) and must not be stepped
        itself afterwards; a fresh initial state when it holds none (a second owner).
        Not in pipelined mode (its state is one update stale)."""
        if self._pipelined:
            raise ValueError("release_state: a pipelined layer's state is one update stale")
        self.build()
        self.flush()
        state = self._state if self._state is not None else self.job.init_state()
        self._state = None
        return state

    @property
    def last_stats(self) -> _pre.PreprocessStats | None:
        """The `PreprocessStats` of the latest `enqueue` (per stack: ids per partition,
        capacity, ids dropped by overflow="drop", whether the capacity grew); None before
        the first batch. A stack of raw ids (`TableConfig.id_map`) has its id maps'
        counts of the latest lookup in `id_map` (hits, admissions, evictions, pending,
        refused, occupancy; reading them waits for that lookup)."""
        stats: _pre.PreprocessStats | None = self._last_stats
        if stats is not None and self._id_stats:
            names, values = self._id_stats
            host = np.asarray(jax.device_get(values))
            counts = {s: dict(zip(ID_STATS, map(int, host[i]))) for i, s in enumerate(names)}
            self._id_stats = ()
            stats = _pre.PreprocessStats(
                {
                    name: dataclasses.replace(st, id_map=counts.get(name, st.id_map))
                    for name, st in stats.stacks.items()
                }
            )
            self._last_stats = stats
        return stats

    @last_stats.setter
    def last_stats(self, value: _pre.PreprocessStats | None) -> None:
        """Set by `enqueue`."""
        self._last_stats = value

    # -- host preprocessing -------------------------------------------------------

    # Pure numpy preprocessing, in TensorFlow's form (`num_replicas_in_sync, ...,
    # flat_features, flat_inputs, flat_weights`) -> `(csr, int, int)`, which `dequeue`
    # takes, the signature `inspect.signature` shows, or embedmesh's `(features,
    # weights, plan, **options)` -> `(csr, stats)` (`embedmesh.host.preprocess`).
    preprocess_features = staticmethod(_pre.preprocess_features)

    def enqueue(self, features: Any, weights: Any | None = None, device: str | None = None) -> dict:
        """Preprocess this process's batch on the host and place it on the mesh.

        Returns `{stack: PartitionedCsrFormatTensor}` of global arrays for
        `dequeue`. `device` is accepted for API compatibility: preprocessing
        always runs on this process's host and feeds all its local devices.
        In a job of several processes, capacities and batch shapes are agreed
        among them (see `_agreed_put`), and each attempt, failed or not, is
        numbered: `apply_gradients` refuses a step whose processes are at
        different numbers (see `_check_step`).
        """
        _check_not_traced("enqueue", features, weights)
        self._maybe_build(features, weights)
        if self._multiprocess:
            return self._agreed_put(self._prepare(features, weights))
        csr, stats = self._preprocess(features, weights, self._capacities, self._overflow)
        self._record(stats)
        return self.core.put(csr, copy=False)  # its arrays, just made: aliased where aligned

    def _preprocess(self, features, weights, capacities, overflow):
        return _pre.preprocess_batch(
            features,
            weights,
            self.plan,
            num_devices_local=self._num_local_devices,
            capacities=capacities,
            overflow=overflow,
            process_index=jax.process_index(),
        )

    def _record(self, stats) -> None:
        """Keep the capacities a batch was compiled for (automatic ones, grown ones)."""
        caps = dict(self._capacities) if isinstance(self._capacities, dict) else {}
        if self._capacities is None or stats.grown or isinstance(self._capacities, dict):
            caps.update(stats.capacities)
            self._capacities = caps
        self.last_stats = stats

    def _prepare(self, features, weights) -> tuple:
        """Several processes: this process's preprocessing at the current capacities,
        `(features, weights, (csr, stats) or None, its exception or None)`; may run
        ahead in the prefetch thread (`_agreed_put` refills stale capacities)."""
        try:
            result = self._preprocess(features, weights, self._capacities, self._overflow)
        except Exception as e:  # noqa: BLE001 - announced to the others, then re-raised
            return features, weights, None, e
        return features, weights, result, None

    def _agreed_put(self, prepared: tuple) -> dict:
        """A `_prepare`d batch of a multi-process job, with capacities and shapes
        agreed among the processes, placed on the mesh.

        Every process must compile the same program, so capacities are chosen from
        every process's needs (`embedmesh.host.agree`): one all-gather of a small
        int32 vector at the first batch and, with overflow="grow" (whether to grow
        depends on every process's batch), at every batch. With fixed capacities
        (overflow "error"/"drop") later batches run no collective: their shapes
        are checked here against the agreed ones. A process whose preprocessing
        failed during an agreement announces it, so the others raise too instead
        of waiting in the collective. Runs in the consumer's thread: from the
        prefetch thread the gather could meet another process's step.
        """
        features, weights, result, error = prepared
        self._attempts += 1  # every attempt counts: see `_check_step`
        number = self._attempts
        before = {
            s.name: _pre._capacity_for(self._capacities, self.plan, s.name)
            for s in self.plan.stacks
        }
        agreed_shapes = self._agreed_shapes
        agree_now = self._overflow == "grow" or agreed_shapes is None
        if error is not None:
            if agree_now:  # the others are about to gather: let them raise too
                multihost_utils.process_allgather(_agree.failed_vector(self.plan))
            raise error
        csr, stats = result
        local = _agree.local_vector(self.plan, csr, stats, before)
        if agree_now:
            gathered = np.asarray(multihost_utils.process_allgather(local))
            target = _agree.decide(gathered, self.plan, before, self._overflow)
            self._agreed_shapes = _agree.shapes_of(local, target, self.plan)
        else:
            assert agreed_shapes is not None
            _agree.check_unchanged(agreed_shapes, local, self.plan, jax.process_index())
            target = {name: cap for name, cap in before.items() if cap is not None}
        if target != stats.capacities:  # another process needed more, or prepared ahead
            csr, stats = self._preprocess(features, weights, target, self._overflow)
        stats = _pre.PreprocessStats(
            {
                name: dataclasses.replace(
                    st, grown=before[name] is not None and target[name] != before[name]
                )
                for name, st in stats.stacks.items()
            }
        )
        self._record(stats)
        mark = np.full(self._num_local_devices, number, np.int32)
        return self.core.put({k: dataclasses.replace(c, batch_number=mark) for k, c in csr.items()})

    def prefetch(self, batches: Iterable, buffer_size: int = 2) -> Iterator[dict]:
        """Enqueue batches in a background thread, `buffer_size` ahead of the consumer.

        `batches` yields `features` or `(features, weights)`. An error in the
        thread is re-raised by the iterator in the training loop. With several
        processes only the local preprocessing runs ahead; the agreement among
        processes runs in the consumer's thread (see `_agreed_put`).
        """

        def split(item):
            return item if isinstance(item, tuple) and len(item) == 2 else (item, None)

        if not self._built and "auto" in self._strategies.values():
            batches = iter(batches)  # the planner sees the first batch
            first = next(batches, None)
            if first is not None:
                self._maybe_build(*split(first))
                batches = itertools.chain([first], batches)
        self._maybe_build()
        if not self._multiprocess:
            return background_map(lambda item: self.enqueue(*split(item)), batches, buffer_size)
        prepared = background_map(lambda item: self._prepare(*split(item)), batches, buffer_size)

        def agreed():
            try:
                for p in prepared:
                    yield self._agreed_put(p)
            finally:
                prepared.close()

        return agreed()

    # -- lookup -------------------------------------------------------------------

    def dequeue(self, partitioned_tensors):
        """Activations for enqueued inputs: `(activations, preserved_outputs)`.

        `partitioned_tensors` is `enqueue`'s `{stack: PartitionedCsrFormatTensor}`
        or, as TensorFlow's signature has it, a tuple `(that dict, int, int)`
        (the seed-form `preprocess_features` returns one; the ints are
        checked to be ints and otherwise unused). `preserved_outputs` is the
        dict.
        """
        _check_not_traced("dequeue", partitioned_tensors)
        self._require_built("dequeue")
        partitioned_tensors = self._partitioned_dict(partitioned_tensors, "dequeue")
        fresh = None
        if any(
            getattr(c, "unique_raw_ids", None) is not None for c in partitioned_tensors.values()
        ):
            if self._pipelined and self._pending is not None:
                partitioned_tensors, fresh = self._map_ahead(partitioned_tensors)
            elif self._pipelined and self._after_lookup is not None:
                partitioned_tensors = self._map_restored(partitioned_tensors)
            else:
                # raw ids to rows (`EmbeddingCore.map_ids`), after the pending update (the
                # map may give its rows to other ids), then the lookup: one program
                return self._map_and_lookup(partitioned_tensors)
        if self._pending is not None:
            grads, prev, view = self._take_pending()
            if fresh is not None:  # pipelined, raw ids: see `_map_ahead`
                (acts, view), self._state = self._fused_refresh_fn(
                    self._state, grads, prev, view, partitioned_tensors, fresh
                )
            else:
                run = self._fused_fn if self._pipelined else self._apply_lookup_fn
                (acts, view), self._state = run(self._state, grads, prev, view, partitioned_tensors)
            self._trim_once()
        else:
            acts, view = self._lookup_fn(self._state, partitioned_tensors)
            if self._after_lookup is not None:  # restored mid-pipeline: now up to date
                self._state, self._after_lookup = self._after_lookup, None
        self._view = (partitioned_tensors, view)
        return self._pack_activations(acts, partitioned_tensors), partitioned_tensors

    def _map_and_lookup(self, csr: dict):
        """Unpipelined `dequeue` of a batch with raw ids: the pending update if any, the
        map, the lookup, in one program."""
        if self._pending is not None:
            grads, prev, view = self._take_pending()
            out = self._apply_map_lookup_fn(self._state, grads, prev, view, csr)
            self._trim_once()
        else:
            out = self._map_lookup_fn(self._state, csr)
        (acts, view), self._state, rows, counts = out
        self._id_stats = _id_counts(rows, counts)
        csr = _with_rows(csr, rows)
        self._view = (csr, view)
        return self._pack_activations(acts, csr), csr

    def _take_pending(self) -> tuple:
        """The pending update `(grads, csr, view)`, no longer pending (nor its read copy,
        `_observed`)."""
        pending, self._pending, self._observed = self._pending, None, None
        assert pending is not None
        return pending

    def _trim_once(self) -> None:
        """After the first update ran: its compilation's temporaries back to the system
        (the step's own are small)."""
        if not self._trimmed:
            self._trimmed = True
            _return_free_heap()

    def _map_ahead(self, csr: dict) -> tuple:
        """Pipelined, an update pending: map the raw ids of the next batch `csr` before
        that update, `(csr with rows, what the map re-initialised)`.

        The map runs at the step the pending update brings, so its decisions (rows,
        admissions, evictions, LRU/LFU order) are those of the unpipelined run, and
        reads the state the lookup reads (one update stale). The pending update may
        then hold the gradient of an id this map evicted, whose row it gave to another
        id: `dequeue` runs the update and re-initialises the rows given in this map
        again (`EmbeddingCore.reinit_fresh_rows`), so no update of an old id stays on
        a new id's row, as if the map had run after the update (the old id's values
        are discarded by its eviction either way)."""
        self._state, rows, counts, fresh = self._map_ahead_fn(self._state, csr)
        self._id_stats = _id_counts(rows, counts)
        return _with_rows(csr, rows), fresh

    def _map_restored(self, csr: dict) -> dict:
        """Pipelined, restored from a checkpoint saved with an update pending (the next
        lookup reads `_state`, the tables before that update; `_after_lookup` has it
        applied): map `csr`'s raw ids with the restored state's maps at its step, as
        the saving run did (`_map_ahead`), into both states, the rows the map gave away
        re-initialised in the tables the lookup reads too. Returns `csr` with rows."""
        full = self._after_lookup
        assert full is not None
        stale = {s: a for s, a in self._state.tables.items() if a is not full.tables[s]}
        step = self._state.step
        full, rows, counts, fresh = self._map_keep_fn(full, csr)
        self._id_stats = _id_counts(rows, counts)
        csr = _with_rows(csr, rows)
        lookup = dataclasses.replace(full, tables=dict(full.tables, **stale), step=step)
        self._state = self._reinit_fn(lookup, fresh)
        self._after_lookup = full
        return csr

    def embedding_lookup(self, features: Any, weights: Any | None = None):
        """`(activations, preserved_outputs)` for a batch: enqueue then dequeue."""
        _check_not_traced("embedding_lookup (__call__)", features, weights)
        return self.dequeue(self.enqueue(features, weights))

    def _partitioned_dict(self, value, what: str) -> dict:
        return self.job.placed(value, what)

    def _check_preserved(self, preserved) -> None:
        self.job.check_preserved(preserved)

    __call__ = embedding_lookup

    def _pack_activations(self, acts: dict, csr: dict):
        return self.job.pack_activations(acts, csr)

    # -- update -------------------------------------------------------------------

    def _flat_gradients(self, gradients, csr) -> dict:
        return self.job.flat_gradients(gradients, csr)

    def apply_gradients(self, gradients: Any, preserved_outputs: dict):
        """Apply one fused sparse update (see `EmbeddingCore.apply_gradients`).

        `gradients` has the feature config's structure, as TensorFlow checks it:
        every feature has an entry, an explicit None (for a feature, or a whole
        subtree, or `gradients=None` for all) counting as a zero gradient. Raises
        RuntimeError before `build()`, ValueError/TypeError naming the feature for
        a gradient of the wrong structure, shape or dtype (a feature left out of a
        dict: a ValueError naming it, and any unknown keys beside it), and
        FloatingPointError for a non-finite gradient (tables untouched), and
        ValueError when `preserved_outputs` is not this layer's dequeue output
        (None, another layer's, unknown stacks; state and step untouched).

        An empty batch (0 samples) is a no-op update that still counts a step
        (`state.step` advances, as it would on TensorFlow).
        """
        _check_not_traced("apply_gradients", gradients)
        self._require_built("apply_gradients")
        preserved_outputs = self._partitioned_dict(preserved_outputs, "apply_gradients")
        self._check_preserved(preserved_outputs)
        raw = [s for s, c in preserved_outputs.items() if c.unique_raw_ids is not None]
        if raw:  # a table of raw ids: the batch dequeue returned has rows, not raw ids
            raise ValueError(
                f"apply_gradients: stacks {sorted(raw)} of these preserved_outputs still carry "
                f"raw ids: pass the preserved_outputs that dequeue/embedding_lookup returned "
                f"(their ids mapped to rows), not enqueue's batch"
            )
        grads = self._flat_gradients(gradients, preserved_outputs)
        self._check_step(grads, preserved_outputs)
        self.flush()  # two updates without a lookup between them
        if all(c.rows_per_device == 0 for c in preserved_outputs.values()):
            # empty batch: nothing to move (the update program cannot take empty
            # partitions); count the step
            self._state = dataclasses.replace(self._state, step=self._state.step + 1)
            return
        # the owners' view of these outputs, when they are the last dequeue's
        last = self._view
        view = last[1] if last is not None and last[0] is preserved_outputs else {}
        self._pending = (grads, preserved_outputs, view)

    def flush(self):
        """Apply an update still waiting for the next lookup.

        Reads never need this (they see every accepted update). In pipelined
        mode it makes the next lookup see the update, which changes the
        trajectory: the TPU's pipelining never does that.
        """
        if self._after_lookup is not None:
            self._state, self._after_lookup = self._after_lookup, None
        if self._pending is None:
            return
        grads, csr, view = self._take_pending()
        self._state = self._apply_fn(self._state, grads, csr, view)

    def _check_step(self, grads: dict, csr: dict) -> None:
        """Before an update is accepted: FloatingPointError for a non-finite gradient
        (with check_finite) and, in a multi-process job, RuntimeError when the
        processes' steps paired different batches. Each process counts its enqueue
        attempts, failed ones included, and carries the count with the batch
        (`PartitionedCsrFormatTensor.batch_number`); a process that caught an
        enqueue error and went on, or enqueued a batch twice, is one off from the
        others, which without this check would pair its batches with theirs, silently
        wrong. Both checks ride one exchange and one host read a step
        (`EmbeddingCore.step_check`); either error leaves the tables untouched.
        """
        check = grads if self._check_finite else {}
        number = next((c.batch_number for c in csr.values() if c.batch_number is not None), None)
        if not check and number is None:
            return
        finite, low, high = (int(x) for x in np.asarray(self._step_check_fn(check, number)))
        if low != high:
            # (-1: a batch this facade did not enqueue, e.g. from preprocess_features)
            mine = -1 if number is None else int(np.asarray(number.addressable_data(0))[0])
            raise RuntimeError(
                f"this step paired different batches: process {jax.process_index()} is at "
                f"batch {mine}, another process at batch {high if mine == low else low} "
                f"(batches counted from 1 by enqueue attempts, failed ones included): a "
                f"process skipped or repeated a batch (did one catch an enqueue error and "
                f"continue?). Every process must enqueue the same number of batches; the "
                f"update was not applied and the tables are unchanged"
            )
        if not finite:
            bad = [n for n, g in grads.items() if not bool(jnp.all(jnp.isfinite(g)))]
            raise FloatingPointError(
                f"non-finite gradient for feature(s) {bad}; the update was "
                f"not applied and the tables are unchanged"
            )

    # -- reading state ------------------------------------------------------------

    def _logical_table(self, table_cfg, field="parameters"):
        return self.job.read_table(self.observed_state(), table_cfg, field)

    @property
    def embedding_tables(self) -> dict:
        """`{TableConfig: [vocabulary_size, dim] numpy array}` in logical row order.

        Read-only copies (writing raises): load rows with `set_tables`. A table of raw
        ids (`TableConfig.id_map`) gives its `embedmesh.RawIdTable` instead: its
        live ids, sorted, and their rows (what `serving_embedding_lookup` and
        `export_serving` take for it; docs/dynamic-ids.md).
        """
        _check_not_traced("embedding_tables")
        self._maybe_build()
        raw = {}
        if self.core.dynamic:
            from embedmesh.device.by_id import raw_id_tables

            raw = raw_id_tables(self.core, self.observed_state())
        return {
            t: raw[t] if t in raw else _read_only(self._logical_table(t))
            for t in self._resolved.tables
        }

    @property
    def variables(self) -> dict:
        """`{TableConfig: {"parameters": ..., slot name: ...}}`, logical row order.

        Read-only copies (writing raises): load values with `set_tables`.
        """
        _check_not_traced("variables")
        self._maybe_build()
        state, job = self.observed_state(), self.job
        out = {}
        for t in self._resolved.tables:
            spec = self.plan.stack_of(t)
            entry = {"parameters": _read_only(job.read_table(state, t))}
            for slot in job.core.slot_names(spec.name):
                entry[slot] = _read_only(job.read_table(state, t, slot))
            out[t] = entry
        return out

    @property
    def embedding_table_shards(self) -> dict:
        """`{TableConfig: [(device, shard)]}`: each device's rows of the table.

        Shard j holds the table's rows `plan.row_layout.rows_on_shard(table, j)`
        in that order (see `embedmesh.layout.rows`; the mod layout: the rows `i`
        with `(i % N + rotation) % N == j`, increasing), padded to the same length
        with zero rows; a shard outside the table's span (a table-wise table's
        other shards) gives zero rows only; a replicated (data_parallel) table's
        every shard gives its replica (all rows, in row order).
        """
        self._maybe_build()
        state = self.observed_state()
        out = {}
        for t in self._resolved.tables:
            p = self.plan.table(t)
            arr = state.tables[p.stack]
            shards = []
            rps = self.plan.stack(p.stack).rows_per_shard
            for shard in sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0):
                block = shard.data[
                    p.local_row_offset : p.local_row_offset + p.rows_per_shard, : p.dim
                ]
                j = (shard.index[0].start or 0) // rps
                if self.plan.row_layout.copy_of(p, j) is None:
                    # the rows there are other tables', not this table's
                    block = jnp.zeros_like(block, device=shard.device)
                shards.append((shard.device, block))
            out[t] = shards
        return out

    def set_tables(self, tables: dict, slots: dict | None = None, step: int = 0):
        """Replace the state from logical arrays `{TableConfig: [V, dim]}` (and slots).

        Every array must have its table's shape `(vocabulary_size, dim)`
        (else a ValueError naming the table; the state is left as it was).
        """
        self._maybe_build()
        self.flush()
        names = {
            self._resolved.table_name(t): self._checked_table(t, v, "parameters")
            for t, v in tables.items()
        }
        slot_names = {
            self._resolved.table_name(t): {k: self._checked_table(t, v, k) for k, v in s.items()}
            for t, s in (slots or {}).items()
        }
        self._state = self.core.state_from_tables(names, slot_names, step)

    def _checked_table(self, table, value, what: str) -> np.ndarray:
        arr = np.asarray(value)
        name = self._resolved.table_name(table)
        want = (table.vocabulary_size, table.dim)
        expected = "(vocabulary_size, dim)"
        if what != "parameters":
            opt = self.core.optimizer_of(self.core.plan.table(name).stack)
            if opt is not None and what in opt.slot_names and opt.slot_width(what, 2) == 1:
                want, expected = (table.vocabulary_size, 1), "(vocabulary_size, 1): a row slot"
        if arr.shape != want:
            raise ValueError(
                f"set_tables: table {name} {what} has shape {arr.shape}, expected "
                f"{expected} = {want}"
            )
        return arr


def _planner_sample(resolved, features, weights) -> list:
    """Every feature's `Csr` of a batch, for the planner's statistics."""
    flat = flatten_inputs_like(resolved, features, "features")
    flat_w = (
        [None] * len(flat) if weights is None else flatten_inputs_like(resolved, weights, "weights")
    )
    return [
        to_csr(name, f, x, w)
        for name, f, x, w in zip(resolved.feature_names, resolved.features, flat, flat_w)
    ]
