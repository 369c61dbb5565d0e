"""Launching real worker processes for the multi-process tests (127.0.0.1 only)."""

import os
import socket
import subprocess
import sys

import numpy as np
from paths import SUPPORT as HERE  # the workers' folder
from paths import child_pythonpath


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """A worker process's environment: this one's, with the test XLA flags alone (not
    this process's device count: each worker sets its own) and the repository on
    PYTHONPATH."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH", ""))
    return env


def run_collect(commands, env, timeout=300):
    """Start every command at once, wait for all (killing any still running after
    `timeout` seconds: a hang fails the caller, it does not stall it);
    `(return codes, outputs)`, a killed process's code negative."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd in commands
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n[killed after {timeout} s]".encode()
        finally:
            if p.poll() is None:
                p.kill()
        outputs.append(out.decode(errors="replace"))
    return [p.returncode for p in procs], outputs


def run_together(commands, env, timeout=300):
    """Start every command at once, wait for all; assert each exits 0 (showing its output)."""
    codes, outputs = run_collect(commands, env, timeout)
    for code, out in zip(codes, outputs):
        assert code == 0, out[-3000:]
    return outputs


# Every sharding the suite's "two processes train like one" tests use (test_multiprocess,
# test_data_parallel, test_table_wise, test_pooled), and the one-process references they
# compare with: trained all at once by one pair of processes (and one reference process
# beside it), once per test run, where each pair and reference of its own cost a process
# start, jax's import and a job's set-up (about half of a worker's CPU time).
TWO_PROCESS_SHARDINGS = ("mod", "data_parallel", "table_wise", "row_wise_pooled", "auto")
ONE_PROCESS_SHARDINGS = ("mod", "table_wise")


def once_per_run(name: str, commands, tmp_path, timeout: int = 900) -> tuple[str, list[str]]:
    """Start the processes `commands(folder)` returns (all at once) once per test run, in
    the run's folder `name` under its cache folder (conftest's EMBEDMESH_TEST_JAX_CACHE,
    shared by the xdist workers and removed at the end; without it, under `tmp_path`):
    the first test to ask runs them, under a lock, the others read what they left.
    Returns the folder and their outputs; a process that failed fails every test that
    asks, with its output."""
    import fcntl
    import json

    root = os.environ.get("EMBEDMESH_TEST_JAX_CACHE") or str(tmp_path)
    folder = os.path.join(root, name)
    done, failed = os.path.join(folder, "outputs.json"), os.path.join(folder, "failed.txt")
    with open(os.path.join(root, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not os.path.exists(done) and not os.path.exists(failed):
            os.makedirs(folder, exist_ok=True)
            cmds = commands(folder)
            codes, outputs = run_collect(cmds, worker_env(), timeout=timeout)
            bad = [
                f"{' '.join(map(str, c[1:]))}: exit {code}\n{out[-3000:]}"
                for c, code, out in zip(cmds, codes, outputs)
                if code != 0
            ]
            if bad:
                with open(failed, "w") as f:
                    f.write("\n".join(bad))
            else:
                with open(done, "w") as f:
                    json.dump(outputs, f)
    if os.path.exists(failed):
        with open(failed) as f:
            raise AssertionError(f.read())
    with open(done) as f:
        return folder, json.load(f)


# Every sharding the suite's "two processes train like one" tests use (test_multiprocess,
# test_data_parallel, test_table_wise, test_pooled), and the one-process references they
# compare with: trained all at once by one pair of processes (and one reference process
# beside it), once per test run, where each pair and reference of its own cost a process
# start, jax's import and a job's set-up (about half of a worker's CPU time).
TWO_PROCESS_SHARDINGS = ("mod", "data_parallel", "table_wise", "row_wise_pooled", "auto")
ONE_PROCESS_SHARDINGS = ("mod", "table_wise")


def train_one_and_two_processes(tmp_path, single_sharding: str, multi_sharding: str):
    """`multiprocess_worker.py`'s results as one process with 4 devices under
    `single_sharding` and as two processes of 2 devices under `multi_sharding` (`np.load`),
    the single one first: from one run of every sharding of ONE_PROCESS_SHARDINGS and
    TWO_PROCESS_SHARDINGS (`once_per_run`)."""
    assert single_sharding in ONE_PROCESS_SHARDINGS, single_sharding
    assert multi_sharding in TWO_PROCESS_SHARDINGS, multi_sharding
    worker = os.path.join(HERE, "multiprocess_worker.py")

    def commands(folder):
        port, single, multi = (
            free_port(),
            ",".join(ONE_PROCESS_SHARDINGS),
            ",".join(TWO_PROCESS_SHARDINGS),
        )
        one = [sys.executable, worker, "0", "1", "0", f"{folder}/single-{{sharding}}.npz", single]
        return [one] + [
            [sys.executable, worker, str(i), "2", str(port), f"{folder}/multi-{{sharding}}.npz"]
            + [multi]
            for i in range(2)
        ]

    folder, _ = once_per_run("two-processes", commands, tmp_path)
    return (
        np.load(os.path.join(folder, f"single-{single_sharding}.npz")),
        np.load(os.path.join(folder, f"multi-{multi_sharding}.npz")),
    )


def two_processes_save_and_restore(tmp_path, sharding: str):
    """checkpoint_multiprocess_worker.py's pair (2 CPU devices each): a checkpoint of a
    4-device MeshEmbedding under `sharding`, each process writing its own shards, restored
    by them. Both shardings the tests use ("mod": test_checkpoint, "table_wise":
    test_table_wise) are saved by one pair, once per test run (`once_per_run`). Returns
    the checkpoint's folder (its `expected.npz` beside it) and the pair's outputs."""
    assert sharding in ("mod", "table_wise"), sharding
    worker = os.path.join(HERE, "checkpoint_multiprocess_worker.py")

    def commands(folder):
        port, root = free_port(), f"{folder}/{{sharding}}/ckpt"
        return [
            [sys.executable, worker, str(i), str(port), root, "mod,table_wise"] for i in range(2)
        ]

    folder, outputs = once_per_run("two-processes-checkpoint", commands, tmp_path)
    return os.path.join(folder, sharding, "ckpt"), outputs


def check_two_processes_match_one(tmp_path, single_sharding, multi_sharding, rtol, atol):
    """`train_one_and_two_processes`: the same six arrays (tables and slots), equal to
    `rtol` / `atol`, and the accumulators moved from their 0.1. The bfloat16 table
    (stochastically rounded) has the same bits under the same strategy; under another,
    whose float32 sums may differ in their last bit, each value within one bfloat16
    spacing of the other."""
    import numpy as np

    a, b = train_one_and_two_processes(tmp_path, single_sharding, multi_sharding)
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 6
    for k in a.files:
        if k != "t3.parameters":
            np.testing.assert_allclose(b[k], a[k], rtol=rtol, atol=atol, err_msg=k)
        elif single_sharding == multi_sharding:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
        else:
            np.testing.assert_allclose(b[k], a[k], rtol=2.0**-7, atol=1e-30, err_msg=k)
    for k in ("t1.accumulators", "t3.accumulators"):
        assert np.abs(a[k] - 0.1).max() > 1e-3, k


def job_args() -> tuple[int, int, int]:
    """A worker's first three arguments: its process id, the number of processes and the
    coordinator's port."""
    import sys

    process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
    return process_id, num_processes, port


def run_python(
    code: str, env: dict | None = None, cwd: str | None = None, timeout=300, args=()
) -> str:
    """`code` run by this interpreter in a fresh process (`python -c code *args`), with
    `env` (None: this process's) in `cwd`: its stdout; an AssertionError with the output's
    end if it fails."""
    import sys

    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def run_json(code: str, env: dict, *args) -> dict:
    """`code` run in a fresh process (this checkout first on sys.path, CPU jax unless
    `env` says otherwise) with the EMBEDMESH_* variables of `env` alone set: its last
    stdout line, as JSON."""
    import json
    import os

    from paths import ROOT

    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDMESH_")}
    full.update(env)
    full.setdefault("JAX_PLATFORMS", "cpu")
    return json.loads(run_python(code, full, cwd=ROOT, args=args).strip().splitlines()[-1])


def start_cpu_process(process_id: int, num_processes: int, port: int, devices: int = 4):
    """Set up this worker process before anything imports jax: `devices` CPU devices
    shared out over the job (`devices // num_processes` here, after any flags in
    EMBEDMESH_TEST_XLA_FLAGS), and with more than one process, gloo collectives and
    `jax.distributed` on 127.0.0.1:`port`. Returns the jax module."""
    import os

    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices // num_processes} "
        + os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
        )
    return jax


def save_and_leave(
    out_file, tables, process_id: int, num_processes: int, leave: bool = True
) -> None:
    """A worker's end: process 0 saves `tables` ({TableConfig: {field: array}}) as the
    .npz `out_file`, keys "table.field"; with more than one process, each leaves the job
    (unless `leave` is false: the job goes on)."""
    import jax
    import numpy as np

    if process_id == 0:
        np.savez(out_file, **{f"{t.name}.{k}": v for t, d in tables.items() for k, v in d.items()})
    if num_processes > 1 and leave:
        jax.distributed.shutdown()


def global_batches(steps, batch):
    """`steps` global batches of `batch` samples (seeded: every process draws the same):
    a 3-valent feature "a", a 1-valent "b" and a ragged one, as (values, lengths)."""
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(steps):
        lengths = rng.integers(0, 5, batch)
        yield {
            "a": rng.integers(0, 50, (batch, 3)),
            "b": rng.integers(0, 30, (batch,)),
            "ragged": (rng.integers(0, 30, int(lengths.sum())), lengths),
        }


def local_slice(batch, pid, nproc):
    """Process `pid`'s contiguous share of a `global_batches` batch (of `nproc`),
    the ragged feature as an `em.RaggedTensor`."""
    import numpy as np

    import embedmesh as em

    out = {}
    for k, v in batch.items():
        if k == "ragged":
            values, lengths = v
            per = len(lengths) // nproc
            splits = np.concatenate([[0], np.cumsum(lengths)])
            lo, hi = splits[pid * per], splits[(pid + 1) * per]
            out[k] = em.RaggedTensor.from_row_lengths(
                values[lo:hi], lengths[pid * per : (pid + 1) * per]
            )
        else:
            per = v.shape[0] // nproc
            out[k] = v[pid * per : (pid + 1) * per]
    return out


_saved_model_checker: list = []  # [(the process, its lines' queue, its stderr file)]


def _checker():
    """This test process's TensorFlow-only process (saved_model_check.py), started at its
    first use: no PYTHONPATH, so no embedmesh either; it dies with this process."""
    import atexit
    import queue
    import tempfile
    import threading

    if _saved_model_checker and _saved_model_checker[0][0].poll() is None:
        return _saved_model_checker[0]
    _saved_model_checker.clear()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "saved_model_check.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # the process ended

    threading.Thread(target=read, daemon=True).start()
    atexit.register(proc.kill)
    _saved_model_checker.append((proc, lines, stderr))
    return _saved_model_checker[0]


def check_saved_model(saved_dir, cases: dict, count: int, tmp_path, timeout=300) -> None:
    """Serve `count` cases (`cases`: "case{i}/in/{input}" the request, "case{i}/out/{name}"
    the outputs it must give) through the SavedModel at `saved_dir` in a process with
    TensorFlow alone (saved_model_check.py), one for all of this test process's checks."""
    import queue
    import time

    np.savez(tmp_path / "cases.npz", count=np.array(count), **cases)
    proc, lines, stderr = _checker()
    proc.stdin.write(f"{os.path.abspath(saved_dir)}\t{tmp_path / 'cases.npz'}\n")
    proc.stdin.flush()
    deadline, answer = time.time() + timeout, []
    while not answer or answer[-1] != "DONE\n":
        try:
            line = lines.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            proc.kill()
            line = None
        if line is None:  # ended, or killed at the timeout
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-3000:]
            raise AssertionError(f"saved_model_check.py ended: {''.join(answer)}{tail}")
        answer.append(line)
    ok = f"OK {count} cases\n" in answer and not any(x.startswith("FAILED") for x in answer)
    assert ok, "".join(answer)[-6000:]
