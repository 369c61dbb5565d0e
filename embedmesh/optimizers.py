"""Embedding optimizers: immutable configs plus a pure per-row update rule.

The classes mirror `tf.tpu.experimental.embedding.{SGD, Adagrad,
AdagradMomentum, Adam, FTRL}`: same names, defaults and positional argument
order, so existing model code can switch its import. Each config is a frozen,
hashable dataclass validated on construction (a bad value raises `ValueError`
naming the field), so it can be used as a static jit argument or a dict key.

The numerics live in `Optimizer.update_rows(rows, slots, grads, step)`, a pure
jax.numpy function over the touched rows only; the engine gathers those rows
and their slots, calls it, and scatters the results back. One call does, in
this order and in float32:

1. gradient clipping: clamp the summed gradient to `clipvalue`;
2. the optimizer rule (see each class);
3. decoupled weight decay: `w_new -= wd * w_old` with `wd` the
   `weight_decay_factor`, times the learning rate when
   `multiply_weight_decay_factor_by_learning_rate`;
4. weight clipping: clamp to `[clip_weight_min, clip_weight_max]`.

`update_rows` validates, takes the learning rate at `step`
(`learning_rate_at`) and calls `update_rows_at_lr`, the arithmetic alone
(what the GPU kernels apply to the rows they load).

`learning_rate` is a float or a callable, of one of two forms told apart by
its signature at construction:

- a schedule `step -> lr` (one required positional argument; an optax
  schedule works): called with the int32 step count, possibly inside jit,
  so it must be jax-traceable;
- TensorFlow's `Callable[[], float]` (no required argument, e.g.
  `lambda: 0.1` or a function reading a Python variable): called with no
  argument on the host at every update, so a value that changes between
  steps is honoured (inside the update program it runs as a
  `jax.pure_callback`; it must return a scalar).

Any other callable (two or more required positional arguments, required
keyword-only arguments, no inspectable signature) is a ValueError at
construction.

About `use_gradient_accumulation`: on a TPU, turning it off lets the hardware
apply the rule once per mini-batch shard instead of once on the summed
gradient. embedmesh always sums every gradient of a row across the whole
(global) batch and applies the rule exactly once per step, so the flag changes
no numerics here. It is kept for API compatibility and, as in TensorFlow, only
forbids `clipvalue` when False.

Compatibility-only arguments: `low_dimensional_packing_status` (a TPU memory
layout hint) is accepted and ignored. `slot_variable_creation_fn` must be None:
embedmesh creates slots itself from `slot_initial_values`, and a non-None value
raises `NotImplementedError` rather than being silently ignored.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh import _compat

__all__ = ["Optimizer", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FTRL", "RowWiseAdagrad"]

LearningRate = Union[float, Callable[[Any], Any]]
ClipValue = Union[None, float, tuple]


# ---------------------------------------------------------------------------
# Validation helpers

# Argument names of TensorFlow's and Keras's optimizers and of TPUEmbedding v1's
# `*Parameters` (and torch's `eps`) -> embedmesh's (as tf.tpu.experimental.embedding's)
_FOREIGN_NAMES = {
    "lr": "learning_rate",
    "beta1": "beta_1",
    "beta2": "beta_2",
    "eps": "epsilon",
    "epsilon_hat": "epsilon",
    "clip_gradient_min": "clipvalue",
    "clip_gradient_max": "clipvalue",
    "initial_accumulator": "initial_accumulator_value",
    "nesterov": "use_nesterov",
    "weight_decay": "weight_decay_factor",
}
_HOW = {
    "clipvalue": "clipvalue=(min, max) (one number c: (-c, c)), a clamp of each gradient element",
    "weight_decay_factor": "weight_decay_factor= (decoupled: w -= wd * w, times the learning "
    "rate with multiply_weight_decay_factor_by_learning_rate=True)",
}


def _refuse_foreign_names(cls: type, kwargs: dict) -> None:
    """A TypeError for a keyword `cls` does not take: the embedmesh argument it means
    (`_FOREIGN_NAMES`), or where none, the ones it takes. Nothing is built."""
    if not dataclasses.is_dataclass(cls):
        return
    fields = list(_field_names(cls))
    for name in kwargs:
        if name in fields:
            continue
        ours = _FOREIGN_NAMES.get(name, name)
        owners = [c.__name__ for c in _optimizer_classes() if ours in _field_names(c)]
        if ours in fields:
            hint = "embedmesh (like tf.tpu.experimental.embedding) spells it " + _HOW.get(
                ours, f"{ours}="
            )
        elif owners:
            hint = f"{cls.__name__} has no {ours}= (taken by {', '.join(owners)})"
        else:
            hint = f"{cls.__name__} has no such argument"
        raise TypeError(f"{cls.__name__} got {name}=; {hint}. Its arguments: {', '.join(fields)}")


def _field_names(cls) -> tuple:
    return tuple(f.name for f in dataclasses.fields(cls))


def _optimizer_classes() -> tuple:
    return (SGD, Adagrad, AdagradMomentum, Adam, FTRL, RowWiseAdagrad)


def _fail(obj, field: str, value, what: str):
    raise ValueError(f"{type(obj).__name__}.{field} must be {what}, got {value!r}")


def _number(
    obj, field: str, value, what: str = "a finite number", ok=None, allow_none: bool = False
) -> float | None:
    """`value` as a finite Python float satisfying `ok`, else ValueError."""
    if value is None and allow_none:
        return None
    x = None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        x = float(value)
    elif (
        getattr(value, "shape", None) == ()
        and getattr(value, "dtype", None) is not None
        and np.dtype(value.dtype).kind in "fiu"
    ):
        x = float(value)  # a concrete 0-d numpy / jax array
    if x is None or not math.isfinite(x) or (ok is not None and not ok(x)):
        _fail(obj, field, value, what + (" or None" if allow_none else ""))
    return x


def _flag(obj, field: str, value, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        _fail(obj, field, value, "a bool" + (" or None" if allow_none else ""))
    return bool(value)


def _set(obj, field: str, value) -> None:
    object.__setattr__(obj, field, value)  # normalizing a frozen dataclass field


def _check_numbers(obj, what: str, ok, *fields: str) -> None:
    """Each of `fields` of `obj` as a finite float satisfying `ok` (`what` says which
    numbers), else ValueError naming the field."""
    for field in fields:
        _set(obj, field, _number(obj, field, getattr(obj, field), what, ok))


def _check_flags(obj, *fields: str) -> None:
    """Each of `fields` of `obj` as a bool, else ValueError naming the field."""
    for field in fields:
        _set(obj, field, _flag(obj, field, getattr(obj, field)))


def _pow(x, q: float):
    """x**q for x >= 0 and a static q >= 0, with 0**q == 0 (q > 0) and x**0 == 1.

    A plain jnp.power goes through log(0) = -inf on some backends, giving
    nan for q == 0 and nan gradients elsewhere; FTRL with
    allow_zero_accumulator evaluates exactly that.
    """
    if q == 0.0:
        return jnp.ones_like(x)
    if q == 1.0:
        return x
    if q == 0.5:
        return jnp.sqrt(x)
    pos = x > 0
    return jnp.where(pos, jnp.power(jnp.where(pos, x, 1.0), q), 0.0)


def _schedule_kind(obj, lr) -> bool:
    """True for a schedule `step -> lr`, False for a zero-argument callable;
    ValueError for any other callable (see the module docstring)."""
    what = "a number, a schedule step -> lr (one positional argument) or a zero-argument callable"
    try:
        sig = inspect.signature(lr)
    except (TypeError, ValueError):
        _fail(obj, "learning_rate", lr, what + " (its signature cannot be inspected)")
    required, kw_required = 0, []
    for p in sig.parameters.values():
        if p.default is not inspect.Parameter.empty:
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            required += 1
        elif p.kind == p.KEYWORD_ONLY:
            kw_required.append(p.name)
    if kw_required or required > 1:
        _fail(
            obj,
            "learning_rate",
            lr,
            what + f" (it requires {required} positional argument"
            f"s{' and keyword-only ' + ', '.join(kw_required) if kw_required else ''})",
        )
    return required == 1


def _host_lr(obj, fn) -> np.ndarray:
    value = np.asarray(fn(), dtype=np.float32)
    if value.shape != ():
        raise ValueError(
            f"{type(obj).__name__}.learning_rate callable must return a scalar, "
            f"got shape {value.shape}"
        )
    return value


def _call_on_host(obj, fn):
    """A zero-argument learning rate: called now, or at run time under a trace."""
    if _compat.trace_state_clean():  # None (hook moved): always use the callback
        return _host_lr(obj, fn)
    return jax.pure_callback(lambda: _host_lr(obj, fn), jax.ShapeDtypeStruct((), jnp.float32))


# ---------------------------------------------------------------------------
# Base class


class Optimizer(abc.ABC):
    """Interface shared by every optimizer config (see the module docstring).

    Subclasses are frozen dataclasses declaring, after their own arguments,
    the common fields `use_gradient_accumulation`, `clip_weight_min`,
    `clip_weight_max`, `weight_decay_factor`,
    `multiply_weight_decay_factor_by_learning_rate`, `clipvalue`,
    `slot_variable_creation_fn`, `low_dimensional_packing_status` (positions
    follow TensorFlow, which is why they are not inherited fields).
    """

    _SLOTS: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args, **kwargs):
        # before the dataclass's __init__ sees them: an argument spelled as TensorFlow,
        # Keras or TPUEmbedding v1 spells it gets a TypeError naming embedmesh's spelling
        # (the dataclass's own is "unexpected keyword argument" and no more)
        _refuse_foreign_names(cls, kwargs)
        return super().__new__(cls)

    # Declared for type checkers; the dataclass subclasses define them.
    learning_rate: LearningRate
    use_gradient_accumulation: bool
    clip_weight_min: float | None
    clip_weight_max: float | None
    weight_decay_factor: float | None
    multiply_weight_decay_factor_by_learning_rate: bool | None
    clipvalue: ClipValue  # a (min, max) tuple or None once normalized
    slot_variable_creation_fn: Any
    low_dimensional_packing_status: bool

    # -- public interface ---------------------------------------------------

    @property
    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-row state tables, as TensorFlow names them."""
        return self._SLOTS

    @property
    def slot_initial_values(self) -> dict[str, float]:
        """Fill value of each slot table at creation."""
        return {name: 0.0 for name in self._SLOTS}

    @property
    def touches_all_rows(self) -> bool:
        """Whether a step must update every row, not just the looked-up ones."""
        return False

    # The fused device kernel that computes exactly this class's `update_rows`; each
    # class declares its own (read from the class itself, never inherited).
    _FUSED_KERNEL: ClassVar[str | None] = None

    @property
    def fused_kernel(self) -> str | None:
        """The name of the fused update kernel that applies this optimizer ("sgd",
        "adagrad"), or None: the device ops then gather the rows, call
        `update_rows` and scatter them back.

        A kernel computes `update_rows` with every common option (`clipvalue`,
        weight decay with or without the learning rate, weight clipping, any
        learning-rate form), taking them from `fused_attrs`. A subclass gets
        None, since it may change the rule, unless it declares `_FUSED_KERNEL`
        itself.
        """
        return type(self).__dict__.get("_FUSED_KERNEL")

    def fused_attrs(self, step) -> dict:
        """The scalars a fused kernel applies at `step`, in `update_rows`'s order:
        `learning_rate` (float32 scalar, traced), the gradient clamp `clip_lo`,
        `clip_hi` (+-inf: none), the weight decay `wd`, `has_wd` (bool), `wd_lr`
        (bool: times the learning rate), the weight clamp `wmin`, `wmax`."""
        inf = float("inf")
        lo, hi = self._clip_range() or (None, None)
        wd = self.weight_decay_factor
        return dict(
            learning_rate=self.learning_rate_at(step),
            clip_lo=-inf if lo is None else lo,
            clip_hi=inf if hi is None else hi,
            wd=wd or 0.0,
            has_wd=wd is not None,
            wd_lr=bool(self.multiply_weight_decay_factor_by_learning_rate),
            wmin=-inf if self.clip_weight_min is None else self.clip_weight_min,
            wmax=inf if self.clip_weight_max is None else self.clip_weight_max,
        )

    def fused_rule_attrs(self) -> dict:
        """The rule's own scalars a fused kernel applies, by name, computed as the
        optimizer's update computes them (constants such as `1 - beta` in Python floats,
        then float32). Empty for SGD and Adagrad."""
        return {}

    # Slots holding one value a row ([rows, 1], not [rows, dim]).
    _ROW_SLOTS: ClassVar[tuple[str, ...]] = ()

    def slot_width(self, name: str, dim: int) -> int:
        """The width of slot `name` for rows of width `dim`: `dim`, or 1 for a slot of one
        value a row (RowWiseAdagrad's accumulator)."""
        if name not in self._SLOTS:
            raise ValueError(f"{type(self).__name__} has no slot {name!r}")
        return 1 if name in self._ROW_SLOTS else int(dim)

    def learning_rate_at(self, step) -> jax.Array:
        """The learning rate at `step` as a float32 scalar (jittable)."""
        lr: Any = self.learning_rate
        if callable(lr):
            if getattr(self, "_lr_takes_step", True):
                lr = lr(jnp.asarray(step, dtype=jnp.int32))
            else:
                lr = _call_on_host(self, lr)
        lr = jnp.asarray(lr, dtype=jnp.float32)
        if lr.shape != ():
            raise ValueError(
                f"{type(self).__name__}.learning_rate schedule must return a "
                f"scalar, got shape {lr.shape}"
            )
        return lr

    def update_rows(self, rows, slots: Mapping[str, Any] | None, grads, step):
        """Apply one step to `rows` [n, dim] given their summed `grads` [n, dim].

        Pure: returns `(new_rows, new_slots)` in the input dtypes, the slots as
        a new dict holding exactly `slot_names` (`slots=None` is read as `{}`,
        for SGD). Each row is updated independently, so any leading shape works
        as long as rows, grads and every slot agree.
        """
        name = type(self).__name__
        rows = jnp.asarray(rows)
        grads = jnp.asarray(grads)
        if rows.shape != grads.shape:
            raise ValueError(
                f"{name}.update_rows: rows shape {rows.shape} != grads shape {grads.shape}"
            )
        slots = {} if slots is None else slots
        if set(slots) != set(self._SLOTS):
            raise ValueError(
                f"{name}.update_rows: slots must have exactly the keys "
                f"{self._SLOTS}, got {tuple(slots)}"
            )
        slots = {k: jnp.asarray(slots[k]) for k in self._SLOTS}
        for k, v in slots.items():
            want = rows.shape[:-1] + (self.slot_width(k, rows.shape[-1]),) if rows.ndim else ()
            if v.shape != want:
                raise ValueError(
                    f"{name}.update_rows: slot {k!r} shape {v.shape} != {want} "
                    f"(rows shape {rows.shape})"
                )

        return self.update_rows_at_lr(rows, slots, grads, self.learning_rate_at(step))

    def update_rows_at_lr(self, rows, slots: Mapping[str, Any], grads, lr):
        """`update_rows` at a given learning rate `lr` (a float32 scalar), unchecked.

        The float32 arithmetic alone (clip, rule, weight decay, weight clip),
        with no validation and no learning-rate schedule: pure elementwise
        jax.numpy, so a kernel (e.g. a Pallas one, which cannot run a schedule
        or a host callback) can call it on rows it has loaded, with `lr`
        computed outside. `slots` holds exactly `slot_names`, shaped like `rows` (a row
        slot: its last axis 1).
        """
        w_old = rows.astype(jnp.float32)
        g = grads.astype(jnp.float32)
        clip = self._clip_range()
        if clip is not None:
            lo, hi = clip
            if lo is not None:
                g = jnp.maximum(g, lo)
            if hi is not None:
                g = jnp.minimum(g, hi)

        w, new = self._rule(w_old, {k: slots[k].astype(jnp.float32) for k in self._SLOTS}, g, lr)

        if self.weight_decay_factor is not None:
            wd: Any = self.weight_decay_factor
            if self.multiply_weight_decay_factor_by_learning_rate:
                wd = wd * lr
            w = w - wd * w_old
        if self.clip_weight_min is not None:
            w = jnp.maximum(w, self.clip_weight_min)
        if self.clip_weight_max is not None:
            w = jnp.minimum(w, self.clip_weight_max)
        return w.astype(rows.dtype), {k: new[k].astype(slots[k].dtype) for k in self._SLOTS}

    # -- for subclasses -----------------------------------------------------

    @abc.abstractmethod
    def _rule(self, w, slots: dict, g, lr):
        """The optimizer rule in float32 on already clipped gradients."""

    def _validate(self, lr_positive: bool = False) -> None:
        """Validate and normalize the common fields (call from __post_init__)."""
        lr: Any = self.learning_rate
        if callable(lr):
            object.__setattr__(self, "_lr_takes_step", _schedule_kind(self, lr))
        else:
            if lr_positive:
                lr = _number(
                    self, "learning_rate", lr, "a number > 0 or a schedule", lambda x: x > 0
                )
            else:
                lr = _number(
                    self, "learning_rate", lr, "a number >= 0 or a schedule", lambda x: x >= 0
                )
            _set(self, "learning_rate", lr)
        uga = _flag(self, "use_gradient_accumulation", self.use_gradient_accumulation)
        _set(self, "use_gradient_accumulation", uga)

        lo = _number(self, "clip_weight_min", self.clip_weight_min, allow_none=True)
        hi = _number(self, "clip_weight_max", self.clip_weight_max, allow_none=True)
        if lo is not None and hi is not None and lo > hi:
            _fail(
                self,
                "clip_weight_min",
                self.clip_weight_min,
                f"<= clip_weight_max ({self.clip_weight_max!r})",
            )
        _set(self, "clip_weight_min", lo)
        _set(self, "clip_weight_max", hi)

        wd = _number(
            self,
            "weight_decay_factor",
            self.weight_decay_factor,
            "a number >= 0",
            lambda x: x >= 0,
            allow_none=True,
        )
        _set(self, "weight_decay_factor", wd)
        mult = _flag(
            self,
            "multiply_weight_decay_factor_by_learning_rate",
            self.multiply_weight_decay_factor_by_learning_rate,
            allow_none=True,
        )
        if mult and wd is None:
            _fail(
                self,
                "multiply_weight_decay_factor_by_learning_rate",
                mult,
                "None or False when weight_decay_factor is None",
            )
        _set(self, "multiply_weight_decay_factor_by_learning_rate", mult)

        if self.clipvalue is not None and not uga:
            _fail(
                self,
                "clipvalue",
                self.clipvalue,
                "None when use_gradient_accumulation is False (as in TensorFlow)",
            )
        _set(self, "clipvalue", self._normalized_clipvalue(self.clipvalue))

        if self.slot_variable_creation_fn is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.slot_variable_creation_fn is not supported by "
                f"embedmesh (got {self.slot_variable_creation_fn!r}); slots are created "
                f"from slot_initial_values. Pass None."
            )
        _set(
            self,
            "low_dimensional_packing_status",
            _flag(self, "low_dimensional_packing_status", self.low_dimensional_packing_status),
        )

    def _clip_range(self) -> tuple | None:
        """`clipvalue` as normalized by `__post_init__`: a (min, max) pair or None."""
        return self.clipvalue  # type: ignore[return-value]

    def _normalized_clipvalue(self, cv) -> tuple | None:
        """A scalar c becomes (-c, c); a pair may hold None on either side.

        Stored as a tuple (hashable); (None, None) becomes None.
        """
        if cv is None:
            return None
        if isinstance(cv, (tuple, list)):
            if len(cv) != 2:
                _fail(self, "clipvalue", cv, "a number >= 0 or a (min, max) pair")
            lo = _number(self, "clipvalue", cv[0], "a (min, max) pair of numbers", allow_none=True)
            hi = _number(self, "clipvalue", cv[1], "a (min, max) pair of numbers", allow_none=True)
            if lo is not None and hi is not None and lo > hi:
                _fail(self, "clipvalue", cv, "a (min, max) pair with min <= max")
            return None if lo is None and hi is None else (lo, hi)
        c: Any = _number(
            self, "clipvalue", cv, "a number >= 0 or a (min, max) pair", lambda x: x >= 0
        )
        return (-c, c)


# ---------------------------------------------------------------------------
# Optimizers. The common fields are repeated in each class because TensorFlow
# puts them after the optimizer-specific arguments.


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD: `w -= lr * g`; no slots.

    `slot_variable_creation_fn` is last because TensorFlow's SGD has none; it is
    accepted (as None) only for uniformity.
    """

    _FUSED_KERNEL: ClassVar[str | None] = "sgd"

    learning_rate: LearningRate = 0.01
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = dataclasses.field(default=False, repr=False)
    slot_variable_creation_fn: Any = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        self._validate()

    def _rule(self, w, slots, g, lr):
        return w - lr * g, {}


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad: `a += g**2; w -= lr * g / sqrt(a)`.

    `initial_accumulator_value` must be > 0 so the first step never divides
    by zero.
    """

    _SLOTS: ClassVar[tuple[str, ...]] = ("accumulators",)
    _FUSED_KERNEL: ClassVar[str | None] = "adagrad"

    learning_rate: LearningRate = 0.001
    initial_accumulator_value: float = 0.1
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: Any = dataclasses.field(default=None, repr=False)
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self):
        _check_numbers(self, "a number > 0", lambda x: x > 0, "initial_accumulator_value")
        self._validate()

    @property
    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulators": self.initial_accumulator_value}

    def _rule(self, w, slots, g, lr):
        a = slots["accumulators"] + g * g
        return w - lr * g * jax.lax.rsqrt(a), {"accumulators": a}


@dataclasses.dataclass(frozen=True)
class AdagradMomentum(Optimizer):
    """Adagrad with momentum, a generalized root and optional decay of the sum.

    `a = a + g**2` (beta2 == 1) or `beta2*a + (1-beta2)*g**2`;
    `s = (a + epsilon)**(-1/exponent) * g`; `m = momentum*m + s`;
    `w -= lr * (momentum*m + s if use_nesterov else m)`.
    Slots start at 0; `epsilon` > 0 keeps the first step finite.
    """

    _SLOTS: ClassVar[tuple[str, ...]] = ("accumulators", "momenta")
    _FUSED_KERNEL: ClassVar[str | None] = "adagrad_momentum"

    learning_rate: LearningRate = 0.001
    momentum: float = 0.0
    use_nesterov: bool = False
    exponent: float = 2
    beta2: float = 1.0
    epsilon: float = 1e-10
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: Any = dataclasses.field(default=None, repr=False)
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self):
        _check_numbers(self, "a number >= 0", lambda x: x >= 0, "momentum")
        _check_flags(self, "use_nesterov")
        _check_numbers(self, "a number > 0", lambda x: x > 0, "exponent")
        _check_numbers(self, "a number in [0, 1]", lambda x: 0 <= x <= 1, "beta2")
        _check_numbers(self, "a number > 0", lambda x: x > 0, "epsilon")
        self._validate()

    def fused_rule_attrs(self) -> dict:
        return dict(
            momentum=self.momentum,
            beta2=self.beta2,
            one_minus_beta2=1.0 - self.beta2,
            epsilon=self.epsilon,
            neg_inv_exponent=-1.0 / self.exponent,
            use_nesterov=self.use_nesterov,
            beta2_is_one=self.beta2 == 1.0,
            exponent_is_two=self.exponent == 2.0,
        )

    def _rule(self, w, slots, g, lr):
        a, m = slots["accumulators"], slots["momenta"]
        if self.beta2 == 1.0:
            a = a + g * g
        else:
            a = self.beta2 * a + (1.0 - self.beta2) * g * g
        if self.exponent == 2.0:
            scale = jax.lax.rsqrt(a + self.epsilon)
        else:
            scale = jnp.power(a + self.epsilon, -1.0 / self.exponent)
        s = scale * g
        m = self.momentum * m + s
        step = self.momentum * m + s if self.use_nesterov else m
        return w - lr * step, {"accumulators": a, "momenta": m}


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """Adam without bias correction, as the TPU SparseCore applies it.

    `m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g**2;
    w -= lr * m / (sqrt(v + e1) + e2)` with `(e1, e2) = (epsilon**2, 0)` when
    `sum_inside_sqrt` else `(0, epsilon)`.

    `lazy_adam=True` (the default) updates only the rows looked up this step.
    `lazy_adam=False` is true Adam: the moments of every row decay every step,
    so `touches_all_rows` is True and the engine runs this rule densely over
    the whole table (g = 0 on untouched rows) -- an O(vocabulary_size * dim)
    cost per step, whatever the batch size.
    """

    _SLOTS: ClassVar[tuple[str, ...]] = ("momenta", "velocities")
    _FUSED_KERNEL: ClassVar[str | None] = "adam"

    learning_rate: LearningRate = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-07
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: Any = dataclasses.field(default=None, repr=False)
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self):
        _check_numbers(self, "a number in [0, 1)", lambda x: 0 <= x < 1, "beta_1", "beta_2")
        _check_numbers(self, "a number > 0", lambda x: x > 0, "epsilon")
        _check_flags(self, "lazy_adam", "sum_inside_sqrt")
        self._validate()

    @property
    def touches_all_rows(self) -> bool:
        return not self.lazy_adam

    @property
    def fused_kernel(self) -> str | None:
        # lazy_adam=False moves every row (the dense path); the kernels update touched rows
        return super().fused_kernel if self.lazy_adam else None

    def fused_rule_attrs(self) -> dict:
        return dict(
            beta_1=self.beta_1,
            one_minus_beta_1=1.0 - self.beta_1,
            beta_2=self.beta_2,
            one_minus_beta_2=1.0 - self.beta_2,
            epsilon=self.epsilon,
            epsilon_squared=self.epsilon**2,
            sum_inside_sqrt=self.sum_inside_sqrt,
        )

    def _rule(self, w, slots, g, lr):
        b1, b2 = self.beta_1, self.beta_2
        m = b1 * slots["momenta"] + (1.0 - b1) * g
        v = b2 * slots["velocities"] + (1.0 - b2) * g * g
        if self.sum_inside_sqrt:
            denom = jnp.sqrt(v + self.epsilon**2)
        else:
            denom = jnp.sqrt(v) + self.epsilon
        return w - lr * m / denom, {"momenta": m, "velocities": v}


@dataclasses.dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-Proximal; the weight is recomputed in closed form from its slots.

    With `q = -learning_rate_power`, `a' = a + g**2`, `p = a'**q`,
    `dp = p - a**q`:

    - default: `lin += g - dp*w/lr`, `N = clamp(lin, -l1, l1) - lin`,
      `D = (p + beta)/lr + 2*l2`;
    - `multiply_linear_by_learning_rate`: the linear slot is stored times lr,
      so a changing lr does not rescale past gradients: `lin += lr*g - dp*w`,
      `N = clamp(lin, -lr*l1, lr*l1) - lin`, `D = p + 2*lr*l2 + beta`;

    then `w = N / D`, `a = a'`. `0**q` is 0 for q > 0 (never inf/nan), so
    `allow_zero_accumulator` is safe; if D is exactly 0 (possible only with a
    zero accumulator, zero gradient and beta = l2 = 0) the weight becomes 0
    instead of NaN.
    """

    _SLOTS: ClassVar[tuple[str, ...]] = ("accumulators", "linears")
    _FUSED_KERNEL: ClassVar[str | None] = "ftrl"

    learning_rate: LearningRate = 0.001
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: Any = dataclasses.field(default=None, repr=False)
    clipvalue: ClipValue = None
    multiply_linear_by_learning_rate: bool = False
    allow_zero_accumulator: bool = False
    low_dimensional_packing_status: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self):
        _check_numbers(self, "a number <= 0", lambda x: x <= 0, "learning_rate_power")
        regularization = ("l1_regularization_strength", "l2_regularization_strength", "beta")
        _check_numbers(self, "a number >= 0", lambda x: x >= 0, *regularization)
        _check_flags(self, "multiply_linear_by_learning_rate", "allow_zero_accumulator")
        if self.allow_zero_accumulator:
            _check_numbers(self, "a number >= 0", lambda x: x >= 0, "initial_accumulator_value")
        else:
            what = "a number > 0 (or >= 0 with allow_zero_accumulator)"
            _check_numbers(self, what, lambda x: x > 0, "initial_accumulator_value")
        # The default mode divides by lr, hence lr > 0 (a schedule is trusted).
        self._validate(lr_positive=True)

    @property
    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulators": self.initial_accumulator_value, "linears": 0.0}

    def fused_rule_attrs(self) -> dict:
        q = -self.learning_rate_power
        return dict(
            q=q,
            q_kind={0.0: 0, 1.0: 1, 0.5: 2}.get(q, 3),
            l1=self.l1_regularization_strength,
            l2=self.l2_regularization_strength,
            two_l2=2.0 * self.l2_regularization_strength,
            beta=self.beta,
            multiply_linear_by_learning_rate=self.multiply_linear_by_learning_rate,
        )

    def _rule(self, w, slots, g, lr):
        q = -self.learning_rate_power
        l1, l2, beta = (self.l1_regularization_strength, self.l2_regularization_strength, self.beta)
        a, lin = slots["accumulators"], slots["linears"]
        a_new = a + g * g
        p = _pow(a_new, q)
        dp = p - _pow(a, q)
        if self.multiply_linear_by_learning_rate:
            lin = lin + lr * g - dp * w
            bound = lr * l1
            d = p + 2.0 * lr * l2 + beta
        else:
            lin = lin + g - dp * w / lr
            bound = l1
            d = (p + beta) / lr + 2.0 * l2
        n = -lin if l1 == 0.0 else jnp.clip(lin, -bound, bound) - lin
        nonzero = d != 0
        w_new = jnp.where(nonzero, n / jnp.where(nonzero, d, 1.0), 0.0)
        return w_new, {"accumulators": a_new, "linears": lin}


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad, as FBGEMM's EXACT_ROWWISE_ADAGRAD (TorchRec's default): one
    accumulator a row (slot `accumulators` of shape [rows, 1], half of Adagrad's state
    and less), `a += mean(g'**2)` over the row's own `dim` columns,
    `w -= lr / (sqrt(a) + epsilon) * g'`, with `g' = g + l2_regularization_strength * w`.

    As in FBGEMM: epsilon is added outside the square root (default 1e-8), the
    accumulator starts at 0 (`initial_accumulator_value`), the learning rate defaults to
    0.01; FBGEMM's weight-decay modes are `l2_regularization_strength` (its L2 mode: the
    decay enters the gradient, and so the accumulator) and the common
    `weight_decay_factor` with `multiply_weight_decay_factor_by_learning_rate=True` (its
    DECOUPLE mode: `w -= lr * wd * w`, outside the accumulator). Not TensorFlow's: beyond
    the TPU API. A table using it is stacked only with tables of its own dim, so the mean
    is over the table's own columns: unpadded, except on a TPU, where its stack's rows are
    whole 128-lane vregs like every other and the stacking sets `mean_dim` (the mean then
    over the row's first `mean_dim` columns, the table's own).

    Its accumulator is not Adagrad's (one value a row, not one an element): restoring an
    Adagrad checkpoint into it, or the reverse, is an error.
    """

    _SLOTS: ClassVar[tuple[str, ...]] = ("accumulators",)
    _ROW_SLOTS: ClassVar[tuple[str, ...]] = ("accumulators",)
    _FUSED_KERNEL: ClassVar[str | None] = "rowwise_adagrad"

    learning_rate: LearningRate = 0.01
    epsilon: float = 1e-8
    initial_accumulator_value: float = 0.0
    l2_regularization_strength: float = 0.0
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    slot_variable_creation_fn: Any = dataclasses.field(default=None, repr=False)
    clipvalue: ClipValue = None
    low_dimensional_packing_status: bool = dataclasses.field(default=False, repr=False)
    # the columns the mean is over (the first ones of a padded row); None: all of them
    mean_dim: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        _check_numbers(self, "a number > 0", lambda x: x > 0, "epsilon")
        nonnegative = ("initial_accumulator_value", "l2_regularization_strength")
        _check_numbers(self, "a number >= 0", lambda x: x >= 0, *nonnegative)
        if self.mean_dim is not None and not (
            isinstance(self.mean_dim, (int, np.integer))
            and not isinstance(self.mean_dim, bool)
            and self.mean_dim >= 1
        ):
            raise ValueError(
                f"RowWiseAdagrad: mean_dim must be None or an int >= 1, got {self.mean_dim!r}"
            )
        self._validate()

    @property
    def row_wise(self) -> bool:
        """Its slot holds one value a row: its tables stack only with tables of their own
        dim (`layout.stacking`)."""
        return True

    @property
    def fused_kernel(self) -> str | None:
        # the CPU kernel takes the mean over the whole row: rows padded past `mean_dim`
        # (a TPU's stacks) take the reference
        return None if self.mean_dim is not None else super().fused_kernel

    @property
    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulators": self.initial_accumulator_value}

    def fused_rule_attrs(self) -> dict:
        # `dim`: the width of the rows the kernel is given (stacks of it are unpadded)
        return dict(epsilon=self.epsilon, l2=self.l2_regularization_strength)

    def _rule(self, w, slots, g, lr):
        g = g + self.l2_regularization_strength * w
        d = g.shape[-1] if self.mean_dim is None else min(self.mean_dim, g.shape[-1])
        own = g[..., :d]  # a padded row's other columns are not the table's
        a = slots["accumulators"] + jnp.sum(own * own, axis=-1, keepdims=True) / float(d)
        scale = lr / (jnp.sqrt(a) + self.epsilon)
        return w - scale * g, {"accumulators": a}


def optimizer_class_names() -> str:
    """embedmesh's optimizer classes for error messages ("SGD, Adagrad, ... or
    RowWiseAdagrad"): every concrete `Optimizer` subclass of this module, in the order
    they are defined, so that a new optimizer is named without editing the messages."""
    names = [
        c.__name__
        for c in globals().values()
        if isinstance(c, type)
        and issubclass(c, Optimizer)
        and c is not Optimizer
        and c.__module__ == __name__
        and not c.__name__.startswith("_")
        and not inspect.isabstract(c)
    ]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)
