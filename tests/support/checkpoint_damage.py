"""Finding and damaging the stored bytes of a checkpoint's arrays (checkpoint tests only).

orbax writes an item as OCDBT: array chunks are values of a key-value store whose data
files lie under `<item>/ocdbt.process_<i>/d/` (small values are inlined in the b-tree
nodes instead). `chunk_locations` reads each chunk's stored value through tensorstore's
OCDBT driver and finds those exact bytes in the data files, so a test damages the bytes of
a chosen array chunk, compressed or not, and nothing else.
"""

import glob
import os

import tensorstore as ts


def chunk_locations(item_dir) -> dict:
    """{chunk key ("tables.d/0.0"): (data file, offset, length)} of the out-of-line chunks."""
    item_dir = str(item_dir)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
    files = glob.glob(os.path.join(item_dir, "ocdbt.process_*", "d", "*"))
    files += glob.glob(os.path.join(item_dir, "d", "*"))
    blobs = {f: open(f, "rb").read() for f in files}
    out = {}
    for key in kv.list().result():
        key = key.decode()
        if key.endswith((".zarray", "zarr.json")):
            continue
        value = kv.read(key).result().value
        if len(value) < 64:
            continue
        hits = [(f, b.find(value)) for f, b in blobs.items() if b.find(value) >= 0]
        if len(hits) == 1:
            out[key] = (hits[0][0], hits[0][1], len(value))
    return out


def flip_bytes(path, offset: int, count: int = 64, stride: int = 1):
    """XOR `count` bytes of a file with 0x5A, from `offset` on, every `stride` bytes."""
    with open(path, "r+b") as f:
        for k in range(count):
            f.seek(offset + k * stride)
            b = f.read(1)
            f.seek(offset + k * stride)
            f.write(bytes([b[0] ^ 0x5A]))
