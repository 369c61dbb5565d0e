"""A guard against the XLA:GPU float32 scatter-add regression, applied at `import embedmesh`.

jaxlib 0.10.2 up to 0.11.0 ship an LLVM whose NVPTX backend lowers a float32
`atomicrmw fadd` to a compare-and-swap retry loop instead of the native
`atom.add.f32` when denormals are kept (XLA's default). Under repeated indices,
which is exactly an embedding gradient over Zipf ids, a scatter-add then runs
hundreds of times slower (about 1 ms -> 500 ms in openxla/xla#46225;
jax-ml/jax#38806; fixed in jaxlib 0.11.1). The LLVM option
`-nvptx-allow-ftz-atomics` restores the native atomic (it may flush a denormal
inside an atomic sum, as jaxlib <= 0.10.1 did).

So, with an affected jaxlib and a CUDA plugin installed: if no jax backend has
started yet, the option is added to `XLA_FLAGS` (XLA reads it once, when the
first backend starts); if one has, XLA has read its flags already and a
`GpuScatterRegressionWarning` says what to do. `EMBEDMESH_GPU_SCATTER_WORKAROUND=0`
turns the guard off. The decision is `plan()`, a pure function tested on CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import warnings

__all__ = [
    "AFFECTED",
    "LLVM_OPTION",
    "GpuScatterRegressionWarning",
    "Plan",
    "apply",
    "is_affected",
    "plan",
    "with_llvm_option",
]

AFFECTED = ((0, 10, 2), (0, 11, 0))  # jaxlib versions, inclusive
LLVM_OPTION = "-nvptx-allow-ftz-atomics"
_EXTRA_OPTIONS = "--xla_backend_extra_options="
SWITCH = "EMBEDMESH_GPU_SCATTER_WORKAROUND"


class GpuScatterRegressionWarning(RuntimeWarning):
    """This jaxlib's GPU scatter-add is slow and the workaround came too late."""


def _version(text: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]))


def is_affected(jaxlib_version: str) -> bool:
    """Whether this jaxlib version has the slow float32 GPU scatter-add."""
    v = _version(jaxlib_version)
    return v is not None and AFFECTED[0] <= v <= AFFECTED[1]


def _has_option(xla_flags: str) -> bool:
    flags = xla_flags.lower()
    return LLVM_OPTION in flags or "--xla_gpu_ftz=true" in flags


def with_llvm_option(xla_flags: str, option: str = LLVM_OPTION) -> str:
    """`xla_flags` with `option` appended to its `--xla_backend_extra_options` (added if none)."""
    tokens = xla_flags.split()
    for i, token in enumerate(tokens):
        if token.startswith(_EXTRA_OPTIONS):
            value = token[len(_EXTRA_OPTIONS) :]
            if option in value.split(","):
                return xla_flags
            tokens[i] = _EXTRA_OPTIONS + (f"{value},{option}" if value else option)
            return " ".join(tokens)
    return " ".join([*tokens, _EXTRA_OPTIONS + option])


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the guard does: "none", "set_flags" (to `xla_flags`) or "warn" (`message`)."""

    action: str
    xla_flags: str | None = None
    message: str | None = None


def plan(
    *,
    jaxlib_version: str,
    cuda_plugin: bool,
    backends_started: bool | None,
    gpu_in_use: bool,
    xla_flags: str,
    enabled: bool = True,
) -> Plan:
    """The guard's decision from the facts it reads (pure)."""
    if not enabled:
        return Plan("none")
    if not is_affected(jaxlib_version) or not cuda_plugin or _has_option(xla_flags):
        return Plan("none")
    if backends_started is False:
        return Plan("set_flags", xla_flags=with_llvm_option(xla_flags))
    if not gpu_in_use:
        return Plan("none")
    return Plan(
        "warn",
        message=(
            f"jaxlib {jaxlib_version} (affected: {'.'.join(map(str, AFFECTED[0]))} to "
            f"{'.'.join(map(str, AFFECTED[1]))}) compiles float32 scatter-add on NVIDIA GPUs "
            "to a compare-and-swap loop, hundreds of times slower on repeated indices such "
            "as embedding gradients (openxla/xla#46225, jax-ml/jax#38806). embedmesh could "
            "not apply the workaround because a jax backend had already started before "
            "`import embedmesh`. Fix: upgrade to jax and jaxlib >= 0.11.1 "
            "(pip install -U 'embedmesh[gpu]'), or import embedmesh before using jax, or "
            f"start Python with XLA_FLAGS='{_EXTRA_OPTIONS}{LLVM_OPTION}'. "
            f"{SWITCH}=0 silences this."
        ),
    )


def _cuda_plugin_installed() -> bool:
    names = ("jax_cuda13_plugin", "jax_cuda12_plugin")
    for name in (*names, "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _gpu_in_use() -> bool:
    try:
        import jax

        return bool(jax.devices("gpu"))
    except Exception:  # noqa: BLE001  (no GPU backend: nothing to warn about)
        return False


def apply() -> Plan:
    """Read the facts, act on `plan()` (set XLA_FLAGS or warn) and return it."""
    import jaxlib

    from embedmesh import _compat, _runtime

    version = getattr(jaxlib, "__version__", "") or ""
    cuda = is_affected(version) and _cuda_plugin_installed()
    started = _compat.backends_are_initialized() if cuda else None
    decision = plan(
        jaxlib_version=version,
        cuda_plugin=cuda,
        backends_started=started,
        gpu_in_use=bool(cuda and started is not False and _gpu_in_use()),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        enabled=_runtime.gpu_scatter_workaround(),
    )
    if decision.action == "set_flags":
        os.environ["XLA_FLAGS"] = decision.xla_flags or ""
    elif decision.action == "warn":
        warnings.warn(decision.message or "", GpuScatterRegressionWarning, stacklevel=3)
    return decision
