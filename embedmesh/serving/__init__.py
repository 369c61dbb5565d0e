"""Serving trained tables on a CPU host: the lookup (`serving_embedding_lookup`),
its host kernels, and an exported, jax-free-at-load serving function."""

from embedmesh.serving.export import Dense, Ragged, Sparse, export_serving, load_serving
from embedmesh.serving.lookup import serving_embedding_lookup, set_host_threads

# (TensorFlow is imported by its call only: `embedmesh[tf]`)
from embedmesh.serving.saved_model import export_saved_model, signature_names

__all__ = [
    "Dense",
    "Ragged",
    "Sparse",
    "export_saved_model",
    "export_serving",
    "load_serving",
    "serving_embedding_lookup",
    "set_host_threads",
    "signature_names",
]
