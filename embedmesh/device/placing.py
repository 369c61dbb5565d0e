"""Placing this process's preprocessed batch on the mesh's devices (`EmbeddingCore.put`):
each leaf of `{stack: PartitionedCsrFormatTensor}` (or any pytree of host arrays) a global
array row-sharded over the mesh, by jaxlib's batched put where it takes it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from embedmesh import _compat
from embedmesh.batch import PartitionedCsrFormatTensor

__all__ = ["BatchPlacer"]


def _fits(shape: tuple, dtype) -> bool:
    """Whether `BatchPlacer.put`'s batched put takes a leaf of `shape` and `dtype`: jax
    keeps its dtype as it is (int64 without x64: no), and it is not empty (jaxlib's put
    of empty shards on several devices raises `bad_function_call`)."""
    return 0 not in shape and jax.dtypes.canonicalize_dtype(dtype) == dtype


class BatchPlacer:
    """Puts batches on `row_sharding` (a core's: every mesh axis), each leaf's placement
    plan kept by shape and dtype."""

    def __init__(self, row_sharding):
        self.row_sharding = row_sharding
        self._plans: dict = {}

    def put(self, csr: dict, *, copy: bool = True) -> dict:
        """Place this process's preprocessed arrays on its devices as global arrays.

        One process: a leaf by jaxlib's batched put of its per-device slices, the
        arrays `jax.device_put` gives (dtype, sharding, committed) for ~3x less time
        (56 leaves of the train benchmark: 56 calls of 40-140 us of Python each), and
        copies (`force_copy`): `jax.device_put` zero-copies 64-byte-aligned numpy
        buffers on CPU and reads the others after it returns, so a host buffer written
        after this call could change the step's input. `jax.device_put` where the hook
        is gone, jax converts the dtype (int64 without x64) or the leaf is empty;
        `make_array_from_process_local_data` across processes.

        `copy=False`: the caller's arrays are its own and never written again (the
        facade's enqueue, on what preprocessing just made): a 64-byte-aligned one is
        aliased, not copied (the train benchmark's static stack: 0.12-0.18 ms a batch
        against 0.43-0.51); jax keeps it alive.

        A stack's `unique_counts` and `pair_counts` stay on the host (None in the placed
        batch): no device program reads them (padding ends a partition), and a leaf costs
        its put and an argument of every program (16 of the 56 leaves of 8 stacks of raw
        ids in benchmarks/train/dynamic_ids.py)."""
        batched, aval = _compat.batched_device_put(), _compat.shaped_array()
        one_process = jax.process_count() == 1
        x64 = bool(jax.config.jax_enable_x64)  # which dtypes jax keeps
        out = {}
        for name, c in csr.items():
            if isinstance(c, PartitionedCsrFormatTensor):
                c = dataclasses.replace(c, unique_counts=None, pair_counts=None)
            leaves, treedef = jax.tree_util.tree_flatten(c)
            placed = []
            for leaf in leaves:
                leaf = np.asarray(leaf)
                how = None
                if one_process and batched is not None and aval is not None:
                    how = self._put_plan(leaf.shape, leaf.dtype, x64, aval)
                if how is not None:
                    a, devices, slices = how
                    shards = [leaf[i] for i in slices]
                    placed.append(batched(a, self.row_sharding, shards, devices, True, copy))
                elif one_process:
                    placed.append(jax.device_put(leaf, self.row_sharding))
                else:
                    global_shape = (leaf.shape[0] * jax.process_count(),) + leaf.shape[1:]
                    placed.append(
                        jax.make_array_from_process_local_data(
                            self.row_sharding, leaf, global_shape
                        )
                    )
            out[name] = jax.tree_util.tree_unflatten(treedef, placed)
        return out

    def _put_plan(self, shape: tuple, dtype, x64: bool, aval) -> tuple | None:
        """`(aval, devices, index a device)` of a leaf of `shape` and `dtype` under
        `row_sharding` (jax's map, which raises on a batch the devices do not divide),
        or None where the batched put does not take it (`_fits`); kept a shape, dtype
        and `x64` (`jax_enable_x64`, which decides the dtypes jax keeps): a batch's leaves
        repeat them, and the aval and the map cost ~2 us a leaf each (the transfer of
        the 56 leaves of 8 stacks of raw ids: 0.84x, benchmarks/train/dynamic_ids.py)."""
        cache = self._plans
        key = (shape, dtype, x64, aval)
        if key in cache:
            return cache[key]
        if len(cache) > 256:  # shapes that keep changing (capacities from each batch)
            cache.clear()
        got = None
        if _fits(shape, dtype):
            index = self.row_sharding.addressable_devices_indices_map(shape)
            got = (aval(shape, dtype), list(index), list(index.values()))
        cache[key] = got
        return got
