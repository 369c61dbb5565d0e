"""The interface of a sharding strategy on the devices: one stack's lookup, update, the
bytes it sends and the memory it holds.

Where a table's rows live is the layout's (`embedmesh.layout.rows.RowLayout`, chosen by
the stacking plan); the host preprocessing sends every id to the shard that holds its row.
A strategy is how one stack's step crosses the devices given that placement: what each
device sends (ids, rows, partial sums, gradients), who combines and who applies the
optimizer. `EmbeddingCore` holds one `Strategy` per stack, chosen in one place
(`embedmesh.device.strategies.strategy_name`, a registry keyed by the plan's stack), and
never asks which one it holds.

Adding a strategy (column-wise, for one: costed in `layout/cost_model.py`, not built) is
one new module in this package plus its tests:

- a subclass of `Strategy` with a registry `name`, decorated with `register`, its module
  imported by the package's `__init__`;
- `lookup(table, batch, carry=...)`: this device's activation rows `[R, D]` from its batch
  (`ShardBatch`) and its shard of the stack, inside `shard_map`; with `carry`, also a view
  of the batch its update can take instead of sending the batch again (or None);
- `update(table, slots, batch, act_grads, step=..., keep=..., view=...)`: the new shard
  and slots after one update from every device's activation gradients; `keep` (a traced
  bool, or None) False moves no row; each touched row updated once with its sum over the
  global batch, so every strategy trains to the same tables;
- `exchange_bytes(csr, carrying=...)`: the bytes one device sends the others in one step
  at the batch's compiled capacities (what `layout/cost_model.py` predicts for it);
- `memory_held()` when a device holds other than `rows_per_shard` rows of the stack's
  width for the table and each slot (column-wise: a slice of the columns);
- `carries_view()` when `lookup(carry=True)` gives a view the update takes;
- a rule in `strategy_name` saying which stacks it serves (and, for a new placement, a
  `RowLayout` and the planner's entry for it).

Every exchange goes through `self.transport` (an `ops.Transport`: the mesh axis, the
device count, in one process or the processes of one host, and the stack's channel),
extended with `transport.at(...)` so that each call of one program has its own channel.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from embedmesh._runtime import PAD_ID
from embedmesh.device import id_map, ops
from embedmesh.device.ops import Transport
from embedmesh.device.shard_program import ShardBatch, after

__all__ = ["STRATEGIES", "ShardBatch", "Strategy", "register"]


class Strategy(abc.ABC):
    """How one stack's lookup and update cross the devices of a mesh.

    Args:
      plan: the `StackingPlan`.
      stack: the stack's name.
      optimizer: the stack's effective optimizer (None: lookups only).
      transport: where the devices are, its channel the stack's name.
    """

    name: ClassVar[str]
    # whether it can hold a table of raw ids (`TableConfig.id_map`, `map_ids`)
    holds_raw_ids: ClassVar[bool] = True

    def __init__(self, plan, stack: str, optimizer: Any, transport: Transport):
        self.plan = plan
        self.stack = stack
        self.spec = plan.stack(stack)
        self.optimizer = optimizer
        self.transport = transport

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.stack!r}, {self.transport})"

    # -- on the host: static questions ------------------------------------------------

    @abc.abstractmethod
    def exchange_bytes(self, csr, *, carrying: bool = True) -> int:
        """Bytes one device sends the others in one training step (lookup and update) of
        a batch shaped like `csr` (the stack's `PartitionedCsrFormatTensor`), at its
        compiled capacities; `carrying`: the update is given the lookup's view."""

    def memory_held(self) -> int:
        """Bytes of the stack's table and optimizer slots one device holds: its
        `rows_per_shard` rows of the table and of each slot (a slot's width: the
        optimizer's `slot_width` where it has one, else the stack's dim; slots kept in the
        rows are in the table's `width`)."""
        spec, opt = self.spec, self.optimizer
        width = spec.width  # the slots in the rows, if the stack keeps them there
        slots = 0
        for slot in getattr(opt, "slot_names", ()) or ():
            slot_width = getattr(opt, "slot_width", None)
            slots += spec.dim if slot_width is None else slot_width(slot, spec.dim)
        row = width * np.dtype(spec.dtype).itemsize + slots * spec.slots_dtype.itemsize
        return int(spec.rows_per_shard * row)

    def carries_view(self) -> bool:
        """Whether `lookup(carry=True)` returns a view of the batch that `update` takes
        in place of sending the batch again."""
        return False

    # -- on the devices: inside `shard_map` -------------------------------------------

    @abc.abstractmethod
    def lookup(self, table, batch: ShardBatch, *, carry: bool = False) -> tuple:
        """`(activation rows [R, D] float32, view or None)` of this device."""

    @abc.abstractmethod
    def update(
        self, table, slots: dict, batch: ShardBatch, act_grads, *, step, keep=None, view=None
    ) -> tuple:
        """`(new table shard, new slots)` after one update from this device's activation
        gradients `act_grads` [R, D] (and every other device's); `keep` False: no row
        moves; `view`: what this batch's `lookup(carry=True)` returned."""

    def map_ids(self, table, slots: dict, id_state, unique_ids, raw, step, reinit) -> tuple:
        """A stack of raw ids (`TableConfig.id_map`): this device's distinct raw ids
        `raw` [N, U, 2] (uint32 pairs; valid where `unique_ids` [N, U] is not `PAD_ID`),
        block j for shard j, sent to their owners (one exchange); the owner maps the ids
        its sources sent with its `id_state` (`id_map.map_ids`, in source order),
        `reinit(table, slots, rows, fresh, raw)`s the rows given to an id in this call,
        and sends each source the rows of its ids back (stack rows, `PAD_ID` for none).
        Returns `(table, slots, id_state, rows [N, U], stats)`. The strategies that
        shard rows over every device (and one device) share this; the others refuse
        such tables (`embedmesh.device.core`)."""
        raw_o, valid, at = self._ids_to_owners(unique_ids, raw, "map")
        # (one source: the host's distinct ids, so the map skips its dedup sorts)
        id_state, rows, fresh, stats = id_map.map_ids(
            id_state, raw_o, valid, step, distinct=at is None
        )
        table, slots = reinit(
            table, slots, rows.reshape(-1), fresh.reshape(-1), raw_o.reshape(-1, 2)
        )
        return table, slots, id_state, self._rows_to_sources(rows, at, table), stats

    def find_ids(self, id_state, unique_ids, raw):
        """`map_ids` read-only (an evaluation lookup): the same exchanges, each owner
        finds the ids it received in its `id_state` (`id_map.lookup`: no admission, no
        eviction, no count or step recorded) and sends back their stack rows, `PAD_ID`
        for an id it does not hold (a zero row, as serving reads it). Returns the rows
        `[N, U]`; nothing is written."""
        raw_o, valid, at = self._ids_to_owners(unique_ids, raw, "find")
        one = id_state if id_state.index.ndim == 3 else _block(id_state)
        return self._rows_to_sources(id_map.lookup(one, raw_o, valid), at)

    def _ids_to_owners(self, unique_ids, raw, what: str) -> tuple:
        """`(raw ids [N, U, 2] this owner received, valid [N, U], the exchanges' channel)`:
        this device's distinct raw ids sent to their owners, one exchange on channel
        `what` (one device: its own, channel None)."""
        if self.transport.num_shards == 1:
            return raw, unique_ids != PAD_ID, None
        at = self.transport.at(what)
        msg = jnp.concatenate(
            [lax.bitcast_convert_type(raw, jnp.int32), unique_ids[..., None]], axis=-1
        )
        got = ops.exchange(msg, at.at("ids"))
        return lax.bitcast_convert_type(got[..., :2], jnp.uint32), got[..., 2] != PAD_ID, at

    def _rows_to_sources(self, rows, at, previous=None):
        """The owner's map `rows` (-1: none) as stack rows (`PAD_ID`: none) sent back to
        the sources that asked (`_ids_to_owners`' channel `at`), after `previous`."""
        offset = self.plan.table(self.spec.tables[0]).local_row_offset
        local = jnp.where(rows >= 0, rows + offset, PAD_ID).astype(jnp.int32)
        if at is None:
            return local
        return ops.exchange(local if previous is None else after(local, previous), at.at("rows"))


def _block(id_state):
    """One shard's block of a map (`[1, ...]` arrays inside `shard_map`) as a map."""
    return jax.tree_util.tree_map(lambda x: x[0], id_state)


# name -> Strategy subclass: filled by `register` as the strategy modules load
STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a `Strategy` subclass to the registry under its `name` (a class decorator)."""
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise ValueError(f"strategy {cls.name!r} is already registered: {STRATEGIES[cls.name]}")
    STRATEGIES[cls.name] = cls
    return cls
