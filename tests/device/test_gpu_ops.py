"""The GPU kernels of the device ops, on CPU: each against its op's reference.

The XLA variants run as they are; the Pallas kernels run through Pallas's
interpreter (`pallas.INTERPRET = True`), and are also lowered for CUDA as on an
H200 (which a CPU-only jaxlib can do: it generates the Triton IR, so an op
Triton cannot lower fails here), at the scale run's shapes too. An end-to-end
test trains through them, registered as the CPU kernels, against the float64
training reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from test_engine import OPTIMIZER_HP, check_training
from test_optimizers import random_slots

from embedmesh import _runtime
from embedmesh.device import ops
from embedmesh.device.ops import gpu, reference
from embedmesh.device.ops.gpu import pallas, xla
from embedmesh.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, RowWiseAdagrad

PAD = ops.PAD_ID
TRITON_CALL = "__gpu$xla.gpu.triton"

_random_inputs = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# the random tests' seeds and row widths
SEEDS = st.integers(0, 2**31 - 1)
DIMS = st.sampled_from([8, 16, 64])


@pytest.fixture(autouse=True)
def interpret_pallas(monkeypatch):
    """Every Pallas kernel runs in the interpreter (the lowering tests turn it off)."""
    monkeypatch.setattr(pallas, "INTERPRET", True)


def rng(seed=0):
    return np.random.default_rng(seed)


def signed(r, shape, lo=0.1, hi=2.0):
    """Random values of magnitude in [lo, hi], either sign: never zero."""
    return (r.uniform(lo, hi, shape) * r.choice([-1.0, 1.0], shape)).astype(np.float32)


def _but_rate(hp: dict) -> dict:
    """An optimizer's arguments from `test_engine.OPTIMIZER_HP` but its rate (`lr_spec`)."""
    return {k: v for k, v in hp.items() if k != "lr_spec"}


# Each optimizer, with the common options and a learning-rate schedule among them.
OPTIMIZERS = [
    SGD(0.3),
    SGD(
        lambda step: 0.4 / (1.0 + step),
        clipvalue=0.5,
        weight_decay_factor=0.05,
        clip_weight_min=-0.8,
        clip_weight_max=0.9,
    ),
    Adagrad(0.2, initial_accumulator_value=0.3),
    Adagrad(
        lambda step: 0.3 * 0.9**step,
        clipvalue=(None, 0.4),
        weight_decay_factor=0.1,
        multiply_weight_decay_factor_by_learning_rate=True,
        clip_weight_max=0.8,
    ),
    AdagradMomentum(0.1, momentum=0.6, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=1e-3),
    AdagradMomentum(0.1, momentum=0.8, clipvalue=(-0.3, 0.5), weight_decay_factor=0.02),
    Adam(0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-3),
    Adam(0.05, sum_inside_sqrt=False, epsilon=1e-2, clipvalue=0.3, clip_weight_min=-0.7),
    FTRL(0.5, l1_regularization_strength=0.01, l2_regularization_strength=0.1, beta=0.1),
    # test_engine's second FTRL, its rate a schedule
    FTRL(lambda step: 0.5 / (1.0 + step), **_but_rate(OPTIMIZER_HP["FTRL"][1])),
    RowWiseAdagrad(0.2, epsilon=1e-3, l2_regularization_strength=0.05, clip_weight_max=0.9),
]
HOST_LR = Adagrad(lambda: 0.25)  # TensorFlow's zero-argument form: a host callback


def slots_of(opt, r, rows, dim):
    if isinstance(opt, RowWiseAdagrad):  # one accumulator a row: [rows, 1]
        return {"accumulators": r.uniform(0.1, 2.0, (rows, 1)).astype(np.float32)}
    return random_slots(type(opt).__name__, r, (rows, dim))


def random_ids(r, rows, n, *, out_of_range=True, repeated=False):
    """[n] ids: distinct rows (any order), PAD_ID, ids past the end, and repeats if asked."""
    ids = r.choice(rows, min(n, rows), replace=False).astype(np.int32)
    ids = np.resize(ids, n)
    ids[r.random(n) < 0.2] = PAD
    if out_of_range:
        ids[r.random(n) < 0.1] = rows + 2
    if not repeated:  # distinct apart from the padding
        seen = set()
        for i, v in enumerate(ids):
            if v in seen and v < rows:
                ids[i] = PAD
            seen.add(int(v))
    elif n > 1:
        ids[r.random(n) < 0.3] = ids[0]
    return ids


def reference_update(opt, table, slots, ids, grads, step):
    """gather, `update_rows`, scatter, in pure JAX (the `sparse_update` reference's parts)."""
    rows = reference.gather_rows(table, ids)
    old = {k: reference.gather_rows(v, ids) for k, v in slots.items()}
    new_rows, new_slots = opt.update_rows(rows, old, grads, step)
    return (
        reference.scatter_rows(table, ids, new_rows),
        {k: reference.scatter_rows(v, ids, new_slots[k]) for k, v in slots.items()},
    )


def reference_backward_update(opt, table, slots, ids, act, pr, pu, pg, step):
    per = reference.segment_gather_sum(act, pr, pg, pu, num_segments=ids.shape[0])
    uniq, grads = reference.dedup_sum_by_sort(ids[None], per)
    return reference_update(opt, table, slots, uniq, grads, step)


def assert_update_matches(got, want, before, touched):
    """Values close to the reference's; rows not updated bit-identical to `before`."""
    (gt, gs), (wt, ws) = got, want
    keep = np.ones(before[0].shape[0], bool)
    keep[touched[touched < keep.size]] = False
    for name, g, w, b in [("table", gt, wt, before[0])] + [
        (k, gs[k], ws[k], before[1][k]) for k in ws
    ]:
        g, w = np.asarray(g), np.asarray(w)
        # both float32, their sums in other orders: a value that is a difference of terms
        # as large as the array's largest (FTRL's linears: lin + g - dp * w / lr) may
        # differ by a few of those terms' ulps, whatever its own size (seen: 2.9e-6 on a
        # linear of 0.098 in an array up to 16, FTRL at learning rate 0.5; 3.8e-6 on one of
        # 0.021 in an array up to 6.7, FTRL with a schedule and power -0.7)
        scale = float(np.abs(w).max(initial=0))
        atol = max(1e-6, 16 * float(np.finfo(np.float32).eps) * scale)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol, err_msg=name)
        np.testing.assert_array_equal(g[keep], b[keep], err_msg=f"{name}: untouched rows")
    assert set(gs) == set(ws)


# ---------------------------------------------------------------------------
# The segment sums and the other primitive ops, against their references

SEGMENT_SUMS = {
    "xla": (xla.segment_gather_sum, xla.segment_gather_sum_mapped),
    "pallas": (pallas.segment_gather_sum, pallas.segment_gather_sum_mapped),
}
REFERENCE_SUMS = (reference.segment_gather_sum, reference.segment_gather_sum_mapped)


@settings(_random_inputs, max_examples=6)
@given(
    seed=SEEDS,
    m=st.sampled_from([1, 9, 40]),
    p=st.sampled_from([0, 1, 6, 300]),
    segs=st.sampled_from([1, 7, 64]),
    dim=DIMS,
    all_padding=st.booleans(),
)
def test_segment_gather_sums_match_references(seed, m, p, segs, dim, all_padding):
    """Both variants (XLA, Pallas) on each example's inputs, against one reference."""
    r = rng(seed)
    src = jnp.asarray(signed(r, (m, dim)))
    sidx = r.integers(0, m + 2, p).astype(np.int32)  # some past the end
    didx = r.integers(0, min(segs, 5) if p > 50 else segs, p).astype(np.int32)  # repeats
    didx[r.random(p) < 0.1] = segs + 1
    if all_padding:
        sidx[:] = m
    gains = jnp.asarray(signed(r, p))
    args = (src, jnp.asarray(sidx), gains, jnp.asarray(didx))
    table = jnp.asarray(signed(r, (3 * m, dim)))
    smap = r.integers(0, 3 * m, m).astype(np.int32)
    smap[r.random(m) < 0.2] = PAD
    smap[r.random(m) < 0.1] = 3 * m  # past the end of the table
    mapped_args = (table, jnp.asarray(smap)) + args[1:]
    variants = sorted(SEGMENT_SUMS.items())

    # the references and both variants one program (each example's shapes are new: their
    # jnp ops compiled one by one, or a program each, cost more)
    @jax.jit
    def sums(args, mapped_args):
        return [
            (
                plain(*args, num_segments=segs),
                mapped(*mapped_args, num_segments=segs),
            )
            for _, (plain, mapped) in [("reference", REFERENCE_SUMS)] + variants
        ]

    (want, want_mapped), *got = sums(args, mapped_args)
    for (variant, _), (got_plain, got_mapped) in zip(variants, got):
        np.testing.assert_allclose(
            np.asarray(got_plain), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=variant
        )
        np.testing.assert_allclose(
            np.asarray(got_mapped), np.asarray(want_mapped), rtol=1e-5, atol=1e-5, err_msg=variant
        )


def test_segment_sums_of_long_segments_match_float64():
    """Hundreds of pairs a segment, values over six decades: within float32 rounding of
    the float64 sum (relative to the sum of the terms' magnitudes)."""
    r = rng(1)
    src = signed(r, (30, 16), 1e-3, 1e3)
    sidx = r.integers(0, 30, 500).astype(np.int32)
    didx = r.integers(0, 3, 500).astype(np.int32)
    gains = signed(r, 500)
    terms = src[sidx].astype(np.float64) * gains[:, None]
    want = np.stack([terms[didx == s].sum(0) for s in range(3)])
    scale = np.stack([np.abs(terms[didx == s]).sum(0) for s in range(3)])
    args = tuple(jnp.asarray(x) for x in (src, sidx, gains, didx))
    for plain, _ in SEGMENT_SUMS.values():
        got = jax.jit(lambda *a, f=plain: f(*a, num_segments=3))(*args)
        assert (np.abs(np.asarray(got) - want) <= 1e-6 * scale).all()


@_random_inputs
@given(
    seed=SEEDS,
    rows=st.sampled_from([1, 30, 200]),
    n=st.sampled_from([0, 1, 5, 64]),
    dim=DIMS,
)
def test_xla_scatter_rows_matches_reference(seed, rows, n, dim):
    r = rng(seed)
    table = signed(r, (rows, dim))
    ids = random_ids(r, rows, n)
    vals = jnp.asarray(signed(r, (n, dim)))
    got = jax.jit(xla.scatter_rows, donate_argnums=0)(jnp.asarray(table), jnp.asarray(ids), vals)
    want = jax.jit(reference.scatter_rows)(jnp.asarray(table), jnp.asarray(ids), vals)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@_random_inputs
@given(
    seed=SEEDS,
    blocks=st.sampled_from([1, 3]),
    u=st.sampled_from([1, 16, 64]),
    order=st.sampled_from(["ascending", "any", "all_padding"]),
)
def test_xla_dedup_sum_matches_reference(seed, blocks, u, order):
    r = rng(seed)
    lists = []
    for _ in range(blocks):
        ids = np.full(u, PAD, np.int32)
        used = int(r.integers(0, u + 1)) if order != "all_padding" else 0
        ids[:used] = np.sort(r.choice(100, used, replace=False))
        if order == "any":
            ids[r.random(u) < 0.3] = 7  # repeats, out of order
            r.shuffle(ids)
        lists.append(ids)
    ids = jnp.asarray(np.stack(lists))
    grads = jnp.asarray(signed(r, (ids.size, 8)))
    gu, gs = jax.jit(xla.dedup_sum)(ids, grads)
    wu, ws = jax.jit(reference.dedup_sum)(ids, grads)
    np.testing.assert_array_equal(np.asarray(gu), np.asarray(wu))
    np.testing.assert_allclose(np.asarray(gs), np.asarray(ws), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# The fused updates (Pallas), for every optimizer


# 5 examples: each compiles its own programs; every optimizer also trains through the
# Pallas kernels (test_training_through_the_gpu_kernels) and lowers for CUDA
@settings(_random_inputs, max_examples=5)
@given(
    seed=SEEDS,
    opt=st.sampled_from(OPTIMIZERS + [HOST_LR]),
    u=st.sampled_from([1, 9, 32]),
    dim=DIMS,
)
def test_pallas_sparse_update_matches_reference(seed, opt, u, dim):
    r = rng(seed)
    rows = 40
    table = signed(r, (rows, dim))
    slots = slots_of(opt, r, rows, dim)
    ids = random_ids(r, rows, u)
    grads = signed(r, (u, dim))
    step = jnp.int32(int(r.integers(0, 5)))
    f = jax.jit(
        lambda t, s, i, g, st: pallas.sparse_update(t, s, i, g, optimizer=opt, step=st),
        donate_argnums=(0, 1),
    )
    got = f(jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}, ids, grads, step)
    want = jax.jit(lambda *a: reference_update(opt, *a))(
        jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}, ids, grads, step
    )
    assert_update_matches(got, want, (table, slots), ids)


@settings(_random_inputs, max_examples=5)  # as the sparse update's
@given(
    seed=SEEDS,
    opt=st.sampled_from(OPTIMIZERS),
    u=st.sampled_from([1, 9, 32]),
    p=st.sampled_from([0, 1, 20, 200]),
    dim=DIMS,
    repeated=st.booleans(),
    all_padding=st.booleans(),
)
def test_pallas_backward_update_matches_reference(seed, opt, u, p, dim, repeated, all_padding):
    r = rng(seed)
    rows, num_rows = 40, 12  # table rows, activation rows (R: the padding pair row)
    table = signed(r, (rows, dim))
    slots = slots_of(opt, r, rows, dim)
    ids = random_ids(r, rows, u, repeated=repeated)
    if all_padding:
        ids[:] = PAD
    act = jnp.asarray(signed(r, (num_rows, dim)))
    pr = r.integers(0, num_rows + 1, p).astype(np.int32)  # num_rows: padding
    pu = r.integers(0, u + 1, p).astype(np.int32)  # u: past the end
    if r.random() < 0.5:
        order = np.argsort(pu, kind="stable")
        pr, pu = pr[order], pu[order]
    pg = signed(r, p)
    step = jnp.int32(int(r.integers(0, 5)))
    args = (ids, act, pr, pu, pg)
    f = jax.jit(
        lambda t, s, *a: pallas.backward_update(t, s, *a, optimizer=opt, step=step),
        donate_argnums=(0, 1),
    )
    got = f(jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}, *args)
    want = jax.jit(lambda *a: reference_backward_update(opt, *a))(
        jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}, *args, step
    )
    assert_update_matches(got, want, (table, slots), ids)


# ---------------------------------------------------------------------------
# Lowering for CUDA (Triton) on a CPU-only jaxlib


# The GPU the CUDA lowering targets: an H200 (compute capability 9.0). jax >= 0.11 reads
# the GPU model from the abstract mesh's device (with neither a GPU nor one: "No supported
# GPU devices found"); jax 0.10 took 9.0 where it found no GPU.
H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
)


def _lowered(fn, *args, platform="cuda") -> str:
    """`fn(*args)` lowered for `platform` (CUDA: for an H200) as StableHLO text."""
    f = lambda *a: fn(*a)  # a fresh function: jit caches traces
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _update_args(opt, rows=50, dim=16, u=8, p=30):
    r = rng(2)
    table = jnp.asarray(signed(r, (rows, dim)))
    slots = {k: jnp.asarray(v) for k, v in slots_of(opt, r, rows, dim).items()}
    ids = jnp.asarray(np.arange(u, dtype=np.int32))
    pairs = (
        jnp.asarray(signed(r, (10, dim))),
        jnp.asarray(r.integers(0, 10, p).astype(np.int32)),
        jnp.asarray(r.integers(0, u, p).astype(np.int32)),
        jnp.asarray(signed(r, p)),
    )
    return table, slots, ids, jnp.asarray(signed(r, (u, dim))), pairs


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_pallas_updates_lower_for_cuda(monkeypatch, opt):
    monkeypatch.setattr(pallas, "INTERPRET", False)
    table, slots, ids, grads, pairs = _update_args(opt)
    step = jnp.int32(3)
    text = _lowered(
        lambda t, s, i, g: pallas.sparse_update(t, s, i, g, optimizer=opt, step=step),
        table,
        slots,
        ids,
        grads,
    )
    assert text.count(TRITON_CALL) == 1
    text = _lowered(
        lambda t, s, i, *a: pallas.backward_update(t, s, i, *a, optimizer=opt, step=step),
        table,
        slots,
        ids,
        *pairs,
    )
    assert text.count(TRITON_CALL) == 1


def test_pallas_segment_sums_lower_for_cuda(monkeypatch):
    monkeypatch.setattr(pallas, "INTERPRET", False)
    r = rng(3)
    src = jnp.asarray(signed(r, (20, 64)))
    sidx = jnp.asarray(r.integers(0, 20, 40).astype(np.int32))
    gains = jnp.asarray(signed(r, 40))
    text = _lowered(
        lambda *a: pallas.segment_gather_sum(*a, num_segments=9), src, sidx, gains, sidx
    )
    assert text.count(TRITON_CALL) == 1
    smap = jnp.asarray(r.integers(0, 20, 20).astype(np.int32))
    text = _lowered(
        lambda *a: pallas.segment_gather_sum_mapped(*a, num_segments=9),
        src,
        smap,
        sidx,
        gains,
        sidx,
    )
    assert text.count(TRITON_CALL) == 1


def test_pallas_kernels_lower_at_the_scale_runs_shapes(monkeypatch, capsys):
    """benchmarks/gpu/gpu.py's scale run, as abstract shapes (nothing is allocated): the
    16M x 128 float32 stacked table (8.2 GB), ~10.5M pairs, 524,288 segments (8 tables x
    batch 65,536). Above 4 GiB Pallas addresses an array with 64-bit offsets: the table's
    (and slots') rows take that path, the 256 MB activations the 32-bit one."""
    monkeypatch.setattr(pallas, "INTERPRET", False)
    # debug=True: Pallas prints each kernel's Triton IR, where the offsets' type shows
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    V, D, P, SEG, U = 16_000_000, 128, 10_500_000, 524_288, 1 << 20
    table = jax.ShapeDtypeStruct((V, D), jnp.float32)
    pair_ids = jax.ShapeDtypeStruct((P,), jnp.int32)
    gains = jax.ShapeDtypeStruct((P,), jnp.float32)
    wide, narrow = (f"tensor<1x{D}x!tt.ptr<f32>>, tensor<1x{D}x{t}>" for t in ("i64", "i32"))

    args = (table, pair_ids, gains, pair_ids)
    assert pallas.KERNELS["segment_gather_sum"][1](*args, num_segments=SEG)
    capsys.readouterr()
    text = _lowered(lambda *a: pallas.segment_gather_sum(*a, num_segments=SEG), *args)
    triton_ir = capsys.readouterr().out
    assert text.count(TRITON_CALL) == 1
    assert triton_ir.count(wide) == 1 and triton_ir.count(narrow) == 1  # table row, output row

    opt = Adagrad(0.1)
    act = jax.ShapeDtypeStruct((SEG, D), jnp.float32)
    args = (table, {"accumulators": table}, jax.ShapeDtypeStruct((U,), jnp.int32), act)
    args += (pair_ids, pair_ids, gains)
    assert pallas.KERNELS["backward_update"][1](*args, optimizer=opt, step=0)
    text = _lowered(
        lambda t, s, *a: pallas.backward_update(t, s, *a, optimizer=opt, step=jnp.int32(0)),
        *args,
    )
    triton_ir = capsys.readouterr().out
    assert text.count(TRITON_CALL) == 1
    # the table and accumulator rows read and written; the activation-gradient rows read
    assert triton_ir.count(wide) == 4 and triton_ir.count(narrow) == 1


@pytest.fixture
def gpu_variant(monkeypatch):
    """Select a GPU kernel variant as `EMBEDMESH_GPU_KERNELS` would."""

    def select(variant):
        monkeypatch.setattr(_runtime, "gpu_kernels_variant", lambda: variant)

    return select


@pytest.mark.parametrize("variant", ["xla", "pallas", "reference"])
def test_the_dispatch_stages_the_selected_variant_for_cuda_and_rocm(
    monkeypatch, gpu_variant, variant
):
    monkeypatch.setattr(pallas, "INTERPRET", False)
    gpu_variant(variant)
    opt = Adam(0.1)
    table, slots, ids, grads, (act, pr, pu, pg) = _update_args(opt)

    def segment_sum(s, i, g, d):
        return ops.segment_gather_sum(s, i, g, d, 8)

    def update(t, s, i, *a):
        return ops.backward_update(opt, t, s, i, *a, jnp.int32(0))

    for call, args in [
        (segment_sum, (act, pr, pg, pu)),
        (update, (table, slots, ids, act, pr, pu, pg)),
    ]:
        cuda = _lowered(call, *args)
        rocm = _lowered(call, *args, platform="rocm")
        assert (TRITON_CALL in cuda) == (variant == "pallas")
        assert TRITON_CALL not in rocm  # Triton is CUDA only: ROCm runs the XLA variants
        if variant != "reference" and call is segment_sum:
            assert "indices_are_sorted = true" in rocm
            assert ("indices_are_sorted = true" in cuda) == (variant == "xla")
        if variant == "reference":
            assert "indices_are_sorted = true" not in cuda + rocm
        assert TRITON_CALL not in _lowered(call, *args, platform="cpu")


def test_kernel_for_gpu_platforms(gpu_variant):
    table, slots, ids, grads, _ = _update_args(Adagrad(0.1))
    call = (table, slots, ids, grads)
    gpu_variant("pallas")
    cuda_kernel = ops.kernel_for("sparse_update", "cuda", *call, optimizer=Adagrad(0.1), step=0)
    assert cuda_kernel is gpu.CUDA_KERNELS["sparse_update"][0]
    assert ops.kernel_for("scatter_rows", "rocm") is gpu.KERNELS["scatter_rows"][0]
    assert ops.kernel_for("scatter_rows", "gpu") is gpu.KERNELS["scatter_rows"][0]
    # neither variant takes a bfloat16 table: the reference (its parts pick kernels)
    half = (table.astype(jnp.bfloat16), {"accumulators": slots["accumulators"]}, ids, grads)
    assert ops.kernel_for(
        "sparse_update", "cuda", *half, optimizer=Adagrad(0.1), step=0
    ) is ops.reference_of("sparse_update")
    # the gather is the reference itself on GPU: none registered
    assert ops.kernel_for("gather_rows", "cuda") is reference.gather_rows
    gpu_variant("xla")
    assert ops.kernel_for(
        "sparse_update", "cuda", *call, optimizer=Adagrad(0.1), step=0
    ) is ops.reference_of("sparse_update")
    gpu_variant("reference")
    for op in ops.op_names():
        for platform in ("gpu", "cuda", "rocm"):
            assert ops.kernel_for(op, platform) is ops.reference_of(op), (op, platform)


def test_kernel_tables():
    assert gpu.kernels("reference") == {}
    assert set(gpu.kernels("xla")) == {
        "scatter_rows",
        "segment_gather_sum",
        "segment_gather_sum_mapped",
        "dedup_sum",
    }
    assert set(gpu.kernels("pallas")) == set(gpu.kernels("xla")) | {
        "sparse_update",
        "backward_update",
    }
    with pytest.raises(ValueError, match="unknown GPU kernel variant 'triton'"):
        gpu.kernels("triton")


def test_pallas_supports():
    take = pallas.KERNELS["sparse_update"][1]
    opt = Adagrad(0.1)
    f32 = jnp.zeros((10, 16), jnp.float32)
    ids = jnp.zeros((3,), jnp.int32)
    assert take(f32, {"accumulators": f32}, ids, ids, optimizer=opt, step=0)
    odd = jnp.zeros((10, 24), jnp.float32)  # not a power of two
    assert not take(odd, {"accumulators": odd}, ids, ids, optimizer=opt, step=0)
    half = f32.astype(jnp.bfloat16)
    assert not take(half, {"accumulators": half}, ids, ids, optimizer=opt, step=0)
    assert not take(f32, {}, ids, ids, optimizer=opt, step=0)

    class MyAdagrad(Adagrad):  # may change the rule
        pass

    assert not take(f32, {"accumulators": f32}, ids, ids, optimizer=MyAdagrad(0.1), step=0)
    huge = jax.ShapeDtypeStruct((2**25, 64), jnp.float32)  # 2**31 elements
    assert not take(huge, {}, ids, ids, optimizer=SGD(0.1), step=0)
    seg = pallas.KERNELS["segment_gather_sum"][1]
    assert seg(f32, ids, ids, ids, num_segments=4)
    assert not seg(odd, ids, ids, ids, num_segments=4)
    assert not seg(f32, ids, ids, ids, num_segments=2**27)  # a [2**27, 16] output
    # what Pallas does not take, the XLA variant does (variant "pallas")
    fn = gpu.kernels("pallas")["segment_gather_sum"][0]
    src = jnp.asarray(signed(rng(4), (6, 24)))
    i = jnp.asarray(np.array([0, 5, 2], np.int32))
    g = jnp.asarray(np.array([1.0, -2.0, 0.5], np.float32))
    np.testing.assert_allclose(
        np.asarray(fn(src, i, g, i, num_segments=6)),
        np.asarray(reference.segment_gather_sum(src, i, g, i, num_segments=6)),
        rtol=1e-6,
    )


# ---------------------------------------------------------------------------
# The switch


@pytest.mark.parametrize(
    "value,variant",
    [
        (None, "xla"),
        ("", "xla"),
        ("xla", "xla"),
        ("XLA", "xla"),
        ("pallas", "pallas"),
        (" Pallas ", "pallas"),
        ("0", "reference"),
        ("reference", "reference"),
    ],
)
def test_switch_values(monkeypatch, value, variant):
    if value is None:
        monkeypatch.delenv("EMBEDMESH_GPU_KERNELS", raising=False)
    else:
        monkeypatch.setenv("EMBEDMESH_GPU_KERNELS", value)
    _runtime.reset()
    try:
        assert _runtime.gpu_kernels_variant() == variant == gpu.variant()
        assert gpu.ready() == (variant != "reference")
    finally:
        monkeypatch.undo()
        _runtime.reset()


@pytest.mark.parametrize("value", ["1", "triton", "cuda", "on"])
def test_switch_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("EMBEDMESH_GPU_KERNELS", value)
    _runtime.reset()
    try:
        with pytest.raises(ValueError, match="EMBEDMESH_GPU_KERNELS") as err:
            _runtime.gpu_kernels_variant()
        for allowed in ("xla", "pallas", "reference", "0"):
            assert allowed in str(err.value)
    finally:
        monkeypatch.undo()
        _runtime.reset()


# ---------------------------------------------------------------------------
# Training end to end through the GPU kernels, registered as the CPU ones


@pytest.fixture
def gpu_kernels_on_cpu(monkeypatch):
    """Make `variant`'s GPU kernels the CPU kernels of every op (the others: none, so
    their references), as a GPU would run them; the registry is restored after.
    Returns the names of the ops whose GPU kernel ran, and of those whose Pallas kernel
    ran (each once per trace)."""
    ran: dict[str, list] = {"gpu": [], "pallas": []}

    def spy(op, fn, log):
        def kernel(*args, **params):
            log.append(op)
            return fn(*args, **params)

        return kernel

    def install(variant):
        spied = {op: (spy(op, fn, ran["pallas"]), sup) for op, (fn, sup) in pallas.KERNELS.items()}
        monkeypatch.setattr(pallas, "KERNELS", spied)
        table = {
            op: (spy(op, fn, ran["gpu"]), sup) for op, (fn, sup) in gpu.kernels(variant).items()
        }
        for op in ops.op_names():
            kernels = dict(ops._PLATFORM_KERNELS[op])
            kernels.pop("cpu", None)
            monkeypatch.setitem(ops._PLATFORM_KERNELS, op, kernels)
            if op in table:
                fn, supports = table[op]
                ops.register_kernel(op, "cpu", fn, supports=supports)
        return ran

    return install


# A covering set: each optimizer through the Pallas kernels on one device count (every
# optimizer's fused rules are checked against their references on both kernels above),
# each device count with three of them; the XLA variants do no optimizer arithmetic:
# one optimizer is enough there, on both device counts.
TRAINING_CASES = [("pallas", name, 1 + i % 2) for i, name in enumerate(OPTIMIZER_HP)] + [
    ("xla", "Adam", 1),
    ("xla", "Adam", 2),
]


@pytest.mark.parametrize("variant,opt_name,num_devices", TRAINING_CASES)
def test_training_through_the_gpu_kernels(gpu_kernels_on_cpu, variant, opt_name, num_devices):
    """Every combiner (the case has sum, mean and sqrtn tables); one shard runs the
    fused backward + update, two the segment sums, dedup and sparse update."""
    ran = gpu_kernels_on_cpu(variant)
    hp = OPTIMIZER_HP[opt_name][num_devices % 2]
    check_training(num_devices, opt_name, hp, stack_tables=True, seed=7 * num_devices, steps=2)
    if num_devices == 1:
        pallas_ops = {"segment_gather_sum_mapped", "backward_update"}
        xla_ops = {"segment_gather_sum_mapped", "dedup_sum", "scatter_rows"}
    else:
        pallas_ops = {"segment_gather_sum", "sparse_update"}
        xla_ops = {"segment_gather_sum", "dedup_sum", "scatter_rows"}
    if variant == "pallas":
        assert pallas_ops <= set(ran["pallas"]), ran
        # one shard: the fused backward + update alone (its reference, with its dedup, is
        # not traced: a core's program traces only its own platform's branch)
        dedup = {"dedup_sum"} if num_devices > 1 else set()
        assert pallas_ops | dedup <= set(ran["gpu"]), ran
    else:
        assert not ran["pallas"] and xla_ops <= set(ran["gpu"]), ran
