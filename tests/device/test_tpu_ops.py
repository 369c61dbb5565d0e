"""The Pallas TPU kernels (`embedmesh.device.ops.tpu.pallas`), each against a float64
reference written out as plain loops: the pair sums `combine` / `reduce` (pairs in the
host's order, in any order: sorted on the device; the resident side split into row
ranges), their `schedule` and `is_sorted`, and the row moves `gather_rows_dma` /
`scatter_rows_dma`.

Off a TPU the kernels run in Pallas's TPU interpreter (`pallas.INTERPRET = True`, slow:
the shapes are small, the blocks too, so that they still make many blocks). On a TPU
the same tests run compiled: `JAX_PLATFORMS=tpu pytest -p no:xdist tests/device/test_tpu_ops.py`
on the chip (conftest.py otherwise picks the CPU).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from embedmesh.device.ops.tpu import pallas

# No shrinking: each example runs the interpreter for seconds (a failure shows as drawn).
_random_inputs = settings(
    max_examples=5, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
BIG = 2**31 - 1
DIMS = [1, 3, 64, 100, 128, 129, 256]


@pytest.fixture(autouse=True, scope="module")
def interpret_off_tpu():
    """The kernels run in the interpreter unless the backend is a TPU (then compiled)."""
    old = pallas.INTERPRET
    if jax.default_backend() != "tpu":
        pallas.INTERPRET = True
    yield
    pallas.INTERPRET = old
    _clear_kernel_caches()  # no interpreted trace outlives the module


def _clear_kernel_caches():
    """Drop the kernels' jit traces (they read INTERPRET and RESIDENT_BYTES when traced)."""
    for f in (
        pallas.reduce_sorted,
        pallas.gather_rows_dma,
        pallas.scatter_rows_dma,
        _gather_rows,
        _scatter_rows,
    ):
        if hasattr(f, "clear_cache"):  # the jitted ones
            f.clear_cache()


def rng(seed=0):
    return np.random.default_rng(seed)


def signed(r, shape, lo=0.1, hi=2.0):
    """Random values of magnitude in [lo, hi], either sign: never zero."""
    return (r.uniform(lo, hi, shape) * r.choice([-1.0, 1.0], shape)).astype(np.float32)


# ---------------------------------------------------------------------------
# Pairs as the host makes them, and the float64 references


def skewed_keys(r, num_keys, n):
    """[n] keys in [0, num_keys), Zipf-like (a few keys take most pairs), drawn from
    three quarters of the keys: the others get no pair."""
    used = r.choice(num_keys, max(1, 3 * num_keys // 4), replace=False)
    ranks = (r.zipf(1.3, n) - 1) % used.size
    return used[ranks]


def bad_pairs(r, num_keys, num_dst, n):
    """[n] invalid pairs with non-zero gains: dst out of range (past the end, 2**31-1,
    -2**31) or key out of range (the same). Ids in [-rows, 0): test_pair_ops_skip_negative_ids."""
    key = np.empty(n, np.int64)
    dst = np.empty(n, np.int64)
    for i in range(n):
        k, d = int(r.integers(0, num_keys)), int(r.integers(0, num_dst))
        kind = i % 7
        if kind < 4:
            d = [num_dst, num_dst + 3, BIG, -(2**31)][kind]
        else:
            k = [num_keys, BIG, -(2**31)][kind - 4]
        key[i], dst[i] = k, d
    return key, dst, signed(r, n)


def make_pairs(r, num_keys, num_dst, n_valid, *, n_bad=0, n_pad=0, layout="sorted", keys=None):
    """Pairs in the host's order (by key, then dst), `n_bad` invalid ones and `n_pad`
    padding pairs (key 0, dst num_dst, gain 0) laid out as `layout`:
    "sorted": the invalid and padding pairs after the valid ones (the kernels' path);
    "invalid_inside": the invalid pairs among the valid ones, the padding last;
    "unsorted": all of them shuffled."""
    if keys is None:
        keys = skewed_keys(r, num_keys, n_valid)
    keys = np.asarray(keys, np.int64)
    dst = r.integers(0, num_dst, keys.size)
    order = np.lexsort((dst, keys))
    key, dst, gains = keys[order], dst[order], signed(r, keys.size)
    bk, bd, bg = bad_pairs(r, num_keys, num_dst, n_bad)
    pk, pd, pg = np.zeros(n_pad, np.int64), np.full(n_pad, num_dst), np.zeros(n_pad, np.float32)
    if layout == "invalid_inside" and key.size and n_bad:
        at = r.integers(0, key.size, n_bad)  # each before some valid pair
        key, dst, gains = (np.insert(a, at, b) for a, b in ((key, bk), (dst, bd), (gains, bg)))
        bk, bd, bg = bk[:0], bd[:0], bg[:0]
    key, dst, gains = (np.concatenate(x) for x in ((key, bk, pk), (dst, bd, pd), (gains, bg, pg)))
    if layout == "unsorted":
        perm = r.permutation(key.size)
        key, dst, gains = key[perm], dst[perm], gains[perm]
    return key.astype(np.int32), dst.astype(np.int32), gains.astype(np.float32)


def combine_reference(src, key, dst, gains, num_dst):
    """out[dst[p]] += gains[p] * src[key[p]] over the valid pairs, in float64; and the
    sum of the terms' magnitudes (for the tolerance)."""
    out = np.zeros((num_dst, src.shape[1]))
    mag = np.zeros_like(out)
    for p in range(key.size):
        k, d = int(key[p]), int(dst[p])
        if 0 <= k < src.shape[0] and 0 <= d < num_dst:
            term = float(gains[p]) * src[k].astype(np.float64)
            out[d] += term
            mag[d] += np.abs(term)
    return out, mag


def reduce_reference(src, key, dst, gains, num_out):
    """out[key[p]] += gains[p] * src[dst[p]] over the valid pairs, in float64; and the
    sum of the terms' magnitudes."""
    out = np.zeros((num_out, src.shape[1]))
    mag = np.zeros_like(out)
    for p in range(key.size):
        k, d = int(key[p]), int(dst[p])
        if 0 <= k < num_out and 0 <= d < src.shape[0]:
            term = float(gains[p]) * src[d].astype(np.float64)
            out[k] += term
            mag[k] += np.abs(term)
    return out, mag


def sorted_reference(key, dst, num_keys, num_dst):
    """Whether the valid pairs come in ascending key order, every invalid pair after them."""
    seen_invalid, last = False, -1
    for k, d in zip(key.tolist(), dst.tolist()):
        if not (0 <= k < num_keys and 0 <= d < num_dst):
            seen_invalid = True
        elif seen_invalid or k < last:
            return False
        else:
            last = k
    return True


def assert_sums_close(got, want, mag):
    got = np.asarray(got)
    assert got.shape == want.shape
    atol = 1e-5 * max(1.0, float(mag.max(initial=0)))  # scaled to the largest sums
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


def sides(op, r, num_keys, num_dst, dim):
    """The rows `op` reads (the resident side): combine's are the keys', reduce's the
    dsts'; and its reference and output rows."""
    if op == "combine":
        return signed(r, (num_keys, dim)), combine_reference, num_dst
    return signed(r, (num_dst, dim)), reduce_reference, num_keys


# ---------------------------------------------------------------------------
# combine / reduce, the host's pairs


@settings(_random_inputs, max_examples=4)
@given(
    seed=st.integers(0, 2**31 - 1),
    dim=st.sampled_from(DIMS),
    num_keys=st.sampled_from([1, 7, 50]),
    num_dst=st.sampled_from([1, 9, 40]),
    n_valid=st.sampled_from([0, 1, 37, 64]),
    n_bad=st.sampled_from([0, 7]),  # 7: every kind of invalid pair
    n_pad=st.sampled_from([0, 13]),
    layout=st.sampled_from(["sorted", "invalid_inside"]),
)
def test_pair_ops_match_reference(seed, dim, num_keys, num_dst, n_valid, n_bad, n_pad, layout):
    """Both ops (combine, reduce) on each example's pairs (one is_sorted for both)."""
    r = rng(seed)
    key, dst, gains = make_pairs(
        r, num_keys, num_dst, n_valid, n_bad=n_bad, n_pad=n_pad, layout=layout
    )
    # sorted: the kernels' path; invalid pairs among valid ones: XLA's
    kernel_path = layout == "sorted" or not (n_valid and n_bad)
    # is_sorted and both ops one program (each example's shapes are new: their jnp ops
    # compiled one by one, or a program each, cost more than the one program)
    srcs = {op: sides(op, r, num_keys, num_dst, dim) for op in ("combine", "reduce")}

    def all_three(src_c, src_r, k, d, g):
        return (
            pallas.is_sorted(k, d, num_keys, num_dst),
            pallas.combine(src_c, k, d, g, num_dst),
            pallas.reduce(src_r, k, d, g, num_keys),
        )

    ok, *sums = jax.jit(all_three)(srcs["combine"][0], srcs["reduce"][0], key, dst, gains)
    assert bool(ok) == kernel_path
    for op, got in zip(("combine", "reduce"), sums):
        src, reference, num_out = srcs[op]
        want, mag = reference(src, key, dst, gains, num_out)
        assert_sums_close(got, want, mag)
        if op == "reduce":  # keys without a pair: zero rows
            absent = np.setdiff1d(np.arange(num_out), key)
            assert (np.asarray(got)[absent] == 0).all()


@pytest.mark.parametrize("op, dim", [("combine", 3), ("reduce", 128)])
def test_pair_ops_take_any_order(op, dim):
    """Pairs out of key order (padding and invalid pairs among them): sorted on the device.
    Each op once, each row width once (whole vreg rows or padded lanes: the sort on the
    device comes before and does not see the rows)."""
    r = rng(10 + dim)
    num_keys, num_dst = 30, 20
    key, dst, gains = make_pairs(r, num_keys, num_dst, 60, n_bad=7, n_pad=6, layout="unsorted")
    assert not bool(pallas.is_sorted(key, dst, num_keys, num_dst))
    src, reference, num_out = sides(op, r, num_keys, num_dst, dim)
    got = getattr(pallas, op)(jnp.asarray(src), key, dst, gains, num_out)
    assert_sums_close(got, *reference(src, key, dst, gains, num_out))


@pytest.mark.parametrize("order", ["sorted", "negative_first"])
@pytest.mark.parametrize("op", ["combine", "reduce"])
def test_pair_ops_skip_negative_ids(op, order):
    """A pair whose id on the read side (combine's key, reduce's dst) is -1 contributes
    nothing: behind the valid pairs or before them (sorted on the device)."""
    src = jnp.asarray([[1.0], [2.0]])  # -1 read as the last row would add 2
    ids = np.array([0, -1] if order == "sorted" else [-1, 0], np.int32)
    zeros, gains = np.zeros(2, np.int32), np.ones(2, np.float32)
    if op == "combine":
        got = pallas.combine(src, ids, zeros, gains, 1)
    else:
        got = pallas.reduce(src, zeros, ids, gains, 1)
    np.testing.assert_array_equal(np.asarray(got), [[1.0]])


def test_reference_segment_sum_drops_extreme_ids():
    """The op's reference (XLA's segment sum, which the kernels are checked against and
    every op without a kernel runs) skips dst ids 2**31 - 1, -2**31 and past-the-end
    ones: on the chip, XLA's segment sum added such rows into segment 0 (2026-12-04)."""
    from embedmesh.device.ops import reference

    r = rng(11)
    src = signed(r, (6, 256))
    key = np.array([0, 1, BIG, 2, -(2**31), 1, 4, 3], np.int32)  # dst of the sums
    read = np.array([0, 5, 1, 2, 3, 4, 5, 1], np.int32)
    gains = signed(r, key.size)
    got = reference.segment_gather_sum(jnp.asarray(src), read, gains, key, num_segments=4)
    assert_sums_close(got, *reduce_reference(src, key, read, gains, 4))


@pytest.mark.parametrize("form", ["segment_sum", "add_drop", "set_drop"])
@pytest.mark.parametrize("rows", [4, 3000])
def test_xla_scatter_drops_ids_outside(form, rows):
    """What this backend's XLA does with ids past the end under "drop" (embedmesh's
    padding is 2**31 - 1): dropped on CPU. A failure on a chip says which of XLA's
    scatters there needs its ids made valid first (as `reference.segment_gather_sum`
    does): the diagnosis of test_reference_segment_sum_drops_extreme_ids."""
    r = rng(rows)
    n = 40
    ids = r.integers(0, rows, n)
    ids[::4] = rows  # just past the end
    ids[1::8] = BIG
    ids[3::8] = rows + 7
    ids = ids.astype(np.int32)
    upd = signed(r, (n, 128))
    base = signed(r, (rows, 128))
    ok = ids < rows
    want = np.zeros((rows, 128)) if form == "segment_sum" else base.astype(np.float64)
    for i in np.flatnonzero(ok):
        if form == "set_drop":
            want[ids[i]] = upd[i]
        else:
            want[ids[i]] += upd[i]
    if form == "set_drop":  # distinct ids: the set is then defined
        _, first = np.unique(ids, return_index=True)
        keep = np.zeros(n, bool)
        keep[first] = True
        ids = np.where(keep | ~ok, ids, rows)
        want = base.astype(np.float64)
        want[ids[ids < rows]] = upd[ids < rows]
    f = {
        "segment_sum": lambda b, i, u: jax.ops.segment_sum(u, i, num_segments=rows),
        "add_drop": lambda b, i, u: b.at[i].add(u, mode="drop"),
        "set_drop": lambda b, i, u: b.at[i].set(u, mode="drop"),
    }[form]
    got = jax.jit(f)(jnp.asarray(base), jnp.asarray(ids), jnp.asarray(upd))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("op", ["combine", "reduce"])
def test_pair_ops_read_whole_vreg_rows_in_place(op):
    """Rows already whole float32 vregs, a multiple of 8 of them (a TPU stack's): the
    kernel reads them as they are, no padded copy; the sums as the reference's."""
    r = rng(21)
    num_keys, num_dst = (16, 11) if op == "combine" else (11, 16)
    key, dst, gains = make_pairs(r, num_keys, num_dst, 40, n_bad=7, n_pad=3)
    src, reference, num_out = sides(op, r, num_keys, num_dst, 128)
    assert src.shape == (16, 128)
    got = getattr(pallas, op)(jnp.asarray(src), key, dst, gains, num_out)
    assert_sums_close(got, *reference(src, key, dst, gains, num_out))


def test_pair_ops_without_pairs():
    r = rng(3)
    src = signed(r, (9, 64))
    none_i, none_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    got = pallas.combine(jnp.asarray(src), none_i, none_i, none_f, 5)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((5, 64), np.float32))
    got = pallas.reduce(jnp.asarray(src), none_i, none_i, none_f, 6)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((6, 64), np.float32))


# ---------------------------------------------------------------------------
# reduce_sorted (and combine), small blocks: items across key and pair blocks

# A TPU takes rank-1 SMEM blocks of 128 pairs or more; the interpreter any.
TW, TP = 16, (128 if jax.default_backend() == "tpu" else 32)
TG = 128 if jax.default_backend() == "tpu" else 16


def small_block_case(name, r):
    """(num_keys, num_dst, key, dst, gains) of the small-block cases (TW keys, TP pairs)."""
    if name == "hot_key":  # key 5: 100 pairs, more than TP (a key block over 4+ pair blocks)
        keys = np.concatenate([[5] * 100, skewed_keys(r, 40, 60)])
        return (40, 30, *make_pairs(r, 40, 30, 0, n_pad=7, keys=keys))
    if name == "spread":  # 40 keys over 6 key blocks: a pair block covers several
        keys = np.repeat(r.choice(90, 40, replace=False), r.integers(1, 3, 40))
        return (90, 20, *make_pairs(r, 90, 20, 0, n_bad=3, keys=keys))
    if name == "empty_blocks":  # keys in [0, 10) and [50, 60) only: blocks 1, 2, 4 empty
        keys = np.concatenate([r.integers(0, 10, 50), r.integers(50, 60, 30)])
        return (80, 25, *make_pairs(r, 80, 25, 0, n_pad=5, keys=keys))
    if name == "zipf":  # 5 key blocks, 4+ pair blocks
        return (70, 33, *make_pairs(r, 70, 33, 4 * TP + 10, n_bad=6, n_pad=9))
    if name == "padding_only":
        return (20, 10, *make_pairs(r, 20, 10, 0, n_pad=40))
    raise ValueError(name)


@pytest.mark.parametrize(
    "op, case, dim",
    [
        # combine sorts the pairs by dst, its kernel's keys: the cases' key structure
        # (hot, spread, empty blocks) is reduce's; combine's two cases its own path
        ("combine", "hot_key", 1),
        ("combine", "zipf", 100),
        ("reduce", "hot_key", 129),
        ("reduce", "spread", 3),
        ("reduce", "empty_blocks", 64),
        ("reduce", "zipf", 256),
        ("reduce", "padding_only", 128),
    ],
)
def test_sorted_kernels_with_small_blocks(op, case, dim):
    r = rng(len(case) * 1000 + dim)
    num_keys, num_dst, key, dst, gains = small_block_case(case, r)
    src, reference, num_out = sides(op, r, num_keys, num_dst, dim)
    if op == "combine":
        out = pallas.combine(src, key, dst, gains, num_dst, tw=TW, tp=TP)
    else:
        out, ok = pallas.reduce_sorted(src, key, dst, gains, num_out=num_keys, tw=TW, tp=TP)
        assert bool(ok)
        out = np.asarray(out)
        assert out.shape == (num_out, pallas.lane_width(dim))
        assert (out[:, dim:] == 0).all()  # the lanes past the dim
        out = out[:, :dim]
    assert_sums_close(out, *reference(src, key, dst, gains, num_out))


# ---------------------------------------------------------------------------
# The resident side split into column blocks and row ranges


@pytest.fixture
def small_resident(monkeypatch):
    """RESIDENT_BYTES of 40 rows of 128 lanes; counts the kernel calls (one a range)."""
    monkeypatch.setattr(pallas, "RESIDENT_BYTES", 8 * 128 * 4 * 5)
    calls = []
    real = pallas._reduce_call

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(pallas, "_reduce_call", counted)
    _clear_kernel_caches()  # traced again with the small limit
    yield calls
    _clear_kernel_caches()


@pytest.mark.parametrize(
    "op, dim, src_rows, ranges",
    [
        ("combine", 64, 60, 2),  # 40 + 20 source rows (the keys')
        ("reduce", 129, 50, 4),  # 2 column blocks of 128 lanes x rows 40 + 10 (the dsts')
        ("reduce", 200, 30, 2),  # 2 column blocks of 128 lanes, every row in each
    ],
)
def test_resident_side_split_into_ranges(small_resident, op, dim, src_rows, ranges):
    r = rng(dim)
    other = 45
    num_keys, num_dst = (src_rows, other) if op == "combine" else (other, src_rows)
    # few pairs (the interpreter's cost goes with them), but every range read by some
    key, dst, gains = make_pairs(r, num_keys, num_dst, 48, n_bad=4, n_pad=5)
    chunks = pallas._chunks(src_rows, pallas.lane_width(dim))
    assert len(chunks) == ranges
    valid = (key >= 0) & (key < num_keys) & (dst >= 0) & (dst < num_dst)
    read = (key if op == "combine" else dst)[valid]
    for r0, rows, _, _ in chunks:
        assert ((read >= r0) & (read < r0 + rows)).any(), (r0, rows)
    src, reference, num_out = sides(op, r, num_keys, num_dst, dim)
    assert src.shape[0] == src_rows
    got = getattr(pallas, op)(jnp.asarray(src), key, dst, gains, num_out)
    assert len(small_resident) == ranges
    assert_sums_close(got, *reference(src, key, dst, gains, num_out))


def test_resident_side_blocks(small_resident):
    """`_chunks` under the 40-row limit: whole rows in column blocks where they fit (256
    lanes of 10 rows: one block, one kernel call), else row ranges, the last one ragged;
    a kernel call a block (test_resident_side_split_into_ranges)."""
    assert pallas._chunks(10, 256) == [(0, 10, 0, 256)]
    assert pallas._chunks(30, 256) == [(0, 30, 0, 128), (0, 30, 128, 128)]
    assert pallas._chunks(60, 128) == [(0, 40, 0, 128), (40, 20, 0, 128)]
    assert pallas._chunks(100, 128) == [(0, 40, 0, 128), (40, 40, 0, 128), (80, 20, 0, 128)]
    assert pallas._chunks(50, 256) == [
        (0, 40, 0, 128),
        (40, 10, 0, 128),
        (0, 40, 128, 128),
        (40, 10, 128, 128),
    ]


# one compiled program a shape, not one a jnp op (the eager ops compile one by one)
_schedule = jax.jit(pallas.schedule, static_argnums=(3, 4, 5, 6))


def one_hot_pairs(r, tables, keys_each, outs_each):
    """Pairs of one-hot features stacked in one table, in the host's order (by key,
    then output row): table t's keys in its own `keys_each` rows, its samples' output
    rows in its own `outs_each` (each output row one pair), some padding last."""
    key = np.concatenate(
        [t * keys_each + (r.zipf(1.5, outs_each) - 1) % keys_each for t in range(tables)]
    )
    dst = np.arange(tables * outs_each)
    order = np.lexsort((dst, key))
    key = np.concatenate([key[order], np.zeros(5, np.int64)])
    dst = np.concatenate([dst[order], np.full(5, tables * outs_each)])
    gains = np.concatenate([signed(r, tables * outs_each), np.zeros(5, np.float32)])
    return key.astype(np.int32), dst.astype(np.int32), gains


def _visits(key, dst, gains, num_keys, num_src):
    """(items with pairs, summed over the passes of `_chunks(num_src, 128)`, with each
    pass visiting only its pair blocks; items with pairs in one pass over every row)."""
    ranges = pallas._chunks(num_src, 128)

    @jax.jit  # one program, not one a range
    def items(key, dst, gains):
        sched, _ = pallas.schedule(key, dst, gains, num_keys, num_src, TW, TP)
        passes = [pallas._in_range(sched, r0, n, TW, TP) for r0, n, _, _ in ranges]
        return sum(jnp.sum(s[3] > s[2]) for s in passes), jnp.sum(sched.hi > sched.lo)

    return tuple(int(x) for x in items(key, dst, gains))


def test_ranges_visit_only_the_pair_blocks_that_read_them(small_resident, monkeypatch):
    """One-hot features over the resident side's row ranges (40 rows each): a range's
    pass visits only the pair blocks that read its rows and adds into the sums of the
    passes before; the sums are the reference's. Both sides' passes counted: the
    backward's (resident: the output rows) and the lookup's (the distinct rows; its
    kernel is the same `reduce_sorted` after a sort by output row)."""
    r = rng(63)
    # sizes in proportion to a pair block (TP pairs): a block of one-hot pairs then reads
    # rows of one or two ranges, on the chip (TP 128) as in interpret mode (TP 32)
    scale = TP // 32
    monkeypatch.setattr(pallas, "RESIDENT_BYTES", pallas.RESIDENT_BYTES * scale)
    tables, keys_each, outs_each = 3, 30 * scale, TP  # 90 distinct rows, 3 TP output rows
    key, dst, gains = one_hot_pairs(r, tables, keys_each, outs_each)
    num_keys, num_dst = tables * keys_each, tables * outs_each
    src, reference, _ = sides("reduce", r, num_keys, num_dst, 128)
    got, ok = pallas.reduce_sorted(
        jnp.asarray(src), key, dst, gains, num_out=num_keys, tw=TW, tp=TP
    )
    assert bool(ok)
    assert len(small_resident) == len(pallas._chunks(num_dst, 128)) >= 3
    assert_sums_close(np.asarray(got)[:, :128], *reference(src, key, dst, gains, num_keys))
    by_dst = pallas._sort_by(dst, key, gains, num_dst, num_keys)
    for pairs, num_out, num_src in (
        (by_dst, num_dst, num_keys),
        ((key, dst, gains), num_keys, num_dst),
    ):
        visited, walked = _visits(*pairs, num_out, num_src)
        ranges = len(pallas._chunks(num_src, 128))
        assert ranges >= 3
        assert walked <= visited <= 2 * walked < ranges * walked  # a block: 1 or 2 ranges


# ---------------------------------------------------------------------------
# is_sorted and schedule

K, D = 8, 6  # keys, dsts of the is_sorted cases
SORTED_CASES = [
    ("sorted", [0, 0, 1, 3, 3, 3, 7], [1, 4, 0, 2, 2, 5, 3], True),
    ("equal_keys_any_dst", [2, 2, 2, 4], [5, 1, 3, 0], True),
    ("padding_tail", [0, 1, 1, 6, 0, 0], [3, 0, 2, 1, D, D], True),
    ("invalid_tail", [1, 2, -1, K, 3, BIG], [0, 0, 1, 1, D + 1, -1], True),
    ("unsorted", [0, 2, 1, 3], [0, 0, 0, 0], False),
    ("descending_run", [5, 5, 4], [1, 2, 3], False),
    ("invalid_inside", [0, 0, 1, 2], [1, D, 0, 0], False),
    ("padding_first", [0, 0, 3], [D, 1, 1], False),
    ("only_padding", [0, 0, 0], [D, D, D], True),
    ("one_pair", [7], [5], True),
    ("none", [], [], True),
]


@pytest.mark.parametrize("name, key, dst, want", SORTED_CASES, ids=[c[0] for c in SORTED_CASES])
def test_is_sorted(name, key, dst, want):
    key, dst = np.asarray(key, np.int32), np.asarray(dst, np.int32)
    assert sorted_reference(key, dst, K, D) == want  # the case is what it says
    gains = np.ones(key.size, np.float32)

    @jax.jit  # one program a case, not one a jnp op
    def verdicts(key, dst, gains):
        return [pallas.is_sorted(key, dst, K, D)] + [
            pallas.schedule(key, dst, gains, K, D, tw, tp)[1] for tw, tp in [(8, 8), (16, 4)]
        ]

    assert [bool(v) for v in verdicts(key, dst, gains)] == [want] * 3


@settings(max_examples=6, deadline=None, phases=_random_inputs.phases)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_keys=st.sampled_from([1, 5, 40, 100]),
    n_valid=st.sampled_from([0, 1, 31, 32, 33, 150]),
    n_tail=st.sampled_from([0, 4]),
    tw=st.sampled_from([8, 16]),
    tp=st.sampled_from([8, 32]),
)
def test_schedule_covers_each_valid_pair_once(seed, num_keys, n_valid, n_tail, tw, tp):
    r = rng(seed)
    num_dst = 12
    key, dst, gains = make_pairs(r, num_keys, num_dst, n_valid, n_bad=n_tail, n_pad=n_tail)
    sched, ok = _schedule(
        jnp.asarray(key), jnp.asarray(dst), jnp.asarray(gains), num_keys, num_dst, tw, tp
    )
    assert bool(ok)
    block, pair_block, lo, hi, first = (np.asarray(a) for a in sched.scalars)
    p = key.size
    nkb, npb = max(1, -(-num_keys // tw)), max(1, -(-p // tp))
    assert sched.num_blocks == nkb
    assert block.shape == pair_block.shape == lo.shape == hi.shape == first.shape

    valid = (key >= 0) & (key < num_keys) & (dst >= 0) & (dst < num_dst)
    cover = np.zeros(p, int)
    for i in range(block.size):
        assert 0 <= block[i] < nkb and 0 <= pair_block[i] < npb
        assert 0 <= lo[i] <= hi[i] <= tp
        for q in range(lo[i], hi[i]):
            pair = pair_block[i] * tp + q
            assert pair < p and valid[pair], (i, pair)  # only real, valid pairs
            assert key[pair] // tw == block[i], (i, pair)
            cover[pair] += 1
    np.testing.assert_array_equal(cover[valid], 1)
    # each key block's items in one run (every block has one), `first` on the first
    assert (np.diff(block) >= 0).all()
    assert set(block.tolist()) == set(range(nkb))
    for i in range(block.size):
        assert first[i] == int(i == 0 or block[i] != block[i - 1]), i


# ---------------------------------------------------------------------------
# Row moves a DMA a row


def random_row_ids(r, rows, n, *, distinct):
    """[n] ids: rows of the table (distinct if asked) and ids outside it."""
    outside = [-1, -7, rows, rows + 5, BIG, -(2**31)]
    ids = r.choice(rows, n, replace=not distinct).astype(np.int64)
    bad = r.random(n) < 0.3
    ids[bad] = r.choice(outside, int(bad.sum()))
    if n >= len(outside):  # each kind at least once
        ids[: len(outside)] = outside
        r.shuffle(ids)
    return ids.astype(np.int32)


# ids a call: one partial block; 2.5 blocks of TG (full ones and a ragged last one)
MANY = 5 * TG // 2
# one program a shape (the random and the ascending ids' cases share it), not a
# pallas_call traced again each call
_gather_rows = jax.jit(pallas.gather_rows_dma, static_argnames="tg")
_scatter_rows = jax.jit(pallas.scatter_rows_dma, static_argnames="tg")


@pytest.mark.parametrize("order", ["random", "ascending"])
@pytest.mark.parametrize("width, n", [(128, 5), (128, MANY), (256, 37)])
def test_gather_rows_dma(width, n, order):
    """Ids in any order, outside the table among them (the tested loop), and ascending
    with the padding last (full blocks untested)."""
    r = rng(width + n)
    rows = 400
    table = signed(r, (rows, width))
    ids = random_row_ids(r, rows, n, distinct=False)
    if order == "ascending":
        ids = np.sort(np.where((ids >= 0) & (ids < rows), ids, 2**31 - 1)).astype(np.int32)
    want = np.zeros((n, width), np.float32)
    for i, row in enumerate(ids.tolist()):
        if 0 <= row < rows:
            want[i] = table[row]
    got = _gather_rows(jnp.asarray(table), jnp.asarray(ids), tg=TG)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("order", ["random", "ascending"])
@pytest.mark.parametrize("width, n", [(128, 5), (128, MANY), (256, 37)])
def test_scatter_rows_dma(width, n, order):
    """Ids in any order with some outside the table (the tested loop), and a stack's
    distinct ids, ascending with the padding past the end (the untested loop, its
    blocks full, partial and empty)."""
    r = rng(2 * width + n)
    rows = 400
    ids = random_row_ids(r, rows, n, distinct=True)
    if order == "ascending":
        ids = np.sort(np.where((ids >= 0) & (ids < rows), ids, 2**31 - 1)).astype(np.int32)
    table = signed(r, (rows, width))
    new = signed(r, (n, width))
    want = table.copy()
    for i, row in enumerate(ids.tolist()):
        if 0 <= row < rows:
            want[row] = new[i]
    # a fresh device copy each call: the kernel writes the table in place (aliased)
    got = _scatter_rows(jnp.array(table), jnp.asarray(ids), jnp.asarray(new), tg=TG)
    np.testing.assert_array_equal(np.asarray(got), want)


def pair_layout(bits16):
    """The uint32 words of 16-bit rows as a TPU lays them out, written for clarity: word
    (p, c) = row 2p's column c (low half) | row 2p + 1's (high half)."""
    rows, width = bits16.shape
    words = np.zeros((rows // 2, width), np.uint64)
    for p in range(rows // 2):
        words[p] = bits16[2 * p].astype(np.uint64) + (bits16[2 * p + 1].astype(np.uint64) << 16)
    return words.astype(np.uint32)


def bits_of(x):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.uint16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pair_moves(dtype):
    """`gather_pairs_dma` / `scatter_pairs_dma`: 16-bit rows moved as 32-bit words two
    rows at a time (ids outside the table: zero words / skipped)."""
    r = rng(11)
    rows, width = 64, 128
    table = jnp.asarray(signed(r, (rows, width))).astype(dtype)
    want_words = pair_layout(bits_of(table))
    pairs = np.array([3, 0, 31, 17, -1, 32, BIG, 5], np.int32)
    got = np.asarray(pallas.gather_pairs_dma(table, jnp.asarray(pairs), tg=TG))
    for i, p in enumerate(pairs.tolist()):
        np.testing.assert_array_equal(got[i], want_words[p] if 0 <= p < rows // 2 else 0)
    # words of real 16-bit values (the chip may flush a subnormal that random bits make)
    new = pair_layout(bits_of(jnp.asarray(signed(r, (2 * pairs.size, width))).astype(dtype)))
    out = pallas.scatter_pairs_dma(jnp.array(table), jnp.asarray(pairs), jnp.asarray(new), tg=TG)
    want = want_words.copy()
    for i, p in enumerate(pairs.tolist()):
        if 0 <= p < rows // 2:
            want[p] = new[i]
    assert out.dtype == table.dtype and out.shape == table.shape
    np.testing.assert_array_equal(pair_layout(bits_of(out)), want)


@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    partners=st.sampled_from(["xla", "dma"]),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 24),
    ascending=st.booleans(),
)
def test_scatter_rows_paired(partners, dtype, seed, n, ascending):
    """A 16-bit table's rows written a pair at a time keep every row not written,
    partners of written rows included (written together or not), in any id order."""
    from embedmesh.device.ops import tpu

    r = rng(seed)
    rows, width = 80, 256
    ids = random_row_ids(r, rows, n, distinct=True)
    if r.random() < 0.5:  # many whole pairs
        base = r.choice(rows // 2, n // 2 + 1, replace=False) * 2
        both = np.concatenate([base, base + 1])[:n]
        ids = r.permutation(both).astype(np.int32)
    if ascending:
        ids = np.sort(np.where((ids >= 0) & (ids < rows), ids, BIG)).astype(np.int32)
        ids[np.r_[False, ids[1:] == ids[:-1]]] = BIG  # pads only repeat
    table = jnp.asarray(signed(r, (rows, width))).astype(dtype)
    new = jnp.asarray(signed(r, (n, width))).astype(dtype)
    want = bits_of(table).copy()
    new_bits = bits_of(new)
    for i, row in enumerate(ids.tolist()):
        if 0 <= row < rows:
            want[row] = new_bits[i]
    old, tpu.PARTNERS = tpu.PARTNERS, partners
    try:
        # one program (traced here, PARTNERS read then: a fresh function, no cached trace),
        # not its jnp ops compiled one by one
        paired = jax.jit(lambda t, i, n: tpu.scatter_rows_paired(t, i, n))
        got = paired(jnp.array(table), jnp.asarray(ids), new)
    finally:
        tpu.PARTNERS = old
    np.testing.assert_array_equal(bits_of(got), want)


# ---------------------------------------------------------------------------
# The registered TPU ops and the TPU layout rule


def test_tpu_stacks_are_whole_vregs():
    """On a TPU mesh stacks are padded to 128 lanes, a row-wise optimizer's too (its mean
    told its table's dim, `mean_dim`); elsewhere to 8 (a row-wise one's not at all)."""
    import embedmesh as em
    from embedmesh.layout.stacking import dim_multiple_for, plan_stacking

    assert dim_multiple_for("tpu") == 128 and dim_multiple_for("cpu") == 8
    fc = {
        "a": em.FeatureConfig(em.TableConfig(100, 40, name="a")),
        "b": em.FeatureConfig(em.TableConfig(100, 24, name="b", optimizer=em.RowWiseAdagrad(0.1))),
    }
    for multiple, want in ((128, {"a": 128, "b": 128}), (8, {"a": 40, "b": 24})):
        stacks = plan_stacking(
            fc, 1, dim_multiple=multiple, default_optimizer=em.Adagrad(0.1)
        ).stacks
        assert {s.tables[0]: s.dim for s in stacks} == want
        (rowwise,) = [s.optimizer for s in stacks if s.tables == ("b",)]
        assert rowwise.mean_dim == (24 if multiple == 128 else None)
    # row-wise tables of two dims padded to one width still stack apart (two means)
    fc["c"] = em.FeatureConfig(em.TableConfig(100, 40, name="c", optimizer=em.RowWiseAdagrad(0.1)))
    stacks = plan_stacking(fc, 1, dim_multiple=128, default_optimizer=em.Adagrad(0.1)).stacks
    assert sorted(s.tables for s in stacks) == [("a",), ("b",), ("c",)]


@_random_inputs
@given(
    seed=st.integers(0, 2**31 - 1),
    dim=st.sampled_from([1, 7, 24, 64, 100, 127]),
    l2=st.sampled_from([0.0, 0.05]),
    clip_min=st.sampled_from([None, 0.2]),
)
def test_row_wise_mean_over_the_tables_columns(seed, dim, l2, clip_min):
    """RowWiseAdagrad on rows padded to 128 lanes (`mean_dim` = the table's dim), the
    padded columns holding other values (weight clipping moves them off zero): the
    table's columns and the accumulator as the float64 rule on the unpadded rows."""
    from optimizer_reference import numpy_update_rows

    import embedmesh as em

    r = rng(seed)
    n = 9
    opt = em.RowWiseAdagrad(
        0.3, l2_regularization_strength=l2, clip_weight_min=clip_min, initial_accumulator_value=0.1
    )
    padded_opt = dataclasses.replace(opt, mean_dim=dim)
    assert padded_opt.fused_kernel is None and opt.fused_kernel == "rowwise_adagrad"
    w = signed(r, (n, 128))
    g = np.zeros((n, 128), np.float32)
    g[:, :dim] = signed(r, (n, dim))
    acc = r.uniform(0.1, 2.0, (n, 1)).astype(np.float32)
    got_w, got_s = padded_opt.update_rows(w, {"accumulators": acc}, g, 2)
    want_w, want_s = numpy_update_rows(
        opt,
        w[:, :dim].astype(np.float64),
        {"accumulators": acc.astype(np.float64)},
        g[:, :dim].astype(np.float64),
        2,
    )
    np.testing.assert_allclose(np.asarray(got_w)[:, :dim], want_w, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(got_s["accumulators"]), want_s["accumulators"], rtol=2e-6, atol=1e-7
    )


def test_row_wise_trains_the_same_in_padded_stacks(monkeypatch):
    """A model with a RowWiseAdagrad table (dim 24, L2 decay, weight clipping) and an
    Adagrad one, trained 3 steps on 2 CPU devices with a TPU's stacks (128 lanes: the
    row-wise stack padded, its mean over 24 columns) and with the CPU's (unpadded, the
    fused CPU kernel): the same tables."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import embedmesh as em
    from embedmesh.facade import MeshEmbedding
    from embedmesh.layout import stacking

    cpus = jax.devices("cpu")  # the stacking patched for "cpu": on a TPU host too
    if len(cpus) < 2:
        pytest.skip("needs 2 CPU devices (--xla_force_host_platform_device_count)")
    # the TPU kernels staged beside the CPU's compiled, not interpreted (an interpreted
    # kernel's callbacks cannot sit in the platform switch)
    monkeypatch.setattr(pallas, "INTERPRET", False)
    _clear_kernel_caches()

    def train(multiple):
        monkeypatch.setitem(stacking.PLATFORM_DIM_MULTIPLE, "cpu", multiple)
        rw = em.RowWiseAdagrad(0.5, l2_regularization_strength=0.05, clip_weight_min=-0.3)
        a = em.TableConfig(50, 24, name="a", combiner="mean", optimizer=rw)
        b = em.TableConfig(40, 40, name="b", combiner="sum")
        feats = {"fa": em.FeatureConfig(a), "fb": em.FeatureConfig(b)}
        emb = MeshEmbedding(feats, em.Adagrad(0.2), mesh=Mesh(np.array(cpus[:2]), ("x",)))
        emb.build()
        r = rng(5)
        for _ in range(3):
            batch = {
                "fa": em.RaggedTensor(values=r.integers(0, 50, 24), row_splits=np.arange(0, 25, 3)),
                "fb": r.integers(0, 40, (8, 2)),
            }
            acts, pre = emb(batch)
            grads = {k: jnp.asarray(signed(r, v.shape)) for k, v in acts.items()}
            emb.apply_gradients(grads, pre)
        dims = {s.tables: (s.dim, getattr(s.optimizer, "mean_dim", None)) for s in emb.plan.stacks}
        return {t.name: np.asarray(v) for t, v in emb.embedding_tables.items()}, dims

    got, dims = train(128)
    assert dims == {("a",): (128, 24), ("b",): (128, None)}
    want, dims = train(8)
    assert dims == {("a",): (24, None), ("b",): (40, None)}
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_registered_tpu_ops_match_their_references():
    """The kernels the registry runs on a TPU (called here as the registry would, in
    interpret mode) against each op's reference, and the calls each one takes."""
    from embedmesh.device import ops
    from embedmesh.device.ops import tpu

    r = rng(3)

    # each call one program (not its jnp ops compiled one by one); `jitted(f, **static)`
    # a fresh function each time (no trace cached across calls)
    def jitted(f, **static):
        return jax.jit(lambda *a: f(*a, **static))

    for width in (64, 128):  # XLA's scatter / a DMA a row
        table = signed(r, (300, width)).astype(np.float32)
        ids = np.array([5, 299, 0, 77, 2**31 - 1], np.int32)
        rows = signed(r, (5, width)).astype(np.float32)
        got = jitted(tpu.scatter_rows)(jnp.asarray(table), jnp.asarray(ids), jnp.asarray(rows))
        want = np.asarray(
            ops.reference_of("scatter_rows")(jnp.asarray(table), jnp.asarray(ids), rows)
        )
        np.testing.assert_array_equal(np.asarray(got), want)
    for dtype in ("bfloat16", "float16"):  # a DMA a row pair
        table = jnp.asarray(signed(r, (300, 128))).astype(dtype)
        ids = np.array([5, 299, 4, 77, 298, 2**31 - 1], np.int32)
        rows = jnp.asarray(signed(r, (6, 128))).astype(dtype)
        got = jitted(tpu.scatter_rows)(jnp.array(table), jnp.asarray(ids), rows)
        want = ops.reference_of("scatter_rows")(table, jnp.asarray(ids), rows)
        np.testing.assert_array_equal(bits_of(got), bits_of(want))
    table = signed(r, (60, 256)).astype(np.float32)
    uniq = np.array([3, 8, 9, 41, 59, 2**31 - 1], np.int32)
    key = np.array([0, 0, 1, 2, 2, 2, 3, 4, 0], np.int32)  # host order, a pad pair last
    dst = np.array([0, 5, 1, 0, 2, 6, 3, 4, 7], np.int32)
    gains = signed(r, (9,)).astype(np.float32)
    gains[-1] = 0.0
    dst[-1] = 7  # == num rows: padding
    sgsm = jitted(tpu.segment_gather_sum_mapped, num_segments=7)
    got = sgsm(table, uniq, key, gains, dst)
    want = ops.reference_of("segment_gather_sum_mapped")(
        table, uniq, key, gains, dst, num_segments=7
    )
    assert_sums_close(got, np.asarray(want, np.float64), np.abs(np.asarray(want)) + 1)
    acts = signed(r, (7, 256)).astype(np.float32)
    got = jitted(tpu.segment_gather_sum, num_segments=6)(acts, dst, gains, key)
    want = ops.reference_of("segment_gather_sum")(acts, dst, gains, key, num_segments=6)
    assert_sums_close(got, np.asarray(want, np.float64), np.abs(np.asarray(want)) + 1)
    # a stack keeping its slots in its rows: only the parameters' columns read and summed
    # (the slot columns poisoned: a NaN there must reach no sum)
    fused = signed(r, (60, 256)).astype(np.float32)
    fused[:, 40:] = np.nan
    for columns in (40, 200):
        src = np.where(np.arange(256) < columns, np.nan_to_num(fused, nan=1.5), np.nan)
        src = src.astype(np.float32)
        sgsm = jitted(tpu.segment_gather_sum_mapped, num_segments=7, columns=columns)
        got = sgsm(src, uniq, key, gains, dst)
        want = ops.reference_of("segment_gather_sum_mapped")(
            src, uniq, key, gains, dst, num_segments=7, columns=columns
        )
        assert got.shape == (7, columns) and np.isfinite(np.asarray(want)).all()
        assert_sums_close(got, np.asarray(want, np.float64), np.abs(np.asarray(want)) + 1)
    got = np.asarray(tpu.gather_columns(jnp.asarray(src), jnp.asarray(uniq), 128))
    np.testing.assert_array_equal(got[:-1], src[uniq[:-1], :128])
    np.testing.assert_array_equal(got[-1], 0)  # an id past the end: a zero row
    # which calls the TPU kernels take: rows of every width
    take = tpu.KERNELS["segment_gather_sum_mapped"][1]
    assert take(jnp.zeros((4, 256)), None) and take(jnp.zeros((4, 64)), None)
    assert not take(jnp.zeros((4,)), None)


@pytest.mark.parametrize("op", ["segment_gather_sum", "segment_gather_sum_mapped"])
def test_registered_ops_keep_a_non_finite_row_to_its_own_sums(op):
    """A NaN row and an inf row (and an inf gain): only the sums they enter are
    non-finite, as in the float64 reference (the MXU's one-hot zeros would carry them into
    their blocks' other rows: 0 * NaN is NaN); every other sum as the reference's."""
    from embedmesh.device.ops import tpu

    r = rng(17)
    num_rows, num_out = 40, 30
    src = signed(r, (num_rows, 128))
    src[3, 5] = np.nan
    src[7] = np.inf
    key, dst, gains = make_pairs(r, num_out, num_rows, 200, n_pad=4)  # reduce's pairs
    gains[int(np.flatnonzero(dst == 11)[0])] = np.inf if (dst == 11).any() else gains[0]
    if op == "segment_gather_sum":  # the backward: sums keyed by `key`, rows by `dst`
        got = tpu.segment_gather_sum(jnp.asarray(src), dst, gains, key, num_segments=num_out)
        with np.errstate(invalid="ignore"):  # inf - inf in the reference: NaN, as wanted
            want, _ = reduce_reference(src, key, dst, gains, num_out)
    else:  # the lookup: rows src[src_map[key]], sums keyed by `dst`
        src_map = r.permutation(num_rows).astype(np.int32)
        got = tpu.segment_gather_sum_mapped(
            jnp.asarray(src), src_map, dst, gains, key, num_segments=num_out
        )
        with np.errstate(invalid="ignore"):
            want, _ = reduce_reference(src[src_map], key, dst, gains, num_out)
    got = np.asarray(got)
    assert (~np.isfinite(want)).any() and np.isfinite(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------
# A lookup given its pairs' order by output row (the host's `pair_order`): no device sort


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs (cond branches, jits,
    platform_dependent's branches, Pallas calls' bodies), outermost first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _primitives(jaxpr) -> set:
    """The names of every primitive in `jaxpr` and its sub-jaxprs."""
    return {eqn.primitive.name for eqn in _eqns(jaxpr)}


def _tpu_branch(jaxpr):
    """The TPU's branch of the registry's `platform_dependent` in `jaxpr`."""
    for eqn in jaxpr.eqns:
        platforms = eqn.params.get("branches_platforms")
        if platforms is not None:
            return eqn.params["branches"][platforms.index(("tpu",))].jaxpr
    raise AssertionError("no platform_dependent")


def _host_batch(r, n, p, u, num_rows, table_rows):
    """One device's batch of `n` partitions as the host makes it: each partition's pairs
    by (id position, output row), padding last (row `num_rows`, position 0, gain 0);
    distinct ids ascending, `PAD_ID` padded (2**31 - 1)."""
    unique_ids = np.full((n, u), BIG, np.int32)
    rows = np.full((n, p), num_rows, np.int32)
    unique = np.zeros((n, p), np.int32)
    gains = np.zeros((n, p), np.float32)
    for j in range(n):
        nu = int(r.integers(1, u + 1))
        unique_ids[j, :nu] = np.sort(r.choice(table_rows, nu, replace=False))
        m = int(r.integers(1, p + 1))
        pu, pr = r.integers(0, nu, m), r.integers(0, num_rows, m)
        keep = np.unique(pu.astype(np.int64) * num_rows + pr)  # distinct, host-ordered
        m = keep.size
        unique[j, :m], rows[j, :m] = keep // num_rows, keep % num_rows
        gains[j, :m] = signed(r, m)
    return unique_ids, rows, unique, gains


def test_lookup_with_pair_order_sorts_nothing():
    """The TPU lookup ops given the host's `pair_order`: the sums of the ops without it and
    of a float64 reference (partitions with padding; a wrong order: still the reference's
    sums), and no `sort` in their programs (through the registry's dispatch too: its TPU
    branch; without the order it has one)."""
    from embedmesh.device import ops
    from embedmesh.device.ops import tpu
    from embedmesh.host.pair_order import pair_order

    r = rng(23)
    n, p, u, num_rows, dim = 3, 40, 9, 17, 128
    table = signed(r, (70, dim))
    unique_ids, rows, unique, gains = _host_batch(r, n, p, u, num_rows, 70)
    order = pair_order(rows[None], unique[None], num_rows, u)[0].reshape(-1)
    slots = np.asarray(ops.slot_index(jnp.asarray(unique), u))
    want = np.zeros((num_rows, dim))
    for j in range(n):
        for q in range(p):
            if rows[j, q] < num_rows:
                want[rows[j, q]] += float(gains[j, q]) * table[unique_ids[j, unique[j, q]]]
    assert np.abs(want).min() > 0  # every output row summed

    flat = (slots, gains.reshape(-1), rows.reshape(-1))
    mapped = jax.jit(
        lambda t, o: tpu.segment_gather_sum_mapped(
            t, unique_ids.reshape(-1), *flat, num_segments=num_rows, dst_order=o
        )
    )
    gathered = table[np.minimum(unique_ids.reshape(-1), 69)] * (unique_ids.reshape(-1, 1) < BIG)
    plain = jax.jit(
        lambda s, o: tpu.segment_gather_sum(s, *flat, num_segments=num_rows, dst_order=o)
    )
    np.testing.assert_allclose(np.asarray(mapped(table, order)), want, rtol=1e-5, atol=1e-5)
    wrong = order[::-1].copy()  # not sorted by row: the reference's sums
    np.testing.assert_allclose(np.asarray(mapped(table, wrong)), want, rtol=1e-5, atol=1e-5)
    poisoned = table.copy()  # a NaN row: only the sums it enters are NaN (the reference's)
    poisoned[unique_ids[0, unique[0, 0]], 3] = np.nan
    got = np.asarray(mapped(poisoned, order))
    hit = np.zeros(num_rows, bool)
    hit[rows[0][(unique[0] == unique[0, 0]) & (rows[0] < num_rows)]] = True
    assert hit.any() and not hit.all()
    np.testing.assert_array_equal(np.isnan(got).any(axis=1), hit)
    np.testing.assert_allclose(got[~hit], want[~hit], rtol=1e-5, atol=1e-5)
    for fn, src in ((mapped, table), (plain, gathered)):  # (one program run: ~8 s interpreted)
        assert "sort" not in _primitives(jax.make_jaxpr(fn)(src, order).jaxpr)
        assert "sort" in _primitives(jax.make_jaxpr(fn)(src, None).jaxpr)

    # the op as the lookups call it, given the pairs again in row order (the host's
    # `pairs_by_row`): summed in place of the others, no sort and no gather of the pairs
    by_row = tuple(x[order] for x in flat)

    def op(t, o):
        return ops.segment_gather_sum(
            t, *flat, num_rows, src_map=jnp.asarray(unique_ids.reshape(-1)), dst_order=o
        )

    tpu_ordered = _tpu_branch(jax.make_jaxpr(op)(table, by_row).jaxpr)
    assert "sort" not in _primitives(tpu_ordered)
    assert not _pair_gathers(tpu_ordered, order.size)
    # its fallback's scatter is told its indices are sorted (XLA's TPU scatter sorts them
    # otherwise: the compile's largest part)
    scatters = _unsorted_scatters(tpu_ordered)
    assert scatters and not any(scatters), scatters
    assert "sort" in _primitives(_tpu_branch(jax.make_jaxpr(op)(table, None).jaxpr))
    assert _pair_gathers(_tpu_branch(jax.make_jaxpr(op)(table, order).jaxpr), order.size)
    order = by_row
    if jax.default_backend() == "cpu":  # the CPU's kernel (or reference), the hint dropped
        old = pallas.INTERPRET  # the TPU branch lowered as it is on CPU (never run)
        pallas.INTERPRET = False
        _clear_kernel_caches()
        try:
            got = np.asarray(jax.jit(lambda t, o: op(t, o))(table, order))  # traced anew
        finally:
            pallas.INTERPRET = old
            _clear_kernel_caches()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _tpu_branches(jaxpr) -> list:
    """The TPU branches of the `platform_dependent`s in `jaxpr` and its sub-jaxprs."""
    found = []
    for eqn in _eqns(jaxpr):
        platforms = eqn.params.get("branches_platforms")
        if platforms is not None and ("tpu",) in platforms:
            found.append(eqn.params["branches"][platforms.index(("tpu",))].jaxpr)
    return found


def _tpu_branches_primitives(jaxpr) -> list:
    """The primitives (`_primitives`) of each TPU branch in `jaxpr` (`_tpu_branches`)."""
    return [_primitives(branch) for branch in _tpu_branches(jaxpr)]


def _unsorted_scatters(jaxpr) -> list:
    """For each scatter-add (a sum) in `jaxpr` and its sub-jaxprs: whether its indices
    may come unsorted (XLA's TPU scatter then sorts them)."""
    return [
        not eqn.params["indices_are_sorted"]
        for eqn in _eqns(jaxpr)
        if eqn.primitive.name == "scatter-add"
    ]


def _pair_gathers(jaxpr, pairs: int) -> list:
    """The gathers in `jaxpr` and its sub-jaxprs of a 1-D operand of `pairs` elements (a
    batch's pairs gathered by a permutation)."""
    return [
        eqn
        for eqn in _eqns(jaxpr)
        if eqn.primitive.name == "gather" and eqn.invars[0].aval.shape == (pairs,)
    ]


def _tpu_pair_gathers(jaxpr, pairs: int) -> list:
    """`_pair_gathers` inside the TPU branches of `jaxpr`'s `platform_dependent`s."""
    return [g for branch in _tpu_branches(jaxpr) for g in _pair_gathers(branch, pairs)]


def test_a_job_hands_the_tpu_lookup_its_pairs_by_row(monkeypatch):
    """A job whose mesh's lookups read the pairs in output-row order (a TPU's: told so
    here, on one CPU device) places each batch with the host's `pairs_by_row`, and its
    lookup's program then holds no sort and no gather of the pairs in its TPU branches
    (one without them sorts); on CPU the hint's pairs are summed in place of the others:
    the same activations."""
    import dataclasses

    from jax.sharding import Mesh

    import embedmesh as em
    from embedmesh.device import ops
    from embedmesh.host.pair_order import pairs_by_row

    monkeypatch.setattr(pallas, "INTERPRET", False)  # staged beside the CPU's, never run
    _clear_kernel_caches()
    monkeypatch.setattr(ops, "reads_pairs_by_row", lambda mesh: True)
    # every platform's branch traced, as outside a core's program (a CPU mesh's programs
    # trace only the CPU's): the TPU's branches are what is checked
    monkeypatch.setattr(ops.staging, "platform_of", lambda mesh: None)
    t = em.TableConfig(30, 8, name="t", combiner="mean")
    feats = {"a": em.FeatureConfig(t), "b": em.FeatureConfig(t)}
    layer = em.MeshEmbedding(
        feats, em.SGD(0.1), mesh=Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    )
    r = rng(9)
    batch = {"a": r.integers(0, 30, (8, 3)), "b": r.integers(0, 30, (8, 2))}
    job = layer.job
    csr = job.placed(layer.enqueue(batch), "test")
    (c,) = csr.values()
    assert c.pairs_by_row is not None
    want_pairs = pairs_by_row(
        np.asarray(c.pair_rows),
        np.asarray(c.pair_unique),
        np.asarray(c.pair_gains),
        c.rows_per_device,
        c.capacity.max_unique_ids_per_partition,
    )
    for got_part, want_part in zip(c.pairs_by_row, want_pairs, strict=True):
        np.testing.assert_array_equal(np.asarray(got_part), want_part)
    unordered = {k: dataclasses.replace(v, pairs_by_row=None) for k, v in csr.items()}
    state = layer.release_state()
    got = job.core.lookup(state, csr)
    want = job.core.lookup(state, unordered)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    with_order = _tpu_branches_primitives(jax.make_jaxpr(job.core.lookup)(state, csr).jaxpr)
    without = _tpu_branches_primitives(jax.make_jaxpr(job.core.lookup)(state, unordered).jaxpr)
    assert with_order and not any("sort" in p for p in with_order)
    assert any("sort" in p for p in without)
    # nor a gather of the pairs by a permutation: a TPU gathers scalars slowly
    pairs = c.pair_rows.size
    lookup = jax.make_jaxpr(job.core.lookup)(state, csr).jaxpr
    assert not _tpu_pair_gathers(lookup, pairs)
    assert not any(any(_unsorted_scatters(b)) for b in _tpu_branches(lookup))
    # the update: one partition's pairs come sorted by id, and its sums are told so
    grads = job.flat_gradients({k: np.ones(np.shape(v), np.float32) for k, v in got.items()}, csr)
    update = jax.make_jaxpr(job.core.apply_gradients)(state, grads, csr).jaxpr
    assert not any("sort" in p for p in _tpu_branches_primitives(update))
    assert not _tpu_pair_gathers(update, pairs)
    assert not any(any(_unsorted_scatters(b)) for b in _tpu_branches(update))
    _clear_kernel_caches()


def test_backward_update_told_its_pairs_order_sorts_nothing():
    """`ops.backward_update` given its pairs' order by id (`dst_order`, one partition's:
    the host's): no sort in its TPU branches; without it, the TPU's sums sort."""
    from embedmesh import optimizers
    from embedmesh.device import ops

    r = rng(4)
    u, p, num_rows = 6, 20, 9
    table, acts = signed(r, (40, 128)), signed(r, (num_rows, 128))
    ids = np.sort(r.choice(40, u, replace=False)).astype(np.int32)
    key = np.sort(r.integers(0, u, p)).astype(np.int32)
    rows = r.integers(0, num_rows, p).astype(np.int32)

    def update(o):
        return ops.backward_update(
            optimizers.SGD(0.1), table, {}, ids, acts, rows, key, signed(r, p), 1, dst_order=o
        )

    told = _tpu_branches_primitives(jax.make_jaxpr(update)(jnp.arange(p, dtype=jnp.int32)).jaxpr)
    assert told and not any("sort" in q for q in told)
    assert any("sort" in q for q in _tpu_branches_primitives(jax.make_jaxpr(update)(None).jaxpr))
