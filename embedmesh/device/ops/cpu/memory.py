"""Buffers on transparent huge pages (CPU): a copy, and a constant array made on a device.

XLA's own buffers get 4 KiB pages; random row access into multi-GB tables and
slots is faster on huge pages in a VM, where TLB misses are expensive (the
training step of `benchmarks/train/train_step.py` went from 47 to 40 ms).
`EmbeddingCore` builds its tables and slots with `embedmesh.device.ops.full`,
which comes here for big CPU buffers. The handlers advise the output to use
huge pages before its first write, then copy or fill it on the kernels'
threads.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def huge_page_copy(x):
    """A copy of `x` in a buffer advised to use transparent huge pages."""
    return jax.ffi.ffi_call("embedmesh_huge_page_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def full(shape: tuple, value, dtype, device):
    """`jnp.full(shape, value, dtype)` made on the CPU `device` (`value` already there),
    on transparent huge pages."""
    return _fill_fn(shape, np.dtype(dtype).name, device)(value)


@functools.lru_cache(maxsize=64)
def _fill_fn(shape, dtype, device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(
        lambda v: jax.ffi.ffi_call("embedmesh_huge_page_fill", jax.ShapeDtypeStruct(shape, dtype))(
            v
        ),
        out_shardings=sharding,
    )
