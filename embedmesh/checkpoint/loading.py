"""Loading a checkpoint's parameters for serving: on the host, no mesh, optimizer slots
never read."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from embedmesh.checkpoint.checksums import _logical_checksum
from embedmesh.checkpoint.format import DEFAULT_ITEM
from embedmesh.checkpoint.leaves import (
    _check_compatible,
    _check_leaf,
    _start_leaf,
    _streamed,
    _verify,
    _wait_leaf,
)
from embedmesh.checkpoint.reading import _item_dir, _Reader
from embedmesh.checkpoint.recut import _logical_table
from embedmesh.config import TableConfig, resolve_feature_config
from embedmesh.layout.rows import logical_layout


def load_tables(
    source, step: int | None = None, *, feature_config: Any = None, item: str = DEFAULT_ITEM
) -> dict:
    """`{TableConfig: [vocabulary_size, dim] numpy array}` of a checkpoint's parameters.

    Reads only the parameters (optimizer slots are never read) on any
    machine: no mesh, no devices needed. Each stored block is read straight
    into its rows of the preallocated output (no temporary copy); the next
    table's reads are issued while the current one completes (the outputs
    are all returned anyway, so this holds nothing extra). With
    `feature_config`, the keys are its `TableConfig`s (matched by name, sizes
    checked) and only its tables are read; without, new `TableConfig`s with
    the saved names, sizes and combiners. Each table is checked against the
    checksum recorded at save (on the host CPU; older checkpoints have none):
    an unreadable or corrupted table raises ValueError naming it.
    """
    with _Reader(_item_dir(source, step, item)) as reader:
        meta = reader.meta
        reader.layout  # noqa: B018 - an unknown row layout raises before anything is read
        by_name = {m["name"]: m for m in meta["tables"]}
        if feature_config is None:
            wanted = [
                (
                    TableConfig(
                        m["vocabulary_size"],
                        m["dim"],
                        combiner=m["combiner"],
                        name=m["name"],
                        dtype=m.get("dtype", "float32"),
                    ),
                    m,
                )
                for m in meta["tables"]
            ]
        else:
            resolved = resolve_feature_config(feature_config)
            wanted = []
            for cfg, name in zip(resolved.tables, resolved.table_names):
                m = by_name.get(name)
                if m is None:
                    raise ValueError(
                        f"table {name} is not in the checkpoint (it has {sorted(by_name)})"
                    )
                _check_compatible(name, cfg, m, "the feature config")
                wanted.append((cfg, m))
        for _, m in wanted:  # before anything is read
            if m.get("id_map") is not None:
                raise ValueError(
                    f"table {m['name']} of checkpoint item {reader.path} is a table of raw ids: "
                    f"its rows are placed by its id map, not by id, so load_tables cannot "
                    f"return it as a [vocabulary_size, dim] table (pass a feature_config "
                    f"without it)"
                )
            _check_leaf(reader, ("tables", m["key"]), m, m["dim"])
        layout, logical = logical_layout(), [_logical_table(m) for _, m in wanted]

        def start(i):  # the logical table: one block of the logical layout, on the host
            m = wanted[i][1]
            return _start_leaf(
                reader,
                ("tables", m["key"]),
                m,
                layout,
                logical[i],
                [(0, None)],
                np.dtype(m.get("dtype", "float32")),
            )

        out = {}
        # at most two tables' reads in flight
        with contextlib.closing(_streamed(len(wanted), start, prefetch=True)) as pending:
            for i, current in enumerate(pending):
                _wait_leaf(current)
                arr = current.pieces[0][2]
                _verify(current, lambda: _logical_checksum(arr, logical[i]))
                out[wanted[i][0]] = arr
        return out
