"""The serving lookup's compiled host kernels (numba): imported by the numba
backend (`embedmesh.serving.backends.numba`) at first use, so importing embedmesh
never imports numba. Module-level `@njit` functions cached on disk; `bag_kernel(mode, has_w,
prune_ids, prune_w)` returns the bag kernel compiled for the combiner and weights
(the pruning options are run-time flags). See `embedmesh.serving.kernels` for what
each computes and `backends/numpy.py` for the numpy form that matches it.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "bag_kernel",
    "gather_kernel",
    "gather_streaming_kernel",
    "sparse_offsets_2d",
    "sparse_offsets_kernel",
]

_PREFETCH_AHEAD = 16  # entries ahead; measured: 8-24 alike, 32 worse (1M x 64 f32 tables)
# Only a row's first cache line is prefetched: on 1M x 64 f32 tables that ran
# ~1.2x faster than prefetching all four lines, and alike for 128-wide rows.
_BLOCK = 64  # columns accumulated at once; a stack array LLVM keeps in 4 zmm registers


_PREFETCH_FN = (
    "llvm.prefetch.p0" if llvm_binding.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"
)


@intrinsic
def _prefetch(typingctx, arr, row, col):  # pragma: no cover (compiled)
    """Hint the CPU to load the cache line of arr[row, col] (never faults)."""
    sig = types.void(arr, row, col)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = [
            context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])
        ]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_FN)
        # read, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _stack_block(typingctx):  # pragma: no cover (compiled)
    """Pointer to _BLOCK float32 on the stack (an alloca in the entry block).

    Unlike np.empty (a heap allocation LLVM must assume may alias the
    table), an alloca is known not to alias anything: with constant trip
    counts LLVM promotes it to vector registers and drops the runtime
    alias checks. This alone made the kernel ~1.7x faster on cached rows.
    """
    sig = types.CPointer(types.float32)()

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=_BLOCK)

    return sig, codegen


def _mark_nontemporal(builder, store):
    store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))


def _address(builder, value):
    """A 64-bit integer byte address argument as an i8*."""
    return builder.inttoptr(value, ir.IntType(8).as_pointer())


@intrinsic
def _stream_copy64(typingctx, dst, src):  # pragma: no cover (compiled)
    """Copy the 64 bytes at address src to address dst (64-byte aligned) with a
    non-temporal store."""
    if not (
        isinstance(dst, types.Integer)
        and isinstance(src, types.Integer)
        and dst.bitwidth == src.bitwidth == 64
    ):
        return None  # addresses only (a typing error otherwise)
    sig = types.void(dst, src)

    def codegen(context, builder, signature, args):
        vty = ir.VectorType(ir.IntType(8), 64)
        v = builder.load(builder.bitcast(_address(builder, args[1]), vty.as_pointer()), align=1)
        dst_p = builder.bitcast(_address(builder, args[0]), vty.as_pointer())
        _mark_nontemporal(builder, builder.store(v, dst_p, align=64))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):  # pragma: no cover (compiled)
    """Order the streaming stores before anything that follows (a full fence:
    on x86 only mfence/sfence order non-temporal stores)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always")
def _accumulate(
    src, ids, weights, has_w, lo, hi, j0, width, acc, uvocab, prune_ids, prune_w, first, mode
):  # pragma: no cover (compiled)
    """acc[:width] = sum over kept k in [lo, hi) of w_k * src[ids_k, j0:j0+width].

    With `first`: also checks ids (returns the first bad entry, else -1),
    sums the denominator (sum w for mode 1, sum w^2 for mode 2) and
    prefetches the row _PREFETCH_AHEAD entries ahead. Entries are added in
    order, in float32, without FMA (bit-equal to the numpy backend).
    """
    for j in range(width):
        acc[j] = np.float32(0.0)
    den = np.float32(0.0)
    last = ids.shape[0] - 1
    for k in range(lo, hi):
        i = ids[k]
        if prune_ids and i < 0:
            continue
        w = weights[k] if has_w else np.float32(1.0)
        if prune_w and not w > np.float32(0.0):
            continue
        if first:
            _prefetch(src, ids[min(k + _PREFETCH_AHEAD, last)], 0)
            if numba.uint64(i) >= uvocab:
                return k, den
            if mode == 1:
                den += w
            elif mode == 2:
                den += w * w
        row = src[numba.uint64(i)]
        for j in range(width):
            acc[j] += w * row[j0 + j]
    return -1, den


@numba.njit(inline="always")
def _store(acc, out, r, j0, width, mode, den):  # pragma: no cover (compiled)
    """out[r, j0:j0+width] = acc normalised by den (mode 1, 2); 0/0 gives 0."""
    if mode == 0:
        for j in range(width):
            out[r, j0 + j] = acc[j]
        return
    d = np.sqrt(den) if mode == 2 else den
    # written straight to out: updating acc in place in a branch made LLVM
    # spill the accumulators to the stack
    if d == np.float32(0.0):
        for j in range(width):
            out[r, j0 + j] = np.float32(0.0)
    else:
        for j in range(width):
            out[r, j0 + j] = acc[j] / d


def _specialised_bag_kernel(mode, has_w):
    """The bag kernel with the combiner and weights fixed at compile time: the one
    kernel built by a factory, as those must be constants for LLVM.

    All four options as run-time flags tested per entry cost ~10% (0.93x torch's
    embedding_bag against 1.03-1.07x specialised, same workload). The two pruning
    flags are run-time arguments (loop-invariant branches): specialising them too
    made 4x the compiles (~2.7 CPU-s each, 24 per id type) for a fallback backend
    (the C++ kernels serve by default). Closures are cached on disk per value of
    their constants. Over 120 lines: it holds the kernel (see its docstring).
    """

    @numba.njit(cache=True, nogil=True)
    def kernel(src, ids, offsets, weights, out, prune_ids, prune_w):  # pragma: no cover
        """out[r] = combine(w_k * src[ids_k] for kept k in [offsets[r], offsets[r+1])).

        Kept: not (prune_ids and id < 0) and not (prune_w and not w > 0).
        mode 0 sum, 1 divide by sum w, 2 divide by sqrt(sum w^2).
        Columns go in blocks of 64 (then 16, then the rest) whose
        accumulators stay in registers; the first block also checks ids
        and sums the denominator. Returns -1, or the first entry whose
        (kept) id is outside the table.

        Over 120 lines as one compiled function: its per-entry work is already in
        the inlined `_accumulate` and `_store`; what stays are the column-block
        loops over accumulators local to it (`_stack_block` arrays, which LLVM keeps
        in registers), one branch per block width. The calls are written out with
        their 14 arguments on purpose (issue #39, 2026-12-04, same process, 15
        rounds): the shared arguments passed as one tuple ran 0.88-0.95x as fast
        at dim 64 (sum, sqrtn; the same elsewhere), and one more inlined helper
        (accumulate, then store) took 1.6x the compile time (18-20 against 11-12
        CPU-s for the 6 kernels).
        """
        num_rows = out.shape[0]
        dim = out.shape[1]
        uvocab = numba.uint64(src.shape[0])
        # one stack array per block width: one used only at constant indices
        # is promoted to registers, one also used at run-time ones is not
        acc = numba.carray(_stack_block(), (_BLOCK,))
        acc16 = numba.carray(_stack_block(), (_BLOCK,))
        acc_tail = numba.carray(_stack_block(), (_BLOCK,))
        for k in range(min(_PREFETCH_AHEAD, ids.shape[0])):
            _prefetch(src, ids[k], 0)
        full = dim - dim % _BLOCK
        quarter = dim - dim % 16
        # the first block (checks, denominator, prefetch) is peeled off so
        # that every inlined copy of the entry loop has constant options
        first = _BLOCK if dim >= _BLOCK else 16 if dim >= 16 else dim
        for r in range(num_rows):
            lo = offsets[r]
            hi = offsets[r + 1]
            if first == _BLOCK:
                bad, den = _accumulate(
                    src,
                    ids,
                    weights,
                    has_w,
                    lo,
                    hi,
                    0,
                    _BLOCK,
                    acc,
                    uvocab,
                    prune_ids,
                    prune_w,
                    True,
                    mode,
                )
                if bad >= 0:
                    return bad
                _store(acc, out, r, 0, _BLOCK, mode, den)
            elif first == 16:
                bad, den = _accumulate(
                    src,
                    ids,
                    weights,
                    has_w,
                    lo,
                    hi,
                    0,
                    16,
                    acc16,
                    uvocab,
                    prune_ids,
                    prune_w,
                    True,
                    mode,
                )
                if bad >= 0:
                    return bad
                _store(acc16, out, r, 0, 16, mode, den)
            else:
                bad, den = _accumulate(
                    src,
                    ids,
                    weights,
                    has_w,
                    lo,
                    hi,
                    0,
                    first,
                    acc_tail,
                    uvocab,
                    prune_ids,
                    prune_w,
                    True,
                    mode,
                )
                if bad >= 0:
                    return bad
                _store(acc_tail, out, r, 0, first, mode, den)
            for j0 in range(first, full, _BLOCK):
                _accumulate(
                    src,
                    ids,
                    weights,
                    has_w,
                    lo,
                    hi,
                    j0,
                    _BLOCK,
                    acc,
                    uvocab,
                    prune_ids,
                    prune_w,
                    False,
                    mode,
                )
                _store(acc, out, r, j0, _BLOCK, mode, den)
            for j0 in range(max(first, full), quarter, 16):
                _accumulate(
                    src,
                    ids,
                    weights,
                    has_w,
                    lo,
                    hi,
                    j0,
                    16,
                    acc16,
                    uvocab,
                    prune_ids,
                    prune_w,
                    False,
                    mode,
                )
                _store(acc16, out, r, j0, 16, mode, den)
            j0 = max(first, quarter)
            if j0 < dim:
                _accumulate(
                    src,
                    ids,
                    weights,
                    has_w,
                    lo,
                    hi,
                    j0,
                    dim - j0,
                    acc_tail,
                    uvocab,
                    prune_ids,
                    prune_w,
                    False,
                    mode,
                )
                _store(acc_tail, out, r, j0, dim - j0, mode, den)
        return -1

    return kernel


_BAG_KERNELS: dict = {}  # options -> compiled bag kernel


def bag_kernel(mode, has_w, prune_ids, prune_w):
    """The bag kernel for these options (`mode`: 0 sum, 1 mean, 2 sqrtn; has
    weights; prune ids < 0; prune weights <= 0), compiled at first use."""
    key = (int(mode), bool(has_w))
    kern = _BAG_KERNELS.get(key)
    if kern is None:
        kern = _BAG_KERNELS[key] = _specialised_bag_kernel(*key)
    prune = (bool(prune_ids), bool(prune_w))
    return lambda src, ids, offsets, weights, out: kern(src, ids, offsets, weights, out, *prune)


@numba.njit(cache=True, nogil=True)
def gather_kernel(src, ids, out):  # pragma: no cover (compiled)
    """out[k] = src[ids[k]], bit for bit (unsigned-int views); returns -1, or the
    first entry whose id is outside the table (out is then incomplete)."""
    n = ids.shape[0]
    dim = src.shape[1]
    uvocab = numba.uint64(src.shape[0])
    last = n - 1
    for k in range(min(_PREFETCH_AHEAD, n)):
        _prefetch(src, ids[k], 0)
    for k in range(n):
        _prefetch(src, ids[min(k + _PREFETCH_AHEAD, last)], 0)
        i = ids[k]
        if numba.uint64(i) >= uvocab:
            return k
        row = src[numba.uint64(i)]
        for j in range(dim):
            out[k, j] = row[j]
    return -1


@numba.njit(cache=True, nogil=True)
def gather_streaming_kernel(src, ids, out):  # pragma: no cover (compiled)
    """`gather_kernel` for rows of a multiple of 64 bytes into a 64-byte aligned
    `out`, written with non-temporal stores (uint8 views)."""
    n = ids.shape[0]
    row_bytes = numba.uint64(src.shape[1])
    uvocab = numba.uint64(src.shape[0])
    src_addr = src.ctypes.data
    out_addr = out.ctypes.data
    last = n - 1
    for k in range(min(_PREFETCH_AHEAD, n)):
        _prefetch(src, ids[k], 0)
    for k in range(n):
        _prefetch(src, ids[min(k + _PREFETCH_AHEAD, last)], 0)
        i = ids[k]
        if numba.uint64(i) >= uvocab:
            return k
        row = src_addr + numba.uint64(i) * row_bytes  # all uint64: byte addresses
        dst = out_addr + numba.uint64(k) * row_bytes
        for j in range(0, row_bytes, 64):
            _stream_copy64(dst + j, row + j)
    _store_fence()
    return -1


@numba.njit(cache=True, nogil=True)
def sparse_offsets_2d(indices, num_rows, num_cols, offsets):  # pragma: no cover
    """`sparse_offsets_kernel` for rank 2 (the usual [batch, ids] form), with
    scalar bounds: ~4x faster than the general loop over dimensions."""
    n = indices.shape[0]
    cur = 0
    offsets[0] = 0
    prev_row = 0
    prev_col = -1
    for k in range(n):
        row = indices[k, 0]
        col = indices[k, 1]
        if row < 0 or row >= num_rows or col < 0 or col >= num_cols:
            return k
        if row == prev_row:
            if col <= prev_col:
                return k
        elif row < prev_row:
            return k
        else:
            while cur < row:
                cur += 1
                offsets[cur] = k
        prev_row = row
        prev_col = col
    while cur < num_rows:
        cur += 1
        offsets[cur] = n
    return -1


@numba.njit(cache=True, nogil=True)
def sparse_offsets_kernel(indices, shape, offsets):  # pragma: no cover (compiled)
    """One pass over COO indices [n, rank]: checks each lies in `shape` and
    follows the previous one in row-major order (no repeats), and fills
    offsets over the flattened leading dims. Returns -1 or the first bad
    entry."""
    n = indices.shape[0]
    rank = indices.shape[1]
    num_rows = offsets.shape[0] - 1
    cur = 0
    offsets[0] = 0
    prev_row = -1
    prev_col = -1
    for k in range(n):
        row = 0
        for d in range(rank - 1):
            v = indices[k, d]
            if v < 0 or v >= shape[d]:
                return k
            row = row * shape[d] + v
        col = indices[k, rank - 1]
        if col < 0 or col >= shape[rank - 1]:
            return k
        if row < prev_row or (row == prev_row and col <= prev_col):
            return k
        while cur < row:
            cur += 1
            offsets[cur] = k
        prev_row = row
        prev_col = col
    while cur < num_rows:
        cur += 1
        offsets[cur] = n
    return -1
