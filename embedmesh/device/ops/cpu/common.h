// Shared by embedmesh's CPU kernels (XLA FFI): constants, row geometry, prefetch, the
// thread fan-out and huge-page advice. The kernels live in the .cc files next to this
// header, one concern each; build.py compiles them into one library, kernels.py and
// memory.py call them.
#pragma once

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
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "storage.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace embedmesh {

// The library's FFI handlers under their XLA target names, in definition order: the
// Python side registers exactly these (EmbedmeshHandlerCount / Name / Address, common.cc),
// so the list of targets, and of the optimizers the update kernels fuse, is kept here
// alone. `EM_HANDLER(target, Symbol, fn[, binding])` defines a handler and lists it
// (`EM_LIST_HANDLER(target, Symbol)` lists one XLA_FFI_DEFINE_HANDLER_SYMBOL defined).
inline std::vector<std::pair<std::string, void*>>& Handlers() {
  static std::vector<std::pair<std::string, void*>> handlers;
  return handlers;
}

struct ListHandler {
  ListHandler(std::string target, void* handler) {
    Handlers().emplace_back(std::move(target), handler);
  }
};

#define EM_LIST_HANDLER(target, symbol) \
  static const embedmesh::ListHandler em_listed_##symbol{target, reinterpret_cast<void*>(&symbol)};

// The FFI handler `symbol` calling `fn`, bound from fn's own signature (XLA FFI's automatic
// binding) or by the explicit binding after it, listed under `target`.
#define EM_HANDLER(target, symbol, ...)              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, __VA_ARGS__); \
  EM_LIST_HANDLER(target, symbol)

// Reads named attributes from a call's attribute dictionary, remembering the first failure
// (the fused updates' hyperparameters, the transports' call sites: transport.h).
class AttrReader {
 public:
  explicit AttrReader(const ffi::Dictionary& d) : d_(d) {}
  float F(const char* name) { return Get<float>(name, 0.0f); }
  bool B(const char* name) { return Get<int32_t>(name, 0) != 0; }
  int64_t I(const char* name) { return Get<int64_t>(name, 0); }
  std::string_view S(const char* name) { return Get<std::string_view>(name, {}); }
  bool Has(const char* name) const { return d_.contains(name); }
  const std::string& error() const { return error_; }

 private:
  template <typename V>
  V Get(const char* name, V fallback) {
    auto v = d_.get<V>(name);
    if (v.has_error()) {
      if (error_.empty()) error_ = std::string("attribute ") + name + ": " + v.error().message();
      return fallback;
    }
    return *v;
  }
  const ffi::Dictionary& d_;
  std::string error_;
};

// Padding id of unique-id lists: int32 max, equal to embedmesh._runtime.PAD_ID
// (tests/device/test_ops.py checks it through EmbedmeshPadId).
constexpr int32_t kPad = 2147483647;
constexpr int64_t kPrefetch = 16;  // rows ahead

inline int64_t RowElems(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  int64_t n = 1;
  for (size_t i = 1; i < d.size(); ++i) n *= d[i];
  return n;
}

inline int64_t Rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return d.size() ? d[0] : 1;
}

template <typename Dims>
int64_t RowWidth(const Dims& dims) {
  int64_t d = 1;
  for (size_t i = 1; i < dims.size(); ++i) d *= dims[i];
  return d;
}

// Software prefetch of one cache line that the optimiser keeps. GCC 12 at -O2 and above
// deletes a loop of __builtin_prefetch whose trip count is not a constant (a loop "without
// side effects"): the loops below compiled to no prefetch instruction at all (objdump)
// until they used asm volatile, as serving/cpu/serving.cc does. Never faults.
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %a0" : : "p"(p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// The same for a line about to be written: prefetchw (the line arrives exclusive, so the
// store needs no second request) where the target has it, else a read prefetch.
inline void PrefetchLineForWrite(void* p) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__PRFCHW__)
  asm volatile("prefetchw %0" : : "m"(*static_cast<char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pstl1keep, %a0" : : "p"(p));
#else
  PrefetchLine(p);
#endif
}

inline void PrefetchRead(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) PrefetchLine(p + o);
}

inline void PrefetchWrite(char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) PrefetchLineForWrite(p + o);
}

// Worker threads for one call: the count the Python side set (EMBEDMESH_CPU_THREADS,
// read by embedmesh._runtime), else the CPUs this process may use. In common.cc.
int64_t NumWorkers();

// Runs call(ctx, chunk) for chunk in [0, n) on the calling thread, joined by up to
// `helpers` idle threads of the library's persistent pool, and returns when every chunk is
// done. The caller works on its own job until no chunk is left, then waits only for the
// chunks that pool threads took; it never runs another caller's chunks, and a pool thread
// runs one chunk at a time, so a ParallelFor inside a chunk (its caller then a pool thread)
// or ParallelFor from several threads at once cannot deadlock: every job can finish on its
// caller alone. In common.cc.
void RunChunks(int64_t n, int64_t helpers, void (*call)(const void*, int64_t), const void* ctx);

// A non-owning reference to a callable of signature R(Args...): lets a function that
// takes a caller's lambda be one non-template function, compiled once, where a template
// would be compiled again for every caller (the transports' rounds: one per op, rule and
// storage type). The callable must outlive the call it is passed to.
template <class Sig>
class FnRef;
template <class R, class... Args>
class FnRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FnRef>>>
  FnRef(const F& f)  // NOLINT: converts implicitly, like a function pointer
      : obj_(&f), call_([](const void* o, Args... a) -> R {
          return (*static_cast<const F*>(o))(std::forward<Args>(a)...);
        }) {}
  R operator()(Args... a) const { return call_(obj_, std::forward<Args>(a)...); }

 private:
  const void* obj_;
  R (*call_)(const void*, Args...);
};

// Runs f(chunk) for chunk in [0, n) on the calling thread plus idle threads of the
// library's own pool (RunChunks), all done before returning. (Not XLA's intra-op pool:
// with several devices per process, its threads may sit in a collective, and work queued
// behind them could wait for the very execution that queued it. Not threads started per
// call either: at ~60 us a thread in a VM, a step of 8 tables' ops paid ~3 ms for them.)
template <typename F>
void ParallelFor(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t helpers = std::min<int64_t>(NumWorkers() - 1, n - 1);
  if (helpers <= 0) {
    for (int64_t c = 0; c < n; ++c) f(c);
    return;
  }
  RunChunks(
      n, helpers, [](const void* fp, int64_t c) { (*static_cast<const F*>(fp))(c); }, &f);
}

// Chunks of about `grain` items, at least one per thread when there is work.
inline int64_t NumChunks(int64_t items, int64_t grain) {
  return items <= 0 ? 0 : (items + grain - 1) / grain;
}

inline void AdviseHuge(void* p, size_t bytes) {
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
inline void PrepareOutput(void* p, size_t bytes) {
  if (bytes >= (size_t{4} << 20)) AdviseHuge(p, bytes);
}

// One pair of SegmentPairSums: its destination row (outside [0, segs): none), its gain and
// its source row of a storage type E (nullptr: none).
template <typename E>
struct SumPair {
  int64_t dst;
  float gain;
  const E* src;
};

// out[p.dst] += p.gain * p.src over the pairs p = pair_of(q, lo, hi), q in [0, np) (a
// SumPair<E>, E a storage type of storage.h, read as float32; pair_of may leave src null
// for a dst outside [lo, hi), the destinations the calling thread sums). Threads own
// disjoint destination ranges, so each destination sums in pair order, in float32. Each
// pair is made once, kPrefetch pairs ahead of its sum (its rows prefetched then), and kept
// in a ring until then: a pair_of that decodes a packed message (pooled.cc) decodes each
// pair once, with no decoded copy of the message.
template <typename PairOf>
void SegmentPairSums(float* o, int64_t d, int64_t segs, int64_t np, const PairOf& pair_of) {
  using Pair = decltype(pair_of(int64_t{0}, int64_t{0}, int64_t{0}));
  using E = std::remove_const_t<std::remove_pointer_t<decltype(Pair::src)>>;
  PrepareOutput(o, sizeof(float) * segs * d);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(NumWorkers(), 16));
  const int64_t span = (segs + parts - 1) / parts;
  ParallelFor(parts, [&](int64_t part) {
    const int64_t lo = part * span, hi = std::min(segs, lo + span);
    if (lo >= hi) return;
    std::memset(o + lo * d, 0, sizeof(float) * (hi - lo) * d);
    constexpr int64_t kRing = 2 * kPrefetch;  // a power of two
    Pair ring[kRing];
    for (int64_t q = 0; q < std::min(np, kPrefetch); ++q) ring[q] = pair_of(q, lo, hi);
    for (int64_t q = 0; q < np; ++q) {
      if (q + kPrefetch < np) {
        const Pair f = pair_of(q + kPrefetch, lo, hi);
        ring[(q + kPrefetch) & (kRing - 1)] = f;
        if (f.dst >= lo && f.dst < hi) {
          if (f.src != nullptr) PrefetchRead(reinterpret_cast<const char*>(f.src), sizeof(E) * d);
          PrefetchWrite(reinterpret_cast<char*>(o + f.dst * d), 4 * d);  // 15% less CPU
        }
      }
      const Pair e = ring[q & (kRing - 1)];
      if (e.dst < lo || e.dst >= hi || e.src == nullptr) continue;
      const E* __restrict__ srow = e.src;
      const float gq = e.gain;
      float* __restrict__ orow = o + e.dst * d;
      for (int64_t k = 0; k < d; ++k) orow[k] += gq * Load(srow[k]);
    }
  });
}

// out[dst[q]] += gains[q] * row_of(q) over the pairs q in [0, np), `row_of(q)` a row of
// width d of a storage type E (storage.h: float32, bfloat16, float16; read as float32) or
// nullptr (the pair is skipped; so is a dst outside [0, segs)): SegmentPairSums. The
// combine and backward sums of segment_sum.cc, the lookups of exchange.cc.
template <typename RowOf>
void SegmentRowSums(float* o, int64_t d, int64_t segs, int64_t np, const int32_t* dst,
                    const float* gains, const RowOf& row_of) {
  using E = std::remove_const_t<std::remove_pointer_t<decltype(row_of(int64_t{0}))>>;
  SegmentPairSums(o, d, segs, np, [&](int64_t q, int64_t lo, int64_t hi) {
    const int64_t t = dst[q];
    return SumPair<E>{t, gains[q], t >= lo && t < hi ? row_of(q) : nullptr};
  });
}

}  // namespace embedmesh
