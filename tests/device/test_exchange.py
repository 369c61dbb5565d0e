"""`ops.exchange`: the shared-memory all-to-all of in-process CPU devices (exchange.cc)
against a plain numpy block transpose and XLA's `all_to_all`, on 2, 4 and 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optimizer_reference import ALL_FUSED, numpy_update_rows

from embedmesh.device import ops
from embedmesh.device.ops import cpu

needs_kernels = pytest.mark.skipif(
    not cpu.ready(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}"
)


def block_transpose(x: np.ndarray, n: int) -> np.ndarray:
    """The oracle: device s holds rows [s*n*b, (s+1)*n*b) as n blocks of b; block s of
    device r's result is block r of device s's input."""
    b = x.shape[0] // (n * n)
    blocks = x.reshape((n, n, b) + x.shape[1:])  # [source, destination, ...]
    return np.swapaxes(blocks, 0, 1).reshape(x.shape)


def mesh_of(n: int, two_axes: bool = False) -> Mesh:
    devices = np.array(jax.devices()[:n])
    if two_axes:
        return Mesh(devices.reshape(2, n // 2), ("a", "b"))
    return Mesh(devices, ("x",))


def exchange_fn(mesh: Mesh, in_process: bool, repeats: int = 1):
    axes = tuple(mesh.axis_names)
    n = mesh.size

    def body(x):
        for _ in range(repeats):  # one call site per repeat: separate rendezvous
            x = ops.exchange(x, ops.Transport(axes, n, in_process=in_process))
        return x

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
    )


def random_array(rng, shape, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int64).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


SEEDS = st.integers(0, 2**31 - 1)  # the random tests' seeds


def shard_cases(devices, rows=40, u=10, num_rows=8) -> dict:
    """The strategies of the sharded lookup and update tests' shapes: `n` one of
    `devices`; `rows`, `u`, `num_rows` from 1 to the given bound, `p` from 0 to 30; `d` 1, 8
    or 16."""
    return dict(
        n=st.sampled_from(devices),
        rows=st.integers(1, rows),
        u=st.integers(1, u),
        p=st.integers(0, 30),
        num_rows=st.integers(1, num_rows),
        d=st.sampled_from([1, 8, 16]),
    )


@needs_kernels
@settings(max_examples=8, deadline=None)
@given(
    n=st.sampled_from([2, 4, 8]),
    b=st.integers(1, 40),
    width=st.sampled_from([(), (1,), (3,), (16,), (2, 5)]),
    dtype=st.sampled_from([np.float32, np.int32, jnp.bfloat16]),
    two_axes=st.booleans(),
    seed=SEEDS,
)
def test_exchange_matches_block_transpose(n, b, width, dtype, two_axes, seed):
    mesh = mesh_of(n, two_axes and n >= 4)
    x = random_array(np.random.default_rng(seed), (n * n * b,) + width, dtype)
    placed = jax.device_put(x, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    fn = exchange_fn(mesh, in_process=True)
    assert "embedmesh_exchange" in fn.lower(placed).as_text()
    got = np.asarray(fn(placed))
    np.testing.assert_array_equal(got, block_transpose(x, n))
    np.testing.assert_array_equal(got, np.asarray(exchange_fn(mesh, in_process=False)(placed)))


@needs_kernels
@pytest.mark.parametrize("n", [2, 8])
def test_exchanges_in_sequence_and_in_a_loop(n):
    """Three call sites in one program, and one call site run 5 times in a loop: each
    call pairs with the same call on the other devices (the rendezvous' generations)."""
    mesh = mesh_of(n)
    axes = tuple(mesh.axis_names)
    x = np.random.default_rng(n).standard_normal((n * n * 7, 4)).astype(np.float32)
    placed = jax.device_put(x, NamedSharding(mesh, P(axes)))
    want = x
    for _ in range(3):
        want = block_transpose(want, n)
    np.testing.assert_array_equal(np.asarray(exchange_fn(mesh, True, repeats=3)(placed)), want)

    def loop(a):
        return jax.lax.fori_loop(
            0, 5, lambda i, v: ops.exchange(v * 2.0 + 1.0, ops.Transport(axes, n, True)), a
        )

    fn = jax.jit(
        jax.shard_map(loop, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
    )
    want = x
    for _ in range(5):
        want = block_transpose(want * 2.0 + 1.0, n)
    for _ in range(3):  # and the program itself run again
        np.testing.assert_array_equal(np.asarray(fn(placed)), want)


@needs_kernels
def test_exchange_over_processes_uses_xla():
    """Only devices of one process share memory: `in_process=False` is XLA's all_to_all."""
    mesh = mesh_of(2)
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("x")))
    text = exchange_fn(mesh, in_process=False).lower(x).as_text()
    assert "embedmesh_exchange" not in text and "all_to_all" in text
    # one device: no exchange at all
    assert ops.exchange(jnp.ones(3), ops.Transport("x", 1, in_process=True)).shape == (3,)


def test_core_knows_its_mesh_is_in_process():
    from embedmesh import FeatureConfig, TableConfig
    from embedmesh.device.core import EmbeddingCore
    from embedmesh.layout.stacking import plan_stacking

    fc = {"f": FeatureConfig(TableConfig(16, 4, name="t"))}
    core = EmbeddingCore(plan_stacking(fc, 4), mesh_of(4))
    assert core.transport == ops.Transport(("x",), 4, in_process=True, host_job=0)
    assert core.in_process


def lookup_oracle(tables, unique_ids, pair_unique, gains, pair_rows, num_rows):
    """float64: device r's row t sums gains * table_s[unique_ids[r][s, k]] over its pairs
    (s, p) with pair_rows[r][s, p] == t, k = pair_unique[r][s, p] (padding skipped)."""
    n = len(tables)
    outs = []
    for r in range(n):
        out = np.zeros((num_rows, tables[0].shape[1]))
        for s in range(n):
            for p in range(pair_unique.shape[-1]):
                t, k = pair_rows[r, s, p], pair_unique[r, s, p]
                if not (0 <= t < num_rows and 0 <= k < unique_ids.shape[-1]):
                    continue
                row = unique_ids[r, s, k]
                if 0 <= row < tables[s].shape[0]:
                    out[t] += gains[r, s, p] * tables[s][row].astype(np.float64)
        outs.append(out)
    return np.concatenate(outs)


@needs_kernels
@settings(max_examples=6, deadline=None)
@given(**shard_cases([2, 4, 8], rows=50, u=12, num_rows=9), seed=SEEDS)
def test_lookup_from_shards_matches_the_exchange_path(n, rows, u, p, num_rows, d, seed):
    """The fused in-process lookup against its reference (ids out, gathers, rows back,
    combine: XLA's all_to_all) and a float64 oracle, with padding ids, out-of-range
    unique positions and padding pairs (row R)."""
    r = np.random.default_rng(seed)
    mesh = mesh_of(n)
    tables = [r.standard_normal((rows, d)).astype(np.float32) for _ in range(n)]
    uids = r.integers(0, rows + 3, size=(n, n, u)).astype(np.int32)  # some past the end
    uids[r.random((n, n, u)) < 0.2] = ops.PAD_ID
    puniq = r.integers(0, u + 2, size=(n, n, p)).astype(np.int32)
    prows = r.integers(0, num_rows + 1, size=(n, n, p)).astype(np.int32)  # num_rows: pad
    gains = r.standard_normal((n, n, p)).astype(np.float32)
    put = lambda x: jax.device_put(
        x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), NamedSharding(mesh, P("x"))
    )
    args = (put(np.stack(tables)[:, None]), put(uids), put(puniq), put(gains), put(prows))

    def run(in_process):
        def body(t, ui, pu, g, pr):
            return ops.lookup_from_shards(
                t[0], ui, pu, g, pr, num_rows, ops.Transport("x", n, in_process=in_process)
            )

        spec = P("x")
        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)
        return jax.jit(fn), np.asarray(jax.jit(fn)(*args))

    fused_fn, fused = run(True)
    assert "embedmesh_lookup_from_shards" in fused_fn.lower(*args).as_text()
    _, via_exchange = run(False)
    want = lookup_oracle(tables, uids, puniq, gains, prows, num_rows)
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused, via_exchange, rtol=1e-6, atol=1e-6)


def _sharded_batch(r, n, rows, u, p, num_rows, d, grouped, shuffled=False):
    """Each device's batch as the host makes it: per shard ascending distinct ids (PAD
    padded; in random order when `shuffled`, which the kernels must sort); pairs grouped
    by slot when `grouped` (the fused kernel's fast case), else in random order; some
    padding pairs (row R) and out-of-range slots."""
    uids = np.full((n, n, u), ops.PAD_ID, np.int32)
    for dev in range(n):
        for s in range(n):
            used = r.integers(0, min(u, rows) + 1)
            ids = np.sort(r.choice(rows, used, replace=False))
            uids[dev, s, :used] = r.permutation(ids) if shuffled else ids
    puniq = r.integers(0, u + 1, size=(n, n, p)).astype(np.int32)  # u: out of range
    if grouped:
        puniq.sort(axis=-1)
    prows = r.integers(0, num_rows + 1, size=(n, n, p)).astype(np.int32)  # R: padding
    gains = r.standard_normal((n, n, p)).astype(np.float32)
    acts = r.standard_normal((n, num_rows, d)).astype(np.float32)
    return uids, puniq, prows, gains, acts


def update_oracle(tables, slots, uids, puniq, prows, gains, acts, opt):
    """float64: owner s sums, over every device r and pair of r's partition s, gain *
    act_r[row] into the row it names; every asked row is updated once by `opt`'s rule
    (the numpy one of optimizer_reference, at step 0)."""
    n = len(tables)
    new_t, new_s = [], []
    for s in range(n):
        w = tables[s].astype(np.float64)
        sl = {k: v[s].astype(np.float64) for k, v in slots.items()}
        g = np.zeros_like(w)
        asked = set()
        for dev in range(n):
            ids = uids[dev, s]
            asked |= {int(i) for i in ids if i != ops.PAD_ID}
            for q in range(puniq.shape[-1]):
                k, row = puniq[dev, s, q], prows[dev, s, q]
                if 0 <= k < ids.size and ids[k] != ops.PAD_ID and 0 <= row < acts.shape[1]:
                    g[ids[k]] += gains[dev, s, q] * acts[dev, row]
        rows = sorted(asked)
        if rows:
            nw, ns = numpy_update_rows(
                opt, w[rows], {k: v[rows] for k, v in sl.items()}, g[rows], 0
            )
            w[rows] = nw
            for k in sl:
                sl[k][rows] = ns[k]
        new_t.append(w)
        new_s.append(sl)
    return new_t, {k: [x[k] for x in new_s] for k in slots}


def _random_slots(r, opt, n, rows, d):
    """n shards' slots of `opt`: positive random values (valid for every rule)."""
    return {
        k: [r.uniform(0.1, 1.0, (rows, opt.slot_width(k, d))).astype(np.float32) for _ in range(n)]
        for k in opt.slot_names
    }


@needs_kernels
@pytest.mark.parametrize("opt", ALL_FUSED, ids=lambda o: type(o).__name__)
@settings(max_examples=2, deadline=None)
@given(
    **shard_cases([2, 4, 8]),
    grouped=st.booleans(),
    shuffled=st.booleans(),
    keep=st.sampled_from([True, True, False]),
    seed=SEEDS,
)
def test_backward_update_sharded_matches_the_exchange_path(
    opt, n, rows, u, p, num_rows, d, grouped, shuffled, keep, seed
):
    """The fused in-process N-shard backward + update (each owner reads its sources'
    pairs and gradients) against its reference (sums, all_to_all, dedup, update) and a
    float64 oracle; `keep=False` moves nothing."""
    r = np.random.default_rng(seed)
    mesh = mesh_of(n)
    tables = [r.standard_normal((rows, d)).astype(np.float32) for _ in range(n)]
    slots = _random_slots(r, opt, n, rows, d)
    uids, puniq, prows, gains, acts = _sharded_batch(
        r, n, rows, u, p, num_rows, d, grouped, shuffled
    )
    sh = NamedSharding(mesh, P("x"))
    flat = lambda x: jax.device_put(x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), sh)
    args = (flat(uids), flat(acts), flat(prows), flat(puniq), flat(gains))

    def state():
        return (
            jax.device_put(np.concatenate(tables), sh),
            {k: jax.device_put(np.concatenate(v), sh) for k, v in slots.items()},
        )

    def run(in_process):
        def body(t, sl, ui, act, pr, pu, g):
            return ops.backward_update_sharded(
                opt, t, sl, ui, act, pr, pu, g, keep, 0, ops.Transport("x", n, in_process)
            )

        fn = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("x"),) * 7, out_specs=P("x"), check_vma=False
            )
        )
        t, sl = fn(*state(), *args)
        return fn, np.asarray(t), {k: np.asarray(v) for k, v in sl.items()}

    fused_fn, t_fused, s_fused = run(True)
    kind = opt.fused_kernel
    assert f"embedmesh_backward_{kind}_from_sources" in fused_fn.lower(*state(), *args).as_text()
    _, t_ref, s_ref = run(False)
    np.testing.assert_allclose(t_fused, t_ref, rtol=2e-6, atol=2e-6)
    for k in slots:
        np.testing.assert_allclose(s_fused[k], s_ref[k], rtol=2e-6, atol=2e-6)
    if keep:
        want_t, want_s = update_oracle(tables, slots, uids, puniq, prows, gains, acts, opt)
    else:
        want_t, want_s = tables, slots
    np.testing.assert_allclose(t_fused, np.concatenate(want_t), rtol=1e-4, atol=1e-5)
    for k in slots:
        np.testing.assert_allclose(s_fused[k], np.concatenate(want_s[k]), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("opt", ALL_FUSED, ids=lambda o: type(o).__name__)
@settings(max_examples=1, deadline=None)
@given(
    **shard_cases([2, 4]),
    grouped=st.booleans(),
    keep=st.just(True),  # keep=False: the multi-process cases (host_exchange_worker)
    seed=SEEDS,
)
# one drawn example is Hypothesis's simplest (no pairs: nothing to update); this one
# updates rows from every device's partition
@example(n=4, rows=37, u=9, p=30, num_rows=6, d=8, grouped=True, keep=True, seed=11)
def test_replicated_backward_update_matches_the_gather_path(
    opt, n, rows, u, p, num_rows, d, grouped, keep, seed
):
    """`backward_update_sharded(replicated=True)`: every device holds a replica and
    sends its one partition; the fused kernel (each replica reads every device's batch
    in place) against its reference (per-id sums, one all-gathered message, merge,
    update) and a float64 oracle over the global batch; the replicas stay bitwise
    equal; `keep=False` moves nothing."""
    r = np.random.default_rng(seed)
    mesh = mesh_of(n)
    table = r.standard_normal((rows, d)).astype(np.float32)
    slot = {k: v[0] for k, v in _random_slots(r, opt, 1, rows, d).items()}
    uids, puniq, prows, gains, acts = _sharded_batch(r, n, rows, u, p, num_rows, d, grouped, False)
    # one partition a device: its partition 0
    uids, puniq, prows, gains = (x[:, :1] for x in (uids, puniq, prows, gains))
    sh = NamedSharding(mesh, P("x"))
    flat = lambda x: jax.device_put(x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), sh)
    args = (flat(uids), flat(acts), flat(prows), flat(puniq), flat(gains))

    def run(in_process):
        def body(t, sl, ui, act, pr, pu, g):
            return ops.backward_update_sharded(
                opt, t, sl, ui, act, pr, pu, g, keep, 0,
                ops.Transport("x", n, in_process, channel="test/replicated"), replicated=True,
            )  # fmt: skip

        fn = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("x"),) * 7, out_specs=P("x"), check_vma=False
            )
        )
        state = (
            jax.device_put(np.concatenate([table] * n), sh),
            {k: jax.device_put(np.concatenate([v] * n), sh) for k, v in slot.items()},
        )
        lowered = fn.lower(*state, *args).as_text()
        t, sl = fn(*state, *args)
        return (
            lowered,
            np.asarray(t).reshape(n, rows, d),
            {k: np.asarray(v).reshape((n,) + slot[k].shape) for k, v in sl.items()},
        )

    text, t_fused, s_fused = run(True)
    assert f"embedmesh_backward_{opt.fused_kernel}_from_sources" in text
    _, t_ref, s_ref = run(False)
    for j in range(n):  # bitwise equal replicas
        np.testing.assert_array_equal(t_fused[j], t_fused[0])
        for k in slot:
            np.testing.assert_array_equal(s_fused[k][j], s_fused[k][0])
    np.testing.assert_allclose(t_fused, t_ref, rtol=2e-6, atol=2e-6)
    for k in slot:
        np.testing.assert_allclose(s_fused[k], s_ref[k], rtol=2e-6, atol=2e-6)
    if keep:  # the oracle of one owner holding every row, each device a source
        # owner 0 of n: partition 0 is every device's batch, the others empty (PAD)
        def widen(x, fill):
            out = np.full((n, n) + x.shape[2:], fill, x.dtype)
            out[:, :1] = x
            return out

        want_t, want_s = update_oracle(
            [table] * n,
            {k: [v] * n for k, v in slot.items()},
            widen(uids, ops.PAD_ID),
            widen(puniq, 0),
            widen(prows, 0),
            widen(gains, 0),
            acts,
            opt,
        )
        want_s = {k: v[0] for k, v in want_s.items()}
    else:
        want_t, want_s = [table], slot
    np.testing.assert_allclose(t_fused[0], want_t[0], rtol=1e-4, atol=1e-5)
    for k in slot:
        np.testing.assert_allclose(s_fused[k][0], want_s[k], rtol=1e-4, atol=1e-5)
