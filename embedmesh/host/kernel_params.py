"""What the compiled preprocessing kernels (numba's `embedmesh.host.numba_backend` and
the C++ `embedmesh.host.native_backend`) share: a table's parameter array and the
counters' layout. Imports neither numba nor the C++ library.

A table's scalar parameters travel in one int64 array (`table_params`, indexed by the
`P_*` constants; `embedmesh/host/cpu/preprocess.cc` reads the same indices); the
row-layout rule's part of them comes from `RowLayout.kernel_params` (the mod layout:
`(span k, rotation, first shard, vocabulary size)`): the kernels apply the mod rule
over the table's span they are given (`KERNEL_LAYOUTS`; row `i` on shard
`first + (i % k + rotation) % k`, block row `i // k`), and a plan with another layout
takes the numpy backend.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "COUNTERS",
    "C_PAIR_KEPT",
    "C_PAIR_TOTAL",
    "C_UNIQUE_KEPT",
    "C_UNIQUE_TOTAL",
    "KERNEL_LAYOUTS",
    "table_params",
]

# The row layouts whose kernel_params the kernels understand.
KERNEL_LAYOUTS = ("mod",)

# Entries of a table's parameter array (int64).
P_SPAN = 0  # k, the shards of the table's span (RowLayout.kernel_params)
P_ROTATION = 1  # the table's rotation (RowLayout.kernel_params)
P_SHARD_SHIFT = 2  # log2(k) when k is a power of two, else -1 (shifts instead of division)
P_ROWS_PER_SHARD = 3  # rows of the table's block on each shard
P_LOCAL_ROW_OFFSET = 4  # where the block starts in the stack's shard
P_VOCAB = 5  # ids must lie in [0, vocabulary size)
P_KEY_BITS = 6  # bits of the largest sort key (shard * rows_per_shard + block row)
P_LOW_BITS = 7  # bits below the key in a sort value: output row or entry index
P_ROW_BASE = 8  # first buffer row of the table's features
P_ROW_SPAN = 9  # buffer rows from ROW_BASE to the end of the last feature
P_CAP_UNIQUE = 10  # U: unique ids a partition holds
P_CAP_PAIRS = 11  # P: pairs a partition holds
P_FIRST_SHARD = 12  # the span's first shard (RowLayout.kernel_params)
_NUM_PARAMS = 13

# Rows of the counters array [4, D, N] int64 the kernels share across a stack's tables.
COUNTERS = 4
C_UNIQUE_TOTAL = 0  # unique ids seen (before dropping)
C_PAIR_TOTAL = 1  # pairs seen
C_UNIQUE_KEPT = 2  # unique ids written
C_PAIR_KEPT = 3  # pairs written


def table_params(
    span: int,
    rotation: int,
    first_shard: int,
    rows_per_shard: int,
    local_row_offset: int,
    vocabulary_size: int,
    key_bits: int,
    low_bits: int,
    row_base: int,
    row_span: int,
    cap_unique: int,
    cap_pairs: int,
) -> np.ndarray:
    """A table's parameter array (see the `P_*` constants)."""
    n = int(span)
    shift = n.bit_length() - 1 if n & (n - 1) == 0 else -1
    p = np.empty(_NUM_PARAMS, np.int64)
    p[P_SPAN], p[P_ROTATION], p[P_SHARD_SHIFT] = n, rotation, shift
    p[P_FIRST_SHARD] = first_shard
    p[P_ROWS_PER_SHARD], p[P_LOCAL_ROW_OFFSET], p[P_VOCAB] = (
        rows_per_shard,
        local_row_offset,
        vocabulary_size,
    )
    p[P_KEY_BITS], p[P_LOW_BITS], p[P_ROW_BASE], p[P_ROW_SPAN] = (
        key_bits,
        low_bits,
        row_base,
        row_span,
    )
    p[P_CAP_UNIQUE], p[P_CAP_PAIRS] = cap_unique, cap_pairs
    return p
