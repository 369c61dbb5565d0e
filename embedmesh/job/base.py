"""`EmbeddingJob`: an embedding job without its state, the functional middle layer.

The resolved features, the stacking plan, the functional core and the declared options
(`JobSpec`), with everything between the user's structures and the core's pure lookup
and update: planning (`build`), batch preparation (`enqueue`, `prepare`,
`agreed_put`: the host's `Feed` in and out), the step programs and their schedule
(`dequeue`, `accept`, `flush`, `observe`: a `Schedule` in and out), and the checks and
shape work (placing host batches on the mesh, checking preserved outputs, packing
activations into the feature config's structure, flattening gradients, reading tables
in logical order). It holds no state, so the stateful facade (`MeshEmbedding`, which
keeps one schedule) and the flax modules (which keep the state as flax variables) run
the same code, as jax-tpu-embedding's `nn` layer sits under its flax modules.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.config import ResolvedFeatures
from embedmesh.device import stack_tables
from embedmesh.device.core import ID_STATS, EmbeddingCore, EmbeddingState
from embedmesh.host import preprocess as _pre
from embedmesh.inputs import flatten_inputs_like
from embedmesh.job import batches as _batches
from embedmesh.job import planning as _planning
from embedmesh.job import steps as _steps
from embedmesh.job.spec import JobSpec, default_mesh
from embedmesh.layout.stacking import StackingPlan

__all__ = ["EmbeddingJob"]


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingJob:
    """A built embedding job, stateless: `resolved` (the feature config resolved as
    TensorFlow does), `plan` (`StackingPlan`), `core` (`EmbeddingCore`: pure lookup and
    update, state in, state out), `seed` (the tables' initial values) and `spec` (the
    declared options, `JobSpec`; default: the defaults with this seed). Build one with
    `EmbeddingJob.build(JobSpec.of(feature_config, optimizer, ...))`."""

    resolved: ResolvedFeatures
    plan: StackingPlan
    core: EmbeddingCore
    seed: int = 0
    spec: JobSpec = None  # type: ignore[assignment]  # None: JobSpec(resolved, seed=seed)

    def __post_init__(self):
        if self.spec is None:
            object.__setattr__(self, "spec", JobSpec(self.resolved, seed=self.seed))

    @classmethod
    def build(cls, spec: JobSpec, mesh=None, sample: list | None = None) -> tuple:
        """`(job, its initial state)`: `spec` planned on `mesh` (default: `default_mesh()`)
        and its tables created shard by shard; `sample`, the first batch's `Csr`s
        (`sample_of`), is what "auto" tables are planned from. With a mesh over several
        processes, all must build the same job (a ValueError naming the first field that
        differs, on every process)."""
        mesh = default_mesh() if mesh is None else mesh
        plan, core, state = _planning.build(spec, mesh, sample)
        job = cls(spec.resolved, plan, core, spec.seed, spec)
        _steps.return_free_heap()  # the build's temporaries
        return job, state

    @staticmethod
    def sample_of(spec: JobSpec, features, weights=None) -> list | None:
        """A batch's `Csr`s for `build`'s planner statistics ("auto" tables); None where
        `spec` plans no table from a batch, or no batch is given."""
        if features is None or not spec.plans_from_a_batch:
            return None
        return _planning.planner_sample(spec, features, weights)

    @property
    def pipelined(self) -> bool:
        """Whether lookups read the tables one update stale (TPU pipelining)."""
        return self.spec.pipelined

    @functools.cached_property
    def programs(self) -> _steps.Programs:
        """The job's jitted step programs (`embedmesh.job.steps.Programs`), made once."""
        return _steps.Programs(self.core)

    @functools.cached_property
    def num_local_devices(self) -> int:
        """This process's devices in the mesh (contiguous in mesh order)."""
        return sum(d.process_index == jax.process_index() for d in self.core.mesh.devices.flat)

    @functools.cached_property
    def multiprocess(self) -> bool:
        """Whether the mesh spans several processes (capacities and shapes are agreed)."""
        return len({d.process_index for d in self.core.mesh.devices.flat}) > 1

    # -- batches: the host's `Feed` in and out ------------------------------------------

    def preprocess(self, features, weights, capacities, overflow: str | None = None) -> tuple:
        """`(csr, stats)`: this process's batch preprocessed on the host."""
        return _batches.preprocess(self, features, weights, capacities, overflow)

    def enqueue(self, feed: _batches.Feed, features, weights=None) -> tuple:
        """`(csr placed on the mesh, PreprocessStats, next feed)` of this process's batch;
        with several processes, capacities and shapes agreed among them."""
        if self.multiprocess:  # (a caller going on after a failure counts it itself)
            prepared = self.prepare(feed.capacities, features, weights)
            return self.agreed_put(feed.attempted(), prepared)
        return _batches.enqueue(self, feed, features, weights)

    def prepare(self, capacities, features, weights=None) -> tuple:
        """Several processes: the local half of `enqueue` (may run ahead in a thread)."""
        return _batches.prepare(self, capacities, features, weights)

    def agreed_put(self, feed: _batches.Feed, prepared: tuple) -> tuple:
        """Several processes: the agreed half of `enqueue`, `(csr, stats, next feed)`;
        `feed` has this attempt counted (`feed.attempted()`, kept by the caller even when
        this raises: every process numbers its attempts, failed ones included)."""
        return _batches.agreed_put(self, feed, prepared)

    # -- steps: the `Schedule` in and out ------------------------------------------------

    def schedule(self, state: EmbeddingState | None) -> _steps.Schedule:
        """A schedule whose next lookup reads `state`, nothing pending."""
        return _steps.Schedule(state)

    def dequeue(self, schedule: _steps.Schedule, csr: dict) -> tuple:
        """`(activations in the feature config's structure, the batch with rows, next
        schedule)`: the lookup with the pending update and the map of raw ids to rows
        where the schedule and the batch call for them (`embedmesh.job.steps.dequeue`);
        a batch enqueued for evaluation (`for_evaluation`) gets `evaluate`'s lookup."""
        if self.is_evaluation(csr):
            return self.evaluate(schedule, csr)
        acts, csr, schedule = _steps.dequeue(self, schedule, csr)
        return self.pack_activations(acts, csr), csr, schedule

    def evaluate(self, schedule: _steps.Schedule, csr: dict) -> tuple:
        """`(activations in the feature config's structure, the batch with rows, marked
        as an evaluation's, next schedule)`: the evaluation lookup (`training=False`),
        which changes no state: no admission, eviction or count in an id map (an id it
        does not hold reads a zero row, as serving reads it), no update, no step; the
        schedule's pending update and view as they were. It reads what the next training
        lookup would read (pipelined: the tables one update stale;
        `embedmesh.job.steps.evaluate`)."""
        acts, csr, schedule = _steps.evaluate(self, schedule, csr)
        return self.pack_activations(acts, csr), csr, schedule

    @staticmethod
    def for_evaluation(csr: dict) -> dict:
        """The batch `csr` (`{stack: PartitionedCsrFormatTensor}`) marked for an
        evaluation lookup: `dequeue` then runs `evaluate`, and an update refuses it."""
        return _steps.for_evaluation(csr)

    @staticmethod
    def is_evaluation(csr) -> bool:
        """Whether `csr` (a batch, or the seed's `(batch, int, int)`) is marked for an
        evaluation lookup (`for_evaluation`)."""
        if isinstance(csr, tuple) and csr and isinstance(csr[0], dict):
            csr = csr[0]
        return isinstance(csr, dict) and any(getattr(c, "evaluation", False) for c in csr.values())

    def apply_gradients(self, schedule: _steps.Schedule, gradients, preserved) -> Any:
        """The next schedule with the update of `gradients` (the feature config's
        structure) for `preserved` (a dequeue's batch) accepted; its checks raise
        before anything changes (see `MeshEmbedding.apply_gradients`)."""
        preserved = self.placed(preserved, "apply_gradients")
        self.check_preserved(preserved)
        raw = [s for s, c in preserved.items() if c.unique_raw_ids is not None]
        if raw:  # a table of raw ids: the batch dequeue returned has rows, not raw ids
            raise ValueError(
                f"apply_gradients: stacks {sorted(raw)} of these preserved_outputs still carry "
                f"raw ids: pass the preserved_outputs that dequeue/embedding_lookup returned "
                f"(their ids mapped to rows), not enqueue's batch"
            )
        self._check_updatable(schedule, preserved)
        grads = self.flat_gradients(gradients, preserved)
        _steps.check_step(self, grads, preserved)
        return _steps.accept(self, schedule, grads, preserved)

    def _check_updatable(self, schedule: _steps.Schedule, preserved: dict) -> None:
        """ValueError, before anything changes, for an update that cannot be applied (a
        stack without an optimizer: a layer built for lookups); a warning for the batch
        of the last accepted update given again."""
        bare = [s for s in preserved if self.core.optimizer_of(s) is None]
        if bare:
            tables = sorted(t for s in bare for t in self.plan.stack(s).tables)
            raise ValueError(
                f"apply_gradients: table(s) {tables} have no optimizer (this layer was built "
                f"for lookups): give MeshEmbedding an optimizer or set TableConfig.optimizer; "
                f"nothing was changed"
            )
        last = schedule.applied
        if (
            last is not None
            and last.keys() == preserved.keys()
            and all(preserved[s] is last[s] for s in preserved)
        ):
            # allowed (two updates of one batch, as TensorFlow does), but most often a
            # loop that kept an old batch's outputs
            warnings.warn(
                "apply_gradients: these preserved_outputs were applied by the previous "
                "update too: this update is a second one for the same batch (pass the "
                "preserved_outputs of the lookup these gradients come from)",
                stacklevel=4,
            )

    def flush(self, schedule: _steps.Schedule) -> _steps.Schedule:
        """The schedule with its pending update applied."""
        return _steps.flush(self, schedule)

    def current(self, schedule: _steps.Schedule) -> _steps.Schedule:
        """The schedule whose `state` is what the next lookup reads: unpipelined, its
        pending update applied; pipelined, as it is (the update applies after it)."""
        return schedule if self.pipelined else _steps.flush(self, schedule)

    def release(self, schedule: _steps.Schedule) -> EmbeddingState:
        """The state of `schedule` for a new owner, every accepted update applied (a
        fresh initial state where it holds none); a ValueError, pipelined, once an
        update is pending (the state is then one update stale)."""
        if self.pipelined and (schedule.pending is not None or schedule.after_lookup is not None):
            raise ValueError("release_state: a pipelined layer's state is one update stale")
        state = _steps.flush(self, schedule).state
        return state if state is not None else self.init_state()

    def observe(self, schedule: _steps.Schedule) -> tuple:
        """`(the state with every accepted update applied, next schedule)`; what the
        next lookup reads is unchanged (`embedmesh.job.steps.observe`)."""
        return _steps.observe(self, schedule)

    def checkpoint_state(self, schedule: _steps.Schedule) -> tuple:
        """`((observed state, {stack: tables the next lookup reads}), next schedule)`."""
        return _steps.checkpoint_state(self, schedule)

    def install_restored(self, schedule: _steps.Schedule, restored) -> _steps.Schedule:
        """The schedule after a restore (`embedmesh.checkpoint.RestoredState`)."""
        return _steps.install_restored(self, schedule, restored)

    # -- traced steps (inside jax.jit): the state and a pending update in and out -------

    def map_ids(self, state: EmbeddingState, csr, pending: tuple | None = None) -> tuple:
        """`(state, csr, fresh)`: the raw ids of the batch's tables of raw ids
        (`TableConfig.id_map`) mapped to rows by the state's id maps (admissions,
        evictions, fresh rows); pipelined with an update `pending`, at the step that
        update brings, `fresh` then the rows to re-initialise after it (`lookup` does).
        A batch without raw ids comes back as it is."""
        csr = self.placed(csr, "the embedding module")
        if not any(c.unique_raw_ids is not None for c in csr.values()):
            return state, csr, None
        if pending is not None and self.pipelined:
            state, csr, _, fresh = _steps.map_ahead(self.core, state, csr)
            return state, csr, fresh
        state, csr, _ = self.core.map_ids(state, csr)
        return state, csr, None

    def find_rows(self, state: EmbeddingState, csr) -> dict:
        """`map_ids` read-only (an evaluation): the batch with the rows the state's id
        maps hold for its raw ids (an id they do not hold: a zero row, as serving reads
        it), marked as an evaluation's (`for_evaluation`: an update refuses it); the
        state is not changed. A batch without raw ids comes back marked."""
        csr = _steps.for_evaluation(self.placed(csr, "the embedding module"), False)
        return _steps.for_evaluation(self.core.find_rows(state, csr))

    def infer(self, state: EmbeddingState, csr) -> tuple:
        """`(activations in the feature config's structure, the batch with rows, marked)`:
        the evaluation lookup of `csr` (with raw ids or mapped), which reads `state` and
        changes nothing (`find_rows`, then the lookup): the traced form of `evaluate`
        for code that keeps the state itself (the flax modules). Pipelined, pass the
        state the next training lookup reads (a pending update left pending)."""
        csr = _steps.for_evaluation(self.placed(csr, "the embedding module"), False)
        frozen = jax.tree_util.tree_map(jax.lax.stop_gradient, state)
        acts, csr = _steps.infer_step(self.core, frozen, csr)
        return self.pack_activations(acts, csr), _steps.for_evaluation(csr)

    def lookup(self, state, csr, pending: tuple | None = None, check_finite: bool = True):
        """`(activations in the feature config's structure, state, ok)`: the lookup of
        `csr` (a batch with rows: `map_ids`), fused with the update `pending` (`defer`'s)
        when there is one, which the lookup does not see (pipelining). Tables enter as
        constants of differentiation: the gradient flows to the activations, never
        densely to the tables."""
        csr = self.placed(csr, "the embedding module")
        self._refuse_raw(csr, "the forward pass")
        frozen = jax.tree_util.tree_map(jax.lax.stop_gradient, state)
        if pending is None:
            return self.pack_activations(self.core.lookup(frozen, csr), csr), state, True
        grads, prev, fresh = pending
        (acts, _), state, ok = _steps.fused_step(
            self.core, frozen, grads, prev, {}, csr, check_finite
        )
        if fresh is not None:
            state = _steps.refreshed(self.core, state, fresh, prev)
        return self.pack_activations(acts, csr), state, ok

    def _checked_update(self, gradients, csr) -> tuple:
        csr = self.placed(csr, "the embedding module")
        self._refuse_raw(csr, "apply_gradients")
        self.check_preserved(csr)
        return self.flat_gradients(gradients, csr), csr

    def update(self, state, gradients, csr, check_finite: bool = True) -> tuple:
        """`(state, ok)` after one fused sparse update from d loss / d activations
        (`gradients` in the feature config's structure; None leaves count as zero)."""
        grads, csr = self._checked_update(gradients, csr)
        return self.core.apply_gradients(state, grads, csr, check_finite=check_finite)

    def defer(self, gradients, csr, check_finite: bool = True) -> tuple:
        """`(pending update, ok)`: the update of `gradients` for `csr`, checked, for the
        next `lookup` to apply (pipelining); `ok`: whether it will be applied (with
        `check_finite`, a non-finite gradient is skipped, the tables untouched)."""
        grads, csr = self._checked_update(gradients, csr)
        ok = jnp.bool_(True)
        if check_finite and grads:
            ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()]))
        return (grads, csr, None), ok

    def applied(self, state, pending: tuple | None, check_finite: bool = True):
        """`state` with the update `pending` applied (`defer`'s; None: `state`)."""
        if pending is None:
            return state
        grads, prev, fresh = pending
        state, _ = self.core.apply_gradients(state, grads, prev, check_finite=check_finite)
        return state if fresh is None else _steps.refreshed(self.core, state, fresh, prev)

    @staticmethod
    def _refuse_raw(csr: dict, what: str) -> None:
        raw = sorted(s for s, c in csr.items() if c.unique_raw_ids is not None)
        if raw:
            raise ValueError(
                f"{what}: stacks {raw} of this batch still carry raw ids (tables with "
                f"TableConfig.id_map): map them to rows first with the module's map_ids(csr) "
                f"(it updates the id maps) and pass the batch it returns to the forward pass "
                f"and to apply_gradients"
            )

    def counted(self, stats, schedule: _steps.Schedule) -> tuple:
        """`(stats with the schedule's id-map counts, the schedule without them)`."""
        if not schedule.id_stats:
            return stats, schedule
        return self.with_id_counts(stats, schedule.id_stats), schedule.but(id_stats=())

    def with_id_counts(self, stats, id_stats: tuple):
        """`stats` (`PreprocessStats`) with a schedule's id-map counts in its stacks'
        `id_map` (reading them waits for the lookup that made them)."""
        if stats is None or not id_stats:
            return stats
        names, values = id_stats
        host = np.asarray(jax.device_get(values))
        counts = {s: dict(zip(ID_STATS, map(int, host[i]))) for i, s in enumerate(names)}
        return _pre.PreprocessStats(
            {
                name: dataclasses.replace(st, id_map=counts.get(name, st.id_map))
                for name, st in stats.stacks.items()
            }
        )

    @property
    def tables(self) -> tuple:
        """The job's `TableConfig`s, in the resolved config's order."""
        return tuple(self.resolved.tables)

    def init_state(self) -> EmbeddingState:
        """A fresh initial state (the tables from `seed`, the slots' initial values)."""
        return self.core.init(jax.random.key(self.seed))

    def placed(self, value, what: str) -> dict:
        """The `{stack: PartitionedCsrFormatTensor}` of `value` (a dict, or the seed's
        `(dict, int, int)` tuple), placed on the mesh if it is host data; `what` names
        the caller in the error."""
        if isinstance(value, tuple) and value and isinstance(value[0], dict):
            if len(value) != 3 or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value[1:]
            ):
                raise ValueError(
                    f"{what}: a tuple must be (dict of PartitionedCsrFormatTensor, "
                    f"int, int) as enqueue/preprocess_features return it, got "
                    f"({', '.join(type(v).__name__ for v in value)})"
                )
            value = value[0]
        if (
            isinstance(value, dict)
            and value
            and all(
                isinstance(v, _pre.PartitionedCsrFormatTensor)
                and isinstance(v.unique_ids, np.ndarray)
                for v in value.values()
            )
        ):
            if getattr(self.core, "tier", None):  # a host tier: placed by dequeue
                if what != "dequeue":
                    raise ValueError(
                        f"{what}: this layer keeps rows in host memory (a host tier): its "
                        f"batches are placed by dequeue (or embedding_lookup)"
                    )
                return value
            value = self.core.put(value)  # host arrays from preprocess_features
        return value

    def check_preserved(self, preserved) -> None:
        """ValueError unless `preserved` is a batch of this job (a dequeue's output)."""
        if not isinstance(preserved, dict):
            raise ValueError(
                f"preserved_outputs must be the dict of PartitionedCsrFormatTensor "
                f"returned by this layer's dequeue/embedding_lookup, got "
                f"{type(preserved).__name__}"
            )
        if self.is_evaluation(preserved):
            raise ValueError(
                "preserved_outputs come from an evaluation lookup (training=False), which "
                "changed no state (ids its id maps do not hold read zero rows and have "
                "none): they cannot be updated. Pass the preserved_outputs of a training "
                "lookup (training=True, the default); nothing was changed"
            )
        want = {s.name: s for s in self.plan.stacks}
        extra = sorted(map(str, set(preserved) - set(want)))
        missing = sorted(set(want) - set(preserved))
        if extra or missing:
            raise ValueError(
                f"preserved_outputs do not come from this layer: stacks "
                f"{extra} are not this layer's and {missing} are missing (this "
                f"layer's stacks: {sorted(want)})"
            )
        for name, c in preserved.items():
            if not isinstance(c, _pre.PartitionedCsrFormatTensor):
                raise ValueError(
                    f"preserved_outputs[{name!r}] must be a "
                    f"PartitionedCsrFormatTensor, got {type(c).__name__}"
                )
            # (rows per sample depend on the batch's input forms: not compared)
            slots = tuple((f.name, f.dim) for f in c.features)
            spec = want[name]
            expect = tuple((f, self.plan.feature(f).dim) for f in spec.features)
            if slots != expect or c.num_shards != self.plan.num_shards:
                raise ValueError(
                    f"preserved_outputs[{name!r}] come from another layer: they "
                    f"hold features {[f[0] for f in slots]} on {c.num_shards} "
                    f"shards, this layer's stack {name} holds {list(spec.features)}"
                    f" on {self.plan.num_shards}"
                )

    @staticmethod
    def _segments(csr: dict) -> dict:
        """`{feature name: its FeatureSegment}` of a batch."""
        return {seg.name: seg for c in csr.values() for seg in c.features}

    def pack_activations(self, acts: dict, csr: dict) -> Any:
        """The core's `{feature: activations}` in the feature config's structure, each
        reshaped to its `output_shape` where it has one."""
        segments = self._segments(csr)
        flat = []
        for name in self.resolved.feature_names:
            a = acts[name]
            if segments[name].output_shape is not None:
                a = a.reshape(segments[name].activation_shape(self.core.mesh.size))
            flat.append(a)
        return jax.tree_util.tree_unflatten(self.resolved.treedef, flat)

    def flat_gradients(self, gradients, csr: dict) -> dict:
        """`{feature: d loss / d activations}` as the core takes them, from `gradients` in
        the feature config's structure (None leaves: no gradient); shapes and dtypes
        checked against the batch `csr`, the errors naming the feature."""
        segments = self._segments(csr)
        flat = (
            flatten_inputs_like(self.resolved, gradients, "gradients", every_feature=True)
            if gradients is not None
            else [None] * len(self.resolved.features)
        )
        size = self.core.mesh.size
        out = {}
        for name, g in zip(self.resolved.feature_names, flat):
            if g is None:
                continue
            if name not in segments:
                raise ValueError(
                    f"gradient for feature {name}, which the preserved outputs do not cover"
                )
            shape = segments[name].activation_shape(size)
            if not hasattr(g, "shape") or not hasattr(g, "dtype"):  # TF: a ValueError
                raise ValueError(
                    f"gradient for feature {name} must be an array, got {type(g).__name__}"
                )
            if not jnp.issubdtype(g.dtype, jnp.floating):
                raise TypeError(
                    f"gradient for feature {name} must be floating point, got dtype {g.dtype}"
                )
            if tuple(g.shape) != shape:
                raise ValueError(
                    f"gradient for feature {name} has shape {tuple(g.shape)}, "
                    f"expected the activation's shape {shape}"
                )
            if not isinstance(g, jax.Array):
                g = jax.device_put(np.asarray(g), self.core.row_sharding)
            seg = segments[name]
            if seg.output_shape is not None:  # back to the lookup's [B, *sample_shape, dim]
                g = g.reshape((seg.samples * size,) + tuple(seg.sample_shape) + (seg.dim,))
            out[name] = g
        return out

    def read_table(self, state: EmbeddingState, table, field: str = "parameters") -> np.ndarray:
        """Table `table`'s `field` ("parameters" or a slot name) of `state`,
        `[vocabulary_size, dim]` in logical row order, on the host."""
        return self.core.read_field(state, table, field)

    def read_tables(self, state: EmbeddingState) -> dict:
        """`{TableConfig: [vocabulary_size, dim] numpy}` in logical row order; a table of
        raw ids (`TableConfig.id_map`) as its `RawIdTable` (its live ids and their rows)."""
        raw: dict = {}
        if self.core.dynamic:
            from embedmesh.device.by_id import raw_id_tables

            raw = raw_id_tables(self.core, state)
        return {t: raw[t] if t in raw else self.read_table(state, t) for t in self.tables}

    def read_variables(self, state: EmbeddingState) -> dict:
        """`{TableConfig: {"parameters": ..., slot name: ...}}`, logical row order."""
        out = {}
        for t in self.tables:
            stack = self.plan.stack_of(t).name
            fields = ["parameters", *self.core.slot_names(stack)]
            out[t] = {f: self.read_table(state, t, f) for f in fields}
        return out

    def table_shards(self, state: EmbeddingState) -> dict:
        """`{TableConfig: [(device, shard)]}`: each device's rows of each table (see
        `MeshEmbedding.embedding_table_shards`)."""
        out = {}
        for t in self.tables:
            p = self.plan.table(t)
            if p.stack in getattr(self.core, "tier", {}):  # rows in host memory
                blocks = self.core.host_blocks(state, t)
                out[t] = [(d, b) for d, b in zip(self.core.mesh.devices.flat, blocks)]
                continue
            arr = state.tables[p.stack]
            shards = []
            rps = self.plan.stack(p.stack).rows_per_shard
            for shard in sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0):
                block = stack_tables.logical_rows(self.plan.stack(p.stack), shard.data)[
                    p.local_row_offset : p.local_row_offset + p.rows_per_shard, : p.dim
                ]
                j = (shard.index[0].start or 0) // rps
                if self.plan.row_layout.copy_of(p, j) is None:
                    # the rows there are other tables', not this table's
                    block = jnp.zeros_like(block, device=shard.device)
                shards.append((shard.device, block))
            out[t] = shards
        return out

    def state_from_tables(self, tables: dict, slots: dict | None = None, step: int = 0):
        """A state from logical arrays `{TableConfig: [V, dim]}` (and slots `{TableConfig:
        {slot: array}}`); a ValueError naming the table for an array of the wrong shape."""
        name = self.resolved.table_name
        values = {name(t): self._checked_table(t, v, "parameters") for t, v in tables.items()}
        slot_values = {
            name(t): {k: self._checked_table(t, v, k) for k, v in s.items()}
            for t, s in (slots or {}).items()
        }
        return self.core.state_from_tables(values, slot_values, step)

    def _checked_table(self, table, value, what: str) -> np.ndarray:
        arr = np.asarray(value)
        name = self.resolved.table_name(table)
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
