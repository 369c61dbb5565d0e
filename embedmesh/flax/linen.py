"""A linen module over embedmesh's functional core (`EmbeddingCore`).

    embed = embedmesh.flax.linen.Embed(em.MeshEmbedding(features, em.Adagrad(0.1)))
    variables = embed.init(jax.random.key(0), csr)      # {"embedding": ...}, eager

    @jax.jit
    def train_step(emb_vars, params, opt_state, csr, labels):
        acts = embed.apply(emb_vars, csr)                  # sharded lookups
        def loss_fn(params, acts):
            return loss(dense.apply(params, acts), labels)
        loss, (g_params, g_acts) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, acts)
        updates, opt_state = tx.update(g_params, opt_state, params)
        params = optax.apply_updates(params, updates)   # optax: dense params only
        _, emb_vars = embed.apply(emb_vars, g_acts, csr, method="apply_gradients",
                                  mutable=["embedding"])  # fused sparse update
        return emb_vars, params, opt_state, loss

Inside a larger linen model, `Embed` also marks its activations as a perturbation
(`"perturbations"` collection, name `"activations"`): `jax.grad` over that collection
gives d loss / d activations (flax's intermediate gradients). A perturbation has the
activations' shape, so it belongs to one batch, not to the model: `init` makes none
(its variables are `{"embedding": ...}` only, fit for any batch size), and the
perturbations of a batch come from an `apply` with the collection mutable:

    _, perturbations = model.apply(variables, csr, mutable=["perturbations"])  # zeros
    def loss_fn(perturbations):
        return loss(model.apply({**variables, **perturbations}, csr), labels)
    g_acts = jax.grad(loss_fn)(perturbations)["perturbations"][...]["activations"]

Without a perturbation for it (none passed, or a `"perturbations"` collection holding
only other modules'), the activations are used as they are; one made for another batch
is an error.

Tables of raw ids (`TableConfig.id_map`): the step maps its batch first and passes the
batch `map_ids` returns to the lookup and the update (docs/dynamic-ids.md):

    csr, emb_vars = embed.apply(emb_vars, csr, method="map_ids", mutable=["embedding"])

The collection `"embedding"` holds `{"tables": {stack: array}, "slots": {stack:
{slot: array}}, "step": int32}` (and `"id_maps": {stack: ...}` with tables of raw ids),
each array a global array sharded over the mesh
exactly as the core shards it. `init` must run eagerly (not under `jax.jit`): the
tables are built shard by shard on their devices.

Evaluation (flax's `deterministic`, as `nn.Dropout` takes it: a module attribute or a
call argument): `embed.apply(variables, csr, deterministic=True)` is a lookup that changes
no state and needs no mutable collection, pipelined or not; a batch of raw ids is read
through the id maps as it is (no admission, eviction or count: an id they do not hold
reads a zero row, as serving reads it); `apply_gradients` refuses a batch made for
evaluation (`map_ids(..., deterministic=True)`, `enqueue(..., training=False)`).

Pipelined (`MeshEmbedding(..., pipeline_execution_with_tensor_core=True)`), the same
step defers each update: `apply_gradients` keeps it in the collection (`"pending"`)
and the next `__call__` applies it fused with its lookup, which reads the tables one
update stale, as the facade does; `__call__` then changes the collection, so call it
with `mutable=["embedding"]` (`embedding_tables` reads the tables with it applied).
"""

from __future__ import annotations

import weakref
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from embedmesh.flax import _layer
from embedmesh.job import EmbeddingJob, EmbeddingState

__all__ = ["Embed", "state_of", "variables_of"]

COLLECTION = _layer.COLLECTION
PERTURBATIONS = "perturbations"  # flax's collection of intermediate-gradient perturbations


def state_of(variables: dict) -> EmbeddingState:
    """The `EmbeddingState` of a module's variables (`{"embedding": ...}` or its value)."""
    v = variables.get(COLLECTION, variables)
    return EmbeddingState(
        tables=dict(v["tables"]),
        slots=dict(v["slots"]),
        step=v["step"],
        id_maps=dict(v.get("id_maps", {})),
    )


def variables_of(state: EmbeddingState) -> dict:
    """`{"embedding": ...}` variables of an `EmbeddingState` (`"id_maps"` only where it has
    tables of raw ids)."""
    out = {
        "tables": dict(state.tables),
        "slots": {s: dict(d) for s, d in state.slots.items()},
        "step": state.step,
    }
    if state.id_maps:
        out["id_maps"] = dict(state.id_maps)
    return {COLLECTION: out}


_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Layer:
    """A built `MeshEmbedding` shared by every clone of one module (linen re-creates
    modules on each `apply`; building is done once, at construction)."""

    def __init__(self, layer: Any):
        self.initial: EmbeddingState | None
        self.layer, self.initial = _layer.built_layer(layer)

    def take_initial(self) -> EmbeddingState:
        """The initial state, handed out once (later inits build a fresh one)."""
        state, self.initial = self.initial, None
        if state is None:
            state = self.layer.job.init_state()
        return state


def _holder(layer: Any) -> _Layer:
    if layer not in _HOLDERS:
        _HOLDERS[layer] = _Layer(layer)
    return _HOLDERS[layer]


class Embed(nn.Module):
    """Sharded embedding lookups (`__call__`) and their fused sparse update
    (`apply_gradients`, with `mutable=["embedding"]`).

    `embedding`: a `MeshEmbedding` describing the job (features, optimizer, mesh,
    sharding, capacities, seed...), built at construction; its own state is dropped
    (see `embedmesh.flax.nnx.Embed`). `deterministic`: evaluation mode (None or False:
    training), which `__call__` and `map_ids` also take per call (the call's wins).
    """

    embedding: Any  # a MeshEmbedding (built on construction)
    deterministic: bool | None = None  # evaluation: lookups that change no state

    def __post_init__(self):
        if hasattr(self.embedding, "release_state") and hasattr(self.embedding, "job"):
            object.__setattr__(self, "holder", _holder(self.embedding))
        else:
            raise TypeError(
                f"Embed takes an embedmesh.MeshEmbedding, got {type(self.embedding).__name__}"
            )
        super().__post_init__()

    @property
    def layer(self) -> Any:
        return self.holder.layer

    @property
    def job(self) -> EmbeddingJob:
        """The layer's job (`EmbeddingJob`), whose traced steps the module runs."""
        return self.holder.layer.job

    @property
    def core(self):
        return self.job.core

    def _pending(self) -> tuple | None:
        if not self.has_variable(COLLECTION, "pending"):
            return None
        pending: Any = self.get_variable(COLLECTION, "pending")
        return pending

    def _put(self, state: EmbeddingState, pending: tuple | None) -> None:
        for name, value in variables_of(state)[COLLECTION].items():
            self.put_variable(COLLECTION, name, value)
        if pending is not None or self.has_variable(COLLECTION, "pending"):
            self.put_variable(COLLECTION, "pending", pending)

    def _embedding_state(self) -> EmbeddingState:
        if not self.has_variable(COLLECTION, "tables"):
            if not self.is_mutable_collection(COLLECTION):
                raise ValueError(
                    f"the {COLLECTION!r} collection is missing: pass the variables from "
                    f"Embed.init (or embedmesh.flax.linen.variables_of(state))"
                )
            init = self.holder.take_initial()
            for name, value in variables_of(init)[COLLECTION].items():
                self.put_variable(COLLECTION, name, value)
        slots: dict = self.get_variable(COLLECTION, "slots")
        maps = self.get_variable(COLLECTION, "id_maps") if self.core.dynamic else None
        return EmbeddingState(
            tables=dict(self.get_variable(COLLECTION, "tables")),
            slots={s: dict(d) for s, d in slots.items()},
            step=self.get_variable(COLLECTION, "step"),
            id_maps=dict(maps or {}),
        )

    def _evaluating(self, csr, deterministic: bool | None) -> bool:
        """Evaluation: `deterministic` (the module's where None), or a batch enqueued or
        mapped for evaluation; never while initialising."""
        mode = self.deterministic if deterministic is None else deterministic
        evaluating = bool(mode) or self.job.is_evaluation(csr)
        return evaluating and not self.is_initializing()

    def map_ids(self, csr: dict, deterministic: bool | None = None) -> dict:
        """A batch with tables of raw ids (`TableConfig.id_map`) mapped to rows by the
        id maps (call with `mutable=["embedding"]`: admissions and evictions change the
        maps, fresh rows the tables): the batch `__call__` and `apply_gradients` take.
        A batch without raw ids comes back as it is. With `deterministic` (evaluation)
        the maps are only read (an id they do not hold gets a zero row), nothing
        changes (no mutable collection needed), and the batch is marked for
        evaluation."""
        if self._evaluating(csr, deterministic):
            return self.job.find_rows(self._embedding_state(), csr)
        pending = self._pending()
        state, csr, fresh = self.job.map_ids(self._embedding_state(), csr, pending)
        if state.id_maps:
            # (rows given ahead of a pending update: re-initialised after it)
            if fresh is not None and pending is not None:
                pending = pending[:2] + (fresh,)
            self._put(state, pending)
        return csr

    def __call__(self, csr: dict, deterministic: bool | None = None) -> Any:
        """Activations of an enqueued batch (`enqueue`; with tables of raw ids, the
        batch `map_ids` returns), in the feature config's structure. `init` takes a batch
        of raw ids too: its activations from a map thrown away (the variables keep the
        empty maps, so the first step maps that batch as any other). Pipelined with an
        update pending, it is applied after the lookup (call with `mutable=["embedding"]`).

        With `deterministic` (evaluation; default the module's attribute; or a batch
        enqueued with `training=False`) the lookup changes no state: a batch of raw ids
        is read through the id maps as it is (an unknown id reads a zero row), and,
        pipelined, it reads the tables the next training lookup reads, the pending
        update left pending."""
        if self._evaluating(csr, deterministic):
            acts, _ = self.job.infer(self._embedding_state(), csr)
            return self._perturbed(acts)
        state = self._embedding_state()
        if self.is_initializing():
            _, csr, _ = self.job.map_ids(state, csr)
        pending = self._pending()
        acts, state, _ = self.job.lookup(state, csr, pending)
        if pending is not None:
            self._put(state, None)
        return self._perturbed(acts)

    def _perturbed(self, acts: Any) -> Any:
        """`acts` plus this batch's perturbation (`Module.perturb`, except that `init`
        makes none and a missing one is no perturbation: they are per batch)."""
        if self.is_initializing():
            return acts
        if self.is_mutable_collection(PERTURBATIONS) and not self.has_variable(
            PERTURBATIONS, "activations"
        ):
            self.put_variable(PERTURBATIONS, "activations", jax.tree.map(jnp.zeros_like, acts))
        if not self.has_variable(PERTURBATIONS, "activations"):
            return acts
        perturbation: Any = self.get_variable(PERTURBATIONS, "activations")
        want = jax.tree.map(jnp.shape, acts)
        got = jax.tree.map(jnp.shape, perturbation)
        got_def: Any = jax.tree.structure(got)
        if got_def != jax.tree.structure(want) or got != want:
            raise ValueError(
                f"the {PERTURBATIONS!r} of the activations were made for another batch "
                f"(shapes {got}, the activations' {want}): they are per batch; make "
                f"them with apply(variables, csr, mutable=[{PERTURBATIONS!r}])"
            )
        return jax.tree.map(jnp.add, acts, perturbation)

    def apply_gradients(self, gradients: Any, csr: dict, check_finite: bool = True):
        """One fused sparse update from d loss / d activations (call with
        `mutable=["embedding"]`); returns whether it was applied. Pipelined, the update
        is kept for the next `__call__` (a non-finite one then skipped)."""
        state = self._embedding_state()
        if self.job.pipelined:  # (an update still pending first: no lookup between them)
            state = self.job.applied(state, self._pending())
            pending, ok = self.job.defer(gradients, csr, check_finite)
            self._put(state, pending)
            return ok
        state, ok = self.job.update(state, gradients, csr, check_finite)
        self.put_variable(COLLECTION, "tables", dict(state.tables))
        self.put_variable(COLLECTION, "slots", {s: dict(d) for s, d in state.slots.items()})
        self.put_variable(COLLECTION, "step", state.step)
        return ok

    # host side and checkpoints: plain methods of the (unbound) module

    def enqueue(
        self, features: Any, weights: Any | None = None, training: bool | None = None
    ) -> dict:
        """This process's batch preprocessed and placed on the mesh (`MeshEmbedding.enqueue`);
        `training=False` (default: `not deterministic`) marks it for evaluation."""
        if training is None:
            training = not self.deterministic
        return self.layer.enqueue(features, weights, training=training)

    def prefetch(self, batches, buffer_size: int = 2):
        return self.layer.prefetch(batches, buffer_size)

    def embedding_tables(self, variables: dict) -> dict:
        """`{TableConfig: numpy [vocabulary_size, dim]}` of `variables`, logical order (a
        table of raw ids: its `RawIdTable`)."""
        pending = variables.get(COLLECTION, variables).get("pending")
        return self.job.read_tables(self.job.applied(state_of(variables), pending))

    def save_args(self, variables: dict):
        """orbax args of the embedding item (`checkpoint.core_save_args`)."""
        return _layer.save_args(self.job, state_of(variables))

    def restore(self, variables: dict, source, step: int | None = None, **kwargs) -> dict:
        """New `{"embedding": ...}` variables restored from a checkpoint (saved on any
        device count, by a module, a `MeshEmbedding` or the core); `variables` give the
        template (and are left as they are). `step` is the checkpoint's own step (default:
        the latest); the restored update count is the result's `["embedding"]["step"]` (what
        `checkpoint.restore` returns), not necessarily that step."""
        restored = _layer.restore(self.job, state_of(variables), source, step, **kwargs)
        return variables_of(restored.state)
