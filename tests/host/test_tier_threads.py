"""A host tier's swaps with their rows copied by several threads: every row's updates
land in the host rows as a plain numpy float64 model of the tables says."""

import numpy as np

from embedmesh.host import tier as mod_tier

PAD = np.iinfo(np.int32).max


def test_threaded_swaps_keep_every_rows_updates(monkeypatch):
    """Batches over two shards through a small cache (victims every step), the rows moved
    and the directory read and written in blocks on 3 threads, the device's cache played
    by numpy (each batch's rows updated by a step-dependent amount while cached): the
    host rows, with the cached rows over them, equal a float64 table updated the same
    way; each batch's ids map to cache rows holding its rows."""
    monkeypatch.setattr(mod_tier, "_MIN_BLOCK", 1)
    monkeypatch.setattr(mod_tier, "copy_threads", lambda: 3)
    shards, rows, cache, width = 2, 400, 90, 3
    rng = np.random.default_rng(7)
    start = rng.integers(-50, 50, size=(shards, rows, width)).astype(np.float64)
    tier = mod_tier.StackTier("s", ("t",), shards, rows, cache, (((width,), np.float32, 0.0),))
    tier.arrays[0][...] = start
    ref = start.copy()
    device = np.zeros((shards, cache + 1, width), np.float32)  # row `cache`: padding
    for step in range(12):
        ids = np.full((1, shards, 60), PAD, np.int32)
        for j in range(shards):
            need = np.unique(np.minimum(rng.zipf(1.2, 70) - 1, rows - 1))[:55]
            ids[0, j, : need.size] = need
        swap = tier.commit(ids, tier.check(ids, pin=False), pin=False)
        tier.write_back()
        rows_in = tier.gather(swap, 0)
        assert np.all(rows_in[:, max(r.size for r in swap.rows) :] == 0)
        old = device[np.arange(shards)[:, None], swap.slots].copy()
        for j in range(shards):
            device[j, swap.slots[j]] = rows_in[j]
            device[j, cache] = 0
            valid = ids[0, j] != PAD
            mapped = swap.ids[0, j, valid]
            np.testing.assert_array_equal(tier.row_of[j, mapped], ids[0, j, valid])
            delta = (step + 1) * (1 + np.arange(width))
            device[j, mapped] += delta.astype(np.float32)
            ref[j, ids[0, j, valid]] += delta
        tier.pending(swap, (old,))
    tier.write_back()
    host = tier.arrays[0].astype(np.float64)
    for j in range(shards):
        slots, held = tier.cached(j)
        host[j, held] = device[j, slots]
    assert np.any(ref != start)
    np.testing.assert_array_equal(host, ref)
