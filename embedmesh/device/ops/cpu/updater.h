// The row update of the fused CPU updates (update.cc): `Updater<Rule, T>` applies one rule
// (update_rules.h) to rows of a table of element type T, with the options common to every
// rule (gradient clamp, rule, weight decay, weight clamp). Included by update.cc only.
#pragma once

#include "update_rules.h"

namespace embedmesh {
namespace {

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

}  // namespace
}  // namespace embedmesh
