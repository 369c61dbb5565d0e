"""The package's C++ libraries: which exist, their ISA variants, building and loading them.

Standard library only, no jax and no other embedmesh module at import: `setup.py` loads
this file by path to build the libraries at install (`build_all`), and both the device
layer (`embedmesh.device.ops.cpu`, XLA FFI handlers) and the serving layer (plain C,
ctypes) load theirs with `load(kind) -> ctypes.CDLL`, as does the host layer (host
preprocessing's kernels, plain C).

`LIBRARIES` is the table of libraries: a name, the package folder of its `*.cc` / `*.h`
sources (all `.cc` of a folder are compiled as one translation unit), and whether it
includes XLA's FFI headers. Those ship with the package (`_ffi_include/`, copied from
jaxlib: see its NOTICE), so the build needs no jax nor jaxlib. An FFI library depends on
the running XLA only through the FFI C API's version (the headers' `XLA_FFI_API_MAJOR`.
`XLA_FFI_API_MINOR`, recorded in the manifest), which XLA checks against the versions it
supports when each handler is registered; another jaxlib needs no rebuild. A library
whose folder does not exist or holds no `.cc` is skipped at install and unavailable at
run time.

ISA variants (x86-64): each library is built at install once per variant,
`x86-64-v4` (AVX-512), `x86-64-v3` (AVX2 + FMA) and `x86-64` (the baseline every x86-64
CPU runs), always with `-ffp-contract=off -fno-math-errno` (float32 results equal the
pure-JAX path's; sqrt vectorises). `load` picks the best variant the running CPU
supports (its `/proc/cpuinfo` flags: `choose_variant`), or the one
`EMBEDMESH_CPU_ISA` names (`avx512` / `x86-64-v4`, `avx2` / `x86-64-v3`, `baseline` /
`x86-64`, or `native`: `-march=native`, built at first use into the cache; a variant
the CPU cannot run is a `ValueError`). Other architectures have one variant, `generic`
(the compiler's default target).

Where `load` finds a library, in order:
1. built with the package (`pip install .` or `pip install -e .`): `embedmesh/_libs/`,
   with `manifest.json` recording each library's source digest (an FFI library's
   includes the shipped FFI headers), variants and compiler; used when its digest
   matches the sources next to it; a reinstall into the same folder compiles only what
   would come out different;
2. the cache (`$EMBEDMESH_CACHE_DIR`, else `$XDG_CACHE_HOME/embedmesh`, else
   `~/.cache/embedmesh`; a per-user temporary directory when that is not writable),
   keyed by a hash of sources, compiler and flags;
3. built now into the cache (a source checkout used through PYTHONPATH, or sources
   edited since the install), after one line on stderr saying so and why.
When none of these works (no compiler, a failed build), `load` raises
`NativeUnavailable` whose message names the cause and the fix.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable

__all__ = [
    "ISA_ENV",
    "LIBRARIES",
    "VARIANTS",
    "Library",
    "NativeUnavailable",
    "build_all",
    "choose_variant",
    "cpu_flags",
    "editable_variants",
    "install_variants",
    "library_path",
    "load",
    "selected_variant",
]

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Where the install puts the built libraries (a package folder; tests point it elsewhere).
LIB_DIR_NAME = "_libs"
PACKAGE_LIB_DIR = os.path.join(PACKAGE_DIR, LIB_DIR_NAME)
MANIFEST = "manifest.json"
ISA_ENV = "EMBEDMESH_CPU_ISA"
# XLA's FFI headers, shipped with the package (the include directory: `xla/ffi/api/...`)
FFI_INCLUDE_DIR = os.path.join(PACKAGE_DIR, "_ffi_include")
FFI_FILES = ("xla/ffi/api/api.h", "xla/ffi/api/c_api.h", "xla/ffi/api/ffi.h")

# No FMA contraction: the float32 arithmetic matches the pure-JAX path. No errno from
# sqrt: with it GCC cannot vectorise the optimizer rows (150 -> 19 ns per 64-wide
# Adagrad row measured). -w: XLA's headers warn a lot.
FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    "-w",
)


class Library:
    """One C++ library of the package: its sources' folder (relative to the package),
    whether it includes XLA's FFI headers, and `own_units`: the `.cc` files compiled as
    translation units of their own, in parallel with one unit `#include`-ing all the
    others (the device library's two halves of the fused updates took 72 s of its 85 as
    one unit; each unit parses XLA's headers again, so the small files stay together)."""

    def __init__(self, name: str, folder: str, ffi: bool, own_units: tuple[str, ...] = ()):
        self.name, self.folder, self.ffi = name, folder, ffi
        self.own_units = tuple(own_units)

    @property
    def source_dir(self) -> str:
        if os.path.isabs(self.folder):
            return self.folder
        return os.path.join(PACKAGE_DIR, *self.folder.split("/"))

    def source_files(self) -> list[str]:
        """Its `.h` and `.cc` files, by name ([] when the folder does not exist)."""
        d = self.source_dir
        if not os.path.isdir(d):
            return []
        names = sorted(n for n in os.listdir(d) if n.endswith((".h", ".cc")))
        return [os.path.join(d, n) for n in names]

    def digest(self) -> str:
        """Hash of its sources (names and contents) and, for an FFI library, of the FFI
        headers it includes: what a built library was built from."""
        h = hashlib.sha256()
        inputs = [(os.path.basename(p), p) for p in self.source_files()]
        if self.ffi and inputs:
            inputs += [(n, os.path.join(FFI_INCLUDE_DIR, *n.split("/"))) for n in FFI_FILES]
        for name, path in inputs:
            try:
                with open(path, "rb") as f:
                    content = f.read()
            except FileNotFoundError:  # a header gone: building says so (ffi_include_dir)
                content = b"missing"
            h.update(name.encode() + b"\0" + content + b"\0")
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"Library({self.name!r}, {self.folder!r}, ffi={self.ffi})"


LIBRARIES = {
    # XLA FFI handlers of the device ops (registered by embedmesh.device.ops.cpu.library)
    "device": Library(
        "device", "device/ops/cpu", ffi=True, own_units=("update.cc", "update_moments.cc")
    ),
    # the serving lookup's bag kernels: plain C ABI (extern "C"), loaded with ctypes
    "serving": Library("serving", "serving/cpu", ffi=False),
    # host preprocessing's kernels (embedmesh.host.native_backend): plain C, ctypes
    "host": Library("host", "host/cpu", ffi=False),
}

# x86-64 variants, best first: (name, compiler flags, /proc/cpuinfo flags it needs).
# The levels are the x86-64 psABI's (x86-64-v3 needs lzcnt: "abm" in /proc/cpuinfo).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANTS = {
    "x86-64-v4": (("-march=x86-64-v4", "-mtune=generic"), _V4),
    "x86-64-v3": (("-march=x86-64-v3", "-mtune=generic"), _V3),
    "x86-64": (("-march=x86-64", "-mtune=generic"), frozenset()),
}
GENERIC = "generic"  # the one variant on other architectures: the compiler's default
NATIVE = "native"  # -march=native: never installed, built at first use when asked for
ALIASES = {
    "avx512": "x86-64-v4",
    "avx2": "x86-64-v3",
    "baseline": "x86-64",
    "v4": "x86-64-v4",
    "v3": "x86-64-v3",
}


def is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def install_variants(machine: str | None = None) -> list[str]:
    """The variants a wheel (`pip install .`, `pip wheel .`) builds on this architecture:
    every one, so that it runs on any CPU of the architecture at its speed."""
    return list(VARIANTS) if is_x86_64(machine) else [GENERIC]


BUILD_VARIANTS_ENV = "EMBEDMESH_BUILD_VARIANTS"


def editable_variants() -> list[str]:
    """The variants an editable install (`pip install -e .`) builds: the one this CPU
    loads (a checkout runs where it was installed; each x86-64 variant is 20-60
    CPU-seconds), or what `EMBEDMESH_BUILD_VARIANTS` says ("all", or names/aliases
    separated by commas). Another variant, if one is ever selected, is built into the
    cache at first use, saying so."""
    value = os.environ.get(BUILD_VARIANTS_ENV, "").strip().lower()
    if not value:
        return [choose_variant(cpu_flags())]
    if value == "all":
        return install_variants()
    words = [v.strip() for v in value.split(",")]
    names = [ALIASES.get(w, w) for w in words if w]
    unknown = [n for n in names if n not in install_variants()]
    if unknown or not names:
        raise ValueError(
            f"{BUILD_VARIANTS_ENV}={value!r}: expected 'all' or some of "
            f"{', '.join(install_variants())}"
        )
    return names


def variant_flags(variant: str) -> tuple[str, ...]:
    if variant == NATIVE:
        return ("-march=native",)
    if variant == GENERIC:
        return ()
    return VARIANTS[variant][0]


def choose_variant(flags: Iterable[str], machine: str = "x86_64") -> str:
    """The best installed variant a CPU with these `/proc/cpuinfo` flags runs."""
    if not is_x86_64(machine):
        return GENERIC
    have = set(flags)
    for name, (_, needs) in VARIANTS.items():
        if needs <= have:
            return name
    return "x86-64"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The running CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere: the
    baseline variant). The kernel lists only what the OS enables (AVX-512 state too)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def selected_variant() -> str:
    """The variant `load` uses: `EMBEDMESH_CPU_ISA` if set, else `choose_variant` of this
    CPU. Read once per process."""
    best = choose_variant(cpu_flags())
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return best
    name = ALIASES.get(value, value)
    known = [*VARIANTS, GENERIC, NATIVE] if is_x86_64() else [GENERIC, NATIVE]
    if name not in known:
        raise ValueError(
            f"{ISA_ENV}={value!r}: expected one of avx512, avx2, baseline, native "
            f"({', '.join(known)})"
        )
    if name == GENERIC and is_x86_64():
        name = "x86-64"
    if name in VARIANTS and not VARIANTS[name][1] <= cpu_flags():
        missing = sorted(VARIANTS[name][1] - cpu_flags())
        raise ValueError(
            f"{ISA_ENV}={value!r}: this CPU cannot run the {name} variant (it lacks "
            f"{', '.join(missing)}); the best it runs is {best}"
        )
    return name


class NativeUnavailable(RuntimeError):
    """A library cannot be loaded; the message says why and what fixes it."""


# ---------------------------------------------------------------------------------------
# Building


def compiler() -> str | None:
    """`$CXX`, else the first of c++, g++, clang++ on PATH."""
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        return (out.stdout.splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        return ""


def ffi_include_dir() -> str:
    """The include directory of XLA's FFI headers shipped with the package (the FFI
    libraries' `-I`); raises NativeUnavailable when a header is missing (a broken copy)."""
    found = os.path.isfile
    missing = [n for n in FFI_FILES if not found(os.path.join(FFI_INCLUDE_DIR, *n.split("/")))]
    if missing:
        raise NativeUnavailable(
            f"XLA's FFI headers shipped with the package are missing: {', '.join(missing)} "
            f"in {FFI_INCLUDE_DIR} (reinstall embedmesh)"
        )
    return FFI_INCLUDE_DIR


_API = ("MAJOR", "MINOR")


def ffi_api_version(include: str | None = None) -> str:
    """The XLA FFI C API version ("major.minor") of the FFI headers in `include` (default:
    the shipped ones): the one an FFI library built against them reports to XLA. "" when
    the headers are missing or do not say."""
    path = os.path.join(include or FFI_INCLUDE_DIR, "xla", "ffi", "api", "c_api.h")
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    found = [re.search(rf"^#define XLA_FFI_API_{p} (\d+)\s*$", text, re.M) for p in _API]
    return ".".join(m.group(1) for m in found) if all(found) else ""


def _cpu_signature() -> str:
    """What -march=native depends on: a cached native build must not move to another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def compile_library(
    lib: Library, variant: str, out: str, cxx: str, include: str | None = None
) -> None:
    """Compile `lib` for `variant` into the file `out`: its `own_units` each a translation
    unit, the other `.cc` files one, compiled in parallel, then linked (undefined symbols
    refused). Raises NativeUnavailable with the compiler's message on failure."""
    sources = [f for f in lib.source_files() if f.endswith(".cc")]
    if not sources:
        raise NativeUnavailable(f"no {lib.name} kernel sources (*.cc) in {lib.source_dir}")
    if lib.ffi and include is None:
        include = ffi_include_dir()
    flags = [*FLAGS, *variant_flags(variant)]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out) or ".") as tmp:
        rest = [f for f in sources if os.path.basename(f) not in lib.own_units]
        if rest:
            unity = os.path.join(tmp, f"embedmesh_{lib.name}.cc")
            with open(unity, "w") as f:
                f.write("".join(f'#include "{s}"\n' for s in rest))
            sources = [f for f in sources if f not in rest] + [unity]  # long ones first

        def run(command: list[str], what: str) -> None:
            try:
                r = subprocess.run(command, capture_output=True, text=True, timeout=1200)
            except (OSError, subprocess.SubprocessError) as e:
                raise NativeUnavailable(f"running {cxx} failed: {e}") from None
            if r.returncode != 0:
                raise NativeUnavailable(
                    f"{what} the {lib.name} kernels ({variant}) failed:\n"
                    f"{' '.join(command)}\n{r.stderr[-2000:]}"
                )

        def compile_one(source: str) -> str:
            obj = os.path.join(tmp, os.path.basename(source) + ".o")
            command = [cxx, *(f for f in flags if f != "-shared"), "-c"]
            if lib.ffi:
                command += ["-I", str(include)]
            run([*command, "-I", lib.source_dir, source, "-o", obj], "compiling")
            return obj

        jobs = min(len(sources), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            objects = list(pool.map(compile_one, sources))
        part = os.path.join(tmp, os.path.basename(out))
        run([cxx, *flags, "-Wl,--no-undefined", *objects, "-o", part], "linking")
        os.replace(part, out)  # atomic: concurrent builders are safe


def build_all(
    out_dir: str,
    kinds: Iterable[str] | None = None,
    variants: Iterable[str] | None = None,
    jobs: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Build every library x variant into `out_dir` (in parallel, `jobs` at a time,
    default one per CPU) and write its manifest; what the install runs. A failed build
    is recorded in the manifest (and logged), not raised: the package still installs,
    and `load` says why at first use. Returns the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    kinds = [k for k in (kinds or LIBRARIES) if LIBRARIES[k].source_files()]
    variants = list(variants or install_variants())
    cxx = compiler()
    manifest: dict = {
        "compiler": (cxx or "") and f"{cxx}: {compiler_version(cxx)}",
        "ffi_api": ffi_api_version(),
        "machine": platform.machine(),
        "libraries": {},
    }
    previous = _read_manifest(out_dir)
    tasks = []
    for kind in kinds:
        lib = LIBRARIES[kind]
        entry = manifest["libraries"][kind] = {"digest": lib.digest(), "variants": {}}
        entry["failed"] = {}
        for variant in variants:
            built = _up_to_date(previous, manifest, kind, variant, out_dir)
            if built is None:
                tasks.append((kind, variant))
            else:
                entry["variants"][variant] = built
                log(f"embedmesh: the {kind} kernels ({variant}) are up to date")
    if cxx is None and tasks:
        for kind, variant in tasks:
            manifest["libraries"][kind]["failed"][variant] = "no C++ compiler found (set CXX)"
        log("embedmesh: no C++ compiler found (set CXX): the C++ kernels are not built")
    elif tasks:

        def one(task):
            kind, variant = task
            name = f"embedmesh_{kind}-{variant}.so"
            compile_library(LIBRARIES[kind], variant, os.path.join(out_dir, name), cxx)
            return name

        with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            futures = {pool.submit(one, t): t for t in tasks}
            for future in concurrent.futures.as_completed(futures):
                kind, variant = futures[future]
                entry = manifest["libraries"][kind]
                try:
                    entry["variants"][variant] = {
                        "file": future.result(),
                        "flags": [*FLAGS, *variant_flags(variant)],
                    }
                    log(f"embedmesh: built the {kind} kernels ({variant})")
                except Exception as e:  # noqa: BLE001 recorded, said at first use
                    entry["failed"][variant] = str(e)
                    log(f"embedmesh: building the {kind} kernels ({variant}) failed: {e}")
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def _read_manifest(out_dir: str) -> dict:
    try:
        with open(os.path.join(out_dir, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest if isinstance(manifest, dict) else {}
    except (OSError, ValueError):
        return {}


def _up_to_date(previous: dict, manifest: dict, kind: str, variant: str, out_dir: str):
    """The previous build's entry for (kind, variant) when building again would make the
    same library: same sources (an FFI library's digest covers the FFI headers), compiler,
    machine and flags, and its file still there; else None. A reinstall (CI's second
    `pip install -e`, a Python 3.12 venv on the same checkout) then compiles only what
    changed."""
    keys = ("compiler", "machine")
    if not manifest["compiler"] or any(previous.get(k) != manifest[k] for k in keys):
        return None
    entry = previous.get("libraries", {}).get(kind, {})
    built = entry.get("variants", {}).get(variant)
    if entry.get("digest") != manifest["libraries"][kind]["digest"] or not built:
        return None
    if built.get("flags") != [*FLAGS, *variant_flags(variant)]:
        return None
    if not os.path.isfile(os.path.join(out_dir, str(built.get("file")))):
        return None
    return built


# ---------------------------------------------------------------------------------------
# Loading

_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL, str]] = {}
_failed: dict[str, str] = {}

_FIX = (
    "install a C++ compiler (g++ or clang++, or set CXX) if there is none, then reinstall "
    "embedmesh: pip install . (pip install -e . in a checkout) builds them"
)


def _installed(kind: str, variant: str, digest: str) -> tuple[str | None, str]:
    """The installed library's path, or (None, why it cannot be used)."""
    try:
        with open(os.path.join(PACKAGE_LIB_DIR, MANIFEST)) as f:
            manifest = json.load(f)
        entry = manifest["libraries"][kind]
    except (OSError, ValueError, KeyError, TypeError):
        return None, "not built with the package (a source checkout without an install?)"
    if entry.get("digest") != digest:
        return None, "its sources changed since the install"
    built = entry.get("variants", {}).get(variant)
    if built is None:
        failed = entry.get("failed", {}).get(variant)
        return None, f"the install's {variant} build failed: {failed}" if failed else (
            f"the install built no {variant} variant"
        )
    path = os.path.join(PACKAGE_LIB_DIR, built["file"])
    return (path, "") if os.path.exists(path) else (None, f"{path} is missing")


def _cache_dirs() -> list[str]:
    d = os.environ.get("EMBEDMESH_CACHE_DIR", "").strip()
    if not d:
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
            os.path.expanduser("~"), ".cache"
        )
        d = os.path.join(base, "embedmesh")
    return [d, os.path.join(tempfile.gettempdir(), f"embedmesh-{os.getuid()}")]


def _build_in_cache(lib: Library, variant: str, reason: str) -> str:
    cxx = compiler()
    if cxx is None:
        raise NativeUnavailable(f"{reason}, and no C++ compiler found to build them (set CXX)")
    include = ffi_include_dir() if lib.ffi else None
    key = [lib.digest(), cxx, compiler_version(cxx), *FLAGS, *variant_flags(variant)]
    key += [sys.platform, platform.machine()]
    if variant == NATIVE:
        key.append(_cpu_signature())
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:20]
    name = f"embedmesh_{lib.name}-{variant}-{digest}.so"
    why = "no writable cache directory"
    for d in _cache_dirs():
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            why = f"cannot write {d}: {e}"
            continue
        sys.stderr.write(
            f"embedmesh: building the C++ {lib.name} kernels ({variant}) into {d}, once "
            f"(about 30 s): {reason}\n"
        )
        sys.stderr.flush()
        try:
            compile_library(lib, variant, path, cxx, include)
        except OSError as e:  # unwritable: try the next directory
            why = f"cannot write {d}: {e}"
            continue
        return path
    raise NativeUnavailable(why)


def _find(kind: str) -> str:
    lib = LIBRARIES[kind]
    if not lib.source_files():
        raise NativeUnavailable(f"no {kind} kernel sources in {lib.source_dir}")
    variant = selected_variant()
    if variant == NATIVE:
        return _build_in_cache(lib, variant, f"{ISA_ENV}=native")
    path, reason = _installed(kind, variant, lib.digest())
    if path is not None:
        return path
    return _build_in_cache(lib, variant, reason)


def load(kind: str) -> ctypes.CDLL:
    """The `kind` library (a key of `LIBRARIES`), loaded once per process: the installed
    build of the selected variant, else a cached or new build (see the module's doc).
    Raises NativeUnavailable (the cause and the fix) when it cannot be had, again on
    each later call; ValueError for an unknown kind or a bad EMBEDMESH_CPU_ISA."""
    if kind not in LIBRARIES:
        raise ValueError(f"unknown native library {kind!r}: expected one of {sorted(LIBRARIES)}")
    with _lock:
        if kind in _loaded:
            return _loaded[kind][0]
        if kind in _failed:
            raise NativeUnavailable(_failed[kind])
        try:
            path = _find(kind)
            lib = ctypes.CDLL(path)
        except (NativeUnavailable, OSError) as e:
            _failed[kind] = f"the C++ {kind} kernels are unavailable: {e} (fix: {_FIX})"
            raise NativeUnavailable(_failed[kind]) from None
        _loaded[kind] = (lib, path)
        return lib


def library_path(kind: str) -> str:
    """Path of the loaded `kind` library ("" before it is loaded or when it failed)."""
    entry = _loaded.get(kind)
    return entry[1] if entry else ""
