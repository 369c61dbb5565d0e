"""Tests for embedmesh.optimizers against an independent float64 reference.

The reference below is deliberately plain (scalar loops over every element)
so that it shares no code or vectorization tricks with the implementation.
Alongside each value it tracks the magnitude of the terms that were summed to
get it; the float32 result is allowed an error proportional to that magnitude
(a forward error bound), which stays tight where there is no cancellation and
does not flake where there is.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh import FTRL, SGD, Adagrad, AdagradMomentum, Adam, Optimizer, RowWiseAdagrad

ALL = [SGD, Adagrad, AdagradMomentum, Adam, FTRL]

# ---------------------------------------------------------------------------
# Float64 reference


def ref_lr(spec, step):
    """The learning rate at `step` from a schedule spec, in float64."""
    kind = spec[0]
    if kind == "const":
        return spec[1]
    if kind == "exp":
        _, init, steps, rate = spec
        return init * rate ** (step / steps)
    if kind == "linear":
        _, init, end, steps = spec
        return init + (end - init) * min(max(step, 0), steps) / steps
    raise AssertionError(kind)


def make_lr(spec):
    """The learning_rate argument (float or optax schedule) for a spec."""
    kind = spec[0]
    if kind == "const":
        return spec[1]
    if kind == "exp":
        _, init, steps, rate = spec
        return optax.exponential_decay(init_value=init, transition_steps=steps, decay_rate=rate)
    _, init, end, steps = spec
    return optax.linear_schedule(init_value=init, end_value=end, transition_steps=steps)


def ref_clip_bounds(clipvalue):
    if clipvalue is None:
        return None, None
    if isinstance(clipvalue, (tuple, list)):
        return clipvalue[0], clipvalue[1]
    return -clipvalue, clipvalue


def ref_rule(name, hp, w, s, g, lr):
    """One element: returns (new_w, w_scale, new_slots, slot_scales)."""
    if name == "SGD":
        return w - lr * g, abs(w) + abs(lr * g), {}, {}
    if name == "Adagrad":
        a = s["accumulators"] + g * g
        upd = lr * g / math.sqrt(a)
        return w - upd, abs(w) + abs(upd), {"accumulators": a}, {"accumulators": a}
    if name == "AdagradMomentum":
        a, m = s["accumulators"], s["momenta"]
        b2 = hp["beta2"]
        a = a + g * g if b2 == 1.0 else b2 * a + (1 - b2) * g * g
        sc = (a + hp["epsilon"]) ** (-1.0 / hp["exponent"]) * g
        mom = hp["momentum"]
        m_scale = abs(mom * m) + abs(sc)
        m = mom * m + sc
        if hp["use_nesterov"]:
            d = mom * m + sc
            d_scale = abs(mom) * m_scale + abs(sc)
        else:
            d, d_scale = m, m_scale
        return (
            w - lr * d,
            abs(w) + lr * d_scale,
            {"accumulators": a, "momenta": m},
            {"accumulators": a, "momenta": m_scale},
        )
    if name == "Adam":
        b1, b2, eps = hp["beta_1"], hp["beta_2"], hp["epsilon"]
        m_scale = abs(b1 * s["momenta"]) + abs((1 - b1) * g)
        m = b1 * s["momenta"] + (1 - b1) * g
        v = b2 * s["velocities"] + (1 - b2) * g * g
        if hp["sum_inside_sqrt"]:
            den = math.sqrt(v + eps * eps)
        else:
            den = math.sqrt(v) + eps
        upd = lr * m / den
        return (
            w - upd,
            abs(w) + lr * m_scale / den,
            {"momenta": m, "velocities": v},
            {"momenta": m_scale, "velocities": v},
        )
    if name == "FTRL":
        q = -hp["learning_rate_power"]
        l1, l2, beta = (
            hp["l1_regularization_strength"],
            hp["l2_regularization_strength"],
            hp["beta"],
        )
        a, lin = s["accumulators"], s["linears"]
        a2 = a + g * g
        p = a2**q
        dp = p - a**q
        if hp["multiply_linear_by_learning_rate"]:
            t = dp * w
            lin_scale = abs(lin) + abs(lr * g) + abs(t) + a**q * abs(w)
            lin = lin + lr * g - t
            bound = lr * l1
            den = p + 2 * lr * l2 + beta
        else:
            t = dp * w / lr
            lin_scale = abs(lin) + abs(g) + abs(t) + a**q * abs(w) / lr
            lin = lin + g - t
            bound = l1
            den = (p + beta) / lr + 2 * l2
        if l1 == 0:
            num = -lin
        else:
            num = min(max(lin, -bound), bound) - lin
        w_new = num / den
        return (
            w_new,
            abs(w_new) + (lin_scale + bound) / den,
            {"accumulators": a2, "linears": lin},
            {"accumulators": a2, "linears": lin_scale},
        )
    raise AssertionError(name)


def ref_update(name, hp, rows, slots, grads, step):
    """Float64 reference of update_rows; returns values and error scales."""
    lr = ref_lr(hp["lr_spec"], step)
    lo, hi = ref_clip_bounds(hp.get("clipvalue"))
    wd = hp.get("weight_decay_factor")
    if wd is not None and hp.get("multiply_weight_decay_factor_by_learning_rate"):
        wd = wd * lr
    wmin, wmax = hp.get("clip_weight_min"), hp.get("clip_weight_max")
    n, dim = rows.shape
    out_w = np.zeros((n, dim))
    out_ws = np.zeros((n, dim))
    out_s = {k: np.zeros((n, dim)) for k in slots}
    out_ss = {k: np.zeros((n, dim)) for k in slots}
    for i in range(n):
        for j in range(dim):
            g = float(grads[i, j])
            if lo is not None:
                g = max(g, lo)
            if hi is not None:
                g = min(g, hi)
            w0 = float(rows[i, j])
            w, ws, s, ss = ref_rule(
                name, hp, w0, {k: float(v[i, j]) for k, v in slots.items()}, g, lr
            )
            if wd is not None:
                w = w - wd * w0
                ws = ws + abs(wd * w0)
            if wmin is not None:
                w = max(w, wmin)
            if wmax is not None:
                w = min(w, wmax)
            out_w[i, j], out_ws[i, j] = w, ws
            for k in slots:
                out_s[k][i, j], out_ss[k][i, j] = s[k], ss[k]
    return out_w, out_ws, out_s, out_ss


def assert_close(actual, expected, scale, rtol, atol, what):
    actual = np.asarray(actual, np.float64)
    err = np.abs(actual - expected)
    tol = rtol * np.maximum(np.abs(expected), scale) + atol
    bad = ~(err <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} mismatches, first at {i}: got "
            f"{actual[i]!r}, expected {expected[i]!r} (scale {scale[i]!r}, "
            f"tol {tol[i]!r})"
        )


# ---------------------------------------------------------------------------
# Hyperparameter strategies

pos = dict(allow_nan=False, allow_infinity=False)

lr_specs = st.one_of(
    st.tuples(st.just("const"), st.floats(1e-3, 0.5, **pos)),
    st.tuples(
        st.just("exp"), st.floats(1e-3, 0.5, **pos), st.integers(1, 50), st.floats(0.5, 1.0, **pos)
    ),
    st.tuples(
        st.just("linear"),
        st.floats(1e-3, 0.5, **pos),
        st.floats(1e-3, 0.5, **pos),
        st.integers(1, 50),
    ),
)


@st.composite
def common_hp(draw):
    hp = {"lr_spec": draw(lr_specs)}
    clip = draw(
        st.one_of(
            st.none(),
            st.floats(0.2, 1.5, **pos),
            st.tuples(
                st.none() | st.floats(-1.5, -0.1, **pos), st.none() | st.floats(0.1, 1.5, **pos)
            ),
        )
    )
    hp["clipvalue"] = clip
    hp["use_gradient_accumulation"] = True if clip is not None else draw(st.booleans())
    hp["clip_weight_min"] = draw(st.none() | st.floats(-1.5, -0.05, **pos))
    hp["clip_weight_max"] = draw(st.none() | st.floats(0.05, 1.5, **pos))
    wd = draw(st.none() | st.floats(0.0, 0.2, **pos))
    hp["weight_decay_factor"] = wd
    hp["multiply_weight_decay_factor_by_learning_rate"] = (
        None if wd is None else draw(st.sampled_from([None, False, True]))
    )
    return hp


SPECIFIC = {
    "SGD": st.fixed_dictionaries({}),
    "Adagrad": st.fixed_dictionaries({"initial_accumulator_value": st.floats(0.01, 1.0, **pos)}),
    "AdagradMomentum": st.fixed_dictionaries(
        {
            "momentum": st.just(0.0) | st.floats(0.0, 0.99, **pos),
            "use_nesterov": st.booleans(),
            "exponent": st.just(2.0) | st.floats(0.5, 4.0, **pos),
            "beta2": st.just(1.0) | st.floats(0.5, 0.999, **pos),
            "epsilon": st.floats(1e-10, 1e-3, **pos),
        }
    ),
    "Adam": st.fixed_dictionaries(
        {
            "beta_1": st.floats(0.0, 0.99, **pos),
            "beta_2": st.floats(0.0, 0.9999, **pos),
            "epsilon": st.floats(1e-8, 1e-2, **pos),
            "lazy_adam": st.booleans(),
            "sum_inside_sqrt": st.booleans(),
        }
    ),
    "FTRL": st.fixed_dictionaries(
        {
            "learning_rate_power": st.sampled_from([-0.5, 0.0, -1.0]) | st.floats(-1.0, 0.0, **pos),
            "l1_regularization_strength": st.just(0.0) | st.floats(1e-3, 1.0, **pos),
            "l2_regularization_strength": st.just(0.0) | st.floats(0.0, 1.0, **pos),
            "beta": st.just(0.0) | st.floats(0.0, 1.0, **pos),
            "initial_accumulator_value": st.floats(0.01, 1.0, **pos),
            "multiply_linear_by_learning_rate": st.booleans(),
            "allow_zero_accumulator": st.booleans(),
        }
    ),
}

CLASSES = {c.__name__: c for c in [*ALL, RowWiseAdagrad]}


def build(name, hp):
    kwargs = {k: v for k, v in hp.items() if k != "lr_spec"}
    return CLASSES[name](learning_rate=make_lr(hp["lr_spec"]), **kwargs)


def signed(rng, shape, lo, hi):
    """Random values with magnitude in [lo, hi] and random sign: never zero."""
    return (rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def random_slots(name, rng, shape):
    slots = {}
    if name in ("Adagrad", "AdagradMomentum", "FTRL"):
        slots["accumulators"] = rng.uniform(0.1, 2.0, shape).astype(np.float32)
    if name == "AdagradMomentum":
        slots["momenta"] = signed(rng, shape, 0.01, 1.0)
    if name == "Adam":
        slots["momenta"] = signed(rng, shape, 0.01, 1.0)
        slots["velocities"] = rng.uniform(0.01, 1.0, shape).astype(np.float32)
    if name == "FTRL":
        slots["linears"] = signed(rng, shape, 0.1, 5.0)
    return slots


TOL = {"SGD": 1e-5, "Adagrad": 1e-5, "AdagradMomentum": 2e-5, "Adam": 1e-5, "FTRL": 5e-5}


# ---------------------------------------------------------------------------
# Property tests against the reference


@pytest.mark.parametrize("name", list(SPECIFIC))
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_update_rows_matches_float64_reference(name, data):
    hp = {**data.draw(common_hp(), "common"), **data.draw(SPECIFIC[name], "specific")}
    n = data.draw(st.integers(1, 20), "rows")
    dim = data.draw(st.integers(1, 16), "dim")
    steps = data.draw(st.integers(1, 4), "steps")
    step0 = data.draw(st.integers(0, 100), "first step")
    seed = data.draw(st.integers(0, 2**32 - 1), "seed")
    rng = np.random.default_rng(seed)

    opt = build(name, hp)
    assert sorted(opt.slot_names) == sorted(random_slots(name, rng, (1, 1)))
    # One compile per example (the hyperparameters are static): eager mode
    # would compile every primitive again for each new (n, dim) and is slower.
    update = jax.jit(opt.update_rows)
    rows = signed(rng, (n, dim), 0.1, 2.0)
    slots = random_slots(name, rng, (n, dim))
    rtol = TOL[name]
    for k in range(steps):
        step = step0 + k
        grads = signed(rng, (n, dim), 0.05, 2.0)
        new_rows, new_slots = update(rows, slots, grads, jnp.int32(step))
        exp_w, scale_w, exp_s, scale_s = ref_update(
            name,
            hp,
            rows.astype(np.float64),
            {s: v.astype(np.float64) for s, v in slots.items()},
            grads.astype(np.float64),
            step,
        )
        assert new_rows.dtype == jnp.float32 and new_rows.shape == (n, dim)
        assert set(new_slots) == set(slots)
        assert_close(new_rows, exp_w, scale_w, rtol, 1e-6, f"rows at step {step}")
        for s in slots:
            assert new_slots[s].dtype == jnp.float32
            assert_close(new_slots[s], exp_s[s], scale_s[s], rtol, 1e-6, f"{s} at step {step}")
        # Feed the state back in; the reference restarts from the same float32
        # state, so each step is checked on its own without drift.
        rows = np.asarray(new_rows)
        slots = {s: np.asarray(v) for s, v in new_slots.items()}


@pytest.mark.parametrize("lr_power", [0.0, -0.25, -0.5, -1.0])
@pytest.mark.parametrize("multiply", [False, True])
def test_ftrl_zero_accumulator_is_finite(lr_power, multiply):
    hp = dict(
        learning_rate_power=lr_power,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.0,
        beta=0.0,
        initial_accumulator_value=0.0,
        allow_zero_accumulator=True,
        multiply_linear_by_learning_rate=multiply,
        lr_spec=("const", 0.1),
    )
    opt = build("FTRL", hp)
    assert opt.slot_initial_values == {"accumulators": 0.0, "linears": 0.0}
    rng = np.random.default_rng(0)
    rows = signed(rng, (5, 3), 0.1, 2.0)
    slots = {"accumulators": np.zeros((5, 3), np.float32), "linears": signed(rng, (5, 3), 0.1, 1)}
    grads = signed(rng, (5, 3), 0.05, 2.0)
    w, s = opt.update_rows(rows, slots, grads, 0)
    assert np.isfinite(w).all() and np.isfinite(s["linears"]).all()
    exp_w, scale_w, exp_s, scale_s = ref_update(
        "FTRL",
        hp,
        rows.astype(np.float64),
        {k: v.astype(np.float64) for k, v in slots.items()},
        grads.astype(np.float64),
        0,
    )
    assert_close(w, exp_w, scale_w, 5e-5, 1e-6, "rows")
    assert_close(s["linears"], exp_s["linears"], scale_s["linears"], 5e-5, 1e-6, "linears")


def test_ftrl_zero_denominator_gives_zero_not_nan():
    # Zero accumulator, zero gradient, beta = l2 = 0: D = 0 and N = -lin.
    opt = FTRL(learning_rate=0.1, initial_accumulator_value=0.0, allow_zero_accumulator=True)
    z = np.zeros((2, 2), np.float32)
    w, s = opt.update_rows(np.ones((2, 2), np.float32), {"accumulators": z, "linears": z}, z, 0)
    np.testing.assert_array_equal(np.asarray(w), 0.0)
    np.testing.assert_array_equal(np.asarray(s["accumulators"]), 0.0)


# ---------------------------------------------------------------------------
# Hand-checked examples of the pipeline order


def test_order_clip_rule_decay_weightclip():
    lr = 0.1
    opt = SGD(
        learning_rate=lr,
        clipvalue=(None, 0.5),
        weight_decay_factor=0.2,
        multiply_weight_decay_factor_by_learning_rate=False,
        clip_weight_min=-1.0,
        clip_weight_max=2.0,
    )
    rows = np.array([[1.0, 1.0, -0.5]], np.float32)
    grads = np.array([[3.0, -3.0, 30.0]], np.float32)
    w, _ = opt.update_rows(rows, {}, grads, 0)
    # g clipped to [.., 0.5] -> [0.5, -3, 0.5]; w - lr*g - 0.2*w_old; clamp to [-1, 2]
    expected = [1 - 0.05 - 0.2, 1 + 0.3 - 0.2, max(-0.5 - 0.05 + 0.1, -1.0)]
    np.testing.assert_allclose(np.asarray(w)[0], expected, rtol=1e-6)
    opt = dataclasses.replace(
        opt, multiply_weight_decay_factor_by_learning_rate=True, clip_weight_max=1.0
    )
    w, _ = opt.update_rows(rows, {}, grads, 0)
    expected = [1 - 0.05 - 0.02, min(1 + 0.3 - 0.02, 1.0), -0.5 - 0.05 + 0.01]
    np.testing.assert_allclose(np.asarray(w)[0], expected, rtol=1e-6)


def test_adam_dense_zero_gradient_still_moves_rows():
    opt = Adam(learning_rate=0.1, lazy_adam=False)
    assert opt.touches_all_rows
    m = np.full((1, 2), 0.5, np.float32)
    w, s = opt.update_rows(
        np.zeros((1, 2), np.float32),
        {"momenta": m, "velocities": m},
        np.zeros((1, 2), np.float32),
        0,
    )
    np.testing.assert_allclose(np.asarray(s["momenta"]), 0.45, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(w), -0.1 * 0.45 / math.sqrt(0.4995 + 1e-14), rtol=1e-5)


# ---------------------------------------------------------------------------
# Interface: jit, purity, dtypes, shapes


def _example(opt, n=4, dim=3, seed=0):
    rng = np.random.default_rng(seed)
    rows = signed(rng, (n, dim), 0.1, 2.0)
    slots = random_slots(type(opt).__name__, rng, (n, dim))
    grads = signed(rng, (n, dim), 0.05, 2.0)
    return rows, slots, grads


JIT_CASES = [
    SGD(learning_rate=optax.linear_schedule(0.1, 0.01, 10), clipvalue=1.0),
    Adagrad(
        learning_rate=0.1,
        weight_decay_factor=0.01,
        multiply_weight_decay_factor_by_learning_rate=True,
    ),
    AdagradMomentum(learning_rate=0.1, momentum=0.9, use_nesterov=True, exponent=3, beta2=0.9),
    Adam(
        learning_rate=optax.exponential_decay(0.1, 5, 0.5),
        sum_inside_sqrt=False,
        clip_weight_min=-1.0,
        clip_weight_max=1.0,
    ),
    FTRL(
        learning_rate=0.1,
        l1_regularization_strength=0.1,
        l2_regularization_strength=0.1,
        beta=0.5,
        multiply_linear_by_learning_rate=True,
        clipvalue=(-0.5, None),
    ),
]


@pytest.mark.parametrize("opt", JIT_CASES, ids=lambda o: type(o).__name__)
def test_jit_matches_eager_and_is_pure(opt):
    rows, slots, grads = _example(opt)
    copies = (rows.copy(), {k: v.copy() for k, v in slots.items()}, grads.copy())
    slot_objs = dict(slots)
    eager = opt.update_rows(rows, slots, grads, 7)
    jitted = jax.jit(opt.update_rows)(rows, slots, grads, jnp.int32(7))
    again = opt.update_rows(rows, slots, grads, 7)
    for a, b, c in zip(
        jax.tree_util.tree_leaves(eager),
        jax.tree_util.tree_leaves(jitted),
        jax.tree_util.tree_leaves(again),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # Inputs untouched, the slots dict neither mutated nor returned.
    np.testing.assert_array_equal(rows, copies[0])
    np.testing.assert_array_equal(grads, copies[2])
    assert slots.keys() == slot_objs.keys() and all(slots[k] is slot_objs[k] for k in slots)
    for k in slots:
        np.testing.assert_array_equal(slots[k], copies[1][k])
    assert eager[1] is not slots


@pytest.mark.parametrize("opt", JIT_CASES, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_returns_input_dtypes(opt, dtype):
    rows, slots, grads = _example(opt)
    w, s = opt.update_rows(
        jnp.asarray(rows, dtype), {k: jnp.asarray(v, dtype) for k, v in slots.items()}, grads, 3
    )
    assert w.dtype == dtype and all(v.dtype == dtype for v in s.values())
    w32, s32 = opt.update_rows(
        np.asarray(jnp.asarray(rows, dtype), np.float32),
        {k: np.asarray(jnp.asarray(v, dtype), np.float32) for k, v in slots.items()},
        grads,
        3,
    )
    # Computed in float32 then rounded once.
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w32.astype(dtype)))


def test_update_rows_rejects_bad_shapes_and_slots():
    opt = Adagrad()
    r = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="grads"):
        opt.update_rows(r, {"accumulators": r}, np.ones((2, 4), np.float32), 0)
    with pytest.raises(ValueError, match="accumulators"):
        opt.update_rows(r, {}, r, 0)
    with pytest.raises(ValueError, match="accumulators"):
        opt.update_rows(r, None, r, 0)
    w, s = SGD().update_rows(r, None, r, 0)
    assert s == {} and w.shape == r.shape
    with pytest.raises(ValueError, match="accumulators"):
        opt.update_rows(r, {"accumulators": r, "momenta": r}, r, 0)
    with pytest.raises(ValueError, match="accumulators"):
        opt.update_rows(r, {"accumulators": np.ones((2, 1), np.float32)}, r, 0)


def test_learning_rate_at():
    lr = SGD(learning_rate=0.25).learning_rate_at(3)
    assert lr.dtype == jnp.float32 and lr.shape == () and float(lr) == 0.25
    sched = optax.exponential_decay(init_value=0.1, transition_steps=10, decay_rate=0.5)
    opt = Adam(learning_rate=sched)
    assert math.isclose(float(opt.learning_rate_at(10)), 0.05, rel_tol=1e-6)
    seen = []

    def spy(step):
        seen.append(step)
        return sched(step)

    got = jax.jit(Adam(learning_rate=spy).learning_rate_at)(jnp.int32(20))
    assert math.isclose(float(got), 0.025, rel_tol=1e-6)
    assert seen[0].dtype == jnp.int32 and seen[0].shape == ()
    with pytest.raises(ValueError, match="learning_rate"):
        SGD(learning_rate=lambda s: jnp.ones(2)).learning_rate_at(0)


# ---------------------------------------------------------------------------
# Construction: defaults, argument order, validation, hashing

COMMON_DEFAULTS = dict(
    use_gradient_accumulation=True,
    clip_weight_min=None,
    clip_weight_max=None,
    weight_decay_factor=None,
    multiply_weight_decay_factor_by_learning_rate=None,
    clipvalue=None,
    slot_variable_creation_fn=None,
    low_dimensional_packing_status=False,
)

DEFAULTS = {
    SGD: dict(learning_rate=0.01),
    Adagrad: dict(learning_rate=0.001, initial_accumulator_value=0.1),
    AdagradMomentum: dict(
        learning_rate=0.001, momentum=0.0, use_nesterov=False, exponent=2, beta2=1.0, epsilon=1e-10
    ),
    Adam: dict(
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-07,
        lazy_adam=True,
        sum_inside_sqrt=True,
    ),
    FTRL: dict(
        learning_rate=0.001,
        learning_rate_power=-0.5,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        beta=0.0,
        initial_accumulator_value=0.1,
        multiply_linear_by_learning_rate=False,
        allow_zero_accumulator=False,
    ),
}

_TAIL = [
    "use_gradient_accumulation",
    "clip_weight_min",
    "clip_weight_max",
    "weight_decay_factor",
    "multiply_weight_decay_factor_by_learning_rate",
]
TF_ORDER = {
    SGD: ["learning_rate", *_TAIL, "clipvalue", "low_dimensional_packing_status"],
    Adagrad: [
        "learning_rate",
        "initial_accumulator_value",
        *_TAIL,
        "slot_variable_creation_fn",
        "clipvalue",
        "low_dimensional_packing_status",
    ],
    AdagradMomentum: [
        "learning_rate",
        "momentum",
        "use_nesterov",
        "exponent",
        "beta2",
        "epsilon",
        *_TAIL,
        "slot_variable_creation_fn",
        "clipvalue",
        "low_dimensional_packing_status",
    ],
    Adam: [
        "learning_rate",
        "beta_1",
        "beta_2",
        "epsilon",
        "lazy_adam",
        "sum_inside_sqrt",
        *_TAIL,
        "slot_variable_creation_fn",
        "clipvalue",
        "low_dimensional_packing_status",
    ],
    FTRL: [
        "learning_rate",
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "beta",
        "initial_accumulator_value",
        *_TAIL,
        "slot_variable_creation_fn",
        "clipvalue",
        "multiply_linear_by_learning_rate",
        "allow_zero_accumulator",
        "low_dimensional_packing_status",
    ],
}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_defaults(cls):
    opt = cls()
    assert isinstance(opt, Optimizer)
    for k, v in {**COMMON_DEFAULTS, **DEFAULTS[cls]}.items():
        assert getattr(opt, k) == v, k
    assert not opt.touches_all_rows


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_tensorflow_positional_order(cls):
    names = [f.name for f in dataclasses.fields(cls)]
    # TF's SGD has no slot_variable_creation_fn; ours is accepted after the TF ones.
    expected = TF_ORDER[cls] + (["slot_variable_creation_fn"] if cls is SGD else [])
    assert names == expected


def test_positional_construction():
    opt = Adagrad(0.5, 0.2, True, -1.0, 1.0, 0.01, True, None, 0.3)
    assert (
        opt.learning_rate,
        opt.initial_accumulator_value,
        opt.clip_weight_min,
        opt.clip_weight_max,
        opt.weight_decay_factor,
        opt.multiply_weight_decay_factor_by_learning_rate,
        opt.clipvalue,
    ) == (0.5, 0.2, -1.0, 1.0, 0.01, True, (-0.3, 0.3))
    opt = FTRL(0.1, -0.25, 0.1, 0.2, 0.3, 0.4, True, None, None, None, None, None, None, True, True)
    assert opt.multiply_linear_by_learning_rate and opt.allow_zero_accumulator
    assert opt.beta == 0.3 and opt.initial_accumulator_value == 0.4


@pytest.mark.parametrize(
    "cls,names,init",
    [
        (SGD, (), {}),
        (Adagrad, ("accumulators",), {"accumulators": 0.1}),
        (AdagradMomentum, ("accumulators", "momenta"), {"accumulators": 0.0, "momenta": 0.0}),
        (Adam, ("momenta", "velocities"), {"momenta": 0.0, "velocities": 0.0}),
        (FTRL, ("accumulators", "linears"), {"accumulators": 0.1, "linears": 0.0}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_slots(cls, names, init):
    assert cls().slot_names == names
    assert cls().slot_initial_values == init
    if cls in (Adagrad, FTRL):
        assert cls(initial_accumulator_value=0.7).slot_initial_values["accumulators"] == 0.7


def test_touches_all_rows_only_dense_adam():
    assert Adam(lazy_adam=False).touches_all_rows
    assert not Adam(lazy_adam=True).touches_all_rows
    assert not any(c().touches_all_rows for c in (SGD, Adagrad, AdagradMomentum, FTRL))


COMMON_BAD = [
    (dict(learning_rate=-0.1), "learning_rate"),
    (dict(learning_rate=float("nan")), "learning_rate"),
    (dict(learning_rate="fast"), "learning_rate"),
    (dict(use_gradient_accumulation="yes"), "use_gradient_accumulation"),
    (dict(clip_weight_min=1.0, clip_weight_max=0.5), "clip_weight_min"),
    (dict(clip_weight_min="low"), "clip_weight_min"),
    (dict(clip_weight_max=float("inf")), "clip_weight_max"),
    (dict(weight_decay_factor=-0.1), "weight_decay_factor"),
    (
        dict(multiply_weight_decay_factor_by_learning_rate=True),
        "multiply_weight_decay_factor_by_learning_rate",
    ),
    (
        dict(weight_decay_factor=0.1, multiply_weight_decay_factor_by_learning_rate=1),
        "multiply_weight_decay_factor_by_learning_rate",
    ),
    (dict(clipvalue=-1.0), "clipvalue"),
    (dict(clipvalue=(1.0, -1.0)), "clipvalue"),
    (dict(clipvalue=(1.0, 2.0, 3.0)), "clipvalue"),
    (dict(clipvalue=("a", None)), "clipvalue"),
    (dict(clipvalue=1.0, use_gradient_accumulation=False), "clipvalue"),
    (dict(clipvalue=(None, 1.0), use_gradient_accumulation=False), "clipvalue"),
    (dict(low_dimensional_packing_status="x"), "low_dimensional_packing_status"),
]

SPECIFIC_BAD = [
    (Adagrad, dict(initial_accumulator_value=0.0), "initial_accumulator_value"),
    (Adagrad, dict(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    (AdagradMomentum, dict(momentum=-0.1), "momentum"),
    (AdagradMomentum, dict(use_nesterov=1), "use_nesterov"),
    (AdagradMomentum, dict(exponent=0), "exponent"),
    (AdagradMomentum, dict(exponent=-2.0), "exponent"),
    (AdagradMomentum, dict(beta2=1.5), "beta2"),
    (AdagradMomentum, dict(beta2=-0.1), "beta2"),
    (AdagradMomentum, dict(epsilon=0.0), "epsilon"),
    (Adam, dict(beta_1=1.0), "beta_1"),
    (Adam, dict(beta_1=-0.1), "beta_1"),
    (Adam, dict(beta_2=1.0), "beta_2"),
    (Adam, dict(beta_2=-1e-3), "beta_2"),
    (Adam, dict(epsilon=0.0), "epsilon"),
    (Adam, dict(epsilon=-1e-7), "epsilon"),
    (Adam, dict(lazy_adam=None), "lazy_adam"),
    (Adam, dict(sum_inside_sqrt="no"), "sum_inside_sqrt"),
    (FTRL, dict(learning_rate=0.0), "learning_rate"),
    (FTRL, dict(learning_rate_power=0.1), "learning_rate_power"),
    (FTRL, dict(l1_regularization_strength=-0.1), "l1_regularization_strength"),
    (FTRL, dict(l2_regularization_strength=-0.1), "l2_regularization_strength"),
    (FTRL, dict(beta=-0.1), "beta"),
    (FTRL, dict(initial_accumulator_value=0.0), "initial_accumulator_value"),
    (
        FTRL,
        dict(initial_accumulator_value=-0.1, allow_zero_accumulator=True),
        "initial_accumulator_value",
    ),
    (FTRL, dict(multiply_linear_by_learning_rate="x"), "multiply_linear_by_learning_rate"),
    (FTRL, dict(allow_zero_accumulator=0), "allow_zero_accumulator"),
]

BAD_CASES = [(cls, kw, field) for cls in ALL for kw, field in COMMON_BAD] + SPECIFIC_BAD


@pytest.mark.parametrize(
    "cls,kwargs,field",
    BAD_CASES,
    ids=[f"{c.__name__}-{f}-{i}" for i, (c, _, f) in enumerate(BAD_CASES)],
)
def test_invalid_values_raise_naming_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        cls(**kwargs)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_valid_edge_values(cls):
    cls(use_gradient_accumulation=False)  # fine without clipvalue
    cls(clip_weight_min=0.5, clip_weight_max=0.5)
    cls(clipvalue=0.0)
    cls(weight_decay_factor=0.0, multiply_weight_decay_factor_by_learning_rate=False)
    cls(learning_rate=np.float32(0.5))
    cls(low_dimensional_packing_status=True)
    if cls is not FTRL:
        cls(learning_rate=0.0)


def test_valid_specific_edge_values():
    FTRL(initial_accumulator_value=0.0, allow_zero_accumulator=True, learning_rate_power=0.0)
    AdagradMomentum(beta2=0.0, momentum=1.5, exponent=0.5)
    Adam(beta_1=0.0, beta_2=0.0)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_slot_variable_creation_fn_is_rejected(cls):
    with pytest.raises(NotImplementedError, match="slot_variable_creation_fn"):
        cls(slot_variable_creation_fn=lambda *a: None)


def test_clipvalue_normalization():
    assert Adagrad(clipvalue=2).clipvalue == (-2.0, 2.0)
    assert Adagrad(clipvalue=[-1, None]).clipvalue == (-1.0, None)
    assert Adagrad(clipvalue=(None, None)).clipvalue is None
    assert Adagrad(clipvalue=1.0) == Adagrad(clipvalue=(-1.0, 1.0))


def test_hashable_frozen_and_value_equal():
    sched = optax.linear_schedule(0.1, 0.01, 100)
    opts = [
        SGD(),
        SGD(),
        Adagrad(),
        Adagrad(clipvalue=[-1, 1]),
        Adam(learning_rate=sched),
        Adam(learning_rate=sched),
        FTRL(),
        AdagradMomentum(momentum=0.5),
    ]
    assert len(set(opts)) == 6
    table = {o: i for i, o in enumerate(opts)}
    assert table[SGD()] == 1 and table[Adam(learning_rate=sched)] == 5
    assert SGD(learning_rate=0.001) != Adagrad()  # same fields would not make them equal
    assert hash(Adagrad(0.5)) == hash(Adagrad(learning_rate=0.5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        SGD().learning_rate = 1.0
    assert "Adam(" in repr(Adam()) and "beta_1=0.9" in repr(Adam())


def test_rowwise_adagrad_rule_slots_and_validation():
    """RowWiseAdagrad's update_rows against the independent float64 rule (FBGEMM's
    EXACT_ROWWISE_ADAGRAD: mean of g'^2 over the row, eps outside the root), its
    [rows, 1] slot, its defaults and its errors."""
    from optimizer_reference import numpy_update_rows

    rng = np.random.default_rng(3)
    opt = RowWiseAdagrad(0.2, epsilon=1e-3, l2_regularization_strength=0.1, clipvalue=0.5)
    rows, g = signed(rng, (6, 5), 0.1, 1.0), signed(rng, (6, 5), 0.1, 1.0)
    acc = rng.uniform(0.1, 1.0, (6, 1)).astype(np.float32)
    w, s = opt.update_rows(rows, {"accumulators": acc}, g, 0)
    want_w, want_s = numpy_update_rows(opt, rows, {"accumulators": acc}, g, 0)
    assert s["accumulators"].shape == (6, 1)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s["accumulators"]), want_s["accumulators"], rtol=1e-5)
    d = RowWiseAdagrad()
    assert (d.learning_rate, d.epsilon, d.initial_accumulator_value) == (0.01, 1e-8, 0.0)
    assert d.slot_width("accumulators", 64) == 1 and Adagrad().slot_width("accumulators", 64) == 64
    with pytest.raises(ValueError, match="RowWiseAdagrad.epsilon"):
        RowWiseAdagrad(epsilon=0.0)
    with pytest.raises(ValueError, match="slot 'accumulators' shape"):
        opt.update_rows(rows, {"accumulators": np.ones((6, 5), np.float32)}, g, 0)


@pytest.mark.parametrize("l1", [0.0, 0.05])  # the kernel's N = -lin loop, and the clamp's
@pytest.mark.parametrize("multiply", [False, True])
@pytest.mark.parametrize("power", [0.0, -1.0, -0.5, -0.3])  # PowNonNeg's four kinds
def test_fused_ftrl_kernel_every_variant(power, multiply, l1):
    """The C++ FTRL kernel (sparse_update) in each of its 16 compiled loops against
    update_rows (float32, at test_ops' tolerance) and the float64 numpy rule: an odd dim
    (vector body and tail), zero accumulators and gradients (with l1 = 0: beta = l2 = 0,
    so some denominators are exactly 0 and their weights must become 0, not nan), and
    untouched rows left bit for bit."""
    from optimizer_reference import numpy_update_rows

    from embedmesh.device import ops
    from embedmesh.device.ops import cpu
    from embedmesh.device.ops.cpu import kernels as cpu_kernels

    if not cpu.ready():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    regular = dict(l2_regularization_strength=0.1, beta=0.3) if l1 else {}
    opt = FTRL(
        0.2,
        learning_rate_power=power,
        l1_regularization_strength=l1,
        multiply_linear_by_learning_rate=multiply,
        initial_accumulator_value=0.0,
        allow_zero_accumulator=True,
        **regular,
    )
    rng = np.random.default_rng([int(-power * 10), int(multiply), int(l1 > 0)])
    rows, d, n = 60, 19, 40
    table = signed(rng, (rows, d), 0.1, 2.0)
    acc = rng.uniform(0.1, 2.0, (rows, d)).astype(np.float32)
    acc[rng.random((rows, d)) < 0.2] = 0.0
    slots = {"accumulators": acc, "linears": signed(rng, (rows, d), 0.01, 1.0)}
    ids = np.sort(rng.choice(rows, n, replace=False)).astype(np.int32)
    grads = signed(rng, (n, d), 0.05, 2.0)
    grads[rng.random((n, d)) < 0.2] = 0.0
    step = jnp.int32(0)
    assert (
        ops.kernel_for("sparse_update", "cpu", table, slots, ids, grads, optimizer=opt, step=step)
        is cpu_kernels.sparse_update
    )
    got_t, got_s = jax.jit(lambda t, s, i, g: ops.sparse_update(opt, t, s, i, g, step))(
        jnp.asarray(table), {k: jnp.asarray(v) for k, v in slots.items()}, ids, grads
    )
    got = {"rows": np.asarray(got_t), **{k: np.asarray(v) for k, v in got_s.items()}}
    before = {"rows": table, **slots}
    untouched = np.setdiff1d(np.arange(rows), ids)
    f32_w, f32_s = opt.update_rows(table[ids], {k: v[ids] for k, v in slots.items()}, grads, 0)
    f64_w, f64_s = numpy_update_rows(
        opt, table[ids], {k: v[ids] for k, v in slots.items()}, grads, 0
    )
    f32, f64 = {"rows": f32_w, **f32_s}, {"rows": f64_w, **f64_s}
    for k in got:
        assert np.isfinite(got[k]).all(), k
        np.testing.assert_array_equal(got[k][untouched], before[k][untouched])
        np.testing.assert_allclose(got[k][ids], np.asarray(f32[k]), rtol=2e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(got[k][ids], f64[k], rtol=1e-4, atol=1e-5, err_msg=k)
    if not l1 and power != 0.0:  # denominators of exactly 0 (a = g = 0): weight 0
        zero = (acc[ids] == 0) & (grads == 0)
        assert zero.any()
        assert (got["rows"][ids][zero] == 0).all()


def test_optimizer_type_errors_list_every_optimizer_class():
    """Issue #40: the error for a non-optimizer named the classes by hand and left out
    RowWiseAdagrad. Every concrete Optimizer class of embedmesh.optimizers is named, in
    the facade's error and TableConfig's."""
    import inspect

    import embedmesh as em
    from embedmesh import optimizers

    classes = [
        c
        for _, c in inspect.getmembers(optimizers, inspect.isclass)
        if issubclass(c, Optimizer) and c is not Optimizer and not inspect.isabstract(c)
    ]
    assert {c.__name__ for c in classes} >= {"SGD", "Adagrad", "RowWiseAdagrad", "FTRL"}
    table = em.TableConfig(10, 4, name="t")
    with pytest.raises(ValueError, match="optimizer") as facade_error:
        em.MeshEmbedding({"f": em.FeatureConfig(table)}, optimizer="adagrad")
    with pytest.raises(ValueError, match="optimizer") as table_error:
        em.TableConfig(10, 4, optimizer=optax.sgd(0.1))
    for error in (facade_error, table_error):
        message = str(error.value)
        for c in classes:
            assert re.search(rf"\b{c.__name__}\b", message), (c.__name__, message)
