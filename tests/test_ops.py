"""The device ops: their CPU kernels against their pure-JAX references, the dispatch.

Skipped where the kernels cannot be built (no C++ compiler); the fallbacks are
exercised by every other test in that case, and here too with
`EMBEDMESH_CPU_KERNELS=0`.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from embedmesh import _runtime
from embedmesh.device import ops
from embedmesh.device.ops import cpu, reference
from embedmesh.optimizers import SGD, Adagrad, AdagradMomentum

PAD = ops.PAD_ID

needs_kernels = pytest.mark.skipif(not cpu.ready(),
                                   reason=f"CPU kernels unavailable: "
                                          f"{cpu.unavailable_reason()}")


def rng(seed=0):
    return np.random.default_rng(seed)


def ids_with_padding(r, rows, n, used, sort=True, extra_bad=()):
    ids = r.choice(rows, used, replace=False).astype(np.int32)
    if sort:
        ids.sort()
    out = np.full(n, PAD, np.int32)
    out[:used] = ids
    for pos, v in extra_bad:
        out[pos] = v
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_gather_rows(dtype):
    r = rng(1)
    table = jnp.asarray((r.standard_normal((500, 7)) * 10).astype(np.float32)).astype(dtype)
    ids = ids_with_padding(r, 500, 300, 250, sort=False, extra_bad=[(3, 501), (4, 500)])
    got = jax.jit(ops.gather_rows)(table, jnp.asarray(ids))
    want = reference.gather_rows(table, jnp.asarray(ids))
    assert got.dtype == table.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got[3]).any() and not np.asarray(got[-1]).any()


@needs_kernels
def test_gather_rows_large_output_and_empty():
    r = rng(2)
    table = jnp.asarray(r.standard_normal((20000, 64)).astype(np.float32))
    ids = jnp.asarray(r.integers(0, 20000, 40000).astype(np.int32))  # 10 MiB output
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.gather_rows)(table, ids)),
                                  np.asarray(table)[np.asarray(ids)])
    empty = jax.jit(ops.gather_rows)(table, jnp.zeros((0,), jnp.int32))
    assert empty.shape == (0, 64)


@needs_kernels
def test_scatter_rows_in_place_and_copy():
    r = rng(3)
    base = r.standard_normal((400, 5)).astype(np.float32)
    ids = ids_with_padding(r, 400, 128, 100, sort=False, extra_bad=[(0, 400)])
    vals = r.standard_normal((128, 5)).astype(np.float32)
    want = np.asarray(reference.scatter_rows(jnp.asarray(base), jnp.asarray(ids),
                                                jnp.asarray(vals)))
    # not donated: XLA copies the operand, the input stays intact
    t = jnp.asarray(base)
    got = jax.jit(ops.scatter_rows)(t, jnp.asarray(ids), jnp.asarray(vals))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(t), base)
    # donated: in place
    f = jax.jit(ops.scatter_rows, donate_argnums=0)
    got = f(jnp.asarray(base), jnp.asarray(ids), jnp.asarray(vals))
    np.testing.assert_array_equal(np.asarray(got), want)


@needs_kernels
@pytest.mark.parametrize("mapped", [False, True])
def test_segment_gather_sum(mapped):
    r = rng(4)
    m, d, p, segs = 300, 16, 2000, 97
    src = r.standard_normal((m, d)).astype(np.float32)
    sidx = r.integers(0, m + 3, p).astype(np.int32)
    didx = r.integers(-2, segs + 4, p).astype(np.int32)
    gains = r.standard_normal(p).astype(np.float32)
    want = np.zeros((segs, d), np.float64)
    if mapped:
        table = r.standard_normal((5000, d)).astype(np.float32)
        smap = ids_with_padding(r, 5000, m, m - 20, sort=False, extra_bad=[(7, 5000)])
        rows_of = np.zeros((m, d), np.float64)
        ok = (smap >= 0) & (smap < 5000)
        rows_of[ok] = table[smap[ok]]
        src_used = rows_of
    else:
        src_used = src.astype(np.float64)
    for q in range(p):
        if 0 <= sidx[q] < m and 0 <= didx[q] < segs:
            want[didx[q]] += gains[q] * src_used[sidx[q]]
    if mapped:
        fn = jax.jit(lambda t, s, i, g, dd: ops.segment_gather_sum(t, i, g, dd, segs,
                                                                       src_map=s))
        got = fn(jnp.asarray(table), jnp.asarray(smap), jnp.asarray(sidx), jnp.asarray(gains),
                 jnp.asarray(didx))
    else:
        fn = jax.jit(lambda s, i, g, dd: ops.segment_gather_sum(s, i, g, dd, segs))
        got = fn(jnp.asarray(src), jnp.asarray(sidx), jnp.asarray(gains), jnp.asarray(didx))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("case", ["one_sorted", "one_sorted_dups", "one_unsorted", "merge",
                                  "merge_unsorted"])
def test_dedup_sum(case):
    r = rng(5)
    n_blocks = 1 if case.startswith("one") else 3
    u, d, rows = 64, 6, 200
    blocks = []
    for b in range(n_blocks):
        used = int(r.integers(10, 60))
        blk = ids_with_padding(r, rows, u, used, sort=True)
        if case == "one_sorted_dups":
            blk[:used] = np.sort(r.integers(0, 30, used))
        if case.endswith("unsorted"):
            r.shuffle(blk)
        blocks.append(blk)
    ids = np.stack(blocks).astype(np.int32)
    grads = r.standard_normal((ids.size, d)).astype(np.float32)
    want_sums = {}
    for i, v in enumerate(ids.reshape(-1)):
        if v != PAD:
            want_sums[v] = want_sums.get(v, 0) + grads[i].astype(np.float64)
    keys = sorted(want_sums)
    uniq, sums = jax.jit(ops.dedup_sum)(jnp.asarray(ids), jnp.asarray(grads))
    uniq, sums = np.asarray(uniq), np.asarray(sums)
    assert list(uniq[:len(keys)]) == keys
    assert (uniq[len(keys):] == PAD).all()
    np.testing.assert_allclose(sums[:len(keys)], np.array([want_sums[k] for k in keys]),
                               rtol=1e-5, atol=1e-6)
    assert not sums[len(keys):].any()
    # the pure-JAX fallback agrees
    ju, js = jax.jit(reference.dedup_sum)(jnp.asarray(ids), jnp.asarray(grads))
    np.testing.assert_array_equal(np.asarray(ju), uniq)
    np.testing.assert_allclose(np.asarray(js), sums, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("opt", [
    Adagrad(0.3, initial_accumulator_value=0.2),
    Adagrad(0.1, clipvalue=0.05, weight_decay_factor=0.01,
            multiply_weight_decay_factor_by_learning_rate=True, clip_weight_min=-0.5,
            clip_weight_max=0.7),
    Adagrad(lambda step: 0.1 / (1.0 + step), weight_decay_factor=0.02),
    SGD(0.5),
    SGD(0.2, clipvalue=(-0.1, None), clip_weight_max=0.3),
    AdagradMomentum(0.1, momentum=0.5),  # generic path
])
def test_sparse_update_matches_update_rows(opt):
    r = rng(6)
    rows, d = 300, 12
    table = r.standard_normal((rows, d)).astype(np.float32)
    slots = {k: np.full((rows, d), v, np.float32) + r.random((rows, d)).astype(np.float32)
             for k, v in opt.slot_initial_values.items()}
    ids = ids_with_padding(r, rows, 128, 100, sort=True)
    grads = r.standard_normal((128, d)).astype(np.float32)
    step = jnp.int32(3)
    f = jax.jit(lambda t, s, i, g, st: ops.sparse_update(opt, t, s, i, g, st),
                donate_argnums=(0, 1))
    got_t, got_s = f(jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()},
                     jnp.asarray(ids), jnp.asarray(grads), step)
    want_t, want_s = _reference_update(opt, table, slots, ids, grads, step)
    np.testing.assert_allclose(np.asarray(got_t), want_t, rtol=2e-6, atol=1e-7)
    for k in want_s:
        np.testing.assert_allclose(np.asarray(got_s[k]), want_s[k], rtol=2e-6, atol=1e-7)


@needs_kernels
def test_huge_page_copy():
    x = jnp.arange(3 * (1 << 20), dtype=jnp.float32).reshape(-1, 64)  # 12 MiB
    y = jax.jit(ops.huge_page_copy)(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_fallbacks_without_kernels(monkeypatch):
    """With the kernels off, every op runs its pure-JAX reference."""
    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: False)
    r = rng(7)
    table = jnp.asarray(r.standard_normal((50, 4)).astype(np.float32))
    ids = jnp.asarray(np.array([3, 1, PAD, 7], np.int32))
    np.testing.assert_array_equal(np.asarray(ops.gather_rows(table, ids)),
                                  np.asarray(reference.gather_rows(table, ids)))
    u, s = ops.dedup_sum(jnp.asarray(np.array([[1, 3, PAD]], np.int32)),
                             jnp.ones((3, 4), jnp.float32))
    assert list(np.asarray(u)) == [1, 3, PAD]
    assert not np.asarray(s)[2].any()
    t, sl = ops.sparse_update(Adagrad(0.1), table, {"accumulators": jnp.ones_like(table)},
                                  ids, jnp.ones((4, 4), jnp.float32), jnp.int32(0))
    assert t.shape == table.shape and sl["accumulators"].shape == table.shape


@pytest.mark.parametrize("dtype,value", [(np.float32, 0.1), (np.float32, -3.5),
                                         (np.int32, 7), (jnp.bfloat16, 1.25)])
@pytest.mark.parametrize("min_bytes", [0, 1 << 40])  # the fill kernel, and plain jnp.full
def test_full_on_a_device(dtype, value, min_bytes):
    device = jax.devices()[1]
    shape = (1000, 37)  # not a multiple of the kernel's tile
    got = ops.full(shape, value, dtype, device, min_bytes=min_bytes)
    assert got.devices() == {device} and got.dtype == dtype and got.shape == shape
    np.testing.assert_array_equal(np.asarray(got, np.float64),
                                  np.full(shape, np.asarray(value, dtype), np.float64))


@needs_kernels
@pytest.mark.parametrize("case", ["sorted", "unsorted_ids", "unsorted_pairs", "large",
                                  "large_unsorted_at_chunk_edge"])
@pytest.mark.parametrize("opt", [Adagrad(0.2, weight_decay_factor=0.01, clipvalue=0.5),
                                 SGD(0.3, clip_weight_min=-1.0)])
def test_backward_update_matches_unfused(case, opt):
    r = rng(8)
    rows, d, u_cap, p_cap, R = 400, 8, 64, 200, 50
    used = 50
    n_pairs = 150
    if case.startswith("large"):  # several of the kernel's pair chunks (16384 pairs each)
        rows, u_cap, p_cap, R, used, n_pairs = 9000, 4096, 90000, 700, 3000, 80000
    ids = ids_with_padding(r, rows, u_cap, used, sort=True)
    pu = np.sort(r.integers(0, used, n_pairs)).astype(np.int32)
    pr = r.integers(0, R, n_pairs).astype(np.int32)
    if case.startswith("large"):
        pu[10000:60000] = 77  # one slot spans whole chunks; more slots span their edges
        pu = np.sort(pu)
        pr[r.random(n_pairs) < 0.05] = R  # invalid pairs inside the valid ones
    if case == "large_unsorted_at_chunk_edge":  # sorted inside each chunk, not across
        pu[16384 - 5:16384], pu[16384:16384 + 5] = pu[16384:16384 + 5].copy(), \
            pu[16384 - 5:16384].copy()
        pu[16384 - 5:16384] = used - 1
    pu = np.concatenate([pu, np.zeros(p_cap - n_pairs, np.int32)])  # padding: row R, gain 0
    pr = np.concatenate([pr, np.full(p_cap - n_pairs, R, np.int32)])
    pg = np.concatenate([r.standard_normal(n_pairs), np.zeros(p_cap - n_pairs)]).astype(np.float32)
    if case == "unsorted_ids":  # shuffle the unique list (and remap the pairs): still valid
        perm = r.permutation(used)
        inv = np.argsort(perm)
        ids[:used] = ids[:used][perm]
        pu[:n_pairs] = inv[pu[:n_pairs]]
    if case == "unsorted_pairs":
        q = r.permutation(n_pairs)
        pu[:n_pairs], pr[:n_pairs], pg[:n_pairs] = pu[q], pr[q], pg[q]
    act = r.standard_normal((R, d)).astype(np.float32)
    table = r.standard_normal((rows, d)).astype(np.float32)
    slots = {k: np.full((rows, d), v, np.float32) for k, v in opt.slot_initial_values.items()}
    step = jnp.int32(2)
    fused = jax.jit(lambda t, s, *a: ops.backward_update(opt, t, s, *a, step))
    got_t, got_s = fused(jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()},
                         *(jnp.asarray(x) for x in (ids, act, pr, pu, pg)))
    # the unfused reference, all in pure JAX
    per = reference.segment_gather_sum(jnp.asarray(act), jnp.asarray(pr), jnp.asarray(pg),
                                       jnp.asarray(pu), num_segments=u_cap)
    uniq, g = reference.dedup_sum_by_sort(jnp.asarray(ids)[None], per)
    want_t, want_s = _reference_update(opt, table, slots, np.asarray(uniq), np.asarray(g),
                                       step)
    np.testing.assert_allclose(np.asarray(got_t), np.asarray(want_t), rtol=2e-6, atol=1e-6)
    for k in want_s:
        np.testing.assert_allclose(np.asarray(got_s[k]), np.asarray(want_s[k]), rtol=2e-6,
                                   atol=1e-6)


def _reference_update(opt, table, slots, uniq, g, step):
    t, s = table.copy(), {k: v.copy() for k, v in slots.items()}
    valid = uniq != PAD
    nr, ns = opt.update_rows(jnp.asarray(table[uniq[valid]]),
                             {k: jnp.asarray(v[uniq[valid]]) for k, v in slots.items()},
                             jnp.asarray(g[valid]), step)
    t[uniq[valid]] = np.asarray(nr)
    for k in s:
        s[k][uniq[valid]] = np.asarray(ns[k])
    return t, s
