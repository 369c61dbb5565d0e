"""The names a checkpoint's embedding item is saved and read under (see the package
docstring for the layout)."""

FORMAT = "embedmesh.checkpoint"
# 2: tables of raw ids (their id maps, `id_maps`), written only where one is, so that an
# embedmesh that does not know id maps refuses it rather than restore rows by place;
# 3: the id maps' index of tags and their rows' `row_info` (`id_map_format`: version 2's
# maps are read and rebuilt)
FORMAT_VERSION = 3
DEFAULT_ITEM = "embedding"
LOOKUP_FIELD = "lookup_parameters"  # checksum field of a table's "lookup_tables" array
