"""The step programs of a job and its schedule as a frozen value.

`Programs`: the jitted programs of one core (the lookup, the update, the update fused
with the next lookup, the map of raw ids to rows before the lookup, ...), made once a
job. `Schedule`: everything a training loop carries between calls besides the batch
(the state the next lookup reads, the update still to apply, the owners' view of the
last lookup, the state to install after a lookup when restored mid-pipeline, the id
maps' latest counts). Each transition (`dequeue`, `accept`, `flush`, `observe`) takes a
schedule and returns the next, so pipelining, raw ids and a restore mid-pipeline are
one function here, not branches of a stateful class.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embedmesh.device import ops
from embedmesh.device.core import ID_STATS, EmbeddingState

__all__ = ["Programs", "Schedule", "evaluate", "for_evaluation", "infer_step", "return_free_heap"]


def return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`).

    Building a layer (table pieces, the planner's statistics) and compiling its
    programs (XLA's LLVM) free tens of MB into malloc's arenas, which glibc keeps
    resident (30-40 MB less peak RSS in training). Called twice a job: after it is
    built, after its first update program compiles. A no-op off glibc."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
            _MALLOC_TRIM.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc
            pass
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None  # None: not looked up yet; False: unavailable (not glibc)

# The update programs compiled in threads of their own while the first lookup compiles
# (`Programs.warm_updates`): True, False, or None (the default) where the mesh's devices
# are not CPUs. An accelerator's compiler runs on the host, whose cores are otherwise
# idle then; on CPU they are the devices, and a job that never updates would pay for it.
BACKGROUND_COMPILE: bool | None = None

_log = logging.getLogger(__name__)

_MAPPED_FIELDS = ("unique_ids", "pair_rows", "pair_unique", "pair_gains")


def _mapped_rows(csr: dict, state, mapped: dict, stats: dict, *rest) -> tuple:
    """`EmbeddingCore.map_ids`'s `(state, csr, stats[, fresh])` with the batch reduced to
    what the map changed, `{stack: (rows, pair_rows, pair_unique, pair_gains)}` (the
    stacks whose raw ids became rows: their rows, and their pairs in the rows' order;
    None for an array the map left as it was, the pairs where the CPU kernels run it),
    for a program to return in place of the batch, whose unchanged arrays it would copy
    (24 copies of ~30 us a step of 8 tables of raw ids); and the counts as one int32
    array `[stacks, len(ID_STATS)]`, the stacks sorted (`id_counts` reads it): a
    program's every output costs its dispatch 3-4 us on CPU, and the counts were 6 a
    stack."""
    rows = {
        s: tuple(
            None if getattr(c, f) is getattr(csr[s], f) else getattr(c, f) for f in _MAPPED_FIELDS
        )
        for s, c in mapped.items()
        if c.unique_raw_ids is None and getattr(csr[s], "unique_raw_ids", None) is not None
    }
    counts = (
        jnp.stack([jnp.stack([stats[s][k] for k in ID_STATS]) for s in sorted(stats)])
        if stats
        else None
    )
    return (state, rows, counts, *rest)


def _id_counts(rows: dict, counts) -> tuple:
    """What a schedule keeps of a map's counts: `(stacks, counts)`."""
    return (tuple(sorted(rows)), counts) if counts is not None else ()


def _with_rows(csr: dict, rows: dict) -> dict:
    """The batch `EmbeddingCore.map_ids` returns, from the batch it took and what
    `_mapped_rows` kept: each mapped stack with its rows, its reordered pairs (or the
    pairs it had; reordered, without the host's `pairs_by_row`) and no raw ids, the others
    as they are (the same arrays)."""
    return {
        s: (
            dataclasses.replace(
                c,
                unique_raw_ids=None,
                **{f: x for f, x in zip(_MAPPED_FIELDS, rows[s]) if x is not None},
                **({"pairs_by_row": None} if any(x is not None for x in rows[s][1:4]) else {}),
            )
            if s in rows
            else c
        )
        for s, c in csr.items()
    }


def fused_step(core, st, g, c_prev, view, c_next, check_finite: bool = False) -> tuple:
    """`((activations, the owners' view of c_next), state, ok)`: the lookup of `c_next`
    fused with the update of the earlier batch `c_prev` (the pipelined step: the lookup
    reads the tables before the update)."""
    acts, st, ok, next_view = core.lookup_then_apply_gradients(
        st, g, c_prev, c_next, check_finite=check_finite, view=view, carrying=True
    )
    return (acts, next_view), st, ok


def infer_step(core, st, c) -> tuple:
    """`(activations, the batch with rows)`: the evaluation lookup of `c`, which reads
    `st` and changes nothing: the raw ids of its tables of raw ids found by the id maps
    without admitting any (`core.find_rows`: an id they do not hold reads a zero row),
    then the lookup."""
    c = core.find_rows(st, c)
    return core.lookup(st, c), c


def for_evaluation(csr: dict, evaluation: bool = True) -> dict:
    """The batch `csr` marked (or, `evaluation=False`, unmarked) as an evaluation
    lookup's (`PartitionedCsrFormatTensor.evaluation`): its programs take it unmarked,
    the same programs as a training batch's; its outputs are marked, so an update
    refuses them."""
    return {
        s: c if c.evaluation == evaluation else dataclasses.replace(c, evaluation=evaluation)
        for s, c in csr.items()
    }


def map_ahead(core, st, c) -> tuple:
    """`core.map_ids(st, c, keep_fresh=True)` at the step the pending update brings (the
    pipelined map: its decisions are the unpipelined run's), the state's step kept:
    `(state, csr, stats, fresh)`; `refreshed` re-initialises the fresh rows after that
    update."""
    ahead = dataclasses.replace(st, step=st.step + 1)
    ahead, c, stats, fresh = core.map_ids(ahead, c, keep_fresh=True)
    return dataclasses.replace(ahead, step=st.step), c, stats, fresh


def refreshed(core, st, fresh, c_prev):
    """After the update of `c_prev`: the rows a map ahead gave to new ids re-initialised
    again (the update may hold the gradient of an id that map evicted)."""
    return core.reinit_fresh_rows(st, fresh, after_update=c_prev)


def _abstract(x):
    """`x`'s shape, dtype and sharding, a program's signature for it (`warm_updates`)."""
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)


class Programs:
    """The jitted programs of one `EmbeddingCore` (every lookup also returns the owners'
    view of its batch, `core.lookup`'s `carrying`, which that batch's update takes: the
    pairs cross once a step). Gradients are checked on the host side (`step_check`)
    before a deferred update runs: an in-program `cond` costs 2-10 ms a step on CPU."""

    # the programs a holder of the job may replace (`program_attributes`)
    NAMES = (
        *("lookup", "fused", "apply", "apply_lookup", "apply_copy", "step_check", "map"),
        *("map_lookup", "apply_map_lookup", "map_ahead", "fused_refresh", "map_keep"),
    )

    def __init__(self, core):
        self.trimmed = False  # the free heap returned after the first update compiled
        self.lookup = jax.jit(lambda st, c: core.lookup(st, c, carrying=True))

        def lookup_then_apply(st, g, c_prev, view, c_next):  # (named: traces show it)
            return fused_step(core, st, g, c_prev, view, c_next)[:2]

        def apply(st, g, c, view):
            return core.apply_gradients(st, g, c, check_finite=False, view=view)[0]

        def apply_then_lookup(st, g, c_prev, view, c_next):
            st = apply(st, g, c_prev, view)
            return core.lookup(st, c_next, carrying=True), st

        self.fused = jax.jit(lookup_then_apply, donate_argnums=0)
        self.apply = jax.jit(apply, donate_argnums=0)
        self.apply_lookup = jax.jit(apply_then_lookup, donate_argnums=0)
        # pipelined reads: the pending update applied into new buffers, the live state
        # (what the next lookup reads) left as it is
        self.apply_copy = jax.jit(apply)
        self.step_check = jax.jit(core.step_check)
        # evaluation (`evaluate`): reads the state, donates nothing
        self.infer = jax.jit(lambda st, c: infer_step(core, st, c))
        self._map_programs(core, lookup_then_apply, apply)
        # {program name: the thread compiling it} (`warm_updates`); None: not started yet
        self._warming: dict | None = None

    def warm_updates(self, core, pipelined: bool, state, csr: dict) -> None:
        """Once, at a job's first lookup: compile the programs its first update runs (the
        one fused with the next lookup, and unpipelined `apply`) in threads of their own,
        from the shapes the lookup will return, while this thread compiles the lookup:
        the first step then waits for the longest compile, not their sum. Only where
        `BACKGROUND_COMPILE` says so, and not for tables of raw ids or a host tier (their
        programs differ). A program whose call does not match these shapes (a gradient
        of another dtype or sharding) compiles again when called; a failed compile here
        is left for the call to raise. The threads are not daemons: a process ending
        before its first update waits for them (XLA's client must outlive a compile)."""
        if self._warming is not None:
            return
        self._warming = {}
        on = BACKGROUND_COMPILE
        if on is None:
            on = ops.on_accelerators(core.mesh)
        if not on or core.dynamic or getattr(core, "tier", None):
            return
        acts, view = jax.eval_shape(self.lookup, state, csr)
        n = core.mesh.size

        def placed(x):  # the lookup's outputs are row-sharded, its scalars replicated
            rows = x.ndim and x.shape[0] % n == 0
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=core.row_sharding if rows else core.replicated
            )

        acts, view = jax.tree.map(placed, (acts, view))
        # the state and batch as shapes too: the first update (`apply` donates the state)
        # may run before a thread has lowered its program from them
        state, csr = jax.tree.map(_abstract, (state, csr))
        # unpipelined: `apply` where the state is read after the first update (`flush`),
        # else the next dequeue's `apply_lookup`; pipelined: the next dequeue's `fused`
        fused = {"fused" if pipelined else "apply_lookup": (state, acts, csr, view, csr)}
        alone = {} if pipelined else {"apply": (state, acts, csr, view)}
        for name, args in {**alone, **fused}.items():
            thread = threading.Thread(
                target=self._compile, args=(name, args), name=f"embedmesh-{name}"
            )
            self._warming[name] = thread
            thread.start()

    def _compile(self, name: str, args: tuple) -> None:
        try:
            getattr(self, name).lower(*args).compile()  # kept in the jitted function's cache
        except Exception as e:  # noqa: BLE001 - the call compiles again and raises its own
            _log.debug("background compile of %s failed: %s", name, e)

    def ready(self, name: str) -> None:
        """Wait for program `name`'s compile in a thread, if one runs (`warm_updates`):
        a call before it ends would compile the program a second time."""
        thread = (self._warming or {}).pop(name, None)
        if thread is not None:
            thread.join()

    def _map_programs(self, core, lookup_then_apply, apply) -> None:
        """Tables of raw ids: their ids become rows before the lookup (`core.map_ids`).
        The map's programs return the new rows and pairs only (`_mapped_rows`), the
        batch made around them on the host (`_with_rows`): a program returning the whole
        batch copies its unchanged arrays out (~0.8 ms a step of 8 tables)."""

        def map_ids(st, c, c_prev=None):  # (named: the program's name in traces)
            return _mapped_rows(c, *core.map_ids(st, c, after_update=c_prev))

        self.map = jax.jit(map_ids, donate_argnums=0)

        # unpipelined, the pending update, the map (after it: the map may give that
        # update's rows to other ids) and the lookup as one program: one dispatch
        # instead of three of the whole state (each 0.4-1.1 ms of host CPU a step)
        def map_lookup(st, c, c_prev=None):
            st, rows, stats = map_ids(st, c, c_prev)
            return core.lookup(st, _with_rows(c, rows), carrying=True), st, rows, stats

        def apply_map_lookup(st, g, c_prev, view, c_next):
            return map_lookup(apply(st, g, c_prev, view), c_next, c_prev)

        self.apply_map_lookup = jax.jit(apply_map_lookup, donate_argnums=0)
        self.map_lookup = jax.jit(map_lookup, donate_argnums=0)

        # pipelined, an update pending: the next batch's ids are mapped first, at the
        # step that update brings (the map's decisions are the unpipelined run's), and
        # the rows it gave to an id are re-initialised again after that update (whose
        # gradient of an id evicted meanwhile may land on one): see `_map_ahead`
        self.map_ahead = jax.jit(
            lambda st, c: _mapped_rows(c, *map_ahead(core, st, c)), donate_argnums=0
        )

        def lookup_apply_refresh(st, g, c_prev, view, c_next, fresh):
            out, st = lookup_then_apply(st, g, c_prev, view, c_next)
            return out, refreshed(core, st, fresh, c_prev)

        self.fused_refresh = jax.jit(lookup_apply_refresh, donate_argnums=0)
        # (restored mid-pipeline: `_map_restored`; once, so nothing donated)
        self.map_keep = jax.jit(
            lambda st, c: _mapped_rows(c, *core.map_ids(st, c, keep_fresh=True))
        )
        self.reinit = jax.jit(core.reinit_fresh_rows)

    def trim_once(self) -> None:
        """After the first update ran: its compilation's temporaries back to the system
        (the step's own are small)."""
        if not self.trimmed:
            self.trimmed = True
            return_free_heap()


def program_attributes() -> dict:
    """`{"_<name>_fn": property}` for each of `Programs.NAMES`: a holder's (the facade's)
    settable attribute for `holder.job.programs.<name>`, where a test puts a spy."""

    def one(name: str) -> property:
        return property(
            lambda holder: getattr(holder.job.programs, name),
            lambda holder, fn: setattr(holder.job.programs, name, fn),
        )

    return {f"_{n}_fn": one(n) for n in Programs.NAMES}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """What a training loop carries between steps: `state` (what the next lookup reads),
    `pending` (`(checked gradients, batch, view)`: the update the next lookup applies),
    `view` (`(batch, the owners' view)` of the last lookup, which that batch's update
    takes), `after_lookup` (pipelined, restored from a checkpoint saved with an update
    pending: the state to install after the next lookup), `observed` (`(pending, state
    with it applied)`, a cached read), `id_stats` (the id maps' latest counts) and
    `applied` (the batch of the last accepted update, which is refused a second time)."""

    state: EmbeddingState | None
    pending: tuple | None = None
    view: tuple | None = None
    after_lookup: EmbeddingState | None = None
    observed: tuple | None = None
    id_stats: tuple = ()
    applied: dict | None = None

    def but(self, **changes) -> Schedule:
        return dataclasses.replace(self, **changes)


def _take_pending(s: Schedule) -> tuple:
    """`(the pending update (grads, csr, view), the schedule without it)`."""
    assert s.pending is not None
    return s.pending, s.but(pending=None, observed=None)


def dequeue(job, s: Schedule, csr: dict) -> tuple:
    """`(the core's activations {feature: array}, the batch with rows, next schedule)`:
    the lookup of `csr`, with the pending update (fused with the lookup, before it
    unpipelined, after it pipelined) and, for tables of raw ids, the map of raw ids to
    rows (after the pending update unpipelined, at that update's step pipelined)."""
    p = job.programs
    fresh = None
    if getattr(job.core, "tier", None):  # a host tier: the batch's misses into the caches
        csr, s = _swapped_in(job, s, csr)
    if any(getattr(c, "unique_raw_ids", None) is not None for c in csr.values()):
        if job.pipelined and s.pending is not None:
            csr, fresh, s = _map_ahead(p, s, csr)
        elif job.pipelined and s.after_lookup is not None:
            csr, s = _map_restored(p, s, csr)
        else:
            return _map_and_lookup(p, s, csr)
    if s.pending is not None:
        (grads, prev, view), s = _take_pending(s)
        if fresh is not None:  # pipelined, raw ids: see `_map_ahead`
            (acts, view), state = p.fused_refresh(s.state, grads, prev, view, csr, fresh)
        else:
            name = "fused" if job.pipelined else "apply_lookup"
            p.ready(name)
            (acts, view), state = getattr(p, name)(s.state, grads, prev, view, csr)
        p.trim_once()
        s = s.but(state=state)
    else:
        p.warm_updates(job.core, job.pipelined, s.state, csr)
        acts, view = p.lookup(s.state, csr)
        if s.after_lookup is not None:  # restored mid-pipeline: now up to date
            s = s.but(state=s.after_lookup, after_lookup=None)
    return acts, csr, s.but(view=(csr, view))


def _swapped_in(job, s: Schedule, csr: dict) -> tuple:
    """`(the batch placed, its rows the cache rows of a host tier, next schedule)`: the
    misses swapped in, never the rows of the pending update (so the swap commutes with
    it: `embedmesh.device.host_tier`)."""
    if s.after_lookup is not None:
        raise NotImplementedError("a host tier restored mid-pipeline")
    if s.pending is not None and not job.pipelined:
        # the update first: it runs on the devices while the host swaps, and holds no
        # cache rows (pipelined, the lookup reads the tables before it: rows held)
        s = flush(job, s)
    pending = s.pending[1] if s.pending is not None else None
    state, csr = job.core.swap_in(s.state, csr, pending, s.view[0] if s.view else None)
    return csr, s.but(state=state, observed=None)


def evaluate(job, s: Schedule, csr: dict) -> tuple:
    """`(the core's activations, the batch with rows, marked, next schedule)`: the
    evaluation lookup of `csr` (`training=False`), which changes no state. It reads what
    the next training lookup would read: unpipelined, every accepted update (a pending
    one applied first, as any read of the state applies it); pipelined, the tables one
    update stale, the pending update left pending. Tables of raw ids are read through
    their id maps without admitting, evicting or counting (`infer_step`). The schedule's
    view, pending update, id-map counts and last update are left as they are."""
    if not job.pipelined:
        s = flush(job, s)
    if getattr(job.core, "tier", None):  # a host tier: the rows it reads into the caches
        if s.pending is not None:  # pipelined: its swaps would meet the update held back
            raise NotImplementedError(
                "an evaluation lookup (training=False) of a pipelined layer with a host "
                "tier while an update is pending: call flush() first (the tables then "
                "have every update applied)"
            )
        csr, s = _swapped_in(job, s, csr)
    csr = for_evaluation(csr, False)
    p = job.programs
    if any(getattr(c, "unique_raw_ids", None) is not None for c in csr.values()):
        acts, csr = p.infer(s.state, csr)
    else:  # the training lookup's program (its view unused)
        acts, _ = p.lookup(s.state, csr)
    return acts, for_evaluation(csr), s


def _map_and_lookup(p: Programs, s: Schedule, csr: dict) -> tuple:
    """Unpipelined `dequeue` of a batch with raw ids: the pending update if any, the
    map, the lookup, in one program."""
    if s.pending is not None:
        (grads, prev, view), s = _take_pending(s)
        out = p.apply_map_lookup(s.state, grads, prev, view, csr)
        p.trim_once()
    else:
        out = p.map_lookup(s.state, csr)
    (acts, view), state, rows, counts = out
    csr = _with_rows(csr, rows)
    return acts, csr, s.but(state=state, view=(csr, view), id_stats=_id_counts(rows, counts))


def _map_ahead(p: Programs, s: Schedule, csr: dict) -> tuple:
    """Pipelined, an update pending: map the raw ids of the next batch `csr` before
    that update, `(csr with rows, what the map re-initialised, next schedule)`.

    The map runs at the step the pending update brings, so its decisions (rows,
    admissions, evictions, LRU/LFU order) are those of the unpipelined run, and
    reads the state the lookup reads (one update stale). The pending update may
    then hold the gradient of an id this map evicted, whose row it gave to another
    id: `dequeue` runs the update and re-initialises the rows given in this map
    again (`EmbeddingCore.reinit_fresh_rows`), so no update of an old id stays on
    a new id's row, as if the map had run after the update (the old id's values
    are discarded by its eviction either way)."""
    state, rows, counts, fresh = p.map_ahead(s.state, csr)
    return _with_rows(csr, rows), fresh, s.but(state=state, id_stats=_id_counts(rows, counts))


def _map_restored(p: Programs, s: Schedule, csr: dict) -> tuple:
    """Pipelined, restored from a checkpoint saved with an update pending (the next
    lookup reads `state`, the tables before that update; `after_lookup` has it
    applied): map `csr`'s raw ids with the restored state's maps at its step, as
    the saving run did (`_map_ahead`), into both states, the rows the map gave away
    re-initialised in the tables the lookup reads too. Returns `(csr with rows, next
    schedule)`."""
    full = s.after_lookup
    assert full is not None and s.state is not None
    stale = {k: a for k, a in s.state.tables.items() if a is not full.tables[k]}
    full, rows, counts, fresh = p.map_keep(full, csr)
    lookup = dataclasses.replace(full, tables=dict(full.tables, **stale), step=s.state.step)
    s = s.but(state=p.reinit(lookup, fresh), after_lookup=full, id_stats=_id_counts(rows, counts))
    return _with_rows(csr, rows), s


def accept(job, s: Schedule, grads: dict, csr: dict) -> Schedule:
    """The schedule with an update of checked gradients `grads` of batch `csr` accepted:
    pending until the next lookup, which applies it (an update still pending first
    applied: two updates without a lookup between them). An empty batch (0 samples) is
    a no-op update that still counts a step, as it would on TensorFlow."""
    s = flush(job, s).but(applied=csr)
    if all(c.rows_per_device == 0 for c in csr.values()):
        # nothing to move (the update program cannot take empty partitions)
        return s.but(state=dataclasses.replace(s.state, step=s.state.step + 1))
    # the owners' view of these outputs, when they are the last dequeue's
    last = s.view
    view = last[1] if last is not None and last[0] is csr else {}
    return s.but(pending=(grads, csr, view))


def flush(job, s: Schedule) -> Schedule:
    """The schedule with no update waiting for the next lookup (in pipelined mode the
    next lookup then sees it, which changes the trajectory)."""
    if s.after_lookup is not None:
        s = s.but(state=s.after_lookup, after_lookup=None)
    if s.pending is None:
        return s
    (grads, csr, view), s = _take_pending(s)
    job.programs.ready("apply")
    return s.but(state=job.programs.apply(s.state, grads, csr, view))


def observe(job, s: Schedule) -> tuple:
    """`(the state with every accepted update applied, next schedule)`, without changing
    what the next lookup sees: unpipelined, the state itself (the pending update
    applied); pipelined, a pending update applied into new arrays (one extra copy of
    the touched stacks while they are held), cached in the schedule."""
    if s.after_lookup is not None:
        return s.after_lookup, s
    if s.pending is None:
        return s.state, s
    if not job.pipelined:
        s = flush(job, s)
        return s.state, s
    if s.observed is None or s.observed[0] is not s.pending:
        grads, csr, view = s.pending
        s = s.but(observed=(s.pending, job.programs.apply_copy(s.state, grads, csr, view)))
    return s.observed[1], s


def checkpoint_state(job, s: Schedule) -> tuple:
    """`((observed state, {stack: parameters the next lookup reads}), next schedule)`:
    what a checkpoint stores. The second is empty unless pipelined with an update
    pending (or restored with one), and then holds only the stacks that update touches."""
    state, s = observe(job, s)
    if not job.pipelined or (s.after_lookup is None and s.pending is None):
        return (state, {}), s
    if s.after_lookup is not None:
        return (state, {k: a for k, a in s.state.tables.items() if a is not state.tables[k]}), s
    _, csr, _ = s.pending
    return (state, {k: s.state.tables[k] for k in csr}), s


def install_restored(job, s: Schedule, restored) -> Schedule:
    """The schedule of a restored state (`embedmesh.checkpoint.RestoredState`): pipelined
    with lookup tables, the next lookup reads `restored.lookup_state()` and
    `restored.state` is installed right after it; a pending update is dropped."""
    if job.pipelined and restored.lookup_tables:
        return Schedule(restored.lookup_state(), None, s.view, restored.state, None, s.id_stats)
    return Schedule(restored.state, None, s.view, None, None, s.id_stats)


def check_step(job, grads: dict, csr: dict) -> None:
    """Before an update is accepted: FloatingPointError for a non-finite gradient
    (with check_finite) and, in a multi-process job, RuntimeError when the
    processes' steps paired different batches. Each process counts its enqueue
    attempts, failed ones included, and carries the count with the batch
    (`PartitionedCsrFormatTensor.batch_number`); a process that caught an
    enqueue error and went on, or enqueued a batch twice, is one off from the
    others, which without this check would pair its batches with theirs, silently
    wrong. Both checks ride one exchange and one host read a step
    (`EmbeddingCore.step_check`); either error leaves the tables untouched.
    """
    check = grads if job.spec.check_finite else {}
    number = next((c.batch_number for c in csr.values() if c.batch_number is not None), None)
    if not check and number is None:
        return
    finite, low, high = (int(x) for x in np.asarray(job.programs.step_check(check, number)))
    if low != high:
        # (-1: a batch this job did not enqueue, e.g. from preprocess_features)
        mine = -1 if number is None else int(np.asarray(number.addressable_data(0))[0])
        raise RuntimeError(
            f"this step paired different batches: process {jax.process_index()} is at "
            f"batch {mine}, another process at batch {high if mine == low else low} "
            f"(batches counted from 1 by enqueue attempts, failed ones included): a "
            f"process skipped or repeated a batch (did one catch an enqueue error and "
            f"continue?). Every process must enqueue the same number of batches; the "
            f"update was not applied and the tables are unchanged"
        )
    if not finite:
        bad = [n for n, g in grads.items() if not bool(jnp.all(jnp.isfinite(g)))]
        raise FloatingPointError(
            f"non-finite gradient for feature(s) {bad}; the update was "
            f"not applied and the tables are unchanged"
        )
