// The all-to-all between processes of one host (ops.exchange with `host_job`) and the
// N-shard lookup between them (ops.lookup_from_shards), through POSIX shared memory (the
// rendezvous is host_peers.h). Part of embedmesh's CPU kernels (XLA FFI); built by
// build.py, registered by library.py, called by kernels.py.
//
// Why: across processes, XLA's CPU all_to_all goes through gloo's TCP loopback, about
// 0.21 GB/s here, so a training step that sends ~34 MB per device spent most of its time
// there and two processes ran 2-3x slower than one. Processes of one host can share memory:
// each device writes its input once into a shared segment and each peer copies its block
// out of it, at memcpy speed (several GB/s). The lookup does better still: each owner
// gathers the rows every device asked of it straight into its segment, and each device
// sums its activations from the owners' segments in place (no exchanged copy of a row).
#include "host_peers.h"

namespace embedmesh {
namespace {

using hostpeers::HostCall;
using hostpeers::WithHostPeers;

ffi::Error HostExchange(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf, int64_t job,
                        int64_t tag, int64_t n, int64_t timeout_ms, std::string_view channel,
                        ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rank = rank_buf.typed_data()[0];
  const size_t bytes = x.size_bytes();
  if (n < 1 || bytes % n != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "embedmesh host exchange (channel '" + std::string(channel) + "'): " +
                          std::to_string(bytes) + " bytes do not split into " +
                          std::to_string(n) + " blocks");
  }
  const size_t block = bytes / n;
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  PrepareOutput(dst, bytes);  // (this rank's own block never leaves it)
  return hostpeers::WrittenAllToAll(HostCall{job, tag, n, rank, timeout_ms, channel}, block, dst,
                                    [&](int64_t s, char* to) {
                                      std::memcpy(to, src + s * block, block);
                                    });
}

// The lookup of one device over N shards in processes of one host: what LookupFromShards
// (exchange.cc) computes for in-process shards, in two rounds. First every device
// publishes the ids it asks of each shard ([n, u]); then each owner gathers, for every
// device r, the rows r asked of it into its segment ([n, u, d]; zeros for padding), and
// each device sums gains * row over its pairs (in (s, p) order, as the in-process kernel)
// reading the rows in the owners' segments (its own shard's in its table).
ffi::Error HostLookup(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> uids,
                      ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                      ffi::Buffer<ffi::S32> prows, ffi::Buffer<ffi::S32> rank_buf, int64_t job,
                      int64_t tag, int64_t rows_tag, int64_t n, int64_t timeout_ms,
                      std::string_view channel, ffi::Result<ffi::Buffer<ffi::F32>> out) {
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
  const float* w = table.typed_data();
  float* o = out->typed_data();
  const size_t id_bytes = sizeof(int32_t) * n * u;
  const size_t row_bytes = sizeof(float) * n * u * d;
  return WithHostPeers(
      HostCall{job, tag, n, rank, timeout_ms, channel}, id_bytes,
      [&](char* seg) { std::memcpy(seg, id, id_bytes); },
      [&](const std::vector<const char*>& asked) {
        ffi::Error e = WithHostPeers(
            HostCall{job, rows_tag, n, rank, timeout_ms, channel}, row_bytes,
            [&](char* seg) {  // the rows each other device asked of this shard
              float* dst = reinterpret_cast<float*>(seg);
              const int64_t grain = 1024;
              ParallelFor(NumChunks(n * u, grain), [&](int64_t c) {
                const int64_t lo = c * grain, hi = std::min(n * u, lo + grain);
                for (int64_t q = lo; q < hi; ++q) {
                  const int64_t r = q / u, k = q % u;
                  if (r == rank) continue;  // this device reads its own shard in place
                  const int32_t row = reinterpret_cast<const int32_t*>(asked[r])[rank * u + k];
                  float* to = dst + q * d;
                  if (row < 0 || row >= rows) {
                    std::memset(to, 0, sizeof(float) * d);
                  } else {
                    std::memcpy(to, w + static_cast<int64_t>(row) * d, sizeof(float) * d);
                  }
                }
              });
            },
            [&](const std::vector<const char*>& served) {
              SegmentRowSums(o, d, segs, n * p, pr, g, [&](int64_t q) -> const float* {
                const int64_t k = pu[q];
                if (k < 0 || k >= u) return nullptr;
                const int64_t s = q / p;
                const int64_t r = id[s * u + k];
                if (r < 0 || r >= rows) return nullptr;
                if (s == rank) return w + r * d;
                return reinterpret_cast<const float*>(served[s]) + (rank * u + k) * d;
              });
              return std::string();
            });
        return e.success() ? std::string() : std::string(e.message());
      });
}

}  // namespace
}  // namespace embedmesh

// Waits (up to timeout_s) until every peer has read the last round of each of this
// process's channels, then unlinks their segments; returns how many it unlinked. The Python
// side calls it at exit. Mappings (ours and the peers') stay valid after an unlink.
extern "C" int64_t EmbedmeshHostExchangeRelease(double timeout_s) {
  namespace hp = embedmesh::hostpeers;
  std::lock_guard<std::mutex> lock(hp::Mutex());
  const auto deadline =
      hp::Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  int64_t unlinked = 0;
  for (auto& [key, ch] : hp::Channels()) {
    if (ch->own.fd < 0) continue;
    for (int64_t s = 0; s < ch->n; ++s) {
      const auto& m = ch->peers[s];
      if (s == ch->rank || m.base == nullptr) continue;
      const int64_t last = ch->round;
      hp::WaitUntil(
          [&] { return m.header()->done.v.load(std::memory_order_acquire) >= last; }, deadline,
          [&] { return hp::WriterExited(m.header()); });
    }
    if (!ch->unlinked && shm_unlink(ch->Name(ch->rank).c_str()) == 0) ++unlinked;
    ch->unlinked = true;
    close(ch->own.fd);
    ch->own.fd = -1;
  }
  return unlinked;
}

// A job starts (peers.same_host_job, at build): registers the pids of its processes (in
// process order, with their pid namespaces) for its waiters to watch, and removes the
// segments of exited writers that jobs killed whole left in /dev/shm; returns how many.
extern "C" int64_t EmbedmeshHostJobBegin(int64_t job, const int64_t* pids, const int64_t* ns,
                                         int64_t count) {
  namespace hp = embedmesh::hostpeers;
  std::vector<hp::JobProcess> procs;
  for (int64_t i = 0; i < count; ++i) {
    char state = 0;
    int64_t start = 0;  // now, while it runs: a later process with its pid is another
    hp::ProcStat(pids[i], state, start);
    procs.push_back({pids[i], ns[i], start});
  }
  {
    std::lock_guard<std::mutex> lock(hp::JobsMutex());
    hp::JobProcesses()[job] = std::move(procs);
  }
  return hp::RemoveDeadSegments();
}

// The tags of this process's channels of job `job` (up to `cap` of them into `out`); how
// many there are. Which host kernels ran, for tests.
extern "C" int64_t EmbedmeshHostChannelTags(int64_t job, int64_t* out, int64_t cap) {
  namespace hp = embedmesh::hostpeers;
  std::lock_guard<std::mutex> lock(hp::Mutex());
  int64_t count = 0;
  for (auto& [key, ch] : hp::Channels()) {
    if (ch->job != job) continue;
    if (count < cap) out[count] = ch->tag;
    ++count;
  }
  return count;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmHostExchange, embedmesh::HostExchange,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("job")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<std::string_view>("channel")
                                  .Ret<ffi::AnyBuffer>());
EM_LIST_HANDLER("embedmesh_host_exchange", EmHostExchange)
XLA_FFI_DEFINE_HANDLER_SYMBOL(EmHostLookup, embedmesh::HostLookup,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("job")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("rows_tag")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<std::string_view>("channel")
                                  .Ret<ffi::Buffer<ffi::F32>>());
EM_LIST_HANDLER("embedmesh_host_lookup", EmHostLookup)
