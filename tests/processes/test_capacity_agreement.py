"""Two real processes fed DIFFERENT batches agree on capacities and batch shapes.

Automatic capacities and overflow="grow" are decided from every process's
needs (issue #15 item 0): the job trains like one process over the union of the
batches; capacities that differ per process raise a clear error on every
process before any collective (no gloo size mismatch, no hang). Issue #24: a job
that differs per process in any field fails at build on every process, naming the
field (the fingerprint, also tested pure below), and a step that pairs different
batches (a process skipped one) fails on every process before its update.
"""

import os
import re
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from paths import SUPPORT as HERE  # the worker's folder
from process_helpers import free_port, run_collect, worker_env

import embedmesh as em
from embedmesh.config import resolve_feature_config
from embedmesh.facade import MeshEmbedding
from embedmesh.host import agree, fingerprint
from embedmesh.host.preprocess import Capacity, preprocess_batch
from embedmesh.layout.stacking import plan_stacking

WORKER = os.path.join(HERE, "capacity_worker.py")
TIMEOUT = 300  # a hang in a collective fails the test instead of stalling it (a
# process's build and compiles take over 60 s on a loaded 2-core machine)


ERROR_SKIPS = ("skip", "skip_prefetch", "skip_prefetch_shm", "skip_prefetch_shm_p0")
ERROR_MODES = ["mismatch", "first_error", "job", *ERROR_SKIPS, "skip_first", "late_error"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One launch for the module: the single-process reference ("auto,grow") beside one
    pair that trains "auto" and "grow", then runs every mode that must fail (ending at
    "late_error", exit code 3): `(folder, pair's codes, pair's outputs)`. (Each pair of
    its own costs two process starts, jax's import and a job's set-up.)"""
    d = tmp_path_factory.mktemp("capacity")
    port = free_port()
    single = [sys.executable, WORKER, "0", "1", "0", str(d / "single"), "auto,grow"]
    modes = ",".join(["auto", "grow", *ERROR_MODES])
    pair = [
        [sys.executable, WORKER, str(i), "2", str(port), str(d / "multi"), modes] for i in (0, 1)
    ]
    # (twelve builds and compiles in each process: minutes on a loaded machine)
    codes, outs = run_collect([single, *pair], env=worker_env(), timeout=2 * TIMEOUT)
    assert codes[0] == 0, outs[0][-3000:]
    return d, codes[1:], outs[1:]


@pytest.fixture(scope="module")
def trained(job):
    """`{mode: (single-process reference, process 0's, process 1's results)}`."""
    d, _, outs = job
    for out in outs:  # both trained before the modes that fail
        assert "mode auto: " in out and "mode grow: " in out, out[-3000:]
    return {
        m: tuple(
            np.load(d / f"{p}.{m}.{i}.npz") for p, i in (("single", 0), ("multi", 0), ("multi", 1))
        )
        for m in ("auto", "grow")
    }


@pytest.mark.parametrize("mode", ["auto", "grow"])
def test_different_batches_train_like_one_process(trained, mode):
    single, p0, p1 = trained[mode]
    # every process uses the capacities one process over the union would choose
    np.testing.assert_array_equal(p0["capacities"], single["capacities"])
    np.testing.assert_array_equal(p1["capacities"], single["capacities"])
    if mode == "grow":  # it grew at step 2, from process 1's batch alone
        caps = single["capacities"]
        assert (caps[2] > caps[1]).all(), caps
        assert (p0["needs"][2] <= caps[1]).all() and (p1["needs"][2] > caps[1]).any()
    keys = [k for k in single.files if k not in ("capacities", "needs")]
    assert len(keys) == 4
    for k in keys:
        np.testing.assert_allclose(p0[k], single[k], rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(p1[k], single[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert np.abs(single["t1.accumulators"] - 0.1).max() > 1e-3  # it trained


def _caught(out, mode):
    return next(x for x in out.splitlines() if x.startswith(f"CAUGHT {mode} "))


def test_errors_reach_every_process_before_any_mismatched_collective(job):
    _, codes, outs = job
    skips = ERROR_SKIPS
    assert codes == [3, 3], "\n=====\n".join(o[-3000:] for o in outs)
    job = {  # issue #24 items 1-4 and 6: the job's field and each process's value
        "mismatch": ("capacities", "max_ids_per_partition=64", "max_ids_per_partition=32"),
        "job:sharding": ("table 't1' sharding", "'mod'", "'auto'"),
        "job:vocabulary": ("table 't1' vocabulary_size", "256", "300"),
        "job:optimizer": ("table 't1' optimizer", "Adagrad", "SGD"),
        "job:combiner": ("table 't1' combiner", "'mean'", "'sum'"),
        "job:exchange_switch": ("EMBEDMESH_HOST_EXCHANGE", "'on'", "'off (0)'"),
    }
    for pid, out in enumerate(outs):
        # a job that differs per process: the same clear error on every process at build
        for mode, (field, v0, v1) in job.items():
            line = _caught(out, mode)
            assert f"ValueError: the processes of this job disagree on {field}: " in line, line
            assert re.search(
                f"process 0 has [^;]*{re.escape(v0)}.*, process 1 has [^;]*{re.escape(v1)}", line
            ), line
        # item 5: a process that skips a batch after its enqueue error: the next step
        # pairs different batches and fails on every process, its update not applied
        # (over gloo and over shared memory; process 1 skipping, or process 0)
        for mode in skips:
            line = _caught(out, mode)
            assert "RuntimeError: this step paired different batches" in line, line
            # the skipper's third attempt failed: its fourth meets the other's third
            skipper = 0 if mode.endswith("_p0") else 1
            mine, other = (4, 3) if pid == skipper else (3, 4)
            assert f"process {pid} is at batch {mine}, another process at batch {other}" in line
            assert f"UNTOUCHED {mode}" in out
    # an overflow in one process's first batch (the agreement): its own error there,
    # and the others learn of it in the agreement instead of waiting in a collective
    line = _caught(outs[1], "first_error")
    assert re.search(r"ValueError: stack t1\+t2: device [23] .* needs \d+ unique ids", line), line
    assert "max_unique_ids_per_partition=6" in line, line
    line = _caught(outs[0], "first_error")
    assert "BatchFailedElsewhere: process(es) [1] could not preprocess their batch" in line, line
    # the same where both processes' loops skip a batch on ValueError: both skip it (the
    # other's error a ValueError too) and train on in step, no process left waiting
    for pid, out in enumerate(outs):
        skipped = [x for x in out.splitlines() if x.startswith("SKIPPED skip_first ")]
        assert len(skipped) == 1, out[-3000:]
        want = "ValueError: stack" if pid == 1 else "BatchFailedElsewhere: process(es) [1]"
        assert want in skipped[0], skipped[0]
        assert "TRAINED skip_first 3 SKIPPED 1" in out, out[-3000:]
    # overflow in a later batch with fixed capacities (no per-step collective): the
    # overflowing process raises before any collective; the other, already in the
    # step's collective, gets the runtime's error when that process exits
    line = _caught(outs[1], "late_error")
    assert re.search(r"ValueError: stack t1\+t2: device [23] .* over the capacity", line), line
    assert "JaxRuntimeError" in _caught(outs[0], "late_error")


# -- the pure agreement (embedmesh.host.agree) and one process, in this process


def _config():
    t1 = em.TableConfig(256, 8, combiner="mean", name="t1")
    t2 = em.TableConfig(64, 4, combiner="sqrtn", name="t2")
    return {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}


def _batch(rng, hi, batch=8, long=False):
    lengths = rng.integers(30, 40, batch) if long else rng.integers(1, 4, batch)
    return {
        "a": rng.integers(0, hi, (batch, 3)),
        "b": em.RaggedTensor.from_row_lengths(rng.integers(0, 64, int(lengths.sum())), lengths),
    }


def _concat(parts):
    return {
        "a": np.concatenate([p["a"] for p in parts]),
        "b": em.RaggedTensor.from_row_lengths(
            np.concatenate([np.asarray(p["b"].values) for p in parts]),
            np.concatenate([np.diff(np.asarray(p["b"].row_splits)) for p in parts]),
        ),
    }


def _gathered(plan, parts, before, overflow="error"):
    """The vectors two processes of 2 devices each would gather."""
    vecs = []
    for p in parts:
        csr, stats = preprocess_batch(
            p, None, plan, num_devices_local=2, capacities=before, overflow=overflow
        )
        before_caps = {s.name: before for s in plan.stacks}
        vecs.append(agree.local_vector(plan, csr, stats, before_caps))
    return np.stack(vecs)


@pytest.mark.parametrize("grow", [False, True])
def test_agreed_capacities_are_those_of_one_process_over_the_union(grow):
    plan = plan_stacking(_config(), 4)
    rng = np.random.default_rng(3)
    parts = [_batch(rng, 6), _batch(rng, 200, long=grow)]  # different needs
    before = Capacity(8, 8) if grow else None
    overflow = "grow" if grow else "error"
    agreed = agree.decide(
        _gathered(plan, parts, before, overflow),
        plan,
        {s.name: before for s in plan.stacks},
        overflow,
    )
    _, union = preprocess_batch(
        _concat(parts), None, plan, num_devices_local=4, capacities=before, overflow=overflow
    )
    assert agreed == union.capacities
    alone = [
        preprocess_batch(p, None, plan, num_devices_local=2, capacities=before, overflow=overflow)
        for p in parts
    ]
    assert alone[0][1].capacities != alone[1][1].capacities  # each alone would differ
    if grow:
        assert union[plan.stacks[0].name].grown


def test_disagreements_raise_naming_stack_field_and_sizes():
    plan = plan_stacking(_config(), 4)
    rng = np.random.default_rng(3)
    parts = [_batch(rng, 6), _batch(rng, 6, batch=4)]  # another per-process batch size
    g = _gathered(plan, parts, Capacity(64, 64))
    name = plan.stacks[0].name
    with pytest.raises(ValueError, match=rf"stack {re.escape(name)}: .* rows_per_device"):
        agree.decide(g, plan, {name: Capacity(64, 64)}, "error")
    g[1] = agree.failed_vector(plan)
    with pytest.raises(RuntimeError, match=r"process\(es\) \[1\] could not preprocess") as e:
        agree.decide(g, plan, {name: Capacity(64, 64)}, "error")
    assert isinstance(e.value, ValueError)  # a loop skipping on ValueError skips it too
    shapes = agree.shapes_of(g[0], {name: Capacity(64, 64)}, plan)
    agree.check_unchanged(shapes, g[0], plan, 0)
    later = _gathered(plan, [_batch(rng, 6, batch=4)], Capacity(64, 64))[0]
    with pytest.raises(
        ValueError, match=r"process 0's batch has rows_per_device 8, .* agreed on 16"
    ):
        agree.check_unchanged(shapes, later, plan, 0)


def test_one_process_runs_no_agreement(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective on one process")

    monkeypatch.setattr(multihost_utils, "process_allgather", no_collective)
    rng = np.random.default_rng(5)
    emb = MeshEmbedding(_config(), em.Adagrad(0.2), mesh=Mesh(np.array(jax.devices()[:1]), ("x",)))
    grown = []
    for long in (False, False, True):  # automatic capacities, then one growth
        emb.enqueue(_batch(rng, 200, long=long))
        grown.append(bool(emb.last_stats.grown))
    assert grown == [False, False, True]


# -- the job fingerprint (embedmesh.host.fingerprint), pure


def _fields(p):
    """The fingerprint fields of a small job described by the parameters `p`."""
    t0 = em.TableConfig(
        p["vocab"],
        8,
        combiner="mean",
        name="t0",
        optimizer=p["optimizer"](p["lr"]),
        initializer=jax.nn.initializers.normal(p["stddev"]),
    )
    t1 = em.TableConfig(64, p["dim"], combiner=p["combiner"], name="t1")
    feats = {
        "a": em.FeatureConfig(t0, max_sequence_length=p["seq"]),
        "b": em.FeatureConfig(t1, output_shape=p["shape"]),
    }
    if p["extra"]:
        feats["c"] = em.FeatureConfig(t1)
    resolved = resolve_feature_config(feats)
    options = {"seed": p["seed"], "EMBEDMESH_HOST_EXCHANGE": p["exchange"]}
    strategies = {"t0": p["sharding"], "t1": "mod"}
    return fingerprint.job_fields(resolved, em.SGD(p["default_lr"]), strategies, options)


def _two_processes(fields0, fields1):
    """What `MeshEmbedding._agree_on_job` derives from two processes' fields: None when
    they agree, else the error every process raises."""
    blobs = [fingerprint.encode(f) for f in (fields0, fields1)]
    headers = np.stack([fingerprint.header(b) for b in blobs])
    if not fingerprint.differs(headers):
        return None
    return fingerprint.mismatch(np.stack([fingerprint.padded(b, headers) for b in blobs]), headers)


_BASE = {
    "vocab": 300,
    "optimizer": em.Adagrad,
    "lr": 0.1,
    "stddev": 0.01,
    "dim": 4,
    "combiner": "sum",
    "seq": 0,
    "shape": None,
    "extra": False,
    "seed": 0,
    "exchange": "on",
    "sharding": "mod",
    "default_lr": 0.5,
}
# parameter -> (the field named in the error, another value, how each process's value shows)
_CHANGES = {
    "vocab": ("table 't0' vocabulary_size", 3600, ("300", "3600")),
    "optimizer": ("table 't0' optimizer", em.SGD, ("Adagrad", "SGD")),
    "lr": ("table 't0' optimizer learning_rate", 0.2, ("0.1", "0.2")),
    "stddev": ("table 't0' initializer", 0.02, ("0.01", "0.02")),
    "dim": ("table 't1' dim", 5, ("4", "5")),
    "combiner": ("table 't1' combiner", "mean", ("'sum'", "'mean'")),
    "seq": ("feature 'a' max_sequence_length", 3, ("0", "3")),
    "shape": ("feature 'b' output_shape", (2, 4), ("None", "(2, 4)")),
    "extra": ("features", True, ("('a', 'b')", "('a', 'b', 'c')")),
    "seed": ("seed", 9, ("0", "9")),  # base seeds are 0..8: 9 always differs
    "exchange": ("EMBEDMESH_HOST_EXCHANGE", "off", ("'on'", "'off'")),
    "sharding": ("table 't0' sharding", "auto", ("'mod'", "'auto'")),
    "default_lr": ("table 't1' optimizer learning_rate", 0.25, ("0.5", "0.25")),
}


@pytest.mark.parametrize("param", sorted(_CHANGES))
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_fingerprint_names_any_single_field_change(param, seed):
    rng = np.random.default_rng(seed)
    base = dict(_BASE, vocab=int(rng.integers(100, 1000)), seed=int(rng.integers(0, 9)))
    assert _two_processes(_fields(base), _fields(dict(base))) is None  # equal jobs agree
    field, other, (shown0, shown1) = _CHANGES[param]
    if param in ("vocab", "seed"):
        shown0 = str(base[param])
    err = _two_processes(_fields(base), _fields(dict(base, **{param: other})))
    assert err is not None
    msg = str(err)
    assert f"disagree on {field}: process 0 has " in msg, msg
    v0, v1 = msg.split(": process 0 has ", 1)[1].split(". Every")[0].split(", process 1 has ")
    assert shown0 in v0 and shown1 in v1, msg


def test_fingerprint_describes_callables_by_name_and_closure():
    assert fingerprint.describe(jax.nn.initializers.normal(0.01)) == fingerprint.describe(
        jax.nn.initializers.normal(0.01)
    )
    assert fingerprint.describe(jax.nn.initializers.normal(0.01)) != fingerprint.describe(
        jax.nn.initializers.normal(0.02)
    )
    assert " at 0x" not in fingerprint.describe(object())
    assert fingerprint.describe(np.float32(0.5)) == "0.5"
