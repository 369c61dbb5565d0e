"""What the flax modules share: the job (`EmbeddingJob`) of a `MeshEmbedding`, used as
the static half of a module (its plan, its step functions, its host preprocessing),
never for its state.

The modules keep the embedding state (`EmbeddingState`: stacked tables, optimizer
slots, the step count, the id maps; pipelined, the update still to apply) as flax
variables and step it through the job's traced functions (`EmbeddingJob.map_ids`,
`lookup`, `update`, `defer`), the same code the facade's programs run.
"""

from __future__ import annotations

from typing import Any

from embedmesh import checkpoint as _ckpt
from embedmesh.job import EmbeddingJob, EmbeddingState

#: The flax variable collection that holds the embedding's tables, optimizer slots and
#: update count (apart from the dense model's `params`).
COLLECTION = "embedding"


def built_layer(layer: Any) -> tuple[Any, EmbeddingState]:
    """`(layer, its initial state)` of a `MeshEmbedding`; the layer keeps no reference
    to the state (the module owns it from here on: one copy of the tables, not two)."""
    if not (hasattr(layer, "release_state") and hasattr(type(layer), "job")):
        raise TypeError(f"layer must be an embedmesh.MeshEmbedding, got {type(layer).__name__}")
    state = layer.release_state()  # (builds it) a second module over one layer: a fresh state
    if not isinstance(layer.job, EmbeddingJob):
        raise TypeError(f"layer must be an embedmesh.MeshEmbedding, got {type(layer).__name__}")
    return layer, state


def save_args(job: EmbeddingJob, state: EmbeddingState):
    """orbax save args of the embedding item: the same item as `checkpoint.save_args`."""
    return _ckpt.core_save_args(job.core, state)


def restore(job: EmbeddingJob, state: EmbeddingState, source, step=None, **kwargs):
    """The `RestoredState` of a checkpoint (any device count, any stacking): its `.state`
    and its `.step`, the update count the modules' restores give back as the facade's."""
    return _ckpt.core_restore(job.core, state, source, step, **kwargs)
