"""The names a checkpoint's embedding item is saved and read under (see the package
docstring for the layout)."""

FORMAT = "embedmesh.checkpoint"
FORMAT_VERSION = 1
DEFAULT_ITEM = "embedding"
LOOKUP_FIELD = "lookup_parameters"  # checksum field of a table's "lookup_tables" array
