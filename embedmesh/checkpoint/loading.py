"""Loading a checkpoint's parameters for serving: on the host, no mesh, optimizer slots
never read."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from embedmesh.checkpoint import id_map_format, leaves
from embedmesh.checkpoint.checksums import logical_checksum
from embedmesh.checkpoint.format import DEFAULT_ITEM
from embedmesh.checkpoint.reading import TreeReader, item_directory
from embedmesh.checkpoint.recut import logical_table, saved_logical_rows
from embedmesh.config import DynamicIds, TableConfig, resolve_feature_config
from embedmesh.layout.by_id import RawIdTable
from embedmesh.layout.rows import logical_layout


def load_tables(
    source, step: int | None = None, *, feature_config: Any = None, item: str = DEFAULT_ITEM
) -> dict:
    """`{TableConfig: [vocabulary_size, dim] numpy array}` of a checkpoint's parameters;
    for a table of raw ids (`TableConfig.id_map`) its `RawIdTable` (the live raw ids its
    saved id maps hold, each with its row; `step` the checkpoint's), ready to serve.

    Reads only the parameters (optimizer slots are never read) on any
    machine: no mesh, no devices needed. Each stored block is read straight
    into its rows of the preallocated output (no temporary copy); the next
    table's reads are issued while the current one completes (the outputs
    are all returned anyway, so this holds nothing extra). With
    `feature_config`, the keys are its `TableConfig`s (matched by name, sizes
    checked) and only its tables are read; without, new `TableConfig`s with
    the saved names, sizes and combiners. Each table is checked against the
    checksum recorded at save (on the host CPU; older checkpoints have none):
    an unreadable or corrupted table raises ValueError naming it (a table of raw ids: its
    id maps too).
    """
    with TreeReader(item_directory(source, step, item)) as reader:
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
                        id_map=_dynamic_ids(m),
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
                leaves.check_compatible(name, cfg, m, "the feature config")
                wanted.append((cfg, m))
        for cfg, m in wanted:  # before anything is read
            if (cfg.id_map is None) != (m.get("id_map") is None):
                raise ValueError(
                    f"table {m['name']}: the checkpoint's is "
                    + ("a table of raw ids" if m.get("id_map") else "not a table of raw ids")
                    + " (TableConfig.id_map), the feature config's "
                    + ("is" if cfg.id_map is not None else "is not")
                )
            leaves.check_leaf(reader, ("tables", m["key"]), m, m["dim"])
        # the id maps of tables of raw ids, read and verified before any table is
        maps = {
            i: id_map_format.read_maps(reader, m)
            for i, (_, m) in enumerate(wanted)
            if m.get("id_map")
        }
        layout, logical = logical_layout(), [logical_table(m) for _, m in wanted]

        def start(i):  # the logical table: one block of the logical layout, on the host
            m = wanted[i][1]
            return leaves.start_leaf(
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
        with contextlib.closing(
            leaves.streamed_leaves(len(wanted), start, prefetch=True)
        ) as pending:
            for i, current in enumerate(pending):
                leaves.wait_leaf(current)
                arr = current.pieces[0][2]
                leaves.verify_checksum(current, lambda: logical_checksum(arr, logical[i]))
                if i in maps:
                    arr = _by_id(reader, wanted[i][1], maps.pop(i), arr)
                out[wanted[i][0]] = arr
        return out


def _dynamic_ids(m: dict) -> DynamicIds | None:
    """The `DynamicIds` of a stored table of raw ids (None for a static table)."""
    saved = m.get("id_map")
    if not saved:
        return None
    return DynamicIds(**{k: v for k, v in saved.items() if k != "capacity"})


def _by_id(reader, m: dict, maps: dict, table: np.ndarray) -> RawIdTable:
    """The `RawIdTable` of a stored table of raw ids: each live id of its saved maps with
    the row its owner put it at (`table`: the stored rows in the logical layout)."""
    live = id_map_format.live_entries(maps)
    n = int(reader.meta["num_shards"])
    rows = table[saved_logical_rows(reader.layout.name, n, m, live["shard"], live["row"])]
    return RawIdTable(live["ids"], rows, m["vocabulary_size"], step=int(reader.meta["step"]))
