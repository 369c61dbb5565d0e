"""Builds the package's C++ libraries at install (`pip install .`, `pip install -e .`,
`pip wheel .`): every library of `embedmesh/_native.py`'s `LIBRARIES`, in parallel, into
`embedmesh/_libs/` (the wheel's, or the checkout's for an editable install): once per
ISA variant for a wheel, the variant this CPU loads for an editable install
(`EMBEDMESH_BUILD_VARIANTS=all` builds them all). Everything else is in pyproject.toml."""

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))


def _native():
    """embedmesh/_native.py, loaded by path: importing the package would import jax."""
    spec = importlib.util.spec_from_file_location(
        "_embedmesh_native_build", os.path.join(ROOT, "embedmesh", "_native.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class BuildNative(build_ext):
    """Compiles the C++ libraries (plain shared libraries loaded with ctypes; a failed
    build is recorded and said at first use), then the one Python extension,
    `embedmesh.serving._request` (optional: without it the serving lookup runs the same
    checks in Python)."""

    def _editable(self) -> bool:
        return bool(self.inplace or getattr(self, "editable_mode", False))

    def _out_dir(self):
        native = _native()
        if self._editable():
            return os.path.join(ROOT, "embedmesh", native.LIB_DIR_NAME)
        return os.path.join(self.build_lib, "embedmesh", native.LIB_DIR_NAME)

    def run(self):
        native = _native()
        jobs = int(os.environ.get("EMBEDMESH_BUILD_JOBS", "0")) or os.cpu_count() or 1
        # a wheel: every ISA variant; a checkout: the one this CPU loads
        variants = native.editable_variants() if self._editable() else native.install_variants()
        native.build_all(
            self._out_dir(), variants=variants, jobs=jobs, log=lambda m: print(m, flush=True)
        )
        super().run()

    def get_outputs(self):
        ext = super().get_outputs()
        if self._editable():
            return ext
        out = self._out_dir()
        libs = [os.path.join(out, f) for f in os.listdir(out)] if os.path.isdir(out) else []
        return ext + libs


class BinaryDistribution(Distribution):
    """A platform wheel: it carries compiled libraries."""

    def has_ext_modules(self):
        return True


# The serving request path (embedmesh/serving/fast_path.py): CPython's stable ABI, so one
# build serves Python 3.11 and newer.
REQUEST = Extension(
    "embedmesh.serving._request",
    ["embedmesh/serving/ext/request.cc"],
    py_limited_api=True,
    define_macros=[("Py_LIMITED_API", "0x030B0000")],
    extra_compile_args=["-O2", "-std=c++17"],
    optional=True,
)

setup(
    cmdclass={"build_ext": BuildNative},
    distclass=BinaryDistribution,
    ext_modules=[REQUEST],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
