"""`MeshEmbedding`: the stateful facade with TPUEmbeddingV2's constructor and methods.

A thin layer over the job (`embedmesh.job.EmbeddingJob`, the functional middle layer):
it keeps the job's state (its `Schedule` and `Feed`) and gives the job's functions
TensorFlow's method names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

from jax.sharding import Mesh

from embedmesh import job as jobs
from embedmesh.job import (
    EmbeddingCore,
    EmbeddingJob,
    EmbeddingState,
    Feed,
    JobSpec,
    PreprocessStats,
    Schedule,
    StackingPlan,
    default_mesh,
)
from embedmesh.optimizers import Optimizer

__all__ = ["MeshEmbedding", "default_mesh"]

_NOT_GIVEN: Any = object()  # `dequeue()` without its batch: a TypeError naming the fix


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
      sharding: how each table is spread over the N devices (docs/sharding.md):
        "mod" (the default, also "row_wise_rows": row `i` on shard `(i % N +
        rotation) % N` as TPUEmbeddingV2 does, the owners sending the rows of
        each source's distinct ids), "row_wise_pooled" (the same rows, the owners
        sending partial sums), "table_wise" (each whole table on one shard,
        bin-packed), "data_parallel" (a replica on every device, the gradients
        exchanged), "auto" (the planner picks per table from its cost model, fed
        by the first batch; `emb.plan` shows the choice), or a mapping `{table
        name or TableConfig: one of these}` (tables not named: "mod"). Unknown
        tables or strategies raise a ValueError. Every strategy gives the same
        results, to float32 rounding.
      batch_size: the global batch a training step takes (all devices, all
        processes), which the planner plans for (`batch_size / N` samples a
        device). Default: the first batch's size (its samples on this process
        over the process's devices), or 256 a device when `build()` comes
        before any batch. `emb.plan` says which it used.
      memory_limit_bytes: the bytes a device may use for its tables and optimizer
        slots and a training step of the planned batch (its batch, activations,
        gradients and largest temporaries: `emb.plan` shows both) (every plan,
        explicit or "auto": with `host_tier="off"` a plan over it is a ValueError
        naming the tables, the bytes and the limit, raised by
        `build()` before anything is allocated, by default a host tier then holds
        the rows; "auto" picks among the plans that fit). Default:
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
      host_tier: "auto" (default), "on" or "off": whether the tables' rows and slots
        live in host memory behind a row cache on each device (a host tier), so a
        model bigger than the devices trains, to the same tables. "auto" uses one
        when the model does not fit an accelerator's limit or `memory_limit_bytes`
        (on CPU: only that one) and logs it (INFO); "on" always; "off" refuses
        such a model. One process; float32 tables; not with tables of raw ids nor
        with Adam(lazy_adam=False). See docs/tpu.md.
      host_tier_cache_rows: rows a device caches of each tiered stack; default: what
        fits in 75% of the memory limit. A batch needs its distinct rows (pipelined, with
        an update pending, that batch's too) cached at once.
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
        host_tier: str = "auto",
        host_tier_cache_rows: int | None = None,
    ):
        # every argument checked here (a ValueError naming a bad one), before build
        args = dict(locals())
        del args["self"], args["mesh"]
        self._spec = JobSpec.of(**args)
        self._mesh = mesh
        self._sample: list | None = None  # the first batch, for "auto" (see build)
        self._job: EmbeddingJob | None = None  # set by build()
        self._schedule = Schedule(None)  # the state, the pending update...: `job.dequeue`
        self._feed = Feed(capacities)  # the capacities batches are compiled for...
        self._last_stats: PreprocessStats | None = None

    def __repr__(self) -> str:
        return self._spec.describe(self._mesh, self._job is not None)

    def build(self):
        """Create tables and slots on the mesh, shard by shard.

        With a mesh over several processes, every process must build the same job:
        a ValueError on every process names the first field that differs, before any
        other collective."""
        jobs.check_not_traced("build")
        if self._job is not None:
            return
        self._mesh = self._mesh if self._mesh is not None else default_mesh()
        sample, self._sample = self._sample, None
        job, state = EmbeddingJob.build(self._spec, self._mesh, sample)
        self._job, self._schedule = job, job.schedule(state)

    def _maybe_build(self, features=None, weights=None):
        if self._job is None:
            self._sample = EmbeddingJob.sample_of(self._spec, features, weights)
            self.build()

    def _build_for(self, what: str) -> EmbeddingJob:
        """Build on first access to `what`, except "auto" before any batch (refused)."""
        if self._job is None:
            self._spec.refuse_unplanned(what)
            self.build()
        return cast(EmbeddingJob, self._job)  # (built)

    def _require_built(self, what: str) -> EmbeddingJob:
        if self._job is None:
            raise RuntimeError(f"{what} needs build() first")
        return self._job

    @property
    def mesh(self) -> Mesh:
        """The device mesh the tables live on (builds on first access)."""
        self._maybe_build()
        return cast(Mesh, self._mesh)  # (built)

    @property
    def plan(self) -> StackingPlan:
        """The `StackingPlan`: per table its strategy, stack, devices and MB held there,
        with the cost model's prediction (`print(emb.plan)`). Builds on first access,
        except with sharding="auto" before the first batch or `build()`: a
        RuntimeError, since "auto" plans from the first batch."""
        return self._build_for("plan").plan

    @property
    def core(self) -> EmbeddingCore:
        """The functional core (`EmbeddingCore`) for a jitted train step of one's own:
        `core.lookup(emb.state, csr)`, `core.apply_gradients(...)`. Built on first access
        as `plan` is (a RuntimeError with sharding="auto" before the first batch)."""
        return self._build_for("core").core

    @property
    def job(self) -> EmbeddingJob:
        """This layer without its state (`EmbeddingJob`: planning, batch preparation,
        the step programs, the checks and shape work around the core), for code that
        keeps the state elsewhere (the flax modules). Built on first access as `plan`
        is."""
        return self._build_for("job")

    @property
    def pipelined(self) -> bool:
        """Whether lookups read the tables one update stale (TPU pipelining)."""
        return self._spec.pipelined

    # -- state --------------------------------------------------------------------

    def observed_state(self) -> EmbeddingState:
        """The state with every accepted update applied, without changing what the
        next lookup sees: what `embedding_tables`, `variables`,
        `embedding_table_shards` and checkpoints read.

        Pipelined, a pending update is applied into new arrays (one extra copy of
        the touched stacks while they are held): observing never changes the
        trajectory."""
        state, self._schedule = self._require_built("observed_state").observe(self._schedule)
        return state

    @property
    def state(self) -> EmbeddingState:
        """The embedding state (`EmbeddingState`) the next lookup reads: every
        accepted update applied, except, in pipelined mode, the one the next
        lookup applies after it reads (see `observed_state`). Built on first access as
        `plan` is (a RuntimeError with sharding="auto" before the first batch)."""
        self._schedule = self._build_for("state").current(self._schedule)
        return cast(EmbeddingState, self._schedule.state)  # (None once released)

    @state.setter
    def state(self, value: EmbeddingState):
        s = self._schedule if self._job is None else self._job.current(self._schedule)
        self._schedule = s.but(state=value, after_lookup=None)

    def checkpoint_state(self) -> tuple:
        """`(observed state, {stack: parameters the next lookup reads})`: what a checkpoint
        of this layer stores (`embedmesh.checkpoint.state_tree`). The second is empty
        unless pipelined with an update pending: the stacks that update touches."""
        job = self._require_built("checkpoint_state")
        out, self._schedule = job.checkpoint_state(self._schedule)
        return out

    def install_restored(self, restored) -> None:
        """Install an `embedmesh.checkpoint.RestoredState` (what `core_restore` of this
        layer's core returns; `embedmesh.checkpoint.restore` calls this). Pipelined with
        lookup tables, the next lookup reads `restored.lookup_state()` and
        `restored.state` is installed right after it; otherwise `restored.state` is
        installed now. A pending update is dropped: the restored state replaces it."""
        job = self._require_built("install_restored")
        self._schedule = job.install_restored(self._schedule, restored)

    def release_state(self) -> EmbeddingState:
        """Hand the state over to a new owner (a flax module): this layer keeps no
        reference to it (one copy of the tables, not two) and must not be stepped
        itself afterwards; a fresh initial state when it holds none (a second owner).
        A ValueError in pipelined mode once an update is pending (the state is then
        one update stale)."""
        self.build()
        state, self._schedule = self.job.release(self._schedule), Schedule(None)
        return state

    @property
    def last_stats(self) -> PreprocessStats | None:
        """The `PreprocessStats` of the latest `enqueue` (per stack: ids per partition,
        capacity, ids dropped by overflow="drop", whether the capacity grew); None before
        the first batch. A stack of raw ids (`TableConfig.id_map`) has its id maps'
        counts of the latest lookup in `id_map` (hits, admissions, evictions, pending,
        refused, occupancy; reading them waits for that lookup)."""
        if self._job is not None:
            self._last_stats, self._schedule = self._job.counted(self._last_stats, self._schedule)
        return self._last_stats

    # -- host preprocessing -------------------------------------------------------

    # Pure numpy preprocessing: TensorFlow's form (`num_replicas_in_sync, ...` -> `(csr, int,
    # int)`, which `dequeue` takes; the signature `inspect.signature` shows) or embedmesh's
    # `(features, weights, plan, **options)` -> `(csr, stats)` (`embedmesh.host.preprocess`).
    preprocess_features = staticmethod(jobs.preprocess_features)

    def enqueue(
        self,
        features: Any,
        weights: Any | None = None,
        device: str | None = None,
        training: bool = True,
    ) -> dict:
        """Preprocess this process's batch on the host and place it on the mesh.

        Returns `{stack: PartitionedCsrFormatTensor}` of global arrays for
        `dequeue`. `device` is accepted for API compatibility: preprocessing
        always runs on this process's host and feeds all its local devices.
        `training=False` (TPUEmbedding's argument) enqueues the batch for evaluation:
        its `dequeue` is an evaluation lookup, which changes no state (see
        `embedding_lookup`), and `last_stats` keeps the latest training batch's.
        In a job of several processes, capacities and batch shapes are agreed
        among them, and each attempt, failed or not, is numbered: `apply_gradients`
        refuses a step whose processes are at different numbers (every process
        enqueues the same batches, evaluation ones included)."""
        jobs.check_enqueue_device(device)  # (TPUEmbedding v1's order: features, weights, training)
        jobs.check_not_traced("enqueue", features, weights)
        self._maybe_build(features, weights)
        job = self.job
        if job.multiprocess:
            prepared = job.prepare(self._feed.capacities, features, weights)
            return self._agreed_put(prepared, training)
        csr, stats, self._feed = job.enqueue(self._feed, features, weights)
        return self._enqueued(csr, stats, training)

    def _agreed_put(self, prepared: tuple, training: bool = True) -> dict:
        self._feed = self._feed.attempted()  # a failed attempt counts too
        csr, stats, self._feed = self.job.agreed_put(self._feed, prepared)
        return self._enqueued(csr, stats, training)

    def _enqueued(self, csr: dict, stats: PreprocessStats, training: bool) -> dict:
        """A training batch's statistics kept; an evaluation batch marked (see `enqueue`)."""
        if training:
            self._last_stats = stats
        return csr if training else self.job.for_evaluation(csr)

    def prefetch(self, batches: Iterable, buffer_size: int = 2) -> Iterator[dict]:
        """Enqueue batches in a background thread, `buffer_size` ahead of the consumer.

        `batches` yields `features` or `(features, weights)`. An error in the
        thread is re-raised by the iterator in the training loop. With several
        processes only the local preprocessing runs ahead; the agreement among
        processes runs in the consumer's thread (a collective from the prefetch
        thread could meet another process's step)."""
        split = jobs.split_item
        if self._job is None and self._spec.plans_from_a_batch:
            first, batches = jobs.peek(batches)  # the planner sees the first batch
            self._maybe_build(*split(first))  # (no batch: planned from the config alone)
        self._maybe_build()
        job = self.job
        if not job.multiprocess:
            return jobs.prefetched(batches, buffer_size, lambda item: self.enqueue(*split(item)))
        prepare = lambda item: job.prepare(self._feed.capacities, *split(item))
        return jobs.prefetched(batches, buffer_size, prepare, self._agreed_put)

    # -- lookup and update ----------------------------------------------------------

    def dequeue(self, partitioned_tensors=_NOT_GIVEN):
        """Activations for enqueued inputs: `(activations, preserved_outputs)`.

        `partitioned_tensors` is `enqueue`'s `{stack: PartitionedCsrFormatTensor}`
        or, as TensorFlow's signature has it, a tuple `(that dict, int, int)`
        (the seed-form `preprocess_features` returns one; the ints are
        checked to be ints and otherwise unused). `preserved_outputs` is the
        dict. A batch enqueued with `training=False` gets an evaluation lookup
        (see `embedding_lookup`)."""
        if partitioned_tensors is _NOT_GIVEN:
            jobs.refuse_missing_batch()
        jobs.check_not_traced("dequeue", partitioned_tensors)
        job = self._require_built("dequeue")
        csr = job.placed(partitioned_tensors, "dequeue")
        acts, csr, self._schedule = job.dequeue(self._schedule, csr)
        return acts, csr

    def embedding_lookup(self, features: Any, weights: Any | None = None, training: bool = True):
        """`(activations, preserved_outputs)` for a batch: enqueue then dequeue.

        `training=False` (an evaluation, as TPUEmbedding and Keras spell it): a lookup
        that changes no state. Tables of raw ids admit, evict and count nothing: an id
        their maps do not hold reads a zero row, as `serving_embedding_lookup` reads it
        from `embedding_tables`. No update, step or optimizer slot changes; `last_stats`
        keeps the latest training batch's. It reads what the next training lookup
        would read: every accepted update unpipelined; pipelined, the tables one update
        stale, the pending update left pending (the trajectory is unchanged). Its
        `preserved_outputs` are refused by `apply_gradients` (a ValueError)."""
        jobs.check_not_traced("embedding_lookup (__call__)", features, weights)
        return self.dequeue(self.enqueue(features, weights, training=training))

    __call__ = embedding_lookup

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
        (`state.step` advances, as it would on TensorFlow)."""
        jobs.check_not_traced("apply_gradients", gradients)
        job = self._require_built("apply_gradients")
        self._schedule = job.apply_gradients(self._schedule, gradients, preserved_outputs)

    def flush(self):
        """Apply an update still waiting for the next lookup.

        Reads never need this (they see every accepted update). In pipelined
        mode it makes the next lookup see the update, which changes the
        trajectory: the TPU's pipelining never does that."""
        if self._job is not None:
            self._schedule = self._job.flush(self._schedule)

    # -- reading and writing tables ---------------------------------------------------

    @property
    def embedding_tables(self) -> dict:
        """`{TableConfig: [vocabulary_size, dim] numpy array}` in logical row order.

        Read-only copies (writing raises): load rows with `set_tables`. A table of raw
        ids (`TableConfig.id_map`) gives its `embedmesh.RawIdTable` instead: its
        live ids, sorted, and their rows (what `serving_embedding_lookup` and
        `export_serving` take for it; docs/dynamic-ids.md)."""
        jobs.check_not_traced("embedding_tables")
        self._maybe_build()
        return jobs.read_only(self.job.read_tables(self.observed_state()))

    @property
    def variables(self) -> dict:
        """`{TableConfig: {"parameters": ..., slot name: ...}}`, logical row order.

        Read-only copies (writing raises): load values with `set_tables`."""
        jobs.check_not_traced("variables")
        self._maybe_build()
        return jobs.read_only(self.job.read_variables(self.observed_state()))

    @property
    def embedding_table_shards(self) -> dict:
        """`{TableConfig: [(device, shard)]}`: each device's rows of the table.

        Shard j holds the table's rows `plan.row_layout.rows_on_shard(table, j)`
        in that order (see `embedmesh.layout.rows`; the mod layout: the rows `i`
        with `(i % N + rotation) % N == j`, increasing), padded to the same length
        with zero rows; a shard outside the table's span (a table-wise table's
        other shards) gives zero rows only; a replicated (data_parallel) table's
        every shard gives its replica (all rows, in row order)."""
        self._maybe_build()
        return self.job.table_shards(self.observed_state())

    def set_tables(self, tables: dict, slots: dict | None = None, step: int = 0):
        """Replace the state from logical arrays `{TableConfig: [V, dim]}` (and slots).

        Every array must have its table's shape `(vocabulary_size, dim)`
        (else a ValueError naming the table; the state is left as it was)."""
        self._maybe_build()
        state = self.job.state_from_tables(tables, slots, step)  # checked: raises first
        self.flush()
        self._schedule = self._schedule.but(state=state)

    # -- the job's programs (below) and host state, by their former names --

    _pending = property(lambda self: self._schedule.pending)
    _capacities = property(lambda self: self._feed.capacities)
    _overflow = property(lambda self: self._spec.overflow)
    _preprocess = property(lambda self: self.job.preprocess)


for _attr, _program in jobs.program_attributes().items():  # `emb._<name>_fn`: a test's spy
    setattr(MeshEmbedding, _attr, _program)
