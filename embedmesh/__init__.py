"""embedmesh: TPUEmbeddingV2's mid-level API on JAX, for every accelerator XLA runs on."""

import importlib as _importlib
import logging as _logging

from embedmesh import _gpu_guard, _lazy, _runtime
from embedmesh.config import (
    DynamicIds,
    FeatureConfig,
    QuantizationConfig,
    TableConfig,
    resolve_feature_config,
)
from embedmesh.device.by_id import export_increment, raw_id_tables
from embedmesh.device.core import EmbeddingCore, EmbeddingState
from embedmesh.facade import MeshEmbedding, default_mesh
from embedmesh.host.preprocess import (
    Capacity,
    PartitionedCsrFormatTensor,
    PreprocessStats,
    SparseCoreStats,
    compute_sparse_core_stats,
    preprocess_features,
)
from embedmesh.initializers import RowIdInitializer, row_id_initializer
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.job import EmbeddingJob
from embedmesh.layout.by_id import RawIdTable, RawIdUpdate, apply_increment
from embedmesh.layout.sharding import shards_to_table, table_to_shards
from embedmesh.layout.stacking import StackingPlan, plan_stacking
from embedmesh.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    Optimizer,
    RowWiseAdagrad,
)
from embedmesh.serving.export import export_serving, load_serving
from embedmesh.serving.lookup import serving_embedding_lookup

__version__ = "0.1.0"

# `logging.getLogger("embedmesh")` (each module logs to its child, `__name__`): silent
# until the application configures logging, as a library's logger should be
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# Importing the package starts no jax backend, so XLA has not read XLA_FLAGS yet.
_gpu_guard.apply()
# JAX's persistent compilation cache, where the user has set none (docs/environment.md)
_runtime.use_compilation_cache()


# `embedmesh.checkpoint` loads orbax only when used.
__getattr__ = _lazy.lazy_getattr(
    __name__, checkpoint=lambda: _importlib.import_module("embedmesh.checkpoint")
)

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "Capacity",
    "DynamicIds",
    "EmbeddingCore",
    "EmbeddingJob",
    "EmbeddingState",
    "FeatureConfig",
    "MeshEmbedding",
    "Optimizer",
    "PartitionedCsrFormatTensor",
    "RowWiseAdagrad",
    "PreprocessStats",
    "QuantizationConfig",
    "RaggedTensor",
    "RawIdTable",
    "RawIdUpdate",
    "RowIdInitializer",
    "SparseCoreStats",
    "SparseTensor",
    "StackingPlan",
    "TableConfig",
    "apply_increment",
    "compute_sparse_core_stats",
    "default_mesh",
    "export_increment",
    "export_serving",
    "load_serving",
    "plan_stacking",
    "preprocess_features",
    "raw_id_tables",
    "resolve_feature_config",
    "row_id_initializer",
    "serving_embedding_lookup",
    "shards_to_table",
    "table_to_shards",
]
