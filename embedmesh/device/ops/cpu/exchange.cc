// The all-to-all (ops.exchange) and the N-shard lookup (ops.lookup_from_shards), written
// once over the transports of transport.h: between the CPU devices of one process, and
// between processes of one host through POSIX shared memory.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by library.py.
//
// Why: XLA's own CPU all_to_all moves about 1.4 GB/s here in one process (its rendezvous
// copies each block through a staging path), and about 0.21 GB/s across processes (gloo's
// TCP loopback). The devices of one process share an address space, so each device copies
// the blocks meant for it straight out of its peers' input buffers; processes of one host
// share memory segments, so each device writes its input once into its segment and each
// peer copies its block out of it, at memcpy speed. The lookup does better still: no
// exchanged copy of a row (ReadPeerRows).
#include "transport.h"

namespace embedmesh {
namespace {

template <class T>
ffi::Error Exchange(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  T t;
  if (ffi::Error e; !ReadTransport(attrs, rank_buf, "exchange", &t, &e)) return e;
  const size_t bytes = x.size_bytes();
  if (t.n < 1 || bytes % t.n != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      t.Where() + ": " + std::to_string(bytes) + " bytes do not split into " +
                          std::to_string(t.n) + " blocks");
  }
  const size_t block = bytes / t.n;
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  PrepareOutput(dst, bytes);
  return AllToAll(t, block, dst, src,
                  [&](int64_t s, char* to) { std::memcpy(to, src + s * block, block); });
}

// The lookup of one device straight from every shard's table: out[pair_rows[s, p]] +=
// gains[s, p] * table_s[unique_ids[s, pair_unique[s, p]]], table_s being device s's
// shard (all of `rows` x `d`, of a storage type: storage.h, read as float32), summed in
// (s, p) order in float32: what the exchange of ids, the owners' gathers into [N, U, D],
// the exchange of rows and the combine compute, with no [N, U, D] buffer in process and no
// exchanged copy of a row (between processes the rows cross in their storage type).
template <class T>
ffi::Error LookupFromShards(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> uids,
                            ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                            ffi::Buffer<ffi::S32> prows, ffi::Buffer<ffi::S32> rank_buf,
                            ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Dictionary attrs) {
  T t;
  if (ffi::Error e; !ReadTransport(attrs, rank_buf, "lookup", &t, &e)) return e;
  const int64_t n = t.n;
  auto td = table.dimensions();
  const int64_t rows = td.size() ? td[0] : 1, d = RowWidth(td);
  auto od = out->dimensions();
  const int64_t segs = od.size() ? od[0] : 1;
  const int64_t u = n >= 1 ? uids.element_count() / n : 0;
  const int64_t p = n >= 1 ? puniq.element_count() / n : 0;
  const int32_t* pu = puniq.typed_data();
  const int32_t* pr = prows.typed_data();
  const float* g = gains.typed_data();
  float* o = out->typed_data();
  return WithStorage(table.element_type(), "lookup", [&](auto tag) {
    using E = typename decltype(tag)::type;
    return ReadPeerRows(t, static_cast<const E*>(table.untyped_data()), rows, d,
                        uids.typed_data(), u, [&](const auto& row_of) {
                          // the pairs are [n, p] row-major: pair q = s * p + k is shard s's
                          SegmentRowSums(o, d, segs, n * p, pr, g, [&](int64_t q) -> const E* {
                            const int64_t k = pu[q];
                            return k < 0 || k >= u ? nullptr : row_of(q / p, k);
                          });
                          return std::string();
                        });
  });
}

// `rank`, copied, once `previous` (the output of the program's last cross-device call; not
// read) is written: what runs one program's cross-device calls in the same order on every
// device (kernels.py, `_after_last_call`). XLA's CPU runtime orders a program's work by
// the buffers it reads and writes alone, and each of these calls blocks until its peers
// reach the same one.
ffi::Error After(ffi::Buffer<ffi::S32> rank, ffi::AnyBuffer /*previous*/,
                 ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::memcpy(out->typed_data(), rank.typed_data(), rank.size_bytes());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embedmesh

EM_HANDLER("embedmesh_after", EmAfter, embedmesh::After)
EM_DEFINE_TRANSPORTED(Exchange,
                      ffi::Ffi::Bind()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::AnyBuffer>()
                          .Attrs(),
                      "embedmesh_exchange", "embedmesh_host_exchange")
EM_DEFINE_TRANSPORTED(LookupFromShards,
                      ffi::Ffi::Bind()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::F32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::F32>>()
                          .Attrs(),
                      "embedmesh_lookup_from_shards", "embedmesh_host_lookup")
