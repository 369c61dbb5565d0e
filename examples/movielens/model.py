"""A DLRM-style click-through model: embedmesh tables + a small MLP in plain JAX.

The demo trains this model in flax nnx by default (`model_flax.Ranker`, on
`embedmesh.flax.nnx.Embed`); this plain-JAX form stays: it is what the serving side
runs (`forward` on the saved parameters), and `--dense jax` trains it over the
functional core directly (`train.Trainer`), the path for a train step of one's own.

Architecture (DLRM without dense features): each categorical feature has its
own embedmesh table of width `dim`; the F activations [B, F, dim] give
F*(F-1)/2 pairwise dot products (the factorization-machine interactions),
which are concatenated with the flattened embeddings and fed to a top MLP
(ReLU) ending in one logit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import embedmesh as em


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    dim: int = 32
    hidden: tuple = (256, 128)
    dropout: float = 0.0
    l2: float = 0.0  # L2 penalty on the looked-up embeddings (per occurrence)
    wide: bool = False  # add a first-order term: one scalar weight per id


BIAS_SUFFIX = "_bias"


def feature_config(
    vocab_sizes: dict, features: Sequence[str], cfg: ModelConfig, init_stddev: float = 0.05
) -> dict:
    """`{feature: FeatureConfig}`: one table per feature; combiner mean (the
    multi-hot genre feature averages its genres; single ids are unaffected).
    With `cfg.wide`, also a 1-wide table per feature (`<name>_bias`)."""
    out = {}
    for name in features:
        table = em.TableConfig(
            vocabulary_size=int(vocab_sizes[name]),
            dim=cfg.dim,
            combiner="mean",
            name=name,
            initializer=jax.nn.initializers.normal(stddev=init_stddev),
        )
        out[name] = em.FeatureConfig(table, name=name)
    if cfg.wide:
        for name in features:
            b = name + BIAS_SUFFIX
            table = em.TableConfig(
                vocabulary_size=int(vocab_sizes[name]),
                dim=1,
                combiner="mean",
                name=b,
                initializer=jax.nn.initializers.zeros,
            )
            out[b] = em.FeatureConfig(table, name=b)
    return out


def expand_inputs(features: dict, cfg: ModelConfig) -> dict:
    """Inputs for `feature_config`: the bias features read the same ids."""
    if not cfg.wide:
        return features
    out = dict(features)
    for name, x in features.items():
        out[name + BIAS_SUFFIX] = x
    return out


def _num_interactions(f: int) -> int:
    return f * (f - 1) // 2


def init_dense(key, num_features: int, cfg: ModelConfig) -> dict:
    """Top-MLP parameters: {"layers": [{"w", "b"}, ...], "bias"} (He-normal weights)."""
    sizes = [num_features * cfg.dim + _num_interactions(num_features), *cfg.hidden, 1]
    layers = []
    for k, (a, b) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        w = jax.random.normal(k, (a, b), jnp.float32) * math.sqrt(2.0 / a)
        layers.append({"w": w, "b": jnp.zeros((b,), jnp.float32)})
    return {"layers": layers}


def forward(
    params: dict, acts: dict, features: Sequence[str], cfg: ModelConfig, dropout_key=None
) -> jax.Array:
    """Logits [B] from activations `{feature: [B, dim]}` (jnp or numpy).

    `dropout_key` (training only) applies dropout to the hidden layers.
    """
    x = jnp.stack([jnp.asarray(acts[n]) for n in features], axis=1)  # [B, F, dim]
    f = x.shape[1]
    dots = jnp.einsum("bfd,bgd->bfg", x, x)
    iu, ju = np.triu_indices(f, k=1)
    z = jnp.concatenate([x.reshape(x.shape[0], -1), dots[:, iu, ju]], axis=1)
    layers = params["layers"]
    for i, layer in enumerate(layers[:-1]):
        z = jax.nn.relu(z @ layer["w"] + layer["b"])
        if dropout_key is not None and cfg.dropout > 0:
            keep = jax.random.bernoulli(
                jax.random.fold_in(dropout_key, i), 1 - cfg.dropout, z.shape
            )
            z = jnp.where(keep, z / (1 - cfg.dropout), 0.0)
    out = (z @ layers[-1]["w"] + layers[-1]["b"])[:, 0]
    if cfg.wide:
        out = out + sum(jnp.asarray(acts[n + BIAS_SUFFIX])[:, 0] for n in features)
    return out


def penalty(acts: dict, features: Sequence[str], cfg: ModelConfig) -> jax.Array:
    """Per-sample L2 penalty of the sample's embeddings, `cfg.l2 * sum ||e||^2`."""
    if cfg.l2 <= 0:
        return 0.0
    return cfg.l2 * sum(jnp.sum(jnp.square(acts[n]), axis=-1) for n in features)


def bce_with_logits(logits, labels):
    """Per-sample binary cross-entropy, numerically stable."""
    return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


# ---------------------------------------------------------------------------
# Metrics (numpy, exact)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties count one half)."""
    labels = np.asarray(labels, np.float64)
    scores = np.asarray(scores, np.float64)
    pos = labels.sum()
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(s.size, np.float64)
    # average rank of each run of tied scores
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    ends = np.concatenate([starts[1:], [s.size]])
    avg = (starts + ends + 1) / 2.0  # 1-based ranks starts+1 .. ends
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def log_loss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probs, np.float64), eps, 1 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
