"""`EmbeddingForServing` (TensorFlow's `TPUEmbeddingForServing`): a feature config's tables
on the host, loaded from a training checkpoint (`embedmesh.checkpoint.load_tables`: no
mesh, no slots), looked up with `serving_embedding_lookup`."""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from embedmesh.checkpoint.format import DEFAULT_ITEM
from embedmesh.checkpoint.loading import load_tables
from embedmesh.checkpoint.reading import item_directory, read_metadata
from embedmesh.config import resolve_feature_config
from embedmesh.serving.lookup import serving_embedding_lookup

__all__ = ["EmbeddingForServing"]


class EmbeddingForServing:
    """TensorFlow's `TPUEmbeddingForServing`: a feature config's tables on the host for serving.

    `restore` loads the parameters of a training checkpoint (no mesh, no
    slots); `embedding_lookup` / `__call__` run `serving_embedding_lookup`
    on them. Before `restore` (or `build`), tables come from their
    initializers. `optimizer` is accepted for API compatibility and unused.
    """

    def __init__(self, feature_config: Any, optimizer: Any = None):
        self.feature_config = feature_config
        self._resolved = resolve_feature_config(feature_config)
        self.optimizer = optimizer
        self._tables: dict | None = None
        self._build_lock = threading.Lock()  # threads racing to a first call build once
        self.step: int | None = None

    def build(self, seed: int = 0):
        """Initialise every table on the host from its initializer."""
        if self._tables is not None:
            return
        with self._build_lock:
            if self._tables is not None:
                return
            key = jax.random.key(seed)
            self._tables = {
                t: np.asarray(t.initialize(jax.random.fold_in(key, i)))
                for i, t in enumerate(self._resolved.tables)
            }

    def restore(self, source, step: int | None = None, *, item: str = DEFAULT_ITEM) -> int:
        """Load the parameters of a checkpoint (see `load_tables`); returns its step."""
        path = item_directory(source, step, item)
        self._tables = load_tables(path, feature_config=self.feature_config)
        self.step = int(read_metadata(path)["step"])
        return self.step

    def __repr__(self) -> str:
        tables = ", ".join(
            f"{t.name}: {t.vocabulary_size} x {t.dim}" for t in self._resolved.tables
        )
        source = (
            f"restored step {self.step}"
            if self.step is not None
            else ("initialized" if self._tables is not None else "not built")
        )
        return f"EmbeddingForServing({tables}; {source})"

    @property
    def embedding_tables(self) -> dict:
        """`{TableConfig: [vocabulary_size, dim] numpy array}`."""
        self.build()
        return dict(self._tables)

    def embedding_lookup(self, features: Any, weights: Any | None = None) -> Any:
        return serving_embedding_lookup(
            features, weights, self.embedding_tables, self.feature_config
        )

    __call__ = embedding_lookup
