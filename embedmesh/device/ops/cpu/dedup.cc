// The owner's dedup: distinct ids and their summed gradients.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

namespace embedmesh {
namespace {

// ids [N, U] (each row expected ascending), grads [N*U, D] -> distinct ids ascending (PAD
// padded) and per-id sums in input order. `sums` may alias `grads` (in place).
ffi::Error DedupSum(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                    ffi::Result<ffi::Buffer<ffi::S32>> uniq,
                    ffi::Result<ffi::Buffer<ffi::F32>> sums) {
  auto idd = ids.dimensions();
  const int64_t m = ids.element_count();
  const int64_t nb = idd.size() >= 2 ? idd[0] : 1;
  const int64_t ub = nb ? m / nb : 0;
  const int64_t d = RowWidth(grads.dimensions());
  const int32_t* id = ids.typed_data();
  const float* g = grads.typed_data();
  int32_t* uo = uniq->typed_data();
  float* so = sums->typed_data();
  bool sorted = true;
  for (int64_t b = 0; b < nb && sorted; ++b)
    for (int64_t i = b * ub + 1; i < (b + 1) * ub; ++i)
      if (id[i] < id[i - 1]) { sorted = false; break; }
  std::vector<int64_t> order;
  bool identity = sorted && nb <= 1;  // then write slot <= read slot: safe in place
  if (!identity) {
    order.reserve(m);
    if (sorted) {  // N-way merge, ties by block (= stable order)
      std::vector<int64_t> head(nb), end(nb);
      for (int64_t b = 0; b < nb; ++b) { head[b] = b * ub; end[b] = (b + 1) * ub; }
      while (true) {
        int64_t best = -1;
        int32_t bv = 0;
        for (int64_t b = 0; b < nb; ++b) {
          if (head[b] < end[b] && id[head[b]] != kPad && (best < 0 || id[head[b]] < bv)) {
            best = b;
            bv = id[head[b]];
          }
        }
        if (best < 0) break;
        order.push_back(head[best]++);
      }
    } else {
      for (int64_t i = 0; i < m; ++i) if (id[i] != kPad) order.push_back(i);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    }
  }
  std::vector<float> copy;
  if (!identity && static_cast<const void*>(so) == static_cast<const void*>(g)) {
    copy.assign(g, g + m * d);
    g = copy.data();
  } else if (static_cast<const void*>(so) != static_cast<const void*>(g)) {
    PrepareOutput(so, sizeof(float) * m * d);
  }
  const int64_t count = identity ? m : static_cast<int64_t>(order.size());
  int64_t k = -1;
  int32_t last = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = identity ? j : order[j];
    if (id[i] == kPad) {
      if (identity) break;  // sorted: only padding follows
      continue;
    }
    const float* gr = g + i * d;
    if (k < 0 || id[i] != last) {
      ++k;
      last = id[i];
      uo[k] = last;
      if (so + k * d != gr) std::memmove(so + k * d, gr, sizeof(float) * d);
    } else {
      float* __restrict__ sr = so + k * d;
      for (int64_t c = 0; c < d; ++c) sr[c] += gr[c];
    }
  }
  for (int64_t i = k + 1; i < m; ++i) uo[i] = kPad;
  if (k + 1 < m) std::memset(so + (k + 1) * d, 0, sizeof(float) * (m - k - 1) * d);
  return ffi::Error::Success();
}

// Fused sparse SGD / Adagrad on the rows `ids` (distinct; out of range skipped), in place:

}  // namespace
}  // namespace embedmesh

EM_HANDLER("embedmesh_dedup_sum", EmDedupSum, embedmesh::DedupSum,
           ffi::Ffi::Bind()
               .Arg<ffi::Buffer<ffi::S32>>()
               .Arg<ffi::Buffer<ffi::F32>>()
               .Ret<ffi::Buffer<ffi::S32>>()
               .Ret<ffi::Buffer<ffi::F32>>())
