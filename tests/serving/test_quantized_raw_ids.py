"""Quantized tables of raw 64-bit ids (`quantize_table(RawIdTable, kind)`, issues 41 and
42): served from int8 / fp16 / bf16 rows, looked up by raw id (unknown ids: exact zero
rows), within each kind's error bound of the float32 rows and equal to a float64
reference over the decoded rows; increments applied to the quantized table give the
quantized table of the increments applied in float32, bit for bit; `export_serving` /
`load_serving` and `apply_increment` on a loaded export; "codes" refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serving_raw_ids import DIM, INT64_MAX, INT64_MIN, fresh_id, reference

import embedmesh as em
from embedmesh.serving import Ragged, export_serving, load_serving
from embedmesh.serving.quantized import QuantizedRawIdTable, quantize_table

CAPACITY = 12
ITEMS = em.TableConfig(CAPACITY, DIM, combiner="mean", name="items", id_map=em.DynamicIds())
FEATURES = {"item": em.FeatureConfig(ITEMS)}
KINDS = ("int8", "fp16", "bf16")


def _table(rng, n: int = 9, step: int = 4) -> em.RawIdTable:
    ids = np.unique(np.concatenate([[INT64_MIN, INT64_MAX, -1], rng.integers(-(2**62), 2**62, n)]))
    ids = ids[:n]
    rows = rng.uniform(-2.0, 3.0, (len(ids), DIM)).astype(np.float32)
    return em.RawIdTable(ids, rows, CAPACITY, step=step)


def _bound(kind: str, rows: np.ndarray) -> np.ndarray:
    """The per-element error bound of each kind (serving/quantized.py's docstring)."""
    if kind == "int8":
        scale = (rows.max(1, keepdims=True) - rows.min(1, keepdims=True)) / 255.0
        return scale / 2 + 2**-23 * (np.abs(rows.min(1, keepdims=True)) + 255 * scale) + 1e-12
    return np.abs(rows) * (2**-11 if kind == "fp16" else 2**-8) + 2**-25


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16), b=st.integers(1, 6))
def test_lookup_decodes_each_rows_kind(kind, seed, b):
    rng = np.random.default_rng(seed)
    table = _table(rng)
    q = quantize_table(table, kind, name="items")
    assert isinstance(q, QuantizedRawIdTable) and q.kind == kind
    assert (q.capacity, q.dim, q.step, q.ids.tolist()) == (CAPACITY, DIM, 4, table.ids.tolist())
    decoded = q.get(table.ids)
    assert np.all(np.abs(decoded - table.rows) <= _bound(kind, table.rows))
    unknown = np.array([fresh_id(), 0, INT64_MIN + 1], np.int64)
    assert not q.get(unknown).any()  # exact zero rows
    lengths = rng.integers(0, 4, b)
    pool = np.concatenate([table.ids, unknown])
    values = rng.choice(pool, int(lengths.sum()))
    splits = np.concatenate([[0], np.cumsum(lengths)])
    weights = rng.uniform(0.2, 2.0, len(values)).astype(np.float32)
    got = em.serving_embedding_lookup(
        {"item": em.RaggedTensor(values, splits)},
        {"item": em.RaggedTensor(weights, splits)},
        {ITEMS: q},
        FEATURES,
    )["item"]
    rows = {int(i): r.astype(np.float64) for i, r in zip(table.ids, decoded)}
    want = reference(rows, values, splits, weights, "mean")
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_increments_on_the_quantized_table_equal_quantizing_the_float_one(kind):
    rng = np.random.default_rng(5)
    base = _table(rng, n=8)
    q = quantize_table(base, kind)
    for k in range(3):  # new ids, trained ids, evicted ids; up to the capacity
        ids = np.concatenate([rng.choice(base.ids, 3, replace=False), [fresh_id(), fresh_id()]])
        removed = np.setdiff1d(base.ids, ids)[:2]
        rows = rng.uniform(-1.0, 1.0, (len(ids), DIM)).astype(np.float32)
        update = em.RawIdUpdate(ids, rows, removed, since_step=base.step, step=base.step + 2)
        base, q = base.apply(update), q.apply(update)
        want = quantize_table(base, kind)
        assert isinstance(q, QuantizedRawIdTable) and q.step == base.step
        assert q.ids.tolist() == want.ids.tolist()
        assert q.padded.tobytes() == want.padded.tobytes(), k


def test_export_serving_round_trip_and_increments(tmp_path):
    rng = np.random.default_rng(11)
    base = _table(rng)
    q = quantize_table(base, "int8")

    def serve(inputs, tables):
        return em.serving_embedding_lookup(inputs, None, tables, FEATURES)

    manifest = export_serving(
        serve, tmp_path, tables={ITEMS: q}, input_signature={"item": Ragged(3, np.int64)}
    )
    (entry,) = manifest["tables"]
    assert entry["quantized"]["kind"] == "int8" and entry["raw_ids"]["step"] == 4
    server = load_serving(tmp_path)
    assert isinstance(server.tables["items"], QuantizedRawIdTable)

    def check(table):
        values = rng.choice(np.concatenate([table.ids, [fresh_id()]]), 6)
        inputs = {"item": em.RaggedTensor(values, np.array([0, 2, 2, 6]))}
        got = np.asarray(server(inputs)["item"])
        want = np.asarray(serve(inputs, {ITEMS: table})["item"])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    check(q)
    ids = np.array([base.ids[0], fresh_id()], np.int64)
    rows = rng.uniform(-1.0, 1.0, (2, DIM)).astype(np.float32)
    update = em.RawIdUpdate(ids, rows, base.ids[1:2], since_step=4, step=6)
    server.apply_increment({"items": update})
    assert server.tables["items"].padded.tobytes() == q.apply(update).padded.tobytes()
    check(q.apply(update))


def test_codes_and_requantizing_are_refused():
    rng = np.random.default_rng(0)
    table = _table(rng)
    with pytest.raises(ValueError, match="table items: a table of raw ids cannot be served as"):
        quantize_table(table, "codes", name="items")
    q = quantize_table(table, "fp16", name="items")
    assert quantize_table(q, "fp16") is q and quantize_table(q, None) is q
    with pytest.raises(ValueError, match=r"table items: already quantized \(fp16\)"):
        quantize_table(q, "int8", name="items")
