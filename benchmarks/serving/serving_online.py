"""Online serving: small ranking-like requests from 1, 2 and 4 client threads at once.

A request is one user's candidates: 26 ragged features (one table each, as Criteo's 26
sparse features), dims 16, 32, 64, 128 in turn, each feature 1-40 ids an example (a
feature's own maximum, drawn once; an example's count uniform up to it), sum and mean
combiners in turn, at batch 1, 8, 64 and 256. Contenders, on the same tables (torch's
share the numpy tables' memory) and the same requests:

- embedmesh: `serving_embedding_lookup(inputs, None, tables, features)` on
  `RaggedTensor`s, with `set_host_threads(1)` (each client thread is one core's work);
- em-numpy: the same under `embedmesh.serving.lookup.set_numpy_outputs(True)` (numpy
  outputs, no jax arrays);
- em-np-release / em-np-hold: em-numpy under the other GIL settings, for A/B (the
  default: a request of fewer than 32k ids keeps the GIL through its kernels while no
  other thread is inside a lookup or entered one in the last 20 ms; release: every
  request releases it, `settings.set_hold_gil_below(0)`; hold: every request keeps it
  while alone, whatever its size, `settings.set_hold_gil_below(2**62)`);
- em-np-own: em-numpy, each client thread sending its own copies of the requests (as
  `--own-requests` does for every contender), against em-numpy's shared objects in the
  same run;
- torch: `torch.nn.functional.embedding_bag(ids, table, offsets, mode=...)` a feature,
  under `torch.inference_mode()`, `torch.set_num_threads(1)`;
- tf: TensorFlow's `tf.tpu.experimental.embedding.serving_embedding_lookup` in a
  `tf.function` (one trace: a ragged input signature) on `tf.RaggedTensor`s built
  before timing, TensorFlow's intra- and inter-op pools of `--tf-threads` (1) threads
  each: TF runs a graph's ops on its pools, not on the calling threads, so with N
  clients it has those threads (a run with `--tf-threads 2` gives it 2). Skipped,
  saying why, where TensorFlow does not import.

Closed loop: N client threads (1, 2, 4) each send the next request as soon as the
last is answered, for `--seconds`; every request's latency is recorded. Reported per
(contender, batch, clients): p50 and p99 latency, requests/s over all clients. Each
round runs every cell once, the contenders alternating, and the figures kept are the
medians over rounds of per-round ratios (embedmesh / torch p50; p99 / p50; requests/s
at N clients / at 1 client), since a noisy machine moves whole rounds.

`--own-requests`: each client thread sends its own copies of the requests (new objects,
arrays copied; TensorFlow's converted inputs stay shared), as in a server whose threads
each parse their own requests; by default every client sends the same 32 request objects
a batch, so two clients write the same objects' reference counts.

`--busy`: one client beside one pure-Python busy thread (a loop that never releases the
GIL except at the interpreter's switch interval): requests/s against one client alone.

Outputs are checked against torch's (allclose) before timing. Run in the benchmark
environment (benchmarks/serving/requirements-serving.txt; torch is never a dependency):

    PYTHONPATH=. /tmp/benchenv/bin/python benchmarks/serving/serving_online.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

import embedmesh as em
from embedmesh.serving import set_host_threads
from embedmesh.serving.settings import set_hold_gil_below, set_numpy_outputs

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # embedmesh alone
    torch = None

try:
    import tensorflow as tf
except Exception as e:  # noqa: BLE001 - not installed, or broken: say why and go on
    tf, TF_REASON = None, f"{type(e).__name__}: {e}"

N_FEATURES = 26
DIMS = (16, 32, 64, 128)
BATCHES = (1, 8, 64, 256)
CLIENTS = (1, 2, 4)


def make_model(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    features, tables, max_ids = {}, {}, []
    for i in range(N_FEATURES):
        combiner = "sum" if i % 2 == 0 else "mean"
        cfg = em.TableConfig(
            vocabulary_size=vocab, dim=DIMS[i % len(DIMS)], combiner=combiner, name=f"t{i}"
        )
        features[f"f{i}"] = em.FeatureConfig(cfg)
        tables[cfg] = rng.normal(size=(vocab, cfg.dim)).astype(np.float32)
        max_ids.append(int(rng.integers(1, 41)))
    return features, tables, max_ids


def make_requests(features, max_ids, batch: int, n: int, vocab: int, seed: int):
    """n requests: (embedmesh inputs, torch inputs [(ids, offsets)])."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        em_in, torch_in = {}, []
        for (name, _), m in zip(features.items(), max_ids):
            lengths = rng.integers(1, m + 1, size=batch)
            ids = rng.integers(0, vocab, size=int(lengths.sum())).astype(np.int64)
            ragged = em.RaggedTensor.from_row_lengths(ids, lengths)
            em_in[name] = ragged
            splits = np.asarray(ragged.row_splits, np.int64)
            if torch is not None:
                torch_in.append((torch.from_numpy(ids), torch.from_numpy(splits[:-1].copy())))
        out.append((em_in, torch_in))
    return out


# the GIL setting of each policy (set_hold_gil_below); None: the library's default
GIL_POLICIES = {"auto": None, "release": 0, "hold": 2**62}
_GIL_DEFAULT = set_hold_gil_below(0)  # read back, restored
if _GIL_DEFAULT is not None:
    set_hold_gil_below(_GIL_DEFAULT)


def embedmesh_call(
    features, tables, numpy_outputs: bool = False, gil: str = "auto", own: bool = False
):
    """own: each client thread sends its own copies of the requests (`own_copies`)."""

    def call(req):
        return em.serving_embedding_lookup(req[0], None, tables, features)

    call.own = own

    def setup():  # before each cell
        set_numpy_outputs(numpy_outputs)
        if _GIL_DEFAULT is not None:
            value = GIL_POLICIES[gil]
            set_hold_gil_below(_GIL_DEFAULT if value is None else value)

    call.setup = setup
    return call


def tf_call(features, tables):
    """TensorFlow's serving lookup in one tf.function; a request's inputs are made into
    tf.RaggedTensors before timing (`call.convert`)."""
    emb = tf.tpu.experimental.embedding
    tcs, fcs, tabs = {}, {}, {}
    for name, f in features.items():
        t = f.table
        tc = emb.TableConfig(
            vocabulary_size=t.vocabulary_size, dim=t.dim, combiner=t.combiner, name=t.name
        )
        tcs[name] = tc
        fcs[name] = emb.FeatureConfig(table=tc, name=name)
        tabs[tc] = tf.constant(tables[t])
    spec = {
        n: tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1, row_splits_dtype=tf.int64)
        for n in features
    }

    @tf.function(input_signature=[spec])
    def lookup(inputs):
        return emb.serving_embedding_lookup(inputs, None, tabs, fcs)

    def call(req):
        out = lookup(req[2])
        return [out[n] for n in features]

    def convert(req):
        return {
            n: tf.RaggedTensor.from_row_splits(r.values, np.asarray(r.row_splits, np.int64))
            for n, r in req[0].items()
        }

    call.convert = convert
    return call


def torch_call(features, tables):
    weights = [torch.from_numpy(tables[f.table]) for f in features.values()]
    modes = [f.table.combiner for f in features.values()]

    def call(req):
        with torch.inference_mode():
            return [
                F.embedding_bag(ids, w, offsets, mode=mode)
                for (ids, offsets), w, mode in zip(req[1], weights, modes)
            ]

    return call


def own_copies(requests):
    """The requests as new objects (their arrays copied), for one client of its own."""

    def copy(q):
        em_in = {
            k: em.RaggedTensor(np.array(r.values), np.array(r.row_splits)) for k, r in q[0].items()
        }
        torch_in = [(ids.clone(), offsets.clone()) for ids, offsets in q[1]]
        return (em_in, torch_in, *q[2:])

    return [copy(q) for q in requests]


def closed_loop(call, requests, clients: int, seconds: float, busy: bool = False):
    """(latencies in seconds, requests/s): `clients` threads calling for `seconds`;
    `requests` a list every client cycles through, or per client its own list."""
    lat: list[list[float]] = [[] for _ in range(clients)]
    stop = threading.Event()
    start = threading.Barrier(clients + 1 + (1 if busy else 0))

    def client(c):
        mine = requests[c] if type(requests[0]) is list else requests
        local, i, n = lat[c], c * 7, len(mine)
        start.wait()
        clock = time.perf_counter
        while not stop.is_set():
            t0 = clock()
            call(mine[i % n])
            local.append(clock() - t0)
            i += 1

    def spin():
        start.wait()
        x = 0
        while not stop.is_set():
            x += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    if busy:
        threads.append(threading.Thread(target=spin))
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    all_lat = np.concatenate([np.asarray(x) for x in lat])
    return all_lat, len(all_lat) / elapsed


def check(features, tables, requests, tf_lookup=None):
    """max |embedmesh - torch| (and |tf - torch|) on a request, asserting allclose."""
    got = embedmesh_call(features, tables)(requests[0])
    want = torch_call(features, tables)(requests[0])
    worst, worst_tf = 0.0, 0.0
    for name, w in zip(features, want):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-5, atol=1e-5)
        worst = max(worst, float(np.max(np.abs(np.asarray(got[name]) - w.numpy()))))
    if tf_lookup is not None:
        for t, w in zip(tf_lookup(requests[0]), want):
            np.testing.assert_allclose(t.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)
            worst_tf = max(worst_tf, float(np.max(np.abs(t.numpy() - w.numpy()))))
    return worst, worst_tf


def make_contenders(args, wanted, batches, features, tables, reqs) -> dict:
    """The contenders named in `wanted` that can run here, their outputs checked against
    torch's; TensorFlow's inputs converted into `reqs` before any timing."""
    makers = {
        "embedmesh": lambda: embedmesh_call(features, tables),
        "em-numpy": lambda: embedmesh_call(features, tables, numpy_outputs=True),
        "em-np-release": lambda: embedmesh_call(features, tables, True, "release"),
        "em-np-hold": lambda: embedmesh_call(features, tables, True, "hold"),
        "em-np-own": lambda: embedmesh_call(features, tables, True, own=True),
    }
    if torch is not None:
        makers["torch"] = lambda: torch_call(features, tables)
    elif "torch" in wanted:
        print("torch not importable: skipped", file=sys.stderr)
    if tf is not None:
        makers["tf"] = lambda: tf_call(features, tables)
    elif "tf" in wanted:
        print(f"tensorflow skipped, not importable ({TF_REASON})")
    contenders = {name: makers[name]() for name in wanted if name in makers}
    if "tf" in contenders:
        for b in batches:  # TF's inputs made before timing, as torch's are
            reqs[b] = [(*q[:2], contenders["tf"].convert(q)) for q in reqs[b]]
    if torch is not None:
        for b in batches:
            worst, worst_tf = check(features, tables, reqs[b], contenders.get("tf"))
            print(
                f"batch {b}: max |embedmesh - torch| {worst:.2e}"
                + (f", |tf - torch| {worst_tf:.2e}" if "tf" in contenders else "")
            )
    print(
        f"versions: numpy {np.__version__}"
        + (f", torch {torch.__version__}" if torch is not None else "")
        + (f", tensorflow {tf.__version__} ({args.tf_threads} threads)" if tf else "")
    )
    return contenders


def time_rounds(args, contenders, reqs, batches, client_counts) -> tuple[list, list]:
    """`args.rounds` rounds of closed loops, contenders in alternating order: per round
    {(contender, batch, clients or "busy"): (p50, p99, requests/s)}; the load averages."""
    rounds = []  # per round: {(contender, batch, clients or "busy"): (p50, p99, rps)}
    loads = [os.getloadavg()[0]]
    own = None
    if args.own_requests or any(getattr(c, "own", False) for c in contenders.values()):
        # each client its own objects of the same requests
        own = {b: [own_copies(reqs[b]) for _ in range(max(client_counts))] for b in batches}
    for r in range(args.rounds):
        cells = {}
        names = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for b in batches:
            for n in client_counts + ([] if args.no_busy else ["busy"]):
                for name in names:
                    getattr(contenders[name], "setup", lambda: None)()
                    lat, rps = closed_loop(
                        contenders[name],
                        own[b]
                        if own and (args.own_requests or getattr(contenders[name], "own", False))
                        else reqs[b],
                        1 if n == "busy" else n,
                        args.seconds,
                        busy=n == "busy",
                    )
                    cells[(name, b, n)] = (
                        float(np.percentile(lat, 50)),
                        float(np.percentile(lat, 99)),
                        rps,
                    )
        rounds.append(cells)
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done (load {loads[-1]:.1f})", file=sys.stderr)

    return rounds, loads


def report(args, contenders, batches, client_counts, rounds, loads) -> None:
    """Print the medians over rounds: per cell, against torch, and the markdown summary."""

    def med(f):
        return statistics.median(f(c) for c in rounds)

    print(
        f"\n{len(rounds)} rounds x {args.seconds} s a cell; medians over rounds "
        "(latencies in us; ratios are medians of per-round ratios); 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} over the run"
    )
    head = "contender  batch clients    p50    p99  p99/p50   req/s  rps/1-client"
    print(head)
    for b in batches:
        for name in contenders:
            for n in client_counts + ([] if args.no_busy else ["busy"]):
                k = (name, b, n)
                ratio = med(lambda c: c[k][2] / c[(name, b, 1)][2])
                print(
                    f"{name:10s} {b:5d} {n!s:>7} {med(lambda c: c[k][0]) * 1e6:6.0f} "
                    f"{med(lambda c: c[k][1]) * 1e6:6.0f} "
                    f"{med(lambda c: c[k][1] / c[k][0]):8.2f} {med(lambda c: c[k][2]):7.0f} "
                    f"{ratio:13.2f}"
                )
    if "torch" in contenders:
        for ours in [c for c in contenders if c != "torch"]:
            print(f"\n{ours} / torch (medians of per-round ratios)")
            print("batch clients  p50 ratio  p99 ratio  req/s ratio")
            for b in batches:
                for n in client_counts + ([] if args.no_busy else ["busy"]):
                    e, t = (ours, b, n), ("torch", b, n)
                    print(
                        f"{b:5d} {n!s:>7} {med(lambda c: c[e][0] / c[t][0]):10.2f} "
                        f"{med(lambda c: c[e][1] / c[t][1]):10.2f} "
                        f"{med(lambda c: c[e][2] / c[t][2]):12.2f}"
                    )
    modes = client_counts + ([] if args.no_busy else ["busy"])
    print(
        "\nsummary (markdown): p50 us at 1 client; p50 and p99 / torch's; p99/p50 at 2 and 4"
        " clients; requests/s at 2 and 4 clients / at 1; beside a busy thread / alone"
    )
    print(
        "| contender | batch | p50 us | p50/torch 1 / 2 / 4 | p99/torch 1 / 2 / 4 |"
        " p99/p50 2 / 4 | req/s 2c/1c | 4c/1c | busy/alone |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(k, i):
        return med(lambda c: c[k][i]) if all(k in c for c in rounds) else float("nan")

    def vs(name, b, i):
        if "torch" not in contenders:
            return "-"
        return " / ".join(
            f"{med(lambda c: c[(name, b, n)][i] / c[('torch', b, n)][i]):.2f}"
            for n in client_counts
        )

    def per(name, b, n, f):
        if n not in modes:
            return "-"
        return f"{med(lambda c: f(c, n)):.2f}"

    for name in contenders:
        for b in batches:
            spread = " / ".join(
                per(name, b, n, lambda c, n: c[(name, b, n)][1] / c[(name, b, n)][0])
                for n in (2, 4)
            )
            scale = [
                per(name, b, n, lambda c, n: c[(name, b, n)][2] / c[(name, b, 1)][2])
                for n in (2, 4, "busy")
            ]
            print(
                f"| {name} | {b} | {cell((name, b, 1), 0) * 1e6:.0f} | {vs(name, b, 0)} |"
                f" {vs(name, b, 1)} | {spread} | {scale[0]} | {scale[1]} | {scale[2]} |"
            )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5, help="per cell and round")
    p.add_argument("--vocab", type=int, default=50_000)
    p.add_argument("--requests", type=int, default=32, help="distinct requests per batch")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    p.add_argument("--no-busy", action="store_true", help="skip the busy-thread cells")
    p.add_argument("--json", help="write every round's figures here")
    p.add_argument(
        "--own-requests",
        action="store_true",
        help="each client thread sends its own copies of the requests (by default all "
        "clients send the same request objects)",
    )
    p.add_argument(
        "--contenders",
        default="embedmesh,em-numpy,em-np-release,em-np-hold,torch,tf",
        help="any of embedmesh, em-numpy, em-np-release, em-np-hold, em-np-own, torch, tf",
    )
    p.add_argument("--tf-threads", type=int, default=1, help="TF's intra/inter-op threads")
    args = p.parse_args(argv)
    wanted = args.contenders.split(",")
    if tf is not None and "tf" in wanted:  # before TensorFlow runs anything
        tf.config.threading.set_intra_op_parallelism_threads(args.tf_threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.tf_threads)
    batches = [int(b) for b in args.batches.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]

    set_host_threads(1)
    if torch is not None:
        torch.set_num_threads(1)
    features, tables, max_ids = make_model(args.vocab)
    reqs = {
        b: make_requests(features, max_ids, b, args.requests, args.vocab, seed=b) for b in batches
    }
    contenders = make_contenders(args, wanted, batches, features, tables, reqs)
    ids = {
        b: np.mean([sum(len(r.values) for r in q[0].values()) for q in reqs[b]]) for b in batches
    }
    print("ids a request: " + ", ".join(f"batch {b} {ids[b]:.0f}" for b in batches))
    for call in contenders.values():  # warm: first calls, caches, allocator
        getattr(call, "setup", lambda: None)()
        for b in batches:
            for r in reqs[b][:4]:
                call(r)

    rounds, loads = time_rounds(args, contenders, reqs, batches, client_counts)
    report(args, contenders, batches, client_counts, rounds, loads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{f"{k[0]}|{k[1]}|{k[2]}": v for k, v in c.items()} for c in rounds], f, indent=1
            )


if __name__ == "__main__":
    main()
