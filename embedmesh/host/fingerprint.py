"""What every process of a multi-process job must agree on, and the error when they do not.

Each process builds its `MeshEmbedding` from its own arguments; when these differ
(a table's vocabulary, an optimizer, a combiner, the sharding, the capacities, the
`EMBEDMESH_HOST_EXCHANGE` switch...), the processes compile different programs
and the job hangs in a collective, aborts in gloo ("Received data size doesn't
match") or, worse, trains silently wrong. So at build, before any other
collective, the facade gathers one `header` per process (a hash of the job's
fields and their encoded length: one all-gather of two int32); when the hashes
differ, every process sees it at once and all of them gather the encoded fields
(`padded`), and `mismatch` names the first differing field with each process's
value. Pure: the collectives are the caller's.

Values are compared by a stable description (`describe`): plain values by repr,
dataclasses (optimizers, quantization configs) field by field, functions
(initializers, learning-rate schedules) by their qualified name and the plain
values of their closure (so `optax.exponential_decay(0.1, ...)` and the same
schedule with another rate differ), other objects by their repr unless it shows
an address, else by their type. Two different callables of the same name and
closure are therefore seen as equal.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["describe", "differs", "encode", "header", "job_fields", "mismatch", "padded"]

_PLAIN = (type(None), bool, int, float, str, complex)
_DEPTH = 4  # nested descriptions deeper than this are cut (closures of closures...)
_SHOWN = 300  # characters of a value shown in an error


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def describe(obj: Any, depth: int = 0) -> str:
    """A description of `obj` that is the same in every process for equal values."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, _PLAIN):
        return repr(obj)
    if depth >= _DEPTH:
        return _qualname(type(obj))
    inner = functools.partial(describe, depth=depth + 1)
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(map(inner, obj)) + ")"
    if isinstance(obj, Mapping):
        items = sorted((inner(k), inner(v)) for k, v in obj.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(obj, np.ndarray):
        return f"array({obj.shape}, {obj.dtype}, crc {zlib.crc32(obj.tobytes())})"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = (f"{f.name}={inner(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__qualname__}({', '.join(fields)})"
    if isinstance(obj, functools.partial):
        return f"partial({inner(obj.func)}, {inner(obj.args)}, {inner(obj.keywords)})"
    if hasattr(obj, "__code__"):  # a function: its name and the values it closes over
        cells = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        return f"{_qualname(obj)}{inner(tuple(cells)) if cells else ''}"
    text = repr(obj)
    return _qualname(type(obj)) if " at 0x" in text else text


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def job_fields(
    resolved, default_optimizer, strategies: Mapping[str, str], options: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """`[(field, description)]` of everything the processes must agree on.

    `resolved`: the `ResolvedFeatures`; `default_optimizer`: the optimizer of
    tables without their own; `strategies`: the sharding asked per table;
    `options`: the job's other settings by name (stacking, capacities, overflow,
    check_finite, pipelining, seed, mesh, switches, versions).
    """
    out = [
        ("features", describe(resolved.feature_names)),
        ("tables", describe(resolved.table_names)),
    ]
    names = {id(t): n for n, t in zip(resolved.table_names, resolved.tables)}
    for name, f in zip(resolved.feature_names, resolved.features):
        for fld in dataclasses.fields(f):
            if fld.name == "name":
                continue
            value = getattr(f, fld.name)
            out.append(
                (
                    f"feature {name!r} {fld.name}",
                    names[id(value)] if fld.name == "table" else describe(value),
                )
            )
    for name, t in zip(resolved.table_names, resolved.tables):
        for fld in dataclasses.fields(t):
            if fld.name not in ("name", "optimizer"):
                out.append((f"table {name!r} {fld.name}", describe(getattr(t, fld.name))))
        opt = t.optimizer if t.optimizer is not None else default_optimizer
        out.append((f"table {name!r} optimizer", type(opt).__qualname__))
        if opt is not None:
            for fld in dataclasses.fields(opt):
                out.append(
                    (f"table {name!r} optimizer {fld.name}", describe(getattr(opt, fld.name)))
                )
        out.append((f"table {name!r} sharding", describe(strategies[name])))
    out += [(k, describe(v)) for k, v in options.items()]
    return out


def encode(fields: Sequence[tuple[str, str]]) -> bytes:
    return json.dumps([list(f) for f in fields]).encode()


def header(blob: bytes) -> np.ndarray:
    """This process's `[hash, length]` of its encoded fields, int32 (what is gathered first)."""
    return np.array([zlib.crc32(blob) & 0x7FFFFFFF, len(blob)], np.int32)


def differs(headers: np.ndarray) -> bool:
    """Whether the gathered `[processes, 2]` headers disagree (then every process
    gathers the `padded` fields next)."""
    return bool((headers != headers[0]).any())


def padded(blob: bytes, headers: np.ndarray) -> np.ndarray:
    """The encoded fields as uint8, padded to the longest process's length."""
    out = np.zeros(int(headers[:, 1].max()), np.uint8)
    out[: len(blob)] = np.frombuffer(blob, np.uint8)
    return out


def _short(value: str) -> str:
    return value if len(value) <= _SHOWN else value[: _SHOWN - 3] + "..."


def mismatch(gathered: np.ndarray, headers: np.ndarray) -> ValueError:
    """The error naming the first field on which the processes' gathered `padded`
    fields (`[processes, length]`) differ, with each process's value."""
    per = [
        dict(json.loads(bytes(row[: int(n)]).decode()))
        for row, n in zip(np.asarray(gathered, np.uint8), headers[:, 1])
    ]
    order = list(dict.fromkeys(k for p in per for k in p))
    for field in order:
        values = [p.get(field) for p in per]
        if any(v != values[0] for v in values):
            shown = ", ".join(
                f"process {i} has {'nothing' if v is None else _short(v)}"
                for i, v in enumerate(values)
            )
            return ValueError(
                f"the processes of this job disagree on {field}: {shown}. Every process "
                f"must build the same job (the same feature and table configs, optimizers, "
                f"sharding, capacities, options, mesh and EMBEDMESH_* switches); nothing was "
                f"built and no program ran"
            )
    return ValueError("the processes of this job disagree on their configuration (hash only)")
