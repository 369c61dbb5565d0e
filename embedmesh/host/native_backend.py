"""The C++ backend of host preprocessing (the default where its library loads): the
kernels of `embedmesh/host/cpu/preprocess.cc`, plain C called through ctypes, which
releases the GIL around every call.

The same algorithm as the numba backend (`embedmesh.host.numba_backend`), written
again in C++ so that a training process needs no numba (its modules and LLVM: ~50 MB
resident, and a JIT or cache load at the first batch): the arrays are bit-identical
(`tests/host/test_preprocess.py`). One call per (stack, local device) task,
`EmHostDevice`: every table of the stack sorted (radix sort per (table, device)
block), appended to the partitions in row order, then the padding; where threads are
spare, the tables' sorts first run as tasks of their own (`EmHostSort`, a handle the
device task consumes). `embedmesh.host.preprocess` drives it (`_NativeRun`) with the
table parameters of `embedmesh.host.kernel_params`.

The library is built at install with the package's other C++ libraries (per ISA
variant) and found by `embedmesh._native.load("host")`; `library()` is None when it
cannot be had (no build and no compiler, a failed build) or
`EMBEDMESH_PREPROCESS_NATIVE=0`, and `reason()` says why.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from embedmesh import _native, _runtime

__all__ = [
    "NAME",
    "TABLE_WORDS",
    "describe",
    "library",
    "reason",
]

NAME = "native"
TABLE_WORDS = 8  # int64 words of a table's descriptor (EmHostTableWords)

_lock = threading.Lock()
_state: dict = {}  # "lib" once loaded; "why" once that failed

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_DT32, _DT64, _DTF = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)


def library():
    """The kernels as a `ctypes.CDLL` (argument types set), or None (see `reason()`).
    Found once per process."""
    with _lock:
        if "lib" in _state or "why" in _state:
            return _state.get("lib")
        if not _runtime.preprocess_native_enabled():
            _state["why"] = "disabled by EMBEDMESH_PREPROCESS_NATIVE=0"
            return None
        try:
            lib = _native.load("host")
            lib.EmHostTableWords.argtypes, lib.EmHostTableWords.restype = [], _I64
            if lib.EmHostTableWords() != TABLE_WORDS:
                raise RuntimeError("the library's table descriptor differs from this module's")
            lib.EmHostSort.argtypes, lib.EmHostSort.restype = [_P, _I64, _I64], _I64
            lib.EmHostFree.argtypes, lib.EmHostFree.restype = [_I64], None
            lib.EmHostDevice.argtypes = [_P, _I64, _P] + [_I64] * 5 + [_P] * 5 + [_I64] * 2
            lib.EmHostDevice.argtypes += [_P, _P]
            lib.EmHostDevice.restype = _I64
            _state["lib"] = lib
        except Exception as e:  # noqa: BLE001 - any failure means: another backend
            _state["why"] = f"{type(e).__name__}: {e}"
        return _state.get("lib")


def reason() -> str:
    """Why `library()` is None ("" when it is not)."""
    library()
    return _state.get("why", "")


def describe(inputs: list) -> np.ndarray:
    """The tables' descriptors [T, TABLE_WORDS] int64 (`preprocess.cc`'s `T_*` words)
    for kernel inputs `(ids, weights, splits, fmeta, params)` (numba's arguments: ids
    int32 or int64, weights float32 (empty: unweighted), splits int64, fmeta [F, 4]
    int64, params int64; C-contiguous). The arrays must outlive the calls."""
    desc = np.zeros((len(inputs), TABLE_WORDS), np.int64)
    for i, (ids, weights, splits, fmeta, params) in enumerate(inputs):
        if not (
            (ids.dtype == _DT32 or ids.dtype == _DT64)
            and splits.dtype == _DT64 == fmeta.dtype == params.dtype
            and (weights.shape[0] == 0 or weights.dtype == _DTF)
            and ids.flags.c_contiguous
            and splits.flags.c_contiguous
            and fmeta.flags.c_contiguous
            and weights.flags.c_contiguous
        ):
            raise TypeError(
                f"kernel inputs of dtypes {ids.dtype}, {weights.dtype}, {splits.dtype}, "
                f"{fmeta.dtype}, {params.dtype}: expected contiguous int32/int64, float32, "
                f"int64, int64, int64"
            )
        desc[i] = (
            ids.ctypes.data,
            ids.dtype == np.int64,
            weights.ctypes.data if weights.shape[0] else 0,  # numba: empty is unweighted
            splits.ctypes.data,
            fmeta.ctypes.data,
            fmeta.shape[0],
            params.ctypes.data,
            0,
        )
    return desc
