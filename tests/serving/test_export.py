"""Exported serving functions: dense, sparse and ragged inputs in padded buckets, tables
stored beside the programs, and a fresh process that loads and runs the export."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import SUPPORT as HERE  # the check's folder
from paths import child_pythonpath

import embedmesh as em
from embedmesh.serving.export import Dense, Ragged, Sparse, export_serving, load_serving

VIDEO = em.TableConfig(20000, 8, combiner="mean", name="video")
USER = em.TableConfig(500, 4, combiner="sum", name="user")
TAGS = em.TableConfig(200, 6, combiner="sqrtn", name="tags")
FEATURES = {
    "watched": em.FeatureConfig(VIDEO),
    "recent": em.FeatureConfig(VIDEO, max_sequence_length=3),
    "user": em.FeatureConfig(USER),
    "tags": em.FeatureConfig(TAGS),
}
SIGNATURE = {
    "features": {
        "watched": Ragged(nnz_per_example=4),
        "recent": Sparse((5,)),
        "user": Dense(),
        "tags": Sparse((4,), nnz_per_example=3),
    },
    "weights": {"tags": Sparse((4,), np.float32, nnz_per_example=3)},
}
BUCKETS = (1, 4, 16)


def make_tables(seed=0):
    rng = np.random.default_rng(seed)
    return {
        t: rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32)
        for t in (VIDEO, USER, TAGS)
    }


def make_params(seed=1):
    rng = np.random.default_rng(seed)
    width = 8 + 3 * 8 + 4 + 6
    return {
        "w1": rng.normal(size=(width, 16)).astype(np.float32) * 0.2,
        "b1": rng.normal(size=(16,)).astype(np.float32) * 0.1,
        "w2": rng.normal(size=(16, 1)).astype(np.float32) * 0.2,
    }


def serve(inputs, tables, params):
    """The seed's serving function: embedding lookups, then the model."""
    acts = em.serving_embedding_lookup(inputs["features"], inputs["weights"], tables, FEATURES)
    b = acts["user"].shape[0]
    x = jnp.concatenate(
        [acts["watched"], acts["recent"].reshape(b, -1), acts["user"], acts["tags"]], axis=-1
    )
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return {"score": (h @ params["w2"])[:, 0], "user_emb": acts["user"]}


def make_inputs(n, seed, long_row=None):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, n)
    if long_row is not None:
        lengths[long_row[0]] = long_row[1]
    watched = em.RaggedTensor.from_row_lengths(rng.integers(0, 20000, lengths.sum()), lengths)

    def sparse(width, vocab, p, dtype=None):
        idx = np.array(
            [[r, c] for r in range(n) for c in range(width) if rng.random() < p], np.int64
        ).reshape(-1, 2)
        vals = rng.integers(0, vocab, len(idx))
        return idx, vals

    r_idx, r_vals = sparse(5, 20000, 0.5)
    t_idx, t_vals = sparse(4, 200, 0.4)
    weights = rng.uniform(0.2, 2.0, len(t_idx)).astype(np.float32)
    return {
        "features": {
            "watched": watched,
            "recent": em.SparseTensor(r_idx, r_vals, (n, 5)),
            "user": rng.integers(0, 500, n),
            "tags": em.SparseTensor(t_idx, t_vals, (n, 4)),
        },
        "weights": {"tags": em.SparseTensor(t_idx, weights, (n, 4))},
    }


def reference(inputs, tables, params):
    """`serve` in numpy float64 after the host lookup kernel (concrete inputs): no eager
    jax op, so no compile for each batch size."""
    acts = em.serving_embedding_lookup(inputs["features"], inputs["weights"], tables, FEATURES)
    acts = {k: np.asarray(v, np.float64) for k, v in acts.items()}
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    b = acts["user"].shape[0]
    x = np.concatenate(
        [acts["watched"], acts["recent"].reshape(b, -1), acts["user"], acts["tags"]], axis=-1
    )
    h = np.maximum(x @ p["w1"] + p["b1"], 0.0)
    return {"score": (h @ p["w2"])[:, 0], "user_emb": acts["user"]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("export")
    tables, params = make_tables(), make_params()
    manifest = export_serving(
        serve,
        directory,
        tables=tables,
        params=params,
        input_signature=SIGNATURE,
        batch_sizes=BUCKETS,
        feature_config=FEATURES,
    )
    return directory, tables, params, manifest


@pytest.fixture(scope="module")
def loaded(exported):
    """The export loaded once, for the tests that only call it (its programs load once)."""
    return load_serving(exported[0])


def test_directory_layout_and_tables_not_baked(exported):
    directory, tables, params, manifest = exported
    files = sorted(os.listdir(directory))
    assert files == [
        "manifest.json",
        "params",
        "program_1.bin",
        "program_16.bin",
        "program_4.bin",
        "tables",
    ]
    assert json.load(open(os.path.join(directory, "manifest.json")))["batch_sizes"] == [1, 4, 16]
    for t in tables:
        np.testing.assert_array_equal(
            np.load(os.path.join(directory, "tables", f"{t.name}.npy")), tables[t]
        )
    table_bytes = sum(v.nbytes for v in tables.values())
    for b in BUCKETS:  # the programs take the tables as arguments: far smaller than them
        assert os.path.getsize(os.path.join(directory, f"program_{b}.bin")) < table_bytes / 10
    assert manifest["extra_row"] == 1


@pytest.mark.parametrize("n", [1, 3, 4, 9, 16, 40])
def test_loaded_function_matches_the_serving_function(exported, loaded, n):
    directory, tables, params, _ = exported
    fn = loaded
    inputs = make_inputs(n, seed=n)
    got = fn(inputs)
    want = reference(inputs, tables, params)
    assert set(got) == {"score", "user_emb"}
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_buckets_grow_for_long_rows_and_chunking(exported):
    directory, tables, params, _ = exported
    fn = load_serving(directory)
    used = []
    original = fn._program

    def spy(b):
        used.append(b)
        return original(b)

    fn._program = spy
    # one example of a batch of 2 has 30 ragged ids: needs the 16-bucket (capacity 64)
    inputs = make_inputs(2, seed=7, long_row=(1, 30))
    got = fn(inputs)
    assert used == [16]
    want = reference(inputs, tables, params)
    np.testing.assert_allclose(got["score"], want["score"], rtol=2e-5, atol=2e-6)
    # 40 examples with long rows: split into several chunks
    used.clear()
    inputs = make_inputs(40, seed=8, long_row=(20, 60))
    got = fn(inputs)
    assert len(used) >= 3
    want = reference(inputs, tables, params)
    np.testing.assert_allclose(got["score"], want["score"], rtol=2e-5, atol=2e-6)
    # a row longer than the largest bucket's capacity cannot be served
    with pytest.raises(ValueError, match=r"example 0 has 65 ids"):
        fn(make_inputs(1, seed=9, long_row=(0, 65)))


def test_input_errors(loaded):
    fn = loaded
    good = make_inputs(3, seed=1)
    bad = dict(good, features=dict(good["features"], user=np.zeros((4,), np.int64)))
    with pytest.raises(ValueError, match=r"batch size 4"):
        fn(bad)
    bad = dict(good, features=dict(good["features"], user=np.zeros((3, 2), np.int64)))
    with pytest.raises(ValueError, match=r"\['features'\]\['user'\]: expected shape"):
        fn(bad)
    bad = dict(good, features=dict(good["features"], recent=np.zeros((3, 5), np.int64)))
    with pytest.raises(ValueError, match="expected a SparseTensor"):
        fn(bad)
    with pytest.raises(ValueError, match="expected keys"):
        fn({"features": good["features"]})


def test_export_errors(tmp_path):
    tables = make_tables()
    with pytest.raises(ValueError, match="leading axis"):
        export_serving(
            lambda x, t: {"total": jnp.sum(x)},
            tmp_path,
            tables=tables,
            input_signature=Dense(),
            batch_sizes=(2,),
        )
    with pytest.raises(TypeError, match="must be Dense, Sparse or Ragged"):
        export_serving(
            lambda x, t: x,
            tmp_path,
            tables=tables,
            input_signature={"x": jax.ShapeDtypeStruct((2,), np.int32)},
        )
    with pytest.raises(ValueError, match="nnz_per_example must be >= 1"):
        Ragged(nnz_per_example=0)


def test_closure_and_dense_only_signature(tmp_path):
    """No params: the tables are still arguments; dense inputs need no hidden row."""
    tables = make_tables()
    feats = {"user": em.FeatureConfig(USER)}
    manifest = export_serving(
        lambda x, t: em.serving_embedding_lookup({"user": x}, None, t, feats)["user"] * 2.0,
        tmp_path,
        tables={USER: tables[USER]},
        input_signature=Dense(),
        batch_sizes=(2, 8),
    )
    assert manifest["extra_row"] == 0 and manifest["params"] == []
    ids = np.array([3, 499, 0, 7, 7])
    got = load_serving(tmp_path)(ids)
    np.testing.assert_array_equal(got, tables[USER][ids] * 2.0)


def test_fresh_process_loads_and_matches(exported, loaded, tmp_path):
    """A separate python process that imports only embedmesh and numpy runs the export."""
    directory, tables, params, _ = exported
    inputs = make_inputs(11, seed=11)
    in_process = loaded(inputs)
    f = inputs["features"]
    np.savez(
        tmp_path / "inputs.npz",
        n=11,
        watched_values=f["watched"].values,
        watched_splits=f["watched"].row_splits,
        recent_indices=f["recent"].indices,
        recent_values=f["recent"].values,
        user=f["user"],
        tags_indices=f["tags"].indices,
        tags_values=f["tags"].values,
        tags_weights=inputs["weights"]["tags"].values,
    )
    np.savez(tmp_path / "expected.npz", **in_process)
    env = dict(os.environ)
    # one CPU device: no mesh of any kind (conftest: the suite's XLA flags)
    env["XLA_FLAGS"] = os.environ.get("EMBEDMESH_TEST_XLA_FLAGS", "")
    env["PYTHONPATH"] = child_pythonpath()
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "export_load_check.py"),
            str(directory),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "expected.npz"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "identical outputs" in proc.stdout
    want = reference(inputs, tables, params)
    np.testing.assert_allclose(in_process["score"], want["score"], rtol=2e-5, atol=2e-6)
