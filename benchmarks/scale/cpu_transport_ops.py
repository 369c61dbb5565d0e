# ruff: noqa: E402  (the XLA flags and the process binding are set before jax loads)
"""Micro-benchmark of the cross-device ops on 2 CPU devices (this tree's embedmesh, from
PYTHONPATH): in one process (`inproc`) or two processes of one host (`host`, jax.distributed
over 127.0.0.1, shared-memory transport), each op jitted alone in shard_map, REPS calls
timed: min and median in ms (host: each process prints its own).

    PYTHONPATH=. python benchmarks/scale/cpu_transport_ops.py inproc REPS
    PYTHONPATH=. python benchmarks/scale/cpu_transport_ops.py host REPS PROC PORT  # PROC 0 and 1
    ONLY=exchange,lookup_from_shards ...   # only these ops

An A/B of two trees runs each tree's copy in turn (ABBA) and compares the RES lines
(benchmarks/scale/RESULTS.md, "the cross-device ops one at a time").
"""

import os
import sys
import time

MODE = sys.argv[1]
REPS = int(sys.argv[2])
PROC = int(sys.argv[3]) if MODE in ("host", "fakehost") else 0
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 if MODE == 'inproc' else 1}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax

if MODE == "host":
    usable = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {usable[PROC % len(usable)]})
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{sys.argv[4]}", num_processes=2, process_id=PROC
    )
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import embedmesh
from embedmesh.device import ops, peers
from embedmesh.optimizers import Adagrad

N, ROWS, D, U, PP, R, W = 2, 400_000, 64, 40_000, 160_000, 40_960, 8192
mesh = Mesh(np.array(jax.devices()), ("x",))
if MODE == "host":
    job = peers.same_host_job(mesh)
    assert job
    T = ops.Transport("x", N, host_job=job, channel="b")
elif MODE == "fakehost":  # no jax.distributed (no sockets): one device a process, its rank faked
    jax.lax.axis_index = lambda name: jnp.int32(PROC)
    T = ops.Transport("x", N, host_job=int(sys.argv[4]), channel="b")
else:
    T = ops.Transport("x", N, in_process=True, channel="b")
rng = np.random.default_rng(0)
spec = P("x")
sharding = NamedSharding(mesh, spec)


def put(a):
    a = np.asarray(a)
    if MODE == "fakehost":  # this process's block of the global array
        b = a.shape[0] // N
        return jnp.asarray(a[PROC * b : (PROC + 1) * b])
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def sm(fn, in_specs, out_specs, name, donate=()):
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False),
        donate_argnums=donate,
    )


def time_update(name, f, t, a, *args):
    """An update with its table and slot donated: each call takes the last one's."""
    if ONLY and name not in ONLY.split(","):
        return t, a
    ts = []
    for i in range(REPS + 2):
        start = time.perf_counter()
        t, s = f(t, a, *args)
        a = s["accumulators"]
        jax.block_until_ready((t, a))
        if i >= 2:
            ts.append(time.perf_counter() - start)
    print(f"RES {name} min {min(ts) * 1e3:.3f} med {np.median(ts) * 1e3:.3f}", flush=True)
    return t, a


ONLY = os.environ.get("ONLY", "")


def timeit(name, f, *args):
    if ONLY and name not in ONLY.split(","):
        return
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(REPS):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    print(f"RES {name} min {min(ts) * 1e3:.3f} med {np.median(ts) * 1e3:.3f}", flush=True)


def T_at(c):
    return T.on(c)


table = put(rng.standard_normal((N * ROWS, D)).astype(np.float32))
acc = put(np.full((N * ROWS, D), 0.1, np.float32))
ids = np.full((N * N, U), ops.PAD_ID, np.int32)
for i in range(N * N):
    u = np.unique(rng.integers(0, ROWS, int(U * 1.3)))[:U]
    ids[i, : len(u)] = u
ids = put(ids)
pu = put(np.sort(rng.integers(0, U, (N * N, PP)), axis=1).astype(np.int32))
pr = put(rng.integers(0, R, (N * N, PP)).astype(np.int32))
pg = put(rng.standard_normal((N * N, PP)).astype(np.float32))
act = put(rng.standard_normal((N * R, D)).astype(np.float32))
x = put(rng.standard_normal((N * 8 * 1024 * 16, D)).astype(np.float32))  # 32 MB a device
keep = put(np.ones((N,), bool))
compact = put(np.minimum(rng.integers(0, W + 1, (N * N, R + 1)), W).astype(np.int32))
grads = put(rng.standard_normal((N * N, W, D)).astype(np.float32))
opt = Adagrad(0.1)

timeit("exchange", sm(lambda a: ops.exchange(a, T_at("x")), spec, spec, "x"), x)
timeit(
    "lookup_from_shards",
    sm(
        lambda t, i, u, g, r: ops.lookup_from_shards(t, i, u, g, r, R, T_at("l")),
        (spec,) * 5,
        spec,
        "l",
    ),
    table,
    ids,
    pu,
    pg,
    pr,
)


def bwd(t, a, i, g, r, u, pgn, k):
    return ops.backward_update_sharded(
        opt, t, {"accumulators": a}, i, g, r, u, pgn, k[0], jnp.int32(0), T_at("bw")
    )


table, acc = time_update(
    "backward_update_sharded",
    sm(bwd, (spec,) * 8, (spec, {"accumulators": spec}), "bw", (0, 1)),
    table,
    acc,
    ids,
    act,
    pr,
    pu,
    pg,
    keep,
)
pairs_fn = sm(
    lambda i, r, u, g, c: ops.exchange_pooled_pairs(i, r, u, g, c, width=W, transport=T_at("pp")),
    (spec,) * 5,
    spec,
    "pp",
)
timeit("exchange_pooled_pairs", pairs_fn, ids, pr, pu, pg, compact)
served = pairs_fn(ids, pr, pu, pg, compact)
timeit(
    "exchange_pooled_partials",
    sm(
        lambda t, s: ops.exchange_pooled_partials(
            t, s, unique_capacity=U, width=W, transport=T_at("pt")
        ),
        (spec,) * 2,
        spec,
        "pt",
    ),
    table,
    served,
)


def pbwd(t, a, s, g, k):
    return ops.exchange_pooled_backward_update(
        opt,
        t,
        {"accumulators": a},
        s,
        g,
        k[0],
        jnp.int32(0),
        unique_capacity=U,
        width=W,
        transport=T_at("pb"),
    )


time_update(
    "exchange_pooled_backward_update",
    sm(pbwd, (spec,) * 5, (spec, {"accumulators": spec}), "pb", (0, 1)),
    table,
    acc,
    served,
    grads,
    keep,
)
print("FROM", embedmesh.__file__, flush=True)
if MODE == "host":
    jax.distributed.shutdown()
