"""The names a checkpoint's embedding item is saved and read under (see the package
docstring for the layout)."""

FORMAT = "embedmesh.checkpoint"
# 2: tables of raw ids (their id maps, `id_maps`), written only where one is, so that an
# embedmesh that does not know id maps refuses it rather than restore rows by place
FORMAT_VERSION = 2
DEFAULT_ITEM = "embedding"
LOOKUP_FIELD = "lookup_parameters"  # checksum field of a table's "lookup_tables" array
