"""The compiler driver and cache of the CPU kernels: `.cc` files in, a shared library out.

The sources are this package's `*.cc` and `*.h` files (package data). They are
compiled as one translation unit (a generated file that includes every `.cc`:
one pass over XLA's FFI headers, about half the build time of separate units,
and the same code as one source file) with `$CXX` (else `c++`, `g++`,
`clang++`) against `jax.ffi.include_dir()`, into a cache directory
(`embedmesh._runtime.cache_dir()`: `$EMBEDMESH_CACHE_DIR`, else
`$XDG_CACHE_HOME/embedmesh`, else `~/.cache/embedmesh`; a per-user temporary
directory when that one is not writable). The library's name is a hash of the
sources, the compiler and its version, jaxlib's version, the flags, the CPU
signature and the OS, so a change to any of them builds a new one; concurrent
builders are safe (atomic rename). One build takes about 10 s.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from embedmesh import _runtime

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))

FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
# Tuned for the CPU that builds (and runs) them: the library is cached per CPU signature.
# No FMA contraction, so the float32 arithmetic matches the pure-JAX path. No errno from
# sqrt: with it, GCC cannot vectorise the optimizer rows (150 -> 19 ns per 64-wide Adagrad
# row here; same results, sqrt stays IEEE-exact).
NATIVE = ("-march=native",)


def source_files() -> list[str]:
    """The kernel sources shipped with the package: every `.h` and `.cc` here, by name."""
    files = glob.glob(os.path.join(SOURCE_DIR, "*.h")) + glob.glob(os.path.join(SOURCE_DIR, "*.cc"))
    return sorted(files, key=os.path.basename)


def _cpu_signature() -> str:
    """What `-march=native` depends on: a cached build must not move to another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _unity_source(files) -> str:
    """One translation unit that includes every `.cc` of `files`."""
    return "".join(f'#include "{source}"\n' for source in files if source.endswith(".cc"))


def build_library() -> tuple[str | None, str]:
    """Path of the built library (building it if needed), or (None, why not)."""
    import jax
    import jaxlib

    files = source_files()
    if not any(source.endswith(".cc") for source in files):
        return None, f"no kernel sources (*.cc) in {SOURCE_DIR}"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=60
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    digest = hashlib.sha256()
    for source in files:
        with open(source, "rb") as text:
            digest.update(os.path.basename(source).encode() + b"\0" + text.read() + b"\0")
    digest.update(
        "\0".join(
            [cxx, *version, jaxlib.__version__, *FLAGS, *NATIVE, _cpu_signature(), sys.platform]
        ).encode()
    )
    name = f"embedmesh_cpu_kernels_{digest.hexdigest()[:20]}.so"
    why = "no writable cache directory"
    for d in (
        _runtime.cache_dir(),
        os.path.join(tempfile.gettempdir(), f"embedmesh-{os.getuid()}"),
    ):
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path, ""
        try:
            os.makedirs(d, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                unity = os.path.join(tmp, "embedmesh_cpu_kernels.cc")
                with open(unity, "w") as unity_file:
                    unity_file.write(_unity_source(files))
                out = os.path.join(tmp, name)
                for native in (NATIVE, ()):  # a compiler without -march=native: plain
                    r = subprocess.run(
                        [
                            cxx,
                            *FLAGS,
                            *native,
                            "-I",
                            jax.ffi.include_dir(),
                            "-I",
                            SOURCE_DIR,
                            unity,
                            "-o",
                            out,
                        ],
                        capture_output=True,
                        text=True,
                        timeout=600,
                    )
                    if r.returncode == 0:
                        break
                if r.returncode != 0:
                    return None, f"compiling the CPU kernels failed:\n{r.stderr[-2000:]}"
                os.replace(out, path)  # atomic: concurrent builders are safe
            return path, ""
        except OSError as e:  # unwritable cache dir: try the next one
            why = f"cannot write {d}: {e}"
    return None, why
