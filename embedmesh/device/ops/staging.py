"""How a device program is staged: the order of its calls that cross devices, and the
platform it is lowered for.

`shard_map_in_order` is every core's `shard_map`: its body's calls that cross devices
(`embedmesh.device.ops`'s kernels with a transport) run in the order they were traced,
on every device (`crossing_order`), and while it traces a body on a mesh of concrete
devices of one platform, `mesh_platform` names that platform, so that the ops trace
only that platform's kernel (`embedmesh.device.ops._on_lowering_platform`).
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["crossing_order", "mesh_platform", "platform_of", "shard_map_in_order"]


class _MeshPlatform(threading.local):
    """The platform of the mesh whose device program is being traced (this thread's):
    set by `shard_map_in_order` while it traces a core's body on a mesh of concrete
    devices, whose programs are lowered for that platform only. None elsewhere (a user's
    own `jit`, an export for other platforms, an abstract mesh)."""

    name: str | None = None


mesh_platform = _MeshPlatform()


def platform_of(mesh) -> str | None:
    """The one platform of a mesh's concrete devices; None for an abstract mesh or a
    mesh of several platforms."""
    devices = getattr(mesh, "devices", None)
    if not isinstance(devices, np.ndarray) or devices.size == 0:
        return None
    platforms = {getattr(d, "platform", None) for d in devices.flat}
    return platforms.pop() if len(platforms) == 1 else None


class _CrossingOrder(threading.local):
    """The order of the kernels that cross devices within one program (this thread's).

    Each of them blocks until its peers (the other devices, or processes) reach the same
    call. XLA's CPU runtime orders a program's work only by the buffers it reads and
    writes, and runs what is ready as it comes: two such calls that share no data could
    start in different orders on two devices, each then waiting for its peer at the other
    call, until the 60 s timeout. So each one waits for the output of the one staged
    before it into the same trace (its kernel's `after` argument), and every device runs
    them in the order they were traced. XLA's own collectives (the references) are
    ordered by XLA. Kept: {id(trace): (trace, its last call's first output)}, at most
    16 traces (a trace's tracers must not outlive it by much)."""

    def __init__(self):
        self.outputs: dict[int, tuple[Any, Any]] = {}

    @staticmethod
    def _trace():
        """The trace calls are staged into; None when they run eagerly (one after
        another) or where this JAX's internals differ."""
        try:
            from jax._src import core as jax_core

            trace = jax_core.trace_ctx.trace
            return None if isinstance(trace, jax_core.EvalTrace) else trace
        except (ImportError, AttributeError):
            return None

    @staticmethod
    def eager() -> bool:
        """Whether calls run now, op by op, rather than being staged into a program: no
        jit's trace below the current one (there may be a grad's or a vmap's over the
        eager evaluation); False where this JAX's internals differ."""
        try:
            from jax._src import core as jax_core
            from jax._src.interpreters import partial_eval as pe

            trace = jax_core.trace_ctx.trace
            while not isinstance(trace, jax_core.EvalTrace):
                if trace is None or isinstance(trace, pe.DynamicJaxprTrace):
                    return False
                trace = getattr(trace, "parent_trace", None)
            return True
        except (ImportError, AttributeError):
            return False

    def last(self):
        trace = self._trace()
        entry = None if trace is None else self.outputs.get(id(trace))
        return entry[1] if entry is not None and entry[0] is trace else None

    def forget(self):
        """The last output of the current trace (`last`), no longer kept."""
        last = self.last()
        if last is not None:
            del self.outputs[id(self._trace())]
        return last

    def called(self, outs) -> None:
        trace = self._trace()
        if trace is None:
            return
        first = jax.tree_util.tree_leaves(outs)[0]
        kept = [
            (k, v)
            for k, v in self.outputs.items()
            if k != id(trace) and getattr(v[0], "is_valid", lambda: True)()
        ]
        self.outputs = dict(kept[-15:] + [(id(trace), (trace, first))])


crossing_order = _CrossingOrder()


def shard_map_in_order(body, *, mesh, in_specs: tuple, out_specs, axes):
    """`jax.shard_map(body, ...)` (unchecked varying-manual-axes) whose calls that cross
    devices run after those staged before it into the calling program, and before those
    staged after it (`_CrossingOrder` orders them within one trace; this carries the
    order across the body's boundary): the body takes the caller's last such output
    where it splits over `axes`, and returns one element of its own last a device, which
    the caller records as its last. Called eagerly, it runs as one jitted program:
    an eager `shard_map` runs its body op by op, each op a program compiled anew on
    every call (a linen `init` compiled 193 of them for one raw-id table's `map_ids`)."""
    spec = P(axes)
    names = axes if isinstance(axes, tuple) else (axes,)
    devices = int(np.prod([mesh.shape[a] for a in names]))

    def marked(previous, *args):
        if previous is not None:
            crossing_order.called(previous)
        out = body(*args)
        last = crossing_order.forget()
        return out, (None if last is None else last.reshape(-1)[:1])

    def call(*args):
        if crossing_order.eager():
            return jax.jit(staged)(*args)
        return staged(*args)

    def staged(*args):
        previous = crossing_order.last()
        if previous is not None and (previous.ndim == 0 or previous.shape[0] % devices):
            previous = None
        fn = jax.shard_map(
            marked if previous is not None else lambda *a: marked(None, *a),
            mesh=mesh,
            in_specs=((spec,) if previous is not None else ()) + tuple(in_specs),
            out_specs=(out_specs, spec),
            check_vma=False,
        )
        outer, mesh_platform.name = mesh_platform.name, platform_of(mesh)
        try:
            out, mark = fn(*(() if previous is None else (previous,)), *args)
        finally:
            mesh_platform.name = outer
        if mark is not None:
            crossing_order.called(mark)
        return out

    return call
