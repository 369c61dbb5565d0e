"""The facade's map program (`MeshEmbedding.dequeue` on a batch of raw ids, issue 42):
it returns the state, the mapped stacks' rows and (where it moves them) pairs and the
counts, never the batch itself, whose unchanged arrays a program returning them would
copy out every step; the batch `dequeue` hands back is the one it took with those rows
in place of the raw ids and its pairs in the rows' order (the host's order for a table
of rows; on CPU, the map's order and the pairs as they were), its other arrays the very
same objects."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from meshes import mesh_of

import embedmesh as em
from embedmesh.device import id_map as im
from embedmesh.device.core import ID_STATS

_PAIRS = ("pair_rows", "pair_unique", "pair_gains")


def _init(key, shape, dtype):  # never zero
    return jax.random.uniform(key, shape, dtype, 0.5, 1.5)


def test_the_map_program_returns_rows_not_the_batch():
    dyn = em.TableConfig(8, 4, initializer=_init, name="dyn", id_map=em.DynamicIds())
    static = em.TableConfig(16, 4, initializer=_init, combiner="sum", name="static")
    features = {"raw": em.FeatureConfig(dyn, name="raw"), "plain": em.FeatureConfig(static)}
    emb = em.MeshEmbedding(features, em.Adagrad(0.1), mesh=mesh_of(1), seed=3)
    raw = em.RaggedTensor(np.array([-(2**63), 5, 2**62, 5], np.int64), np.array([0, 2, 4]))
    plain = em.RaggedTensor(np.array([1, 2, 3], np.int64), np.array([0, 1, 3]))
    csr = emb.enqueue({"raw": raw, "plain": plain})
    (dyn_stack,) = [s for s, c in csr.items() if c.unique_raw_ids is not None]

    # what the program returns: the state, {stack of raw ids: rows and pairs}, the counts;
    # with the CPU kernels the pairs stay as they were: None (an output would be a copy)
    as_is = im.blocks_as_mapped()
    state_shape, rows, counts = jax.eval_shape(emb._map_fn, emb.state, csr)
    assert set(rows) == {dyn_stack}
    assert counts.shape == (1, len(ID_STATS))  # the stacks' counts in one array
    c = csr[dyn_stack]
    want = (c.unique_ids, c.pair_rows, c.pair_unique, c.pair_gains)
    got = rows[dyn_stack]
    assert got[0].shape == c.unique_ids.shape
    if as_is:
        assert got[1:] == (None, None, None)
    else:
        assert [r.shape for r in got[1:]] == [w.shape for w in want[1:]]
    assert len(jax.tree_util.tree_leaves(state_shape)) == len(jax.tree_util.tree_leaves(emb.state))

    _, out = emb.dequeue(csr)
    for s, c in csr.items():
        for f in dataclasses.fields(c):
            moved = ("unique_ids", "unique_raw_ids") + ((), _PAIRS)[not as_is]
            if s == dyn_stack and f.name in moved:
                continue
            assert getattr(out[s], f.name) is getattr(c, f.name), (s, f.name)
    d = out[dyn_stack]
    assert d.unique_raw_ids is None
    ids = np.asarray(d.unique_ids)[0, 0, : _kept(csr[dyn_stack].unique_ids)]
    assert sorted(ids.tolist()) == [0, 1, 2]  # three distinct raw ids, three fresh rows


@pytest.mark.skipif(
    not im.blocks_as_mapped(), reason="the CPU kernels' order (without them the blocks are sorted)"
)
def test_the_mapped_batch_keeps_the_maps_order_on_cpu():
    """After evictions the rows of a batch's distinct raw ids (in the host's order) are in no
    order; on CPU the batch dequeue returns keeps them so (the fused update takes a
    block's distinct rows in any order: a reorder cost ~1.3 ms a step of 8 tables), its
    valid pairs still grouped by slot in slot order, each pair naming its id's row,
    sample and gain. Training on such batches is the reference's (test_dynamic_ids)."""
    dyn = em.TableConfig(
        6, 4, initializer=_init, name="dyn", id_map=em.DynamicIds("lru", admit_after=1)
    )
    emb = em.MeshEmbedding(
        {"raw": em.FeatureConfig(dyn, name="raw")}, em.Adagrad(0.1), mesh=mesh_of(1), seed=3
    )
    rng = np.random.default_rng(7)
    pool = rng.integers(-(2**63), 2**63 - 1, size=14, dtype=np.int64)
    unordered = 0
    for _ in range(3):
        ids = rng.choice(pool, size=10)
        csr = emb.enqueue({"raw": em.RaggedTensor(ids, np.array([0, 3, 3, 7, 10]))})
        (s,) = csr
        c = csr[s]
        raw = np.asarray(c.unique_raw_ids)[0, 0]
        acts, out = emb.dequeue(csr)
        emb.apply_gradients(jax.tree_util.tree_map(lambda a: a * 0 + 0.25, acts), out)
        o = out[s]
        # each slot's row as the map gave it (the map read back; PAD where none)
        m = jax.tree_util.tree_map(lambda x: x[0], emb.state.id_maps[s]["map"])
        before = np.asarray(_map_lookup(m, raw))
        before = np.where(before < 0, np.iinfo(np.int32).max, before)
        rows = np.asarray(o.unique_ids)[0, 0]
        np.testing.assert_array_equal(rows, before)  # the map's order, PAD where none
        k = _kept(c.unique_ids)
        unordered += bool((np.diff(before[:k]) < 0).any())
        r = o.rows_per_device
        n = int((np.asarray(c.pair_rows)[0, 0] < r).sum())  # (the counts stay on the host)
        pu, pr, pg = (np.asarray(x)[0, 0] for x in (o.pair_unique, o.pair_rows, o.pair_gains))
        assert (np.diff(pu[:n]) >= 0).all() and ((pr[n:] < 0) | (pr[n:] >= r)).all()
        # each pair: the same (sample, row, gain) as the enqueued pair of the same id
        old_pu, old_pr, old_pg = (np.asarray(x)[0, 0] for x in _pair_arrays(c))
        want = sorted((int(old_pr[q]), int(before[old_pu[q]]), float(old_pg[q])) for q in range(n))
        assert sorted((int(pr[q]), int(rows[pu[q]]), float(pg[q])) for q in range(n)) == want
    assert unordered  # the stream did give rows out of raw-id order


# the map read back in one program (op by op, each of its operations compiled on its own)
_map_lookup = jax.jit(im.lookup)


def _kept(unique_ids) -> int:
    """A placed batch's unique ids before its padding in block (0, 0) (its counts stay on
    the host)."""
    return int((np.asarray(unique_ids)[0, 0] != np.iinfo(np.int32).max).sum())


def _pair_arrays(c):
    return c.pair_unique, c.pair_rows, c.pair_gains


_STEP_PROGRAMS = (
    "_apply_map_lookup_fn",
    "_map_lookup_fn",
    "_map_ahead_fn",
    "_fused_refresh_fn",
    "_apply_fn",
    "_lookup_fn",
)


@pytest.mark.parametrize(("devices", "pipelined"), [(1, False), (2, False), (2, True)])
def test_the_step_programs_copy_no_table(devices, pipelined):
    """No program of a training step copies a table or a slot array: each stack's update
    reads the table the previous stack's update wrote (an order of their exchanges),
    and a map or a re-initialisation that writes those tables in place in the same
    program must come after those reads in data, or XLA copies every table but the last
    each step (14 copies of 32 MB a step of 8 tables on benchmarks/train/dynamic_ids.py,
    100 ms). (On one device nothing is ordered: no such read.) Read off the compiled
    programs (their `copy` instructions' shapes)."""
    import re

    tables = [
        em.TableConfig(
            v, 8, initializer=_init, name=f"dyn{v}", id_map=em.DynamicIds("lru", admit_after=1)
        )
        for v in (56, 72, 88)
    ]
    features = {t.name: em.FeatureConfig(t) for t in tables}
    features["plain"] = em.FeatureConfig(em.TableConfig(104, 8, initializer=_init, name="st"))
    emb = em.MeshEmbedding(
        features,
        em.Adagrad(0.1),
        mesh=mesh_of(devices),
        seed=3,
        pipeline_execution_with_tensor_core=pipelined,
    )
    emb.build()
    big = {  # each device's shard's shape, as the programs (inside shard_map) see it
        tuple(s.data.shape)
        for x in jax.tree_util.tree_leaves((emb.state.tables, emb.state.slots))
        for s in x.addressable_shards[:1]
    }
    assert len(big) >= 4
    compiled: dict = {}
    seen = set()
    for name in _STEP_PROGRAMS:
        fn = getattr(emb, name)

        def spy(*args, fn=fn, name=name):  # compiled before the call donates the state
            leaves, treedef = jax.tree_util.tree_flatten(args)
            signature = (name, treedef) + tuple(
                (getattr(x, "shape", x), str(getattr(x, "dtype", "")), getattr(x, "sharding", None))
                for x in leaves
            )
            if signature not in seen:  # each distinct program read once
                seen.add(signature)
                compiled.setdefault(name, []).append(fn.lower(*args).compile().as_text())
            return fn(*args)

        setattr(emb, name, spy)
    rng = np.random.default_rng(5)
    for _ in range(3):
        batch = {
            f: em.RaggedTensor(rng.integers(-(2**40), 2**40, 12), np.array([0, 3, 7, 9, 12]))
            for f in features
            if f != "plain"
        }
        batch["plain"] = em.RaggedTensor(rng.integers(0, 104, 5), np.array([0, 1, 2, 4, 5]))
        acts, out = emb.dequeue(emb.enqueue(batch))
        emb.apply_gradients(jax.tree_util.tree_map(lambda a: a * 0 + 0.25, acts), out)
    emb.flush()
    want = {"_map_ahead_fn", "_fused_refresh_fn"} if pipelined else {"_apply_map_lookup_fn"}
    assert want <= set(compiled)
    for name, hlo in ((n, h) for n, texts in compiled.items() for h in texts):
        copies = re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", hlo)
        copied = [s for s in copies if tuple(int(x) for x in s.split(",")) in big]
        assert not copied, (name, copied)


def test_each_stacks_counts_reach_its_last_stats():
    """The map's counts leave the program as one array (a row a stack, stacks sorted):
    each stack's row reaches that stack's `last_stats`, whatever the features' order."""
    cfg = {
        name: em.TableConfig(
            32, 4, initializer=_init, name=name, id_map=em.DynamicIds(), combiner="sum"
        )
        for name in ("zeta", "alpha", "mid")
    }
    emb = em.MeshEmbedding(
        {n: em.FeatureConfig(t) for n, t in cfg.items()}, em.Adagrad(0.1), mesh=mesh_of(1)
    )
    fresh = {"zeta": 3, "alpha": 5, "mid": 2}  # distinct ids a table, then one repeated
    batch = {
        n: em.RaggedTensor(
            np.array([*range(100 * k, 100 * k + c), 100 * k], np.int64), np.array([0, c + 1])
        )
        for k, (n, c) in enumerate(fresh.items())
    }
    emb(batch)
    for n, c in fresh.items():
        assert emb.last_stats[n].id_map["admissions"] == c, n
        assert emb.last_stats[n].id_map["occupancy"] == c, n
    emb(batch)  # the same ids again: hits
    for n, c in fresh.items():
        got = emb.last_stats[n].id_map
        assert (got["hits"], got["admissions"], got["occupancy"]) == (c, 0, c), n
