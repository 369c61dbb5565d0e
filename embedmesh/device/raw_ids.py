"""Tables of raw 64-bit ids (`TableConfig.id_map`) on the devices: a table-level feature
composed with the core, not threaded through it.

`RawIdTables` is the part of one `EmbeddingCore` that holds them (`core.raw_ids`): which
stacks are tables of raw ids (each checked to be one the strategies can hold), their
empty id maps in a fresh state, the device programs that map a batch's raw ids to rows
(`map_ids`, and `find_rows`, its read-only form for an evaluation), re-initialise the
rows given to an id (`reinit_fresh_rows`), and the host read of a table's live ids
(`read`). The core keeps its public names for them (`EmbeddingCore.map_ids`, ...), and
its lookup and update refuse a batch that still carries raw ids; the owner's map itself
is `embedmesh.device.id_map`, run by each strategy's `map_ids`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from embedmesh.device import id_map, slots_in_rows

__all__ = ["FRESH_SALT", "ID_STATS", "RawIdTables", "refuse_raw"]

# the fresh rows' key: `fold_in(init key, FRESH_SALT)`, then the table's index, then the
# raw id's two words (so a row's initial values depend on its id only, not on the shards)
FRESH_SALT = 0x1D5
# what `map_ids` counts, per stack (`id_map.map_ids`'s stats, summed over the shards)
ID_STATS = ("hits", "admissions", "evictions", "pending", "refused", "occupancy")


def _dynamic_stacks(plan, num_shards: int, by_stack: dict) -> dict:
    """`{stack: (TablePlacement, IdMapConfig)}` for the tables of raw ids
    (`TableConfig.id_map`), each checked to be one the strategies can hold: alone in
    its stack, not replicated, its capacity a multiple of the shards of its span (every
    shard: mod / row-wise, rows or pooled exchange; one: table-wise), its slots in arrays
    of their own. Each shard of the span holds a map of `vocabulary_size / span` rows
    (`StackingPlan.id_owners`); the shards outside it hold an empty one, never given an id."""
    out = {}
    for spec in plan.stacks:
        configs = [plan.table_config(t) for t in spec.tables]
        if not any(getattr(c, "id_map", None) is not None for c in configs):
            continue
        t, cfg = plan.table(spec.tables[0]), configs[0]
        if len(spec.tables) != 1:
            raise ValueError(
                f"stack {spec.name}: a table of raw ids (TableConfig.id_map) must be alone in "
                f"its stack, it holds {list(spec.tables)}"
            )
        strategy = by_stack[spec.name]
        _, k = plan.row_layout.span(t)
        # the table's span, not the strategy: over every shard, or whole on one owner
        every_shard, one_owner = k == num_shards, k == 1
        if not strategy.holds_raw_ids or not (every_shard or one_owner):
            raise NotImplementedError(
                f"table {t.name}: a table of raw ids (TableConfig.id_map) is row-sharded over "
                f"every device (sharding 'mod', 'row_wise_rows' or 'row_wise_pooled') or "
                f"placed whole on one ('table_wise'); its strategy here ({strategy.name}, over "
                f"{k} of {num_shards} shards) cannot hold it yet"
            )
        v = cfg.vocabulary_size
        if v % k:
            raise ValueError(
                f"table {t.name}: vocabulary_size {v}, the capacity of a table of raw ids, "
                f"must be a multiple of the {k} shards (each holds an equal share)"
            )
        out[spec.name] = (t, id_map.IdMapConfig.of(cfg.id_map, v // k))
    return out


def refuse_raw(csr: dict, what: str) -> None:
    """ValueError naming the stacks of `csr` that still carry raw ids (`what`: the
    program that refuses them, a lookup or an update)."""
    raw = [s for s, c in csr.items() if getattr(c, "unique_raw_ids", None) is not None]
    if raw:
        raise ValueError(
            f"{what}: stacks {sorted(raw)} still carry raw ids: run map_ids(state, csr) on "
            f"the batch first and pass the batch it returns"
        )


class RawIdTables:
    """The tables of raw ids of one `EmbeddingCore` (`core.raw_ids`): `stacks`,
    `{stack: (TablePlacement, IdMapConfig)}` (empty when there is none), and the pure
    functions over a core's state that map, re-initialise and read them."""

    def __init__(self, core):
        self.core, self.plan, self.num_shards = core, core.plan, core.num_shards
        self.strategies, self.transport = core.strategies, core.transport
        self._specs, self._shard_map, self._after = core.specs, core.shard_program, core.after
        self.stacks = _dynamic_stacks(core.plan, core.num_shards, core.strategies)

    @property
    def table_names(self) -> tuple:
        """The names of the tables of raw ids, in stack order."""
        return tuple(t.name for t, _ in self.stacks.values())

    def init(self, key) -> dict:
        """Empty id maps of the dynamic stacks, one a shard, and their fresh rows' key."""
        out = {}
        for stack, (_, config) in self.stacks.items():
            empty = jax.tree_util.tree_map(np.asarray, id_map.init(config))
            n = self.num_shards

            def place(x, n=n):
                full = np.broadcast_to(x[None], (n,) + x.shape)
                return id_map.on_huge_pages(
                    jax.make_array_from_callback(
                        full.shape, self.core.row_sharding, lambda idx, full=full: full[idx]
                    )
                )

            data = np.asarray(jax.random.key_data(jax.random.fold_in(key, FRESH_SALT)))
            out[stack] = {
                "map": jax.tree_util.tree_map(place, empty),
                "key": jax.make_array_from_callback(
                    data.shape, self.core.replicated, lambda idx, data=data: data[idx]
                ),
            }
        return out

    def _reinit_fresh(self, stack: str, key_data, table, slots: dict, rows, fresh, raw):
        """Rows given to an id in this step (`fresh` [M], the map's `rows` [M], their ids
        `raw` [M, 2]): the table's initializer keyed by the id, the slots' initial
        values; the other rows as they were."""
        t, _ = self.stacks[stack]
        cfg = self.plan.table_config(t.name)
        base = jax.random.fold_in(jax.random.wrap_key_data(key_data), t.index)

        def one(pair):
            k = jax.random.fold_in(jax.random.fold_in(base, pair[0]), pair[1])
            return cfg.initialize(k, (1, t.dim), jnp.float32)[0]

        fresh = fresh & (rows >= 0)
        m = raw.shape[0]
        few = max(1, m // 16)
        opt = self.core.optimizer_of(stack)
        # the row a fresh id starts from: the padding 0 and, where the stack keeps its
        # slots in its rows (a TPU's layout), each slot's initial value in its columns
        start = slots_in_rows.initial_row(self.plan.stack(stack), opt)
        start = jnp.broadcast_to(jnp.asarray(start, jnp.float32), (few, table.shape[1]))
        chunks = -(-m // few)
        # the fresh positions first, in `few`-long chunks: the initializer and the writes
        # run on the fresh entries only, a chunk a loop step (a step of hits runs none,
        # and materialises no [m, dim] array); the loop carries the table and slots,
        # updated in place
        count = fresh.sum(dtype=jnp.int32)
        # (a step with nothing fresh, the steady state, skips the nonzero's cumsums)
        order = jax.lax.cond(
            count > 0,
            lambda f: jnp.nonzero(f, size=chunks * few, fill_value=m)[0].astype(jnp.int32),
            lambda f: jnp.full((chunks * few,), m, jnp.int32),
            fresh,
        )
        initial = opt.slot_initial_values.items() if opt is not None else ()

        def chunk(k, carried):
            table, slots = carried
            pos = jax.lax.dynamic_slice(order, (k * few,), (few,))
            at_m = jnp.minimum(pos, m - 1)
            values = start.at[:, : t.dim].set(jax.vmap(one)(raw[at_m])).astype(table.dtype)
            at = jnp.where(pos < m, rows[at_m] + t.local_row_offset, table.shape[0])
            table = table.at[at].set(values, mode="drop")
            slots = dict(slots)
            for name, value in initial:
                if name not in slots:  # in the rows: set above
                    continue
                arr = slots[name]
                slots[name] = arr.at[at].set(jnp.asarray(value, arr.dtype), mode="drop")
            return table, slots

        return jax.lax.fori_loop(0, (count + few - 1) // few, chunk, (table, dict(slots)))

    def _last_updated(self, csr_prev: dict | None) -> str | None:
        """The stack whose table an `apply_gradients` of `csr_prev` writes last (its
        stacks' writes chain in plan order): a program that runs more writes after that
        update starts them after this one's (`map_ids`, `reinit_fresh_rows`)."""
        if csr_prev is None:
            return None
        return next((s.name for s in reversed(self.plan.stacks) if s.name in csr_prev), None)

    def _leading(self, state, stack: str | None) -> dict:
        """`{stack: its table}` for a program's writes to follow (`_after`); none where
        nothing is ordered (`Transport.crosses`)."""
        if stack is None or not self.transport.crosses:
            return {}
        return {stack: state.tables[stack]}

    def _mappable(self, state, csr: dict) -> list:
        """`csr`'s stacks of raw ids, in plan order; ValueError naming a stack whose batch
        has no raw ids (mapped already) or whose id map the state lacks."""
        stacks = [s.name for s in self.plan.stacks if s.name in csr and s.name in self.stacks]
        for s in stacks:
            if csr[s].unique_raw_ids is None:
                raise ValueError(
                    f"stack {s}: the batch has no raw ids (map_ids was run on it already, or it "
                    f"was not preprocessed for this plan)"
                )
            if s not in state.id_maps:
                raise ValueError(
                    f"stack {s}: the state has no id map (a state from EmbeddingCore.init holds "
                    f"one for every table of raw ids)"
                )
        return stacks

    def map_ids(
        self,
        state,
        csr: dict,
        *,
        keep_fresh: bool = False,
        after_update: dict | None = None,
    ):
        """The raw ids of the stacks of raw ids (`TableConfig.id_map`) mapped to rows:
        `(new state, csr, stats)`. Run it on a batch before `lookup` and
        `apply_gradients` (which refuse a batch with raw ids still in it), once a batch.

        Each device sends its distinct raw ids to their owners (the host routed them
        there: `host.dynamic_ids.owner_of`); each owner maps them with its id map
        (`id_map.map_ids`, at `state.step`), re-initialises the rows given to an id in
        this call (the table's initializer keyed by the id, the optimizer slots' initial
        values) and sends the rows back: the batch returned has rows in `unique_ids`
        (`PAD_ID` for an id pending admission or refused: a zero row, no update) and no
        raw ids, its pairs grouped by slot in slot order; on CPU each block's rows in the
        host's order of its raw ids (first sighting on the source; the fused update takes
        distinct rows in any order: 1.3 ms a step of 8 tables' reorder saved), elsewhere
        ascending, as the host orders a table of rows (`id_map.sort_mapped`). Other stacks
        pass through unchanged. `stats`: `{stack: {name: int32}}`, `ID_STATS` summed over
        the owners. Pure: jit it, donate the state.

        `after_update`: the batch of an `apply_gradients` that `state` comes from in the
        same program: the map starts after that update's last write. Each stack's update
        reads the table the previous one wrote (`shard_program.after`); unless the map's
        in-place writes follow those reads in data, XLA copies the tables (14 whole-table
        copies a step of 8 tables, 100 ms at 10^6 rows x dim 8).

        With `keep_fresh`, returns `(state, csr, stats, fresh)` too: `fresh`, what each
        owner re-initialised (its received ids' rows, fresh flags and raw ids), for
        `reinit_fresh_rows` to do again after an update that ran late (pipelining: the
        previous batch's update, which may write a row this call gave to another id)."""
        stacks = self._mappable(state, csr)
        if not stacks:
            return (state, csr, {}, {}) if keep_fresh else (state, csr, {})
        tables = {s: state.tables[s] for s in stacks}
        slots = {s: state.slots[s] for s in stacks}
        maps = {s: state.id_maps[s]["map"] for s in stacks}
        keys = {s: state.id_maps[s]["key"] for s in stacks}
        ids = {s: csr[s].unique_ids for s in stacks}
        raws = {s: csr[s].unique_raw_ids for s in stacks}
        pairs = {s: (csr[s].pair_rows, csr[s].pair_unique, csr[s].pair_gains) for s in stacks}

        lead = self._leading(state, self._last_updated(after_update))

        def body(tables, slots, maps, keys, step, ids, raws, pairs, lead):
            out_t, out_s, out_m, out_rows, out_stats, kept = {}, {}, {}, {}, {}, {}
            out_pairs = {}
            previous = next(iter(lead.values()), None)
            for s in stacks:
                m = maps[s]  # this shard's block, [1, ...] (id_map.map_ids takes it so)

                def reinit(table, sl, rows, fresh, raw, s=s):
                    kept[s] = (rows[None], fresh[None], raw[None])
                    return self._reinit_fresh(s, keys[s], table, sl, rows, fresh, raw)

                table, sl, m, rows, stats = self.strategies[s].map_ids(
                    tables[s],
                    slots[s],
                    m,
                    self._after(ids[s][0], previous),
                    raws[s][0],
                    step,
                    reinit,
                )
                previous = rows
                out_t[s], out_s[s], out_rows[s] = table, sl, rows
                out_m[s] = m
                out_stats[s] = jnp.stack([stats[k] for k in ID_STATS])[None]
            if as_is:  # the CPU kernels: the blocks as the maps gave them, pairs unmoved
                rows = {s: r[None] for s, r in out_rows.items()}
                return out_t, out_s, out_m, rows, (out_stats, kept, None)
            # this source's blocks in the host's order for a table of rows, every stack's
            # in one call (its threads share them out)
            ordered = id_map.sort_mapped_many(
                [(out_rows[s], *(x[0] for x in pairs[s])) for s in stacks],
                [csr[s].rows_per_device for s in stacks],
            )
            for s, (rows, *moved) in zip(stacks, ordered):
                out_rows[s] = rows[None]
                out_pairs[s] = tuple(x[None] for x in moved)
            return out_t, out_s, out_m, out_rows, (out_stats, kept, out_pairs)

        # Blocks left as the maps gave them (`id_map.blocks_as_mapped`): the pairs are not
        # outputs of the program (returned unchanged, they cost a copy each: 24 of ~30 us
        # a step of 8 tables, beside the first map's call); else sorted as the host orders
        # a table of rows.
        as_is = id_map.blocks_as_mapped()
        kept_like = {s: (0, 0, 0) for s in stacks}  # (rows, fresh flags, raw ids) a stack
        fn = self._shard_map(
            body,
            in_specs=self._specs(tables, slots, maps, P(), P(), ids, raws, pairs, lead),
            out_specs=(
                *self._specs(tables, slots, maps, ids),
                (self._specs(ids), self._specs(kept_like), None if as_is else self._specs(pairs)),
            ),
        )
        new_t, new_s, new_m, rows, (counts, kept, moved) = fn(
            tables, slots, maps, keys, state.step, ids, raws, pairs, lead
        )
        state = dataclasses.replace(
            state,
            tables=dict(state.tables, **new_t),
            slots=dict(state.slots, **new_s),
            id_maps=dict(state.id_maps, **{s: {"map": new_m[s], "key": keys[s]} for s in stacks}),
        )
        csr = dict(csr)
        for s in stacks:
            pairs = (csr[s].pair_rows, csr[s].pair_unique, csr[s].pair_gains)
            csr[s] = _with_rows(csr[s], rows[s], pairs if as_is else moved[s])
        stats = {s: {k: counts[s][:, i].sum() for i, k in enumerate(ID_STATS)} for s in stacks}
        return (state, csr, stats, kept) if keep_fresh else (state, csr, stats)

    def find_rows(self, state, csr: dict) -> dict:
        """`map_ids` read-only, for an evaluation lookup: the batch with the rows the id
        maps hold for its raw ids (`PAD_ID`, a zero row, for an id they do not hold, as
        serving reads it) and no raw ids; the state is only read (no admission, eviction,
        count, last-used step or fresh row). Other stacks pass through unchanged. The
        rows and pairs come in the order `map_ids` gives them, so `lookup` reads what
        it would read after a `map_ids` that admitted nothing. Pure: jit it (nothing to
        donate). A stack mapped already (no raw ids) passes through too."""
        raw = {s: c for s, c in csr.items() if getattr(c, "unique_raw_ids", None) is not None}
        stacks = self._mappable(state, raw)
        if not stacks:
            return csr
        maps = {s: state.id_maps[s]["map"] for s in stacks}
        ids = {s: csr[s].unique_ids for s in stacks}
        raws = {s: csr[s].unique_raw_ids for s in stacks}
        pairs = {s: (csr[s].pair_rows, csr[s].pair_unique, csr[s].pair_gains) for s in stacks}
        as_is = id_map.blocks_as_mapped()

        def body(maps, ids, raws, pairs):
            found, previous = {}, None
            for s in stacks:
                found[s] = self.strategies[s].find_ids(
                    maps[s], self._after(ids[s][0], previous), raws[s][0]
                )
                previous = found[s]
            if as_is:  # (see `map_ids`)
                return {s: r[None] for s, r in found.items()}, None
            ordered = id_map.sort_mapped_many(
                [(found[s], *(x[0] for x in pairs[s])) for s in stacks],
                [csr[s].rows_per_device for s in stacks],
            )
            rows = {s: r[None] for s, (r, *_) in zip(stacks, ordered)}
            return rows, {
                s: tuple(x[None] for x in moved) for s, (_, *moved) in zip(stacks, ordered)
            }

        fn = self._shard_map(
            body,
            in_specs=self._specs(maps, ids, raws, pairs),
            out_specs=(self._specs(ids), None if as_is else self._specs(pairs)),
        )
        rows, moved = fn(maps, ids, raws, pairs)
        out = dict(csr)
        for s in stacks:
            out[s] = _with_rows(csr[s], rows[s], pairs[s] if as_is else moved[s])
        return out

    def reinit_fresh_rows(self, state, fresh: dict, *, after_update: dict | None = None):
        """The rows a `map_ids(keep_fresh=True)` call gave to an id, re-initialised again
        (the same values: keyed by the id; the slots' initial values), the other rows
        as they are: after an update of an earlier batch that ran after that call
        (pipelining), whose gradient of an evicted id would otherwise land on the row
        of the id that took it. Pure: jit it, donate the state. `after_update`: as
        `map_ids`'s (the update of that batch ran before, in the same program)."""
        stacks = [s for s in fresh if s in self.stacks]
        if not stacks:
            return state
        tables = {s: state.tables[s] for s in stacks}
        slots = {s: state.slots[s] for s in stacks}
        keys = {s: state.id_maps[s]["key"] for s in stacks}
        kept = {s: fresh[s] for s in stacks}
        lead = self._leading(state, self._last_updated(after_update))

        def body(tables, slots, keys, kept, lead):
            out_t, out_s = {}, {}
            previous = next(iter(lead.values()), None)
            for s in stacks:
                rows, flags, raw = (x[0] for x in kept[s])
                rows = self._after(rows, previous)  # its writes after the update's reads
                out_t[s], out_s[s] = self._reinit_fresh(
                    s, keys[s], tables[s], slots[s], rows, flags, raw
                )
                previous = out_t[s]
            return out_t, out_s

        fn = self._shard_map(
            body,
            in_specs=self._specs(tables, slots, P(), kept, lead),
            out_specs=self._specs(tables, slots),
        )
        new_t, new_s = fn(tables, slots, keys, kept, lead)
        return dataclasses.replace(
            state, tables=dict(state.tables, **new_t), slots=dict(state.slots, **new_s)
        )

    def read(self, state, table, field: str = "parameters") -> dict:
        """A table of raw ids on the host: `{raw id (int): (shard, row in the shard's map,
        values)}` for its live ids (`field`: "parameters" or a slot name)."""
        t = self.plan.table(table)
        if t.stack not in self.stacks:
            raise ValueError(f"table {t.name} is not a table of raw ids (TableConfig.id_map)")
        _, config = self.stacks[t.stack]
        arr, column = self.core.field_array(state, t.stack, field)
        width = self.core.field_width(t, field)
        host = np.asarray(jax.device_get(arr))
        maps = jax.device_get(state.id_maps[t.stack]["map"])
        per_shard = host.shape[0] // self.num_shards
        out = {}
        for j in range(self.num_shards):
            m = jax.tree_util.tree_map(lambda x, j=j: np.asarray(x)[j], maps)
            for raw, row in id_map.live_ids(m).items():
                at = j * per_shard + t.local_row_offset + row
                out[raw] = (j, row, host[at, column : column + width].copy())
        return out


def _with_rows(c, rows, pairs):
    """The batch `c` of one stack with its raw ids replaced by the rows they map to, and
    its pairs `(rows, unique, gains)` (moved to the owners' order where they were moved;
    the host's `pairs_by_row` dropped: it ordered the pairs the host made)."""
    pr, pu, pg = pairs
    return dataclasses.replace(
        c,
        unique_ids=rows,
        unique_raw_ids=None,
        pair_rows=pr,
        pair_unique=pu,
        pair_gains=pg,
        pairs_by_row=None,
    )
