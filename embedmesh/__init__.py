"""embedmesh: TPUEmbeddingV2's mid-level API on JAX, for every accelerator XLA runs on."""

from embedmesh.config import (FeatureConfig, QuantizationConfig, TableConfig,
                              resolve_feature_config)
from embedmesh.initializers import RowIdInitializer, row_id_initializer
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, Optimizer
from embedmesh.serving import serving_embedding_lookup

__version__ = "0.1.0"

__all__ = [
    "FTRL", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FeatureConfig", "Optimizer",
    "QuantizationConfig", "RaggedTensor", "SparseTensor", "TableConfig",
    "RowIdInitializer", "resolve_feature_config", "row_id_initializer",
    "serving_embedding_lookup",
]
