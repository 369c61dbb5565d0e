"""Reading one stored array (a leaf: a table's parameters or one slot) into host blocks of
any row layout: checks before anything is read, the reads started and streamed one or two
leaves at a time, waited for, and verified against the recorded checksum. Host only:
`restore` places the blocks on a mesh's devices, `load_tables` returns the logical table."""

from __future__ import annotations

import dataclasses
import logging

from embedmesh.checkpoint.checksums import CHECKSUM, expected_checksum
from embedmesh.checkpoint.format import LOOKUP_FIELD
from embedmesh.checkpoint.reading import host_buffer, wait_all
from embedmesh.checkpoint.recut import (
    recut_copies,
    same_layout,
    stored_shape_check,
    stored_shards,
    stored_table,
)
from embedmesh.layout.rows import RowLayout, row_layout

_log = logging.getLogger(__name__)


def check_compatible(
    name: str, table, meta_table: dict | None, what: str = "the embedding"
) -> None:
    """ValueError unless the stored table (if any) has `table`'s vocabulary size and dim."""
    if meta_table is None:
        return
    if (meta_table["vocabulary_size"], meta_table["dim"]) != (table.vocabulary_size, table.dim):
        raise ValueError(
            f"table {name}: the checkpoint has "
            f"[{meta_table['vocabulary_size']}, {meta_table['dim']}], {what} "
            f"[{table.vocabulary_size}, {table.dim}]"
        )


def _leaf_name(leaf: tuple) -> str:
    return ".".join(leaf)  # orbax's parameter name for a key path


def _describe(t_name: str, field: str, leaf: tuple) -> str:
    what = "parameters" if field == "parameters" else f"slot {field!r}"
    return f"{what} of table {t_name} (array '{_leaf_name(leaf)}')"


def check_leaf(reader, leaf: tuple, meta_table: dict, dim: int) -> None:
    """ValueError, before anything is read, when an array the metadata lists is missing or
    has another shape."""
    if reader.has(leaf) is False:
        raise ValueError(
            f"checkpoint item {reader.path} lacks the array "
            f"'{_leaf_name(leaf)}' of table {meta_table['name']} that its "
            f"metadata lists"
        )
    n, num_shards = stored_shards(reader.meta, meta_table), int(reader.meta["num_shards"])
    stored_shape_check(reader.shape(leaf), meta_table, n, num_shards, dim)


@dataclasses.dataclass
class PendingLeaf:
    """One leaf being read: the table's new blocks on the host, and the reads."""

    kind: str  # "direct" (stored blocks are these blocks) or "resharded"
    pieces: list  # [(shard j, device or None, numpy [rows_per_shard, ...])]
    futures: list
    what: str = ""  # "slot 'accumulators' of table u (array 'slots.u.accumulators')"
    source: str = ""  # the item directory
    checksum: str | None = None  # expected (None: not verified)


def start_leaf(
    reader,
    leaf: tuple,
    meta_table: dict,
    layout: RowLayout,
    t,
    shards: list,
    dtype,
    field: str = "parameters",
) -> PendingLeaf:
    """Allocate table `t`'s blocks on `shards` (`[(j, device)]`) of `layout` on the host and
    start reading the stored array `leaf` into them: only the stored rows these blocks
    need, each copied once, straight into place (padding rows are zero).

    `restore` reads into this process's shards of a mesh (`plan.row_layout`),
    `load_tables` into the logical table (`logical_layout()`, one shard)."""
    n_old = stored_shards(reader.meta, meta_table)
    src_layout = row_layout(reader.layout.name, n_old)
    src = stored_table(meta_table, n_old)
    stored_shape = reader.shape(leaf)
    width = t.dim if field in ("parameters", LOOKUP_FIELD) else None  # slots: checked before
    stored_shape_check(stored_shape, meta_table, n_old, int(reader.meta["num_shards"]), width)
    rest = tuple(stored_shape[1:])
    pieces, copies = [], []
    empty = None  # shards outside the table's span: one zero block, never written
    for j, device in shards:
        source = layout.copy_of(t, j)  # a replica reads its canonical block's rows
        if source is None:
            if empty is None:
                empty = host_buffer((t.rows_per_shard,) + rest, dtype)
                empty[:] = 0
            pieces.append((j, device, empty))
            continue
        piece = host_buffer((t.rows_per_shard,) + rest, dtype)
        piece[layout.count_on_shard(t, source) :] = 0
        pieces.append((j, device, piece))
        copies += [(piece,) + c for c in recut_copies(src_layout, src, layout, t, source)]
    kind = "direct" if same_layout(src_layout, src, layout, t) else "resharded"
    checksum = expected_checksum(reader, meta_table, field, leaf, dtype)
    what = _describe(t.name, field, leaf)
    try:
        futures = reader.start_fill(leaf, copies)
    except Exception as e:
        raise _read_error(reader.path, what, e) from e
    return PendingLeaf(kind, pieces, futures, what, str(reader.path), checksum)


def _read_error(path, what: str, error: Exception) -> ValueError:
    return ValueError(f"cannot read {what} from checkpoint item {path}: {error}")


def _drain(pending: PendingLeaf | None) -> None:
    """Wait for a leaf's reads, ignoring their errors (an abandoned restore must not leave
    tensorstore writing into buffers that are about to be freed)."""
    if pending is None:
        return
    for f in pending.futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - the restore is failing already
            pass


def streamed_leaves(count: int, start, prefetch: bool):
    """Yield `start(i)` (a `PendingLeaf`) for i in range(count), in order. With `prefetch` the
    reads of leaf i+1 are started before leaf i is handed over (two leaves on the host),
    else after the caller is done with leaf i (one). Use under `contextlib.closing`: if the
    caller fails, every read still in flight is waited for."""
    current = following = None
    try:
        following = start(0) if count else None
        for i in range(count):
            current, following = following, None
            if prefetch and i + 1 < count:
                following = start(i + 1)
            yield current
            current = None
            if following is None and i + 1 < count:
                following = start(i + 1)
    finally:
        _drain(current)
        _drain(following)


def wait_leaf(pending: PendingLeaf) -> None:
    """Wait for a leaf's reads; a failed read is a ValueError naming the leaf."""
    try:
        wait_all(pending.futures)
    except Exception as e:
        _drain(pending)
        raise _read_error(pending.source, pending.what, e) from e
    # how the leaf was read: its stored blocks whole ("direct") or gathered into another
    # layout ("resharded")
    _log.debug("restore: %s read %s", pending.kind, pending.what)


def verify_checksum(pending: PendingLeaf, checksum) -> None:
    """Compare the leaf's recorded checksum (if any) with `checksum()` (computed only then)."""
    if pending.checksum is None:
        return
    got = checksum()
    if got != pending.checksum:
        raise ValueError(
            f"checkpoint item {pending.source}: {pending.what} is corrupted: "
            f"its checksum is {got}, the checkpoint recorded "
            f"{pending.checksum} ({CHECKSUM})"
        )
