"""GPU kernels of the device ops, registered through the same registry as the CPU ones.

Two variants, chosen per process by `EMBEDMESH_GPU_KERNELS` (read through
`embedmesh._runtime`, at the first op traced):

- `xla` (the default): `xla`, the ops in plain XLA arranged for GPUs (sorted
  segment sums instead of contended scatter-add atomics, scatters told their
  ids are distinct);
- `pallas`: `pallas`, Triton kernels (one program per output row, no atomics;
  fused sparse update and backward + update for all five optimizers) where
  they take the call, the `xla` variants for the rest. Triton is CUDA only:
  on ROCm this variant runs the `xla` ones;
- `reference` (or `0`): every op its pure-JAX reference.

The default is `xla` only because nothing has been measured on a GPU yet;
the benchmarks time both by setting the variable.

`KERNELS` (registered for "gpu": CUDA and ROCm) and `CUDA_KERNELS`
(registered for "cuda", where it replaces the former) map op names to
`(kernel, supports)` like `embedmesh.device.ops.cpu.KERNELS`; each kernel
runs the selected variant's function for its op. `kernels(variant)` is that
table for one variant, without the environment (for tests).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from embedmesh import _runtime
from embedmesh.device.ops.gpu import xla

__all__ = ["CUDA_KERNELS", "KERNELS", "VARIANTS", "kernels", "ready", "variant"]

VARIANTS = _runtime.GPU_KERNEL_VARIANTS

KernelTable = dict[str, tuple[Callable[..., Any], Callable[..., bool] | None]]

XLA_KERNELS: KernelTable = {
    "scatter_rows": (xla.scatter_rows, None),
    "segment_gather_sum": (xla.segment_gather_sum, None),
    "segment_gather_sum_mapped": (xla.segment_gather_sum_mapped, None),
    "dedup_sum": (xla.dedup_sum, None),
}


def variant() -> str:
    """The variant `EMBEDMESH_GPU_KERNELS` selects ("xla", "pallas", "reference")."""
    return _runtime.gpu_kernels_variant()


def ready() -> bool:
    """Whether the GPU kernels are used at all (not `EMBEDMESH_GPU_KERNELS=reference`)."""
    return variant() != "reference"


def _first_that_takes(first, fallback):
    """A kernel that runs `first` where its `supports` takes the call, else `fallback`."""
    fn, supports = first

    def kernel(*args, **params):
        if supports is None or supports(*args, **params):
            return fn(*args, **params)
        return fallback(*args, **params)

    kernel.__name__ = getattr(fn, "__name__", "kernel")
    kernel.__doc__ = fn.__doc__
    return kernel


def kernels(variant: str) -> KernelTable:
    """op -> (kernel, supports) of `variant` ("xla", "pallas" or "reference": none)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown GPU kernel variant {variant!r}; expected one of {VARIANTS}")
    if variant == "reference":
        return {}
    if variant == "xla":
        return dict(XLA_KERNELS)
    pallas = importlib.import_module("embedmesh.device.ops.gpu.pallas")  # imports Pallas
    table = dict(XLA_KERNELS)
    for op, (fn, supports) in pallas.KERNELS.items():
        if op in XLA_KERNELS:  # the XLA variant takes what Pallas does not
            table[op] = (_first_that_takes((fn, supports), XLA_KERNELS[op][0]), None)
        else:  # the registry falls back to the reference
            table[op] = (fn, supports)
    return table


def _selected(op: str, cuda: bool):
    """(kernel, supports) of `op` in the variant the environment selects (outside CUDA,
    `pallas` reads as `xla`), looked up at each call."""

    def table() -> KernelTable:
        v = variant()
        return kernels("xla" if v == "pallas" and not cuda else v)

    def kernel(*args, **params):
        return table()[op][0](*args, **params)

    def supports(*args, **params) -> bool:
        entry = table().get(op)
        return entry is not None and (entry[1] is None or entry[1](*args, **params))

    kernel.__name__ = f"gpu_{op}"
    return kernel, supports


_PALLAS_OPS = (
    "segment_gather_sum",
    "segment_gather_sum_mapped",
    "sparse_update",
    "backward_update",
)

KERNELS: KernelTable = {op: _selected(op, cuda=False) for op in XLA_KERNELS}
CUDA_KERNELS: KernelTable = {
    op: _selected(op, cuda=True) for op in dict.fromkeys((*XLA_KERNELS, *_PALLAS_OPS))
}
