"""Packed narrow rows (`embedmesh.device.ops.packed`, a TPU's layout): several logical rows
side by side in each 128-lane stored row. The update of ids that share a stored row
against the float64 rule of every optimizer (the stored rows written by the TPU's DMA
scatter, run in Pallas's TPU interpreter off a TPU), and the lookup's reads and sums
against float64 numpy. Small shapes, one compiled program a case (CI time)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optimizer_reference import numpy_update_rows
from test_tpu_ops import interpret_off_tpu  # noqa: F401 (autouse: the kernels interpreted off a TPU)

import embedmesh as em
from embedmesh import FeatureConfig, TableConfig
from embedmesh.device import ops
from embedmesh.device.ops import packed, tpu
from embedmesh.device.slots_in_rows import device_optimizer
from embedmesh.layout.stacking import plan_stacking

PAD = 2**31 - 1
OPTIMIZERS = {
    "SGD": em.SGD(0.3),
    "Adagrad": em.Adagrad(0.2, initial_accumulator_value=0.1),
    "AdagradMomentum": em.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True),
    "Adam": em.Adam(0.05),
    "FTRL": em.FTRL(0.2, l1_regularization_strength=0.01),
    "RowWiseAdagrad": em.RowWiseAdagrad(0.3, l2_regularization_strength=0.05),
}
# (optimizer, dim, want pack): every optimizer once, dims 8 to 64 and packs 1 to 8 each
# at least once
CASES = [
    ("SGD", 64, 2),
    ("Adagrad", 8, 8),
    ("AdagradMomentum", 8, 4),
    ("Adam", 16, 2),
    ("FTRL", 32, 1),
    ("RowWiseAdagrad", 32, 2),
    ("Adagrad", 64, 1),
]


def signed(r, shape):
    return (r.uniform(0.1, 2.0, shape) * r.choice([-1, 1], shape)).astype(np.float32)


def _spec(name, dim, vocab=40):
    opt = OPTIMIZERS[name]
    fc = {"f": FeatureConfig(TableConfig(vocab, dim, name="t", optimizer=opt))}
    plan = plan_stacking(
        fc, 1, dim_multiple=128, default_optimizer=opt, slots_in_rows=128, pack_lanes=128
    )
    return plan.stacks[0]


def _logical(r, spec):
    """Random logical rows [rows, width]: parameters of either sign, slots positive,
    padding columns poisoned with a value no update writes."""
    rows = np.full((spec.num_rows, spec.width), 7.25, np.float32)
    rows[:, : spec.dim] = signed(r, (spec.num_rows, spec.dim))
    for _, a, w in spec.slot_columns:
        rows[:, a : a + w] = r.uniform(0.1, 2.0, (spec.num_rows, w))
    return rows


@pytest.mark.parametrize("name, dim, want_pack", CASES)
def test_update_of_ids_sharing_a_stored_row_is_the_float64_rule(monkeypatch, name, dim, want_pack):
    """Ids of one batch that share stored rows (every slot of some, one of others; sorted,
    and shuffled with the padding among them): each updated row as the float64 rule, every
    other logical row (neighbours in the same stored rows included) and every padding
    column bit-identical."""
    spec = _spec(name, dim)
    assert spec.pack == want_pack
    if spec.pack == 1:  # a row too wide to pack keeps its 128 lanes
        assert spec.width == 128
        return
    assert spec.width * spec.pack == 128
    opt = spec.optimizer
    dev = device_optimizer(spec, opt)
    monkeypatch.setattr(ops, "scatter_rows", tpu.scatter_rows)  # the DMA kernel's writes
    r = np.random.default_rng(dim)
    logical = _logical(r, spec)
    p = spec.pack
    # stored row 0 whole, one slot of row 1, the last two of row 2, the last logical row
    ids = sorted({*range(p), p + 1, 3 * p - 2, 3 * p - 1, spec.num_rows - 1})
    ids = np.array(ids + [PAD, PAD], np.int32)
    grads = signed(r, (ids.size, spec.dim))
    grads[:, dim:] = 0.0  # past the table's dim: zero, as the core pads

    @jax.jit
    def update(stored, ids, grads):
        table, none = ops.sparse_update(dev, packed.PackedRows(stored, p), {}, ids, grads, 3)
        assert none == {}
        return table.data

    valid = ids != PAD
    v_ids = ids[valid]
    slots = {k: logical[v_ids, a : a + min(w, dim)] for k, a, w in spec.slot_columns}
    want_w, want_s = numpy_update_rows(opt, logical[v_ids, :dim], slots, grads[valid, :dim], 3)
    order = np.random.default_rng(1).permutation(ids.size)
    for case in (np.arange(ids.size), order):  # ascending; any order (sorted on the device)
        stored = jnp.asarray(logical.reshape(-1, 128))
        got = np.asarray(update(stored, jnp.asarray(ids[case]), jnp.asarray(grads[case])))
        got = got.reshape(spec.num_rows, spec.width)
        untouched = np.setdiff1d(np.arange(spec.num_rows), v_ids)
        np.testing.assert_array_equal(got[untouched], logical[untouched])
        np.testing.assert_allclose(got[v_ids, :dim], want_w, rtol=2e-5, atol=1e-6)
        used = spec.dim
        for k, a, w in spec.slot_columns:
            np.testing.assert_allclose(
                got[v_ids, a : a + min(w, dim)], want_s[k], rtol=2e-5, atol=1e-6
            )
            used = max(used, a + w)
        np.testing.assert_array_equal(got[:, used:], logical[:, used:])


@pytest.mark.parametrize("dim", [8, 32])
def test_lookup_reads_each_ids_lanes(dim):
    """A lookup from packed rows: each id's parameters (never its slots, never a
    neighbour's lanes) weighted and summed per output row, as float64 numpy; ids past
    the table and pairs of padding contribute nothing; the sums of the rows read also
    through the TPU's pair-sum kernel."""
    spec = _spec("Adagrad", dim)
    r = np.random.default_rng(dim + 1)
    logical = _logical(r, spec)
    table = packed.PackedRows(jnp.asarray(logical.reshape(-1, 128)), spec.pack)
    uniq = np.array([0, 1, 2, 3, 9, spec.num_rows - 1, PAD], np.int32)
    key = np.array([0, 1, 1, 2, 3, 4, 5, 6, 2], np.int32)
    dst = np.array([0, 0, 3, 1, 2, 4, 4, 1, 9], np.int32)  # 9: past the 5 output rows
    gains = signed(r, (9,))
    got = ops.segment_gather_sum(table, key, gains, dst, 5, src_map=uniq, columns=dim)
    want = np.zeros((5, dim))
    for k, d, g in zip(key, dst, gains):
        if uniq[k] < spec.num_rows and d < 5:
            want[d] += g * logical[uniq[k], :dim].astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    rows = packed.gather(table, jnp.asarray(uniq))
    np.testing.assert_array_equal(np.asarray(rows[:-1]), logical[uniq[:-1]])
    np.testing.assert_array_equal(np.asarray(rows[-1]), 0.0)
    kernel = tpu.segment_gather_sum(rows[:, :dim], key, gains, dst, num_segments=5)
    np.testing.assert_allclose(np.asarray(kernel), want, rtol=1e-5, atol=1e-5)


def test_scatter_keeps_the_neighbours_lanes():
    """`ops.scatter_rows` of a packed table: the rows set, every other lane of their
    stored rows as it was."""
    spec = _spec("SGD", 16)
    r = np.random.default_rng(4)
    logical = _logical(r, spec)
    table = packed.PackedRows(jnp.asarray(logical.reshape(-1, 128)), spec.pack)
    ids = np.array([9, 3, 4, PAD], np.int32)
    rows = signed(r, (4, spec.width))
    got = ops.scatter_rows(table, jnp.asarray(ids), jnp.asarray(rows))
    want = logical.copy()
    want[ids[:-1]] = rows[:-1]
    np.testing.assert_array_equal(np.asarray(got.data).reshape(logical.shape), want)
    assert packed.stored(got) is got.data and packed.view(got.data, 1) is got.data


@pytest.mark.parametrize("pack", [2, 4, 8])
def test_every_id_carries_its_whole_stored_row(pack):
    """The scatter writes each id's merged stored row, and ids that share a stored row
    write the same row several times (which write lands is the backend's choice: a TPU's
    DMAs in any order, the CPU's in order): so each id's merged row must hold the new
    rows of every id of its stored row, before it and after it, and the stored lanes of
    the ids not updated. Checked on the merge itself against numpy, whatever the
    scatter does."""
    r = np.random.default_rng(pack)
    w, rows_stored = 128 // pack, 9
    ids = np.sort(r.choice(rows_stored * pack, size=6 * pack, replace=False)).astype(np.int32)
    row, slot = ids // pack, ids % pack
    words = r.standard_normal((ids.size, pack * w)).astype(np.float32)
    words = words[np.searchsorted(np.unique(row), row)]  # one stored row's ids read the same
    new = r.standard_normal((ids.size, w)).astype(np.float32)
    got = np.asarray(jax.jit(packed._merged, static_argnums=4)(words, row, slot, new, pack))
    want = words.copy()
    for i in range(ids.size):
        for j in np.flatnonzero(row == row[i]):
            want[i, slot[j] * w : (slot[j] + 1) * w] = new[j]
    np.testing.assert_array_equal(got, want)
