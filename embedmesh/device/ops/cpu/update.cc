// Fused sparse SGD / Adagrad updates, alone and fused with the backward (on one shard, and
// on N in-process shards reading their sources' gradients through peers.h, and on N shards
// in processes of one host reading them in shared memory through host_peers.h).
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"
#include "host_peers.h"
#include "peers.h"
#include "pooled.h"

namespace embedmesh {
namespace {

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
template <bool kAdagrad>
void BackwardUpdateFromSources(float* w, float* acc, int64_t rows, int64_t d, int64_t me,
                               const std::vector<const SourceBatch*>& src, float lr,
                               const UpdateAttrs& at) {
  const int64_t n = static_cast<int64_t>(src.size());
  const float wd = EffectiveWd(lr, at);
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
        PrefetchWrite(reinterpret_cast<char*>(w + r * d), 4 * d);
        if (kAdagrad) PrefetchWrite(reinterpret_cast<char*>(acc + r * d), 4 * d);
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
      UpdateRow<kAdagrad>(w + r * d, kAdagrad ? acc + r * d : nullptr, g.data(), d, lr, wd, at);
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

// ops.pooled_backward_update: an owner's fused backward + update from its N sources'
// pooled messages and the gradients [N * Rc, D] of the rows they feed:
// BackwardUpdateFromSources, no [N * U, D] buffer, no dedup output.
template <bool kAdagrad>
ffi::Error PooledBackward(ffi::Buffer<ffi::F32> table, float* acc_in, ffi::Buffer<ffi::S32> served,
                          ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> lr,
                          ffi::Buffer<ffi::S32> keep, int64_t u, int64_t rc, int64_t k,
                          const UpdateAttrs& at, float* w, float* a) {
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  if (kAdagrad && a != acc_in) std::memcpy(a, acc_in, table.size_bytes());
  if (keep.typed_data()[0] == 0) return ffi::Error::Success();  // a rejected step
  auto td = table.dimensions();
  auto sd = served.dimensions();
  const int64_t d = RowWidth(td);
  const int64_t n = sd.size() ? sd[0] : 1;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  PooledSources ps;
  DecodeSources(ps, served.typed_data(), n, words, l,
                [&](int64_t s) { return grads.typed_data() + s * rc * d; });
  BackwardUpdateFromSources<kAdagrad>(w, a, td.size() ? td[0] : 1, d, 0, ps.src,
                                      lr.typed_data()[0], at);
  return ffi::Error::Success();
}

// ops.exchange_pooled_backward_update between processes of one host: this rank publishes
// the gradients [N, Rc, D] of the rows each other owner feeds in its segment, and applies
// every source's gradients for its own rows read in place (its own from `grads`):
// pooled_backward_update(..., exchange(grads)), with no exchanged copy.
template <bool kAdagrad>
ffi::Error HostPooledBackward(ffi::Buffer<ffi::F32> table, float* acc_in,
                              ffi::Buffer<ffi::S32> served, ffi::Buffer<ffi::F32> grads,
                              ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
                              ffi::Buffer<ffi::S32> rank_buf, int64_t u, int64_t rc, int64_t k,
                              const hostpeers::HostCall& base, const UpdateAttrs& at, float* w,
                              float* a) {
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  if (kAdagrad && a != acc_in) std::memcpy(a, acc_in, table.size_bytes());
  hostpeers::HostCall call = base;
  call.rank = rank_buf.typed_data()[0];
  auto td = table.dimensions();
  const int64_t d = RowWidth(td), n = call.n, rank = call.rank;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const float* g = grads.typed_data();
  const size_t block = sizeof(float) * rc * d;
  const bool apply = keep.typed_data()[0] != 0;  // every process agrees (the finite check)
  const float rate = lr.typed_data()[0];
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
        BackwardUpdateFromSources<kAdagrad>(w, a, td.size() ? td[0] : 1, d, 0, ps.src, rate, at);
        return std::string();
      });
}

ffi::Error HostPooledBackwardSgd(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> served,
                                 ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> lr,
                                 ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> rank,
                                 int64_t u, int64_t rc, int64_t k, int64_t job, int64_t tag,
                                 int64_t n, int64_t timeout_ms, std::string_view channel,
                                 float clip_lo, float clip_hi, float wd, int32_t has_wd,
                                 int32_t wd_lr, float wmin, float wmax,
                                 ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return HostPooledBackward<false>(table, nullptr, served, grads, lr, keep, rank, u, rc, k,
                                   hostpeers::HostCall{job, tag, n, 0, timeout_ms, channel},
                                   MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax),
                                   out->typed_data(), nullptr);
}

ffi::Error HostPooledBackwardAdagrad(
    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accum, ffi::Buffer<ffi::S32> served,
    ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
    ffi::Buffer<ffi::S32> rank, int64_t u, int64_t rc, int64_t k, int64_t job, int64_t tag,
    int64_t n, int64_t timeout_ms, std::string_view channel, float clip_lo, float clip_hi,
    float wd, int32_t has_wd, int32_t wd_lr, float wmin, float wmax,
    ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> out_acc) {
  return HostPooledBackward<true>(table, accum.typed_data(), served, grads, lr, keep, rank, u,
                                  rc, k, hostpeers::HostCall{job, tag, n, 0, timeout_ms, channel},
                                  MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax),
                                  out->typed_data(), out_acc->typed_data());
}

ffi::Error PooledBackwardSgd(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> served,
                             ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> lr,
                             ffi::Buffer<ffi::S32> keep, int64_t u, int64_t rc, int64_t k,
                             float clip_lo, float clip_hi, float wd, int32_t has_wd,
                             int32_t wd_lr, float wmin, float wmax,
                             ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return PooledBackward<false>(table, nullptr, served, grads, lr, keep, u, rc, k,
                               MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax),
                               out->typed_data(), nullptr);
}

ffi::Error PooledBackwardAdagrad(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accum,
                                 ffi::Buffer<ffi::S32> served, ffi::Buffer<ffi::F32> grads,
                                 ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep, int64_t u,
                                 int64_t rc, int64_t k, float clip_lo, float clip_hi, float wd,
                                 int32_t has_wd, int32_t wd_lr, float wmin, float wmax,
                                 ffi::Result<ffi::Buffer<ffi::F32>> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> out_acc) {
  return PooledBackward<true>(table, accum.typed_data(), served, grads, lr, keep, u, rc, k,
                              MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax),
                              out->typed_data(), out_acc->typed_data());
}

template <bool kAdagrad>
ffi::Error BackwardFromSources(ffi::Buffer<ffi::F32> table, float* acc_in, ffi::Buffer<ffi::S32> ids,
                               ffi::Buffer<ffi::F32> act, ffi::Buffer<ffi::S32> prow,
                               ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                               ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
                               ffi::Buffer<ffi::S32> rank_buf, int64_t tag, int64_t n,
                               bool replica, const UpdateAttrs& at, float* w, float* a) {
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  if (kAdagrad && a != acc_in) std::memcpy(a, acc_in, table.size_bytes());
  auto td = table.dimensions();
  auto ad = act.dimensions();
  const int64_t rank = rank_buf.typed_data()[0];
  // a replica (data_parallel) applies every source's one partition to its whole table
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
  const float rate = lr.typed_data()[0];
  return WithPeers(tag, n, rank, &mine, "backward", [&](const auto& peers) {
    if (!apply) return;  // a rejected step: every process agrees, no row moves
    std::vector<const SourceBatch*> src(n);
    for (int64_t s = 0; s < n; ++s) src[s] = reinterpret_cast<const SourceBatch*>(peers[s]);
    BackwardUpdateFromSources<kAdagrad>(w, a, td.size() ? td[0] : 1, RowWidth(td), part, src,
                                        rate, at);
  });
}

// The same fused backward + update over N shards in processes of one host: each source
// device publishes its batch (ids, activation gradients, pairs) in its shared-memory
// segment (host_peers.h) and each owner runs BackwardUpdateFromSources on every source's
// batch read in place: no [N, U, D] gradient buffer, one copy of each source's batch.
template <bool kAdagrad>
ffi::Error BackwardFromHostSources(ffi::Buffer<ffi::F32> table, float* acc_in,
                                   ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
                                   ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
                                   ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr,
                                   ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> rank_buf,
                                   const hostpeers::HostCall& base, bool replica,
                                   const UpdateAttrs& at, float* w, float* a) {
  if (w != table.typed_data()) std::memcpy(w, table.typed_data(), table.size_bytes());
  if (kAdagrad && a != acc_in) std::memcpy(a, acc_in, table.size_bytes());
  auto td = table.dimensions();
  auto ad = act.dimensions();
  hostpeers::HostCall call = base;
  call.rank = rank_buf.typed_data()[0];
  const int64_t n = call.n;
  // a replica (data_parallel) applies every source's one partition to its whole table
  const int64_t parts = replica ? 1 : n, part = replica ? 0 : call.rank;
  const int64_t u = parts >= 1 ? static_cast<int64_t>(ids.element_count()) / parts : 0;
  const int64_t p = parts >= 1 ? static_cast<int64_t>(prow.element_count()) / parts : 0;
  const int64_t nr = ad.size() ? ad[0] : 1;
  hostpeers::Packing pack;
  const size_t at_ids = pack.Add(ids.size_bytes()), at_act = pack.Add(act.size_bytes());
  const size_t at_prow = pack.Add(prow.size_bytes()), at_puniq = pack.Add(puniq.size_bytes());
  const size_t at_gain = pack.Add(gains.size_bytes());
  const bool apply = keep.typed_data()[0] != 0;
  const float rate = lr.typed_data()[0];
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
        BackwardUpdateFromSources<kAdagrad>(w, a, td.size() ? td[0] : 1, RowWidth(td), part, src,
                                            rate, at);
        return std::string();
      });
}

ffi::Error BackwardSgdFromHostSources(
    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> act,
    ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
    ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> rank,
    int64_t job, int64_t tag, int64_t n, int64_t timeout_ms, std::string_view channel,
    int64_t replica, float clip_lo, float clip_hi, float wd, int32_t has_wd, int32_t wd_lr,
    float wmin, float wmax, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return BackwardFromHostSources<false>(
      table, nullptr, ids, act, prow, puniq, gains, lr, keep, rank,
      hostpeers::HostCall{job, tag, n, 0, timeout_ms, channel}, replica != 0,
      MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax), out->typed_data(), nullptr);
}

ffi::Error BackwardAdagradFromHostSources(
    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accum, ffi::Buffer<ffi::S32> ids,
    ffi::Buffer<ffi::F32> act, ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
    ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
    ffi::Buffer<ffi::S32> rank, int64_t job, int64_t tag, int64_t n, int64_t timeout_ms,
    std::string_view channel, int64_t replica, float clip_lo, float clip_hi, float wd,
    int32_t has_wd, int32_t wd_lr, float wmin, float wmax, ffi::Result<ffi::Buffer<ffi::F32>> out,
    ffi::Result<ffi::Buffer<ffi::F32>> out_acc) {
  return BackwardFromHostSources<true>(
      table, accum.typed_data(), ids, act, prow, puniq, gains, lr, keep, rank,
      hostpeers::HostCall{job, tag, n, 0, timeout_ms, channel}, replica != 0,
      MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax), out->typed_data(),
      out_acc->typed_data());
}

ffi::Error BackwardSgdFromSources(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                                  ffi::Buffer<ffi::F32> act, ffi::Buffer<ffi::S32> prow,
                                  ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                                  ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
                                  ffi::Buffer<ffi::S32> rank, int64_t tag, int64_t n,
                                  int64_t replica, float clip_lo, float clip_hi, float wd,
                                  int32_t has_wd, int32_t wd_lr, float wmin, float wmax,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return BackwardFromSources<false>(table, nullptr, ids, act, prow, puniq, gains, lr, keep, rank,
                                    tag, n, replica != 0, MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax),
                                    out->typed_data(), nullptr);
}

ffi::Error BackwardAdagradFromSources(
    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accum, ffi::Buffer<ffi::S32> ids,
    ffi::Buffer<ffi::F32> act, ffi::Buffer<ffi::S32> prow, ffi::Buffer<ffi::S32> puniq,
    ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> keep,
    ffi::Buffer<ffi::S32> rank, int64_t tag, int64_t n, int64_t replica, float clip_lo,
    float clip_hi, float wd, int32_t has_wd, int32_t wd_lr, float wmin, float wmax,
    ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> out_acc) {
  return BackwardFromSources<true>(table, accum.typed_data(), ids, act, prow, puniq, gains, lr,
                                   keep, rank, tag, n, replica != 0,
                                   MakeAttrs(clip_lo, clip_hi, wd, has_wd, wd_lr, wmin, wmax),
                                   out->typed_data(), out_acc->typed_data());
}

}  // namespace
}  // namespace embedmesh

#define EM_UPDATE_ATTRS                 \
  .Attr<float>("clip_lo")               \
      .Attr<float>("clip_hi")           \
      .Attr<float>("wd")                \
      .Attr<int32_t>("has_wd")          \
      .Attr<int32_t>("wd_lr")           \
      .Attr<float>("wmin")              \
      .Attr<float>("wmax")
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSparseSgd, embedmesh::SparseSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSparseAdagrad, embedmesh::SparseAdagrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardSgd, embedmesh::BackwardSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardAdagrad, embedmesh::BackwardAdagrad,
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
#define EM_SOURCES_ARGS                  \
  .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Attr<int64_t>("tag")              \
      .Attr<int64_t>("n")                \
      .Attr<int64_t>("replica")
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardSgdFromSources, embedmesh::BackwardSgdFromSources,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_SOURCES_ARGS EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardAdagradFromSources,
                              embedmesh::BackwardAdagradFromSources,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_SOURCES_ARGS EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#define EM_HOST_SOURCES_ARGS             \
  .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Attr<int64_t>("job")              \
      .Attr<int64_t>("tag")              \
      .Attr<int64_t>("n")                \
      .Attr<int64_t>("timeout_ms")       \
      .Attr<std::string_view>("channel") \
      .Attr<int64_t>("replica")
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardSgdFromHostSources, embedmesh::BackwardSgdFromHostSources,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_HOST_SOURCES_ARGS
                                      EM_UPDATE_ATTRS.Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmBackwardAdagradFromHostSources,
                              embedmesh::BackwardAdagradFromHostSources,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_HOST_SOURCES_ARGS
                                      EM_UPDATE_ATTRS.Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#define EM_POOLED_ARGS                   \
  .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Attr<int64_t>("u")                \
      .Attr<int64_t>("rc")               \
      .Attr<int64_t>("k")
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmPooledBackwardSgd, embedmesh::PooledBackwardSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_POOLED_ARGS EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmPooledBackwardAdagrad, embedmesh::PooledBackwardAdagrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_POOLED_ARGS EM_UPDATE_ATTRS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#define EM_HOST_POOLED_ARGS              \
  .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Attr<int64_t>("u")                \
      .Attr<int64_t>("rc")               \
      .Attr<int64_t>("k")                \
      .Attr<int64_t>("job")              \
      .Attr<int64_t>("tag")              \
      .Attr<int64_t>("n")                \
      .Attr<int64_t>("timeout_ms")       \
      .Attr<std::string_view>("channel")
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmHostPooledBackwardSgd, embedmesh::HostPooledBackwardSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_HOST_POOLED_ARGS
                                      EM_UPDATE_ATTRS.Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmHostPooledBackwardAdagrad, embedmesh::HostPooledBackwardAdagrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() EM_HOST_POOLED_ARGS
                                      EM_UPDATE_ATTRS.Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
