// The bag kernel over quantized serving tables (EmServingBagQ, see serving.h and
// embedmesh/serving/quantized.py): rows of float16, bfloat16, FBGEMM's fused 8-bit
// row-wise layout (dim bytes q, then float32 scale and bias: x = q * scale + bias) or
// one-byte bucket codes (x = values[q]), each decoded to float32 in registers inside
// the sum. Same sums as EmServingBagF32 over the decoded rows: float32, in entry order,
// no FMA (the decode is a product then a sum), so the numpy and numba backends, which
// decode with numpy first, give the same values bit for bit.
//
// Built in one translation unit with serving.cc (embedmesh._native includes every .cc
// of the folder, in name order: this file comes after serving.cc), whose helpers it
// uses: the entry walk with its prefetch (walk, check_entry), the per-thread entry
// scratch, the output rows' store (store_combined, streaming stores).
//
// Rows of 1, 2, 4, 8 or 16 full vectors (dims 16-256 with AVX-512) are summed in the
// walk itself, in registers (qbag_fused, as serving.cc's bag_fused); other widths take
// two passes per bag, like serving.cc's `bag`: the walk lists the kept (row, weight)
// pairs, then each block of columns is summed over them with its accumulators in
// registers (one template instance per format, register block, tail and weights).
// Quantized rows are 2-4x narrower than float32 ones, so the walk's prefetch covers
// each row with one to three prefetches.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "serving.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace embedmesh_serving {
namespace {

constexpr int kQF16 = 1, kQBF16 = 2, kQInt8 = 3, kQCodes = 4;  // EmServingBagQ's kinds

typedef uint8_t vu8 __attribute__((vector_size(kV)));
typedef uint16_t vu16 __attribute__((vector_size(kV * 2)));
typedef uint32_t vu32 __attribute__((vector_size(kV * 4)));

// What a row's decoder needs beyond the row: the dim (where int8 rows keep their scale
// and bias) and the codes' values.
struct QCtx {
  int64_t dim;
  const float* values;
};

inline vf bits_to_float(vu32 w) {
  vf f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

// GCC 12 turns __builtin_convertvector from bytes or _Float16 to floats into one scalar
// conversion a lane; the x86 conversions are spelt out (AVX-512, AVX2 + F16C), other
// targets widen bytes through int32 (vectorised) and convert halves by their bits.
typedef int32_t vi32 __attribute__((vector_size(kV * 4)));

// The kV bytes at p as floats (exact).
inline vf bytes_to_float(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
#if defined(__AVX2__)
  if constexpr (kV == 8) {
    return (vf)_mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#endif
  vu8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
#endif
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The kV float16 values at p as floats (exact).
inline vf half_to_float(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (kV == 8) {
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#endif
  float t[kV];
  for (int i = 0; i < kV; ++i) {
    uint16_t h;
    std::memcpy(&h, p + i, sizeof h);
    t[i] = half_bits_to_float(h);
  }
  return load(t);
#endif
}

// Row decoders: at(c) the kV floats from column c, tail(c, t) the t (< kV) floats from
// column c and zeros (never reading past the row's t values).
template <int K>
struct Dec;

template <>
struct Dec<kQF16> {
  const uint16_t* p;
  Dec(const char* row, const QCtx&) : p(reinterpret_cast<const uint16_t*>(row)) {}
  vf at(int64_t c) const { return half_to_float(p + c); }
  vf tail(int64_t c, int t) const {
    uint16_t h[kV] = {};
    std::memcpy(h, p + c, sizeof(uint16_t) * t);
    return half_to_float(h);
  }
};

template <>
struct Dec<kQBF16> {
  const uint16_t* p;
  Dec(const char* row, const QCtx&) : p(reinterpret_cast<const uint16_t*>(row)) {}
  vf at(int64_t c) const {
    vu16 h;
    std::memcpy(&h, p + c, sizeof h);
    return bits_to_float(__builtin_convertvector(h, vu32) << 16);
  }
  vf tail(int64_t c, int t) const {
    vu16 h = vu16{};
    std::memcpy(&h, p + c, sizeof(uint16_t) * t);
    return bits_to_float(__builtin_convertvector(h, vu32) << 16);
  }
};

template <>
struct Dec<kQInt8> {
  const uint8_t* p;
  vf s, b;
  Dec(const char* row, const QCtx& ctx) : p(reinterpret_cast<const uint8_t*>(row)) {
    float sb[2];
    std::memcpy(sb, row + ctx.dim, sizeof sb);
    s = splat(sb[0]);
    b = splat(sb[1]);
  }
  vf at(int64_t c) const {
    return bytes_to_float(p + c) * s + b;  // a product, then a sum (no FMA)
  }
  vf tail(int64_t c, int t) const {
    uint8_t q[kV] = {};
    std::memcpy(q, p + c, static_cast<size_t>(t));
    return bytes_to_float(q) * s + b;
  }
};

template <>
struct Dec<kQCodes> {
  const uint8_t* p;
  const float* v;
  Dec(const char* row, const QCtx& ctx) : p(reinterpret_cast<const uint8_t*>(row)), v(ctx.values) {}
  vf at(int64_t c) const {
#if defined(__AVX512F__)
    const __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
    return (vf)_mm512_i32gather_ps(k, v, 4);
#elif defined(__AVX2__)
    if constexpr (kV == 8) {
      const __m256i k =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)));
      return (vf)_mm256_i32gather_ps(v, k, 4);
    }
#endif
    float t[kV];
    for (int i = 0; i < kV; ++i) t[i] = v[p[c + i]];
    return load(t);
  }
  vf tail(int64_t c, int t) const {
    float x[kV] = {};
    for (int i = 0; i < t; ++i) x[i] = v[p[c + i]];
    return load(x);
  }
};

// One column block of one bag: acc = sum_i w_i * decode(row_i)[col0 : col0 + NV*kV (+
// tail)], then out = acc (div = 0) or acc / d (0 where d == 0).
template <int K, int NV, bool Tail, bool HasW>
void qblock(const Entry* e, int64_t m, int64_t col0, int tail, int div, float d, float* out,
            bool stream, const QCtx& ctx) {
  vf acc[NV > 0 ? NV : 1];
  vf tacc = vf{};
  for (int v = 0; v < NV; ++v) acc[v] = vf{};
  for (int64_t i = 0; i < m; ++i) {
    const Dec<K> row(reinterpret_cast<const char*>(e[i].row), ctx);
    if (HasW) {
      const vf wv = splat(e[i].w);
      for (int v = 0; v < NV; ++v) acc[v] += wv * row.at(col0 + v * kV);
      if (Tail) tacc += wv * row.tail(col0 + NV * kV, tail);
    } else {
      for (int v = 0; v < NV; ++v) acc[v] += row.at(col0 + v * kV);
      if (Tail) tacc += row.tail(col0 + NV * kV, tail);
    }
  }
  store_combined<NV, Tail>(acc, tacc, div != 0, d, tail, out + col0, stream);
}

using QBlockFn = void (*)(const Entry*, int64_t, int64_t, int, int, float, float*, bool,
                          const QCtx&);

template <int K, int NV>
struct QTable {
  static QBlockFn get(int nv, bool tail, bool has_w) {
    if (nv == NV) {
      if (tail) return has_w ? &qblock<K, NV, true, true> : &qblock<K, NV, true, false>;
      return has_w ? &qblock<K, NV, false, true> : &qblock<K, NV, false, false>;
    }
    return QTable<K, NV - 1>::get(nv, tail, has_w);
  }
};

template <int K>
struct QTable<K, -1> {
  static QBlockFn get(int, bool, bool) { return nullptr; }
};

inline QBlockFn qblock_for(int kind, int nv, bool tail, bool has_w) {
  switch (kind) {
    case kQF16:
      return QTable<kQF16, kMaxNV>::get(nv, tail, has_w);
    case kQBF16:
      return QTable<kQBF16, kMaxNV>::get(nv, tail, has_w);
    case kQInt8:
      return QTable<kQInt8, kMaxNV>::get(nv, tail, has_w);
    case kQCodes:
      return QTable<kQCodes, kMaxNV>::get(nv, tail, has_w);
    default:
      return nullptr;
  }
}

// The column blocks of a decoded row (serving.cc's Blocks), the rows' format in `ctx`.
struct QPlan : Blocks<QBlockFn> {
  QCtx ctx;

  QPlan(int kind, int64_t dim, bool has_w, const float* values)
      : Blocks(dim, [=](int nv, bool tail) { return qblock_for(kind, nv, tail, has_w); }),
        ctx{dim, values} {}

  void run(const Entry* e, int64_t m, int div, float d, float* out, bool stream) const {
    Blocks::run(e, m, div, d, out, stream, ctx);
  }
};

// The walk (serving.cc's, with its prefetch shapes) over byte rows, then QPlan per bag.
template <typename Id, bool HasW, int Pf>
int64_t qbag(const char* table, uint64_t vocab, int64_t stride_bytes, int64_t row_bytes,
             const Id* ids, const int64_t* offsets, int64_t num_rows, const float* weights,
             int mode, bool prune_ids, bool prune_w, float* out, int64_t out_stride,
             const QPlan& plan) {
  const int64_t ahead = entries_ahead(row_lines(table, stride_bytes, row_bytes));
  const int64_t last = row_bytes > 4 ? (row_bytes - 1) / 4 : 0;  // floats: the row's last line
  return two_pass_bags<Id, HasW, Pf>(
      table, vocab, stride_bytes, last, ahead, ids, offsets, num_rows, weights, mode, prune_ids,
      prune_w, out, out_stride, plan, [&] {
        const int64_t n = offsets[num_rows];
        for (int64_t k = offsets[0]; k < offsets[0] + ahead && k < n; ++k) {
          if (static_cast<uint64_t>(static_cast<int64_t>(ids[k])) < vocab) {
            const char* p = table + static_cast<int64_t>(ids[k]) * stride_bytes;
            prefetch(p);
            prefetch(p + row_bytes - 1);
          }
        }
      });
}

using QBagFn = int64_t (*)(const char*, uint64_t, int64_t, int64_t, const void*,
                           const int64_t*, int64_t, const float*, int, bool, bool, float*,
                           int64_t, const QPlan&);

template <typename Id, bool HasW, int Pf>
int64_t qbag_erased(const char* table, uint64_t vocab, int64_t stride_bytes, int64_t row_bytes,
                    const void* ids, const int64_t* offsets, int64_t num_rows,
                    const float* weights, int mode, bool prune_ids, bool prune_w, float* out,
                    int64_t out_stride, const QPlan& plan) {
  return qbag<Id, HasW, Pf>(table, vocab, stride_bytes, row_bytes, static_cast<const Id*>(ids),
                            offsets, num_rows, weights, mode, prune_ids, prune_w, out,
                            out_stride, plan);
}

// The whole bag in one pass for rows of NV full vectors (NV in 1, 2, 4, 8, 16: dims 16,
// 32, 64, 128, 256 with AVX-512), as serving.cc's bag_fused: checks, pruning, the
// denominators, prefetch and the decoded sums in the same walk, the sums in registers.
// Rows of other widths, and EmServingSetFused(0), take qbag's two passes.
template <int K, int NV>
constexpr int64_t fused_row_bytes() {
  return K == kQInt8 ? NV * kV + 8 : (K == kQF16 || K == kQBF16) ? 2 * NV * kV : NV * kV;
}

template <int K, int NV>
constexpr int fused_prefetch_shape() {
  return fused_row_bytes<K, NV>() <= 64 ? 2 : fused_row_bytes<K, NV>() <= 132 ? 3 : 1;
}

// Rows of more than 132 bytes (int8 and float16 rows at dims 128 and 256): every line of
// the row is prefetched (its first byte, every 64 bytes after, its last byte), where
// serving.cc's walk prefetches the first line only of float32 rows this long
// (EmServingSetQuantizedRowPrefetch(0): that walk here too, for A/B runs).
int g_q_row_prefetch = 1;

template <int64_t RowBytes, typename Id, typename Fn>
inline int64_t walk_all_lines(const char* table, uint64_t stride_bytes, const Id* ids,
                              int64_t lo, int64_t hi, int64_t n, int64_t ahead, Fn fn) {
  auto pf = [&](Id id) {
    const char* p = table + static_cast<uint64_t>(static_cast<int64_t>(id)) * stride_bytes;
    for (int64_t b = 0; b < RowBytes; b += 64) prefetch(p + b);
    prefetch(p + RowBytes - 1);
  };
  if (hi + ahead <= n) {
    for (int64_t k = lo; k < hi; ++k) {
      pf(ids[k + ahead]);
      if (!fn(k)) return k;
    }
  } else {
    for (int64_t k = lo; k < hi; ++k) {
      pf(ids[k + ahead < n ? k + ahead : n - 1]);
      if (!fn(k)) return k;
    }
  }
  return -1;
}

template <int K, typename Id, int NV, bool HasW>
int64_t qbag_fused(const char* table, uint64_t vocab, int64_t stride_bytes, const Id* ids,
                   const int64_t* offsets, int64_t num_rows, const float* weights, int mode,
                   bool prune_ids, bool prune_w, float* out, int64_t out_stride,
                   const QCtx& ctx) {
  constexpr int kPf = fused_prefetch_shape<K, NV>();
  constexpr int64_t row_bytes = fused_row_bytes<K, NV>();
  const int64_t n = offsets[num_rows];
  const int64_t lines = row_lines(table, stride_bytes, row_bytes);
  const int64_t ahead = entries_ahead(lines);
  const uint64_t ustride = static_cast<uint64_t>(stride_bytes);
  constexpr int64_t last = (row_bytes - 1) / 4;
  const float* tf = reinterpret_cast<const float*>(table);  // addresses only
  for (int64_t k = offsets[0]; k < offsets[0] + ahead && k < n; ++k) {
    if (static_cast<uint64_t>(static_cast<int64_t>(ids[k])) < vocab) {
      const char* p = table + static_cast<int64_t>(ids[k]) * stride_bytes;
      prefetch(p);
      prefetch(p + row_bytes - 1);
    }
  }
  const bool all_lines = row_bytes > 132 && g_q_row_prefetch;
  return fused_bags<Id, NV, false, HasW>(
      ids, weights, vocab, prune_ids, prune_w, mode, 0, num_rows, out, out_stride,
      [&](vf* acc, vf&, Id id, float w) {
        const Dec<K> row(table + static_cast<int64_t>(id) * stride_bytes, ctx);
        if (HasW) {
          const vf wv = splat(w);
          for (int v = 0; v < NV; ++v) acc[v] += wv * row.at(v * kV);
        } else {
          for (int v = 0; v < NV; ++v) acc[v] += row.at(v * kV);
        }
      },
      [&](int64_t r, auto& entry) {
        return all_lines ? walk_all_lines<row_bytes>(table, ustride, ids, offsets[r],
                                                     offsets[r + 1], n, ahead, entry)
                         : walk<kPf>(tf, ustride, last, ids, offsets[r], offsets[r + 1], n,
                                     ahead, entry);
      });
}

template <typename Id>
using QFusedFn = int64_t (*)(const char*, uint64_t, int64_t, const Id*, const int64_t*, int64_t,
                             const float*, int, bool, bool, float*, int64_t, const QCtx&);

template <int K, typename Id, int NV>
QFusedFn<Id> qfused_with(bool has_w) {
  return has_w ? &qbag_fused<K, Id, NV, true> : &qbag_fused<K, Id, NV, false>;
}

template <int K, typename Id>
QFusedFn<Id> qfused_nv(int64_t nv, bool has_w) {
  switch (nv) {
    case 1:
      return qfused_with<K, Id, 1>(has_w);
    case 2:
      return qfused_with<K, Id, 2>(has_w);
    case 4:
      return qfused_with<K, Id, 4>(has_w);
    case 8:
      return kMaxNV >= 8 ? qfused_with<K, Id, (kMaxNV >= 8 ? 8 : 1)>(has_w) : nullptr;
    case 16:
      return kMaxNV >= 16 ? qfused_with<K, Id, (kMaxNV >= 16 ? 16 : 1)>(has_w) : nullptr;
    default:
      return nullptr;
  }
}

// The one-pass kernel for this format and dim, or nullptr (qbag's two passes).
template <typename Id>
QFusedFn<Id> qfused_for(int kind, int64_t dim, bool has_w) {
  if (!g_fused || dim <= 0 || dim % kV != 0) return nullptr;
  const int64_t nv = dim / kV;
  switch (kind) {
    case kQF16:
      return qfused_nv<kQF16, Id>(nv, has_w);
    case kQBF16:
      return qfused_nv<kQBF16, Id>(nv, has_w);
    case kQInt8:
      return qfused_nv<kQInt8, Id>(nv, has_w);
    case kQCodes:
      return qfused_nv<kQCodes, Id>(nv, has_w);
    default:
      return nullptr;
  }
}

template <typename Id, bool HasW>
QBagFn qbag_for(int pf) {
  switch (pf) {
    case 1:
      return &qbag_erased<Id, HasW, 1>;
    case 2:
      return &qbag_erased<Id, HasW, 2>;
    case 3:
      return &qbag_erased<Id, HasW, 3>;
    default:
      return &qbag_erased<Id, HasW, 4>;
  }
}

// The walk's prefetch shape for rows of `row_bytes` (see prefetch_shape in serving.cc):
// rows of one line at most their first and last byte, of up to 132 bytes (at most three
// lines) those and the next line, longer rows their first line.
template <typename Id>
QBagFn qpick(int64_t row_bytes, bool aligned, bool has_w) {
  int pf = row_bytes <= 64 ? 2 : row_bytes <= 132 ? 3 : 1;
  if (aligned && g_aligned_prefetch) pf = aligned_prefetch_shape(pf);
  return has_w ? qbag_for<Id, true>(pf) : qbag_for<Id, false>(pf);
}

}  // namespace
}  // namespace embedmesh_serving

extern "C" {

int64_t EmServingBagQ(const void* table, int64_t vocab, int64_t dim, int64_t stride_bytes,
                      const void* ids, int32_t ids_are_64, const int64_t* offsets,
                      int64_t num_rows, const float* weights, int32_t mode, int32_t prune_ids,
                      int32_t prune_weights, float* out, int64_t out_stride,
                      const int64_t* format) {
  using namespace embedmesh_serving;
  const int kind = static_cast<int>(format[0]);
  const float* values = reinterpret_cast<const float*>(static_cast<uintptr_t>(format[1]));
  int64_t row_bytes;
  switch (kind) {
    case kQF16:
    case kQBF16:
      row_bytes = 2 * dim;
      break;
    case kQInt8:
      row_bytes = dim + 8;
      break;
    case kQCodes:
      if (values == nullptr) return INT64_MIN;
      row_bytes = dim;
      break;
    default:
      return INT64_MIN;  // an unknown format
  }
  if (dim <= 0 || stride_bytes < row_bytes) return INT64_MIN;
  const bool has_w = weights != nullptr;
  const char* t = static_cast<const char*>(table);
  const QCtx ctx{dim, values};
  if (ids_are_64) {
    if (auto f = qfused_for<int64_t>(kind, dim, has_w)) {
      const int64_t r = f(t, static_cast<uint64_t>(vocab), stride_bytes,
                          static_cast<const int64_t*>(ids), offsets, num_rows, weights, mode,
                          prune_ids != 0, prune_weights != 0 && has_w, out, out_stride, ctx);
      fence_streams();
      return r;
    }
  } else if (auto f = qfused_for<int32_t>(kind, dim, has_w)) {
    const int64_t r = f(t, static_cast<uint64_t>(vocab), stride_bytes,
                        static_cast<const int32_t*>(ids), offsets, num_rows, weights, mode,
                        prune_ids != 0, prune_weights != 0 && has_w, out, out_stride, ctx);
    fence_streams();
    return r;
  }
  const QPlan plan(kind, dim, has_w, values);
  const bool aligned = rows_on_lines(t, stride_bytes) && row_bytes <= 128;
  const QBagFn fn = ids_are_64 ? qpick<int64_t>(row_bytes, aligned, has_w)
                               : qpick<int32_t>(row_bytes, aligned, has_w);
  const int64_t r = fn(t, static_cast<uint64_t>(vocab), stride_bytes, row_bytes, ids, offsets,
                       num_rows, weights, mode, prune_ids != 0, prune_weights != 0 && has_w, out,
                       out_stride, plan);
  fence_streams();
  return r;
}

int64_t EmServingSetQuantizedRowPrefetch(int64_t on) {
  return embedmesh_serving::replace_setting(embedmesh_serving::g_q_row_prefetch, on != 0);
}

}  // extern "C"
