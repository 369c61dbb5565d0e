"""The shared-memory exchange between processes of one host (host_exchange.cc).

Real processes on 127.0.0.1 (one CPU device each, gloo) exchange through
`ops.exchange` with the job's same-host key: the results equal numpy's and XLA's
all-to-all exactly, and the host kernels of the N-shard lookup and update equal their
references (tests/support/host_exchange_worker.py says what it runs); sizes that
differ per process are a clear error on every process; a MeshEmbedding trains to
the same tables as with EMBEDMESH_HOST_EXCHANGE=0 (gloo). In this process: the
channel tags and the check that one program uses each channel once.
"""

import glob
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from paths import SUPPORT as HERE  # the worker's folder
from paths import child_pythonpath
from process_helpers import free_port, run_collect

from embedmesh import _runtime
from embedmesh.device import ops
from embedmesh.device.ops.cpu import kernels, library

WORKER = os.path.join(HERE, "host_exchange_worker.py")
# A worker still running after this is killed (a hang fails the test, it does not stall
# the suite); a deadlock at an exchange ends the worker at the exchange's own 60 s
# timeout first, with its message. Not less: the 2-process run of all three modes took
# 122 s once at load 10 (21-27 s at load 4-5).
TIMEOUT = 300

needs_kernels = pytest.mark.skipif(not library.ready(), reason="no CPU kernels")


def _env(**extra):
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _commands(n, mode, *rest):
    port = str(free_port())
    return [[sys.executable, WORKER, str(i), str(n), port, mode, *rest] for i in range(n)]


def _check_modes(outs, modes):
    for out in outs:
        for mode in modes.split(","):
            assert f"OK {mode}" in out, out[-3000:]


@needs_kernels
def test_two_processes_exchange_train_and_refuse_sizes_that_differ(tmp_path):
    """One 2-process job (one start-up, not four): ops.exchange, and the host kernels of
    the N-shard lookup and update and of the pooled ops, against XLA's exchange; then
    training against the gloo exchange (`_check_training`); then sizes that differ per
    process on one channel, a clear error on every process (`_check_mismatch`); then one
    round on a new channel and the job SIGKILLed whole: its nameless segments (memfds)
    never had a name, nothing is left in /dev/shm (`_check_killed`)."""
    out_file = str(tmp_path / "tables")
    modes = "exchange,ops,pooled,train,mismatch,killed"
    codes, outs = run_collect(_commands(2, modes, out_file), _env(), timeout=TIMEOUT)
    _check_killed(codes, outs, nameless=True)
    _check_modes(outs, "exchange,ops,pooled")
    _check_training(outs, out_file)
    _check_mismatch(outs)


@needs_kernels
def test_three_processes_exchange_like_all_to_all_and_named_segments_go():
    """The host kernels of the N-shard lookup and update and of the pooled ops, where each
    rank has several peers (2: three processes cost a start-up less than four), against
    XLA's exchange; on named segments (the fallback, when
    a process cannot open the others' descriptors: here the last one pretends so), which
    lose their names once every peer has arrived in their first round (each has mapped
    them): the job SIGKILLed whole after one more round leaves none in /dev/shm."""
    modes = "named,ops,pooled,killed"
    codes, outs = run_collect(_commands(3, modes), _env(), timeout=TIMEOUT)
    _check_killed(codes, outs, nameless=False)
    _check_modes(outs, "ops,pooled")


def _check_killed(codes, outs, nameless: bool):
    """A job that SIGKILLed itself (every process) after a round: every process was
    killed, each saw its segments nameless or not, and none of the job's is left."""
    assert codes == [-signal.SIGKILL] * len(outs), "\n=====\n".join(o[-3000:] for o in outs)
    assert _nameless(outs) == {"1" if nameless else "0"}
    (killed,) = _jobs(outs)
    assert _segments(killed) == []


def _check_mismatch(outs):
    for pid, out in enumerate(outs):
        (line,) = [x for x in out.splitlines() if x.startswith(("CAUGHT", "NO ERROR"))]
        mine, theirs = (64, 128) if pid == 0 else (128, 64)
        assert "channel 'test/mismatch'" in line and f"rank {pid} of 2" in line, line
        assert f"rank {1 - pid} sent {theirs} bytes, this rank {mine}" in line, line


@needs_kernels
def test_a_missing_peer_fails_the_call_and_an_exited_one_at_once():
    codes, outs = run_collect(
        _commands(2, "absent"), _env(EMBEDMESH_EXCHANGE_TIMEOUT_S="1.5"), timeout=TIMEOUT
    )
    assert codes == [0, 0], "\n=====\n".join(o[-3000:] for o in outs)
    lines = [x for x in outs[0].splitlines() if x.startswith(("CAUGHT", "NO ERROR"))]
    assert len(lines) == 2, outs[0][-3000:]
    where = "channel 'test/absent', tag "
    assert lines[0].startswith("CAUGHT timeout") and where in lines[0], lines[0]
    assert "rank 0 of 2), round 2: peers 1 did not arrive within 1.5 s" in lines[0], lines[0]
    assert (
        lines[1].startswith("CAUGHT exited")
        and "round 3: the process of peers 1 exited" in (lines[1])
    ), lines[1]
    assert float(lines[1].split()[2]) < 1.5  # not the timeout: it saw the process gone


def _segments(job: str) -> list[str]:
    """The names of job `job`'s segments in /dev/shm (`job`: its key in hex)."""
    return sorted(glob.glob(f"/dev/shm/embedmesh-{job}-*"))


def _jobs(outs) -> set[str]:
    return {x.split()[1] for out in outs for x in out.splitlines() if x.startswith("JOB ")}


def _nameless(outs) -> set[str]:
    return {x.split()[1] for out in outs for x in out.splitlines() if x.startswith("NAMELESS ")}


@needs_kernels
@pytest.mark.parametrize("segments", ["nameless", "named"])
def test_a_peer_killed_before_its_segment_is_noticed_within_seconds(segments):
    """A peer killed before it created its segment fails the others within seconds (its
    pid, gathered at build, is gone), even with no timeout (inf); the named segments left
    then are unlinked by the process that noticed. (A job SIGKILLed whole after a round:
    the 2- and 3-process tests above, nameless and named.)"""
    env = _env(EMBEDMESH_EXCHANGE_TIMEOUT_S="inf")
    extra = ",named" if segments == "named" else ""
    codes, outs = run_collect(_commands(2, "early" + extra), env, timeout=TIMEOUT)
    assert codes == [0, -signal.SIGKILL], "\n=====\n".join(o[-3000:] for o in outs)
    assert _nameless(outs) == {"1" if segments == "nameless" else "0"}
    (line,) = [x for x in outs[0].splitlines() if x.startswith(("CAUGHT", "NO ERROR"))]
    assert "channel 'test/early'" in line and "process 1 (pid " in line, line
    assert "exited" in line and float(line.split()[1]) < 20, line
    (early,) = _jobs(outs)
    assert _segments(early) == []


@needs_kernels
def test_a_job_killed_inside_its_first_exchange_leaves_no_segment():
    """SIGKILLed whole (one `kill -9` of both pids) while process 0 waits in its first
    exchange for process 1, which never started its own, so that no process saw all its
    peers arrive: nothing of the job is left in /dev/shm (its segments never had a name
    there). Before nameless segments, process 0's stayed until the next job on the host."""
    env = _env(EMBEDMESH_EXCHANGE_TIMEOUT_S="inf")
    codes, outs = run_collect(_commands(2, "killed_waiting"), env, timeout=TIMEOUT)
    assert codes == [-signal.SIGKILL] * 2, "\n=====\n".join(o[-3000:] for o in outs)
    assert _nameless(outs) == {"1"}
    (job,) = _jobs(outs)
    assert _segments(job) == []


def _check_training(outs, out_file):
    """Adagrad on one stack; SGD on two stacks with each update fused with the next lookup
    (independent host calls in one program): the same tables as XLA's exchange (gloo)."""
    channels = {
        "adagrad": ["finite", "t1+t2/lookup/ids", "t1+t2/lookup/rows", "t1+t2/update/sources"],
        "sgd": [f"{t}/{k}" for t in ("t1", "t2") for k in ("lookup/ids", "lookup/rows")],
    }
    channels["sgd"] = sorted(channels["sgd"] + ["finite", "t1/update/sources", "t2/update/sources"])
    # the job trains with EMBEDMESH_HOST_EXCHANGE=1, then =0 (gloo): one start-up, not two
    for out in outs:
        for setting in ("1", "0"):
            for name, expected in channels.items():
                # the setting took: the core has a same-host key or not
                assert f"HOST_JOB {setting} {name} {setting}" in out, out[-3000:]
                # the host lookup and update kernels ran (their segments), or none
                want = expected if setting == "1" else []
                assert f"CHANNELS {setting} {name} {want}" in out, out[-3000:]
        for name in channels:
            # a NaN in one process's gradients: both reject the step, tables as before
            assert out.count(f"REJECTED {name} unchanged=True") == 2, out[-3000:]
    a, b = (np.load(f"{out_file}_{setting}.npz") for setting in ("1", "0"))
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 6
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert np.abs(a["adagrad/t1.accumulators"] - 0.1).max() > 1e-3  # training happened


@needs_kernels
def test_exchange_timeout_setting(monkeypatch):
    """EMBEDMESH_EXCHANGE_TIMEOUT_S reaches the kernel's attribute (inf: -1, no deadline);
    a value that is not a positive number raises naming the variable and the value."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def lowered(value):  # a fresh function: traced anew
        monkeypatch.setenv("EMBEDMESH_EXCHANGE_TIMEOUT_S", value)
        _runtime.reset()
        f = jax.shard_map(
            lambda x: ops.exchange(x, ops.Transport("x", 2, host_job=7, channel="timeout")),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
        return jax.jit(f).lower(jnp.zeros((4, 2), jnp.float32)).as_text()

    try:
        for value, ms in [("2.5", 2500), (" inf ", -1), ("1e300", -1), ("1e-9", 1)]:
            text = lowered(value)
            assert "embedmesh_host_exchange" in text and f"timeout_ms = {ms} :" in text, value
        for value in ["-1", "0", "nan", "-inf", "soon"]:
            with pytest.raises(ValueError, match=f"EMBEDMESH_EXCHANGE_TIMEOUT_S='{value}'"):
                lowered(value)
    finally:
        monkeypatch.delenv("EMBEDMESH_EXCHANGE_TIMEOUT_S")
        _runtime.reset()
    assert _runtime.exchange_timeout_s() == 60.0


def test_channel_tags_are_stable_and_distinct():
    # the same in every process (not Python's salted hash): fixed values
    assert kernels.channel_tag("stack/lookup/ids") == 0x72A9FEC7C7C7D50A
    names = [f"stack{i}/{p}/{k}" for i in range(50) for p in ("lookup", "update") for k in "ab"]
    tags = {kernels.channel_tag(c) for c in names}
    assert len(tags) == len(names) and all(0 <= t < 2**63 for t in tags)


@needs_kernels
def test_one_program_cannot_use_a_channel_twice():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(x, channel_b):
        a = ops.exchange(x, ops.Transport("x", 2, host_job=12345, channel="dup/a"))
        b = ops.exchange(x * 2, ops.Transport("x", 2, host_job=12345, channel=channel_b))
        return a + b

    def program(channel_b):
        f = jax.shard_map(
            lambda x: body(x, channel_b),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
        return jax.jit(f).lower(jnp.zeros((8, 3), jnp.float32))  # traced, never run

    program("dup/b")  # distinct channels: fine
    program("dup/b")  # a second program (a new trace) may use the same channels
    with pytest.raises(ValueError, match="channel 'dup/a' is used twice in one program"):
        program("dup/a")
