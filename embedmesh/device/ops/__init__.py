"""Optional CPU kernels for the sparse ops, through XLA's FFI (built lazily with a C++ compiler).

XLA's CPU gather and scatter move about 2-3 M rows of 64 float32 per second
on this project's 2-core machines, whatever the access pattern, and with the
page faults of XLA's fresh output buffers they were most of a training step
(see `benchmarks/RESULTS_train.md`). These handlers do the same row moves with
software prefetch, on all the CPUs the process may use (`EMBEDMESH_CPU_THREADS`
caps them), and advise their large outputs to use huge pages before writing
them (one fault per 2 MiB instead of per 4 KiB).

All ids are int32 and non-negative (negative ids wrap in `jnp.take`, so the
kernels and the fallbacks may differ there); PAD_ID and other ids past the
end are padding.

- `gather_rows(table, ids)`: `table[ids]`, zeros for ids `>= rows`.
- `scatter_rows(table, ids, rows)`: `table.at[ids].set(rows, mode="drop")`, in
  place (the table is aliased to the result; donate it to avoid a copy).
  Ids must be distinct (or duplicates carry equal rows).
- `segment_gather_sum(src, src_idx, gains, dst_idx, num_segments)`:
  `segment_sum(src[src_idx] * gains[:, None], dst_idx, num_segments)`, pairs
  with an out-of-range `src_idx` or `dst_idx` skipped; sums in pair order.
- `dedup_sum(ids, grads)`: the distinct ids of `ids` ascending (padded with
  `PAD_ID`, ids equal to `PAD_ID` dropped) and the sum of the `grads` rows of
  each, in input order. Linear when every row of `ids` [N, U] is ascending (an
  N-way merge; the host preprocessing guarantees it), a sort otherwise.
- `sparse_update(optimizer, table, slots, ids, grads, step)`: the owner's
  update of the rows `ids`, in place; SGD and Adagrad (float32) fused in one
  pass over the rows, other optimizers through `gather_rows`, their
  `update_rows` and `scatter_rows`.
- `backward_update(...)`: one shard's backward (pairs -> per-row gradient
  sums) and update fused, for SGD and Adagrad: no [U, D] gradient buffer.
- `huge_page_copy(x)`, `full(shape, value, dtype, device)`: a copy, or a
  constant array made on a device, whose buffer is advised to use transparent
  huge pages before it is first written (XLA's own buffers get 4 KiB pages;
  random row access into multi-GB tables and slots is faster on huge pages in
  a VM, where TLB misses are expensive: the training step of
  `benchmarks/train_step.py` went from 47 to 40 ms). `EmbeddingCore` builds
  its tables and slots with `full`.

Every function has a pure-JAX fallback with the same semantics, used on other
platforms (through `jax.lax.platform_dependent`), when no C++ compiler is
found, when the build fails, when `EMBEDMESH_CPU_KERNELS=0`, or when JAX's default
backend is not CPU (unless `EMBEDMESH_CPU_KERNELS=1`). The library is
compiled at first use from the source below with `$CXX` (else `c++`/`g++`)
against `jax.ffi.include_dir()` into a cache directory (`$EMBEDMESH_CACHE_DIR`,
else `$XDG_CACHE_HOME/embedmesh`, else `~/.cache/embedmesh`), keyed by a hash
of the source, the compiler and jaxlib's version; one build takes ~10-20 s.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

PAD_ID = int(np.iinfo(np.int32).max)

_SOURCE = r"""
// embedmesh CPU kernels (XLA FFI). See embedmesh/cpu_ops.py.
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kPad = 2147483647;
constexpr int64_t kPrefetch = 16;  // rows ahead

int64_t RowElems(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  int64_t n = 1;
  for (size_t i = 1; i < d.size(); ++i) n *= d[i];
  return n;
}

int64_t Rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return d.size() ? d[0] : 1;
}

inline void PrefetchRead(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 0);
}

inline void PrefetchWrite(char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 1, 0);
}

// Worker threads for one call: EMBEDMESH_CPU_THREADS, else the CPUs this process may use.
int64_t NumWorkers() {
  static const int64_t n = [] {
    if (const char* e = std::getenv("EMBEDMESH_CPU_THREADS")) {
      long v = std::strtol(e, nullptr, 10);
      if (v >= 1) return static_cast<int64_t>(v);
    }
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

// Runs f(chunk) for chunk in [0, n) on the calling thread plus short-lived helper threads
// of our own, joined before returning. (Not XLA's intra-op pool: with several devices per
// process, its threads may sit in a collective, and work queued behind them could wait for
// the very execution that queued it.)
template <typename F>
void ParallelFor(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t helpers = std::min<int64_t>(NumWorkers() - 1, n - 1);
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    int64_t c;
    while ((c = next.fetch_add(1, std::memory_order_relaxed)) < n) f(c);
  };
  std::vector<std::thread> threads;
  for (int64_t h = 0; h < helpers; ++h) {
    try {
      threads.emplace_back(work);
    } catch (...) {  // no thread: the caller does the work
      break;
    }
  }
  work();
  for (auto& t : threads) t.join();
}

// Chunks of about `grain` items, at least one per thread when there is work.
int64_t NumChunks(int64_t items, int64_t grain) {
  return items <= 0 ? 0 : (items + grain - 1) / grain;
}

void AdviseHuge(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t kHuge = 2u << 20;
  uintptr_t s = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (e > s) madvise(reinterpret_cast<void*>(s), e - s, MADV_HUGEPAGE);
#endif
}

// XLA hands each call a fresh output buffer, which on Linux is a fresh mmap for
// anything large: writing it costs one page fault per 4 KiB (8192 faults, ~30 ms
// in a VM, for a 32 MiB output: more than the gather itself). Advised to use
// huge pages before its first write, it faults 2 MiB at a time.
void PrepareOutput(void* p, size_t bytes) {
  if (bytes >= (size_t{4} << 20)) AdviseHuge(p, bytes);
}

// ---------------------------------------------------------------------------

ffi::Error GatherRows(ffi::AnyBuffer table,
                      ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rows = Rows(table);
  const int64_t rb = RowElems(table) * ffi::ByteWidth(table.element_type());
  const int64_t n = ids.element_count();
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  PrepareOutput(dst, n * rb);
  const int64_t grain = 4096;
  ParallelFor(NumChunks(n, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(n, lo + grain);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        int64_t r = id[i + kPrefetch];
        if (r >= 0 && r < rows) PrefetchRead(src + r * rb, rb);
      }
      int64_t r = id[i];
      if (r >= 0 && r < rows) {
        std::memcpy(dst + i * rb, src + r * rb, rb);
      } else {
        std::memset(dst + i * rb, 0, rb);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error ScatterRows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                       ffi::AnyBuffer values, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rows = Rows(table);
  const int64_t rb = RowElems(table) * ffi::ByteWidth(table.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != table.untyped_data()) {  // not aliased: copy the table first
    std::memcpy(dst, table.untyped_data(), table.size_bytes());
  }
  const int64_t n = ids.element_count();
  const char* src = static_cast<const char*>(values.untyped_data());
  const int32_t* id = ids.typed_data();
  const int64_t grain = 4096;
  ParallelFor(NumChunks(n, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(n, lo + grain);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        int64_t r = id[i + kPrefetch];
        if (r >= 0 && r < rows) PrefetchWrite(dst + r * rb, rb);
      }
      int64_t r = id[i];
      if (r >= 0 && r < rows) std::memcpy(dst + r * rb, src + i * rb, rb);
    }
  });
  return ffi::Error::Success();
}

// out[dst[p]] += gains[p] * src[row(p)], row(p) = sidx[p] (or map[sidx[p]] with a map);
// threads own disjoint destination ranges, so each destination sums in pair order.
ffi::Error SegmentGatherSumImpl(const float* s, int64_t m, int64_t d,
                                const int32_t* map, int64_t map_n, const int32_t* si,
                                const float* g, const int32_t* di, int64_t p, float* o,
                                int64_t segs) {
  PrepareOutput(o, sizeof(float) * segs * d);
  auto row_of = [&](int64_t q) -> int64_t {
    int64_t r = si[q];
    if (map != nullptr) {
      if (r < 0 || r >= map_n) return -1;
      r = map[r];
    }
    return (r >= 0 && r < m) ? r : -1;
  };
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(NumWorkers(), 16));
  const int64_t span = (segs + parts - 1) / parts;
  ParallelFor(parts, [&](int64_t part) {
    const int64_t lo = part * span, hi = std::min(segs, lo + span);
    if (lo >= hi) return;
    std::memset(o + lo * d, 0, sizeof(float) * (hi - lo) * d);
    for (int64_t q = 0; q < p; ++q) {
      if (q + kPrefetch < p) {
        int64_t tq = di[q + kPrefetch];
        if (tq >= lo && tq < hi) {
          int64_t r = row_of(q + kPrefetch);
          if (r >= 0) PrefetchRead(reinterpret_cast<const char*>(s + r * d), 4 * d);
          PrefetchWrite(reinterpret_cast<char*>(o + tq * d), 4 * d);  // 15% less CPU
        }
      }
      int64_t t = di[q];
      if (t < lo || t >= hi) continue;
      int64_t r = row_of(q);
      if (r < 0) continue;
      const float gq = g[q];
      float* __restrict__ orow = o + t * d;
      const float* __restrict__ srow = s + r * d;
      for (int64_t k = 0; k < d; ++k) orow[k] += gq * srow[k];
    }
  });
  return ffi::Error::Success();
}

template <typename Dims>
int64_t RowWidth(const Dims& dims) {
  int64_t d = 1;
  for (size_t i = 1; i < dims.size(); ++i) d *= dims[i];
  return d;
}

ffi::Error SegmentGatherSum(ffi::Buffer<ffi::F32> src,
                            ffi::Buffer<ffi::S32> sidx, ffi::Buffer<ffi::F32> gains,
                            ffi::Buffer<ffi::S32> didx, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto sd = src.dimensions();
  auto od = out->dimensions();
  return SegmentGatherSumImpl(src.typed_data(), sd.size() ? sd[0] : 1, RowWidth(sd),
                              nullptr, 0, sidx.typed_data(), gains.typed_data(),
                              didx.typed_data(), sidx.element_count(), out->typed_data(),
                              od.size() ? od[0] : 1);
}

ffi::Error SegmentGatherSumMapped(ffi::Buffer<ffi::F32> src,
                                  ffi::Buffer<ffi::S32> map, ffi::Buffer<ffi::S32> sidx,
                                  ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::S32> didx,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto sd = src.dimensions();
  auto od = out->dimensions();
  return SegmentGatherSumImpl(src.typed_data(), sd.size() ? sd[0] : 1, RowWidth(sd),
                              map.typed_data(), map.element_count(), sidx.typed_data(),
                              gains.typed_data(), didx.typed_data(), sidx.element_count(),
                              out->typed_data(), od.size() ? od[0] : 1);
}

// ids [N, U] (each row expected ascending), grads [N*U, D] -> distinct ids ascending (PAD
// padded) and per-id sums in input order. `sums` may alias `grads` (in place).
ffi::Error DedupSum(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                    ffi::Result<ffi::Buffer<ffi::S32>> uniq,
                    ffi::Result<ffi::Buffer<ffi::F32>> sums) {
  auto idd = ids.dimensions();
  const int64_t m = ids.element_count();
  const int64_t nb = idd.size() >= 2 ? idd[0] : 1;
  const int64_t ub = nb ? m / nb : 0;
  const int64_t d = RowWidth(grads.dimensions());
  const int32_t* id = ids.typed_data();
  const float* g = grads.typed_data();
  int32_t* uo = uniq->typed_data();
  float* so = sums->typed_data();
  bool sorted = true;
  for (int64_t b = 0; b < nb && sorted; ++b)
    for (int64_t i = b * ub + 1; i < (b + 1) * ub; ++i)
      if (id[i] < id[i - 1]) { sorted = false; break; }
  std::vector<int64_t> order;
  bool identity = sorted && nb <= 1;  // then write slot <= read slot: safe in place
  if (!identity) {
    order.reserve(m);
    if (sorted) {  // N-way merge, ties by block (= stable order)
      std::vector<int64_t> head(nb), end(nb);
      for (int64_t b = 0; b < nb; ++b) { head[b] = b * ub; end[b] = (b + 1) * ub; }
      while (true) {
        int64_t best = -1;
        int32_t bv = 0;
        for (int64_t b = 0; b < nb; ++b) {
          if (head[b] < end[b] && id[head[b]] != kPad && (best < 0 || id[head[b]] < bv)) {
            best = b;
            bv = id[head[b]];
          }
        }
        if (best < 0) break;
        order.push_back(head[best]++);
      }
    } else {
      for (int64_t i = 0; i < m; ++i) if (id[i] != kPad) order.push_back(i);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    }
  }
  std::vector<float> copy;
  if (!identity && static_cast<const void*>(so) == static_cast<const void*>(g)) {
    copy.assign(g, g + m * d);
    g = copy.data();
  } else if (static_cast<const void*>(so) != static_cast<const void*>(g)) {
    PrepareOutput(so, sizeof(float) * m * d);
  }
  const int64_t count = identity ? m : static_cast<int64_t>(order.size());
  int64_t k = -1;
  int32_t last = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = identity ? j : order[j];
    if (id[i] == kPad) {
      if (identity) break;  // sorted: only padding follows
      continue;
    }
    const float* gr = g + i * d;
    if (k < 0 || id[i] != last) {
      ++k;
      last = id[i];
      uo[k] = last;
      if (so + k * d != gr) std::memmove(so + k * d, gr, sizeof(float) * d);
    } else {
      float* __restrict__ sr = so + k * d;
      for (int64_t c = 0; c < d; ++c) sr[c] += gr[c];
    }
  }
  for (int64_t i = k + 1; i < m; ++i) uo[i] = kPad;
  if (k + 1 < m) std::memset(so + (k + 1) * d, 0, sizeof(float) * (m - k - 1) * d);
  return ffi::Error::Success();
}

// Fused sparse SGD / Adagrad on the rows `ids` (distinct; out of range skipped), in place:
// the table (and accumulator) are aliased to the results. Same float32 arithmetic, in the
// same order, as `embedmesh.optimizers` (clip g, rule, weight decay, clip w).
struct UpdateAttrs {
  float clip_lo, clip_hi, wd, wmin, wmax;
  bool has_wd, wd_lr;
};

template <bool kAdagrad>
inline void UpdateRow(float* __restrict__ wr, float* __restrict__ ar, const float* __restrict__ gr,
                      int64_t d, float lr, float wd, const UpdateAttrs& at) {
  for (int64_t k = 0; k < d; ++k) {
    float gk = gr[k];
    gk = gk < at.clip_lo ? at.clip_lo : gk;
    gk = gk > at.clip_hi ? at.clip_hi : gk;
    const float w_old = wr[k];
    float wn;
    if (kAdagrad) {
      const float a = ar[k] + gk * gk;
      ar[k] = a;
      wn = w_old - lr * gk * (1.0f / std::sqrt(a));
    } else {
      wn = w_old - lr * gk;
    }
    if (at.has_wd) wn = wn - wd * w_old;
    wn = wn < at.wmin ? at.wmin : wn;
    wn = wn > at.wmax ? at.wmax : wn;
    wr[k] = wn;
  }
}

inline float EffectiveWd(float lr, const UpdateAttrs& at) {
  return at.has_wd ? (at.wd_lr ? at.wd * lr : at.wd) : 0.0f;
}

template <bool kAdagrad>
void SparseUpdate(float* w, float* acc, int64_t rows, int64_t d, const int32_t* id, int64_t n,
                  const float* g, float lr, const UpdateAttrs& at) {
  const float wd = EffectiveWd(lr, at);
  const int64_t grain = 2048;
  ParallelFor(NumChunks(n, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(n, lo + grain);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        int64_t r = id[i + kPrefetch];
        if (r >= 0 && r < rows) {
          PrefetchWrite(reinterpret_cast<char*>(w + r * d), 4 * d);
          if (kAdagrad) PrefetchWrite(reinterpret_cast<char*>(acc + r * d), 4 * d);
        }
      }
      const int64_t r = id[i];
      if (r < 0 || r >= rows) continue;
      UpdateRow<kAdagrad>(w + r * d, kAdagrad ? acc + r * d : nullptr, g + i * d, d, lr, wd, at);
    }
  });
}

// One shard, fused backward + update: for each unique slot u (ids[u] its row), the gradient
// sum_q gains[q] * act[rows[q]] over the pairs q with uniq[q] == u, in pair order, then the
// update of row ids[u]. Equal to segment_gather_sum -> dedup_sum -> sparse_update when ids is
// ascending and distinct (up to trailing PAD) and the valid pairs (rows[q] in range) come in
// non-decreasing uniq order, as the host preprocessing makes them; otherwise it runs those
// three steps itself.
// For the fused backward: beg[u] and cnt[u], the first valid pair (rows[q] in [0, nr),
// uniq[q] in [0, nu)) of slot u and how many it has; false unless the ids are ascending and
// distinct up to trailing PAD and the valid pairs come in non-decreasing slot order. One
// serial pass (~1 ms for 400k pairs): a chunked parallel version was slower on 2 cores.
bool GroupPairs(const int32_t* id, int64_t nu, const int32_t* prow, int64_t nr,
                const int32_t* puniq, int64_t np, int64_t* beg, int64_t* cnt) {
  for (int64_t u = 1; u < nu; ++u)
    if (id[u] != kPad && id[u] <= id[u - 1]) return false;
  int64_t last = 0;
  for (int64_t q = 0; q < np; ++q) {
    if (prow[q] < 0 || prow[q] >= nr) continue;
    const int64_t u = puniq[q];
    if (u < 0 || u >= nu) continue;
    if (u < last) return false;
    last = u;
    if (cnt[u]++ == 0) beg[u] = q;
  }
  return true;
}

template <bool kAdagrad>
void BackwardUpdate(float* w, float* acc, int64_t rows, int64_t d, const int32_t* id, int64_t nu,
                    const float* act, int64_t nr, const int32_t* prow, const int32_t* puniq,
                    const float* gain, int64_t np, float lr, const UpdateAttrs& at) {
  std::vector<int64_t> beg(nu + 1, 0), cnt(nu, 0);
  const bool ok = GroupPairs(id, nu, prow, nr, puniq, np, beg.data(), cnt.data());
  const float wd = EffectiveWd(lr, at);
  if (!ok) {  // general order: per-slot sums, then dedup by row, then update
    std::vector<float> sums(nu * d, 0.0f);
    for (int64_t q = 0; q < np; ++q) {
      const int64_t r = prow[q], u = puniq[q];
      if (r < 0 || r >= nr || u < 0 || u >= nu) continue;
      for (int64_t k = 0; k < d; ++k) sums[u * d + k] += gain[q] * act[r * d + k];
    }
    std::vector<int64_t> order;
    for (int64_t u = 0; u < nu; ++u) if (id[u] != kPad) order.push_back(u);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    std::vector<float> g(d);
    for (size_t i = 0; i < order.size();) {
      size_t j = i;
      std::fill(g.begin(), g.end(), 0.0f);
      for (; j < order.size() && id[order[j]] == id[order[i]]; ++j)
        for (int64_t k = 0; k < d; ++k) g[k] += sums[order[j] * d + k];
      const int64_t r = id[order[i]];
      if (r >= 0 && r < rows)
        UpdateRow<kAdagrad>(w + r * d, kAdagrad ? acc + r * d : nullptr, g.data(), d, lr, wd, at);
      i = j;
    }
    return;
  }
  const int64_t grain = 1024;
  ParallelFor(NumChunks(nu, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(nu, lo + grain);
    std::vector<float> g(d);
    for (int64_t u = lo; u < hi; ++u) {
      if (u + kPrefetch < hi) {
        int64_t r = id[u + kPrefetch];
        if (r >= 0 && r < rows) {
          PrefetchWrite(reinterpret_cast<char*>(w + r * d), 4 * d);
          if (kAdagrad) PrefetchWrite(reinterpret_cast<char*>(acc + r * d), 4 * d);
        }
      }
      if (u + kPrefetch / 2 < hi) {  // the activation gradients of a coming row (5-8%)
        const int64_t v = u + kPrefetch / 2;
        for (int64_t q = beg[v], left = cnt[v]; left > 0; ++q, --left) {
          const int64_t ar = prow[q];
          if (ar >= 0 && ar < nr) PrefetchRead(reinterpret_cast<const char*>(act + ar * d), 4 * d);
        }
      }
      const int64_t r = id[u];
      if (r < 0 || r >= rows) continue;
      std::fill(g.begin(), g.end(), 0.0f);
      for (int64_t q = beg[u], left = cnt[u]; left > 0; ++q) {
        const int64_t ar = prow[q];
        if (ar < 0 || ar >= nr || puniq[q] != u) continue;
        --left;
        const float gq = gain[q];
        const float* __restrict__ src = act + ar * d;
        for (int64_t k = 0; k < d; ++k) g[k] += gq * src[k];
      }
      UpdateRow<kAdagrad>(w + r * d, kAdagrad ? acc + r * d : nullptr, g.data(), d, lr, wd, at);
    }
  });
}

UpdateAttrs MakeAttrs(float clip_lo, float clip_hi, float wd, int32_t has_wd, int32_t wd_lr,
                      float wmin, float wmax) {
  return UpdateAttrs{clip_lo, clip_hi, wd, wmin, wmax, has_wd != 0, wd_lr != 0};
}

ffi::Error SparseSgd(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> lr, float clip_lo,
                     float clip_hi, float wd, int32_t has_wd, int32_t wd_lr, float wmin,
                     float wmax, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  float* w = out->typed_data();
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  auto td = table.dimensions();
  SparseUpdate<false>(w, nullptr, td.size() ? td[0] : 1, RowWidth(td), ids.typed_data(),
                      ids.element_count(), grads.typed_data(), lr.typed_data()[0],
                      MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax));
  return ffi::Error::Success();
}

ffi::Error SparseAdagrad(ffi::Buffer<ffi::F32> table,
                         ffi::Buffer<ffi::F32> accum, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> lr, float clip_lo,
                         float clip_hi, float wd, int32_t has_wd, int32_t wd_lr, float wmin,
                         float wmax, ffi::Result<ffi::Buffer<ffi::F32>> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> out_acc) {
  float* w = out->typed_data();
  float* a = out_acc->typed_data();
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  if (a != accum.typed_data()) std::memcpy(a, accum.typed_data(), accum.size_bytes());
  auto td = table.dimensions();
  SparseUpdate<true>(w, a, td.size() ? td[0] : 1, RowWidth(td), ids.typed_data(),
                     ids.element_count(), grads.typed_data(), lr.typed_data()[0],
                     MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax));
  return ffi::Error::Success();
}

ffi::Error HugePageCopy(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  const size_t bytes = x.size_bytes();
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(x.untyped_data());
  if (dst == src) return ffi::Error::Success();
  AdviseHuge(dst, bytes);
  const size_t grain = 8u << 20;
  ParallelFor(static_cast<int64_t>((bytes + grain - 1) / grain), [&](int64_t c) {
    size_t lo = static_cast<size_t>(c) * grain, hi = std::min(bytes, lo + grain);
    std::memcpy(dst + lo, src + lo, hi - lo);
  });
  return ffi::Error::Success();
}

// `out` filled with the one-element `value`, on transparent huge pages: a new table
// shard or optimizer slot made on the device, without a host copy to move there.
ffi::Error HugePageFill(ffi::AnyBuffer value, ffi::Result<ffi::AnyBuffer> out) {
  const size_t bytes = out->size_bytes(), w = value.size_bytes();
  char* dst = static_cast<char*>(out->untyped_data());
  if (bytes == 0 || w == 0) return ffi::Error::Success();
  AdviseHuge(dst, bytes);
  const size_t tile = std::max<size_t>(1, (64u << 10) / w) * w;
  std::vector<char> pattern(tile);
  for (size_t o = 0; o < tile; o += w) std::memcpy(pattern.data() + o, value.untyped_data(), w);
  const size_t grain = (size_t{8} << 20) / tile * tile;
  ParallelFor(static_cast<int64_t>((bytes + grain - 1) / grain), [&](int64_t c) {
    size_t lo = static_cast<size_t>(c) * grain, hi = std::min(bytes, lo + grain);
    for (size_t o = lo; o < hi; o += tile) std::memcpy(dst + o, pattern.data(), std::min(tile, hi - o));
  });
  return ffi::Error::Success();
}

ffi::Error BackwardAdagrad(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accum,
                           ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                           ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                           ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr, float clip_lo,
                           float clip_hi, float wd, int32_t has_wd, int32_t wd_lr, float wmin,
                           float wmax, ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> out_acc) {
  float* w = out->typed_data();
  float* a = out_acc->typed_data();
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  if (a != accum.typed_data()) std::memcpy(a, accum.typed_data(), accum.size_bytes());
  auto td = table.dimensions();
  auto ad = act.dimensions();
  BackwardUpdate<true>(w, a, td.size() ? td[0] : 1, RowWidth(td), ids.typed_data(),
                       ids.element_count(), act.typed_data(), ad.size() ? ad[0] : 1,
                       prow.typed_data(), puniq.typed_data(), gains.typed_data(),
                       prow.element_count(), lr.typed_data()[0],
                       MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax));
  return ffi::Error::Success();
}

ffi::Error BackwardSgd(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::F32> act, ffi::Buffer<ffi::S32> prow,
                       ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                       ffi::Buffer<ffi::F32> lr, float clip_lo, float clip_hi, float wd,
                       int32_t has_wd, int32_t wd_lr, float wmin, float wmax,
                       ffi::Result<ffi::Buffer<ffi::F32>> out) {
  float* w = out->typed_data();
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  auto td = table.dimensions();
  auto ad = act.dimensions();
  BackwardUpdate<false>(w, nullptr, td.size() ? td[0] : 1, RowWidth(td), ids.typed_data(),
                        ids.element_count(), act.typed_data(), ad.size() ? ad[0] : 1,
                        prow.typed_data(), puniq.typed_data(), gains.typed_data(),
                        prow.element_count(), lr.typed_data()[0],
                        MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmScatterRows, ScatterRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSegmentGatherSum, SegmentGatherSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSegmentGatherSumMapped, SegmentGatherSumMapped,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#define EM_UPDATE_ATTRS                 \
  .Attr<float>("clip_lo")               \
      .Attr<float>("clip_hi")           \
      .Attr<float>("wd")                \
      .Attr<int32_t>("has_wd")          \
      .Attr<int32_t>("wd_lr")           \
      .Attr<float>("wmin")              \
      .Attr<float>("wmax")
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSparseSgd, SparseSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSparseAdagrad, SparseAdagrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardSgd, BackwardSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardAdagrad, BackwardAdagrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmDedupSum, DedupSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmHugePageCopy, HugePageCopy,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmHugePageFill, HugePageFill,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
"""

_TARGETS = {
    "embedmesh_gather_rows": "EmGatherRows",
    "embedmesh_scatter_rows": "EmScatterRows",
    "embedmesh_segment_gather_sum": "EmSegmentGatherSum",
    "embedmesh_segment_gather_sum_mapped": "EmSegmentGatherSumMapped",
    "embedmesh_dedup_sum": "EmDedupSum",
    "embedmesh_sparse_sgd": "EmSparseSgd",
    "embedmesh_sparse_adagrad": "EmSparseAdagrad",
    "embedmesh_backward_sgd": "EmBackwardSgd",
    "embedmesh_backward_adagrad": "EmBackwardAdagrad",
    "embedmesh_huge_page_copy": "EmHugePageCopy",
    "embedmesh_huge_page_fill": "EmHugePageFill",
}
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
# Tuned for the CPU that builds (and runs) them: the library is cached per CPU signature.
# No FMA contraction, so the float32 arithmetic matches the pure-JAX path. No errno from
# sqrt: with it, GCC cannot vectorise the optimizer rows (150 -> 19 ns per 64-wide Adagrad
# row here; same results, sqrt stays IEEE-exact).
_NATIVE = ("-march=native",)


def _cpu_signature() -> str:
    """What `-march=native` depends on: a cached build must not move to another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform
        return platform.machine() + platform.processor()

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "why": str, "lib": CDLL, "path": str


def _compiler() -> Optional[str]:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cache_dir() -> str:
    d = os.environ.get("EMBEDMESH_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "embedmesh")
    return d


def _build() -> tuple[Optional[str], str]:
    """Path of the built library (building it if needed), or (None, why not)."""
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    import jaxlib
    key = hashlib.sha256("\0".join([_SOURCE, cxx, *version, jaxlib.__version__, *_FLAGS,
                                    *_NATIVE, _cpu_signature(),
                                    sys.platform]).encode()).hexdigest()[:20]
    name = f"embedmesh_cpu_ops_{key}.so"
    why = "no writable cache directory"
    for d in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"embedmesh-{os.getuid()}")):
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path, ""
        try:
            os.makedirs(d, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src = os.path.join(tmp, "cpu_ops.cc")
                with open(src, "w") as f:
                    f.write(_SOURCE)
                out = os.path.join(tmp, name)
                for native in (_NATIVE, ()):  # a compiler without -march=native: plain
                    r = subprocess.run([cxx, *_FLAGS, *native, "-I", jax.ffi.include_dir(), src,
                                        "-o", out], capture_output=True, text=True, timeout=600)
                    if r.returncode == 0:
                        break
                if r.returncode != 0:
                    return None, f"compiling the CPU kernels failed:\n{r.stderr[-2000:]}"
                os.replace(out, path)  # atomic: concurrent builders are safe
            return path, ""
        except OSError as e:  # unwritable cache dir: try the next one
            why = f"cannot write {d}: {e}"
    return None, why


def _load() -> bool:
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        _state["ok"] = False
        flag = os.environ.get("EMBEDMESH_CPU_KERNELS", "").lower()
        if flag in ("0", "false", "no", "off"):
            _state["why"] = "disabled by EMBEDMESH_CPU_KERNELS"
            return False
        if flag not in ("1", "true", "yes", "on") and jax.default_backend() != "cpu":
            _state["why"] = (f"the default backend is {jax.default_backend()} "
                             f"(EMBEDMESH_CPU_KERNELS=1 builds them anyway)")
            return False
        try:
            path, why = _build()
            if path is None:
                _state["why"] = why
                warnings.warn(f"embedmesh: CPU kernels unavailable, using pure JAX ({why})",
                              RuntimeWarning, stacklevel=3)
                return False
            lib = ctypes.CDLL(path)
            for target, symbol in _TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
        except Exception as e:  # noqa: BLE001 - any failure means: fall back
            _state["why"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"embedmesh: CPU kernels unavailable, using pure JAX "
                          f"({_state['why']})", RuntimeWarning, stacklevel=3)
            return False
        _state.update(ok=True, lib=lib, path=path, why="")
        return True


def available() -> bool:
    """Whether the CPU kernels are built and registered (builds them on first call)."""
    return _load()


def unavailable_reason() -> str:
    _load()
    return _state.get("why", "")


def _on_cpu(kernel, fallback, *args):
    """`kernel(*args)` when lowering for CPU with the kernels available, else `fallback`."""
    if not available():
        return fallback(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)


# ---------------------------------------------------------------------------
# Pure-JAX references (also the fallbacks)


def _gather_rows_jax(table, ids):
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def _scatter_rows_jax(table, ids, rows):
    return table.at[ids].set(rows.astype(table.dtype), mode="drop")


def _segment_gather_sum_jax(src, src_idx, gains, dst_idx, num_segments):
    g = jnp.take(src, src_idx, axis=0, mode="fill", fill_value=0) * gains[:, None]
    return jax.ops.segment_sum(g, dst_idx, num_segments=num_segments)


def _sort_dedup_sum_jax(ids, grads):
    flat = ids.reshape(-1)
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    segment = jnp.cumsum(starts.astype(jnp.int32)) - 1
    uniq = jnp.full((m,), PAD_ID, jnp.int32).at[segment].set(sorted_ids)
    sums = jax.ops.segment_sum(grads[order], segment, num_segments=m)
    # ids equal to PAD_ID sort last and form (at most) one segment: zero its sum.
    sums = jnp.where((uniq == PAD_ID)[:, None], 0, sums)
    return uniq, sums


def _ascending_distinct(flat):
    """Whether `flat` is strictly ascending up to trailing PAD_IDs."""
    return jnp.all((flat[1:] > flat[:-1]) | (flat[1:] == PAD_ID))


def _dedup_sum_jax(ids, grads):
    if ids.shape[0] != 1:
        return _sort_dedup_sum_jax(ids, grads)
    # One list, as the host preprocessing makes it (ascending, distinct): skip the sort
    # when a cheap check confirms it.
    flat = ids.reshape(-1)

    def as_is(flat, grads):
        return flat, jnp.where((flat == PAD_ID)[:, None], 0, grads)

    return jax.lax.cond(_ascending_distinct(flat), as_is, _sort_dedup_sum_jax, flat, grads)


# ---------------------------------------------------------------------------
# Public ops


def gather_rows(table, ids):
    """`table[ids]` for int32 `ids` of shape [n]; zero rows for ids outside the table."""
    ids = ids.astype(jnp.int32)

    def kernel(table, ids):
        out = jax.ShapeDtypeStruct((ids.shape[0],) + table.shape[1:], table.dtype)
        return jax.ffi.ffi_call("embedmesh_gather_rows", out)(table, ids)

    return _on_cpu(kernel, _gather_rows_jax, table, ids)


def scatter_rows(table, ids, rows):
    """`table.at[ids].set(rows, mode="drop")` in place; `ids` [n] distinct (PAD_ID allowed)."""
    ids = ids.astype(jnp.int32)
    rows = rows.astype(table.dtype)

    def kernel(table, ids, rows):
        out = jax.ShapeDtypeStruct(table.shape, table.dtype)
        return jax.ffi.ffi_call("embedmesh_scatter_rows", out,
                                input_output_aliases={0: 0})(table, ids, rows)

    return _on_cpu(kernel, _scatter_rows_jax, table, ids, rows)


def segment_gather_sum(src, src_idx, gains, dst_idx, num_segments: int, *, src_map=None):
    """`segment_sum(src[rows] * gains[:, None], dst_idx, num_segments)` in float32.

    src [M, D]; src_idx, gains, dst_idx [P]; `rows = src_idx`, or
    `src_map[src_idx]` with a `src_map` (then `src` can be a whole table and
    `src_map` the ids to read: no intermediate [len(src_map), D] buffer). Pairs
    whose index (or mapped row) is out of range, or whose `dst_idx` is outside
    `[0, num_segments)`, contribute nothing. Each segment sums in pair order.
    """
    src_idx = src_idx.astype(jnp.int32)
    gains = gains.astype(jnp.float32)
    dst_idx = dst_idx.astype(jnp.int32)
    out = jax.ShapeDtypeStruct((num_segments,) + src.shape[1:], jnp.float32)
    if src_map is None:
        src = src.astype(jnp.float32)

        def kernel(src, src_idx, gains, dst_idx):
            return jax.ffi.ffi_call("embedmesh_segment_gather_sum", out)(src, src_idx, gains,
                                                                         dst_idx)

        def fallback(src, src_idx, gains, dst_idx):
            return _segment_gather_sum_jax(src, src_idx, gains, dst_idx, num_segments)

        return _on_cpu(kernel, fallback, src, src_idx, gains, dst_idx)

    src_map = src_map.astype(jnp.int32)

    def kernel_mapped(src, src_map, src_idx, gains, dst_idx):
        return jax.ffi.ffi_call("embedmesh_segment_gather_sum_mapped", out)(
            src, src_map, src_idx, gains, dst_idx)

    def fallback_mapped(src, src_map, src_idx, gains, dst_idx):
        rows = _gather_rows_jax(src, src_map).astype(jnp.float32)
        return _segment_gather_sum_jax(rows, src_idx, gains, dst_idx, num_segments)

    if src.dtype != jnp.float32:  # the kernel reads float32 tables only
        return fallback_mapped(src, src_map, src_idx, gains, dst_idx)
    return _on_cpu(kernel_mapped, fallback_mapped, src, src_map, src_idx, gains, dst_idx)


def dedup_sum(ids, grads):
    """(distinct ids ascending, PAD_ID padded; their summed grads) for ids [N, U], grads [N*U, D].

    Ids equal to PAD_ID are dropped. Each row of `ids` ascending makes it a
    linear merge (in place when N == 1: donate-free, `grads` is dead after);
    any order is correct.
    """
    ids = ids.astype(jnp.int32)
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids.reshape(ids.shape[0], -1)
    grads = grads.astype(jnp.float32)

    def kernel(ids, grads):
        m = ids.size
        outs = (jax.ShapeDtypeStruct((m,), jnp.int32),
                jax.ShapeDtypeStruct((m,) + grads.shape[1:], jnp.float32))
        return tuple(jax.ffi.ffi_call("embedmesh_dedup_sum", outs,
                                      input_output_aliases={1: 1})(ids, grads))

    return _on_cpu(kernel, _dedup_sum_jax, ids, grads)


def _generic_update(optimizer, table, slots, ids, grads, step):
    """Gather the rows and slots, `optimizer.update_rows`, scatter them back (any optimizer)."""
    rows = gather_rows(table, ids)
    old = {k: gather_rows(v, ids) for k, v in slots.items()}
    new_rows, new_slots = optimizer.update_rows(rows, old, grads, step)
    return (scatter_rows(table, ids, new_rows),
            {k: scatter_rows(v, ids, new_slots[k]) for k, v in slots.items()})


def _fused_kind(optimizer, table, slots) -> Optional[str]:
    from embedmesh.optimizers import SGD, Adagrad
    if table.dtype != jnp.float32 or any(v.dtype != jnp.float32 for v in slots.values()):
        return None
    if type(optimizer) is Adagrad and set(slots) == {"accumulators"}:
        return "adagrad"
    if type(optimizer) is SGD and not slots:
        return "sgd"
    return None


def _update_attrs(optimizer, step):
    lr = optimizer.learning_rate_at(step).reshape(1)
    lo, hi = optimizer.clipvalue if optimizer.clipvalue is not None else (None, None)
    inf = float("inf")
    attrs = dict(
        clip_lo=np.float32(-inf if lo is None else lo),
        clip_hi=np.float32(inf if hi is None else hi),
        wd=np.float32(optimizer.weight_decay_factor or 0.0),
        has_wd=np.int32(optimizer.weight_decay_factor is not None),
        wd_lr=np.int32(bool(optimizer.multiply_weight_decay_factor_by_learning_rate)),
        wmin=np.float32(-inf if optimizer.clip_weight_min is None else optimizer.clip_weight_min),
        wmax=np.float32(inf if optimizer.clip_weight_max is None else optimizer.clip_weight_max))
    return lr, attrs


def fusable(optimizer, table, slots: dict) -> bool:
    """Whether `sparse_update` / `backward_update` run as one fused CPU kernel here."""
    return available() and _fused_kind(optimizer, table, slots) is not None


def sparse_update(optimizer, table, slots: dict, ids, grads, step):
    """Apply `optimizer` to the rows `ids` (distinct; PAD_ID skipped) of `table` and `slots`.

    Returns `(new table, new slots)`, updated in place when the caller donates
    them. SGD and Adagrad on float32 run as one fused CPU kernel (the same
    float32 arithmetic as `Optimizer.update_rows`, in the same order); other
    optimizers gather the rows, call `update_rows` and scatter them back.
    """
    ids = ids.astype(jnp.int32)
    kind = _fused_kind(optimizer, table, slots) if available() else None
    if kind is None:
        return _generic_update(optimizer, table, slots, ids, grads, step)
    lr, attrs = _update_attrs(optimizer, step)
    grads = grads.astype(jnp.float32)
    names = sorted(slots)

    def kernel(table, slot_list, ids, grads, lr):
        if kind == "sgd":
            out = jax.ffi.ffi_call("embedmesh_sparse_sgd",
                                   jax.ShapeDtypeStruct(table.shape, table.dtype),
                                   input_output_aliases={0: 0})(table, ids, grads, lr, **attrs)
            return out, []
        outs = (jax.ShapeDtypeStruct(table.shape, table.dtype),
                jax.ShapeDtypeStruct(table.shape, table.dtype))
        t, a = jax.ffi.ffi_call("embedmesh_sparse_adagrad", outs,
                                input_output_aliases={0: 0, 1: 1})(table, slot_list[0], ids,
                                                                    grads, lr, **attrs)
        return t, [a]

    def fallback(table, slot_list, ids, grads, lr):
        t, s = _generic_update(optimizer, table, dict(zip(names, slot_list)), ids, grads, step)
        return t, [s[k] for k in names]

    t, s = jax.lax.platform_dependent(table, [slots[k] for k in names], ids, grads, lr,
                                      cpu=kernel, default=fallback)
    return t, dict(zip(names, s))


def backward_update(optimizer, table, slots: dict, ids, act_grads, pair_rows, pair_unique,
                    pair_gains, step):
    """One shard's whole backward + update: `sparse_update` of the rows `ids` [U] with
    `dedup_sum(ids, segment_gather_sum(act_grads, pair_rows, pair_gains, pair_unique, U))`.

    Fused in one pass over the unique rows when `fusable(...)` (no [U, D]
    gradient buffer); the same sums in the same order, so the same result.
    """
    ids = ids.reshape(-1).astype(jnp.int32)
    u = ids.shape[0]
    pair_rows = pair_rows.reshape(-1).astype(jnp.int32)
    pair_unique = pair_unique.reshape(-1).astype(jnp.int32)
    pair_gains = pair_gains.reshape(-1).astype(jnp.float32)
    act_grads = act_grads.astype(jnp.float32)
    names = sorted(slots)

    def fallback(table, slot_list, ids, act_grads, pair_rows, pair_unique, pair_gains):
        per_unique = segment_gather_sum(act_grads, pair_rows, pair_gains, pair_unique, u)
        uniq, g = dedup_sum(ids.reshape(1, -1), per_unique)
        t, s = sparse_update(optimizer, table, dict(zip(names, slot_list)), uniq, g, step)
        return t, [s[k] for k in names]

    kind = _fused_kind(optimizer, table, slots) if available() else None
    args = (table, [slots[k] for k in names], ids, act_grads, pair_rows, pair_unique, pair_gains)
    if kind is None:
        t, s = fallback(*args)
        return t, dict(zip(names, s))
    lr, attrs = _update_attrs(optimizer, step)

    def kernel(table, slot_list, ids, act_grads, pair_rows, pair_unique, pair_gains):
        shape = jax.ShapeDtypeStruct(table.shape, table.dtype)
        if kind == "sgd":
            t = jax.ffi.ffi_call("embedmesh_backward_sgd", shape, input_output_aliases={0: 0})(
                table, ids, act_grads, pair_rows, pair_unique, pair_gains, lr, **attrs)
            return t, []
        t, a = jax.ffi.ffi_call("embedmesh_backward_adagrad", (shape, shape),
                                input_output_aliases={0: 0, 1: 1})(
            table, slot_list[0], ids, act_grads, pair_rows, pair_unique, pair_gains, lr,
            **attrs)
        return t, [a]

    t, s = jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)
    return t, dict(zip(names, s))


def huge_page_copy(x):
    """A copy of `x` in a buffer advised to use transparent huge pages (CPU); `x` elsewhere."""
    def kernel(x):
        return jax.ffi.ffi_call("embedmesh_huge_page_copy",
                                jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    return _on_cpu(kernel, lambda x: x, x)


_HUGE_MIN_BYTES = 64 << 20


def full(shape, value, dtype, device, min_bytes: int = _HUGE_MIN_BYTES):
    """`jnp.full(shape, value, dtype)` made on `device`; on transparent huge pages
    when it is a CPU device, the kernels are available and it holds `min_bytes`."""
    shape = tuple(int(x) for x in shape)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    huge = device.platform == "cpu" and nbytes >= min_bytes and available()
    value = jax.device_put(np.asarray(value, dtype), device)
    return _full_fn(shape, np.dtype(dtype).name, device, huge)(value)


@functools.lru_cache(maxsize=64)
def _full_fn(shape, dtype, device, huge):
    sharding = jax.sharding.SingleDeviceSharding(device)
    if not huge:
        return jax.jit(lambda v: jnp.full(shape, v, dtype), out_shardings=sharding)
    return jax.jit(lambda v: jax.ffi.ffi_call("embedmesh_huge_page_fill",
                                              jax.ShapeDtypeStruct(shape, dtype))(v),
                   out_shardings=sharding)
