"""The host half of tables of raw 64-bit ids (`TableConfig.id_map`, a `DynamicIds`).

Such a table is alone in its stack. Its ids are not rows: the host routes each raw id
to the shard that owns it (`owner_of`: the same keyed hash as
`embedmesh.device.id_map.owner_of`, in numpy) and hands the device the raw ids
themselves, as uint32 pairs (`PartitionedCsrFormatTensor.unique_raw_ids`); the owner's
id map gives them rows inside the device program (`EmbeddingCore.map_ids`).

The rest of preprocessing (bags, combiners, gains, sequence features, capacities and
their overflow policies) is the static tables' numpy path, run on codes: each local
device's distinct raw ids get codes in order of first sighting on the device (its
entries in order: the table's features in order, each over the device's rows; device
d's codes after device d - 1's), routed to their owners by a stand-in row layout, so a
partition lists its device's ids in order of first sighting, and `unique_ids` holds
the codes (`PAD_ID` padding), `unique_raw_ids` the ids they stand for. (First
sighting, not ascending raw ids: the map gives rows in any order, and no sort is
needed; the order is the device's alone, whatever else the process drives.)

With numba (`embedmesh.host.numba_dynamic`, when the static tables take compiled
kernels too) two kernels a stack give the same arrays: `raw_codes` (each entry's key
`owner * K + code`, K codes, and the distinct ids by code) and `device_fill` (the static
tables' sort and fill on those keys, as rows of the mod layout over N shards, K rows a
shard, and the partitions' raw words); the numpy path stays the fallback (numba
unavailable or disabled, `backend="numpy"`) and the tests' oracle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embedmesh._runtime import fmix32, fmix32_int

__all__ = [
    "first_sighting_codes",
    "owner_of",
    "owner_words",
    "prepare_stack",
    "raw_ids",
    "raw_pairs",
    "split_ids",
]

# the keyed hash of `embedmesh.device.id_map` (its salts and finaliser;
# tests/engine/test_dynamic_ids.py checks the two agree)
_SALT_OWNER = 0x6A09E667
_M32 = 0xFFFFFFFF


def split_ids(ids) -> np.ndarray:
    """int64 (or uint64) ids -> uint32 `[..., 2]` (high word, low word)."""
    a = np.asarray(ids)
    u = a.astype(np.int64).view(np.uint64) if a.dtype.kind == "i" else a.astype(np.uint64)
    return np.stack([(u >> np.uint64(32)).astype(np.uint32), u.astype(np.uint32)], axis=-1)


def owner_words(seed: int) -> tuple[int, int, int]:
    """The owner hash's three seed words (`id_hash.hash_words(seed, salt)`)."""
    s0 = fmix32_int((int(seed) ^ _SALT_OWNER) & _M32)
    s1 = fmix32_int((s0 + 0x9E3779B9) & _M32)
    s2 = fmix32_int((s1 + 0x9E3779B9) & _M32)
    return s0, s1, s2


def owner_of(ids, num_shards: int, seed: int = 0) -> np.ndarray:
    """The shard (int64 in `[0, num_shards)`) owning each int64 id: a keyed hash of both
    halves modulo the shard count, as `embedmesh.device.id_map.owner_of`."""
    p = split_ids(ids)
    hi, lo = p[..., 0], p[..., 1]
    s0, s1, s2 = owner_words(seed)
    with np.errstate(over="ignore"):
        a = fmix32(lo ^ np.uint32(s0))
        b = fmix32(hi ^ np.uint32(s1))
        h = fmix32((a + b * np.uint32(0x9E3779B1)) ^ np.uint32(s2))
    return (h % np.uint32(num_shards)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class _CodeTable:
    """Stands in for the table in `numpy_backend.sort_table`: codes `[0, K)` as rows."""

    vocabulary_size: int
    rows_per_shard: int
    local_row_offset: int = 0


@dataclasses.dataclass(frozen=True)
class _OwnerLayout:
    """Stands in for the row layout: code k lives on shard `owner[k]`, block row k."""

    owner: np.ndarray

    def shard_of(self, table, codes):
        return self.owner[codes]

    def block_row(self, table, codes):
        return codes


def raw_ids(ids: np.ndarray) -> np.ndarray:
    """Input ids as int64 raw ids (uint64 read bit for bit)."""
    if ids.dtype == np.uint64:
        return ids.view(np.int64)
    return ids.astype(np.int64, copy=False)


def first_sighting_codes(ids: list, devices: int, rows_per_device: list, splits: list) -> tuple:
    """`(codes, distinct ids)`: each id's code per entry (int64 arrays shaped as `ids`, one
    a feature) and the distinct ids by code. Codes go device by device (device d's after
    device d - 1's), each device's entries in order (the features in order, each over
    the device's rows: `rows_per_device[f]` rows from `d * rows_per_device[f]`, entries
    `splits[f]`): a code to each id at its first sighting on the device."""
    codes = [np.empty(r.shape[0], np.int64) for r in ids]
    uniqs, k = [], 0
    for d in range(devices):
        spans = [
            (f, int(s[d * rpd]), int(s[(d + 1) * rpd]))
            for f, (s, rpd) in enumerate(zip(splits, rows_per_device))
        ]
        mine = np.concatenate([ids[f][lo:hi] for f, lo, hi in spans] or [np.zeros(0, np.int64)])
        distinct, first, inverse = np.unique(mine, return_index=True, return_inverse=True)
        order = np.argsort(first)  # by first sighting
        code_of = np.empty(order.shape[0], np.int64)
        code_of[order] = k + np.arange(order.shape[0])
        at = 0
        for f, lo, hi in spans:
            codes[f][lo:hi] = code_of[inverse[at : at + hi - lo]]
            at += hi - lo
        uniqs.append(distinct[order])
        k += order.shape[0]
    return codes, np.concatenate(uniqs or [np.zeros(0, np.int64)])


def prepare_stack(
    members: list, devices: int, num_shards: int, seed: int, owners: tuple | None = None
) -> tuple:
    """`(members on codes, stand-in table, stand-in layout, distinct ids by code)` for one
    dynamic table's features (`(name, Csr, FeatureSegment)`) on `devices` local devices,
    for `sort_table`: codes by first sighting on each device (`first_sighting_codes`).
    `owners`: `(first, k)`, the shards owning the table's ids (`first + owner_of(id, k)`;
    `(owner, 1)` for a table-wise one); None: every shard."""
    codes, uniq = first_sighting_codes(
        [raw_ids(c.ids) for _, c, _ in members],
        devices,
        [seg.num_rows for _, _, seg in members],
        [c.splits for _, c, _ in members],
    )
    coded = [
        (name, dataclasses.replace(c, ids=code), seg)
        for (name, c, seg), code in zip(members, codes)
    ]
    k = max(int(uniq.shape[0]), 1)
    first, k_own = (0, num_shards) if owners is None else owners
    layout = _OwnerLayout(
        first + owner_of(uniq, k_own, seed) if uniq.size else np.zeros(0, np.int64)
    )
    return coded, _CodeTable(k, k), layout, uniq


def raw_pairs(unique_ids: np.ndarray, uniq: np.ndarray, pad_id: int) -> np.ndarray:
    """uint32 `[..., 2]` raw ids of the codes in `unique_ids` (zeros at padding)."""
    valid = unique_ids != pad_id
    out = np.zeros(unique_ids.shape + (2,), np.uint32)
    if uniq.size:
        out[valid] = split_ids(uniq[unique_ids[valid]])
    return out
