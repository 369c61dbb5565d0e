"""Table-wise tables grouped into stacks and packed onto their owners: which table-wise
tables share a stack (a stacked array costs every device its fullest owner's block, so a
narrow table joins a wider stack only where that saves bytes on every device), and which
shard owns each (largest first onto the emptiest shard; a table spread over several
consecutive shards first, onto the ones whose fullest has the fewest rows).
`embedmesh.layout.stacking` plans with these; its choice of which tables to spread, and
over how many shards, stays there.
"""

from __future__ import annotations

import functools
import heapq

__all__ = ["merge_table_wise", "owners_of", "pack_owners", "spread_order"]


def pack_owners(rows: list, n: int, load: list | None = None, used: list | None = None) -> tuple:
    """Greedy bin packing of table-wise blocks onto n shards (LPT): the items (their rows)
    largest first (then in the given order), each onto the shard with the fewest rows so
    far (`used`: the rows a shard holds already, default none; ties: the least `load`, the
    bytes of table-wise rows a shard holds over all stacks, updated by the caller; then
    the lowest index). Returns (shard of each item, rows per shard): the stack's
    table-wise block is the most rows a shard gets."""
    used = [0] * n if used is None else list(used)
    where = [0] * len(rows)
    for k in sorted(range(len(rows)), key=lambda k: (-rows[k], k)):
        j = min(range(n), key=lambda j: (used[j], load[j] if load is not None else 0, j))
        where[k] = j
        used[j] += rows[k]
    return where, used


def _stack_bytes(dim: int, members: list, strategies: tuple, padded: list, n: int) -> int:
    """A stack's columns times its rows a shard, the bytes (in columns) it costs every
    device: its mod tables' blocks plus its fullest owner's table-wise rows (`pack_owners`)."""
    mod = sum(padded[i] // n for i in members if strategies[i] == "mod")
    return dim * (mod + _fullest([padded[i] for i in members if strategies[i] == "table_wise"], n))


def _fullest(rows: list, n: int) -> int:
    """`max(pack_owners(rows, n)[1])`, the rows of the fullest shard (0 for none), computed
    alone: which of the emptiest shards an item goes to does not change what they hold."""
    if len(rows) <= n:
        return max(rows, default=0)
    used = [0] * n
    for v in sorted(rows, reverse=True):
        heapq.heapreplace(used, used[0] + v)
    return max(used)


def merge_table_wise(
    stacks_idx: list, strategies: tuple, padded: list, n: int, limit, keys: list
) -> list:
    """Stacks of table-wise tables only join a wider stack of the same optimizer, dtype
    and exchange (their dims padded to its width) where that costs fewer bytes a device:
    a stack costs its width times its rows a shard (its mod tables' blocks plus the
    fullest owner's table-wise rows, `pack_owners`), on every device, since a stacked array has
    the same block on each. Widest first; each joins the stack it saves most in (the
    size limit `max_stack_rows` kept). Then single table-wise tables move between the
    stacks (`_move_table_wise`) where that saves more."""

    def cost(dim: int, members: list) -> int:
        return _stack_bytes(dim, members, strategies, padded, n)

    out: list = []
    for key, members in sorted(stacks_idx, key=lambda s: -s[0][0]):
        best, saving = None, 0
        if all(strategies[i] == "table_wise" for i in members) and not getattr(
            key[1], "row_wise", False
        ):  # a row-wise optimizer's stack keeps its own dim
            for k, (okey, other) in enumerate(out):
                if okey[1:] != key[1:] or (
                    limit is not None and sum(padded[i] for i in other + members) > limit
                ):
                    continue
                gain = cost(okey[0], other) + cost(key[0], members)
                gain -= cost(okey[0], other + members)
                if gain > saving:
                    best, saving = k, gain
        if best is None:
            out.append((key, list(members)))
        else:
            out[best][1].extend(members)
    out = _move_table_wise(out, strategies, padded, n, limit, keys)
    out = _exact_table_wise(out, strategies, padded, n, limit, keys)
    return [(key, sorted(members)) for key, members in out]


# `_move_table_wise` tries every table-wise table in every stack, each try re-packing two
# stacks: past this many table-wise tables it keeps the whole stacks' merge alone
_MOVE_MAX_TABLES = 16


def _move_table_wise(groups: list, strategies: tuple, padded: list, n: int, limit, keys) -> list:
    """Single table-wise tables moved to another stack of the same optimizer, dtype and
    exchange at least as wide as their own dim, or to a stack of their own, while a move
    saves bytes a device: a stack's fullest owner sets its rows on every device, so a
    table fits for free under it where its owners' rows leave room, and a stack that
    loses its widest or its tallest table shrinks. Each round takes the move that saves
    most (ties: the first table, then the first stack); a stack takes its widest table's
    key. Tables of a row-wise optimizer (their stack keeps their dim) stay put."""
    groups = [list(members) for _, members in groups]
    movable = [
        i
        for i, st in enumerate(strategies)
        if st == "table_wise" and not getattr(keys[i][1], "row_wise", False)
    ]
    if len(movable) > _MOVE_MAX_TABLES:
        return [(_group_key(g, keys), g) for g in groups]

    @functools.cache
    def cost(members: tuple) -> int:  # members sorted: one entry a set of tables
        if not members:
            return 0
        return _stack_bytes(_group_key(members, keys)[0], members, strategies, padded, n)

    groups = [sorted(g) for g in groups]
    for _ in range(4 * len(movable) + 1):  # each move saves bytes: this bounds the rounds
        best = None
        for i in movable:
            src = next(k for k, g in enumerate(groups) if i in g)
            left = tuple(x for x in groups[src] if x != i)
            saved_by_leaving = cost(tuple(groups[src])) - cost(left)
            for dst in range(len(groups) + 1):  # len(groups): a stack of its own
                if dst == src or (dst == len(groups) and not left):
                    continue
                other = groups[dst] if dst < len(groups) else []
                if other and keys[other[0]][1:] != keys[i][1:]:
                    continue
                joined = tuple(sorted(other + [i]))
                if limit is not None and sum(padded[x] for x in joined) > limit:
                    continue
                gain = saved_by_leaving + cost(tuple(other)) - cost(joined)
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, src, dst, left, joined)
        if best is None:
            break
        _, src, dst, left, joined = best
        if dst == len(groups):
            groups.append(list(joined))
        else:
            groups[dst] = list(joined)
        groups[src] = list(left)
        if not left:
            del groups[src]
    return [(_group_key(g, keys), g) for g in groups]


# `_exact_table_wise` tries every grouping of a class of this many table-wise tables or
# fewer (by subsets: 3^6 pairs of a subset and a group of it, each group's bytes once)
_EXACT_MAX_TABLES = 6


def _exact_table_wise(groups: list, strategies: tuple, padded: list, n: int, limit, keys) -> list:
    """The stacks of each class of tables that may share one (the same optimizer, dtype
    and exchange) replaced by the grouping that costs the fewest bytes a device, every
    grouping tried, where the class is only table-wise tables (of an optimizer that is
    not row-wise) and has at most `_EXACT_MAX_TABLES`; kept where none saves bytes."""
    classes: dict = {}
    for g, (key, _) in enumerate(groups):
        classes.setdefault(key[1:], []).append(g)
    replaced: dict = {}  # group index -> the grouping of its class that replaces it
    for cls in classes.values():
        tables = sorted(i for g in cls for i in groups[g][1])
        if len(tables) > _EXACT_MAX_TABLES or not all(
            strategies[i] == "table_wise" and not getattr(keys[i][1], "row_wise", False)
            for i in tables
        ):
            continue
        costs = [  # each subset of `tables` (a bit mask) as one stack
            _subset_bytes(members, strategies, padded, n, limit, keys)
            for members in _subsets(tables)
        ]
        now = sum(costs[_mask(tables, groups[g][1])] for g in cls)
        least, split = _least_partition(costs, len(tables))
        if least[-1] < now:
            found, mask = [], len(costs) - 1
            while mask:
                part = split[mask]
                found.append([t for b, t in enumerate(tables) if part >> b & 1])
                mask &= ~part
            replaced.update(dict.fromkeys(cls, ()))
            replaced[cls[0]] = tuple((_group_key(g, keys), g) for g in found)
    out = []
    for g, (key, members) in enumerate(groups):
        out.extend(replaced[g] if g in replaced else [(key, list(members))])
    return out


def _subset_bytes(members: list, strategies, padded, n: int, limit, keys) -> float:
    """`_stack_bytes` of one stack of `members` at its widest table's width (0 for none;
    inf over the size limit `max_stack_rows`)."""
    if not members:
        return 0
    if limit is not None and sum(padded[t] for t in members) > limit:
        return float("inf")
    return _stack_bytes(_group_key(members, keys)[0], members, strategies, padded, n)


def _subsets(items: list) -> list:
    """Every subset of `items`, subset `m` holding `items[b]` where bit `b` of `m` is set."""
    return [[t for b, t in enumerate(items) if m >> b & 1] for m in range(1 << len(items))]


def _mask(items: list, members) -> int:
    """The bit mask of `members` among `items`."""
    return sum(1 << items.index(t) for t in members)


def _least_partition(costs: list, k: int) -> tuple:
    """`(least, split)` over the subsets (bit masks) of k items: `least[m]` the fewest total
    `costs` of any partition of subset m into groups, `split[m]` the group holding m's
    lowest item in one such partition (the first found, groups in increasing masks)."""
    least = [0] * (1 << k)
    split = [0] * (1 << k)
    for m in range(1, 1 << k):
        low = m & -m
        rest = m & ~low
        best, part = float("inf"), m
        sub = rest
        while True:  # every subset of the rest, with the lowest item: its group
            c = costs[sub | low] + least[rest & ~sub]
            if c < best:
                best, part = c, sub | low
            if sub == 0:
                break
            sub = (sub - 1) & rest
        least[m], split[m] = best, part
    return least, split


def _group_key(members: list, keys: list) -> tuple:
    """The key of a stack of `members`: its widest table's (the first of them)."""
    return keys[max(members, key=lambda i: (keys[i][0], -i))]


def spread_order(members: list, vocabs: list, spans: list) -> list:
    """The table-wise tables of `members` spread over several shards (`spans[i] > 1`), in
    the order they are placed: widest span first, then most rows a shard, then config
    order."""
    spread = [i for i in members if spans[i] > 1]
    return sorted(spread, key=lambda i: (-spans[i], -(-vocabs[i] // spans[i]), i))


def _consecutive(used: list, load: list, k: int) -> tuple:
    """`(first, top)`: the k consecutive shards whose fullest has the fewest `used` rows
    (ties: the least `load` over them, then the lowest first shard) and those rows. Plain
    Python over a few shards: the spread search calls it for every table of every trial."""
    if k == len(used):
        return 0, max(used)
    first = min(
        range(len(used) - k + 1), key=lambda f: (max(used[f : f + k]), sum(load[f : f + k]))
    )
    return first, max(used[first : first + k])


def owners_of(
    stacks_idx: list, vocabs: list, strategies: tuple, n: int, spans: list | None = None
) -> dict:
    """`{table index: owner shard}` of the table-wise tables (a spread one's: the first of
    its span): in each stack, the stacks with the most table-wise bytes first, its spread
    tables first (`spread_order`), each onto the `spans[i]` consecutive shards whose
    fullest has the fewest rows (ties: the least table-wise bytes over the stacks placed
    before, then the lowest first shard); then its whole tables bin-packed by rows
    (`pack_owners`) onto what the spread ones left, ties onto the shard with the fewest
    table-wise bytes over the stacks placed before."""
    spans = spans if spans is not None else [1] * len(vocabs)
    owners: dict[int, int] = {}
    load = [0] * n
    table_wise = [
        (key[0], [i for i in members if strategies[i] == "table_wise"])
        for key, members in stacks_idx
    ]
    for dim, tw in sorted(table_wise, key=lambda s: -s[0] * sum(vocabs[i] for i in s[1])):
        used = [0] * n
        for i in spread_order(tw, vocabs, spans):
            k, rows = spans[i], -(-vocabs[i] // spans[i])
            first, top = _consecutive(used, load, k)
            used[first : first + k] = [top + rows] * k
            owners[i] = first
        whole = [i for i in tw if spans[i] == 1]
        where, _ = pack_owners([vocabs[i] for i in whole], n, load, used)
        owners.update(zip(whole, where))
        for i in tw:  # the stack's table-wise bytes on each shard, for the next stacks' ties
            for j in range(owners[i], owners[i] + spans[i]):
                load[j] += -(-vocabs[i] // spans[i]) * dim
    return owners
