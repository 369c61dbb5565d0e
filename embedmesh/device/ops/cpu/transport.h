// The one transport interface of the cross-device ops: each op (exchange.cc, pooled.cc,
// update.cc) is written once, as a template over the transport, and registered for each
// (EM_DEFINE_TRANSPORTED). Part of embedmesh's CPU kernels (XLA FFI).
//
// A transport is the rendezvous of the n device ranks of one call site; two implement it:
//   InProcess     the devices of one process (peers.h): a rank lends its buffers and its
//                 peers read them in place; every rank waits for all at the end of a round,
//                 so nothing lent is released while a peer reads it.
//   SharedMemory  the processes of one host (host_peers.h): a rank copies what it publishes
//                 into its POSIX shared-memory segment and its peers read it there; a rank
//                 waits at the start of a round until its peers have read its last one.
// Each has `n`, `rank`, `kLends` (whether peers can read this rank's own buffers), `Read`
// (the transport of a call, from its attributes and its rank) and
//   Round(bytes, lend, fill, meanwhile, work): one round. This rank publishes `bytes` laid
//   out as at `lend` (lent as it is where the transport lends; else fill(dst) writes them),
//   runs meanwhile() (its own work, no peer needed), then work(peers) with peers[s] rank s's
//   data; work returns "" or an error message.
// On them, the ways the ops move data, each choosing per transport how (kLends):
//   AllToAll      block s of this rank's out from rank s;
//   ReadBlocks    the blocks every rank published for this one, read in place;
//   ShareArrays   every rank's arrays, read in place;
//   ReadPeerRows  rows of every rank's table.
#pragma once

#include <array>

#include "common.h"
#include "host_peers.h"
#include "peers.h"

namespace embedmesh {

// The devices of one process. Its attributes: `tag` (unique per traced call) and `n`.
struct InProcess {
  static constexpr bool kLends = true;
  int64_t tag = 0, n = 0, rank = 0;
  const char* what = "";  // the op, for errors

  static InProcess Read(AttrReader& a, int64_t rank, const char* what) {
    return InProcess{a.I("tag"), a.I("n"), rank, what};
  }
  std::string Where() const { return std::string("embedmesh ") + what; }

  // `lend` is required (fill is never called); meanwhile runs before this rank arrives.
  template <class Fill, class Meanwhile, class Work>
  ffi::Error Round(size_t, const void* lend, const Fill&, const Meanwhile& meanwhile,
                   const Work& work) const {
    meanwhile();
    std::string err;
    ffi::Error e =
        WithPeers(tag, n, rank, lend, what, [&](const auto& peers) { err = work(peers); });
    if (e.success() && !err.empty()) return ffi::Error::InvalidArgument(Where() + ": " + err);
    return e;
  }
};

// The processes of one host. Its attributes: `job`, `tag` (the channel's hash), `n`,
// `timeout_ms`, `channel` and, for a call of two rounds (ReadPeerRows), `rows_tag`.
struct SharedMemory {
  static constexpr bool kLends = false;
  hostpeers::HostCall call;
  int64_t n = 0, rank = 0, rows_tag = 0;

  static SharedMemory Read(AttrReader& a, int64_t rank, const char*) {
    SharedMemory t{{a.I("job"), a.I("tag"), a.I("n"), rank, a.I("timeout_ms"), a.S("channel")}};
    t.n = t.call.n, t.rank = rank;
    if (a.Has("rows_tag")) t.rows_tag = a.I("rows_tag");
    return t;
  }
  std::string Where() const {
    return "embedmesh host exchange (channel '" + std::string(call.channel) + "')";
  }

  template <class Fill, class Meanwhile, class Work>
  ffi::Error Round(size_t bytes, const void*, const Fill& fill, const Meanwhile& meanwhile,
                   const Work& work) const {
    return hostpeers::WithHostPeers(call, bytes, fill, meanwhile, work);
  }
  // The same call site's second round of a call (ReadPeerRows: the rows after the ids).
  SharedMemory Second() const {
    SharedMemory t = *this;
    t.call.tag = rows_tag;
    return t;
  }
};

inline void Nothing() {}
inline void NoFill(char*) {}

// The transport of a call: its attributes and rank (rank_buf [1]); false with `e` set when
// they are wrong.
template <class T>
bool ReadTransport(const ffi::Dictionary& attrs, const ffi::Buffer<ffi::S32>& rank_buf,
                   const char* what, T* t, ffi::Error* e) {
  AttrReader a(attrs);
  *t = T::Read(a, rank_buf.typed_data()[0], what);
  if (a.error().empty()) return true;
  *e = ffi::Error::InvalidArgument(std::string("embedmesh ") + what + ": " + a.error());
  return false;
}

// An all-to-all of `block`-byte blocks into `out` (block s from rank s). This rank's block
// for rank s is at lend + s * block when `lend` is given, and write(s, dst) writes it at dst
// in any case. In process, with `lend`, each rank copies its blocks out of the senders'
// buffers (the senders copy nothing); without, each sender writes its blocks straight into
// the receivers' outputs. Between processes, each rank writes its blocks for the others
// into its segment (its own into `out` while the peers arrive), then copies its blocks out
// of theirs.
template <class T, class Write>
ffi::Error AllToAll(const T& t, size_t block, char* out, const char* lend, const Write& write) {
  const int64_t n = t.n, rank = t.rank;
  if constexpr (T::kLends) {
    if (lend != nullptr) {
      return t.Round(n * block, lend, NoFill, Nothing, [&](const std::vector<const char*>& peers) {
        for (int64_t s = 0; s < n; ++s) {
          std::memcpy(out + s * block, peers[s] + rank * block, block);
        }
        return std::string();
      });
    }
    return t.Round(n * block, out, NoFill, Nothing, [&](const std::vector<const char*>& outs) {
      for (int64_t s = 0; s < n; ++s) write(s, const_cast<char*>(outs[s]) + rank * block);
      return std::string();
    });
  } else {
    return t.Round(
        n * block, lend,
        [&](char* seg) {
          for (int64_t s = 0; s < n; ++s) {
            if (s != rank) write(s, seg + s * block);
          }
        },
        [&] { write(rank, out + rank * block); },
        [&](const std::vector<const char*>& peers) {
          for (int64_t s = 0; s < n; ++s) {
            if (s != rank) std::memcpy(out + s * block, peers[s] + rank * block, block);
          }
          return std::string();
        });
  }
}

// Every rank publishes `mine` [n, block] (block s for rank s); work(block_for_me) reads, in
// place, block_for_me(s): what rank s published for this rank (its own from `mine`), and
// returns "" or an error. An exchange with no copy into an output. meanwhile(): this rank's
// own work that needs no peer, run while they arrive.
template <class T, class Meanwhile, class Work>
ffi::Error ReadBlocks(const T& t, size_t block, const char* mine, const Meanwhile& meanwhile,
                      const Work& work) {
  const int64_t n = t.n, rank = t.rank;
  return t.Round(
      n * block, mine,
      [&](char* seg) {  // the others' blocks (never read by this rank: a transport that copies)
        for (int64_t s = 0; s < n; ++s) {
          if (s != rank) std::memcpy(seg + s * block, mine + s * block, block);
        }
      },
      meanwhile,
      [&](const std::vector<const char*>& peers) {
        return work([&](int64_t s) {
          return s == rank ? mine + rank * block : peers[s] + rank * block;
        });
      });
}

// A block of float rows as a reader sees it: contiguous ([rows, d] at `at`) or row by row
// (row r at rows[r]); nothing (both null) when not known yet.
struct RowBlock {
  const float* at = nullptr;
  const float* const* rows = nullptr;
  RowBlock(const float* contiguous = nullptr, const float* const* by_row = nullptr)  // NOLINT
      : at(contiguous), rows(by_row) {}
  bool known() const { return at != nullptr || rows != nullptr; }
  const float* Row(int64_t r, int64_t d) const { return rows != nullptr ? rows[r] : at + r * d; }
};

// ReadBlocks of blocks of `rc` rows of `d` floats that this rank holds row by row, where
// they are (rows[s * rc + j]: row j of its block for rank s; e.g. the activation gradients
// of the features each owner feeds, no concatenation): work(block_for_me) reads
// block_for_me(s), a RowBlock of rank s's block for this rank, in place, and returns "" or
// an error. In process each rank lends its row table; between processes each rank copies
// the others' rows into its segment (they read them there) and reads its own in place.
template <class T, class Meanwhile, class Work>
ffi::Error ReadRowBlocks(const T& t, const float* const* rows, int64_t rc, int64_t d,
                         const Meanwhile& meanwhile, const Work& work) {
  const int64_t n = t.n, rank = t.rank;
  const size_t row_bytes = sizeof(float) * d;
  if constexpr (T::kLends) {
    return t.Round(0, rows, NoFill, meanwhile, [&](const std::vector<const char*>& peers) {
      return work([&](int64_t s) {
        return RowBlock(nullptr, reinterpret_cast<const float* const*>(peers[s]) + rank * rc);
      });
    });
  } else {
    return t.Round(
        n * rc * row_bytes, nullptr,
        [&](char* seg) {
          for (int64_t s = 0; s < n; ++s) {
            if (s == rank) continue;
            for (int64_t j = 0; j < rc; ++j)
              std::memcpy(seg + (s * rc + j) * row_bytes, rows[s * rc + j], row_bytes);
          }
        },
        meanwhile,
        [&](const std::vector<const char*>& peers) {
          return work([&](int64_t s) {
            if (s == rank) return RowBlock(nullptr, rows + rank * rc);
            return RowBlock(reinterpret_cast<const float*>(peers[s]) + rank * rc * d);
          });
        });
  }
}

// One array a rank shares: where it is and its size.
struct Span {
  const void* data;
  size_t bytes;
};

// Every rank shares its K arrays `mine`; work(array) reads them in place, array(s, i) rank
// s's i-th, and returns "" or an error. In process the arrays are lent (a list of K
// pointers); between processes they are copied into the segment, each 64-byte aligned.
template <class T, size_t K, class Work>
ffi::Error ShareArrays(const T& t, const std::array<Span, K>& mine, const Work& work) {
  if constexpr (T::kLends) {
    std::array<const char*, K> lent;
    for (size_t i = 0; i < K; ++i) lent[i] = static_cast<const char*>(mine[i].data);
    return t.Round(0, lent.data(), NoFill, Nothing, [&](const std::vector<const char*>& peers) {
      return work([&](int64_t s, size_t i) {
        return reinterpret_cast<const char* const*>(peers[s])[i];
      });
    });
  } else {
    hostpeers::Packing pack;
    std::array<size_t, K> at;
    for (size_t i = 0; i < K; ++i) at[i] = pack.Add(mine[i].bytes);
    return t.Round(
        pack.bytes, nullptr,
        [&](char* seg) {
          for (size_t i = 0; i < K; ++i) std::memcpy(seg + at[i], mine[i].data, mine[i].bytes);
        },
        Nothing,
        [&](const std::vector<const char*>& peers) {
          return work([&](int64_t s, size_t i) { return peers[s] + at[i]; });
        });
  }
}

// Rows of every rank's table (`rows` x `d` values of storage type E on each: storage.h): this rank asks rank s for the
// rows ids[s * u + k], k < u; work(row_of) reads row_of(s, k), that row of rank s's table
// (nullptr when out of range), and returns "" or an error. In process each rank's table is
// lent and read in place. Between processes, two rounds: every rank publishes the ids it
// asks ([n, u]), then each owner gathers the rows each other rank asked of it into its
// segment ([n, u, d]; zeros for out-of-range ids) and each rank reads them there (its own
// shard's in its table). Rows cross in their storage type.
template <class T, typename E, class Work>
ffi::Error ReadPeerRows(const T& t, const E* table, int64_t rows, int64_t d,
                        const int32_t* ids, int64_t u, const Work& work) {
  const int64_t n = t.n, rank = t.rank;
  auto row_id = [&](int64_t s, int64_t k) -> int64_t {
    const int64_t r = ids[s * u + k];
    return r < 0 || r >= rows ? -1 : r;
  };
  if constexpr (T::kLends) {
    return t.Round(0, table, NoFill, Nothing, [&](const std::vector<const char*>& tables) {
      return work([&](int64_t s, int64_t k) -> const E* {
        const int64_t r = row_id(s, k);
        return r < 0 ? nullptr : reinterpret_cast<const E*>(tables[s]) + r * d;
      });
    });
  } else {
    const size_t id_bytes = sizeof(int32_t) * n * u;
    const size_t row_bytes = sizeof(E) * n * u * d;
    return t.Round(
        id_bytes, nullptr, [&](char* seg) { std::memcpy(seg, ids, id_bytes); }, Nothing,
        [&](const std::vector<const char*>& asked) {
          ffi::Error e = t.Second().Round(
              row_bytes, nullptr,
              [&](char* seg) {  // the rows each other rank asked of this one
                E* dst = reinterpret_cast<E*>(seg);
                const int64_t grain = 1024;
                ParallelFor(NumChunks(n * u, grain), [&](int64_t c) {
                  const int64_t lo = c * grain, hi = std::min(n * u, lo + grain);
                  for (int64_t q = lo; q < hi; ++q) {
                    const int64_t r = q / u, k = q % u;
                    if (r == rank) continue;  // this rank reads its own shard in place
                    const int32_t row = reinterpret_cast<const int32_t*>(asked[r])[rank * u + k];
                    E* to = dst + q * d;
                    if (row < 0 || row >= rows) {
                      std::memset(to, 0, sizeof(E) * d);
                    } else {
                      std::memcpy(to, table + static_cast<int64_t>(row) * d, sizeof(E) * d);
                    }
                  }
                });
              },
              Nothing,
              [&](const std::vector<const char*>& served) {
                return work([&](int64_t s, int64_t k) -> const E* {
                  const int64_t r = row_id(s, k);
                  if (r < 0) return nullptr;
                  if (s == rank) return table + r * d;
                  return reinterpret_cast<const E*>(served[s]) + (rank * u + k) * d;
                });
              });
          return e.success() ? std::string() : std::string(e.message());
        });
  }
}

}  // namespace embedmesh

// Registers Op<InProcess> under target `in_process` and Op<SharedMemory> under `host` (the
// handlers Em<Op>InProcess, Em<Op>SharedMemory), both bound by `bind`.
#define EM_DEFINE_TRANSPORTED(Op, bind, in_process, host)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Em##Op##InProcess, embedmesh::Op<embedmesh::InProcess>, bind); \
  EM_LIST_HANDLER(in_process, Em##Op##InProcess)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Em##Op##SharedMemory, embedmesh::Op<embedmesh::SharedMemory>, \
                                bind);                                                      \
  EM_LIST_HANDLER(host, Em##Op##SharedMemory)
