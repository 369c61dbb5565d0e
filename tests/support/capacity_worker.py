"""One process of the capacity-agreement tests (run by test_capacity_agreement.py).

Usage: capacity_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_PREFIX MODE[,MODE...]

Each process feeds its OWN batches (different ids, different unique ids per
partition), so the capacities each would choose alone differ. NUM_PROCESSES 1
runs the single-process reference on 4 devices over the union of both
processes' batches (process p's samples on devices 2p, 2p+1, as in the job).
Modes: "auto" (automatic capacities, overflow="error": sized once, from every
process's first batch), "grow" (automatic, overflow="grow": at step 2 only
process 1 needs more; batches through `prefetch`), and modes that must fail,
each failure printed as a line "CAUGHT mode ExceptionType: message":
"mismatch" (explicit capacities that differ per process: a ValueError on every
process), "first_error" (explicit
capacities, overflow="error", process 1's first batch overflows: its ValueError,
a RuntimeError on process 0), "late_error" (automatic capacities sized at the
first batch, overflow="error", process 1's step-2 batch overflows; no per-step
collective: process 1 raises, then exits with code 3, and process 0, waiting in
the step's collective, gets the runtime's error and exits with code 3 too),
"job" (issue #24 items 1-4 and 6: process 1 builds a job that differs in one
field, one case after the other: each a ValueError on every process at build,
"CAUGHT job:CASE ..."), "skip" and "skip_prefetch" (item 5: as "late_error", but
process 1's loop catches its enqueue error and goes on with its next batch; the
next step pairs different batches: a RuntimeError on every process, tables as
after the last good step; "skip_prefetch": pipelined, check_finite=False,
EMBEDMESH_HOST_EXCHANGE=0, batches through `prefetch`, restarted after the error;
"skip_prefetch_shm": the same over the shared-memory exchange; a suffix "_p0": process 0
is the one that overflows and skips), "skip_first" (process 1's first batch overflows the
explicit capacities; both processes' loops skip on ValueError: both skip it, both train
on the 3 others).
"""

import contextlib
import os
import sys
import time

import orphan_guard  # noqa: F401  (this worker dies with the test process)
from process_helpers import start_cpu_process

process_id, num_processes, port, out_prefix, modes = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5].split(","),
)
start_cpu_process(process_id, num_processes, port)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import embedmesh as em  # noqa: E402
from embedmesh.facade import MeshEmbedding  # noqa: E402
from embedmesh.host.preprocess import Capacity  # noqa: E402

STEPS = 4
BATCH = 8  # per process


def process_batches(pid, mode, steps=STEPS):
    """Process pid's batches: process 0 draws from few ids, process 1 from many."""
    rng = np.random.default_rng(100 + pid)
    for step in range(steps):
        hi = 6 if pid == 0 else 200
        if mode in ("auto", "late_error", "skip_first") and step > 0:
            hi = 6  # later batches fit the capacities agreed at the first
        lengths = rng.integers(1, 4, BATCH)
        if mode in ("grow", "late_error") and pid == 1 and step == 2:
            hi, lengths = 256, rng.integers(30, 40, BATCH)  # only process 1 outgrows here
        yield {
            "a": rng.integers(0, hi, (BATCH, 3)),
            "b": (rng.integers(0, min(hi, 64), int(lengths.sum())), lengths),
        }


def union_batches(mode):
    for parts in zip(*(process_batches(p, mode) for p in range(2))):
        yield {
            "a": np.concatenate([p["a"] for p in parts]),
            "b": tuple(np.concatenate([p["b"][i] for p in parts]) for i in range(2)),
        }


def run(mode):
    t1 = em.TableConfig(256, 8, combiner="mean", name="t1")
    t2 = em.TableConfig(64, 4, combiner="sqrtn", name="t2")
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    assert mesh.size == 4, mesh
    kwargs = {"overflow": "error"} if mode in ("auto", "late_error") else {}
    if mode == "mismatch":
        kwargs = {"capacities": Capacity(64, 64) if process_id == 0 else Capacity(32, 32)}
    if mode == "first_error":
        kwargs = {"capacities": Capacity(32, 6)}  # process 0's first batch fits, 1's not
    emb = MeshEmbedding(feats, em.Adagrad(0.2), mesh=mesh, **kwargs)
    emb.build()
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))
    batches = union_batches(mode) if num_processes == 1 else process_batches(process_id, mode)
    batches = (dict(b, b=em.RaggedTensor.from_row_lengths(*b["b"])) for b in batches)
    # grow: through prefetch (local preprocessing in a thread, the agreement not)
    stream = emb.prefetch(batches) if mode == "grow" else map(emb.enqueue, batches)
    caps, needs = [], []  # per step and stack: the capacities, this process's needs
    for enqueued in stream:
        acts, pre = emb.dequeue(enqueued)
        emb.apply_gradients(grad_fn(acts), pre)
        caps.append(
            [
                [c.capacity.max_ids_per_partition, c.capacity.max_unique_ids_per_partition]
                for c in pre.values()
            ]
        )
        if num_processes > 1:  # (one process prefetching: last_stats may be a later batch's)
            stacks = emb.last_stats.stacks.values()
            needs.append(
                [[c.max_ids_per_partition, c.max_unique_ids_per_partition] for c in stacks]
            )
    tables = emb.variables
    out = {f"{t.name}.{k}": v for t, d in tables.items() for k, v in d.items()}
    out["capacities"], out["needs"] = np.array(caps), np.array(needs)
    np.savez(f"{out_prefix}.{mode}.{process_id}.npz", **out)


@contextlib.contextmanager
def exchange_switch(value):
    """EMBEDMESH_HOST_EXCHANGE=value (None: as it is) while the block runs."""
    saved = os.environ.get("EMBEDMESH_HOST_EXCHANGE")
    if value is not None:
        os.environ["EMBEDMESH_HOST_EXCHANGE"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("EMBEDMESH_HOST_EXCHANGE", None)
        else:
            os.environ["EMBEDMESH_HOST_EXCHANGE"] = saved


def job_mismatches():
    """Each case: process 1 differs from process 0 in one field; build must fail on both."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    cases = {
        "sharding": {"sharding": "auto"},
        "vocabulary": {"vocab": 300},
        "optimizer": {"optimizer": em.SGD(0.2)},
        "combiner": {"combiner": "sum"},
        "exchange_switch": {"EMBEDMESH_HOST_EXCHANGE": "0"},
    }
    base = {"vocab": 256, "optimizer": em.Adagrad(0.2), "combiner": "mean", "sharding": "mod"}
    for case, change in cases.items():
        cfg = dict(base, **(change if process_id == 1 else {}))
        t1 = em.TableConfig(cfg["vocab"], 8, combiner=cfg["combiner"], name="t1")
        t2 = em.TableConfig(64, 4, combiner="sqrtn", name="t2")
        feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
        emb = MeshEmbedding(feats, cfg["optimizer"], mesh=mesh, sharding=cfg["sharding"])
        batch = next(process_batches(process_id, "auto"))
        try:  # (the first batch builds: "auto" plans from it)
            with exchange_switch(cfg.get("EMBEDMESH_HOST_EXCHANGE")):
                emb.enqueue(dict(batch, b=em.RaggedTensor.from_row_lengths(*batch["b"])))
        except ValueError as e:
            print(f"CAUGHT job:{case} {type(e).__name__}: {e}", flush=True)


def skip_a_batch(mode):
    """Process 1 skips its overflowing step-2 batch; the step pairing it with process
    0's step-2 batch fails on both, before its update."""
    prefetching = mode.startswith("skip_prefetch")
    with exchange_switch("0" if mode == "skip_prefetch" else None):
        _skip_a_batch(mode, prefetching)


def _skip_a_batch(mode, prefetching):
    t1 = em.TableConfig(256, 8, combiner="mean", name="t1")
    t2 = em.TableConfig(64, 4, combiner="sqrtn", name="t2")
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
    emb = MeshEmbedding(
        feats,
        em.Adagrad(0.2),
        prefetching,  # pipelined
        mesh=Mesh(np.array(jax.devices()), ("x",)),
        overflow="error",
        check_finite=not prefetching,
    )
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))
    batches = (
        dict(b, b=em.RaggedTensor.from_row_lengths(*b["b"]))
        # (restarting prefetch loses the batches its thread had taken: a long stream)
        for b in process_batches(
            1 - process_id if mode.endswith("_p0") else process_id, "late_error", 2 * STEPS
        )
    )
    stream = emb.prefetch(batches) if prefetching else map(emb.enqueue, batches)
    before = None
    try:
        while True:
            try:
                enqueued = next(stream)
            except StopIteration:
                break
            except ValueError as e:  # the user's loop skips the batch and goes on
                print(f"SKIPPED {mode} {e}", flush=True)
                if prefetching:
                    stream = emb.prefetch(batches)
                continue
            acts, pre = emb.dequeue(enqueued)
            before = {t.name: v["parameters"] for t, v in emb.variables.items()}
            emb.apply_gradients(grad_fn(acts), pre)
    except RuntimeError as e:
        print(f"CAUGHT {mode} {type(e).__name__}: {e}", flush=True)
        after = {t.name: v["parameters"] for t, v in emb.variables.items()}
        assert before is not None
        for name in after:  # the refused step left the tables as they were
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        print(f"UNTOUCHED {mode}", flush=True)


def skip_first():
    """Process 1's first batch overflows the explicit capacities (the agreement): its own
    ValueError there, `agree.BatchFailedElsewhere` (a ValueError too) on process 0, so
    the usual loop, skipping a batch on ValueError, skips it on both and both train on
    the next ones in step."""
    t1 = em.TableConfig(256, 8, combiner="mean", name="t1")
    t2 = em.TableConfig(64, 4, combiner="sqrtn", name="t2")
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    emb = MeshEmbedding(feats, em.Adagrad(0.2), mesh=mesh, capacities=Capacity(32, 6))
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))
    trained = skipped = 0
    for b in process_batches(process_id, "skip_first"):
        try:
            enqueued = emb.enqueue(dict(b, b=em.RaggedTensor.from_row_lengths(*b["b"])))
        except ValueError as e:  # the user's loop skips the batch and goes on
            print(f"SKIPPED skip_first {type(e).__name__}: {e}", flush=True)
            skipped += 1
            continue
        acts, pre = emb.dequeue(enqueued)
        emb.apply_gradients(grad_fn(acts), pre)
        trained += 1
    print(f"TRAINED skip_first {trained} SKIPPED {skipped}", flush=True)


def main():
    for mode in modes:
        t = time.perf_counter()
        try:
            if mode == "job":
                job_mismatches()
            elif mode == "skip_first":
                skip_first()
            elif mode.startswith("skip"):
                skip_a_batch(mode)
            else:
                run(mode)
        except Exception as e:
            if mode not in ("mismatch", "first_error", "late_error"):
                raise
            print(f"CAUGHT {mode} {type(e).__name__}: {e}", flush=True)
            if mode == "late_error":
                os._exit(3)  # the job is broken: no shutdown barrier with the other process
        print(f"mode {mode}: {time.perf_counter() - t:.2f} s", flush=True)
    if num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
