"""Loading the CPU kernel library: when to build it, registering its FFI targets.

`ready()` is what the dispatch in `embedmesh.device.ops` asks before using a
CPU kernel. It is False, and every op runs its pure-JAX reference, when
`EMBEDMESH_CPU_KERNELS=0`, when JAX's default backend is not CPU (unless
`EMBEDMESH_CPU_KERNELS=1`: then computations placed on CPU devices still use
the kernels), or when the library cannot be had (with a `RuntimeWarning` naming
the cause and the fix). Otherwise the first call loads the library
(`embedmesh._native.load("device")`: the variant for this CPU built at install,
else a cached or new build), hands it the thread count and registers its
handlers with XLA; later calls only check.

`EMBEDMESH_CPU_THREADS=n` (read through `embedmesh._runtime.cpu_threads()`)
makes each kernel call use n threads (the caller's and n - 1 short-lived
helpers); unset, one per CPU this process may use. It is read once, when the
library is loaded, and passed to it (`EmbedmeshSetThreads`; the C++ side reads
no environment variable). `threads()` reports the count the library uses.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import warnings

from embedmesh import _native, _runtime

# The FFI targets the library lists (common.h `Handlers`): name -> address, once loaded.
_TARGETS: dict[str, int] = {}


def targets() -> dict[str, int]:
    """The library's FFI targets, `{name: handler address}` ({} until it is loaded): the
    C++ side lists them, so no list is kept here."""
    return dict(_TARGETS)


def _listed_handlers(lib) -> dict[str, int]:
    lib.EmbedmeshHandlerCount.restype = ctypes.c_int64
    lib.EmbedmeshHandlerName.argtypes = [ctypes.c_int64]
    lib.EmbedmeshHandlerName.restype = ctypes.c_char_p
    lib.EmbedmeshHandlerAddress.argtypes = [ctypes.c_int64]
    lib.EmbedmeshHandlerAddress.restype = ctypes.c_void_p
    return {
        lib.EmbedmeshHandlerName(i).decode(): lib.EmbedmeshHandlerAddress(i)
        for i in range(lib.EmbedmeshHandlerCount())
    }


_lock = threading.Lock()
_loaded: dict = {}  # "lib" (CDLL) and "path" once loaded; "why" once it failed


def _warn(why: str) -> None:
    warnings.warn(
        f"embedmesh: CPU kernels unavailable, using pure JAX ({why})", RuntimeWarning, stacklevel=4
    )


def _load() -> bool:
    """Build (or find), load and register the library once per process."""
    with _lock:
        if "lib" in _loaded or "why" in _loaded:
            return "lib" in _loaded
        # A bad EMBEDMESH_CPU_THREADS raises here, not as a failed build.
        threads_setting = _runtime.cpu_threads() or 0
        _native.selected_variant()  # and a bad EMBEDMESH_CPU_ISA
        try:
            import jax

            try:
                lib = _native.load("device")
            except _native.NativeUnavailable as e:
                _loaded["why"] = str(e)
                _warn(str(e))
                return False
            path = _native.library_path("device")
            lib.EmbedmeshSetThreads.argtypes = [ctypes.c_int64]
            lib.EmbedmeshSetThreads.restype = None
            lib.EmbedmeshThreads.restype = ctypes.c_int64
            lib.EmbedmeshPadId.restype = ctypes.c_int32
            lib.EmbedmeshHostExchangeRelease.argtypes = [ctypes.c_double]
            lib.EmbedmeshHostExchangeRelease.restype = ctypes.c_int64
            lib.EmbedmeshSetThreads(threads_setting)
            listed = _listed_handlers(lib)
            for target, address in listed.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(address), platform="cpu")
            _TARGETS.update(listed)
        except Exception as e:  # any failure means: fall back
            _loaded["why"] = f"{type(e).__name__}: {e}"
            _warn(_loaded["why"])
            return False
        _loaded.update(lib=lib, path=path)
        return True


def _why_not_wanted() -> str:
    """Why the kernels are not to be used in this process, or "" when they are."""
    setting = _runtime.cpu_kernels_setting()
    if setting is False:
        return "disabled by EMBEDMESH_CPU_KERNELS"
    if setting is None:
        import jax

        backend = jax.default_backend()
        if backend != "cpu":
            return f"the default backend is {backend} (EMBEDMESH_CPU_KERNELS=1 builds them anyway)"
    return ""


def ready() -> bool:
    """Whether the CPU kernels are to be used: wanted here and built and registered
    (building them on the first call that wants them)."""
    return not _why_not_wanted() and _load()


def unavailable_reason() -> str:
    """Why `ready()` is False ("" when it is True)."""
    why = _why_not_wanted()
    if why:
        return why
    _load()
    return _loaded.get("why", "")


def library_path() -> str:
    """Path of the loaded library ("" before it is loaded or when it failed)."""
    return _loaded.get("path", "")


def threads() -> int:
    """The thread count of each kernel call (0 when `ready()` is False)."""
    if not ready():
        return 0
    return int(_loaded["lib"].EmbedmeshThreads())


def all_cpu(devices) -> bool:
    """Whether these devices are all CPU devices, which the host kernels (the
    SharedMemory transport, `transport.h`) can serve when their processes share a host."""
    return all(d.platform == "cpu" for d in devices)


_release_registered: list[bool] = []


def release_host_exchanges_at_exit() -> None:
    """Make this process unlink its host-exchange segments (`host_exchange.cc`) at exit,
    once its peers have read its last round (each call after the first does nothing)."""
    with _lock:
        if _release_registered:
            return
        _release_registered.append(True)
    atexit.register(release_host_exchanges)


def release_host_exchanges(timeout_s: float = 10.0) -> int:
    """Unlink this process's host-exchange segments, waiting up to `timeout_s` for its
    peers to read their last round; how many it unlinked (0 when `ready()` is False).
    Later exchanges of those channels fail: call it at exit only."""
    lib = _loaded.get("lib")
    return int(lib.EmbedmeshHostExchangeRelease(float(timeout_s))) if lib is not None else 0


def begin_host_job(job: int, pids, pid_namespaces) -> int:
    """Register the pids of job `job`'s processes (in process order, with their pid
    namespaces' inodes) so that its host exchanges fail within a second when one of them
    exits, not at the timeout; and remove the shared-memory segments that jobs killed
    whole left behind (their writers exited). How many it removed (0 without the kernels)."""
    lib = _loaded.get("lib")
    if lib is None:
        return 0
    count = len(pids)
    fn = lib.EmbedmeshHostJobBegin
    fn.argtypes = [ctypes.c_int64] + [ctypes.POINTER(ctypes.c_int64)] * 2 + [ctypes.c_int64]
    fn.restype = ctypes.c_int64
    return int(
        fn(job, (ctypes.c_int64 * count)(*pids), (ctypes.c_int64 * count)(*pid_namespaces), count)
    )


def new_host_directory() -> int:
    """A new directory of this process's nameless host-exchange segments
    (`host_peers.h`): its descriptor, for the job about to start to gather with the
    pids, or -1 (without the kernels, or when it cannot be made)."""
    lib = _loaded.get("lib")
    if lib is None:
        return -1
    lib.EmbedmeshHostDirectory.restype = ctypes.c_int64
    return int(lib.EmbedmeshHostDirectory())


def open_host_directories(job: int, process: int, pids, fds) -> bool:
    """Open every process's directory of job `job` (`fds[i]`, made by process `pids[i]`
    with `new_host_directory`; this one is `process`): whether all opened (through
    /proc/<pid>/fd: the same pid namespace and user)."""
    lib = _loaded.get("lib")
    if lib is None:
        return False
    count = len(pids)
    fn = lib.EmbedmeshHostJobDirectories
    fn.argtypes = [ctypes.c_int64] * 2 + [ctypes.POINTER(ctypes.c_int64)] * 2 + [ctypes.c_int64]
    fn.restype = ctypes.c_int64
    arrays = [(ctypes.c_int64 * count)(*(int(v) for v in a)) for a in (pids, fds)]
    return bool(fn(job, process, *arrays, count))


def set_host_job_nameless(job: int, nameless: bool) -> None:
    """Whether job `job`'s segments are nameless (memfds found through the directories,
    never a name in /dev/shm): True only when every process opened every directory."""
    lib = _loaded.get("lib")
    if lib is None:
        return
    fn = lib.EmbedmeshHostJobNameless
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64]
    fn.restype = None
    fn(job, 1 if nameless else 0)


def host_job_nameless(job: int) -> bool:
    """Whether job `job`'s segments are nameless here (`set_host_job_nameless`)."""
    lib = _loaded.get("lib")
    if lib is None:
        return False
    fn = lib.EmbedmeshHostJobIsNameless
    fn.argtypes = [ctypes.c_int64]
    fn.restype = ctypes.c_int64
    return bool(fn(job))


def host_channel_tags(job: int) -> set[int]:
    """The tags of this process's host-exchange channels of job `job` (which host kernels
    ran here; empty when `ready()` is False)."""
    lib = _loaded.get("lib")
    if lib is None:
        return set()
    fn = lib.EmbedmeshHostChannelTags
    fn.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    fn.restype = ctypes.c_int64
    buf = (ctypes.c_int64 * 4096)()
    count = int(fn(job, buf, 4096))
    return {int(buf[i]) for i in range(min(count, 4096))}


def pad_id() -> int | None:
    """The library's padding id, its `kPad` (None when `ready()` is False)."""
    if not ready():
        return None
    return int(_loaded["lib"].EmbedmeshPadId())
