"""Training-step throughput: embedmesh vs plain JAX vs TorchRec/FBGEMM's CPU TBE.

Workload (issue 4): 8 tables x 1M rows x dim 64 (float32), one feature each,
batch 4096, ragged Poisson(10) ids per sample drawn Zipf(1.05) over permuted
ranks, sum combiner; a trivial dense loss `0.5 * sum(act**2) / B`; its
gradient; a fused Adagrad update (lr 0.01). ids/s = ids in the batch (before
any dedup; ~327k) / step time.

Peers, each in its own child process (so each gets its own peak RSS and no
allocator or thread pool state leaks between them), run in interleaved rounds
within one invocation; medians over rounds of per-round medians:

  embedmesh         `MeshEmbedding` on a 1-device mesh: `enqueue` (host
                    preprocessing + transfer) timed apart from the device step
                    (`dequeue` + loss gradient + `apply_gradients`; the facade
                    runs each update with the next lookup, so a timed step holds
                    the previous step's update and its own lookup), plus the
                    end-to-end step with `prefetch` overlapping preprocessing.
  embedmesh-pipelined  as embedmesh with pipeline_execution_with_tensor_core=True
                    (each update runs fused with the next lookup, one program a step).
  embedmesh-2dev    as embedmesh on a 2-device CPU mesh (rows mod-sharded; the
                    in-process devices read each other's shards through shared
                    memory: `ops.lookup_from_shards`, `ops.backward_update_sharded`).
  embedmesh-4dev    the same on 4 CPU devices (the same 2 cores).
  embedmesh-1core   as embedmesh, the process pinned to one core, on its own batch of
                    B (the batch of process 0 below): weak scaling's base.
  embedmesh-2proc   2 processes x 1 device (jax.distributed, gloo, 127.0.0.1), each
                    pinned to its own core and fed its own, different batch of B (so
                    2B per step); capacities measured over both processes' batches.
                    Its ids/s counts both batches; weak scaling = 2proc / 1core.
  embedmesh-core    as embedmesh, as one user `jax.jit` train step over
                    `EmbeddingCore` (lookup, loss, grad, update in one program).
  embedmesh-base    (with --baseline PATH) `embedmesh` with an older shard_program.py.
  embedmesh-xla     `embedmesh` with its CPU kernels off (EMBEDMESH_CPU_KERNELS=0):
                    the pure-JAX path, i.e. XLA's own gather/scatter.
  plain-jax         per table `jnp.take` + `segment_sum`, `jax.grad` to the dense
                    tables, `optax.adagrad` on them (jit, tables and state donated).
  fbgemm-exact      `SplitTableBatchedEmbeddingBagsCodegen` on CPU, EXACT_ADAGRAD.
  fbgemm-rowwise    the same, EXACT_ROWWISE_ADAGRAD (one accumulator per row).
  torch             `torch.nn.EmbeddingBag(sparse=True)` per table and a sparse torch
                    optimizer (SGD, SparseAdam, Adagrad: see --optimizer).

`--optimizer adagrad,adam,...` runs each peer with each optimizer (peers PEER:OPT) in
the same interleaved rounds; fbgemm-exact runs FBGEMM's optimizer of that name where its
CPU kernels have it (sgd, adagrad, rowwise_adagrad).

Memory: peak RSS (VmHWM) of each child after setup, during the timed device steps and
during the end to end with prefetch (each phase from a reset through /proc/self/clear_refs),
against the bytes of tables + slots; benchmarks/train/train_memory.py says where it goes.

End to end: from the same raw (ids, lengths) arrays, embedmesh through `emb.prefetch`
(RaggedTensors built in its thread), FBGEMM through its own preparation (int64 ids,
offsets) serially and in a thread 2 batches ahead (the faster counts); each embedmesh peer
is compared with each FBGEMM peer of its optimizer as medians of per-round ratios.

    /tmp/trainbench/bin/python benchmarks/train/train_step.py            # all peers
    ... --peers embedmesh,fbgemm-exact --rounds 5 --steps 10
    ... --profile                        # where embedmesh's step time goes
    ... --sharding table_wise            # one strategy (default auto: the planner's)
    ... --peers embedmesh-2proc,embedmesh-2proc@mod   # a peer under one strategy
    ... --trace DIR                      # perfetto traces of each peer's steps

Sharded peers use `--sharding` (default "auto": the planner's pick for their mesh,
from the first batch, as `MeshEmbedding(sharding="auto")` makes it); each reports the
bytes its device sends per step (`EmbeddingCore.exchange_bytes`) against the row
exchange of mod sharding at its capacities.

See benchmarks/train/requirements-train.txt for the peer environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import types

T, B, VALENCY, ZIPF_A = 8, 4096, 10, 1.05
D = int(os.environ.get("EMBEDMESH_BENCH_DIM", 64))  # each table's dim (--dim)
V = int(os.environ.get("EMBEDMESH_BENCH_VOCAB", 1_000_000))  # rows a table (--vocab)
# the tables' storage type (--table-dtype): embedmesh's TableConfig dtype (stochastic
# rounding of the updates) and FBGEMM's weights_precision (its own stochastic rounding)
TABLE_DTYPE = os.environ.get("EMBEDMESH_BENCH_TABLE_DTYPE", "fp32")
LR = 0.01
NUM_BATCHES = 4  # distinct batches, cycled
HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = os.environ.get("EMBEDMESH_BENCH_BASELINE", "")  # see --baseline
ROOT = os.path.dirname(os.path.dirname(HERE))
PEERS = (
    "embedmesh",
    "embedmesh-pipelined",
    "embedmesh-2dev",
    "embedmesh-4dev",
    "embedmesh-1core",
    "embedmesh-2proc",
    "embedmesh-core",
    "embedmesh-xla",
    "plain-jax",
    "fbgemm-exact",
    "fbgemm-rowwise",
)


# ---------------------------------------------------------------------------
# Shared helpers (child side)


def make_batches(seed=0, stream=0, *, vocab=None, batch=None, num=None):
    """NUM_BATCHES (`num`) batches: per table (values int32, lengths int64), over `vocab`
    rows (default V) with `batch` samples (default B). Streams > 0 draw other samples
    over the same ids (the same permuted ranks): one per process."""
    import numpy as np

    v = V if vocab is None else vocab
    b = B if batch is None else batch
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, v + 1, dtype=np.float64) ** -ZIPF_A)
    cdf /= cdf[-1]
    perms = [rng.permutation(v).astype(np.int32) for _ in range(T)]
    if stream:
        rng = np.random.default_rng([seed, stream])
    out = []
    for _ in range(NUM_BATCHES if num is None else num):
        feats = []
        for t in range(T):
            lengths = rng.poisson(VALENCY, b).astype(np.int64)
            r = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), v - 1)
            feats.append((perms[t][r], lengths))
        out.append(feats)
    return out


def rss_status():
    """(VmHWM, VmRSS) in bytes."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                vals[k] = int(v.split()[0]) * 1024
    return vals.get("VmHWM", 0), vals.get("VmRSS", 0)


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def time_steps(args, batches, inputs, host_prep, device_step, reset_before_steps=False):
    """A contender's warm-up (`args.warmup` steps over `inputs`, its prepared batches),
    then `args.steps` timings of `host_prep` over the raw `batches` and of `device_step`
    over `inputs`: (enqueue s, device s, peak RSS after the warm-up). The peak is reset
    before the timings (`reset_before_steps`: again before the device steps)."""
    nb = len(inputs)
    for i in range(args.warmup):
        device_step(inputs[i % nb])
    setup_hwm, _ = rss_status()
    reset_peak()
    it = iter(range(10**9))
    enq = timed(lambda: host_prep(batches[next(it) % nb]), args.steps)
    it = iter(range(10**9))
    if reset_before_steps:
        reset_peak()  # the device steps' own peak
    dev = timed(lambda: device_step(inputs[next(it) % nb]), args.steps)
    return enq, dev, setup_hwm


def step_result(enq, dev, setup_hwm, step_hwm, rss, state_bytes, devices, **more) -> dict:
    """A child's result: host-preparation and device-step times, the peak RSS after
    setup and over the steps, the RSS at the end, the tables' and slots' bytes, the
    devices used, then what that contender adds (`more`)."""
    common = (enq, dev, setup_hwm, step_hwm, rss, state_bytes, devices)
    keys = ("enqueue", "device", "setup_hwm", "step_hwm", "rss", "state_bytes", "devices")
    return dict(zip(keys, common), **more)


def thread_prefetch(fn, items, depth: int = 2):
    """Yield `fn(item)` computed in a thread up to `depth` items ahead: the standard
    library's version of `MeshEmbedding.prefetch` for the peers (no embedmesh or jax
    import in their processes)."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    end = object()

    def work():
        for item in items:
            q.put(fn(item))
        q.put(end)

    threading.Thread(target=work, daemon=True).start()
    while (x := q.get()) is not end:
        yield x


def loss_of(acts_list):
    return sum(0.5 * (a * a).sum() for a in acts_list) / B


# ---------------------------------------------------------------------------
# embedmesh


def embedmesh_setup(batches, capacity_batches=None):
    if os.environ.get("EMBEDMESH_BENCH_SPARSE_OPS"):
        # the core no longer calls one shard_program module (each strategy has its own,
        # embedmesh/device/strategies/): an older file cannot be swapped in
        raise SystemExit(
            "--baseline (an older shard_program.py) is no longer supported; compare two "
            "trees with benchmarks/ab.py --only train_step"
        )
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import embedmesh as em
    from embedmesh.inputs import RaggedTensor

    def const_init(key, shape, dtype):  # cheap; values do not change the speed
        return jnp.full(shape, 0.01, dtype)

    fc = {
        f"f{t}": em.FeatureConfig(
            em.TableConfig(
                V,
                D,
                initializer=const_init,
                combiner="sum",
                name=f"t{t}",
                dtype={"fp32": jnp.float32, "fp16": jnp.float16}[TABLE_DTYPE],
            )
        )
        for t in range(T)
    }

    def features(bs):
        return [{f"f{t}": RaggedTensor.from_row_lengths(*b[t]) for t in range(T)} for b in bs]

    feats = features(batches)
    ndev = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    from embedmesh.layout.planner import STRATEGY_FORMS
    from embedmesh.layout.stacking import plan_stacking

    sample = feats if capacity_batches is None else features(capacity_batches)
    # "auto": the planner's choice from the first batch (process 0's in 2proc), as the
    # facade makes it; then the plan of that choice, for its capacities
    strategies = chosen_strategies(
        os.environ.get("EMBEDMESH_BENCH_SHARDING", "auto"), fc, sample[0], mesh
    )
    names = [f"t{t}" for t in range(T)]
    local = len(jax.local_devices())

    def capacities(strategies):
        plan = plan_stacking(
            fc,
            ndev,
            sharding={t: STRATEGY_FORMS[strategies[t]][0] for t in names},
            stack_keys={t: STRATEGY_FORMS[strategies[t]][1] for t in names} if ndev > 1 else None,
        )
        return em.compute_sparse_core_stats(sample, plan, num_devices_local=local).capacities()

    caps = capacities(strategies)
    mod_caps = capacities({t: "mod" for t in names})  # today's row exchange, for the ratio
    pipelined = os.environ.get("EMBEDMESH_BENCH_PIPELINED") == "1"
    emb = em.MeshEmbedding(
        fc,
        make_optimizer(bench_optimizer_name()),
        pipelined,
        mesh=mesh,
        capacities=caps,
        sharding=strategies,
    )
    emb.mod_exchange_bytes = row_exchange_bytes(mod_caps, ndev)
    emb.build()
    return emb, feats, caps


# --optimizer: embedmesh's optimizer of each name (lr LR), FBGEMM's CPU optimizer type for
# it (None: FBGEMM's CPU kernels lack it), torch's sparse optimizer for the torch peer.
OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl", "adagrad_momentum", "rowwise_adagrad")
FBGEMM_OPTIM = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
}


def bench_optimizer_name() -> str:
    return os.environ.get("EMBEDMESH_BENCH_OPTIMIZER", "adagrad")


def make_optimizer(name: str):
    """embedmesh's optimizer `name` at lr LR (defaults otherwise; Adagrad's accumulator
    starts at 0.1 as FBGEMM's and optax's do here)."""
    import embedmesh as em

    return {
        "sgd": lambda: em.SGD(learning_rate=LR),
        "adagrad": lambda: em.Adagrad(learning_rate=LR),
        "adam": lambda: em.Adam(learning_rate=LR),
        "ftrl": lambda: em.FTRL(learning_rate=LR),
        "adagrad_momentum": lambda: em.AdagradMomentum(learning_rate=LR, momentum=0.9),
        "rowwise_adagrad": lambda: em.RowWiseAdagrad(learning_rate=LR, epsilon=1e-8),
    }[name]()


def preprocess_backend() -> str:
    """The host preprocessing's backend ("auto"'s pick), "+numba" where numba was imported."""
    try:
        from embedmesh.host.preprocess import auto_backend
    except ImportError:  # an older embedmesh (--baseline)
        return "?"
    loaded = any(m.split(".")[0] == "numba" for m in sys.modules)
    return auto_backend() + (" (numba imported)" if loaded else " (numba not imported)")


def chosen_strategies(sharding: str, fc, batch, mesh) -> dict:
    """`{table: strategy}`: `sharding` for every table, or with "auto" the planner's
    pick from `batch` for `mesh` (the facade's own call: `planner.plan` on the batch's
    table statistics, the cost model's machine for the mesh)."""
    names = [f"t{t}" for t in range(T)]
    if sharding != "auto":
        return {t: sharding for t in names}
    from embedmesh.config import resolve_feature_config
    from embedmesh.device import peers
    from embedmesh.inputs import flatten_inputs_like, to_csr
    from embedmesh.layout import planner

    resolved = resolve_feature_config(fc)
    flat = flatten_inputs_like(resolved, batch)
    csrs = [to_csr(n, f, x) for n, f, x in zip(resolved.feature_names, resolved.features, flat)]
    opt = make_optimizer(bench_optimizer_name())
    stats = planner.table_stats(resolved, {t: opt for t in resolved.table_names}, csrs)
    machine = planner.machine_for(mesh, peers.mesh_on_cpu(mesh))
    chosen, _ = planner.plan(stats, {t: "auto" for t in names}, mesh.size, B, machine)
    return {t: ("mod" if chosen[t] in ("mod", "row_wise_rows") else chosen[t]) for t in names}


def row_exchange_bytes(caps, n: int) -> int:
    """Bytes one device sends per step through the row exchange (ids, rows, per-unique
    gradients to the N - 1 other devices, at the compiled capacities): what XLA's
    all_to_all moves. In-process CPU devices read each other's memory instead (0 copies)."""
    if n == 1:
        return 0
    per_block = sum(c.max_unique_ids_per_partition * (4 + 2 * 4 * D) for c in caps.values())
    return (n - 1) * per_block


def child_embedmesh(args, batches, capacity_batches=None):
    import jax

    emb, feats, caps = embedmesh_setup(batches, capacity_batches)
    lossgrad = jax.jit(jax.grad(lambda acts: loss_of(list(acts.values()))))
    nb = len(feats)

    def facade_step(csr):
        acts, pres = emb.dequeue(csr)
        emb.apply_gradients(lossgrad(acts), pres)  # syncs on its finite check

    device_step = facade_step
    if args.child.startswith("embedmesh-core"):
        core = emb.core

        def train(state, csr):
            acts = core.lookup(state, csr)
            g = jax.grad(lambda a: loss_of(list(a.values())))(acts)
            state, ok = core.apply_gradients(state, g, csr)
            return state, ok

        train_jit = jax.jit(train, donate_argnums=0)

        def core_step(csr):
            emb.state, ok = train_jit(emb.state, csr)
            bool(ok)

        device_step = core_step

    csrs = [emb.enqueue(f) for f in feats]
    for i in range(args.warmup):
        device_step(csrs[i % nb])
    jax.block_until_ready(emb.state)  # reading the state applies a deferred update
    device_step(csrs[args.warmup % nb])  # so that each timed step runs exactly one update
    setup_hwm, _ = rss_status()
    reset_peak()
    it = iter(range(10**9))
    enq = timed(lambda: jax.block_until_ready(emb.enqueue(feats[next(it) % nb])), args.steps)
    it = iter(range(10**9))
    import resource

    reset_peak()  # the device steps' own peak (FBGEMM's is measured the same way)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    dev = timed(lambda: device_step(csrs[next(it) % nb]), args.steps)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    step_hwm, _ = rss_status()

    from embedmesh.inputs import RaggedTensor

    def e2e():
        # from the raw ids, as FBGEMM's end to end: the RaggedTensors are built in the
        # prefetch thread (it runs the generator), preprocessed, placed, then stepped on
        src = (
            {f"f{t}": RaggedTensor.from_row_lengths(*batches[i % nb][t]) for t in range(T)}
            for i in range(args.steps)
        )
        t = time.perf_counter()
        for csr in emb.prefetch(src):
            device_step(csr)
        jax.block_until_ready(emb.state)
        return (time.perf_counter() - t) / args.steps

    reset_peak()
    e2e_t = e2e()
    e2e_hwm, _ = rss_status()
    trace_dir = os.environ.get("EMBEDMESH_BENCH_TRACE")
    if trace_dir:  # a perfetto trace of a few device steps (--trace)
        it = iter(range(10**9))
        with jax.profiler.trace(
            os.path.join(trace_dir, f"{args.child}-{args.proc_id}"), create_perfetto_trace=True
        ):
            for _ in range(4):
                device_step(csrs[next(it) % nb])
            jax.block_until_ready(emb.state)
    _, rss = rss_status()
    state_bytes = sum(
        x.nbytes for x in jax.tree_util.tree_leaves((emb.state.tables, emb.state.slots))
    )
    more = dict(
        e2e=[e2e_t],
        e2e_hwm=e2e_hwm,
        capacity=str(list(caps.values())[0]),
        exchange_bytes=sum(emb.core.exchange_bytes(csrs[0]).values()),
        page_faults_per_step=faults,
        mod_exchange_bytes=emb.mod_exchange_bytes,
        strategies="+".join(sorted({s for _, s in emb.plan.strategies})),
        # the host preprocessing's backend, and whether the process imported numba
        preprocess=preprocess_backend(),
    )
    devices = len(jax.devices())
    return step_result(enq, dev, setup_hwm, step_hwm, rss, state_bytes, devices, **more)


# ---------------------------------------------------------------------------
# plain JAX


def padded_cap(batches) -> int:
    """The plain-JAX step's fixed id count a table: the most ids a table has in any of
    `batches`, rounded up to a multiple of 1024."""
    cap = max(int(l.sum()) for b in batches for _, l in b)
    return -(-cap // 1024) * 1024


def padded_ids(b, cap, batch):
    """Batch `b` in fixed shapes, on the device: ids [T, cap] (each table's padded to
    `cap`) and each id's sample [T, cap], pad entries going to sample `batch` (dropped)."""
    import jax
    import numpy as np

    ids = np.zeros((T, cap), np.int32)
    seg = np.full((T, cap), batch, np.int32)
    for t, (vals, lengths) in enumerate(b):
        ids[t, : vals.size] = vals
        seg[t, : vals.size] = np.repeat(np.arange(batch, dtype=np.int32), lengths)
    return jax.device_put(ids), jax.device_put(seg)


def child_plain(args, batches):
    import functools

    import jax
    import jax.numpy as jnp
    import optax

    cap = padded_cap(batches)

    def host_prep(b):
        return padded_ids(b, cap, B)

    tables = [jnp.full((V, D), 0.01, jnp.float32) for _ in range(T)]
    opt = optax.adagrad(LR, initial_accumulator_value=0.1)
    opt_state = opt.init(tables)

    def loss(tables, ids, seg):
        acts = [
            jax.ops.segment_sum(jnp.take(tables[t], ids[t], axis=0), seg[t], num_segments=B)
            for t in range(T)
        ]
        return loss_of(acts)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(tables, opt_state, ids, seg):
        g = jax.grad(loss)(tables, ids, seg)
        updates, opt_state = opt.update(g, opt_state, tables)
        return optax.apply_updates(tables, updates), opt_state

    inputs = [host_prep(b) for b in batches]
    state = [tables, opt_state]

    def device_step(x):
        state[0], state[1] = step(state[0], state[1], *x)
        jax.block_until_ready(state[0])

    enq, dev, setup_hwm = time_steps(
        args, batches, inputs, lambda b: jax.block_until_ready(host_prep(b)), device_step
    )
    step_hwm, rss = rss_status()
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    return step_result(enq, dev, setup_hwm, step_hwm, rss, state_bytes, 1)


# ---------------------------------------------------------------------------
# FBGEMM


def child_fbgemm(args, batches):
    import logging

    logging.disable(logging.WARNING)  # its version check logs a warning per library
    import numpy as np
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    if args.child == "fbgemm-rowwise":
        optim = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    else:  # fbgemm-exact: the optimizer of --optimizer
        optim = getattr(EmbOptimType, FBGEMM_OPTIM[bench_optimizer_name()])
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(V, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T,
        optimizer=optim,
        learning_rate=LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
        weights_precision={"fp32": SparseType.FP32, "fp16": SparseType.FP16}[TABLE_DTYPE],
        device=torch.device("cpu"),
    )

    def host_prep(b):  # table-major: all of table 0's samples, then table 1's, ...
        ids = torch.from_numpy(np.concatenate([v for v, _ in b]).astype(np.int64))
        lengths = np.concatenate([l for _, l in b])
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return ids, torch.from_numpy(offsets)

    inputs = [host_prep(b) for b in batches]
    nb = len(inputs)

    def device_step(x):
        out = tbe(x[0], x[1])  # [B, T * D]
        loss = 0.5 * (out * out).sum() / B
        loss.backward()  # the fused optimizer updates the touched rows here

    enq, dev, setup_hwm = time_steps(
        args, batches, inputs, host_prep, device_step, reset_before_steps=True
    )
    step_hwm, _ = rss_status()

    def e2e(prefetch: bool):
        """Seconds a step from the raw ids: FBGEMM's input preparation (ids to int64,
        offsets) then the step, serially or with the preparation in a thread ahead
        (`thread_prefetch`, as `MeshEmbedding.prefetch`: 2 batches ahead)."""
        src = (batches[i % nb] for i in range(args.steps))
        t = time.perf_counter()
        for x in thread_prefetch(host_prep, src) if prefetch else map(host_prep, src):
            device_step(x)
        return (time.perf_counter() - t) / args.steps

    reset_peak()
    e2e_serial = e2e(False)
    e2e_prefetch = e2e(True)
    e2e_hwm, rss = rss_status()
    state_bytes = sum(p.numel() * p.element_size() for p in tbe.split_embedding_weights())
    state_bytes += sum(
        s.numel() * s.element_size() for st in tbe.split_optimizer_states() for s in st
    )
    more = dict(
        # FBGEMM's better way (its preparation is ~1 ms: a thread may not pay)
        e2e=[min(e2e_serial, e2e_prefetch)],
        e2e_serial=[e2e_serial],
        e2e_prefetch=[e2e_prefetch],
        e2e_hwm=e2e_hwm,
        threads=torch.get_num_threads(),
    )
    return step_result(enq, dev, setup_hwm, step_hwm, rss, state_bytes, 1, **more)


def child_torch(args, batches):
    """torch's `EmbeddingBag(sparse=True)` per table (sum) and a sparse optimizer: SGD,
    Adagrad or SparseAdam for --optimizer's sgd, adagrad, adam; torch has no sparse
    FTRL or Adagrad-with-momentum, so those (and rowwise_adagrad) run torch's Adagrad,
    the nearest sparse rule (same per-row memory traffic as Adagrad)."""
    import numpy as np
    import torch

    bags = torch.nn.ModuleList(
        [torch.nn.EmbeddingBag(V, D, mode="sum", sparse=True) for _ in range(T)]
    )
    name = bench_optimizer_name()
    params = list(bags.parameters())
    if name == "sgd":
        opt = torch.optim.SGD(params, lr=LR)
    elif name == "adam":
        opt = torch.optim.SparseAdam(params, lr=LR)
    else:
        opt = torch.optim.Adagrad(params, lr=LR, initial_accumulator_value=0.1)

    def host_prep(b):
        out = []
        for v, l in b:
            offsets = np.zeros(l.size, np.int64)
            np.cumsum(l[:-1], out=offsets[1:])
            out.append((torch.from_numpy(v.astype(np.int64)), torch.from_numpy(offsets)))
        return out

    inputs = [host_prep(b) for b in batches]

    def device_step(x):
        opt.zero_grad(set_to_none=True)
        loss = sum(0.5 * (bag(i, o) ** 2).sum() for bag, (i, o) in zip(bags, x)) / B
        loss.backward()
        opt.step()

    enq, dev, setup_hwm = time_steps(args, batches, inputs, host_prep, device_step)
    step_hwm, rss = rss_status()
    state_bytes = sum(p.numel() * p.element_size() for p in params)
    for st in opt.state.values():
        state_bytes += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return step_result(
        enq, dev, setup_hwm, step_hwm, rss, state_bytes, 1, threads=torch.get_num_threads()
    )


# ---------------------------------------------------------------------------
# Profile: embedmesh's step, piece by piece (1 device), kernels vs XLA


def child_profile(args, batches):
    """The profile child: each piece of embedmesh's step timed alone, args.rounds times."""
    import numpy as np

    from embedmesh.device.ops import cpu

    s = profile_arrays(batches)
    times = PieceTimes()
    for _ in range(args.rounds):
        profile_round(s, times, args.steps)
    emb = s.emb
    emb.state = type(emb.state)(
        {s.stack: s.tab}, {s.stack: {"accumulators": s.acc}}, emb.state.step
    )
    return dict(
        pieces=times.medians(),
        U=s.U,
        P=s.P,
        R=s.R,
        n_unique=s.n_unique,
        n_pairs=int(np.asarray(s.csr.pair_counts).sum()),
        kernels=cpu.ready(),
        note="'kernel' = embedmesh.device.ops; "
        "'xla' = the pure-JAX path; pieces without a kernel are XLA either way",
    )


class PieceTimes:
    """The profile's samples: piece name -> {"kernel": [seconds], "xla": [seconds]}."""

    def __init__(self):
        self.samples = {}

    def add(self, name, kind, value):
        self.samples.setdefault(name, {"kernel": [], "xla": []})[kind].append(value)

    def medians(self) -> dict:
        return {
            k: {kk: statistics.median(vv) if vv else None for kk, vv in v.items()}
            for k, v in self.samples.items()
        }


def profile_arrays(batches):
    """embedmesh's state and the first batch's CSR (its first stack, device 0) as the
    profile's inputs; tab, acc, g_u, htab and hacc are donated and replaced as it runs."""
    import jax.numpy as jnp
    import numpy as np

    emb, feats, caps = embedmesh_setup(batches)
    c = list(emb.enqueue(feats[0]).values())[0]
    u, pr, pu, pg = (
        np.asarray(x)[0] for x in (c.unique_ids, c.pair_rows, c.pair_unique, c.pair_gains)
    )
    u, pr, pu, pg = (jnp.asarray(x) for x in (u, pr, pu, pg))
    R, U = c.rows_per_device, u.shape[1]
    return types.SimpleNamespace(
        emb=emb,
        feats=feats,
        caps=caps,
        csr=c,
        stack=c.stack,
        tab=emb.state.tables[c.stack],
        acc=emb.state.slots[c.stack]["accumulators"],
        htab=None,  # tab and acc on transparent huge pages, copied in the first round
        hacc=None,
        u=u,
        R=R,
        U=U,
        P=pr.shape[1],
        n_unique=int(np.asarray(c.unique_counts).sum()),
        opt=emb.core.optimizer_of(c.stack),
        rows=jnp.full((U, D), 0.01, jnp.float32),
        g_u=jnp.full((U, D), 1e-3, jnp.float32),
        act_g=jnp.full((R, D), 1e-3, jnp.float32),
        flat_u=u.reshape(-1),
        flat_pu=pu.reshape(-1),
        flat_pr=pr.reshape(-1),
        flat_pg=pg.reshape(-1),
    )


def median_time(f, a, steps):
    """Median time of `f(*a)` over `steps` calls, after one untimed call."""
    import jax

    jax.block_until_ready(f(*a))
    return statistics.median(timed(lambda: jax.block_until_ready(f(*a)), steps))


def median_time_donated(f, state, rest, steps):
    """Median time of `state = f(*state, *rest)` (state donated, updated in place)."""
    import jax

    state = f(*state, *rest)
    jax.block_until_ready(state)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state = f(*state, *rest)
        jax.block_until_ready(state)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), state


def time_pieces(times, pieces, steps):
    """Time each piece {name: (kernel version, XLA version, args)}; None: no such version."""
    import jax

    for name, (k, x, a) in pieces.items():
        if k is not None:
            times.add(name, "kernel", median_time(jax.jit(k), a, steps))
        if x is not None:
            times.add(name, "xla", median_time(jax.jit(x), a, steps))


def lookup_one_shard(R):
    """The 1-shard lookup (combine P pairs straight from the table): (kernel, XLA)."""
    from embedmesh.device import ops as J
    from embedmesh.device.ops import reference as Ref

    return (
        lambda t, m, i, g, d: J.segment_gather_sum(t, i, g, d, R, src_map=m),
        lambda t, m, i, g, d: Ref.segment_gather_sum(
            Ref.gather_rows(t, m), i, g, d, num_segments=R
        ),
    )


def profile_pieces(s) -> dict:
    """The pieces timed alone: {name: (kernel version, XLA version, args)}."""
    import jax
    import jax.numpy as jnp

    from embedmesh.device import ops as J
    from embedmesh.device.ops import reference as Ref

    R, U, opt, rows, g_u, act_g = s.R, s.U, s.opt, s.rows, s.g_u, s.act_g
    return {
        "lookup, 1 shard: combine P pairs from the table": (
            *lookup_one_shard(R),
            (s.tab, s.flat_u, s.flat_pu, s.flat_pg, s.flat_pr),
        ),
        "lookup, N shards: gather U unique rows": (
            J.gather_rows,
            Ref.gather_rows,
            (s.tab, s.flat_u),
        ),
        "lookup, N shards: combine P pairs -> R rows": (
            lambda r, i, g, d: J.segment_gather_sum(r, i, g, d, R),
            lambda r, i, g, d: Ref.segment_gather_sum(r, i, g, d, num_segments=R),
            (rows, s.flat_pu, s.flat_pg, s.flat_pr),
        ),
        "backward: P pairs -> U grads": (
            lambda a, i, g, d: J.segment_gather_sum(a, i, g, d, U),
            lambda a, i, g, d: Ref.segment_gather_sum(a, i, g, d, num_segments=U),
            (act_g, s.flat_pr, s.flat_pg, s.flat_pu),
        ),
        "owner dedup, 1 list (XLA: sorted check+cond)": (J.dedup_sum, Ref.dedup_sum, (s.u, g_u)),
        "owner dedup, sort + segment sum (old path)": (None, Ref.dedup_sum_by_sort, (s.u, g_u)),
        "owner: optimizer math alone (Adagrad, XLA)": (
            None,
            lambda r, a, g: opt.update_rows(r, {"accumulators": a}, g, jnp.int32(1)),
            (rows, rows, g_u),
        ),
        "cond + isfinite over the activations' grads": (
            None,
            lambda g: jax.lax.cond(jnp.all(jnp.isfinite(g)), lambda x: x + 0, lambda x: x, g),
            (act_g,),
        ),
    }


def profile_round(s, times, steps):
    """One round of the profile: every piece once, in the same order each round."""
    import jax

    from embedmesh.device import ops as J

    time_pieces(times, profile_pieces(s), steps)
    # in place in the step (the backward's output is dead after it): donate here too
    v, (s.g_u,) = median_time_donated(
        jax.jit(lambda g, i: (J.dedup_sum(i, g)[1],), donate_argnums=0), (s.g_u,), (s.u,), steps
    )
    times.add("owner dedup, 1 list, in place", "kernel", v)
    updates = owner_updates(s.opt)
    name = "owner update: gather, Adagrad, scatter (in place)"
    s.tab, s.acc = time_owner_update(times, name, updates, (s.tab, s.acc), s, steps)
    # the same on tables and slots moved to transparent huge pages
    if s.htab is None:
        s.htab, s.hacc = jax.block_until_ready((J.huge_page_copy(s.tab), J.huge_page_copy(s.acc)))
    time_pieces(
        times,
        {
            "lookup, 1 shard: combine P pairs, huge pages": (
                *lookup_one_shard(s.R),
                (s.htab, s.flat_u, s.flat_pu, s.flat_pg, s.flat_pr),
            )
        },
        steps,
    )
    name = "owner update (in place), huge pages"
    s.htab, s.hacc = time_owner_update(times, name, updates, (s.htab, s.hacc), s, steps)
    profile_backward_update(s, times, steps)
    profile_host(s, times, steps)


def owner_updates(opt):
    """The owner's in-place update (tables and accumulators donated): (kernel, XLA)."""
    import jax
    import jax.numpy as jnp

    from embedmesh.device import ops as J

    def kernel(t, a, i, g):
        t, s_ = J.sparse_update(opt, t, {"accumulators": a}, i, g, jnp.int32(1))
        return t, s_["accumulators"]

    def xla(t, a, i, g):
        t, s_ = J.reference_of("sparse_update")(
            t, {"accumulators": a}, i, g, optimizer=opt, step=jnp.int32(1)
        )
        return t, s_["accumulators"]

    return jax.jit(kernel, donate_argnums=(0, 1)), jax.jit(xla, donate_argnums=(0, 1))


def time_owner_update(times, name, updates, state, s, steps):
    """Time both owner updates on `state` (table, accumulators); returns the new state."""
    kernel, xla = updates
    v, state = median_time_donated(kernel, state, (s.flat_u, s.g_u), steps)
    times.add(name, "kernel", v)
    # the XLA version must not see the kernels: run it with them switched off
    with kernels_off():
        v, state = median_time_donated(xla, state, (s.flat_u, s.g_u), steps)
    times.add(name, "xla", v)
    return state


def profile_backward_update(s, times, steps):
    """The whole owner side (1 shard): backward + dedup + update, unfused vs fused."""
    import jax
    import jax.numpy as jnp

    from embedmesh.device import ops as J

    opt, U = s.opt, s.U

    def unfused(t, a, ag, pr_, pu_, pg_, i):
        per = J.segment_gather_sum(ag, pr_, pg_, pu_, U)
        uq, g = J.dedup_sum(i[None], per)
        t, s_ = J.sparse_update(opt, t, {"accumulators": a}, uq, g, jnp.int32(1))
        return t, s_["accumulators"]

    def fused(t, a, ag, pr_, pu_, pg_, i):
        t, s_ = J.backward_update(opt, t, {"accumulators": a}, i, ag, pr_, pu_, pg_, jnp.int32(1))
        return t, s_["accumulators"]

    name = "backward+dedup+update, huge pages"
    bu_args = (s.act_g, s.flat_pr, s.flat_pu, s.flat_pg, s.flat_u)
    for label, f in ((" (unfused kernels)", unfused), (" (fused kernel)", fused)):
        v, (s.htab, s.hacc) = median_time_donated(
            jax.jit(f, donate_argnums=(0, 1)), (s.htab, s.hacc), bu_args, steps
        )
        times.add(name + label, "kernel", v)


def profile_host(s, times, steps):
    """The host side: preprocessing one batch, and its CSR's transfer to the device."""
    import jax

    from embedmesh.host import preprocess as pre

    def preprocess():
        return pre.preprocess_features(s.feats[0], None, s.emb.plan, capacities=s.caps)

    times.add("host: preprocess (numba)", "kernel", statistics.median(timed(preprocess, steps)))
    arrays = preprocess()[0]
    put = timed(lambda: jax.block_until_ready(s.emb.core.put(arrays)), steps)
    times.add("host -> device transfer of the CSR", "kernel", statistics.median(put))


# ---------------------------------------------------------------------------
# Parent


def pin_to_core(core: int) -> None:
    """This process on one core (before jax starts its threads)."""
    usable = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {usable[core % len(usable)]})


def child_processes(args):
    """embedmesh-2proc: launch the two processes, wait, merge their results."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env("embedmesh")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    ).strip()
    procs = [
        subprocess.Popen(
            child_cmd("embedmesh-2proc-worker", args, "--proc-id", str(i), "--port", str(port)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        res = next((json.loads(l[7:]) for l in out.splitlines() if l.startswith("RESULT ")), None)
        if res is None:
            raise RuntimeError(f"a process of embedmesh-2proc failed:\n{(err or out)[-1500:]}")
        outs.append(res)
    merged = dict(outs[0])
    for key in ("enqueue", "device", "e2e"):  # the job is as fast as its slower process
        merged[key] = [max(a, b) for a, b in zip(outs[0][key], outs[1][key])]
    for key in ("setup_hwm", "step_hwm", "e2e_hwm", "rss", "state_bytes"):
        merged[key] = max(outs[0][key], outs[1][key])
    merged["ids"] = outs[0]["ids"] + outs[1]["ids"]
    merged["processes"] = outs
    return merged


def child_process_worker(args):
    """One process of embedmesh-2proc: pinned to core `proc_id`, its own batches."""
    pin_to_core(args.proc_id)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2, process_id=args.proc_id
    )
    every = [make_batches(args.seed, stream=1 + i) for i in range(2)]
    mine = every[args.proc_id]
    # capacities from both processes' batches: the same program in both
    res = child_embedmesh(args, mine, capacity_batches=[b for bs in every for b in bs])
    res["ids"] = statistics.mean(sum(int(l.sum()) for _, l in b) for b in mine)
    jax.distributed.shutdown()
    return res


def child_main(args):
    name = args.child
    if name == "embedmesh-2proc":
        print("RESULT " + json.dumps(child_processes(args)), flush=True)
        return
    if name == "embedmesh-2proc-worker":
        print("RESULT " + json.dumps(child_process_worker(args)), flush=True)
        return
    if name == "embedmesh-1core":
        pin_to_core(0)
        batches = make_batches(args.seed, stream=1)  # the batches of process 0 of 2proc
    else:
        batches = make_batches(args.seed)
    if name.startswith("fbgemm"):
        res = child_fbgemm(args, batches)
    elif name == "torch":
        res = child_torch(args, batches)
    elif name == "plain-jax":
        res = child_plain(args, batches)
    elif name == "profile":
        res = child_profile(args, batches)
    else:
        res = child_embedmesh(args, batches)
    res["ids"] = statistics.mean(sum(int(l.sum()) for _, l in b) for b in batches)
    print("RESULT " + json.dumps(res), flush=True)


def child_env(peer):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = env.get("XLA_FLAGS", "")
    if peer in ("embedmesh-2dev", "embedmesh-4dev"):
        flags += f" --xla_force_host_platform_device_count={peer[-4]}"
    env["XLA_FLAGS"] = flags.strip()
    if peer == "embedmesh-xla":
        env["EMBEDMESH_CPU_KERNELS"] = "0"
    if peer == "embedmesh-pipelined":
        env["EMBEDMESH_BENCH_PIPELINED"] = "1"
    if peer == "embedmesh-base":
        env["EMBEDMESH_BENCH_SPARSE_OPS"] = BASELINE
    return env


# Peak RSS of each child (GB, measured here), to wait for or skip a child rather than push a
# shared machine into the OOM killer.
NEEDS_GB = {"plain-jax": 9.0, "fbgemm-exact": 4.5, "fbgemm-rowwise": 2.5, "torch": 6.0}


def mem_available_gb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def child_cmd(peer, args, *extra) -> list:
    """The command line of one child process of this script."""
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    return [sys.executable, os.path.abspath(__file__), "--child", peer, *common, *extra]


def run_child(peer, args):
    need = NEEDS_GB.get(peer.partition(":")[0], 7.0) * min(1.0, args.vocab / 1_000_000) + 0.5
    waited = 0
    while mem_available_gb() < need and waited < args.mem_wait:
        time.sleep(10)
        waited += 10
    if mem_available_gb() < need:
        return None, (
            f"skipped: needs ~{need:.1f} GB, {mem_available_gb():.1f} GB available "
            f"after waiting {waited} s"
        )
    peer, _, optimizer = peer.partition(":")  # "embedmesh:adam": with that optimizer
    base, _, strategy = peer.partition("@")  # "embedmesh-2proc@mod": that peer, one strategy
    env = child_env(base)
    if strategy:
        env["EMBEDMESH_BENCH_SHARDING"] = strategy
    if optimizer:
        env["EMBEDMESH_BENCH_OPTIMIZER"] = optimizer
    cmd = child_cmd(base, args, "--rounds", str(args.rounds))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), None
    return None, (r.stderr or r.stdout)[-1500:]


def fbgemm_importable():
    code = (
        "import logging; logging.disable(logging.WARNING); "
        "from fbgemm_gpu.split_table_batched_embeddings_ops_training import "
        "SplitTableBatchedEmbeddingBagsCodegen"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip().splitlines()[-1:] if r.returncode else ""


def gb(x):
    return f"{x / 2**30:.2f}"


@contextlib.contextmanager
def kernels_off():
    """Trace with embedmesh's CPU kernels switched off (the pure-JAX path)."""
    from embedmesh import _runtime

    saved = _runtime.cpu_kernels_setting
    _runtime.cpu_kernels_setting = lambda: False
    try:
        yield
    finally:
        _runtime.cpu_kernels_setting = saved


def print_profile(res):
    print(
        f"\nwhere embedmesh's step goes (1 device): U={res['U']} unique slots "
        f"({res['n_unique']} used), P={res['P']} pair slots ({res['n_pairs']} used), "
        f"R={res['R']} activation rows; medians, ms; kernels available: {res['kernels']}"
    )
    print(f"  {'piece':54s} {'CPU kernel':>10s} {'XLA':>8s} {'ratio':>6s}")
    for name, v in res["pieces"].items():
        k, x = v.get("kernel"), v.get("xla")
        ratio = f"{x / k:5.1f}x" if k and x else ""
        print(
            f"  {name:54s} {k * 1e3 if k else float('nan'):10.1f} "
            f"{x * 1e3 if x else float('nan'):8.1f} {ratio:>6s}"
        )


def build_parser():
    """The script's options (the hidden ones are the children's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per child")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument(
        "--mem-wait",
        type=int,
        default=300,
        help="seconds to wait for enough free memory before skipping a child",
    )
    ap.add_argument("--profile", action="store_true", help="profile embedmesh's step instead")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument(
        "--sharding",
        default="auto",
        help="embedmesh's strategy for every table: auto (the planner's pick), mod, "
        "row_wise_pooled or table_wise",
    )
    ap.add_argument(
        "--vocab",
        type=int,
        default=V,
        help="rows of each table (default %(default)s; e.g. 100: tiny multi-hot tables, "
        "where data_parallel replication is the planner's pick)",
    )
    ap.add_argument("--trace", help="write a perfetto trace of 4 steps of each peer here")
    ap.add_argument(
        "--baseline",
        help="path of an older embedmesh/device/shard_program.py: "
        "adds the peer "
        "embedmesh-base, embedmesh run with it (measures the gain of this one)",
    )
    ap.add_argument(
        "--optimizer",
        default="adagrad",
        help="the optimizer of every peer, or several (comma-separated): each peer then "
        "runs once with each, as PEER:OPTIMIZER, in the same interleaved rounds, of "
        + ", ".join(OPTIMIZERS)
        + "; FBGEMM's CPU kernels have sgd, adagrad and rowwise_adagrad only (its peers "
        "are skipped for the others); the torch peer runs SGD, SparseAdam or Adagrad",
    )
    ap.add_argument("--dim", type=int, default=D, help="each table's dim (default 64)")
    ap.add_argument(
        "--table-dtype",
        choices=("fp32", "fp16"),
        default="fp32",
        help="the tables' storage type, embedmesh's and FBGEMM's (fp16: embedmesh's "
        "TableConfig(dtype=float16), stochastically rounded updates; FBGEMM's "
        "weights_precision FP16); e.g. --peers embedmesh,fbgemm-rowwise "
        "--optimizer rowwise_adagrad --table-dtype fp16",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--proc-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main():
    args = build_parser().parse_args()
    if not args.child:  # the children's (child_env); a child keeps the one it was given
        os.environ["EMBEDMESH_BENCH_SHARDING"] = args.sharding
        os.environ["EMBEDMESH_BENCH_VOCAB"] = str(args.vocab)
        os.environ["EMBEDMESH_BENCH_DIM"] = str(args.dim)
        os.environ["EMBEDMESH_BENCH_TABLE_DTYPE"] = args.table_dtype
    if args.trace and not args.child:
        os.environ["EMBEDMESH_BENCH_TRACE"] = os.path.abspath(args.trace)
    if args.child:
        return child_main(args)

    import platform

    print(
        f"python {platform.python_version()}, {os.cpu_count()} cpus, load "
        f"{os.getloadavg()[0]:.1f}; workload {T} tables x {args.vocab} rows x {args.dim}, "
        f"{args.table_dtype}, batch {B}, "
        f"~{VALENCY} ids/sample Zipf({ZIPF_A}), sum, Adagrad"
    )
    if args.profile:
        return main_profile(args)
    optimizers = [o for o in args.optimizer.split(",") if o]
    peers = chosen_peers(args, optimizers)
    results = run_rounds(args, peers)
    rows = summary_rows(peers, results)
    print_summary(args, peers, rows, results)
    print_ratios(rows)
    print_against_fbgemm(results)
    print_scale_out(rows, results)
    print_optimizer_ratios(results, optimizers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "raw": results}, f, indent=1)


def main_profile(args):
    """--profile: the profile child's pieces, printed (and written to --json)."""
    res, err = run_child("profile", args)
    if res is None:
        sys.exit(f"profile failed:\n{err}")
    print_profile(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def chosen_peers(args, optimizers) -> list:
    """The peers to run: --peers, once per optimizer, with --baseline's, less FBGEMM's
    where it does not import."""
    peers = [p for p in args.peers.split(",") if p]
    bad = [o for o in optimizers if o not in OPTIMIZERS]
    if bad:
        sys.exit(f"--optimizer: unknown {bad}; one or more of {', '.join(OPTIMIZERS)}")
    if optimizers != ["adagrad"]:
        peers = [  # a peer named PEER:OPT already runs that optimizer only
            p if ":" in p else f"{p}:{o}"
            for p in peers
            for o in ([None] if ":" in p else optimizers)
            if ":" in p
            or not (p == "fbgemm-exact" and o not in FBGEMM_OPTIM)
            and not (p == "fbgemm-rowwise" and o != "rowwise_adagrad")
        ]
    if args.baseline:
        global BASELINE
        BASELINE = os.path.abspath(args.baseline)
        if "embedmesh-base" not in peers:
            peers.append("embedmesh-base")
    if any(p.startswith("fbgemm") for p in peers):
        ok, why = fbgemm_importable()
        if not ok:
            print(f"FBGEMM not importable ({why}): its peers are skipped")
            peers = [p for p in peers if not p.startswith("fbgemm")]
    return peers


def run_rounds(args, peers) -> dict:
    """Each peer's child once a round, in interleaved rounds (the peer order rotated each
    round): {peer: [each round's result]}."""
    results = {p: [] for p in peers}
    for rnd in range(args.rounds):
        order = peers[rnd % len(peers) :] + peers[: rnd % len(peers)]
        for p in order:
            t = time.perf_counter()
            res, err = run_child(p, args)
            if res is None:
                print(f"  round {rnd}: {p} failed:\n{err}")
                continue
            results[p].append(res)
            step_ms = statistics.median(res["device"]) * 1e3
            pre = f", preprocessing {res['preprocess']}" if "preprocess" in res else ""
            print(
                f"  round {rnd}: {p:15s} device step {step_ms:8.1f} ms "
                f"({time.perf_counter() - t:.0f} s with setup), load "
                f"{os.getloadavg()[0]:.1f}{pre}",
                flush=True,
            )
    return results


def summary_rows(peers, results) -> dict:
    """Each peer's medians over the rounds (of its children's medians), rates and peaks."""

    def med(p, key, of=statistics.median):
        vals = [of(r[key]) for r in results[p] if key in r]
        return statistics.median(vals) if vals else None

    rows = {}
    for p in peers:
        if not results[p]:
            continue
        first = results[p][0]
        ids = first["ids"]
        dev, enq, e2e = med(p, "device"), med(p, "enqueue"), med(p, "e2e")
        best = med(p, "device", min)
        rows[p] = dict(
            ids=ids,
            device=dev,
            enqueue=enq,
            e2e=e2e,
            device_best=best,
            ids_s=ids / dev,
            ids_s_best=ids / best,
            ids_s_e2e=ids / e2e if e2e else None,
            ids_s_serial=ids / (dev + enq),
            setup_hwm=max(r["setup_hwm"] for r in results[p]),
            step_hwm=max(r["step_hwm"] for r in results[p]),
            e2e_hwm=max((r["e2e_hwm"] for r in results[p] if "e2e_hwm" in r), default=None),
            state_bytes=first["state_bytes"],
            exchange_bytes=first.get("exchange_bytes"),
            mod_exchange_bytes=first.get("mod_exchange_bytes"),
            strategies=first.get("strategies"),
        )
    return rows


def print_summary(args, peers, rows, results):
    """The table of each peer's times, rates and memory."""
    ids = next(iter(rows.values()))["ids"] if rows else 0
    print(
        f"\n{ids / 1e3:.0f}k ids per step; medians over {len(results[peers[0]])} rounds of each "
        f"child's median (and, as 'best', of its fastest) of {args.steps} steps"
    )
    print(
        f"  {'peer':15s} {'host prep':>9s} {'device':>9s} {'M ids/s':>8s} {'best':>9s} "
        f"{'M ids/s':>8s} {'e2e prefetch':>12s} {'M ids/s':>8s} {'tables+slots':>12s} "
        f"{'peak setup':>10s} {'peak steps':>10s} {'peak e2e':>10s}"
    )
    for p, r in rows.items():
        e2e = f"{r['e2e'] * 1e3:9.1f} ms" if r["e2e"] else f"{'-':>12s}"
        e2e_ids = f"{r['ids_s_e2e'] / 1e6:8.2f}" if r["ids_s_e2e"] else f"{'-':>8s}"
        print(
            f"  {p:15s} {r['enqueue'] * 1e3:6.1f} ms {r['device'] * 1e3:6.1f} ms "
            f"{r['ids_s'] / 1e6:8.2f} {r['device_best'] * 1e3:6.1f} ms "
            f"{r['ids_s_best'] / 1e6:8.2f} {e2e} {e2e_ids} {gb(r['state_bytes']):>9s} GB "
            f"{gb(r['setup_hwm']):>7s} GB {gb(r['step_hwm']):>7s} GB "
            + (f"{gb(r['e2e_hwm']):>7s} GB" if r["e2e_hwm"] else f"{'-':>10s}")
        )


def print_ratios(rows):
    """Each embedmesh peer's device-step rate against the reference peers'."""
    print("\nratios of device-step ids/s (row peer / column peer):")
    refs = [
        p for p in ("plain-jax", "fbgemm-exact", "fbgemm-rowwise", "embedmesh-xla") if p in rows
    ]
    for p in rows:
        if p in ("plain-jax",) or p.startswith("fbgemm"):
            continue
        print(
            f"  {p:15s} "
            + "  ".join(
                f"vs {q}: {rows[p]['ids_s'] / rows[q]['ids_s']:5.2f}x "
                f"(best {rows[p]['ids_s_best'] / rows[q]['ids_s_best']:4.2f}x)"
                for q in refs
                if q != p
            )
        )


def print_against_fbgemm(results):
    """Each embedmesh peer against each FBGEMM peer of the same optimizer (the same
    tables, slots and batches): medians of per-round ratios of the device step, of the
    end to end from raw ids with prefetch (FBGEMM: its own preparation, serial or in a
    thread ahead, the faster), and of the peak RSS of each phase (FBGEMM / embedmesh
    for times: > 1 is embedmesh faster; embedmesh / FBGEMM for memory: < 1 is smaller)."""

    def of(peer):
        name, _, opt = peer.partition(":")
        return name, opt or bench_optimizer_name()

    lines = []
    for p in results:
        name, opt = of(p)
        if not name.startswith("embedmesh") or "@" in name:
            continue
        for q in results:
            qname, qopt = of(q)
            if not qname.startswith("fbgemm") or qopt != opt:
                continue
            if qname == "fbgemm-rowwise" and opt != "rowwise_adagrad" and ":" in p:
                continue
            pairs = list(zip(results[p], results[q]))
            cols = []
            for what, key, inverse in (
                ("device step", "device", True),
                ("e2e prefetch", "e2e", True),
                ("peak RSS steps", "step_hwm", False),
                ("peak RSS e2e", "e2e_hwm", False),
            ):
                vals = []
                for a, b in pairs:
                    if key not in a or key not in b:
                        continue
                    x, y = a[key], b[key]
                    if isinstance(x, list):
                        x, y = statistics.median(x), statistics.median(y)
                    vals.append(y / x if inverse else x / y)
                if vals:
                    rounds = " / ".join(f"{v:.2f}" for v in vals)
                    cols.append(f"{what} {statistics.median(vals):.2f}x ({rounds})")
            if cols:
                lines.append(f"  {p} vs {q}: " + "; ".join(cols))
    if lines:
        print(
            "\nagainst FBGEMM, medians of per-round ratios (times: FBGEMM / embedmesh; "
            "peak RSS: embedmesh / FBGEMM):"
        )
        print("\n".join(lines))


def print_optimizer_ratios(results, optimizers):
    """With several --optimizer: each embedmesh optimizer's device step against its
    Adagrad's, and each peer's step against embedmesh's of the same optimizer, as medians
    of per-round ratios (the rounds interleave the children)."""
    if len(optimizers) < 2 and optimizers == ["adagrad"]:
        return

    def per_round(a, b):  # median over rounds of step(a) / step(b)
        ra, rb = results.get(a, []), results.get(b, [])
        vals = [
            statistics.median(x["device"]) / statistics.median(y["device"]) for x, y in zip(ra, rb)
        ]
        return (statistics.median(vals), len(vals)) if vals else (None, 0)

    print("\noptimizers: device-step time ratios, medians of per-round ratios")
    for o in optimizers:
        line = [f"  {o:17s}"]
        for num, den, what in (
            (f"embedmesh:{o}", "embedmesh:adagrad", "embedmesh step / its Adagrad step"),
            (f"torch:{o}", f"embedmesh:{o}", "torch / embedmesh"),
            (f"fbgemm-exact:{o}", f"embedmesh:{o}", "FBGEMM / embedmesh"),
            (f"fbgemm-rowwise:{o}", f"embedmesh:{o}", "FBGEMM rowwise / embedmesh"),
        ):
            r, n = per_round(num, den)
            if r is not None and num != den:
                line.append(f"{what} {r:.2f}x ({n} rounds)")
        print(";  ".join(line))


def print_scale_out(rows, results):
    """N devices against 1 on the same global batch (step time), and 2 processes against
    1 process on one core (global ids/s: weak scaling), as medians of per-round ratios;
    and the bytes each device sends through a row exchange."""
    pairs = [
        ("embedmesh-2dev", "embedmesh", "step time, 2 devices / 1 (same global batch)"),
        ("embedmesh-4dev", "embedmesh", "step time, 4 devices / 1 (same global batch)"),
        ("embedmesh-2proc", "embedmesh-1core", "weak scaling, ids/s of 2 processes / 1 core"),
    ]
    # the same comparisons for the peers run under one strategy ("embedmesh-2proc@mod")
    pairs += [
        (p, b, f"{what} ({p.partition('@')[2]})")
        for p in rows
        if "@" in p
        for a, b, what in pairs
        if p.partition("@")[0] == a
    ]
    lines = []
    for a, b, what in pairs:
        if a not in rows or b not in rows:
            continue
        per_round = []
        for ra, rb in zip(results[a], results[b]):
            ta, tb = statistics.median(ra["device"]), statistics.median(rb["device"])
            if a.partition("@")[0].endswith("2proc"):
                per_round.append((ra["ids"] / ta) / (rb["ids"] / tb))
            else:
                per_round.append(ta / tb)
        if per_round:
            rounds = " / ".join(f"{x:.2f}" for x in per_round)
            lines.append(f"  {what}: {statistics.median(per_round):.2f}x (rounds {rounds})")
    for p, r in rows.items():
        if r.get("mod_exchange_bytes"):
            sent, mod = r["exchange_bytes"], r["mod_exchange_bytes"]
            lines.append(
                f"  {p}: {r['strategies']} sends {sent / 1e6:.1f} MB per device per step at its "
                f"capacities; the row exchange (mod) {mod / 1e6:.1f} MB: "
                f"{mod / max(sent, 1):.2f}x fewer"
            )
    if lines:
        print("\nscale-out (medians of per-round ratios):")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
