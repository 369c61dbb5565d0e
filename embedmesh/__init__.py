"""embedmesh: TPUEmbeddingV2's mid-level API on JAX, for every accelerator XLA runs on."""

from embedmesh.config import (FeatureConfig, QuantizationConfig, TableConfig,
                              resolve_feature_config)
from embedmesh.core import EmbeddingCore, EmbeddingState
from embedmesh.engine import MeshEmbedding, default_mesh
from embedmesh.initializers import RowIdInitializer, row_id_initializer
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, Optimizer
from embedmesh.preprocess import (Capacity, PartitionedCsrFormatTensor, PreprocessStats,
                                  SparseCoreStats, compute_sparse_core_stats,
                                  preprocess_features)
from embedmesh.serving import serving_embedding_lookup
from embedmesh.sharding import shards_to_table, table_to_shards
from embedmesh.stacking import StackingPlan, plan_stacking

__version__ = "0.1.0"

__all__ = [
    "FTRL", "SGD", "Adagrad", "AdagradMomentum", "Adam", "Capacity", "EmbeddingCore",
    "EmbeddingState", "FeatureConfig", "MeshEmbedding", "Optimizer",
    "PartitionedCsrFormatTensor", "PreprocessStats", "QuantizationConfig", "RaggedTensor",
    "RowIdInitializer", "SparseCoreStats", "SparseTensor", "StackingPlan", "TableConfig",
    "compute_sparse_core_stats", "default_mesh", "plan_stacking", "preprocess_features",
    "resolve_feature_config", "row_id_initializer", "serving_embedding_lookup",
    "shards_to_table", "table_to_shards",
]
