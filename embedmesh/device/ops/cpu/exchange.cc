// Collectives of CPU devices that live in one process, through their shared memory: the
// all-to-all, and the lookup read straight from every shard's table.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
//
// XLA's own CPU all_to_all moves about 1.4 GB/s here (its rendezvous copies each block
// through a staging path); the devices of one process share an address space, so each
// device can copy the blocks meant for it straight out of its peers' input buffers.
// The rendezvous that pairs the calls of the devices is in peers.h.
#include "peers.h"

namespace embedmesh {
namespace {

ffi::Error Exchange(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf, int64_t tag, int64_t n,
                    ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rank = rank_buf.typed_data()[0];
  const size_t bytes = x.size_bytes();
  if (n >= 1 && bytes % n != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "embedmesh exchange: " + std::to_string(bytes) +
                          " bytes do not split into " + std::to_string(n) + " blocks");
  }
  const size_t block = n >= 1 ? bytes / n : 0;
  char* dst = static_cast<char*>(out->untyped_data());
  return WithPeers(tag, n, rank, x.untyped_data(), "exchange", [&](const auto& peers) {
    PrepareOutput(dst, bytes);
    for (int64_t s = 0; s < n; ++s) std::memcpy(dst + s * block, peers[s] + rank * block, block);
  });
}

// The lookup of one device straight from every shard's table: out[pair_rows[s, p]] +=
// gains[s, p] * table_s[unique_ids[s, pair_unique[s, p]]], table_s being device s's
// shard (all of `rows` x `d`), summed in (s, p) order: what the exchange of ids, the
// owners' gathers into [N, U, D], the exchange of rows and the combine compute, with no
// [N, U, D] buffer and no copy of a row.
ffi::Error LookupFromShards(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> uids,
                            ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                            ffi::Buffer<ffi::S32> prows, ffi::Buffer<ffi::S32> rank_buf,
                            int64_t tag, int64_t n, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t rank = rank_buf.typed_data()[0];
  auto td = table.dimensions();
  const int64_t rows = td.size() ? td[0] : 1, d = RowWidth(td);
  auto od = out->dimensions();
  const int64_t segs = od.size() ? od[0] : 1;
  const int64_t u = n >= 1 ? uids.element_count() / n : 0;
  const int64_t p = n >= 1 ? puniq.element_count() / n : 0;
  const int32_t* id = uids.typed_data();
  const int32_t* pu = puniq.typed_data();
  const int32_t* pr = prows.typed_data();
  const float* g = gains.typed_data();
  float* o = out->typed_data();
  // the pairs are [n, p] row-major: the flat pair q = s * p + k belongs to shard s
  return WithPeers(tag, n, rank, table.typed_data(), "lookup", [&](const auto& peers) {
    SegmentRowSums(o, d, segs, n * p, pr, g, [&](int64_t q) -> const float* {
      const int64_t k = pu[q];
      if (k < 0 || k >= u) return nullptr;
      const int64_t s = q / p;
      const int64_t r = id[s * u + k];
      if (r < 0 || r >= rows) return nullptr;
      return reinterpret_cast<const float*>(peers[s]) + r * d;
    });
  });
}

}  // namespace
}  // namespace embedmesh

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmExchange, embedmesh::Exchange,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::AnyBuffer>());
EM_LIST_HANDLER("embedmesh_exchange", EmExchange)
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmLookupFromShards, embedmesh::LookupFromShards,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::F32>>());
EM_LIST_HANDLER("embedmesh_lookup_from_shards", EmLookupFromShards)
