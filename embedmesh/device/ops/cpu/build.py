"""The device kernels' sources and build: `embedmesh._native`'s "device" library.

The sources are this package's `*.cc` and `*.h` files (package data), compiled with
XLA's FFI headers as one translation unit at install (`setup.py`: one build per ISA
variant, the running CPU's best loaded) or, in a source checkout without an install,
at first use into the cache. See `embedmesh._native`.
"""

from __future__ import annotations

from embedmesh import _native

LIBRARY = _native.LIBRARIES["device"]
SOURCE_DIR = LIBRARY.source_dir


def source_files() -> list[str]:
    """The kernel sources shipped with the package: every `.h` and `.cc` here, by name."""
    return LIBRARY.source_files()
