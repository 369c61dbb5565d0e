"""Probe: XLA's TPU gather of part of each row (the first 128 lanes of 256/512-lane rows)
against a whole-row gather then a slice, 117k distinct ids of a 1M-row table, one process.
(Slots in rows, issue #38: the lookup reads only the parameters' vregs.)"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.device.ops import tpu


def timed(fn, n=10):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main(out):
    r = np.random.default_rng(0)
    ids = jnp.asarray(np.sort(r.choice(1_000_000, 117_295, replace=False)).astype(np.int32))
    res = {}
    for width in (256, 512):
        table = jnp.ones((1_000_000 if width == 256 else 500_000, width), jnp.float32)
        idw = jnp.minimum(ids, table.shape[0] - 1)
        part = jax.jit(lambda t, i: tpu.gather_columns(t, i, 128))
        full = jax.jit(lambda t, i: jax.lax.optimization_barrier(jnp.take(t, i, axis=0))[:, :128])
        whole = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
        for name, f in (("partial", part), ("whole_then_slice", full), ("whole", whole)):
            s = timed(lambda f=f, t=table, i=idw: jax.block_until_ready(f(t, i)))
            res[f"w{width}/{name}_ms"] = s * 1e3
            print(width, name, f"{s * 1e3:.2f} ms", flush=True)
        del table
    with open(os.path.join(out, "gather_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
