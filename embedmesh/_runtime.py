"""Process-wide runtime settings and shared constants, in one place.

Environment switches are read here, once, the first time they are asked for
(tests reset them with `reset()`); every module asks this one instead of
reading `os.environ` itself. docs/environment.md
lists them:

  EMBEDMESH_NUMBA=0           host kernels (preprocessing, serving) use numpy
  EMBEDMESH_PREPROCESS_NATIVE=0   host preprocessing without its C++ kernels (numba's,
                              then numpy's)
  EMBEDMESH_PAGE_OUT_LLVM=0   keep numba's LLVM code resident once the preprocessing
                              kernels are loaded (default: paged out, `page_out_llvm`)
  EMBEDMESH_CPU_KERNELS=0|1   device ops: 0 pure JAX; 1 build the C++ kernels
                              even when the default backend is not CPU
  EMBEDMESH_CPU_THREADS=n     threads of the C++ device kernels
  EMBEDMESH_CPU_ISA=avx512|avx2|baseline|native   the C++ libraries' ISA variant
                              (default: the best this CPU runs; read by
                              `embedmesh._native`, which setup.py loads alone)
  EMBEDMESH_GPU_KERNELS=xla|pallas|reference   device ops on GPU: XLA variants
                              (default), Pallas kernels, or the references
  EMBEDMESH_PREPROCESS_THREADS=n   threads of host preprocessing (its default
                              `num_threads`)
  EMBEDMESH_SERVING_THREADS=n threads of the serving lookup (0 or 1: caller only)
  EMBEDMESH_OUTPUT_POOL_MB=n  MB of free serving output buffers kept for reuse
  EMBEDMESH_SERVING_SPIN_US=n how long the serving pool's threads poll for the next
                              request before they sleep (default 300; 0: sleep at once)
  EMBEDMESH_GPU_SCATTER_WORKAROUND=0  no XLA flag against jaxlib 0.10.2-0.11.0's
                              slow GPU scatter-add (see `embedmesh._gpu_guard`)
  EMBEDMESH_CACHE_DIR=path    where kernels built at first use are cached
  EMBEDMESH_COMPILATION_CACHE=0|1|path   JAX's persistent compilation cache: 0 (or
                              off/false/no) leaves it off; 1 (on/true/yes) puts it
                              at $EMBEDMESH_CACHE_DIR/jax, a path there (default:
                              1 where a TPU or GPU backend is installed, 0 on a
                              host with the CPU backend alone; used only where
                              neither jax_compilation_cache_dir nor
                              JAX_COMPILATION_CACHE_DIR is set; it then keeps
                              every program, unless the user set JAX's minimum
                              compile time)
  EMBEDMESH_HOST_EXCHANGE=0   processes on one host exchange through XLA's
                              collectives (gloo), not shared memory
  EMBEDMESH_EXCHANGE_TIMEOUT_S=s   how long a shared-memory exchange between
                              processes waits for its peers (default 60; inf:
                              forever)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import importlib
import os
import sys
import threading

import numpy as np

__all__ = [
    "COMBINER_CODE",
    "PACK_LIMIT",
    "PAD_ID",
    "aligned_buffer",
    "aligned_empty",
    "cache_dir",
    "combiner_code",
    "compilation_cache_dir",
    "cpu_kernels_setting",
    "cpu_threads",
    "exchange_timeout_s",
    "gpu_kernels_variant",
    "use_compilation_cache",
    "llvm_page_outs",
    "numba_enabled",
    "output_pool_bytes",
    "page_out_llvm",
    "page_out_llvm_enabled",
    "pooled_pair_fields",
    "preprocess_native_enabled",
    "preprocess_threads",
    "reset",
    "serving_threads",
    "thread_pool",
    "usable_cores",
]

# Padding id of unique-id lists: int32 max, out of range on every shard (the C++
# kernels' kPad has the same value).
PAD_ID = int(np.iinfo(np.int32).max)

# A pooled message's pair (ops.pack_pooled_pairs): its id's position and its row among the
# owner's Rc rows share one int32 word while (U + 1) * (Rc + 1) stays below this.
PACK_LIMIT = 2**31


def pooled_pair_fields(unique_capacity: int, width: int) -> int:
    """Int32 words a pair takes in a pooled message: 2 (position and row packed in one
    word, then the gain's bits) below `PACK_LIMIT`, else 3."""
    return 2 if (int(unique_capacity) + 1) * (int(width) + 1) < PACK_LIMIT else 3


# Combiner codes the host and device kernels take.
COMBINER_CODE = {None: 0, "sum": 0, "mean": 1, "sqrtn": 2}


def fmix32(h):
    """MurmurHash3's 32-bit finaliser (a bijection) on uint32 arrays, numpy's or jax's (the
    constants numpy uint32 scalars: the result keeps the array's kind): the one mixing of
    the ids' keyed hash (host routing, the devices' id maps) and the checkpoints' checksums."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def fmix32_int(h: int) -> int:
    """`fmix32` of a Python int in [0, 2**32)."""
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def combiner_code(combiner: str | None) -> int:
    try:
        return COMBINER_CODE[combiner]
    except (KeyError, TypeError):  # TypeError: unhashable
        raise ValueError(
            f"unknown combiner {combiner!r}: expected one of "
            f"{sorted(k for k in COMBINER_CODE if k)}"
        ) from None


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _positive_int(name: str) -> int | None:
    value = _env(name)
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return n


@functools.cache
def numba_enabled() -> bool:
    """False when EMBEDMESH_NUMBA is 0/false/no/off: host kernels use numpy."""
    return _env("EMBEDMESH_NUMBA").lower() not in _OFF


@functools.cache
def preprocess_native_enabled() -> bool:
    """False when EMBEDMESH_PREPROCESS_NATIVE is 0/false/no/off: host preprocessing
    without its C++ kernels (`embedmesh.host.native_backend`)."""
    return _env("EMBEDMESH_PREPROCESS_NATIVE").lower() not in _OFF


@functools.cache
def cpu_kernels_setting() -> bool | None:
    """EMBEDMESH_CPU_KERNELS: False (off), True (build even off CPU), None (default:
    on when the default backend is CPU)."""
    value = _env("EMBEDMESH_CPU_KERNELS").lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return None


GPU_KERNEL_VARIANTS = ("xla", "pallas", "reference")


@functools.cache
def gpu_kernels_variant() -> str:
    """EMBEDMESH_GPU_KERNELS: "xla" (default, also when unset), "pallas", or
    "reference" (also "0"); anything else is a ValueError."""
    value = _env("EMBEDMESH_GPU_KERNELS").lower()
    if value in ("", "xla"):
        return "xla"
    if value == "pallas":
        return "pallas"
    if value in ("0", "reference"):
        return "reference"
    raise ValueError(
        f"EMBEDMESH_GPU_KERNELS={value!r}: expected one of xla (the default), pallas, "
        f"reference (or 0)"
    )


@functools.cache
def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def cpu_threads() -> int | None:
    """EMBEDMESH_CPU_THREADS (None: the C++ kernels decide, one per usable core)."""
    return _positive_int("EMBEDMESH_CPU_THREADS")


@functools.cache
def preprocess_threads() -> int:
    """EMBEDMESH_PREPROCESS_THREADS, else one per usable core."""
    return _positive_int("EMBEDMESH_PREPROCESS_THREADS") or usable_cores()


@functools.cache
def serving_threads() -> int:
    """EMBEDMESH_SERVING_THREADS (0 counts as 1: the caller's thread only), else one
    per usable core up to 8 (TensorFlow and torch also use every core): on the
    serving benchmark 2 threads ran 1.6-1.7x faster than 1 with the other core free."""
    value = _env("EMBEDMESH_SERVING_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(
                f"EMBEDMESH_SERVING_THREADS={value!r}: expected an integer >= 0"
            ) from None
    return min(usable_cores(), 8)


@functools.cache
def serving_spin_us() -> int | None:
    """EMBEDMESH_SERVING_SPIN_US (None: the C++ runner's default, 300)."""
    value = _env("EMBEDMESH_SERVING_SPIN_US")
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"EMBEDMESH_SERVING_SPIN_US={value!r}: expected an integer >= 0")
    return n


@functools.cache
def output_pool_bytes() -> int:
    """EMBEDMESH_OUTPUT_POOL_MB (default 256) in bytes."""
    value = _env("EMBEDMESH_OUTPUT_POOL_MB")
    return (int(value) if value else 256) << 20


@functools.cache
def cache_dir() -> str:
    """EMBEDMESH_CACHE_DIR, else $XDG_CACHE_HOME/embedmesh (default ~/.cache/embedmesh)."""
    d = _env("EMBEDMESH_CACHE_DIR")
    if d:
        return d
    base = _env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "embedmesh")


@functools.cache
def compilation_cache_dir() -> str | None:
    """EMBEDMESH_COMPILATION_CACHE: None where it is 0/false/off/no; `cache_dir()`/jax
    (the directory of JAX's persistent compilation cache) where it is 1/true/on/yes, or
    unset where a TPU or GPU backend is installed (`accelerator_installed`); else its
    path. Unset on a host with only the CPU backend: None. XLA:CPU executables read back
    from the cache ran the pipelined training step ~1.2x slower than the same programs
    compiled in the process (jaxlib 0.10.2, 2026-12-08; the generic programs tried were
    not), while a CPU step compiles in seconds: the cache would cost every step to save
    those seconds once."""
    value = _env("EMBEDMESH_COMPILATION_CACHE")
    if value.lower() in ("0", "false", "off", "no"):
        return None
    if value.lower() in ("1", "true", "on", "yes") or (not value and accelerator_installed()):
        return os.path.join(cache_dir(), "jax")
    return value or None


def accelerator_installed() -> bool:
    """Whether JAX may run on a TPU or GPU here, found without starting a backend: the
    platforms JAX_PLATFORMS (or `jax_platforms`) names, else an installed TPU runtime
    (`libtpu`) or PJRT plugin (the `jax_plugins` namespace or entry points: CUDA, ROCm)."""
    import importlib.metadata
    import importlib.util

    import jax

    named = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    if named.strip():
        return any(p.strip() not in ("", "cpu") for p in named.split(","))
    if any(importlib.util.find_spec(m) is not None for m in ("libtpu", "jax_plugins")):
        return True
    return bool(importlib.metadata.entry_points(group="jax_plugins"))


def use_compilation_cache() -> str | None:
    """Point JAX's persistent compilation cache at `compilation_cache_dir()` unless the
    user chose for it (`jax_compilation_cache_dir` set, or JAX_COMPILATION_CACHE_DIR in
    the environment) or turned it off (EMBEDMESH_COMPILATION_CACHE=0). The first step of
    a model compiles its programs for tens of seconds on an accelerator; a second process
    with the same programs reads them from the cache. Called once at import, before
    anything compiles (JAX reads the setting at its first compile). Returns the
    directory set, or None.

    Where it sets the directory, it also keeps every program there, not only those that
    compiled for a second or more (JAX's default threshold, unless the user set one):
    building a layer and its first step compile a dozen small programs, each again in
    every process (the test suite keeps them all too: its CPU time fell 1.9x)."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    path = compilation_cache_dir()
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", path)
        if (
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_MIN_COMPILE_S
        ):
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


# JAX's default `jax_persistent_cache_min_compile_time_secs` (a value the user left as it is)
_JAX_MIN_COMPILE_S = 1.0


def host_exchange_enabled() -> bool:
    """EMBEDMESH_HOST_EXCHANGE (default on; 0/false/off/no: off): processes of one host
    exchange through shared memory (`embedmesh.device.peers`)."""
    return _env("EMBEDMESH_HOST_EXCHANGE").lower() not in _OFF


@functools.cache
def exchange_timeout_s() -> float:
    """EMBEDMESH_EXCHANGE_TIMEOUT_S (default 60): how long a shared-memory exchange
    between the processes of one host waits for its peers before failing; inf waits
    forever (a peer that exits still fails it at once). Anything but a positive number
    (0, negative, nan, text) is a ValueError naming the variable and the value."""
    value = _env("EMBEDMESH_EXCHANGE_TIMEOUT_S")
    if not value:
        return 60.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"EMBEDMESH_EXCHANGE_TIMEOUT_S={value!r}: expected a positive number of seconds "
            "(inf: wait forever)"
        )
    return seconds


def gpu_scatter_workaround() -> bool:
    """EMBEDMESH_GPU_SCATTER_WORKAROUND (default on; 0/false/off/no: off). Read afresh:
    the guard runs once, at import."""
    return _env("EMBEDMESH_GPU_SCATTER_WORKAROUND").lower() not in ("0", "false", "off", "no")


_numba_modules: dict = {}  # module name -> the module, or None where it cannot load


def numba_module(name: str):
    """The numba-compiled module `name`, imported at first use (so that `import
    embedmesh` never loads numba), or None: EMBEDMESH_NUMBA=0, or numba is not
    importable. One answer per module and process."""
    if name not in _numba_modules:
        module = None
        if numba_enabled():
            try:
                module = importlib.import_module(name)
            except ImportError:
                module = None
        _numba_modules[name] = module
    return _numba_modules[name]


@functools.cache
def page_out_llvm_enabled() -> bool:
    """False when EMBEDMESH_PAGE_OUT_LLVM is 0/false/no/off (see `page_out_llvm`)."""
    return _env("EMBEDMESH_PAGE_OUT_LLVM").lower() not in _OFF


_MADV_PAGEOUT = 21  # Linux >= 5.4 (include/uapi/asm-generic/mman-common.h)
_llvm_lock = threading.Lock()
_llvm_seen = [-1, 0]  # [numba overloads at the last page-out, page-outs done]


_dispatchers: dict = {}  # numba module name -> its module-level dispatchers


def _numba_overloads() -> int:
    """Compiled (or cache-loaded) specializations of the numba modules loaded so far."""
    n = 0
    for name, module in list(_numba_modules.items()):
        if name not in _dispatchers:
            _dispatchers[name] = [
                value
                for value in (vars(module).values() if module is not None else ())
                if isinstance(getattr(value, "overloads", None), dict) and hasattr(value, "py_func")
            ]
        n += sum(len(d.overloads) for d in _dispatchers[name])
    return n


def llvm_page_outs() -> int:
    """How many times this process has paged numba's LLVM code out (`page_out_llvm`)."""
    return _llvm_seen[1]


def page_out_llvm() -> int:
    """Once numba has compiled or loaded kernels that it had not before, ask the kernel
    to page out the clean, read-only mappings (code, constants) of llvmlite's shared
    library, numba's LLVM: `madvise(MADV_PAGEOUT)`; bytes advised, or 0 (nothing new
    compiled, `EMBEDMESH_PAGE_OUT_LLVM=0`, not Linux, or a kernel without
    MADV_PAGEOUT). Running compiled kernels never executes LLVM, so a training process
    that preprocesses every step keeps ~60-70 MB less resident for nothing (measured:
    benchmarks/train/RESULTS.md); a later compilation faults the pages it needs back
    in from the file (the page cache, or disk). Pages another process maps too are
    left alone by the kernel. The preprocessing calls this after each batch it ran on
    numba; it costs a walk over a few dozen module attributes when nothing is new."""
    if not sys.platform.startswith("linux") or not page_out_llvm_enabled():
        return 0
    if "llvmlite" not in sys.modules:
        return 0
    with _llvm_lock:
        count = _numba_overloads()
        if count == _llvm_seen[0]:
            return 0
        _llvm_seen[0] = count
        spans = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split()
                    if (
                        len(parts) > 5
                        and os.path.basename(parts[5]).startswith("libllvmlite")
                        and parts[1] in ("r-xp", "r--p")
                    ):
                        lo, hi = (int(x, 16) for x in parts[0].split("-"))
                        spans.append((lo, hi - lo))
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return 0
        advised = 0
        for start, size in spans:
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), _MADV_PAGEOUT) == 0:
                advised += size
        if advised:
            _llvm_seen[1] += 1
        return advised


def reset() -> None:
    """Forget the switches read so far (tests change the environment)."""
    for fn in (
        numba_enabled,
        preprocess_native_enabled,
        page_out_llvm_enabled,
        cpu_kernels_setting,
        gpu_kernels_variant,
        usable_cores,
        cpu_threads,
        preprocess_threads,
        serving_threads,
        serving_spin_us,
        output_pool_bytes,
        cache_dir,
        compilation_cache_dir,
        exchange_timeout_s,
    ):
        fn.cache_clear()


def aligned_buffer(nbytes: int, align: int = 64) -> tuple[np.ndarray, int]:
    """`(raw, start)`: a fresh uint8 array of `nbytes + align` bytes and the offset
    of its first `align`-byte aligned byte (`nbytes` usable bytes follow it)."""
    raw = np.empty(int(nbytes) + align, np.uint8)
    return raw, (-raw.ctypes.data) % align


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """`np.empty(shape, dtype)` whose data starts on an `align`-byte boundary (64:
    XLA's CPU client aliases such host buffers; 4096: page aligned)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw, start = aligned_buffer(nbytes, align)
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# One thread pool for the host's parallel work (preprocessing's (stack, device)
# tasks, serving's features), grown to the largest size asked for; a forked child
# (whose copy has no threads) gets a fresh one.
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0
_pool_lock = threading.Lock()


def thread_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's host thread pool, with at least `n` threads."""
    global _pool, _pool_size, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_size < n or _pool_pid != os.getpid():
            old = _pool if _pool_pid == os.getpid() else None
            _pool = concurrent.futures.ThreadPoolExecutor(
                max(int(n), 1), thread_name_prefix="embedmesh"
            )
            _pool_size, _pool_pid = max(int(n), 1), os.getpid()
            if old is not None:
                old.shutdown(wait=False)  # its threads finish what they hold, then exit
        return _pool
