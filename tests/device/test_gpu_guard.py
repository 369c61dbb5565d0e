"""The guard against jaxlib 0.10.2-0.11.0's slow GPU scatter-add (embedmesh._gpu_guard).

Its decision is a pure function of what it reads, tested over every case here;
`apply` is tested in-process with the facts faked, and in a fresh process where
a stand-in CUDA plugin package makes this machine's jaxlib (0.10.2 when these
tests were written) look like an affected GPU install.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import jaxlib
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedmesh import _compat, _gpu_guard, _runtime
from embedmesh._gpu_guard import LLVM_OPTION, GpuScatterRegressionWarning, plan

EXTRA = "--xla_backend_extra_options="


@pytest.mark.parametrize(
    "version, affected",
    [
        ("0.10.1", False),
        ("0.10.2", True),
        ("0.10.2.dev20260701", True),
        ("0.10.9", True),
        ("0.11.0", True),
        ("0.11.1", False),
        ("0.11.2", False),
        ("0.9.2", False),
        ("1.0.0", False),
        ("", False),
        ("unknown", False),
    ],
)
def test_affected_versions(version, affected):
    assert _gpu_guard.is_affected(version) is affected


def test_llvm_option_added_to_flags():
    assert _gpu_guard.with_llvm_option("") == EXTRA + LLVM_OPTION
    assert (
        _gpu_guard.with_llvm_option("--xla_gpu_autotune_level=0")
        == f"--xla_gpu_autotune_level=0 {EXTRA}{LLVM_OPTION}"
    )
    # merged into the options already there, once
    merged = _gpu_guard.with_llvm_option(f"--a=1 {EXTRA}-foo=2 --b=3")
    assert merged == f"--a=1 {EXTRA}-foo=2,{LLVM_OPTION} --b=3"
    assert _gpu_guard.with_llvm_option(merged) == merged
    assert _gpu_guard.with_llvm_option(EXTRA) == EXTRA + LLVM_OPTION


_flag = st.from_regex(r"--xla_[a-z_]{1,12}=[a-z0-9]{1,4}", fullmatch=True)


@given(st.lists(_flag, max_size=5))
def test_llvm_option_keeps_other_flags(flags):
    out = _gpu_guard.with_llvm_option(" ".join(flags)).split()
    assert out[: len(flags)] == flags
    assert out[len(flags) :] == [EXTRA + LLVM_OPTION]


FACTS = dict(
    jaxlib_version="0.10.2",
    cuda_plugin=True,
    backends_started=False,
    gpu_in_use=False,
    xla_flags="--xla_gpu_autotune_level=2",
)


def test_plan_sets_the_flag_before_the_backend_starts():
    p = plan(**FACTS)
    assert p.action == "set_flags"
    assert p.xla_flags == f"--xla_gpu_autotune_level=2 {EXTRA}{LLVM_OPTION}"


@pytest.mark.parametrize(
    "change",
    [
        dict(jaxlib_version="0.11.1"),
        dict(jaxlib_version="0.10.1"),
        dict(cuda_plugin=False),
        dict(xla_flags=f"{EXTRA}{LLVM_OPTION}"),
        dict(xla_flags="--xla_gpu_ftz=true"),
        dict(enabled=False),
        dict(backends_started=True, gpu_in_use=False),  # started, but no GPU in use
        dict(backends_started=None, gpu_in_use=False),
    ],
)
def test_plan_does_nothing(change):
    assert plan(**{**FACTS, **change}).action == "none"


@pytest.mark.parametrize("started", [True, None])
def test_plan_warns_when_too_late(started):
    p = plan(
        **{**FACTS, "jaxlib_version": "0.11.0", "backends_started": started, "gpu_in_use": True}
    )
    assert p.action == "warn"
    for part in ("0.11.0", "0.10.2", "0.11.1", "46225", "38806", LLVM_OPTION, "XLA_FLAGS"):
        assert part in p.message, part
    assert "EMBEDMESH_GPU_SCATTER_WORKAROUND=0" in p.message


@pytest.fixture
def affected_gpu_install(monkeypatch):
    """Fake an affected jaxlib with a CUDA plugin, in this process."""
    monkeypatch.setattr(jaxlib, "__version__", "0.10.2")
    monkeypatch.setattr(_gpu_guard, "_cuda_plugin_installed", lambda: True)
    monkeypatch.delenv("EMBEDMESH_GPU_SCATTER_WORKAROUND", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nonexistent")  # restored after
    yield monkeypatch
    _runtime.reset()


def test_apply_sets_xla_flags(affected_gpu_install):
    affected_gpu_install.setattr(_compat, "backends_are_initialized", lambda: False)
    assert _gpu_guard.apply().action == "set_flags"
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/nonexistent {EXTRA}{LLVM_OPTION}"


def test_apply_warns_when_backend_started(affected_gpu_install):
    affected_gpu_install.setattr(_compat, "backends_are_initialized", lambda: True)
    affected_gpu_install.setattr(_gpu_guard, "_gpu_in_use", lambda: True)
    with pytest.warns(GpuScatterRegressionWarning, match="0.10.2"):
        assert _gpu_guard.apply().action == "warn"
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/nonexistent"


def test_apply_switched_off(affected_gpu_install):
    affected_gpu_install.setattr(_compat, "backends_are_initialized", lambda: True)
    affected_gpu_install.setattr(_gpu_guard, "_gpu_in_use", lambda: True)
    affected_gpu_install.setenv("EMBEDMESH_GPU_SCATTER_WORKAROUND", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _gpu_guard.apply().action == "none"


def test_unaffected_install_left_alone(monkeypatch):
    monkeypatch.setattr(jaxlib, "__version__", "0.11.2")
    monkeypatch.setattr(_gpu_guard, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert _gpu_guard.apply().action == "none"
    assert os.environ["XLA_FLAGS"] == ""


FRESH = textwrap.dedent(
    """
    import os, sys
    import embedmesh
    print("FLAGS", repr(os.environ.get("XLA_FLAGS")))
    import jax, jax.numpy as jnp
    # the flag must not upset the CPU backend: a scatter-add with repeated ids
    out = jax.jit(lambda t, i, u: t.at[i].add(u))(
        jnp.zeros((4, 3)), jnp.array([1, 1, 2]), jnp.full((3, 3), 1.5))
    print("SUM", float(out.sum()))
    """
)


def _fresh(tmp_path, env_extra):
    plugin = tmp_path / "jax_cuda13_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("")  # a stand-in: only its presence is read
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDMESH_")}
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.update(env_extra)
    res = subprocess.run(
        [sys.executable, "-c", FRESH], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.skipif(
    not _gpu_guard.is_affected(jaxlib.__version__), reason="needs jaxlib 0.10.2-0.11.0"
)
def test_fresh_process_gets_the_flag(tmp_path):
    out = _fresh(tmp_path, {})
    assert f"FLAGS '{EXTRA}{LLVM_OPTION}'" in out
    assert "SUM 13.5" in out


@pytest.mark.skipif(
    not _gpu_guard.is_affected(jaxlib.__version__), reason="needs jaxlib 0.10.2-0.11.0"
)
def test_fresh_process_switched_off(tmp_path):
    out = _fresh(tmp_path, {"EMBEDMESH_GPU_SCATTER_WORKAROUND": "0"})
    assert "FLAGS None" in out


def test_gpu_extra_is_past_the_regression():
    """`pip install embedmesh[gpu]` never resolves to an affected jaxlib."""
    import pathlib
    import re
    import tomllib

    meta = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    (req,) = [r for r in meta["project"]["optional-dependencies"]["gpu"] if r.startswith("jax")]
    lower = re.search(r">=\s*(\d+\.\d+\.\d+)", req)
    assert lower is not None, req
    assert tuple(map(int, lower[1].split("."))) > _gpu_guard.AFFECTED[1]
