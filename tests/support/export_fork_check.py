"""An exported serving function used in forked children (run by test_export_fork.py).

Usage: export_fork_check.py EXPORT_DIR OUT_NPZ
The parent loads and calls the export, then forks: with os.fork, and with a
multiprocessing "fork" pool; each child calls the parent's function on new inputs
(other buckets, several chunks) and sends the outputs back; the parent compares them
with its own outputs for the same inputs, computed after the forks.
"""

import multiprocessing
import os
import pickle
import sys

import numpy as np
import orphan_guard  # noqa: F401  (this worker dies with the test process)
import test_export as T

from embedmesh.serving.export import load_serving

export_dir, out_file = sys.argv[1:3]
fn = load_serving(export_dir)
warm = fn(T.make_inputs(3, seed=1))  # the parent uses it first (bucket 4 compiled)
SIZES = (1, 11, 40)


def child_outputs(_=None):
    out = {}
    for n in SIZES:
        for k, v in fn(T.make_inputs(n, seed=100 + n)).items():
            out[f"{n}.{k}"] = v
    try:
        load_serving(export_dir)
        out["load_in_child"] = "loaded"
    except RuntimeError as e:
        out["load_in_child"] = str(e)
    return out


# os.fork: the child writes its outputs into a pipe
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        data = pickle.dumps(child_outputs())
    except BaseException as e:  # noqa: BLE001
        data = pickle.dumps({"error": repr(e)})
    with os.fdopen(w, "wb") as f:
        f.write(data)
    os._exit(0)
os.close(w)
with os.fdopen(r, "rb") as f:
    forked = pickle.loads(f.read())
_, status = os.waitpid(pid, 0)
assert status == 0, status
assert "error" not in forked, forked

with multiprocessing.get_context("fork").Pool(2) as pool:
    pooled = pool.map(child_outputs, range(2))

mine = {}
for n in SIZES:
    for k, v in fn(T.make_inputs(n, seed=100 + n)).items():
        mine[f"{n}.{k}"] = v
for got in [forked] + pooled:
    assert "must" not in got["load_in_child"] and "forked" in got["load_in_child"], got
    for k, v in mine.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)
np.savez(out_file, **mine)
print("forked children match", len(pooled) + 1, flush=True)
