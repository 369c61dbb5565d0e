"""The serving kernels' C++ library (`embedmesh/serving/cpu/*.cc`), through ctypes.

`library()` finds (or builds) the shared library and returns it as a
`ctypes.CDLL`, or None when it cannot be had (no C++ compiler, a failed build,
`EMBEDMESH_SERVING_NATIVE=0`); `reason()` says why. ctypes releases the GIL
around every call, so features run in parallel on `set_host_threads` threads.
Everything else in `embedmesh.serving` goes through `lib()`, never through how
the library was found.

TEMPORARY: until the package's build compiles these sources at install time
(ISA variants, a loader in a neutral module), `_find_or_build` compiles them
here on first use, with the flags that build will use plus `-march=native`,
into the cache directory (`embedmesh._runtime.cache_dir()`), keyed by a hash
of the sources, the compiler, the flags and the CPU. One build takes ~3 s;
later processes only load it (~1 ms).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from embedmesh import _runtime

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
NATIVE = ("-march=native",)

_lock = threading.Lock()
_state: dict = {}  # "lib" once loaded; "why" once that failed


def _sources() -> list[str]:
    """The `.h` and `.cc` files of SOURCE_DIR, by name (no glob: its pattern compile is
    a few ms of a process's first lookup)."""
    try:
        names = sorted(n for n in os.listdir(SOURCE_DIR) if n.endswith((".h", ".cc")))
    except OSError:
        return []
    return [os.path.join(SOURCE_DIR, n) for n in names]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _find_or_build(march: tuple = NATIVE) -> tuple[str | None, str]:
    """(path of the built library, "") or (None, why not). TEMPORARY (see module doc)."""
    files = _sources()
    if not any(f.endswith(".cc") for f in files):
        return None, f"no serving kernel sources in {SOURCE_DIR}"
    cxx = next(
        (
            shutil.which(c)
            for c in (os.environ.get("CXX"), "c++", "g++", "clang++")
            if c and shutil.which(c)
        ),
        None,
    )
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    # the compiler by path and modification time, not `--version` (a subprocess on
    # every process's first call: ~10 ms of a serving replica's first request)
    stamp = str(os.stat(cxx).st_mtime_ns)
    digest.update("\0".join([cxx, stamp, *FLAGS, *march, _cpu_signature(), sys.platform]).encode())
    name = f"embedmesh_serving_{digest.hexdigest()[:20]}.so"
    why = "no writable cache directory"
    for d in (
        _runtime.cache_dir(),
        os.path.join(tempfile.gettempdir(), f"embedmesh-{os.getuid()}"),
    ):
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path, ""
        try:
            os.makedirs(d, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                out = os.path.join(tmp, name)
                cc = [f for f in files if f.endswith(".cc")]
                for flags in (march, ()):  # a compiler without -march=native: plain
                    r = subprocess.run(
                        [cxx, *FLAGS, *flags, "-I", SOURCE_DIR, *cc, "-o", out],
                        capture_output=True,
                        text=True,
                        timeout=600,
                    )
                    if r.returncode == 0:
                        break
                if r.returncode != 0:
                    return None, f"compiling the serving kernels failed:\n{r.stderr[-2000:]}"
                os.replace(out, path)  # atomic: concurrent builders are safe
            return path, ""
        except OSError as e:
            why = f"cannot write {d}: {e}"
    return None, why


def library():
    """The serving kernels as a `ctypes.CDLL` (argument types set), or None (see
    `reason()`). Built or found once per process. TEMPORARY body: the package's
    build system will provide the library; only this function knows how."""
    with _lock:
        if "lib" in _state or "why" in _state:
            return _state.get("lib")
        if _env_off():
            _state["why"] = "disabled by EMBEDMESH_SERVING_NATIVE=0"
            return None
        try:
            # EMBEDMESH_SERVING_MARCH (temporary loader only): e.g. "-march=x86-64-v3" to
            # measure the AVX2 build on an AVX-512 machine
            march = os.environ.get("EMBEDMESH_SERVING_MARCH", "").split() or NATIVE
            path, why = _find_or_build(tuple(march))
            if path is None:
                _state["why"] = why
                return None
            _state["lib"] = declare(ctypes.CDLL(path))
            _state["path"] = path
        except Exception as e:  # noqa: BLE001 - any failure means: another backend
            _state["why"] = f"{type(e).__name__}: {e}"
        return _state.get("lib")


def _env_off() -> bool:
    return os.environ.get("EMBEDMESH_SERVING_NATIVE", "").strip().lower() in (
        "0",
        "false",
        "off",
        "no",
    )


def reason() -> str:
    """Why `library()` is None ("" when it is not)."""
    library()
    return _state.get("why", "")


def path() -> str:
    """The loaded library's path ("" when none is loaded)."""
    return _state.get("path", "")


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the serving symbols of `lib`."""
    sigs = {
        "EmServingBagF32": [
            _P,
            _I64,
            _I64,
            _I64,
            _P,
            _I32,
            _P,
            _I64,
            _P,
            _I32,
            _I32,
            _I32,
            _P,
            _I64,
        ],
        "EmServingGather": [_P, _I64, _I64, _I64, _P, _I32, _I64, _P],
        "EmServingSparseOffsets": [_P, _I32, _I64, _I64, _P, _P],
        "EmServingRowsToOffsets": [_P, _I64, _I64, _P],
        "EmServingSetPrefetch": [_I64],
        "EmServingSetFused": [_I64],
        "EmServingSetRowLines": [_I64],
        "EmServingVectorWidth": [],
    }
    for symbol, argtypes in sigs.items():
        fn = getattr(lib, symbol)
        fn.argtypes = argtypes
        fn.restype = _I64
    return lib
