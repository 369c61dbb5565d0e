"""The compiled request: what `serving_embedding_lookup` hands the request rules
(`embedmesh.serving._request`, `embedmesh/serving/ext/request.cc`).

A serving request is mostly ragged, 2-D sparse or dense numpy ids, with or without finite
float32 weights, on float32 or quantized numpy tables. The compiled module is the one
statement of which features are such common cases and how each becomes a C++ kernel task
(~1 us a feature, its arrays read through numpy's fields, the tasks handed to the
runner, the GIL released by the policy described in docs/serving.md); anything else, and
any error the kernels report, gives None, and the caller runs the general path
(`lookup.py`), which raises TensorFlow's errors. Results are bit for bit the general
path's: the same kernels on the same arrays (tests/serving/test_serving_request.py
compares the two, and both with a Python restatement of the rules,
tests/support/request_rules.py, on every input kind).

This module makes what the compiled calls take, once a model: per feature its plan
(`plans_of`), and for a model configured as one dict of features under str keys the
whole request's arguments (`dict_served`: `_request.serve` then flattens the inputs,
checks that the config still holds what was planned, runs the request and builds the
result dict in one call). It keeps the model served last (`served`), which the lookup
serves in one call until a setting changes (`forget_served`).
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np

from embedmesh._runtime import combiner_code
from embedmesh.config import resolve_feature_config
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.serving import kernels, pool, raw_ids
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.quantized import QuantizedTable

# The calling convention this module speaks to the compiled rules in (their `INTERFACE`).
INTERFACE = 2

try:  # built at install (setup.py); a checkout used without an install may have none
    from embedmesh.serving import _request as compiled
except ImportError:  # pragma: no cover - the install builds it where a compiler is
    compiled = None
if compiled is not None and getattr(compiled, "INTERFACE", 1) != INTERFACE:
    # built from an older (or newer) source: an editable install whose sources moved on
    warnings.warn(
        f"embedmesh.serving._request ({compiled.__file__}) was built from another version "
        f"of embedmesh's sources (interface {getattr(compiled, 'INTERFACE', 1)}, this one "
        f"speaks {INTERFACE}): serving requests take the general path until it is rebuilt "
        f"(pip install -e . again)",
        RuntimeWarning,
        stacklevel=2,
    )
    compiled = None

__all__ = ["compiled", "dict_served", "forget_served", "in_flight", "plans_of"]

# The request types the compiled checks compare with (a QuantizedTable's ragged and sparse
# features are decoded by the bag kernels).
TYPES = (np.ndarray, RaggedTensor, SparseTensor, QuantizedTable)

# (config, what `_request.serve` takes) of the dict model served last, else None:
# `serving_embedding_lookup`'s next dict request of that config takes `_request.serve`.
served: tuple | None = None
# id(config) -> config of the configs `dict_served` said no to (a bounded cache, read by
# the lookup before it asks again; forgotten with `served`)
unserved: dict = {}

_bound = False
_plan_cache: dict = {}  # id(features) -> (features, plans)
_dict_plans: dict = {}  # id(config) -> (config, the dict plan or None)


def ready() -> bool:
    """Whether requests can take the compiled rules now: the module was built and the
    C++ kernels are the backend in use (asked once a backend: `forget_served` forgets it;
    binding them at the first use)."""
    global _native
    if compiled is None:
        return False
    if _native is None:
        _native = kernels.native_in_use()
    if _native and not _bound:
        _bind()
    return _native


_native: bool | None = None  # whether the C++ kernels are the backend (None: ask)


def plans_of(features) -> tuple | None:
    """Per feature, what the compiled checks need of its config: (common: no sequence or
    output_shape, vocabulary size, dim, combiner code, safe lookup, table config, prune
    weights: safe and a combiner other than sum). Kept per resolved config. None where
    requests cannot take the compiled rules now (`ready`)."""
    if not ready():
        return None
    hit = _plan_cache.get(id(features))
    if hit is not None and hit[0] is features:
        return hit[1]
    plans = tuple(
        (
            not (f.max_sequence_length or f.output_shape),
            f.table.vocabulary_size,
            f.table.dim,
            combiner_code(f.table.combiner),
            bool(f.validate_weights_and_indices),
            f.table,
            bool(f.validate_weights_and_indices) and f.table.combiner != "sum",
        )
        for f in features
    )
    if len(_plan_cache) > 64:
        _plan_cache.clear()
    _plan_cache[id(features)] = (features, plans)
    return plans


def dict_served(feature_config, threads: int, finish, collect) -> tuple | None:
    """(config, the arguments of `_request.serve`) for a model whose feature config is one
    dict of FeatureConfigs under str keys and has no table of raw ids, remembered as
    `served`; None for any other config, or where requests cannot take the compiled rules
    (`ready`). `finish(outputs dict, before_run)` makes the result from the numpy outputs
    (None: they are the result); `collect()` runs first (None: nothing)."""
    global served
    plan = _dict_plan(feature_config)
    if plan is None:
        if len(unserved) > 64:
            unserved.clear()
        unserved[id(feature_config)] = feature_config
        return None
    config, index, features, plans, order = plan
    alloc = pool.output_float32_at  # where numpy's C API is not bound
    args = (config, index, features, plans, order, TYPES, alloc, threads, finish, collect)
    served = (config, args)
    return served


def _dict_plan(feature_config) -> tuple | None:
    """(config, index {key: position in the resolved order}, the FeatureConfigs in that
    order, their plans, per entry of the config in its own order (key, FeatureConfig,
    position)), kept per config object; None where `dict_served` gives None. The
    compiled side checks at every request that the config still holds the same
    FeatureConfigs under the same keys (a dict changed since: False, planned anew)."""
    if not ready():
        return None
    hit = _dict_plans.get(id(feature_config))
    if hit is not None and hit[0] is feature_config:
        return hit[1]
    plan = None
    if type(feature_config) is dict and all(type(k) is str for k in feature_config):
        resolved = resolve_feature_config(feature_config)  # the config's errors, as usual
        keys = tuple(sorted(feature_config))
        features = tuple(feature_config[k] for k in keys)
        if (
            len(resolved.features) == len(features)
            and all(a is b for a, b in zip(resolved.features, features))
            and not raw_ids.raw_features(resolved)
        ):
            index = {k: i for i, k in enumerate(keys)}
            order = tuple((k, v, index[k]) for k, v in feature_config.items())
            plan = (feature_config, index, features, plans_of(features), order)
    if len(_dict_plans) > 64:
        _dict_plans.clear()
    _dict_plans[id(feature_config)] = (feature_config, plan)
    return plan


def forget_served() -> None:
    """The next request takes the usual path (a setting it depends on changed, or the
    config served last changed)."""
    global served, _native
    served = _native = None
    _dict_plans.clear()
    unserved.clear()


kernels.on_backend_change(forget_served)  # the kernels' backend is such a setting


def in_flight() -> int:
    """Threads inside `serving_embedding_lookup` now, as the GIL policy counts them (0
    without the compiled module)."""
    return 0 if compiled is None else compiled.in_flight()


def enter_and_leave() -> tuple:
    """(enter, leave): what `serving_embedding_lookup` calls around its work, so the
    compiled module knows how many threads are serving at once (no-ops without it)."""
    if compiled is None:
        return _nothing, _nothing
    return compiled.enter, compiled.leave


def _nothing() -> None:
    return None


def _bind() -> None:
    global _bound
    compiled.bind(*native_backend.runner_addresses())
    api = _numpy_c_api()
    if api is not None:
        dtypes = (np.int64, np.int32, np.float32, np.float16, np.uint8)
        compiled.bind_numpy(api, np.ndarray, tuple(np.dtype(d) for d in dtypes), pool.output_lease)
    pool.on_output_pool_limit(_block_cache_limit)
    _bound = True


def _block_cache_limit(limit: int) -> None:
    """The compiled module's cache of small request buffers (a request's outputs at most
    64 KiB: a C object over aligned memory, no Python lease) keeps at most the pool's
    limit, and at most 1 MiB."""
    compiled.set_block_cache(min(int(limit), 1 << 20))


def _numpy_c_api():
    """numpy's C API capsule (`_ARRAY_API`: numpy 2's `numpy._core`, 1.x's `numpy.core`),
    or None."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return importlib.import_module(name)._ARRAY_API
        except (ImportError, AttributeError):
            continue
    return None
