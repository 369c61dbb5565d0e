"""Every private jax, jaxlib and orbax hook embedmesh uses, in one place.

Each hook has a public fallback at its call site, so a jax or orbax release
that moves one keeps embedmesh working (slower, or with a plainer error); a
fallback taken silently would hide that, so `tests/project/test_compat.py` checks that
each hook in `HOOKS` still resolves on the installed versions and fails when
one stops resolving. Resolution is lazy: importing this module imports
nothing private (and never orbax).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = [
    "HOOKS",
    "backends_are_initialized",
    "batched_device_put",
    "collect_garbage",
    "default_device_is_set",
    "orbax_tensorstore_utils",
    "plain_cpu_put_target",
    "reinit_backends_after_fork",
    "shaped_array",
    "trace_state_clean",
]


@functools.cache
def _trace_state_clean() -> Callable[[], bool] | None:
    try:
        from jax._src.core import trace_state_clean as fn

        return fn
    except Exception:  # noqa: BLE001 - private module moved
        return None


def trace_state_clean() -> bool | None:
    """Whether no jax trace (jit, grad, vmap, ...) is active on this thread (0.2 us);
    None when the hook is gone (callers then look for tracers among their arguments)."""
    fn = _trace_state_clean()
    return None if fn is None else bool(fn())


@functools.cache
def batched_device_put() -> Callable | None:
    """jaxlib's `batched_device_put(aval, sharding, [x], [device], committed)`: ~4 us
    per array where `jax.device_put` spends ~18 us of Python (serving's outputs)."""
    try:
        from jax._src.lib import xla_client

        return xla_client.batched_device_put
    except Exception:  # noqa: BLE001
        return None


@functools.cache
def shaped_array() -> type | None:
    """jax's `ShapedArray` (the aval `batched_device_put` takes)."""
    try:
        from jax._src import core as jax_core

        return jax_core.ShapedArray
    except Exception:  # noqa: BLE001
        return None


@functools.cache
def _jax_config():
    try:
        from jax._src import config

        return config
    except Exception:  # noqa: BLE001
        return None


def default_device_is_set() -> bool | None:
    """Whether `jax.default_device` is set (None: unknown, the hook is gone)."""
    config = _jax_config()
    try:
        return config.default_device.value is not None
    except Exception:  # noqa: BLE001
        return None


_plain_cpu: list = []  # [(device, SingleDeviceSharding) or None], once known


def plain_cpu_put_target() -> tuple | None:
    """`(device, sharding)` where `jax.device_put(numpy array)` lands, when that is
    this process's first local device, a CPU, and no default device is set: there
    `batched_device_put` gives the same array as `jax.device_put`, faster. Else
    None (also when the config hook is gone: then a default device may be set)."""
    if default_device_is_set() is not False:
        return None
    if not _plain_cpu:
        import jax

        device = jax.local_devices()[0]
        _plain_cpu.append(
            (device, jax.sharding.SingleDeviceSharding(device))
            if device.platform == "cpu"
            else None
        )
    return _plain_cpu[0]


@functools.cache
def collect_garbage() -> Callable[[], None] | None:
    """jaxlib's deferred-decref flush: lets the numpy buffers of deleted jax.Arrays
    go now instead of at Python's next gc (serving's output pool reuses them)."""
    try:
        from jax._src.lib import _jax

        return _jax.collect_garbage
    except Exception:  # noqa: BLE001
        return None


def backends_are_initialized() -> bool | None:
    """Whether this process has live jax backends (None: unknown)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # noqa: BLE001
        return None


def reinit_backends_after_fork(keep: list) -> None:
    """Give a forked child its own jax runtime: new clients, emptied compile caches.

    The parent's runtime objects are appended to `keep` (destroying them in the
    child would wait on the parent's threads). `jax.clear_backends` cannot be
    used: its effects barrier waits on the parent's runtime.
    """
    import jax
    from jax._src import pjit as _pjit
    from jax._src import util as _util
    from jax._src import xla_bridge as _xb
    from jax._src.interpreters import mlir as _mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir as _ir

    with _xb._backend_lock:
        keep.append((dict(_xb._backends), _mlir.global_thread_pool))
    _mlir.global_thread_pool = _ir.ThreadPool()
    _xb._clear_backends()
    _util.clear_all_caches()
    _pjit._cpp_pjit_cache_fun_only.clear()
    _pjit._cpp_pjit_cache_explicit_attributes.clear()
    _jax.PjitFunctionCache.clear_all()
    jax.devices()  # the new clients, created here in the child


def _fork_reinit_resolves() -> bool:
    from jax._src import pjit as _pjit
    from jax._src import util as _util
    from jax._src import xla_bridge as _xb
    from jax._src.interpreters import mlir as _mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir as _ir

    return all(
        [
            hasattr(_xb, "_backend_lock"),
            hasattr(_xb, "_backends"),
            hasattr(_xb, "_clear_backends"),
            hasattr(_mlir, "global_thread_pool"),
            hasattr(_ir, "ThreadPool"),
            hasattr(_util, "clear_all_caches"),
            hasattr(_pjit, "_cpp_pjit_cache_fun_only"),
            hasattr(_pjit, "_cpp_pjit_cache_explicit_attributes"),
            hasattr(_jax, "PjitFunctionCache"),
        ]
    )


@functools.cache
def orbax_tensorstore_utils() -> Any | None:
    """orbax's tensorstore helpers (`ArrayReadSpec`, `get_ts_context`): restores read
    with orbax's own spec and context; None: a hand-made spec stands in."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils

        return tensorstore_utils
    except Exception:  # noqa: BLE001
        return None


def _orbax_hooks_resolve() -> bool:
    utils = orbax_tensorstore_utils()
    return (
        utils is not None and hasattr(utils, "ArrayReadSpec") and hasattr(utils, "get_ts_context")
    )


# name -> a check that the hook resolves on the installed versions (tests/project/test_compat.py)
HOOKS: dict = {
    "jax._src.core.trace_state_clean": lambda: _trace_state_clean() is not None,
    "jax._src.lib.xla_client.batched_device_put": lambda: batched_device_put() is not None,
    "jax._src.core.ShapedArray": lambda: shaped_array() is not None,
    "jax._src.config.default_device": lambda: default_device_is_set() is not None,
    "jax._src.lib._jax.collect_garbage": lambda: collect_garbage() is not None,
    "jax._src.xla_bridge.backends_are_initialized": lambda: backends_are_initialized() is not None,
    "fork re-initialisation (xla_bridge, mlir, pjit caches)": _fork_reinit_resolves,
    "orbax.checkpoint._src.serialization.tensorstore_utils": _orbax_hooks_resolve,
}
