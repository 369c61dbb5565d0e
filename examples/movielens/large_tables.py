"""Large-table mode: the same training step on synthetic Zipf data, for throughput.

26 categorical features (Criteo-like), each with its own table of 1M rows
(26M rows in all), ids drawn from a Zipf(1.05) law, one id per feature per
sample, random labels. Reports training throughput in looked-up ids per
second over a few hundred steps; the labels carry no signal, so no accuracy
is claimed.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import optax

import embedmesh as em
from embedmesh.host.preprocess import preprocess_features
from examples.movielens import model as mdl
from examples.movielens import train as trn


class HashUniformInitializer:
    """Row-aware uniform(-scale, scale) values from a hash of (row, column).

    Cheap on the host (no random generator over 26M rows) and independent of
    the number of shards (`embedmesh.initializers` documents row-aware
    initialisers).
    """

    def __init__(self, scale: float, salt: int = 0):
        self.scale, self.salt = float(scale), int(salt)

    def rows(self, row_ids, dim: int, dtype) -> np.ndarray:
        r = np.asarray(row_ids, np.uint64).reshape(-1, 1)
        c = np.arange(dim, dtype=np.uint64).reshape(1, -1)
        salt = np.uint64((self.salt * 0x94D049BB133111EB + 1) % (1 << 64))
        h = r * np.uint64(0x9E3779B97F4A7C15) + c * np.uint64(0xBF58476D1CE4E5B9) + salt
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xD6E8FEB86659FD93)
        h ^= h >> np.uint64(32)
        u = (h >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))
        return ((u * 2 - 1) * self.scale).astype(dtype)

    def __call__(self, key, shape, dtype=np.float32):
        return self.rows(np.arange(shape[0]), int(np.prod(shape[1:])), dtype).reshape(shape)


def feature_config(num_features: int, rows: int, dim: int) -> dict:
    out = {}
    for i in range(num_features):
        name = f"C{i + 1}"
        table = em.TableConfig(
            rows, dim, combiner="sum", name=name, initializer=HashUniformInitializer(0.05, salt=i)
        )
        out[name] = em.FeatureConfig(table, name=name)
    return out


def zipf_batches(num_features: int, rows: int, batch: int, steps: int, seed: int, a: float):
    """(features, labels, mask) of Zipf ids; each feature's hot ids scattered over its table."""
    rng = np.random.default_rng(seed)
    mult = [int(p) for p in rng.choice([1000003, 999983, 1000033, 998347], num_features)]
    for _ in range(steps):
        z = rng.zipf(a, size=(num_features, batch)).astype(np.int64) - 1
        feats = {
            f"C{i + 1}": ((z[i] * mult[i]) % rows).astype(np.int32) for i in range(num_features)
        }
        labels = (rng.random(batch) < 0.25).astype(np.float32)
        yield feats, labels, np.ones(batch, np.float32)


def run(
    mesh,
    *,
    num_features: int = 26,
    rows: int = 1_000_000,
    dim: int = 16,
    batch: int = 4096,
    steps: int = 300,
    warmup: int = 10,
    seed: int = 0,
    zipf_a: float = 1.05,
    hidden: tuple = (256, 128),
) -> dict:
    names = [f"C{i + 1}" for i in range(num_features)]
    fc = feature_config(num_features, rows, dim)
    cfg = mdl.ModelConfig(dim=dim, hidden=tuple(hidden))
    print(
        f"large-table mode: {num_features} tables x {rows:,} rows x {dim} "
        f"({num_features * rows * dim * 4 / 2**30:.2f} GiB of float32 parameters + as much "
        f"Adagrad state) on {mesh.size} {mesh.devices.flat[0].platform} device(s); "
        f"Zipf({zipf_a}) ids, batch {batch}, {steps} timed steps",
        flush=True,
    )
    t0 = time.perf_counter()
    caps = trn.Trainer.measure_capacities(
        fc,
        mesh.size,
        zipf_batches(num_features, rows, batch, 4, seed + 1, zipf_a),
        cfg,
        headroom=1.3,
    )
    trainer = trn.Trainer(
        {},
        names,
        mesh,
        model_cfg=cfg,
        feature_config=fc,
        table_optimizer=em.Adagrad(learning_rate=0.01),
        dense_optimizer=optax.adam(1e-3),
        seed=seed,
        capacities=caps,
    )
    jax.block_until_ready(trainer.state)
    t_init = time.perf_counter() - t0
    print(f"  tables built in {t_init:.1f}s; capacities {caps}", flush=True)

    # Host preprocessing alone (one thread), for reference.
    sample = list(zipf_batches(num_features, rows, batch, 5, seed + 2, zipf_a))
    t1 = time.perf_counter()
    for b in sample:
        preprocess_features(
            b[0],
            None,
            trainer.emb.plan,
            num_devices_local=mesh.size,
            capacities=caps,
            overflow="grow",
        )
    pre_rate = len(sample) * batch * num_features / (time.perf_counter() - t1)

    t2 = time.perf_counter()
    trainer.train_epoch(
        zipf_batches(num_features, rows, batch, warmup, seed + 3, zipf_a),
        warmup,
        "  warm-up (compiles)",
    )
    t_compile = time.perf_counter() - t2
    res = trainer.train_epoch(
        zipf_batches(num_features, rows, batch, steps, seed + 4, zipf_a), steps, "  timed     "
    )
    out = {
        "tables": num_features,
        "rows": rows,
        "dim": dim,
        "batch": batch,
        "steps": steps,
        "devices": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "ids_per_s": res["ids_per_s"],
        "samples_per_s": res["samples_per_s"],
        "step_ms": 1000 * res["seconds"] / steps,
        "init_s": t_init,
        "warmup_s": t_compile,
        "preprocess_ids_per_s": pre_rate,
        "recompiles": trainer.recompiles,
    }
    print(
        f"  => {out['ids_per_s']:,.0f} ids/s ({out['samples_per_s']:,.0f} samples/s, "
        f"{out['step_ms']:.1f} ms/step) training end to end; host preprocessing alone "
        f"{pre_rate:,.0f} ids/s; build {t_init:.1f}s, warm-up {t_compile:.1f}s",
        flush=True,
    )
    return out
