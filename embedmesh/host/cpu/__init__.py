"""C++ sources of the host preprocessing kernels (package data; see
embedmesh.host.native_backend)."""
