"""`JobSpec`: what a user declares for an embedding job, checked once, immutable.

The facade's constructor arguments (TensorFlow's `TPUEmbeddingV2` ones and embedmesh's
own) as one frozen value, so a job can be planned and built from it without the
stateful facade (`EmbeddingJob.build`). Bad values raise a ValueError naming the
argument and the value, before anything is planned or allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from embedmesh import _compat
from embedmesh.config import ResolvedFeatures, resolve_feature_config
from embedmesh.host.preprocess import OVERFLOW_POLICIES
from embedmesh.layout import planner as _planner
from embedmesh.optimizers import Optimizer, optimizer_class_names

__all__ = [
    "JobSpec",
    "check_enqueue_device",
    "check_not_traced",
    "default_mesh",
    "read_only",
    "refuse_missing_batch",
]


def check_not_traced(what: str, *args) -> None:
    """RuntimeError when a facade method runs under a jax trace (inside `jax.jit`).

    The facade is stateful (it owns the state, preprocesses on the host and
    dispatches its own programs), so it cannot be traced; jax's own errors
    there are obscure. Cost: one trace-state query (or, without it, a scan of
    the arguments' leaves for tracers).
    """
    clean = _compat.trace_state_clean()  # 0.2 us; None: the private hook moved
    if clean is not None:
        if clean:
            return
    elif not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
        return
    raise RuntimeError(
        f"MeshEmbedding.{what} was called inside jax.jit (or another jax transformation). "
        f"The MeshEmbedding facade is stateful and runs outside jit: call emb.enqueue(...) "
        f"outside the jitted function and pass its result in, and inside jit use the "
        f"functional core, emb.core.lookup(state, csr) and emb.core.apply_gradients(state, "
        f"gradients, csr), with emb.state as an argument (see embedmesh.device.core)."
    )


def check_enqueue_device(device) -> None:
    """TypeError for TPUEmbedding (v1)'s argument order, `training` third: a bool where
    this layer takes `device` (as TPUEmbeddingV2)."""
    if isinstance(device, bool):
        raise TypeError(
            f"enqueue: device={device!r} is a bool: TPUEmbedding (v1) takes `training` "
            f"third, this layer takes `device` there (as TPUEmbeddingV2): pass "
            f"training={device} by name"
        )


def refuse_missing_batch() -> None:
    """TypeError for `dequeue()` called without its batch, as TPUEmbedding's is."""
    raise TypeError(
        "MeshEmbedding.dequeue() takes the batch to look up: pass what enqueue "
        "returned, `acts, preserved = emb.dequeue(emb.enqueue(features))` "
        "(TPUEmbedding's dequeue() reads an implicit queue; this layer has none)"
    )


def read_only(tree: Any) -> Any:
    """`tree` (an array or nested dicts of them) with its numpy arrays made read-only:
    copies of device data, whose writes would be lost; other values as they are."""
    if isinstance(tree, dict):
        return {k: read_only(v) for k, v in tree.items()}
    if isinstance(tree, np.ndarray):
        tree.flags.writeable = False
    return tree


def default_mesh() -> Mesh:
    """The mesh set by `jax.set_mesh` if any, else all devices on one axis."""
    current = jax.sharding.get_mesh()
    if current is not None and not current.empty:
        return current
    return Mesh(np.array(jax.devices()), ("devices",))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_host_tier(mode, cache_rows) -> None:
    """ValueError for a host tier setting out of range (`MeshEmbedding`'s `host_tier`)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"host_tier must be 'auto', 'on' or 'off', got {mode!r}")
    if cache_rows is not None and not (_is_int(cache_rows) and cache_rows >= 1):
        raise ValueError(f"host_tier_cache_rows must be None or an int >= 1, got {cache_rows!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class JobSpec:
    """An embedding job as declared (see `MeshEmbedding` for each argument):
    `resolved` (the feature config resolved as TensorFlow does), the default
    `optimizer`, `pipelined` (`pipeline_execution_with_tensor_core`), `strategies`
    (`{table: strategy or "auto"}`), the stacking options, `batch_size`,
    `memory_limit_bytes`, `capacities`, `overflow`, `check_finite`, `seed` and the host
    tier's `host_tier` and `host_tier_cache_rows`."""

    resolved: ResolvedFeatures
    optimizer: Optimizer | None = None
    pipelined: bool = False
    strategies: Mapping[str, str] = dataclasses.field(default_factory=dict)
    stack_tables: bool = True
    max_stack_rows: int | None = None
    batch_size: int | None = None
    memory_limit_bytes: float | None = None
    capacities: Any = None
    overflow: str = "grow"
    check_finite: bool = True
    seed: int = 0
    host_tier: str = "auto"
    host_tier_cache_rows: int | None = None

    def describe(self, mesh: Mesh | None, built: bool) -> str:
        """What a `MeshEmbedding` of this spec holds, for its `repr`: its tables (name,
        rows x dim), optimizer, pipelining and mesh."""
        tables = ", ".join(f"{t.name}: {t.vocabulary_size} x {t.dim}" for t in self.resolved.tables)
        where = f"{mesh.devices.size} devices" if mesh is not None else "the default mesh"
        return (
            f"MeshEmbedding({tables}; {type(self.optimizer).__name__ if self.optimizer else None}"
            f"{', pipelined' if self.pipelined else ''}; {'built on' if built else 'for'} "
            f"{where})"
        )

    @classmethod
    def of(
        cls,
        feature_config: Any,
        optimizer: Optimizer | None = None,
        pipeline_execution_with_tensor_core: bool = False,
        **options: Any,
    ) -> JobSpec:
        """The spec of `MeshEmbedding`'s arguments (`options`: its keyword ones but `mesh`,
        with its defaults), each checked (a ValueError naming a bad one: an optimizer that
        is not embedmesh's, an unknown table or strategy, a batch size, memory limit or
        overflow policy out of range; an unknown option is a TypeError)."""
        # the declared fields' defaults, `sharding` for `strategies` (resolved below), and
        # `overflow` chosen by `capacities` where not given
        named = ("resolved", "optimizer", "pipelined", "strategies")
        o = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in named}
        o.update(sharding="mod", overflow=None)
        if unknown := sorted(set(options) - set(o)):
            raise TypeError(f"unknown MeshEmbedding arguments {unknown}")
        o.update(options)
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(
                f"optimizer must be None or an instance of one of embedmesh's optimizers "
                f"({optimizer_class_names()}), e.g. em.Adagrad(learning_rate=0.1); got "
                f"{optimizer!r}"
            )
        resolved = resolve_feature_config(feature_config)
        strategies = _planner.resolve_strategies(resolved, o.pop("sharding"))
        batch_size, memory_limit_bytes = o["batch_size"], o["memory_limit_bytes"]
        if batch_size is not None and not (_is_int(batch_size) and batch_size >= 1):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
        if memory_limit_bytes is not None and not (
            isinstance(memory_limit_bytes, (int, float, np.integer, np.floating))
            and not isinstance(memory_limit_bytes, bool)
            and memory_limit_bytes > 0
        ):
            raise ValueError(
                f"memory_limit_bytes must be None or a number > 0, got {memory_limit_bytes!r}"
            )
        if o["overflow"] is None:
            o["overflow"] = "grow" if o["capacities"] is None else "error"
        if o["overflow"] not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {o['overflow']!r}")
        _check_host_tier(o["host_tier"], o["host_tier_cache_rows"])
        if o["host_tier_cache_rows"] is not None:
            o["host_tier_cache_rows"] = int(o["host_tier_cache_rows"])
        return cls(resolved, optimizer, bool(pipeline_execution_with_tensor_core), strategies, **o)

    @property
    def plans_from_a_batch(self) -> bool:
        """Whether a table is planned by "auto", from the first batch's statistics."""
        return "auto" in self.strategies.values()

    def refuse_unplanned(self, what: str) -> None:
        """RuntimeError for a read of `what` (a `MeshEmbedding` property) that would build
        a job planned by "auto" before its first batch: building then would plan without
        the batch statistics "auto" plans from."""
        if self.plans_from_a_batch:
            raise RuntimeError(
                f"MeshEmbedding.{what} is not planned yet: sharding='auto' plans from the "
                f"first batch, so enqueue a batch first (emb.enqueue, emb(...), "
                f"emb.prefetch), or call emb.build() to plan from the config alone"
            )
