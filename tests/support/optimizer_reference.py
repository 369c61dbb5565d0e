"""An independent float64 numpy implementation of every optimizer's `update_rows`, and
one instance of each fused optimizer with every option set, for the kernel tests.

Written from the optimizers' docstrings (and, for RowWiseAdagrad, FBGEMM's
EXACT_ROWWISE_ADAGRAD CPU update), not from `embedmesh.optimizers`' code: a kernel or a
rule that drifts from the documented arithmetic fails against it.
"""

from __future__ import annotations

import numpy as np

from embedmesh.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, RowWiseAdagrad

# Every fused optimizer, each with its own options and the common ones set.
ALL_FUSED = (
    SGD(0.3, clipvalue=0.8, weight_decay_factor=0.02, clip_weight_min=-0.9),
    Adagrad(
        lambda step: 0.2 / (1.0 + step),
        initial_accumulator_value=0.3,
        clipvalue=(-0.6, None),
        weight_decay_factor=0.05,
        multiply_weight_decay_factor_by_learning_rate=True,
    ),
    AdagradMomentum(
        0.1,
        momentum=0.7,
        use_nesterov=True,
        exponent=3.0,
        beta2=0.9,
        epsilon=1e-3,
        clip_weight_max=0.8,
        weight_decay_factor=0.01,
    ),
    AdagradMomentum(0.2, momentum=0.3, clipvalue=0.5),
    Adam(0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-3, clipvalue=0.7, clip_weight_min=-1.0),
    Adam(
        lambda step: 0.1 * (0.9**step),
        sum_inside_sqrt=False,
        weight_decay_factor=0.02,
        multiply_weight_decay_factor_by_learning_rate=True,
    ),
    FTRL(
        0.2,
        learning_rate_power=-0.5,
        l1_regularization_strength=0.05,
        l2_regularization_strength=0.1,
        beta=0.3,
        initial_accumulator_value=0.2,
        clip_weight_max=0.9,
    ),
    FTRL(
        0.1,
        learning_rate_power=-0.3,
        l1_regularization_strength=0.02,
        multiply_linear_by_learning_rate=True,
        clipvalue=0.9,
        weight_decay_factor=0.01,
    ),
    RowWiseAdagrad(0.1, epsilon=1e-4, l2_regularization_strength=0.05, clipvalue=1.0),
    RowWiseAdagrad(
        0.2, weight_decay_factor=0.1, multiply_weight_decay_factor_by_learning_rate=True
    ),
)


def _lr(opt, step) -> float:
    lr = opt.learning_rate
    if callable(lr):
        lr = lr(int(step)) if getattr(opt, "_lr_takes_step", True) else lr()
    return float(lr)


def numpy_update_rows(opt, rows, slots, grads, step):
    """`opt.update_rows` in float64 numpy: (new rows, new slots) as float64 arrays."""
    w0 = np.asarray(rows, np.float64)
    g = np.asarray(grads, np.float64)
    s = {k: np.asarray(v, np.float64) for k, v in (slots or {}).items()}
    lr = _lr(opt, step)
    if opt.clipvalue is not None:
        lo, hi = opt.clipvalue
        g = np.clip(g, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    name = type(opt).__name__
    new = {}
    if name == "SGD":
        w = w0 - lr * g
    elif name == "Adagrad":
        a = s["accumulators"] + g**2
        w, new = w0 - lr * g / np.sqrt(a), {"accumulators": a}
    elif name == "AdagradMomentum":
        b2 = opt.beta2
        a = s["accumulators"] + g**2 if b2 == 1 else b2 * s["accumulators"] + (1 - b2) * g**2
        scaled = (a + opt.epsilon) ** (-1.0 / opt.exponent) * g
        m = opt.momentum * s["momenta"] + scaled
        w = w0 - lr * (opt.momentum * m + scaled if opt.use_nesterov else m)
        new = {"accumulators": a, "momenta": m}
    elif name == "Adam":
        m = opt.beta_1 * s["momenta"] + (1 - opt.beta_1) * g
        v = opt.beta_2 * s["velocities"] + (1 - opt.beta_2) * g**2
        if opt.sum_inside_sqrt:
            denom = np.sqrt(v + opt.epsilon**2)
        else:
            denom = np.sqrt(v) + opt.epsilon
        w, new = w0 - lr * m / denom, {"momenta": m, "velocities": v}
    elif name == "FTRL":
        q = -opt.learning_rate_power
        l1, l2, beta = opt.l1_regularization_strength, opt.l2_regularization_strength, opt.beta
        a = s["accumulators"]
        a_new = a + g**2
        p = a_new**q
        dp = p - a**q
        if opt.multiply_linear_by_learning_rate:
            lin = s["linears"] + lr * g - dp * w0
            n = np.clip(lin, -lr * l1, lr * l1) - lin
            d = p + 2 * lr * l2 + beta
        else:
            lin = s["linears"] + g - dp * w0 / lr
            n = np.clip(lin, -l1, l1) - lin
            d = (p + beta) / lr + 2 * l2
        w = np.where(d != 0, n / np.where(d != 0, d, 1), 0.0)
        new = {"accumulators": a_new, "linears": lin}
    elif name == "RowWiseAdagrad":
        # FBGEMM's CPU update: L2 decay into the gradient, the mean over the row's dim,
        # multiplier = lr / (sqrt(a) + eps), w = w - multiplier * g
        gl2 = g + opt.l2_regularization_strength * w0
        a = s["accumulators"] + (gl2**2).sum(axis=-1, keepdims=True) / g.shape[-1]
        w = w0 - lr / (np.sqrt(a) + opt.epsilon) * gl2
        new = {"accumulators": a}
    else:
        raise NotImplementedError(name)
    if opt.weight_decay_factor is not None:
        wd = opt.weight_decay_factor * (
            lr if opt.multiply_weight_decay_factor_by_learning_rate else 1
        )
        w = w - wd * w0
    w = np.clip(
        w,
        -np.inf if opt.clip_weight_min is None else opt.clip_weight_min,
        np.inf if opt.clip_weight_max is None else opt.clip_weight_max,
    )
    return w, new
