"""Serving trained tables on a CPU host: the lookup (`serving_embedding_lookup`),
quantized tables for it (`quantize_tables`: int8 rows, fp16, bf16, bucket codes),
tables of raw 64-bit ids served by id (`RawIdTable`) and kept fresh by increments
(`RawIdUpdate`, `apply_increment`; read from training by `embedmesh.raw_id_tables` and
`embedmesh.export_increment`),
its host kernels and what a user may tune of them (`embedmesh.serving.settings`), an
exported, jax-free-at-load serving function, and
`EmbeddingForServing` (a training checkpoint's tables, loaded on first use of the name:
it loads orbax)."""

from embedmesh import _lazy
from embedmesh.serving.export import (
    Dense,
    Ragged,
    ServingFunction,
    Sparse,
    export_serving,
    load_serving,
)
from embedmesh.serving.lookup import serving_embedding_lookup, set_host_threads
from embedmesh.serving.quantized import (
    QuantizedTable,
    load_tables,
    quantize_table,
    quantize_tables,
)
from embedmesh.serving.raw_ids import RawIdTable, RawIdUpdate, apply_increment

# (TensorFlow is imported by its call only: `embedmesh[tf]`)
from embedmesh.serving.saved_model import export_saved_model, signature_names

__all__ = [
    "Dense",
    "EmbeddingForServing",
    "QuantizedTable",
    "Ragged",
    "RawIdTable",
    "RawIdUpdate",
    "ServingFunction",
    "Sparse",
    "apply_increment",
    "export_saved_model",
    "export_serving",
    "load_serving",
    "load_tables",
    "quantize_table",
    "quantize_tables",
    "serving_embedding_lookup",
    "set_host_threads",
    "signature_names",
]


def _embedding_for_serving():
    from embedmesh.serving.for_serving import EmbeddingForServing

    return EmbeddingForServing


__getattr__ = _lazy.lazy_getattr(__name__, EmbeddingForServing=_embedding_for_serving)
