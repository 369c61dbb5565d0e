"""The host side of a host tier: a stack's full rows in host memory, and the directory
of the row cache that stands for the stack on the devices.

A stack too big for the devices keeps all its rows (and its optimizer slots) here, in
numpy, in the device layout (`[shards, rows a shard, columns]`: a device row, slots in
its columns where the stack keeps them there, moves as one). Each device holds `C`
rows of its shard in a cache (`embedmesh.device.host_tier`), and the step programs run
on the cache as if it were the table: before a batch's lookup, the batch's distinct
rows that are not cached (its misses) are gathered here, written into cache rows whose
rows no step in flight needs (their victims, chosen by CLOCK: a second chance to rows
used since the hand last passed), and the victims' rows are read back and written here
(`write_back`, one batch later: by then the device has long finished the swap). The
batch's row ids are then mapped to cache rows. Any victim order gives the same tables:
a row's updates all happen in the cache, where it stays while a batch needs it.

Pure numpy; one `StackTier` a stack. `check` checks a batch (raising, nothing changed,
when its misses do not fit the cache) before `commit` changes the directory, so a
batch that does not fit leaves the tier as it was. The rows a swap moves (tens of MB a
step) are copied by a few threads, each a block of rows (numpy's row gathers and
scatters release the GIL): one thread is bound by memory latency, not bandwidth.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading

import numpy as np

from embedmesh._runtime import PAD_ID

__all__ = ["StackTier", "Swap"]

_MIN_SCAN = 4096  # cache rows the CLOCK hand looks at in one vectorised pass, at least
_MIN_BLOCK = 8192  # rows a copying thread takes at least (fewer: not worth a thread)
_MIN_LOOKUPS = 8  # the directory's reads and writes: 8x as many a thread (4-byte entries)
_pool: tuple | None = None  # (threads, process id, ThreadPoolExecutor)
_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Threads that copy a swap's rows: the process's cores, at most 8 (more add no
    memory bandwidth)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _in_blocks(fn, n: int, scale: int = 1) -> None:
    """`fn(a, b)` over blocks `[a, b)` covering `range(n)`, on a pool of threads when
    there are enough for more than one block of `scale * _MIN_BLOCK` (disjoint blocks)."""
    k = max(1, min(copy_threads(), n // (scale * _MIN_BLOCK)))
    if k == 1:
        fn(0, n)
        return
    global _pool
    with _pool_lock:
        # (a forked child has the pool but not its threads: it makes its own)
        if _pool is None or _pool[0] < k or _pool[1] != os.getpid():
            if _pool is not None and _pool[1] == os.getpid():
                _pool[2].shutdown(wait=False)  # (a smaller one: its threads end)
            pool = concurrent.futures.ThreadPoolExecutor(k, thread_name_prefix="embedmesh-tier")
            _pool = (k, os.getpid(), pool)
        pool = _pool[2]
    bounds = [n * i // k for i in range(k + 1)]
    for f in [pool.submit(fn, a, b) for a, b in zip(bounds[:-1], bounds[1:])]:
        f.result()  # (raises a block's error)


def _padded(count: int) -> int:
    """The rows a swap moves for `count` misses: at least 1024, rounded up to an eighth
    of their power of two (few shapes to compile, at most 1/8 of the rows padding)."""
    step = max(1024, (1 << max(0, int(count - 1).bit_length())) // 8)
    return max(1024, -(-count // step) * step)


def _take(src: np.ndarray, index: np.ndarray, out=None, scale: int = 1) -> np.ndarray:
    """`src[index]` (`index` in range along the first axis: "clip" then copies straight
    into `out`, a new array where None), gathered in blocks on threads (random reads of a
    big array: several threads keep more of them in flight); `scale`: `_in_blocks`'."""
    if out is None:
        out = np.empty(index.shape + src.shape[1:], src.dtype)
    _in_blocks(
        lambda a, b: np.take(src, index[a:b], axis=0, out=out[a:b], mode="clip"),
        index.size,
        scale,
    )
    return out


@dataclasses.dataclass(frozen=True)
class Swap:
    """One batch's change to a stack's cache: `slots` `[N, M]` (cache rows to fill, `C`
    padding: out of range, dropped), `rows` (per shard, the stack rows loaded into
    them), `victims` (per shard, `(positions in slots, stack rows)` of the rows they held,
    which the device hands back for `write_back`), `used` (per shard, the batch's cache
    rows) and `ids` (the batch's `unique_ids` mapped to cache rows)."""

    slots: np.ndarray
    rows: tuple
    victims: tuple
    used: tuple
    ids: np.ndarray


class StackTier:
    """A stack's rows in host memory and its device cache's directory.

    `arrays`: the stack's fields (the table array, then each slot kept apart), each
    `[N, S, ...]`; `slot_of[j, r]`: the cache row holding stack row `r` of shard `j`
    (-1: not cached); `row_of[j, c]`: the stack row in cache row `c` (-1: free)."""

    def __init__(
        self, name: str, tables: tuple, num_shards: int, rows: int, cache_rows: int, fields: tuple
    ):
        if not 1 <= cache_rows <= rows:
            raise ValueError(
                f"host tier of stack {name}: cache rows a device must be in [1, {rows}] "
                f"(the stack's rows a device), got {cache_rows}"
            )
        self.name, self.tables = name, tuple(tables)
        self.num_shards, self.rows, self.cache_rows = int(num_shards), int(rows), int(cache_rows)
        n, s, c = self.num_shards, self.rows, self.cache_rows
        # fields: ((trailing shape, dtype, initial value), ...)
        self.arrays = [np.empty((n, s) + tuple(shape), dtype) for shape, dtype, _ in fields]
        for arr, (_, _, value) in zip(self.arrays, fields):
            arr[...] = np.asarray(value, arr.dtype)
        self.slot_of = np.full((n, s), -1, np.int32)
        self.row_of = np.full((n, c), -1, np.int32)
        self.ref = np.zeros((n, c), bool)
        self._mask = np.zeros(c, bool)  # `commit`'s held rows, all False between batches
        self.hand = np.zeros(n, np.int64)
        self.in_flight: tuple | None = None  # `used` of the last batch swapped in
        self.misses = 0  # rows the last batch swapped in
        self._pending: tuple | None = None  # (victims, device array of their rows)
        self._checked: tuple | None = None  # (`check`'s needed rows, their cache rows)

    def reset(self) -> None:
        """Empty the cache (its rows' values are the host's: a new state was set)."""
        self._pending = self._checked = None
        self.slot_of.fill(-1)
        self.row_of.fill(-1)
        self.ref.fill(False)
        self.hand.fill(0)
        self.in_flight = None

    # -- a batch in ----------------------------------------------------------------

    def _needed(self, unique_ids: np.ndarray) -> list:
        """Per shard, the distinct stack rows any device of this process reads of it."""
        ids = np.asarray(unique_ids)
        out = []
        for j in range(self.num_shards):
            sub = ids[:, j]
            valid = sub[sub != PAD_ID]
            if ids.shape[0] > 1:  # several devices' lists: one sorted, distinct list
                valid = np.sort(valid)
                valid = valid[np.r_[True, valid[1:] != valid[:-1]]] if valid.size else valid
            out.append(valid)  # (one device's list is distinct already)
        return out

    def check(self, unique_ids: np.ndarray, pin: bool) -> list:
        """The batch's rows per shard; ValueError (nothing changed) when its misses do not
        fit the cache rows neither it nor, with `pin`, the batch in flight holds."""
        needed = self._needed(unique_ids)
        found = []
        for j, need in enumerate(needed):
            if need.size and (need.max() >= self.rows or need.min() < 0):
                raise ValueError(
                    f"host tier of stack {self.name}: row {int(need.max())} of shard {j} is "
                    f"outside its {self.rows} rows"
                )
            slots = _take(self.slot_of[j], need, scale=_MIN_LOOKUPS)
            found.append(slots)
            hits = slots[slots >= 0]
            misses = need.size - hits.size
            held = self._held(j, hits, pin)
            free = self.cache_rows - held.size
            least = need.size + (self.cache_rows - free - hits.size)
            if misses > free:
                raise ValueError(
                    f"host tier of stack {self.name} (tables {list(self.tables)}): device {j}'s "
                    f"cache of {self.cache_rows} rows cannot take this batch: it needs "
                    f"{need.size} distinct rows, {misses} of them not cached, and only {free} "
                    f"cache rows are not held by this batch"
                    + (" or by the update in flight" if pin else "")
                    + f"; give the tier a cache of at least {least} rows"
                    f" (host_tier_cache_rows) or use smaller batches. Nothing was changed"
                )
        self._checked = (needed, found)  # (`commit` of these rows reuses their slots)
        return needed

    def _held(self, j: int, hits: np.ndarray, pin: bool) -> np.ndarray:
        """Shard j's cache rows a swap may not take: the batch's hits and, with `pin`,
        the rows of the batch in flight (distinct)."""
        if not (pin and self.in_flight is not None):
            return hits  # (distinct: distinct rows have distinct cache rows)
        mask, flight = self._mask, self.in_flight[j]
        mask[hits] = True
        extra = flight[~mask[flight]]
        mask[hits] = False
        return np.concatenate([hits, extra])

    def _victims(self, j: int, count: int, held: np.ndarray) -> np.ndarray:
        """`count` cache rows of shard j not `held`, by CLOCK: free or unused since the
        hand last passed (the hand clears the use bits it passes over)."""
        out, c = [], self.cache_rows
        ref, hand = self.ref[j], int(self.hand[j])
        while count > 0:
            w = min(c, max(4 * count, _MIN_SCAN))
            if hand + w <= c:  # (the window does not wrap: slices, no index arrays)
                w_held, w_ref, first = held[hand : hand + w], ref[hand : hand + w], hand
            else:
                idx = (hand + np.arange(w)) % c
                w_held, w_ref, first = held[idx], ref[idx], None
            ok = np.flatnonzero(~w_held & ~w_ref)
            cut = int(ok[count - 1]) + 1 if ok.size >= count else w
            ok = ok[:count]
            if first is not None:
                chosen = first + ok
                ref[first : first + cut] = False
            else:
                chosen = idx[ok]
                ref[idx[:cut]] = False
            held[chosen] = True
            out.append(chosen)
            count -= chosen.size
            hand = (hand + cut) % c
        self.hand[j] = hand
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def commit(self, unique_ids: np.ndarray, needed: list, pin: bool) -> Swap:
        """The batch's `Swap` (`check`ed first), the directory updated to it."""
        n, c = self.num_shards, self.cache_rows
        loads, victims, used = [], [], []
        checked, self._checked = self._checked, None
        found = checked[1] if checked is not None and checked[0] is needed else None
        for j, need in enumerate(needed):
            slots = _take(self.slot_of[j], need, scale=_MIN_LOOKUPS) if found is None else found[j]
            hit = slots >= 0
            hits = slots[hit]
            ref = self.ref[j]
            ref[hits] = True
            miss = need[~hit].astype(np.int32)
            chosen = np.zeros(0, np.int32)
            if miss.size:  # (the hand clears use bits: after the batch's hits are marked)
                kept = self._held(j, hits, pin)
                self._mask[kept] = True  # (a mask kept between batches: no [C] array a batch)
                try:
                    chosen = self._victims(j, miss.size, self._mask).astype(np.int32)
                finally:
                    self._mask[kept] = False
                self._mask[chosen] = False
            old = self.row_of[j, chosen]
            had = np.flatnonzero(old >= 0)
            self.slot_of[j, old[had]] = -1
            self.row_of[j, chosen] = miss
            where = self.slot_of[j]
            _in_blocks(
                lambda a, b, w=where, m=miss, v=chosen: w.__setitem__(m[a:b], v[a:b]),
                miss.size,
                _MIN_LOOKUPS,
            )
            self.ref[j, chosen] = True
            loads.append((chosen, miss))
            victims.append((had, old[had]))
            slots = slots.copy()
            slots[~hit] = chosen
            used.append(slots)  # (= slot_of[j, need] now)
        m = _padded(max((x[0].size for x in loads), default=0))
        slots = np.full((n, m), c, np.int32)
        for j, (chosen, _) in enumerate(loads):
            slots[j, : chosen.size] = chosen
        ids = np.array(unique_ids, np.int32, copy=True)
        for j in range(n):
            sub = ids[:, j]
            valid = sub != PAD_ID
            # one device's list is `needed`'s, in its order: its cache rows are `used`
            if ids.shape[0] == 1:
                sub[valid] = used[j]
            else:
                sub[valid] = _take(self.slot_of[j], sub[valid], scale=_MIN_LOOKUPS)
        self.in_flight = tuple(used)
        self.misses = sum(rows.size for _, rows in loads)  # (statistics: this batch's)
        return Swap(slots, tuple(x[1] for x in loads), tuple(victims), tuple(used), ids)

    def gather(self, swap: Swap, field: int) -> np.ndarray:
        """`[N, M, ...]`: field `field`'s host rows the swap loads (zeros as padding)."""
        arr = self.arrays[field]
        out = np.empty(swap.slots.shape + arr.shape[2:], arr.dtype)
        for j, rows in enumerate(swap.rows):  # (rows in range: `check`ed)
            out[j, rows.size :] = 0
            _take(arr[j], rows, out=out[j, : rows.size])
        return out

    # -- rows back -----------------------------------------------------------------

    def pending(self, swap: Swap, old_rows: tuple) -> None:
        """Record the device arrays `old_rows` (one a field, `[N, M, ...]`) of `swap`'s
        victims, written back at the next `write_back`."""
        self.write_back()
        self._pending = (swap.victims, old_rows)

    def write_back(self) -> None:
        """Write the last swap's victims' rows into the host arrays (waits for that swap)."""
        if self._pending is None:
            return
        victims, old_rows = self._pending
        self._pending = None
        if not any(rows.size for _, rows in victims):
            return
        for arr, old in zip(self.arrays, old_rows):
            host = np.asarray(old)
            for j, (pos, rows) in enumerate(victims):
                src, dst = host[j], arr[j]
                # every slot filled held a row (a full cache): the victims lead the swap
                lead = pos.size > 0 and int(pos[-1]) == pos.size - 1

                def put(a, b, src=src, dst=dst, pos=pos, rows=rows, lead=lead):
                    dst[rows[a:b]] = src[a:b] if lead else src[pos[a:b]]

                _in_blocks(put, rows.size)

    def cached(self, j: int) -> tuple:
        """`(cache rows, stack rows)` of shard j's cached rows."""
        slots = np.flatnonzero(self.row_of[j] >= 0)
        return slots, self.row_of[j, slots]
