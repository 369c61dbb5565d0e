"""Evaluation lookups (`training=False`): a lookup that changes no state.

For every table kind (float32, bfloat16 and float16 storage, a table of raw ids whose
map is full, stacked and unstacked, sum / mean / sqrtn, ragged / sparse / dense inputs,
weights, a sequence feature), on 1 and 8 devices, pipelined and not:
- an eval lookup equals `serving_embedding_lookup` on the tables the next training
  lookup reads (the tables of raw ids as their `RawIdTable`: unknown ids read zero rows),
  and a float64 numpy reference written here;
- N eval lookups leave every array of the state (tables, slots, id maps, step), the
  pending update, the id maps' counts and the preprocessing statistics as they were,
  though a training lookup of the same batch admits and evicts;
- evaluating between training steps leaves the training run bit for bit as it was;
- an eval lookup's preserved outputs are refused by `apply_gradients`, state untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshes import mesh_of

import embedmesh as em

BATCH = 16
RAW_CAPACITY = 8  # the case: full after training, an eval batch of new ids
POOL = np.array([0, -1, 2**63 - 1, -(2**63), 2**40, 7, 8, 16, 123456789012, -8, 5, 99], np.int64)
NEW_IDS = np.array([1001, 1002, 1003, 1004, -1005, 2**50, 2**51, 1008], np.int64)


def _init(key, shape, dtype):  # key-dependent, never zero
    return jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5).astype(dtype)


def features():
    a = em.TableConfig(32, 4, initializer=_init, combiner="sum", name="a")
    b = em.TableConfig(24, 4, initializer=_init, combiner="mean", name="b")  # stacks with a
    h = em.TableConfig(16, 8, initializer=_init, combiner="mean", name="h", dtype="bfloat16")
    f = em.TableConfig(16, 8, initializer=_init, combiner="sqrtn", name="f", dtype="float16")
    raw = em.TableConfig(
        RAW_CAPACITY,
        4,
        initializer=_init,
        combiner="mean",
        name="raw",
        id_map=em.DynamicIds("lru", evict_batch=1),
    )
    return {
        "ragged_a": em.FeatureConfig(a),
        "dense_a": em.FeatureConfig(a),
        "sparse_b": em.FeatureConfig(b),
        "h": em.FeatureConfig(h),
        "f": em.FeatureConfig(f),
        "raw": em.FeatureConfig(raw),
        "seq_h": em.FeatureConfig(h, max_sequence_length=2),  # [B, 2, dim], not combined
    }


def _ragged(rng, pool_or_vocab, lengths):
    n = int(lengths.sum())
    if isinstance(pool_or_vocab, np.ndarray):
        values = rng.choice(pool_or_vocab, n)
    else:
        values = rng.integers(0, pool_or_vocab, n)
    return em.RaggedTensor.from_row_lengths(values, lengths)


def _sparse(rng, vocab, batch, width=3):
    idx = np.array([[i, p] for i in range(batch) for p in range(int(rng.integers(0, width)))])
    idx = idx.reshape(-1, 2)
    return em.SparseTensor(idx, rng.integers(0, vocab, len(idx)), (batch, width))


def batch_of(rng, raw_pool=POOL):
    """`(features, weights)`: every input form, weights on three of them."""
    lengths = rng.integers(0, 4, BATCH)
    ra = _ragged(rng, 32, lengths)
    sb = _sparse(rng, 24, BATCH)
    fs = _sparse(rng, 16, BATCH)
    raw = _ragged(rng, raw_pool, rng.integers(1, 3, BATCH))
    inputs = {
        "ragged_a": ra,
        "dense_a": rng.integers(0, 32, BATCH),
        "sparse_b": sb,
        "h": _ragged(rng, 16, rng.integers(0, 3, BATCH)),
        "f": fs,
        "raw": raw,
        "seq_h": _ragged(rng, 16, rng.integers(0, 4, BATCH)),
    }

    def w(n):
        return rng.uniform(0.5, 2.0, n).astype(np.float32)

    weights = {
        "ragged_a": em.RaggedTensor(w(len(ra.values)), ra.row_splits),
        "dense_a": None,
        "sparse_b": em.SparseTensor(sb.indices, w(len(sb.values)), sb.dense_shape),
        "h": None,
        "f": em.SparseTensor(fs.indices, w(len(fs.values)), fs.dense_shape),
        "raw": em.RaggedTensor(w(len(raw.values)), raw.row_splits),
        "seq_h": None,
    }
    return inputs, weights


def grad_of(acts):
    return jax.tree_util.tree_map(lambda x: jnp.sin(3.0 * x) + 0.1, acts)


# ------------------------------------------------------------------ float64 reference


def _bags(inp, weight):
    """`[(ids, weights)]` a sample, float64 weights (1 where none)."""
    if isinstance(inp, em.RaggedTensor):
        s = np.asarray(inp.row_splits)
        v = np.asarray(inp.values)
        ww = np.ones(len(v)) if weight is None else np.asarray(weight.values, np.float64)
        return [(v[s[i] : s[i + 1]], ww[s[i] : s[i + 1]]) for i in range(len(s) - 1)]
    if isinstance(inp, em.SparseTensor):
        idx = np.asarray(inp.indices)
        v = np.asarray(inp.values)
        ww = np.ones(len(v)) if weight is None else np.asarray(weight.values, np.float64)
        return [(v[idx[:, 0] == i], ww[idx[:, 0] == i]) for i in range(inp.dense_shape[0])]
    ids = np.asarray(inp)
    return [(ids[i : i + 1], np.ones(1)) for i in range(len(ids))]


def reference(inputs, weights, tables, fc) -> dict:
    """float64 loops: each sample's rows, weighted and combined (an empty bag: zeros; a
    sequence feature: each position's row, no combining); a table of raw ids reads its
    `RawIdTable` by id (unknown ids: zero rows)."""
    out = {}
    for name, feature in fc.items():
        table = tables[feature.table]
        comb = feature.table.combiner
        rows_of = (
            (lambda ids, t=table: np.asarray(t.get(ids), np.float64))
            if hasattr(table, "ids")
            else (lambda ids, t=table: np.asarray(t, np.float64)[ids])
        )
        res = []
        if feature.max_sequence_length:  # each position's row, zeros past the bag's end
            for ids, w in _bags(inputs[name], weights[name]):
                seq = np.zeros((feature.max_sequence_length, feature.table.dim))
                ids, w = ids[: len(seq)], w[: len(seq)]
                if len(ids):
                    seq[: len(ids)] = w[:, None] * rows_of(ids)
                res.append(seq)
            out[name] = np.stack(res)
            continue
        for ids, w in _bags(inputs[name], weights[name]):
            if len(ids) == 0:
                res.append(np.zeros(feature.table.dim))
                continue
            total = (w[:, None] * rows_of(ids)).sum(0)
            if comb == "mean":
                total = total / w.sum()
            elif comb == "sqrtn":
                total = total / np.sqrt((w * w).sum())
            res.append(total)
        out[name] = np.stack(res)
    return out


# -------------------------------------------------------------------------- helpers


def snapshot(emb) -> dict:
    """Everything an eval lookup must leave as it is: every array of the state the next
    lookup reads (bit for bit), the pending update and the owners' view (by identity),
    the id maps' counts and the preprocessing statistics."""
    s = emb._schedule
    return {
        "leaves": [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(s.state)],
        "treedef": jax.tree_util.tree_structure(s.state),
        "pending": s.pending,
        "view": s.view,
        "applied": s.applied,
        "after_lookup": s.after_lookup,
        "stats": repr(emb.last_stats),
    }


def _bits(x) -> np.ndarray:
    """An array's bytes (bit for bit: -0.0 and NaNs told apart)."""
    return np.atleast_1d(np.ascontiguousarray(np.asarray(x))).view(np.uint8)


def assert_same_snapshot(got: dict, want: dict) -> None:
    assert got["treedef"] == want["treedef"]
    assert len(got["leaves"]) == len(want["leaves"])
    for x, y in zip(got["leaves"], want["leaves"]):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(_bits(x), _bits(y))
    for k in ("pending", "view", "applied", "after_lookup"):
        assert got[k] is want[k], k
    assert got["stats"] == want["stats"]


def assert_tables_identical(got: dict, want: dict) -> None:
    assert sorted(t.name for t in got) == sorted(t.name for t in want)
    by_name = {t.name: v for t, v in got.items()}
    for t, v in want.items():
        g = by_name[t.name]
        if hasattr(v, "ids"):
            np.testing.assert_array_equal(g.ids, v.ids)
            g, v = g.rows, v.rows
        if isinstance(v, dict):
            for k in v:
                np.testing.assert_array_equal(_bits(g[k]), _bits(v[k]))
        else:
            np.testing.assert_array_equal(_bits(g), _bits(v))


def assert_acts(got: dict, want: dict, what: str) -> None:
    for k in want:
        np.testing.assert_allclose(
            np.asarray(got[k], np.float64), want[k], rtol=2e-5, atol=2e-6, err_msg=f"{what}: {k}"
        )


def assert_served(acts: dict, served: dict) -> None:
    """Serving's activations: float32 tables' to float32 rounding; a bfloat16 or float16
    table's come out in its dtype (the lookup's are float32, as in training): to its
    rounding."""
    for k, v in served.items():
        v = np.asarray(v)
        # (ml_dtypes' finfo: numpy's knows bfloat16 only from ml_dtypes 0.7 on)
        eps = 2e-5 if v.dtype == np.float32 else float(ml_dtypes.finfo(v.dtype).eps)
        np.testing.assert_allclose(
            np.asarray(acts[k], np.float64),
            v.astype(np.float64),
            rtol=eps,
            atol=eps * float(np.abs(v.astype(np.float64)).max(initial=1.0)),
            err_msg=f"serving: {k} ({v.dtype})",
        )


def new_layer(n: int, pipelined: bool, stack: bool = True) -> tuple:
    """`(a MeshEmbedding of the kinds' features on n devices, its feature config)`."""
    fc = features()
    emb = em.MeshEmbedding(
        fc,
        em.Adagrad(0.3, initial_accumulator_value=0.2),
        pipelined,
        mesh=mesh_of(n),
        stack_tables=stack,
        capacities=em.Capacity(64, 64),
        seed=5,
    )
    return emb, fc


_LAYERS: dict = {}
_FEATURES: dict = {}  # id(layer) -> its feature config


def layer(n: int, stack: bool, pipelined: bool, kernels: bool = True):
    """One compiled layer a configuration, reset to its initial state (`kernels`: whether
    the CPU kernels were in use when it was made)."""
    key = (n, stack, pipelined, kernels)
    if key not in _LAYERS:
        emb, fc = new_layer(n, pipelined, stack)
        emb.build()
        _LAYERS[key] = emb
        _FEATURES[id(emb)] = fc
    emb = _LAYERS[key]
    emb.flush()
    emb.state = emb.job.init_state()
    return emb


def train(emb, data: list, evaluate=None) -> dict:
    """Training steps on `data`; `evaluate(emb)` called after each lookup and after each
    update. Returns the tables the next training lookup reads (pipelined: read before the
    last update, which stays pending)."""
    nxt = None
    for i, (inputs, weights) in enumerate(data):
        acts, pre = emb(inputs, weights)
        if evaluate is not None:
            evaluate(emb)
        if emb.pipelined and i == len(data) - 1:
            nxt = emb.embedding_tables
        emb.apply_gradients(grad_of(acts), pre)
        if evaluate is not None:
            evaluate(emb)
    return emb.embedding_tables if nxt is None else nxt


# with the CPU kernels; test_eval_without_the_cpu_kernels runs (2, False, False): every
# pair of values of (one device or several, stacked, pipelined) runs
CONFIGS = [(1, True, False), (1, False, True), (8, True, True)]


@pytest.mark.parametrize("n,stack,pipelined", CONFIGS)
def test_eval_equals_serving_and_changes_nothing(n, stack, pipelined):
    check_evaluation(n, stack, pipelined)


def test_eval_without_the_cpu_kernels(monkeypatch):
    """The path of the platforms without the CPU kernels (GPU, TPU): the maps' rows
    sorted as the host orders a table of rows, every op its reference."""
    from embedmesh import _runtime
    from embedmesh.device import id_map

    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: False)
    assert not id_map.blocks_as_mapped()
    check_evaluation(2, False, False, kernels=False)


def check_evaluation(n: int, stack: bool, pipelined: bool, kernels: bool = True) -> None:
    """(a), (b), (c) and (e) of the module docstring on one configuration."""
    rng = np.random.default_rng(n * 4 + 2 * stack + pipelined)
    data = [batch_of(rng) for _ in range(3)]
    evals = [batch_of(rng, np.concatenate([POOL, NEW_IDS])) for _ in range(2)]

    def evaluate(emb):  # what an eval between steps does (its outputs unused)
        for inputs, weights in evals:
            emb(inputs, weights, training=False)

    # (c) evaluating between steps: the same run, bit for bit
    emb = layer(n, stack, pipelined, kernels)
    train(emb, data, evaluate)
    with_evals = emb.variables, emb.embedding_tables, int(emb.observed_state().step)
    emb = layer(n, stack, pipelined, kernels)
    tables = train(emb, data)
    assert_tables_identical(emb.variables, with_evals[0])
    assert_tables_identical(emb.embedding_tables, with_evals[1])
    assert int(emb.observed_state().step) == with_evals[2] == len(data)
    raw = next(t for t in tables if t.name == "raw")
    if n == 1:  # (8 devices: a row a shard, as the hash routes the ids)
        assert len(tables[raw].ids) == RAW_CAPACITY  # the map is full

    # (a), (b) an eval lookup: serving's activations on the tables the next training
    # lookup reads; every array of the state as it was, pipelined the update pending
    if not pipelined:
        emb.flush()
    else:
        assert emb._pending is not None
    before = snapshot(emb)
    fc = features_of(emb)
    for inputs, weights in evals * 2:
        acts, pre = emb(inputs, weights, training=False)
        assert_served(acts, em.serving_embedding_lookup(inputs, weights, tables, fc))
        assert_acts(acts, reference(inputs, weights, tables, fc), "reference")
        assert_same_snapshot(snapshot(emb), before)
    # the eval batch's new ids read zero rows (a sample of new ids only)
    inputs, weights = evals[0]
    only_new = em.RaggedTensor.from_row_lengths(NEW_IDS, [1] * 8 + [0] * (BATCH - 8))
    acts, _ = emb(dict(inputs, raw=only_new), dict(weights, raw=None), training=False)
    assert not np.asarray(acts["raw"]).any()
    assert_same_snapshot(snapshot(emb), before)

    # (e) its preserved outputs are refused by apply_gradients, nothing changed
    acts, pre = emb(inputs, weights, training=False)
    with pytest.raises(ValueError, match="training=False"):
        emb.apply_gradients(grad_of(acts), pre)
    assert_same_snapshot(snapshot(emb), before)

    # a training lookup of the same batch admits (and, the map full, evicts)
    emb(dict(inputs, raw=only_new), dict(weights, raw=None))
    counts = emb.last_stats["raw"].id_map
    assert counts["admissions"] > 0 and counts["evictions"] > 0


def features_of(emb):
    """The layer's feature config (the one its tables were declared with)."""
    return _FEATURES[id(emb)]


def test_enqueue_training_false_then_dequeue_follows_it():
    """TPUEmbedding's form: `enqueue(..., training=False)`, then `dequeue` of what it
    returned is an eval lookup (the tuple form too); `dequeue()` without its argument
    is a TypeError naming the fix."""
    emb = layer(1, True, False)
    rng = np.random.default_rng(11)
    train(emb, [batch_of(rng) for _ in range(2)])
    tables = emb.embedding_tables
    before = snapshot(emb)
    inputs, weights = batch_of(rng, np.concatenate([POOL, NEW_IDS]))
    enqueued = emb.enqueue(inputs, weights, training=False)
    acts, pre = emb.dequeue(enqueued)
    assert_acts(acts, reference(inputs, weights, tables, features_of(emb)), "dequeue")
    assert_same_snapshot(snapshot(emb), before)
    with pytest.raises(ValueError, match="training=False"):
        emb.apply_gradients(grad_of(acts), pre)
    with pytest.raises(TypeError, match="pass what enqueue returned"):
        emb.dequeue()
    with pytest.raises(TypeError, match="pass training=False by name"):
        emb.enqueue(inputs, weights, False)  # TPUEmbedding v1's positional order
    assert_same_snapshot(snapshot(emb), before)


def test_full_map_eval_admits_and_evicts_nothing():
    """The reported case: a table of raw ids of capacity 8, full after training; an
    eval-only lookup of 8 new ids admits and evicts nothing, reads zero rows for them,
    and keeps every trained id and its row."""
    dyn = em.TableConfig(8, 4, initializer=_init, name="v", id_map=em.DynamicIds("lru"))
    fc = {"v": em.FeatureConfig(dyn)}
    emb = em.MeshEmbedding(fc, em.Adagrad(0.1), mesh=mesh_of(1))
    trained = np.arange(8, dtype=np.int64) * 3 + 1
    acts, pre = emb({"v": trained})
    emb.apply_gradients({"v": jnp.ones_like(acts["v"])}, pre)
    table = emb.embedding_tables[dyn]
    stats = emb.last_stats["v"].id_map
    assert len(table.ids) == 8
    for _ in range(3):
        acts, _ = emb({"v": NEW_IDS}, training=False)
        assert not np.asarray(acts["v"]).any()
    assert emb.last_stats["v"].id_map == stats
    after = emb.embedding_tables[dyn]
    np.testing.assert_array_equal(after.ids, table.ids)
    np.testing.assert_array_equal(after.rows, table.rows)
    mixed = np.concatenate([trained[::2], NEW_IDS[::2]])
    acts, _ = emb({"v": mixed}, training=False)
    np.testing.assert_array_equal(np.asarray(acts["v"]), table.get(mixed))
    # the core's form, in a jitted step of one's own: find_rows, then lookup
    core = emb.core
    own = jax.jit(lambda state, csr: core.lookup(state, core.find_rows(state, csr)))
    got = own(emb.state, emb.enqueue({"v": mixed}, training=False))
    np.testing.assert_array_equal(np.asarray(got["v"]), np.asarray(acts["v"]))
    assert emb.last_stats["v"].id_map == stats
    np.testing.assert_array_equal(emb.embedding_tables[dyn].ids, table.ids)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**16),
    eval_ids=st.lists(st.sampled_from(list(POOL) + list(NEW_IDS)), min_size=8, max_size=8),
)
def test_eval_of_any_ids_reads_the_served_rows(seed, eval_ids):
    """Any raw ids, known or not, repeated or not: the eval lookup of each id alone is
    its served row (zero for an unknown id), and nothing changes."""
    emb = layer(1, False, True)
    rng = np.random.default_rng(seed)
    tables = train(emb, [batch_of(rng) for _ in range(2)])
    before = snapshot(emb)
    raw_t = next(t for t in tables if t.name == "raw")
    inputs, weights = batch_of(rng)
    ids = np.asarray(eval_ids, np.int64)
    one_each = em.RaggedTensor.from_row_lengths(
        np.concatenate([ids, ids[:0]]), [1] * 8 + [0] * (BATCH - 8)
    )
    acts, _ = emb(dict(inputs, raw=one_each), dict(weights, raw=None), training=False)
    np.testing.assert_array_equal(
        np.asarray(acts["raw"])[:8], np.asarray(tables[raw_t].get(ids), np.float32)
    )
    assert not np.asarray(acts["raw"])[8:].any()
    assert_same_snapshot(snapshot(emb), before)


def test_eval_after_a_restore_mid_pipeline(tmp_path):
    """Pipelined, restored from a checkpoint saved with an update pending: an eval
    lookup reads what the next training lookup reads (the tables before that update),
    as before the save, changes nothing, and the run then resumes bit for bit."""
    from embedmesh import checkpoint as em_ckpt

    emb = layer(1, False, True)
    rng = np.random.default_rng(31)
    data = [batch_of(rng) for _ in range(4)]
    held_out = batch_of(rng, np.concatenate([POOL, NEW_IDS]))
    train(emb, data[:2])
    want_eval = emb(*held_out, training=False)[0]
    em_ckpt.save(tmp_path / "c", emb)  # the second update pending
    train(emb, data[2:])
    want = emb.variables, emb.embedding_tables

    em_ckpt.restore(emb, tmp_path / "c")
    before = snapshot(emb)
    assert before["after_lookup"] is not None  # restored mid-pipeline
    for _ in range(2):
        got = emb(*held_out, training=False)[0]
        for k in want_eval:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want_eval[k]), k)
        assert_same_snapshot(snapshot(emb), before)
    train(emb, data[2:])
    assert_tables_identical(emb.variables, want[0])
    assert_tables_identical(emb.embedding_tables, want[1])
