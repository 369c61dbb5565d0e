"""The names a checkpoint's embedding item is saved and read under (see the package
docstring for the layout)."""

FORMAT = "embedmesh.checkpoint"
# 2: tables of raw ids (their id maps, `id_maps`), written only where one is, so that an
# embedmesh that does not know id maps refuses it rather than restore rows by place;
# 3: the id maps' index of tags and their rows' `row_info` (`id_map_format`: version 2's
# maps are read and rebuilt)
#: The version of the checkpoint format this embedmesh writes; it reads every earlier one.
FORMAT_VERSION = 3
#: The name of the embedding's item in an orbax `CheckpointManager`'s composite
#: checkpoint (pass another to `save` / `restore` to keep two embeddings apart).
DEFAULT_ITEM = "embedding"
LOOKUP_FIELD = "lookup_parameters"  # checksum field of a table's "lookup_tables" array
