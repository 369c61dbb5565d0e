"""The CPU kernels' one transport interface (`ops/cpu/transport.h`): the pooled ops fused
with their exchange, written once over it, run between in-process devices too, and give
exactly what the references (pack / partials / backward, then `ops.exchange`) give."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from optimizer_reference import ALL_FUSED, numpy_update_rows

from embedmesh import _runtime
from embedmesh.device import ops
from embedmesh.device.ops import cpu
from embedmesh.device.ops.cpu import kernels as cpu_kernels

needs_kernels = pytest.mark.skipif(
    not cpu.ready(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}"
)
PAD = ops.PAD_ID
U, P_PAIRS, WIDTH, ROWS, D = 6, 40, 7, 30, 5


def source_batch(r, n, compacted):
    """One device's batch for its n owners: ascending distinct ids (PAD padded), pairs
    whose positions and rows are sometimes out of range, a compact map or none."""
    ids = np.full((n, U), PAD, np.int32)
    for o in range(n):
        used = int(r.integers(0, U + 1))
        ids[o, :used] = np.sort(r.choice(ROWS + 3, used, replace=False))  # some past ROWS
    pair_rows = r.integers(-1, WIDTH + 2, (n, P_PAIRS)).astype(np.int32)
    pair_unique = r.integers(-1, U + 2, (n, P_PAIRS)).astype(np.int32)
    gains = r.standard_normal((n, P_PAIRS)).astype(np.float32)
    compact = np.zeros((n, 0), np.int32)
    if compacted:
        compact = np.full((n, WIDTH + 3), WIDTH, np.int32)
        for o in range(n):
            fed = r.choice(WIDTH + 2, WIDTH, replace=False)
            compact[o, fed] = np.arange(WIDTH)
    return ids, pair_rows, pair_unique, gains, compact


def per_device(fn, mesh, n_in):
    spec = P("x")
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec, check_vma=False)
    )


@needs_kernels
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("compacted", [False, True])
def test_in_process_pooled_exchanges_match_their_references(n, compacted):
    r = np.random.default_rng(n * 10 + compacted)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    transport = ops.Transport("x", n, in_process=True, channel="pooled")
    batches = [source_batch(r, n, compacted) for _ in range(n)]
    batch = [jnp.asarray(np.concatenate([b[i] for b in batches])) for i in range(5)]
    assert (
        ops.kernel_for("exchange_pooled_pairs", "cpu", *batch, width=WIDTH, transport=transport)
        is cpu_kernels.exchange_pooled_pairs
    )

    def pairs(kernel):
        return per_device(lambda *a: kernel(*a, width=WIDTH, transport=transport), mesh, 5)

    kernel = pairs(cpu_kernels.exchange_pooled_pairs)
    assert "embedmesh_exchange_pooled_pairs" in kernel.lower(*batch).as_text()
    served = kernel(*batch)
    want = pairs(ops.reference_of("exchange_pooled_pairs"))(*batch)
    np.testing.assert_array_equal(np.asarray(served), np.asarray(want))

    table = jnp.asarray(r.standard_normal((n * ROWS, D)).astype(np.float32))
    params = dict(unique_capacity=U, width=WIDTH, transport=transport)

    def partials(kernel):
        return per_device(lambda t, s: kernel(t, s, **params), mesh, 2)

    got = partials(cpu_kernels.exchange_pooled_partials)(table, served)
    want = partials(ops.reference_of("exchange_pooled_partials"))(table, served)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def grouped_by_slot(batch):
    """`batch` (source_batch's) with each owner's pairs in ascending slot order (stable):
    the order the owner groups without per-slot sums."""
    ids, pair_rows, pair_unique, gains, compact = batch
    order = np.argsort(pair_unique, axis=1, kind="stable")
    take = lambda x: np.take_along_axis(x, order, axis=1)
    return ids, take(pair_rows), take(pair_unique), take(gains), compact


# A pairwise covering set of optimizer x keep x grouped: each optimizer with each `keep`
# and each order, each (keep, order) pair met.
BACKWARD_CASES = [
    pytest.param(
        opt,
        keep,
        grouped,
        id=f"{'some-grouped' if grouped else 'any-order'}-{keep}-{type(opt).__name__}",
    )
    for i, opt in enumerate(ALL_FUSED[:3])
    for keep, grouped in ((True, i % 2 == 1), (False, i % 2 == 0))
]


@needs_kernels
@pytest.mark.parametrize("opt, keep, grouped", BACKWARD_CASES)
def test_in_process_pooled_backward_update_matches_its_reference(opt, keep, grouped):
    # some-grouped: sources 0 and 2 send their pairs in slot order (grouped while the peers
    # arrive), 1 and 3 in any order (summed per slot once the gradients are there)
    n = 4
    r = np.random.default_rng(7)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    transport = ops.Transport("x", n, in_process=True, channel="pooled")
    batches = [source_batch(r, n, False) for _ in range(n)]
    if grouped:
        batches = [grouped_by_slot(b) if i % 2 == 0 else b for i, b in enumerate(batches)]
    batch = [jnp.asarray(np.concatenate([b[i] for b in batches])) for i in range(5)]
    served = per_device(
        lambda *a: ops.reference_of("exchange_pooled_pairs")(*a, width=WIDTH, transport=transport),
        mesh,
        5,
    )(*batch)
    assert served.shape[1] == U + P_PAIRS * _runtime.pooled_pair_fields(U, WIDTH)
    table = jnp.asarray(r.standard_normal((n * ROWS, D)).astype(np.float32))
    slots = {
        k: jnp.asarray((0.1 + r.random((n * ROWS, opt.slot_width(k, D)))).astype(np.float32))
        for k in opt.slot_names
    }
    grads = jnp.asarray(r.standard_normal((n * n, WIDTH, D)).astype(np.float32))
    keeps = jnp.full((n,), keep)
    params = dict(optimizer=opt, step=jnp.int32(3), unique_capacity=U, width=WIDTH)

    def update(kernel):
        def body(t, s, m, g, k):
            return kernel(t, s, m, g, k[0], **params, transport=transport)

        spec = P("x")
        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(spec, {k: spec for k in slots}, spec, spec, spec),
                out_specs=(spec, {k: spec for k in slots}),
                check_vma=False,
            )
        )

    fused = update(cpu_kernels.exchange_pooled_backward_update)
    text = fused.lower(table, slots, served, grads, keeps).as_text()
    assert f"embedmesh_exchange_pooled_backward_{opt.fused_kernel}" in text
    got = fused(table, slots, served, grads, keeps)
    want = update(ops.reference_of("exchange_pooled_backward_update"))(
        table, slots, served, grads, keeps
    )
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if not keep:  # a rejected step moves no row
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(table))


def _custom_calls(hlo: str):
    """(name, target, operand names) of each custom call of a compiled program's text."""
    calls = []
    for line in hlo.splitlines():
        m = re.search(r"%(\S+) = .*? custom-call\(([^)]*)\).*custom_call_target=\"(\w+)\"", line)
        if m:
            operands = [o.strip().lstrip("%") for o in m.group(2).split(",")]
            calls.append((m.group(1), m.group(3), operands))
    return calls


@needs_kernels
@pytest.mark.parametrize("n", [2, 4])
def test_independent_exchanges_of_one_program_run_in_trace_order(n):
    """Two exchanges that share no data, in one program: the second one's rank comes
    through `embedmesh_after`, which reads the first one's output, so every device runs
    them in the order they were traced (XLA's CPU runtime runs ready work as it comes:
    without the chain a device could block in one while its peer blocks in the other,
    until the 60 s timeout). Both still exchange exactly what the reference does."""
    r = np.random.default_rng(n)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    transport = ops.Transport("x", n, in_process=True, channel="order")
    a = jnp.asarray(r.standard_normal((n * n * 3, 2)).astype(np.float32))
    b = jnp.asarray(r.integers(-9, 9, (n * n * 5,)).astype(np.int32))

    def two(exchange):
        return per_device(
            lambda x, y: (exchange(x, transport.at("a")), exchange(y, transport.at("b"))),
            mesh,
            2,
        )

    program = two(ops.exchange)
    calls = _custom_calls(program.lower(a, b).compile().as_text())
    assert [c[1] for c in calls] == ["embedmesh_exchange", "embedmesh_after", "embedmesh_exchange"]
    (first, _, _), (order, _, order_reads), (_, _, second_reads) = calls
    assert order_reads[1] == first  # waits for the first exchange's output
    assert second_reads[-1] == order  # the rank argument
    got = program(a, b)
    want = two(lambda x, t: ops.reference_of("exchange")(x, transport=t))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def numpy_pooled_backward(opt, table, slots, batches, grads, n, step):
    """The owners' fused backward + update in float64 numpy: grads[s][o] [WIDTH, D] the
    gradients source s sends owner o; each owner updates every distinct id of its shard
    (ROWS rows) that a source asked for, with the sum of gain * gradient row over every
    source's valid pairs of it (zero where none)."""
    table = np.asarray(table, np.float64).copy()
    slots = {k: np.asarray(v, np.float64).copy() for k, v in slots.items()}
    for o in range(n):
        sums: dict = {}
        for s, (ids, pair_rows, pair_unique, gains, _) in enumerate(batches):
            for i in ids[o]:
                if i != PAD and 0 <= i < ROWS:
                    sums.setdefault(int(i), np.zeros(D))
            for q in range(P_PAIRS):
                row, pos = pair_rows[o, q], pair_unique[o, q]
                if not (0 <= row < WIDTH and 0 <= pos < U):
                    continue
                i = int(ids[o, pos])
                if i == PAD or not 0 <= i < ROWS:
                    continue
                sums[i] = sums[i] + float(gains[o, q]) * np.asarray(grads[s][o][row], np.float64)
        if not sums:
            continue
        rows = o * ROWS + np.array(sorted(sums))
        g = np.stack([sums[i] for i in sorted(sums)])
        state = {k: v[rows] for k, v in slots.items()}
        new_rows, new_slots = numpy_update_rows(opt, table[rows], state, g, step)
        table[rows] = new_rows
        for k, v in new_slots.items():
            slots[k][rows] = v
    return table, slots


@needs_kernels
@pytest.mark.parametrize("opt", ALL_FUSED[:2], ids=lambda o: type(o).__name__)
def test_in_process_pooled_backward_reads_gradient_parts_in_place(opt):
    """`blocks`: each source's gradients as parts of rows (segments at offsets, several
    in one block, one part in two owners' blocks, zero rows past a block's), read where
    they are: the float64 rule, and bit for bit the concatenated blocks' kernel."""
    n = 4
    r = np.random.default_rng(11)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    transport = ops.Transport("x", n, in_process=True, channel="pooled")
    batches = [grouped_by_slot(source_batch(r, n, False)) for _ in range(n)]
    batch = [jnp.asarray(np.concatenate([b[i] for b in batches])) for i in range(5)]
    served = per_device(
        lambda *a: ops.reference_of("exchange_pooled_pairs")(*a, width=WIDTH, transport=transport),
        mesh,
        5,
    )(*batch)
    table = jnp.asarray(r.standard_normal((n * ROWS, D)).astype(np.float32))
    slots = {
        k: jnp.asarray((0.1 + r.random((n * ROWS, opt.slot_width(k, D)))).astype(np.float32))
        for k in opt.slot_names
    }
    # parts [9, D] and [4, D] of each source; block o: the segments below (WIDTH = 7 rows)
    blocks = (
        ((0, 0, 3), (1, 1, 3)),  # 6 rows, 1 zero row
        ((0, 3, 6), (1, 0, 1)),  # 7 rows
        ((1, 0, 4),),  # 4 rows, 3 zero rows
        (),  # none: all zeros
    )
    a = jnp.asarray(r.standard_normal((n * 9, D)).astype(np.float32))
    b = jnp.asarray(r.standard_normal((n * 4, D)).astype(np.float32))
    as_blocks = np.zeros((n, n, WIDTH, D), np.float32)  # [source, owner]
    for s in range(n):
        parts = (np.asarray(a)[s * 9 : (s + 1) * 9], np.asarray(b)[s * 4 : (s + 1) * 4])
        for o, segs in enumerate(blocks):
            rows = [parts[p][f : f + c] for p, f, c in segs]
            if rows:
                got = np.concatenate(rows)
                as_blocks[s, o, : len(got)] = got
    params = dict(optimizer=opt, step=jnp.int32(3), unique_capacity=U, width=WIDTH)
    spec = P("x")

    def update(body, n_grads):
        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(spec, {k: spec for k in slots}, spec) + (spec,) * n_grads,
                out_specs=(spec, {k: spec for k in slots}),
                check_vma=False,
            )
        )

    def with_parts(t, s, m, pa, pb):
        return ops.exchange_pooled_backward_update(
            opt, t, s, m, (pa, pb), True, 3, unique_capacity=U, width=WIDTH,
            transport=transport, blocks=blocks,
        )  # fmt: skip

    fn = update(with_parts, 2)
    assert (
        f"embedmesh_exchange_pooled_backward_{opt.fused_kernel}"
        in fn.lower(table, slots, served, a, b).as_text()
    )
    got = fn(table, slots, served, a, b)
    concatenated = update(
        lambda t, s, m, g: cpu_kernels.exchange_pooled_backward_update(
            t, s, m, g, jnp.asarray(True), **params, transport=transport
        ),
        1,
    )(table, slots, served, jnp.asarray(as_blocks.reshape(n * n, WIDTH, D)))
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(concatenated)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    want_t, want_s = numpy_pooled_backward(opt, table, slots, batches, as_blocks, n, 3)
    np.testing.assert_allclose(np.asarray(got[0]), want_t, rtol=2e-5, atol=2e-6)
    assert not np.array_equal(np.asarray(got[0]), np.asarray(table))  # some rows moved
    for k in slots:
        np.testing.assert_allclose(np.asarray(got[1][k]), want_s[k], rtol=2e-5, atol=2e-6)


def test_pooled_backward_blocks_out_of_the_parts_are_refused():
    parts = (jnp.zeros((3, D)),)
    with pytest.raises(ValueError, match=r"block 1's segment \(part 0, first 2, count 2\)"):
        ops.exchange_pooled_backward_update(
            ALL_FUSED[0], jnp.zeros((ROWS, D)), {}, jnp.zeros((1, 9), jnp.int32), parts,
            True, 0, unique_capacity=U, width=WIDTH,
            transport=ops.Transport("x", 1, in_process=True, channel="pooled"),
            blocks=(((0, 0, 3),), ((0, 2, 2),)),
        )  # fmt: skip
    with pytest.raises(ValueError, match="block 0 has 9 rows, over width 7"):
        ops.exchange_pooled_backward_update(
            ALL_FUSED[0], jnp.zeros((ROWS, D)), {}, jnp.zeros((1, 9), jnp.int32), parts,
            True, 0, unique_capacity=U, width=WIDTH,
            transport=ops.Transport("x", 1, in_process=True, channel="pooled"),
            blocks=(((0, 0, 3), (0, 0, 3), (0, 0, 3)),),
        )  # fmt: skip
