"""Serving tables of raw 64-bit ids (issue 42, docs/dynamic-ids.md#serving-tables-of-raw-ids):
the served form (`RawIdTable`), the lookup by raw id (host, traced with x64, an export),
and increments (`export_increment`, `RawIdUpdate`, `apply_increment`).

References: a float64 dict of {raw id: row} with TensorFlow's bag rules (unknown ids a
zero row that counts in a mean's weights), and the training engine's own lookup of the
same raw ids (ids pending admission read zero rows there). Output buffers are poisoned
(`poisoned_outputs`); tables never zero."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshes import mesh_of

import embedmesh as em
from embedmesh.serving import Dense, Ragged, Sparse, export_serving, load_serving

DIM = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
OPT = em.Adagrad(0.3, initial_accumulator_value=0.2)
COMBINERS = ("sum", "mean", "sqrtn")


def _init(key, shape, dtype):  # never zero: a missing row shows
    return 0.5 + jax.random.uniform(key, shape, dtype)


# ids never drawn before in this process (a fresh id each call: never admitted by a
# second sighting in the engine's lookups)
_fresh = itertools.count(1)


def fresh_id() -> int:
    k = next(_fresh)
    return int(np.int64(np.uint64((k * 0x9E3779B97F4A7C15) & (2**64 - 1)).view(np.int64)))


def reference(rows: dict, ids, splits, weights, combiner, prune_weights=False) -> np.ndarray:
    """float64 bags over `{raw id: row}`: unknown ids a zero row, counted in the weights;
    TensorFlow's pruning of weights <= 0 (sparse, safe, combiner other than sum)."""
    out = np.zeros((len(splits) - 1, DIM))
    for r in range(len(splits) - 1):
        den = 0.0
        for k in range(splits[r], splits[r + 1]):
            w = 1.0 if weights is None else float(weights[k])
            if prune_weights and not w > 0:
                continue
            out[r] += w * np.asarray(rows.get(int(ids[k]), np.zeros(DIM)), np.float64)
            den += w if combiner == "mean" else w * w
        if combiner != "sum":
            den = np.sqrt(den) if combiner == "sqrtn" else den
            out[r] = 0.0 if den == 0 else out[r] / den
    return out


def _table(n: int, capacity: int, seed: int = 0, ids=None) -> em.RawIdTable:
    rng = np.random.default_rng(seed)
    if ids is None:
        ids = np.unique(
            np.concatenate(
                [
                    [INT64_MIN, INT64_MAX, -1, 0],
                    rng.integers(INT64_MIN, INT64_MAX, n, np.int64),
                ]
            )
        )[:n]
    rows = (0.25 + rng.random((len(ids), DIM))).astype(np.float32)
    return em.RawIdTable(rng.permutation(ids), rows[rng.permutation(len(ids))], capacity, step=3)


# ---------------------------------------------------------------------------
# RawIdTable, by hand


def test_raw_id_table_sorts_validates_and_is_read_only():
    ids = np.array([5, INT64_MIN, -7, INT64_MAX], np.int64)
    rows = np.arange(16, dtype=np.float32).reshape(4, 4) + 1
    t = em.RawIdTable(ids, rows, capacity=6, step=2)
    np.testing.assert_array_equal(t.ids, [INT64_MIN, -7, 5, INT64_MAX])
    np.testing.assert_array_equal(t.rows, rows[[1, 2, 0, 3]])
    assert t.padded.shape == (7, 4) and not t.padded[4:].any() and len(t) == 4
    np.testing.assert_array_equal(t.positions([5, 6, INT64_MIN, -7]), [2, 6, 0, 1])
    np.testing.assert_array_equal(t.get(np.array([INT64_MAX], np.uint64).view(np.int64)), rows[3:])
    u = np.array([2**64 - 7], np.uint64)  # uint64: the same 64 bits as -7
    np.testing.assert_array_equal(t.positions(u), [1])
    for a in (t.ids, t.rows, t.padded):
        with pytest.raises(ValueError):
            a[0] = 0
    with pytest.raises(ValueError, match="distinct; 5 occurs twice"):
        em.RawIdTable([5, 1, 5], np.ones((3, 4)), 4)
    with pytest.raises(ValueError, match="more than the capacity"):
        em.RawIdTable([1, 2, 3], np.ones((3, 4)), 2)
    with pytest.raises(ValueError, match=r"\[len\(ids\), dim\]"):
        em.RawIdTable([1, 2], np.ones((3, 4)), 4)
    empty = em.RawIdTable(np.zeros(0, np.int64), np.zeros((0, 4), np.float32), 3)
    np.testing.assert_array_equal(empty.positions([1, 2]), [3, 3])


# ---------------------------------------------------------------------------
# The lookup against the float64 reference: every input kind, combiner, weights


@st.composite
def _request(draw, table: em.RawIdTable):
    """One feature's ragged bags of known and unknown raw ids (extremes included), with
    or without weights (negative and zero ones too)."""
    b = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, 4), min_size=b, max_size=b))
    n = sum(lengths)
    known = st.sampled_from(list(table.ids))
    unknown = st.sampled_from([INT64_MIN + 1, INT64_MAX - 1, -2, 1, 2**40 + 3, 12345])
    ids = np.array(
        draw(st.lists(st.one_of(known, known, unknown), min_size=n, max_size=n)),
        np.int64,
    )
    weights = None
    if draw(st.booleans()):
        weights = np.array(
            draw(
                st.lists(
                    st.sampled_from([0.5, 2.0, 1.25, -0.75, 0.0]),
                    min_size=n,
                    max_size=n,
                )
            ),
            np.float32,
        )
    return ids, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), weights


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_lookup_matches_the_float64_reference(poisoned_outputs, data):
    combiner = data.draw(st.sampled_from(COMBINERS))
    kind = data.draw(st.sampled_from(["ragged", "sparse", "dense", "sequence"]))
    cfg = em.TableConfig(16, DIM, name="items", combiner=combiner, id_map=em.DynamicIds())
    plain = em.TableConfig(5, DIM, name="plain", combiner="sum")
    t = _table(9, 16, seed=data.draw(st.integers(0, 3)))
    rows = dict(zip(t.ids.tolist(), t.rows))
    ids, splits, w = data.draw(_request(t))
    b = len(splits) - 1
    feature = em.FeatureConfig(cfg, max_sequence_length=3 if kind == "sequence" else 0)
    features = {"f": feature, "p": em.FeatureConfig(plain)}
    plain_rows = 1.0 + np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM)
    tables = {cfg: t, plain: plain_rows}
    p_in = em.RaggedTensor(np.arange(b) % 5, np.arange(b + 1))
    if kind == "dense":
        x = ids[: (len(ids) // 2) * 2].reshape(-1, 2)
        if x.shape[0] == 0:
            return
        out = em.serving_embedding_lookup({"f": x}, None, tables, {"f": feature})["f"]
        want = np.stack([[rows.get(int(i), np.zeros(DIM)) for i in r] for r in x])
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
        return
    if kind == "sequence":
        inp = em.RaggedTensor(ids, splits)
        out = em.serving_embedding_lookup({"f": inp}, None, tables, {"f": feature})["f"]
        want = np.zeros((b, 3, DIM))
        for s in range(b):
            for p, i in enumerate(ids[splits[s] : splits[s + 1]][:3]):
                want[s, p] = rows.get(int(i), np.zeros(DIM))
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
        return
    if kind == "ragged":
        inp = em.RaggedTensor(ids, splits)
        win = None if w is None else em.RaggedTensor(w, splits)
        prune = False
    else:
        rows_of = np.repeat(np.arange(b), np.diff(splits))
        cols = np.concatenate([np.arange(k) for k in np.diff(splits)] + [np.zeros(0, int)])
        idx = np.stack([rows_of, cols], axis=1).astype(np.int64)
        inp = em.SparseTensor(idx, ids, (b, 4))
        win = None if w is None else em.SparseTensor(idx, w, (b, 4))
        prune = w is not None and combiner != "sum"  # TF's safe lookup
    out = em.serving_embedding_lookup(
        {"f": inp, "p": p_in},
        None if win is None else {"f": win, "p": None},
        tables,
        features,
    )
    want = reference(rows, ids, splits, w, combiner, prune)
    np.testing.assert_allclose(np.asarray(out["f"]), want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(out["p"]), plain_rows[np.arange(b) % 5])
    # traced, with 64-bit ids (x64 on): the same values
    with jax.enable_x64(True):
        traced = jax.jit(
            lambda i, ww: em.serving_embedding_lookup(
                {"f": i}, None if ww is None else {"f": ww}, {cfg: t}, {"f": feature}
            )
        )(inp, win)
    np.testing.assert_allclose(np.asarray(traced["f"]), want, rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------------------
# The lookup against the training engine's, for the same raw ids


@pytest.fixture(scope="module")
def trained():
    """One engine, one table of raw ids per combiner (admitted at the second sighting,
    a wide sketch: an id sighted once stays pending, a zero row), trained 2 steps."""
    tables = {
        c: em.TableConfig(
            32,
            DIM,
            initializer=_init,
            combiner=c,
            name=f"t_{c}",
            id_map=em.DynamicIds(admit_after=2, sketch_width=1 << 14, sketch_depth=4),
        )
        for c in COMBINERS
    }
    features = {c: em.FeatureConfig(t, name=c) for c, t in tables.items()}
    emb = em.MeshEmbedding(features, OPT, mesh=mesh_of(1), seed=5)
    rng = np.random.default_rng(1)
    pool = rng.integers(INT64_MIN, INT64_MAX, 12, np.int64)
    pool[:3] = [INT64_MIN, INT64_MAX, -1]
    for _ in range(2):  # every pool id sighted twice: admitted
        batch = {c: em.RaggedTensor(rng.permutation(pool), np.arange(0, 13, 3)) for c in tables}
        acts, preserved = emb(batch)
        emb.apply_gradients({c: jnp.full_like(a, 0.3) for c, a in acts.items()}, preserved)
    return emb, tables, features, pool


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_served_lookup_equals_the_engines(trained, poisoned_outputs, data):
    emb, tables, features, pool = trained
    served = emb.embedding_tables
    for t in tables.values():
        assert isinstance(served[t], em.RawIdTable) and len(served[t]) == len(pool)
    inputs, weights = {}, {}
    for c in COMBINERS:
        lengths = data.draw(st.lists(st.integers(0, 4), min_size=4, max_size=4))
        picks = [
            int(pool[data.draw(st.integers(0, 11))]) if data.draw(st.booleans()) else fresh_id()
            for _ in range(sum(lengths))
        ]
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        inputs[c] = em.RaggedTensor(np.array(picks, np.int64), splits)
        w = data.draw(
            st.lists(
                st.sampled_from([0.5, 1.5, 2.0]),
                min_size=len(picks),
                max_size=len(picks),
            )
        )
        weights[c] = em.RaggedTensor(np.array(w, np.float32), splits)
    out = em.serving_embedding_lookup(inputs, weights, served, features)
    acts, _ = emb(inputs, weights)  # the engine's lookup of the same ids (unknown: pending)
    for c in COMBINERS:
        t = served[tables[c]]
        rows = dict(zip(t.ids.tolist(), t.rows))
        x = inputs[c]
        want = reference(rows, x.values, x.row_splits, weights[c].values, c)
        np.testing.assert_allclose(np.asarray(acts[c]), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out[c]), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out[c]), np.asarray(acts[c]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Increments


def _engine_of(n: int, capacity: int):
    cfg = em.TableConfig(
        capacity,
        DIM,
        initializer=_init,
        combiner="mean",
        name="items",
        id_map=em.DynamicIds("lru", evict_batch=1),
    )
    other = em.TableConfig(6, DIM, name="other", combiner="sum")
    features = {"item": em.FeatureConfig(cfg), "other": em.FeatureConfig(other)}
    return em.MeshEmbedding(features, OPT, mesh=mesh_of(n), seed=3), cfg, other


def _step(emb, rng, pool, samples):
    ids = rng.choice(pool, size=2 * samples)
    acts, preserved = emb(
        {
            "item": em.RaggedTensor(ids, np.arange(0, 2 * samples + 1, 2)),
            "other": em.RaggedTensor(rng.integers(0, 6, samples), np.arange(samples + 1)),
        }
    )
    emb.apply_gradients({k: jnp.full_like(a, 0.7) for k, a in acts.items()}, preserved)


def _assert_same(a: em.RawIdTable, b: em.RawIdTable):
    assert a.step == b.step and a.capacity == b.capacity
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.padded, b.padded)  # bit for bit, zero rows included


_ENGINES: dict = {}  # n -> (emb, cfg): one engine a device count, its state carried on


@pytest.mark.parametrize("n", [1, 2])
@settings(max_examples=3, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    every=st.lists(st.integers(1, 2), min_size=1, max_size=3),
)
def test_increments_in_sequence_equal_the_full_export(n, seed, every):
    """Steps over a pool of 3x the capacity (exact LRU: evictions), then over new ids
    (the old ones evicted); after every few steps an increment since the last one,
    applied: always the full read, bit for bit (the engine's state carries on from
    example to example)."""
    if n not in _ENGINES:
        _ENGINES[n] = _engine_of(n, 8)[:2]
    emb, cfg = _ENGINES[n]
    rng = np.random.default_rng(seed)
    pool = rng.integers(INT64_MIN, INT64_MAX, 24, np.int64)
    _step(emb, rng, pool, 2 * n)
    base = {cfg: emb.embedding_tables[cfg]}
    start = base[cfg]
    removed = 0
    new_pool = rng.integers(INT64_MIN, INT64_MAX, 24, np.int64)  # at the end: evicts the old
    for k, p in [(k, pool) for k in every] + [(2, new_pool)]:
        for _ in range(k):
            _step(emb, rng, p, 2 * n)
        update = em.export_increment(emb, since=base)
        u = update[cfg]
        assert (u.since_step, u.step) == (base[cfg].step, base[cfg].step + k)
        assert not np.isin(u.removed, u.ids).any() and np.isin(u.removed, base[cfg].ids).all()
        removed += len(u.removed)
        base = em.apply_increment(base, update)
        _assert_same(base[cfg], emb.embedding_tables[cfg])
    assert removed > 0  # evictions were reported
    # the core's functional form gives the same
    again = em.export_increment(emb.core, {cfg: start}, state=emb.state)[cfg]
    _assert_same(start.apply(again), base[cfg])


# ---------------------------------------------------------------------------
# export_serving / load_serving


def test_export_round_trip_and_increments(tmp_path, poisoned_outputs):
    """An export with a table of raw ids (ragged, weighted; dense) beside a plain table:
    the loaded function equals the host lookup, before and after increments applied in
    place, in every bucket; the manifest names the raw inputs."""
    emb, cfg, other = _engine_of(1, 8)
    rng = np.random.default_rng(7)
    pool = rng.integers(INT64_MIN, INT64_MAX, 16, np.int64)
    _step(emb, rng, pool, 3)
    served = emb.embedding_tables
    features = {
        "item": em.FeatureConfig(cfg),
        "pair": em.FeatureConfig(cfg, name="pair"),
        "other": em.FeatureConfig(other),
    }

    def serve(inputs, tables):
        acts = em.serving_embedding_lookup(inputs, None, tables, features)
        return {
            "item": acts["item"],
            "pair": acts["pair"],
            "score": acts["other"].sum(-1),
        }

    signature = {
        "item": Ragged(nnz_per_example=4, dtype=np.int64),
        "pair": Dense((2,), np.int64),
        "other": Sparse((3,)),
    }
    manifest = export_serving(
        serve, tmp_path, tables=served, input_signature=signature, batch_sizes=(2, 4)
    )
    assert manifest["format_version"] == 3 and sorted(manifest["raw_id_inputs"]) == [
        [0, 0],
        [2, 0],
    ]
    entry = next(e for e in manifest["tables"] if e["name"] == "items")
    assert entry["raw_ids"]["step"] == 1 and entry["raw_ids"]["capacity"] == 8
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    server = load_serving(tmp_path)

    def request(table: em.RawIdTable, b: int):
        ids = [
            int(table.ids[rng.integers(len(table))]) if rng.random() < 0.7 else fresh_id()
            for _ in range(3 * b)
        ]
        inputs = {
            "item": em.RaggedTensor(np.array(ids[: b * 2], np.int64), np.arange(0, 2 * b + 1, 2)),
            "pair": np.array(ids[b : 3 * b], np.int64).reshape(b, 2),
            "other": em.SparseTensor(
                np.stack([np.arange(b), np.zeros(b, int)], 1),
                rng.integers(0, 6, b),
                (b, 3),
            ),
        }
        return inputs

    def check(tables, b):
        inputs = request(tables[cfg], b)
        got = server(inputs)
        want = serve(inputs, tables)
        for k in want:
            np.testing.assert_allclose(got[k], np.asarray(want[k]), rtol=1e-6, atol=1e-7)

    for b in (1, 2, 4, 7):
        check(served, b)
    base = dict(served)
    for _ in range(3):
        _step(emb, rng, pool, 3)
        update = em.export_increment(emb, since={cfg: base[cfg]})
        server.apply_increment({"items": update[cfg]})
        base = em.apply_increment(base, update)
        assert server.tables["items"] is not None and server.tables["items"].step == base[cfg].step
        for b in (1, 3):
            check(base, b)
    _assert_same(server.tables["items"], emb.embedding_tables[cfg])
    with pytest.raises(KeyError, match="not a table of raw ids"):
        server.apply_increment({"other": update[cfg]})
    # a fresh load starts from the export again
    assert load_serving(tmp_path, precompile=False).tables["items"].step == 1
    _an_update_applies_only_at_its_step(emb, cfg, served[cfg])


def _an_update_applies_only_at_its_step(emb, cfg, first):
    """An update applies to the table at its `since` step only (`first`: the engine's
    table at step 1, the engine now at step 4); a table without a step, a plain table's
    name or a plain array is refused (on the engine of the test above: no engine of its
    own to build and train)."""
    update = em.export_increment(emb, {cfg: first})[cfg]
    later = first.apply(update)
    assert later.step == 4
    with pytest.raises(ValueError, match="since step 1, but the table is at step 4"):
        later.apply(update)
    with pytest.raises(ValueError, match="has no step"):
        em.export_increment(emb, {cfg: em.RawIdTable([1], np.ones((1, DIM)), 8)})
    with pytest.raises(ValueError, match="not a table of raw ids"):
        em.export_increment(emb, {"other": first})
    with pytest.raises(TypeError, match="not a RawIdTable"):
        em.apply_increment({cfg: np.ones((8, DIM))}, {cfg: update})


def test_export_refuses_an_input_given_to_two_kinds_of_table(tmp_path):
    cfg = em.TableConfig(8, DIM, name="items", id_map=em.DynamicIds())
    other = em.TableConfig(6, DIM, name="other", combiner="sum")
    features = {"item": em.FeatureConfig(cfg), "other": em.FeatureConfig(other)}
    served = {
        cfg: em.RawIdTable([1, 2], np.ones((2, DIM)), 8, step=0),
        other: np.ones((6, DIM)),
    }

    def both(inputs, tables):
        acts = em.serving_embedding_lookup(
            {"item": inputs["x"], "other": inputs["x"]}, None, tables, features
        )
        return {"s": acts["item"] + acts["other"]}

    def export(fn):
        signature = {"x": Ragged(2)}
        export_serving(fn, tmp_path, tables=served, input_signature=signature, batch_sizes=(2,))

    with pytest.raises(ValueError, match="input leaf 0 .* is looked up in a table of raw ids"):
        export(both)

    def hashed(inputs, tables):  # ids transformed before the lookup: not a signature input
        x = inputs["x"]
        return em.serving_embedding_lookup(
            {"item": em.RaggedTensor(x.values + 1, x.row_splits)},
            None,
            tables,
            features,
        )

    with pytest.raises(ValueError, match="must be an input of the signature"):
        export(hashed)


# ---------------------------------------------------------------------------
# What refuses


def test_what_refuses_a_table_of_raw_ids(tmp_path):
    cfg = em.TableConfig(8, DIM, name="items", id_map=em.DynamicIds())
    features = {"item": em.FeatureConfig(cfg)}
    t = em.RawIdTable([3, -4], np.ones((2, DIM), np.float32), 8, step=0)
    x = {"item": np.array([[3], [2**62]], np.int64)}
    with pytest.raises(ValueError, match="serve it from its RawIdTable"):
        em.serving_embedding_lookup(x, None, {cfg: np.ones((8, DIM), np.float32)}, features)
    with pytest.raises(ValueError, match="capacity 4 and dim 4, expected"):
        em.serving_embedding_lookup(
            x, None, {cfg: em.RawIdTable([1], np.ones((1, 4)), 4)}, features
        )
    with pytest.raises(ValueError, match="traced raw ids of dtype int32"):
        jax.jit(lambda i: em.serving_embedding_lookup({"item": i}, None, {cfg: t}, features))(
            np.array([[3]], np.int32)
        )


def test_apply_increment_while_threads_serve(tmp_path):
    """Increments applied to a loaded export while 3 threads call it: every call's output
    is one of the tables' (before or after an update), never a mix; the last is the
    last table's."""
    import threading

    cfg = em.TableConfig(16, DIM, name="items", combiner="mean", id_map=em.DynamicIds())
    features = {"item": em.FeatureConfig(cfg)}
    rng = np.random.default_rng(3)
    versions, updates = [_table(10, 16, seed=3)], []
    for k in range(3):  # by hand: some rows changed, a new id, an id removed
        t = versions[-1]
        changed = np.concatenate([t.ids[k : k + 3], [fresh_id()]])
        rows = (1.0 + rng.random((4, DIM))).astype(np.float32)
        updates.append(em.RawIdUpdate(changed, rows, t.ids[-1 - k :][:1], t.step, t.step + 1))
        versions.append(t.apply(updates[-1]))
    all_ids = np.unique(np.concatenate([v.ids for v in versions]))
    inputs = {"item": em.RaggedTensor(all_ids, np.linspace(0, len(all_ids), 5).astype(np.int64))}

    def serve(x, tables):
        return em.serving_embedding_lookup(x, None, tables, features)

    want = [np.asarray(serve(inputs, {cfg: v})["item"]) for v in versions]
    export_serving(
        serve,
        tmp_path,
        tables={cfg: versions[0]},
        input_signature={"item": Ragged(nnz_per_example=len(all_ids), dtype=np.int64)},
        batch_sizes=(4,),
    )
    server = load_serving(tmp_path)
    stop, seen, bad = threading.Event(), set(), []

    def client():
        while not stop.is_set():
            got = server(inputs)["item"]
            match = [i for i, w in enumerate(want) if np.allclose(got, w, rtol=1e-6, atol=1e-7)]
            (seen.update(match) if match else bad.append(got))

    threads = [threading.Thread(target=client) for _ in range(3)]
    for th in threads:
        th.start()
    for u in updates:
        server.apply_increment({cfg: u})
    stop.set()
    for th in threads:
        th.join()
    assert not bad and seen
    np.testing.assert_allclose(server(inputs)["item"], want[-1], rtol=1e-6, atol=1e-7)
    _assert_same(server.tables["items"], versions[-1])


def test_served_table_survives_a_checkpoint_on_another_device_count(tmp_path):
    """Saved on 2 devices, restored on 1 (the id maps rebuilt): the same served table."""
    from embedmesh import checkpoint as em_ckpt

    emb, cfg, _ = _engine_of(2, 8)
    rng = np.random.default_rng(11)
    pool = rng.integers(INT64_MIN, INT64_MAX, 12, np.int64)
    for _ in range(2):
        _step(emb, rng, pool, 4)
    em_ckpt.save(tmp_path / "ckpt", emb)
    other, cfg1, _ = _engine_of(1, 8)
    em_ckpt.restore(other, tmp_path / "ckpt")
    before, after = emb.embedding_tables[cfg], other.embedding_tables[cfg1]
    assert len(before) > 0
    _assert_same(before, after)
