"""Failed restores leave the live embedding untouched; damaged data is detected.

Issue #12, items 14 (a restore that fails on a late leaf destroyed the live state, and a
retry crashed the process) and 16 (flipped bytes in stored chunks restored as garbage)."""

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from checkpoint_common import save_edited, variables_by_name
from checkpoint_damage import chunk_locations, flip_bytes
from meshes import mesh_of

import embedmesh as em
from embedmesh import checkpoint as ckpt
from embedmesh.checkpoint import reading, restoring
from embedmesh.facade import MeshEmbedding

TABLES = {
    "u": em.TableConfig(3000, 8, name="u"),  # u and w share a stack
    "w": em.TableConfig(2000, 8, name="w"),
    "z": em.TableConfig(1500, 16, name="z", optimizer=em.Adam(0.05)),
}
FEATS = {f"f{n}": em.FeatureConfig(t) for n, t in TABLES.items()}


def random_engine(n, seed, step):
    """An engine on n devices whose tables and slots are random (no zeros, no constants)."""
    rng = np.random.default_rng(seed)
    emb = MeshEmbedding(FEATS, em.Adagrad(0.1), mesh=mesh_of(n))
    emb.build()
    values, slots = {}, {}
    for t in TABLES.values():
        values[t] = rng.normal(size=(t.vocabulary_size, t.dim)).astype(np.float32)
        names = emb.state.slots[emb.plan.stack_of(t).name]
        slots[t] = {
            k: rng.uniform(0.1, 2, (t.vocabulary_size, t.dim)).astype(np.float32) for k in names
        }
    emb.set_tables(values, slots, step=step)
    return emb


def assert_bit_identical(got: dict, want: dict):
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]), name
        for k in want[name]:
            a, b = got[name][k], want[name][k]
            assert a.dtype == b.dtype and a.shape == b.shape, (name, k)
            assert a.tobytes() == b.tobytes(), f"{name}.{k} changed"


def restore_order(emb):
    """[(table name, field)] in the order restore reads them (plan order)."""
    return [
        (t.name, f)
        for t in emb.plan.tables
        for f in ["parameters"] + list(emb.state.slots[t.stack])
    ]


def leaf_key(name, field):
    return f"tables.{name}" if field == "parameters" else f"slots.{name}.{field}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A good checkpoint of a 4-device engine (step 5), and its values."""
    root = tmp_path_factory.mktemp("good")
    emb = random_engine(4, seed=1, step=5)
    assert ckpt.save(root, emb)

    def save_again():  # the same values, another run of orbax's writers (another layout)
        again = tmp_path_factory.mktemp("good")
        assert ckpt.save(again, emb)
        return again

    return root, variables_by_name(emb), save_again


def copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------
# Item 14: a restore that fails late leaves the embedding exactly as it was


@pytest.mark.parametrize("n_to", [4, 2])  # same device count ("direct"), other ("resharded")
def test_failed_restore_leaves_state_untouched_and_retry_works(saved, tmp_path, n_to, monkeypatch):
    good_root, good_values, save_again = saved
    emb = random_engine(n_to, seed=2, step=9)
    order = [leaf_key(*x) for x in restore_order(emb)]
    # cut a data file at one of its chunks: that chunk and those after it in the file
    # are lost, and the restore fails at the first of their arrays it reads. Pick the cut
    # whose failure comes latest (not at the first array: the failure must come late).
    # orbax's writers place arrays in files in no fixed order, so every cut is considered,
    # and a layout with no late cut (the first array read first in every file) is saved
    # again.
    for attempt in range(5):
        bad_root = copy_checkpoint(good_root, tmp_path / f"bad{attempt}")
        locations = chunk_locations(bad_root / "5" / "embedding")
        chunks = {}  # file -> [(offset, array)]
        others = {}  # file -> the offsets of what is read before the arrays (meta, step)
        for key, (f, off, _length) in locations.items():
            if key.split("/")[0] in order:
                chunks.setdefault(f, []).append((off, key.split("/")[0]))
            else:
                others.setdefault(f, []).append(off)
        candidates = [(-1, 0, None, order[0])]
        for f, items in chunks.items():
            for off, _ in items:
                if any(o >= off for o in others.get(f, [])):
                    continue  # the cut would lose the metadata too: it fails first
                first_lost = min((a for o, a in items if o >= off), key=order.index)
                candidates.append((order.index(first_lost), off, f, first_lost))
        _, cut, file, lost = max(candidates)
        if order.index(lost) > 0:
            break
        good_root = save_again()
    assert order.index(lost) > 0, (lost, order)
    os.truncate(file, cut)

    placed = []
    original = restoring._place_leaf

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        placed.append(1)
        return out

    monkeypatch.setattr(restoring, "_place_leaf", spy)
    before = variables_by_name(emb)
    with pytest.raises(
        ValueError,
        match=rf"cannot read .*\(array '{lost}'\) from "
        rf"checkpoint item {bad_root}",
    ) as info:
        ckpt.restore(emb, bad_root)
    assert placed, "the restore failed before any leaf was written: not a late failure"
    assert "OUT_OF_RANGE" in str(info.value) or "DATA_LOSS" in str(info.value), info.value
    # the live embedding is usable and bit-identical
    assert_bit_identical(variables_by_name(emb), before)
    assert int(emb.state.step) == 9
    # a restore from the good checkpoint works and matches it
    assert ckpt.restore(emb, good_root) == 5
    assert_bit_identical(variables_by_name(emb), good_values)
    assert int(emb.state.step) == 5


def test_failed_restore_keeps_a_shared_stack_and_the_step(saved, tmp_path):
    """Corrupting the second table of a shared stack (u+w) fails after the first table was
    written into the new state: the live stack is untouched, and so is the step."""
    good_root, _, _ = saved
    bad_root = copy_checkpoint(good_root, tmp_path / "bad")
    emb = random_engine(2, seed=3, step=4)
    stack = emb.plan.table(TABLES["w"]).stack
    assert stack == emb.plan.table(TABLES["u"]).stack  # one stack
    order = restore_order(emb)
    assert order.index(("u", "parameters")) < order.index(("w", "parameters"))
    locations = chunk_locations(bad_root / "5" / "embedding")
    file, offset, length = locations["tables.w/1.0"]
    flip_bytes(file, offset + length // 3)
    before = variables_by_name(emb)
    live = emb.state.tables[stack]
    with pytest.raises(
        ValueError,
        match=r"parameters of table w \(array 'tables\.w'\) is "
        r"corrupted",
    ):
        ckpt.restore(emb, bad_root)
    assert emb.state.tables[stack] is live and not live.is_deleted()
    assert_bit_identical(variables_by_name(emb), before)
    assert int(emb.state.step) == 4


# ---------------------------------------------------------------------------
# Item 16: checksums of every stored array


def reference_checksum(logical: np.ndarray) -> str:
    """numpy reference of the documented checksum of a logical [V, ...] table."""
    with np.errstate(over="ignore"):
        w = np.ascontiguousarray(logical).view(np.uint32).reshape(logical.shape[0], -1)
        i = np.arange(w.shape[0], dtype=np.uint32)[:, None]
        k = np.arange(w.shape[1], dtype=np.uint32)[None, :]

        def fmix(h):
            h = h ^ (h >> np.uint32(16))
            h = h * np.uint32(0x85EBCA6B)
            h = h ^ (h >> np.uint32(13))
            h = h * np.uint32(0xC2B2AE35)
            return h ^ (h >> np.uint32(16))

        a = fmix(
            w ^ (i * np.uint32(0x9E3779B1) + k * np.uint32(0x85EBCA77) + np.uint32(0x165667B1))
        )
        b = fmix(
            (w * np.uint32(0x27D4EB2F))
            ^ (i * np.uint32(0xC2B2AE3D) + k * np.uint32(0x61C88647) + np.uint32(0x2545F491))
        )
        sa = int(a.astype(np.uint64).sum() % (1 << 32))
        sb = int(b.astype(np.uint64).sum() % (1 << 32))
    return f"{sa:08x}{sb:08x}"


def test_checksums_recorded_match_a_reference(saved):
    root, values, _ = saved
    meta = ckpt.read_metadata(root)
    assert meta["checksum"] == ckpt.CHECKSUM
    for m in meta["tables"]:
        assert set(m["checksums"]) == {"parameters"} | set(m["slots"])
        for field, value in m["checksums"].items():
            assert value == reference_checksum(values[m["name"]][field]), (m["name"], field)
    # a sum over logical rows: the same whatever the device count and stacking
    emb = random_engine(4, seed=1, step=5)
    for n in (1, 3):
        other = MeshEmbedding(FEATS, em.Adagrad(0.1), mesh=mesh_of(n), stack_tables=n == 3)
        other.set_tables(
            emb.embedding_tables,
            {
                t: {k: v for k, v in d.items() if k != "parameters"}
                for t, d in emb.variables.items()
            },
            step=5,
        )
        tree_meta = json.loads(bytes(ckpt.state_tree(other)["meta"]).decode())
        assert {m["name"]: m["checksums"] for m in tree_meta["tables"]} == {
            m["name"]: m["checksums"] for m in meta["tables"]
        }


def save_compressed(root, emb, step):
    mngr = ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    )
    mngr.save(step, args=ocp.args.Composite(embedding=ckpt.save_args(emb, compression=True)))
    mngr.wait_until_finished()
    mngr.close()


def stored_leaf(item_dir, leaf):
    """The stored array as orbax itself reads it (no embedmesh verification)."""
    with reading.TreeReader(item_dir) as reader:
        return np.asarray(reader.read(leaf))


@pytest.mark.parametrize("compression", [False, True])
@pytest.mark.parametrize("leaf", [("tables", "z"), ("slots", "u", "accumulators")])
def test_flipped_bytes_are_detected(tmp_path, compression, leaf):
    emb = random_engine(4, seed=4, step=6)
    values = variables_by_name(emb)
    root = tmp_path / "ckpt"
    if compression:
        save_compressed(root, emb, 6)
    else:
        assert ckpt.save(root, emb)
    item = root / "6" / "embedding"
    name = ".".join(leaf)
    good = stored_leaf(item, leaf)
    locations = chunk_locations(item)
    file, offset, length = locations[name + "/2.0"]
    assert length > 1000, length
    # 64 bytes, spread over the chunk's second half (compressed: its literals)
    flip_bytes(file, offset + length // 2, count=64, stride=max(1, length // 2 // 64 - 1))
    damaged = stored_leaf(item, leaf)  # orbax reads it without complaint: different values
    assert damaged.shape == good.shape and not np.array_equal(damaged, good)

    field = "parameters" if leaf[0] == "tables" else leaf[2]
    table = leaf[1]
    what = (
        rf"parameters of table {table} \(array 'tables\.{table}'\)"
        if field == "parameters"
        else rf"slot '{field}' of table {table} \(array 'slots\.{table}\.{field}'\)"
    )
    for n in (4, 2):
        target = random_engine(n, seed=5, step=1)
        before = variables_by_name(target)
        with pytest.raises(ValueError, match=what + " is corrupted") as info:
            ckpt.restore(target, root)
        assert str(item) in str(info.value)
        assert_bit_identical(variables_by_name(target), before)
        assert int(target.state.step) == 1
    serving = ckpt.EmbeddingForServing(FEATS)
    if field == "parameters":
        with pytest.raises(ValueError, match=what + " is corrupted"):
            ckpt.load_tables(root)
        with pytest.raises(ValueError, match=what + " is corrupted"):
            serving.restore(root)
    else:  # slots are never read for serving: the parameters load and are exact
        loaded = {t.name: v for t, v in ckpt.load_tables(root).items()}
        for t in TABLES:
            assert loaded[t].tobytes() == values[t]["parameters"].tobytes()
        assert serving.restore(root) == 6


def test_checkpoints_without_checksums_still_load(tmp_path):
    """A checkpoint of the format before checksums (no "checksum" keys in its metadata)
    restores and loads, unverified."""
    emb = random_engine(4, seed=6, step=3)
    values = variables_by_name(emb)

    def edit(meta):
        del meta["checksum"]
        for m in meta["tables"]:
            del m["checksums"]

    save_edited(tmp_path, emb, 3, edit)
    assert "checksum" not in ckpt.read_metadata(tmp_path)
    for n in (4, 2):
        target = random_engine(n, seed=7, step=0)
        assert ckpt.restore(target, tmp_path) == 3
        assert_bit_identical(variables_by_name(target), values)
    loaded = {t.name: v for t, v in ckpt.load_tables(tmp_path).items()}
    for t in TABLES:
        assert loaded[t].tobytes() == values[t]["parameters"].tobytes()


# ---------------------------------------------------------------------------
# Item 5: restore right after an async save


@pytest.fixture
def slow_commit(monkeypatch):
    """orbax's commit (the rename of a step's temporary directory) waits until `release`
    is set: a save stays in flight for as long as a test needs."""
    import threading

    release = threading.Event()
    atomicity = ocp.path.atomicity
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        for name in ("finalize", "finalize_async"):
            original = cls.__dict__.get(name)
            if original is None:
                continue
            if name == "finalize":

                def patched(self, *a, _original=original, **k):
                    assert release.wait(120), "the commit was never released"
                    return _original(self, *a, **k)
            else:

                async def patched(self, *a, _original=original, **k):
                    import asyncio

                    assert await asyncio.to_thread(release.wait, 120), "never released"
                    return await _original(self, *a, **k)

            monkeypatch.setattr(cls, name, patched)
    yield release
    release.set()


def _wait_for_orbax_temporary(directory, limit_s: float = 60.0) -> None:
    """Until orbax's temporary directory of a save in flight exists (its commit is held
    by `slow_commit`, so it stays); fails after `limit_s`."""
    import time

    end = time.monotonic() + limit_s
    while not any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir()):
        assert time.monotonic() < end, f"no orbax temporary directory in {directory}"
        time.sleep(0.01)


def test_restore_right_after_an_async_save(tmp_path, slow_commit):
    import threading

    emb = random_engine(4, seed=8, step=2)
    values = variables_by_name(emb)
    mngr = ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    mngr.save(2, args=ocp.args.Composite(embedding=ckpt.save_args(emb)))
    try:
        # in flight: only orbax's temporary directory exists (made by orbax's background
        # thread, maybe a moment after `save` returns: CI saw none at once under load)
        _wait_for_orbax_temporary(tmp_path)
        assert not (tmp_path / "2").exists()
        target = random_engine(2, seed=9, step=0)
        before = variables_by_name(target)
        # a path: the step is not committed yet, and the error says so
        with pytest.raises(FileNotFoundError, match=r"step 2 under .* is still being written"):
            ckpt.restore(target, tmp_path, step=2)
        with pytest.raises(FileNotFoundError, match="still being written"):
            ckpt.restore(target, tmp_path)  # no committed step at all yet
        with pytest.raises(FileNotFoundError, match="still being written"):
            ckpt.load_tables(tmp_path, step=2)
        assert_bit_identical(variables_by_name(target), before)
        # the manager: its save in flight is waited for (released a moment later)
        threading.Timer(0.5, slow_commit.set).start()
        assert ckpt.restore(target, mngr) == 2
        assert_bit_identical(variables_by_name(target), values)
    finally:
        slow_commit.set()
        mngr.wait_until_finished()
    # load_tables from a manager with a save in flight too
    slow_commit.clear()
    emb.set_tables({t: v + 1.0 for t, v in emb.embedding_tables.items()}, step=3)
    mngr.save(3, args=ocp.args.Composite(embedding=ckpt.save_args(emb)))
    try:
        assert not (tmp_path / "3").exists()
        threading.Timer(0.5, slow_commit.set).start()
        loaded = {t.name: v for t, v in ckpt.load_tables(mngr).items()}
        for t in TABLES:
            assert loaded[t].tobytes() == (values[t]["parameters"] + 1.0).tobytes()
    finally:
        slow_commit.set()
        mngr.close()


# ---------------------------------------------------------------------------
# Item 21: unreadable metadata gives an error naming the file


def _orbax_metadata_damages():
    def bad_byte(b):
        return b[:767] + b"\xff\xfe" + b[769:]

    def bad_json(b):
        return b[: len(b) // 2]

    def missing_keys(b):
        return json.dumps({"something": "else"}).encode()

    def not_an_object(b):
        return b"[1, 2, 3]"

    return {
        "bad_byte": bad_byte,
        "bad_json": bad_json,
        "missing_keys": missing_keys,
        "not_an_object": not_an_object,
    }


@pytest.mark.parametrize("damage", list(_orbax_metadata_damages()))
def test_garbled_orbax_metadata_names_the_file(saved, tmp_path, damage):
    root = copy_checkpoint(saved[0], tmp_path / "ckpt")
    file = root / "5" / "embedding" / "_METADATA"
    data = file.read_bytes()
    assert len(data) > 800
    file.write_bytes(_orbax_metadata_damages()[damage](data))
    emb = random_engine(2, seed=10, step=1)
    before = variables_by_name(emb)
    pattern = rf"checkpoint metadata file {file}"
    with pytest.raises(ValueError, match=pattern):
        ckpt.restore(emb, root)
    with pytest.raises(ValueError, match=pattern):
        ckpt.load_tables(root)
    with pytest.raises(ValueError, match=pattern):
        ckpt.read_metadata(root)
    with pytest.raises(ValueError, match=pattern):
        ckpt.EmbeddingForServing(FEATS).restore(root)
    assert_bit_identical(variables_by_name(emb), before)


def _save_with_meta_blob(root, emb, blob: bytes):
    tree = ckpt.state_tree(emb)
    tree["meta"] = np.frombuffer(blob, np.uint8).copy()
    mngr = ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    )
    mngr.save(1, args=ocp.args.Composite(embedding=ckpt.EmbeddingSave(tree)))
    mngr.wait_until_finished()
    mngr.close()


def _meta_damages(meta: dict) -> dict:
    def without(*path):
        m = json.loads(json.dumps(meta))
        node = m
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        return json.dumps(m).encode()

    good = json.dumps(meta).encode()
    return {
        "bad_bytes": good[:40] + b"\xff\xfe\xfd" + good[43:],
        "bad_json": good[:-10],
        "no_num_shards": without("num_shards"),
        "no_tables": without("tables"),
        "table_without_rows_per_shard": without("tables", 1, "rows_per_shard"),
        "tables_not_a_list": json.dumps(dict(meta, tables=7)).encode(),
    }


def test_garbled_embedding_metadata_names_the_item_and_key(tmp_path):
    emb = random_engine(4, seed=11, step=1)
    meta = json.loads(bytes(ckpt.state_tree(emb)["meta"]).decode())
    target = random_engine(2, seed=12, step=0)
    before = variables_by_name(target)
    for name, blob in _meta_damages(meta).items():
        root = tmp_path / name
        _save_with_meta_blob(root, emb, blob)
        item = root / "1" / "embedding"
        key = {
            "no_num_shards": "num_shards",
            "no_tables": "tables",
            "table_without_rows_per_shard": "rows_per_shard",
            "tables_not_a_list": "tables",
        }.get(name, "")
        pattern = rf"embedmesh metadata \(array 'meta'\) of checkpoint item {item}.*{key}"
        for call in (
            lambda: ckpt.restore(target, root),
            lambda: ckpt.load_tables(root),
            lambda: ckpt.read_metadata(root),
        ):
            with pytest.raises(ValueError, match=pattern):
                call()
        assert_bit_identical(variables_by_name(target), before)


def test_relative_paths_save_and_restore(tmp_path, monkeypatch):
    """Issue #40: a relative checkpoint directory works (taken from the working directory
    at the call) for every entry point, where orbax wanted an absolute path and a restore
    first said it could not read the embedmesh metadata, as if the checkpoint were
    damaged."""
    monkeypatch.chdir(tmp_path)
    emb = random_engine(2, seed=5, step=3)
    want = variables_by_name(emb)
    assert ckpt.save("ckpt", emb)
    assert (tmp_path / "ckpt" / "3" / "embedding").is_dir()
    other = random_engine(2, seed=6, step=9)
    assert ckpt.restore(other, "ckpt") == 3
    assert_bit_identical(variables_by_name(other), want)
    assert ckpt.latest_step("ckpt") == 3 and ckpt.read_metadata("ckpt")["step"] == 3
    loaded = ckpt.load_tables(os.path.join("ckpt", "3"), feature_config=FEATS)
    np.testing.assert_array_equal(loaded[TABLES["z"]], want["z"]["parameters"])
    serving = ckpt.EmbeddingForServing(FEATS)
    assert serving.restore(os.path.join(".", "ckpt", "3", "embedding")) == 3
    # the functional core's entry points, and a path with ".." in it
    os.mkdir("sub")
    assert ckpt.core_save(os.path.join("sub", "..", "core_ckpt"), emb.core, emb.state, step=4)
    third = random_engine(2, seed=7, step=1)
    assert (tmp_path / "core_ckpt" / "4" / "embedding").is_dir()
    restored = ckpt.core_restore(third.core, third.state, "core_ckpt")
    assert restored.step == 3  # the state's step count, saved as checkpoint step 4
    third.install_restored(restored)
    assert_bit_identical(variables_by_name(third), want)


def test_saving_through_a_manager_on_a_relative_path_says_so(tmp_path, monkeypatch):
    """A user's own manager opened on a relative directory cannot save (orbax writes to
    absolute paths only): a ValueError saying so before anything is written, instead of
    orbax's error from its writer thread after it made a temporary step."""
    monkeypatch.chdir(tmp_path)
    emb = random_engine(2, seed=5, step=3)
    mngr = ocp.CheckpointManager("rel")
    try:
        with pytest.raises(ValueError, match=r"directory 'rel' is relative.*os.path.abspath"):
            ckpt.save(mngr, emb)
        assert not (tmp_path / "rel").exists() or not os.listdir(tmp_path / "rel")
    finally:
        mngr.close()
    # a manager on the absolute path saves, and a restore through a relative path reads it
    with ocp.CheckpointManager(os.path.abspath("rel")) as mngr:
        assert ckpt.save(mngr, emb, wait=True)
    other = random_engine(2, seed=6, step=9)
    assert ckpt.restore(other, "rel") == 3
    assert_bit_identical(variables_by_name(other), variables_by_name(emb))
