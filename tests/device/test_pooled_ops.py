"""The pooled-exchange ops (`ops.pack_pooled_pairs`, `ops.pooled_partials`,
`ops.pooled_backward_update`): their references against plain float64 numpy, and
their CPU kernels against their references, on random inputs (poisoned tables,
padding, out-of-range positions and rows, both pair forms)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizer_reference import ALL_FUSED, numpy_update_rows

from embedmesh import _runtime
from embedmesh.device import ops
from embedmesh.device.ops import cpu
from embedmesh.device.ops.cpu import kernels as cpu_kernels
from embedmesh.optimizers import SGD, Adagrad

PAD = ops.PAD_ID
needs_kernels = pytest.mark.skipif(
    not cpu.ready(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}"
)


def random_batch(r, n, u, p, num_rows, width, compacted, ids_below=50):
    """A source's [N, ...] batch: ascending distinct ids below `ids_below` per block (PAD
    padded), pairs whose positions and rows are sometimes out of range, and each block's
    compact map."""
    ids = np.full((n, u), PAD, np.int32)
    for o in range(n):
        used = int(r.integers(0, u + 1))
        ids[o, :used] = np.sort(r.choice(ids_below, used, replace=False))
    pair_rows = r.integers(-1, num_rows + 2, (n, p)).astype(np.int32)
    pair_unique = r.integers(-1, u + 2, (n, p)).astype(np.int32)
    pair_gains = r.standard_normal((n, p)).astype(np.float32)
    if compacted:
        compact = np.full((n, num_rows + 1), width, np.int32)
        for o in range(n):
            fed = r.choice(num_rows, min(width, num_rows), replace=False)
            compact[o, fed] = np.arange(fed.size)
    else:
        compact = np.zeros((n, 0), np.int32)
    return ids, pair_rows, pair_unique, pair_gains, compact


def np_pairs(ids, pair_rows, pair_unique, pair_gains, compact, width):
    """The (source block o, position, row, gain) an owner should read: plain loops."""
    n, u = ids.shape
    out = []
    for o in range(n):
        for q in range(pair_rows.shape[1]):
            r = int(pair_rows[o, q])
            if compact.shape[1]:  # rows out of [0, R]: none
                r = int(compact[o, r]) if 0 <= r < compact.shape[1] else width
            pos = int(pair_unique[o, q])
            valid = 0 <= pos < u and 0 <= r < width
            out.append((o, pos if valid else None, r if valid else None, float(pair_gains[o, q])))
    return out


# each example of new shapes compiles new programs: few examples, drawn from few shapes
_random = settings(max_examples=6, deadline=None)
SHAPES = dict(
    seed=st.integers(0, 2**31 - 1),
    n=st.sampled_from([1, 2, 3]),
    u=st.sampled_from([1, 6]),
    p=st.sampled_from([0, 5, 40]),
    width=st.sampled_from([1, 7]),
    compacted=st.booleans(),
)


@_random
@given(**SHAPES)
def test_pack_then_unpack_reads_every_pair_as_sent(seed, n, u, p, width, compacted):
    r = np.random.default_rng(seed)
    num_rows = 9 if compacted else width
    batch = random_batch(r, n, u, p, num_rows, width, compacted)

    @jax.jit  # one program (each example's shapes are new), not its jnp ops one by one
    def pack_then_unpack(*batch):
        served = ops.reference_of("pack_pooled_pairs")(*batch, width=width)
        return served, ops.unpack_pooled_pairs(served, unique_capacity=u, width=width)

    served, (ids, slot, row, gains) = pack_then_unpack(*map(jnp.asarray, batch))
    k = _runtime.pooled_pair_fields(u, width)
    assert served.shape == (n, u + p * k)
    np.testing.assert_array_equal(np.asarray(ids), batch[0])
    want = np_pairs(*batch, width)
    for q, (o, pos, rr, g) in enumerate(want):
        if pos is None:  # skipped: its slot or its row says "none"
            assert int(slot[q]) == n * u or int(row[q]) == n * width
        else:
            assert (int(slot[q]), int(row[q])) == (o * u + pos, o * width + rr)
        assert float(gains[q]) == g


def test_unpacked_form_past_the_pack_limit(monkeypatch):
    """Where position and row cannot share a word, a pair takes 3 words; same reading."""
    r = np.random.default_rng(3)
    batch = random_batch(r, 2, 6, 10, 9, 4, True)
    packed = ops.reference_of("pack_pooled_pairs")(*map(jnp.asarray, batch), width=4)
    monkeypatch.setattr(_runtime, "PACK_LIMIT", 8)
    assert _runtime.pooled_pair_fields(6, 4) == 3
    wide = ops.reference_of("pack_pooled_pairs")(*map(jnp.asarray, batch), width=4)
    assert wide.shape[1] == 6 + 10 * 3 and packed.shape[1] == 6 + 10 * 2
    got = ops.unpack_pooled_pairs(wide, unique_capacity=6, width=4)
    monkeypatch.setattr(_runtime, "PACK_LIMIT", 2**31)
    want = ops.unpack_pooled_pairs(packed, unique_capacity=6, width=4)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.cache
def _packer(width):
    """The reference's packing jitted: one program a shape, kept across examples (not its
    jnp ops compiled one by one)."""
    return jax.jit(functools.partial(ops.reference_of("pack_pooled_pairs"), width=width))


def _served_and_oracle_pairs(seed, n, u, p, width, compacted):
    """Owner 0's served messages from n sources, and the pairs as plain tuples
    (source, its ids, position or None, row or None, gain)."""
    r = np.random.default_rng(seed)
    num_rows = 9 if compacted else width
    blocks, pairs = [], []
    for s in range(n):
        batch = random_batch(r, n, u, p, num_rows, width, compacted)
        msg = np.asarray(_packer(width)(*map(jnp.asarray, batch)))
        blocks.append(msg[0])
        mine = [x[:1] for x in batch]
        for _, pos, row, g in np_pairs(*mine, width):
            pairs.append((s, batch[0][0], pos, row, g))
    return r, jnp.asarray(np.stack(blocks)), pairs


@_random
@given(**SHAPES)
def test_pooled_partials_reference_matches_numpy(seed, n, u, p, width, compacted):
    r, served, pairs = _served_and_oracle_pairs(seed, n, u, p, width, compacted)
    table = r.standard_normal((40, 3)).astype(np.float32)  # ids >= 40 read nothing
    want = np.zeros((n * width, 3))
    for s, ids, pos, row, g in pairs:
        if pos is None or ids[pos] >= 40:
            continue
        want[s * width + row] += g * table[ids[pos]].astype(np.float64)
    got = jax.jit(  # one program, not its jnp ops one by one
        lambda t, m: ops.reference_of("pooled_partials")(t, m, unique_capacity=u, width=width)
    )(jnp.asarray(table), served)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def np_backward_update(opt, table, slots, pairs, grads, width, keep, asked=()):
    """Per distinct id, the float64 sum of gain * grads[row] over every source's pairs,
    then one step of `opt` on that row and on every `asked` row without pairs (a zero
    gradient) (optimizer_reference's numpy rule, at step 0)."""
    w = table.astype(np.float64)
    sl = {k: np.asarray(v, np.float64) for k, v in slots.items()}
    if not keep:
        return w, sl
    g = {}
    for s, ids, pos, row, gain in pairs:
        if pos is None or ids[pos] >= table.shape[0]:
            continue
        i = int(ids[pos])
        g[i] = g.get(i, 0.0) + gain * grads[s * width + row].astype(np.float64)
    rows = sorted(set(g) | set(asked))
    if rows:
        zero = np.zeros(table.shape[1])
        grads_of = np.stack([g.get(i, zero) for i in rows])
        nw, ns = numpy_update_rows(opt, w[rows], {k: v[rows] for k, v in sl.items()}, grads_of, 0)
        w[rows] = nw
        for k in sl:
            sl[k][rows] = ns[k]
    return w, sl


@_random
@given(**SHAPES, adagrad=st.booleans(), keep=st.booleans())
def test_pooled_backward_update_reference_matches_numpy(
    seed, n, u, p, width, compacted, adagrad, keep
):
    r, served, pairs = _served_and_oracle_pairs(seed, n, u, p, width, compacted)
    opt = Adagrad(learning_rate=0.3) if adagrad else SGD(learning_rate=0.3)
    table = r.standard_normal((45, 3)).astype(np.float32)
    acc = (0.1 + r.random((45, 3))).astype(np.float32)
    grads = r.standard_normal((n * width, 3)).astype(np.float32)
    slots = {"accumulators": jnp.asarray(acc)} if adagrad else {}
    update = jax.jit(  # one program, not its jnp ops one by one
        lambda *a: ops.reference_of("pooled_backward_update")(
            *a, optimizer=opt, step=jnp.int32(0), unique_capacity=u, width=width
        )
    )
    t, s = update(jnp.asarray(table), slots, served, jnp.asarray(grads), jnp.asarray(keep))
    want_w, want_s = np_backward_update(opt, table, slots, pairs, grads, width, keep)
    np.testing.assert_allclose(np.asarray(t), want_w, rtol=1e-5, atol=1e-5)
    if adagrad:
        np.testing.assert_allclose(
            np.asarray(s["accumulators"]), want_s["accumulators"], rtol=1e-5, atol=1e-5
        )


@needs_kernels
@_random
@given(**SHAPES)
def test_pack_and_partials_kernels_match_references(seed, n, u, p, width, compacted):
    r = np.random.default_rng(seed)
    num_rows = 9 if compacted else width
    batch = tuple(map(jnp.asarray, random_batch(r, n, u, p, num_rows, width, compacted)))
    want = jax.jit(lambda *a: ops.reference_of("pack_pooled_pairs")(*a, width=width))(*batch)
    got = jax.jit(lambda *a: cpu_kernels.pack_pooled_pairs(*a, width=width))(*batch)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    table = jnp.asarray(r.standard_normal((40, 5)).astype(np.float32))
    params = dict(unique_capacity=u, width=width)
    want = jax.jit(lambda t, m: ops.reference_of("pooled_partials")(t, m, **params))(table, got)
    have = jax.jit(lambda t, m: cpu_kernels.pooled_partials(t, m, **params))(table, got)
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("opt", ALL_FUSED, ids=lambda o: type(o).__name__)
@settings(max_examples=2, deadline=None)
@given(**SHAPES, keep=st.booleans())
def test_pooled_backward_update_kernel_matches_reference(
    opt, seed, n, u, p, width, compacted, keep
):
    """Every fused optimizer's pooled kernel against the reference and the float64 rule."""
    r, served, pairs = _served_and_oracle_pairs(seed, n, u, p, width, compacted)
    table_np = r.standard_normal((45, 4)).astype(np.float32)
    table = jnp.asarray(table_np)
    slots_np = {
        k: (0.1 + r.random((45, opt.slot_width(k, 4)))).astype(np.float32) for k in opt.slot_names
    }
    slots = {k: jnp.asarray(v) for k, v in slots_np.items()}
    grads = jnp.asarray(r.standard_normal((n * width, 4)).astype(np.float32))
    params = dict(optimizer=opt, step=jnp.int32(0), unique_capacity=u, width=width)
    args = (table, slots, served, grads, jnp.asarray(keep))
    assert ops.kernel_for("pooled_backward_update", "cpu", *args, **params) is (
        cpu_kernels.pooled_backward_update
    )
    want = jax.jit(lambda *a: ops.reference_of("pooled_backward_update")(*a, **params))(*args)
    got = jax.jit(lambda *a: cpu_kernels.pooled_backward_update(*a, **params))(*args)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=2e-6)
    asked = {int(i) for i in np.asarray(served)[:, :u].ravel() if 0 <= i < 45}
    want_w, want_s = np_backward_update(
        opt, table_np, slots_np, pairs, np.asarray(grads), width, keep, asked
    )
    np.testing.assert_allclose(np.asarray(got[0]), want_w, rtol=1e-4, atol=1e-5)
    for k in want_s:
        np.testing.assert_allclose(np.asarray(got[1][k]), want_s[k], rtol=1e-4, atol=1e-5)


@needs_kernels
def test_pooled_kernels_take_their_calls():
    table = jnp.zeros((4, 2), jnp.float32)
    served = jnp.zeros((2, 3), jnp.int32)
    assert ops.kernel_for("pooled_partials", "cpu", table, served) is cpu_kernels.pooled_partials
    for low in (jnp.bfloat16, jnp.float16):  # one template over the storage type
        low_table = table.astype(low)
        assert ops.kernel_for("pooled_partials", "cpu", low_table, served) is (
            cpu_kernels.pooled_partials
        )
    assert ops.kernel_for(
        "pooled_partials", "cpu", table.astype(jnp.int32), served
    ) is ops.reference_of("pooled_partials")
    assert ops.kernel_for("pack_pooled_pairs", "cpu") is cpu_kernels.pack_pooled_pairs


@needs_kernels
def test_pooled_kernels_decode_pairs_near_the_pack_limit():
    """Position and row packed into one word near its limit ((U + 1) * (Rc + 1) just
    below 2**31): the kernels' decode by multiplication reads every pair as the reference's
    division does (partials and the fused backward + update)."""
    u, width, n, p, d = 65535, 32766, 2, 64, 2
    assert (u + 1) * (width + 1) < _runtime.PACK_LIMIT
    assert _runtime.pooled_pair_fields(u, width) == 2
    r = np.random.default_rng(7)
    ids = np.tile(np.arange(u, dtype=np.int32), (n, 1))  # every position a valid row
    pair_rows = r.integers(width - 40, width, (n, p)).astype(np.int32)
    pair_rows[:, :4] = [0, 1, width - 1, width - 2]  # the corners of the packed word
    pair_unique = np.sort(r.integers(u - 40, u, (n, p))).astype(np.int32)
    pair_unique[:, :4] = [0, 1, u - 2, u - 1]
    pair_unique = np.sort(pair_unique, axis=1)
    gains = (0.5 + r.random((n, p))).astype(np.float32)
    compact = np.zeros((n, 0), np.int32)
    batch = tuple(map(jnp.asarray, (ids, pair_rows, pair_unique, gains, compact)))
    served = cpu_kernels.pack_pooled_pairs(*batch, width=width)
    table = jnp.asarray(r.standard_normal((u + 5, d)).astype(np.float32))
    params = dict(unique_capacity=u, width=width)
    want = ops.reference_of("pooled_partials")(table, served, **params)
    got = cpu_kernels.pooled_partials(table, served, **params)
    assert float(jnp.abs(want).sum()) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    grads = jnp.asarray(r.standard_normal((n * width, d)).astype(np.float32))
    params = dict(optimizer=SGD(learning_rate=0.5), step=jnp.int32(0), **params)
    args = (table, {}, served, grads, jnp.asarray(True))
    want = ops.reference_of("pooled_backward_update")(*args, **params)[0]
    got = cpu_kernels.pooled_backward_update(*args, **params)[0]
    assert not np.array_equal(np.asarray(got), np.asarray(table))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@needs_kernels
def test_pooled_backward_update_merges_two_sources_over_many_chunks():
    """An owner's two sources whose ids overlap in part (rows in one source only, in both,
    below and above the other's), thousands each: the fused backward + update walks both
    lists in several chunks of rows (on every thread) and equals the float64 rule and the
    reference; pairs to PAD slots and out-of-range rows are skipped."""
    n, u, width, p, d, rows = 2, 3000, 64, 9000, 3, 8000
    r = np.random.default_rng(11)
    ids = np.full((n, u), PAD, np.int32)
    ids[0, :2900] = np.sort(r.choice(np.arange(1000, 7000), 2900, replace=False))
    ids[1] = np.sort(r.choice(rows, u, replace=False))
    pair_unique = np.sort(r.integers(0, u, (n, p)), axis=1).astype(np.int32)  # host order
    pair_rows = r.integers(0, width + 3, (n, p)).astype(np.int32)  # some out of range
    gains = (0.5 + r.random((n, p))).astype(np.float32)
    compact = np.zeros((n, 0), np.int32)
    batch = tuple(map(jnp.asarray, (ids, pair_rows, pair_unique, gains, compact)))
    served = cpu_kernels.pack_pooled_pairs(*batch, width=width)
    table_np = r.standard_normal((rows, d)).astype(np.float32)
    acc_np = (0.1 + r.random((rows, d))).astype(np.float32)
    grads_np = r.standard_normal((n * width, d)).astype(np.float32)
    opt = Adagrad(learning_rate=0.3)
    params = dict(optimizer=opt, step=jnp.int32(0), unique_capacity=u, width=width)
    args = (
        jnp.asarray(table_np),
        {"accumulators": jnp.asarray(acc_np)},
        served,
        jnp.asarray(grads_np),
        jnp.asarray(True),
    )
    got = cpu_kernels.pooled_backward_update(*args, **params)
    want = ops.reference_of("pooled_backward_update")(*args, **params)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=2e-6)
    pairs = [
        (s, ids[s], int(pair_unique[s, q]), int(pair_rows[s, q]), float(gains[s, q]))
        for s in range(n)
        for q in range(p)
        if pair_rows[s, q] < width
    ]
    asked = {int(i) for i in ids.ravel() if i < rows}
    want_w, want_s = np_backward_update(
        opt, table_np, {"accumulators": acc_np}, pairs, grads_np, width, True, asked
    )
    assert not np.array_equal(np.asarray(got[0]), table_np)
    np.testing.assert_allclose(np.asarray(got[0]), want_w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(got[1]["accumulators"]), want_s["accumulators"], rtol=1e-4, atol=1e-5
    )
