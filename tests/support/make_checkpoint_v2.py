"""Writes `tests/checkpoint/data/raw_ids_v2/`: a checkpoint of format version 2 (the id
maps' layout before 2026-12-06 xiii: index slots `[hi, lo, row]` in buckets of 16, the
rows' ids, last-used steps and use counts apart), and `expected.npz`, what its live ids
hold by the code that wrote it: {raw id: values, accumulators, last used, use count}.

Run on a checkout that still writes format version 2 (e.g. bdf052f), from the tests'
folder: `XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
python support/make_checkpoint_v2.py OUT`. The fixture was made so; the test that reads
it (`test_checkpoint_dynamic_ids.py`) needs only the files.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoint"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_checkpoint_dynamic_ids as t

from embedmesh import checkpoint as ckpt


def main(out: str) -> None:
    emb = t._engine(2, "lfu")
    rng = np.random.default_rng(42)
    for k, ids in enumerate(t._batches(rng, 5)):
        t._step(emb, ids, k)
    assert ckpt.save(os.path.join(out, "checkpoint"), emb)
    assert ckpt.read_metadata(os.path.join(out, "checkpoint"))["format_version"] == 2
    live = t._by_id(emb)
    ids = np.array(sorted(live), np.int64)
    np.savez(
        os.path.join(out, "expected.npz"),
        ids=ids,
        values=np.stack([live[i][0] for i in ids]),
        accumulators=np.stack([live[i][1] for i in ids]),
        last_used=np.array([live[i][2] for i in ids], np.int32),
        use_count=np.array([live[i][3] for i in ids], np.int32),
    )


if __name__ == "__main__":
    main(sys.argv[1])
