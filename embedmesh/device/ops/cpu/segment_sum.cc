// Gather-scale-segment sums (the lookup combine and the backward).
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

namespace embedmesh {
namespace {

// out[dst[p]] += gains[p] * src[row(p)], row(p) = sidx[p] (or map[sidx[p]] with a map),
// src of any storage type (storage.h: read as float32), through SegmentRowSums (common.h):
// each destination sums in pair order, in float32.
ffi::Error SegmentGatherSumImpl(const ffi::AnyBuffer& src, const int32_t* map, int64_t map_n,
                                ffi::Buffer<ffi::S32>& sidx, ffi::Buffer<ffi::F32>& gains,
                                ffi::Buffer<ffi::S32>& didx, ffi::Buffer<ffi::F32>& out) {
  auto sd = src.dimensions();
  auto od = out.dimensions();
  const int64_t m = sd.size() ? sd[0] : 1, d = RowWidth(sd), segs = od.size() ? od[0] : 1;
  const int32_t* si = sidx.typed_data();
  return WithStorage(src.element_type(), "segment_gather_sum", [&](auto tag) {
    using E = typename decltype(tag)::type;
    const E* s = static_cast<const E*>(src.untyped_data());
    SegmentRowSums(out.typed_data(), d, segs, sidx.element_count(), didx.typed_data(),
                   gains.typed_data(), [&](int64_t q) -> const E* {
                     int64_t r = si[q];
                     if (map != nullptr) {
                       if (r < 0 || r >= map_n) return nullptr;
                       r = map[r];
                     }
                     return (r >= 0 && r < m) ? s + r * d : nullptr;
                   });
    return ffi::Error::Success();
  });
}

ffi::Error SegmentGatherSum(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> sidx,
                            ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::S32> didx,
                            ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return SegmentGatherSumImpl(src, nullptr, 0, sidx, gains, didx, *out);
}

ffi::Error SegmentGatherSumMapped(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> map,
                                  ffi::Buffer<ffi::S32> sidx, ffi::Buffer<ffi::F32> gains,
                                  ffi::Buffer<ffi::S32> didx,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return SegmentGatherSumImpl(src, map.typed_data(), map.element_count(), sidx, gains, didx,
                              *out);
}

}  // namespace
}  // namespace embedmesh

EM_HANDLER("embedmesh_segment_gather_sum", EmSegmentGatherSum, embedmesh::SegmentGatherSum)
EM_HANDLER("embedmesh_segment_gather_sum_mapped", EmSegmentGatherSumMapped,
           embedmesh::SegmentGatherSumMapped)
