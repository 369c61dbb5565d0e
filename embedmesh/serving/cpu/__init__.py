"""C++ sources of the serving kernels (package data; see embedmesh.serving.native)."""
