// Row gathers and in-place row scatters.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

namespace embedmesh {
namespace {

// Calls move(i, r) for each i < n with its row r = id[i] (any value: `move` checks it), in
// parallel chunks, first prefetching (prefetch(r)) the row kPrefetch ids ahead when it is
// one of the table's `rows`.
template <typename Prefetch, typename Move>
void ForEachRowId(const int32_t* id, int64_t n, int64_t rows, Prefetch prefetch, Move move) {
  const int64_t grain = 4096;
  ParallelFor(NumChunks(n, grain), [&](int64_t c) {
    const int64_t lo = c * grain, hi = std::min(n, lo + grain);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        int64_t r = id[i + kPrefetch];
        if (r >= 0 && r < rows) prefetch(r);
      }
      move(i, static_cast<int64_t>(id[i]));
    }
  });
}

ffi::Error GatherRows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                      ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rows = Rows(table);
  const int64_t rb = RowElems(table) * ffi::ByteWidth(table.element_type());
  const int64_t n = ids.element_count();
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  PrepareOutput(dst, n * rb);
  ForEachRowId(
      ids.typed_data(), n, rows, [&](int64_t r) { PrefetchRead(src + r * rb, rb); },
      [&](int64_t i, int64_t r) {
        if (r >= 0 && r < rows) {
          std::memcpy(dst + i * rb, src + r * rb, rb);
        } else {
          std::memset(dst + i * rb, 0, rb);
        }
      });
  return ffi::Error::Success();
}

ffi::Error ScatterRows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer values,
                       ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rows = Rows(table);
  const int64_t rb = RowElems(table) * ffi::ByteWidth(table.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != table.untyped_data()) {  // not aliased: copy the table first
    std::memcpy(dst, table.untyped_data(), table.size_bytes());
  }
  const char* src = static_cast<const char*>(values.untyped_data());
  ForEachRowId(
      ids.typed_data(), ids.element_count(), rows,
      [&](int64_t r) { PrefetchWrite(dst + r * rb, rb); },
      [&](int64_t i, int64_t r) {
        if (r >= 0 && r < rows) std::memcpy(dst + r * rb, src + i * rb, rb);
      });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embedmesh

EM_HANDLER("embedmesh_gather_rows", EmGatherRows, embedmesh::GatherRows)
EM_HANDLER("embedmesh_scatter_rows", EmScatterRows, embedmesh::ScatterRows)
