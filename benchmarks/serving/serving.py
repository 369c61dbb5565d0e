"""Serving lookup throughput (ids/s): embedmesh vs TensorFlow vs torch, one process.

Workload (the issue's): 8 features, each on its own table of 1M x 64 float32;
batch 4096; ~10 ids per sample (ragged, Poisson(10) lengths); ids drawn from a
Zipf(1.05) law over the 1M ranks, ranks mapped to ids by a random permutation
per table. Input forms: ragged (default), sparse (the same batch as a
[batch, max_len] SparseTensor) and dense ([batch, 10]: a plain lookup, no
combiner). Combiners: sum and mean (`--combiners`; sqrtn too: torch runs it as its
sum with per-sample weights, see torch_contender). A grid of table mixes, dims, batch
sizes and threads against torch alone: serving_torch_sweep.py.

Contenders, run in the same process, interleaved round by round:
- embedmesh[numba]: `embedmesh.serving_embedding_lookup` on numpy inputs and
  numpy tables (the host path), kernel backend "numba" (when importable);
- embedmesh[numba-Nt]: the same with features spread over one thread per
  core (`embedmesh.serving.lookup.set_host_threads`, set before each timed call);
- embedmesh[numpy]: the same with the pure-numpy kernel backend;
- tf.function / tf.eager: `tf.tpu.experimental.embedding.serving_embedding_lookup`
  on tf.RaggedTensor / tf.SparseTensor / tf.Tensor inputs and tf.Variable
  tables (when TensorFlow is importable), on its default threads (every core), or
  on `--tf-threads` of them;
- torch[Nt] / torch[1t]: `torch.nn.functional.embedding_bag` (offsets form;
  one call per table) or `F.embedding` for dense inputs, under
  `torch.inference_mode`, on tables sharing the numpy tables' memory (when
  torch is importable), with torch's default intra-op threads (N = cores)
  and with one thread (`torch.set_num_threads`, set before each timed block:
  on this 2-core shared machine OpenMP's barrier makes 2 threads far slower).

Quantized tables (`--table-dtypes float32,int8,fp16`; embedmesh.serving.quantize_table,
made once per dim from the same float32 tables): embedmesh[native:int8] (and
[native:int8-Nt], ...) serve them; against them, beside torch's embedding_bag on the
float32 tables:
- torch-q8[Nt] / torch-q8[1t]: `torch.ops.quantized.embedding_bag_byte_rowwise_offsets`
  (FBGEMM's 8-bit row-wise kernel inside torch) on the very bytes embedmesh's int8
  tables hold (the same fused layout), one call per table;
- fbgemm-int8[..] / fbgemm-fp16[..]: FBGEMM's `IntNBitTableBatchedEmbeddingBagsCodegen`
  (fbgemm-gpu-cpu, when importable: see fbgemm_modules) over all 8 tables in one call,
  rows of its own layout filled at random (its timing does not depend on the values).

Inputs for every contender are built before timing. One timed sample is one
call over all 8 features on one batch. In each round the contenders take
turns call by call on the same batches (order shuffled), `--reps` passes over
the batches (with `--blocks`: each contender in turn runs its passes alone,
after an untimed one); TensorFlow, which reads its own copy of the tables,
runs its passes as such a block before or after the others' (see time_round;
`--tf-interleaved` interleaves it too); a round gives each contender's median seconds per
call, ratios are taken within a round, and the medians over rounds are
reported. Every contender's outputs are
checked against TensorFlow's (without TensorFlow: torch[1t]'s) with allclose; the max
abs diff is printed.

Environment: see benchmarks/serving/requirements-serving.txt. Run from the repo root:

    PYTHONPATH=. /tmp/benchenv/bin/python benchmarks/serving/serving.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import embedmesh as em
from embedmesh import _runtime
from embedmesh.serving import kernels
from embedmesh.serving import lookup as em_serving
from embedmesh.serving import settings as em_settings

try:
    import tensorflow as tf
except ImportError:
    tf = None
try:
    import torch
    import torch.nn.functional as F

    TORCH_THREADS = torch.get_num_threads()  # its default, before any contender sets it
except ImportError:
    torch = None


# ---------------------------------------------------------------------------
# Workload


def zipf_sampler(vocab: int, a: float, rng: np.random.Generator):
    """Draw ranks in [0, vocab) with P(rank k) proportional to (k + 1)^-a (bounded Zipf)."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]

    def draw(n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), vocab - 1)

    return draw


def make_workload(args, rng):
    draw = zipf_sampler(args.vocab, args.zipf, rng)
    perms = [rng.permutation(args.vocab) for _ in range(args.tables)]
    tables = make_tables(args, rng)
    batches = make_batches(args, rng, draw, perms)
    max_len = max(int(f["lengths"].max()) for b in batches for f in b)
    return tables, batches, max_len


def make_tables(args, rng) -> list:
    """`args.tables` float32 tables [vocab, dim] of standard normal values."""
    tables = []
    for _ in range(args.tables):
        if getattr(args, "aligned", False):  # rows on 64-byte lines (torch's own allocation)
            t = _runtime.aligned_empty((args.vocab, args.dim), np.float32, 64)
        else:  # numpy's: 16 bytes past a line
            t = np.empty((args.vocab, args.dim), np.float32)
        for lo in range(0, args.vocab, 1 << 18):  # chunked: no float64 temporary of 256 MB
            hi = min(lo + (1 << 18), args.vocab)
            t[lo:hi] = rng.standard_normal((hi - lo, args.dim), dtype=np.float32)
        tables.append(t)
    return tables


def make_batches(args, rng, draw, perms) -> list:
    """`args.batches` batches of `args.batch` samples, per feature (one a permutation in
    `perms`: Zipf ranks, drawn by `draw`, to ids) its ragged ids, row splits, lengths
    (Poisson(`args.ids_per_sample`)) and dense ids [batch, ids_per_sample]."""
    batches = []
    for _ in range(args.batches):
        feats = []
        for perm in perms:
            lengths = rng.poisson(args.ids_per_sample, args.batch)
            splits = np.zeros(args.batch + 1, np.int64)
            np.cumsum(lengths, out=splits[1:])
            ids = perm[draw(int(splits[-1]))].astype(np.int64)
            dense = perm[draw(args.batch * args.ids_per_sample)].astype(np.int64)
            feats.append(
                {
                    "ids": ids,
                    "splits": splits,
                    "lengths": lengths,
                    "dense": dense.reshape(args.batch, args.ids_per_sample),
                }
            )
        batches.append(feats)
    return batches


class Workload(NamedTuple):
    """make_workload's arrays with embedmesh's configs for them (see workload_at)."""

    tables: list  # numpy [vocab, dim] float32, one a feature
    batches: list  # per batch, per feature: {"ids", "splits", "lengths", "dense"}
    max_len: int  # the longest bag (a sparse input's dense_shape[1])
    names: list  # feature names f0, f1, ...
    by_config: dict  # {TableConfig: table}
    features: dict  # {name: FeatureConfig}


def workload_at(
    dim: int, tables: int = 8, vocab: int = 1_000_000, batch: int = 4096, combiner: str = "sum"
) -> Workload:
    """The default workload at `dim` (2 batches, seed 0, numpy's table layout) and
    embedmesh's configs for it: for the benchmarks that time one part of what this one
    compares."""
    args = argparse.Namespace(
        tables=tables, vocab=vocab, dim=dim, batch=batch, ids_per_sample=10, zipf=1.05,
        batches=2,
    )  # fmt: skip
    arrays, batches, max_len = make_workload(args, np.random.default_rng(0))
    names = [f"f{i}" for i in range(tables)]
    tcs = [em.TableConfig(vocab, dim, combiner=combiner, name=f"t{i}") for i in range(tables)]
    features = {n: em.FeatureConfig(tc, name=n) for n, tc in zip(names, tcs)}
    return Workload(arrays, batches, max_len, names, dict(zip(tcs, arrays)), features)


def each_dim(args, run_dim) -> None:
    """The machine, then `run_dim(args, dim)` for each of `args.dims` (comma-separated)."""
    print(machine_line())
    print(native_line())
    for dim in (int(d) for d in args.dims.split(",")):
        run_dim(args, dim)


def ids_in(kind: str, feats) -> int:
    if kind == "dense":
        return sum(f["dense"].size for f in feats)
    return sum(f["ids"].size for f in feats)


# ---------------------------------------------------------------------------
# Contenders: each is (name, prepare(kind, combiner) -> list of per-batch thunks)


def embedmesh_contender(tables, batches, max_len, args, backend, threads=1, shapes=None):
    """`tables` may be `QuantizedTable`s; `shapes`: per table (vocab, dim), default
    (args.vocab, args.dim) each. The kernel backend and threads are set in `setup`
    (untimed), and only when they change: each change makes the next call plan its
    request anew (~30 us, the cost of a first request, not of serving)."""
    names = [f"f{i}" for i in range(len(tables))]
    shapes = shapes or [(args.vocab, args.dim)] * len(tables)

    def setup():
        if kernels.get_backend() != backend:
            kernels.set_backend(backend)
        if em_settings.threads() != threads:
            em_serving.set_host_threads(threads)

    def prepare(kind, combiner):
        tcs = [
            em.TableConfig(vocab, dim, combiner=combiner, name=f"t{i}")
            for i, (vocab, dim) in enumerate(shapes)
        ]
        fcs = {n: em.FeatureConfig(tc, name=n) for n, tc in zip(names, tcs)}
        tabs = {tc: t for tc, t in zip(tcs, tables)}
        calls = Calls()
        calls.setup = setup
        for feats in batches:
            if kind == "ragged":
                inputs = {n: em.RaggedTensor(f["ids"], f["splits"]) for n, f in zip(names, feats)}
            elif kind == "sparse":
                inputs = {
                    n: em.SparseTensor(sparse_indices(f), f["ids"], (args.batch, max_len))
                    for n, f in zip(names, feats)
                }
            else:
                inputs = {n: f["dense"] for n, f in zip(names, feats)}

            def call(inputs=inputs):
                return ready(em.serving_embedding_lookup(inputs, None, tabs, fcs), names)

            calls.append(call)
        return calls

    return prepare


def ready(out: dict, names: list) -> list:
    """A lookup's outputs in `names`' order, once every one is computed (jax arrays, or
    numpy ones under `set_numpy_outputs`)."""
    for v in out.values():
        if hasattr(v, "block_until_ready"):
            v.block_until_ready()
    return [out[n] for n in names]


def torch_bags(feats: list) -> list:
    """Each feature's ids and bag offsets as torch tensors (embedding_bag's offsets form)."""
    return [(torch.from_numpy(f["ids"]), torch.from_numpy(f["splits"][:-1].copy())) for f in feats]


def sparse_indices(f) -> np.ndarray:
    splits, lengths = f["splits"], f["lengths"]
    rows = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)
    pos = np.arange(splits[-1], dtype=np.int64) - splits[:-1][rows]
    return np.stack([rows, pos], axis=1)


def tf_contender(tables, batches, max_len, args, use_function: bool):
    emb = tf.tpu.experimental.embedding
    variables = [tf.Variable(t, name=f"t{i}") for i, t in enumerate(tables)]
    names = [f"f{i}" for i in range(args.tables)]

    def prepare(kind, combiner):
        tcs = [
            emb.TableConfig(
                vocabulary_size=args.vocab, dim=args.dim, combiner=combiner, name=f"t{i}"
            )
            for i in range(args.tables)
        ]
        fcs = {n: emb.FeatureConfig(table=tc, name=n) for n, tc in zip(names, tcs)}
        tabs = {tc: v for tc, v in zip(tcs, variables)}

        def lookup(inputs):
            return emb.serving_embedding_lookup(inputs, None, tabs, fcs)

        fn = tf.function(lookup) if use_function else lookup
        calls = []
        for feats in batches:
            if kind == "ragged":
                inputs = {
                    n: tf.RaggedTensor.from_row_splits(f["ids"], f["splits"])
                    for n, f in zip(names, feats)
                }
            elif kind == "sparse":
                inputs = {
                    n: tf.SparseTensor(sparse_indices(f), f["ids"], [args.batch, max_len])
                    for n, f in zip(names, feats)
                }
            else:
                inputs = {n: tf.constant(f["dense"]) for n, f in zip(names, feats)}

            def call(inputs=inputs):
                out = fn(inputs)
                return [out[n] for n in names]

            calls.append(call)
        return calls

    return prepare


class Calls(list):
    """Per-batch thunks of one contender; `setup` runs (untimed) before each timed call."""

    setup = None


def torch_contender(tables, batches, max_len, args, threads: int, coo=False, sqrtn="call"):
    """torch's `embedding_bag` (dense: `embedding`) on the same tables. Ragged and sparse
    input both reach it as ids + bag offsets, given for free; with `coo` (sparse input
    only: torch-coo) it is handed what embedmesh and TensorFlow get, the COO indices,
    and derives the offsets from their rows itself (`bincount`, an exclusive `cumsum`;
    it checks nothing of the indices, where embedmesh checks each).

    torch has no sqrtn mode: sqrtn is its sum mode with per_sample_weights 1/sqrt(bag
    length) (`torch_sqrtn_weights`), which `sqrtn="call"` derives from the offsets in
    each call, as a torch user must (embedmesh's cost of the scale counts in its call
    too), and `sqrtn="given"` hands it ready-made, before timing (its weighted sum alone:
    the stricter bar)."""
    weights = [torch.from_numpy(t) for t in tables]  # shares the numpy tables' memory

    def prepare(kind, combiner):
        if coo and kind != "sparse":
            return None
        if coo:
            return _torch_coo_calls(batches, weights, combiner, threads, args.batch)
        calls = Calls()
        calls.setup = lambda: torch.set_num_threads(threads)
        for feats in batches:
            if kind == "dense":
                ins = [torch.from_numpy(f["dense"]) for f in feats]

                def call(ins=ins):
                    with torch.inference_mode():
                        return [F.embedding(x, w) for x, w in zip(ins, weights)]
            elif combiner == "sqrtn":
                ins = [
                    (x, o, torch_sqrtn_weights(o, x.shape[0]) if sqrtn == "given" else None)
                    for x, o in torch_bags(feats)
                ]

                def call(ins=ins):
                    with torch.inference_mode():
                        outs = []
                        for (x, o, scale), w in zip(ins, weights):
                            if scale is None:  # derived in the call
                                scale = torch_sqrtn_weights(o, x.shape[0])
                            outs.append(
                                F.embedding_bag(x, w, o, mode="sum", per_sample_weights=scale)
                            )
                        return outs
            else:
                ins = torch_bags(feats)

                def call(ins=ins):
                    with torch.inference_mode():
                        return [
                            F.embedding_bag(x, w, o, mode=combiner)
                            for (x, o), w in zip(ins, weights)
                        ]

            calls.append(call)
        return calls

    return prepare


def torch_sqrtn_weights(offsets, n_ids: int):
    """Per id 1/sqrt(its bag's length), from the bags' start offsets: embedding_bag's sum
    mode with these weights is TensorFlow's sqrtn combiner (an empty bag: zeros)."""
    lengths = torch.diff(offsets, append=offsets.new_tensor([n_ids]))
    return torch.repeat_interleave(lengths.to(torch.float32).rsqrt(), lengths)


def _torch_coo_calls(batches, weights, combiner, threads, batch):
    calls = Calls()
    calls.setup = lambda: torch.set_num_threads(threads)
    for feats in batches:
        ins = [(torch.from_numpy(f["ids"]), torch.from_numpy(sparse_indices(f))) for f in feats]

        def call(ins=ins):
            with torch.inference_mode():
                outs = []
                for (x, idx), w in zip(ins, weights):
                    counts = torch.bincount(idx[:, 0], minlength=batch)
                    offsets = torch.cumsum(counts, 0) - counts
                    if combiner == "sqrtn":  # see torch_contender
                        scale = torch_sqrtn_weights(offsets, x.shape[0])
                        outs.append(
                            F.embedding_bag(x, w, offsets, mode="sum", per_sample_weights=scale)
                        )
                    else:
                        outs.append(F.embedding_bag(x, w, offsets, mode=combiner))
                return outs

        calls.append(call)
    return calls


def as_numpy(x):
    """A copy: holding views of the outputs would keep embedmesh's output buffers
    from being reused while the others are timed."""
    if hasattr(x, "detach"):
        return x.detach().numpy().copy()
    return np.array(x)


# ---------------------------------------------------------------------------
# Driver


# What a call is timed with: the wall clock (default), or with `--clock thread` the
# calling thread's CPU time, for 1-thread contenders only (embedmesh[...] without -Nt,
# torch[1t]: their whole call runs on the calling thread), so that time spent
# descheduled by other processes on a loaded machine is left out.
CLOCK = [time.perf_counter]


# Contenders timed apart from the interleaved others unless --tf-interleaved (see time_round).
TF_CONTENDERS = ("tf.function", "tf.eager")
# Whose outputs the others' are checked against: the first of these that ran.
OUTPUT_REFERENCES = (*TF_CONTENDERS, "torch[1t]")


def warm_pass(cs) -> None:
    """One untimed call of a contender on each batch (after its setup)."""
    if getattr(cs, "setup", None):
        cs.setup()
    for c in cs:
        c()


def time_round(calls: dict, reps: int, seed: int, blocks: bool = False, apart: tuple = ()) -> dict:
    """One round: {contender: median seconds per call}.

    Contenders alternate call by call (batch by batch, in an order shuffled
    for every batch, seeded by the round), so a change in the machine's load
    hits them alike and no contender always follows the same one (whose
    threads or cache footprint it would inherit); ratios are then taken
    within the round.

    `blocks`: each contender instead runs alone for the round's turn (order
    shuffled per round): one untimed pass over the batches, then `reps` timed
    passes, as a server running only that system would. Interleaved calls
    each inherit the caches (TensorFlow keeps its own copy of the tables) and
    the still-spinning worker threads of another system.

    Contenders named in `apart` (TensorFlow's, unless --tf-interleaved) run as blocks
    even so, before or after the interleaved others by turns: they read their own
    copy of the tables, so a call of theirs evicts the rows that the contenders sharing
    the numpy tables (embedmesh, torch) keep warm for each other, and the call after
    it finds them cold. Interleaved with TensorFlow, embedmesh[native] and torch[1t]
    both ran 2.1-2.6x slower (ragged/sum, dim 32: 5.33 and 5.38 ms a call against 2.02
    and 2.54 without it, 2026-12-04), which moved their ratio from 1.26x to 0.99x.
    """
    if blocks:
        return _time_blocks(calls, reps, seed)
    alone = {n: cs for n, cs in calls.items() if n in apart}
    if alone:  # their block before or after the others' interleaved calls, by turns
        shared = {n: cs for n, cs in calls.items() if n not in apart}
        first = seed % 2 == 0
        result = _time_blocks(alone, reps, seed) if first else {}
        for cs in shared.values():  # untimed: the rows that the block evicted back
            warm_pass(cs)
        result.update(time_round(shared, reps, seed) if shared else {})
        if not first:
            result.update(_time_blocks(alone, reps, seed))
        return {name: result[name] for name in calls}
    names = list(calls)
    times = {name: [] for name in names}
    shuffle = random.Random(seed)
    for _rep in range(reps):
        for i in range(len(next(iter(calls.values())))):
            order = list(names)
            shuffle.shuffle(order)
            for name in order:
                cs = calls[name]
                if getattr(cs, "setup", None):
                    cs.setup()
                t0 = CLOCK[0]()
                cs[i]()
                times[name].append(CLOCK[0]() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _time_blocks(calls: dict, reps: int, seed: int) -> dict:
    order = list(calls)
    random.Random(seed).shuffle(order)
    result = {}
    for name in order:
        cs = calls[name]
        warm_pass(cs)  # from here on this contender runs alone
        times = []
        for _rep in range(reps):
            for c in cs:
                t0 = CLOCK[0]()
                c()
                times.append(CLOCK[0]() - t0)
        result[name] = statistics.median(times)
    return {name: result[name] for name in calls}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; sets TensorFlow's threads and the clock it asks for."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--dims", help="comma-separated dims to sweep (one workload each; --dim ignored)"
    )
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--ids-per-sample", type=int, default=10)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--batches", type=int, default=3, help="distinct batches, cycled")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median over them)")
    p.add_argument("--reps", type=int, default=3, help="passes over the batches per round")
    p.add_argument("--kinds", default="ragged,sparse,dense")
    p.add_argument("--combiners", default="sum,mean")
    p.add_argument(
        "--contenders",
        default="embedmesh[native],embedmesh[native-Nt],tf.function,torch,torch[1t]",
        help="comma-separated; embedmesh[B] (B: native, numba, numpy) runs the host path on "
        "kernel backend B, embedmesh[B-Nt] spreads features over one thread per core; "
        "tf.function, tf.eager, torch (default threads), torch[1t], torch-coo, torch-coo[1t] "
        "(sparse input: torch derives its offsets from the COO indices), jax.jit (the traced "
        "path)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: the calling thread's CPU time (1-thread contenders only; see CLOCK)",
    )
    p.add_argument(
        "--blocks",
        action="store_true",
        help="time each contender alone for its turn of a round (see time_round)",
    )
    p.add_argument(
        "--tf-interleaved",
        action="store_true",
        help="interleave TensorFlow's calls with the others' too (default: its own block "
        "in each round; see time_round)",
    )
    p.add_argument(
        "--tf-threads",
        type=int,
        default=0,
        help="TensorFlow's intra- and inter-op threads (0: its default, every core); "
        "1 compares it on one thread, as embedmesh[native] and torch[1t] run",
    )
    p.add_argument(
        "--aligned",
        action="store_true",
        help="tables start on a 64-byte line (as torch's allocator, embedmesh's checkpoint "
        "loaders and jax arrays give them); default: numpy's, 16 bytes past one",
    )
    p.add_argument(
        "--table-dtypes",
        default="float32",
        help="comma-separated: float32 and quantized serving dtypes (int8, fp16, bf16); "
        "each quantized one adds embedmesh[B:dtype] for every embedmesh[B] contender "
        "(-Nt too), and for int8 torch-q8 / torch-q8[1t] and fbgemm-int8, for fp16 "
        "fbgemm-fp16 when named in --contenders",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--saved-model",
        action="store_true",
        help="then time the TensorFlow SavedModel (export_saved_model, run by TF) against "
        "load_serving on the same requests: benchmarks/serving/serving_saved_model.py, its own "
        "workload (100k-row tables and a small MLP), --rounds rounds",
    )
    args = p.parse_args(argv)
    if args.tf_threads and tf is not None:  # before TensorFlow runs anything
        tf.config.threading.set_intra_op_parallelism_threads(args.tf_threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.tf_threads)
    if args.clock == "thread":
        multi = [
            c
            for c in args.contenders.split(",")
            if c.endswith("-Nt]") or c in ("torch", "torch-coo", "torch-q8")
        ]
        multi += [c for c in args.contenders.split(",") if c.startswith("tf.")]
        if multi:
            p.error(f"--clock thread times 1-thread contenders only, not {multi}")
        CLOCK[0] = time.thread_time
        print("clock: the calling thread's CPU time (--clock thread)")

    return args


def versions_line(args) -> str:
    """Python, numpy, the kernels embedmesh runs on and the peers' versions."""
    return (
        f"python {platform.python_version()}, numpy {np.__version__}, embedmesh kernels: "
        f"native={'yes' if kernels.HAVE_NATIVE else 'no'}"
        + (f" ({native_line()})" if kernels.HAVE_NATIVE else "")
        + f", numba={'yes' if kernels.HAVE_NUMBA else 'no'}"
        + (f" {importlib.metadata.version('numba')}" if kernels.HAVE_NUMBA else "")
        + (
            f", tensorflow {tf.__version__} ({args.tf_threads or 'default'} threads)"
            if tf
            else ", tensorflow: not importable"
        )
        + (
            f", torch {torch.__version__} ({TORCH_THREADS} threads)"
            if torch
            else ", torch: not importable"
        )
        + f", cpus {os.cpu_count()}"
    )


def main(argv=None):
    args = parse_args(argv)
    print(machine_line())
    print(versions_line(args))
    results = []
    dims = [int(d) for d in args.dims.split(",")] if args.dims else [args.dim]
    for dim in dims:
        args.dim = dim
        results += run_dim(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"args": vars(args), "machine": machine_line(), "results": results}, fh, indent=1
            )
    summary(results)
    if args.saved_model:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(
            "serving_saved_model", os.path.join(here, "serving_saved_model.py")
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(["--rounds", str(args.rounds), "--seed", str(args.seed)])
    return results


def make_contenders(tables, batches, max_len, args) -> dict:
    wanted = args.contenders.split(",")
    contenders = {}
    cores = os.cpu_count() or 1
    for backend in ("native", "numba", "numpy"):
        usable = {
            "native": lambda: kernels.HAVE_NATIVE,
            "numba": lambda: kernels.HAVE_NUMBA,
            "numpy": lambda: True,
        }[backend]
        if f"embedmesh[{backend}]" in wanted and usable():
            contenders[f"embedmesh[{backend}]"] = embedmesh_contender(
                tables, batches, max_len, args, backend
            )
        if f"embedmesh[{backend}-Nt]" in wanted and usable() and cores > 1:
            # features spread over one thread per core (serving.set_host_threads)
            contenders[f"embedmesh[{backend}-{cores}t]"] = embedmesh_contender(
                tables, batches, max_len, args, backend, threads=cores
            )
    if tf is not None and "tf.function" in wanted:
        contenders["tf.function"] = tf_contender(tables, batches, max_len, args, True)
    if tf is not None and "tf.eager" in wanted:
        contenders["tf.eager"] = tf_contender(tables, batches, max_len, args, False)
    if torch is not None:
        default_threads = TORCH_THREADS
        if "torch" in wanted:  # torch's default: one intra-op thread per core
            contenders[f"torch[{default_threads}t]"] = torch_contender(
                tables, batches, max_len, args, default_threads
            )
        if "torch[1t]" in wanted and default_threads != 1:
            contenders["torch[1t]"] = torch_contender(tables, batches, max_len, args, 1)
        if "torch-coo" in wanted:  # sparse input only: offsets from the COO indices
            contenders[f"torch-coo[{default_threads}t]"] = torch_contender(
                tables, batches, max_len, args, default_threads, coo=True
            )
        if "torch-coo[1t]" in wanted and default_threads != 1:
            contenders["torch-coo[1t]"] = torch_contender(
                tables, batches, max_len, args, 1, coo=True
            )
    if "jax.jit" in wanted:
        contenders["jax.jit"] = jit_contender(tables, batches, max_len, args)
    contenders.update(quantized_contenders(tables, batches, max_len, args, wanted, cores))
    return contenders


def quantized_contenders(tables, batches, max_len, args, wanted, cores) -> dict:
    """embedmesh on `--table-dtypes` other than float32 (quantized once from `tables`),
    torch's 8-bit row-wise bag on embedmesh's int8 bytes, FBGEMM's TBE (see the module's
    docstring)."""
    from embedmesh.serving import quantize_table

    contenders = {}
    dtypes = [d for d in args.table_dtypes.split(",") if d not in ("float32", "fp32", "")]
    for dtype in dtypes:
        t0 = time.perf_counter()
        qtables = [quantize_table(t, dtype) for t in tables]
        print(
            f"  {dtype} tables: quantized in {time.perf_counter() - t0:.1f}s, "
            f"{qtables[0].bytes_per_row} bytes a row (float32: {args.dim * 4})"
        )
        for backend in ("native", "numba", "numpy"):
            if f"embedmesh[{backend}]" in wanted:
                contenders[f"embedmesh[{backend}:{dtype}]"] = embedmesh_contender(
                    qtables, batches, max_len, args, backend
                )
            if f"embedmesh[{backend}-Nt]" in wanted and cores > 1:
                contenders[f"embedmesh[{backend}:{dtype}-{cores}t]"] = embedmesh_contender(
                    qtables, batches, max_len, args, backend, threads=cores
                )
        if torch is not None and dtype == "int8":
            rows = [torch.from_numpy(q.data) for q in qtables]  # the same bytes
            for name, n in (("torch-q8", TORCH_THREADS), ("torch-q8[1t]", 1)):
                if name in wanted:
                    contenders[f"torch-q8[{n}t]"] = torch_q8_contender(rows, batches, n)
        if torch is not None and f"fbgemm-{dtype}" in wanted and fbgemm_modules() is not None:
            # one thread only under --clock thread (CPU time of the calling thread)
            for n in [1] if CLOCK[0] is time.thread_time else sorted({1, TORCH_THREADS}):
                contenders[f"fbgemm-{dtype}[{n}t]"] = fbgemm_contender(batches, args, dtype, n)
    return contenders


def torch_q8_contender(rows, batches, threads: int):
    """torch.ops.quantized.embedding_bag_byte_rowwise_offsets (FBGEMM's 8-bit row-wise
    kernel in torch) on fused rows [V, dim + 8]: ragged/sparse input (sum, mean)."""

    def prepare(kind, combiner):
        if kind == "dense" or combiner not in ("sum", "mean"):
            return None
        mode = {"sum": 0, "mean": 1}[combiner]
        calls = Calls()
        calls.setup = lambda: torch.set_num_threads(threads)
        for feats in batches:
            ins = torch_bags(feats)

            def call(ins=ins):
                with torch.inference_mode():
                    return [
                        torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                            w, x, o, False, mode, False, None, None, False
                        )
                        for (x, o), w in zip(ins, rows)
                    ]

            calls.append(call)
        return calls

    return prepare


_FBGEMM: list = []  # [modules or None] once tried


def fbgemm_modules():
    """FBGEMM's inference TBE modules, or None (printed why). fbgemm-gpu-cpu 1.9.0 (the
    newest) was built for an older torch: under torch 2.13 its fbgemm_gpu_py,
    tbe_index_select and training_backward libraries fail to load (undefined symbol
    torch::autograd::_wrap_outputs), so `import fbgemm_gpu` fails; the inference TBE's
    libraries load, so they are loaded one by one and the package is imported without
    its __init__ (a namespace stub)."""
    if _FBGEMM:
        return _FBGEMM[0]
    _FBGEMM.append(None)
    spec = importlib.util.find_spec("fbgemm_gpu")
    if spec is None or torch is None:
        print("  fbgemm: not installed")
        return None
    import glob
    import types

    where = os.path.dirname(spec.origin)
    failed = []
    for so in sorted(glob.glob(os.path.join(where, "*.so"))):
        try:
            torch.ops.load_library(so)
        except OSError:
            failed.append(os.path.basename(so))
    if "fbgemm_gpu" not in sys.modules:
        stub = types.ModuleType("fbgemm_gpu")
        stub.__path__ = [where]
        sys.modules["fbgemm_gpu"] = stub
    try:
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # noqa: BLE001 - whatever fails, the benchmark runs without it
        print(f"  fbgemm: unusable ({type(e).__name__}: {e}); libraries not loaded: {failed}")
        return None
    version = importlib.metadata.version("fbgemm-gpu-cpu")
    print(f"  fbgemm-gpu-cpu {version}: libraries that did not load (unused here): {failed}")
    _FBGEMM[0] = (
        IntNBitTableBatchedEmbeddingBagsCodegen,
        SparseType,
        EmbeddingLocation,
        PoolingMode,
    )
    return _FBGEMM[0]


def fbgemm_contender(batches, args, dtype: str, threads: int):
    """FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen, all tables in one call (its form),
    rows of `dtype` ("int8": its 8-bit rows, "fp16") filled at random; ragged/sparse."""
    tbe, sparse_type, location, pooling = fbgemm_modules()
    weights_ty = {"int8": sparse_type.INT8, "fp16": sparse_type.FP16}[dtype]
    op = tbe(
        embedding_specs=[
            (f"t{i}", args.vocab, args.dim, weights_ty, location.HOST) for i in range(args.tables)
        ],
        device="cpu",
        pooling_mode=pooling.SUM,
        output_dtype=sparse_type.FP32,
    )
    op.fill_random_weights()
    modes = {"sum": pooling.SUM, "mean": pooling.MEAN}

    def prepare(kind, combiner):
        if kind == "dense" or combiner not in modes:
            return None
        calls = Calls()

        def setup():
            torch.set_num_threads(threads)
            op.pooling_mode = modes[combiner]

        calls.setup = setup
        for feats in batches:
            ids = torch.from_numpy(np.concatenate([f["ids"] for f in feats]))
            starts = np.cumsum([0] + [f["ids"].size for f in feats])
            offsets = np.concatenate(
                [f["splits"][:-1] + s for f, s in zip(feats, starts)] + [[starts[-1]]]
            )
            offsets = torch.from_numpy(offsets.astype(np.int64))

            def call(ids=ids, offsets=offsets):
                with torch.inference_mode():
                    out = op(ids, offsets)  # [batch, tables * dim]
                return list(out.split(args.dim, dim=1))

            calls.append(call)
        return calls

    return prepare


class Measured(NamedTuple):
    """What `measure` gives."""

    per_round: dict  # {contender: [median seconds per call, one a round]}
    diffs: dict  # {contender: max abs diff from the reference, contender + " allclose": bool}
    ref: str | None  # the reference's name (None: no contender of `refs` ran)
    reps: int  # passes over the batches a round


def measure(calls: dict, rounds, reps, blocks=False, apart=(), refs=(), round_s=None):
    """Warm every contender up (tracing, jit, caches: its setup, one checked call, one
    untimed pass), its first call's outputs compared with those of the first of `refs`
    that ran (max abs diff, allclose at 1e-5), then `rounds` rounds of `time_round`.

    `round_s`: `reps` raised (to at most 200) so that a round lasts about that long, from
    one more untimed pass of them all: small batches' calls take microseconds, and a
    round's median needs more of them."""
    outs = {}
    for name, cs in calls.items():
        if getattr(cs, "setup", None):
            cs.setup()
        outs[name] = [as_numpy(o) for o in cs[0]()]
    ref = next((r for r in refs if r in outs), None)
    diffs = {}
    for name, out in outs.items():
        if ref is None or name == ref:
            continue
        diffs[name] = max(float(np.max(np.abs(a - b))) for a, b in zip(out, outs[ref]))
        ok = all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(out, outs[ref]))
        diffs[name + " allclose"] = ok
    for cs in calls.values():
        warm_pass(cs)
    if round_s:
        spent = 0.0  # the calls' time, not their setups'
        for cs in calls.values():
            if getattr(cs, "setup", None):
                cs.setup()
            t0 = time.perf_counter()
            for c in cs:
                c()
            spent += time.perf_counter() - t0
        reps = max(reps, min(200, int(round_s / max(spent, 1e-9))))
    per_round = {name: [] for name in calls}
    for r in range(rounds):
        for name, t in time_round(calls, reps, r, blocks, apart).items():
            per_round[name].append(t)
    return Measured(per_round, diffs, ref, reps)


def median_ratio(per_round: dict, a: str, b: str) -> float:
    """The median over rounds of b's seconds over a's (> 1: a faster), each within its
    round."""
    return statistics.median(tb / ta for ta, tb in zip(per_round[a], per_round[b]))


def run_dim(args) -> list:
    """Every kind and combiner at args.dim: results rows (also printed)."""
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    tables, batches, max_len = make_workload(args, rng)
    print(
        f"\n#### dim {args.dim}: workload built in {time.perf_counter() - t0:.1f}s: "
        f"{args.tables} tables x {args.vocab} x {args.dim} f32 (first row at "
        f"{tables[0].ctypes.data % 64} bytes past a 64-byte line), batch {args.batch}, "
        f"Poisson({args.ids_per_sample}) ids/sample (max {max_len}), Zipf({args.zipf}); "
        f"unique ids per table per batch ~"
        f"{int(np.mean([np.unique(f['ids']).size for f in batches[0]]))} of "
        f"{int(np.mean([f['ids'].size for f in batches[0]]))}"
    )
    contenders = make_contenders(tables, batches, max_len, args)
    results = []
    for kind in args.kinds.split(","):
        for combiner in args.combiners.split(","):
            if kind == "dense" and combiner != args.combiners.split(",")[0]:
                continue  # a dense input is a plain lookup: the combiner does not apply
            label = f"{kind}" + ("" if kind == "dense" else f"/{combiner}")
            n_ids = statistics.mean(ids_in(kind, b) for b in batches)  # per call
            calls = {name: prep(kind, combiner) for name, prep in contenders.items()}
            calls = {name: cs for name, cs in calls.items() if cs is not None}
            apart = () if args.tf_interleaved else TF_CONTENDERS
            per_round, diffs, ref_name, _ = measure(
                calls, args.rounds, args.reps, args.blocks, apart, refs=OUTPUT_REFERENCES
            )
            names = list(calls)
            row = {
                "dim": args.dim,
                "input": label,
                "ids_per_call": n_ids,
                "max_abs_diff_vs_tf": diffs,
                "ids_per_s": {},
                "ratio": {},
            }
            row["seconds_per_call_by_round"] = per_round
            for name, ts in per_round.items():
                row["ids_per_s"][name] = n_ids / statistics.median(ts)
            for em_name in [n for n in names if n.startswith("embedmesh")]:
                for peer in [n for n in names if not n.startswith("embedmesh")]:
                    ratio = median_ratio(per_round, em_name, peer)
                    row["ratio"][f"{em_name} / {peer}"] = ratio
            results.append(row)
            print(
                f"\n== dim {args.dim} {label}: {n_ids:.0f} ids per call, median of "
                f"{args.rounds} rounds x {args.reps * args.batches} calls"
                + (", each contender alone in turn" if args.blocks else ", interleaved")
            )
            for name in names:
                print(
                    f"  {name:18s} {row['ids_per_s'][name] / 1e6:8.2f} M ids/s  "
                    f"({n_ids / row['ids_per_s'][name] * 1e3:7.2f} ms/call)"
                )
            for k, v in row["ratio"].items():
                print(f"  {k:34s} {v:6.2f}x")
            for k, v in diffs.items():
                if not k.endswith("allclose"):
                    print(
                        f"  max |{k} - {ref_name}| = {v:.3g}  allclose(1e-5): "
                        f"{diffs[k + ' allclose']}"
                    )
            sys.stdout.flush()
    return results


def summary(results) -> None:
    """One line per (dim, input): embedmesh over each peer, medians of per-round ratios."""
    print("\n#### summary: embedmesh / peer (median of per-round ratios)")
    for row in results:
        pairs = [
            f"{k.replace('embedmesh', 'em')}: {v:.2f}x"
            for k, v in row["ratio"].items()
            if _same_threads(k)
        ]
        print(f"  dim {row['dim']:4d} {row['input']:12s} " + "  ".join(pairs))


def _same_threads(pair: str) -> bool:
    """A ratio worth summarising: 1 thread vs 1 thread, N vs N, or vs TF / jit."""
    em, peer = pair.split(" / ")
    if not peer.endswith("t]"):  # TensorFlow, jax.jit: whatever their threads
        return True
    em_t = em.rsplit("-", 1)[1].rstrip("]") if "t]" in em else "1t"
    peer_t = peer[peer.index("[") + 1 : -1]
    return em_t == peer_t


def machine_line() -> str:
    """CPU model, cores and vector ISA extensions (lscpu's), for the record."""
    model, flags = cpu_model_and_flags()
    isa = [f for f in flags if f.startswith(("avx", "fma", "sse4_2", "amx"))]
    return f"cpu: {model}, {os.cpu_count()} cpus, isa: {' '.join(isa) or 'unknown'}"


def cpu_model_and_flags() -> tuple[str, list]:
    """The CPU's model name and its /proc/cpuinfo feature flags (empty where unreadable)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return model, flags


def isa_name(flags) -> str:
    """The widest x86 vector extension the CPU (as the OS enables it) has; elsewhere the
    architecture."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return platform.machine()
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "pre-AVX2"


def native_line() -> str:
    from embedmesh.serving import native

    width = native.library().EmServingVectorWidth()
    return f"{width}-float vectors, {os.path.basename(native.path())}"


def jit_contender(tables, batches, max_len, args):
    """The traced path: `serving_embedding_lookup` inside `jax.jit`, tables as arguments
    (device arrays), inputs as device arrays; one compile per batch shape (warm-up)."""
    import jax
    import jax.numpy as jnp

    names = [f"f{i}" for i in range(args.tables)]
    dev_tables = [jnp.asarray(t) for t in tables]

    def prepare(kind, combiner):
        tcs = [
            em.TableConfig(args.vocab, args.dim, combiner=combiner, name=f"t{i}")
            for i in range(args.tables)
        ]
        fcs = {n: em.FeatureConfig(tc, name=n) for n, tc in zip(names, tcs)}

        @jax.jit
        def lookup(inputs, tabs):
            return em.serving_embedding_lookup(inputs, None, dict(zip(tcs, tabs)), fcs)

        calls = Calls()
        for feats in batches:
            if kind == "ragged":
                inputs = {
                    n: em.RaggedTensor(jnp.asarray(f["ids"]), jnp.asarray(f["splits"]))
                    for n, f in zip(names, feats)
                }
            elif kind == "sparse":
                inputs = {
                    n: em.SparseTensor(
                        jnp.asarray(sparse_indices(f)), jnp.asarray(f["ids"]), (args.batch, max_len)
                    )
                    for n, f in zip(names, feats)
                }
            else:
                inputs = {n: jnp.asarray(f["dense"]) for n, f in zip(names, feats)}

            def call(inputs=inputs):
                return ready(lookup(inputs, dev_tables), names)

            calls.append(call)
        return calls

    return prepare


if __name__ == "__main__":
    main()
