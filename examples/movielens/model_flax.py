"""The click-through model in flax nnx: embedmesh's `Embed` module + the DLRM top MLP.

The same architecture and initial values as `model.py`'s plain-JAX `forward` (the
pairwise dot products of the F embeddings, concatenated with the flattened
embeddings, a ReLU MLP with dropout, one logit, plus the wide per-id biases), written
as an nnx module whose parameters are `nnx.Param`s (optax updates them through
`nnx.Optimizer`) and whose tables are `Embed`'s `EmbeddingVariable`s (the fused sparse
Adagrad updates them). `dense_params()` gives the plain pytree `model.forward` takes,
which the serving side runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embedmesh.facade import MeshEmbedding
from embedmesh.flax.nnx import Embed
from examples.movielens import model as mdl


class Linear(nnx.Module):
    """`x @ w + b` with given initial values (`model.init_dense`'s He-normal weights)."""

    def __init__(self, w, b):
        self.w = nnx.Param(w)
        self.b = nnx.Param(b)

    def __call__(self, x):
        return x @ self.w[...] + self.b[...]


class Ranker(nnx.Module):
    """Embeddings (sharded, `Embed`) -> interactions -> top MLP -> logit."""

    def __init__(
        self, embedding: MeshEmbedding, params: dict, features: Sequence[str], cfg: mdl.ModelConfig
    ):
        self.embed = Embed(embedding)
        self.layers = nnx.List([Linear(p["w"], p["b"]) for p in params["layers"]])
        self.features = tuple(features)
        self.cfg = cfg

    def __call__(self, acts: dict, dropout_key=None) -> jax.Array:
        """Logits [B] from the activations (`self.embed(csr)`)."""
        feats, cfg = self.features, self.cfg
        x = jnp.stack([acts[n] for n in feats], axis=1)  # [B, F, dim]
        dots = jnp.einsum("bfd,bgd->bfg", x, x)
        iu, ju = np.triu_indices(len(feats), k=1)
        z = jnp.concatenate([x.reshape(x.shape[0], -1), dots[:, iu, ju]], axis=1)
        for i, layer in enumerate(self.layers[:-1]):
            z = jax.nn.relu(layer(z))
            if dropout_key is not None and cfg.dropout > 0:
                keep = jax.random.bernoulli(
                    jax.random.fold_in(dropout_key, i), 1 - cfg.dropout, z.shape
                )
                z = jnp.where(keep, z / (1 - cfg.dropout), 0.0)
        out = self.layers[-1](z)[:, 0]
        if cfg.wide:
            out = out + sum(acts[n + mdl.BIAS_SUFFIX][:, 0] for n in feats)
        return out

    def dense_params(self) -> dict:
        """The MLP as `model.forward`'s pytree (numpy): what serving runs."""
        return {
            "layers": [
                {"w": np.asarray(layer.w[...]), "b": np.asarray(layer.b[...])}
                for layer in self.layers
            ]
        }
