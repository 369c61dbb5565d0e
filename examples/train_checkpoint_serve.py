"""Train -> checkpoint -> serve: the seed's TPUEmbedding serving flow in embedmesh's terms.

1. train an embedding (MeshEmbedding, Adagrad) and a small dense model (optax) together,
   checkpointing both into one orbax checkpoint (async), resuming if one exists;
2. restore the trained tables for serving (host only: no mesh, no optimizer slots) and
   export a serving function: `serving_embedding_lookup` on the tables, then the model;
3. load the export in a fresh process that imports only embedmesh and numpy, and serve.

Run: python examples/train_checkpoint_serve.py [WORKDIR]   (run it twice: it resumes)
"""

import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import embedmesh as em
from embedmesh import checkpoint as em_ckpt
from embedmesh.facade import MeshEmbedding
from embedmesh.serving.export import Dense, Ragged, export_serving, load_serving

video = em.TableConfig(10_000, 16, combiner="mean", name="video")
user = em.TableConfig(1_000, 8, combiner="sum", name="user")
feature_config = {"watched": em.FeatureConfig(video), "user": em.FeatureConfig(user)}
BATCH = 64


def model(params, acts):
    x = jnp.concatenate([acts["watched"], acts["user"]], axis=-1)
    return (jax.nn.relu(x @ params["w1"]) @ params["w2"])[:, 0]


def batch(step):
    rng = np.random.default_rng(step)
    lengths = rng.integers(1, 6, BATCH)
    watched = em.RaggedTensor.from_row_lengths(rng.zipf(1.3, lengths.sum()) % 10_000, lengths)
    users = rng.integers(0, 1_000, BATCH)
    labels = (users % 7) / 7.0 + (watched.values[watched.row_splits[:-1]] % 3) / 3.0
    return {"watched": watched, "user": users}, labels.astype(np.float32)


optimizer = optax.adam(1e-2)


@jax.jit
def dense_step(params, opt_state, acts, labels):
    def loss_fn(params, acts):
        return jnp.mean((model(params, acts) - labels) ** 2)

    loss, (g_params, g_acts) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, acts)
    updates, opt_state = optimizer.update(g_params, opt_state)
    return optax.apply_updates(params, updates), opt_state, g_acts, loss


def resume(emb, mngr, params, opt_state):
    """The latest checkpoint of `mngr` restored: `(its step, the embedding's update count,
    params, opt_state)`. Two numbers, kept apart: the checkpoint's step is the one it was
    saved under (`mngr.save(step, ...)`: this loop's own counter), and both the
    embedding and the dense model are restored from that step; `restore` returns the
    embedding's update count (how many `apply_gradients` it has taken), which equals the
    step only when every step saved is numbered by its updates."""
    step = mngr.latest_step()
    updates = em_ckpt.restore(emb, mngr, step)
    host = lambda tree: jax.tree.map(np.asarray, tree)
    dense = mngr.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(host(params)),
            opt_state=ocp.args.StandardRestore(host(opt_state)),
        ),
    )
    return step, updates, dense["params"], dense["opt_state"]


def train(ckpt_dir, steps=40, every=20):
    emb = MeshEmbedding(feature_config, em.Adagrad(0.1))  # all devices, one mesh axis
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(keys[0], (24, 32)) * 0.1,
        "w2": jax.random.normal(keys[1], (32, 1)) * 0.1,
    }
    opt_state = optimizer.init(params)
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if mngr.latest_step() is not None:  # resume: the embedding on this mesh, whatever it was
        start, updates, params, opt_state = resume(emb, mngr, params, opt_state)
        print(f"resumed from checkpoint step {start} ({updates} embedding updates)")
    for step in range(start, start + steps):
        features, labels = batch(step)
        acts, preserved = emb(features)
        params, opt_state, g_acts, loss = dense_step(params, opt_state, acts, labels)
        emb.apply_gradients(g_acts, preserved)
        if (step + 1) % every == 0:  # async: training goes on while it is written
            mngr.save(
                step + 1,
                args=ocp.args.Composite(
                    embedding=em_ckpt.save_args(emb),
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                ),
            )
            print(f"step {step + 1}: loss {float(loss):.4f}, checkpoint started")
    mngr.wait_until_finished()
    mngr.close()
    return params


def export(ckpt_dir, export_dir):
    # The serving side needs no mesh and never reads the optimizer slots.
    tables = em_ckpt.load_tables(ckpt_dir, feature_config=feature_config)
    mngr = ocp.CheckpointManager(ckpt_dir)
    params = mngr.restore(
        mngr.latest_step(),
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(
                {"w1": np.zeros((24, 32), np.float32), "w2": np.zeros((32, 1), np.float32)}
            )
        ),
    )["params"]
    mngr.close()

    def serve(features, tables, params):  # the seed's serve_tensors
        acts = em.serving_embedding_lookup(features, None, tables, feature_config)
        return {"score": model(params, acts)}

    export_serving(
        serve,
        export_dir,
        tables=tables,
        params=params,
        feature_config=feature_config,
        input_signature={"watched": Ragged(nnz_per_example=8), "user": Dense()},
        batch_sizes=(1, 8, 64),
    )
    return serve, tables, params


SERVER = """
import sys, numpy as np, embedmesh
from embedmesh.serving.export import load_serving
serve = load_serving(sys.argv[1])
watched = embedmesh.RaggedTensor.from_row_lengths(np.array([5, 17, 17, 3]), [3, 1])
print(serve({"watched": watched, "user": np.array([12, 400])})["score"].tolist())
"""


def main():
    workdir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="embedmesh_")
    ckpt_dir, export_dir = os.path.join(workdir, "ckpt"), os.path.join(workdir, "export")
    train(ckpt_dir)
    serve, tables, params = export(ckpt_dir, export_dir)
    out = subprocess.run(
        [sys.executable, "-c", SERVER, export_dir], check=True, capture_output=True, text=True
    ).stdout
    print("served by a fresh process:", out.strip())
    watched = em.RaggedTensor.from_row_lengths(np.array([5, 17, 17, 3]), [3, 1])
    local = load_serving(export_dir)({"watched": watched, "user": np.array([12, 400])})
    direct = serve({"watched": watched, "user": np.array([12, 400])}, tables, params)
    print(
        "same scores in this process:",
        local["score"].tolist(),
        "| without export:",
        np.asarray(direct["score"]).round(6).tolist(),
    )


if __name__ == "__main__":
    main()
