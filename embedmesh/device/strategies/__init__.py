"""The sharding strategies on the devices, one module each, behind one interface
(`base.Strategy`: lookup, update, bytes exchanged, memory held), and the one place that
chooses a stack's.

    single_device  single_device.SingleDevice   a mesh of one device: nothing crosses
    rows           rows.RowExchange             rows to the sources, gradient sums to the
                                                owners (mod / `row_wise_rows`)
    pooled         pooled.PooledOnOwners        partial sums to the sources, activation
                                                gradients to the owners (`row_wise_pooled`,
                                                `table_wise`)
    data_parallel  data_parallel.DataParallel   a replica on every device (`data_parallel`)

A stack's strategy follows from the plan's stack (replicated or not), its exchange form
(`EmbeddingCore`'s `exchange`: "rows" or "pooled", which the planner's strategies map to,
`layout.planner.STRATEGY_FORMS`) and the mesh size: `strategy_name`. Adding one: a module
here with a `Strategy` subclass registered by `register`, and its rule in `strategy_name`
(see `base`).
"""

from __future__ import annotations

from embedmesh.device.ops import Transport
from embedmesh.device.strategies import data_parallel, pooled, rows, single_device
from embedmesh.device.strategies.base import STRATEGIES, ShardBatch, Strategy, register

__all__ = [
    "EXCHANGE_FORMS",
    "STRATEGIES",
    "ShardBatch",
    "Strategy",
    "data_parallel",
    "exchange_forms",
    "pooled",
    "register",
    "rows",
    "single_device",
    "strategy_for",
    "strategy_name",
]

EXCHANGE_FORMS = ("rows", "pooled")


def strategy_name(plan, stack: str, exchange: str) -> str:
    """The registry's name of `stack`'s strategy: one device needs none of the others;
    a replicated stack is data-parallel; else its exchange form says."""
    if plan.num_shards == 1:
        return "single_device"
    if plan.stack(stack).replicated:
        return "data_parallel"
    return exchange


def strategy_for(plan, stack: str, exchange: str, optimizer, transport: Transport) -> Strategy:
    """`stack`'s strategy object: its exchanges named after the stack (the channel)."""
    cls = STRATEGIES[strategy_name(plan, stack, exchange)]
    return cls(plan, stack, optimizer, transport.on(stack))


def exchange_forms(plan, exchange) -> dict:
    """`{stack: "rows" | "pooled"}` from one form for every stack or a mapping from stack
    (or table) names to forms (a table names its stack; missing stacks: "rows")."""
    if isinstance(exchange, str):
        if exchange not in EXCHANGE_FORMS:
            raise ValueError(f"exchange must be one of {EXCHANGE_FORMS}, got {exchange!r}")
        return {s.name: exchange for s in plan.stacks}
    out = {s.name: "rows" for s in plan.stacks}
    for name, form in dict(exchange).items():
        if form not in EXCHANGE_FORMS:
            raise ValueError(
                f"exchange of {name!r}: expected one of {EXCHANGE_FORMS}, got {form!r}"
            )
        if name in out:
            stack = name
        else:
            try:
                stack = plan.table(name).stack
            except KeyError:
                raise ValueError(
                    f"exchange names {name!r}, which is neither a stack nor a table of this plan"
                ) from None
        if out[stack] != "rows" and out[stack] != form:
            raise ValueError(f"stack {stack}: its tables ask for different exchanges")
        out[stack] = form
    return out
