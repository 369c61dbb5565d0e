"""JAX's persistent compilation cache: embedmesh turns it on at import where the user has
set none, and leaves it alone where they have, or where EMBEDMESH_COMPILATION_CACHE=0."""

import os

import jax
import pytest

from embedmesh import _runtime


@pytest.fixture
def cache_config(monkeypatch):
    """The cache's setting cleared for the test (restored after it), the switches re-read."""
    before = jax.config.jax_compilation_cache_dir
    min_s = jax.config.jax_persistent_cache_min_compile_time_secs
    for var in (
        "JAX_COMPILATION_CACHE_DIR",
        "EMBEDMESH_COMPILATION_CACHE",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    ):
        monkeypatch.delenv(var, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # JAX's default
    _runtime.reset()
    yield monkeypatch
    jax.config.update("jax_compilation_cache_dir", before)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
    _runtime.reset()


def test_default_is_under_embedmesh_cache_dir_where_an_accelerator_is(cache_config, tmp_path):
    cache_config.setenv("EMBEDMESH_CACHE_DIR", str(tmp_path))
    cache_config.setattr(_runtime, "accelerator_installed", lambda: True)
    _runtime.reset()
    assert _runtime.use_compilation_cache() == os.path.join(str(tmp_path), "jax")
    assert jax.config.jax_compilation_cache_dir == os.path.join(str(tmp_path), "jax")


def test_default_is_off_with_the_cpu_backend_alone(cache_config, tmp_path):
    # XLA:CPU executables read back from the cache ran the pipelined step slower
    cache_config.setenv("EMBEDMESH_CACHE_DIR", str(tmp_path))
    cache_config.setattr(_runtime, "accelerator_installed", lambda: False)
    _runtime.reset()
    assert _runtime.use_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


@pytest.mark.parametrize("on", ["1", "on", "True", "yes"])
def test_switched_on_with_the_cpu_backend_alone(cache_config, tmp_path, on):
    cache_config.setenv("EMBEDMESH_CACHE_DIR", str(tmp_path))
    cache_config.setenv("EMBEDMESH_COMPILATION_CACHE", on)
    cache_config.setattr(_runtime, "accelerator_installed", lambda: False)
    assert _runtime.use_compilation_cache() == os.path.join(str(tmp_path), "jax")


@pytest.mark.parametrize(
    "platforms, expected",
    [("cpu", False), ("tpu", True), ("cpu,cuda", True), ("rocm", True), (" cpu ", False)],
)
def test_accelerator_installed_reads_jax_platforms(monkeypatch, platforms, expected):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert _runtime.accelerator_installed() is expected


def test_accelerator_installed_finds_plugins(monkeypatch):
    import importlib.util

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    before = jax.config.jax_platforms
    jax.config.update("jax_platforms", None)
    try:
        find = importlib.util.find_spec
        installed = {"libtpu"}
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda m, *a: object() if m in installed else find(m, *a)
        )
        assert _runtime.accelerator_installed() is True
        installed = set()
        assert _runtime.accelerator_installed() is False  # this machine has no plugin
    finally:
        jax.config.update("jax_platforms", before)


def test_a_path_is_used(cache_config, tmp_path):
    cache_config.setenv("EMBEDMESH_COMPILATION_CACHE", str(tmp_path / "c"))
    assert _runtime.use_compilation_cache() == str(tmp_path / "c")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    # every program kept, not only those over JAX's 1 s default
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0


def test_the_users_threshold_is_kept(cache_config, tmp_path):
    cache_config.setenv("EMBEDMESH_COMPILATION_CACHE", str(tmp_path / "c"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    assert _runtime.use_compilation_cache() == str(tmp_path / "c")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    cache_config.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    jax.config.update("jax_compilation_cache_dir", None)
    assert _runtime.use_compilation_cache() == str(tmp_path / "c")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


@pytest.mark.parametrize("off", ["0", "off", "False", "no"])
def test_switched_off(cache_config, off):
    cache_config.setenv("EMBEDMESH_COMPILATION_CACHE", off)
    assert _runtime.use_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


def test_the_users_setting_is_kept(cache_config, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    cache_config.setenv("EMBEDMESH_COMPILATION_CACHE", str(tmp_path / "ours"))
    assert _runtime.use_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def test_the_users_environment_is_kept(cache_config, tmp_path):
    cache_config.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert _runtime.use_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None  # jax reads it itself
