"""Shared helpers of the checkpoint tests and their subprocess workers (not a test module)."""

import collections
import contextlib
import logging

import numpy as np

import embedmesh as em


def apply_copies(stored: np.ndarray, copies: list, out: np.ndarray) -> np.ndarray:
    """numpy reference of a copy list (checks the index arithmetic of the re-cut)."""
    for d0, dstep, s0, sstep, rows in copies:
        if rows > 0:
            out[d0 : d0 + dstep * (rows - 1) + 1 : dstep] = stored[
                s0 : s0 + sstep * (rows - 1) + 1 : sstep
            ]
    return out


class HashInit:
    """Row-aware, cheap, shard-count independent pseudo-random initializer."""

    def __init__(self, seed: float = 0.0):
        self.seed = float(seed)

    def rows(self, row_ids, dim, dtype):
        r = np.asarray(row_ids, np.float64).reshape(-1, 1)
        c = np.arange(dim)[None, :]
        return (np.sin(r * 12.9898 + c * 78.233 + self.seed) * 0.5).astype(dtype)

    def __call__(self, key, shape, dtype=np.float32):
        return self.rows(np.arange(shape[0]), int(np.prod(shape[1:])), dtype).reshape(shape)


def make_tables(extra: bool = False, drop_c: bool = False):
    """Tables a, b, c stack (dims pad to 8); d has its own dim and optimizer (Adam)."""
    tables = {
        "a": em.TableConfig(37, 5, combiner="mean", name="a", initializer=HashInit(1)),
        "b": em.TableConfig(23, 8, combiner="sqrtn", name="b", initializer=HashInit(2)),
        "c": em.TableConfig(3, 3, combiner="sum", name="c", initializer=HashInit(3)),
        "d": em.TableConfig(
            300, 16, combiner="sum", name="d", initializer=HashInit(4), optimizer=em.Adam(0.05)
        ),
    }
    if extra:
        tables["e"] = em.TableConfig(11, 4, combiner="mean", name="e", initializer=HashInit(5))
    if drop_c:
        del tables["c"]
    return tables


def make_features(tables):
    t = tables
    feats = {
        "fa": em.FeatureConfig(t["a"]),
        "fb": em.FeatureConfig(t["b"]),
        "seq": em.FeatureConfig(t["a"], max_sequence_length=2),
        "fd": em.FeatureConfig(t["d"]),
    }
    if "c" in t:
        feats["fc"] = em.FeatureConfig(t["c"])
    if "e" in t:
        feats["fe"] = em.FeatureConfig(t["e"])
    return feats


def make_batch(feats, seed: int, batch: int = 24):
    """Deterministic inputs for every feature: ragged, sparse and dense kinds."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, f in sorted(feats.items()):
        vocab = f.table.vocabulary_size
        if name in ("fa", "seq"):
            lengths = rng.integers(0, 4, batch)
            out[name] = em.RaggedTensor.from_row_lengths(
                rng.integers(0, vocab, lengths.sum()), lengths
            )
        elif name == "fb":
            idx = np.array(
                [[b, c] for b in range(batch) for c in range(3) if rng.random() < 0.6], np.int64
            ).reshape(-1, 2)
            out[name] = em.SparseTensor(idx, rng.integers(0, vocab, len(idx)), (batch, 3))
        else:
            out[name] = rng.integers(0, vocab, (batch, 2) if name == "fd" else (batch,))
    return out


def train_step(emb, feats, seed: int, batch: int = 24):
    """One lookup + update with deterministic gradients; returns the activations (numpy)."""
    acts, preserved = emb(make_batch(feats, seed, batch))
    rng = np.random.default_rng(10_000 + seed)
    grads = {k: rng.normal(size=a.shape).astype(np.float32) for k, a in sorted(acts.items())}
    emb.apply_gradients(grads, preserved)
    return {k: np.asarray(v) for k, v in acts.items()}


def variables_by_name(emb) -> dict:
    return {t.name: {k: np.asarray(v) for k, v in d.items()} for t, d in emb.variables.items()}


def trained_checkpoints(tmp_path_factory, specs: dict, engine) -> dict:
    """`{name: dict(path, saved, emb)}`: for each `name: (devices, sharding)` of `specs`, an
    `engine(devices, sharding)` (-> `(emb, feats)`) trained two steps and saved."""
    from embedmesh import checkpoint as ckpt

    out = {}
    for name, (n, sharding) in specs.items():
        emb, feats = engine(n, sharding)
        for s in range(2):
            train_step(emb, feats, seed=s)
        path = tmp_path_factory.mktemp(name)
        assert ckpt.save(path, emb)
        out[name] = dict(path=path, saved=variables_by_name(emb), emb=emb)
    return out


def save_edited(root, emb, step: int, edit) -> None:
    """Save `emb` as a checkpoint of step `step` under `root` (synchronously) with its
    metadata changed by `edit(meta)` (in place): a checkpoint as another version or
    writer left it."""
    import json

    import orbax.checkpoint as ocp

    from embedmesh import checkpoint as ckpt

    tree = ckpt.state_tree(emb)
    meta = json.loads(bytes(tree["meta"]).decode())
    edit(meta)
    tree["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8).copy()
    mngr = ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    )
    mngr.save(step, args=ocp.args.Composite(embedding=ckpt.EmbeddingSave(tree)))
    mngr.wait_until_finished()
    mngr.close()


@contextlib.contextmanager
def leaf_reads():
    """`{"direct" or "resharded": count}` of the stored arrays a restore read inside the
    block: each leaf's read is logged (DEBUG) as its stored blocks read whole or gathered
    into another layout."""
    kinds: collections.Counter = collections.Counter()

    class Kinds(logging.Handler):
        def emit(self, record):
            if record.msg == "restore: %s read %s":
                kinds[record.args[0]] += 1

    logger = logging.getLogger("embedmesh.checkpoint.leaves")
    handler, level = Kinds(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield kinds
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
