"""`EmbeddingJob`: what a built `MeshEmbedding` is, without its state.

The resolved features, the stacking plan, the functional core and the seed, with the
checks and shape work between the user's structures and the core's flat dicts:
placing host batches on the mesh, checking preserved outputs, packing activations into
the feature config's structure, flattening gradients, reading a table in logical order.
It holds no state, so the stateful facade (`MeshEmbedding`, which owns one state) and
the flax modules (which keep the state as flax variables) share it through these public
names, as jax-tpu-embedding's `nn` layer sits under its flax modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.config import ResolvedFeatures
from embedmesh.device.core import EmbeddingCore, EmbeddingState
from embedmesh.host import preprocess as _pre
from embedmesh.inputs import flatten_inputs_like
from embedmesh.layout.stacking import StackingPlan

__all__ = ["EmbeddingJob"]


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingJob:
    """A built embedding job, stateless: `resolved` (the feature config resolved as
    TensorFlow does), `plan` (`StackingPlan`), `core` (`EmbeddingCore`: pure lookup and
    update, state in, state out) and `seed` (the tables' initial values)."""

    resolved: ResolvedFeatures
    plan: StackingPlan
    core: EmbeddingCore
    seed: int = 0

    @property
    def tables(self) -> tuple:
        """The job's `TableConfig`s, in the resolved config's order."""
        return tuple(self.resolved.tables)

    def init_state(self) -> EmbeddingState:
        """A fresh initial state (the tables from `seed`, the slots' initial values)."""
        return self.core.init(jax.random.key(self.seed))

    def placed(self, value, what: str) -> dict:
        """The `{stack: PartitionedCsrFormatTensor}` of `value` (a dict, or the seed's
        `(dict, int, int)` tuple), placed on the mesh if it is host data; `what` names
        the caller in the error."""
        if isinstance(value, tuple) and value and isinstance(value[0], dict):
            if len(value) != 3 or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value[1:]
            ):
                raise ValueError(
                    f"{what}: a tuple must be (dict of PartitionedCsrFormatTensor, "
                    f"int, int) as enqueue/preprocess_features return it, got "
                    f"({', '.join(type(v).__name__ for v in value)})"
                )
            value = value[0]
        if (
            isinstance(value, dict)
            and value
            and all(
                isinstance(v, _pre.PartitionedCsrFormatTensor)
                and isinstance(v.unique_ids, np.ndarray)
                for v in value.values()
            )
        ):
            value = self.core.put(value)  # host arrays from preprocess_features
        return value

    def check_preserved(self, preserved) -> None:
        """ValueError unless `preserved` is a batch of this job (a dequeue's output)."""
        if not isinstance(preserved, dict):
            raise ValueError(
                f"preserved_outputs must be the dict of PartitionedCsrFormatTensor "
                f"returned by this layer's dequeue/embedding_lookup, got "
                f"{type(preserved).__name__}"
            )
        want = {s.name: s for s in self.plan.stacks}
        extra = sorted(map(str, set(preserved) - set(want)))
        missing = sorted(set(want) - set(preserved))
        if extra or missing:
            raise ValueError(
                f"preserved_outputs do not come from this layer: stacks "
                f"{extra} are not this layer's and {missing} are missing (this "
                f"layer's stacks: {sorted(want)})"
            )
        for name, c in preserved.items():
            if not isinstance(c, _pre.PartitionedCsrFormatTensor):
                raise ValueError(
                    f"preserved_outputs[{name!r}] must be a "
                    f"PartitionedCsrFormatTensor, got {type(c).__name__}"
                )
            # (rows per sample depend on the batch's input forms: not compared)
            slots = tuple((f.name, f.dim) for f in c.features)
            spec = want[name]
            expect = tuple((f, self.plan.feature(f).dim) for f in spec.features)
            if slots != expect or c.num_shards != self.plan.num_shards:
                raise ValueError(
                    f"preserved_outputs[{name!r}] come from another layer: they "
                    f"hold features {[f[0] for f in slots]} on {c.num_shards} "
                    f"shards, this layer's stack {name} holds {list(spec.features)}"
                    f" on {self.plan.num_shards}"
                )

    @staticmethod
    def _segments(csr: dict) -> dict:
        """`{feature name: its FeatureSegment}` of a batch."""
        return {seg.name: seg for c in csr.values() for seg in c.features}

    def pack_activations(self, acts: dict, csr: dict) -> Any:
        """The core's `{feature: activations}` in the feature config's structure, each
        reshaped to its `output_shape` where it has one."""
        segments = self._segments(csr)
        flat = []
        for name in self.resolved.feature_names:
            a = acts[name]
            if segments[name].output_shape is not None:
                a = a.reshape(segments[name].activation_shape(self.core.mesh.size))
            flat.append(a)
        return jax.tree_util.tree_unflatten(self.resolved.treedef, flat)

    def flat_gradients(self, gradients, csr: dict) -> dict:
        """`{feature: d loss / d activations}` as the core takes them, from `gradients` in
        the feature config's structure (None leaves: no gradient); shapes and dtypes
        checked against the batch `csr`, the errors naming the feature."""
        segments = self._segments(csr)
        flat = (
            flatten_inputs_like(self.resolved, gradients, "gradients", every_feature=True)
            if gradients is not None
            else [None] * len(self.resolved.features)
        )
        size = self.core.mesh.size
        out = {}
        for name, g in zip(self.resolved.feature_names, flat):
            if g is None:
                continue
            if name not in segments:
                raise ValueError(
                    f"gradient for feature {name}, which the preserved outputs do not cover"
                )
            shape = segments[name].activation_shape(size)
            if not hasattr(g, "shape") or not hasattr(g, "dtype"):  # TF: a ValueError
                raise ValueError(
                    f"gradient for feature {name} must be an array, got {type(g).__name__}"
                )
            if not jnp.issubdtype(g.dtype, jnp.floating):
                raise TypeError(
                    f"gradient for feature {name} must be floating point, got dtype {g.dtype}"
                )
            if tuple(g.shape) != shape:
                raise ValueError(
                    f"gradient for feature {name} has shape {tuple(g.shape)}, "
                    f"expected the activation's shape {shape}"
                )
            if not isinstance(g, jax.Array):
                g = jax.device_put(np.asarray(g), self.core.row_sharding)
            seg = segments[name]
            if seg.output_shape is not None:  # back to the lookup's [B, *sample_shape, dim]
                g = g.reshape((seg.samples * size,) + tuple(seg.sample_shape) + (seg.dim,))
            out[name] = g
        return out

    def read_table(self, state: EmbeddingState, table, field: str = "parameters") -> np.ndarray:
        """Table `table`'s `field` ("parameters" or a slot name) of `state`,
        `[vocabulary_size, dim]` in logical row order, on the host."""
        return self.core.read_field(state, table, field)
