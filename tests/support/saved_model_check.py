"""Child of the SavedModel tests (process_helpers.py's `check_saved_model`): loads each
SavedModel it is sent with TensorFlow alone (no embedmesh imported here) and checks its
outputs against the expected ones saved by the parent (embedmesh's
serving_embedding_lookup + the JAX model).

One such process serves every check of a test process in turn (its start and TensorFlow's
import, ~10 CPU-s, paid once, not once a test): each line on stdin, "SAVED_MODEL_DIR
CASES.npz" (tab-separated), is answered on stdout by "OK <count> cases" or "FAILED <the
error>", then a line "DONE". Each SavedModel is loaded anew from its own directory.

Cases: "case{i}/in/{input}" a tensor fed as it is; "case{i}/ragged/{values}/{splits}" and
"case{i}/lengths/{values}/{splits}" a feature's ids and row lengths, fed the way the docs
say, as a `tf.RaggedTensor`'s components (`rt.values`, `rt.row_splits`: TensorFlow's own
row splits dtype); "case{i}/out/{name}" an output it must give.

Usage: saved_model_check.py    (requests on stdin)
"""

import sys
import traceback

import numpy as np
import orphan_guard  # noqa: F401  (this worker dies with the test process)
import tensorflow as tf


def check(directory: str, cases_file: str) -> int:
    served = tf.saved_model.load(directory).signatures["serving_default"]
    cases = np.load(cases_file)
    count = int(cases["count"])
    for i in range(count):
        prefix = f"case{i}/"
        inputs = {
            k[len(prefix) + 3 :]: tf.constant(cases[k])
            for k in cases.files
            if k.startswith(prefix + "in/")
        }
        for k in cases.files:
            if k.startswith(prefix + "ragged/"):
                values_name, splits_name = k[len(prefix) + 7 :].split("/")
                lengths = cases[f"{prefix}lengths/{values_name}/{splits_name}"]
                rt = tf.RaggedTensor.from_row_lengths(cases[k], lengths)
                assert rt.row_splits.dtype == tf.int64, rt.row_splits.dtype
                inputs[values_name], inputs[splits_name] = rt.values, rt.row_splits
        out = served(**inputs)
        for k in cases.files:
            if k.startswith(prefix + "out/"):
                name = k[len(prefix) + 4 :]
                np.testing.assert_allclose(
                    out[name].numpy(), cases[k], rtol=2e-5, atol=2e-6, err_msg=f"case {i} {name}"
                )
    assert not any(m.split(".")[0] == "embedmesh" for m in sys.modules), "embedmesh imported"
    return count


for line in sys.stdin:
    try:
        print(f"OK {check(*line.rstrip(chr(10)).split(chr(9)))} cases")
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        print("FAILED " + traceback.format_exc().replace("\n", "\n  "))
    print("DONE", flush=True)
