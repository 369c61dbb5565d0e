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
- torch: `torch.nn.functional.embedding_bag(ids, table, offsets, mode=...)` a feature,
  under `torch.inference_mode()`, `torch.set_num_threads(1)`.

Closed loop: N client threads (1, 2, 4) each send the next request as soon as the
last is answered, for `--seconds`; every request's latency is recorded. Reported per
(contender, batch, clients): p50 and p99 latency, requests/s over all clients. Each
round runs every cell once, the contenders alternating, and the figures kept are the
medians over rounds of per-round ratios (embedmesh / torch p50; p99 / p50; requests/s
at N clients / at 1 client), since a noisy machine moves whole rounds.

`--busy`: one client beside one pure-Python busy thread (a loop that never releases the
GIL except at the interpreter's switch interval): requests/s against one client alone.

Outputs are checked against torch's (allclose) before timing. Run in the benchmark
environment (benchmarks/requirements-serving.txt; torch is never a dependency):

    PYTHONPATH=. /tmp/benchenv/bin/python benchmarks/serving_online.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import numpy as np

import embedmesh as em
from embedmesh.serving import set_host_threads
from embedmesh.serving.lookup import set_numpy_outputs

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # embedmesh alone
    torch = None

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


def embedmesh_call(features, tables, numpy_outputs: bool = False):
    def call(req):
        return em.serving_embedding_lookup(req[0], None, tables, features)

    call.setup = lambda: set_numpy_outputs(numpy_outputs)  # before each cell
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


def closed_loop(call, requests, clients: int, seconds: float, busy: bool = False):
    """(latencies in seconds, requests/s): `clients` threads calling for `seconds`."""
    lat: list[list[float]] = [[] for _ in range(clients)]
    stop = threading.Event()
    start = threading.Barrier(clients + 1 + (1 if busy else 0))

    def client(c):
        local, i, n = lat[c], c * 7, len(requests)
        start.wait()
        clock = time.perf_counter
        while not stop.is_set():
            t0 = clock()
            call(requests[i % n])
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


def check(features, tables, requests):
    got = embedmesh_call(features, tables)(requests[0])
    want = torch_call(features, tables)(requests[0])
    worst = 0.0
    for name, w in zip(features, want):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-5, atol=1e-5)
        worst = max(worst, float(np.max(np.abs(np.asarray(got[name]) - w.numpy()))))
    return worst


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
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]

    set_host_threads(1)
    if torch is not None:
        torch.set_num_threads(1)
    features, tables, max_ids = make_model(args.vocab)
    reqs = {
        b: make_requests(features, max_ids, b, args.requests, args.vocab, seed=b) for b in batches
    }
    contenders = {
        "embedmesh": embedmesh_call(features, tables),
        "em-numpy": embedmesh_call(features, tables, numpy_outputs=True),
    }
    if torch is not None:
        contenders["torch"] = torch_call(features, tables)
        for b in batches:
            print(f"batch {b}: max |embedmesh - torch| {check(features, tables, reqs[b]):.2e}")
    else:
        print("torch not importable: embedmesh alone", file=sys.stderr)
    ids = {
        b: np.mean([sum(len(r.values) for r in q[0].values()) for q in reqs[b]]) for b in batches
    }
    print("ids a request: " + ", ".join(f"batch {b} {ids[b]:.0f}" for b in batches))
    for call in contenders.values():  # warm: first calls, caches, allocator
        getattr(call, "setup", lambda: None)()
        for b in batches:
            for r in reqs[b][:4]:
                call(r)

    rounds = []  # per round: {(contender, batch, clients or "busy"): (p50, p99, rps)}
    for r in range(args.rounds):
        cells = {}
        names = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for b in batches:
            for n in client_counts + ([] if args.no_busy else ["busy"]):
                for name in names:
                    getattr(contenders[name], "setup", lambda: None)()
                    lat, rps = closed_loop(
                        contenders[name],
                        reqs[b],
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
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def med(f):
        return statistics.median(f(c) for c in rounds)

    print(
        f"\n{len(rounds)} rounds x {args.seconds} s a cell; medians over rounds "
        "(latencies in us; ratios are medians of per-round ratios)"
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{f"{k[0]}|{k[1]}|{k[2]}": v for k, v in c.items()} for c in rounds], f, indent=1
            )


if __name__ == "__main__":
    main()
