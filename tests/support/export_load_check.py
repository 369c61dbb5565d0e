"""Loads an export in a fresh process that imports only embedmesh and numpy (run by
test_export.py): rebuilds the inputs from an .npz, calls the export and compares its
outputs with the ones computed in the exporting process.

Usage: export_load_check.py EXPORT_DIR INPUTS_NPZ EXPECTED_NPZ
"""

import sys

import numpy as np
import orphan_guard  # noqa: F401  (this worker dies with the test process)

import embedmesh
from embedmesh.serving.export import load_serving

export_dir, inputs_file, expected_file = sys.argv[1:4]
a = np.load(inputs_file)
n = int(a["n"])
inputs = {
    "features": {
        "watched": embedmesh.RaggedTensor(a["watched_values"], a["watched_splits"]),
        "recent": embedmesh.SparseTensor(a["recent_indices"], a["recent_values"], (n, 5)),
        "user": a["user"],
        "tags": embedmesh.SparseTensor(a["tags_indices"], a["tags_values"], (n, 4)),
    },
    "weights": {"tags": embedmesh.SparseTensor(a["tags_indices"], a["tags_weights"], (n, 4))},
}

serving = load_serving(export_dir)
out = serving(inputs)
expected = np.load(expected_file)
assert sorted(out) == sorted(expected.files), (sorted(out), expected.files)
for k in expected.files:
    assert isinstance(out[k], np.ndarray)
    np.testing.assert_array_equal(out[k], expected[k], err_msg=k)
# nothing of the training side was needed: no test or model module, no checkpoint library
banned = [
    m
    for m in sys.modules
    if m.split(".")[0] in ("test_export", "checkpoint_common", "orbax", "optax")
]
assert not banned, banned
print("identical outputs", {k: v.shape for k, v in out.items()})
