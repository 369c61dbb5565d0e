"""Checkpoint the trained model, restore it for serving on one CPU device.

Saving: one orbax checkpoint (`embedmesh.checkpoint.save`) holding the
embedding state as saved from the training mesh, the dense parameters and a
small JSON item describing the model. Serving needs none of the training
objects: `load_for_serving` reads the tables' parameters only (no optimizer
slots, no mesh) with `embedmesh.checkpoint.load_tables`, restores the dense
parameters as numpy, and `ServingModel` runs `serving_embedding_lookup` on
numpy inputs followed by the same `forward` on a single CPU device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import embedmesh as em
from embedmesh import checkpoint as em_ckpt
from embedmesh import serving as em_serving
from examples.movielens import model as mdl

MODEL_ITEM = "model"
DENSE_ITEM = "dense"


def save(path: Path, trainer, vocab_sizes: dict, step: int) -> Path:
    """Save embedding state + dense parameters + model description as step `step`."""
    path = Path(path).resolve()
    meta = {
        "features": list(trainer.features),
        "vocab_sizes": dict(vocab_sizes),
        "model": dataclasses.asdict(trainer.model_cfg),
    }
    em_ckpt.core_save(  # the embedding item of the trainer's (core, state)
        path,
        trainer.core,
        trainer.state,
        step,
        others={DENSE_ITEM: trainer.dense_params(), MODEL_ITEM: ocp.args.JsonSave(meta)},
    )
    return path


class ServingModel:
    """Tables (numpy, host) + dense parameters; `predict(features)` -> probabilities."""

    def __init__(
        self,
        feature_config: dict,
        tables: dict,
        params: dict,
        features: Sequence[str],
        cfg: mdl.ModelConfig,
        device=None,
    ):
        self.feature_config = feature_config
        self.tables = tables
        self.features = tuple(features)
        self.cfg = cfg
        self.device = device or jax.devices("cpu")[0]
        self.params = jax.device_put(params, self.device)
        feats = self.features
        self._forward = jax.jit(lambda p, acts: jax.nn.sigmoid(mdl.forward(p, acts, feats, cfg)))

    def predict(self, features: dict) -> np.ndarray:
        inputs = mdl.expand_inputs(features, self.cfg)
        with jax.default_device(self.device):
            acts = em.serving_embedding_lookup(inputs, None, self.tables, self.feature_config)
            acts = jax.device_put(acts, self.device)
            return np.asarray(self._forward(self.params, acts))


def load_for_serving(path: Path, device=None, dtype=None) -> ServingModel:
    """Everything from the checkpoint on disk: no trainer, no mesh, no optimizer slots.
    `dtype`: the tables quantized for serving ("int8", "fp16", "bf16"; None: float32)."""
    path = Path(path).resolve()
    mngr = ocp.CheckpointManager(path)
    try:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {path}")
        meta = mngr.restore(step, args=ocp.args.Composite(**{MODEL_ITEM: ocp.args.JsonRestore()}))[
            MODEL_ITEM
        ]
        cfg_dict = dict(meta["model"])
        cfg_dict["hidden"] = tuple(cfg_dict["hidden"])
        cfg = mdl.ModelConfig(**cfg_dict)
        features = tuple(meta["features"])
        shapes = jax.eval_shape(lambda: mdl.init_dense(jax.random.key(0), len(features), cfg))
        target = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)
        params = mngr.restore(
            step, args=ocp.args.Composite(**{DENSE_ITEM: ocp.args.StandardRestore(target)})
        )[DENSE_ITEM]
    finally:
        mngr.close()
    feature_config = mdl.feature_config(meta["vocab_sizes"], features, cfg)
    tables = em_serving.load_tables(path, step, feature_config=feature_config, dtype=dtype)
    params = jax.tree_util.tree_map(np.asarray, params)
    return ServingModel(feature_config, tables, params, features, cfg, device=device)


def describe(path: Path) -> str:
    meta = em_ckpt.read_metadata(Path(path).resolve())
    rows = sum(t["vocabulary_size"] for t in meta["tables"])
    return (
        f"{len(meta['tables'])} tables, {rows:,} rows, saved from {meta['num_shards']} "
        f"shards at step {meta['step']}"
    )
