// Serving kernels of embedmesh (see serving.h): the bag combine (gather rows, scale,
// sum per bag, normalise, TensorFlow's pruning and the id range check in one pass),
// a checked row gather, and the offsets of sparse inputs.
//
// The bag kernels walk the entries one bag at a time (`walk`: range check, pruning, the
// denominators, software prefetch of the rows some entries ahead, in as few instructions
// an entry as the checks allow). Rows of one register block (AVX-512: up to 16 x 16
// floats plus a masked tail, so any dim up to 271) are summed in the same walk, in
// registers (`bag_fused`); wider rows list the kept (row, weight) pairs in a per-thread
// scratch and sum them block by block (`bag`). Each block shape is its own template
// instance (constant trip counts: the accumulators live in registers), chosen once per
// call. Sums are taken in float32, in entry order, without FMA (built with
// -ffp-contract=off): the same values as the numpy fallback.

#include "serving.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace embedmesh_serving {

thread_local int64_t t_output_bytes = 0;  // see serving.h

namespace {

// kMaxNV: the vectors of one column block of the two-pass kernel (`bag`); kMaxFusedNV:
// the widest row, in vectors, the one-pass kernel (`bag_fused`) sums in registers. With
// AVX2 the one-pass kernel takes 16 (all 16 ymm as sums; the unweighted adds read their
// rows as memory operands): rows of 72-128 floats in one pass, not two passes of 8-vector
// blocks over the same entries, 1.32-1.40x at dims 96-128 (benchmarks/serving/
// serving_kernel_ab.py, AMD EPYC, 2026-12-08); 16-vector blocks for longer rows measured
// 0.96x, so the two-pass blocks stay at 8.
#if defined(__AVX512F__)
constexpr int kV = 16;
constexpr int kMaxNV = 16;  // 16 accumulators + tail + weight + loads of 32 zmm
constexpr int kMaxFusedNV = 16;
#elif defined(__AVX__)
constexpr int kV = 8;
#ifndef EM_AVX_MAX_FUSED_NV
#define EM_AVX_MAX_FUSED_NV 16  // A/B builds: 8, the one-pass width before
#endif
constexpr int kMaxNV = 8;  // of 16 ymm
constexpr int kMaxFusedNV = EM_AVX_MAX_FUSED_NV;
#else
constexpr int kV = 4;
constexpr int kMaxNV = 8;  // of 16 xmm (SSE2, NEON: 32)
constexpr int kMaxFusedNV = 8;
#endif

typedef float vf __attribute__((vector_size(kV * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float x) { return vf{} + x; }

// The first `tail` (< kV) floats at p, the other lanes zero; never reads past them.
inline vf load_tail(const float* p, int tail) {
#if defined(__AVX512F__)
  return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << tail) - 1u), p);
#elif defined(__AVX__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return (vf)_mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane));
#else
  vf v = vf{};
  std::memcpy(&v, p, sizeof(float) * tail);
  return v;
#endif
}

inline void store_tail(float* p, vf v, int tail) {
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << tail) - 1u), (__m512)v);
#elif defined(__AVX__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane), (__m256)v);
#else
  std::memcpy(p, &v, sizeof(float) * tail);
#endif
}

// A software prefetch that the optimiser keeps: GCC 12 at -O2 and above deletes a loop of
// __builtin_prefetch whose trip count is not a constant (a loop "without side effects"),
// which silently dropped every prefetch of this file. Never faults.
inline void prefetch(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %a0" : : "p"(p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// EM_PF_ALL: float32 rows of more than 32 floats get every line prefetched (1), or their
// first line only (0: the out-of-order core issues the rest itself). Measured per
// instruction set: 0 on the AVX-512 (Intel) instances; on the AVX2 (AMD EPYC) one, every
// line ran the one-pass kernel 1.49-1.71x faster at dims 64-128 (serving_kernel_ab.py,
// 2026-12-08); the two-pass one (longer rows) within noise of the first-line rule (dims
// 136-256: 0.95-1.06x, one run each).
#ifndef EM_PF_ALL
#if defined(__AVX512F__)
#define EM_PF_ALL 0
#else
#define EM_PF_ALL 1
#endif
#endif
int64_t g_prefetch = 128;  // cache lines of rows ahead (see entries_ahead)
int g_fused = 1;
int64_t g_row_lines = 0;  // cache lines prefetched per row (0: all of them)          // one-pass kernel where a row fits one register block

struct Entry {
  const float* row;
  float w;
};

struct Scratch {
  std::vector<Entry> entries;
};

Entry* scratch(int64_t n) {
  thread_local Scratch s;
  if (static_cast<int64_t>(s.entries.size()) < n) s.entries.resize(static_cast<size_t>(n) * 2);
  return s.entries.data();
}

// Whether every row of an array at `p`, `stride_bytes` apart, starts on a 64-byte line.
inline bool rows_on_lines(const void* p, int64_t stride_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 64 == 0 && stride_bytes % 64 == 0;
}

// A store that bypasses the caches (p aligned to the vector): no read of the line first.
inline void store_stream(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
  _mm256_stream_ps(p, (__m256)v);
#elif defined(__SSE2__)
  _mm_stream_ps(p, (__m128)v);
#else
  store(p, v);
#endif
}

// Order a call's streaming stores before whatever follows it (another thread reading
// the output once the runner's request is done).
inline void fence_streams() {
#if defined(__SSE2__) || defined(__AVX__)
  _mm_sfence();
#endif
}

// Whether a bag kernel writes its output rows with streaming stores. A bag's row is
// written once, after its sum; a plain store first reads the line in (the output
// buffers are cold: the walk has just streamed megabytes of rows through the caches),
// and those reads compete with the walk's own row misses. Streaming stores skip them:
// kernel alone against torch's, 8 x 1M tables, batch 4096, thread clock, same process
// (benchmarks/serving/serving_kernel_ab.py, 2026-12-03, two builds of the streamed variant
// against one of plain stores, 31 rounds): dim 64 1.12 -> 1.22x, dim 32 1.18 ->
// 1.20-1.29x; 15 rounds: dim 128 1.15 -> 1.17x, dim 16 1.52 -> 1.46x (within its
// 1.20-1.95 spread). Small outputs stay cached for whoever reads them
// next: only outputs of at least kStreamOutputBytes (the runner's whole task, else the
// call's), rows on 64-byte lines.
constexpr int64_t kStreamOutputBytes = 256 << 10;
#ifndef EM_STREAM_OUTPUT
#define EM_STREAM_OUTPUT 1  // the default of EmServingSetStreamOutput (A/B builds: 0)
#endif
int g_stream_output = EM_STREAM_OUTPUT;

inline bool stream_rows(const float* out, int64_t out_stride, int64_t rows) {
  const int64_t bytes = t_output_bytes > 0 ? t_output_bytes : rows * out_stride * 4;
  return g_stream_output && bytes >= kStreamOutputBytes && rows_on_lines(out, out_stride * 4);
}

// Store one combined row: out[0 : NV*kV (+ tail)] = acc, divided by d first when
// `divide` (0 where d == 0: an empty or all-pruned bag under mean / sqrtn); `stream`:
// with streaming stores (see stream_rows).
template <int NV, bool Tail>
inline void store_combined(vf* acc, vf tacc, bool divide, float d, int tail, float* o,
                           bool stream) {
  if (divide) {
    if (d == 0.0f) {
      for (int v = 0; v < NV; ++v) acc[v] = vf{};
      tacc = vf{};
    } else {
      const vf dv = splat(d);
      for (int v = 0; v < NV; ++v) acc[v] = acc[v] / dv;
      tacc = tacc / dv;
    }
  }
  if (stream) {
    for (int v = 0; v < NV; ++v) store_stream(o + v * kV, acc[v]);
  } else {
    for (int v = 0; v < NV; ++v) store(o + v * kV, acc[v]);
  }
  if (Tail) store_tail(o + NV * kV, tacc, tail);
}

// acc += w * row[0 : NV*kV] and tacc += w * row[NV*kV : + tail] (no product without
// weights): one entry's row added to a bag's register block.
template <int NV, bool Tail, bool HasW>
inline void accumulate(vf* acc, vf& tacc, const float* p, float w, int tail) {
  if (HasW) {
    const vf wv = splat(w);
    for (int v = 0; v < NV; ++v) acc[v] += wv * load(p + v * kV);
    if (Tail) tacc += wv * load_tail(p + NV * kV, tail);
  } else {
    for (int v = 0; v < NV; ++v) acc[v] += load(p + v * kV);
    if (Tail) tacc += load_tail(p + NV * kV, tail);
  }
}

// One column block of one bag: acc = sum_i w_i * row_i[col0 : col0 + NV*kV (+ tail)],
// then out = acc (div = 0) or acc / d (0 where d == 0).
template <int NV, bool Tail, bool HasW>
void block(const Entry* e, int64_t m, int64_t col0, int tail, int div, float d, float* out,
           bool stream) {
  vf acc[NV > 0 ? NV : 1];
  vf tacc = vf{};
  for (int v = 0; v < NV; ++v) acc[v] = vf{};
  for (int64_t i = 0; i < m; ++i) {
    accumulate<NV, Tail, HasW>(acc, tacc, e[i].row + col0, e[i].w, tail);
  }
  store_combined<NV, Tail>(acc, tacc, div != 0, d, tail, out + col0, stream);
}

using BlockFn = void (*)(const Entry*, int64_t, int64_t, int, int, float, float*, bool);

template <int NV>
struct Table {
  static BlockFn get(int nv, bool tail, bool has_w) {
    if (nv == NV) {
      if (tail) return has_w ? &block<NV, true, true> : &block<NV, true, false>;
      return has_w ? &block<NV, false, true> : &block<NV, false, false>;
    }
    return Table<NV - 1>::get(nv, tail, has_w);
  }
};

template <>
struct Table<-1> {
  static BlockFn get(int, bool, bool) { return nullptr; }
};

// The column blocks of a row of `dim` values: `nfull` blocks of kMaxNV vectors (`full`),
// then the rest (`last`, from column `last_col`, with the masked tail), if any;
// block_for(nv, tail) is the kernel of a block of nv vectors. Fn: the kernels' type (Plan
// below for float rows; serving_quantized.cc's QPlan for decoded ones, `ctx` its rows'
// format).
template <typename Fn>
struct Blocks {
  Fn full = nullptr;
  int64_t nfull = 0;
  Fn last = nullptr;
  int64_t last_col = 0;
  int tail = 0;

  template <typename BlockFor>
  Blocks(int64_t dim, BlockFor block_for) {
    int64_t nvec = dim / kV;
    tail = static_cast<int>(dim % kV);
    nfull = nvec / kMaxNV;
    if (nfull > 0 && nvec % kMaxNV == 0 && tail) --nfull;  // the tail needs one more register
    full = block_for(kMaxNV, false);
    nvec -= nfull * kMaxNV;
    last_col = nfull * kMaxNV * kV;
    if (nvec > 0 || tail) last = block_for(static_cast<int>(nvec), tail != 0);
  }

  template <typename... Ctx>
  void run(const Entry* e, int64_t m, int div, float d, float* out, bool stream,
           const Ctx&... ctx) const {
    for (int64_t b = 0; b < nfull; ++b) full(e, m, b * kMaxNV * kV, 0, div, d, out, stream, ctx...);
    if (last) last(e, m, last_col, tail, div, d, out, stream, ctx...);
  }
};

struct Plan : Blocks<BlockFn> {
  Plan(int64_t dim, bool has_w)
      : Blocks(dim, [=](int nv, bool tail) { return Table<kMaxNV>::get(nv, tail, has_w); }) {}
};

// Prefetch every cache line of row `id` (`lines`: its length in cache lines, plus one
// when rows need not start on a line: numpy's large arrays start 16 bytes past one).
template <typename Id>
inline void prefetch_row(const float* table, uint64_t vocab, int64_t stride, int64_t lines,
                         Id id) {
  if (static_cast<uint64_t>(static_cast<int64_t>(id)) < vocab) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(table + static_cast<int64_t>(id) * stride);
    const char* p = reinterpret_cast<const char*>(a & ~static_cast<uintptr_t>(63));
    for (int64_t l = 0; l < lines; ++l) prefetch(p + 64 * l);
  }
}

// The bag kernels' prefetch: entries ahead whose rows are prefetched. `lines` is the
// row's length in cache lines (see row_lines). Rows of up to 3 lines (dims <= 32 on
// numpy's 16-byte offset rows) are prefetched whole, g_prefetch lines in flight (64
// entries of 1-2 line rows, 42 of 3); longer rows their first line only, g_prefetch / 4
// entries ahead (32): the out-of-order core issues the rest of each row's loads itself,
// and every prefetch instruction spent on them costs it window; where EM_PF_ALL (the
// builds without AVX-512), every line of them too, g_prefetch lines in flight.
// g_row_lines > 0 sets the distance as if rows were that many lines (benchmarks). 0: no
// prefetch.
inline int64_t entries_ahead(int64_t lines) {
  if (g_prefetch <= 0 || lines <= 0) return 0;
  int64_t n;
  if (g_row_lines > 0) {
    n = g_prefetch / (lines < g_row_lines ? lines : g_row_lines);
  } else if (lines > 3 && !EM_PF_ALL) {
    n = g_prefetch / 4;
  } else {
    n = g_prefetch / lines;
  }
  return n < 2 ? 2 : n > 64 ? 64 : n;
}

// The prefetch of the row gather (it copies whole rows): every line of rows of up to 5
// lines, g_prefetch lines in flight; longer rows their first 2 lines, g_prefetch / 8
// entries ahead.
inline int64_t all_lines_entries_ahead(int64_t& lines) {
  if (g_prefetch <= 0 || lines <= 0) return 0;
  int64_t n;
  if (g_row_lines > 0) {
    if (lines > g_row_lines) lines = g_row_lines;
    n = g_prefetch / lines;
  } else if (lines > 5) {
    lines = 2;
    n = g_prefetch / 8;
  } else {
    n = g_prefetch / lines;
  }
  return n < 2 ? 2 : n > 64 ? 64 : n;
}

// Cache lines a row of `bytes` may touch: one more unless every row starts on a line.
inline int64_t row_lines(const void* table, int64_t stride_bytes, int64_t bytes) {
  return (bytes + 63) / 64 + (rows_on_lines(table, stride_bytes) || bytes == 0 ? 0 : 1);
}

// ---------------------------------------------------------------------------
// The bag kernels' loop over entries, shared by all of them.
//
// Every instruction per entry counts: the loop is bound by how many rows' misses the
// out-of-order window holds, and the window is counted in instructions. So the hot path
// of an entry is: one prefetch (two or three for short rows) of a row some entries
// ahead, without a branch and without clamping that id (a prefetch never faults,
// whatever the address); the id's load and one range check (pruning, an error: both
// behind that one branch, except pruning by weight); the denominators without a branch
// on the combiner; the row's loads and adds. Against the loop this replaced (prefetch
// through a clamped id and a loop over lines, the combiner and pruning tested per
// entry), kernel alone, 8 x 1M tables, same process, quiet machine, 21-31 rounds
// (benchmarks/serving/serving_kernel_ab.py, 2026-12-03): dim 16 1.16 -> 1.42x torch, dim 32
// 1.05 -> 1.35x, dim 64 0.96 -> 1.24x, dim 64 mean 1.37 -> 1.52x, dim 128 1.09 -> 1.16x.

// Cache lines prefetched per entry, fixed per register-block shape (lanes: the widest
// row the instance takes): rows of up to 16 floats (at most 2 lines, however they sit)
// their first and last float, rows of up to 32 (at most 3 lines) the first, the next
// line and the last float, longer rows their first line only (5: every line, EM_PF_ALL).
constexpr int prefetch_shape(int lanes) {
  return lanes <= 16 ? 2 : lanes <= 32 ? 3 : EM_PF_ALL ? 5 : 1;
}

// The same where every row starts on a 64-byte line (the table's address and row stride
// multiples of 64): rows of up to 16 floats are one line (1: the first float), rows of up
// to 32 two lines (4: the first and the 17th float); the last float is in a line already
// prefetched. One prefetch an entry fewer on the aligned tables of torch's allocator,
// embedmesh's checkpoint loaders and jax arrays (see EmServingSetAlignedPrefetch).
constexpr int aligned_prefetch_shape(int pf) { return pf == 2 ? 1 : pf == 3 ? 4 : pf; }
int g_aligned_prefetch = 1;

// Prefetch the row of `id` (see prefetch_shape); `last`: the offset of its last float.
template <int Pf, typename Id>
inline void prefetch_entry(const float* table, uint64_t stride_bytes, int64_t last, Id id) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(table) +
                      static_cast<uint64_t>(static_cast<int64_t>(id)) * stride_bytes;
  const float* p = reinterpret_cast<const float*>(a);
  prefetch(p);
  if (Pf == 3 || Pf == 4) prefetch(p + 16);
  if (Pf == 2 || Pf == 3) prefetch(p + last);
  if (Pf == 5) {
    for (int64_t o = 16; o < last; o += 16) prefetch(p + o);
    prefetch(p + last);
  }
}

// What one entry gives: 0 a row to add, 1 nothing (pruned), 2 an id outside the table.
// TensorFlow's order: ids < 0 pruned, then weights not > 0, then the range check.
template <typename Id, bool HasW>
inline int check_entry(Id id, float w, uint64_t vocab, bool prune_ids, bool prune_w) {
  if (__builtin_expect(static_cast<uint64_t>(static_cast<int64_t>(id)) >= vocab, 0)) {
    if (prune_ids && id < 0) return 1;
    if (HasW && prune_w && !(w > 0.0f)) return 1;
    return 2;
  }
  if (HasW && prune_w && !(w > 0.0f)) return 1;
  return 0;
}

// check_entry, and a kept entry's (0) weight added to its bag's denominators (den: the
// kept weights' sum, den2: their squares').
template <typename Id, bool HasW>
inline int keep_entry(Id id, float w, uint64_t vocab, bool prune_ids, bool prune_w, float& den,
                      float& den2) {
  const int c = check_entry<Id, HasW>(id, w, vocab, prune_ids, prune_w);
  if (c == 0) {
    den += w;
    if (HasW) den2 += w * w;
  }
  return c;
}

// The prefetching walk over entries [lo, hi) of n: fn(k) per entry, false to stop (its
// k returned); -1 when all ran. Bags ending `ahead` or more before n prefetch entry
// k + ahead as it is; the last ones clamp it to n - 1.
template <int Pf, typename Id, typename Fn>
inline int64_t walk(const float* table, uint64_t stride_bytes, int64_t last, const Id* ids,
                    int64_t lo, int64_t hi, int64_t n, int64_t ahead, Fn fn) {
  if (hi + ahead <= n) {
    for (int64_t k = lo; k < hi; ++k) {
      prefetch_entry<Pf>(table, stride_bytes, last, ids[k + ahead]);
      if (!fn(k)) return k;
    }
  } else {
    for (int64_t k = lo; k < hi; ++k) {
      prefetch_entry<Pf>(table, stride_bytes, last, ids[k + ahead < n ? k + ahead : n - 1]);
      if (!fn(k)) return k;
    }
  }
  return -1;
}

// Prefetch the first `ahead` entries' rows (before a walk).
template <typename Id>
inline void prefetch_start(const float* table, uint64_t vocab, int64_t stride, int64_t lines,
                           const Id* ids, int64_t ahead, int64_t k0, int64_t n) {
  for (int64_t k = k0; k < k0 + ahead && k < n; ++k) {
    prefetch_row(table, vocab, stride, lines, ids[k]);
  }
}

// The two passes of a bag kernel, over the rows at `table` + id * stride_bytes (float or
// quantized: addresses only here): per bag, the walk lists its kept (row, weight) pairs,
// then plan.run sums them into the bag's output row. `prefetch_first()` runs once the
// scratch is ready, before the first walk. The entry of the first id outside the table,
// or -1.
template <typename Id, bool HasW, int Pf, typename PlanT, typename Start>
int64_t two_pass_bags(const char* table, uint64_t vocab, int64_t stride_bytes, int64_t last,
                      int64_t ahead, const Id* ids, const int64_t* offsets, int64_t num_rows,
                      const float* weights, int mode, bool prune_ids, bool prune_w, float* out,
                      int64_t out_stride, const PlanT& plan, Start prefetch_first) {
  const bool stream = stream_rows(out, out_stride, num_rows);
  const int64_t n = offsets[num_rows];
  const uint64_t ustride = static_cast<uint64_t>(stride_bytes);
  const float* tf = reinterpret_cast<const float*>(table);  // addresses only
  int64_t max_bag = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t len = offsets[r + 1] - offsets[r];
    if (len > max_bag) max_bag = len;
  }
  Entry* e = scratch(max_bag > 0 ? max_bag : 1);
  prefetch_first();
  for (int64_t r = 0; r < num_rows; ++r) {
    int64_t m = 0;
    float den = 0.0f, den2 = 0.0f;
    auto entry = [&](int64_t k) {
      const Id id = ids[k];
      const float w = HasW ? weights[k] : 1.0f;
      const int c = keep_entry<Id, HasW>(id, w, vocab, prune_ids, prune_w, den, den2);
      if (c == 0) {
        e[m].row = reinterpret_cast<const float*>(table + static_cast<int64_t>(id) * stride_bytes);
        e[m].w = w;
        ++m;
      }
      return c != 2;
    };
    const int64_t bad =
        walk<Pf>(tf, ustride, last, ids, offsets[r], offsets[r + 1], n, ahead, entry);
    if (bad >= 0) return bad;
    const float d = mode == 2 ? std::sqrt(HasW ? den2 : den) : den;
    plan.run(e, m, mode, d, out + r * out_stride, stream);
  }
  return -1;
}

// The two-pass bag kernel (rows wider than one register block, or EmServingSetFused(0)):
// the walk lists each bag's kept (row, weight) pairs, then Plan sums them block by block.
template <typename Id, bool HasW, int Pf>
int64_t bag(const float* table, uint64_t vocab, int64_t dim, int64_t stride, const Id* ids,
            const int64_t* offsets, int64_t num_rows, const float* weights, int mode,
            bool prune_ids, bool prune_w, float* out, int64_t out_stride) {
  const Plan plan(dim, HasW);
  const int64_t lines = row_lines(table, stride * 4, dim * 4);
  const int64_t ahead = entries_ahead(lines);
  return two_pass_bags<Id, HasW, Pf>(
      reinterpret_cast<const char*>(table), vocab, stride * 4, dim > 0 ? dim - 1 : 0, ahead, ids,
      offsets, num_rows, weights, mode, prune_ids, prune_w, out, out_stride, plan, [&] {
        prefetch_start(table, vocab, stride, lines, ids, ahead, offsets[0], offsets[num_rows]);
      });
}

using BagFn = int64_t (*)(const float*, uint64_t, int64_t, int64_t, const void*, const int64_t*,
                          int64_t, const float*, int, bool, bool, float*, int64_t);

template <typename Id, bool HasW, int Pf>
int64_t bag_erased(const float* table, uint64_t vocab, int64_t dim, int64_t stride,
                   const void* ids, const int64_t* offsets, int64_t num_rows,
                   const float* weights, int mode, bool prune_ids, bool prune_w, float* out,
                   int64_t out_stride) {
  return bag<Id, HasW, Pf>(table, vocab, dim, stride, static_cast<const Id*>(ids), offsets,
                           num_rows, weights, mode, prune_ids, prune_w, out, out_stride);
}

template <typename Id>
BagFn pick(int64_t dim, bool has_w) {
  const int pf = prefetch_shape(static_cast<int>(dim < 64 ? dim : 64));
  if (has_w) {
    return pf == 2 ? &bag_erased<Id, true, 2>
                   : pf == 3 ? &bag_erased<Id, true, 3> : &bag_erased<Id, true, 1>;
  }
  return pf == 2 ? &bag_erased<Id, false, 2>
                 : pf == 3 ? &bag_erased<Id, false, 3> : &bag_erased<Id, false, 1>;
}

// The loop of the one-pass kernels (float rows: bag_fused; quantized rows:
// serving_quantized.cc's qbag_fused): per bag, walk_bag(r, entry) runs entry(k) over its
// entries (with the kernel's prefetch), each kept entry's row added to the register sums
// by add_row(acc, tacc, id, w), then the sums are combined and stored. The entry of the
// first id outside the table, or -1.
template <typename Id, int NV, bool Tail, bool HasW, typename AddRow, typename WalkBag>
int64_t fused_bags(const Id* ids, const float* weights, uint64_t vocab, bool prune_ids,
                   bool prune_w, int mode, int tail, int64_t num_rows, float* out,
                   int64_t out_stride, AddRow add_row, WalkBag walk_bag) {
  const bool stream = stream_rows(out, out_stride, num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    vf acc[NV > 0 ? NV : 1];
    vf tacc = vf{};
    for (int v = 0; v < NV; ++v) acc[v] = vf{};
    float den = 0.0f, den2 = 0.0f;
    auto entry = [&](int64_t k) {
      const Id id = ids[k];
      const float w = HasW ? weights[k] : 1.0f;
      const int c = keep_entry<Id, HasW>(id, w, vocab, prune_ids, prune_w, den, den2);
      if (c != 0) return c != 2;
      add_row(acc, tacc, id, w);
      return true;
    };
    const int64_t bad = walk_bag(r, entry);
    if (bad >= 0) return bad;
    const float d = mode == 2 ? std::sqrt(HasW ? den2 : den) : den;
    store_combined<NV, Tail>(acc, tacc, mode != 0, d, tail, out + r * out_stride, stream);
  }
  return -1;
}

// The whole bag kernel in one pass for rows of at most one register block (any dim up
// to kMaxFusedNV vectors plus a tail: 271 floats with AVX-512, 135 with AVX2): checks,
// pruning, the denominator, prefetch and the sums in the same walk over the entries, the
// sums in registers.
template <typename Id, int NV, bool Tail, bool HasW, int kPf>
int64_t bag_fused(const float* table, uint64_t vocab, int64_t stride, const Id* ids,
                  const int64_t* offsets, int64_t num_rows, const float* weights, int mode,
                  bool prune_ids, bool prune_w, int tail, float* out, int64_t out_stride) {
  const int64_t n = offsets[num_rows];
  const int64_t row_floats = NV * kV + tail;
  const int64_t lines = row_lines(table, stride * 4, row_floats * 4);
  const int64_t ahead = entries_ahead(lines);
  const uint64_t stride_bytes = static_cast<uint64_t>(stride) * 4;
  const int64_t last = row_floats > 0 ? row_floats - 1 : 0;
  prefetch_start(table, vocab, stride, lines, ids, ahead, offsets[0], n);
  return fused_bags<Id, NV, Tail, HasW>(
      ids, weights, vocab, prune_ids, prune_w, mode, tail, num_rows, out, out_stride,
      [&](vf* acc, vf& tacc, Id id, float w) {
        accumulate<NV, Tail, HasW>(acc, tacc, table + static_cast<int64_t>(id) * stride, w, tail);
      },
      [&](int64_t r, auto& entry) {
        return walk<kPf>(table, stride_bytes, last, ids, offsets[r], offsets[r + 1], n, ahead,
                         entry);
      });
}

template <typename Id>
using FusedFn = int64_t (*)(const float*, uint64_t, int64_t, const Id*, const int64_t*, int64_t,
                            const float*, int, bool, bool, int, float*, int64_t);

template <typename Id, int NV>
struct FusedTable {
  template <bool Tail>
  static FusedFn<Id> with(bool has_w, bool aligned) {
    constexpr int pf = prefetch_shape(NV * kV + (Tail ? kV - 1 : 0));
    constexpr int pfa = aligned_prefetch_shape(pf);
    if (aligned) {
      return has_w ? &bag_fused<Id, NV, Tail, true, pfa> : &bag_fused<Id, NV, Tail, false, pfa>;
    }
    return has_w ? &bag_fused<Id, NV, Tail, true, pf> : &bag_fused<Id, NV, Tail, false, pf>;
  }

  static FusedFn<Id> get(int nv, bool tail, bool has_w, bool aligned) {
    if (nv == NV) return tail ? with<true>(has_w, aligned) : with<false>(has_w, aligned);
    return FusedTable<Id, NV - 1>::get(nv, tail, has_w, aligned);
  }
};

template <typename Id>
struct FusedTable<Id, -1> {
  static FusedFn<Id> get(int, bool, bool, bool) { return nullptr; }
};

// The fused kernel for this dim, or nullptr when the row needs more than one block.
template <typename Id>
FusedFn<Id> fused_for(int64_t dim, bool has_w, bool aligned) {
  const int64_t nvec = dim / kV;
  const bool tail = dim % kV != 0;
  if (dim <= 0 || nvec > kMaxFusedNV) return nullptr;
  return FusedTable<Id, kMaxFusedNV>::get(static_cast<int>(nvec), tail, has_w,
                                     aligned && g_aligned_prefetch);
}

// ---------------------------------------------------------------------------
// gather

// One vector's streaming store of the widest the target has (kStreamWidth bytes, 0: none).
#if defined(__AVX512F__)
constexpr int64_t kStreamWidth = 64;
inline void stream_vector(char* dst, const char* src) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst),
                      _mm512_loadu_si512(reinterpret_cast<const void*>(src)));
}
#elif defined(__AVX__)
constexpr int64_t kStreamWidth = 32;
inline void stream_vector(char* dst, const char* src) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
#elif defined(__SSE2__)
constexpr int64_t kStreamWidth = 16;
inline void stream_vector(char* dst, const char* src) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
#else
constexpr int64_t kStreamWidth = 0;
inline void stream_vector(char*, const char*) {}
#endif

inline void copy_row(char* dst, const char* src, int64_t bytes, bool stream) {
  if (kStreamWidth > 0 && stream) {
    for (int64_t j = 0; j < bytes; j += kStreamWidth) stream_vector(dst + j, src + j);
    return;
  }
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// The output of a gather whose rows are not whole 64-byte lines (dim 100: 400-byte rows),
// streamed all the same: rows are copied into a line-aligned staging buffer that stays in
// L1, whose whole lines go out with streaming stores; the partial lines at the range's
// two ends (shared with the neighbouring chunks' threads) get plain stores. Plain stores
// into lines a row only half covers first read each line in: dim 100, 8 x 1M tables,
// batch 4096 x 10, one thread, 24.4 ms a call against torch's 24.7 and TensorFlow's 21.5
// (benchmarks/runs/serving-history.md, seventh session). Staged over plain, same process,
// 1 thread (2 threads): dim 100 1.41x (1.61x), dim 50 1.75x, dim 36 1.31x, dim 20
// 0.97x, dim 8 0.74x (0.85x): rows of fewer than 128 bytes stay plain (kMinStagedRow).
constexpr int64_t kMinStagedRow = 128;
class StagedOutput {
 public:
  // The whole lines of [begin, begin + bytes) go through the stage (worth() said so).
  StagedOutput(char* begin, int64_t bytes)
      : a_(line_up(begin)), z_(line_down(begin + bytes)), next_(a_) {}

  // Whether enough whole lines lie inside [begin, begin + bytes) to be worth it.
  static bool worth(char* begin, int64_t bytes) {
    return line_down(begin + bytes) - line_up(begin) >= kMinStagedBytes;
  }

  // Write the bytes [d, d + len) of the output from `src` (rows in order).
  void put(char* d, const char* src, int64_t len) {
    char* d1 = d + len;
    if (d < a_) {  // the range's first partial line
      const int64_t m = (d1 < a_ ? d1 : a_) - d;
      std::memcpy(d, src, static_cast<size_t>(m));
    }
    char* m0 = d > a_ ? d : a_;
    char* m1 = d1 < z_ ? d1 : z_;
    if (m1 > m0) {
      const int64_t m = m1 - m0;
      std::memcpy(stage_ + filled_, src + (m0 - d), static_cast<size_t>(m));
      filled_ += m;
      if (filled_ >= kFlushBytes) flush();
    }
    if (d1 > z_) {  // its last partial line
      char* t0 = d > z_ ? d : z_;
      std::memcpy(t0, src + (t0 - d), static_cast<size_t>(d1 - t0));
    }
  }

  // Every staged byte out: whole lines streamed, a last partial line (only where the
  // gather stopped at a bad id) stored plainly.
  void finish() {
    flush();
    if (filled_ > 0) std::memcpy(next_, stage_, static_cast<size_t>(filled_));
    filled_ = 0;
  }

 private:
  static constexpr int64_t kFlushBytes = 4096;
  static constexpr int64_t kMinStagedBytes = 64 << 10;
  alignas(64) char stage_[kFlushBytes + 4096];  // + a row of up to 4 KB past the mark
  char* const a_;  // the range's first and last line boundaries: stage [a_, z_)
  char* const z_;
  char* next_;  // where the stage's first byte goes
  int64_t filled_ = 0;

  static char* line_up(char* p) {
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  }
  static char* line_down(char* p) {
    return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  }

  void flush() {
    const int64_t whole = filled_ & ~int64_t{63};
    copy_row(next_, stage_, whole, true);  // whole lines, both ends on lines: streamed
    next_ += whole;
    filled_ -= whole;
    if (filled_ > 0) std::memmove(stage_, stage_ + whole, static_cast<size_t>(filled_));
  }
};

// The gather's walk: each row `write(k, row)` in order, the rows ahead prefetched (every
// line of rows of up to 5 lines); stops at the first id outside [0, vocab) (returned,
// else -1).
template <typename Id, typename Write>
int64_t walk_rows(const char* table, uint64_t vocab, int64_t stride, const Id* ids, int64_t n,
                  int64_t lines, int64_t ahead, Write&& write) {
  auto pf = [&](Id id) {
    if (static_cast<uint64_t>(static_cast<int64_t>(id)) < vocab) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(table + static_cast<int64_t>(id) * stride);
      const char* p = reinterpret_cast<const char*>(a & ~static_cast<uintptr_t>(63));
      for (int64_t l = 0; l < lines; ++l) prefetch(p + 64 * l);
    }
  };
  for (int64_t k = 0; k < ahead && k < n; ++k) pf(ids[k]);
  for (int64_t k = 0; k < n; ++k) {
    if (k + ahead < n) pf(ids[k + ahead]);
    const Id id = ids[k];
    if (static_cast<uint64_t>(static_cast<int64_t>(id)) >= vocab) return k;
    write(k, table + static_cast<int64_t>(id) * stride);
  }
  return -1;
}

template <typename Id>
int64_t gather(const char* table, uint64_t vocab, int64_t row_bytes, int64_t stride,
               const Id* ids, int64_t n, char* out) {
  int64_t lines = row_lines(table, stride, row_bytes);
  const int64_t ahead = all_lines_entries_ahead(lines);
  const bool stream = rows_on_lines(out, row_bytes);
  const bool staged_out = !stream && row_bytes >= kMinStagedRow && row_bytes <= 4096 &&
                          g_stream_output && StagedOutput::worth(out, n * row_bytes);
  int64_t bad;
  if (staged_out) {
    StagedOutput staged(out, n * row_bytes);
    bad = walk_rows(table, vocab, stride, ids, n, lines, ahead, [&](int64_t k, const char* row) {
      staged.put(out + k * row_bytes, row, row_bytes);
    });
    staged.finish();
  } else {
    bad = walk_rows(table, vocab, stride, ids, n, lines, ahead, [&](int64_t k, const char* row) {
      copy_row(out + k * row_bytes, row, row_bytes, stream);
    });
  }
#if defined(__SSE2__) || defined(__AVX__)
  if (stream || staged_out) _mm_sfence();  // order the streaming stores before what follows
#endif
  return bad;
}

// ---------------------------------------------------------------------------
// offsets

// The checking loop, any rank (rank 2: sparse_offsets_2d, the fast forms' fallback that
// finds the first bad entry): entry k must lie in `shape` and after entry k - 1 in
// row-major order, else k is returned; offsets[r + 1] is the end of row r's entries (a
// row: the index without its last dimension). -1: every entry good.
template <typename I>
int64_t sparse_offsets_checked(const I* idx, int64_t n, int64_t rank, const int64_t* shape,
                               int64_t* offsets) {
  int64_t num_rows = 1;
  for (int64_t d = 0; d + 1 < rank; ++d) num_rows *= shape[d];
  int64_t cur = 0, prev_row = -1, prev_col = -1;
  offsets[0] = 0;
  for (int64_t k = 0; k < n; ++k) {
    const I* e = idx + k * rank;
    int64_t row = 0;
    for (int64_t d = 0; d + 1 < rank; ++d) {
      const int64_t v = e[d];
      if (v < 0 || v >= shape[d]) return k;
      row = row * shape[d] + v;
    }
    const int64_t col = e[rank - 1];
    if (col < 0 || col >= shape[rank - 1]) return k;
    if (row < prev_row || (row == prev_row && col <= prev_col)) return k;
    while (cur < row) offsets[++cur] = k;
    prev_row = row;
    prev_col = col;
  }
  while (cur < num_rows) offsets[++cur] = n;
  return -1;
}

template <typename I>
int64_t sparse_offsets_2d(const I* idx, int64_t n, int64_t num_rows, int64_t num_cols,
                          int64_t* offsets) {
  const int64_t shape[2] = {num_rows, num_cols};
  return sparse_offsets_checked(idx, n, 2, shape, offsets);
}

// sparse_offsets_2d without a branch per entry: each entry is checked (in range, after
// the previous one in row-major order) into a flag, and writes its row's end
// (offsets[row + 1] = k + 1: the last entry of a row writes last); a running max then
// fills the rows without entries. Blocks of entries are checked as they go; a bad
// block hands over to sparse_offsets_2d, which finds the first bad entry. ~2.5x the
// speed of the branchy loop, whose branch on a row change mispredicts once per row.
template <typename I>
int64_t sparse_offsets_2d_fast(const I* idx, int64_t n, int64_t num_rows, int64_t num_cols,
                               int64_t* offsets) {
  if (n == 0 || num_rows <= 0 || num_cols <= 0) {
    return sparse_offsets_2d(idx, n, num_rows, num_cols, offsets);
  }
  std::memset(offsets, 0, static_cast<size_t>(num_rows + 1) * sizeof(int64_t));
  const uint64_t R = static_cast<uint64_t>(num_rows), C = static_cast<uint64_t>(num_cols);
  int64_t prev_row = -1, prev_col = 0;
  constexpr int64_t kBlock = 1024;
  for (int64_t k0 = 0; k0 < n; k0 += kBlock) {
    const int64_t k1 = k0 + kBlock < n ? k0 + kBlock : n;
    unsigned bad = 0;
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t row = idx[2 * k], col = idx[2 * k + 1];
      const bool ok = (static_cast<uint64_t>(row) < R) & (static_cast<uint64_t>(col) < C) &
                      ((row > prev_row) | ((row == prev_row) & (col > prev_col)));
      bad |= !ok;
      offsets[(ok ? row : 0) + 1] = k + 1;
      prev_row = row;
      prev_col = col;
    }
    if (bad) return sparse_offsets_2d(idx, n, num_rows, num_cols, offsets);
  }
  int64_t run = 0;
  for (int64_t r = 1; r <= num_rows; ++r) {
    run = offsets[r] > run ? offsets[r] : run;
    offsets[r] = run;
  }
  return -1;
}

#if defined(__AVX512F__)
// sparse_offsets_2d_fast for int64 indices, 8 entries a step: the rows and columns of
// 8 entries deinterleaved into two vectors, checked against the bounds and against the
// entry before each (the previous step's last one for the first) into a mask, and each
// row's end written only by the lanes that end a row in the step (plus the step's
// last lane), with one masked scatter. Entries per lane and order as the scalar loop,
// so a bad step hands over to sparse_offsets_2d as that loop's bad block does. The 327k
// entries of serving.py's 8 features (`kernels.sparse_offsets` from Python, hot caches):
// 0.86 -> 0.46 ms, where numpy's sum over the same bytes takes 0.21-0.25 ms.
// Indices (int64 words) prefetched ahead of the loads: the hardware prefetcher alone left
// the offsets of 8 features (5.2 MB of indices, serving.py's workload) at 318-341 us from
// the last-level cache and 365-421 us after an eviction; 2 KB ahead: 275-278 and 321-355
// us (1 KB: 294 / 336, 4 KB: 285 / 337; same process, 15 rounds, 2026-12-03).
constexpr int64_t kIdxPrefetch = 2048 / 8;

int64_t sparse_offsets_2d_avx512(const int64_t* idx, int64_t n, int64_t num_rows,
                                 int64_t num_cols, int64_t* offsets) {
  if (n < 8 || num_rows <= 0 || num_cols <= 0) {
    return sparse_offsets_2d_fast(idx, n, num_rows, num_cols, offsets);
  }
  std::memset(offsets, 0, static_cast<size_t>(num_rows + 1) * sizeof(int64_t));
  const __m512i even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
  const __m512i odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
  const __m512i R = _mm512_set1_epi64(num_rows), C = _mm512_set1_epi64(num_cols);
  const __m512i one = _mm512_set1_epi64(1);
  __m512i prev_rows = _mm512_set1_epi64(-1), prev_cols = _mm512_setzero_si512();
  __m512i k1 = _mm512_add_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), one);  // k + 1
  const __m512i eight = _mm512_set1_epi64(8);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    prefetch(idx + 2 * k + kIdxPrefetch);  // the 128 bytes of indices 2 KB ahead
    prefetch(idx + 2 * k + kIdxPrefetch + 8);
    const __m512i a = _mm512_loadu_si512(idx + 2 * k), b = _mm512_loadu_si512(idx + 2 * k + 8);
    const __m512i rows = _mm512_permutex2var_epi64(a, even, b);
    const __m512i cols = _mm512_permutex2var_epi64(a, odd, b);
    // the entry before each lane: [previous step's last, lanes 0..6]
    const __m512i pr = _mm512_alignr_epi64(rows, prev_rows, 7);
    const __m512i pc = _mm512_alignr_epi64(cols, prev_cols, 7);
    __mmask8 ok = _mm512_cmplt_epu64_mask(rows, R) & _mm512_cmplt_epu64_mask(cols, C);
    ok &= _mm512_cmpgt_epi64_mask(rows, pr) |
          (_mm512_cmpeq_epi64_mask(rows, pr) & _mm512_cmpgt_epi64_mask(cols, pc));
    if (ok != 0xFF) return sparse_offsets_2d(idx, n, num_rows, num_cols, offsets);
    // lanes whose next entry starts another row, and the last lane
    const __mmask8 ends =
        _mm512_cmpneq_epi64_mask(rows, _mm512_alignr_epi64(rows, rows, 1)) | 0x80;
    _mm512_mask_i64scatter_epi64(offsets + 1, ends, rows, k1, 8);
    k1 = _mm512_add_epi64(k1, eight);
    prev_rows = rows;
    prev_cols = cols;
  }
  int64_t prev_row = k > 0 ? idx[2 * (k - 1)] : -1, prev_col = k > 0 ? idx[2 * k - 1] : 0;
  const uint64_t Ru = static_cast<uint64_t>(num_rows), Cu = static_cast<uint64_t>(num_cols);
  for (; k < n; ++k) {
    const int64_t row = idx[2 * k], col = idx[2 * k + 1];
    const bool good = (static_cast<uint64_t>(row) < Ru) & (static_cast<uint64_t>(col) < Cu) &
                      ((row > prev_row) | ((row == prev_row) & (col > prev_col)));
    if (!good) return sparse_offsets_2d(idx, n, num_rows, num_cols, offsets);
    offsets[row + 1] = k + 1;
    prev_row = row;
    prev_col = col;
  }
  int64_t run = 0;
  for (int64_t r = 1; r <= num_rows; ++r) {
    run = offsets[r] > run ? offsets[r] : run;
    offsets[r] = run;
  }
  return -1;
}
#endif

template <typename I>
int64_t sparse_offsets_2d_best(const I* idx, int64_t n, int64_t num_rows, int64_t num_cols,
                               int64_t* offsets) {
#if defined(__AVX512F__)
  if constexpr (sizeof(I) == 8) {
    return sparse_offsets_2d_avx512(reinterpret_cast<const int64_t*>(idx), n, num_rows,
                                    num_cols, offsets);
  }
#endif
  return sparse_offsets_2d_fast(idx, n, num_rows, num_cols, offsets);
}

template <typename I>
int64_t sparse_offsets(const I* idx, int64_t n, int64_t rank, const int64_t* shape,
                       int64_t* offsets) {
  if (rank == 2) return sparse_offsets_2d_best(idx, n, shape[0], shape[1], offsets);
  return sparse_offsets_checked(idx, n, rank, shape, offsets);
}

// The EmServingSet* calls: `setting` takes `value`, its previous value returned.
template <typename T>
int64_t replace_setting(T& setting, int64_t value) {
  const int64_t previous = setting;
  setting = static_cast<T>(value);
  return previous;
}

}  // namespace
}  // namespace embedmesh_serving

using namespace embedmesh_serving;

extern "C" {

static int64_t bag_f32(const float* table, int64_t vocab, int64_t dim, int64_t table_stride,
                       const void* ids, int32_t ids_are_64, const int64_t* offsets,
                       int64_t num_rows, const float* weights, int32_t mode, int32_t prune_ids,
                       int32_t prune_weights, float* out, int64_t out_stride) {
  const bool has_w = weights != nullptr;
  const bool aligned = rows_on_lines(table, table_stride * 4);
  if (g_fused && ids_are_64) {
    if (auto f = fused_for<int64_t>(dim, has_w, aligned)) {
      return f(table, static_cast<uint64_t>(vocab), table_stride, static_cast<const int64_t*>(ids),
               offsets, num_rows, weights, mode, prune_ids, prune_weights && has_w,
               static_cast<int>(dim % kV), out, out_stride);
    }
  } else if (g_fused) {
    if (auto f = fused_for<int32_t>(dim, has_w, aligned)) {
      return f(table, static_cast<uint64_t>(vocab), table_stride, static_cast<const int32_t*>(ids),
               offsets, num_rows, weights, mode, prune_ids, prune_weights && has_w,
               static_cast<int>(dim % kV), out, out_stride);
    }
  }
  const BagFn fn = ids_are_64 ? pick<int64_t>(dim, has_w) : pick<int32_t>(dim, has_w);
  return fn(table, static_cast<uint64_t>(vocab), dim, table_stride, ids, offsets, num_rows,
            weights, mode, prune_ids != 0, prune_weights != 0 && has_w, out, out_stride);
}

int64_t EmServingBagF32(const float* table, int64_t vocab, int64_t dim, int64_t table_stride,
                        const void* ids, int32_t ids_are_64, const int64_t* offsets,
                        int64_t num_rows, const float* weights, int32_t mode, int32_t prune_ids,
                        int32_t prune_weights, float* out, int64_t out_stride) {
  const int64_t r = bag_f32(table, vocab, dim, table_stride, ids, ids_are_64, offsets, num_rows,
                            weights, mode, prune_ids, prune_weights, out, out_stride);
  fence_streams();
  return r;
}

int64_t EmServingGather(const void* table, int64_t vocab, int64_t row_bytes,
                        int64_t table_stride_bytes, const void* ids, int32_t ids_are_64,
                        int64_t n, void* out) {
  const char* t = static_cast<const char*>(table);
  char* o = static_cast<char*>(out);
  if (ids_are_64) {
    return gather(t, static_cast<uint64_t>(vocab), row_bytes, table_stride_bytes,
                  static_cast<const int64_t*>(ids), n, o);
  }
  return gather(t, static_cast<uint64_t>(vocab), row_bytes, table_stride_bytes,
                static_cast<const int32_t*>(ids), n, o);
}

int64_t EmServingSparseOffsets(const void* indices, int32_t indices_are_64, int64_t n,
                               int64_t rank, const int64_t* shape, int64_t* offsets) {
  if (indices_are_64) {
    return sparse_offsets(static_cast<const int64_t*>(indices), n, rank, shape, offsets);
  }
  return sparse_offsets(static_cast<const int32_t*>(indices), n, rank, shape, offsets);
}

int64_t EmServingSetPrefetch(int64_t entries) {
  return replace_setting(g_prefetch, entries < 0 ? 0 : entries);
}

int64_t EmServingVectorWidth(void) { return kV; }

int64_t EmServingSetStreamOutput(int64_t on) { return replace_setting(g_stream_output, on != 0); }

int64_t EmServingSetRowLines(int64_t n) { return replace_setting(g_row_lines, n < 0 ? 0 : n); }

int64_t EmServingSetAlignedPrefetch(int64_t on) {
  return replace_setting(g_aligned_prefetch, on != 0);
}

int64_t EmServingSetFused(int64_t on) { return replace_setting(g_fused, on != 0); }

}  // extern "C"
