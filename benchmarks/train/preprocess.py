"""Host preprocessing throughput: embedmesh vs jax-tpu-embedding's C++ preprocessing.

The workload of jax-tpu-embedding's own preprocessing benchmark: 26 features,
each with its own 1M-row table, 8 devices (one process), 4096 samples per
device, Zipf(1.05) ids with permuted ranks, ~10 ids per sample, either dense
`[B, 10]` or ragged with Poisson(10) row lengths: about 8.5 M ids per step.

Both libraries run in this one process, interleaved, on the same batch, each
with capacities measured in a first pass (embedmesh: `compute_sparse_core_stats`;
jax-tpu-embedding: limits from its returned stats), each given its native input
form (embedmesh: a `RaggedTensor`, ten ids a row for "dense"; jax-tpu-embedding: a
`[B, 10]` array or an object array of per-sample arrays). Prints the median
ids/s of each and the ratio.

    PYTHONPATH=. python benchmarks/train/preprocess.py            # both cores
    PYTHONPATH=. python benchmarks/train/preprocess.py --cores 1  # pin everything to one core

jax-tpu-embedding is an optional peer (`pip install jax-tpu-embedding`, in a
separate environment: it is no dependency of embedmesh); without it only
embedmesh is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

# Pin before anything starts a thread pool (numba, the peer's C++ pool).
if __name__ == "__main__" and "--cores" in sys.argv:
    _n = int(sys.argv[sys.argv.index("--cores") + 1])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:_n])
    os.environ.setdefault("NUMBA_NUM_THREADS", str(_n))

import numpy as np

from embedmesh.config import FeatureConfig, TableConfig
from embedmesh.host.preprocess import (
    compute_sparse_core_stats,
    native_available,
    numba_available,
    preprocess_features,
)
from embedmesh.inputs import RaggedTensor
from embedmesh.layout.stacking import plan_stacking

NUM_FEATURES = 26
VOCAB = 1_000_000
DEVICES = 8
PER_DEVICE = 4096
VALENCY = 10
ZIPF_A = 1.05
DIM = 16
COMBINER = "sum"


def zipf_ids(rng, cdf, perm, size):
    """Zipf(a) ranks over the vocabulary (inverse CDF), mapped through a permutation."""
    r = np.searchsorted(cdf, rng.random(size))
    return perm[np.minimum(r, VOCAB - 1)].astype(np.int32)


def make_batches(seed=0):
    rng = np.random.default_rng(seed)
    batch = DEVICES * PER_DEVICE
    cdf = np.cumsum(np.arange(1, VOCAB + 1, dtype=np.float64) ** -ZIPF_A)
    cdf /= cdf[-1]
    dense, ragged = [], []
    for _ in range(NUM_FEATURES):
        perm = rng.permutation(VOCAB).astype(np.int32)
        dense.append(zipf_ids(rng, cdf, perm, (batch, VALENCY)))
        lengths = rng.poisson(VALENCY, batch)
        ragged.append(
            RaggedTensor.from_row_lengths(zipf_ids(rng, cdf, perm, int(lengths.sum())), lengths)
        )
    return dense, ragged


def feature_config():
    return {
        f"f{i:02d}": FeatureConfig(TableConfig(VOCAB, DIM, combiner=COMBINER, name=f"t{i:02d}"))
        for i in range(NUM_FEATURES)
    }


# ---------------------------------------------------------------------------
# Peer: jax-tpu-embedding


def load_peer():
    try:
        from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec
    except Exception as e:  # ImportError, or a broken install
        return None, f"{type(e).__name__}: {e}"
    return (embedding, embedding_spec), None


@contextlib.contextmanager
def quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peer_runner(peer, inputs):
    embedding, embedding_spec = peer
    batch = DEVICES * PER_DEVICE

    def specs(limits):
        out = {}
        for i in range(NUM_FEATURES):
            name = f"t{i:02d}"
            ids, uniq = limits.get(name, (1 << 15, 1 << 15))
            table = embedding_spec.TableSpec(
                vocabulary_size=VOCAB,
                embedding_dim=DIM,
                initializer=lambda *a: None,
                optimizer=embedding_spec.SGDOptimizerSpec(),
                combiner=COMBINER,
                name=name,
                max_ids_per_partition=ids,
                max_unique_ids_per_partition=uniq,
            )
            out[f"f{i:02d}"] = embedding_spec.FeatureSpec(
                name=f"f{i:02d}",
                table_spec=table,
                input_shape=[batch, VALENCY],
                output_shape=[batch, DIM],
            )
        embedding.prepare_feature_specs_for_training(
            out, global_device_count=DEVICES, num_sc_per_device=4
        )
        return out

    def run(fs):
        with quiet_stderr():  # its C++ logs a warning per table and call
            return embedding.preprocess_sparse_dense_matmul_input(
                inputs,
                None,
                fs,
                local_device_count=DEVICES,
                global_device_count=DEVICES,
                num_sc_per_device=4,
                has_leading_dimension=False,
                allow_id_dropping=False,
            )

    _, stats = run(specs({}))  # first pass: measure, then tune the limits
    limits = {}
    for name in stats.max_ids_per_partition:
        ids = int(np.max(stats.max_ids_per_partition[name]))
        uniq = int(np.max(stats.max_unique_ids_per_partition[name]))
        limits[name] = (-(-ids // 8) * 8, -(-uniq // 8) * 8)
    tuned = specs(limits)
    return lambda: run(tuned)


def peer_inputs(dense, ragged, variant):
    keys = [f"f{i:02d}" for i in range(NUM_FEATURES)]
    if variant == "dense":
        return dict(zip(keys, dense))
    out = {}
    for k, r in zip(keys, ragged):
        splits = np.asarray(r.row_splits)
        rows = np.empty(splits.shape[0] - 1, dtype=object)
        rows[:] = np.split(np.asarray(r.values), splits[1:-1])
        out[k] = rows
    return out


# ---------------------------------------------------------------------------


def embedmesh_runner(inputs, stack_tables, backend, threads=1):
    plan = plan_stacking(feature_config(), DEVICES, stack_tables=stack_tables)
    caps = compute_sparse_core_stats(
        [inputs], plan, num_devices_local=DEVICES, backend=backend
    ).capacities()
    return lambda: preprocess_features(
        inputs,
        None,
        plan,
        num_devices_local=DEVICES,
        capacities=caps,
        backend=backend,
        num_threads=threads,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", type=int, default=None, help="pin the process to this many cores")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="dense,ragged")
    ap.add_argument("--numpy", action="store_true", help="also time the pure numpy backend")
    ap.add_argument(
        "--backends",
        default=",".join(
            b for b, ok in (("native", native_available()), ("numba", numba_available())) if ok
        ),
        help="compiled backends to time, comma-separated (default: native,numba where available); "
        "the first's per-round ratio against the second is printed",
    )
    args = ap.parse_args()

    peer, why = load_peer()
    print(
        f"cores: {len(os.sched_getaffinity(0))}, native: {native_available()}, "
        f"numba: {numba_available()}, "
        f"jax-tpu-embedding: {'yes' if peer else 'missing (' + why + ')'}"
    )
    t = time.perf_counter()
    dense, ragged = make_batches()
    print(f"generated the batches in {time.perf_counter() - t:.1f}s")

    for variant in args.variants.split(","):
        # jax-tpu-embedding combines the ids of a dense [B, 10] row; embedmesh follows
        # TensorFlow's serving rules (dense ids are plain lookups, [B, 10, dim]), so it
        # gets the same ids as ten-id ragged rows: the same work
        ours = dict(
            zip(
                [f"f{i:02d}" for i in range(NUM_FEATURES)],
                [RaggedTensor(x.reshape(-1), np.arange(0, x.size + 1, x.shape[1])) for x in dense]
                if variant == "dense"
                else ragged,
            )
        )
        n_ids = sum(int(x.row_splits[-1]) for x in ours.values())
        runners = {}
        compiled = [b for b in args.backends.split(",") if b]
        for threads in range(1, len(os.sched_getaffinity(0)) + 1):
            for stack in (True, False):
                for backend in compiled:  # native then numba: interleaved in each round
                    runners[f"{backend} {threads}T, {'stacked' if stack else 'unstacked'}"] = (
                        embedmesh_runner(ours, stack, backend, threads)
                    )
        if len(compiled) > 1:  # the compiled backends agree bit for bit on this batch
            for k in [k for k in runners if k.startswith(compiled[0])]:
                a, *others = [runners[k.replace(compiled[0], b, 1)]()[0] for b in compiled]
                for b in others:
                    for name in a:
                        for f in a[name]._ARRAYS:
                            x, y = getattr(a[name], f), getattr(b[name], f)
                            np.testing.assert_array_equal(x, y, err_msg=f"{k}: {name}.{f}")
            print(f"{variant}: {', '.join(compiled)} gave identical arrays")
        if args.numpy or not compiled:
            runners["numpy, stacked"] = embedmesh_runner(ours, True, "numpy")
            runners["numpy, unstacked"] = embedmesh_runner(ours, False, "numpy")
        if peer:
            runners["jax-tpu-embedding"] = peer_runner(peer, peer_inputs(dense, ragged, variant))
        for run in runners.values():  # warm up (compilation, first-touch allocations)
            run()
        wall = {k: [] for k in runners}
        cpu = {k: [] for k in runners}
        for _ in range(args.rounds):  # interleaved rounds
            for k, run in runners.items():
                t, c = time.perf_counter(), time.process_time()
                run()
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c)
        print(
            f"\n{variant}: {n_ids / 1e6:.2f} M ids per step; medians of {args.rounds} "
            f"interleaved rounds; wall time, and CPU time of all threads"
        )
        med = {k: statistics.median(v) for k, v in wall.items()}
        mcpu = {k: statistics.median(v) for k, v in cpu.items()}
        for k, v in med.items():
            print(
                f"  {k:28s} wall {v * 1e3:7.1f} ms {n_ids / v / 1e6:6.1f} M ids/s"
                f" (best {n_ids / min(wall[k]) / 1e6:5.1f})   cpu {mcpu[k] * 1e3:7.1f} ms "
                f"{n_ids / mcpu[k] / 1e6:6.1f} M ids/cpu-s"
            )
        if len(compiled) > 1:  # medians of per-round ratios against the second backend
            for k in [k for k in runners if k.startswith(compiled[0])]:
                other = k.replace(compiled[0], compiled[1], 1)
                r = [b / a for a, b in zip(wall[k], wall[other])]
                rc = [b / a for a, b in zip(cpu[k], cpu[other])]
                print(
                    f"  {k} vs {compiled[1]}: wall {statistics.median(r):.2f}x faster "
                    f"(rounds {min(r):.2f}-{max(r):.2f}), cpu {statistics.median(rc):.2f}x"
                )
        if peer:
            ref, ref_cpu = med["jax-tpu-embedding"], mcpu["jax-tpu-embedding"]
            for k in med:
                if k != "jax-tpu-embedding":
                    print(
                        f"  {k} vs jax-tpu-embedding: wall {ref / med[k]:.2f}x, "
                        f"cpu {ref_cpu / mcpu[k]:.2f}x"
                    )


if __name__ == "__main__":
    main()
