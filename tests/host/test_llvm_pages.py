"""numba's LLVM code pages are paged out once the preprocessing kernels are loaded
(`embedmesh._runtime.page_out_llvm`): the steps that follow run the compiled kernels and
never touch LLVM, so its ~60-70 MB of clean, file-backed code stop counting in the
process's resident memory; `EMBEDMESH_PAGE_OUT_LLVM=0` keeps them. Each case runs in a
fresh process (the switch is read once; smaps are per process)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from process_helpers import run_json

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux only"),
    pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="needs numba"),
]

SCRIPT = """
import json, os
import numpy as np
import embedmesh as em
from embedmesh import _runtime


def llvm_kb():  # libllvmlite.so's clean pages resident in this process, by kind
    out = {"private": 0, "shared": 0}
    name = None
    for line in open("/proc/self/smaps"):
        p = line.split()
        if len(p) >= 5 and "-" in p[0] and ":" not in p[0]:
            name = os.path.basename(p[5]) if len(p) > 5 else ""
        elif name == "libllvmlite.so" and p[0] == "Private_Clean:":
            out["private"] += int(p[1])
        elif name == "libllvmlite.so" and p[0] == "Shared_Clean:":
            out["shared"] += int(p[1])
    return out


rng = np.random.default_rng(0)
fc = {f"f{t}": em.FeatureConfig(em.TableConfig(100, 8, name=f"t{t}")) for t in range(2)}
plan = em.plan_stacking(fc, 1)


def preprocess():
    feats = {f: em.RaggedTensor(rng.integers(0, 100, 40), np.arange(0, 41, 5)) for f in fc}
    # numba's kernels (the default is the C++ ones, which load no LLVM)
    return em.preprocess_features(feats, None, plan, num_devices_local=1, backend="numba")


preprocess()
first = dict(llvm_kb(), page_outs=_runtime.llvm_page_outs())
preprocess()
second = dict(llvm_kb(), page_outs=_runtime.llvm_page_outs())
print(json.dumps({"first": first, "second": second}))
"""


def run(env: dict) -> dict:
    return run_json(SCRIPT, dict(env, JAX_PLATFORMS="cpu"))


def test_llvm_code_paged_out_after_the_kernels_load_and_kept_with_the_switch_off():
    kept = run({"EMBEDMESH_PAGE_OUT_LLVM": "0"})
    assert kept["first"]["page_outs"] == 0 and kept["second"]["page_outs"] == 0
    resident = kept["first"]["private"] + kept["first"]["shared"]
    assert resident > 16 * 1024, kept  # LLVM ran: tens of MB of its code touched
    seen = run({})
    if seen["first"]["page_outs"] == 0:
        pytest.skip("madvise(MADV_PAGEOUT) is not supported here (Linux < 5.4)")
    # one page-out after the kernels loaded; the second call compiled nothing: none more
    assert seen["first"]["page_outs"] == 1 and seen["second"]["page_outs"] == 1, seen
    # what is left private is a few pages; pages another process maps stay (shared)
    assert seen["first"]["private"] < 8 * 1024, seen
    assert seen["second"]["private"] < 8 * 1024, seen  # running the kernels needs no LLVM
