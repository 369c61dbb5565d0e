"""The host lookup of the common inputs, prepared in a few Python operations a feature.

A serving request is mostly ragged, 2-D sparse or dense numpy ids, with or without weights, on
float32 numpy tables: the general host path (`lookup._prepare_host`) spends ~30 us of
Python a feature on them (layouts, structure checks in numpy, `to_csr`, argument
conversions, ~5 array addresses at ~1 us each), 0.4 ms of a batch-64 request whose kernels
take 0.1 ms. Here each such feature becomes one C++ task after a handful of type, dtype
and shape tests (all run in one C++ call, `native_backend.run_tasks`, or handed to the pool one
by one as they are made when the request is large enough for several threads), and its
structure is checked in C++ as the task is added: ragged row_splits by the runner (task
kind 4), sparse indices by the offsets phase (kind 3), ids by the kernels.

Quantized tables (`QuantizedTable` of int8, fp16 or codes rows in numpy arrays) are
common for ragged and sparse input: their tasks carry the row format (word 19) and the
kernels decode the rows (`EmServingBagQ`), as the general path's do. Before, every request
on them took the general path: 8 x 1M int8 tables at dim 16, batch 4096, one thread, 3.37
ms a request against 2.36 ms for the kernels alone (0.29 ms more than the kernels now;
benchmarks/serving/serving_quantized_ab.py --api). A dense lookup on them (a gather of
float rows) and bf16 rows (no buffer protocol for ml_dtypes' bfloat16) stay the general
path's.

Weights are taken as they are when they are finite float32 numpy arrays laid out like
their input. Anything else (sequence features, `output_shape`, other dtypes or array types,
a table of the wrong shape, the numba/numpy backends) returns None, and so does any
error the C++ side reports: the caller then runs the general path, which raises
TensorFlow's errors exactly as it always has (nothing was written but fresh output
buffers). Results are bit for bit the general path's: the same kernels on the same
arrays (tests/serving/test_serving_fast_path.py compares the two on every input kind).

The same tests run compiled where the install built `embedmesh.serving._request`
(embedmesh/serving/ext/request.cc, CPython's stable ABI): ~1 us a feature against ~5
warm and 15-20 cold here, whose Python a second thread cannot share. Batch 64, dim 64,
8 x 1M tables: 0.26 -> 0.19 ms a request (benchmarks/runs/serving-history.md, seventh
session). This module's form stays for a checkout used without an install, and as the
readable statement of the rules; `use_compiled(False)` selects it.
"""

from __future__ import annotations

import array
import importlib
from typing import Any

import jax
import numpy as np

from embedmesh._runtime import combiner_code
from embedmesh.inputs import RaggedTensor, SparseTensor
from embedmesh.serving import kernels, pool
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.quantized import FORMAT_CODES, QuantizedTable

try:  # the same checks compiled (setup.py builds it; a checkout used without an install
    # has none)
    from embedmesh.serving import _request as _compiled
except ImportError:  # pragma: no cover - the install builds it where a compiler is
    _compiled = None
_dict_lookup: Any = getattr(_compiled, "lookup_dict", None)  # older builds: none

__all__ = [
    "dict_requests",
    "direct_numpy",
    "fair_gil",
    "gil_between_us",
    "gil_handoff_us",
    "gil_stats",
    "hold_gil_below",
    "in_flight",
    "kernel_slots",
    "one_buffer",
    "lookup",
    "serve_calls",
    "release_when_shared",
    "shared_window_us",
    "use_compiled",
]

_I32, _I64, _F32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
_KIND_BAG_CHECKED, _KIND_SPARSE_OFFSETS_BAG, _KIND_GATHER = 4, 3, 2
_PAD = (0,) * native_backend.TASK_WORDS
_Tracer = jax.core.Tracer


def _ids_ok(v) -> bool:
    """Signed int32/int64 ids in one contiguous numpy array."""
    return type(v) is np.ndarray and (v.dtype is _I64 or v.dtype is _I32) and v.flags.c_contiguous


def _table_ok(t, feature) -> np.ndarray | None:
    """The table as a float32 numpy array of the feature's shape with contiguous rows, or
    None (another dtype or shape, a tracer: the general path's)."""
    if not isinstance(t, np.ndarray):  # np.memmap tables (a checkpoint mapped) are arrays
        if isinstance(t, _Tracer) or not isinstance(t, jax.Array):
            return None
        t = np.asarray(t)
    cfg = feature.table
    if (
        t.dtype is not _F32
        or t.ndim != 2
        or t.shape[0] != cfg.vocabulary_size
        or t.shape[1] != cfg.dim
        or cfg.dim <= 0
        or t.strides[1] != 4
        or t.strides[0] < 0
        or t.strides[0] % 4
    ):
        return None
    return t


def lookup(features, flat_inputs, flat_weights, tables, threads: int, finish):
    """The request's result, or None: some feature is not a common case, or the C++
    side reported an error (the caller runs the general path, which raises it).

    `finish(outs, before_run)` makes the result from the output buffers (`outs`: None
    where a feature has no input). It is called first before the kernels have run,
    while the caches are warm; where it cannot be made then (it returns None) it is
    called again after them.

    A request large enough for several threads is handed to the C++ pool task by task
    as each is made (`native_backend.NativeRequest`): the pool's threads sum the first
    features while this thread makes the next ones and the result. Requests back to
    back on 2 threads, 8 x 1M tables (benchmarks/runs/serving-history.md, sixth session):
    0.99-1.08x one C++ call at the end at dims 16-64 by itself, 1.06-1.16x with the
    pool's threads polling for the next request (runner.cc, g_pool_spin_us).
    """
    if not kernels.native_in_use():
        return None
    if _use_compiled and _compiled is not None and type(tables) is dict:
        if not _bound:
            _bind()
        return _compiled.lookup(
            _plans(features), flat_inputs, flat_weights, tables, _TYPES, _alloc_f32, finish, threads
        )
    entries = _plausible(features, flat_inputs, flat_weights)
    if entries < 0:
        return None
    keep: list = []
    if threads > 1 and native_backend.threads_for_entries(entries, threads) > 1:
        return _handed_over(features, flat_inputs, flat_weights, tables, threads, finish, keep)
    words: list = []
    outs = _prepare(features, flat_inputs, flat_weights, tables, words.extend, keep)
    if outs is None:
        return None  # not a common request: the general path's
    result = finish(outs, True)
    if words and any(c != -1 for c in native_backend.run_tasks(array.array("q", words), threads)):
        return None  # an error: the general path names it
    return result if result is not None else finish(outs, False)


def dict_plan(feature_config, resolve, has_raw_ids):
    """What `lookup_dict` needs of a model whose feature config is one dict of
    FeatureConfigs under str keys: (config, index {key: position in the resolved order},
    the FeatureConfigs in that order, their `_plans`, the resolved config, per entry of
    the config in its own order (key, FeatureConfig, position)), kept per
    config object; None where the compiled form (or its `lookup_dict`) is not here, the
    C++ kernels are not the backend, the config is another structure or has tables of raw
    ids. `resolve(config)` resolves it (raising the config's errors as the general path
    does), `has_raw_ids(resolved)` says whether some table maps raw ids. The compiled
    side checks at every request that the config still holds the same FeatureConfigs
    under the same keys (a dict changed since: None, the general path)."""
    if not (_use_dict and _use_compiled and _dict_lookup is not None and kernels.native_in_use()):
        return None
    hit = _dict_plans.get(id(feature_config))
    if hit is not None and hit[0] is feature_config:
        return hit[1]
    plan = None
    if type(feature_config) is dict and all(type(k) is str for k in feature_config):
        resolved = resolve(feature_config)
        keys = tuple(sorted(feature_config))
        features = tuple(feature_config[k] for k in keys)
        if (
            len(resolved.features) == len(features)
            and all(a is b for a, b in zip(resolved.features, features))
            and not has_raw_ids(resolved)
        ):
            index = {k: i for i, k in enumerate(keys)}
            order = tuple((k, v, index[k]) for k, v in feature_config.items())
            plan = (feature_config, index, features, _plans(features), resolved, order)
    if len(_dict_plans) > 64:
        _dict_plans.clear()
    _dict_plans[id(feature_config)] = (feature_config, plan)
    return plan


def lookup_dict(plan, inputs: dict, tables, threads: int, finish):
    """A request given as a dict of some of the plan's keys (`dict_plan`), no weights, in
    one compiled call (`_request.lookup_dict`): the result (`finish(outs, before_run)`'s,
    as in `lookup`; finish None: the numpy outputs as a dict in `inputs`' key order),
    None where `lookup` would give None (then the general path's, without this path),
    NotImplemented where the request is not of this form (a key the config lacks, a
    None input, a config changed since the plan: the caller's usual path, and the plan
    is made anew at the next request)."""
    if not _bound:
        _bind()
    config, index, features, plans, _, order = plan
    out = _dict_lookup(
        config, index, features, plans, order, inputs, tables, _TYPES, _alloc_f32, finish, threads
    )
    if out is False:  # the config dict changed since the plan was made
        _dict_plans.pop(id(config), None)
        return NotImplemented  # the usual path (which resolves it again); planned anew next
    return out


_dict_plans: dict = {}  # id(config) -> (config, dict_plan's plan or None)
_use_dict = True
_serve = getattr(_compiled, "serve", None)  # older builds: none
# (config, what `_request.serve` takes) of the model whose last dict request with numpy
# outputs `lookup_dict` served, else None: serving_embedding_lookup's next request of that
# config goes straight to `_request.serve` (`serve`); anything that changes how a request
# is served forgets it (forget_served).
served: tuple | None = None


_use_serve = True


def serve_calls(on: bool) -> bool:
    """Whether a dict request with numpy outputs of the model served last takes one
    compiled call, `enter` and `leave` included (`_request.serve`; default True), or the
    Python layers above `lookup_dict` as before; returns the previous setting (for A/B:
    benchmarks/serving/serving_online.py)."""
    global _use_serve
    previous, _use_serve = _use_serve, bool(on)
    forget_served()
    return previous


def remember_served(plan, threads: int) -> None:
    """After `lookup_dict` served a dict request of `plan` with numpy outputs on `threads`
    threads: the next request of its config may take `serve`."""
    global served
    if _serve is not None and _use_serve and _use_dict and _use_compiled:
        config, index, features, plans, _, order = plan
        served = (config, (config, index, features, plans, order, _TYPES, _alloc_f32, threads))


def forget_served() -> None:
    """The next request takes the usual path (a setting it depends on changed)."""
    global served
    served = None


kernels.on_backend_change(forget_served)  # the kernels' backend is such a setting


# serve(served[1], inputs, tables) (`_request.serve`): `served`'s dict request in one
# compiled call, `enter` and `leave` included: the numpy outputs as a dict in `inputs`'
# key order, or anything else (None, NotImplemented, False) where `lookup_dict` would not
# serve it: the caller then forgets `served` and takes its usual path.
serve = _serve


def dict_requests(on: bool) -> bool:
    """Whether dict requests of a dict model take `lookup_dict` (default True; off: the
    flat `lookup` after Python resolves, flattens and packs, as before it); returns the
    previous setting (for A/B: benchmarks/serving/serving_online.py)."""
    global _use_dict
    previous, _use_dict = _use_dict, bool(on)
    forget_served()
    return previous


_use_compiled = True
_bound = False
# QuantizedTable fourth where the compiled form takes its tables (older builds: three)
_TYPES = (np.ndarray, RaggedTensor, SparseTensor) + (
    (QuantizedTable,) if getattr(_compiled, "QUANTIZED_TABLES", 0) else ()
)
_plan_cache: dict = {}  # id(features) -> (features, plans)


def use_compiled(on: bool) -> bool:
    """Whether requests take the compiled form of this module's checks
    (`embedmesh.serving._request`, where it was built); returns the previous setting
    (tests and benchmarks compare the two forms)."""
    global _use_compiled
    previous, _use_compiled = _use_compiled, bool(on)
    forget_served()
    return previous


def hold_gil_below(entries: int) -> int | None:
    """Requests of fewer than `entries` ids (summed or copied, all features) keep the GIL
    while their kernels run in the compiled form, when no other thread is inside
    `serving_embedding_lookup` (`release_when_shared`); 0: every request releases it;
    the default is 32768. Returns the previous value, None where the compiled form (or
    this setting in it) was not built. Releasing the GIL costs a request little alone,
    but beside a busy Python thread taking it back waits up to Python's switch interval
    (`sys.getswitchinterval()`, 5 ms), against at most ~1 ms of kernels below 32k ids.
    The Python form's kernels go through ctypes, which always releases it."""
    fn = getattr(_compiled, "set_hold_gil_below", None)
    return None if fn is None else fn(int(entries))


def release_when_shared(on: bool) -> bool | None:
    """Whether a request under `hold_gil_below` releases the GIL all the same while
    other threads are inside `serving_embedding_lookup` (default True); returns the
    previous setting, None where the compiled form was not built. Holding it then makes
    the other threads wait for it until Python's switch interval forces it out: their
    requests run one after the other, with ~5 ms waits in the tail."""
    fn = getattr(_compiled, "set_release_when_shared", None)
    return None if fn is None else fn(bool(on))


def gil_handoff_us(us: int) -> int | None:
    """How long a thread that released the GIL for its kernels while others are serving
    waits after them, without the GIL and yielding its core, while another serving thread
    holds the GIL inside a lookup, before it asks for the GIL (0: no wait; default 1000);
    returns the previous value, None without the compiled form. Asking at once, it would
    sleep in CPython until that thread drops the GIL and be woken then (tens of us on a
    VM, the GIL idle meanwhile); and CPython's GIL is not fair: a thread that gives it up
    for a few us takes it back before a sleeping waiter has woken."""
    fn = getattr(_compiled, "set_handoff_us", None)
    return None if fn is None else fn(int(us))


def shared_window_us(us: int) -> int | None:
    """How long after another thread entered `serving_embedding_lookup` a request counts
    as shared (so a small one releases the GIL for its kernels: `hold_gil_below`) although
    no other thread is inside a lookup now (0: only while one is; default 20000); returns
    the previous value, None without the compiled form. A serving thread between two
    requests (its own Python) is not inside a lookup, yet waits for the GIL: a request
    that keeps it through its kernels made that thread wait up to Python's switch interval
    (5 ms). One thread serving beside a busy Python thread is never shared."""
    fn = getattr(_compiled, "set_shared_window_us", None)
    return None if fn is None else fn(int(us))


def fair_gil(on: bool) -> bool | None:
    """Whether serving threads whose kernels end take the GIL back in the order their
    kernels ended, while requests are shared (default True); returns the previous
    setting, None without the compiled form. Each takes a ticket and sleeps on a futex
    without the GIL until the thread before it has the GIL; the first in line then waits
    for it as `gil_handoff_us` and `gil_between_us` say, the only serving thread asking
    for it. Off, every such thread asks CPython at once, and CPython's GIL goes to
    whichever asks at the right moment: a thread asleep in take_gil is woken, finds it
    taken again and sleeps another switch interval (5 ms), anew each time. 4 clients,
    26 features (benchmarks/serving/RESULTS.md): p99/p50 1.6-2.0 at batch 1-256 on
    (37.7 / 7.2 / 12.0 / 2.05 off; torch's own 2.2-2.6 in that run); it costs 4 clients
    14-17% of their requests/s at batch 8 and 64 (sleepers woken in turn)."""
    fn = getattr(_compiled, "set_fair_gil", None)
    return None if fn is None else fn(bool(on))


def gil_between_us(us: int) -> int | None:
    """How long after a serving thread that holds the GIL left its lookup the first in
    line (`fair_gil`) still waits for that thread's next request to drop it, rather than
    asking CPython (0: not at all; default 100); returns the previous value, None
    without the compiled form. It waits only while serving threads come back within
    that time (a running mean of the time from a thread's leaving a lookup to its
    entering the next): a client thread's own Python between two requests takes a few
    us, and a thread asleep in CPython's take_gil takes 50-250 us to wake on a VM. A
    server whose threads block between requests (a socket, a queue) does not wait."""
    fn = getattr(_compiled, "set_between_us", None)
    return None if fn is None else fn(int(us))


def kernel_slots(n: int) -> int | None:
    """At most `n` serving threads run their kernels at once while requests are shared,
    the others asleep on a futex without the GIL and let in the order they came
    (0: no limit, the default); returns the previous value, None without the compiled
    form. For A/B: at `os.cpu_count()` it left the tails and requests/s as they were
    (benchmarks/serving/RESULTS.md)."""
    fn = getattr(_compiled, "set_kernel_slots", None)
    return None if fn is None else fn(int(n))


def gil_stats() -> tuple[int, int, int] | None:
    """(requests, those that released the GIL, ns their kernels ran without it) of the
    compiled form since the process started; None without it. What is not those ns of a
    request's time holds the GIL: its checks, output views and result."""
    fn = getattr(_compiled, "stats", None)
    return None if fn is None else fn()


def plan_cache(on: bool) -> bool | None:
    """Whether the compiled form keeps the per-feature plans (vocabulary size, dim,
    combiner, table key, flags) of the model it served last read into C (default True),
    or reads them from their Python tuples every request (~14 calls a feature); returns
    the previous setting, None without the compiled form. A batch-1 request of 26
    features: ~1 us less of its ~7 us holding the GIL (benchmarks/serving/RESULTS.md)."""
    fn = getattr(_compiled, "set_plan_cache", None)
    return None if fn is None else fn(bool(on))


def turn_spin_us(us: int) -> int | None:
    """How long the next serving thread in line for the GIL (`fair_gil`) spins before it
    sleeps on a futex (0: sleeps at once, the default); returns the previous value, None
    without the compiled form. For A/B: on the shared 2-core machine it cost 2 clients
    at batch 1 more than the wake-ups it saved (benchmarks/serving/RESULTS.md)."""
    fn = getattr(_compiled, "set_turn_spin_us", None)
    return None if fn is None else fn(int(us))


def first_pause(on: bool) -> bool | None:
    """Whether the first serving thread in line for the GIL spins with a pause
    instruction (keeping its core) instead of `sched_yield` (default False); returns the
    previous setting, None without the compiled form. For A/B, as `turn_spin_us`."""
    fn = getattr(_compiled, "set_first_pause", None)
    return None if fn is None else fn(bool(on))


def handover_timing(on: bool) -> bool | None:
    """Whether the compiled form times its one-call dict requests (`serve`) and the
    hand-over of the GIL after shared requests' kernels (`handover_stats`; default
    False: four clock reads a request); returns the previous setting, None without the
    compiled form."""
    fn = getattr(_compiled, "set_handover_timing", None)
    return None if fn is None else fn(bool(on))


def handover_stats() -> tuple[int, int, int, int, int] | None:
    """While `handover_timing` is on, since the process started: (one-call dict requests,
    ns they held the GIL, requests that released it while other threads served, ns from
    their kernels' end to the GIL taken back, how many of those slept on a futex waiting
    for their turn); None without the compiled form."""
    fn = getattr(_compiled, "handover_stats", None)
    return None if fn is None else fn()


def one_buffer(on: bool) -> bool | None:
    """Whether a request's outputs in the compiled form are views of one buffer taken
    from the output pool for the request (default True), each 64-byte aligned, or each
    its own buffer (the Python form's way); returns the previous setting, None without
    the compiled form. A buffer from the pool costs ~4 us of Python: 26 features at
    batch 1, numpy outputs, 124 -> 60 us a request (benchmarks/runs/serving-history.md). A
    view held keeps the whole request's buffer from reuse."""
    fn = getattr(_compiled, "set_one_buffer", None)
    return None if fn is None else fn(bool(on))


def in_flight() -> int:
    """Threads inside `serving_embedding_lookup` now, as the GIL policy counts them (0
    without the compiled form)."""
    fn = getattr(_compiled, "in_flight", None)
    return 0 if fn is None else fn()


def _nothing() -> None:
    return None


def in_flight_hooks() -> tuple:
    """(enter, leave): what `serving_embedding_lookup` calls around its work, so the
    compiled form knows how many threads are serving at once."""
    if _compiled is None or not hasattr(_compiled, "enter"):
        return _nothing, _nothing
    return _compiled.enter, _compiled.leave


def compiled_available() -> bool:
    """Whether the compiled form was built."""
    return _compiled is not None


def _bind() -> None:
    global _bound
    _compiled.bind(*native_backend.runner_addresses())
    bind_numpy = getattr(_compiled, "bind_numpy", None)
    if bind_numpy is not None:  # older builds: the buffer protocol and Python's API
        api = _numpy_c_api()
        if api is not None:
            dtypes = (np.int64, np.int32, np.float32, np.float16, np.uint8)
            bind_numpy(api, np.ndarray, tuple(np.dtype(d) for d in dtypes), pool.output_lease)
        set_cache = getattr(_compiled, "set_block_cache", None)
        if set_cache is not None:  # small request buffers: kept within the pool's limit
            pool.on_output_pool_limit(_block_cache_limit)
    _bound = True


def _block_cache_limit(limit: int) -> None:
    """The compiled path's cache of small request buffers (a request's outputs at most
    64 KiB: a C object over aligned memory, no Python lease) keeps at most the pool's
    limit, and at most 1 MiB."""
    _compiled.set_block_cache(min(int(limit), 1 << 20))


def _numpy_c_api():
    """numpy's C API capsule (`_ARRAY_API`: numpy 2's `numpy._core`, 1.x's `numpy.core`),
    or None."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return importlib.import_module(name)._ARRAY_API
        except (ImportError, AttributeError):
            continue
    return None


def direct_numpy(on: bool) -> bool | None:
    """Whether the compiled form reads numpy arrays' fields directly and makes output
    views with numpy's C API (default True, where numpy's C API was found), or goes
    through the buffer protocol and Python's API (a slice and a reshape a view); returns
    the previous setting, None where the compiled form (or this in it) was not built.
    The same arrays and checks either way: for A/B (benchmarks/serving/RESULTS.md)."""
    fn = getattr(_compiled, "set_direct_numpy", None)
    return None if fn is None else fn(bool(on))


def _plans(features) -> tuple:
    """Per feature, what the compiled checks need of its config: (common: no sequence
    or output_shape, vocabulary size, dim, combiner code, safe lookup, table config,
    prune weights: safe and a combiner other than sum). Kept per resolved config."""
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


def _alloc_f32(shape):
    return pool.output_float32_at(shape)


def _handed_over(features, flat_inputs, flat_weights, tables, threads, finish, keep):
    """`lookup`'s request, each task handed to the pool as it is made."""
    request = native_backend.NativeRequest(len(flat_inputs), threads)
    outs = result = None
    try:
        outs = _prepare(features, flat_inputs, flat_weights, tables, request.add_words, keep)
        if outs is not None:
            result = finish(outs, True)
    finally:
        results = request.close()  # waits for the tasks added: they write into `outs`
    if outs is None or any(c != -1 for c in results):
        return None
    return result if result is not None else finish(outs, False)


def _plausible(features, flat_inputs, flat_weights) -> int:
    """The request's ids, or -1: some feature is not a common case, by the tests that
    cost nothing, made before any output buffer is taken (a sequence feature among the
    others is common in recommenders: its requests go to the general path at once)."""
    entries = 0
    for feature, inp, weight in zip(features, flat_inputs, flat_weights):
        if inp is None:
            continue
        kind = type(inp)
        if (
            feature.max_sequence_length
            or feature.output_shape
            or not (kind is RaggedTensor or kind is SparseTensor or kind is np.ndarray)
            or (weight is not None and (type(weight) is not kind or kind is np.ndarray))
        ):
            return -1
        ids = inp if kind is np.ndarray else inp.values
        if type(ids) is np.ndarray:
            entries += ids.size
    return entries


class _Rows:
    """A table as the bag tasks see it: the rows' address, vocabulary, dim, row stride
    (floats; bytes for a quantized table) and the row format's address (0: float32)."""

    __slots__ = ("addr", "vocab", "dim", "stride", "fmt", "keep")

    def __init__(self, addr, vocab, dim, stride, fmt, keep):
        self.addr, self.vocab, self.dim, self.stride = addr, vocab, dim, stride
        self.fmt, self.keep = fmt, keep


_QROW = {"int8": (np.dtype(np.uint8), 8), "fp16": (np.dtype(np.float16), 0)}
_QROW["codes"] = (np.dtype(np.uint8), 0)  # bf16: the general path (as the compiled form)


def _rows_ok(t, feature) -> _Rows | None:
    """`_table_ok`'s table as `_Rows`, or a `QuantizedTable` whose rows the bag kernels
    decode (`EmServingBagQ`): numpy rows of its kind's layout, contiguous (bf16 and
    anything else: the general path's)."""
    if type(t) is not QuantizedTable:
        t = _table_ok(t, feature)
        if t is None:
            return None
        return _Rows(pool.address(t), t.shape[0], t.shape[1], t.strides[0] >> 2, 0, t)
    cfg, data = feature.table, t.data
    spec = _QROW.get(t.kind)
    if (
        spec is None
        or type(data) is not np.ndarray
        or t.dim != cfg.dim
        or cfg.dim <= 0
        or data.dtype != spec[0]
        or data.ndim != 2
        or data.shape != (cfg.vocabulary_size, cfg.dim + spec[1])
        or data.strides[1] != data.itemsize
        or data.strides[0] < data.shape[1] * data.itemsize
    ):
        return None
    values = 0
    if t.kind == "codes":
        v = t.values
        if (
            type(v) is not np.ndarray
            or v.dtype is not _F32
            or v.ndim != 1
            or v.size < 1
            or not v.flags.c_contiguous
        ):
            return None
        values = pool.address(v)
    fmt = np.array([FORMAT_CODES[t.kind], values], np.int64)
    return _Rows(
        pool.address(data), data.shape[0], cfg.dim, data.strides[0], pool.address(fmt), (t, fmt)
    )


def _prepare(features, flat_inputs, flat_weights, tables, add, keep) -> list | None:
    """Each given feature's output buffer (None where no input is given), its task's
    words given to `add` as they are made, or None: a feature that is not a common case.
    `keep` gets the arrays the tasks read that nothing else holds (tables converted here,
    sparse offsets): the caller holds them until the kernels ran."""
    outs: list = []
    for feature, inp, weight in zip(features, flat_inputs, flat_weights):
        if inp is None:
            outs.append(None)
            continue
        table = _rows_ok(tables[feature.table] if feature.table in tables else None, feature)
        if table is None:
            return None
        kind = type(inp)  # with fitting weights (see _plausible)
        if kind is RaggedTensor:
            task = _ragged(feature, inp, weight, table)
        elif kind is SparseTensor:
            task = _sparse(feature, inp, weight, table, keep)
        elif table.fmt == 0:
            task = _dense(inp, table)
        else:  # a dense lookup gathers float rows: the general path decodes them
            task = None
        if task is None:
            return None
        out, task_words = task
        outs.append(out)
        keep.append(table.keep)
        add(task_words)
    return outs


def _weights_address(weight, ids) -> int | None:
    """The address of finite float32 weights fitting `ids` (0 for no weights), or None
    (another dtype or layout, a NaN or Inf: the general path converts or names it)."""
    if weight is None:
        return 0
    w = weight.values
    if (
        type(w) is not np.ndarray
        or w.dtype is not _F32
        or w.shape != ids.shape
        or not w.flags.c_contiguous
        or not np.isfinite(w).all()
    ):
        return None
    return pool.address(w)


def _ragged(feature, inp, weight, table):
    ids, splits = inp.values, inp.row_splits
    if (
        not _ids_ok(ids)
        or ids.ndim != 1
        or type(splits) is not np.ndarray
        or splits.dtype is not _I64
        or splits.ndim != 1
        or splits.shape[0] < 2
        or not splits.flags.c_contiguous
    ):
        return None
    if (
        weight is not None
        and weight.row_splits is not splits
        and not np.array_equal(weight.row_splits, splits)
    ):
        return None  # the general path names the mismatch
    w_addr = _weights_address(weight, ids)
    if w_addr is None:
        return None
    rows = splits.shape[0] - 1
    out, out_addr = pool.output_empty_at((rows, table.dim), _F32)
    task = _bag_words(_KIND_BAG_CHECKED, table, ids, pool.address(splits), rows, w_addr, feature)
    task += (out_addr, table.dim, ids.shape[0])  # ids: checked against row_splits[-1]
    return out, _padded(task, table)


def _padded(task: tuple, table: _Rows) -> tuple:
    """A task's words padded to TASK_WORDS, a quantized table's format in the last."""
    task = task + _PAD[len(task) :]
    return task if table.fmt == 0 else task[:-1] + (table.fmt,)


def _bag_words(kind, table, ids, offsets_addr, rows, w_addr, feature, prune_ids=0, prune_w=0):
    """A bag task's first words: its kind, then EmServingBagF32's arguments up to the
    output's (EmServingBagQ's: the stride in bytes)."""
    return (
        kind,
        table.addr,
        table.vocab,
        table.dim,
        table.stride,
        pool.address(ids),
        int(ids.dtype is _I64),
        offsets_addr,
        rows,
        w_addr,
        combiner_code(feature.table.combiner),
        prune_ids,
        prune_w,
    )


def _sparse(feature, inp, weight, table, keep):
    ids, idx, shape = inp.values, inp.indices, inp.dense_shape
    if (
        len(shape) != 2
        or not _ids_ok(ids)
        or ids.ndim != 1
        or type(idx) is not np.ndarray
        or not (idx.dtype is _I64 or idx.dtype is _I32)
        or idx.ndim != 2
        or idx.shape[0] != ids.shape[0]
        or idx.shape[1] != 2
        or not idx.flags.c_contiguous
    ):
        return None
    rows, cols, dim = int(shape[0]), int(shape[1]), table.dim
    if rows <= 0 or cols <= 0:
        return None
    if weight is not None and tuple(weight.dense_shape) != tuple(shape):
        return None
    w_addr = _weights_address(weight, ids)
    if w_addr is None:
        return None
    # TensorFlow's safe lookup (validate_weights_and_indices): ids < 0 dropped, and with
    # a combiner other than sum weights not > 0
    safe = bool(feature.validate_weights_and_indices)
    combiner = feature.table.combiner
    out, out_addr = pool.output_empty_at((rows, dim), _F32)
    offsets = np.empty(rows + 1, np.int64)  # written by the request's first phase
    keep.append(offsets)
    prune_w = int(safe and w_addr != 0 and combiner != "sum")
    task = _bag_words(
        _KIND_SPARSE_OFFSETS_BAG,
        table,
        ids,
        pool.address(offsets),
        rows,
        w_addr,
        feature,
        int(safe),
        prune_w,
    )
    task += (out_addr, dim, pool.address(idx), int(idx.dtype is _I64), ids.shape[0], cols)
    return out, _padded(task, table)


def _dense(inp, table):
    if not _ids_ok(inp) or inp.ndim < 1:
        return None
    dim = table.dim
    out, out_addr = pool.output_empty_at((*inp.shape, dim), _F32)
    task = (
        _KIND_GATHER,
        table.addr,
        table.vocab,
        dim * 4,
        table.stride * 4,
        pool.address(inp),
        int(inp.dtype is _I64),
        inp.size,
        out_addr,
    )
    return out, task + _PAD[len(task) :]
