// A mapped batch in the host preprocessing's order (`id_map.sort_mapped` of
// embedmesh/device/id_map.py, its jnp reference there): each block's slots by row,
// ascending (stable: `PAD_ID` rows last), and its valid pairs grouped by their slot's new
// position, in pair order within a slot, the others after them as they were. The order a
// table of rows gets from the host, which the fused backward + update's parallel path
// requires (update_forms.h's GroupPairs): on a batch in raw-id order it takes its serial
// general path.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

#include <vector>

namespace embedmesh {
namespace sort_mapped {

constexpr int kDigit = 11;  // bits a radix pass: three passes sort a 32-bit key
constexpr int64_t kBuckets = int64_t{1} << kDigit;

// Scratch kept between calls (a fresh buffer of this size would be fresh pages each call).
struct Scratch {
  std::vector<uint32_t> key, key2;
  std::vector<int32_t> idx, idx2, pos, beg, cnt;
};

// idx[0, m): the slots of the rows that are not PAD_ID, by row (int32 order), stable: a
// least-significant-digit radix sort of the biased rows, the digits all rows share
// skipped. Then the PAD_ID slots in slot order: the order of a stable sort of all rows.
int64_t SortSlots(const int32_t* rows, int64_t u, Scratch& w) {
  w.key.resize(u);
  w.key2.resize(u);
  w.idx.resize(u);
  w.idx2.resize(u);
  int64_t m = 0;
  for (int64_t i = 0; i < u; ++i) {
    if (rows[i] == kPad) continue;
    w.key[m] = static_cast<uint32_t>(rows[i]) ^ 0x80000000u;
    w.idx[m++] = static_cast<int32_t>(i);
  }
  constexpr int kPasses = (32 + kDigit - 1) / kDigit;
  int64_t count[kPasses][kBuckets] = {};
  for (int64_t i = 0; i < m; ++i)
    for (int d = 0; d < kPasses; ++d) ++count[d][(w.key[i] >> (d * kDigit)) & (kBuckets - 1)];
  for (int d = 0; d < kPasses && m > 0; ++d) {
    int64_t* c = count[d];
    const int shift = d * kDigit;
    if (c[(w.key[0] >> shift) & (kBuckets - 1)] == m) continue;  // one digit: in order
    int64_t sum = 0;
    for (int64_t b = 0; b < kBuckets; ++b) sum += std::exchange(c[b], sum);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t at = c[(w.key[i] >> shift) & (kBuckets - 1)]++;
      w.key2[at] = w.key[i];
      w.idx2[at] = w.idx[i];
    }
    w.key.swap(w.key2);
    w.idx.swap(w.idx2);
  }
  int64_t n = m;
  for (int64_t i = 0; i < u; ++i)
    if (rows[i] == kPad) w.idx[n++] = static_cast<int32_t>(i);
  return m;
}

// One block: rows [u], pairs [p]; a pair is valid when its row is in [0, r) and its slot
// in [0, u).
void Block(const int32_t* rows, const int32_t* prow, const int32_t* puniq, const float* gain,
           int64_t u, int64_t p, int64_t r, int32_t* orows, int32_t* oprow, int32_t* opuniq,
           float* ogain, Scratch& w) {
  SortSlots(rows, u, w);
  const int32_t* idx = w.idx.data();
  for (int64_t i = 0; i < u; ++i) orows[i] = rows[idx[i]];
  auto valid = [&](int64_t q) {
    return prow[q] >= 0 && prow[q] < r && puniq[q] >= 0 && puniq[q] < u;
  };
  // The host's order: the valid pairs first, in runs of one slot each, slots ascending.
  // Then pair q goes to q + shift[its slot] (the run moved whole), without a branch.
  w.beg.assign(u + 1, 0);  // end[s]: one past slot s's last pair; then shift[s]
  w.cnt.resize(u);         // the new position of slot s
  int32_t* end = w.beg.data();
  int32_t* pos = w.cnt.data();
  int64_t nv = 0;
  int32_t prev = 0;
  bool runs = true;
  for (; nv < p && valid(nv); ++nv) {
    const int32_t s = puniq[nv];
    runs &= s >= prev;
    prev = s;
    end[s] = static_cast<int32_t>(nv + 1);
  }
  for (int64_t q = nv; q < p && runs; ++q) runs = !valid(q);
  if (runs) {
    int32_t begin = 0;  // slots ascending: a slot's run starts where the last one ended
    for (int64_t s = 0; s < u; ++s) {
      const int32_t e = end[s];
      const int32_t b = begin;
      begin = e ? e : begin;
      end[s] = e ? e - b : 0;  // its count, for now
      w.idx2[s] = b;           // (scratch: its first pair)
    }
    int32_t at = 0;
    for (int64_t i = 0; i < u; ++i) {
      const int32_t old = idx[i];
      pos[old] = static_cast<int32_t>(i);
      const int32_t c = end[old];
      end[old] = at - w.idx2[old];  // the shift of its pairs
      at += c;
    }
    for (int64_t q = 0; q < nv; ++q) {
      const int32_t s = puniq[q];
      const int64_t to = q + end[s];
      oprow[to] = prow[q];
      opuniq[to] = pos[s];
      ogain[to] = gain[q];
    }
    // the others (none valid among them) as they were
    std::memcpy(oprow + nv, prow + nv, sizeof(int32_t) * (p - nv));
    std::memcpy(opuniq + nv, puniq + nv, sizeof(int32_t) * (p - nv));
    std::memcpy(ogain + nv, gain + nv, sizeof(float) * (p - nv));
    return;
  }
  // any order: a stable counting sort of the valid pairs by their slot's new position
  w.pos.resize(u);
  pos = w.pos.data();
  for (int64_t i = 0; i < u; ++i) pos[idx[i]] = static_cast<int32_t>(i);
  std::vector<int64_t> start(u + 1, 0);
  nv = 0;  // (recounted: the loop above stopped at the first pair out of order)
  for (int64_t q = 0; q < p; ++q) {
    if (!valid(q)) continue;
    ++start[pos[puniq[q]] + 1];
    ++nv;
  }
  for (int64_t i = 0; i < u; ++i) start[i + 1] += start[i];
  int64_t rest = nv;
  for (int64_t q = 0; q < p; ++q) {
    int64_t at;
    int32_t slot = puniq[q];
    if (valid(q)) {
      slot = pos[slot];
      at = start[slot]++;
    } else {
      at = rest++;
    }
    oprow[at] = prow[q];
    opuniq[at] = slot;
    ogain[at] = gain[q];
  }
}

// Several stacks in one call: an s32 [k] operand (each stack's r), then each stack's rows
// s32 [..., U], pair_rows, pair_unique s32 [..., P], pair_gains f32 [..., P] (the same
// leading dimensions: the blocks); results likewise, sorted. The stacks' blocks shared
// out over the threads (a call a stack ran on one thread: its helper thread started late).
ffi::Error SortMappedMany(ffi::Buffer<ffi::S32> rs, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  const int64_t k = static_cast<int64_t>(rs.element_count());
  if (static_cast<int64_t>(args.size()) != 4 * k || static_cast<int64_t>(rets.size()) != 4 * k)
    return ffi::Error::InvalidArgument("sort_mapped_many: four operands and results a stack");
  struct Task {
    const int32_t *rows, *prow, *puniq;
    const float* gain;
    int32_t *orows, *oprow, *opuniq;
    float* ogain;
    int64_t u, p, r;
  };
  std::vector<Task> tasks;
  for (int64_t t = 0; t < k; ++t) {
    const void* in[4];
    void* out[4];
    int64_t count[4] = {0, 0, 0, 0}, last[2] = {1, 1};
    for (int64_t j = 0; j < 4; ++j) {
      auto a = args.get<ffi::AnyBuffer>(4 * t + j);
      auto o = rets.get<ffi::AnyBuffer>(4 * t + j);
      if (a.has_error()) return a.error();
      if (o.has_error()) return o.error();
      in[j] = a->untyped_data();
      out[j] = (*o)->untyped_data();
      count[j] = static_cast<int64_t>(a->element_count());
      auto d = a->dimensions();
      if (j < 2 && d.size()) last[j] = d[d.size() - 1];
    }
    const int64_t u = last[0], p = last[1];
    const int64_t n = u ? count[0] / u : 0;
    if (n * p != count[1] || count[1] != count[2] || count[1] != count[3])
      return ffi::Error::InvalidArgument("sort_mapped_many: the pairs' blocks do not match");
    for (int64_t s = 0; s < n; ++s)
      tasks.push_back(Task{static_cast<const int32_t*>(in[0]) + s * u,
                           static_cast<const int32_t*>(in[1]) + s * p,
                           static_cast<const int32_t*>(in[2]) + s * p,
                           static_cast<const float*>(in[3]) + s * p,
                           static_cast<int32_t*>(out[0]) + s * u,
                           static_cast<int32_t*>(out[1]) + s * p,
                           static_cast<int32_t*>(out[2]) + s * p,
                           static_cast<float*>(out[3]) + s * p, u, p, rs.typed_data()[t]});
  }
  ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    thread_local Scratch w;
    const Task& t = tasks[i];
    Block(t.rows, t.prow, t.puniq, t.gain, t.u, t.p, t.r, t.orows, t.oprow, t.opuniq, t.ogain,
          w);
  });
  return ffi::Error::Success();
}

}  // namespace sort_mapped
}  // namespace embedmesh

EM_HANDLER("embedmesh_sort_mapped_many", EmSortMappedMany,
           embedmesh::sort_mapped::SortMappedMany,
           ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets());
