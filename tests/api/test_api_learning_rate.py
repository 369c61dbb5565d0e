"""Item 8: TF's zero-argument learning-rate callables and step schedules both work."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import embedmesh as em
from embedmesh import FeatureConfig, TableConfig
from embedmesh.facade import MeshEmbedding

OPTS = {
    "SGD": em.SGD,
    "Adagrad": em.Adagrad,
    "AdagradMomentum": em.AdagradMomentum,
    "Adam": em.Adam,
    "FTRL": em.FTRL,
}


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTS)),
    lr=st.floats(0.01, 2.0),
    seed=st.integers(0, 99),
    step=st.integers(0, 5),
)
def test_callable_forms_match_the_constant(name, lr, seed, step):
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(5, 3)).astype(np.float32)
    grads = rng.normal(size=(5, 3)).astype(np.float32)
    const = OPTS[name](learning_rate=lr)
    slots = {k: np.full((5, 3), v, np.float32) for k, v in const.slot_initial_values.items()}
    want = const.update_rows(rows, slots, grads, step)

    def jitted(opt):  # under jit the zero-argument form runs as a host callback
        return jax.jit(lambda r, s, g: opt.update_rows(r, s, g, step))(rows, slots, grads)

    want_jit = jitted(const)
    for form in (lambda: lr, lambda count: lr * jnp.ones((), jnp.float32)):
        opt = OPTS[name](learning_rate=form)
        # eagerly bit-identical; under jit XLA folds a constant lr into the
        # arithmetic (e.g. FTRL's w / lr), an opaque one not: 1-ulp differences
        for got, ref, tol in (
            (opt.update_rows(rows, slots, grads, step), want, 0),
            (jitted(opt), want_jit, 1e-6),
        ):
            np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=tol, atol=tol)
            for k in ref[1]:
                np.testing.assert_allclose(
                    np.asarray(got[1][k]), np.asarray(ref[1][k]), rtol=tol, atol=tol
                )


def test_bad_callables_are_value_errors_at_construction():
    with pytest.raises(ValueError, match="learning_rate"):
        em.SGD(learning_rate=lambda a, b: 0.1)
    with pytest.raises(ValueError, match="learning_rate"):
        em.Adagrad(learning_rate=lambda *, k: 0.1)
    em.SGD(learning_rate=lambda x=3: 0.1)  # no required argument: zero-argument form
    em.SGD(learning_rate=functools.partial(lambda a, step: a * step, 0.5))  # schedule


def _train(opt, lrs_seen, steps=3):
    """SGD, sum combiner, one id per sample: each step row i -= lr * (count of i)."""
    t = TableConfig(6, 2, combiner="sum", name="t", initializer=jax.nn.initializers.zeros)
    feats = {"f": FeatureConfig(t)}
    emb = MeshEmbedding(feats, opt, mesh=Mesh(np.array(jax.devices()[:2]), ("x",)))
    emb.build()
    ids = np.array([0, 1, 1, 3])
    counts = np.bincount(ids, minlength=6)[:, None].astype(np.float32)
    want = np.zeros((6, 2), np.float32)
    for s in range(steps):
        acts, pre = emb({"f": ids})
        emb.apply_gradients({"f": jnp.ones((4, 2))}, pre)
        want = want - np.float32(lrs_seen(s)) * counts
        np.testing.assert_allclose(emb.embedding_tables[t], want, rtol=1e-6)


def test_zero_argument_callable_trains_with_the_current_value():
    cell = {"lr": 0.1}

    def current_lr():
        return cell["lr"]

    opt = em.SGD(learning_rate=current_lr)
    values = [0.1, 0.5, 0.25]

    def lr_of_step(s):
        cell["lr"] = values[s]  # changed before each step, read by the update
        return values[s]

    _train(opt, lr_of_step)


def test_step_schedule_trains_with_the_step():
    opt = em.SGD(learning_rate=lambda count: 0.1 * (count + 1).astype(jnp.float32))
    _train(opt, lambda s: 0.1 * (s + 1))
