"""Checkpoints of embedding state with orbax-checkpoint, portable across device counts.

Two entry points over one implementation:

- the functional core (`EmbeddingCore` + `EmbeddingState`, e.g. inside a
  user's own jitted train step): `core_state_tree(core, state)`,
  `core_save_args(core, state)`, `core_save(target, core, state)` and
  `core_restore(core, state, source) -> RestoredState` (the restored
  `.state`, the `.step`, and for a pipelined run the `.lookup_tables` its
  next lookup reads). Pure: the given state is never changed or donated.
- the stateful facade (`MeshEmbedding`): `state_tree(emb)`, `save_args(emb)`,
  `save(target, emb)` and `restore(emb, source) -> step`, thin wrappers that
  take the state (and a pending pipelined update's lookup tables) from `emb`
  and install the restored state in it.

Everything a checkpoint records comes from the core and its `StackingPlan`
(tables, stacks, row layout, optimizers, the resolved feature config) and
from the state (slots, step).

Layout. The embedding state is saved as one orbax pytree (the *embedding
item*), stored per table rather than per stack, so that it restores into any
number of devices and any stacking:

    {"tables": {key: [R, dim]},          # sharded jax.Arrays
     "slots":  {key: {slot name: [R, dim]}},
     "step":   int64 scalar,
     "meta":   uint8 [bytes of a JSON document],
     "lookup_tables": {key: [R, dim]},  # pipelined, update pending
     "id_maps": {key: {field: [N, ...]}}}  # tables of raw ids (`id_maps`)

(`R = k * rows_per_shard` rounded up to a multiple of N, `k` the shards of the
table's span: `N * rows_per_shard` for a "mod" table, `V` plus fewer than N
zero rows for a "table_wise" one.)

"tables", "slots" and "step" hold every accepted update. A pipelined run saved
with an update pending (its next lookup reads the tables one update stale)
also stores "lookup_tables": the parameters that next lookup reads, for the
tables of the stacks the pending update touches. A pipelined restore installs
those for one lookup and the saved state right after it, so the run resumes
exactly where it was (bit-identical on the same mesh and stacking); an
unpipelined restore and serving ignore them. Saving never applies the
pending update early.

Block b of a table's array (rows `[b * rows_per_shard, (b+1) * rows_per_shard)`,
b < k) holds the table's block on shard `first_shard + b` of the saving mesh, as
the plan's row layout (`embedmesh.layout.rows`) places it: only the shards of
the table's span, so a table-wise table is stored as its `[V, dim]` rows alone
(no other table's rows, not N times its size). The stored array is the table
in the mod layout over `k` shards (first shard 0): table row `i` is at row
`(shard_of(i) - first_shard) * rows_per_shard + block_row(i)`. A mod table's
blocks are sliced on their own devices out of the stack arrays; a table on
fewer shards is spread evenly over all devices by one all_to_all (orbax
writes no array that lives on one process's devices only), so every process
writes only its own shards. "meta" records the format version, the embedmesh
version, N, the row layout's name ("row_layout": "mod", the only one today; a
checkpoint without the key is "mod", one naming a layout this embedmesh does
not know is refused), the step and per table its name, vocabulary size, dim,
rows per shard, rotation, its placement ("sharding": "mod" or "table_wise",
"first_shard", "span"; absent in older checkpoints: "mod", 0, N), dtype,
combiner, optimizer class and slot names. Re-cutting the stored blocks into
another layout (other device count, other stacking, other placements) goes
through the two layouts (`RowLayout.rows_index`, `shard_of`, `block_row`,
`period`).

The item is an ordinary pytree (`state_tree(emb)`, `core_state_tree(core,
state)`), so it sits beside the user's dense parameters in one orbax
`Composite` checkpoint:

    mngr = ocp.CheckpointManager(path)                  # async by default
    mngr.save(step, args=ocp.args.Composite(
        embedding=embedmesh.checkpoint.save_args(emb),
        params=ocp.args.StandardSave(params)))
    ...
    embedmesh.checkpoint.restore(emb, mngr)             # any mesh, any stacking
    # functional core: args=...(embedding=core_save_args(core, state), ...), then
    # state = embedmesh.checkpoint.core_restore(core, state, mngr).state
    params = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))["params"]

`save_args` writes it uncompressed (`EmbeddingSave`, found by orbax through
its args registry): trained embeddings are close to random bits, and zstd
saves ~9% of the size for half the read and write speed.
`ocp.args.StandardSave(state_tree(emb))` (compressed) restores the same way.

Restoring goes one table (or slot) at a time. This process's shards of the
table in the new layout are allocated on the host (page aligned: on CPU,
`device_put` aliases them) and filled by tensorstore reads issued all at
once: each copies only the stored rows a shard needs (a contiguous block
when the device count is unchanged, strided rows otherwise), straight into
place, in one tensorstore batch, so a stored chunk is read from disk once.
The shards are then checked against the array's checksum and written into
the new state: a stack array is copied on its first write (the live one is
never donated) and written in place afterwards, and the new state is returned
(`emb.state` replaced) only when every leaf was read and verified, so a
failed restore changes nothing. Besides the live state, a restore holds
one more copy of the state (at its end) and at most one table on the host
(its new shards). The on-disk format is orbax's; only the reading bypasses
orbax's per-leaf restore (same tensorstore spec, no whole-table
temporaries). Serving loads only the parameters (`load_tables`,
`EmbeddingForServing`): no mesh, optimizer slots never read. Both read
paths are one: `load_tables` reads a table into the logical layout
(`embedmesh.layout.rows.logical_layout`) as `restore` reads it into a mesh's.

Integrity: "meta" records per table a checksum of its parameters and of
each slot (see `CHECKSUM`: a layout-independent sum over logical rows,
computed at save on the devices holding the arrays), verified by `restore`
and `load_tables`; checkpoints without checksums load unverified.

Crash safety comes from orbax: a step is written under a temporary name and
renamed when complete, and uncommitted steps are never listed, so a save
killed halfway leaves the previous step as the latest one.

Modules (this package's `__init__` re-exports the public names):

- `format`: the item's format name and version, default item name, field names;
- `saving`: the item's pytree from a core's state (`core_state_tree`, `state_tree`), its
  orbax args and handler, `core_save` / `save`; the all_to_all spreading a table on part
  of the mesh over every device;
- `checksums`: `CHECKSUM`, on the devices at save, on the host for `load_tables`;
- `reading`: locating the item (`latest_step`, a manager, root, step or item directory),
  its metadata (`read_metadata`) and the tensorstore reader;
- `recut`: which stored rows go where in another layout (index arithmetic);
- `leaves`: one stored array read into host blocks of any layout, streamed, verified;
- `restoring`: `core_restore` / `restore` onto a mesh (`RestoredState`);
- `loading`: `load_tables`, the parameters on the host for serving;
- `id_maps`: the id maps of tables of raw ids (`TableConfig.id_map`): saved beside their
  rows with checksums, restored bit for bit on the same device count and map
  configuration, else rebuilt on their new owners (live ids moved with their rows, slots
  and LRU/LFU bookkeeping; the admission sketch merged or reset: its docstring).

A table's blocks are sliced out of and written into its stack on the devices by
`embedmesh.device.stack_tables` (the engine's one home for stack <-> table arrays); the
facade is reached through its public hooks (`MeshEmbedding.checkpoint_state`,
`install_restored`). `EmbeddingForServing` lives on the serving side
(`embedmesh.serving.for_serving`); `embedmesh.checkpoint.EmbeddingForServing` still
names it.
"""

from __future__ import annotations

from embedmesh.checkpoint.checksums import CHECKSUM
from embedmesh.checkpoint.format import DEFAULT_ITEM, FORMAT_VERSION
from embedmesh.checkpoint.format import FORMAT as FORMAT  # names of the module this replaced
from embedmesh.checkpoint.format import LOOKUP_FIELD as LOOKUP_FIELD
from embedmesh.checkpoint.loading import load_tables
from embedmesh.checkpoint.reading import latest_step, read_metadata
from embedmesh.checkpoint.restoring import MISSING_POLICIES as MISSING_POLICIES
from embedmesh.checkpoint.restoring import RestoredState, core_restore, restore
from embedmesh.checkpoint.saving import (
    EmbeddingCheckpointHandler,
    EmbeddingRestore,
    EmbeddingSave,
    core_save,
    core_save_args,
    core_state_tree,
    save,
    save_args,
    state_tree,
)

__all__ = [
    "CHECKSUM",
    "DEFAULT_ITEM",
    "EmbeddingCheckpointHandler",
    "EmbeddingForServing",
    "EmbeddingRestore",
    "EmbeddingSave",
    "FORMAT_VERSION",
    "RestoredState",
    "core_restore",
    "core_save",
    "core_save_args",
    "core_state_tree",
    "latest_step",
    "load_tables",
    "read_metadata",
    "restore",
    "save",
    "save_args",
    "state_tree",
]


def __getattr__(name):
    # the serving side's class under its old path; imported on use, as the serving module
    # imports this package's readers
    if name == "EmbeddingForServing":
        from embedmesh.serving.for_serving import EmbeddingForServing

        return EmbeddingForServing
    raise AttributeError(f"module 'embedmesh.checkpoint' has no attribute {name!r}")
