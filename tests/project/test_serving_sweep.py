"""`benchmarks/serving/serving_torch_sweep.py` at tiny sizes, in this process: every cell
of its grid runs, each embedmesh output agrees with torch's (sqrtn through torch's
per-sample weights, itself checked against the float64 bag reference), and every row
carries the machine's record. Nothing is timed: the figures mean nothing here. Needs torch
(the benchmarks' peer environment, requirements-serving.txt); skipped without it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest
from bag_reference import reference
from paths import ROOT

from embedmesh.serving import kernels, settings

SCRIPT = os.path.join(ROOT, "benchmarks", "serving", "serving_torch_sweep.py")


@pytest.fixture
def sweep(monkeypatch):
    """The script as a module; the process-wide settings it changes put back after."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(sys, "path", list(sys.path))
    if "tensorflow" not in sys.modules:  # not a peer of the sweep: seconds of import saved
        monkeypatch.setitem(sys.modules, "tensorflow", None)
    monkeypatch.setattr(settings, "host_threads", settings.host_threads)
    backend, torch_threads = kernels.get_backend(), torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("serving_torch_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("serving", None)  # the script's helper module, by its bare name
        torch.set_num_threads(torch_threads)
        if kernels.get_backend() != backend:
            kernels.set_backend(backend)


def test_every_cell_checked_against_torch(sweep, tmp_path):
    out = tmp_path / "sweep.json"
    argv = ["--mixes", "m=2x300x8+1x200x16@3,u=1x400xD@2", "--dims", "4", "--threads", "1,2"]
    argv += ["--batch-sizes", "5", "--rounds", "1", "--round-ms", "0", "--distinct", "1"]
    argv += ["--settle-ms", "1"]
    assert sweep.main([*argv, "--backend", kernels.get_backend(), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    cells = [(r["mix"], r["kind"], r["combiner"], r["threads"]) for r in doc["rows"]]
    every = [(m, k, c, t) for m in ("m", "u") for k, c in sweep.KINDS for t in (1, 2)]
    assert sorted(cells) == sorted(every)
    assert {tuple(r["dims"]) for r in doc["rows"]} == {(8, 16), (4,)}
    assert doc["outputs_differ"] == [] and all(r["allclose"] for r in doc["rows"])
    assert all(r["ratio"] > 0 and len(r["ratio_by_round"]) == 1 for r in doc["rows"])
    assert all("embedmesh" in r["gain_vs_1t"] for r in doc["rows"] if r["threads"] == 2)
    # one thread interleaved; two in turns (torch's OpenMP worker spins after its calls)
    assert {(r["threads"], r["timing"]) for r in doc["rows"]} == {
        (1, "interleaved"),
        (2, "blocks, 1 ms settle"),
    }
    for row in doc["rows"]:
        m = row["machine"]
        assert m["isa"] in ("AVX-512", "AVX2", "pre-AVX2") or m["isa"] == os.uname().machine
        assert m["cpu"] and m["torch"] and m["numpy"] == np.__version__ and row["load"] >= 0


def test_torch_sqrtn_is_the_float64_sqrtn(sweep):
    """torch's sum mode with the sweep's per-sample weights, an empty bag among them."""
    torch = sweep.bench.torch
    rng = np.random.default_rng(7)
    table = rng.standard_normal((11, 5)).astype(np.float32)
    offsets = np.array([0, 3, 3, 4, 9], np.int64)  # bag 1 empty
    ids = rng.integers(0, 11, offsets[-1])
    start = torch.from_numpy(offsets[:-1].copy())
    scale = sweep.bench.torch_sqrtn_weights(start, ids.size)
    got = torch.nn.functional.embedding_bag(
        torch.from_numpy(ids), torch.from_numpy(table), start, mode="sum", per_sample_weights=scale
    )
    want, _, _ = reference(table, ids, offsets, None, "sqrtn", False, False)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    assert np.abs(want[1]).max() == 0 and np.abs(want).max() > 0.1
