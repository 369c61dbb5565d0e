"""The CPU lookup kernels of bfloat16 / float16 tables (`ops/cpu/storage.h`: one template
over the storage type, rows widened to float32 exactly and summed in float32).

Against float64 numpy references: each lookup form a float32 stack uses on CPU (the
combine of one device's rows, `segment_gather_sum_mapped`; the owners' pooled partials,
`pooled_partials`; the in-process lookup from 2 devices' shards, `lookup_from_shards`;
hypothesis over shapes, padding and out-of-range ids, table rows no pair reads set to
NaN) is within float32 accumulation's error of the float64 sums, and bit-identical to the
float32 kernel run on the table widened to float32 (the same sums in the same order).
Through the facade: every combiner, with and without weights, on 1 device and on 2 under
every strategy (the row exchange, table-wise, pooled on the owners, replicas), bf16 and
fp16 tables, each activation against the float64 lookup of the table's values, with the
kernels in the lowered program.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import mesh_of
from test_pooled_ops import random_batch

import embedmesh as em
from embedmesh import FeatureConfig, TableConfig
from embedmesh.device import ops
from embedmesh.device.ops import cpu
from embedmesh.host.preprocess import Capacity

PAD = ops.PAD_ID
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
needs_kernels = pytest.mark.skipif(
    not cpu.ready(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}"
)


def _table(r, name, rows, d, read=None):
    """A [rows, d] table of the type (normal values; fp16 subnormals too), rows outside
    `read` (ids that no pair reads) NaN: a kernel reading one shows."""
    x = r.standard_normal((rows, d)) * 2.0 ** r.integers(-6, 6, (rows, 1))
    if name == "float16" and rows * d > 4:
        x.reshape(-1)[:4] = r.uniform(-1, 1, 4) * 2.0**-20  # subnormals
    t = x.astype(NUMPY[name])
    if read is not None:
        t[~np.isin(np.arange(rows), read)] = np.nan
    return t


def _check(got, want, scale, terms):
    """float32 sums of `terms` products against float64: within (terms + 2) float32
    roundings of the sum of |gain * x|, per element."""
    assert got.dtype == np.float32 and got.shape == want.shape
    assert not np.isnan(got).any(), "a NaN row was read, or an element never written"
    tol = 2 * (terms + 2) * 2.0**-24 * scale
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol + 1e-30)


def _segment_oracle(table, rows_of_pairs, gains, dst, segs):
    """float64: out[dst[q]] += gains[q] * table[rows_of_pairs[q]] (rows < 0 or past the
    end, dst outside [0, segs): nothing); also the sums of |gain * x| and pair counts."""
    t = table.astype(np.float64)
    out = np.zeros((segs, t.shape[1]))
    scale = np.zeros((segs, t.shape[1]))
    count = np.zeros((segs, 1))
    for q in range(len(dst)):
        r, s = int(rows_of_pairs[q]), int(dst[q])
        if 0 <= r < t.shape[0] and 0 <= s < segs:
            out[s] += float(gains[q]) * t[r]
            scale[s] += np.abs(float(gains[q]) * t[r])
            count[s] += 1
    return out, scale, count.max(initial=0)


@needs_kernels
@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(sorted(DTYPES)),
    rows=st.integers(1, 40),
    d=st.sampled_from([1, 3, 8, 16, 17, 64]),
    m=st.integers(0, 12),
    p=st.integers(0, 40),
    segs=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_segment_gather_sum_mapped_reads_the_storage_type(name, rows, d, m, p, segs, seed):
    """One device's combine from its table: the kernel on the bf16 / fp16 table, against
    float64 and bit for bit against the float32 kernel on the widened table."""
    r = np.random.default_rng(seed)
    src_map = r.integers(0, rows + 3, m).astype(np.int32)  # some past the end
    src_map[r.random(m) < 0.2] = PAD
    src_idx = r.integers(-1, m + 2, p).astype(np.int32)
    gains = r.standard_normal(p).astype(np.float32)
    dst = r.integers(-1, segs + 2, p).astype(np.int32)
    ok = (src_idx >= 0) & (src_idx < m)
    rows_of_pairs = np.where(ok, src_map[np.clip(src_idx, 0, max(m - 1, 0))] if m else -1, -1)
    rows_of_pairs = np.where(rows_of_pairs == PAD, -1, rows_of_pairs)
    live = (dst >= 0) & (dst < segs)
    table = _table(r, name, rows, d, read=rows_of_pairs[live])
    args = (src_idx, gains, dst, segs)
    call = (table, src_map, *args[:-1])
    assert (
        ops.kernel_for("segment_gather_sum_mapped", "cpu", *call, num_segments=segs)
        is (cpu.KERNELS["segment_gather_sum_mapped"][0])
    )
    got = np.asarray(ops.segment_gather_sum(jnp.asarray(table), *args, src_map=src_map))
    wide = np.where(np.isnan(table), np.float32(0), table.astype(np.float32))
    table32 = np.where(np.isnan(table), np.nan, wide).astype(np.float32)
    want32 = np.asarray(ops.segment_gather_sum(jnp.asarray(table32), *args, src_map=src_map))
    np.testing.assert_array_equal(got, want32)
    want, scale, terms = _segment_oracle(table, rows_of_pairs, gains, dst, segs)
    _check(got, want, scale, terms)


@needs_kernels
@settings(max_examples=3, deadline=None)
@given(
    name=st.sampled_from(sorted(DTYPES)),
    n=st.sampled_from([1, 2]),
    u=st.integers(1, 8),
    p=st.integers(0, 24),
    num_rows=st.integers(1, 8),
    d=st.sampled_from([1, 8, 33]),
    compacted=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_pooled_partials_read_the_storage_type(name, n, u, p, num_rows, d, compacted, seed):
    """An owner's partial sums over its sources' pooled messages, from a bf16 / fp16 table:
    against float64 and bit for bit against the float32 kernel on the widened table."""
    r = np.random.default_rng(seed)
    rows = 50
    width = max(1, num_rows - 1) if compacted else num_rows
    # some ids past the table's end
    ids, pair_rows, pair_unique, gains, compact = random_batch(
        r, n, u, p, num_rows, width, compacted, ids_below=rows + 2
    )
    served = ops.pack_pooled_pairs(ids, pair_rows, pair_unique, gains, compact, width=width)
    uids, slot, row, g = (
        np.asarray(x) for x in ops.unpack_pooled_pairs(served, unique_capacity=u, width=width)
    )
    flat = uids.reshape(-1)
    ok = slot < n * u
    rows_of_pairs = np.where(ok, flat[np.clip(slot, 0, n * u - 1)], -1)
    rows_of_pairs = np.where(rows_of_pairs == PAD, -1, rows_of_pairs)
    table = _table(r, name, rows, d, read=rows_of_pairs[row < n * width])
    table32 = table.astype(np.float32)
    pooled = dict(unique_capacity=u, width=width)
    assert (
        ops.kernel_for("pooled_partials", "cpu", table, served, **pooled)
        is (cpu.KERNELS["pooled_partials"][0])
    )
    got = np.asarray(ops.pooled_partials(jnp.asarray(table), served, **pooled))
    np.testing.assert_array_equal(got, np.asarray(ops.pooled_partials(table32, served, **pooled)))
    want, scale, terms = _segment_oracle(table, rows_of_pairs, g, row, n * width)
    _check(got, want, scale, terms)


@needs_kernels
@settings(max_examples=3, deadline=None)
@given(
    name=st.sampled_from(sorted(DTYPES)),
    rows=st.integers(1, 30),
    u=st.integers(1, 10),
    p=st.integers(0, 24),
    num_rows=st.integers(1, 9),
    d=st.sampled_from([1, 8, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_lookup_from_shards_reads_the_storage_type(name, rows, u, p, num_rows, d, seed):
    """2 devices, each reading its rows straight from both shards' bf16 / fp16 tables
    (the in-process kernel): against float64 and bit for bit against the float32 kernel
    on the widened tables."""
    n = 2
    r = np.random.default_rng(seed)
    mesh = mesh_of(n)
    uids = r.integers(0, rows + 3, size=(n, n, u)).astype(np.int32)
    uids[r.random((n, n, u)) < 0.2] = PAD
    puniq = r.integers(0, u + 2, size=(n, n, p)).astype(np.int32)
    prows = r.integers(0, num_rows + 1, size=(n, n, p)).astype(np.int32)  # num_rows: pad
    gains = r.standard_normal((n, n, p)).astype(np.float32)
    tables = [_table(r, name, rows, d) for _ in range(n)]

    def put(x):
        x = x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
        return jax.device_put(x, NamedSharding(mesh, P("x")))

    def run(stacked):
        def body(t, ui, pu, g, pr):
            return ops.lookup_from_shards(
                t[0], ui, pu, g, pr, num_rows, ops.Transport("x", n, in_process=True)
            )

        spec = P("x")
        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)
        )
        args = (put(stacked[:, None]), put(uids), put(puniq), put(gains), put(prows))
        assert "embedmesh_lookup_from_shards" in fn.lower(*args).as_text()
        return np.asarray(fn(*args))

    got = run(np.stack(tables))
    np.testing.assert_array_equal(got, run(np.stack(tables).astype(np.float32)))
    for dev in range(n):  # device dev's rows: its pairs over both shards
        rows_of_pairs, g, dst = [], [], []
        for s in range(n):
            k = puniq[dev, s]
            ok = (k >= 0) & (k < u)
            rid = np.where(ok, uids[dev, s][np.clip(k, 0, u - 1)], -1)
            rid = np.where((rid == PAD) | (rid >= rows), -1, rid)
            rows_of_pairs.append(np.where(rid >= 0, rid + s * rows, -1))
            g.append(gains[dev, s])
            dst.append(prows[dev, s])
        want, scale, terms = _segment_oracle(
            np.concatenate(tables),
            np.concatenate(rows_of_pairs),
            np.concatenate(g),
            np.concatenate(dst),
            num_rows,
        )
        _check(got[dev * num_rows : (dev + 1) * num_rows], want, scale, terms)


# ---------------------------------------------------------------------------
# Through the facade: every combiner and strategy

COMBINERS = ("sum", "mean", "sqrtn")
# 2 devices: per table, a strategy of each kind for each dtype
STRATEGIES_2 = {
    "bfloat16_0": "mod",
    "bfloat16_1": "row_wise_pooled",
    "bfloat16_2": "table_wise",
    "float16_0": "data_parallel",
    "float16_1": "mod",
    "float16_2": "row_wise_pooled",
}


def _embedding(n):
    tables, feats = [], {}
    for name in sorted(DTYPES):
        for i, combiner in enumerate(COMBINERS):
            t = TableConfig(
                40, 8 * (i + 1), name=f"{name}_{i}", combiner=combiner, dtype=DTYPES[name]
            )
            tables.append(t)
            feats[f"f_{name}_{i}"] = FeatureConfig(t)
    sharding = "mod" if n == 1 else {t: STRATEGIES_2[t.name] for t in tables}
    emb = em.MeshEmbedding(
        feats, em.SGD(0.1), mesh=mesh_of(n), capacities=Capacity(64, 64), sharding=sharding
    )
    return emb, tables


def _bag_oracle(table, bags, combiner):
    """float64 lookup of one bag feature: sum of w * row over each sample's (ids,
    weights), then the combiner (mean: / sum w, sqrtn: / sqrt(sum w^2); a zero
    denominator, an empty bag: zeros)."""
    t = table.astype(np.float64)
    out = np.zeros((len(bags), t.shape[1]))
    scale = np.zeros_like(out)
    for b, (ids, w) in enumerate(bags):
        w = np.asarray(w, np.float64)
        out[b] = (w[:, None] * t[ids]).sum(0)
        scale[b] = np.abs(w[:, None] * t[ids]).sum(0)
        den = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        out[b] = out[b] / den if den else 0.0
        scale[b] = scale[b] / abs(den) if den else 0.0
    return out, scale


@needs_kernels
@pytest.mark.parametrize("n", [1, 2])
def test_lookups_of_low_precision_tables_on_every_strategy(n):
    """bf16 and fp16 tables, each combiner, with and without weights (one embedding, two
    batches), 1 device and 2 under every strategy: each activation within float32
    accumulation's error of the float64 lookup of the table's values; the lowered lookup
    runs the C++ kernels (no XLA gather of a table)."""
    emb, tables = _embedding(n)
    if n == 2:
        assert dict(emb.plan.strategies) == STRATEGIES_2
    r = np.random.default_rng(7 + n)
    emb.set_tables(
        {
            t: (r.standard_normal((t.vocabulary_size, t.dim)) * 2.0 ** r.integers(-4, 4))
            .astype(t.dtype)
            .astype(np.float32)
            for t in tables
        }
    )
    values = emb.embedding_tables
    want_kernels = {"embedmesh_segment_gather_sum_mapped"}
    if n == 2:
        want_kernels |= {"embedmesh_lookup_from_shards", "embedmesh_exchange_pooled_partials"}
    for weighted in (False, True):
        csr = _check_lookups(emb, tables, values, r, n, weighted)
        text = jax.jit(emb.core.lookup).lower(emb.state, csr).as_text()
        for target in want_kernels:
            assert target in text, (target, weighted)
        assert "stablehlo.gather" not in text, weighted


def _check_lookups(emb, tables, values, r, n, weighted):
    """One random batch of bags (weighted or not) looked up by `emb` against the float64
    oracle of the tables' `values`; returns its enqueued form."""
    lengths = [r.integers(0, 6, 8) for _ in tables]  # bags of 0-5 ids
    ids = {f"f_{t.name}": r.integers(0, 40, int(m.sum())) for t, m in zip(tables, lengths)}
    weights = {k: (r.integers(1, 9, v.size) / 4).astype(np.float32) for k, v in ids.items()}
    lens = {f"f_{t.name}": m for t, m in zip(tables, lengths)}
    feats = {k: em.RaggedTensor.from_row_lengths(v, lens[k]) for k, v in ids.items()}
    w = {k: em.RaggedTensor.from_row_lengths(v, lens[k]) for k, v in weights.items()}
    csr = emb.enqueue(feats, w if weighted else None)
    acts, _ = emb.dequeue(csr)
    for t in tables:
        k = f"f_{t.name}"
        table = np.asarray(values[t])
        assert table.dtype == np.dtype(NUMPY[t.name.rsplit("_", 1)[0]])
        ends = np.cumsum(lens[k])
        bags = [
            (ids[k][e - m : e], weights[k][e - m : e] if weighted else np.ones(m))
            for e, m in zip(ends, lens[k])
        ]
        want, scale = _bag_oracle(table, bags, t.combiner)
        got = np.asarray(acts[k])
        assert got.dtype == np.float32 and got.shape == want.shape
        tol = 2 * (6 + 4) * 2.0**-24 * scale
        assert np.all(np.abs(got - want) <= tol + 1e-30), (t.name, n, weighted)
    return csr
