"""The seed's names, so code written against `tf.tpu.experimental.embedding` ports
by changing its import: `from embedmesh import tpu as embedding`."""

from embedmesh import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    FeatureConfig,
    PartitionedCsrFormatTensor,
    QuantizationConfig,
    TableConfig,
    serving_embedding_lookup,
)
from embedmesh.facade import MeshEmbedding as TPUEmbeddingV2

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "FeatureConfig",
    "PartitionedCsrFormatTensor",
    "QuantizationConfig",
    "TPUEmbeddingV2",
    "TableConfig",
    "serving_embedding_lookup",
]


def __getattr__(name):
    # TPUEmbeddingForServing loads checkpoints; load orbax only when asked.
    if name == "TPUEmbeddingForServing":
        from embedmesh.serving.for_serving import EmbeddingForServing

        return EmbeddingForServing
    raise AttributeError(f"module 'embedmesh.tpu' has no attribute {name!r}")
