"""Host (CPU) kernels over numpy memory, used where XLA's CPU gather is slow: the
interface of each op and the one place that picks the backend.

The serving lookup's inner loops: `bag_combine` (gather rows, scale, sum per bag
given by offsets, normalise; TensorFlow's pruning and the id range check in the
same pass), `gather` (a checked plain lookup), `sparse_offsets` (validate COO
indices and derive bag offsets in one pass; also `inputs`' check of every
SparseTensor, through `embedmesh.sparse_index`), and `prepare_sparse_bag_combine`
(2-D sparse input, C++ only). `prepare_bag_combine` / `prepare_gather` split the
first two into checks (now) and the kernel (later), so a caller can run many
kernels back to back.

Each op is implemented once per backend, one module each
(`embedmesh.serving.backends`: the interface they share):

- "native" (`backends/native.py`, the default where its library loads): C++
  kernels (`embedmesh/serving/cpu/serving.cc`, loaded by
  `embedmesh.serving.native.library()`); a request's kernels also run in one C++
  call on a pool of threads (`run_native`, `NativeRequest` there: the general request
  path, `lookup.py`, hands them over; the compiled request rules, `request.py`, call the
  runner themselves);
- "numba" (`backends/numba.py`, when the C++ kernels are unavailable and numba is
  importable; compiled at a process's first call, never imported by `import
  embedmesh`);
- "numpy" (`backends/numpy.py`, always available).

All give the same values, bit for bit: float32 accumulation in entry order, no FMA.
`set_backend` switches between them (tests, benchmarks); the environment variable
`EMBEDMESH_SERVING_NATIVE=0` disables the C++ kernels and `EMBEDMESH_NUMBA=0`
(read once, by `embedmesh._runtime`) numba altogether, here and in host
preprocessing. Outputs come from `embedmesh.serving.pool` (64-byte aligned,
reused; `set_output_pool_limit`), which this module does not re-export.
"""

from __future__ import annotations

import functools

import numpy as np

from embedmesh import sparse_index
from embedmesh._runtime import combiner_code
from embedmesh.serving.backends import native as native_backend
from embedmesh.serving.backends import numba as numba_backend
from embedmesh.serving.backends import numpy as numpy_backend
from embedmesh.serving.backends.common import BadSparseIndex, IdOutOfRange, finish, signed_ids
from embedmesh.serving.quantized import QuantizedTable

__all__ = [
    "BadSparseIndex",
    "IdOutOfRange",
    "bag_combine",
    "gather",
    "get_backend",
    "native_in_use",
    "prepare_bag_combine",
    "prepare_gather",
    "prepare_sparse_bag_combine",
    "set_backend",
    "sparse_offsets",
]

_BACKENDS = {m.NAME: m for m in (native_backend, numba_backend, numpy_backend)}
_backend: str | None = None  # a key of _BACKENDS; None: chosen at first use


def __getattr__(name):
    # HAVE_NUMBA: whether the numba backend can be used (asking imports numba);
    # HAVE_NATIVE: whether the C++ kernels can be used (asking builds or loads them)
    if name == "HAVE_NUMBA":
        return numba_backend.load() is not None
    if name == "HAVE_NATIVE":
        return native_backend.load() is not None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_backend() -> str:
    """The implementation the kernels use now: "native", "numba" or "numpy" (the
    first of them that can run here, unless `set_backend` chose)."""
    global _backend
    if _backend is None:
        _backend = next(name for name, m in _BACKENDS.items() if m.load() is not None)
    return _backend


def set_backend(name: str) -> str:
    """Select "native" (the C++ kernels; needs a C++ compiler or the built library),
    "numba" (requires numba) or "numpy"; returns the previous backend."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(_BACKENDS)}")
    if name == "numba" and numba_backend.load() is None:
        raise RuntimeError(
            "the numba backend needs numba, which is not importable (or EMBEDMESH_NUMBA=0)"
        )
    if name == "native" and native_backend.load() is None:
        raise RuntimeError(f"the native backend is unavailable: {native_backend.reason()}")
    previous, _backend = get_backend(), name
    for hook in _backend_hooks:  # request: a model remembered for the C++ kernels
        hook()
    return previous


_backend_hooks: list = []


def on_backend_change(hook) -> None:
    """Call `hook()` after every `set_backend` (the request path forgets what it kept for
    the backend before; registered by it, which imports this module)."""
    _backend_hooks.append(hook)


def _impl():
    """The backend module in use."""
    return _BACKENDS[_backend or get_backend()]


def native_in_use() -> bool:
    """Whether the lookup's kernels are the C++ ones now (the backend in use)."""
    return (_backend or get_backend()) == "native"


def _check_offsets(offsets, n) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.shape[0] < 1 or offsets.dtype.kind not in "iu":
        raise ValueError(
            f"offsets must be a non-empty 1-D integer array, got {offsets.dtype} {offsets.shape}"
        )
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0 or offsets[-1] != n or (offsets[1:] < offsets[:-1]).any():
        raise ValueError(f"offsets must be non-decreasing from 0 to the number of ids ({n})")
    return offsets


def _check_ids(ids) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"ids must be 1-D integers, got {ids.dtype} {ids.shape}")
    return ids


def _check_table_ids(table, ids):
    table = np.asarray(table)
    ids = np.asarray(ids)
    if table.ndim != 2 or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"table must be 2-D and ids 1-D integers, got {table.shape} and {ids.dtype} {ids.shape}"
        )
    return table, ids


def _checked_weights(weights, ids):
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != ids.shape:
            raise ValueError(f"weights {weights.shape} must match ids {ids.shape}")
    return weights


def bag_combine(
    table: np.ndarray,
    ids: np.ndarray,
    offsets: np.ndarray,
    weights: np.ndarray | None = None,
    combiner: str | None = None,
    *,
    prune_ids: bool = False,
    prune_weights: bool = False,
) -> np.ndarray:
    """Combine the bags `ids[offsets[r]:offsets[r+1]]`: out[r] = sum w_k table[ids_k], normalised.

    The serving lookup's kernel, fed straight from ragged row_splits or
    sparse row offsets (no per-entry row array). `offsets` runs from 0 to
    len(ids), non-decreasing; `weights` None means all ones. With
    `prune_ids`, ids < 0 are skipped; with `prune_weights`, entries whose
    weight is not > 0 (TensorFlow's safe lookup). Kept ids outside the table
    raise `IdOutOfRange` (a ValueError) naming the first such entry.
    combiner None or "sum": no normalisation; "mean": divide by sum w;
    "sqrtn": divide by sqrt(sum w^2); a zero denominator gives a zero row
    (TensorFlow's div_no_nan); bags with no entry are zero. Accumulates in
    float32, in entry order, and returns a new, 64-byte aligned
    `[len(offsets) - 1, dim]` array of the table's dtype.
    """
    return prepare_bag_combine(
        table, ids, offsets, weights, combiner, prune_ids=prune_ids, prune_weights=prune_weights
    )()


def prepare_bag_combine(
    table,
    ids,
    offsets,
    weights=None,
    combiner=None,
    *,
    prune_ids: bool = False,
    prune_weights: bool = False,
    offsets_checked: bool = False,
):
    """`bag_combine` in two steps: checks the arguments and takes the output buffer
    now, and returns a function that runs the kernel (raising `IdOutOfRange`)
    and returns the output. Lets a caller run many kernels back to back.
    `offsets_checked`: the caller has already checked that `offsets` is a 1-D
    integer array running non-decreasing from 0 to len(ids) (ragged row_splits
    validated by `inputs.validate_structure`)."""
    mode = combiner_code(combiner)
    quantized = isinstance(table, QuantizedTable)
    if quantized:  # decoded inside the kernel (every backend: `prepare_bag`)
        table, ids = table.host(), _check_ids(ids)
    else:
        table, ids = _check_table_ids(table, ids)
    if offsets_checked:
        offsets = np.asarray(offsets).astype(np.int64, copy=False)
    else:
        offsets = _check_offsets(offsets, ids.shape[0])
    weights = _checked_weights(weights, ids)
    given = ids
    ids, can_be_negative = signed_ids(ids)
    prune_ids = prune_ids and can_be_negative
    prune_weights = prune_weights and weights is not None
    run = _impl().prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_weights)
    if not quantized and table.dtype != np.float32:  # the kernels sum in float32
        run = functools.partial(_finish_run, run, table.dtype)
    return _report_given_ids(run, given)


def _finish_run(run, dtype) -> np.ndarray:
    """`run()`'s float32 result as `dtype`."""
    return finish(run(), dtype)


def gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table[ids] for 1-D ids, bit for bit, into a new 64-byte aligned array;
    ids outside the table raise `IdOutOfRange`."""
    return prepare_gather(table, ids)()


def prepare_gather(table, ids):
    """`gather` in two steps, as `prepare_bag_combine`. A `QuantizedTable`'s rows are
    decoded: one bag a row (float32)."""
    if isinstance(table, QuantizedTable):
        ids = _check_ids(ids)
        return prepare_bag_combine(table, ids, np.arange(ids.shape[0] + 1), offsets_checked=True)
    table, ids = _check_table_ids(table, ids)
    return _report_given_ids(_impl().prepare_gather(table, signed_ids(ids)[0]), ids)


def _report_given_ids(run, given: np.ndarray):
    """`run`, its IdOutOfRange naming the id as given: uint64 ids are viewed as
    int64 by the kernels, so 2**64 - 1 would read -1. Other dtypes: `run` itself."""
    if given.dtype != np.uint64:
        return run

    def checked():
        try:
            return run()
        except IdOutOfRange as e:
            raise IdOutOfRange(e.entry, given[e.entry], e.vocabulary_size) from None

    return checked


def prepare_sparse_bag_combine(
    table,
    ids,
    indices,
    dense_shape,
    weights=None,
    combiner=None,
    *,
    prune_ids=False,
    prune_weights=False,
):
    """`prepare_bag_combine` for 2-D sparse input whose bags are the rows of COO
    `indices [n, 2]`, checked (inside `dense_shape`, row-major order, no repeats)
    when the kernels run, not now: the run raises `BadSparseIndex(k)` for the first
    bad index (before any bad id), `IdOutOfRange` as `bag_combine`. The bag offsets
    are derived first, in `run_native`'s first phase (in parallel over features, no
    Python between), then the bag kernel sums. Only with the C++ kernels, a float32
    table, signed int32/int64 ids and indices; None otherwise (the caller takes
    `sparse_offsets` + `prepare_bag_combine`).

    A one-pass kernel that checked the indices in the bag kernel's own walk was slower
    at every dim once that walk and the offsets pass were tuned (0.95x / 0.89x / 0.78x
    at dims 16 / 32 / 64, 2026-12-03) and was removed (issue #39): history in
    benchmarks/runs/serving-history.md, its A/B `git show
    978d03b:benchmarks/serving_sparse_ab.py`."""
    if (_backend or get_backend()) != "native" or isinstance(table, QuantizedTable):
        return None
    table = np.asarray(table)
    ids = np.asarray(ids)
    indices = np.asarray(indices)
    if (
        table.dtype != np.float32
        or table.ndim != 2
        or ids.ndim != 1
        or indices.ndim != 2
        or indices.shape != (ids.shape[0], 2)
        or len(dense_shape) != 2
        or ids.dtype not in (np.int32, np.int64)
        or indices.dtype not in (np.int32, np.int64)
    ):
        return None
    if table.shape[1] <= 0:
        return None
    mode = combiner_code(combiner)
    weights = _checked_weights(weights, ids)
    return native_backend.prepare_sparse_bag(
        table,
        np.ascontiguousarray(ids),
        np.ascontiguousarray(indices),
        int(dense_shape[0]),
        int(dense_shape[1]),
        weights,
        mode,
        prune_ids,
        prune_weights,
    )


def sparse_offsets(indices: np.ndarray, dense_shape: tuple) -> tuple[np.ndarray | None, int]:
    """Bag offsets over the flattened leading dims of COO `indices [n, rank]`.

    Returns (offsets [prod(dense_shape[:-1]) + 1], -1) when every index lies
    in `dense_shape` and follows the previous one in row-major order without
    repeats, else (None, k) for the first entry k breaking that. One pass.
    """
    indices = np.asarray(indices)
    shape = np.asarray(dense_shape, np.int64)
    num_rows = int(np.prod(shape[:-1]))
    done = _impl().sparse_offsets(indices, shape, num_rows)
    if done is not None:
        return done
    return numpy_backend.sparse_offsets(indices, shape, num_rows)


# `inputs`' check of sparse indices (embedmesh.sparse_index) runs on the backend in use
sparse_index.set_kernel(sparse_offsets)
