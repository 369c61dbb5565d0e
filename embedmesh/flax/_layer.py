"""What the flax modules share: a built `MeshEmbedding` used as the static half of a
module (its plan, its functional core, its host preprocessing), never for its state.

The modules keep the embedding state (`EmbeddingState`: stacked tables, optimizer
slots, the step count) as flax variables; the layer here only describes the job and
turns host batches into the placed `{stack: PartitionedCsrFormatTensor}` the module's
forward pass takes.
"""

from __future__ import annotations

from typing import Any

import jax

from embedmesh import checkpoint as _ckpt
from embedmesh.device.core import EmbeddingState
from embedmesh.facade import MeshEmbedding

#: The flax variable collection that holds the embedding's tables, optimizer slots and
#: update count (apart from the dense model's `params`).
COLLECTION = "embedding"


def built_layer(layer: MeshEmbedding) -> tuple[MeshEmbedding, EmbeddingState]:
    """`(layer, its initial state)`; the layer keeps no reference to the state (the
    module owns it from here on: one copy of the tables, not two)."""
    if not isinstance(layer, MeshEmbedding):
        raise TypeError(f"layer must be an embedmesh.MeshEmbedding, got {type(layer).__name__}")
    if layer.pipelined:
        raise ValueError(
            "the flax modules do not pipeline (pipeline_execution_with_tensor_core=True): "
            "use core.lookup_then_apply_gradients in a step of your own"
        )
    return layer, layer.release_state()  # a second module over one layer: a fresh state


def lookup(layer: MeshEmbedding, state: EmbeddingState, csr: dict) -> Any:
    """Activations in the feature config's structure (`output_shape` applied), as the
    facade's `dequeue` returns them. Tables enter as constants of differentiation: the
    gradient flows to the activations, never densely to the tables."""
    placed = _placed(layer, csr)
    _refuse_raw(placed, "the forward pass")
    state = jax.tree_util.tree_map(jax.lax.stop_gradient, state)
    acts = layer.core.lookup(state, placed)
    return layer.job.pack_activations(acts, csr)


def map_ids(layer: MeshEmbedding, state: EmbeddingState, csr: dict) -> tuple:
    """`(new state, csr)`: the raw ids of the batch's tables of raw ids (`TableConfig.id_map`)
    mapped to rows by the state's id maps (`EmbeddingCore.map_ids`: admissions,
    evictions, fresh rows), the batch the forward pass and the update then take; a batch
    without raw ids as it is."""
    placed = _placed(layer, csr)
    if not any(c.unique_raw_ids is not None for c in placed.values()):
        return state, placed
    state, placed, _ = layer.core.map_ids(state, placed)
    return state, placed


def _refuse_raw(csr: dict, what: str) -> None:
    raw = sorted(s for s, c in csr.items() if c.unique_raw_ids is not None)
    if raw:
        raise ValueError(
            f"{what}: stacks {raw} of this batch still carry raw ids (tables with "
            f"TableConfig.id_map): map them to rows first with the module's map_ids(csr) "
            f"(it updates the id maps) and pass the batch it returns to the forward pass "
            f"and to apply_gradients"
        )


def apply_gradients(
    layer: MeshEmbedding, state: EmbeddingState, gradients: Any, csr: dict, check_finite: bool
) -> tuple[EmbeddingState, Any]:
    """`(new state, ok)` after one fused sparse update from d loss / d activations
    (`gradients` in the feature config's structure; None leaves count as zero). Shapes
    and dtypes are checked with the facade's errors, naming the feature."""
    job = layer.job
    csr = _placed(layer, csr)
    _refuse_raw(csr, "apply_gradients")
    job.check_preserved(csr)
    grads = job.flat_gradients(gradients, csr)
    return layer.core.apply_gradients(state, grads, csr, check_finite=check_finite)


def _placed(layer: MeshEmbedding, csr) -> dict:
    """`csr` as the core takes it: `enqueue`'s dict (or the seed's `(dict, int, int)`)."""
    return layer.job.placed(csr, "the embedding module")


def save_args(layer: MeshEmbedding, state: EmbeddingState):
    """orbax save args of the embedding item: the same item as `checkpoint.save_args`."""
    return _ckpt.core_save_args(layer.core, state)


def restore(layer: MeshEmbedding, state: EmbeddingState, source, step=None, **kwargs):
    """The state restored from a checkpoint (any device count, any stacking)."""
    return _ckpt.core_restore(layer.core, state, source, step, **kwargs).state


def read_tables(layer: MeshEmbedding, state: EmbeddingState) -> dict:
    """`{TableConfig: numpy [vocabulary_size, dim]}` in logical row order; a table of raw
    ids as its `RawIdTable` (its live ids and their rows), as the facade's
    `embedding_tables` gives them."""
    job = layer.job
    raw: dict = {}
    if job.core.dynamic:
        from embedmesh.device.by_id import raw_id_tables

        raw = raw_id_tables(job.core, state)
    return {t: raw[t] if t in raw else job.read_table(state, t) for t in job.tables}
