// Pooling on the owner (shard_program.lookup_pooled): a source packs its pairs for each
// owner into one int32 message (pooled.h), and an owner sums its sources' pairs from its
// table into partial activations. Part of embedmesh's CPU kernels (XLA FFI); built by
// build.py, registered by kernels.py.
#include "common.h"
#include "pooled.h"

namespace embedmesh {
namespace {

// ops.pack_pooled_pairs: for each owner o, ids[o] then per pair (position, row, gain).
ffi::Error PackPooledPairs(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> prow,
                           ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                           ffi::Buffer<ffi::S32> compact, int64_t rc, int64_t k,
                           ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto idd = ids.dimensions();
  const int64_t n = idd.size() ? idd[0] : 1;
  const int64_t u = n ? static_cast<int64_t>(ids.element_count()) / n : 0;
  const int64_t p = n ? static_cast<int64_t>(prow.element_count()) / n : 0;
  const int64_t cw = n ? static_cast<int64_t>(compact.element_count()) / n : 0;
  const PooledLayout l{n, u, p, rc, k};
  int32_t* o = out->typed_data();
  ParallelFor(n, [&](int64_t s) {
    int32_t* block = o + s * l.width();
    std::memcpy(block, ids.typed_data() + s * u, sizeof(int32_t) * u);
    const int32_t* pr = prow.typed_data() + s * p;
    const int32_t* pu = puniq.typed_data() + s * p;
    const float* pg = gains.typed_data() + s * p;
    const int32_t* map = cw ? compact.typed_data() + s * cw : nullptr;
    int32_t* w = block + u;
    for (int64_t q = 0; q < p; ++q, w += k) {
      // out of range: "none" (compact[R], rc, u)
      int64_t r = pr[q];
      if (map != nullptr) r = map[(r < 0 || r > cw - 1) ? cw - 1 : r];
      if (r < 0 || r > rc) r = rc;
      int64_t pos = pu[q];
      if (pos < 0 || pos > u) pos = u;
      if (k == 2) {
        w[0] = static_cast<int32_t>(pos * (rc + 1) + r);
      } else {
        w[0] = static_cast<int32_t>(pos);
        w[1] = static_cast<int32_t>(r);
      }
      std::memcpy(w + k - 1, pg + q, sizeof(float));
    }
  });
  return ffi::Error::Success();
}

// ops.pooled_partials: out[s * rc + row] += gain * table[ids_s[position]] over each
// source's pairs, each row in pair order (SegmentRowSums).
ffi::Error PooledPartials(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> served, int64_t u,
                          int64_t rc, int64_t k, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto td = table.dimensions();
  auto sd = served.dimensions();
  const int64_t rows = td.size() ? td[0] : 1, d = RowWidth(td);
  const int64_t n = sd.size() ? sd[0] : 1;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const int32_t* msg = served.typed_data();
  std::vector<int32_t> dst(n * l.p);
  std::vector<int32_t> src(n * l.p);
  std::vector<float> gain(n * l.p);
  ParallelFor(n, [&](int64_t s) {
    const int32_t* block = msg + s * words;
    for (int64_t q = 0; q < l.p; ++q) {
      int32_t pos, row;
      const int64_t i = s * l.p + q;
      DecodePair(block, l, q, &pos, &row, &gain[i]);
      const int32_t id = pos >= 0 ? block[pos] : -1;
      const bool ok = row >= 0 && id >= 0 && id < rows;
      dst[i] = ok ? static_cast<int32_t>(s * rc + row) : -1;
      src[i] = ok ? id : -1;
    }
  });
  const float* t = table.typed_data();
  SegmentRowSums(out->typed_data(), d, n * rc, n * l.p, dst.data(), gain.data(),
                 [&](int64_t q) -> const float* { return src[q] >= 0 ? t + src[q] * d : nullptr; });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embedmesh

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmPackPooledPairs, embedmesh::PackPooledPairs,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("rc")
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmPooledPartials, embedmesh::PooledPartials,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("u")
                                  .Attr<int64_t>("rc")
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::F32>>());
