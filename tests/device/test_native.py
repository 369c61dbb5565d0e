"""The package's C++ libraries (`embedmesh._native`): the ISA variant chooser and its
override, the installed / cached / missing cases of `load`, on a tiny plain-C library
built here (fast), and a fresh process's first lookup loading the device kernels from
the package's folder without running a compiler."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from paths import ROOT

from embedmesh import _native
from embedmesh.device.ops import cpu

# /proc/cpuinfo flags of real CPUs (abridged to what the levels ask for, plus noise)
SAPPHIRE_RAPIDS = [
    "fpu",
    "sse",
    "sse2",
    "ssse3",
    "pni",
    "cx16",
    "sse4_1",
    "sse4_2",
    "popcnt",
    "lahf_lm",
    "movbe",
    "xsave",
    "avx",
    "f16c",
    "fma",
    "abm",
    "bmi1",
    "bmi2",
    "avx2",
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512_fp16",
    "amx_tile",
]
ZEN3 = [f for f in SAPPHIRE_RAPIDS if not f.startswith(("avx512", "amx"))]
SANDY_BRIDGE = [f for f in ZEN3 if f not in ("avx2", "fma", "bmi1", "bmi2", "movbe", "abm")]
CORE2 = ["fpu", "sse", "sse2", "ssse3", "pni", "cx16", "lahf_lm"]


@pytest.mark.parametrize(
    "flags, machine, variant",
    [
        (SAPPHIRE_RAPIDS, "x86_64", "x86-64-v4"),
        (ZEN3, "x86_64", "x86-64-v3"),
        ([f for f in ZEN3 if f != "fma"], "x86_64", "x86-64"),  # AVX2 without FMA: not v3
        (SANDY_BRIDGE, "x86_64", "x86-64"),
        (CORE2, "x86_64", "x86-64"),
        ([], "x86_64", "x86-64"),  # no /proc/cpuinfo: the baseline
        (SAPPHIRE_RAPIDS[:-3], "x86_64", "x86-64-v3"),  # avx512 without bw/vl: not v4
        (SAPPHIRE_RAPIDS, "aarch64", "generic"),
    ],
)
def test_variant_chooser(flags, machine, variant):
    assert _native.choose_variant(flags, machine) == variant


@pytest.fixture
def isa(monkeypatch):
    """Set EMBEDMESH_CPU_ISA and the CPU's flags; `selected_variant` re-read."""

    def set_(value, flags=SAPPHIRE_RAPIDS):
        monkeypatch.setenv(_native.ISA_ENV, value)
        monkeypatch.setattr(_native, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(_native, "is_x86_64", lambda machine=None: True)
        _native.selected_variant.cache_clear()
        return _native.selected_variant()

    yield set_
    _native.selected_variant.cache_clear()


def test_isa_override(isa):
    assert isa("") == "x86-64-v4"  # unset: the best the CPU runs
    assert isa("avx2") == isa("x86-64-v3") == isa(" AVX2 ") == "x86-64-v3"
    assert isa("baseline") == isa("x86-64") == "x86-64"
    assert isa("native") == "native"
    assert isa("avx2", ZEN3) == "x86-64-v3"
    with pytest.raises(ValueError, match=r"EMBEDMESH_CPU_ISA='avx512'.*lacks avx512bw"):
        isa("avx512", ZEN3)  # would die of SIGILL
    with pytest.raises(ValueError, match=r"EMBEDMESH_CPU_ISA='sse9'.*expected one of"):
        isa("sse9")


def test_editable_install_builds_the_variant_this_cpu_loads(monkeypatch):
    """A wheel builds every variant; an editable install the one this CPU loads, unless
    EMBEDMESH_BUILD_VARIANTS says otherwise."""
    monkeypatch.setattr(_native, "is_x86_64", lambda machine=None: True)
    monkeypatch.setenv(_native.ISA_ENV, "avx2")  # a runtime choice: not what is built
    for flags, want in ((SAPPHIRE_RAPIDS, "x86-64-v4"), (ZEN3, "x86-64-v3"), (CORE2, "x86-64")):
        monkeypatch.setattr(_native, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.delenv(_native.BUILD_VARIANTS_ENV, raising=False)
        assert _native.editable_variants() == [want]
        monkeypatch.setenv(_native.BUILD_VARIANTS_ENV, " ALL ")
        assert _native.editable_variants() == _native.install_variants() == list(_native.VARIANTS)
    monkeypatch.setenv(_native.BUILD_VARIANTS_ENV, "avx2, baseline")
    assert _native.editable_variants() == ["x86-64-v3", "x86-64"]
    for bad in ("sse9", ",", "avx2,native"):
        monkeypatch.setenv(_native.BUILD_VARIANTS_ENV, bad)
        with pytest.raises(ValueError, match=r"EMBEDMESH_BUILD_VARIANTS=.*expected 'all'"):
            _native.editable_variants()


def test_native_module_imports_only_the_standard_library():
    """setup.py loads it by path in the build environment (no jax, numpy, embedmesh)."""
    path = os.path.join(ROOT, "embedmesh", "_native.py")
    tree = ast.parse(open(path).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    top = {n.split(".")[0] for n in names}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top
    code = (
        "import importlib.util, sys; "
        "sys.modules['jaxlib'] = None; "  # as in a build environment without jaxlib
        f"s = importlib.util.spec_from_file_location('n', {path!r}); "
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
        "m.selected_variant(); m.LIBRARIES['device'].digest(); print(m.ffi_include_dir()); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in "
        "('jax', 'jaxlib', 'numpy', 'embedmesh') and sys.modules[k] is not None))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    include = os.path.join(ROOT, "embedmesh", "_ffi_include")
    assert out.stdout.splitlines() == [include, "[]"]


def test_ffi_headers_ship_with_the_package():
    """The build compiles the device kernels against XLA's FFI headers shipped in the
    package, not jaxlib's: pip's build environment installs no jaxlib. Every header the
    kernels include is there (transitively, nothing more), with its license, as package
    data; its FFI C API version is one the running jaxlib's XLA speaks."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    requires = pyproject["build-system"]["requires"]
    assert not [r for r in requires if r.lower().startswith(("jax", "jaxlib"))], requires
    include = os.path.join(ROOT, "embedmesh", "_ffi_include")
    assert _native.ffi_include_dir() == _native.FFI_INCLUDE_DIR == include
    quoted = re.compile(r'^\s*#\s*include\s+"(xla/[^"]+)"', re.M)
    todo = _native.LIBRARIES["device"].source_files()
    seen: set[str] = set()
    while todo:
        with open(todo.pop()) as f:
            for name in quoted.findall(f.read()):
                assert os.path.isfile(os.path.join(include, name)), name
                if name not in seen:
                    seen.add(name)
                    todo.append(os.path.join(include, name))
    assert seen == set(_native.FFI_FILES)
    for name in _native.FFI_FILES:
        with open(os.path.join(include, name)) as f:
            assert "Licensed under the Apache License, Version 2.0" in f.read(1000), name
    notice = open(os.path.join(include, "NOTICE")).read()
    assert "jaxlib 0.10.2" in notice and f"({_native.ffi_api_version()} here)" in notice
    assert "Apache License" in open(os.path.join(include, "LICENSE")).read(200)
    data = pyproject["tool"]["setuptools"]["package-data"]["embedmesh"]
    shipped = {"_ffi_include/NOTICE", "_ffi_include/LICENSE", "_ffi_include/xla/ffi/api/*.h"}
    assert shipped <= set(data), data
    # the running jaxlib's own copy (where it ships one): XLA's version of the C API
    import jaxlib

    theirs = _native.ffi_api_version(os.path.join(os.path.dirname(jaxlib.__file__), "include"))
    ours = _native.ffi_api_version()
    if theirs:
        (major, minor), (their_major, their_minor) = (
            tuple(map(int, v.split("."))) for v in (ours, theirs)
        )
        assert major == their_major and minor <= their_minor, (ours, theirs)


# A tiny plain-C library in a temporary folder: the loader's cases, fast.
TINY = textwrap.dedent(
    """
    #include "tiny.h"
    extern "C" int EmTinyAnswer() { return kAnswer; }
    """
)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cc").write_text(TINY)
    (src / "tiny.h").write_text("constexpr int kAnswer = 42;\n")
    lib = _native.Library("tiny", str(src), ffi=False)  # an absolute folder
    monkeypatch.setitem(_native.LIBRARIES, "tiny", lib)
    monkeypatch.setattr(_native, "PACKAGE_LIB_DIR", str(tmp_path / "libs"))
    monkeypatch.setenv("EMBEDMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_native, "_cache_dirs", lambda: [str(tmp_path / "cache")])
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_failed", {})
    return lib, tmp_path


needs_compiler = pytest.mark.skipif(_native.compiler() is None, reason="no C++ compiler")


def _no_compiler(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a compiler ran: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(_native, "compiler", lambda: None)


@needs_compiler
def test_installed_library_is_loaded_without_compiling(tiny, monkeypatch, capfd):
    lib, tmp = tiny
    manifest = _native.build_all(str(tmp / "libs"), kinds=["tiny"], log=lambda m: None)
    entry = manifest["libraries"]["tiny"]
    assert set(entry["variants"]) == set(_native.install_variants()) and not entry["failed"]
    assert json.load(open(tmp / "libs" / "manifest.json")) == manifest
    _no_compiler(monkeypatch)
    assert _native.load("tiny").EmTinyAnswer() == 42
    path = _native.library_path("tiny")
    assert os.path.dirname(path) == str(tmp / "libs")
    assert os.path.basename(path) == f"embedmesh_tiny-{_native.selected_variant()}.so"
    assert not (tmp / "cache").exists()
    assert capfd.readouterr().err == ""  # nothing said: nothing built


@needs_compiler
def test_stale_or_missing_install_builds_into_the_cache_saying_so(tiny, capfd):
    lib, tmp = tiny
    _native.build_all(str(tmp / "libs"), kinds=["tiny"], variants=[_native.selected_variant()])
    capfd.readouterr()
    (tmp / "src" / "tiny.h").write_text("constexpr int kAnswer = 43;\n")  # edited since
    assert _native.load("tiny").EmTinyAnswer() == 43
    assert os.path.dirname(_native.library_path("tiny")) == str(tmp / "cache")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, before the build
    assert "building the C++ tiny kernels" in err[0]
    assert "its sources changed since the install" in err[0]


@needs_compiler
def test_reinstall_compiles_only_what_changed(tiny, monkeypatch):
    """A second install into the same folder (CI's second `pip install -e`, another venv
    on the same checkout) reuses what would be built the same, and rebuilds on a change."""
    lib, tmp = tiny
    out, variant = str(tmp / "libs"), _native.selected_variant()
    first = _native.build_all(out, kinds=["tiny"], variants=[variant], log=lambda m: None)
    compiled = []
    real = _native.compile_library

    def counting(lib, variant, *args, **kwargs):
        compiled.append(variant)
        return real(lib, variant, *args, **kwargs)

    monkeypatch.setattr(_native, "compile_library", counting)
    said = []
    assert _native.build_all(out, kinds=["tiny"], variants=[variant], log=said.append) == first
    assert compiled == [] and said == [f"embedmesh: the tiny kernels ({variant}) are up to date"]
    (tmp / "src" / "tiny.h").write_text("constexpr int kAnswer = 44;\n")  # sources changed
    _native.build_all(out, kinds=["tiny"], variants=[variant], log=lambda m: None)
    assert compiled == [variant]
    os.remove(os.path.join(out, f"embedmesh_tiny-{variant}.so"))  # the file gone
    _native.build_all(out, kinds=["tiny"], variants=[variant], log=lambda m: None)
    assert compiled == [variant, variant]
    monkeypatch.setattr(lib, "ffi", True)  # an FFI library: the FFI headers count too
    _native.build_all(out, kinds=["tiny"], variants=[variant], log=lambda m: None)
    assert compiled == [variant] * 3
    _native.build_all(out, kinds=["tiny"], variants=[variant], log=lambda m: None)
    assert compiled == [variant] * 3
    _edit_ffi_headers(tmp, monkeypatch)
    _native.build_all(out, kinds=["tiny"], variants=[variant], log=lambda m: None)
    assert compiled == [variant] * 4
    _no_compiler(monkeypatch)
    assert _native.load("tiny").EmTinyAnswer() == 44
    assert os.path.dirname(_native.library_path("tiny")) == out


def _edit_ffi_headers(tmp, monkeypatch):
    """The shipped FFI headers as a copy in `tmp`, one of them then changed."""
    include = tmp / "include"
    shutil.copytree(_native.FFI_INCLUDE_DIR, include)
    monkeypatch.setattr(_native, "FFI_INCLUDE_DIR", str(include))
    with open(include / "xla" / "ffi" / "api" / "api.h", "a") as f:
        f.write("// changed\n")


@needs_compiler
def test_ffi_library_follows_the_ffi_headers_not_jaxlib(tiny, monkeypatch, capfd):
    """An FFI library's install records the FFI C API version of the headers it was
    built against (what XLA checks at registration); the running jaxlib's version plays
    no part; headers changed since the install are a rebuild, saying so."""
    lib, tmp = tiny
    monkeypatch.setattr(lib, "ffi", True)
    manifest = _native.build_all(
        str(tmp / "libs"), kinds=["tiny"], variants=[_native.selected_variant()]
    )
    assert manifest["ffi_api"] == _native.ffi_api_version() == "0.3"
    assert "jaxlib" not in manifest
    # another jaxlib since the install (no version of it is asked for at all)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0")
    capfd.readouterr()
    assert _native.load("tiny").EmTinyAnswer() == 42
    assert os.path.dirname(_native.library_path("tiny")) == str(tmp / "libs")
    assert capfd.readouterr().err == ""
    _edit_ffi_headers(tmp, monkeypatch)
    monkeypatch.setattr(_native, "_loaded", {})
    assert _native.load("tiny").EmTinyAnswer() == 42
    assert os.path.dirname(_native.library_path("tiny")) == str(tmp / "cache")
    assert "its sources changed since the install" in capfd.readouterr().err


def test_no_install_and_no_compiler_is_a_clear_error(tiny, monkeypatch):
    _no_compiler(monkeypatch)
    for _ in range(2):  # and again on a later call, without retrying
        with pytest.raises(_native.NativeUnavailable) as e:
            _native.load("tiny")
        message = str(e.value)
        assert "C++ tiny kernels are unavailable" in message
        assert "not built with the package" in message  # the cause
        assert "no C++ compiler found" in message
        assert "pip install" in message and "CXX" in message  # the fix


def test_install_without_a_compiler_records_why(tiny, monkeypatch):
    lib, tmp = tiny
    _no_compiler(monkeypatch)
    said = []
    manifest = _native.build_all(str(tmp / "libs"), kinds=["tiny"], log=said.append)
    entry = manifest["libraries"]["tiny"]
    assert entry["variants"] == {} and set(entry["failed"]) == set(_native.install_variants())
    assert all("no C++ compiler found" in why for why in entry["failed"].values())
    assert said == ["embedmesh: no C++ compiler found (set CXX): the C++ kernels are not built"]
    with pytest.raises(_native.NativeUnavailable, match=r"install's .* build failed: no C\+\+"):
        _native.load("tiny")


def test_failed_install_build_is_named(tiny, monkeypatch):
    lib, tmp = tiny
    (tmp / "src" / "tiny.cc").write_text("this is not C++\n")
    manifest = _native.build_all(
        str(tmp / "libs"), kinds=["tiny"], variants=["x86-64"], log=lambda m: None
    )
    if _native.compiler() is not None:
        assert (
            "compiling the tiny kernels (x86-64) failed"
            in manifest["libraries"]["tiny"]["failed"]["x86-64"]
        )
    monkeypatch.setattr(_native, "selected_variant", lambda: "x86-64")
    _no_compiler(monkeypatch)
    with pytest.raises(_native.NativeUnavailable, match=r"the install's x86-64 build failed"):
        _native.load("tiny")


def test_missing_library_folder_is_skipped_and_named(tmp_path, monkeypatch):
    lib = _native.Library("nothing", str(tmp_path / "absent"), ffi=False)
    monkeypatch.setitem(_native.LIBRARIES, "nothing", lib)
    monkeypatch.setattr(_native, "_failed", {})
    manifest = _native.build_all(str(tmp_path / "libs"), kinds=["nothing"], log=lambda m: None)
    assert "nothing" not in manifest["libraries"]  # skipped silently at install
    with pytest.raises(_native.NativeUnavailable, match=r"no nothing kernel sources in"):
        _native.load("nothing")
    with pytest.raises(ValueError, match=r"unknown native library 'tpu'"):
        _native.load("tpu")


FIRST_LOOKUP = """
import os, subprocess, sys
import embedmesh._native as native
if sys.argv[1] != "installed":
    native.PACKAGE_LIB_DIR = sys.argv[1]
def refuse(*args, **kwargs):
    raise AssertionError(f"a subprocess ran: {args}")
subprocess.Popen = refuse  # no compiler (nor anything else) is run
import jax, numpy as np
import embedmesh as em
from embedmesh.device.ops import cpu
video = em.TableConfig(vocabulary_size=1000, dim=16, combiner="mean", name="video")
emb = em.MeshEmbedding({"watched": em.FeatureConfig(video)}, optimizer=em.Adagrad(0.1))
emb.build()
activations, _ = emb({"watched": em.RaggedTensor.from_row_lengths(np.arange(24), [3] * 8)})
jax.block_until_ready(activations)
assert cpu.ready(), cpu.unavailable_reason()
print(cpu.library_path())
"""


def test_fresh_process_first_lookup_compiles_nothing(tmp_path):
    """The device kernels of a fresh process come from the package's folder (the
    install's build; in a checkout without one, this process's library laid out as
    one); no compiler runs and nothing is written to the cache."""
    if not cpu.ready():
        pytest.skip(f"no CPU kernels here: {cpu.unavailable_reason()}")
    variant = _native.selected_variant()
    digest = _native.LIBRARIES["device"].digest()
    installed, _ = _native._installed("device", variant, digest)
    if installed is not None:
        libs, arg = _native.PACKAGE_LIB_DIR, "installed"
    else:
        libs = arg = str(tmp_path / "libs")
        os.makedirs(libs)
        name = f"embedmesh_device-{variant}.so"
        shutil.copy(cpu.library_path(), os.path.join(libs, name))
        entry = {"digest": digest, "failed": {}, "variants": {variant: {"file": name}}}
        with open(os.path.join(libs, "manifest.json"), "w") as f:
            json.dump({"ffi_api": _native.ffi_api_version(), "libraries": {"device": entry}}, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBEDMESH_", "CXX"))}
    env.update(
        EMBEDMESH_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        PATH=os.path.dirname(sys.executable),  # no compiler on PATH
    )
    out = subprocess.run(
        [sys.executable, "-c", FIRST_LOOKUP, arg],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.path.dirname(out.stdout.strip()) == libs
    assert "building" not in out.stderr
    assert not (tmp_path / "cache").exists()


def test_no_device_library_is_a_warning_naming_cause_and_fix(monkeypatch):
    """The device layer's first use without a library: a RuntimeWarning with the
    loader's message (cause and fix), and the ops run their pure-JAX references."""
    from embedmesh.device.ops.cpu import library

    monkeypatch.setattr(library, "_loaded", {})
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_failed", {})
    monkeypatch.setattr(_native, "PACKAGE_LIB_DIR", "/nonexistent")
    monkeypatch.setattr(_native, "selected_variant", lambda: "x86-64")
    _no_compiler(monkeypatch)
    with pytest.warns(RuntimeWarning) as seen:
        assert library._load() is False
    message = str(seen[0].message)
    assert "CPU kernels unavailable, using pure JAX" in message
    assert "not built with the package" in message and "no C++ compiler found" in message
    assert "pip install" in message
    assert library.unavailable_reason() == library._loaded["why"]
