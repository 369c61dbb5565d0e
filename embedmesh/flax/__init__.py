"""flax modules over embedmesh's functional core: `embedmesh.flax.nnx.Embed` and
`embedmesh.flax.linen.Embed` (flax is an optional extra: `pip install embedmesh[flax]`).

Each module holds the embedding's tables, optimizer slots and step count as flax
variables in their own collection (`"embedding"`; nnx: `EmbeddingVariable`), sharded
over the mesh as `EmbeddingCore` shards them. The forward pass looks the activations
up; the user's train step differentiates the dense model with respect to its
parameters and the activations, updates the dense parameters with optax and hands
d loss / d activations to the module's `apply_gradients`, the fused sparse update.
Host preprocessing (`enqueue`, `prefetch`) runs outside the jitted step, as with
`MeshEmbedding`.
"""

from embedmesh.flax._layer import COLLECTION

__all__ = ["COLLECTION"]
