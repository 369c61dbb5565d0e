"""Serving a trained model: the TensorFlow SavedModel (`export_saved_model`, run by TF)
against embedmesh's own export (`export_serving` + `load_serving`), same requests.

Workload: 8 features, each on its own table of `--vocab` x `--dim` float32 (default
100k x 64: the SavedModel writes every table into its variables file, so serving.py's
1M-row tables would be 2 GB on disk here); ragged inputs, Poisson(10) ids per sample,
ids Zipf(1.05) over the ranks through a random permutation per table, mean combiner;
the model a small MLP (the 8 activations concatenated, `--hidden` ReLU units, one
logit). Batches of `--batch` samples.

Contenders, same process, same batches:
- saved_model: `tf.saved_model.load(dir).signatures["serving_default"]` called with
  the batch's `tf.RaggedTensor` components as tf tensors (built before timing); TF's
  `serving_embedding_lookup` then the jax2tf-converted MLP;
- load_serving: `load_serving(dir)` called with `embedmesh.RaggedTensor` numpy inputs
  (its bucket equals the batch: no padding), the lookup and the MLP in one jax.export
  program.

Each round: the two take turns (order shuffled), each `--reps` passes over the batches,
its median seconds per call taken; the ratio saved_model / load_serving is taken
within the round; medians over `--rounds` rounds are printed (with the CPU model).
Outputs are compared (allclose) first.

Needs TensorFlow and jax in one environment (the `embedmesh[tf]` extra). Run from the
repository root:

    PYTHONPATH=. .venv-flax/bin/python benchmarks/serving/serving_saved_model.py

or as the last part of `benchmarks/serving/serving.py --saved-model` (with its `--rounds`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp

import embedmesh as em
from embedmesh.serving import Ragged, export_serving, load_serving
from embedmesh.serving.saved_model import export_saved_model

NUM_FEATURES = 8


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "")
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "other")
    return (
        f"{fields.get('Model name', '?').strip()} ({isa}, {fields.get('CPU(s)', '?').strip()} CPUs)"
    )


def zipf_ids(rng, vocab, n, perm):
    ranks = rng.zipf(1.05, n)
    ranks = ranks[ranks <= vocab][:n]
    while ranks.size < n:
        more = rng.zipf(1.05, n)
        ranks = np.concatenate([ranks, more[more <= vocab]])[:n]
    return perm[ranks - 1].astype(np.int32)


def make_batches(rng, args) -> list:
    """`args.batches` requests: per feature, ragged Poisson(10) Zipf ids."""
    perms = [rng.permutation(args.vocab) for _ in range(NUM_FEATURES)]
    batches = []
    for _ in range(args.batches):
        batch = {}
        for i in range(NUM_FEATURES):
            lengths = rng.poisson(10, args.batch)
            ids = zipf_ids(rng, args.vocab, int(lengths.sum()), perms[i])
            batch[f"f{i}"] = em.RaggedTensor.from_row_lengths(ids, lengths)
        batches.append(batch)
    return batches


def time_rounds(contenders: dict, num_batches: int, args) -> tuple[dict, list]:
    """`args.rounds` rounds, the contenders in a shuffled order, each `args.reps` passes
    over the batches: per contender its median seconds a call each round, and per round
    the ratio saved_model / load_serving."""
    per_round = {k: [] for k in contenders}
    ratios = []
    order = list(contenders)
    rnd = random.Random(args.seed)
    for _ in range(args.rounds):
        rnd.shuffle(order)
        med = {}
        for name in order:
            fn = contenders[name]
            ts = []
            for _ in range(args.reps):
                for i in range(num_batches):
                    t0 = time.perf_counter()
                    fn(i)
                    ts.append(time.perf_counter() - t0)
            med[name] = statistics.median(ts)
            per_round[name].append(med[name])
        ratios.append(med["saved_model"] / med["load_serving"])
    return per_round, ratios


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import tensorflow as tf

    rng = np.random.default_rng(args.seed)
    tables_cfg = [
        em.TableConfig(args.vocab, args.dim, combiner="mean", name=f"t{i}")
        for i in range(NUM_FEATURES)
    ]
    feats = {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tables_cfg)}
    tables = {
        t: (rng.standard_normal((args.vocab, args.dim), np.float32) * 0.1) for t in tables_cfg
    }
    params = {
        "w1": rng.standard_normal((NUM_FEATURES * args.dim, args.hidden), np.float32) * 0.05,
        "b1": np.zeros(args.hidden, np.float32),
        "w2": rng.standard_normal((args.hidden, 1), np.float32) * 0.05,
    }

    def model(p, acts):
        x = jnp.concatenate([acts[f"f{i}"] for i in range(NUM_FEATURES)], axis=-1)
        return {"score": (jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"])[:, 0]}

    def serve(inputs, tables, p):
        return model(p, em.serving_embedding_lookup(inputs, None, tables, feats))

    batches = make_batches(rng, args)
    nnz = max(int(np.diff(b[f].row_splits).max()) for b in batches for f in b)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        names = export_saved_model(
            model,
            os.path.join(tmp, "sm"),
            tables=tables,
            params=params,
            feature_config=feats,
            input_signature={f: Ragged(nnz) for f in feats},
        )
        t_sm = time.perf_counter() - t0
        t0 = time.perf_counter()
        sig = {
            f: Ragged(int(np.ceil(max(len(b[f].values) for b in batches) / args.batch)))
            for f in feats
        }
        export_serving(
            serve,
            os.path.join(tmp, "ex"),
            tables=tables,
            params=params,
            input_signature=sig,
            batch_sizes=(args.batch,),
        )
        t_ex = time.perf_counter() - t0
        served = tf.saved_model.load(os.path.join(tmp, "sm")).signatures["serving_default"]
        server = load_serving(os.path.join(tmp, "ex"))

        tf_inputs = []
        for b in batches:
            d = {}
            for f in feats:
                d[names[f]["values"]] = tf.constant(np.asarray(b[f].values, np.int32))
                d[names[f]["row_splits"]] = tf.constant(np.asarray(b[f].row_splits, np.int64))
            tf_inputs.append(d)

        def call_tf(i):
            return served(**tf_inputs[i])["score"].numpy()

        def call_em(i):
            return np.asarray(server(batches[i])["score"])

        diffs = [float(np.max(np.abs(call_tf(i) - call_em(i)))) for i in range(len(batches))]
        for i in range(len(batches)):
            np.testing.assert_allclose(call_tf(i), call_em(i), rtol=1e-4, atol=1e-5)

        contenders = {"saved_model": call_tf, "load_serving": call_em}
        for fn in contenders.values():  # warm-up
            for i in range(len(batches)):
                fn(i)
        per_round, ratios = time_rounds(contenders, len(batches), args)

    print(f"CPU: {cpu_model()}")
    print(f"tensorflow {tf.__version__}, jax {jax.__version__}, embedmesh {em.__version__}")
    print(
        f"workload: {NUM_FEATURES} x {args.vocab} x {args.dim} tables, batch {args.batch}, "
        f"Poisson(10) ragged ids, mean; MLP {NUM_FEATURES * args.dim}-{args.hidden}-1"
    )
    print(f"export: SavedModel {t_sm:.1f} s, export_serving {t_ex:.1f} s")
    print(f"max |saved_model - load_serving| = {max(diffs):.2e}")
    for name, ts in per_round.items():
        print(
            f"{name:>13}: median {statistics.median(ts) * 1e3:.2f} ms/call "
            f"(rounds: {' '.join(f'{t * 1e3:.2f}' for t in ts)})"
        )
    print(
        f"saved_model / load_serving time: median {statistics.median(ratios):.2f}x "
        f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
