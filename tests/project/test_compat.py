"""Each private jax/jaxlib/orbax hook of `embedmesh._compat` resolves on the
installed versions: a release that moves one fails here, not silently in a
fallback."""

import pytest

from embedmesh import _compat


@pytest.mark.parametrize("name", sorted(_compat.HOOKS))
def test_private_hook_resolves(name):
    assert _compat.HOOKS[name](), f"private hook {name} no longer resolves"


def test_trace_state_clean_sees_jit():
    import jax
    import jax.numpy as jnp

    assert _compat.trace_state_clean() is True
    seen = []

    @jax.jit
    def f(x):
        seen.append(_compat.trace_state_clean())
        return x + 1

    f(jnp.ones(2))
    assert seen == [False]


def test_importing_compat_imports_nothing_private():
    import subprocess
    import sys

    code = "import sys, embedmesh._compat; print(any(m.startswith('orbax') for m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"
