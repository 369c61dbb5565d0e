"""The id map's `map_ids` as one program on whatever JAX's default device is (on a TPU the
jnp path; on CPU with its kernels the native op), at train_step.py's per-table scale
(issue 42): capacity 1M, 360,448 live random ids, calls of 16,384 slots holding 14,700
distinct ids (`distinct=True`, as the engine calls it): all hits, then 1,600 of them
new; and `lookup` of 16,384 live ids. ms a call, medians of 10 after 2.

Made to compare two checkouts' layouts on the lent TPU chip (session 2026-12-06 xiii:
`runs/id_map_chip_2026-12-06_xiii.txt`), each in its own process:

    PYTHONPATH=<checkout>:$PYTHONPATH python3 benchmarks/id_map_chip.py TAG
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.device import id_map as im

CAPACITY, LIVE, SLOTS, DISTINCT, NEW = 1_000_000, 360_448, 16_384, 14_700, 1_600


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def main(tag: str) -> None:
    print(tag, jax.devices(), im.__file__, flush=True)
    cfg = im.IdMapConfig(capacity=CAPACITY, eviction="lru", seed=3)

    def step(state, pairs, valid, t):
        return im.map_ids(state, pairs, valid, t, distinct=True)

    fn = jax.jit(step, donate_argnums=0)
    state = im.init(cfg)
    rng = np.random.default_rng(0)
    live = rng.integers(-(2**63), 2**63 - 1, LIVE, dtype=np.int64)
    ones = jnp.ones(SLOTS, bool)
    for k in range(0, live.size, SLOTS):
        pairs = jnp.asarray(im.split_ids(live[k : k + SLOTS]))
        state, rows, fresh, stats = fn(state, pairs, ones, jnp.int32(k // SLOTS))
    print(tag, "filled", {k: int(v) for k, v in stats.items()}, flush=True)
    out = {}
    for what, new in (("hits", 0), (f"hits+{NEW} new", NEW)):
        times = []
        for r in range(12):
            ids = np.zeros(SLOTS, np.int64)
            fresh_ids = rng.integers(-(2**63), 2**63 - 1, new, dtype=np.int64)
            ids[:DISTINCT] = np.r_[rng.choice(live, DISTINCT - new, replace=False), fresh_ids]
            pairs = jnp.asarray(im.split_ids(ids))
            valid = jnp.asarray(np.arange(SLOTS) < DISTINCT)
            jax.block_until_ready((pairs, valid))
            t0 = time.perf_counter()
            state, rows, fresh, stats = fn(state, pairs, valid, jnp.int32(100 + r))
            rows.block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
            live = np.r_[live, fresh_ids]
        out[what] = float(np.median(times[2:]))
        counts = {k: int(v) for k, v in stats.items()}
        print(tag, what, f"{out[what]:.2f} ms a call (median of 10)", counts, flush=True)
    lookup = jax.jit(im.lookup)
    pairs = jnp.asarray(im.split_ids(rng.choice(live, SLOTS)))
    timed(lookup, state, pairs)
    out["lookup"] = float(np.median([timed(lookup, state, pairs) for _ in range(10)]))
    print(tag, "lookup", f"{out['lookup']:.2f} ms", flush=True)
    print("RESULT", json.dumps({tag: out}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this")
