// Buffers on transparent huge pages: a copy, and a constant fill.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

namespace embedmesh {
namespace {

ffi::Error HugePageCopy(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  const size_t bytes = x.size_bytes();
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(x.untyped_data());
  if (dst == src) return ffi::Error::Success();
  AdviseHuge(dst, bytes);
  const size_t grain = 8u << 20;
  ParallelFor(static_cast<int64_t>((bytes + grain - 1) / grain), [&](int64_t c) {
    size_t lo = static_cast<size_t>(c) * grain, hi = std::min(bytes, lo + grain);
    std::memcpy(dst + lo, src + lo, hi - lo);
  });
  return ffi::Error::Success();
}

// `out` filled with the one-element `value`, on transparent huge pages: a new table
// shard or optimizer slot made on the device, without a host copy to move there.
ffi::Error HugePageFill(ffi::AnyBuffer value, ffi::Result<ffi::AnyBuffer> out) {
  const size_t bytes = out->size_bytes(), w = value.size_bytes();
  char* dst = static_cast<char*>(out->untyped_data());
  if (bytes == 0 || w == 0) return ffi::Error::Success();
  AdviseHuge(dst, bytes);
  const size_t tile = std::max<size_t>(1, (64u << 10) / w) * w;
  std::vector<char> pattern(tile);
  for (size_t o = 0; o < tile; o += w) std::memcpy(pattern.data() + o, value.untyped_data(), w);
  const size_t grain = (size_t{8} << 20) / tile * tile;
  ParallelFor(static_cast<int64_t>((bytes + grain - 1) / grain), [&](int64_t c) {
    size_t lo = static_cast<size_t>(c) * grain, hi = std::min(bytes, lo + grain);
    for (size_t o = lo; o < hi; o += tile) std::memcpy(dst + o, pattern.data(), std::min(tile, hi - o));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embedmesh

EM_HANDLER("embedmesh_huge_page_copy", EmHugePageCopy, embedmesh::HugePageCopy,
           ffi::Ffi::Bind()
               .Arg<ffi::AnyBuffer>()
               .Ret<ffi::AnyBuffer>())
EM_HANDLER("embedmesh_huge_page_fill", EmHugePageFill, embedmesh::HugePageFill,
           ffi::Ffi::Bind()
               .Arg<ffi::AnyBuffer>()
               .Ret<ffi::AnyBuffer>())
