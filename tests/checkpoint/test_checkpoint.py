"""Checkpoints: orbax save/restore across device counts and stackings, serving loads,
async saves, crash safety (a saving process killed with SIGKILL) and bit-identical resume."""

import gc
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import orbax.checkpoint as ocp
import pytest
from checkpoint_common import (
    HashInit,
    apply_copies,
    leaf_reads,
    make_batch,
    make_features,
    make_tables,
    train_step,
    variables_by_name,
)
from meshes import mesh_of
from paths import SUPPORT as HERE  # the workers' folder
from paths import child_pythonpath
from process_helpers import two_processes_save_and_restore

import embedmesh as em
from embedmesh import checkpoint as ckpt
from embedmesh.checkpoint import reading
from embedmesh.checkpoint import recut as ckpt_recut
from embedmesh.facade import MeshEmbedding
from embedmesh.layout.rows import logical_layout, row_layout


def engine(n, tables=None, stack_tables=True, optimizer=None):
    feats = make_features(tables or make_tables())
    return MeshEmbedding(
        feats, optimizer or em.Adagrad(0.1), mesh=mesh_of(n), stack_tables=stack_tables
    ), feats


def assert_same_variables(got: dict, want: dict, tables=None):
    for name in tables or want:
        assert set(got[name]) == set(want[name]), name
        for k in want[name]:
            np.testing.assert_array_equal(got[name][k], want[name][k], err_msg=f"{name}.{k}")


# ---------------------------------------------------------------------------
# Sources: trained on N devices, saved, then one more step recorded


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for n in (8, 4, 1):
        emb, feats = engine(n)
        for s in range(2):
            train_step(emb, feats, seed=s)
        path = tmp_path_factory.mktemp(f"ckpt{n}")
        assert ckpt.save(path, emb, others={"params": {"w": np.arange(6.0).reshape(2, 3)}})
        saved = variables_by_name(emb)
        acts = train_step(emb, feats, seed=2)
        out[n] = dict(path=path, saved=saved, next_acts=acts, next_vars=variables_by_name(emb))
    return out


def test_state_tree_layout_and_metadata(sources):
    emb, _ = engine(4)
    emb.build()
    tree = ckpt.state_tree(emb)
    meta = json.loads(bytes(tree["meta"]).decode())
    assert meta["format"] == "embedmesh.checkpoint" and meta["num_shards"] == 4
    assert meta["step"] == 0 and int(tree["step"]) == 0
    by_name = {m["name"]: m for m in meta["tables"]}
    assert by_name["d"]["optimizer"] == "Adam" and by_name["d"]["slots"] == [
        "momenta",
        "velocities",
    ]
    assert by_name["a"]["slots"] == ["accumulators"] and by_name["a"]["stack"] == "a+b+c"
    for t in emb.plan.tables:
        arr = tree["tables"][t.name]
        assert arr.shape == (4 * t.rows_per_shard, t.dim)
        # each device holds its own block: the table's rows on that shard
        for shard in arr.addressable_shards:
            j = (shard.index[0].start or 0) // t.rows_per_shard
            want = emb.embedding_table_shards[emb.plan.table_config(t)][j][1]
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want))
            assert shard.device == emb.mesh.devices.flat[j]
    # an orbax StandardSave pytree: saved beside dense params and read back with orbax alone
    meta_n8 = ckpt.read_metadata(sources[8]["path"])
    assert meta_n8["step"] == 2 and meta_n8["num_shards"] == 8
    mngr = ocp.CheckpointManager(sources[8]["path"])
    params = mngr.restore(
        2, args=ocp.args.Composite(params=ocp.args.StandardRestore({"w": np.zeros((2, 3))}))
    )["params"]
    np.testing.assert_array_equal(params["w"], np.arange(6.0).reshape(2, 3))
    mngr.close()


CASES = {  # (the source device counts, restored one after the other onto one engine, ...)
    "8to4": ((8,), 4, {}),
    "4to8_and_1to8": ((4, 1), 8, {}),
    "8to1": ((8,), 1, {}),
    "8to8_unstacked": ((8,), 8, dict(stack_tables=False)),
    "4to3_other_tables": ((4,), 3, dict(tables=make_tables(extra=True, drop_c=True))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_restore_on_other_device_counts_and_stackings(sources, case):
    """Each source restored onto the engine (a restore replaces whatever it held: a
    second source restored onto the trained engine is checked as the first)."""
    n_froms, n_to, kw = CASES[case]
    emb, feats = engine(n_to, **kw)
    for n_from in n_froms:
        _restore_and_step(emb, feats, sources[n_from], n_from, n_to, "tables" in kw)


def _restore_and_step(emb, feats, src, n_from, n_to, other_tables):
    if other_tables:
        with pytest.raises(ValueError, match="table e is not in the checkpoint"):
            ckpt.restore(emb, src["path"])
    with leaf_reads() as stats:
        step = ckpt.restore(emb, src["path"], **(dict(missing="keep") if other_tables else {}))
    assert step == 2 and int(emb.state.step) == 2
    # same device count: the stored blocks are this mesh's shards, read whole ("direct");
    # otherwise each new shard gathers its rows from the stored blocks ("resharded")
    assert set(stats) == ({"direct"} if n_from == n_to else {"resharded"})
    got = variables_by_name(emb)
    common = [n for n in src["saved"] if n in got]
    assert_same_variables(got, src["saved"], common)
    if other_tables:  # the new table keeps its initial values
        np.testing.assert_array_equal(
            got["e"]["parameters"], HashInit(5)(None, (11, 4), np.float32)
        )
        np.testing.assert_array_equal(got["e"]["accumulators"], np.full((11, 4), 0.1, np.float32))
    # next step: identical to the same values set directly on this mesh, and equal (up to
    # the order of float sums over devices) to the source's own next step
    acts = train_step(emb, feats, seed=2)
    after = variables_by_name(emb)
    emb.set_tables(
        {emb.plan.table_config(n): got[n]["parameters"] for n in got},
        {
            emb.plan.table_config(n): {k: v for k, v in got[n].items() if k != "parameters"}
            for n in got
        },
        step=2,
    )
    acts2 = train_step(emb, feats, seed=2)
    for k in acts:
        np.testing.assert_array_equal(acts[k], acts2[k], err_msg=k)
    assert_same_variables(variables_by_name(emb), after)
    if not other_tables:
        for k in acts:
            np.testing.assert_allclose(acts[k], src["next_acts"][k], rtol=1e-6, atol=1e-6)
        for name, d in src["next_vars"].items():
            for k, v in d.items():
                np.testing.assert_allclose(
                    after[name][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{name}.{k}"
                )


def test_rowwise_adagrad_round_trip_and_no_restore_from_adagrad(sources, tmp_path):
    """RowWiseAdagrad's [rows, 1] accumulators save and restore on another device count
    (and train on identically); an Adagrad checkpoint (per-element accumulators of the
    same name) restored into it, or its checkpoint into Adagrad, is a clear error."""
    opt = em.RowWiseAdagrad(0.2, epsilon=1e-3)
    emb, feats = engine(4, optimizer=opt)
    for s in range(2):
        train_step(emb, feats, seed=s)
    saved = variables_by_name(emb)
    for name in "abc":  # d keeps its own Adam
        d = saved[name]
        assert d["accumulators"].shape == (d["parameters"].shape[0], 1), name
        assert (d["accumulators"] > 0).any(), name  # trained: not the initial zeros
    assert ckpt.save(tmp_path / "rw", emb)
    acts = train_step(emb, feats, seed=2)
    other, _ = engine(2, optimizer=opt)
    assert ckpt.restore(other, tmp_path / "rw") == 2
    assert_same_variables(variables_by_name(other), saved)
    acts2 = train_step(other, feats, seed=2)
    for k in acts:
        np.testing.assert_allclose(acts2[k], acts[k], rtol=1e-6, atol=1e-6, err_msg=k)
    with pytest.raises(ValueError, match="optimizer is Adagrad, this one RowWiseAdagrad"):
        ckpt.restore(other, sources[4]["path"])  # the built engine: no second build
    with pytest.raises(ValueError, match="optimizer is RowWiseAdagrad, this one Adagrad"):
        ckpt.restore(engine(2)[0], tmp_path / "rw")


def test_restore_streams_one_table_at_a_time(tmp_path, monkeypatch):
    """Restoring N=4 -> M=2 reads one leaf (one table or slot) at a time, and the host
    memory it allocates on top (that table's shards in the new layout, which on CPU become
    the device buffers) stays near one table, while the state is 16 tables' worth."""
    tables = {
        f"t{i}": em.TableConfig(20000, 16, name=f"t{i}", initializer=HashInit(i)) for i in range(8)
    }
    feats = {f"f{i}": em.FeatureConfig(t) for i, t in enumerate(tables.values())}
    src = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(4))
    src.build()
    ckpt.save(tmp_path, src)
    table_bytes = 20000 * 16 * 4
    dst = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(2))
    ckpt.restore(dst, tmp_path)  # compiles the writers: measure the next restore only
    dst.set_tables({t: np.zeros((20000, 16), np.float32) for t in tables.values()})
    reads = []
    original = reading.TreeReader.start_fill

    def counting_fill(self, path, copies):
        # bytes of the distinct buffers this read fills: the table's new shards
        reads.append((path, sum({id(c[0]): c[0].nbytes for c in copies}.values())))
        return original(self, path, copies)

    monkeypatch.setattr(reading.TreeReader, "start_fill", counting_fill)
    tracemalloc.start()
    tracemalloc.reset_peak()
    ckpt.restore(dst, tmp_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    data_reads = [r for r in reads if r[0][0] != "meta"]
    assert len(data_reads) == 16  # 8 tables x (parameters, accumulators), one read each
    assert max(n for _, n in data_reads) == table_bytes
    state_bytes = 16 * table_bytes
    # (tracemalloc counts every thread of the process: in a full run the worker's other
    # threads added ~0.1 table once, 2.58 tables in all; a whole-state read is 16)
    assert peak < 2.65 * table_bytes < state_bytes / 6, (peak, table_bytes, state_bytes)
    assert_same_variables(variables_by_name(dst), variables_by_name(src))


def _file_bytes_read():
    import tensorstore as ts

    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        return sum(v.get("value", 0) for v in m["values"])
    return 0


def test_load_tables_for_serving_reads_parameters_only(sources, tmp_path):
    # random (incompressible) tables so that bytes on disk track bytes of data
    rng = np.random.default_rng(0)
    tables = {n: em.TableConfig(20000, 8, name=n) for n in ("u", "v")}
    feats = {"fu": em.FeatureConfig(tables["u"]), "fv": em.FeatureConfig(tables["v"])}
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(4))
    values = {t: rng.normal(size=(20000, 8)).astype(np.float32) for t in tables.values()}
    slots = {
        t: {"accumulators": rng.uniform(0.1, 2, (20000, 8)).astype(np.float32)}
        for t in tables.values()
    }
    emb.set_tables(values, slots, step=7)
    ckpt.save(tmp_path, emb)
    before = _file_bytes_read()
    loaded = ckpt.load_tables(tmp_path, feature_config=feats)
    read = _file_bytes_read() - before
    params_bytes = 2 * 20000 * 8 * 4
    assert params_bytes * 0.5 < read < params_bytes * 1.05 + 200_000, (read, params_bytes)
    assert set(loaded) == set(tables.values())  # keyed by the user's TableConfigs
    for t, v in loaded.items():
        assert isinstance(v, np.ndarray)
        np.testing.assert_array_equal(v, values[t])
    # without a feature config: new TableConfigs with the saved names, sizes and combiners
    plain = ckpt.load_tables(sources[8]["path"])
    assert sorted(t.name for t in plain) == ["a", "b", "c", "d"]
    for t, v in plain.items():
        np.testing.assert_array_equal(v, sources[8]["saved"][t.name]["parameters"])
        assert v.shape == (t.vocabulary_size, t.dim)
    assert {t.name: t.combiner for t in plain} == {
        "a": "mean",
        "b": "sqrtn",
        "c": "sum",
        "d": "sum",
    }


def test_restore_and_load_tables_retain_no_objects(sources, caplog):
    """Reading a checkpoint keeps nothing per call, so save + restore cycles do not grow
    memory on its account (issue 24, item 11; benchmarks/checkpoint/checkpoint_rss.py): orbax's
    `metadata()` of the item retained every array's spec (tensorstore 0.1.86's
    `Spec.to_json` leaks the nested values it returns)."""
    emb, _ = engine(4)
    path = sources[8]["path"]

    def retained(read):
        # the objects alive before frozen, out of the collections and counts below: they
        # walk what the reads make, not all of a whole suite's worker (millions of objects)
        gc.freeze()
        try:
            read()  # compiles, fills caches
            gc.collect()
            before = len(gc.get_objects())
            for _ in range(4):
                read()
            gc.collect()
            return len(gc.get_objects()) - before
        finally:
            gc.unfreeze()

    # the package's INFO records (a restore logs its progress) are kept by pytest's log
    # capture where a logger is at INFO: records, not the reading code's, so not counted
    with caplog.at_level(logging.WARNING, logger="embedmesh"):
        assert retained(lambda: ckpt.restore(emb, path)) <= 8
        assert retained(lambda: ckpt.load_tables(path)) <= 8


@pytest.mark.parametrize("n_from,n_to", [(1, 8), (2, 3), (8, 4), (4, 4)])
def test_restore_reads_each_stored_byte_once(tmp_path, n_from, n_to):
    """Every new shard gathers strided rows from several stored blocks (and 1 -> 8 reads
    each block into eight shards); the reads of one table go out as one batch, so each
    stored chunk is read from disk once: bytes read ~ bytes stored, values exact."""
    rng = np.random.default_rng(n_from * 10 + n_to)
    tables = {n: em.TableConfig(v, 8, name=n) for n, v in (("u", 20001), ("w", 9000))}
    feats = {"fu": em.FeatureConfig(tables["u"]), "fw": em.FeatureConfig(tables["w"])}
    values = {
        t: rng.normal(size=(t.vocabulary_size, 8)).astype(np.float32) for t in tables.values()
    }
    slots = {
        t: {"accumulators": rng.uniform(0.1, 2, (t.vocabulary_size, 8)).astype(np.float32)}
        for t in tables.values()
    }
    src = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(n_from))
    src.set_tables(values, slots, step=3)
    ckpt.save(tmp_path, src)
    stored = sum(2 * t.vocabulary_size * 8 * 4 for t in tables.values())  # params + accs
    dst = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(n_to))
    before = _file_bytes_read()
    assert ckpt.restore(dst, tmp_path) == 3
    read = _file_bytes_read() - before
    assert stored <= read < stored * 1.05 + 200_000, (read, stored)
    got = variables_by_name(dst)
    for t in tables.values():
        np.testing.assert_array_equal(got[t.name]["parameters"], values[t])
        np.testing.assert_array_equal(got[t.name]["accumulators"], slots[t]["accumulators"])


def test_embedding_for_serving(sources):
    tables = make_tables()
    feats = make_features(tables)
    serving = ckpt.EmbeddingForServing(feats, em.SGD(0.1))
    assert serving.restore(sources[4]["path"]) == 2
    for t, v in serving.embedding_tables.items():
        np.testing.assert_array_equal(v, sources[4]["saved"][t.name]["parameters"])
    batch = make_batch(feats, seed=5)
    got = serving(batch)
    want = em.serving_embedding_lookup(
        batch, None, {tables[n]: sources[4]["saved"][n]["parameters"] for n in tables}, feats
    )
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_restore_errors(sources, tmp_path):
    path = sources[8]["path"]
    small = make_tables()
    small["a"] = em.TableConfig(36, 5, name="a")
    emb, _ = engine(2, tables=small)
    before = variables_by_name(emb)
    with pytest.raises(ValueError, match=r"table a: the checkpoint has \[37, 5\]"):
        ckpt.restore(emb, path)
    assert_same_variables(variables_by_name(emb), before)  # untouched
    emb, _ = engine(2, optimizer=em.Adam(0.1))  # other slots than the checkpoint's Adagrad
    with pytest.raises(ValueError, match="slot 'momenta' of table a"):
        ckpt.restore(emb, path)
    ckpt.restore(emb, path, missing="keep")  # parameters restored, Adam slots kept
    np.testing.assert_array_equal(
        variables_by_name(emb)["a"]["parameters"], sources[8]["saved"]["a"]["parameters"]
    )
    with pytest.raises(ValueError, match="missing must be one of"):
        ckpt.restore(emb, path, missing="init")
    with pytest.raises(FileNotFoundError):
        ckpt.restore(emb, tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no committed step 9"):
        ckpt.restore(emb, path, step=9)
    with pytest.raises(ValueError, match="not an embedmesh checkpoint"):
        ckpt.restore(emb, path, item="params")
    with pytest.raises(ValueError, match="table zz is not in the checkpoint"):
        ckpt.load_tables(
            path, feature_config={"y": em.FeatureConfig(em.TableConfig(5, 2, name="zz"))}
        )
    with pytest.raises(ValueError, match=r"table a: the checkpoint has \[37, 5\]"):
        ckpt.load_tables(
            path, feature_config={"y": em.FeatureConfig(em.TableConfig(5, 2, name="a"))}
        )


# ---------------------------------------------------------------------------
# Async saves beside dense parameters, and bit-identical resume


def test_async_save_and_bit_identical_resume(tmp_path):
    emb, feats = engine(4)
    for s in range(2):
        train_step(emb, feats, seed=s)
    params = {"dense": {"w": np.linspace(0, 1, 12).reshape(3, 4).astype(np.float32)}}
    at_save = variables_by_name(emb)
    mngr = ocp.CheckpointManager(
        tmp_path,
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=2),
    )
    mngr.save(
        2,
        args=ocp.args.Composite(
            embedding=ckpt.save_args(emb), params=ocp.args.StandardSave(params)
        ),
    )
    # keep training while the save is written: tables are donated and updated in place
    for s in range(2, 5):
        train_step(emb, feats, seed=s)
    mngr.wait_until_finished()
    assert mngr.latest_step() == 2
    final = variables_by_name(emb)

    resumed, _ = engine(4)
    assert ckpt.restore(resumed, mngr) == 2
    assert_same_variables(variables_by_name(resumed), at_save)  # the save saw step 2
    restored = mngr.restore(2, args=ocp.args.Composite(params=ocp.args.StandardRestore(params)))[
        "params"
    ]
    np.testing.assert_array_equal(restored["dense"]["w"], params["dense"]["w"])
    for s in range(2, 5):
        train_step(resumed, feats, seed=s)
    assert int(resumed.state.step) == int(emb.state.step) == 5
    assert_same_variables(variables_by_name(resumed), final)  # bit-identical
    mngr.close()


def test_save_into_manager_with_others_and_policies(tmp_path):
    emb, _ = engine(2)
    emb.build()
    mngr = ocp.CheckpointManager(
        tmp_path,
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=1),
    )
    assert ckpt.save(mngr, emb, others={"opt": {"count": np.int32(3)}}, wait=True)
    assert ckpt.save(mngr, emb, step=5, wait=True)
    assert mngr.all_steps() == [5] and ckpt.latest_step(tmp_path) == 5
    with pytest.raises(ValueError, match="names the embedding item"):
        ckpt.save(mngr, emb, step=6, others={"embedding": {}})
    mngr.close()
    assert ckpt.read_metadata(tmp_path / "5")["step"] == 0
    assert ckpt.read_metadata(tmp_path / "5" / "embedding")["num_shards"] == 2


# ---------------------------------------------------------------------------
# Crash safety: a saving process killed with SIGKILL


def _env(devices=4):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} " + os.environ.get(
        "EMBEDMESH_TEST_XLA_FLAGS", ""
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH", ""))
    return env


@pytest.mark.parametrize("kill_at", ["before_commit", "while_writing"])
def test_save_killed_midway_leaves_previous_checkpoint(tmp_path, kill_at):
    """The child saves step 1, then starts step 2 and is SIGKILLed: before the final rename
    (everything written, not committed), or while array data is being written."""
    root = tmp_path / "ckpt"
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "checkpoint_kill_worker.py"),
            str(root),
            str(marker),
            kill_at,
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.time() < deadline, "the worker never reached the kill point"
            time.sleep(0.005)
        if kill_at == "while_writing":  # kill once step 2's temporary directory appears
            while not any(".orbax-checkpoint-tmp" in p.name for p in root.iterdir()):
                assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
                assert time.time() < deadline
                time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "2").exists()  # step 2 was never committed
    leftovers = [p.name for p in root.iterdir()]
    assert any(".orbax-checkpoint-tmp" in n for n in leftovers), leftovers

    assert ckpt.latest_step(root) == 1
    mngr = ocp.CheckpointManager(root)
    assert mngr.latest_step() == 1 and mngr.all_steps() == [1]
    tables = make_tables()
    feats = make_features(tables)
    emb = MeshEmbedding(feats, em.Adagrad(0.1), mesh=mesh_of(2))
    assert ckpt.restore(emb, mngr) == 1
    want = np.load(tmp_path / "marker.step1.npz")
    for t, d in variables_by_name(emb).items():
        for k, v in d.items():
            np.testing.assert_array_equal(v, want[f"{t}.{k}"])
    # saving step 2 again into the same directory works and becomes the latest
    assert ckpt.save(mngr, emb, step=2, wait=True)
    assert mngr.latest_step() == 2
    mngr.close()


# ---------------------------------------------------------------------------
# Two processes, each writing its own shards; restored in one process on other meshes


def test_two_processes_save_their_own_shards(tmp_path):
    root, outs = two_processes_save_and_restore(tmp_path, "mod")
    root = pathlib.Path(root)
    item = root / "3" / "embedding"
    assert (item / "ocdbt.process_0").exists() and (item / "ocdbt.process_1").exists()
    want = np.load(root.parent / "expected.npz")
    for n in (8, 1):
        emb = MeshEmbedding(make_features(make_tables()), em.Adagrad(0.1), mesh=mesh_of(n))
        assert ckpt.restore(emb, root) == 3
        for t, d in variables_by_name(emb).items():
            for k, v in d.items():
                np.testing.assert_array_equal(v, want[f"{t}.{k}"], err_msg=f"{n} {t}.{k}")
    assert all("restored ok (mod)" in out for out in outs), outs


def placed_on(meta: dict, n: int, rotation: int):
    """A table of `meta`'s size laid out on n shards with `rotation` (mod layout)."""
    return ckpt_recut.stored_table(
        dict(meta, rows_per_shard=-(-meta["vocabulary_size"] // n), rotation=rotation), n
    )


def recut(meta: dict, n_from: int, n_to: int, rotation: int, shard: int) -> list:
    """The copy list of stored blocks of n_from shards -> new shard `shard` of n_to."""
    return ckpt_recut.recut_copies(
        row_layout("mod", n_from),
        ckpt_recut.stored_table(meta, n_from),
        row_layout("mod", n_to),
        placed_on(meta, n_to, rotation),
        shard,
    )


def to_logical(meta: dict, n: int) -> list:
    """The copy list of stored blocks of n shards -> the logical table."""
    return ckpt_recut.recut_copies(
        row_layout("mod", n),
        ckpt_recut.stored_table(meta, n),
        logical_layout(),
        ckpt_recut.logical_table(meta),
        0,
    )


def test_reshard_rows_matches_the_layout_for_any_shard_counts():
    """The strided re-cut of stored blocks equals the mod-sharded layout of the table."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        v, n, m = int(rng.integers(1, 60)), int(rng.integers(1, 9)), int(rng.integers(1, 9))
        rot_old, rot = int(rng.integers(0, n)), int(rng.integers(0, m))
        rps_old, rps = -(-v // n), -(-v // m)
        table = rng.normal(size=(v, 3))
        stored = np.zeros((n * rps_old, 3))
        for j in range(n):
            rows = table[(j - rot_old) % n :: n]
            stored[j * rps_old : j * rps_old + len(rows)] = rows
        meta = {
            "name": "x",
            "vocabulary_size": v,
            "rows_per_shard": rps_old,
            "rotation": rot_old,
            "dim": 3,
        }
        for k in range(m):
            out = np.full((rps, 3), np.nan)
            apply_copies(stored, recut(meta, n, m, rot, k), out)
            want = table[(k - rot) % m :: m]
            np.testing.assert_array_equal(out[: len(want)], want)
        np.testing.assert_array_equal(
            apply_copies(stored, to_logical(meta, n), np.full((v, 3), np.nan)), table
        )


def test_reader_fills_strided_rows_with_a_cast(sources):
    """The tensorstore copy lists (what restore and load_tables use) against numpy, into a
    buffer of another dtype (the stored float32 is cast on the fly)."""
    path = reading.item_directory(sources[4]["path"], None, ckpt.DEFAULT_ITEM)
    with reading.TreeReader(path) as reader:
        m = next(t for t in reader.meta["tables"] if t["name"] == "d")
        leaf = ("tables", m["key"])
        stored = np.asarray(reader.read(leaf))
        for n_to, rot in ((3, 1), (8, 5), (4, m["rotation"])):
            rps = -(-m["vocabulary_size"] // n_to)
            for j in range(n_to):
                copies = recut(m, 4, n_to, rot, j)
                want = apply_copies(stored, copies, np.zeros((rps, m["dim"]), np.float32))
                got = np.zeros((rps, m["dim"]), np.float64)
                reading.wait_all(reader.start_fill(leaf, [(got,) + c for c in copies]))
                np.testing.assert_array_equal(got, want.astype(np.float64))
        logical = np.zeros((m["vocabulary_size"], m["dim"]), np.float64)
        reading.wait_all(reader.start_fill(leaf, [(logical,) + c for c in to_logical(m, 4)]))
        np.testing.assert_array_equal(logical, sources[4]["saved"]["d"]["parameters"])


@pytest.mark.parametrize("use_zarr3", [False, True])
@pytest.mark.parametrize("use_ocdbt", [False, True])
def test_hand_made_read_spec_matches_orbax(use_zarr3, use_ocdbt):
    """Restore reads through orbax's private read spec; if orbax moves it, the
    hand-made spec stands in, and this keeps it equal to orbax's."""
    from embedmesh import _compat
    from embedmesh.checkpoint import reading

    # test_compat fails when orbax moves it; the hand-made spec must still equal the last one
    assert _compat.orbax_tensorstore_utils() is not None
    args = ("/tmp/some/ckpt/0/embedding", "tables.t0.parameters", use_zarr3, use_ocdbt)
    assert reading._read_spec(*args, from_orbax=False) == reading._read_spec(*args)


def test_restore_through_the_hand_made_read_spec(sources, monkeypatch):
    from embedmesh import _compat

    monkeypatch.setattr(_compat, "orbax_tensorstore_utils", lambda: None)
    src = sources[8]
    emb, _ = engine(4)
    assert ckpt.restore(emb, src["path"]) == 2
    assert_same_variables(variables_by_name(emb), src["saved"])
