"""The training step compiled ahead of time for v5e slices of 4 to 64 chips.

Runs only where a TPU backend is present (the lent v5e host: JAX_PLATFORMS=tpu,cpu);
the chips of each slice are `jax.experimental.topologies` descriptions, so nothing
runs on them: the step (lookup and update, every strategy a TPU mesh takes, several
optimizers, pipelined and not) is lowered from shapes (`benchmarks/tpu_aot.py`) and
compiled for the slice. For each: it compiles; the bytes a chip needs
(`memory_analysis()`: arguments, outputs not aliased to them, temporaries) are within
10% of the planner's estimate (`embedmesh.layout.step_memory`: the state a chip holds,
exact, plus the step's own bytes at the batch's capacities: the batch, the activations
and their gradients, the largest phase's temporaries); the collectives are the
design's (all-to-alls for the sharded strategies, the replicas' gradient exchange for
data_parallel), and the bytes a chip sends in them are within 10% of what the
strategies count (`EmbeddingCore.exchange_bytes`).
"""

import importlib.util
import json
import os
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _on_tpu() -> bool:
    try:
        return jax.devices()[0].platform == "tpu"
    except RuntimeError:
        return False


pytestmark = pytest.mark.skipif(not _on_tpu(), reason="needs a TPU backend (the v5e host)")


@pytest.fixture(scope="module")
def aot():
    spec = importlib.util.spec_from_file_location(
        "tpu_aot", os.path.join(ROOT, "benchmarks", "tpu_aot.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tpu_aot"] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


ROWS = 1 << 20  # a table's rows: its state is most of a chip's bytes on 64 chips too
BATCH = 512


def model():
    import embedmesh as em

    tables = [
        em.TableConfig(ROWS, 64, combiner="sum", name="a"),
        em.TableConfig(ROWS, 32, combiner="mean", name="b"),
        em.TableConfig(ROWS // 4, 16, combiner="sum", name="c"),
    ]
    fc = {t.name: em.FeatureConfig(t, name=t.name) for t in tables}
    rng = np.random.default_rng(7)
    features = {
        t.name: rng.integers(0, t.vocabulary_size, size=(BATCH, 3)).astype(np.int32) for t in tables
    }
    return fc, features


def optimizer(name):
    import embedmesh as em

    return {
        "adagrad": em.Adagrad(learning_rate=0.1),
        "sgd": em.SGD(learning_rate=0.1),
        "adam": em.Adam(learning_rate=0.05),
        "ftrl": em.FTRL(learning_rate=0.1),
    }[name]


CASES = [(topo, "mod", "adagrad", False) for topo in ("2x2", "2x4", "4x4", "8x8")]
CASES += [("2x4", s, "adagrad", False) for s in ("row_wise_pooled", "table_wise", "data_parallel")]
CASES += [("2x2", s, "adagrad", True) for s in ("mod", "row_wise_pooled")]
CASES += [("2x2", "mod", o, False) for o in ("sgd", "adam", "ftrl")]


@pytest.mark.parametrize("topology,strategy,opt,pipelined", CASES)
def test_compiles_for_the_slice(aot, topology, strategy, opt, pipelined):
    mesh = aot.topology_mesh(f"v5e:{topology}")
    fc, features = model()
    step = aot.abstract_step(fc, features, optimizer(opt), mesh, strategy, pipelined=pipelined)
    got = aot.compile_step(step)
    n = mesh.size
    found = got["collectives"]
    sent = aot.sent_bytes(found, n)
    print(json.dumps({"case": [topology, strategy, opt, pipelined], "sent": sent, **got}))
    # the bytes a chip needs: the planner's estimate of its state and of the step's own
    # bytes, within 10% (the state's term exact)
    assert got["state_bytes"] == got["planned_bytes"] == got["estimate"]["state"]
    estimated = got["estimated_bytes"]
    assert abs(got["per_chip_bytes"] - estimated) <= 0.1 * estimated, got
    # the collectives the design expects, with the bytes the strategies count
    assert "all-to-all" in found, found
    assert abs(sent - got["exchange_bytes"]) <= 0.1 * got["exchange_bytes"], (sent, got)
