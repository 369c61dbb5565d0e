"""The planner's per-device memory: the state plus the step's own bytes, against what XLA
compiles.

One small `MeshEmbedding` on the 8 CPU devices holds a stack of every multi-device form
(row-wise rows, row-wise pooled, table-wise, data-parallel); its step programs (the
lookup, the update) are compiled and their `memory_analysis()` read per device. The
terms that do not depend on the platform are checked exactly: a program's arguments are
the state, the batch and (the update's) the activations' gradients and the lookup's
view; the lookup's outputs are the activations and that view. The temporaries are the
platform's: on CPU the in-process kernels read each other's memory, so no exchange
buffer exists and the compiled step stays under the estimate, which counts a TPU's (the
on-chip check of the whole figure is `tests/device/test_tpu_topologies.py`).
"""

import jax
import numpy as np
import pytest

import embedmesh as em
from embedmesh.layout import planner
from embedmesh.layout.step_memory import (
    StackShape,
    estimated_shapes,
    shapes_from_csr,
    step_memory,
    table_loads,
)

BATCH = 64  # 8 samples a device
STRATEGIES = {"a": "mod", "b": "row_wise_pooled", "c": "table_wise", "d": "data_parallel"}


def _model():
    tables = [
        em.TableConfig(2048, 32, combiner="sum", name="a"),
        em.TableConfig(1024, 16, combiner="mean", name="b"),
        em.TableConfig(512, 24, combiner="sum", name="c"),
        em.TableConfig(256, 8, combiner="sqrtn", name="d"),
    ]
    fc = {t.name: em.FeatureConfig(t, name=t.name) for t in tables}
    rng = np.random.default_rng(3)
    lengths = {"a": 3, "b": 5, "c": 2, "d": 4}
    features = {
        t.name: em.RaggedTensor.from_row_lengths(
            rng.integers(0, t.vocabulary_size, BATCH * lengths[t.name]).astype(np.int32),
            np.full(BATCH, lengths[t.name]),
        )
        for t in tables
    }
    return fc, features


def _per_device(mem) -> dict:
    return {
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
    }


def _leaf_bytes(tree, n: int) -> int:
    """Bytes one device holds of `tree`'s arrays sharded over `n` devices on axis 0."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize // n for x in jax.tree.leaves(tree))


def test_compiled_step_within_the_estimate():
    fc, features = _model()
    emb = em.MeshEmbedding(fc, em.Adagrad(learning_rate=0.1), sharding=STRATEGIES, batch_size=BATCH)
    csr = emb.enqueue(features)
    job, state = emb.job, emb.state
    plan, n = emb.plan, job.core.mesh.size
    assert n == 8
    exchanges = {t: planner.STRATEGY_FORMS[s][1] for t, s in STRATEGIES.items()}
    shapes = shapes_from_csr(plan, csr)
    est = step_memory(plan, exchanges, shapes)
    # the state term is the plan's, and what the built arrays hold
    assert est.state == max(plan.bytes_per_device) == max(plan.measured_bytes_per_device)
    # the batch term: the placed arrays' bytes a device (the counts stay on the host)
    placed = {k: (c.unique_ids, c.pair_rows, c.pair_unique, c.pair_gains) for k, c in csr.items()}
    assert est.batch == _leaf_bytes(placed, n)

    programs = job.programs
    acts, view = jax.eval_shape(programs.lookup, state, csr)
    assert est.activations == est.gradients == _leaf_bytes(acts, n)
    view_bytes = _leaf_bytes(view, n)  # the pooled stack's pairs, kept for its update
    # the update program (the larger of the step's two; one compile keeps the test cheap)
    grads = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), acts
    )
    m = _per_device(programs.apply.lower(state, grads, csr, view).compile().memory_analysis())
    scalars = 128  # the step counter, the flags: a few scalars a program
    # its arguments: the state, the gradients, the view, the batch (less the pooled
    # stack's pairs, which its update reads from the view: XLA leaves them out)
    least = est.state + est.gradients + view_bytes
    assert least <= m["argument"] <= least + est.batch + scalars
    assert m["output"] - m["alias"] <= scalars  # the state, updated in place
    assert m["argument"] + m["output"] - m["alias"] + m["temp"] <= est.total
    # and the plan's summary says both, the state and the step (from the planned batch)
    text = plan.describe()
    assert "state" in text and "step" in text and plan.step_memory is not None


def _shape(u, p, rows, dim, fed=None):
    return StackShape(u, p, ((rows, dim),), fed if fed is not None else rows)


def test_terms_from_shapes():
    """Each term from the shapes by hand (the module's formulas written out): a stack of
    dim 32 with Adagrad's slot apart (a row of 64 columns) on 4 devices, for each
    exchange form, a replica, one device, and rows laid out in 128 lanes."""
    fc = {"a": em.FeatureConfig(em.TableConfig(1000, 32, combiner="sum", name="a"))}
    resolved = em.config.resolve_feature_config(fc)
    u, p, r, d, w, n, fed = 24, 48, 16, 32, 64, 4, 16

    def got(strategy, devices=n, **kw):
        plan = planner.stacking_for(
            resolved, devices, {"a": strategy}, default_optimizer=em.Adagrad(0.1)
        )
        (stack,) = plan.stacks
        form = planner.STRATEGY_FORMS[strategy][1]
        return step_memory(plan, {"a": form}, {stack.name: _shape(u, p, r, d, fed)}, **kw)

    rows = got("mod")
    assert rows.state == 250 * (32 + 32) * 4
    assert rows.batch == 4 * n * (u + 3 * p)
    assert rows.activations == rows.gradients == 4 * r * d
    lookup = 2 * 4 * n * u + 2 * 4 * n * u * d
    update = 2 * 4 * n * u * d + 4 * n * u * w
    assert rows.temporaries == max(lookup, update) and "update" in rows.phase
    assert rows.total == rows.state + rows.batch + 2 * 4 * r * d + rows.temporaries
    assert got("mod", batches=2).batch == 2 * rows.batch  # pipelined: two batches
    wide = got("mod", lanes=128)  # [U, 32] and [U, 64] blocks take [U, 128]
    assert wide.temporaries == max(2 * 4 * n * u + 2 * 4 * n * u * 128, 3 * 4 * n * u * 128)

    partials = 4 * n * fed * d  # a pair: 2 words (its slot and row in one, its gain)
    pooled = got("row_wise_pooled")
    lookup = 2 * 4 * n * (u + 2 * p) + 2 * partials
    update = 2 * partials + 2 * 4 * n * u * d + 4 * n * u * w
    assert pooled.temporaries == max(lookup, update)

    replica = got("data_parallel")
    update = 4 * u * (1 + d) + 4 * n * u * (1 + d) + 4 * n * u * d + 4 * n * u * w
    assert replica.temporaries == max(4 * u * d, update)
    assert replica.state == 1000 * (32 + 32) * 4

    one = got("mod", devices=1)
    assert one.batch == 4 * (u + 3 * p)
    assert one.temporaries == 2 * 4 * u * d + 4 * u * w


def test_planner_counts_the_step():
    """The memory rule takes the state and the step: a limit between the state and the
    whole figure refuses the plan, naming the bytes; the estimate from the statistics
    holds the batch the plan is made for (its capacities cover a partition's ids)."""
    fc, _ = _model()
    resolved = em.config.resolve_feature_config(fc)
    opts = dict(default_optimizer=em.Adagrad(0.1))
    plan = planner.stacking_for(resolved, 8, STRATEGIES, **opts)
    stats = planner.table_stats(resolved, {t: em.Adagrad(0.1) for t in STRATEGIES})
    full = planner.step_memory_for(plan, STRATEGIES, stats, 512)
    assert full.state == max(plan.bytes_per_device) and full.step > 0
    with_step = planner.layout_memory(resolved, 8, stats=stats, batch_per_device=512, **opts)
    state_only = planner.layout_memory(resolved, 8, **opts)
    assert max(with_step(STRATEGIES)) == full.total
    assert max(state_only(STRATEGIES)) == full.state
    shapes = estimated_shapes(plan, table_loads(stats, 512), 512)
    # one id a sample (no batch seen): a mod table's 512 ids over 8 shards, 64 a partition
    assert shapes[plan.table("a").stack].pairs >= 64
    machine = planner.machine_for(jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",)), True)
    limit = full.state + full.step / 2
    with pytest.raises(ValueError, match="memory limit"):
        planner.plan(stats, STRATEGIES, 8, 512, machine, memory_limit=limit, memory_of=with_step)
    planner.plan(stats, STRATEGIES, 8, 512, machine, memory_limit=limit, memory_of=state_only)
