"""The serving kernels' C++ library (`embedmesh/serving/cpu/*.cc`), through ctypes.

`library()` returns it as a `ctypes.CDLL` (argument types set), or None when it
cannot be had (no build and no C++ compiler, a failed build,
`EMBEDMESH_SERVING_NATIVE=0`); `reason()` says why. The library is built at
install with the device kernels, per ISA variant, and found by
`embedmesh._native.load("serving")` (`EMBEDMESH_CPU_ISA` picks a variant). ctypes
releases the GIL around every call; a request's kernels go in one call
(`EmServingRun`), which spreads them over `set_host_threads` threads itself.
Everything else in `embedmesh.serving` goes through `library()`, never through
how the library was found.
"""

from __future__ import annotations

import ctypes
import os
import threading

from embedmesh import _native, _runtime

_lock = threading.Lock()
_state: dict = {}  # "lib" once loaded; "why" once that failed


def library():
    """The serving kernels as a `ctypes.CDLL` (argument types set), or None (see
    `reason()`). Found once per process."""
    with _lock:
        if "lib" in _state or "why" in _state:
            return _state.get("lib")
        if _env_off():
            _state["why"] = "disabled by EMBEDMESH_SERVING_NATIVE=0"
            return None
        spin = _runtime.serving_spin_us()  # a bad value raises, not a silent fallback
        try:
            lib = _native.load("serving")
            _state["lib"] = declare(lib)
            _state["path"] = lib._name
        except Exception as e:  # noqa: BLE001 - any failure means: another backend
            _state["why"] = f"{type(e).__name__}: {e}"
        if spin is not None and "lib" in _state:
            _state["lib"].EmServingSetPoolSpin(spin)
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
_CODES = {"p": _P, "q": _I64, "i": _I32}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the serving symbols of `lib`: each
    signature a string of argument codes in the order `embedmesh/serving/cpu/serving.h`
    declares them (p a pointer, q an int64, i an int32); every result an int64."""
    sigs = {
        "EmServingBagF32": "pqqqpipqpiiipq",
        "EmServingBagQ": "pqqqpipqpiiipqp",
        "EmServingGather": "pqqqpiqp",
        "EmServingSparseOffsets": "piqqpp",
        "EmServingSetPrefetch": "q",
        "EmServingSetQuantizedRowPrefetch": "q",
        "EmServingSetFused": "q",
        "EmServingSetAlignedPrefetch": "q",
        "EmServingSetRowLines": "q",
        "EmServingVectorWidth": "",
        "EmServingSetStreamOutput": "q",
        "EmServingRun": "pqqp",
        "EmServingThreadsFor": "pqq",
        "EmServingSetMinEntriesPerThread": "q",
        "EmServingThreadsForEntries": "qq",
        "EmServingSetPoolSpin": "q",
    }
    for symbol, codes in sigs.items():
        fn = getattr(lib, symbol)
        fn.argtypes = [_CODES[c] for c in codes]
        fn.restype = _I64
    # a request handed its tasks one by one (see serving.h)
    lib.EmServingOpen.argtypes, lib.EmServingOpen.restype = [_I64, _I64], _P
    lib.EmServingAdd.argtypes, lib.EmServingAdd.restype = [_P, _P], _I64
    lib.EmServingClose.argtypes, lib.EmServingClose.restype = [_P, _P], None
    return lib
