"""Builds the package's C++ libraries at install (`pip install .`, `pip install -e .`,
`pip wheel .`): every library of `embedmesh/_native.py`'s `LIBRARIES`, in parallel, into
`embedmesh/_libs/` (the wheel's, or the checkout's for an editable install): once per
ISA variant for a wheel, the variant this CPU loads for an editable install
(`EMBEDMESH_BUILD_VARIANTS=all` builds them all). Everything else is in pyproject.toml."""

import importlib.util
import os
import sys

from setuptools import setup
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
    """Compiles the C++ libraries (they are no Python extensions: plain shared
    libraries loaded with ctypes); a failed build is recorded and said at first use."""

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

    def get_outputs(self):
        if self._editable():
            return []
        out = self._out_dir()
        return [os.path.join(out, f) for f in os.listdir(out)] if os.path.isdir(out) else []

    def get_output_mapping(self):
        return {}


class BinaryDistribution(Distribution):
    """A platform wheel: it carries compiled libraries."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_ext": BuildNative}, distclass=BinaryDistribution)
