// Fused sparse optimizer updates, alone and fused with the backward (on one shard, on N
// in-process shards reading their sources' gradients through peers.h, on N shards in
// processes of one host reading them in shared memory through host_peers.h, and from the
// pooled messages of pooled.h).
//
// One implementation per transport, generic over the optimizer and the storage type:
//   - an optimizer is a rule struct (Sgd, Adagrad, ...): its slot count, whether its slot
//     holds one value a row (kRowWise), its hyperparameters read from the call's FFI
//     attributes, and its float32 arithmetic per element (`Step`) and, for a row-wise rule,
//     per row (`RowScale`);
//   - `Updater<Rule, T>` applies a rule to rows of a table of element type T (float now;
//     bfloat16 / float16 drop in through Load / Store), with the common options around
//     the rule: gradient clamp, rule, weight decay, weight clamp;
//   - each transport (Sparse, Backward, FromSources, FromHostSources, Pooled, HostPooled)
//     is a template over the rule that finds the rows and their summed gradients and calls
//     `Updater::Row` on each;
//   - the FFI handlers are generated for every (transport, rule) pair at the end of this
//     file (EM_FOR_EACH_RULE x EM_DEFINE_*), named Em<Transport><Rule>.
// Every handler takes its fixed arguments first, then the state: the table and the rule's
// slots (the last 1 + kSlots arguments, aliased to the 1 + kSlots results), and all its
// attributes as one dictionary. The arithmetic is that of `embedmesh.optimizers`
// (`Optimizer.update_rows_at_lr`), in float32, in the same order (except FTRL's divisions by
// lr, products with 1 / lr here: see Ftrl), with no FMA contraction (-ffp-contract=off).
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "common.h"
#include "host_peers.h"
#include "peers.h"
#include "pooled.h"

namespace embedmesh {
namespace {

// ---------------------------------------------------------------------------------------
// Storage types: the arithmetic is float32 whatever the table holds.

template <typename T>
inline float Load(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T Store(float x) {
  return static_cast<T>(x);
}

template <typename T>
struct DType;
template <>
struct DType<float> {
  static constexpr ffi::DataType kType = ffi::DataType::F32;
};

// ---------------------------------------------------------------------------------------
// Attributes

// Reads named scalars from a call's attribute dictionary, remembering the first failure.
class AttrReader {
 public:
  explicit AttrReader(const ffi::Dictionary& d) : d_(d) {}
  float F(const char* name) { return Get<float>(name, 0.0f); }
  bool B(const char* name) { return Get<int32_t>(name, 0) != 0; }
  int64_t I(const char* name) { return Get<int64_t>(name, 0); }
  std::string_view S(const char* name) { return Get<std::string_view>(name, {}); }
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

struct Sgd {
  static constexpr const char* kName = "sgd";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 0;
  static constexpr bool kRowWise = false;
  static constexpr int kVariants = 1;
  struct Params {};
  static Params Read(AttrReader&) { return {}; }
  static int Variant(const Params&) { return 0; }
  template <int V>
  static inline float Step(const Params&, float w, float g, float lr, float*, float) {
    return w - lr * g;
  }
};

struct Adagrad {
  static constexpr const char* kName = "adagrad";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 1;  // accumulators
  static constexpr bool kRowWise = false;
  static constexpr int kVariants = 1;
  struct Params {};
  static Params Read(AttrReader&) { return {}; }
  static int Variant(const Params&) { return 0; }
  template <int V>
  static inline float Step(const Params&, float w, float g, float lr, float* s, float) {
    const float a = s[0] + g * g;
    s[0] = a;
    return w - lr * g * (1.0f / std::sqrt(a));
  }
};

struct AdagradMomentum {
  static constexpr const char* kName = "adagrad_momentum";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 2;  // accumulators, momenta
  static constexpr bool kRowWise = false;
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

struct Adam {
  static constexpr const char* kName = "adam";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 2;  // momenta, velocities
  static constexpr bool kRowWise = false;
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
// divisions. (Within a few float32 ulps of `_rule`'s order: tests/test_ops.py compares them
// at 2e-6.) The division is unconditional and its quotient selected after, so the loop
// needs no masked division and stays vectorised in every context.
struct Ftrl {
  static constexpr const char* kName = "ftrl";  // Optimizer._FUSED_KERNEL
  static constexpr int kSlots = 2;  // accumulators, linears
  static constexpr bool kRowWise = false;
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

// ---------------------------------------------------------------------------------------
// The row update: one rule on one table of element type T, with the common options.

template <class Rule, typename T>
struct Updater {
  static constexpr int kSlots = Rule::kSlots;
  T* w = nullptr;
  T* slot[kSlots > 0 ? kSlots : 1] = {};
  int64_t rows = 0, d = 0, slot_width = 0;
  float lr = 0.0f, wd = 0.0f;
  Common c;
  typename Rule::Params p;

  inline float Clip(float g) const {
    g = g < c.clip_lo ? c.clip_lo : g;
    return g > c.clip_hi ? c.clip_hi : g;
  }

  inline void Prefetch(int64_t r) const {
    PrefetchWrite(reinterpret_cast<char*>(w + r * d), sizeof(T) * d);
    for (int j = 0; j < kSlots; ++j)
      PrefetchWrite(reinterpret_cast<char*>(slot[j] + r * slot_width), sizeof(T) * slot_width);
  }

  // Row r of the table and its slots, given its summed gradient gr [d]: the loop of the
  // rule's variant, with or without weight decay. A rule of one variant has its two loops
  // inlined into the transport's; a rule of several calls the loop `Select` chose for the
  // call through `row_fn`: each is then a function of its own, compiled (and vectorised)
  // alone. Inlined into the transports, GCC threaded some of FTRL's 32 loops through the
  // select before its division and left them scalar (4x slower, which ones changing with
  // the code around them), and the choice cost a chain of up to 32 compares a row.
  using RowFn = void (*)(const Updater&, int64_t, const float*);
  RowFn row_fn = nullptr;

  inline void Row(int64_t r, const float* __restrict__ gr) const {
    if constexpr (Rule::kVariants == 1) {
      if (c.has_wd) return RowLoop<0, true>(r, gr);
      return RowLoop<0, false>(r, gr);
    } else {
      row_fn(*this, r, gr);
    }
  }

  // Chooses the call's loop (after p and c are read).
  void Select() { row_fn = RowFns(std::make_integer_sequence<int, 2 * Rule::kVariants>())[Index()]; }
  int Index() const { return Rule::Variant(p) * 2 + (c.has_wd ? 1 : 0); }

  template <int kV>
  __attribute__((noinline)) static void RowAt(const Updater& u, int64_t r, const float* gr) {
    u.template RowLoop<kV / 2, (kV % 2) != 0>(r, gr);
  }
  template <int... kV>
  static const RowFn* RowFns(std::integer_sequence<int, kV...>) {
    static const RowFn fns[] = {&RowAt<kV>...};
    return fns;
  }

  template <int kVariant, bool kWd>
  inline void RowLoop(int64_t r, const float* __restrict__ gr) const {
    RowKernel<kVariant, kWd>(w + r * d, kSlots > 0 ? slot[0] + r * slot_width : nullptr,
                             kSlots > 1 ? slot[kSlots > 1 ? 1 : 0] + r * slot_width : nullptr,
                             gr);
  }

  // The row's arrays as restrict parameters (no aliasing to check at run time).
  template <int kVariant, bool kWd>
  inline void RowKernel(T* __restrict__ wr, T* __restrict__ s0, T* __restrict__ s1,
                        const float* __restrict__ gr) const {
    const int64_t d = this->d;
    const float lr = this->lr, wd = this->wd, wmin = c.wmin, wmax = c.wmax;
    const typename Rule::Params p = this->p;
    float scale = 0.0f;
    if constexpr (Rule::kRowWise) {
      // the sum of g'^2 in 16 fixed lanes, then the lanes in order: a vectorisable
      // reduction of a fixed order (the same sum on every run and machine)
      constexpr int kLanes = 16;
      float lanes[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= d; k += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          const float g = RowWiseGrad(Load(wr[k + j]), Clip(gr[k + j]));
          lanes[j] += g * g;
        }
      }
      for (int j = 0; k < d; ++k, ++j) {
        const float g = RowWiseGrad(Load(wr[k]), Clip(gr[k]));
        lanes[j] += g * g;
      }
      float sum_sq = 0.0f;
      for (int j = 0; j < kLanes; ++j) sum_sq += lanes[j];
      float a = Load(s0[0]);
      scale = Rule::RowScale(p, sum_sq, static_cast<float>(d), lr, &a);
      s0[0] = Store<T>(a);
    }
    const float lo = c.clip_lo, hi = c.clip_hi;
    for (int64_t k = 0; k < d; ++k) {
      float g = gr[k];
      g = g < lo ? lo : g;
      g = g > hi ? hi : g;
      const float w_old = Load(wr[k]);
      float s[kSlots > 0 ? kSlots : 1];
      if constexpr (kSlots > 0 && !Rule::kRowWise) s[0] = Load(s0[k]);
      if constexpr (kSlots > 1) s[1] = Load(s1[k]);
      float wn = Rule::template Step<kVariant>(p, w_old, g, lr, s, scale);
      if constexpr (kSlots > 0 && !Rule::kRowWise) s0[k] = Store<T>(s[0]);
      if constexpr (kSlots > 1) s1[k] = Store<T>(s[1]);
      if constexpr (kWd) wn = wn - wd * w_old;
      wn = wn < wmin ? wmin : wn;
      wn = wn > wmax ? wmax : wn;
      wr[k] = Store<T>(wn);
    }
  }

  inline float RowWiseGrad(float w_old, float g) const {
    if constexpr (Rule::kRowWise) return Rule::Grad(p, w_old, g);
    return g;
  }
};

// Whether a rule has constants of the call's learning rate (`AtLr(Params&, lr)`).
template <class Rule, class = void>
struct HasAtLr : std::false_type {};
template <class Rule>
struct HasAtLr<Rule, std::void_t<decltype(Rule::AtLr(std::declval<typename Rule::Params&>(),
                                                    0.0f))>> : std::true_type {};

// The state of a call: the table and its slots are its last 1 + kSlots arguments, aliased
// to its 1 + kSlots results (copied when XLA did not alias them). Fills `up` (lr from the
// [1] buffer) or returns why not.
template <class Rule, typename T>
ffi::Error MakeUpdater(const ffi::RemainingArgs& state, const ffi::RemainingRets& outs,
                       const ffi::Dictionary& attrs, const float* lr, Updater<Rule, T>* up,
                       const ffi::AnyBuffer** table_out = nullptr) {
  if (state.size() != 1 + Rule::kSlots || outs.size() != 1 + Rule::kSlots)
    return ffi::Error::InvalidArgument("update: expected the table and " +
                                       std::to_string(Rule::kSlots) + " slot(s)");
  AttrReader reader(attrs);
  up->c = Common::Read(reader);
  up->p = Rule::Read(reader);
  if (!reader.error().empty()) return ffi::Error::InvalidArgument("update: " + reader.error());
  for (int i = 0; i <= Rule::kSlots; ++i) {
    auto in = state.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    const ffi::AnyBuffer& b = *in;
    if (b.element_type() != DType<T>::kType)
      return ffi::Error::InvalidArgument("update: table and slots must share the kernel's type");
    T* o = reinterpret_cast<T*>((*out)->untyped_data());
    if (o != b.untyped_data()) std::memcpy(o, b.untyped_data(), b.size_bytes());
    auto dims = b.dimensions();
    const int64_t rows = dims.size() ? dims[0] : 1;
    if (i == 0) {
      up->w = o, up->rows = rows, up->d = RowWidth(dims);
    } else {
      const int64_t width = RowWidth(dims);
      if (rows != up->rows || width != (Rule::kRowWise ? 1 : up->d))
        return ffi::Error::InvalidArgument("update: a slot's shape does not fit the table");
      up->slot[i - 1] = o, up->slot_width = width;
    }
  }
  up->lr = lr[0];
  up->wd = up->c.EffectiveWd(up->lr);
  if constexpr (HasAtLr<Rule>::value) Rule::AtLr(up->p, up->lr);
  up->Select();
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Transports

// ops.sparse_update: rows ids[i] (distinct; PAD and out-of-range skipped) with grads[i].
template <class U>
void SparseUpdate(const U& up, const int32_t* id, int64_t n, const float* g) {
  const int64_t grain = 2048, rows = up.rows, d = up.d;
  ParallelFor(NumChunks(n, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(n, lo + grain);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        const int64_t r = id[i + kPrefetch];
        if (r >= 0 && r < rows) up.Prefetch(r);
      }
      const int64_t r = id[i];
      if (r < 0 || r >= rows) continue;
      up.Row(r, g + i * d);
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

template <class U>
void BackwardUpdate(const U& up, const int32_t* id, int64_t nu, const float* act, int64_t nr,
                    const int32_t* prow, const int32_t* puniq, const float* gain, int64_t np) {
  const int64_t rows = up.rows, d = up.d;
  std::vector<int64_t> beg(nu + 1, 0), cnt(nu, 0);
  const bool ok = GroupPairs(id, nu, prow, nr, puniq, np, beg.data(), cnt.data());
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
      if (r >= 0 && r < rows) up.Row(r, g.data());
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
        if (r >= 0 && r < rows) up.Prefetch(r);
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
      up.Row(r, g.data());
    }
  });
}

// What one source device lends its owners in the fused N-shard backward (peers.h).
struct SourceBatch {
  const int32_t* ids;    // [n, u] the rows it asked of each shard (ascending, PAD padded)
  const float* act;      // [nr, d] its activation gradients
  const int32_t* prow;   // [n, p] activation row of each pair
  const int32_t* puniq;  // [n, p] position of each pair's id in ids[shard]
  const float* gain;     // [n, p]
  int64_t u, p, nr;
};

// N in-process shards, fused backward + update on the owner: for each distinct row this
// shard was asked for by any source, the gradient sum over sources (in source order) of
// each source's pair-order sum over its pairs of that row, then one update of the row.
// Equal to backward (per-source segment sums) -> exchange -> dedup_sum -> sparse_update,
// with no [N, U, D] gradient buffer, no exchange and no dedup output. A source whose pairs
// are not grouped by slot (see GroupPairs) gets its per-slot sums materialised first.
template <class U>
void BackwardUpdateFromSources(const U& up, int64_t me,
                               const std::vector<const SourceBatch*>& src) {
  const int64_t rows = up.rows, d = up.d;
  const int64_t n = static_cast<int64_t>(src.size());
  struct Part {  // source r's partition for this shard
    const int32_t* ids;
    const int32_t* prow;
    const int32_t* puniq;
    const float* gain;
    const float* act;
    int64_t u, p, nr;
    std::vector<int64_t> beg, cnt;
    std::vector<float> sums;  // [u, d] when the pairs are not grouped
  };
  std::vector<Part> parts(n);
  for (int64_t r = 0; r < n; ++r) {
    const SourceBatch& b = *src[r];
    Part& q = parts[r];
    q.ids = b.ids + me * b.u;
    q.prow = b.prow + me * b.p;
    q.puniq = b.puniq + me * b.p;
    q.gain = b.gain + me * b.p;
    q.act = b.act;
    q.u = b.u, q.p = b.p, q.nr = b.nr;
    q.beg.assign(q.u + 1, 0);
    q.cnt.assign(q.u, 0);
    if (!GroupPairs(q.ids, q.u, q.prow, q.nr, q.puniq, q.p, q.beg.data(), q.cnt.data())) {
      q.beg.clear();
      q.sums.assign(q.u * d, 0.0f);
      for (int64_t k = 0; k < q.p; ++k) {
        const int64_t ar = q.prow[k], s = q.puniq[k];
        if (ar < 0 || ar >= q.nr || s < 0 || s >= q.u) continue;
        for (int64_t j = 0; j < d; ++j) q.sums[s * d + j] += q.gain[k] * q.act[ar * d + j];
      }
    }
  }
  // The distinct rows asked of this shard, ascending, each with its (source, slot) list
  // in source order: a merge when every list is ascending, else a sort.
  int64_t max_u = 1;
  for (const Part& q : parts) max_u = std::max(max_u, q.u);
  // per source, its valid (row, source * max_u + slot) entries in slot order
  std::vector<std::vector<std::pair<int32_t, int64_t>>> lists(n);
  bool ascending = true;
  size_t total = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < parts[r].u; ++k) {
      const int32_t row = parts[r].ids[k];
      if (row == kPad || row < 0 || row >= rows) continue;
      if (!lists[r].empty() && row <= lists[r].back().first) ascending = false;
      lists[r].emplace_back(row, r * max_u + k);
    }
    total += lists[r].size();
  }
  std::vector<std::pair<int32_t, int64_t>> asked;  // (row, source * max_u + slot)
  asked.reserve(total);
  if (ascending) {  // the host's order: an N-way merge, ties in source order
    std::vector<size_t> at(n, 0);
    for (size_t i = 0; i < total; ++i) {
      int64_t best = -1;
      for (int64_t r = 0; r < n; ++r)
        if (at[r] < lists[r].size() &&
            (best < 0 || lists[r][at[r]].first < lists[best][at[best]].first))
          best = r;
      asked.push_back(lists[best][at[best]++]);
    }
  } else {
    for (const auto& l : lists) asked.insert(asked.end(), l.begin(), l.end());
    std::stable_sort(asked.begin(), asked.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  std::vector<int64_t> starts;
  for (size_t i = 0; i < asked.size(); ++i)
    if (i == 0 || asked[i].first != asked[i - 1].first) starts.push_back(static_cast<int64_t>(i));
  const int64_t distinct = static_cast<int64_t>(starts.size());
  starts.push_back(static_cast<int64_t>(asked.size()));
  const int64_t grain = 1024;
  ParallelFor(NumChunks(distinct, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(distinct, lo + grain);
    std::vector<float> g(d), gr(d);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        const int64_t r = asked[starts[i + kPrefetch]].first;
        up.Prefetch(r);
      }
      std::fill(g.begin(), g.end(), 0.0f);
      for (int64_t e = starts[i]; e < starts[i + 1]; ++e) {
        const Part& q = parts[asked[e].second / max_u];
        const int64_t k = asked[e].second % max_u;
        if (!q.sums.empty()) {
          for (int64_t j = 0; j < d; ++j) g[j] += q.sums[k * d + j];
          continue;
        }
        std::fill(gr.begin(), gr.end(), 0.0f);
        for (int64_t t = q.beg[k], left = q.cnt[k]; left > 0; ++t) {
          const int64_t ar = q.prow[t];
          if (ar < 0 || ar >= q.nr || q.puniq[t] != k) continue;
          --left;
          const float gq = q.gain[t];
          const float* __restrict__ a = q.act + ar * d;
          for (int64_t j = 0; j < d; ++j) gr[j] += gq * a[j];
        }
        for (int64_t j = 0; j < d; ++j) g[j] += gr[j];
      }
      const int64_t r = asked[starts[i]].first;
      up.Row(r, g.data());
    }
  });
}

// An owner's N sources' pooled messages (pooled.h) decoded once, each into a SourceBatch
// (its block of ids, its Rc gradient rows at grads_of(s)).
struct PooledSources {
  std::vector<int32_t> prow, puniq;
  std::vector<float> gain;
  std::vector<SourceBatch> batches;
  std::vector<const SourceBatch*> src;
};

template <typename GradsOf>
void DecodeSources(PooledSources& ps, const int32_t* served, int64_t n, int64_t words,
                   const PooledLayout& l, const GradsOf& grads_of) {
  ps.prow.resize(n * l.p);
  ps.puniq.resize(n * l.p);
  ps.gain.resize(n * l.p);
  ps.batches.resize(n);
  ps.src.resize(n);
  for (int64_t s = 0; s < n; ++s) {
    const int32_t* block = served + s * words;
    for (int64_t q = 0; q < l.p; ++q) {
      const int64_t i = s * l.p + q;
      DecodePair(block, l, q, &ps.puniq[i], &ps.prow[i], &ps.gain[i]);
    }
    ps.batches[s] = SourceBatch{block,   grads_of(s), ps.prow.data() + s * l.p,
                                ps.puniq.data() + s * l.p, ps.gain.data() + s * l.p, l.u, l.p,
                                l.rc};
    ps.src[s] = &ps.batches[s];
  }
}

// ---------------------------------------------------------------------------------------
// The handlers of each transport, generic over the rule and the storage type T.

#define EM_MAKE_UPDATER(lr_buf)                                                  \
  Updater<Rule, T> up;                                                           \
  if (ffi::Error e = MakeUpdater(state, outs, attrs, (lr_buf).typed_data(), &up); \
      e.failure())                                                               \
    return e;

template <class Rule, typename T>
ffi::Error Sparse(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                  ffi::Buffer<ffi::F32> lr, ffi::RemainingArgs state, ffi::RemainingRets outs,
                  ffi::Dictionary attrs) {
  EM_MAKE_UPDATER(lr)
  SparseUpdate(up, ids.typed_data(), ids.element_count(), grads.typed_data());
  return ffi::Error::Success();
}

template <class Rule, typename T>
ffi::Error Backward(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                    ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                    ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr,
                    ffi::RemainingArgs state, ffi::RemainingRets outs, ffi::Dictionary attrs) {
  EM_MAKE_UPDATER(lr)
  auto ad = act.dimensions();
  BackwardUpdate(up, ids.typed_data(), ids.element_count(), act.typed_data(),
                 ad.size() ? ad[0] : 1, prow.typed_data(), puniq.typed_data(),
                 gains.typed_data(), prow.element_count());
  return ffi::Error::Success();
}

// N in-process shards: each source device lends its batch through peers.h and each owner
// applies every source's part for its rows (a replica, data_parallel: every source's one
// partition to its whole table).
template <class Rule, typename T>
ffi::Error FromSources(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                       ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                       ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr,
                       ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::RemainingArgs state, ffi::RemainingRets outs, ffi::Dictionary attrs) {
  EM_MAKE_UPDATER(lr)
  AttrReader a(attrs);
  const int64_t tag = a.I("tag"), n = a.I("n");
  const bool replica = a.I("replica") != 0;
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  auto ad = act.dimensions();
  const int64_t rank = rank_buf.typed_data()[0];
  const int64_t parts = replica ? 1 : n, part = replica ? 0 : rank;
  SourceBatch mine{ids.typed_data(),
                   act.typed_data(),
                   prow.typed_data(),
                   puniq.typed_data(),
                   gains.typed_data(),
                   parts >= 1 ? static_cast<int64_t>(ids.element_count()) / parts : 0,
                   parts >= 1 ? static_cast<int64_t>(prow.element_count()) / parts : 0,
                   ad.size() ? ad[0] : 1};
  const bool apply = keep.typed_data()[0] != 0;
  return WithPeers(tag, n, rank, &mine, "backward", [&](const auto& peers) {
    if (!apply) return;  // a rejected step: every process agrees, no row moves
    std::vector<const SourceBatch*> src(n);
    for (int64_t s = 0; s < n; ++s) src[s] = reinterpret_cast<const SourceBatch*>(peers[s]);
    BackwardUpdateFromSources(up, part, src);
  });
}

hostpeers::HostCall ReadHostCall(AttrReader& a) {
  return hostpeers::HostCall{a.I("job"), a.I("tag"), a.I("n"), 0, a.I("timeout_ms"),
                             a.S("channel")};
}

// The same over N shards in processes of one host: each source device publishes its batch
// (ids, activation gradients, pairs) in its shared-memory segment (host_peers.h) and each
// owner runs BackwardUpdateFromSources on every source's batch read in place: no [N, U, D]
// gradient buffer, one copy of each source's batch.
template <class Rule, typename T>
ffi::Error FromHostSources(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                           ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                           ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr,
                           ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> rank_buf,
                           ffi::RemainingArgs state, ffi::RemainingRets outs,
                           ffi::Dictionary attrs) {
  EM_MAKE_UPDATER(lr)
  AttrReader a(attrs);
  hostpeers::HostCall call = ReadHostCall(a);
  const bool replica = a.I("replica") != 0;
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  auto ad = act.dimensions();
  call.rank = rank_buf.typed_data()[0];
  const int64_t n = call.n;
  const int64_t parts = replica ? 1 : n, part = replica ? 0 : call.rank;
  const int64_t u = parts >= 1 ? static_cast<int64_t>(ids.element_count()) / parts : 0;
  const int64_t p = parts >= 1 ? static_cast<int64_t>(prow.element_count()) / parts : 0;
  const int64_t nr = ad.size() ? ad[0] : 1;
  hostpeers::Packing pack;
  const size_t at_ids = pack.Add(ids.size_bytes()), at_act = pack.Add(act.size_bytes());
  const size_t at_prow = pack.Add(prow.size_bytes()), at_puniq = pack.Add(puniq.size_bytes());
  const size_t at_gain = pack.Add(gains.size_bytes());
  const bool apply = keep.typed_data()[0] != 0;
  return hostpeers::WithHostPeers(
      call, pack.bytes,
      [&](char* seg) {
        std::memcpy(seg + at_ids, ids.typed_data(), ids.size_bytes());
        std::memcpy(seg + at_act, act.typed_data(), act.size_bytes());
        std::memcpy(seg + at_prow, prow.typed_data(), prow.size_bytes());
        std::memcpy(seg + at_puniq, puniq.typed_data(), puniq.size_bytes());
        std::memcpy(seg + at_gain, gains.typed_data(), gains.size_bytes());
      },
      [&](const std::vector<const char*>& peers) {
        if (!apply) return std::string();  // a rejected step: every process agrees
        std::vector<SourceBatch> batches(n);
        std::vector<const SourceBatch*> src(n);
        for (int64_t s = 0; s < n; ++s) {
          const char* b = peers[s];
          batches[s] = SourceBatch{reinterpret_cast<const int32_t*>(b + at_ids),
                                   reinterpret_cast<const float*>(b + at_act),
                                   reinterpret_cast<const int32_t*>(b + at_prow),
                                   reinterpret_cast<const int32_t*>(b + at_puniq),
                                   reinterpret_cast<const float*>(b + at_gain),
                                   u,
                                   p,
                                   nr};
          src[s] = &batches[s];
        }
        BackwardUpdateFromSources(up, part, src);
        return std::string();
      });
}

// ops.pooled_backward_update: an owner's fused backward + update from its N sources'
// pooled messages and the gradients [N * Rc, D] of the rows they feed:
// BackwardUpdateFromSources, no [N * U, D] buffer, no dedup output.
template <class Rule, typename T>
ffi::Error Pooled(ffi::Buffer<ffi::S32> served, ffi::Buffer<ffi::F32> grads,
                  ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep, ffi::RemainingArgs state,
                  ffi::RemainingRets outs, ffi::Dictionary attrs) {
  EM_MAKE_UPDATER(lr)
  AttrReader a(attrs);
  const int64_t u = a.I("u"), rc = a.I("rc"), k = a.I("k");
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  if (keep.typed_data()[0] == 0) return ffi::Error::Success();  // a rejected step
  auto sd = served.dimensions();
  const int64_t d = up.d;
  const int64_t n = sd.size() ? sd[0] : 1;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  PooledSources ps;
  DecodeSources(ps, served.typed_data(), n, words, l,
                [&](int64_t s) { return grads.typed_data() + s * rc * d; });
  BackwardUpdateFromSources(up, 0, ps.src);
  return ffi::Error::Success();
}

// ops.exchange_pooled_backward_update between processes of one host: this rank publishes
// the gradients [N, Rc, D] of the rows each other owner feeds in its segment, and applies
// every source's gradients for its own rows read in place (its own from `grads`):
// pooled_backward_update(..., exchange(grads)), with no exchanged copy.
template <class Rule, typename T>
ffi::Error HostPooled(ffi::Buffer<ffi::S32> served, ffi::Buffer<ffi::F32> grads,
                      ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
                      ffi::Buffer<ffi::S32> rank_buf, ffi::RemainingArgs state,
                      ffi::RemainingRets outs, ffi::Dictionary attrs) {
  EM_MAKE_UPDATER(lr)
  AttrReader a(attrs);
  const int64_t u = a.I("u"), rc = a.I("rc"), k = a.I("k");
  hostpeers::HostCall call = ReadHostCall(a);
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  call.rank = rank_buf.typed_data()[0];
  const int64_t d = up.d, n = call.n, rank = call.rank;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const float* g = grads.typed_data();
  const size_t block = sizeof(float) * rc * d;
  const bool apply = keep.typed_data()[0] != 0;  // every process agrees (the finite check)
  return hostpeers::WithHostPeers(
      call, n * block,
      [&](char* seg) {
        for (int64_t s = 0; s < n; ++s) {
          if (s != rank) std::memcpy(seg + s * block, g + s * rc * d, block);
        }
      },
      [&](const std::vector<const char*>& peers) {
        if (!apply) return std::string();  // a rejected step: no row moves
        PooledSources ps;
        DecodeSources(ps, served.typed_data(), n, words, l, [&](int64_t s) {
          return s == rank ? g + rank * rc * d
                           : reinterpret_cast<const float*>(peers[s] + rank * block);
        });
        BackwardUpdateFromSources(up, 0, ps.src);
        return std::string();
      });
}

#undef EM_MAKE_UPDATER

}  // namespace
}  // namespace embedmesh

// ---------------------------------------------------------------------------------------
// Registration: every (transport, rule) pair, float32 tables, listed (common.h) under the
// target names kernels.py calls; the rules listed here are the optimizers the CPU fuses.

#define EM_F32 ffi::Buffer<ffi::F32>
#define EM_S32 ffi::Buffer<ffi::S32>
#define EM_STATE .RemainingArgs().RemainingRets().Attrs()
#define EM_BIND_Sparse ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_F32>() EM_STATE
#define EM_BIND_PAIRS                                                                      \
  ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_S32>().Arg<EM_S32>().Arg<EM_F32>() \
      .Arg<EM_F32>()
#define EM_BIND_Backward EM_BIND_PAIRS EM_STATE
#define EM_BIND_FromSources EM_BIND_PAIRS.Arg<EM_S32>().Arg<EM_S32>() EM_STATE
#define EM_BIND_FromHostSources EM_BIND_FromSources
#define EM_BIND_Pooled \
  ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_F32>().Arg<EM_S32>() EM_STATE
#define EM_BIND_HostPooled                                                                 \
  ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_F32>().Arg<EM_S32>().Arg<EM_S32>() \
      EM_STATE

// the exported symbols, Em<...><Rule><...>
#define EM_SYMBOL_Sparse(rule) EmSparse##rule
#define EM_SYMBOL_Backward(rule) EmBackward##rule
#define EM_SYMBOL_FromSources(rule) EmBackward##rule##FromSources
#define EM_SYMBOL_FromHostSources(rule) EmBackward##rule##FromHostSources
#define EM_SYMBOL_Pooled(rule) EmPooledBackward##rule
#define EM_SYMBOL_HostPooled(rule) EmHostPooledBackward##rule
// their target names, embedmesh_..._<rule's kName>_... (kernels.py calls them so)
#define EM_TARGET_Sparse(rule) std::string("embedmesh_sparse_") + embedmesh::rule::kName
#define EM_TARGET_Backward(rule) std::string("embedmesh_backward_") + embedmesh::rule::kName
#define EM_TARGET_FromSources(rule) EM_TARGET_Backward(rule) + "_from_sources"
#define EM_TARGET_FromHostSources(rule) EM_TARGET_Backward(rule) + "_from_host_sources"
#define EM_TARGET_Pooled(rule) \
  std::string("embedmesh_pooled_backward_") + embedmesh::rule::kName
#define EM_TARGET_HostPooled(rule) \
  std::string("embedmesh_host_pooled_backward_") + embedmesh::rule::kName
#define EM_DEFINE(transport, rule)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(EM_SYMBOL_##transport(rule),                         \
                                (embedmesh::transport<embedmesh::rule, float>),      \
                                EM_BIND_##transport);                                \
  static const embedmesh::ListHandler em_listed_##transport##_##rule{                \
      EM_TARGET_##transport(rule), reinterpret_cast<void*>(&EM_SYMBOL_##transport(rule))};
#define EM_FOR_EACH_RULE(transport) \
  EM_DEFINE(transport, Sgd)         \
  EM_DEFINE(transport, Adagrad)     \
  EM_DEFINE(transport, AdagradMomentum) \
  EM_DEFINE(transport, Adam)        \
  EM_DEFINE(transport, Ftrl)        \
  EM_DEFINE(transport, RowWiseAdagrad)

EM_FOR_EACH_RULE(Sparse)
EM_FOR_EACH_RULE(Backward)
EM_FOR_EACH_RULE(FromSources)
EM_FOR_EACH_RULE(FromHostSources)
EM_FOR_EACH_RULE(Pooled)
EM_FOR_EACH_RULE(HostPooled)
