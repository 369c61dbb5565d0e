"""Builds the package's C++ libraries at install (`pip install .`, `pip install -e .`,
`pip wheel .`): every library of `embedmesh/_native.py`'s `LIBRARIES`, in parallel, into
`embedmesh/_libs/` (the wheel's, or the checkout's for an editable install): once per
ISA variant for a wheel, the variant this CPU loads for an editable install
(`EMBEDMESH_BUILD_VARIANTS=all` builds them all). Everything else is in pyproject.toml."""

import concurrent.futures
import importlib.util
import os
import re
import stat
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


def _pip_stdout() -> str | None:
    """Where pip's own output goes, when pip runs this build and was not asked to be quiet:
    `/proc/<pip>/fd/1` (Linux), else None. pip captures a build's output and shows it only
    with `pip -v`, so `pip install -e .` would compile the kernels for minutes with nothing
    on the screen but a spinner; the build's progress lines go beside pip's own instead,
    where that is a terminal or a pipe. Quiet (`-q`, `--quiet`, `PIP_QUIET`) stays quiet:
    README's demo command."""
    if os.environ.get("PIP_QUIET", "").strip() not in ("", "0", "false", "no", "off"):
        return None
    pid = os.getppid()
    for _ in range(6):  # pip -> its build backend's process -> setuptools -> this file
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        words = [os.path.basename(a) for a in argv[:3]]
        if any(re.fullmatch(r"pip[\d.]*", w) for w in words) and any(
            a in ("install", "wheel") for a in argv
        ):
            quiet = any(a == "--quiet" or re.fullmatch(r"-[a-zA-Z]*q[a-zA-Z]*", a) for a in argv)
            target = f"/proc/{pid}/fd/1"
            try:
                # a terminal or a pipe; not a file, whose offset is pip's own: pip's next
                # line would overwrite ours
                return None if quiet or stat.S_ISREG(os.stat(target).st_mode) else target
            except OSError:
                return None
        if parent <= 1:
            return None
        pid = parent
    return None


def _progress(message: str) -> None:
    """One line of the build's progress: on stdout (pip shows it with -v; a plain
    `python setup.py ...` shows it), and where pip's own output goes (`_pip_stdout`)."""
    print(message, flush=True)
    target = _pip_stdout()
    if target is None:
        return
    try:
        with open(target, "a") as f:
            f.write(f"\n{message}" if os.isatty(f.fileno()) else f"{message}\n")
    except OSError:
        pass  # not ours to write to (another user's pip, a closed pipe): stdout only


class BuildNative(build_ext):
    """Compiles the C++ libraries (plain shared libraries loaded with ctypes; a failed
    build is recorded and said at first use) and, beside them, the one Python extension,
    `embedmesh.serving._request` (optional: without it every serving request takes the
    general path)."""

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
        kinds = [k for k, lib in native.LIBRARIES.items() if lib.source_files()]
        _progress(
            f"embedmesh: building the C++ kernels ({', '.join(kinds)}; {', '.join(variants)})"
            f" and the serving request extension, {jobs} at a time: a minute or a few"
        )
        # The request extension (setuptools' compile of one file) builds beside the
        # libraries: after them it ran alone on one core while the others idled. Where
        # they go is read first: setuptools' run clears `inplace` while it runs.
        out = self._out_dir()
        with concurrent.futures.ThreadPoolExecutor(1) as extension:
            request = extension.submit(super().run)
            native.build_all(out, variants=variants, jobs=jobs, log=_progress)
            request.result()
        _progress("embedmesh: built the serving request extension; the C++ build is done")

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


# The serving request rules (bound by embedmesh/serving/request.py): CPython's stable ABI, so one
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
