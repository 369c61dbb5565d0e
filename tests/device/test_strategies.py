"""The sharding strategies on the devices (`embedmesh.device.strategies`): one module each
behind one interface, chosen in one place, and a core that never asks which it holds;
the transport as one immutable value.

Each strategy's training against the float64 reference is in the strategy's own tests
(tests/engine/test_engine.py: one device and the row exchange; tests/device/test_pooled.py
and tests/device/test_table_wise.py: pooling on the owners; tests/device/test_data_parallel.py:
replicas); here, what holds for all of them."""

import ast
import dataclasses
import inspect
import pathlib

import pytest
from meshes import mesh_of

import embedmesh as em
from embedmesh.config import resolve_feature_config
from embedmesh.device import ops, strategies
from embedmesh.device.core import EmbeddingCore
from embedmesh.device.strategies import base
from embedmesh.layout import planner
from embedmesh.layout.stacking import plan_stacking

CORE = pathlib.Path(strategies.__file__).resolve().parents[1] / "core.py"

# a mesh size and a table's `sharding` that give each registered strategy
CASES = {
    "single_device": (1, "mod"),
    "rows": (4, "mod"),
    "pooled": (4, "row_wise_pooled"),
    "data_parallel": (4, "data_parallel"),
}


def features():
    big = em.TableConfig(50, 8, name="big", combiner="sum")
    small = em.TableConfig(7, 4, name="small", combiner="mean")
    tiny = em.TableConfig(3, 5, name="tiny", combiner="sqrtn")
    return {
        "f": em.FeatureConfig(big),
        "g": em.FeatureConfig(small),
        "h": em.FeatureConfig(tiny, max_sequence_length=2),
    }


def test_every_registered_strategy_has_the_interface():
    assert set(strategies.STRATEGIES) == set(CASES), "give a new strategy a case in CASES"
    for name, cls in strategies.STRATEGIES.items():
        assert issubclass(cls, base.Strategy) and cls.name == name
        assert not inspect.isabstract(cls), (name, cls.__abstractmethods__)
        for method in ("lookup", "update", "exchange_bytes", "memory_held", "carries_view"):
            want = inspect.signature(getattr(base.Strategy, method))
            got = inspect.signature(getattr(cls, method))
            assert list(got.parameters) == list(want.parameters), (name, method)
            for p in want.parameters.values():
                assert got.parameters[p.name].kind == p.kind, (name, method, p.name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_chooses_its_strategy_and_the_memory_it_holds_is_measured(name):
    """The plan's stack and the mesh choose the strategy (`strategy_name`, the one place),
    each stack's object holds the core's transport on the stack's channel, and the bytes
    the strategies say a device holds are what the built arrays' shards measure."""
    n, sharding = CASES[name]
    emb = em.MeshEmbedding(features(), em.Adagrad(0.1), mesh=mesh_of(n), sharding={"big": sharding})
    emb.build()
    stack = emb.plan.table("big").stack
    got = emb.core.strategies[stack]
    assert type(got) is strategies.STRATEGIES[name]
    assert got.transport == emb.core.transport.on(stack)
    assert got.transport.num_shards == n and got.transport.in_process
    measured = emb.core.bytes_per_device(emb.observed_state())
    assert measured == (emb.core.memory_held(),) * n
    assert emb.core.memory_held() == emb.plan.bytes_per_device[0]


def test_strategy_name_is_the_plan_the_exchange_and_the_mesh():
    fc = features()
    for n in (1, 2):
        plan = plan_stacking(fc, n, sharding={"small": "data_parallel"})
        small, big = plan.table("small").stack, plan.table("big").stack
        for form in strategies.EXCHANGE_FORMS:
            want_big = "single_device" if n == 1 else form
            assert strategies.strategy_name(plan, big, form) == want_big
            want_small = "single_device" if n == 1 else "data_parallel"
            assert strategies.strategy_name(plan, small, form) == want_small


def test_planner_strategies_map_onto_registered_ones():
    """Every strategy the facade accepts lands on a registered device strategy (the
    facade's plan and exchange forms, as `MeshEmbedding.build` makes them)."""
    resolved = resolve_feature_config(features())
    for user, (placement, form) in planner.STRATEGY_FORMS.items():
        chosen = dict.fromkeys(resolved.table_names, "mod") | {"big": user}
        plan = planner.stacking_for(resolved, 2, chosen)
        exchanges = {t: planner.STRATEGY_FORMS[s][1] for t, s in chosen.items()}
        core = EmbeddingCore(plan, mesh_of(2), em.SGD(0.1), exchanges)
        got = core.strategies[plan.table("big").stack]
        want = "data_parallel" if placement == "data_parallel" else form
        assert got.name == want, user


def test_registering_another_class_under_a_taken_name_is_an_error():
    class Impostor(strategies.STRATEGIES["rows"]):
        name = "rows"

    with pytest.raises(ValueError, match="strategy 'rows' is already registered"):
        strategies.register(Impostor)
    assert strategies.register(strategies.STRATEGIES["rows"]) is strategies.STRATEGIES["rows"]


def test_transport_is_one_immutable_value():
    t = ops.Transport(("x",), 4, in_process=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.num_shards = 2  # type: ignore[misc]
    s = t.on("stack")
    assert s.channel == "stack" and t.channel == ""
    assert s.at("update", "pooled").at("grads").channel == "stack/update/pooled/grads"
    assert hash(s.at("a")) == hash(t.on("stack/a")) and s.at("a") == t.on("stack/a")
    # a stack's exchange channels: the core's names, one per call
    core = EmbeddingCore(plan_stacking(features(), 2), mesh_of(2), em.SGD(0.1))
    for stack, st in core.strategies.items():
        assert st.transport.channel == stack


# ---------------------------------------------------------------------------
# core.py never asks which strategy a stack has

STRATEGY_WORDS = (
    set(strategies.STRATEGIES)
    | set(strategies.EXCHANGE_FORMS)
    | set(planner.STRATEGY_FORMS)
    | {"replicated", "table_wise", "data_parallel"}
)
STRATEGY_ATTRIBUTES = {"is_replicated", "pooled_rows", "replicated", "one_owner"}


def strategy_branches(source: str) -> list:
    """Where `source` chooses by strategy: a comparison or membership test with a
    strategy's or exchange form's name, a test of a stack's `replicated`, pooling rows or
    exchange form (`self.replicated`, the replicated sharding, is no strategy), a test
    of the device count against a constant (one device is a strategy), or an
    `isinstance` with a strategy class."""
    bad = []
    tree = ast.parse(source)
    classes = {cls.__name__ for cls in strategies.STRATEGIES.values()} | {"Strategy"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]  # (a tuple of names: each of them)
            consts = [c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)]
            if any(isinstance(c, str) and c in STRATEGY_WORDS for c in consts):
                bad.append(f"line {node.lineno}: compares with {consts}")
            names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if "num_shards" in names and any(isinstance(c, int) for c in consts):
                bad.append(f"line {node.lineno}: compares the device count with {consts}")
        if isinstance(node, ast.Attribute) and node.attr in STRATEGY_ATTRIBUTES:
            own_sharding = (
                node.attr == "replicated"
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            )
            if not own_sharding:
                bad.append(f"line {node.lineno}: reads .{node.attr}")
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            test = ast.unparse(node.test)
            if any(w in test for w in ("self.exchange", "replicated", "pooled")):
                bad.append(f"line {node.lineno}: branches on {test}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and any(n.id in classes for n in ast.walk(node) if isinstance(n, ast.Name))
        ):
            bad.append(f"line {node.lineno}: isinstance with a strategy")
    return bad


def test_core_has_no_branch_on_the_strategy():
    assert strategy_branches(CORE.read_text()) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "if self.is_replicated(s):\n    pass",
        "lookup = a if self.plan.stack(s).replicated else b",
        "if self.exchange[s] == 'pooled':\n    pass",
        "x = 0 if form in ('rows', 'data_parallel') else 1",
        "if self.num_shards == 1:\n    pass",
        "pooled = self.pooled_rows(s, c)",
        "if isinstance(st, PooledOnOwners):\n    pass",
    ],
)
def test_the_branch_check_finds_a_strategy_branch(snippet):
    """The check above can fail: each of these (the old core's branches among them) is
    found."""
    assert strategy_branches(snippet), snippet
