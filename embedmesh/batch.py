"""The preprocessed batch, what the host hands the device: `PartitionedCsrFormatTensor`
(one stack's partitioned CSR arrays for this process's devices), where each
feature sits in it (`FeatureSegment`), the static sizes it is padded to
(`Capacity`, `capacity_bucket`) and what preprocessing saw (`StackStats`,
`PreprocessStats`). Produced by `embedmesh.host.preprocess`, consumed by
`embedmesh.device`; a declared form (numpy and jax only), so the device side
needs nothing of the host's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from embedmesh._runtime import PAD_ID

__all__ = [
    "Capacity",
    "FeatureSegment",
    "PAD_ID",
    "PartitionedCsrFormatTensor",
    "PreprocessStats",
    "StackStats",
    "capacity_bucket",
]


# ---------------------------------------------------------------------------
# Capacities


def _check_count(cls: str, field: str, value) -> int:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{cls}.{field} must be an int >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static sizes of one stack's partitions (one per source device and shard)."""

    max_ids_per_partition: int  # P: (row, id) pairs, after duplicates merge
    max_unique_ids_per_partition: int  # U: distinct ids

    def __post_init__(self):
        object.__setattr__(
            self,
            "max_ids_per_partition",
            _check_count("Capacity", "max_ids_per_partition", self.max_ids_per_partition),
        )
        object.__setattr__(
            self,
            "max_unique_ids_per_partition",
            _check_count(
                "Capacity", "max_unique_ids_per_partition", self.max_unique_ids_per_partition
            ),
        )


def capacity_bucket(n: int, minimum: int = 8) -> int:
    """Smallest bucket >= n among 8, 12, 16, 24, 32, 48, 64, ... (2^k and 1.5 * 2^k).

    Buckets keep recompilations logarithmic when capacities grow, at most
    1.5x the need.
    """
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # next power of two >= n
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


# ---------------------------------------------------------------------------
# Output containers


@dataclasses.dataclass(frozen=True)
class FeatureSegment:
    """Where one feature's activations sit in a stack's per-device buffer.

    Rows `[row_offset, row_offset + num_rows)` of the buffer, `samples` local
    samples of `sample_shape` rows each (`FeatureLayout`: `()` for a
    combined feature, `(L,)` for a sequence, `(n,)` for dense `[B, n]` ids),
    row `s * rows_per_sample + p` for local sample `s` and sub-row `p`; the
    first `dim` columns. `output_shape` is the global activation's shape
    without `dim` where `FeatureConfig.output_shape` reshapes it.
    """

    name: str
    row_offset: int
    samples: int
    sample_shape: tuple
    dim: int
    output_shape: tuple | None = None

    @property
    def rows_per_sample(self) -> int:
        return math.prod(self.sample_shape)

    @property
    def num_rows(self) -> int:
        return self.samples * self.rows_per_sample

    def local_shape(self) -> tuple:
        """One device's activation block: `[samples, *sample_shape, dim]`."""
        return (self.samples,) + tuple(self.sample_shape) + (self.dim,)

    def activation_shape(self, num_devices: int) -> tuple:
        """The global activation's shape over `num_devices` devices."""
        if self.output_shape is not None:
            return tuple(self.output_shape) + (self.dim,)
        return (self.samples * num_devices,) + tuple(self.sample_shape) + (self.dim,)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PartitionedCsrFormatTensor:
    """Preprocessed input of ONE stack for the `D` local devices of a process.

    `N` is the number of shards, `U`/`P` the stack's capacities
    (`max_unique_ids_per_partition` / `max_ids_per_partition`), `R` the rows
    of the per-device activation buffer. Partition `(d, j)` holds what source
    device `d` needs from shard `j`. Arrays are numpy on the host (the leaves
    of the pytree); the rest is static aux data.

    Fields:
      unique_ids   [D, N, U] int32: local rows of shard j that device d needs,
                   ascending, distinct; padding `PAD_ID` (int32 max: out of
                   range on every shard, so `take(mode="fill")` reads zeros
                   and `.at[].add(mode="drop")` ignores it).
      unique_counts [D, N] int32: valid entries of `unique_ids[d, j]` (host side
                   only, as `pair_counts`: `EmbeddingCore.put` leaves both on the host,
                   None in the placed batch; padding ends a partition on the device).
      pair_rows    [D, N, P] int32: output row (in device d's buffer, < R)
                   of each (row, id) pair; padding `R` (dropped by
                   `segment_sum(num_segments=R)`).
      pair_unique  [D, N, P] int32: index of the pair's id in
                   `unique_ids[d, j]`; padding 0.
      pair_gains   [D, N, P] float32: the pair's gain (combiner scale times
                   weight, duplicates summed); padding 0.
      pair_counts  [D, N] int32: valid entries of the pair arrays.
      stack: the stack's name.  rows_per_device: R.
      features: `FeatureSegment`s of the stack's features, in buffer order.
      batch_number [D] int32 or None: in a multi-process job, the facade's count of
                   this process's enqueue attempts (failed ones included), which
                   `MeshEmbedding.apply_gradients` checks to be the same on every
                   process (`EmbeddingCore.step_check`): a process that skipped or
                   repeated a batch would otherwise pair its step with another
                   batch of the others. None: not checked.
      unique_raw_ids [D, N, U, 2] uint32 or None: for a stack of raw 64-bit ids
                   (`TableConfig.id_map`), the raw id (high word, low word) of each
                   entry of `unique_ids` (a partition lists device d's ids in order
                   of first sighting on d), which then holds codes (`PAD_ID`
                   where padding) until the owners' id maps give them rows
                   (`EmbeddingCore.map_ids`, which returns the batch with rows in
                   `unique_ids`, in the host's order on CPU (each source device's ids
                   in order of first sighting), and this field None). None for
                   every other stack.
      pairs_by_row (slots, gains, rows), each [D, N, P] (int32, float32, int32), or
                   None: for a mesh whose lookups read it (a TPU's kernels), each
                   device's pairs again, in output-row order over its flattened [N * P]
                   pairs, the padding last: `slots` the pair's position in the device's
                   N stacked distinct-id lists (`embedmesh.host.pair_order.pairs_by_row`);
                   the lookup then neither sorts nor gathers them on the device. Any
                   change to the pair arrays drops it (None). None: the lookup orders
                   the pairs itself where it needs them ordered.
      evaluation   bool (static): the batch of an evaluation lookup
                   (`training=False`): its rows were read without changing any
                   state, so it is refused as the batch of an update.

    On device d: `buffer = segment_sum(gains[..., None] *
    rows_j[pair_unique], pair_rows, R)` over all (j, p), with `rows_j` the
    rows gathered for `unique_ids[d, j]` from shard j; gradients run the
    other way.
    """

    unique_ids: Any
    unique_counts: Any
    pair_rows: Any
    pair_unique: Any
    pair_gains: Any
    pair_counts: Any
    stack: str
    rows_per_device: int
    features: tuple
    batch_number: Any = None
    unique_raw_ids: Any = None
    pairs_by_row: Any = None
    evaluation: bool = False

    _ARRAYS = (
        "unique_ids",
        "unique_counts",
        "pair_rows",
        "pair_unique",
        "pair_gains",
        "pair_counts",
    )

    def tree_flatten(self):
        return (
            tuple(getattr(self, a) for a in self._ARRAYS)
            + (self.batch_number, self.unique_raw_ids, self.pairs_by_row),
            (self.stack, self.rows_per_device, self.features, self.evaluation),
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        *arrays, batch_number, unique_raw_ids, pairs_by_row = children
        *aux, evaluation = aux
        return cls(
            *arrays,
            *aux,
            batch_number=batch_number,
            unique_raw_ids=unique_raw_ids,
            pairs_by_row=pairs_by_row,
            evaluation=evaluation,
        )

    @property
    def num_devices(self) -> int:
        return int(np.shape(self.unique_ids)[0])

    @property
    def num_shards(self) -> int:
        return int(np.shape(self.unique_ids)[1])

    @property
    def capacity(self) -> Capacity:
        return Capacity(int(np.shape(self.pair_rows)[2]), int(np.shape(self.unique_ids)[2]))

    def feature_segment(self, name: str) -> FeatureSegment:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"feature {name!r} is not in stack {self.stack}")


@dataclasses.dataclass(frozen=True)
class StackStats:
    """What one stack's preprocessing saw (counts before any dropping)."""

    ids_per_partition: np.ndarray  # [D, N] int64: (row, id) pairs after merging
    unique_ids_per_partition: np.ndarray  # [D, N] int64
    num_ids: int  # input entries (row, id) of this stack, before merging
    dropped_ids: int  # input entries lost to overflow="drop"
    capacity: Capacity  # capacity of the returned arrays
    grown: bool  # overflow="grow" raised the capacity for this batch
    # a stack of raw ids (`TableConfig.id_map`): its id maps' counts at the latest lookup
    # (`EmbeddingCore.map_ids`: hits, admissions, evictions, pending, refused, occupancy;
    # over distinct ids, summed over the owners); None for other stacks
    id_map: Mapping[str, int] | None = None

    @property
    def max_ids_per_partition(self) -> int:
        return int(self.ids_per_partition.max(initial=0))

    @property
    def max_unique_ids_per_partition(self) -> int:
        return int(self.unique_ids_per_partition.max(initial=0))

    @property
    def required_capacity(self) -> Capacity:
        """The smallest bucketed capacity that holds this batch."""
        return Capacity(
            capacity_bucket(self.max_ids_per_partition),
            capacity_bucket(self.max_unique_ids_per_partition),
        )


@dataclasses.dataclass(frozen=True)
class PreprocessStats:
    """Per-stack `StackStats` of one `preprocess_features` call."""

    stacks: Mapping[str, StackStats]

    def __getitem__(self, stack: str) -> StackStats:
        return self.stacks[stack]

    @property
    def dropped_ids(self) -> dict:
        return {k: v.dropped_ids for k, v in self.stacks.items()}

    @property
    def capacities(self) -> dict:
        """Capacities of the returned arrays (after any growth)."""
        return {k: v.capacity for k, v in self.stacks.items()}

    @property
    def grown(self) -> dict:
        """Stacks whose capacity overflow="grow" raised: `{stack: new Capacity}`."""
        return {k: v.capacity for k, v in self.stacks.items() if v.grown}
