"""Where the processes of a job are, which says how their devices can exchange.

Several processes on one host (one process per core or per socket is the usual
way to train on a big CPU box, and what a test on 127.0.0.1 runs) can exchange
through POSIX shared memory at memcpy speed, where XLA's CPU collectives go
through gloo's TCP loopback (~0.2 GB/s here). `same_host_job(mesh)` finds out,
once per `EmbeddingCore`, with one small all-gather of every process's host
identity (hostname, boot id, IPC namespace) and pid; when they all match, it
returns a key for the job's shared-memory segments, drawn by process 0 and the
same in every process (0 otherwise: the exchanges stay XLA's), and hands the
kernels the job's pids (a peer that dies is noticed within a second, even before
its segment exists) and removes the segments that jobs killed whole left behind.
Each process also gathers the descriptor of its directory of segments; when every
process can open every other's (through /proc/<pid>/fd), a second all-gather of one
flag makes the job's segments nameless: a job killed at any moment leaves nothing in
/dev/shm (`host_peers.h`).
The shared-memory exchange itself is the CPU kernel of `ops.exchange`
(`host_exchange.cc`).

`EMBEDMESH_HOST_EXCHANGE=0` turns it off (XLA's collectives, gloo on CPU).
"""

from __future__ import annotations

import os
import secrets
import socket
import zlib

import numpy as np

from embedmesh import _runtime

__all__ = ["host_identity", "mesh_on_cpu", "same_host_job"]


def host_identity() -> int:
    """A 31-bit hash of what two processes share exactly when they can share memory:
    the host name, the kernel's boot id and this process's IPC namespace."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("?")
    try:
        parts.append(str(os.stat("/proc/self/ns/ipc").st_ino))
    except OSError:
        parts.append("?")
    return zlib.crc32("\0".join(parts).encode()) & 0x7FFFFFFF


def same_host_job(mesh) -> int:
    """The job's shared-memory key when the mesh spans several processes, all on this
    host, with CPU devices and the CPU kernels available; else 0. A collective: every
    process of the job calls it at the same point (building its `EmbeddingCore`)."""
    import jax
    from jax.experimental import multihost_utils

    devices = list(mesh.devices.flat)
    if len({d.process_index for d in devices}) <= 1 or not _runtime.host_exchange_enabled():
        return 0
    from embedmesh.device.ops import cpu

    if not cpu.all_cpu(devices):
        return 0  # accelerators have their own links (NCCL, ICI)
    usable = 1 if cpu.ready() else 0
    key = secrets.randbits(62) | 1 if jax.process_index() == 0 else 0
    pid_ns = _pid_namespace()
    directory = cpu.new_host_directory() if usable else -1
    # 31-bit parts: without jax_enable_x64 the all-gather carries int32
    local = np.array(
        [host_identity(), usable, key >> 31, key & 0x7FFFFFFF, os.getpid(),
         (pid_ns >> 31) & 0x7FFFFFFF, pid_ns & 0x7FFFFFFF, directory],
        np.int32,
    )  # fmt: skip
    gathered = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 8)
    if len(set(gathered[:, 0].tolist())) != 1 or not gathered[:, 1].all():
        return 0
    job = (int(gathered[0, 2]) << 31) | int(gathered[0, 3])
    # every process's pid: the exchanges notice within a second when one exits
    pids = [int(p) for p in gathered[:, 4]]
    namespaces = [(int(hi) << 31) | int(lo) for hi, lo in gathered[:, 5:7]]
    cpu.begin_host_job(job, pids, namespaces)
    # nameless segments (a kill leaves nothing in /dev/shm) when every process can open
    # every other's directory; else named ones (host_peers.h): all processes the same
    opened = cpu.open_host_directories(job, jax.process_index(), pids, gathered[:, 7])
    agreed = multihost_utils.process_allgather(np.array([opened], np.int32))
    cpu.set_host_job_nameless(job, bool(np.asarray(agreed).all()))
    return job


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0: unknown): pids of processes in
    another one mean nothing here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def mesh_on_cpu(mesh) -> bool:
    """Whether every device of `mesh` is a CPU (the ops layer's answer)."""
    from embedmesh.device.ops import cpu

    return cpu.all_cpu(list(mesh.devices.flat))
