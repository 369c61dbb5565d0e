"""bfloat16 tables on a TPU chip (issue #41): correctness and a rough step time.

Part 1, for Adagrad, Adam and FTRL, a 1000 x 64 table trained 4 steps
from tables every dtype represents, with small integer gradients, on the chip's first
device: the bfloat16 table (float32 slots, then bfloat16 slots) against the chip's
float32 run (the bound of tests/device/test_low_precision.py: 2 * steps * 2^-7 * max|w|), the
stacks' slot columns (a TPU keeps slots in its rows only where they are bfloat16), the
fraction of values equal to the CPU's bfloat16 run (the chip's float32 arithmetic rounds
apart from the CPU's: not expected equal), the plan's bytes against the arrays'.

Part 2: the jitted step (core lookup + update, no host work) of 8 tables x VOCAB (env,
default 1M) x 64, Adagrad, batch 4096, one Zipf(1.05) id a sample: float32, bfloat16 with
float32 slots, bfloat16 with bfloat16 slots; ms a step (mean of 20 after 4 warm-up steps)
and the bytes of state a device holds.

    python benchmarks/tpu_bf16.py        # JSON into $OUT/tpu_bf16.json (or .)
    VOCAB=1000 python benchmarks/tpu_bf16.py   # the plumbing, on CPU
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import embedmesh as em
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity

out = {}
tpu = jax.devices()[0]
cpu = jax.devices("cpu")[0]
print(tpu, cpu, flush=True)


def run(dev, dtype, slot_dtype, opt, steps=4):
    a = em.TableConfig(1000, 64, name="a", combiner="sum", dtype=dtype, slot_dtype=slot_dtype)
    feats = {"fa": em.FeatureConfig(a)}
    mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
    emb = MeshEmbedding(feats, opt, mesh=mesh, capacities=Capacity(256, 256), seed=5)
    r = np.random.default_rng(3)
    start = (r.integers(32, 256, (1000, 64)) / 128 * r.choice([-1, 1], (1000, 64))).astype(
        np.float32
    )
    emb.set_tables({a: start})
    for _ in range(steps):
        ids = r.integers(0, 1000, (64, 3))
        acts, pre = emb({"fa": ids})
        assert acts["fa"].dtype == jnp.float32
        g = r.integers(-3, 4, acts["fa"].shape).astype(np.float32)
        emb.apply_gradients({"fa": jnp.asarray(g)}, pre)
    v = {k: np.asarray(x) for k, x in emb.variables[a].items()}
    return v, emb


for name, opt in [
    ("Adagrad", em.Adagrad(0.125, initial_accumulator_value=0.5)),
    ("Adam", em.Adam(2.0**-5)),
    ("FTRL", em.FTRL(0.25, l1_regularization_strength=0.01)),
]:
    f32, _ = run(tpu, jnp.float32, None, opt)
    bf, emb_bf = run(tpu, jnp.bfloat16, None, opt)
    bfs, emb_bfs = run(tpu, jnp.bfloat16, jnp.bfloat16, opt)
    cpu_bfs, emb_cpu = run(cpu, jnp.bfloat16, jnp.bfloat16, opt)
    w = f32["parameters"]
    rec = {
        "err_bf16_vs_f32": float(np.abs(bf["parameters"].astype(np.float64) - w).max()),
        "bound": float(2 * 4 * 2**-7 * np.abs(w).max()),
        "err_bf16slots_vs_f32": float(np.abs(bfs["parameters"].astype(np.float64) - w).max()),
        "dtypes": {k: str(v.dtype) for k, v in bfs.items()},
        "slot_columns_f32slots": [s.slot_columns for s in emb_bf.plan.stacks],
        "slot_columns_bf16slots": [s.slot_columns for s in emb_bfs.plan.stacks],
        "tpu_vs_cpu_bf16slots_equal_fraction": {
            k: float(np.mean(bfs[k].astype(np.float32) == cpu_bfs[k].astype(np.float32)))
            for k in bfs
        },
        "bytes_measured_vs_plan": [
            emb_bfs.plan.measured_bytes_per_device,
            emb_bfs.plan.bytes_per_device,
        ],
    }
    out[name] = rec
    print(name, json.dumps(rec, default=str), flush=True)

# rough step time: 8 tables x 1M x 64, Adagrad, batch 4096, 1 id a sample, Zipf ids
V = int(os.environ.get("VOCAB", 1_000_000))


def timing(dtype, slot_dtype, steps=20):
    tables = [
        em.TableConfig(V, 64, name=f"t{i}", combiner="sum", dtype=dtype, slot_dtype=slot_dtype)
        for i in range(8)
    ]
    feats = {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tables)}
    emb = MeshEmbedding(
        feats, em.Adagrad(0.1), mesh=jax.sharding.Mesh(np.array([tpu]), ("x",)), seed=1
    )
    r = np.random.default_rng(0)
    batches = [{f"f{i}": (r.zipf(1.05, 4096) % V) for i in range(8)} for _ in range(4)]
    csrs = [emb.enqueue(b) for b in batches]
    core = emb.core

    def step(state, csr):
        acts = core.lookup(state, csr)
        g = {k: v * 0.01 for k, v in acts.items()}
        state, _ = core.apply_gradients(state, g, csr, check_finite=False)
        return state

    fn = jax.jit(step, donate_argnums=0)
    state = emb.core.init(jax.random.key(0))
    for c in csrs:
        state = fn(state, c)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):
        state = fn(state, csrs[i % 4])
    jax.block_until_ready(state)
    ms = (time.perf_counter() - t0) / steps * 1e3
    return ms, emb.plan.bytes_per_device[0]


try:
    for label, d, s in [
        ("f32", jnp.float32, None),
        ("bf16_f32slots", jnp.bfloat16, None),
        ("bf16_bf16slots", jnp.bfloat16, jnp.bfloat16),
    ]:
        ms, b = timing(d, s)
        out["time_" + label] = {"ms": ms, "bytes_per_device": b}
        print(label, ms, b, flush=True)
except Exception as e:
    import traceback

    traceback.print_exc()
    out["timing_error"] = repr(e)
json.dump(
    out, open(os.path.join(os.environ.get("OUT", "."), "tpu_bf16.json"), "w"), indent=1, default=str
)
