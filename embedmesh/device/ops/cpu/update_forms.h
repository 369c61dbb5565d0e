// The forms of the fused sparse optimizer updates and their registration macros, shared by
// update.cc and update_moments.cc (see update.cc): two translation units, so the install
// compiles the rules in parallel (one took 72 s).
#pragma once
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "common.h"
#include "pooled.h"
#include "transport.h"
#include "update_rules.h"
#include "updater.h"

namespace embedmesh {
namespace {

// ---------------------------------------------------------------------------------------
// The row sums of each form

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
// Whether the ids other than PAD are distinct, by an open-addressing set (a table of raw
// ids' mapped rows come in raw-id order, distinct by construction: ~0.1 ms for 16k ids,
// where sorting them into ascending order cost the caller ~0.4 ms a stack).
bool DistinctUpToPad(const int32_t* id, int64_t nu) {
  int bits = 4;
  while ((int64_t{1} << bits) < 2 * nu) ++bits;
  thread_local std::vector<int32_t> set;
  set.assign(size_t{1} << bits, kPad);  // kPad: an empty place (PAD ids are not entered)
  const uint32_t mask = (uint32_t{1} << bits) - 1;
  for (int64_t u = 0; u < nu; ++u) {
    const int32_t v = id[u];
    if (v == kPad) continue;
    uint32_t h = (static_cast<uint32_t>(v) * 0x9E3779B1u) >> (32 - bits);
    while (set[h] != kPad) {
      if (set[h] == v) return false;
      h = (h + 1) & mask;
    }
    set[h] = v;
  }
  return true;
}

// For the fused backward: beg[u] and cnt[u], the first valid pair (rows[q] in [0, nr),
// uniq[q] in [0, nu)) of slot u and how many it has; false unless the ids are distinct up
// to PAD (ascending with PAD trailing, the host's order, checked first; else by a set) and
// the valid pairs come in non-decreasing slot order. Distinct rows are what the fused path
// needs: each row's gradient is its one slot's pair-order sum, as the general path's
// per-slot sums give it, and the threads own disjoint slots, so disjoint rows. One serial
// pass (~1 ms for 400k pairs): a chunked parallel version was slower on 2 cores.
bool GroupPairs(const int32_t* id, int64_t nu, const int32_t* prow, int64_t nr,
                const int32_t* puniq, int64_t np, int64_t* beg, int64_t* cnt) {
  for (int64_t u = 1; u < nu; ++u) {
    if (id[u] != kPad && id[u] <= id[u - 1]) {
      if (!DistinctUpToPad(id, nu)) return false;
      break;
    }
  }
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

// One source's pairs for this shard, as the owner's fused backward reads them: its ids
// [u] and activation gradients [nr, d] (a RowBlock: contiguous, or row by row), and either its valid pairs (activation row in
// [0, nr), slot in [0, u)) grouped by slot, in pair order (slot k's at [off[k], off[k+1])
// of row / gain), or, when the pairs are not grouped (see GroupPairs), its per-slot sums
// [u, d]. The vectors keep their capacity from call to call (GroupedSources). Grouped
// before its gradients are known (act not known), a source whose pairs need the per-slot
// sums is left `pending`: grouped again once they are (GroupServedGrads).
struct GroupedSource {
  const int32_t* ids = nullptr;
  RowBlock act;
  int64_t u = 0, nr = 0;
  bool pending = false;
  std::vector<int64_t> off;
  std::vector<int32_t> row;
  std::vector<float> gain;
  std::vector<float> sums;
};

// Groups source g's np pairs (pair_of(q, &row, &slot, &gain): pair q's activation row and
// slot, each checked here, and its gain) in one pass, with no decoded copy of them (the
// owner's pooled messages are read packed); falls back to the per-slot sums where
// GroupPairs would (ids not distinct up to PAD, or valid pairs not in non-decreasing slot
// order). Either way each slot's gradient is its pairs' sum in pair order. With act not
// known (the gradients not there yet) the sums are not made: the source is `pending`.
template <class PairOf>
void GroupSource(GroupedSource& g, const int32_t* ids, int64_t u, RowBlock act, int64_t nr,
                 int64_t np, int64_t d, const PairOf& pair_of) {
  g.ids = ids, g.act = act, g.u = u, g.nr = nr;
  g.pending = false;
  g.sums.clear();
  bool grouped = true;  // the ids distinct up to PAD, as GroupPairs checks them
  for (int64_t k = 1; k < u; ++k) {
    if (ids[k] != kPad && ids[k] <= ids[k - 1]) {
      grouped = DistinctUpToPad(ids, u);
      break;
    }
  }
  g.off.resize(u + 1);
  g.row.resize(np);
  g.gain.resize(np);
  int64_t* __restrict__ off = g.off.data();
  int32_t* __restrict__ row = g.row.data();
  float* __restrict__ gain = g.gain.data();
  int64_t m = 0, next = 0;  // pairs kept; the first slot whose offset is not yet set
  for (int64_t q = 0; q < np && grouped; ++q) {
    int32_t r, k;
    float w;
    pair_of(q, &r, &k, &w);
    const bool ok = r >= 0 && r < nr && k >= 0 && k < u;
    grouped = !ok || k + 1 >= next;
    for (; ok && next <= k; ++next) off[next] = m;
    row[m] = r;
    gain[m] = w;
    m += ok;
  }
  if (grouped) {
    for (; next <= u; ++next) off[next] = m;
    return;
  }
  g.off.clear();
  if (!act.known()) {
    g.pending = true;
    return;
  }
  g.sums.assign(u * d, 0.0f);
  for (int64_t q = 0; q < np; ++q) {
    int32_t r, k;
    float w;
    pair_of(q, &r, &k, &w);
    if (r < 0 || r >= nr || k < 0 || k >= u) continue;
    const float* a = act.Row(r, d);
    for (int64_t j = 0; j < d; ++j) g.sums[k * d + j] += w * a[j];
  }
}

// This thread's GroupedSource of each of n sources (their vectors reused across calls).
inline std::vector<GroupedSource>& GroupedSources(int64_t n) {
  thread_local std::vector<GroupedSource> parts;
  if (static_cast<int64_t>(parts.size()) < n) parts.resize(n);
  return parts;
}

// N sources, fused backward + update on the owner: for each distinct row this shard was
// asked for by any source, the gradient sum over sources (in source order) of each
// source's pair-order sum over its pairs of that row, then one update of the row. Equal to
// backward (per-source segment sums) -> exchange -> dedup_sum -> sparse_update, with no
// [N, U, D] gradient buffer, no exchange and no dedup output. parts[0, n): GroupSource's.
template <class U>
void BackwardUpdateFromSources(const U& up, const GroupedSource* parts, int64_t n) {
  const int64_t rows = up.rows, d = up.d;
  // The distinct rows asked of this shard, ascending, each with its (source, slot) list
  // in source order: a merge when every list is ascending, else a sort.
  // per source, its valid entries (rows in range) in slot order, compacted
  auto valid = [&](int32_t row) { return row != kPad && row >= 0 && row < rows; };
  thread_local std::vector<std::vector<int32_t>> vrow, vslot;
  vrow.resize(n);
  vslot.resize(n);
  bool ascending = true;
  size_t total = 0;
  for (int64_t r = 0; r < n; ++r) {
    vrow[r].resize(parts[r].u + 1);
    vslot[r].resize(parts[r].u + 1);
    int64_t m = 0, last = -1;
    for (int64_t k = 0; k < parts[r].u; ++k) {
      const int32_t row = parts[r].ids[k];
      if (!valid(row)) continue;
      ascending &= row > last;
      last = row;
      vrow[r][m] = row;
      vslot[r][m++] = static_cast<int32_t>(k);
    }
    vrow[r][m] = INT32_MAX;  // a sentinel past every valid row
    vrow[r].resize(m + 1);
    total += m;
  }
  // One entry of a row (source q's slot k) into its gradient g: the row's first entry
  // sums straight into g (0 + its sum is its sum: a sum from +0 is never -0), each later
  // one into gr, then is added (per source, in pair order; sources in source order).
  auto add = [d](const GroupedSource& q, int64_t k, float* __restrict__ g,
                 float* __restrict__ gr, bool& first) {
    if (!q.sums.empty()) {
      for (int64_t j = 0; j < d; ++j) g[j] += q.sums[k * d + j];
      first = false;
      return;
    }
    float* __restrict__ acc = first ? g : gr;
    if (!first) std::fill(gr, gr + d, 0.0f);
    const int32_t* prow = q.row.data();
    const float* pgain = q.gain.data();
    for (int64_t t = q.off[k], end = q.off[k + 1]; t < end; ++t) {
      const float gq = pgain[t];
      const float* __restrict__ a = q.act.Row(prow[t], d);
      for (int64_t j = 0; j < d; ++j) acc[j] += gq * a[j];
    }
    if (!first)
      for (int64_t j = 0; j < d; ++j) g[j] += gr[j];
    first = false;
  };
  const int64_t grain = 1024;
  if (ascending && n == 2) {
    // the host's order, 2 sources: the rows in one merge walk of the two lists (ties:
    // source 0 first), chunked by source 0's entries, source 1's split where their rows
    // fall; each list's rows prefetched kPrefetch entries ahead
    const int32_t* const r0 = vrow[0].data();  // by address (see below)
    const int32_t* const r1 = vrow[1].data();
    const int32_t* const s0 = vslot[0].data();
    const int32_t* const s1 = vslot[1].data();
    const int64_t m0 = static_cast<int64_t>(vrow[0].size()) - 1;
    const int64_t m1 = static_cast<int64_t>(vrow[1].size()) - 1;
    const int64_t chunks = std::max<int64_t>(1, NumChunks(m0, grain));
    ParallelFor(chunks, [&](int64_t c) {
      const int64_t a0 = std::min(m0, c * grain);
      const int64_t b0 = c + 1 == chunks ? m0 : std::min(m0, (c + 1) * grain);
      const int64_t a1 = c == 0 ? 0 : std::lower_bound(r1, r1 + m1, r0[a0]) - r1;
      const int64_t b1 = c + 1 == chunks ? m1 : std::lower_bound(r1, r1 + m1, r0[b0]) - r1;
      std::vector<float> g(d), gr(d);
      for (int64_t k = a0; k < std::min(b0, a0 + kPrefetch); ++k) up.Prefetch(r0[k]);
      for (int64_t k = a1; k < std::min(b1, a1 + kPrefetch); ++k) up.Prefetch(r1[k]);
      int64_t i0 = a0, i1 = a1;
      while (i0 < b0 || i1 < b1) {
        const int32_t x = i0 < b0 ? r0[i0] : INT32_MAX, y = i1 < b1 ? r1[i1] : INT32_MAX;
        const int32_t row = std::min(x, y);
        std::fill(g.begin(), g.end(), 0.0f);
        bool first = true;
        if (x == row) {
          if (i0 + kPrefetch < b0) up.Prefetch(r0[i0 + kPrefetch]);
          add(parts[0], s0[i0++], g.data(), gr.data(), first);
        }
        if (y == row) {
          if (i1 + kPrefetch < b1) up.Prefetch(r1[i1 + kPrefetch]);
          add(parts[1], s1[i1++], g.data(), gr.data(), first);
        }
        up.Row(row, g.data());
      }
    });
    return;
  }
  // else the entries sorted by row, ties in source order: (row, source << 32 | slot)
  thread_local std::vector<int32_t> arow;
  thread_local std::vector<uint64_t> akey;
  thread_local std::vector<int64_t> starts;
  arow.resize(total);
  akey.resize(total);
  starts.resize(total + 1);
  int64_t distinct = 0;
  {
    std::vector<std::pair<int32_t, uint64_t>> all;
    all.reserve(total);
    for (int64_t r = 0; r < n; ++r)
      for (size_t m = 0; m + 1 < vrow[r].size(); ++m)
        all.emplace_back(vrow[r][m], (static_cast<uint64_t>(r) << 32) | static_cast<uint32_t>(vslot[r][m]));
    std::stable_sort(all.begin(), all.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < total; ++i) {
      if (i == 0 || all[i].first != all[i - 1].first) starts[distinct++] = static_cast<int64_t>(i);
      arow[i] = all[i].first;
      akey[i] = all[i].second;
    }
  }
  starts[distinct] = static_cast<int64_t>(total);
  // this thread's buffers by address: the workers of ParallelFor have thread_locals of
  // their own (empty), so the loop must not name them
  const int32_t* const row_at = arow.data();
  const uint64_t* const key_at = akey.data();
  const int64_t* const start_at = starts.data();
  ParallelFor(NumChunks(distinct, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(distinct, lo + grain);
    std::vector<float> g(d), gr(d);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        up.Prefetch(row_at[start_at[i + kPrefetch]]);
      }
      std::fill(g.begin(), g.end(), 0.0f);
      bool first = true;
      for (int64_t e = start_at[i]; e < start_at[i + 1]; ++e)
        add(parts[key_at[e] >> 32], static_cast<int64_t>(key_at[e] & 0xffffffffu), g.data(),
            gr.data(), first);
      up.Row(row_at[start_at[i]], g.data());
    }
  });
}

// Source s's pairs of an owner's pooled messages, grouped (GroupSource) straight from its
// packed words, its gradients `act` (not known yet: none).
inline void GroupServedSource(GroupedSource& g, const int32_t* served, int64_t s, int64_t words,
                              const PooledLayout& l, int64_t d, RowBlock act) {
  const int32_t* block = served + s * words;
  GroupSource(g, block, l.u, act, l.rc, l.p, d,
              [&](int64_t q, int32_t* row, int32_t* slot, float* gain) {
                DecodePair(block, l, q, slot, row, gain);
              });
}

// The pairs of an owner's N sources' pooled messages (pooled.h), each grouped
// (GroupSource) straight from its packed words (no decoded copy), its Rc gradient rows at
// grads_of(s) (none: not known yet; GroupServedGrads gives them); this thread's
// GroupedSources.
template <typename GradsOf>
GroupedSource* GroupServed(const int32_t* served, int64_t n, int64_t words,
                           const PooledLayout& l, int64_t d, const GradsOf& grads_of) {
  std::vector<GroupedSource>& parts = GroupedSources(n);
  for (int64_t s = 0; s < n; ++s) GroupServedSource(parts[s], served, s, words, l, d, grads_of(s));
  return parts.data();
}

// The gradients of sources grouped without them (GroupServed with no gradients):
// source s's at grads_of(s); a pending source grouped again with them.
template <typename GradsOf>
void GroupServedGrads(GroupedSource* parts, const int32_t* served, int64_t n, int64_t words,
                      const PooledLayout& l, int64_t d, const GradsOf& grads_of) {
  for (int64_t s = 0; s < n; ++s) {
    if (parts[s].pending) {
      GroupServedSource(parts[s], served, s, words, l, d, grads_of(s));
    } else {
      parts[s].act = grads_of(s);
    }
  }
}

// ---------------------------------------------------------------------------------------
// The handlers of each form, generic over the rule and the storage type T.

// A call's updater, by the state's types: `Updater<Rule, float>` for float32 tables (the
// forms inlined over it); for a bfloat16 / float16 table (its slots float32 or its type),
// `Updater<Rule, T, S>` with the call's rounding (its int32 words are the first of the
// remaining arguments, before the state) behind an `AnyUpdater`, so that each form is
// compiled once for all four low-precision pairs, calling their rows through a pointer.
struct AnyUpdater {
  const void* self = nullptr;
  void (*row)(const void*, int64_t, const float*) = nullptr;
  void (*prefetch)(const void*, int64_t) = nullptr;
  int64_t rows = 0, d = 0;
  inline void Row(int64_t r, const float* g) const { row(self, r, g); }
  inline void Prefetch(int64_t r) const { prefetch(self, r); }
};

// AnyUpdater's row and prefetch of a rounded updater U: functions of U alone, so that
// each low-precision row loop is compiled once per (rule, T, S), not once per form.
template <class U>
void AnyRow(const void* u, int64_t r, const float* g) {
  static_cast<const U*>(u)->Row(r, g);
}
template <class U>
void AnyPrefetch(const void* u, int64_t r) {
  static_cast<const U*>(u)->Prefetch(r);
}

// A rounded call's updater `up` (its words `rounding`) behind `any`; of no form either.
template <class Rule, typename T, typename S>
__attribute__((noinline)) ffi::Error MakeRounded(const ffi::RemainingArgs& state,
                                                 const ffi::RemainingRets& outs,
                                                 const ffi::Dictionary& attrs, const float* lr,
                                                 size_t skip, Updater<Rule, T, S>* up,
                                                 Rounding* rounding, AnyUpdater* any) {
  using U = Updater<Rule, T, S>;
  if (ffi::Error e = MakeUpdater(state, outs, attrs, lr, up, skip + 1); e.failure()) return e;
  auto words = state.get<ffi::AnyBuffer>(skip);
  if (words.has_error()) return words.error();
  const ffi::AnyBuffer& wb = *words;
  if (wb.element_type() != ffi::DataType::S32 ||
      !rounding->Read(static_cast<const int32_t*>(wb.untyped_data()),
                      static_cast<int64_t>(wb.element_count()), 1 + Rule::kSlots, up->d))
    return ffi::Error::InvalidArgument("update: malformed rounding words");
  up->rounding = rounding;
  any->self = up;
  any->row = &AnyRow<U>;
  any->prefetch = &AnyPrefetch<U>;
  any->rows = up->rows, any->d = up->d;
  return ffi::Error::Success();
}

template <class Rule, typename T, typename S, class Body>
ffi::Error WithRounding(const ffi::RemainingArgs& state, const ffi::RemainingRets& outs,
                        const ffi::Dictionary& attrs, const float* lr, const Body& body,
                        size_t skip) {
  Updater<Rule, T, S> up;
  Rounding rounding;
  AnyUpdater any;
  if (ffi::Error e = MakeRounded(state, outs, attrs, lr, skip, &up, &rounding, &any);
      e.failure())
    return e;
  return body(any);
}

// The remaining arguments: `skip` of the call's own first (ExchangePooled's gradient
// parts), then the rounding words of a rounded update, then the table and its slots.
template <class Rule, class Body>
ffi::Error WithUpdater(const ffi::RemainingArgs& state, const ffi::RemainingRets& outs,
                       const ffi::Dictionary& attrs, const float* lr, const Body& body,
                       size_t skip = 0) {
  if (state.size() != skip + 2 + Rule::kSlots) {  // float32: no rounding words
    Updater<Rule, float> up;
    if (ffi::Error e = MakeUpdater(state, outs, attrs, lr, &up, skip); e.failure()) return e;
    return body(up);
  }
  using DT = ffi::DataType;
  auto type = [&](size_t i) {
    auto b = state.get<ffi::AnyBuffer>(skip + i);
    return b.has_error() ? DT::INVALID : (*b).element_type();
  };
  const DT t = type(1), s = Rule::kSlots > 0 ? type(2) : t;
  if (t == DT::BF16 && s == DT::F32) return WithRounding<Rule, Bf16, float>(state, outs, attrs, lr, body, skip);
  if (t == DT::BF16 && s == DT::BF16) return WithRounding<Rule, Bf16, Bf16>(state, outs, attrs, lr, body, skip);
  if (t == DT::F16 && s == DT::F32) return WithRounding<Rule, F16, float>(state, outs, attrs, lr, body, skip);
  if (t == DT::F16 && s == DT::F16) return WithRounding<Rule, F16, F16>(state, outs, attrs, lr, body, skip);
  return ffi::Error::InvalidArgument(
      "update: a rounded update takes a bfloat16 or float16 table, its slots float32 or its type");
}

template <class Rule>
ffi::Error Sparse(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                  ffi::Buffer<ffi::F32> lr, ffi::RemainingArgs state, ffi::RemainingRets outs,
                  ffi::Dictionary attrs) {
  return WithUpdater<Rule>(state, outs, attrs, lr.typed_data(), [&](const auto& up) {
    SparseUpdate(up, ids.typed_data(), ids.element_count(), grads.typed_data());
    return ffi::Error::Success();
  });
}

template <class Rule>
ffi::Error Backward(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                    ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                    ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr,
                    ffi::RemainingArgs state, ffi::RemainingRets outs, ffi::Dictionary attrs) {
  return WithUpdater<Rule>(state, outs, attrs, lr.typed_data(), [&](const auto& up) {
    auto ad = act.dimensions();
    BackwardUpdate(up, ids.typed_data(), ids.element_count(), act.typed_data(),
                   ad.size() ? ad[0] : 1, prow.typed_data(), puniq.typed_data(),
                   gains.typed_data(), prow.element_count());
    return ffi::Error::Success();
  });
}

// ops.backward_update_sharded over N shards: each source device shares its batch (ids,
// activation gradients, pairs: ShareArrays, lent in process, in its segment between
// processes) and each owner runs BackwardUpdateFromSources on every source's batch read in
// place (a replica, data_parallel: every source's one partition to its whole table): no
// [N, U, D] gradient buffer, no exchange.
template <class Rule, class Tr>
ffi::Error Sharded(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                   ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                   ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr,
                   ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::RemainingArgs state, ffi::RemainingRets outs, ffi::Dictionary attrs) {
  return WithUpdater<Rule>(state, outs, attrs, lr.typed_data(),
                           [&](const auto& up) -> ffi::Error {
  Tr t;
  if (ffi::Error e; !ReadTransport(attrs, rank_buf, "backward", &t, &e)) return e;
  AttrReader a(attrs);
  const bool replica = a.I("replica") != 0;
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  const int64_t n = t.n;
  const int64_t parts = replica ? 1 : n, part = replica ? 0 : t.rank;
  const int64_t u = parts >= 1 ? static_cast<int64_t>(ids.element_count()) / parts : 0;
  const int64_t p = parts >= 1 ? static_cast<int64_t>(prow.element_count()) / parts : 0;
  auto ad = act.dimensions();
  const int64_t nr = ad.size() ? ad[0] : 1;
  const bool apply = keep.typed_data()[0] != 0;
  const std::array<Span, 5> mine{{{ids.typed_data(), ids.size_bytes()},
                                  {act.typed_data(), act.size_bytes()},
                                  {prow.typed_data(), prow.size_bytes()},
                                  {puniq.typed_data(), puniq.size_bytes()},
                                  {gains.typed_data(), gains.size_bytes()}}};
  return ShareArrays(t, mine, [&](const auto& array) {
    if (!apply) return std::string();  // a rejected step: every process agrees, no row moves
    std::vector<GroupedSource>& parts = GroupedSources(n);
    for (int64_t s = 0; s < n; ++s) {
      const int32_t* prow = reinterpret_cast<const int32_t*>(array(s, 2)) + part * p;
      const int32_t* puniq = reinterpret_cast<const int32_t*>(array(s, 3)) + part * p;
      const float* gain = reinterpret_cast<const float*>(array(s, 4)) + part * p;
      GroupSource(parts[s], reinterpret_cast<const int32_t*>(array(s, 0)) + part * u, u,
                  reinterpret_cast<const float*>(array(s, 1)), nr, p, up.d,
                  [&](int64_t q, int32_t* row, int32_t* slot, float* w) {
                    *row = prow[q], *slot = puniq[q], *w = gain[q];
                  });
    }
    BackwardUpdateFromSources(up, parts.data(), n);
    return std::string();
  });
  });
}

// ops.pooled_backward_update: an owner's fused backward + update from its N sources'
// pooled messages and the gradients [N * Rc, D] of the rows they feed:
// BackwardUpdateFromSources, no [N * U, D] buffer, no dedup output.
template <class Rule>
ffi::Error Pooled(ffi::Buffer<ffi::S32> served, ffi::Buffer<ffi::F32> grads,
                  ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep, ffi::RemainingArgs state,
                  ffi::RemainingRets outs, ffi::Dictionary attrs) {
  return WithUpdater<Rule>(state, outs, attrs, lr.typed_data(),
                           [&](const auto& up) -> ffi::Error {
  AttrReader a(attrs);
  const int64_t u = a.I("u"), rc = a.I("rc"), k = a.I("k");
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  if (keep.typed_data()[0] == 0) return ffi::Error::Success();  // a rejected step
  auto sd = served.dimensions();
  const int64_t d = up.d;
  const int64_t n = sd.size() ? sd[0] : 1;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const GroupedSource* parts = GroupServed(served.typed_data(), n, words, l, d, [&](int64_t s) {
    return grads.typed_data() + s * rc * d;
  });
  BackwardUpdateFromSources(up, parts, n);
  return ffi::Error::Success();
  });
}

// The row table of an exchange's gradient parts: rows[o * rc + j] is row j of this rank's
// block for owner o, from `seg` (quads: owner, part, first row, count; each owner's in
// block order) over the parts, the first `np` of `args` (float32 [rows, d]); the rows past
// an owner's segments read `zeros`. Returns "" or what is wrong.
inline std::string PartRows(const ffi::RemainingArgs& args, int64_t np,
                            ffi::Span<const int64_t> seg, int64_t n, int64_t rc, int64_t d,
                            const float* zeros, std::vector<const float*>* rows) {
  rows->assign(n * rc, zeros);
  std::vector<int64_t> filled(n, 0);
  if (seg.size() % 4 != 0) return "segments: not (owner, part, first, count) quads";
  for (size_t i = 0; i < seg.size(); i += 4) {
    const int64_t o = seg[i], p = seg[i + 1], first = seg[i + 2], count = seg[i + 3];
    const std::string which = "segment " + std::to_string(i / 4) + " (owner " +
                              std::to_string(o) + ", part " + std::to_string(p) + ")";
    if (o < 0 || o >= n || p < 0 || p >= np) return which + ": owner or part out of range";
    auto part = args.get<ffi::AnyBuffer>(p);
    if (part.has_error()) return std::string(part.error().message());
    const ffi::AnyBuffer& b = *part;
    if (b.element_type() != ffi::DataType::F32 || RowWidth(b.dimensions()) != d)
      return which + ": the part is not float32 rows of the table's width";
    if (first < 0 || count < 0 || first + count > Rows(b) || filled[o] + count > rc)
      return which + ": rows [" + std::to_string(first) + ", " + std::to_string(first + count) +
             ") out of the part's " + std::to_string(Rows(b)) + " or past its owner's " +
             std::to_string(rc);
    const float* base = static_cast<const float*>(b.untyped_data()) + first * d;
    for (int64_t j = 0; j < count; ++j) (*rows)[o * rc + filled[o]++] = base + j * d;
  }
  return std::string();
}

inline RowBlock AsRows(const char* block) { return RowBlock(reinterpret_cast<const float*>(block)); }
inline RowBlock AsRows(RowBlock block) { return block; }

// ops.exchange_pooled_backward_update: this rank shares the gradients [N, Rc, D] of the
// rows each owner feeds (ReadBlocks: lent in process, in its segment between processes),
// and applies every source's gradients for its own rows read in place:
// pooled_backward_update(..., exchange(grads)), with no exchanged copy. With the attribute
// `parts` (P > 0) the gradients are not one [N, Rc, D] array (`grads` is empty) but P
// float32 arrays of rows, the first P remaining arguments, and `segments` says which rows
// make each owner's block (PartRows; ReadRowBlocks): no concatenation of them first.
template <class Rule, class Tr>
ffi::Error ExchangePooled(ffi::Buffer<ffi::S32> served, ffi::Buffer<ffi::F32> grads,
                          ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
                          ffi::Buffer<ffi::S32> rank_buf, ffi::RemainingArgs state,
                          ffi::RemainingRets outs, ffi::Dictionary attrs) {
  AttrReader given(attrs);
  const int64_t np = given.Has("parts") ? given.I("parts") : 0;
  if (!given.error().empty() || np < 0 || static_cast<size_t>(np) > state.size())
    return ffi::Error::InvalidArgument("embedmesh pooled backward: bad attribute parts");
  return WithUpdater<Rule>(state, outs, attrs, lr.typed_data(),
                           [&](const auto& up) -> ffi::Error {
  Tr t;
  if (ffi::Error e; !ReadTransport(attrs, rank_buf, "pooled backward", &t, &e)) return e;
  AttrReader a(attrs);
  const int64_t u = a.I("u"), rc = a.I("rc"), k = a.I("k");
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  const int64_t d = up.d, n = t.n;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const bool apply = keep.typed_data()[0] != 0;  // every process agrees (the finite check)
  // the sources' pairs grouped while the peers arrive (they need no gradient: a source
  // that needs its per-slot sums is summed once the gradients are there)
  GroupedSource* parts = nullptr;
  auto group = [&] {
    if (apply) parts = GroupServed(served.typed_data(), n, words, l, d, [](int64_t) {
      return RowBlock();
    });
  };
  auto work = [&](const auto& block_for_me) {
    if (!apply) return std::string();  // a rejected step: no row moves
    GroupServedGrads(parts, served.typed_data(), n, words, l, d,
                     [&](int64_t s) { return AsRows(block_for_me(s)); });
    BackwardUpdateFromSources(up, parts, n);
    return std::string();
  };
  if (np == 0) {
    const size_t block = sizeof(float) * rc * d;
    return ReadBlocks(t, block, reinterpret_cast<const char*>(grads.typed_data()), group, work);
  }
  auto seg = attrs.get<ffi::Span<const int64_t>>("segments");
  if (seg.has_error())
    return ffi::Error::InvalidArgument("embedmesh pooled backward: attribute segments: " +
                                       std::string(seg.error().message()));
  std::vector<float> zeros(d, 0.0f);
  std::vector<const float*> rows;
  const std::string err = PartRows(state, np, *seg, n, rc, d, zeros.data(), &rows);
  if (!err.empty()) return ffi::Error::InvalidArgument("embedmesh pooled backward: " + err);
  return ReadRowBlocks(t, rows.data(), rc, d, group, work);
  }, static_cast<size_t>(np));
}

}  // namespace
}  // namespace embedmesh

// ---------------------------------------------------------------------------------------
// Registration: every (form, rule) pair, on each transport (each handler takes float32,
// bfloat16 and float16 tables: WithUpdater), listed
// (common.h) under the target names kernels.py calls; the rules listed here are the
// optimizers the CPU fuses.

#define EM_F32 ffi::Buffer<ffi::F32>
#define EM_S32 ffi::Buffer<ffi::S32>
#define EM_STATE .RemainingArgs().RemainingRets().Attrs()
#define EM_BIND_Sparse ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_F32>() EM_STATE
#define EM_BIND_PAIRS                                                                      \
  ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_S32>().Arg<EM_S32>().Arg<EM_F32>() \
      .Arg<EM_F32>()
#define EM_BIND_Backward EM_BIND_PAIRS EM_STATE
#define EM_BIND_Sharded EM_BIND_PAIRS.Arg<EM_S32>().Arg<EM_S32>() EM_STATE
#define EM_BIND_Pooled \
  ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_F32>().Arg<EM_S32>() EM_STATE
#define EM_BIND_ExchangePooled                                                             \
  ffi::Ffi::Bind().Arg<EM_S32>().Arg<EM_F32>().Arg<EM_F32>().Arg<EM_S32>().Arg<EM_S32>() \
      EM_STATE

// each form's function of a rule, over a transport of transport.h (InProcess, SharedMemory)
#define EM_FN(form, rule) (embedmesh::form<embedmesh::rule>)
#define EM_FN_ON(form, rule, tr) (embedmesh::form<embedmesh::rule, embedmesh::tr>)
// the exported symbols, Em<...><Rule><...>, and their target names,
// embedmesh_..._<rule's kName>_... (kernels.py calls them so)
#define EM_BACKWARD(rule) std::string("embedmesh_backward_") + embedmesh::rule::kName
#define EM_POOLED(rule) std::string("pooled_backward_") + embedmesh::rule::kName
#define EM_DEFINE(symbol, fn, bind, target) EM_HANDLER(target, symbol, fn, bind)
#define EM_DEFINE_RULE(rule)                                                                 \
  EM_DEFINE(EmSparse##rule, EM_FN(Sparse, rule), EM_BIND_Sparse,                             \
            std::string("embedmesh_sparse_") + embedmesh::rule::kName)                       \
  EM_DEFINE(EmBackward##rule, EM_FN(Backward, rule), EM_BIND_Backward, EM_BACKWARD(rule))    \
  EM_DEFINE(EmBackward##rule##FromSources, EM_FN_ON(Sharded, rule, InProcess),       \
            EM_BIND_Sharded, EM_BACKWARD(rule) + "_from_sources")                            \
  EM_DEFINE(EmBackward##rule##FromHostSources, EM_FN_ON(Sharded, rule, SharedMemory), \
            EM_BIND_Sharded, EM_BACKWARD(rule) + "_from_host_sources")                       \
  EM_DEFINE(EmPooledBackward##rule, EM_FN(Pooled, rule), EM_BIND_Pooled,                     \
            "embedmesh_" + EM_POOLED(rule))                                                  \
  EM_DEFINE(EmExchangePooledBackward##rule, EM_FN_ON(ExchangePooled, rule, InProcess), \
            EM_BIND_ExchangePooled, "embedmesh_exchange_" + EM_POOLED(rule))                 \
  EM_DEFINE(EmHostPooledBackward##rule,                                                      \
            EM_FN_ON(ExchangePooled, rule, SharedMemory), EM_BIND_ExchangePooled,    \
            "embedmesh_host_" + EM_POOLED(rule))

