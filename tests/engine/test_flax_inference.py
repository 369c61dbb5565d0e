"""Evaluation in the flax modules: nnx's `model.eval()` / `nnx.view(deterministic=True)`
and linen's `deterministic` give the facade's `training=False` activations (every table
kind of tests/engine/test_inference_mode.py, a full table of raw ids read without
admitting), pipelined or not, and change no variable; a batch made for evaluation is
refused by `apply_gradients`."""

import jax
import numpy as np
import pytest
from test_inference_mode import NEW_IDS, POOL, batch_of, grad_of, new_layer, reference

pytest.importorskip("flax")
from flax import nnx
from test_flax import linen_train_step

from embedmesh.flax import linen as em_linen
from embedmesh.flax import nnx as em_nnx


def make(n: int, pipelined: bool):
    return new_layer(n, pipelined)


@nnx.jit
def nnx_step(embed, csr):
    csr = embed.map_ids(csr)
    acts = embed(csr)
    embed.apply_gradients(grad_of(acts), csr)
    return acts


def leaves(tree) -> list:
    return [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(tree)]


def assert_leaves_identical(got: list, want: list) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(
            np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8)
        )


def assert_close(got, want, what: str) -> None:
    for k in want:
        np.testing.assert_allclose(
            np.asarray(got[k], np.float64), want[k], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {k}"
        )


@pytest.mark.parametrize("n,pipelined", [(1, False), (2, True)])
def test_modules_evaluate_as_the_facade(n, pipelined):
    rng = np.random.default_rng(21 + n)
    data = [batch_of(rng) for _ in range(3)]
    evals = [batch_of(rng, np.concatenate([POOL, NEW_IDS])) for _ in range(2)]

    emb, fc = make(n, pipelined)
    tables = None
    for i, (x, w) in enumerate(data):
        acts, pre = emb(x, w)
        if i == len(data) - 1:  # what the next training lookup reads (pipelined)
            tables = emb.embedding_tables
        emb.apply_gradients(grad_of(acts), pre)
    if not pipelined:
        tables = emb.embedding_tables
    want = [jax.tree_util.tree_map(np.asarray, emb(x, w, training=False)[0]) for x, w in evals]
    for (x, w), y in zip(evals, want):  # (the facade's eval: tests/engine/test_inference_mode.py)
        assert_close(y, reference(x, w, tables, fc), "facade")

    # nnx: model.eval(), a per-call flag, nnx.view; eager and jitted; with and without map_ids
    embed = em_nnx.Embed(make(n, pipelined)[0])
    for x, w in data:
        nnx_step(embed, embed.enqueue(x, w))
    assert (embed.pending is not None) == pipelined
    before, pending = leaves(nnx.state(embed, em_nnx.EmbeddingVariable)), embed.pending
    view = nnx.view(embed, deterministic=True)
    assert view.deterministic and not embed.deterministic
    jitted = nnx.jit(lambda e, c: e(c))
    # the jitted forms on both evaluation batches; the eager ones (each eager call traces
    # and compiles its programs anew) on one each, every form meeting an evaluation
    (x0, w0), (x1, w1) = evals
    assert_close(embed(embed.enqueue(x0, w0), deterministic=True), want[0], "nnx, per call")
    for (x, w), y in zip(evals, want):
        assert_close(jitted(view, view.enqueue(x, w)), y, "nnx.view, jitted")
    embed.eval()
    assert embed.deterministic
    # (enqueue: the module's mode, for evaluation)
    assert_close(embed(embed.enqueue(x1, w1)), want[1], "nnx eval()")
    assert_close(embed(embed.map_ids(embed.enqueue(x0, w0))), want[0], "nnx eval(), map_ids first")
    assert_leaves_identical(leaves(nnx.state(embed, em_nnx.EmbeddingVariable)), before)
    assert embed.pending is pending
    with pytest.raises(ValueError, match="training=False"):
        embed.apply_gradients(grad_of(want[0]), embed.map_ids(embed.enqueue(*evals[0])))
    assert_leaves_identical(leaves(nnx.state(embed, em_nnx.EmbeddingVariable)), before)
    embed.train()
    assert not embed.deterministic

    # linen: deterministic as a call argument or a module attribute, no mutable needed
    lin = em_linen.Embed(make(n, pipelined)[0])
    variables = lin.init(jax.random.key(0), lin.enqueue(*data[0]))

    linen_step = linen_train_step(lin)
    for x, w in data:
        variables, _ = linen_step(variables, lin.enqueue(x, w))
    before = leaves(variables)
    lin_eval = em_linen.Embed(lin.embedding, deterministic=True)
    evaluate = jax.jit(lambda v, c: lin.apply(v, c, deterministic=True))
    for (x, w), y in zip(evals, want):
        assert_close(evaluate(variables, lin.enqueue(x, w)), y, "linen, jitted")
    assert_close(lin.apply(variables, lin.enqueue(x0, w0), deterministic=True), want[0], "linen")
    assert_close(lin.apply(variables, lin.enqueue(x1, w1, training=False)), want[1], "linen, batch")
    got, changed = lin_eval.apply(variables, lin_eval.enqueue(x1, w1), mutable=["embedding"])
    assert_close(got, want[1], "linen, attribute")
    assert_leaves_identical(leaves(changed), before)
    assert_leaves_identical(leaves(variables), before)
    csr = lin.apply(variables, lin.enqueue(*evals[0]), method="map_ids", deterministic=True)
    with pytest.raises(ValueError, match="training=False"):
        lin.apply(variables, grad_of(want[0]), csr, method="apply_gradients", mutable=True)
