"""One process of the host-exchange tests (run by test_host_exchange.py).

Usage: host_exchange_worker.py PROCESS_ID NUM_PROCESSES PORT MODE[,MODE...] [OUT_FILE]

Every process has one CPU device; all run on 127.0.0.1 (gloo), so
`peers.same_host_job` gives a nonzero key and `ops.exchange` with it takes the
shared-memory kernel (host_exchange.cc). Modes:
  "exchange": results equal numpy's all-to-all and XLA's (host_job=0, gloo)
    exactly: several shapes and dtypes, a fori_loop of many rounds, a Python
    loop, growing sizes on one channel (its segments remapped), two channels in
    one program. Prints "OK exchange".
  "mismatch": the processes trace different sizes for one channel; each prints
    "CAUGHT <message>" (the kernel's error naming both sizes).
  "absent": a peer that stops calling, then exits: timeout, then exit errors.
  "killed": one round, then every process prints "JOB <key>" and SIGKILLs itself.
  "early": the last process SIGKILLs itself before its first exchange (before its
    segment exists); process 0 prints "JOB <key>" and "CAUGHT <seconds> s <message>".
  "killed_waiting": every process prints "JOB <key>"; the others wait in their first
    exchange for the last one, which has not started its own; the job is SIGKILLed whole
    there (one `kill -9` of every pid), before any process saw all its peers arrive.
  "named" (with others): the last process acts as if it could not open the others'
    directories, so the job's segments are named ones in /dev/shm, not nameless memfds.
    Every process prints "NAMELESS <0 or 1>" at the start.
  "ops": the host kernels of lookup_from_shards and backward_update_sharded (sharded
    and replicated) equal their references (the exchange path over gloo). Prints
    "OK ops".
  "pooled": the host kernels of the pooled ops fused with their exchange equal their
    references (the unfused op, then the exchange over gloo). Prints "OK pooled".
  "train" (alone, or after other modes in one job): a MeshEmbedding trained for 4
    steps, then one step with a NaN gradient in the last process only (every process
    prints "REJECTED <name> unchanged=True"), for each optimizer, first with
    EMBEDMESH_HOST_EXCHANGE=1, then with 0 (the variable restored after): process 0
    saves each setting's tables to OUT_FILE_<setting>.npz and every process prints
    "HOST_JOB <setting> <name> <nonzero?>" and "CHANNELS <setting> <name> <channels>".
"""

import os
import signal
import subprocess
import sys
import time

import orphan_guard  # noqa: F401  (this worker dies with the test process)
from process_helpers import job_args, start_cpu_process

process_id, num_processes, port = job_args()
mode = sys.argv[4]
out_file = sys.argv[5] if len(sys.argv) > 5 else ""
# one CPU device a process, gloo, jax.distributed (every job here has 2 or more processes)
jax = start_cpu_process(process_id, num_processes, port, devices=num_processes)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from embedmesh.device import ops, peers  # noqa: E402
from embedmesh.device.ops.cpu import library  # noqa: E402

N = num_processes


def global_input(shape, dtype, seed):
    """The same poisoned global array [N * rows, ...] in every process: random, nonzero
    (so a block left unwritten or copied from the wrong place shows), NaN-free."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        v = rng.integers(1, 2**30, shape).astype(dtype)
        return v * rng.choice(np.array([-1, 1], dtype), shape)
    v = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return v.astype(dtype)


def expected_all_to_all(g):
    """Device d's block s of the result is device s's block d of the input."""
    blocks = g.reshape((N, N, -1) + g.shape[1:])  # [device, block, rows / N, ...]
    return np.swapaxes(blocks, 0, 1).reshape(g.shape)


def shard(g, mesh):
    sharding = NamedSharding(mesh, P("x"))
    return jax.make_array_from_callback(g.shape, sharding, lambda index: g[index])


def gathered(a):
    """A global array read back whole in every process, as numpy."""
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def run_mapped(mesh, body, n_in, *args):
    """`body` over the devices of `mesh` (`mapped`) on `args`: its lowered program's text
    and each of its outputs (an array or a dict of them) gathered whole."""
    fn = mapped(mesh, body, n_in)
    out = fn(*args)
    text = fn.lower(*args).as_text()
    outs = out if isinstance(out, tuple) else (out,)
    return text, [jax.tree.map(gathered, x) for x in outs]


def per_device(mesh):
    """`(put, put_slots)` over `mesh`: `put` makes [N, ...] (a block a device) a global
    array sharded over the devices; `put_slots` does it to each array of a dict."""

    def put(x):
        return shard(x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), mesh)

    def put_slots(slots):
        return {k: put(v) for k, v in slots.items()}

    return put, put_slots


def local(a):
    """This process's part of `a` (sharded over axis 0), as numpy."""
    (s,) = a.addressable_shards
    return np.asarray(s.data), s.index


def check(name, got, want_global):
    data, index = local(got)
    want = want_global[index]
    if got.dtype == jnp.bfloat16:
        data, want = data.view(np.uint16), want.view(np.uint16)
    if not np.array_equal(data, want):
        raise AssertionError(f"{name}: process {process_id} differs")


def mapped(mesh, f, n_in=1):
    spec = (P("x"),) * n_in
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=P("x"), check_vma=False))


def run_exchange(mesh, job):
    def both(x):  # the host kernel and XLA's all_to_all (host_job=0: gloo) side by side
        a = ops.exchange(x, ops.Transport("x", N, host_job=job, channel="test/both"))
        b = ops.exchange(x, ops.Transport("x", N, host_job=0, channel="test/xla"))
        return jnp.stack([a, b])

    both_mapped = jax.jit(
        jax.shard_map(both, mesh=mesh, in_specs=P("x"), out_specs=P(None, "x"), check_vma=False)
    )
    nn = N * N  # global rows per unit: each device holds N * k rows, k per peer
    cases = [
        ((nn * 2, 3), np.float32),
        ((nn,), np.int32),
        ((nn * 4, 5, 2), jnp.bfloat16),
        ((nn * 3, 7), np.float32),
        ((0, 4), np.float32),  # nothing to send: the round still pairs up
    ]
    for i, (shape, dtype) in enumerate(cases):
        g = global_input(shape, dtype, seed=10 + i)
        out = both_mapped(shard(g, mesh))
        want = expected_all_to_all(g)
        check(f"case {i} host", out[0], want)
        check(f"case {i} xla", out[1], want)

    # many rounds in one program: generation counters
    def loop(x):
        def body(i, v):
            return ops.exchange(v, ops.Transport("x", N, host_job=job, channel="test/loop")) + 1

        return jax.lax.fori_loop(0, 40, body, x)

    g = global_input((N * N * 3, 4), np.int32, seed=3)
    want = g.copy()
    for _ in range(40):
        want = expected_all_to_all(want) + 1
    check("fori_loop", mapped(mesh, loop)(shard(g, mesh)), want)

    # a Python loop of calls of one program, and growing sizes on one channel (remaps)
    once = mapped(
        mesh, lambda x: ops.exchange(x, ops.Transport("x", N, host_job=job, channel="test/grow"))
    )
    for step, k in enumerate([4, 4, 32, 2048, 1, 35000, 150000, 8, 150000]):
        g = global_input((N * N * k, 8), np.float32, seed=100 + step)
        check(f"grow {k}", once(shard(g, mesh)), expected_all_to_all(g))

    # two channels in one program, independent and chained
    def two(x, y):
        a = ops.exchange(x, ops.Transport("x", N, host_job=job, channel="test/two/a"))
        b = ops.exchange(y, ops.Transport("x", N, host_job=job, channel="test/two/b"))
        c = ops.exchange(a * 2, ops.Transport("x", N, host_job=job, channel="test/two/c"))
        return a + b + c

    gx = global_input((N * N * 5, 3), np.float32, seed=7)
    gy = global_input((N * N * 5, 3), np.float32, seed=8)
    want = expected_all_to_all(gx) + expected_all_to_all(gy)
    want = want + expected_all_to_all(expected_all_to_all(gx) * 2)
    for _ in range(3):
        check("two channels", mapped(mesh, two, 2)(shard(gx, mesh), shard(gy, mesh)), want)
    print("OK exchange", flush=True)


def run_mismatch(mesh, job):
    rows = 4 * N * (process_id + 1)  # each process its own size: the kernel must refuse
    block = jnp.ones((rows, 2), jnp.float32)
    x = jax.make_array_from_single_device_arrays(
        (N * rows, 2), NamedSharding(mesh, P("x")), [jax.device_put(block, jax.local_devices()[0])]
    )
    f = mapped(
        mesh,
        lambda v: ops.exchange(v, ops.Transport("x", N, host_job=job, channel="test/mismatch")),
    )
    try:
        np.asarray(local(f(x))[0])
    except Exception as e:  # noqa: BLE001 - the runtime's error type
        print("CAUGHT", str(e).replace("\n", " "), flush=True)
    else:
        print("NO ERROR", flush=True)


def run_absent(mesh, job):
    """Process 1 leaves after one round: process 0's next call times out naming it
    (EMBEDMESH_EXCHANGE_TIMEOUT_S), and, once process 1 has exited, the call after fails
    at once saying so. Prints "CAUGHT timeout ..." and "CAUGHT exited ..."."""
    f = mapped(
        mesh, lambda v: ops.exchange(v, ops.Transport("x", N, host_job=job, channel="test/absent"))
    )
    g = global_input((N * N * 2, 3), np.float32, seed=1)
    x = shard(g, mesh)
    check("absent round 1", f(x), expected_all_to_all(g))
    if process_id == 1:
        time.sleep(3)
        os._exit(0)  # the job is broken: no shutdown barrier
    for what in ("timeout", "exited"):
        t = time.perf_counter()
        try:
            np.asarray(local(f(x))[0])
        except Exception as e:  # noqa: BLE001 - the runtime's error type
            line = str(e).replace("\n", " ")
            print(f"CAUGHT {what} {time.perf_counter() - t:.1f} s {line}", flush=True)
        else:
            print(f"NO ERROR {what}", flush=True)
        if what == "timeout":
            time.sleep(2.5)  # process 1 exits meanwhile
    os._exit(0)


def run_killed(mesh, job):
    f = mapped(
        mesh, lambda v: ops.exchange(v, ops.Transport("x", N, host_job=job, channel="test/killed"))
    )
    g = global_input((N * N * 2, 3), np.float32, seed=2)
    check("killed round 1", f(shard(g, mesh)), expected_all_to_all(g))
    print(f"JOB {job:x}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def run_early(mesh, job):
    if process_id == N - 1:
        time.sleep(1)  # the others are in their exchange by then
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"JOB {job:x}", flush=True)
    f = mapped(
        mesh, lambda v: ops.exchange(v, ops.Transport("x", N, host_job=job, channel="test/early"))
    )
    t = time.perf_counter()
    try:
        np.asarray(local(f(shard(global_input((N * N, 2), np.float32, seed=3), mesh)))[0])
    except Exception as e:  # noqa: BLE001 - the runtime's error type
        line = str(e).replace("\n", " ")
        print(f"CAUGHT {time.perf_counter() - t:.1f} s {line}", flush=True)
    else:
        print("NO ERROR", flush=True)
    os._exit(0)  # the job is broken: no shutdown barrier


def run_killed_waiting(mesh, job):
    pids = np.asarray(multihost_utils.process_allgather(np.int32(os.getpid()))).ravel()
    print(f"JOB {job:x}", flush=True)
    if process_id == N - 1:  # never reaches its exchange
        time.sleep(60)
        os._exit(1)
    if process_id == 0:  # the whole job at once, by a killer that needs no GIL of ours
        victims = " ".join(str(int(p)) for p in pids)
        subprocess.Popen(["sh", "-c", f"sleep 1.5; kill -9 {victims}"])
    f = mapped(
        mesh,
        lambda v: ops.exchange(v, ops.Transport("x", N, host_job=job, channel="test/waiting")),
    )
    np.asarray(local(f(shard(global_input((N * N, 2), np.float32, seed=4), mesh)))[0])
    print("NO KILL", flush=True)
    os._exit(1)


def case_optimizer(case: int):
    """The fused optimizer of a case: SGD, Adagrad, AdagradMomentum, Adam, FTRL,
    RowWiseAdagrad for cases 0-5, each with options set (optimizer_reference)."""
    from optimizer_reference import ALL_FUSED

    return ALL_FUSED[(0, 1, 2, 4, 6, 8)[case % 6]]


def random_slots(r, opt, rows, d):
    """Every device's slots of `opt`, [N, 1, rows, width]: positive random values."""
    return {
        k: r.uniform(0.1, 1.0, (N, 1, rows, opt.slot_width(k, d))).astype(np.float32)
        for k in opt.slot_names
    }


def run_ops(mesh, job):
    """The host kernels of lookup_from_shards and backward_update_sharded against their
    references (the exchange path, XLA's all_to_all over gloo), on random batches with
    padding ids, ids past the end, out-of-range slots, padding pairs, unsorted ids or
    ungrouped pairs, and keep=False; each case another fused optimizer."""
    put, put_slots = per_device(mesh)

    # the 3-process run (where each rank has several peers) takes case 3 (shuffled ids,
    # ungrouped pairs); the 2-process run the others, so every case (and every optimizer)
    # runs once a test (each case costs every process its traces and compiles: the
    # 3-process run, on a 2-core machine, half as much again as the 2-process one)
    for case in (0, 1, 2, 4, 5) if N <= 2 else (3,):
        r = np.random.default_rng(1000 + case)
        rows, u, p, num_rows, d = 30, int(r.integers(1, 9)), int(r.integers(0, 25)), 7, 8
        opt, keep = case_optimizer(case), case != 4
        grouped, shuffled = case in (0, 1, 4), case == 3
        tables = r.standard_normal((N, 1, rows, d)).astype(np.float32)
        accs = random_slots(r, opt, rows, d)
        uids = np.full((N, N, u), ops.PAD_ID, np.int32)
        for dev in range(N):
            for s in range(N):
                used = int(r.integers(0, u + 1))
                ids = np.sort(r.choice(rows + 3, used, replace=False))  # some past the end
                uids[dev, s, :used] = r.permutation(ids) if shuffled else ids
        puniq = r.integers(0, u + 2, size=(N, N, p)).astype(np.int32)  # >= u: out of range
        if grouped:
            puniq.sort(axis=-1)
        prows = r.integers(0, num_rows + 1, size=(N, N, p)).astype(np.int32)  # R: padding
        gains = r.standard_normal((N, N, p)).astype(np.float32)
        acts = r.standard_normal((N, num_rows, d)).astype(np.float32)

        def lookup(host_job, tables=tables):
            def body(t, ui, pu, g, pr):
                return ops.lookup_from_shards(
                    t[0], ui, pu, g, pr, num_rows, ops.Transport("x", N, False, host_job, "ops/lk")
                )

            text, (out,) = run_mapped(
                mesh, body, 5, put(tables), put(uids), put(puniq), put(gains), put(prows)
            )
            return text, out

        text, host = lookup(job)
        assert "embedmesh_host_lookup" in text
        _, ref = lookup(0)
        np.testing.assert_allclose(host, ref, rtol=1e-6, atol=1e-6, err_msg=f"lookup {case}")
        if case < 2:  # a bfloat16, a float16 table: rows cross in the storage type, and the
            # sums are the float32 kernel's on the widened table, bit for bit
            low = tables.astype((jnp.bfloat16, jnp.float16)[case])
            text, host_low = lookup(job, low)
            assert "embedmesh_host_lookup" in text and ("bf16", "f16")[case] in text
            np.testing.assert_array_equal(host_low, lookup(job, low.astype(np.float32))[1])

        # replicated (data_parallel): every device the same table, one partition each
        rep_t = np.broadcast_to(tables[:1], tables.shape).copy()
        rep_a = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in accs.items()}
        rep = [put(x[:, :1]) for x in (uids, prows, puniq, gains)]

        def update(host_job, replicated):
            channel = "ops/rep" if replicated else "ops/up"

            def body(t, a, ui, act, pr, pu, g):
                t, slots = ops.backward_update_sharded(
                    opt, t[0], {k: v[0] for k, v in a.items()}, ui, act, pr, pu, g, keep, 0,
                    ops.Transport("x", N, host_job=host_job, channel=channel),
                    replicated=replicated,
                )  # fmt: skip
                return t[None], {k: v[None] for k, v in slots.items()}

            if replicated:
                args = (put(rep_t), put_slots(rep_a), rep[0], put(acts), rep[1], rep[2], rep[3])
            else:
                args = (put(tables), put_slots(accs), put(uids), put(acts), put(prows))
                args += (put(puniq), put(gains))
            return run_mapped(mesh, body, 7, *args)

        def check_update(replicated, table_msg, slot_msg):
            text, (t_host, a_host) = update(job, replicated)
            assert f"embedmesh_backward_{opt.fused_kernel}_from_host_sources" in text
            _, (t_ref, a_ref) = update(0, replicated)
            np.testing.assert_allclose(t_host, t_ref, rtol=2e-6, atol=2e-6, err_msg=table_msg)
            for k in a_ref:
                np.testing.assert_allclose(
                    a_host[k], a_ref[k], rtol=2e-6, atol=2e-6, err_msg=f"{slot_msg}{k} {case}"
                )
            return t_host

        t_host = check_update(False, f"table {case}", "")
        if not keep:
            np.testing.assert_array_equal(t_host, tables.reshape(t_host.shape))
        t_host = check_update(True, f"rep {case}", "rep ")
        for dev in range(N):  # the replicas stay bitwise equal
            np.testing.assert_array_equal(t_host[dev], t_host[0])
    print("OK ops", flush=True)


def run_pooled(mesh, job):
    """The host kernels of the pooled ops fused with their exchange
    (exchange_pooled_pairs, exchange_pooled_partials, exchange_pooled_backward_update)
    against their references (the unfused op, then XLA's all_to_all over gloo), on
    random batches with positions and rows out of range, padding and ids past the
    table, a compacted and an uncompacted row map, and keep=False (the tables come back
    unchanged); each case another fused optimizer."""
    put, put_slots = per_device(mesh)

    def transport_of(host_job, channel):
        return ops.Transport("x", N, host_job=host_job, channel=channel)

    # the 3-process run takes case 1 (a compacted row map), the 2-process run the others
    # (case 3: keep=False)
    for case in (0, 2, 3, 4, 5) if N <= 2 else (1,):
        r = np.random.default_rng(2000 + case)
        rows, u, p, num_rows, d = 40, int(r.integers(1, 9)), int(r.integers(1, 25)), 9, 8
        opt, keep, compacted = case_optimizer(case), case != 3, case in (0, 1, 4)
        uids = r.integers(0, rows + 3, size=(N, N, u)).astype(np.int32)  # some past the end
        uids[r.random((N, N, u)) < 0.2] = ops.PAD_ID
        prows = r.integers(-1, num_rows + 2, size=(N, N, p)).astype(np.int32)  # some "none"
        puniq = r.integers(-1, u + 2, size=(N, N, p)).astype(np.int32)
        gains = r.uniform(0.5, 2.0, (N, N, p)).astype(np.float32)
        if compacted:  # each owner feeds some rows (compact[o][row]: its position, or rc)
            rc = max(1, num_rows - 3)
            compact = np.full((N, num_rows + 1), rc, np.int32)
            for o in range(N):
                fed = r.choice(num_rows, rc, replace=False)
                compact[o, fed] = np.arange(rc)
        else:  # every owner feeds every row
            rc, compact = num_rows, np.zeros((N, 0), np.int32)

        def pairs(host_job):
            def body(ui, pr, pu, g):
                return ops.exchange_pooled_pairs(
                    ui,
                    pr,
                    pu,
                    g,
                    jnp.asarray(compact),
                    width=rc,
                    transport=transport_of(host_job, "pooled/pairs"),
                )

            return run_mapped(mesh, body, 4, put(uids), put(prows), put(puniq), put(gains))

        text, (served_host,) = pairs(job)
        assert "embedmesh_host_pack_pooled_pairs" in text
        _, (served_ref,) = pairs(0)
        np.testing.assert_array_equal(served_host, served_ref, err_msg=f"pairs {case}")
        served = served_ref.reshape(N, N, -1)

        tables = r.standard_normal((N, 1, rows, d)).astype(np.float32)
        accs = random_slots(r, opt, rows, d)

        def partials(host_job):
            def body(t, m):
                return ops.exchange_pooled_partials(
                    t[0],
                    m,
                    unique_capacity=u,
                    width=rc,
                    transport=transport_of(host_job, "pooled/partials"),
                )

            return run_mapped(mesh, body, 2, put(tables), put(served))

        text, (back_host,) = partials(job)
        assert "embedmesh_host_pooled_partials" in text
        _, (back_ref,) = partials(0)
        np.testing.assert_allclose(back_host, back_ref, rtol=1e-6, atol=1e-6, err_msg=f"{case}")
        assert np.abs(back_ref).sum() > 0, "no pair contributed: the case tests nothing"

        grads = r.standard_normal((N, N, rc, d)).astype(np.float32)

        def backward(host_job):
            def body(t, a, m, g):
                t, slots = ops.exchange_pooled_backward_update(
                    opt,
                    t[0],
                    {k: v[0] for k, v in a.items()},
                    m,
                    g.reshape(N, rc, d),
                    keep,
                    0,
                    unique_capacity=u,
                    width=rc,
                    transport=transport_of(host_job, "pooled/grads"),
                )
                return t[None], {k: v[None] for k, v in slots.items()}

            text, (t, sl) = run_mapped(
                mesh, body, 4, put(tables), put_slots(accs), put(served), put(grads)
            )
            return text, (t, sl)

        text, (t_host, a_host) = backward(job)
        assert f"embedmesh_host_pooled_backward_{opt.fused_kernel}" in text
        _, (t_ref, a_ref) = backward(0)
        np.testing.assert_allclose(t_host, t_ref, rtol=2e-6, atol=2e-6, err_msg=f"table {case}")
        for k in a_ref:
            np.testing.assert_allclose(
                a_host[k], a_ref[k], rtol=2e-6, atol=2e-6, err_msg=f"{k} {case}"
            )
        if keep:
            assert not np.array_equal(t_ref, tables.reshape(t_ref.shape)), "no row moved"
        else:
            np.testing.assert_array_equal(t_host, tables.reshape(t_host.shape))
    print("OK pooled", flush=True)


def train(name, optimizer, **kwargs):
    """A MeshEmbedding trained for 4 steps: (its tables by "name/table.var", its core's
    same-host key, the channels of that job's shared-memory segments)."""
    import embedmesh as em
    from embedmesh.device.ops.cpu import kernels
    from embedmesh.facade import MeshEmbedding
    from embedmesh.host.preprocess import Capacity

    t1 = em.TableConfig(300, 8, combiner="mean", name="t1")
    t2 = em.TableConfig(70, 4, combiner="sqrtn", name="t2")
    feats = {"a": em.FeatureConfig(t1), "b": em.FeatureConfig(t2)}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    emb = MeshEmbedding(feats, optimizer, mesh=mesh, capacities=Capacity(64, 64), **kwargs)
    emb.build()
    grad_fn = jax.jit(lambda a: jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, a))
    rng = np.random.default_rng(5)
    batch = 8 * N
    per = batch // N
    for _ in range(4):
        a = rng.integers(0, 300, (batch, 3))
        b = rng.integers(0, 70, (batch,))
        lo, hi = process_id * per, (process_id + 1) * per
        acts, pre = emb({"a": a[lo:hi], "b": b[lo:hi]})
        emb.apply_gradients(grad_fn(acts), pre)
    tables = {f"{name}/{t.name}.{k}": v for t, d in emb.variables.items() for k, v in d.items()}
    # a NaN in the last process's slice only: every process rejects the step, no row moves
    acts, pre = emb({"a": a[lo:hi], "b": b[lo:hi]})
    grads = grad_fn(acts)
    g = grads["a"]
    local = np.array(g.addressable_shards[0].data)
    if process_id == N - 1:
        local[0, 0] = np.nan
    grads["a"] = jax.make_array_from_single_device_arrays(
        g.shape, g.sharding, [jax.device_put(local, g.addressable_shards[0].device)]
    )
    try:
        emb.apply_gradients(grads, pre)
        print(f"ACCEPTED {name}", flush=True)
    except FloatingPointError:
        after = {f"{name}/{t.name}.{k}": v for t, d in emb.variables.items() for k, v in d.items()}
        same = all(np.array_equal(after[k], v) for k, v in tables.items())
        print(f"REJECTED {name} unchanged={same}", flush=True)
    job = emb.core.host_job
    channels = []
    if job:  # which kernels ran: the channels this process used for that job
        from embedmesh.device.ops.cpu import library

        tags = library.host_channel_tags(job)
        names = {
            kernels.channel_tag(f"{s}/{k}"): f"{s}/{k}"
            for s in ("t1", "t2", "t1+t2")
            for k in ("lookup/ids", "lookup/rows", "update/sources")
        }
        names[kernels.channel_tag("finite")] = "finite"  # the gradients' finite check
        channels = sorted(names.get(t, "?") for t in tags)
    return tables, job, channels


def run_train():
    """Both runs with EMBEDMESH_HOST_EXCHANGE=1, then both with 0 (gloo), in this one job
    (read at each build); process 0 saves each setting's tables to OUT_FILE_<setting>.npz."""
    import embedmesh as em

    runs = [
        ("adagrad", em.Adagrad(0.2), {}),
        # two stacks, each update fused with the next lookup: independent host calls
        # in one program
        ("sgd", em.SGD(0.3), dict(stack_tables=False, pipeline_execution_with_tensor_core=True)),
    ]
    for setting in ("1", "0"):
        os.environ["EMBEDMESH_HOST_EXCHANGE"] = setting
        tables = {}
        for name, optimizer, kwargs in runs:
            t, job, channels = train(name, optimizer, **kwargs)
            tables.update(t)
            print(f"HOST_JOB {setting} {name} {int(job != 0)}", flush=True)
            print(f"CHANNELS {setting} {name} {channels}", flush=True)
        if process_id == 0:
            np.savez(f"{out_file}_{setting}.npz", **tables)


def main():
    modes = mode.split(",")
    if modes == ["train"]:
        run_train()
    else:
        mesh = Mesh(np.array(jax.devices()), ("x",))
        if "named" in modes and process_id == N - 1:
            # as if this process could not open the others' descriptors (/proc/<pid>/fd:
            # another pid namespace or user): the job falls back to named segments
            from embedmesh.device.ops import cpu

            cpu.open_host_directories = lambda *args: False
        job = peers.same_host_job(mesh)
        assert job != 0, "same_host_job found no shared host on 127.0.0.1"
        print(f"NAMELESS {int(library.host_job_nameless(job))}", flush=True)
        for m in modes:
            if m == "named":
                continue
            if m == "train":  # its own embeddings (and same-host keys), the setting restored
                before = os.environ.get("EMBEDMESH_HOST_EXCHANGE")
                run_train()
                os.environ.pop("EMBEDMESH_HOST_EXCHANGE")
                if before is not None:
                    os.environ["EMBEDMESH_HOST_EXCHANGE"] = before
                continue
            {
                "exchange": run_exchange,
                "mismatch": run_mismatch,
                "ops": run_ops,
                "pooled": run_pooled,
                "absent": run_absent,
                "killed": run_killed,
                "early": run_early,
                "killed_waiting": run_killed_waiting,
            }[m](mesh, job)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
