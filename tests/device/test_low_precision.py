"""bfloat16 and float16 training tables (`TableConfig.dtype`, `embedmesh.device.rounding`).

Against float64 numpy references: stochastic rounding lands on one of the two
neighbouring representable values (all 2^16 codes of the type enumerated in float64),
is unbiased (the mean of 10,000 roundings of a value within 5 sigma of it, sigma the
binomial's), and is reproducible for a seed; a bf16 / fp16 table trained with every
optimizer tracks the float32 run from the same tables within `k` rounding errors
(bound below) and, with gradient sums that are exact, is bit-identical on 1 and 2
devices and under every sharding strategy (the generator's words are logical rows);
stacks never mix dtypes; checkpoints keep the dtype and restore into float32 on request.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import embedmesh as em
from embedmesh import FeatureConfig, TableConfig
from embedmesh import checkpoint as ckpt
from embedmesh.device import ops
from embedmesh.device.rounding import Rounded, random_bits, stochastic_round
from embedmesh.facade import MeshEmbedding
from embedmesh.host.preprocess import Capacity
from embedmesh.layout import stacking
from embedmesh.layout.stacking import plan_stacking

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
# relative spacing of neighbouring values (2^-(mantissa bits)); fp16's subnormals: 2^-24
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}
CAPS = Capacity(64, 64)

OPTIMIZERS = {
    "SGD": em.SGD(2.0**-4),
    "Adagrad": em.Adagrad(0.125, initial_accumulator_value=0.5),
    "AdagradMomentum": em.AdagradMomentum(0.125, momentum=0.5),
    "Adam": em.Adam(2.0**-5),
    "DenseAdam": em.Adam(2.0**-5, lazy_adam=False),
    "FTRL": em.FTRL(0.25, l1_regularization_strength=0.01),
    "RowWiseAdagrad": em.RowWiseAdagrad(0.25),
}


def _representable(name: str) -> np.ndarray:
    """Every finite value of the 16-bit type, float64, sorted (each zero once)."""
    codes = np.arange(1 << 16, dtype=np.uint16)
    vals = codes.view(ml_dtypes.bfloat16 if name == "bfloat16" else np.float16)
    with np.errstate(invalid="ignore"):  # the NaN codes
        vals = vals.astype(np.float64)
    return np.unique(vals[np.isfinite(vals)])


def _values(name: str, r) -> np.ndarray:
    """float32 values to round: magnitudes over many binades, both signs, some already
    representable, zero; fp16's subnormals too."""
    x = r.uniform(1, 2, 40) * 2.0 ** r.integers(-12, 12, 40) * r.choice([-1, 1], 40)
    if name == "float16":
        x[:6] = r.uniform(-1, 1, 6) * 2.0**-20  # fp16 subnormals (spacing 2^-24)
    exact = _representable(name)[r.integers(0, 1000, 4) * 60]
    exact = exact[np.abs(exact) < 1e4]
    return np.concatenate([x, exact, [0.0]]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_stochastic_rounding_is_unbiased_onto_the_two_neighbours(name):
    """10,000 roundings of each value (the generator's step word varies): every result is
    the float64 reference's lower or upper neighbour, representable values stay, and the
    mean is within 5 sigma of the value (sigma = (hi - lo) sqrt(p (1 - p) / n))."""
    r = np.random.default_rng(0)
    x = _values(name, r)
    trials = 10_000
    bits = random_bits(
        7, jnp.arange(trials)[:, None], 0, 3, jnp.arange(x.size)[None, :], jnp.int32(5)
    )
    got = np.asarray(stochastic_round(jnp.broadcast_to(x, bits.shape), DTYPES[name], bits))
    assert got.dtype == np.dtype(DTYPES[name])
    got = got.astype(np.float64)
    vals = _representable(name)
    x64 = x.astype(np.float64)
    lo = vals[np.searchsorted(vals, x64, side="right") - 1]
    hi = vals[np.searchsorted(vals, x64, side="left")]
    assert np.all((got == lo) | (got == hi))
    p = np.where(hi > lo, (x64 - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / trials)
    mean = got.mean(axis=0)
    assert np.all(np.abs(mean - x64) <= 5 * sigma + 1e-12 * np.abs(x64)), (
        np.abs(mean - x64) / np.maximum(sigma, 1e-300)
    ).max()
    np.testing.assert_array_equal(
        got[:, lo == hi], np.broadcast_to(x64[lo == hi], got[:, lo == hi].shape)
    )
    # both neighbours are used where p is away from 0 and 1
    mid = (p > 0.05) & (p < 0.95)
    assert np.all((got[:, mid] == lo[mid]).any(0) & (got[:, mid] == hi[mid]).any(0))


def test_stochastic_rounding_keeps_non_finite_values_and_saturates():
    x = jnp.asarray([np.nan, np.inf, -np.inf, 70000.0, 65504.0], jnp.float32)
    bits = jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32)  # always "round away" if it could
    got = np.asarray(stochastic_round(x, jnp.float16, bits)).astype(np.float64)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf
    assert got[3] == np.inf and got[4] == 65504.0  # past the largest: as nearest rounding


def test_generator_is_reproducible_for_a_seed():
    """The same words give the same bits (and roundings); another seed, step, field,
    table, row or column others."""
    rows, cols = jnp.arange(64)[:, None], jnp.arange(16)[None, :]
    base = np.asarray(random_bits(11, 3, 0, 1, rows, cols))
    np.testing.assert_array_equal(base, np.asarray(random_bits(11, 3, 0, 1, rows, cols)))
    for other in (
        random_bits(12, 3, 0, 1, rows, cols),
        random_bits(11 + (1 << 32), 3, 0, 1, rows, cols),
        random_bits(11, 4, 0, 1, rows, cols),
        random_bits(11, 3, 1, 1, rows, cols),
        random_bits(11, 3, 0, 2, rows, cols),
        random_bits(11, 3, 0, 1, rows + 1, cols),
    ):
        assert np.mean(np.asarray(other) != base) > 0.99
    assert len(np.unique(base)) == base.size
    u = (base >> 8) * 2.0**-24
    assert abs(u.mean() - 0.5) < 0.03


# ---------------------------------------------------------------------------
# Configuration and stacking


def test_a_bad_dtype_names_the_table():
    for bad in (jnp.int8, "float64", "nope", np.float64):
        with pytest.raises(ValueError, match="TableConfig videos: dtype must be one of float32"):
            TableConfig(10, 4, name="videos", dtype=bad)
    with pytest.raises(ValueError, match="TableConfig videos: slot_dtype must be None, float32"):
        TableConfig(10, 4, name="videos", dtype=jnp.bfloat16, slot_dtype=jnp.float16)
    with pytest.raises(ValueError, match="slot_dtype"):
        TableConfig(10, 4, name="videos", slot_dtype=jnp.bfloat16)  # a float32 table's
    t = TableConfig(10, 4, name="v", dtype="bfloat16", slot_dtype=jnp.bfloat16)
    assert t.dtype == np.dtype(ml_dtypes.bfloat16) and t.storage_slot_dtype == t.dtype
    assert TableConfig(10, 4).dtype == np.float32 and TableConfig(10, 4).slot_dtype is None
    assert hash(t) == hash(t) and t != TableConfig(10, 4, name="v", dtype="bfloat16")
    assert "dtype=bfloat16, slot_dtype=bfloat16" in repr(t)


@settings(max_examples=15, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(
            [("float32", None), ("bfloat16", None), ("bfloat16", "bfloat16"), ("float16", None)]
        ),
        min_size=1,
        max_size=6,
    ),
    shards=st.sampled_from([1, 2]),
    in_rows=st.sampled_from([0, 128]),
)
def test_stacks_never_mix_dtypes(kinds, shards, in_rows):
    """Tables of one dim and optimizer in any dtypes: each stack's tables share its dtype
    and slot dtype; slots go into the rows only where their dtype is the table's; the
    plan's bytes count each array at its dtype's width."""
    tables = [
        TableConfig(20 + i, 8, name=f"t{i}", dtype=d, slot_dtype=s)
        for i, (d, s) in enumerate(kinds)
    ]
    plan = plan_stacking(
        {f"f{i}": FeatureConfig(t) for i, t in enumerate(tables)},
        shards,
        default_optimizer=em.Adagrad(0.1),
        slots_in_rows=in_rows,
    )
    by_name = {t.name: t for t in tables}
    for s in plan.stacks:
        assert {by_name[n].dtype for n in s.tables} == {np.dtype(s.dtype)}
        assert {by_name[n].storage_slot_dtype for n in s.tables} == {s.slots_dtype}
        assert bool(s.slot_columns) == (in_rows > 0 and s.slots_dtype == np.dtype(s.dtype))
        if not s.slot_columns:
            want = 8 * np.dtype(s.dtype).itemsize + 8 * s.slots_dtype.itemsize
            assert plan.row_bytes(s.name) == want
    assert len(plan.stacks) >= len(set(kinds))


# ---------------------------------------------------------------------------
# Training


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _features(kinds, optimizers=(None, None), which="ab"):
    """Tables a_<i> (dim 8) and b_<i> (dim 16) for each kind `(dtype, slot dtype)` or
    `(dtype, slot dtype, (a's optimizer, b's))` of `kinds` (default: `optimizers`), read
    by features fa_<i>, fb_<i> and seq_<i> (b_<i> again); `which`: "a" for a_<i> only."""
    tables, feats = [], {}
    for i, (dtype, slot_dtype, *opts) in enumerate(kinds):
        opts = opts[0] if opts else optimizers
        a, b = (
            TableConfig(
                v,
                d,
                name=f"{n}_{i}",
                combiner="sum",
                dtype=dtype,
                slot_dtype=slot_dtype,
                optimizer=opt,
            )
            for n, v, d, opt in (("a", 40, 8, opts[0]), ("b", 30, 16, opts[1]))
        )
        tables.append(a)
        feats[f"fa_{i}"] = FeatureConfig(a)
        if "b" in which:
            tables.append(b)
            feats[f"fb_{i}"] = FeatureConfig(b)
            feats[f"seq_{i}"] = FeatureConfig(b, max_sequence_length=2)
    return tables, feats


def _train(kinds, opt, n=1, sharding="mod", steps=4, optimizers=(None, None), which="ab"):
    """`steps` steps, each kind's tables from the same values (every dtype represents
    them: 8 significant bits, magnitudes in [1/4, 2)) fed the same ids and the same
    gradients, independent of the tables and small integers (so every gradient sum is
    exact, on any device count). Returns the embedding and `[{table: {field: array}}]`,
    one dict a kind, keyed "a" and "b"."""
    tables, feats = _features(kinds, optimizers, which)
    if isinstance(sharding, dict):  # by table name
        sharding = {t: sharding[t.name] for t in tables if t.name in sharding}
    emb = MeshEmbedding(feats, opt, mesh=_mesh(n), capacities=CAPS, sharding=sharding, seed=5)
    r = np.random.default_rng(3)
    start = {}
    for v, d in ((40, 8), (30, 16)):
        start[d] = (r.integers(32, 256, (v, d)) / 128 * r.choice([-1, 1], (v, d))).astype(
            np.float32
        )
    emb.set_tables({t: start[t.dim] for t in tables})
    for _ in range(steps):
        ids = {"fa": r.integers(0, 40, (8, 3)), "fb": r.integers(0, 30, (8, 2))}
        ids["seq"] = em.RaggedTensor.from_row_lengths(
            r.integers(0, 30, 8), [2, 0, 1, 1, 2, 0, 1, 1]
        )
        if "b" not in which:
            ids = {"fa": ids["fa"]}
        acts, pre = emb({f"{k}_{i}": v for i in range(len(kinds)) for k, v in ids.items()})
        assert all(v.dtype == jnp.float32 for v in acts.values())
        shapes = {k: acts[f"{k}_0"].shape for k in ids}
        g = {k: r.integers(-3, 4, shape).astype(np.float32) for k, shape in shapes.items()}
        emb.apply_gradients(
            {f"{k}_{i}": jnp.asarray(v) for i in range(len(kinds)) for k, v in g.items()}, pre
        )
    out = [{} for _ in kinds]
    for t, fields in emb.variables.items():
        name, i = t.name.split("_")
        out[int(i)][name] = {k: np.asarray(v) for k, v in fields.items()}
    return emb, out


def test_low_precision_training_tracks_float32():
    """Every optimizer, 4 steps on one device, float32 and bfloat16 tables (and float16 for
    Adagrad and FTRL; float32 slots) in one embedding: each low-precision table stays
    within 2 * steps * spacing * max|w| of the float32 table (spacing 2^-7 for bf16,
    2^-10 for fp16: each step rounds once, by at most one spacing of |w|; FTRL feeds the
    parameters back through its linear slot: the factor 2); arrays in their dtypes, slots
    float32; the plan's bytes are the arrays'."""
    steps = 4
    runs = [
        (name, dname)
        for name in OPTIMIZERS
        for dname in ("float32", "bfloat16") + (("float16",) if name in ("Adagrad", "FTRL") else ())
    ]
    dtypes = dict(DTYPES, float32=jnp.float32)
    kinds = [(dtypes[d], None, (OPTIMIZERS[n],) * 2) for n, d in runs]
    emb, out = _train(kinds, None, steps=steps, which="a")
    got = dict(zip(runs, out))
    for (name, dname), vs in got.items():
        if dname == "float32":
            continue
        want = got[name, "float32"]
        for t in want:
            w, g = want[t]["parameters"], vs[t]["parameters"]
            assert g.dtype == np.dtype(DTYPES[dname])
            bound = 2 * steps * ULP[dname] * np.abs(w).max()
            err = np.abs(g.astype(np.float64) - w).max()
            assert err <= bound, (name, dname, t, err, bound)
            assert err > 0 or name == "SGD"  # SGD's steps here are exact in fp16
            for field in set(want[t]) - {"parameters"}:
                assert vs[t][field].dtype == np.float32
    assert emb.plan.measured_bytes_per_device == emb.plan.bytes_per_device


BF16 = [(jnp.bfloat16, None), (jnp.bfloat16, jnp.bfloat16)]  # float32 slots, bf16 slots
# one table a strategy on 2 devices: table-wise, pooled on the owners, replicas, mod
STRATEGIES = {"a_0": "table_wise", "b_0": "row_wise_pooled", "a_1": "data_parallel"}


def test_bf16_rounds_the_same_on_any_device_count_and_strategy():
    """Exact gradient sums: the float32 updates are the same on 1 and 2 devices, so the
    stochastic roundings (keyed by logical rows) are too: every variable bit-identical
    under every strategy, bfloat16 tables with float32 or bfloat16 slots (Adam, FTRL)."""
    opts = (OPTIMIZERS["Adam"], OPTIMIZERS["FTRL"])
    _, want = _train(BF16, None, 1, steps=3, optimizers=opts)
    emb, got = _train(BF16, None, 2, STRATEGIES, steps=3, optimizers=opts)
    assert dict(emb.plan.strategies) == dict(STRATEGIES, b_1="mod")
    for kind, (g, w) in enumerate(zip(got, want)):
        for t in w:
            for k in w[t]:
                low = k == "parameters" or kind == 1
                assert g[t][k].dtype == np.dtype(ml_dtypes.bfloat16 if low else np.float32)
                np.testing.assert_array_equal(g[t][k], w[t][k], err_msg=f"{kind} {t}.{k}")


# ---------------------------------------------------------------------------
# The CPU's fused update of bf16 / fp16 stacks: rounding.py's generator, bit for bit

FUSED = {k: v for k, v in OPTIMIZERS.items() if v.fused_kernel}  # all but DenseAdam


def _cpu_kernels():
    from embedmesh.device.ops.cpu import kernels, library

    if not library.ready():
        pytest.skip(f"no CPU kernels: {library.unavailable_reason()}")
    return kernels


def _kernel_arithmetic_rounded(rounded, rows, slots, grads, step, ids):
    """`Rounded.update_rows` with the fused kernel's float32 arithmetic: the float32
    kernel's update of the rows widened (XLA's own contracts multiply-adds into FMAs and
    takes an approximate rsqrt), each result rounded by rounding.py (`Rounded.round`, the
    logical rows from `Rounded.logical_rows`)."""
    at = jnp.arange(rows.shape[0], dtype=jnp.int32)
    wide = {k: v.astype(jnp.float32) for k, v in slots.items()}
    new_rows, new_slots = _cpu_kernels().sparse_update(
        rows.astype(jnp.float32), wide, at, grads, optimizer=rounded.optimizer, step=step
    )
    table, row = rounded.logical_rows(ids)
    step = jnp.asarray(step, jnp.int32)
    names = tuple(rounded.optimizer.slot_names)
    return rounded.round(new_rows, rows.dtype, step, 0, table, row), {
        k: rounded.round(new_slots[k], slots[k].dtype, step, 1 + names.index(k), table, row)
        for k in slots
    }


@pytest.mark.parametrize("slot", ["float32", "table"])
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_fused_update_rounds_as_the_generator_bit_for_bit(name, slot):
    """The CPU's fused update of a bf16 / fp16 stack (two tables, a padding block, a seed
    past 32 bits), every optimizer with a fused kernel, slots float32 or of the table's
    type, random rows, slots and gradients: bit-identical to the kernel's float32 update
    rounded by rounding.py. Against the XLA reference (`Rounded.update_rows`, whose float32
    arithmetic is XLA's): SGD's equal; the others' rare 16-bit differences one code apart
    (under 1%), float32 slots within 2e-6. Each optimizer runs in two of the four cases
    (bf16 and fp16, float32 slots and the table's type: every pair of them), each case
    three optimizers: half the programs of every optimizer in every case."""
    kernels = _cpu_kernels()
    from embedmesh.layout.rows import ModRowLayout

    dtype = DTYPES[name]
    r = np.random.default_rng(7)
    v, d, n = 300, 24, 200
    # tables 2 (rows 0-149) and 5 (140 rows at 150-289; 290-299 pad), one shard
    tables = ((2, 0, 150, (1, 0, 0, 150), False), (5, 150, 150, (1, 0, 0, 140), False))
    parity = (name == "float16") != (slot == "table")
    for oname, opt in list(FUSED.items())[parity::2]:
        rounded = Rounded(opt, (3 << 32) + 17, tables, ModRowLayout(1))
        sdt = jnp.float32 if slot == "float32" else dtype
        table = jnp.asarray(r.normal(size=(v, d)), dtype)
        slots = {
            k: jnp.asarray(np.abs(r.normal(size=(v, opt.slot_width(k, d)))) + 0.1, sdt)
            for k in opt.slot_names
        }
        ids = r.choice(v, n, replace=False).astype(np.int32)
        ids[:3] = ops.PAD_ID
        ids = jnp.asarray(ids)
        grads = jnp.asarray(r.normal(size=(n, d)), jnp.float32)
        call = (table, slots, ids, grads)
        kernel = ops.kernel_for("sparse_update", "cpu", *call, optimizer=rounded, step=3)
        assert kernel is kernels.sparse_update, oname
        got = jax.jit(lambda *a, o=rounded: ops.sparse_update(o, *a, 3))(*call)

        def want_update(table, slots, ids, grads, rounded=rounded):
            safe = jnp.where(ids == ops.PAD_ID, 0, ids)
            rows, old = table[safe], {k: x[safe] for k, x in slots.items()}
            new_rows, new = _kernel_arithmetic_rounded(rounded, rows, old, grads, 3, ids)
            put = lambda x, y: x.at[ids].set(y, mode="drop")
            return put(table, new_rows), {k: put(x, new[k]) for k, x in slots.items()}

        want = jax.jit(want_update)(*call)
        ref_fn = ops.reference_of("sparse_update")
        ref = jax.jit(lambda *a, o=rounded: ref_fn(*a, optimizer=o, step=3))(*call)
        for field, g, w, x in [("parameters", got[0], want[0], ref[0])] + [
            (k, got[1][k], want[1][k], ref[1][k]) for k in slots
        ]:
            g, w, x = np.asarray(g), np.asarray(w), np.asarray(x)
            assert g.dtype == w.dtype, (oname, field)
            np.testing.assert_array_equal(
                g.view(np.uint16 if g.itemsize == 2 else np.uint32),
                w.view(np.uint16 if w.itemsize == 2 else np.uint32),
                err_msg=f"{oname}.{field}",
            )
            if g.dtype == np.float32:  # float32 slots: not rounded
                # test_ops' rtol; atol two float32 ulps of the operands (|x| < 2): where a
                # slot's update cancels (momentum), the contraction of its multiply-adds
                # into FMAs, which XLA chooses per CPU, shows in absolute terms (1.2e-7 at
                # 0.0028 on an AVX-512 Xeon, 2026-12-06)
                np.testing.assert_allclose(g, x, rtol=2e-6, atol=2.4e-7, err_msg=oname)
                continue
            differ = g != x
            if oname == "SGD":
                assert not differ.any()
            assert differ.mean() < 1e-2, (oname, field, differ.mean())
            if differ.any():  # neighbours: one code apart
                codes = np.abs(g.view(np.int16).astype(np.int32) - x.view(np.int16))
                assert np.all(codes[differ] == 1), (oname, codes[differ])


# every fused optimizer, bf16 and fp16, slots float32 and the table's type, one kind each
FUSED_KINDS = [
    (jnp.bfloat16, None, (FUSED["Adagrad"], FUSED["RowWiseAdagrad"])),
    (jnp.bfloat16, jnp.bfloat16, (FUSED["Adam"], FUSED["FTRL"])),
    (jnp.float16, None, (FUSED["AdagradMomentum"], FUSED["SGD"])),
    (jnp.float16, jnp.float16, (FUSED["FTRL"], FUSED["Adagrad"])),
]


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_fused_update_rounds_edge_values_as_the_generator(name):
    """The fused update (SGD, lr 1: new = w - g) of rows 32 wide (the vectorised rounding's
    16-column blocks) whose values land on every edge: the type's subnormals (and float32's
    for bf16), zero, the largest finite value and past it (infinity or the largest kept),
    NaN and infinite gradients, values already representable: bit-identical to the float32
    update rounded by rounding.py."""
    from embedmesh.layout.rows import ModRowLayout

    _cpu_kernels()
    dtype = DTYPES[name]
    r = np.random.default_rng(11)
    big = float(jnp.finfo(dtype).max)
    tiny = 2.0**-24 if name == "float16" else 2.0**-133  # the smallest subnormal
    v, d = 40, 32
    w = r.normal(size=(v, d)) * 2.0 ** r.integers(-8, 8, (v, d))
    g = r.normal(size=(v, d)) * 2.0 ** r.integers(-14, 2, (v, d))
    edges = [
        (big, -big / 2**11),  # past the largest finite: infinity, or kept
        (big, -big / 2**12),
        (-big, big / 2**11),
        (big, 0.0),
        (3 * tiny, 0.4 * tiny),  # subnormal results
        (0.0, 2.5 * tiny),
        (-tiny, tiny),
        (1.0, np.nan),
        (1.0, np.inf),
        (-1.0, -np.inf),
        (2.0, 1e30),
        (0.5, 0.0),
    ]
    at = r.choice(v * d, (len(edges), 20), replace=False)
    for (wv, gv), where in zip(edges, at):
        w.reshape(-1)[where], g.reshape(-1)[where] = wv, gv
    table = jnp.asarray(w, dtype)
    ids = jnp.arange(v, dtype=jnp.int32)
    grads = jnp.asarray(g, jnp.float32)
    tables = ((0, 0, v, (1, 0, 0, v), False),)
    rounded = Rounded(em.SGD(1.0), 99, tables, ModRowLayout(1))
    got = jax.jit(lambda t, i, gr: ops.sparse_update(rounded, t, {}, i, gr, 4))(table, ids, grads)
    want, _ = _kernel_arithmetic_rounded(rounded, table, {}, grads, 4, ids)
    got, want = np.asarray(got[0]), np.asarray(want)
    assert np.isinf(got.astype(np.float32)).any() and np.isnan(got.astype(np.float32)).any()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


# the 4 kinds' tables on 2 devices: mod and three other strategies, each on bf16 and on
# fp16 tables (kinds 0-1: bfloat16, 2-3: float16; b_1 and a_3 stay mod)
FUSED_STRATEGIES_2 = {
    "a_0": "table_wise",
    "b_0": "row_wise_pooled",
    "a_1": "data_parallel",
    "a_2": "row_wise_pooled",
    "b_3": "table_wise",
    "b_2": "data_parallel",
}


def test_fused_training_rounds_as_the_generator_on_2_devices(monkeypatch):
    """Training bf16 / fp16 tables (every fused optimizer, slots float32 or the table's
    type) with the CPU's fused updates on 2 devices under mod and the other strategies
    (table-wise, pooled on the owners, replicas): every variable bit-identical to the ops'
    references run with the kernel's float32 arithmetic and rounding.py's rounding
    (`_kernel_arithmetic_rounded`; the gradient sums are exact). One device's fused update
    is the same kernel on one shard (test_fused_update_rounds_as_the_generator_bit_for_bit
    checks it alone; test_bf16_rounds_the_same_on_any_device_count_and_strategy trains the
    fused kernels on 1 device against 2): run here too it cost CI ~40 s for no other path.
    The bf16 and the fp16 kinds train in one embedding (their stacks apart, as in two:
    stacks never mix dtypes), each run one build and one set of programs, not two. The
    reference runs on one device (its mod stacks, a smaller program than the 2 devices'
    strategies): the gradient sums are exact, so the updates and their roundings (keyed
    by logical rows) are the same on any device count and strategy, and the 2 devices'
    fused training must give them bit for bit."""
    _cpu_kernels()
    n, sharding = 2, FUSED_STRATEGIES_2
    emb, got = _train(FUSED_KINDS, None, n, sharding, steps=2)
    assert dict(emb.plan.strategies) == dict(sharding, b_1="mod", a_3="mod")
    for s in emb.plan.stacks:
        assert emb.core.strategies[s.name].optimizer.fused_kernel is not None
    assert {np.dtype(s.dtype) for s in emb.plan.stacks} == {np.dtype(d) for d in DTYPES.values()}
    jax.clear_caches()
    monkeypatch.setattr(Rounded, "fused_kernel", property(lambda self: None))

    def update_rows(self, rows, slots, grads, step, ids=None):
        return _kernel_arithmetic_rounded(self, rows, slots, grads, step, ids)

    monkeypatch.setattr(Rounded, "update_rows", update_rows)
    _, want = _train(FUSED_KINDS, None, 1, steps=2)
    jax.clear_caches()
    for kind, (g, w) in enumerate(zip(got, want)):
        for t in w:
            for k in w[t]:
                assert g[t][k].dtype == w[t][k].dtype
                np.testing.assert_array_equal(g[t][k], w[t][k], err_msg=f"{kind} {t}.{k}")


def test_bf16_slots_in_rows_only_with_bf16_slots(monkeypatch):
    """With a TPU's layout on CPU: bfloat16 tables with bfloat16 slots keep them in their
    rows and train bit-identically to slots apart; with float32 slots they stay apart."""
    opt = OPTIMIZERS["AdagradMomentum"]
    _, want = _train(BF16, opt, steps=2, which="a")
    monkeypatch.setitem(stacking.PLATFORM_SLOTS_IN_ROWS, "cpu", 128)
    emb, got = _train(BF16, opt, steps=2, which="a")
    for s in emb.plan.stacks:
        assert bool(s.slot_columns) == (s.tables[0][-1] == "1"), s  # kind 1: bf16 slots
    assert any(s.slot_columns for s in emb.plan.stacks)
    for kind in range(2):
        for t in want[kind]:
            for k in want[kind][t]:
                np.testing.assert_array_equal(got[kind][t][k], want[kind][t][k])
    assert emb.plan.measured_bytes_per_device == emb.plan.bytes_per_device


def test_cpu_kernels_fuse_the_update_and_rows_cross_in_the_storage_type():
    """A bf16 stack's optimizer is `Rounded`, fused by the CPU's update kernel (its
    optimizer's); its lookup is the C++ kernel reading the bfloat16 table (the combine's,
    and on 2 devices the row exchange's: each device reads the bf16 shards in place;
    tests/device/test_low_precision_lookup.py checks their sums)."""
    from embedmesh.device.ops.cpu import kernels as cpu_kernels

    emb, _ = _train(BF16[:1], OPTIMIZERS["Adagrad"], 2, steps=0)
    ids = jnp.zeros(3, jnp.int32)
    for s in emb.plan.stacks:
        dev = emb.core.strategies[s.name].optimizer
        assert isinstance(dev, Rounded) and dev.fused_kernel == "adagrad"
        table = emb.state.tables[s.name]
        slots = dict(emb.state.slots[s.name])
        call = (table, slots, ids, jnp.ones((3, table.shape[1])))
        kernel = ops.kernel_for("sparse_update", "cpu", *call, optimizer=dev, step=0)
        assert kernel is cpu_kernels.sparse_update
        args = (table, ids, ids, jnp.ones(3), ids)
        kernel = ops.kernel_for("segment_gather_sum_mapped", "cpu", *args, num_segments=2)
        assert kernel is cpu_kernels.segment_gather_sum_mapped
    batch = {"fa_0": np.zeros((8, 3), np.int64), "fb_0": np.zeros((8, 2), np.int64)}
    batch["seq_0"] = em.RaggedTensor.from_row_lengths(np.zeros(8, np.int64), [1] * 8)
    csr = emb.enqueue(batch)
    text = jax.jit(emb.core.lookup).lower(emb.state, csr).as_text()
    looked_up = [line for line in text.splitlines() if "embedmesh_lookup_from_shards" in line]
    assert any("bf16" in line for line in looked_up), looked_up


# ---------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_keeps_the_dtype_and_restores_into_float32(tmp_path):
    """Saved bfloat16 (float32 slots) on 2 devices: restored into a bfloat16 embedding on
    one bit for bit, into a float32 one on request (its tables float32) as the same values
    widened; `load_tables` reads the saved dtype."""
    opt = OPTIMIZERS["Adagrad"]
    saved, want = _train(BF16[:1], opt, 2, steps=2)
    ckpt.save(str(tmp_path / "c"), saved)
    for dtype in (jnp.bfloat16, jnp.float32):
        emb, _ = _train([(dtype, None)], opt, 1, steps=0)
        assert ckpt.restore(emb, str(tmp_path / "c")) == 2
        got = {
            t.name[0]: {k: np.asarray(v) for k, v in d.items()} for t, d in emb.variables.items()
        }
        for t in want[0]:
            assert got[t]["parameters"].dtype == np.dtype(dtype)
            for k in want[0][t]:
                np.testing.assert_array_equal(
                    got[t][k].astype(np.float32), want[0][t][k].astype(np.float32)
                )
    loaded = ckpt.load_tables(str(tmp_path / "c"))
    assert {t.name: (t.dtype, v.dtype) for t, v in loaded.items()} == {
        n: (np.dtype(ml_dtypes.bfloat16),) * 2 for n in ("a_0", "b_0")
    }


def test_the_functional_core_rounds_by_its_seed():
    """`EmbeddingCore(rounding_seed=)`: one update of the same state and batch is the same
    for one seed, twice, and for another seed differs in some values, each by one bf16
    spacing at most."""
    from embedmesh.device.core import EmbeddingCore

    emb, _ = _train(BF16[:1], OPTIMIZERS["Adagrad"], 1, steps=0, which="a")
    batch = {"fa_0": np.arange(24).reshape(8, 3)}
    csr = emb.enqueue(batch)
    acts = jax.eval_shape(emb.core.lookup, emb.state, csr)  # the shapes alone: no program
    grads = {k: jnp.full(v.shape, 0.01, jnp.float32) for k, v in acts.items()}
    cores = [emb.core] + [
        EmbeddingCore(emb.plan, emb.mesh, OPTIMIZERS["Adagrad"], rounding_seed=s) for s in (5, 6)
    ]
    out = [
        np.asarray(jax.jit(c.apply_gradients)(emb.state, grads, csr)[0].tables["a_0"])
        for c in cores
    ]
    np.testing.assert_array_equal(out[0], out[1])  # the facade's seed is 5
    diff = np.abs(out[2].astype(np.float64) - out[0])
    assert 0 < np.count_nonzero(diff) < diff.size
    assert np.all(diff <= 2.0**-7 * np.abs(out[0].astype(np.float64)) + 1e-30)


def test_a_flax_module_trains_a_bf16_table():
    """nnx `Embed` over a bfloat16 table: float32 activations, the table variable bfloat16,
    its accumulators float32, and the table moves."""
    nnx = pytest.importorskip("flax.nnx")
    from embedmesh.flax.nnx import Embed

    table = TableConfig(50, 8, name="v", dtype=jnp.bfloat16)
    embed = Embed(MeshEmbedding({"f": FeatureConfig(table)}, em.Adagrad(0.5), mesh=_mesh(1)))
    before = np.asarray(embed.state.tables["v"]).copy()

    @nnx.jit
    def step(embed, csr):
        acts = embed(csr)
        embed.apply_gradients({"f": acts["f"] * 0 + 1.0}, csr)
        return acts

    acts = step(embed, embed.enqueue({"f": np.arange(8)}))
    assert acts["f"].dtype == jnp.float32
    dtypes = sorted(str(x.dtype) for x in jax.tree.leaves(nnx.state(embed)))
    assert dtypes == ["bfloat16", "float32", "int32"]
    after = np.asarray(embed.state.tables["v"])
    assert after.dtype == before.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.count_nonzero(after != before) > 0
