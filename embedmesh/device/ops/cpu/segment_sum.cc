// Gather-scale-segment sums (the lookup combine and the backward).
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

namespace embedmesh {
namespace {

// out[dst[p]] += gains[p] * src[row(p)], row(p) = sidx[p] (or map[sidx[p]] with a map),
// through SegmentRowSums (common.h): each destination sums in pair order.
ffi::Error SegmentGatherSumImpl(const float* s, int64_t m, int64_t d,
                                const int32_t* map, int64_t map_n, const int32_t* si,
                                const float* g, const int32_t* di, int64_t p, float* o,
                                int64_t segs) {
  SegmentRowSums(o, d, segs, p, di, g, [&](int64_t q) -> const float* {
    int64_t r = si[q];
    if (map != nullptr) {
      if (r < 0 || r >= map_n) return nullptr;
      r = map[r];
    }
    return (r >= 0 && r < m) ? s + r * d : nullptr;
  });
  return ffi::Error::Success();
}

ffi::Error SegmentGatherSum(ffi::Buffer<ffi::F32> src,
                            ffi::Buffer<ffi::S32> sidx, ffi::Buffer<ffi::F32> gains,
                            ffi::Buffer<ffi::S32> didx, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto sd = src.dimensions();
  auto od = out->dimensions();
  return SegmentGatherSumImpl(src.typed_data(), sd.size() ? sd[0] : 1, RowWidth(sd),
                              nullptr, 0, sidx.typed_data(), gains.typed_data(),
                              didx.typed_data(), sidx.element_count(), out->typed_data(),
                              od.size() ? od[0] : 1);
}

ffi::Error SegmentGatherSumMapped(ffi::Buffer<ffi::F32> src,
                                  ffi::Buffer<ffi::S32> map, ffi::Buffer<ffi::S32> sidx,
                                  ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::S32> didx,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto sd = src.dimensions();
  auto od = out->dimensions();
  return SegmentGatherSumImpl(src.typed_data(), sd.size() ? sd[0] : 1, RowWidth(sd),
                              map.typed_data(), map.element_count(), sidx.typed_data(),
                              gains.typed_data(), didx.typed_data(), sidx.element_count(),
                              out->typed_data(), od.size() ? od[0] : 1);
}

}  // namespace
}  // namespace embedmesh

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSegmentGatherSum, embedmesh::SegmentGatherSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
EM_LIST_HANDLER("embedmesh_segment_gather_sum", EmSegmentGatherSum)
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmSegmentGatherSumMapped, embedmesh::SegmentGatherSumMapped,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
EM_LIST_HANDLER("embedmesh_segment_gather_sum_mapped", EmSegmentGatherSumMapped)
