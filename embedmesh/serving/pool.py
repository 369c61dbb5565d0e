"""The serving kernels' output buffers: 64-byte aligned, reused once nothing
references them.

Outputs are 64-byte aligned so `jax.device_put(out, may_alias=True)` can wrap
them without a copy, and come from a pool of buffers reused once nothing
references them (`embedmesh.serving.settings.set_output_pool_limit`,
`EMBEDMESH_OUTPUT_POOL_MB`: the free bytes kept). Every backend
(`embedmesh.serving.backends`) takes its outputs here, and so does the request path
(`lookup.py`, the compiled `request.py`).
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np

from embedmesh import _runtime
from embedmesh._runtime import aligned_empty

__all__ = [
    "address",
    "output_empty",
    "output_empty_at",
    "output_float32_at",
    "set_output_pool_limit",
    "set_release_hook",
]

_ALIGN = 64  # bytes; XLA's CPU client aliases host buffers aligned like this
_F32 = np.dtype(np.float32)
_F32_STR = _F32.str


class _Lease:
    """One output buffer handed out. numpy reads its memory through
    `__array_interface__`, so the array made over it, every numpy view of that array
    and every jax.Array aliasing it (`device_put(..., may_alias=True)` holds the
    numpy array) keep this object alive; when the last of them goes, `__del__` gives
    the memory back to the pool, in O(1), with no scan of reference counts."""

    __slots__ = ("__array_interface__", "_raw", "_pool")

    def __del__(self) -> None:
        try:
            self._pool._give_back(self._raw)
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be gone
            pass


class _BufferPool:
    """Output buffers reused once nothing references them any more.

    On the serving machine (a VM) the first touch of fresh memory costs
    ~0.45 ms per MB in page faults: 3.7 ms for eight 1 MB outputs against
    0.15 ms to rewrite reused ones, as much as the lookup itself. Each buffer
    handed out is an array over a `_Lease`, which returns the memory when the
    last array over it is gone; buffers are matched by byte size.

    `limit` bounds the bytes of free buffers kept (the oldest freed go first),
    not the buffers in use: those are the caller's outputs. A caller that holds
    one result while it asks for the next (a serving loop) needs two requests'
    outputs in the pool; counting the held ones against the limit made every
    request over half the limit allocate afresh and fault its pages in (dense
    dim 128, batch 4096 x 10, 8 tables: 168 MB a request, 29.6 against 18.8 ms
    a call; benchmarks/runs/serving-history.md, seventh session).
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        # byte size -> free raw buffers of that size, oldest first (`_aligned_raw`)
        self._free: dict[int, list[list]] = {}
        self._free_bytes = 0
        self.release = None  # called before allocating afresh (see set_release_hook)
        # re-entrant: a lease's __del__ may run inside this pool's own allocation (the
        # cyclic garbage collector runs there) and give a buffer back
        self._lock = threading.RLock()

    def empty(self, shape, dtype) -> np.ndarray:
        return self.empty_at(shape, dtype)[0]

    def empty_at(self, shape, dtype) -> tuple[np.ndarray, int]:
        """`empty`, and the array's address (kept with the buffer: reading it from
        numpy costs ~1 us, and a call takes 8+ buffers)."""
        # cheap on purpose: the serving lookup takes 8+ buffers per call, on caches
        # its kernels have just flushed
        dtype = np.dtype(dtype)
        shape = tuple(map(int, shape))
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or dtype.hasobject:
            out = aligned_empty(shape, dtype)
            return out, address(out)
        raw = self._raw_of(nbytes)
        if dtype.isbuiltin != 1:  # ml_dtypes' bfloat16, structured: bytes, viewed as the dtype
            lease = self._lease_of(raw)
            lease.__array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (raw[1], False),
                "version": 3,
            }
            return np.asarray(lease).view(dtype).reshape(shape), raw[1]
        return self._leased(raw, shape, dtype.str)  # numpy's own dtypes: the string says all

    def float32_at(self, shape: tuple) -> tuple[np.ndarray, int]:
        """`empty_at(shape, float32)` for a tuple of Python ints, with less Python where a
        free buffer of its size is kept (the request path's outputs: ~1 us of a request)."""
        nbytes = 4 * math.prod(shape)
        raw = self._take(nbytes) if nbytes else None
        if raw is None:
            return self.empty_at(shape, _F32)
        return self._leased(raw, shape, _F32_STR)

    def lease(self, nbytes: int) -> tuple[_Lease, int]:
        """A free buffer of `nbytes` (or a fresh one) as its lease and its address, no
        array over it: the compiled request path makes its outputs' views over it with
        numpy's C API, the lease their base (back to the pool when the last is gone)."""
        raw = self._raw_of(nbytes)
        return self._lease_of(raw), raw[1]

    def _raw_of(self, nbytes: int) -> list:
        """A free buffer of `nbytes`, else a fresh one."""
        raw = self._take(nbytes)
        if raw is None and self.release is not None:
            self.release()  # jax.Arrays deleted but not yet released give theirs back
            raw = self._take(nbytes)
        return _aligned_raw(nbytes) if raw is None else raw

    def _lease_of(self, raw: list) -> _Lease:
        """`raw`'s lease: the buffer back to this pool when the lease dies."""
        lease = _Lease()
        lease._raw, lease._pool = raw, self
        return lease

    def _leased(self, raw, shape: tuple, typestr: str) -> tuple[np.ndarray, int]:
        """An array of `shape` and `typestr` on the pool's buffer `raw`, leased: back to
        the pool when it dies. A buffer mostly comes back for the same shape: its array
        interface is kept for it."""
        lease = self._lease_of(raw)
        if raw[3] != (shape, typestr):
            raw[3] = (shape, typestr)
            raw[4] = {"shape": shape, "typestr": typestr, "data": (raw[1], False), "version": 3}
        lease.__array_interface__ = raw[4]
        return np.asarray(lease), raw[1]

    def _take(self, nbytes: int):
        with self._lock:
            free = self._free.get(nbytes)
            if not free:
                return None
            raw = free.pop()  # the most recently freed: the likeliest still in cache
            self._free_bytes -= nbytes
            return raw

    def _give_back(self, raw: list) -> None:
        nbytes = raw[2]
        with self._lock:
            if nbytes > self.limit:
                return
            while self._free_bytes + nbytes > self.limit:  # the oldest freed go first
                size, free = next((k, v) for k, v in self._free.items() if v)
                free.pop(0)
                self._free_bytes -= size
            self._free.setdefault(nbytes, []).append(raw)
            self._free_bytes += nbytes

    def free_bytes(self) -> int:
        """Bytes of free buffers kept for reuse."""
        return self._free_bytes

    def clear(self) -> None:
        with self._lock:
            self._free, self._free_bytes = {}, 0


def _aligned_raw(nbytes: int) -> list:
    """A fresh buffer: `[raw, address, nbytes, key, interface]`, where raw is a uint8
    array with room for `nbytes` from its 64-byte aligned `address` on, and `interface`
    the `__array_interface__` last handed out over it, for (shape, type string) `key`."""
    raw, start = _runtime.aligned_buffer(nbytes, _ALIGN)
    return [raw, address(raw) + start, nbytes, None, None]


_pool = _BufferPool(_runtime.output_pool_bytes())  # EMBEDMESH_OUTPUT_POOL_MB


def set_release_hook(fn) -> None:
    """`fn()` lets owners of outputs drop references they hold only lazily (jaxlib
    defers releasing a deleted jax.Array's numpy buffer); called before the pool
    allocates a fresh buffer."""
    _pool.release = fn


def set_output_pool_limit(nbytes: int) -> int:
    """Bytes of free output buffers kept for reuse (0: none; the outputs in use do not
    count); returns the previous limit."""
    previous, _pool.limit = _pool.limit, int(nbytes)
    _pool.clear()
    for hook in _limit_hooks:
        hook(_pool.limit)
    return previous


# fn(limit) for each cache of output buffers kept outside the pool: called with the new
# limit (the compiled request path's small buffers: `request._bind`)
_limit_hooks: list = []


def on_output_pool_limit(hook) -> None:
    """Call `hook(limit)` now and whenever `set_output_pool_limit` sets a new limit (once
    per hook, however often registered)."""
    if hook not in _limit_hooks:
        _limit_hooks.append(hook)
    hook(_pool.limit)


def output_empty(shape, dtype) -> np.ndarray:
    """An aligned output array, from the reuse pool when one is free."""
    return _pool.empty(shape, dtype)


def output_empty_at(shape, dtype) -> tuple[np.ndarray, int]:
    """`output_empty`, and the array's address."""
    return _pool.empty_at(shape, dtype)


def output_float32_at(shape: tuple) -> tuple[np.ndarray, int]:
    """`output_empty_at(shape, float32)` for a tuple of Python ints, faster."""
    return _pool.float32_at(shape)


def output_lease(nbytes: int) -> tuple:
    """An output buffer of `nbytes` as (lease, address), no array over it (`_BufferPool.lease`:
    the compiled request path's)."""
    return _pool.lease(nbytes)


def address(a: np.ndarray) -> int:
    """The data address of an array: through ctypes' view of a writable contiguous
    buffer (~0.3 us), else numpy's interface (~1.1 us; read-only, strided or empty
    arrays). A request takes 3-5 addresses a feature."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]
