"""CPU kernels of the device ops: C++ through XLA's FFI, built with the package.

XLA's CPU gather and scatter move about 2-3 M rows of 64 float32 per second
on this project's 2-core machines, whatever the access pattern, and with the
page faults of XLA's fresh output buffers they were most of a training step
(see `benchmarks/runs/train-history.md`). These handlers do the same row moves with
software prefetch, on all the CPUs the process may use (`EMBEDMESH_CPU_THREADS`
caps them), and advise their large outputs to use huge pages before writing
them (one fault per 2 MiB instead of per 4 KiB).

- `*.cc`, `common.h`: the C++ sources, one concern a file (gathers and
  scatters, segment sums, dedup, fused updates, huge-page memory, the id map's hit
  path; `storage.h`: the
  storage types, float32, bfloat16 and float16, each kernel that reads a table one
  template over them), shipped as
  package data; every op that crosses devices is written once over
  `transport.h`'s transports: the devices of one process (`peers.h`) and the
  processes of one host through POSIX shared memory (`host_peers.h`);
- `build.py`: the sources (`embedmesh._native`'s "device" library: built at install per
  ISA variant, the running CPU's best loaded);
- `library.py`: when the kernels are used (`ready()`), loading the library,
  registering its FFI targets, the thread count;
- `kernels.py`, `memory.py`: the JAX side of each kernel; `KERNELS` is what
  `embedmesh.device.ops` registers for the "cpu" platform.

Environment (read through `embedmesh._runtime`): `EMBEDMESH_CPU_KERNELS=0`
never builds or uses them, `=1` builds them even when JAX's default backend is
not CPU (computations on CPU devices then use them); `EMBEDMESH_CPU_THREADS=n`
sets the threads of each call; `EMBEDMESH_CACHE_DIR` where the library is
cached when built at first use (a source checkout); `EMBEDMESH_CPU_ISA` the ISA
variant. See `library` and `embedmesh._native`.
"""

from embedmesh.device.ops.cpu.kernels import KERNELS
from embedmesh.device.ops.cpu.library import (
    all_cpu,
    begin_host_job,
    library_path,
    new_host_directory,
    open_host_directories,
    pad_id,
    ready,
    set_host_job_nameless,
    threads,
    unavailable_reason,
)

__all__ = [
    "KERNELS",
    "all_cpu",
    "begin_host_job",
    "library_path",
    "new_host_directory",
    "open_host_directories",
    "pad_id",
    "ready",
    "set_host_job_nameless",
    "threads",
    "unavailable_reason",
]
