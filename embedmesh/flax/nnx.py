"""An nnx module over embedmesh's functional core (`EmbeddingCore`).

    embed = embedmesh.flax.nnx.Embed(em.MeshEmbedding(features, em.Adagrad(0.1)))

    @nnx.jit
    def train_step(model, optimizer, csr, labels):
        acts = model.embed(csr)                               # sharded lookups
        def loss_fn(dense, acts):
            return loss(dense(acts), labels)
        loss, (g_dense, g_acts) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(
            model.dense, acts)
        optimizer.update(model.dense, g_dense)                # optax, dense params only
        model.embed.apply_gradients(g_acts, csr)              # fused sparse update
        return loss

    for batch in batches:
        loss = train_step(model, optimizer, embed.enqueue(batch), labels)

The tables, the optimizer slots and the step count are `EmbeddingVariable`s (their
own collection, `nnx.state(model, EmbeddingVariable)`), each a global array sharded
over the mesh exactly as the core shards it; `nnx.Param` filters (and so
`nnx.Optimizer(model, tx, wrt=nnx.Param)`, `nnx.grad`) never see them. `Embed.tables`
is a plain dict `{stack name: EmbeddingVariable}` and `Embed.slots` `{stack name: {slot
name: EmbeddingVariable}}` (nnx state paths `tables/<stack>`, `slots/<stack>/<slot>`):
keys, not attributes, so any table name works (`items`, `__class__`, `a.b`...).

Tables of raw ids (`TableConfig.id_map`): the step maps its batch first, in place, and
passes the batch `map_ids` returns to the forward pass and `apply_gradients`:

        csr = model.embed.map_ids(csr)                        # raw ids -> rows
        acts = model.embed(csr)

Their id maps are `Embed.id_maps` (`{stack: EmbeddingVariable}`, docs/dynamic-ids.md).

Evaluation: `model.eval()` (nnx's switch, which sets `deterministic=True` on every
module that has it; `model.train()` sets it back), `nnx.view(model, deterministic=True)`
or `embed(csr, deterministic=True)` makes the lookup change no state: tables of raw ids
are read through their id maps without admitting, evicting or counting (an id they do
not hold reads a zero row, as serving reads it), a pending update stays pending, and a
batch `map_ids` or `enqueue` give in that mode is refused by `apply_gradients`.

Pipelined (`MeshEmbedding(..., pipeline_execution_with_tensor_core=True)`), the same
step defers each update: `apply_gradients` keeps it in `Embed.pending` and the next
forward pass applies it fused with its lookup, which reads the tables one update
stale, as the facade does (`flush()` applies it now; `embedding_tables`, `variables`
and `save_args` read the tables with it applied).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from embedmesh.flax import _layer
from embedmesh.job import EmbeddingJob, EmbeddingState

__all__ = ["Embed", "EmbeddingVariable"]


class EmbeddingVariable(nnx.Variable):
    """An embedmesh table, optimizer slot or step count: updated by the fused sparse
    update (`Embed.apply_gradients`), never by an optax optimizer."""


class Embed(nnx.Module):
    """Sharded embedding lookups (forward) and their fused sparse update (`apply_gradients`).

    Args:
      layer: a `MeshEmbedding` describing the job (features, optimizer, mesh, sharding,
        capacities, seed...). It is built here; the module takes its initial state and
        from then on uses only its plan, its core and its host preprocessing (`enqueue`,
        `prefetch`). Its own state is dropped, so its state-reading methods must not be
        used: read `Embed.embedding_tables` instead.
      deterministic: evaluation mode (False: training). `model.eval()` /
        `model.train()` and `nnx.view(model, deterministic=...)` set it; the forward
        pass and `map_ids` take it per call too. In evaluation the lookups change no
        state: see `__call__`.
    """

    # plain dicts keyed by stack name (the table's name for a stack of one table), not
    # nnx.Dict: its keys are attributes, so a table named "items" or "__class__" would
    # hide or break the container's own attributes
    tables: dict[str, EmbeddingVariable]
    slots: dict[str, dict[str, EmbeddingVariable]]
    step: EmbeddingVariable
    id_maps: dict[str, EmbeddingVariable]  # the tables of raw ids' (empty: none)
    pending: EmbeddingVariable | None  # pipelined: the update the next lookup applies
    deterministic: bool  # evaluation mode (nnx's `eval()` / `train()` set it)

    def __init__(self, layer: Any, *, deterministic: bool = False):
        layer, state = _layer.built_layer(layer)
        self.layer = layer  # static: compared by identity in nnx's graph
        self.pending = nnx.data(None)
        self.deterministic = bool(deterministic)
        self._set(state)

    def set_view(self, deterministic: bool | None = None):
        """`nnx.view(model, deterministic=...)`'s hook.

        Args:
          deterministic: True for evaluation (lookups that change no state), False
            for training.
        """
        if deterministic is not None:
            self.deterministic = bool(deterministic)

    def _evaluating(self, csr, deterministic: bool | None) -> bool:
        """Evaluation: `deterministic` (the module's mode where None), or a batch
        enqueued or mapped for evaluation."""
        mode = self.deterministic if deterministic is None else deterministic
        return bool(mode) or self.job.is_evaluation(csr)

    @property
    def job(self) -> EmbeddingJob:
        """The layer's job (`EmbeddingJob`), whose traced steps the module runs."""
        return self.layer.job

    @property
    def plan(self):
        """The stacking plan (`StackingPlan`): `print(embed.plan)` shows each stack's
        tables, strategy and the bytes each device holds."""
        return self.job.plan

    @property
    def last_stats(self):
        """The `PreprocessStats` of the latest `enqueue` (per stack: ids per partition,
        capacity, ids dropped by overflow="drop", whether the capacity grew); None before
        the first batch."""
        return self.layer.last_stats

    def _pending(self) -> tuple | None:
        return None if self.pending is None else self.pending.get_value()

    def _set_pending(self, pending: tuple | None) -> None:
        self.pending = nnx.data(None if pending is None else EmbeddingVariable(pending))

    # -- state ----------------------------------------------------------------------

    def _set(self, state: EmbeddingState) -> None:
        def var(x):
            # the partition spec the core placed it with, as nnx sharding metadata
            # (`nnx.get_partition_spec`); the array is already placed: no eager resharding
            spec = getattr(getattr(x, "sharding", None), "spec", None)
            if spec is None:
                return EmbeddingVariable(x)
            names = tuple(spec) + (None,) * (x.ndim - len(spec))
            return EmbeddingVariable(x, out_sharding=names, eager_sharding=False)

        if hasattr(self, "tables"):
            for s, a in state.tables.items():
                self.tables[s].set_value(a)
            for s, d in state.slots.items():
                for k, a in d.items():
                    self.slots[s][k].set_value(a)
            self.step.set_value(state.step)
            for s, m in state.id_maps.items():
                self.id_maps[s].set_value(m)
            return
        self.tables = nnx.data({s: var(a) for s, a in state.tables.items()})
        self.slots = nnx.data(
            {s: {k: var(a) for k, a in d.items()} for s, d in state.slots.items()}
        )
        self.step = var(state.step)
        # the id maps of the tables of raw ids (a pytree a stack: `EmbeddingState.id_maps`)
        self.id_maps = nnx.data({s: EmbeddingVariable(m) for s, m in state.id_maps.items()})

    @property
    def state(self) -> EmbeddingState:
        """The `EmbeddingState` the variables hold (for the core, checkpoints)."""
        return EmbeddingState(
            tables={s: v.get_value() for s, v in self.tables.items()},
            slots={s: {k: v.get_value() for k, v in d.items()} for s, d in self.slots.items()},
            step=self.step.get_value(),
            id_maps={s: v.get_value() for s, v in self.id_maps.items()},
        )

    @state.setter
    def state(self, value: EmbeddingState) -> None:
        self._set(value)

    @property
    def core(self):
        """The functional core (`EmbeddingCore`)."""
        return self.job.core

    def observed_state(self) -> EmbeddingState:
        """The state with a pending update (pipelined) applied; the module unchanged."""
        return self.job.applied(self.state, self._pending())

    def flush(self) -> None:
        """Apply a pending update now (pipelined: the next lookup then sees it)."""
        self._set(self.observed_state())
        self._set_pending(None)

    # -- host side --------------------------------------------------------------------

    def enqueue(
        self, features: Any, weights: Any | None = None, *, training: bool | None = None
    ) -> dict:
        """This process's batch preprocessed on the host and placed on the mesh: the
        `csr` the forward pass and `apply_gradients` take (`MeshEmbedding.enqueue`).
        `training=False` (default: the module's mode, `not deterministic`) marks it for
        evaluation: its forward pass changes no state, `apply_gradients` refuses it."""
        if training is None:
            training = not self.deterministic
        return self.layer.enqueue(features, weights, training=training)

    def prefetch(self, batches, buffer_size: int = 2):
        """`enqueue` run ahead in a background thread (`MeshEmbedding.prefetch`)."""
        return self.layer.prefetch(batches, buffer_size)

    # -- forward and update -----------------------------------------------------------

    def map_ids(self, csr: dict, *, deterministic: bool | None = None) -> dict:
        """A batch with tables of raw ids (`TableConfig.id_map`) mapped to rows by the
        id maps, in place (admissions and evictions change the maps, fresh rows the
        tables): the batch the forward pass and `apply_gradients` take. A batch without
        raw ids comes back as it is. In evaluation (`deterministic`, default the
        module's mode) the maps are only read: an id they do not hold gets no row (a
        zero row), nothing changes, and the batch is marked for evaluation."""
        if self._evaluating(csr, deterministic):
            return self.job.find_rows(self.state, csr)
        pending = self._pending()
        state, csr, fresh = self.job.map_ids(self.state, csr, pending)
        if state.id_maps:
            self._set(state)
        if fresh is not None and pending is not None:  # rows given ahead of the update
            self._set_pending(pending[:2] + (fresh,))
        return csr

    def __call__(self, csr: dict, *, deterministic: bool | None = None) -> Any:
        """Activations of an enqueued batch (with tables of raw ids, the batch `map_ids`
        returns), in the feature config's structure (pipelined: the pending update
        applied after the lookup, in one program).

        In evaluation (`deterministic`, default the module's mode: `model.eval()`; or a
        batch enqueued with `training=False`) the lookup changes no state: a batch of raw
        ids is read through the id maps as it is (no `map_ids` needed; no admission,
        eviction or count: an unknown id reads a zero row, as serving reads it), and,
        pipelined, it reads the tables the next training lookup reads (one update
        stale), the pending update left pending."""
        if self._evaluating(csr, deterministic):
            return self.job.infer(self.state, csr)[0]
        pending = self._pending()
        acts, state, _ = self.job.lookup(self.state, csr, pending)
        if pending is not None:
            self._set(state)
            self._set_pending(None)
        return acts

    def apply_gradients(self, gradients: Any, csr: dict, *, check_finite: bool = True):
        """One fused sparse update of the tables and slots from d loss / d activations
        (the feature config's structure; None counts as zero), in place. With
        `check_finite`, a non-finite gradient leaves the state unchanged; returns
        whether the update was applied (a traced bool inside `nnx.jit`). Pipelined, the
        update is kept for the next forward pass (a non-finite one then skipped)."""
        if self.job.pipelined:
            pending, ok = self.job.defer(gradients, csr, check_finite)  # (checks first)
            if self.pending is not None:  # two updates without a lookup between them
                self.flush()
            self._set_pending(pending)
            return ok
        state, ok = self.job.update(self.state, gradients, csr, check_finite)
        self._set(state)
        return ok

    # -- reading and checkpoints -----------------------------------------------------

    @property
    def embedding_tables(self) -> dict:
        """`{TableConfig: numpy [vocabulary_size, dim]}` in logical row order (a table of
        raw ids: its `RawIdTable`)."""
        return self.job.read_tables(self.observed_state())

    @property
    def variables(self) -> dict:
        """`{TableConfig: {"parameters": ..., slot name: ...}}` (numpy, logical order)."""
        return self.job.read_variables(self.observed_state())

    def save_args(self):
        """orbax args of the embedding item (`checkpoint.core_save_args`): put it in an
        `ocp.args.Composite` beside the dense model's `nnx.state(model, nnx.Param)`."""
        return _layer.save_args(self.job, self.observed_state())

    def restore(self, source, step: int | None = None, **kwargs) -> int:
        """Restore the embedding item of a checkpoint (a directory or an
        `ocp.CheckpointManager`; saved on any device count, by a module, a
        `MeshEmbedding` or the core) into this module (`checkpoint.core_restore`).

        `step` is the checkpoint's own step (default: the latest). Returns the restored
        update count (`checkpoint.restore` returns the same): how many updates the
        tables have had, which is the checkpoint's step only where the steps were
        numbered so; restore the dense state at the checkpoint's step, not at this."""
        restored = _layer.restore(self.job, self.observed_state(), source, step, **kwargs)
        self._set(restored.state)
        self._set_pending(None)
        return restored.step
