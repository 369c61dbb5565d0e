"""Host preprocessing against a deliberately simple reference (loops and dicts)."""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import training_reference as tref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh.config import FeatureConfig, TableConfig
from embedmesh.host.preprocess import (
    PAD_ID,
    Capacity,
    PartitionedCsrFormatTensor,
    capacity_bucket,
    compute_sparse_core_stats,
    native_available,
    numba_available,
    preprocess_features,
)
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.layout.sharding import stack_to_shards
from embedmesh.layout.stacking import plan_stacking

BACKENDS = (
    ["numpy"]
    + (["numba"] if numba_available() else [])
    + (["native"] if native_available() else [])
)
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------
# The reference: one (sample, position, id, weight) at a time.


def rows_of(config, inp, weight):
    """(batch, rows per sample, [(sample, sub-row, id, gain)]) of one feature under the
    layout rules shared with serving (`training_reference.layout`, plain loops)."""
    shape, gains, _ = tref.layout(config, inp, weight)
    out = []
    for row, i, g in gains:
        sub = 0
        for k, d in zip(row[1:], shape[1:]):
            sub = sub * d + k
        out.append((row[0], sub, i, g))
    return shape[0], math.prod(shape[1:]), out


def reference(plan, features, weights, num_devices, capacities=None):
    """{stack: {"R", "parts": {(d, j): (uniques, pairs)}, "u_total", "p_total", "dropped"}}.

    pairs are (local row, output row, gain, entries) sorted by (local row,
    output row). With `capacities`, applies the documented drop rule.
    """
    n = plan.num_shards
    feats = {}
    batch = None
    rps = {}
    for name in plan.resolved.feature_names:
        config = plan.resolved.features[plan.feature(name).index]
        batch, rps[name], feats[name] = rows_of(config, features[name], (weights or {}).get(name))
    b = batch // num_devices
    result = {}
    for stack in plan.stacks:
        cells = collections.defaultdict(dict)
        offset = 0
        for fname in stack.features:
            fp = plan.feature(fname)
            t = plan.table(fp.table)
            for s, sub, i, g in feats[fname]:
                d, local = divmod(s, b)
                orow = offset + local * rps[fname] + sub
                # the mod rule over the table's span (k = N: mod, k = 1: table-wise)
                k = t.span
                j = t.first_shard + (i % k + t.rotation) % k
                lr = t.local_row_offset + i // k
                cell = cells[(d, j)].setdefault((lr, orow), [0.0, 0])
                cell[0] += g
                cell[1] += 1
            offset += b * rps[fname]
        parts, u_total, p_total, dropped = {}, {}, {}, 0
        for d in range(num_devices):
            for j in range(n):
                pairs = sorted((lr, o, g, c) for (lr, o), (g, c) in cells[(d, j)].items())
                uniques = sorted({lr for lr, _, _, _ in pairs})
                u_total[d, j], p_total[d, j] = len(uniques), len(pairs)
                if capacities is not None:
                    cap = capacities[stack.name]
                    U, P = cap.max_unique_ids_per_partition, cap.max_ids_per_partition
                    first_pair = {}
                    for q, (lr, _, _, _) in enumerate(pairs):
                        first_pair.setdefault(lr, q)
                    kept_u = [lr for u, lr in enumerate(uniques) if u < U and first_pair[lr] < P]
                    kept_p = [
                        pr for q, pr in enumerate(pairs) if uniques.index(pr[0]) < U and q < P
                    ]
                    dropped += sum(pr[3] for pr in pairs) - sum(pr[3] for pr in kept_p)
                    uniques, pairs = kept_u, kept_p
                parts[d, j] = (uniques, pairs)
        result[stack.name] = dict(
            R=offset, parts=parts, u_total=u_total, p_total=p_total, dropped=dropped
        )
    return result


def check_against_reference(out, stats, ref, num_devices, num_shards):
    assert set(out) == set(ref)
    for name, r in ref.items():
        t = out[name]
        assert isinstance(t, PartitionedCsrFormatTensor) and t.stack == name
        assert t.rows_per_device == r["R"]
        D, N, U = t.unique_ids.shape
        assert (num_devices, num_shards) == (D, N) and t.pair_rows.shape[:2] == (D, N)
        assert t.unique_ids.dtype == np.int32 and t.pair_rows.dtype == np.int32
        assert t.pair_unique.dtype == np.int32 and t.pair_gains.dtype == np.float32
        assert t.unique_counts.dtype == np.int32 and t.pair_counts.dtype == np.int32
        st_ = stats[name]
        assert st_.dropped_ids == r["dropped"]
        for (d, j), (uniques, pairs) in r["parts"].items():
            assert st_.unique_ids_per_partition[d, j] == r["u_total"][d, j]
            assert st_.ids_per_partition[d, j] == r["p_total"][d, j]
            cu, cp = int(t.unique_counts[d, j]), int(t.pair_counts[d, j])
            assert cu == len(uniques) and cp == len(pairs)
            assert t.unique_ids[d, j, :cu].tolist() == uniques
            assert (t.unique_ids[d, j, cu:] == PAD_ID).all()
            assert t.pair_rows[d, j, :cp].tolist() == [o for _, o, _, _ in pairs]
            assert t.unique_ids[d, j][t.pair_unique[d, j, :cp]].tolist() == [
                lr for lr, _, _, _ in pairs
            ]
            np.testing.assert_allclose(
                t.pair_gains[d, j, :cp], [g for _, _, g, _ in pairs], rtol=2e-6, atol=1e-6
            )
            assert (t.pair_rows[d, j, cp:] == r["R"]).all()
            assert (t.pair_unique[d, j, cp:] == 0).all()
            assert (t.pair_gains[d, j, cp:] == 0).all()


# ---------------------------------------------------------------------------
# Random configurations and batches


KINDS = ["dense1", "dense2", "sparse", "ragged", "sparse3"]
WEIGHT_VALUES = np.array([0.0, 0.5, 1.0, 2.0, -1.0, 3.25], np.float32)


def make_input(rng, kind, batch, vocab, weighted, width):
    """One feature's input (and weights) of `kind` with ids drawn in [0, vocab)."""
    hot = min(vocab, 3)  # a few hot ids, so duplicates happen

    def ids(size):
        x = rng.integers(0, vocab, size)
        return np.where(rng.random(size) < 0.4, rng.integers(0, hot, size), x)

    def w(size):
        return WEIGHT_VALUES[rng.integers(0, len(WEIGHT_VALUES), size)]

    if kind == "dense1":
        x = ids(batch).astype(np.int32 if rng.random() < 0.5 else np.int64)
        return x, (w(batch) if weighted else None)
    if kind == "dense2":
        x = ids((batch, width)).astype(np.int64)
        return x, (w((batch, width)) if weighted else None)
    if kind == "sparse3":  # [batch, width, 5]: one combined row per (sample, group)
        rows = [
            (s, a, p)
            for s in range(batch)
            for a in range(width)
            for p in sorted(rng.choice(5, size=int(rng.integers(0, 4)), replace=False))
        ]
        indices = np.array(rows, np.int64).reshape(-1, 3)
        values = ids(len(rows)).astype(np.int64)
        inp = SparseTensor(indices, values, (batch, width, 5))
        return inp, (SparseTensor(indices, w(len(rows)), (batch, width, 5)) if weighted else None)
    lengths = rng.integers(0, 6, batch)
    if kind == "ragged":
        values = ids(int(lengths.sum())).astype(np.int32)
        inp = RaggedTensor.from_row_lengths(values, lengths)
        return inp, (RaggedTensor(w(values.size), inp.row_splits) if weighted else None)
    rows = []
    for s, k in enumerate(lengths):
        for p in sorted(rng.choice(7, size=min(k, 7), replace=False)):
            rows.append((s, p))
    indices = np.array(rows, np.int64).reshape(-1, 2)
    values = ids(len(rows)).astype(np.int64)
    inp = SparseTensor(indices, values, (batch, 7))
    return inp, (SparseTensor(indices, w(len(rows)), (batch, 7)) if weighted else None)


@st.composite
def cases(draw, force_sum=False):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_shards = draw(st.sampled_from([1, 2, 4, 8, 3]))
    n_dev = draw(st.sampled_from([1, 2, 4, 3]))
    n_proc = draw(st.sampled_from([p for p in (1, 2, 3, 4) if n_dev % p == 0]))
    batch = n_dev * draw(st.integers(1, 3))
    n_tables = draw(st.integers(1, 3))
    tables = [
        TableConfig(
            int(draw(st.integers(1, 40))),
            int(draw(st.sampled_from([1, 4, 8, 12]))),
            combiner="sum" if force_sum else draw(st.sampled_from(["sum", "mean", "sqrtn"])),
            name=f"t{i}",
        )
        for i in range(n_tables)
    ]
    n_feat = draw(st.integers(1, 4))
    config, features, weights = {}, {}, {}
    for k in range(n_feat):
        table = tables[draw(st.integers(0, n_tables - 1))]
        kind = draw(st.sampled_from(KINDS))
        # dense ids are plain lookups (no sequence, no weights), and sequence
        # features take no weights: TensorFlow's rules
        seq = 0 if kind.startswith("dense") else draw(st.sampled_from([0, 0, 1, 3]))
        name = f"f{k}"
        config[name] = FeatureConfig(
            table,
            max_sequence_length=seq,
            name=name,
            validate_weights_and_indices=draw(st.booleans()),
        )
        weighted = draw(st.booleans()) and seq == 0 and not kind.startswith("dense")
        inp, w = make_input(
            rng, kind, batch, table.vocabulary_size, weighted, int(draw(st.integers(1, 4)))
        )
        features[name] = inp
        if w is not None:
            weights[name] = w
    stack = draw(st.booleans())
    sharding = draw(
        st.sampled_from(["mod", "mod", "table_wise", {"t0": "table_wise"}, {"t1": "table_wise"}])
    )
    if isinstance(sharding, dict):  # only the tables this config uses
        sharding = {
            k: v for k, v in sharding.items() if k in {f.table.name for f in config.values()}
        }
    plan = plan_stacking(config, n_shards, stack_tables=stack, sharding=sharding)
    return plan, features, weights or None, n_dev, n_proc


def slice_input(x, lo, hi):
    """Samples [lo, hi) of one input (rank-2 sparse, ragged or dense)."""
    if x is None:
        return None
    if isinstance(x, RaggedTensor):
        splits = np.asarray(x.row_splits)
        return RaggedTensor(
            np.asarray(x.values)[splits[lo] : splits[hi]], splits[lo : hi + 1] - splits[lo]
        )
    if isinstance(x, SparseTensor):
        idx = np.asarray(x.indices)
        keep = (idx[:, 0] >= lo) & (idx[:, 0] < hi)
        sub = idx[keep].copy()
        sub[:, 0] -= lo
        return SparseTensor(sub, np.asarray(x.values)[keep], (hi - lo,) + x.dense_shape[1:])
    return np.asarray(x)[lo:hi]


# ---------------------------------------------------------------------------
# Agreement with the reference


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(cases())
def test_matches_reference(backend, case):
    plan, features, weights, n_dev, _ = case
    out, stats = preprocess_features(
        features, weights, plan, num_devices_local=n_dev, backend=backend
    )
    ref = reference(plan, features, weights, n_dev)
    check_against_reference(out, stats, ref, n_dev, plan.num_shards)
    for name, t in out.items():  # capacities=None: the bucketed need of this batch
        s = stats[name]
        assert t.capacity == s.capacity == s.required_capacity
        assert not s.grown and s.dropped_ids == 0


@SETTINGS
@given(cases())
def test_backends_agree_bit_for_bit_and_processes_concatenate(case):
    plan, features, weights, n_dev, n_proc = case
    results = [
        preprocess_features(
            features, weights, plan, num_devices_local=n_dev, backend=b, num_threads=t
        )
        for b in BACKENDS
        for t in ((1, 3) if b in ("numba", "native") else (1,))
    ]
    out, stats = results[0]
    for other, _ in results[1:]:
        for name in out:
            for a, b in zip(
                jax.tree_util.tree_leaves(out[name]), jax.tree_util.tree_leaves(other[name])
            ):
                np.testing.assert_array_equal(a, b)
    # Several processes' slices of one global batch: the per-process results,
    # concatenated along the device axis, are the global result.
    caps = stats.capacities
    size = next(iter(features.values()))
    total = (
        size.nrows
        if isinstance(size, RaggedTensor)
        else size.dense_shape[0]
        if isinstance(size, SparseTensor)
        else np.shape(size)[0]
    )
    per = total // n_proc
    parts = []
    for p in range(n_proc):
        f = {k: slice_input(v, p * per, (p + 1) * per) for k, v in features.items()}
        w = (
            None
            if weights is None
            else {k: slice_input(v, p * per, (p + 1) * per) for k, v in weights.items()}
        )
        parts.append(
            preprocess_features(
                f,
                w,
                plan,
                num_devices_local=n_dev // n_proc,
                capacities=caps,
                process_index=p,
                backend=BACKENDS[-1],
            )[0]
        )
    for name, t in out.items():
        for field in PartitionedCsrFormatTensor._ARRAYS:
            np.testing.assert_array_equal(
                np.concatenate([getattr(part[name], field) for part in parts]),
                getattr(t, field),
                err_msg=f"{name}.{field}",
            )
        assert all(part[name].rows_per_device == t.rows_per_device for part in parts)


@SETTINGS
@given(cases(force_sum=True))
def test_round_trip_rebuilds_the_input_multiset(case):
    """(feature, sample, position, id) -> summed weight, from the CSR alone."""
    plan, features, weights, n_dev, _ = case
    out, _ = preprocess_features(
        features, weights, plan, num_devices_local=n_dev, backend=BACKENDS[-1]
    )
    expected = collections.defaultdict(float)
    for name in plan.resolved.feature_names:
        config = plan.resolved.features[plan.feature(name).index]
        batch, _, rows = rows_of(config, features[name], (weights or {}).get(name))
        for s, sub, i, g in rows:
            expected[(name, s, sub, i)] += g
    b = batch // n_dev
    got = collections.defaultdict(float)
    for name, t in out.items():
        for d in range(n_dev):
            for j in range(plan.num_shards):
                cp = int(t.pair_counts[d, j])
                lr = t.unique_ids[d, j][t.pair_unique[d, j, :cp]]
                table_index, ids = plan.unlocate(name, np.full(cp, j), lr)
                assert (table_index >= 0).all()
                for row, ti, i, g in zip(
                    t.pair_rows[d, j, :cp], table_index, ids, t.pair_gains[d, j, :cp]
                ):
                    slot = next(
                        f for f in t.features if f.row_offset <= row < f.row_offset + f.num_rows
                    )
                    fp = plan.feature(slot.name)
                    assert plan.table(fp.table).index == ti
                    sample, pos = divmod(int(row) - slot.row_offset, slot.rows_per_sample)
                    got[(slot.name, d * b + sample, pos, int(i))] += float(g)
    keys = set(expected) | set(got)
    for k in keys:
        assert math.isclose(got.get(k, 0.0), expected.get(k, 0.0), rel_tol=1e-6, abs_tol=1e-6), k


def emulate_device(t, shards, num_shards):
    """Activation buffers [D, R, dim] from the padded arrays, with the device's
    padding semantics (take(mode="fill") and a segment sum that drops row R)."""
    D = t.unique_ids.shape[0]
    R = t.rows_per_device
    dim = shards[0].shape[1]
    out = np.zeros((D, R + 1, dim))
    for d in range(D):
        for j in range(num_shards):
            ids = t.unique_ids[d, j]
            valid = ids < shards[j].shape[0]
            rows = np.where(valid[:, None], shards[j][np.where(valid, ids, 0)], 0.0)
            contrib = t.pair_gains[d, j][:, None] * rows[t.pair_unique[d, j]]
            assert (t.pair_rows[d, j] <= R).all()
            np.add.at(out[d], t.pair_rows[d, j], contrib)
    return out[:, :R]


@SETTINGS
@given(cases(), st.integers(0, 2**31 - 1))
def test_activations_from_poisoned_shards_match_a_direct_lookup(case, seed):
    """Padding rows of every shard hold NaN: no real or padding entry may read them."""
    plan, features, weights, n_dev, _ = case
    rng = np.random.default_rng(seed)
    tables = {t.name: rng.standard_normal((t.vocabulary_size, t.dim)) for t in plan.tables}
    out, _ = preprocess_features(
        features, weights, plan, num_devices_local=n_dev, backend=BACKENDS[-1]
    )
    for s in plan.stacks:
        shards = stack_to_shards(tables, plan, s.name)
        for j, sh in enumerate(shards):  # poison the vocabulary padding rows
            used = np.zeros(sh.shape[0], bool)
            for name in s.tables:
                t = plan.table(name)
                if not t.first_shard <= j < t.first_shard + t.span:
                    continue  # no block of the table on this shard
                k = t.span
                first = (j - t.first_shard - t.rotation) % k
                used[
                    t.local_row_offset : t.local_row_offset
                    + len(range(first, t.vocabulary_size, k))
                ] = True
            sh[~used] = np.nan
        act = emulate_device(out[s.name], shards, plan.num_shards)
        for slot in out[s.name].features:
            fp = plan.feature(slot.name)
            config = plan.resolved.features[fp.index]
            batch, rps, rows = rows_of(config, features[slot.name], (weights or {}).get(slot.name))
            b = batch // n_dev
            want = np.zeros((batch * rps, slot.dim))
            for smp, sub, i, g in rows:
                want[smp * rps + sub] += g * tables[fp.table][i]
            got = act[:, slot.row_offset : slot.row_offset + slot.num_rows, : slot.dim]
            np.testing.assert_allclose(
                got.reshape(n_dev * b * slot.rows_per_sample, slot.dim), want, rtol=1e-5, atol=1e-5
            )


def test_padding_is_inert_with_real_jax_ops():
    t = TableConfig(50, 8, combiner="mean", name="t")
    cfg = {"a": FeatureConfig(t), "b": FeatureConfig(t, max_sequence_length=2)}
    plan = plan_stacking(cfg, 2)
    rng = np.random.default_rng(0)
    a_ids = rng.integers(0, 50, (4, 3))  # three ids a sample, combined (mean)
    feats = {
        "a": RaggedTensor.from_row_lengths(a_ids.reshape(-1), [3] * 4),
        "b": RaggedTensor.from_row_lengths(rng.integers(0, 50, 7), [3, 0, 2, 2]),
    }
    out, _ = preprocess_features(
        feats, None, plan, num_devices_local=2, capacities=Capacity(64, 64)
    )
    csr = out["t"]
    table = rng.standard_normal((50, 8)).astype(np.float32)
    shards = jnp.asarray(np.stack(stack_to_shards({"t": table}, plan, "t")))
    R = csr.rows_per_device
    for d in range(2):
        acc = jnp.zeros((R, 8))
        for j in range(2):
            rows = jnp.take(
                shards[j], jnp.asarray(csr.unique_ids[d, j]), axis=0, mode="fill", fill_value=0
            )
            vals = csr.pair_gains[d, j][:, None] * rows[csr.pair_unique[d, j]]
            acc += jax.ops.segment_sum(vals, jnp.asarray(csr.pair_rows[d, j]), num_segments=R)
        x = a_ids[2 * d : 2 * d + 2]
        np.testing.assert_allclose(acc[:2], table[x].mean(1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Overflow policies


def _skewed_case():
    t = TableConfig(64, 8, combiner="sum", name="t")
    u = TableConfig(64, 8, combiner="mean", name="u")
    cfg = {"a": FeatureConfig(t), "b": FeatureConfig(u)}
    plan = plan_stacking(cfg, 4)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 64, (8, 6))
    ids[4:, :] = 4 * rng.integers(0, 16, (4, 6)) + 1  # device 1 sends these to one shard
    feats = {
        "a": ids,
        "b": RaggedTensor.from_row_lengths(rng.integers(0, 64, 20), [3, 2, 0, 5, 2, 3, 3, 2]),
    }
    return plan, feats


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_error_names_stack_device_shard_count_and_capacity(backend):
    plan, feats = _skewed_case()
    _, stats = preprocess_features(feats, None, plan, num_devices_local=2, backend=backend)
    s = stats["t+u"]
    need_p, need_u = s.ids_per_partition, s.unique_ids_per_partition
    cap = Capacity(int(need_p.max()) - 1, 64)
    d, j = (int(x) for x in np.argwhere(need_p > cap.max_ids_per_partition)[0])
    with pytest.raises(ValueError) as e:
        preprocess_features(
            feats,
            None,
            plan,
            num_devices_local=2,
            capacities={"t+u": cap},
            process_index=3,
            backend=backend,
        )
    msg = str(e.value)
    assert "stack t+u" in msg and f"device {3 * 2 + d}" in msg and f"shard {j}" in msg
    assert f"{int(need_p[d, j])} ids" in msg
    assert f"max_ids_per_partition={cap.max_ids_per_partition}" in msg
    cap = Capacity(64, int(need_u.max()) - 1)
    d, j = (int(x) for x in np.argwhere(need_u > cap.max_unique_ids_per_partition)[0])
    with pytest.raises(
        ValueError,
        match=f"device {d} .*{int(need_u[d, j])} unique ids from "
        f"shard {j}.*max_unique_ids_per_partition="
        f"{cap.max_unique_ids_per_partition}",
    ):
        preprocess_features(feats, None, plan, num_devices_local=2, capacities=cap, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(cases(), st.data())
def test_overflow_drop_matches_the_documented_rule(backend, case, data):
    plan, features, weights, n_dev, _ = case
    _, stats = preprocess_features(
        features, weights, plan, num_devices_local=n_dev, backend=backend
    )
    caps = {}
    for s in plan.stacks:
        st_ = stats[s.name]
        caps[s.name] = Capacity(
            data.draw(st.integers(0, st_.max_ids_per_partition + 1)),
            data.draw(st.integers(0, st_.max_unique_ids_per_partition + 1)),
        )
    out, stats = preprocess_features(
        features,
        weights,
        plan,
        num_devices_local=n_dev,
        capacities=caps,
        overflow="drop",
        backend=backend,
    )
    ref = reference(plan, features, weights, n_dev, capacities=caps)
    check_against_reference(out, stats, ref, n_dev, plan.num_shards)
    for s in plan.stacks:
        assert out[s.name].capacity == caps[s.name] == stats[s.name].capacity
    assert stats.dropped_ids == {k: v["dropped"] for k, v in ref.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_grow_loses_nothing_and_reports_the_bucket(backend):
    plan, feats = _skewed_case()
    small = Capacity(4, 4)
    out, stats = preprocess_features(
        feats, None, plan, num_devices_local=2, capacities=small, overflow="grow", backend=backend
    )
    s = stats["t+u"]
    assert s.grown and stats.grown == {"t+u": s.capacity} and s.dropped_ids == 0
    assert s.capacity == Capacity(
        capacity_bucket(s.max_ids_per_partition), capacity_bucket(s.max_unique_ids_per_partition)
    )
    assert out["t+u"].capacity == s.capacity
    check_against_reference(out, stats, reference(plan, feats, None, 2), 2, 4)
    # Enough room: nothing grows, the given capacity is kept.
    big = Capacity(1000, 500)
    out, stats = preprocess_features(
        feats, None, plan, num_devices_local=2, capacities=big, overflow="grow", backend=backend
    )
    assert not stats["t+u"].grown and stats.grown == {} and out["t+u"].capacity == big


def test_capacity_buckets():
    assert [capacity_bucket(n) for n in (0, 1, 8, 9, 12, 13, 16, 17, 25, 33, 100, 1000)] == [
        8,
        8,
        8,
        12,
        12,
        16,
        16,
        24,
        32,
        48,
        128,
        1024,
    ]
    for n in range(1, 5000, 7):
        c = capacity_bucket(n)
        assert n <= c <= max(8, 1.5 * n)
    with pytest.raises(ValueError, match="max_ids_per_partition"):
        Capacity(-1, 3)


# ---------------------------------------------------------------------------
# Validation and errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("kind", ["dense", "ragged", "sparse"])
def test_out_of_range_ids_name_the_feature_and_the_first_bad_id(backend, validate, kind):
    t = TableConfig(10, 4, name="t")
    cfg = {"ok": FeatureConfig(t), "bad": FeatureConfig(t, validate_weights_and_indices=validate)}
    plan = plan_stacking(cfg, 2)
    for bad_value in (10, -3):
        vals = np.array([1, 2, bad_value, 11, 4, 5])
        if kind == "dense":
            x = vals.reshape(2, 3)
        elif kind == "ragged":
            x = RaggedTensor.from_row_lengths(vals, [3, 3])
        else:
            x = SparseTensor(
                np.array([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]), vals, (2, 3)
            )
        want = rf"feature bad: id {bad_value} \(entry 2\)"
        if kind == "sparse" and validate and bad_value < 0:
            # TensorFlow's safe sparse lookup prunes ids < 0; 11 is the first bad one left,
            # reported at its position in the input
            want = r"feature bad: id 11 \(entry 3\)"
        with pytest.raises(ValueError, match=want):
            preprocess_features(
                {"ok": np.array([1, 2]), "bad": x}, None, plan, num_devices_local=2, backend=backend
            )


def test_argument_errors():
    t = TableConfig(10, 4, name="t")
    plan = plan_stacking({"a": FeatureConfig(t), "b": FeatureConfig(t)}, 2)
    ok = np.array([1, 2, 3, 4])
    with pytest.raises(ValueError, match="feature b has batch size 3 but feature a has 4"):
        preprocess_features({"a": ok, "b": np.array([1, 2, 3])}, None, plan)
    with pytest.raises(ValueError, match="not a multiple of the 3 local .* a multiple of 3"):
        preprocess_features({"a": ok, "b": ok}, None, plan, num_devices_local=3)
    with pytest.raises(ValueError, match="feature b has no input.*an input for every feature"):
        preprocess_features({"a": ok}, None, plan)
    with pytest.raises(ValueError, match="overflow"):
        preprocess_features({"a": ok, "b": ok}, None, plan, overflow="ignore")
    with pytest.raises(ValueError, match="backend"):
        preprocess_features({"a": ok, "b": ok}, None, plan, backend="cuda")
    with pytest.raises(TypeError, match="StackingPlan"):
        preprocess_features({"a": ok, "b": ok}, None, {"a": 1})
    with pytest.raises(ValueError, match="weight shape"):
        preprocess_features({"a": ok, "b": ok}, {"a": np.ones(3)}, plan)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank3_sparse_and_empty_rows(backend):
    t = TableConfig(30, 4, name="t", combiner="sqrtn")
    cfg = {"s": FeatureConfig(t), "e": FeatureConfig(t, max_sequence_length=2)}
    plan = plan_stacking(cfg, 4)
    idx = np.array([[0, 0, 0], [0, 0, 1], [1, 1, 0], [1, 1, 2], [1, 1, 3]])
    # batch 2, two combined rows a sample ([B, 2, dim], as serving gives), beside a
    # rank-2 feature of the same batch
    s = SparseTensor(idx, np.array([3, 3, 7, 29, 0]), (2, 2, 4))
    e = RaggedTensor.from_row_lengths(np.zeros(0, np.int64), [0, 0])
    out, stats = preprocess_features(
        {"s": s, "e": e}, None, plan, num_devices_local=2, backend=backend
    )
    check_against_reference(out, stats, reference(plan, {"s": s, "e": e}, None, 2), 2, 4)
    assert stats["t"].num_ids == 5
    slot = out["t"].feature_segment("s")
    assert (slot.samples, slot.sample_shape, slot.num_rows) == (1, (2,), 2)
    assert slot.activation_shape(2) == (2, 2, 4)


def test_pytree_and_layout():
    t = TableConfig(10, 3, name="t")
    u = TableConfig(20, 5, name="u")
    cfg = {"a": FeatureConfig(t), "b": FeatureConfig(u, max_sequence_length=4)}
    plan = plan_stacking(cfg, 2)
    out, _ = preprocess_features(
        {"a": np.arange(4), "b": RaggedTensor.from_row_lengths(np.arange(8), [2] * 4)},
        None,
        plan,
        num_devices_local=2,
    )
    csr = out["t+u"]
    leaves, treedef = jax.tree_util.tree_flatten(csr)
    assert len(leaves) == 6
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.stack == "t+u" and back.features == csr.features
    assert csr.rows_per_device == 2 * 1 + 2 * 4
    a, b = csr.features
    assert (a.name, a.row_offset, a.num_rows, a.rows_per_sample, a.dim) == ("a", 0, 2, 1, 3)
    assert (b.name, b.row_offset, b.num_rows, b.rows_per_sample, b.dim) == ("b", 2, 8, 4, 5)
    assert csr.feature_segment("b") == b and csr.num_devices == 2 and csr.num_shards == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_compute_sparse_core_stats_takes_maxima_over_batches(backend):
    plan, feats = _skewed_case()
    rng = np.random.default_rng(5)
    batches = [
        feats,
        {
            "a": rng.integers(0, 64, (8, 6)),
            "b": RaggedTensor.from_row_lengths(rng.integers(0, 64, 30), [9, 2, 0, 5, 2, 3, 7, 2]),
        },
    ]
    got = compute_sparse_core_stats(batches, plan, num_devices_local=2, backend=backend)
    singles = [preprocess_features(b, None, plan, num_devices_local=2)[1]["t+u"] for b in batches]
    assert got.num_batches == 2
    assert got.max_ids_per_partition["t+u"] == max(s.max_ids_per_partition for s in singles)
    assert got.max_unique_ids_per_partition["t+u"] == max(
        s.max_unique_ids_per_partition for s in singles
    )
    caps = got.capacities()
    for b in batches:  # the measured capacities hold every batch
        preprocess_features(b, None, plan, num_devices_local=2, capacities=caps)
    via_config = compute_sparse_core_stats(
        batches, plan.resolved, num_shards=4, num_devices_local=2
    )
    assert via_config.max_ids_per_partition == got.max_ids_per_partition
    with pytest.raises(ValueError, match="num_shards"):
        compute_sparse_core_stats(batches, plan.resolved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    t = TableConfig(10, 4, name="t")
    plan = plan_stacking({"a": FeatureConfig(t), "b": FeatureConfig(t, max_sequence_length=2)}, 2)
    feats = {
        "a": np.zeros((0, 3), np.int64),
        "b": RaggedTensor.from_row_lengths(np.zeros(0, np.int32), []),
    }
    out, stats = preprocess_features(feats, None, plan, num_devices_local=2, backend=backend)
    csr = out["t"]
    assert csr.rows_per_device == 0 and (csr.unique_counts == 0).all()
    assert (csr.unique_ids == PAD_ID).all() and (csr.pair_rows == 0).all()
    assert stats["t"].num_ids == 0 and stats["t"].capacity == Capacity(8, 8)


def test_capacities_from_table_configs():
    t = TableConfig(64, 8, name="t")
    u = TableConfig(64, 8, name="u")
    plan = plan_stacking({"a": FeatureConfig(t), "b": FeatureConfig(u)}, 2)
    feats = {"a": np.arange(8).reshape(4, 2), "b": np.arange(8).reshape(4, 2)}
    out, _ = preprocess_features(feats, None, plan, num_devices_local=2)
    assert out["t+u"].capacity == Capacity(8, 8)  # bucketed need of the batch
    # A table config carrying limits (forward compatible: TableConfig has no
    # such fields yet) gives the stack the sum of its tables' limits.
    for table, (ids, unique) in ((t, (40, 24)), (u, (9, 5))):
        object.__setattr__(table, "max_ids_per_partition", ids)
        object.__setattr__(table, "max_unique_ids_per_partition", unique)
    out, stats = preprocess_features(feats, None, plan, num_devices_local=2)
    assert out["t+u"].capacity == Capacity(49, 29) == stats["t+u"].capacity
    out, _ = preprocess_features(
        feats, None, plan, num_devices_local=2, capacities={"t+u": Capacity(16, 16)}
    )
    assert out["t+u"].capacity == Capacity(16, 16)  # an explicit capacity wins


def test_numpy_fallback_when_numba_is_missing(monkeypatch):
    import embedmesh.host.preprocess as pp

    monkeypatch.setattr(pp, "_NUMBA", False)
    assert not pp.numba_available()
    plan, feats = _skewed_case()
    out, stats = preprocess_features(feats, None, plan, num_devices_local=2)  # backend="auto"
    check_against_reference(out, stats, reference(plan, feats, None, 2), 2, 4)
    with pytest.raises(ImportError, match="numba"):
        preprocess_features(feats, None, plan, num_devices_local=2, backend="numba")


def test_fallback_when_the_cpp_kernels_are_missing(monkeypatch):
    """ "auto" takes the C++ kernels where their library loads, else numba's, else
    numpy's; "native" without the library names the cause."""
    import embedmesh.host.preprocess as pp
    from embedmesh.host import native_backend

    monkeypatch.setattr(native_backend, "_state", {"why": "no library in this test"})
    assert not pp.native_available()
    assert pp.auto_backend() == ("numba" if numba_available() else "numpy")
    plan, feats = _skewed_case()
    out, stats = preprocess_features(feats, None, plan, num_devices_local=2)  # backend="auto"
    check_against_reference(out, stats, reference(plan, feats, None, 2), 2, 4)
    with pytest.raises(ImportError, match="no library in this test"):
        preprocess_features(feats, None, plan, num_devices_local=2, backend="native")
    monkeypatch.setattr(pp, "_NUMBA", False)
    assert pp.auto_backend() == "numpy"


@pytest.mark.skipif(not native_available(), reason="no C++ preprocessing kernels here")
def test_native_is_auto_and_a_bad_id_after_a_presorted_table_frees_its_sorts():
    """ "auto" is the C++ kernels; a stack whose second table has a bad id (its first
    table's sort run ahead on another thread) raises the range error and leaves no
    sort behind."""
    import embedmesh.host.preprocess as pp

    assert pp.auto_backend() == "native"
    t = TableConfig(16, 4, name="t")
    u = TableConfig(8, 4, name="u")
    plan = plan_stacking({"a": FeatureConfig(t), "b": FeatureConfig(u)}, 2)
    feats = {"a": np.arange(8).reshape(4, 2) % 16, "b": np.array([[1, 2], [3, 9], [0, 0], [1, 1]])}
    with pytest.raises(ValueError, match="b"):
        preprocess_features(feats, None, plan, num_devices_local=1, backend="native", num_threads=2)
    out, _ = preprocess_features(
        {"a": feats["a"], "b": feats["b"] % 8}, None, plan, num_devices_local=1, num_threads=2
    )
    ref, _ = preprocess_features(
        {"a": feats["a"], "b": feats["b"] % 8}, None, plan, num_devices_local=1, backend="numpy"
    )
    for name in out:
        for f in PartitionedCsrFormatTensor._ARRAYS:
            np.testing.assert_array_equal(getattr(out[name], f), getattr(ref[name], f))
