"""A DLRM trained, evaluated, checkpointed, resumed and served by TF Serving.

The model of the Criteo benchmarks, in embedmesh's terms, from the docs alone:

- 26 categorical features, one table each (MLPerf DLRM-DCNv2's cardinalities, scaled to
  this machine), 13 dense float features, a flax nnx model (bottom MLP, dot interaction,
  top MLP), the tables sharded over every device;
- feature 0 has unbounded raw 64-bit ids (a table with an `id_map`: a dynamic vocabulary),
  feature 2's table is stored in bfloat16;
- training epochs with an evaluation pass between them (nnx's `model.eval()`): lookups
  that change nothing (no id admitted or evicted, no optimizer state touched; an unseen
  raw id reads a zero row, as serving reads it);
- a checkpoint per epoch (the embedding beside the dense parameters and their optax
  state, one orbax checkpoint), resumed where it stopped when run again;
- a TensorFlow SavedModel of the whole model (tables, the dense towers and the dense
  features in its signature), loaded by a process that imports TensorFlow alone, whose
  scores equal the evaluation's.

Run:  python examples/dlrm.py [--quick] [WORKDIR]    (again on the same WORKDIR: it resumes)
      [--no-serve] skips the SavedModel; [--summary FILE] writes the run's figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import embedmesh as em
from embedmesh import checkpoint as em_ckpt
from embedmesh.flax.nnx import Embed
from embedmesh.serving import Dense

# MLPerf DLRM-DCNv2's cardinalities (40M cap), scaled below to the run's size
# fmt: off
CARDINALITIES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
# fmt: on
DENSE = 13
RAW_ID_FEATURE, BF16_FEATURE = 0, 2
NAMES = tuple(f"c{i}" for i in range(len(CARDINALITIES)))


def feature_config(max_rows: int, dim: int) -> dict:
    """One table a feature. Feature 0's ids are raw (any int64): its table keeps
    `max_rows` of them at once (`vocabulary_size` is then its capacity); feature 2's
    table is stored in bfloat16."""
    features = {}
    for i, (name, rows) in enumerate(zip(NAMES, CARDINALITIES)):
        options = {}
        if i == RAW_ID_FEATURE:
            options["id_map"] = em.DynamicIds(eviction="lru")
        if i == BF16_FEATURE:
            options["dtype"] = jnp.bfloat16
        table = em.TableConfig(min(rows, max_rows), dim, combiner="sum", name=f"t{i}", **options)
        features[name] = em.FeatureConfig(table)
    return features


class Towers(nnx.Module):
    """Everything but the embedding: bottom MLP on the dense features, the pairwise dot
    products of the 27 vectors, top MLP to one logit. `x` is `{feature: activation,
    "dense": [batch, 13]}` (the SavedModel's signature hands the same structure)."""

    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.bottom1 = nnx.Linear(DENSE, 64, rngs=rngs)
        self.bottom2 = nnx.Linear(64, dim, rngs=rngs)
        n = len(NAMES) + 1
        self.top1 = nnx.Linear(dim + n * (n - 1) // 2, 64, rngs=rngs)
        self.top2 = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x: dict) -> jax.Array:
        d = nnx.relu(self.bottom2(nnx.relu(self.bottom1(jnp.log1p(x["dense"])))))
        vectors = jnp.stack([d] + [x[name] for name in NAMES], axis=1)  # [batch, 27, dim]
        dots = jnp.einsum("bnd,bmd->bnm", vectors, vectors)
        upper = np.triu_indices(vectors.shape[1], k=1)
        h = jnp.concatenate([d, dots[:, upper[0], upper[1]]], axis=-1)
        return self.top2(nnx.relu(self.top1(h)))[:, 0]


class DLRM(nnx.Module):
    def __init__(self, features: dict, dim: int, rngs: nnx.Rngs):
        self.embed = Embed(em.MeshEmbedding(features, em.Adagrad(0.05)))
        self.towers = Towers(dim, rngs)


def synthetic_batch(seed: int, batch: int, features: dict):
    """Skewed categorical ids, log-normal dense features, and a click drawn from a rule
    the model can learn. Feature 0 draws raw ids from a huge id space, new ones all the
    time."""
    rng = np.random.default_rng(seed)
    cats = {}
    for i, name in enumerate(NAMES):
        rows = features[name].table.vocabulary_size
        ids = (rng.zipf(1.2, batch) - 1) % rows
        if i == RAW_ID_FEATURE:  # raw ids: 64-bit hashes, many never seen again
            mixed = rng.zipf(1.2, batch).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            ids = mixed.view(np.int64)  # wraps around: any int64, negative ones too
        cats[name] = ids.astype(np.int64)
    dense = rng.lognormal(0.0, 1.0, (batch, DENSE)).astype(np.float32)
    logit = (cats["c1"] % 5 - 2.0) * 0.6 + np.log1p(dense[:, 0]) - 1.0
    labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return cats, dense, labels


@nnx.jit(donate_argnums=0)
def train_step(model: DLRM, optimizer: nnx.Optimizer, csr, dense, labels):
    csr = model.embed.map_ids(csr)  # raw ids to rows: admits new ids, may evict
    acts = model.embed(csr)

    def loss_fn(towers, acts):
        logits = towers({**acts, "dense": dense})
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    loss, (g_towers, g_acts) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model.towers, acts)
    optimizer.update(model.towers, g_towers)
    model.embed.apply_gradients(g_acts, csr)
    return loss


@nnx.jit
def eval_scores(model: DLRM, csr, dense):
    """Scores with the model in evaluation mode: raw ids read as they are (no `map_ids`:
    nothing admitted or evicted, an unseen id a zero row), nothing of the model changes."""
    acts = model.embed(csr)
    return jax.nn.sigmoid(model.towers({**acts, "dense": dense}))


def evaluate(model: DLRM, batches) -> tuple[float, np.ndarray]:
    """Log loss over `batches`, and the scores of the first batch."""
    losses, first = [], None
    model.eval()  # nnx's switch: the embedding's lookups in evaluation mode
    for cats, dense, labels in batches:
        csr = model.embed.enqueue(cats)  # marked for evaluation: the module's mode
        p = np.clip(np.asarray(eval_scores(model, csr, jnp.asarray(dense))), 1e-7, 1 - 1e-7)
        losses.append(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
        first = p if first is None else first
    model.train()
    return float(np.mean(losses)), first


def place_dense(model: DLRM, optimizer: nnx.Optimizer) -> None:
    """The towers and their optax state replicated over the embedding's mesh, up front
    and after a restore: the first step's program is then every later step's (no second
    compile when the outputs come back placed there), and restored arrays join the mesh."""
    replicated = NamedSharding(model.embed.core.mesh, PartitionSpec())
    for part in (model.towers, optimizer):
        nnx.update(part, jax.device_put(nnx.state(part), replicated))


def live_raw_ids(model: DLRM) -> set:
    """The raw ids feature 0's table holds now."""
    return set(model.embed.core.read_dynamic(model.embed.state, f"t{RAW_ID_FEATURE}"))


def dense_args(model: DLRM, optimizer: nnx.Optimizer, restore: bool):
    """The orbax items of the dense part: the towers' parameters and their optax state."""
    item = ocp.args.StandardRestore if restore else ocp.args.StandardSave
    return {
        "towers": item(nnx.state(model.towers, nnx.Param)),
        "optimizer": item(nnx.state(optimizer, nnx.OptState)),
    }


def run(workdir: str, quick: bool, serve: bool = True) -> dict:
    max_rows, dim, batch = (512, 8, 64) if quick else (100_000, 32, 2048)
    epochs, steps, eval_batches = (2, 3, 2) if quick else (3, 50, 8)
    features = feature_config(max_rows, dim)
    model = DLRM(features, dim, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model.towers, optax.adam(1e-3), wrt=nnx.Param)
    place_dense(model, optimizer)
    held_out = [synthetic_batch(10_000 + i, batch, features) for i in range(eval_batches)]

    mngr = ocp.CheckpointManager(os.path.join(workdir, "ckpt"))
    start = 0
    if mngr.latest_step() is not None:  # resume: the checkpoint's own step is the epoch
        start = mngr.latest_step()
        updates = model.embed.restore(mngr, start)  # the embedding's update count
        dense = mngr.restore(
            start, args=ocp.args.Composite(**dense_args(model, optimizer, restore=True))
        )
        nnx.update(model.towers, dense["towers"])
        nnx.update(optimizer, dense["optimizer"])
        place_dense(model, optimizer)
        print(f"resumed after epoch {start} ({updates} embedding updates)")
    for epoch in range(start, start + epochs):
        for step in range(steps):
            cats, dense, labels = synthetic_batch(epoch * steps + step, batch, features)
            csr = model.embed.enqueue(cats)
            loss = train_step(model, optimizer, csr, jnp.asarray(dense), jnp.asarray(labels))
        live = live_raw_ids(model)
        eval_loss, scores = evaluate(model, held_out)
        assert live_raw_ids(model) == live  # evaluation admitted and evicted nothing
        print(
            f"epoch {epoch + 1}: train loss {float(loss):.4f}, eval log loss {eval_loss:.4f}, "
            f"raw ids held {len(live)}"
        )
        mngr.save(
            epoch + 1,
            args=ocp.args.Composite(
                embedding=model.embed.save_args(), **dense_args(model, optimizer, restore=False)
            ),
        )
    mngr.wait_until_finished()
    mngr.close()
    if not serve:
        return {"eval_loss": eval_loss, "scores": scores, "served": None}
    served = serve_through_tensorflow(workdir, features, model, held_out[0])
    np.testing.assert_allclose(served, scores, rtol=2e-5, atol=2e-6)
    print(f"TF Serving's SavedModel, in a TensorFlow-only process: {len(served)} scores equal")
    return {"eval_loss": eval_loss, "scores": scores, "served": served}


TF_ONLY = """
import sys, numpy as np, tensorflow as tf
served = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
inputs = dict(np.load(sys.argv[2]))
specs = served.structured_input_signature[1]  # each input's dtype (ids: int32 or int64)
out = served(**{k: tf.constant(v, specs[k].dtype) for k, v in inputs.items()})
np.save(sys.argv[3], tf.sigmoid(out["output_0"]).numpy())
"""


def serve_through_tensorflow(workdir: str, features: dict, model: DLRM, batch) -> np.ndarray:
    """Export the whole model from the last checkpoint (the tables read from it, the dense
    towers from memory) as a SavedModel; score `batch` with it in a process that imports
    TensorFlow and numpy only."""
    from embedmesh.serving.saved_model import export_saved_model

    tables = em_ckpt.load_tables(os.path.join(workdir, "ckpt"), feature_config=features)
    graphdef, params = nnx.split(model.towers, nnx.Param)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(params))

    def whole_model(params, x):
        towers = nnx.merge(graphdef, nnx.State(params))
        return towers(x)

    export_dir = os.path.join(workdir, "saved_model")
    signature = {name: Dense() for name in NAMES}  # int32 ids
    signature[NAMES[RAW_ID_FEATURE]] = Dense(dtype=np.int64)  # raw ids: 64 bits
    signature["dense"] = Dense((DENSE,), np.float32)  # the dense features beside them
    export_saved_model(
        whole_model,
        export_dir,
        tables=tables,
        params=params,
        feature_config=features,
        input_signature=signature,
    )
    cats, dense, _ = batch
    inputs = os.path.join(workdir, "request.npz")
    np.savez(inputs, dense=dense, **cats)
    out = os.path.join(workdir, "served.npy")
    subprocess.run([sys.executable, "-c", TF_ONLY, export_dir, inputs, out], check=True)
    return np.load(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", nargs="?", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a minute on a CPU)")
    parser.add_argument(
        "--no-serve", action="store_true", help="train and checkpoint only: no SavedModel"
    )
    parser.add_argument(
        "--summary",
        help="write the last evaluation's log loss and scores (and the served "
        "scores) to this JSON file",
    )
    args = parser.parse_args(argv)
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="embedmesh_dlrm_"))
    result = run(workdir, args.quick, serve=not args.no_serve)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(
                {k: None if v is None else np.asarray(v).tolist() for k, v in result.items()}, f
            )


if __name__ == "__main__":
    main()
