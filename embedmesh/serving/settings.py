"""What a user may tune of `serving_embedding_lookup` on the host, in one place.

Each setting is process-wide, returns the value it replaces, and is meant to be set
before serving (docs/serving.md, "Serving from many threads", lists them with the
environment variables that set their defaults). Nothing else of the request path is
tunable: its other choices are fixed where they were measured (docs/serving.md).

- `set_host_threads(n)`: threads a request's kernels run on (`EMBEDMESH_SERVING_THREADS`);
- `set_numpy_outputs(on)`: numpy outputs instead of jax.Arrays over the same buffers;
- `set_output_pool_limit(nbytes)`: free output buffers kept for reuse
  (`EMBEDMESH_OUTPUT_POOL_MB`);
- `set_hold_gil_below(entries)`: requests smaller than this keep the GIL while their
  kernels run when no other thread is serving;
- `gil_stats()`: what the request path ran without the GIL (a read-out, not a setting).
"""

from __future__ import annotations

from embedmesh import _runtime
from embedmesh.serving import pool, request

__all__ = [
    "gil_stats",
    "set_hold_gil_below",
    "set_host_threads",
    "set_numpy_outputs",
    "set_output_pool_limit",
]

# Read by the lookup on every request (module attributes: no call).
host_threads: int | None = None  # set_host_threads; None: _runtime.serving_threads()
numpy_outputs = False  # set_numpy_outputs


def threads() -> int:
    """The threads a host lookup runs on now."""
    return host_threads or _runtime.serving_threads()


def set_host_threads(n: int) -> int:
    """Threads a host lookup runs on, the caller's included (1: the caller's thread
    only; the default is `EMBEDMESH_SERVING_THREADS`, else one per core up to 8); returns
    the previous value. The C++ kernels split each feature into chunks of whole bags over
    them (other backends: whole features). A server running many lookups at once may
    prefer 1: the C++ pool serves one request at a time, and lookups that find it busy
    run on their caller's thread alone."""
    global host_threads
    if int(n) < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    previous, host_threads = threads(), int(n)
    request.forget_served()
    return previous


def set_numpy_outputs(on: bool) -> bool:
    """Whether a lookup run on the host (concrete inputs and tables) returns numpy arrays
    (float32, 64-byte aligned views of the output pool's buffers) instead of jax.Arrays
    over them; returns the previous setting (default False: jax.Arrays). A traced lookup
    (inside `jax.jit` / `jax.export`) returns jax values either way.

    Wrapping a request's outputs as jax arrays costs a few us an array, about half of a
    small request's time: a server that hands the activations to numpy code, or to a
    jitted model that takes numpy arguments anyway, need not pay it."""
    global numpy_outputs
    previous, numpy_outputs = numpy_outputs, bool(on)
    request.forget_served()
    return previous


def set_output_pool_limit(nbytes: int) -> int:
    """Bytes of free output buffers kept for reuse (0: none; the outputs in use do not
    count; the default is `EMBEDMESH_OUTPUT_POOL_MB`, 256 MB); returns the previous
    limit. A buffer comes back to the pool once nothing references it (no array, view or
    jax array); reusing it saves a request the page faults of fresh memory."""
    return pool.set_output_pool_limit(nbytes)


def set_hold_gil_below(entries: int) -> int | None:
    """Requests of fewer than `entries` ids (summed or copied, all features) keep the GIL
    while their kernels run, unless other threads are serving (inside a lookup, or one
    entered lately); 0: every request releases it; the default is 32768. Returns the
    previous value, None where the compiled request path was not built (its kernels go
    through ctypes, which always releases it). Releasing the GIL costs a request little
    alone, but beside a busy Python thread taking it back waits up to Python's switch
    interval (`sys.getswitchinterval()`, 5 ms), against at most ~1 ms of kernels below
    32k ids."""
    if request.compiled is None:
        return None
    return request.compiled.set_hold_gil_below(int(entries))


def gil_stats() -> tuple[int, int, int] | None:
    """(requests, those that released the GIL, ns their kernels ran without it) of the
    compiled request path since the process started; None without it. What is not those
    ns of a request's time holds the GIL: its checks, output views and result."""
    return None if request.compiled is None else request.compiled.stats()
