"""The device ops: their CPU kernels against their pure-JAX references, the dispatch.

Skipped where the kernels cannot be built (no C++ compiler); the fallbacks are
exercised by every other test in that case, and here too with
`EMBEDMESH_CPU_KERNELS=0`.
"""

import functools
import os
import re
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import paths
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from optimizer_reference import ALL_FUSED, numpy_update_rows
from process_helpers import run_python

from embedmesh import _runtime
from embedmesh.device import ops
from embedmesh.device.ops import cpu, reference
from embedmesh.device.ops import tpu as tpu_kernels
from embedmesh.device.ops.cpu import kernels as cpu_kernels
from embedmesh.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, RowWiseAdagrad

PAD = ops.PAD_ID

needs_kernels = pytest.mark.skipif(
    not cpu.ready(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}"
)


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
    np.testing.assert_array_equal(
        np.asarray(jax.jit(ops.gather_rows)(table, ids)), np.asarray(table)[np.asarray(ids)]
    )
    empty = jax.jit(ops.gather_rows)(table, jnp.zeros((0,), jnp.int32))
    assert empty.shape == (0, 64)


@needs_kernels
def test_scatter_rows_in_place_and_copy():
    r = rng(3)
    base = r.standard_normal((400, 5)).astype(np.float32)
    ids = ids_with_padding(r, 400, 128, 100, sort=False, extra_bad=[(0, 400)])
    vals = r.standard_normal((128, 5)).astype(np.float32)
    want = np.asarray(
        reference.scatter_rows(jnp.asarray(base), jnp.asarray(ids), jnp.asarray(vals))
    )
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
        fn = jax.jit(lambda t, s, i, g, dd: ops.segment_gather_sum(t, i, g, dd, segs, src_map=s))
        got = fn(
            jnp.asarray(table),
            jnp.asarray(smap),
            jnp.asarray(sidx),
            jnp.asarray(gains),
            jnp.asarray(didx),
        )
    else:
        fn = jax.jit(lambda s, i, g, dd: ops.segment_gather_sum(s, i, g, dd, segs))
        got = fn(jnp.asarray(src), jnp.asarray(sidx), jnp.asarray(gains), jnp.asarray(didx))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    "case", ["one_sorted", "one_sorted_dups", "one_unsorted", "merge", "merge_unsorted"]
)
def test_dedup_sum(case):
    r = rng(5)
    n_blocks = 1 if case.startswith("one") else 3
    u, d, rows = 64, 6, 200
    blocks = []
    for _b in range(n_blocks):
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
    assert list(uniq[: len(keys)]) == keys
    assert (uniq[len(keys) :] == PAD).all()
    np.testing.assert_allclose(
        sums[: len(keys)], np.array([want_sums[k] for k in keys]), rtol=1e-5, atol=1e-6
    )
    assert not sums[len(keys) :].any()
    # the pure-JAX fallback agrees
    ju, js = jax.jit(reference.dedup_sum)(jnp.asarray(ids), jnp.asarray(grads))
    np.testing.assert_array_equal(np.asarray(ju), uniq)
    np.testing.assert_allclose(np.asarray(js), sums, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize(
    "opt",
    [
        Adagrad(0.3, initial_accumulator_value=0.2),
        Adagrad(
            0.1,
            clipvalue=0.05,
            weight_decay_factor=0.01,
            multiply_weight_decay_factor_by_learning_rate=True,
            clip_weight_min=-0.5,
            clip_weight_max=0.7,
        ),
        Adagrad(lambda step: 0.1 / (1.0 + step), weight_decay_factor=0.02),
        SGD(0.5),
        SGD(0.2, clipvalue=(-0.1, None), clip_weight_max=0.3),
        *ALL_FUSED,
    ],
)
def test_sparse_update_matches_update_rows(opt):
    r = rng(6)
    rows, d = 300, 12
    table = r.standard_normal((rows, d)).astype(np.float32)
    slots = {
        k: np.full((rows, opt.slot_width(k, d)), v, np.float32)
        + r.random((rows, opt.slot_width(k, d))).astype(np.float32)
        for k, v in opt.slot_initial_values.items()
    }
    ids = ids_with_padding(r, rows, 128, 100, sort=True)
    grads = r.standard_normal((128, d)).astype(np.float32)
    step = jnp.int32(3)
    f = jax.jit(
        lambda t, s, i, g, st: ops.sparse_update(opt, t, s, i, g, st), donate_argnums=(0, 1)
    )
    got_t, got_s = f(
        jnp.asarray(table),
        {k: jnp.asarray(v) for k, v in slots.items()},
        jnp.asarray(ids),
        jnp.asarray(grads),
        step,
    )
    assert (
        opt.fused_kernel is None
        or ops.kernel_for(
            "sparse_update", "cpu", table, slots, ids, grads, optimizer=opt, step=step
        )
        is cpu_kernels.sparse_update
    )
    want_t, want_s = _reference_update(opt, table, slots, ids, grads, step)
    np.testing.assert_allclose(np.asarray(got_t), want_t, rtol=2e-6, atol=1e-7)
    for k in want_s:
        np.testing.assert_allclose(np.asarray(got_s[k]), want_s[k], rtol=2e-6, atol=1e-7)
    # and the float64 numpy rule
    want_t, want_s = _reference_update(opt, table, slots, ids, grads, step, numpy_update_rows)
    np.testing.assert_allclose(np.asarray(got_t), want_t, rtol=1e-4, atol=1e-5)
    for k in want_s:
        np.testing.assert_allclose(np.asarray(got_s[k]), want_s[k], rtol=1e-4, atol=1e-5)


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
    np.testing.assert_array_equal(
        np.asarray(ops.gather_rows(table, ids)), np.asarray(reference.gather_rows(table, ids))
    )
    u, s = ops.dedup_sum(
        jnp.asarray(np.array([[1, 3, PAD]], np.int32)), jnp.ones((3, 4), jnp.float32)
    )
    assert list(np.asarray(u)) == [1, 3, PAD]
    assert not np.asarray(s)[2].any()
    t, sl = ops.sparse_update(
        Adagrad(0.1),
        table,
        {"accumulators": jnp.ones_like(table)},
        ids,
        jnp.ones((4, 4), jnp.float32),
        jnp.int32(0),
    )
    assert t.shape == table.shape and sl["accumulators"].shape == table.shape


@pytest.mark.parametrize(
    "dtype,value", [(np.float32, 0.1), (np.float32, -3.5), (np.int32, 7), (jnp.bfloat16, 1.25)]
)
@pytest.mark.parametrize("min_bytes", [0, 1 << 40])  # the fill kernel, and plain jnp.full
def test_full_on_a_device(dtype, value, min_bytes):
    device = jax.devices()[1]
    shape = (1000, 37)  # not a multiple of the kernel's tile
    got = ops.full(shape, value, dtype, device, min_bytes=min_bytes)
    assert got.devices() == {device} and got.dtype == dtype and got.shape == shape
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), np.full(shape, np.asarray(value, dtype), np.float64)
    )


@needs_kernels
@pytest.mark.parametrize(
    "case", ["sorted", "unsorted_ids", "unsorted_pairs", "large", "large_unsorted_at_chunk_edge"]
)
@pytest.mark.parametrize(
    "opt",
    [
        Adagrad(0.2, weight_decay_factor=0.01, clipvalue=0.5),
        SGD(0.3, clip_weight_min=-1.0),
        AdagradMomentum(0.1, momentum=0.5, use_nesterov=True),
        Adam(0.05, clipvalue=0.5),
        FTRL(0.1, l1_regularization_strength=0.01, weight_decay_factor=0.01),
        RowWiseAdagrad(0.1, clip_weight_max=0.9),
    ],
)
def test_backward_update_matches_unfused(case, opt):
    if case.startswith("large") and opt.fused_kernel not in ("sgd", "adagrad"):
        pytest.skip("the large cases exercise the transport, not the rule")
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
        pu[16384 - 5 : 16384], pu[16384 : 16384 + 5] = (
            pu[16384 : 16384 + 5].copy(),
            pu[16384 - 5 : 16384].copy(),
        )
        pu[16384 - 5 : 16384] = used - 1
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
    slots = {
        k: np.full((rows, opt.slot_width(k, d)), v, np.float32)
        for k, v in opt.slot_initial_values.items()
    }
    step = jnp.int32(2)
    fused = jax.jit(lambda t, s, *a: ops.backward_update(opt, t, s, *a, step))
    got_t, got_s = fused(
        jnp.asarray(table),
        {k: jnp.asarray(v) for k, v in slots.items()},
        *(jnp.asarray(x) for x in (ids, act, pr, pu, pg)),
    )
    # the unfused reference, all in pure JAX
    per = reference.segment_gather_sum(
        jnp.asarray(act), jnp.asarray(pr), jnp.asarray(pg), jnp.asarray(pu), num_segments=u_cap
    )
    uniq, g = reference.dedup_sum_by_sort(jnp.asarray(ids)[None], per)
    want_t, want_s = _reference_update(opt, table, slots, np.asarray(uniq), np.asarray(g), step)
    np.testing.assert_allclose(np.asarray(got_t), np.asarray(want_t), rtol=2e-6, atol=1e-6)
    for k in want_s:
        np.testing.assert_allclose(
            np.asarray(got_s[k]), np.asarray(want_s[k]), rtol=2e-6, atol=1e-6
        )


def _reference_update(opt, table, slots, uniq, g, step, update_rows=None):
    t, s = table.copy(), {k: v.copy() for k, v in slots.items()}
    valid = uniq != PAD
    nr, ns = (update_rows or type(opt).update_rows)(
        opt,
        jnp.asarray(table[uniq[valid]]),
        {k: jnp.asarray(v[uniq[valid]]) for k, v in slots.items()},
        jnp.asarray(g[valid]),
        step,
    )
    t[uniq[valid]] = np.asarray(nr)
    for k in s:
        s[k][uniq[valid]] = np.asarray(ns[k])
    return t, s


# ---------------------------------------------------------------------------
# Random inputs: each primitive op's CPU kernel against its reference

# 8 examples: most draw shapes not drawn before, each compiling its programs anew
_random_inputs = settings(max_examples=8, deadline=None)
SEEDS = st.integers(0, 2**31 - 1)  # the random tests' seeds


@functools.cache
def _jitted(module, op: str, static: tuple):
    """`module.op` jitted with its static keyword arguments, one function a (module, op,
    static): examples of shapes drawn before reuse its compiled programs."""
    return jax.jit(lambda *a: getattr(module, op)(*a, **dict(static)))


def kernel_and_reference(op: str, *args, **static):
    """Op `op` of the C++ kernels and of the reference on `args`, each jitted (`static`:
    its static keyword arguments), as numpy (each output of a tuple)."""

    def run(module):
        out = _jitted(module, op, tuple(sorted(static.items())))(*args)
        return jax.tree.map(np.asarray, out)

    return run(cpu_kernels), run(reference)


@needs_kernels
@_random_inputs
@given(
    seed=SEEDS,
    rows=st.sampled_from([1, 37, 300]),
    dim=st.sampled_from([1, 8]),
    n=st.sampled_from([0, 5, 256]),
)
@example(seed=1, rows=300, dim=8, n=256)  # the largest of each (the smallest: Hypothesis's first)
def test_gather_scatter_kernels_match_references_on_random_inputs(seed, rows, dim, n):
    r = rng(seed)
    table = jnp.asarray(r.standard_normal((rows, dim)).astype(np.float32))
    ids = r.integers(0, rows + 3, n).astype(np.int32)  # some past the end
    ids[r.random(n) < 0.1] = PAD
    ids = jnp.asarray(ids)
    np.testing.assert_array_equal(*kernel_and_reference("gather_rows", table, ids))
    distinct = ids_with_padding(r, rows, n, min(n, rows) // 2, sort=False)
    vals = jnp.asarray(r.standard_normal((n, dim)).astype(np.float32))
    got, want = kernel_and_reference("scatter_rows", table, jnp.asarray(distinct), vals)
    np.testing.assert_array_equal(got, want)


@needs_kernels
@_random_inputs
@given(
    seed=SEEDS,
    m=st.sampled_from([1, 50]),
    p=st.sampled_from([0, 7, 400]),
    segs=st.sampled_from([1, 33]),
)
@example(seed=2, m=50, p=400, segs=33)
def test_segment_gather_sum_kernels_match_references_on_random_inputs(seed, m, p, segs):
    r = rng(seed)
    d = 4
    src = jnp.asarray(r.standard_normal((m, d)).astype(np.float32))
    sidx = jnp.asarray(r.integers(0, m + 2, p).astype(np.int32))
    didx = jnp.asarray(r.integers(-1, segs + 2, p).astype(np.int32))
    gains = jnp.asarray(r.standard_normal(p).astype(np.float32))
    args = (src, sidx, gains, didx)
    got, want = kernel_and_reference("segment_gather_sum", *args, num_segments=segs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    table = jnp.asarray(r.standard_normal((3 * m, d)).astype(np.float32))
    smap = jnp.asarray(r.integers(0, 3 * m + 2, m).astype(np.int32))
    args = (table, smap, sidx, gains, didx)
    got, want = kernel_and_reference("segment_gather_sum_mapped", *args, num_segments=segs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
@_random_inputs
@given(
    seed=SEEDS,
    blocks=st.sampled_from([1, 3]),
    u=st.sampled_from([1, 16, 64]),
    sort=st.booleans(),
)
@example(seed=3, blocks=3, u=64, sort=False)
def test_dedup_sum_kernel_matches_reference_on_random_inputs(seed, blocks, u, sort):
    r = rng(seed)
    ids = np.stack(
        [
            ids_with_padding(r, 40, u, int(r.integers(0, min(u, 40) + 1)), sort=sort)
            for _ in range(blocks)
        ]
    )
    if not sort:
        ids[r.random(ids.shape) < 0.2] = 3  # duplicates, in any order
    grads = jnp.asarray(r.standard_normal((ids.size, 5)).astype(np.float32))
    ids = jnp.asarray(ids)
    (gu, gs), (wu, ws) = kernel_and_reference("dedup_sum", ids, grads)
    np.testing.assert_array_equal(gu, wu)
    np.testing.assert_allclose(gs, ws, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# The dispatch


def _random_update_args(dtype=np.float32, slot_names=("accumulators",)):
    r = rng(9)
    table = jnp.asarray(r.standard_normal((20, 4)).astype(dtype))
    slots = {k: jnp.ones((20, 4), dtype) for k in slot_names}
    return table, slots, jnp.asarray(np.arange(4, dtype=np.int32)), jnp.ones((4, 4))


@needs_kernels
def test_kernel_for_picks_the_cpu_kernel_when_it_takes_the_call():
    for op in (
        "gather_rows",
        "scatter_rows",
        "segment_gather_sum",
        "dedup_sum",
        "sparse_update",
        "backward_update",
        "huge_page_copy",
        "full",
    ):
        assert ops.kernel_for(op, "cpu") is cpu_kernels.KERNELS[op][0], op
        on_tpu = tpu_kernels.KERNELS[op][0] if op in tpu_kernels.KERNELS else None
        assert ops.kernel_for(op, "tpu") is (on_tpu or ops.reference_of(op)), op
    assert ops.reference_of("gather_rows") is reference.gather_rows
    table, slots, ids, grads = _random_update_args()
    fused = cpu_kernels.sparse_update
    generic = ops.reference_of("sparse_update")
    call = (table, slots, ids, grads)
    assert ops.kernel_for("sparse_update", "cpu", *call, optimizer=Adagrad(0.1), step=0) is fused
    assert (
        ops.kernel_for("sparse_update", "cpu", table, {}, ids, grads, optimizer=SGD(0.1), step=0)
        is fused
    )
    # the optimizer names no kernel, or the slots / dtypes are not the kernel's
    assert (
        ops.kernel_for("sparse_update", "cpu", *call, optimizer=AdagradMomentum(0.1), step=0)
        is generic
    )
    assert (
        ops.kernel_for(
            "sparse_update",
            "cpu",
            *_random_update_args(jnp.bfloat16),
            optimizer=Adagrad(0.1),
            step=0,
        )
        is generic
    )
    assert (
        ops.kernel_for(
            "sparse_update", "cpu", table, {}, ids, grads, optimizer=Adagrad(0.1), step=0
        )
        is generic
    )

    class MyAdagrad(Adagrad):
        pass

    assert (
        ops.kernel_for("sparse_update", "cpu", *call, optimizer=MyAdagrad(0.1), step=0) is generic
    )

    # the mapped kernel reads float32, bfloat16 and float16 tables, nothing else
    def mapped_for(dtype):
        src = jnp.zeros((5, 2), dtype)
        return ops.kernel_for(
            "segment_gather_sum_mapped", "cpu", src, *[jnp.zeros(1)] * 4, num_segments=1
        )

    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert mapped_for(dtype) is cpu_kernels.KERNELS["segment_gather_sum_mapped"][0], dtype
    assert mapped_for(jnp.int32) is reference.segment_gather_sum_mapped


def _custom_calls(fn, *args):
    return [
        line
        for line in jax.jit(fn).lower(*args).as_text().splitlines()
        if "custom_call @embedmesh" in line
    ]


@needs_kernels
def test_the_platform_of_the_computation_picks_the_kernel(monkeypatch):
    """A kernel registered for another platform is staged but not run on CPU; the
    registered CPU kernel is. (Fresh functions each time: jit caches traces.)"""
    table = jnp.arange(12, dtype=jnp.float32).reshape(6, 2)
    ids = jnp.asarray(np.array([4, 1, PAD], np.int32))
    want = np.asarray(reference.gather_rows(table, ids))

    def gather(t, i):
        return ops.gather_rows(t, i)

    registered = ops._PLATFORM_KERNELS
    monkeypatch.setitem(registered, "gather_rows", dict(registered["gather_rows"]))
    ops.register_kernel("gather_rows", "tpu", lambda t, i: reference.gather_rows(t, i) + 7)
    np.testing.assert_array_equal(np.asarray(jax.jit(gather)(table, ids)), want)
    assert len(_custom_calls(lambda t, i: ops.gather_rows(t, i), table, ids)) == 1
    ops.register_kernel("gather_rows", "cpu", lambda t, i: reference.gather_rows(t, i) - 1)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda t, i: ops.gather_rows(t, i))(table, ids)), want - 1
    )
    assert ops.kernel_for("gather_rows", "cpu") is not cpu_kernels.gather_rows
    del registered["gather_rows"]["cpu"]
    assert ops.kernel_for("gather_rows", "cpu") is reference.gather_rows
    with pytest.raises(KeyError):
        ops.register_kernel("no_such_op", "cpu", lambda: None)


@needs_kernels
def test_one_shard_update_is_one_fused_op_and_others_compose():
    """The one-shard backward + update stages one fused kernel for Adagrad, and the
    reference's parts (their own kernels) for an optimizer that names none."""
    r = rng(10)
    table = jnp.asarray(r.standard_normal((50, 4)).astype(np.float32))
    ids = jnp.asarray(ids_with_padding(r, 50, 16, 10))
    act = jnp.asarray(r.standard_normal((8, 4)).astype(np.float32))
    pr = jnp.asarray(r.integers(0, 8, 30).astype(np.int32))
    pu = jnp.asarray(np.sort(r.integers(0, 10, 30)).astype(np.int32))
    pg = jnp.ones((30,), jnp.float32)

    def step(opt, slots):
        return lambda t, *a: ops.backward_update(opt, t, slots, *a, 0)

    fused = _custom_calls(step(Adagrad(0.1), {"accumulators": table}), table, ids, act, pr, pu, pg)
    assert len(fused) == 1 and "embedmesh_backward_adagrad" in fused[0]
    slots = {"accumulators": table, "momenta": table}

    class Custom(AdagradMomentum):  # a subclass may change the rule: no fused kernel
        pass

    parts = " ".join(_custom_calls(step(Custom(0.1), slots), table, ids, act, pr, pu, pg))
    for target in ("segment_gather_sum", "dedup_sum", "gather_rows", "scatter_rows"):
        assert f"embedmesh_{target}" in parts


def test_kernels_wanted_only_as_the_switch_and_backend_say(monkeypatch):
    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: False)
    assert not cpu.ready() and "EMBEDMESH_CPU_KERNELS" in cpu.unavailable_reason()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: None)
    assert not cpu.ready() and "default backend is gpu" in cpu.unavailable_reason()
    assert ops.kernel_for("gather_rows", "cpu") is reference.gather_rows
    monkeypatch.setattr(_runtime, "cpu_kernels_setting", lambda: True)  # =1: anyway
    from embedmesh.device.ops.cpu import library

    assert cpu.ready() == library._load()


_ROOT = paths.ROOT


def _run_python(code: str, **env_vars) -> str:
    """Run `code` in a fresh interpreter on this tree, with `env_vars` set."""
    env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
    for k in ("EMBEDMESH_CPU_KERNELS", "EMBEDMESH_CPU_THREADS"):
        env.pop(k, None)
    env.update(env_vars)
    return run_python(code, env, _ROOT)


def test_switch_off_runs_every_op_as_its_reference():
    """EMBEDMESH_CPU_KERNELS=0: nothing is built or staged; the results are the references'."""
    out = _run_python(
        """
import jax, jax.numpy as jnp, numpy as np
from embedmesh.device import ops
from embedmesh.device.ops import cpu, reference
from embedmesh.device.ops import tpu as tpu_kernels
from embedmesh.device.ops.cpu import library
from embedmesh.optimizers import Adagrad
for op in ops.op_names():
    assert ops.kernel_for(op, "cpu") is ops.reference_of(op), op
assert not cpu.ready() and cpu.threads() == 0
table = jnp.arange(40, dtype=jnp.float32).reshape(10, 4)
ids = jnp.array([3, 1, ops.PAD_ID, 7], jnp.int32)
text = jax.jit(ops.gather_rows).lower(table, ids).as_text()
assert "custom_call" not in text
np.testing.assert_array_equal(np.asarray(jax.jit(ops.gather_rows)(table, ids)),
                              np.asarray(reference.gather_rows(table, ids)))
t, s = jax.jit(lambda t, a, i, g: ops.sparse_update(Adagrad(0.1), t, {"accumulators": a}, i,
                                                    g, 0))(table, jnp.ones_like(table), ids,
                                                           jnp.ones((4, 4)))
r, rs = Adagrad(0.1).update_rows(table[ids[:2]], {"accumulators": jnp.ones((2, 4))},
                                 jnp.ones((2, 4)), 0)
np.testing.assert_array_equal(np.asarray(t[ids[:2]]), np.asarray(r))
assert "lib" not in library._loaded and library.library_path() == ""
print("off", cpu.unavailable_reason())
""",
        EMBEDMESH_CPU_KERNELS="0",
    )
    assert "off disabled by EMBEDMESH_CPU_KERNELS" in out


@needs_kernels
def test_thread_switch_and_the_thread_pool():
    """One fresh process (EMBEDMESH_CPU_THREADS=5): importing builds nothing, the library
    runs the switch's 5 threads a call (more than the cores of the CI's machines); and
    ParallelFor's persistent pool: a ParallelFor inside a ParallelFor's chunk, and
    ParallelFor from several threads at once, run each chunk exactly once and return (no
    deadlock: a fresh process with a timeout), in a child of fork() after the parent's
    pool started too."""
    out = _run_python(
        """
import ctypes, os
import embedmesh
from embedmesh.device.ops.cpu import library
assert not library._loaded, library._loaded
print("threads", library.threads())
assert library.ready()
lib = library._loaded["lib"]
lib.EmbedmeshParallelForCheck.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p]
lib.EmbedmeshParallelForCheck.restype = None

def check(callers, outer, inner):
    out = (ctypes.c_int64 * 3)(-7, -7, -7)
    lib.EmbedmeshParallelForCheck(callers, outer, inner, out)
    n = callers * outer * inner
    want = [n, n * (n + 1) // 2, n * (n + 1) * (2 * n + 1) // 6]
    assert list(out) == want, (callers, outer, inner, list(out))

shapes = [(1, 1, 1), (1, 7, 1), (1, 1, 9), (1, 5, 13), (3, 4, 6), (6, 3, 3), (2, 64, 2)]
for _ in range(20):
    for shape in shapes + [(4, 1, 50)]:
        check(*shape)
pid = os.fork()
if pid == 0:
    check(3, 4, 6)
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
print("pool ok", library.threads())
""",
        EMBEDMESH_CPU_THREADS="5",
    )
    assert "threads 5" in out and "pool ok 5" in out
    if not os.environ.get("EMBEDMESH_CPU_THREADS"):  # this process: the default
        assert cpu.threads() == _runtime.usable_cores()


@needs_kernels
def test_cpu_pad_id_is_the_runtime_pad_id():
    assert cpu.pad_id() == _runtime.PAD_ID == ops.PAD_ID


def test_kernel_sources_are_package_data():
    import importlib.resources

    from embedmesh.device.ops.cpu import build

    names = {f.name for f in importlib.resources.files("embedmesh.device.ops.cpu").iterdir()}
    sources = {os.path.basename(f) for f in build.source_files()}
    assert (
        {
            "common.h",
            "common.cc",
            "gather_scatter.cc",
            "segment_sum.cc",
            "dedup.cc",
            "update.cc",
            "memory.cc",
        }
        <= sources
        <= names
    )
    with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert set(data["embedmesh.device.ops.cpu"]) >= {"*.cc", "*.h"}
    with open(os.path.join(build.SOURCE_DIR, "common.h")) as f:
        assert int(re.search(r"kPad = (\d+);", f.read()).group(1)) == _runtime.PAD_ID


def test_no_platform_question_outside_the_ops_layer():
    device_dir = os.path.dirname(os.path.dirname(ops.__file__))
    strategy_modules = sorted(
        os.path.join("strategies", f)
        for f in os.listdir(os.path.join(device_dir, "strategies"))
        if f.endswith(".py")
    )
    assert len(strategy_modules) >= 5, strategy_modules
    for name in ("core.py", "shard_program.py", *strategy_modules):
        with open(os.path.join(device_dir, name)) as f:
            text = f.read()
        for word in ("default_backend", "platform", "available(", "PendingGradients"):
            assert word not in text, (name, word)


# ---------------------------------------------------------------------------
# Optimizers name their fused kernel


def test_optimizers_name_their_fused_kernel():
    assert SGD(0.1).fused_kernel == "sgd"
    assert Adagrad(0.1, clipvalue=1.0, weight_decay_factor=0.1).fused_kernel == "adagrad"
    assert AdagradMomentum(0.1).fused_kernel == "adagrad_momentum"
    assert Adam(0.1).fused_kernel == "adam"
    assert FTRL(0.1).fused_kernel == "ftrl"
    assert RowWiseAdagrad(0.1).fused_kernel == "rowwise_adagrad"
    assert Adam(0.1, lazy_adam=False).fused_kernel is None  # every row: the dense path

    class Subclass(SGD):  # may change the rule: no kernel unless it says so
        pass

    class Declares(Adagrad):
        _FUSED_KERNEL = "adagrad"

    assert Subclass(0.1).fused_kernel is None
    assert Declares(0.1).fused_kernel == "adagrad"


def test_fused_attrs():
    inf = float("inf")
    a = Adagrad(
        lambda step: 0.5 / (1.0 + step),
        clipvalue=(-0.1, None),
        weight_decay_factor=0.01,
        multiply_weight_decay_factor_by_learning_rate=True,
        clip_weight_max=0.7,
    ).fused_attrs(jnp.int32(1))
    assert float(a.pop("learning_rate")) == pytest.approx(0.25)
    assert a == dict(
        clip_lo=-0.1, clip_hi=inf, wd=0.01, has_wd=True, wd_lr=True, wmin=-inf, wmax=0.7
    )
    b = SGD(0.3).fused_attrs(0)
    assert float(b.pop("learning_rate")) == pytest.approx(0.3)
    assert b == dict(
        clip_lo=-inf, clip_hi=inf, wd=0.0, has_wd=False, wd_lr=False, wmin=-inf, wmax=inf
    )


@needs_kernels
def test_the_library_lists_every_target_the_python_side_calls():
    """The FFI targets come from the C++ library's own list (common.h `Handlers`): every
    target name the Python side calls is listed, and the fused optimizers are exactly
    the built-in optimizers that name a fused kernel (update.cc's rules)."""
    import inspect

    from embedmesh.device.ops.cpu import library, memory

    assert cpu.ready()
    listed = library.targets()
    assert all(isinstance(a, int) and a for a in listed.values())
    called = set()
    for module in (cpu_kernels, memory):
        src = inspect.getsource(module)
        called |= set(re.findall(r'"(embedmesh_[a-z_]+)"', src))
        templates = re.findall(r'"(embedmesh_[a-z_]*\{\}[a-z_]*)"', src)
        called |= {t.format(k) for t in templates for k in cpu_kernels.fused_kinds()}
    called.discard("embedmesh_sparse_")  # fused_kinds' prefix
    assert called and called <= set(listed), sorted(called - set(listed))
    optimizers = [SGD(0.1), Adagrad(0.1), AdagradMomentum(0.1), Adam(0.1), FTRL(0.1)]
    optimizers.append(RowWiseAdagrad(0.1))
    assert cpu_kernels.fused_kinds() == {o.fused_kernel for o in optimizers}
