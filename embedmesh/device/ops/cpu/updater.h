// The row update of the fused CPU updates (update.cc): `Updater<Rule, T, S>` applies one
// rule (update_rules.h) to rows of a table of element type T with slots of type S (float32,
// or T), with the options common to every rule (gradient clamp, rule, weight decay, weight
// clamp); a bfloat16 / float16 array's new values are rounded stochastically with
// device/rounding.py's generator (`Rounding`: the words of the call and of each local row's
// table and logical row). Included by update.cc only.
#pragma once

#include "update_rules.h"

namespace embedmesh {
namespace {

// ---------------------------------------------------------------------------------------
// The stochastic rounding of a call (device/rounding.Rounded): its words, read from the
// int32 array kernels.py passes before the state, `[step, shard, seed_lo, seed_hi, tables,
// then per table (index, local row offset, rows per shard, replicated, k, rotation, first,
// vocabulary size)]`, the last four the mod layout's kernel params (layout/rows.py).

struct Rounding {
  struct Table {
    int64_t index, offset, rows, replicated, k, rotation, first, vocab;
  };
  uint32_t step_hash = 0;  // the seed's and step's words absorbed
  int64_t shard = 0;
  std::vector<Table> tables;
  std::vector<uint32_t> field_words, column_words;  // Mix(word + key) of each

  // Reads `words` [n]; false when they are malformed.
  bool Read(const int32_t* words, int64_t n, int fields, int64_t columns) {
    if (n < 5) return false;
    const int64_t count = words[4];
    if (count < 0 || n != 5 + 8 * count) return false;
    const uint32_t lo = static_cast<uint32_t>(words[2]), hi = static_cast<uint32_t>(words[3]);
    step_hash = Absorb(Mix(lo ^ Mix(hi)), static_cast<uint32_t>(words[0]), kStepKey);
    shard = words[1];
    tables.clear();
    for (int64_t t = 0; t < count; ++t) {
      const int32_t* w = words + 5 + 8 * t;
      tables.push_back(Table{w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]});
      if (w[4] <= 0) return false;
    }
    field_words.resize(fields);
    for (int f = 0; f < fields; ++f) field_words[f] = Mix(static_cast<uint32_t>(f) + kFieldKey);
    column_words.resize(std::max<int64_t>(columns, 1));
    for (int64_t c = 0; c < static_cast<int64_t>(column_words.size()); ++c)
      column_words[c] = Mix(static_cast<uint32_t>(c) + kColumnKey);
    return true;
  }

  // Rounded.logical_rows of local row r: (table index, logical row), (-1, -1) for a row
  // of no table (padding). The mod rule: block * k + (at - first - rotation) mod k, plus
  // the vocabulary size outside the span (`at`: this shard, a replica's canonical first).
  std::pair<int32_t, int32_t> Logical(int64_t r) const {
    int32_t table = -1, row = -1;
    for (const Table& t : tables) {
      const int64_t block = r - t.offset;
      if (block < 0 || block >= t.rows) continue;
      const int64_t at = t.replicated ? t.first : shard, local = at - t.first;
      const int64_t outside = (local < 0 || local >= t.k) ? 1 : 0;
      const int64_t phase = ((local - t.rotation) % t.k + t.k) % t.k;
      const int64_t logical = block * t.k + phase + outside * t.vocab;
      if (logical < t.vocab) table = static_cast<int32_t>(t.index), row = static_cast<int32_t>(logical);
    }
    return {table, row};
  }

  // The words of field f (0: the parameters, 1 + i: slot i) of local row r absorbed,
  // all but the column's.
  void RowHashes(int64_t r, int fields, uint32_t* out) const {
    const auto [table, row] = Logical(r);
    const uint32_t tw = Mix(static_cast<uint32_t>(table) + kTableKey);
    const uint32_t rw = Mix(static_cast<uint32_t>(row) + kRowKey);
    for (int f = 0; f < fields; ++f) out[f] = Mix(Mix(Mix(step_hash ^ field_words[f]) ^ tw) ^ rw);
  }
};

// ---------------------------------------------------------------------------------------
// The row update: one rule on one table of element type T (slots of type S), with the
// common options.

template <class Rule, typename T, typename S = T>
struct Updater {
  static constexpr int kSlots = Rule::kSlots;
  // whether any array is stored in a 16-bit type (its new values rounded stochastically)
  static constexpr bool kRound = !std::is_same_v<T, float> || !std::is_same_v<S, float>;
  T* w = nullptr;
  S* slot[kSlots > 0 ? kSlots : 1] = {};
  const Rounding* rounding = nullptr;  // kRound: the call's words
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
      PrefetchWrite(reinterpret_cast<char*>(slot[j] + r * slot_width), sizeof(S) * slot_width);
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

  __attribute__((always_inline)) inline void Row(int64_t r, const float* __restrict__ gr) const {
    if constexpr (Rule::kVariants == 1) {
      if (c.has_wd) return RowLoop<0, true>(r, gr);
      return RowLoop<0, false>(r, gr);
    } else {
      row_fn(*this, r, gr);
    }
  }

  // Chooses the call's loop (after p and c are read); a rule of one variant has none to
  // choose (its loops are inlined: no RowAt of it is compiled).
  void Select() {
    if constexpr (Rule::kVariants > 1)
      row_fn = RowFns(std::make_integer_sequence<int, 2 * Rule::kVariants>())[Index()];
  }
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
    uint32_t h[1 + kSlots] = {};  // each array's words of this row (kRound)
    if constexpr (kRound) rounding->RowHashes(r, 1 + kSlots, h);
    RowKernel<kVariant, kWd>(w + r * d, kSlots > 0 ? slot[0] + r * slot_width : nullptr,
                             kSlots > 1 ? slot[kSlots > 1 ? 1 : 0] + r * slot_width : nullptr,
                             gr, h);
  }

  // The row's arrays as restrict parameters (no aliasing to check at run time). `h`: each
  // array's row words (kRound), `cw` the columns' (each new value Put: update_rules.h).
  template <int kVariant, bool kWd>
  inline void RowKernel(T* __restrict__ wr, S* __restrict__ s0, S* __restrict__ s1,
                        const float* __restrict__ gr, const uint32_t* h) const {
    const uint32_t* cw = kRound ? rounding->column_words.data() : nullptr;
    const uint32_t h0 = h[0], h1 = h[kSlots > 0 ? 1 : 0], h2 = h[kSlots > 1 ? 2 : 0];
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
      if constexpr (kRound) {
        s0[0] = Put<S>(a, h1, cw[0]);
      } else {
        s0[0] = Store<S>(a);
      }
    }
    const float lo = c.clip_lo, hi = c.clip_hi;
    // column k: the slots' new values stored, the parameter's new value returned
    auto column = [&](int64_t k) -> float {
      float g = gr[k];
      g = g < lo ? lo : g;
      g = g > hi ? hi : g;
      const float w_old = Load(wr[k]);
      float s[kSlots > 0 ? kSlots : 1];
      if constexpr (kSlots > 0 && !Rule::kRowWise) s[0] = Load(s0[k]);
      if constexpr (kSlots > 1) s[1] = Load(s1[k]);
      float wn = Rule::template Step<kVariant>(p, w_old, g, lr, s, scale);
      if constexpr (kRound) {
        if constexpr (kSlots > 0 && !Rule::kRowWise) s0[k] = Put<S>(s[0], h1, cw[k]);
        if constexpr (kSlots > 1) s1[k] = Put<S>(s[1], h2, cw[k]);
      } else {
        if constexpr (kSlots > 0 && !Rule::kRowWise) s0[k] = Store<S>(s[0]);
        if constexpr (kSlots > 1) s1[k] = Store<S>(s[1]);
      }
      if constexpr (kWd) wn = wn - wd * w_old;
      wn = wn < wmin ? wmin : wn;
      return wn > wmax ? wmax : wn;
    };
    int64_t k = 0;
#ifdef EM_F16_ROUND_VECTOR
    if constexpr (std::is_same_v<T, F16>) {
      // 16 columns at a time: their new values and random bits, then the vector rounding
      // (update_rules.h; the same bits as Put's)
      for (; k + 16 <= d; k += 16) {
        float nw[16];
        uint32_t bits[16];
        for (int j = 0; j < 16; ++j) {
          nw[j] = column(k + j);
          bits[j] = Mix(h0 ^ cw[k + j]);
        }
        StochasticRoundF16x16(nw, bits, reinterpret_cast<uint16_t*>(wr + k), 0xFFFF);
      }
    }
#endif
    for (; k < d; ++k) {
      const float wn = column(k);
      if constexpr (kRound) {
        wr[k] = Put<T>(wn, h0, cw[k]);
      } else {
        wr[k] = Store<T>(wn);
      }
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
// to its 1 + kSlots results (copied when XLA did not alias them); `first`: the table's
// place among the remaining arguments (1 after a rounding's words). Fills `up` (lr from
// the [1] buffer) or returns why not.
template <class Rule, typename T, typename S>
ffi::Error MakeUpdater(const ffi::RemainingArgs& state, const ffi::RemainingRets& outs,
                       const ffi::Dictionary& attrs, const float* lr, Updater<Rule, T, S>* up,
                       size_t first = 0) {
  if (state.size() != first + 1 + Rule::kSlots || outs.size() != 1 + Rule::kSlots)
    return ffi::Error::InvalidArgument("update: expected the table and " +
                                       std::to_string(Rule::kSlots) + " slot(s)");
  AttrReader reader(attrs);
  up->c = Common::Read(reader);
  up->p = Rule::Read(reader);
  if (!reader.error().empty()) return ffi::Error::InvalidArgument("update: " + reader.error());
  for (int i = 0; i <= Rule::kSlots; ++i) {
    auto in = state.get<ffi::AnyBuffer>(first + i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    const ffi::AnyBuffer& b = *in;
    if (b.element_type() != (i == 0 ? DType<T>::kType : DType<S>::kType))
      return ffi::Error::InvalidArgument("update: table and slots must be of the kernel's types");
    void* o = (*out)->untyped_data();
    if (o != b.untyped_data()) std::memcpy(o, b.untyped_data(), b.size_bytes());
    auto dims = b.dimensions();
    const int64_t rows = dims.size() ? dims[0] : 1;
    if (i == 0) {
      up->w = static_cast<T*>(o), up->rows = rows, up->d = RowWidth(dims);
    } else {
      const int64_t width = RowWidth(dims);
      if (rows != up->rows || width != (Rule::kRowWise ? 1 : up->d))
        return ffi::Error::InvalidArgument("update: a slot's shape does not fit the table");
      up->slot[i - 1] = static_cast<S*>(o), up->slot_width = width;
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
