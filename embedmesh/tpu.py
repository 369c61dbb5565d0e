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
    _lazy,
    serving_embedding_lookup,
)
from embedmesh import serving as _serving
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


# TPUEmbeddingForServing loads checkpoints; load orbax only when asked.
__getattr__ = _lazy.lazy_getattr(
    __name__, TPUEmbeddingForServing=lambda: _serving.EmbeddingForServing
)
