"""Checkpoints of a pipelined run: saving never changes the trajectory, and a run
restored from a checkpoint saved mid-pipeline (an update pending) resumes
bit-identically to the run that was never interrupted, on any device count and
stacking (issue #12, item 1)."""

import jax.numpy as jnp
import numpy as np
import pytest
from meshes import mesh_of

import embedmesh as em
from embedmesh import FeatureConfig, RaggedTensor, TableConfig
from embedmesh import checkpoint as ckpt
from embedmesh.checkpoint import leaves
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity

CAPS = Capacity(64, 64)


def _features():
    t1 = TableConfig(40, 4, combiner="sum", name="t1")
    t2 = TableConfig(25, 8, combiner="mean", name="t2")
    t3 = TableConfig(30, 4, combiner="sum", name="t3")  # never looked up before the save
    return {
        "a": FeatureConfig(t1),
        "b": FeatureConfig(t2),
        "c": FeatureConfig(t3),
        "s": FeatureConfig(t1, max_sequence_length=3),
    }


def _batch(rng, step, batch=8, max_len=4):
    lengths = rng.integers(0, max_len + 1, batch)
    out = {
        "a": rng.integers(0, 40, (batch, 2)),
        "b": RaggedTensor.from_row_lengths(rng.integers(0, 25, lengths.sum()), lengths),
        "s": RaggedTensor.from_row_lengths(rng.integers(0, 40, lengths.sum()), lengths),
    }
    # c only after the save: its stack's lookup tables are the restored ones
    c_len = rng.integers(0, 3, batch) if step >= 3 else np.zeros(batch, np.int64)
    out["c"] = RaggedTensor.from_row_lengths(rng.integers(0, 30, c_len.sum()), c_len)
    return out


def _gradients(acts, step):
    """Gradients that depend on the activations: a stale or fresh lookup shows."""
    return {
        k: jnp.asarray(
            np.tanh(np.asarray(v))
            + 0.05 * (step + 1) * np.cos(np.arange(v.size, dtype=np.float32)).reshape(v.shape)
        )
        for k, v in acts.items()
    }


def _step(emb, rng, step):
    acts, pre = emb(_batch(rng, step))
    emb.apply_gradients(_gradients(acts, step), pre)
    return {k: np.asarray(v) for k, v in acts.items()}


def _run(emb, steps, rng):
    return [_step(emb, rng, i) for i in steps]


def _variables(emb):
    return {t.name: {k: np.asarray(v) for k, v in d.items()} for t, d in emb.variables.items()}


OPTIMIZERS = {
    "SGD": em.SGD(0.5),
    "Adagrad": em.Adagrad(0.3),
    "Adam": em.Adam(0.05),
    "FTRL": em.FTRL(0.2),
}
TOTAL, SAVE_AFTER = 7, 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`get(optimizer name) -> (activations, variables, checkpoint path)`, made once per
    optimizer for every restore target: the uninterrupted run on 4 devices, and a second
    run saved mid-pipeline (an update pending), checked to follow the first before and
    after the save (saving changed nothing)."""
    cache = {}

    def get(name):
        if name in cache:
            return cache[name]
        opt, feats = OPTIMIZERS[name], _features()
        straight = MeshEmbedding(feats, opt, True, mesh=mesh_of(4), capacities=CAPS)
        want = _run(straight, range(TOTAL), np.random.default_rng(11))
        want_vars = _variables(straight)

        first = MeshEmbedding(feats, opt, True, mesh=mesh_of(4), capacities=CAPS)
        rng = np.random.default_rng(11)
        got = _run(first, range(SAVE_AFTER), rng)
        path = tmp_path_factory.mktemp(f"pipelined_{name}") / "c"
        ckpt.save(str(path), first)  # an update is pending: saved beside the tables
        got += _run(first, range(SAVE_AFTER, SAVE_AFTER + 1), rng)  # saving changed nothing
        for i, (g, w) in enumerate(zip(got, want)):
            for k in w:
                np.testing.assert_array_equal(g[k], w[k], err_msg=f"{k} at step {i}")
        cache[name] = (want, want_vars, path)
        return cache[name]

    return get


# A covering set: each optimizer's checkpoint (its slots, its pending update) restored
# onto one target; each target (the saving mesh and stacking; another device count,
# unstacked) with two optimizers, one of them with two slots (Adam's, FTRL's)
RESUMES = [
    ("SGD", (4, True)),
    ("Adagrad", (2, False)),
    ("Adam", (2, False)),
    ("FTRL", (4, True)),
]


@pytest.mark.parametrize(
    "opt, restore_on",
    RESUMES,
    ids=[f"{'4dev' if on == (4, True) else '2dev-unstacked'}-{o}" for o, on in RESUMES],
)
def test_pipelined_checkpoint_resumes_bit_identically(saved, opt, restore_on):
    feats = _features()
    total, save_after = TOTAL, SAVE_AFTER
    want, want_vars, path = saved(opt)

    n, stacked = restore_on
    resumed = MeshEmbedding(
        feats, OPTIMIZERS[opt], True, mesh=mesh_of(n), capacities=CAPS, stack_tables=stacked
    )
    assert ckpt.restore(resumed, str(path)) == save_after
    assert int(resumed.observed_state().step) == save_after
    rng = np.random.default_rng(11)
    for i in range(save_after):  # the same batches up to the save: the generator's position
        _batch(rng, i)
    later = _run(resumed, range(save_after, total), rng)
    # same mesh and stacking: bit-identical. Another device count sums a bag's rows in
    # another order (so does the uninterrupted run on that count): equal to float32
    # rounding, far closer than a lookup that missed, or saw early, one update
    same = (n, stacked) == (4, True)

    def check(g, w, msg):
        if same:
            np.testing.assert_array_equal(g, w, err_msg=msg)
        else:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7, err_msg=msg)

    for i, (g, w) in enumerate(zip(later, want[save_after:]), start=save_after):
        for k in w:
            check(g[k], w[k], f"{k} at step {i} after restore")
    got_vars = _variables(resumed)
    for t in want_vars:
        for k in want_vars[t]:
            check(got_vars[t][k], want_vars[t][k], f"{t}.{k}")


def test_a_stale_lookup_after_restore_is_what_the_check_sees():
    """The tolerance above is tight enough: the lookup after an early-applied update
    (the bug this file guards) differs from the stale one far beyond it."""
    feats = _features()
    stale = MeshEmbedding(feats, em.SGD(0.5), True, mesh=mesh_of(2), capacities=CAPS)
    fresh = MeshEmbedding(feats, em.SGD(0.5), True, mesh=mesh_of(2), capacities=CAPS)
    r1, r2 = np.random.default_rng(2), np.random.default_rng(2)
    _run(stale, range(2), r1)
    _run(fresh, range(2), r2)
    fresh.flush()  # what an observing save used to do
    a, b = _step(stale, r1, 2), _step(fresh, r2, 2)
    assert max(np.max(np.abs(a[k] - b[k])) for k in a) > 1e-3


def test_checkpoint_of_pipelined_run_reads_all_updates(tmp_path):
    """What a pipelined checkpoint stores as tables, and what serving and an
    unpipelined restore load, has every accepted update applied."""
    feats = _features()
    opt = em.Adagrad(0.3)
    piped = MeshEmbedding(feats, opt, True, mesh=mesh_of(2), capacities=CAPS)
    _run(piped, range(3), np.random.default_rng(5))
    seen = {t.name: v for t, v in piped.embedding_tables.items()}
    ckpt.save(str(tmp_path / "c"), piped)
    assert ckpt.read_metadata(str(tmp_path / "c"))["step"] == 3
    served = {t.name: v for t, v in ckpt.load_tables(str(tmp_path / "c")).items()}
    eager = MeshEmbedding(feats, opt, mesh=mesh_of(2), capacities=CAPS)
    ckpt.restore(eager, str(tmp_path / "c"))
    for name, v in seen.items():
        np.testing.assert_array_equal(served[name], v)
        np.testing.assert_array_equal(
            {t.name: a for t, a in eager.embedding_tables.items()}[name], v
        )


def test_corrupted_lookup_tables_fail_the_restore_and_change_nothing(tmp_path):
    feats = _features()
    opt = em.SGD(0.5)
    piped = MeshEmbedding(feats, opt, True, mesh=mesh_of(2), capacities=CAPS)
    _run(piped, range(2), np.random.default_rng(6))
    tree = ckpt.state_tree(piped)
    assert {"t1", "t2"} <= set(tree["lookup_tables"])  # the stacks the pending update touches
    path = tmp_path / "c"
    ckpt.save(str(path), piped)
    import json

    meta_leaf = json.loads(bytes(np.asarray(tree["meta"])).decode())
    assert {m["name"] for m in meta_leaf["tables"] if m["lookup"]} == set(tree["lookup_tables"])

    other = MeshEmbedding(feats, opt, True, mesh=mesh_of(2), capacities=CAPS)
    _run(other, range(1), np.random.default_rng(7))
    before = _variables(other)
    before_lookup = {s: np.asarray(a) for s, a in other.state.tables.items()}
    # damage the lookup array's recorded checksum: the restore must refuse it
    real = leaves.expected_checksum

    def wrong(reader, meta_table, field, leaf, dtype):
        got = real(reader, meta_table, field, leaf, dtype)
        return "0" * 16 if field == ckpt.LOOKUP_FIELD and got is not None else got

    leaves.expected_checksum = wrong
    try:
        with pytest.raises(ValueError, match="corrupted"):
            ckpt.restore(other, str(path))
    finally:
        leaves.expected_checksum = real
    after = _variables(other)
    for t in before:
        for k in before[t]:
            np.testing.assert_array_equal(after[t][k], before[t][k])
    for s, a in other.state.tables.items():
        np.testing.assert_array_equal(np.asarray(a), before_lookup[s])
