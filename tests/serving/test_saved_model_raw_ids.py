"""export_saved_model with a table of raw 64-bit ids (`TableConfig.id_map`, issue 42): the
SavedModel, loaded by TensorFlow alone in a fresh process, finds each raw id's row by
its binary search and serves what a float64 reference over `{raw id: row}` gives (an
unknown id a zero row, counted in a mean's weights), beside a static table, for ragged
(weighted), dense and sparse inputs, int64 and uint64 ids, the int64 extremes and
negative ids; a wrong kind of table is a ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest
from process_helpers import check_saved_model
from test_serving_raw_ids import DIM, INT64_MAX, INT64_MIN, reference

import embedmesh as em
from embedmesh.serving import Dense, Ragged, Sparse

pytest.importorskip("tensorflow")
from embedmesh.serving.saved_model import export_saved_model

CAPACITY = 16
ITEMS = em.TableConfig(CAPACITY, DIM, combiner="mean", name="items", id_map=em.DynamicIds())
USERS = em.TableConfig(10, DIM, combiner="sum", name="users")
FEATURES = {
    "item": em.FeatureConfig(ITEMS),
    "item_pair": em.FeatureConfig(ITEMS),
    "item_sparse": em.FeatureConfig(ITEMS),
    "user": em.FeatureConfig(USERS),
}
SIGNATURE = {
    "item": Ragged(4, np.int64),
    "item_pair": Dense((2,), np.uint64),
    "item_sparse": Sparse((3,), np.int64),
    "user": Dense(),
}


def _raw_table(rng) -> em.RawIdTable:
    ids = np.unique(
        np.concatenate([[INT64_MIN, INT64_MAX, -1, 0], rng.integers(-(2**62), 2**62, 8)])
    )
    rows = (0.25 + rng.random((len(ids), DIM))).astype(np.float32)  # never zero
    return em.RawIdTable(ids, rows, CAPACITY, step=5)


def _draw_ids(rng, table: em.RawIdTable, n: int) -> np.ndarray:
    """Live ids and unknown ones (fresh draws, the neighbours of live ids)."""
    unknown = np.array([1, -2, INT64_MIN + 1, INT64_MAX - 1, 2**40 + 7], np.int64)
    pool = np.concatenate([table.ids, unknown, table.ids[1:] - 1])
    return rng.choice(pool, n)


def test_saved_model_serves_raw_ids_like_the_reference(tmp_path):
    rng = np.random.default_rng(12)
    table = _raw_table(rng)
    users = (0.5 + rng.random((10, DIM))).astype(np.float32)
    tables = {ITEMS: table, USERS: users}
    rows = {int(i): r for i, r in zip(table.ids, table.rows)}
    names = export_saved_model(
        lambda a: dict(a),
        tmp_path / "saved",
        tables=tables,
        feature_config=FEATURES,
        input_signature=SIGNATURE,
        weighted=("item",),
    )
    cases = {}
    for case, b in enumerate((1, 6)):
        lengths = rng.integers(0, 4, b)
        values = _draw_ids(rng, table, int(lengths.sum()))
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        weights = rng.uniform(0.1, 2.0, len(values)).astype(np.float32)
        pair = _draw_ids(rng, table, 2 * b).reshape(b, 2)
        idx = np.array([[s, c] for s in range(b) for c in range(int(rng.integers(0, 4)))])
        idx = idx.reshape(-1, 2).astype(np.int64)
        sparse_values = _draw_ids(rng, table, len(idx))
        user = rng.integers(0, 10, b).astype(np.int32)
        inputs = {
            names["item"]["values"]: values,
            names["item"]["row_splits"]: splits,  # int64, a tf.RaggedTensor's
            names["item"]["weights"]: weights,
            names["item_pair"]["ids"]: pair.view(np.uint64),
            names["item_sparse"]["indices"]: idx,
            names["item_sparse"]["values"]: sparse_values,
            names["item_sparse"]["dense_shape"]: np.array([b, 3], np.int64),
            names["user"]["ids"]: user,
        }
        sparse_splits = np.searchsorted(idx[:, 0], np.arange(b + 1)) if len(idx) else [0] * (b + 1)
        want = {
            "item": reference(rows, values, splits, weights, "mean"),
            "item_pair": np.array(
                [[rows.get(int(i), np.zeros(DIM)) for i in sample] for sample in pair], np.float64
            ),
            "item_sparse": reference(rows, sparse_values, sparse_splits, None, "mean"),
            "user": users[user].astype(np.float64),
        }
        # embedmesh's own lookup agrees with the reference on the same request
        got = em.serving_embedding_lookup(
            {
                "item": em.RaggedTensor(values, splits),
                "item_pair": pair.view(np.uint64),
                "item_sparse": em.SparseTensor(idx, sparse_values, (b, 3)),
                "user": user,
            },
            {"item": em.RaggedTensor(weights, splits), "item_pair": None},
            tables,
            FEATURES,
        )
        for k, v in want.items():
            np.testing.assert_allclose(np.asarray(got[k]), v, rtol=1e-6, atol=1e-6, err_msg=k)
            cases[f"case{case}/out/{k}"] = v.astype(np.float32)
        for k, v in inputs.items():
            cases[f"case{case}/in/{k}"] = v
    check_saved_model(tmp_path / "saved", cases, 2, tmp_path)


def test_a_wrong_kind_of_table_names_it(tmp_path):
    rng = np.random.default_rng(0)
    table = _raw_table(rng)
    users = np.ones((10, DIM), np.float32)
    cases = [
        ({ITEMS: np.ones((CAPACITY, DIM), np.float32), USERS: users}, "table items: a table of"),
        ({ITEMS: table, USERS: table}, "table users: a RawIdTable is for a table of raw ids"),
        (
            {ITEMS: em.RawIdTable([1], np.ones((1, DIM)), CAPACITY + 1), USERS: users},
            "table items: its RawIdTable has capacity 17",
        ),
    ]
    for tables, message in cases:
        with pytest.raises(ValueError, match=message):
            export_saved_model(
                lambda a: a["user"],
                tmp_path / "x",
                tables=tables,
                feature_config=FEATURES,
                input_signature=SIGNATURE,
            )


@pytest.mark.parametrize("spec", [Dense(), Ragged(4), Sparse((3,), np.int32)])
def test_a_raw_id_feature_with_32_bit_ids_in_the_signature_is_refused(tmp_path, spec):
    """`Dense()`'s default int32 for a feature of raw 64-bit ids: refused at export,
    naming the feature and the spec to give (a client casting its ids to the signature's
    type would otherwise send them cut to 32 bits)."""
    rng = np.random.default_rng(3)
    tables = {ITEMS: _raw_table(rng), USERS: (0.5 + rng.random((10, DIM))).astype(np.float32)}
    signature = {**SIGNATURE, "item_pair": spec}
    with pytest.raises(
        ValueError, match=r"feature item_pair: its table items holds raw 64-bit.*int64"
    ):
        export_saved_model(
            lambda a: dict(a),
            tmp_path / "m",
            tables=tables,
            feature_config=FEATURES,
            input_signature=signature,
        )
    assert not (tmp_path / "m").exists()
