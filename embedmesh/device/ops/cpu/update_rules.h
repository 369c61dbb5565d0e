// The optimizer rules of the fused CPU updates (update.cc): storage types and one rule
// struct per optimizer (its slot count, whether its slot holds one value a row, its
// hyperparameters, its float32 arithmetic per element and, for a row-wise rule, per row).
// Each mirrors its class's `_rule` in embedmesh.optimizers; its `kName` is that class's
// `_FUSED_KERNEL`. Included by update.cc only.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace embedmesh {
namespace {

// Storage types (Bf16, F16, DType, Widen, Load): storage.h, through common.h.

template <typename T>
inline T Nearest(float x);
template <>
inline Bf16 Nearest<Bf16>(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t nan = (b >> 16) | 0x40u, rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return Bf16{static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded)};
}
// Round to nearest even through float32 additions that round at fp16's spacing (M.
// Dukhan's FP16 library, fp16_ieee_from_fp32_value): subnormals and overflow included.
template <>
inline F16 Nearest<F16>(float x) {
  uint32_t w;
  std::memcpy(&w, &x, 4);
  float base = (std::fabs(x) * 0x1p112f) * 0x1p-110f;
  const uint32_t shl1 = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1 & 0xFF000000u, 0x71000000u);
  const uint32_t magic = (bias >> 1) + 0x07800000u;
  float mf;
  std::memcpy(&mf, &magic, 4);
  base = mf + base;
  uint32_t bits;
  std::memcpy(&bits, &base, 4);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  const uint32_t nan = 0u - static_cast<uint32_t>(shl1 > 0xFF000000u);
  return F16{static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan))};
}

// device/rounding.py's generator: lowbias32 (Wellons) absorbed over the words (seed, step,
// field, table, row, column), each word w as Mix(h ^ Mix(w + key)), its key one of these.
inline uint32_t Mix(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  return h ^ (h >> 16);
}
constexpr uint32_t kStepKey = 0x85EBCA6Bu, kFieldKey = 0xC2B2AE35u, kTableKey = 0x27D4EB2Fu,
                   kRowKey = 0x165667B1u, kColumnKey = 0xD3A2646Cu;
inline uint32_t Absorb(uint32_t h, uint32_t word, uint32_t key) {
  return Mix(h ^ Mix(word + key));
}

inline bool Finite(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x7F800000u) != 0x7F800000u;
}

// rounding.stochastic_round of x to T with the value's random bits: the nearest value, or
// the neighbour on x's other side with probability |x - near| / |other - near| (the
// uniform (bits >> 8) * 2^-24); x already representable, NaN, infinities and values whose
// neighbours are not both finite keep the nearest rounding. Branch-free (selects, bitwise
// ors), so that the row loops vectorise around it.
template <typename T>
inline T StochasticRound(float x, uint32_t bits) {
  const uint16_t near = Nearest<T>(x).code;
  const float nf = Widen(T{near});
  const uint16_t step = std::fabs(nf) < std::fabs(x) ? 1 : 0xFFFF;  // towards x
  const uint16_t other = static_cast<uint16_t>(near + step);
  const float of = Widen(T{other});
  const float p = std::fabs(x - nf) / std::fabs(of - nf);
  const float u = static_cast<float>(bits >> 8) * 0x1p-24f;
  const bool keep = (nf == x) | !Finite(x) | !Finite(nf) | !Finite(of);
  return T{(keep | (u >= p)) ? near : other};
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define EM_F16_ROUND_VECTOR 1
// StochasticRound<F16> of 16 values at once (`m` the lanes to store), bit for bit the
// scalar one: the hardware's conversions (exact float16 -> float32; float32 -> float16 to
// nearest, ties to even, overflow to infinity, as Nearest<F16>; a NaN then made
// Nearest's quiet NaN) in place of the integer arithmetic the scalar loops vectorise, the
// neighbour rule the same. `bits` the values' random bits (Mix(h ^ column word)).
inline void StochasticRoundF16x16(const float* x, const uint32_t* bits, uint16_t* out,
                                  __mmask16 m) {
  const __m512 vx = _mm512_maskz_loadu_ps(m, x);
  const __m512i xi = _mm512_castps_si512(vx);
  __m256i near = _mm512_cvtps_ph(vx, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(vx, vx, _CMP_UNORD_Q);
  const __m256i qnan = _mm256_or_si256(
      _mm512_cvtepi32_epi16(_mm512_and_si512(_mm512_srli_epi32(xi, 16),
                                             _mm512_set1_epi32(0x8000))),
      _mm256_set1_epi16(0x7E00));
  near = _mm256_mask_blend_epi16(nan, near, qnan);
  const __m512 nf = _mm512_cvtph_ps(near);
  const __m512 ax = _mm512_abs_ps(vx), anf = _mm512_abs_ps(nf);
  const __mmask16 towards_up = _mm512_cmp_ps_mask(anf, ax, _CMP_LT_OQ);
  const __m256i step =
      _mm256_mask_blend_epi16(towards_up, _mm256_set1_epi16(-1), _mm256_set1_epi16(1));
  const __m256i other = _mm256_add_epi16(near, step);
  const __m512 of = _mm512_cvtph_ps(other);
  // p = |x - nf| / s, s = |of - nf| a power of two in [2^-24, 2^5] when both are finite
  // (else the value is kept, whatever p is): times 1 / s, exact from s's exponent, it is
  // the quotient bit for bit, with no division's latency
  const __m512i ex = _mm512_set1_epi32(0x7F800000);
  const __m512 spacing = _mm512_abs_ps(_mm512_sub_ps(of, nf));
  const __m512 inverse = _mm512_castsi512_ps(_mm512_sub_epi32(
      _mm512_set1_epi32(254 << 23), _mm512_and_si512(_mm512_castps_si512(spacing), ex)));
  const __m512 p = _mm512_mul_ps(_mm512_abs_ps(_mm512_sub_ps(vx, nf)), inverse);
  const __m512i bi = _mm512_maskz_loadu_epi32(m, bits);
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bi, 8)),
                                 _mm512_set1_ps(0x1p-24f));
  auto infinite = [&](__m512 v) {
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), ex), ex);
  };
  const __mmask16 keep = _mm512_cmp_ps_mask(nf, vx, _CMP_EQ_OQ) | infinite(vx) |
                         infinite(nf) | infinite(of) | _mm512_cmp_ps_mask(u, p, _CMP_GE_OQ);
  const __m256i result = _mm256_mask_blend_epi16(keep, other, near);
  _mm256_mask_storeu_epi16(out, m, result);
}
#endif

// A value stored into an array of type S: float32 as it is; bfloat16 / float16 rounded
// stochastically with the bits Mix(h ^ column_word) (h: the row's and array's words
// absorbed, column_word: Mix(column + kColumnKey)).
template <typename S>
inline S Put(float x, uint32_t h, uint32_t column_word) {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    return StochasticRound<S>(x, Mix(h ^ column_word));
  }
}

// The options every optimizer has, in `update_rows`'s order around the rule.
struct Common {
  float clip_lo, clip_hi, wd, wmin, wmax;
  bool has_wd, wd_lr;
  static Common Read(AttrReader& a) {
    Common c;
    c.clip_lo = a.F("clip_lo"), c.clip_hi = a.F("clip_hi"), c.wd = a.F("wd");
    c.has_wd = a.B("has_wd"), c.wd_lr = a.B("wd_lr");
    c.wmin = a.F("wmin"), c.wmax = a.F("wmax");
    return c;
  }
  float EffectiveWd(float lr) const { return has_wd ? (wd_lr ? wd * lr : wd) : 0.0f; }
};

// ---------------------------------------------------------------------------------------
// Optimizer rules: float32 arithmetic on a clipped gradient g, the old weight w, the slot
// values s[] (read and written) and the learning rate lr; `Step<V>` returns the new weight
// before weight decay and clamping. Each mirrors its class's `_rule` in embedmesh.optimizers
// operation by operation; the constants computed in Python doubles there (1 - beta, ...)
// arrive as attributes computed the same way.
// A rule's options that choose between code paths make its variant V (`Variant(p)`, one of
// kVariants), a template argument: a branch inside the element loop would keep it scalar
// (a conditional sqrt or division is never if-converted under IEEE trapping semantics), so
// the Updater instantiates one vectorisable loop per variant and picks it per call.

// What a rule whose slots hold one value an element (every rule but RowWiseAdagrad)
// declares.
struct ElementWise {
  static constexpr bool kRowWise = false;
};

// What a rule with no options of its own (SGD, Adagrad) declares: no parameters, one
// variant, one slot value an element.
struct NoOptions : ElementWise {
  static constexpr int kVariants = 1;
  struct Params {};
  static Params Read(AttrReader&) { return {}; }
  static int Variant(const Params&) { return 0; }
};

struct Sgd : NoOptions {
  static constexpr const char* kName = "sgd";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 0;
  template <int V>
  static inline float Step(const Params&, float w, float g, float lr, float*, float) {
    return w - lr * g;
  }
};

struct Adagrad : NoOptions {
  static constexpr const char* kName = "adagrad";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 1;  // accumulators
  template <int V>
  static inline float Step(const Params&, float w, float g, float lr, float* s, float) {
    const float a = s[0] + g * g;
    s[0] = a;
    return w - lr * g * (1.0f / std::sqrt(a));
  }
};

struct AdagradMomentum : ElementWise {
  static constexpr const char* kName = "adagrad_momentum";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 2;  // accumulators, momenta
  struct Params {
    float momentum, beta2, one_minus_beta2, epsilon, neg_inv_exponent;
    bool nesterov, beta2_is_one, exponent_is_two;
  };
  static Params Read(AttrReader& a) {
    Params p;
    p.momentum = a.F("momentum"), p.beta2 = a.F("beta2");
    p.one_minus_beta2 = a.F("one_minus_beta2"), p.epsilon = a.F("epsilon");
    p.neg_inv_exponent = a.F("neg_inv_exponent"), p.nesterov = a.B("use_nesterov");
    p.beta2_is_one = a.B("beta2_is_one"), p.exponent_is_two = a.B("exponent_is_two");
    return p;
  }
  // bit 0: beta2 == 1, bit 1: exponent == 2, bit 2: Nesterov
  static constexpr int kVariants = 8;
  static int Variant(const Params& p) {
    return (p.beta2_is_one ? 1 : 0) | (p.exponent_is_two ? 2 : 0) | (p.nesterov ? 4 : 0);
  }
  template <int V>
  static inline float Step(const Params& p, float w, float g, float lr, float* s, float) {
    float a = s[0];
    if constexpr ((V & 1) != 0) {
      a = a + g * g;
    } else {
      a = p.beta2 * a + p.one_minus_beta2 * g * g;
    }
    float scale;
    if constexpr ((V & 2) != 0) {
      scale = 1.0f / std::sqrt(a + p.epsilon);
    } else {
      scale = std::pow(a + p.epsilon, p.neg_inv_exponent);
    }
    const float sg = scale * g;
    const float m = p.momentum * s[1] + sg;
    float step;
    if constexpr ((V & 4) != 0) {
      step = p.momentum * m + sg;
    } else {
      step = m;
    }
    s[0] = a, s[1] = m;
    return w - lr * step;
  }
};

struct Adam : ElementWise {
  static constexpr const char* kName = "adam";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 2;  // momenta, velocities
  struct Params {
    float b1, one_minus_b1, b2, one_minus_b2, eps_inside, eps_outside;
    bool sum_inside_sqrt;
  };
  static Params Read(AttrReader& a) {
    Params p;
    p.b1 = a.F("beta_1"), p.one_minus_b1 = a.F("one_minus_beta_1");
    p.b2 = a.F("beta_2"), p.one_minus_b2 = a.F("one_minus_beta_2");
    p.eps_inside = a.F("epsilon_squared"), p.eps_outside = a.F("epsilon");
    p.sum_inside_sqrt = a.B("sum_inside_sqrt");
    return p;
  }
  static constexpr int kVariants = 2;  // sum_inside_sqrt
  static int Variant(const Params& p) { return p.sum_inside_sqrt ? 1 : 0; }
  template <int V>
  static inline float Step(const Params& p, float w, float g, float lr, float* s, float) {
    const float m = p.b1 * s[0] + p.one_minus_b1 * g;
    const float v = p.b2 * s[1] + p.one_minus_b2 * g * g;
    float denom;
    if constexpr (V == 1) {
      denom = std::sqrt(v + p.eps_inside);
    } else {
      denom = std::sqrt(v) + p.eps_outside;
    }
    s[0] = m, s[1] = v;
    return w - lr * m / denom;
  }
};

// x**q for x >= 0 with 0**q == 0 (q > 0), x**0 == 1: optimizers._pow.
template <int kKind>
inline float PowNonNeg(float x, float q) {
  if constexpr (kKind == 0) return 1.0f;          // q == 0
  if constexpr (kKind == 1) return x;             // q == 1
  if constexpr (kKind == 2) return std::sqrt(x);  // q == 0.5
  if constexpr (kKind == 3) return x > 0.0f ? std::pow(x, q) : 0.0f;
}

// TF's FTRL-Proximal (optimizers.FTRL). Per element, with q = -learning_rate_power:
// a' = a + g^2, p = a'^q, dp = p - a^q; default: lin += g - dp * w / lr,
// d = (p + beta) / lr + 2 * l2; multiply_linear_by_learning_rate: lin += lr * g - dp * w,
// d = p + 2 * lr * l2 + beta; then w = (clamp(lin, -bound, bound) - lin) / d (0 where d is
// 0), bound = l1 (times lr in the second form). The common q = 0.5 takes two square roots
// (PowNonNeg); the divisions by lr are products with 1 / lr (AtLr, once a call), so an
// element divides once: 2 square roots and 1 division where the plain form has 3
// divisions. (Within a few float32 ulps of `_rule`'s order: tests/device/test_ops.py compares them
// at 2e-6.) The division is unconditional and its quotient selected after, so the loop
// needs no masked division and stays vectorised in every context.
struct Ftrl : ElementWise {
  static constexpr const char* kName = "ftrl";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 2;  // accumulators, linears
  struct Params {
    float q, l1, l2, two_l2, beta;
    int q_kind;
    bool mult_linear;
    float inv_lr, lr_l1, two_l2_lr;  // of the call's learning rate (AtLr)
  };
  static Params Read(AttrReader& a) {
    Params p;
    p.q = a.F("q"), p.l1 = a.F("l1"), p.l2 = a.F("l2"), p.two_l2 = a.F("two_l2");
    p.beta = a.F("beta"), p.q_kind = static_cast<int>(a.I("q_kind"));
    p.mult_linear = a.B("multiply_linear_by_learning_rate");
    p.inv_lr = p.lr_l1 = p.two_l2_lr = 0.0f;
    return p;
  }
  static void AtLr(Params& p, float lr) {
    p.inv_lr = 1.0f / lr;
    p.lr_l1 = lr * p.l1;
    p.two_l2_lr = 2.0f * lr * p.l2;  // (2 lr) l2, as _rule
  }
  // bits 0-1: the power's kind (PowNonNeg), bit 2: multiply_linear_by_learning_rate,
  // bit 3: l1 == 0
  static constexpr int kVariants = 16;
  static int Variant(const Params& p) {
    return (p.q_kind & 3) | (p.mult_linear ? 4 : 0) | (p.l1 == 0.0f ? 8 : 0);
  }
  template <int V>
  static inline float Step(const Params& p, float w, float g, float lr, float* s, float) {
    const float a = s[0];
    const float a_new = a + g * g;
    const float pw = PowNonNeg<V & 3>(a_new, p.q);
    const float dp = pw - PowNonNeg<V & 3>(a, p.q);
    float lin = s[1], bound, d;
    if constexpr ((V & 4) != 0) {
      lin = lin + lr * g - dp * w;
      bound = p.lr_l1;
      d = pw + p.two_l2_lr + p.beta;
    } else {
      lin = lin + g - dp * w * p.inv_lr;
      bound = p.l1;
      d = (pw + p.beta) * p.inv_lr + p.two_l2;
    }
    float n;
    if constexpr ((V & 8) != 0) {
      n = -lin;
    } else {
      float c = lin < -bound ? -bound : lin;
      c = c > bound ? bound : c;
      n = c - lin;
    }
    s[0] = a_new, s[1] = lin;
    const float q = n / d;  // inf or nan where d == 0: not selected
    return d != 0.0f ? q : 0.0f;
  }
};

// FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator a row, a += mean(g'^2) over the row's
// d columns (its table's own dim: stacks of it are never padded), w -= lr / (sqrt(a) + eps) * g', with
// g' = g + l2 * w (FBGEMM's L2 weight-decay mode; l2 = 0: none).
struct RowWiseAdagrad {
  static constexpr const char* kName = "rowwise_adagrad";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 1;  // accumulators, [rows, 1]
  static constexpr bool kRowWise = true;
  static constexpr int kVariants = 1;
  struct Params {
    float epsilon, l2;
  };
  static Params Read(AttrReader& a) {
    Params p;
    p.epsilon = a.F("epsilon"), p.l2 = a.F("l2");
    return p;
  }
  static int Variant(const Params&) { return 0; }
  static inline float Grad(const Params& p, float w, float g) { return g + p.l2 * w; }
  // the row's multiplier lr / (sqrt(a) + eps), given the sum of its g'^2 over its `dim`
  // columns (stacks of this rule are unpadded: the row's width is its table's dim)
  static inline float RowScale(const Params& p, float sum_sq, float dim, float lr, float* a) {
    const float acc = *a + sum_sq / dim;
    *a = acc;
    return lr / (std::sqrt(acc) + p.epsilon);
  }
  template <int V>
  static inline float Step(const Params& p, float w, float g, float, float*, float scale) {
    return w - scale * Grad(p, w, g);
  }
};

}  // namespace
}  // namespace embedmesh
