"""A table of raw 64-bit ids against the static table, on train_step.py's workload (issue 42).

Workload: train_step.py's (8 tables x V rows x dim 64, float32, one feature each, batch
4096, ragged Poisson(10) ids a sample drawn Zipf(1.05) over permuted ranks, sum
combiner, the loss `0.5 * sum(act**2) / B`, Adagrad lr 0.01; its `make_batches`, `T`,
`B`, `V`, `D`, `loss_of`, `make_optimizer`), on one CPU device, two contenders built in
this one process:

  static    the tables as train_step.py's `embedmesh` peer has them (ids in [0, V)).
  dynamic   each table `TableConfig(V, ..., id_map=DynamicIds(eviction))`, fed the same
            ids through a fixed random 64-bit bijection (splitmix64's finalizer with a
            seed: odd multipliers and xor-shifts), so the raw ids look like production
            hashes while the vocabulary (at most V distinct ids a table) fits the
            capacity: after the warm-up every step is hits, as a steady state is.

Each contender's capacities come from `compute_sparse_core_stats` over its batches
(as train_step.py's). Timed, as train_step.py times its `embedmesh` peer: `enqueue`
(host preprocessing + transfer, blocked on) and the device step (`dequeue`, the loss
gradient, `apply_gradients`; the facade runs each update with the next lookup, so a
step holds the previous update and its own lookup; the dynamic table's `dequeue` also
runs `map_ids`). Rounds interleave the contenders (static then dynamic, then the other
order), each round `--steps` steps of each after a warm-up; the figures are the medians
over rounds of the per-round ratios dynamic / static of the per-round medians.

`--enqueue-parts`: each round also times enqueue's two parts apart, the host
preprocessing (`preprocess_batch`) and the transfer of its arrays (`core.put`, blocked
on), with their ratios. `--put batched`: both contenders' transfer by `batched_put`
(jaxlib's batched put a leaf) instead of `EmbeddingCore.put`, a proposal measured here
before it was made: `EmbeddingCore.put` puts so itself since issue 42's batched put
(`device/core.py`), so the option now compares only with older checkouts. `--profile`:
the dynamic step split into `map_ids`'s program (the facade's jitted map alone, blocked
on, timed once the previous update it follows is done; the facade's step runs it inside
one program with that update and the lookup) and the rest (that update, the lookup, the
loss gradient), and the host preprocessing's share that is the raw
ids' routing (`host.dynamic_ids`), by a cProfile of `enqueue`. `--trace DIR`:
a `jax.profiler` trace of `--steps` steps of each contender into DIR/<kind>, the wall
time a step from the first thunk to the last, and the time a step of each program (its
thunks' span; programs of one name, e.g. `jit__lambda`, summed) and of its costliest
HLO ops (the thunks' own times; an op inside a `conditional` or `while` counts in its
parent too).

    .venv/bin/python benchmarks/train/dynamic_ids.py                 # 5 rounds x 8 steps
    ... --rounds 3 --steps 5 --vocab 131072 --profile
    ... --rounds 1 --trace /tmp/dyn_trace
    ... --rounds 7 --enqueue-parts      # enqueue's preprocessing and transfer apart too
    ... --rounds 5 --enqueue-parts --dim 16   # (or 8, 128, 256 with --vocab 262144)
    ... --optimizer adam --zipf 0             # another optimizer, uniform ids
    ... --pipelined                           # both with pipeline_execution_with_tensor_core
    ... --rounds 7 --enqueue-parts --put batched
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def bijection64(ids, seed: int = 0x5EED):
    """A fixed random bijection of the 64-bit integers (splitmix64's finalizer after
    adding a seeded odd constant): ids in [0, V) become raw int64 hashes."""
    import numpy as np

    z = ids.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & (2**64 - 1) | 1)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def batched_put(core, csr: dict) -> dict:
    """What `--put batched` puts in place of `EmbeddingCore.put` (the proposal, measured
    here, that `EmbeddingCore.put` adopted: the same on checkouts since): on one process,
    every leaf by jaxlib's `batched_device_put` (`embedmesh._compat`, as serving's
    outputs) with its per-device slices, where `jax.device_put` spends 40-140 us a leaf;
    the same global arrays, copies (`force_copy`) as `jax.device_put` makes."""
    import jax
    import numpy as np

    from embedmesh import _compat

    put, aval = _compat.batched_device_put(), _compat.shaped_array()
    if jax.process_count() != 1 or put is None or aval is None:
        return core.put(csr)
    sharding = core.row_sharding
    out = {}
    for name, c in csr.items():
        leaves, treedef = jax.tree_util.tree_flatten(c)
        placed = []
        for leaf in map(np.asarray, leaves):
            index = sharding.addressable_devices_indices_map(leaf.shape)
            devices = list(index)
            shards = [leaf[index[d]] for d in devices]
            # force_copy: the arrays own their memory, as jax.device_put's (jaxlib's
            # default, zero copy, aliases a 64-byte-aligned numpy buffer on CPU)
            placed.append(put(aval(leaf.shape, leaf.dtype), sharding, shards, devices, True, True))
        out[name] = jax.tree_util.tree_unflatten(treedef, placed)
    return out


def build(kind: str, batches, eviction: str, pipelined: bool = False):
    """(MeshEmbedding, features per batch) of one contender."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import train_step as ts
    from jax.sharding import Mesh

    import embedmesh as em
    from embedmesh.inputs import RaggedTensor
    from embedmesh.layout.stacking import plan_stacking

    def const_init(key, shape, dtype):  # cheap; values do not change the speed
        return jnp.full(shape, 0.01, dtype)

    id_map = em.DynamicIds(eviction=eviction) if kind == "dynamic" else None
    fc = {
        f"f{t}": em.FeatureConfig(
            em.TableConfig(
                ts.V, ts.D, initializer=const_init, combiner="sum", name=f"t{t}", id_map=id_map
            )
        )
        for t in range(ts.T)
    }
    raw = (lambda x: bijection64(x)) if kind == "dynamic" else (lambda x: x)
    feats = [
        {f"f{t}": RaggedTensor.from_row_lengths(raw(b[t][0]), b[t][1]) for t in range(ts.T)}
        for b in batches
    ]
    mesh = Mesh(np.array(jax.devices()[:1]), ("devices",))
    plan = plan_stacking(fc, 1)
    caps = em.compute_sparse_core_stats(feats, plan, num_devices_local=1).capacities()
    emb = em.MeshEmbedding(
        fc,
        ts.make_optimizer(ts.bench_optimizer_name()),
        mesh=mesh,
        capacities=caps,
        sharding="mod",
        pipeline_execution_with_tensor_core=pipelined,
    )
    emb.build()
    return emb, feats, caps


class Contender:
    def __init__(self, kind, batches, eviction, warmup, put="core", pipelined=False):
        import functools

        import jax
        import numpy as np
        import train_step as ts

        self.kind = kind
        self.emb, self.feats, self.caps = build(kind, batches, eviction, pipelined)
        if put == "batched":  # both contenders: `batched_put` in place of core.put
            e = self.emb
            csr, _ = e._preprocess(self.feats[0], None, e._capacities, e._overflow)
            want, got = e.core.put(csr), batched_put(e.core, csr)
            for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
                assert a.sharding == b.sharding and a.dtype == b.dtype, (a.sharding, b.sharding)
                assert a.committed == b.committed and (np.asarray(a) == np.asarray(b)).all()
            e.core.put = functools.partial(batched_put, e.core)
        self.lossgrad = jax.jit(jax.grad(lambda acts: ts.loss_of(list(acts.values()))))
        self.csrs = [self.emb.enqueue(f) for f in self.feats]  # raw ids kept: mapped per step
        self.i = 0
        for _ in range(warmup):
            self.device_step()
        jax.block_until_ready(self.emb.state)

    def device_step(self):
        csr = self.csrs[self.i % len(self.csrs)]
        self.i += 1
        acts, pres = self.emb.dequeue(csr)
        self.emb.apply_gradients(self.lossgrad(acts), pres)  # syncs on its finite check

    def enqueue(self):
        import jax

        jax.block_until_ready(self.emb.enqueue(self.feats[self.i % len(self.feats)]))
        self.i += 1

    def preprocess(self):
        """Host preprocessing alone (`enqueue` without the transfer): `(csr, seconds)`."""
        e = self.emb
        f = self.feats[self.i % len(self.feats)]
        self.i += 1
        t = time.perf_counter()
        csr, _ = e._preprocess(f, None, e._capacities, e._overflow)
        return csr, time.perf_counter() - t

    def parts(self, steps):
        """Median seconds of `enqueue`'s two parts: host preprocessing, then the transfer
        of its arrays (`core.put(copy=False)`, as `enqueue` puts them, blocked on)."""
        import jax

        pre, put = [], []
        for _ in range(steps):
            csr, s = self.preprocess()
            pre.append(s)
            t = time.perf_counter()
            jax.block_until_ready(self.emb.core.put(csr, copy=False))  # as enqueue puts
            put.append(time.perf_counter() - t)
        return statistics.median(pre), statistics.median(put)

    def time(self, fn, steps):
        from train_step import timed

        return statistics.median(timed(fn, steps))


def profile(dyn: Contender, steps: int) -> None:
    """Where the dynamic step and its preprocessing go."""
    import cProfile
    import pstats

    import jax

    from embedmesh.job.steps import _id_counts, _with_rows

    emb = dyn.emb
    whole = []
    for _ in range(steps):
        t = time.perf_counter()
        dyn.device_step()
        whole.append(time.perf_counter() - t)
    # the map's program alone: the job runs the pending update, the map and the lookup
    # as one program (`apply_map_lookup`); here the same steps as three programs, the
    # map's timed once the update it follows is done
    programs = emb.job.programs
    spent = []
    for _ in range(steps):
        csr = dyn.csrs[dyn.i % len(dyn.csrs)]
        dyn.i += 1
        emb.flush()
        state = jax.block_until_ready(emb._schedule.state)
        t = time.perf_counter()
        state, rows, counts = jax.block_until_ready(programs.map(state, csr))
        spent.append(time.perf_counter() - t)
        mapped = _with_rows(csr, rows)
        acts, view = programs.lookup(state, mapped)
        emb._schedule = emb._schedule.but(
            state=state, view=(mapped, view), id_stats=_id_counts(rows, counts)
        )
        emb.apply_gradients(dyn.lossgrad(emb.job.pack_activations(acts, mapped)), mapped)
    m, w = statistics.median(spent), statistics.median(whole)
    print(
        f"dynamic device step {w * 1e3:.1f} ms; map_ids's program alone {m * 1e3:.1f} ms "
        f"({m / w:.0%} of it), the rest (update + lookup + loss gradient) {(w - m) * 1e3:.1f} ms"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        dyn.enqueue()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[3] for k, v in st.stats.items() if k[2] == "enqueue") / steps
    # only top-level entries of host/dynamic_ids.py: cumulative times of its functions
    # nest, so take the largest cumulative one as the routing's time
    routing = max((v[3] for k, v in st.stats.items() if "host/dynamic_ids" in k[0]), default=0.0)
    print(
        f"dynamic enqueue {total * 1e3:.1f} ms a batch (under cProfile): host/dynamic_ids.py's "
        f"largest cumulative {routing / steps * 1e3:.1f} ms; top functions by own time:"
    )
    st.sort_stats("tottime").print_stats(12)


def trace(dyn: Contender, steps: int, out: str, top: int = 25) -> None:
    """A `jax.profiler` trace of `steps` steps of a contender (`dyn`: either); per program
    (XLA module) the span of its thunks a step, then the `top` HLO ops by their thunks'
    time a step."""
    import collections
    import glob
    import gzip
    import json

    import jax

    with jax.profiler.trace(out, create_perfetto_trace=True):
        for _ in range(steps):
            dyn.device_step()
        jax.block_until_ready(dyn.emb.state)
    path = sorted(glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True))[-1]
    ops, spans = collections.Counter(), {}
    for e in json.load(gzip.open(path))["traceEvents"]:
        a = e.get("args", {})
        if e.get("ph") != "X" or "hlo_module" not in a:
            continue
        ops[f"{a['hlo_module']}:{a['hlo_op']}"] += e["dur"]
        run = (a["hlo_module"], a.get("run_id"))
        t0, t1 = spans.get(run, (float("inf"), 0.0))
        spans[run] = (min(t0, e["ts"]), max(t1, e["ts"] + e["dur"]))
    programs = collections.Counter()
    for (module, _), (t0, t1) in spans.items():
        programs[module] += t1 - t0
    first = min(t0 for t0, _ in spans.values())
    last = max(t1 for _, t1 in spans.values())
    print(
        f"trace of {steps} {dyn.kind} steps ({path}): {(last - first) / steps / 1e3:.2f} ms a "
        f"step from the first thunk to the last, of which in programs (ms a step):"
    )
    for module, us in programs.most_common():
        print(f"  program {module}: {us / steps / 1e3:.2f}")
    for op, us in ops.most_common(top):
        print(f"    {us / steps / 1e3:8.2f}  {op}")


def profile_map(capacity: int, slots: int, live: int, steps: int) -> None:
    """`id_map.map_ids` alone on one table's map (a step of hits), and what its three
    multi-operand sorts cost on their own: where the map's time goes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from train_step import timed

    from embedmesh.device import id_map

    def med(fn, *a):
        jax.block_until_ready(fn(*a))
        return statistics.median(timed(lambda: jax.block_until_ready(fn(*a)), steps)) * 1e3

    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**63), 2**63 - 1, size=slots, dtype=np.int64)
    pairs = jnp.asarray(id_map.split_ids(ids))
    valid = jnp.asarray(np.arange(slots) < live)
    fn = jax.jit(id_map.map_ids, donate_argnums=0)
    state, *_ = fn(id_map.init(id_map.IdMapConfig(capacity=capacity)), pairs, valid, 0)
    ts = []
    for step in range(1, steps + 3):
        t = time.perf_counter()
        state, rows, *_ = fn(state, pairs, valid, jnp.int32(step))
        jax.block_until_ready(rows)
        ts.append(time.perf_counter() - t)
    whole = statistics.median(ts[2:]) * 1e3
    k = [jnp.asarray(rng.integers(0, 2**32, slots, dtype=np.uint32)) for _ in range(3)]
    pos = jnp.arange(slots, dtype=jnp.int32)
    four = med(jax.jit(lambda a, b, c, p: lax.sort((a, b, c, p), num_keys=4)), *k, pos)
    two = med(jax.jit(lambda a, p: lax.sort((a, p), num_keys=2)), k[0], pos)
    one = med(jax.jit(jnp.sort), k[0])
    print(
        f"map_ids alone, one table: capacity {capacity}, {slots} id slots, {live} valid "
        f"(hits): {whole:.1f} ms. Its sorts over {slots}: a 4-operand sort {four:.1f} ms, "
        f"two 2-operand sorts {2 * two:.1f} ms (a 1-operand sort: {one:.2f} ms)"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed steps a contender a round")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--vocab", type=int, help="rows a table (default train_step's V)")
    ap.add_argument("--dim", type=int, help="each table's dim (default train_step's D, 64)")
    ap.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    ap.add_argument(
        "--optimizer",
        default="adagrad",
        choices=("sgd", "adagrad", "adam", "ftrl", "adagrad_momentum", "rowwise_adagrad"),
        help="both contenders' optimizer (train_step.py's make_optimizer)",
    )
    ap.add_argument(
        "--zipf",
        type=float,
        help="the ids' Zipf exponent (default train_step's 1.05; 0: uniform over the rows)",
    )
    ap.add_argument("--profile", action="store_true", help="then where the dynamic time goes")
    ap.add_argument(
        "--pipelined",
        action="store_true",
        help="both contenders with pipeline_execution_with_tensor_core=True",
    )
    ap.add_argument("--trace", metavar="DIR", help="then a jax.profiler trace of dynamic steps")
    ap.add_argument(
        "--put",
        default="core",
        choices=("core", "batched"),
        help="the transfer enqueue runs: EmbeddingCore.put, or batched_put (core.put's since #42)",
    )
    ap.add_argument(
        "--enqueue-parts",
        action="store_true",
        help="time enqueue's host preprocessing and transfer apart too, each round",
    )
    args = ap.parse_args(argv)
    if args.pipelined and args.profile:
        ap.error("--profile times the unpipelined step's programs: not with --pipelined")
    if args.vocab:
        os.environ["EMBEDMESH_BENCH_VOCAB"] = str(args.vocab)
    if args.dim:
        os.environ["EMBEDMESH_BENCH_DIM"] = str(args.dim)
    os.environ["EMBEDMESH_BENCH_OPTIMIZER"] = args.optimizer
    import platform

    import jax
    import numpy as np
    import train_step as ts

    if args.zipf is not None:
        ts.ZIPF_A = args.zipf  # (make_batches reads it)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {platform.node()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; jax {jax.__version__}; "
        f"{ts.T} tables x {ts.V} rows x dim {ts.D}, batch {ts.B}, Poisson({ts.VALENCY}) "
        f"{f'Zipf({ts.ZIPF_A})' if ts.ZIPF_A else 'uniform'} ids, {args.optimizer}; "
        f"dynamic: DynamicIds(eviction={args.eviction!r}); "
        f"transfer: {'EmbeddingCore.put' if args.put == 'core' else 'batched_put'}"
        f"{'; pipelined' if args.pipelined else ''}"
    )
    batches = ts.make_batches(0)
    t = time.perf_counter()
    static = Contender("static", batches, args.eviction, args.warmup, args.put, args.pipelined)
    dyn = Contender("dynamic", batches, args.eviction, args.warmup, args.put, args.pipelined)
    print(f"set-up and warm-up {time.perf_counter() - t:.0f} s")
    for c in (static, dyn):
        cap = next(iter(c.caps.values()))
        print(f"{c.kind:8s} stacks {len(c.caps)}, capacity of the first {cap}")
    stats = dyn.emb.last_stats
    counts = [stats[f"t{t}"].id_map for t in range(ts.T)]
    print(
        "dynamic id maps after the warm-up: "
        + ", ".join(f"{k} {sum(c[k] for c in counts)}" for k in counts[0])
    )
    rows = []
    for r in range(args.rounds):
        order = (static, dyn) if r % 2 == 0 else (dyn, static)
        got = {}
        for c in order:
            dev = c.time(c.device_step, args.steps)
            jax.block_until_ready(c.emb.state)
            enq = c.time(c.enqueue, args.steps)
            got[c.kind] = (dev, enq) + (c.parts(args.steps) if args.enqueue_parts else ())
        rows.append(got)
        (sd, se, *sp), (dd, de, *dp) = got["static"], got["dynamic"]
        parts = "".join(
            f"; {what} static {a * 1e3:.2f} ms, dynamic {b * 1e3:.2f} ms ({b / a:.2f}x)"
            for what, a, b in zip(("preprocessing", "transfer"), sp, dp)
        )
        print(
            f"round {r}: device step static {sd * 1e3:.1f} ms, dynamic {dd * 1e3:.1f} ms "
            f"({dd / sd:.2f}x); enqueue static {se * 1e3:.1f} ms, dynamic {de * 1e3:.1f} ms "
            f"({de / se:.2f}x){parts}; load {os.getloadavg()[0]:.2f}"
        )

    def med(i, kind):
        return statistics.median(g[kind][i] for g in rows) * 1e3

    def ratio(i):
        return statistics.median(g["dynamic"][i] / g["static"][i] for g in rows)

    print(
        f"\nmedians over {args.rounds} rounds | static ms | dynamic ms | dynamic / static "
        "(median of per-round ratios)"
    )
    print(f"device step | {med(0, 'static'):.1f} | {med(0, 'dynamic'):.1f} | {ratio(0):.2f}x")
    print(f"enqueue | {med(1, 'static'):.1f} | {med(1, 'dynamic'):.1f} | {ratio(1):.2f}x")
    if args.enqueue_parts:
        for i, what in ((2, "enqueue's preprocessing"), (3, "enqueue's transfer")):
            print(f"{what} | {med(i, 'static'):.2f} | {med(i, 'dynamic'):.2f} | {ratio(i):.2f}x")
    if args.profile:
        print()
        profile(dyn, args.steps)
        e = dyn.emb  # (the host batch: a placed one leaves its counts on the host)
        host, _ = e._preprocess(dyn.feats[0], None, e._capacities, e._overflow)
        csr = host[next(iter(dyn.caps))]
        slots = next(iter(dyn.caps.values())).max_unique_ids_per_partition
        live = int(np.asarray(csr.unique_counts).sum())
        profile_map(ts.V, slots, live, args.steps)
    if args.trace:
        for c in (static, dyn):
            print()
            trace(c, args.steps, os.path.join(args.trace, c.kind))


if __name__ == "__main__":
    main()
