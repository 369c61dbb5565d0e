// The id map's hit path (embedmesh/device/id_map.py, issue 42): every valid raw id's
// row from its two hash buckets, and whether every valid id is a hit. A call with a miss
// says so: `map_ids` then runs its jnp path, which admits and evicts.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

namespace embedmesh {
namespace id_map_hits {

constexpr uint32_t kEmpty = 0xFFFFFFFFu;  // id_map.EMPTY: the row word of an empty slot
constexpr int64_t kWidth = 16;            // id_map.BUCKET_WIDTH
constexpr int32_t kMax = 2147483647;      // use counts saturate here
constexpr int64_t kAhead = 8;             // ids ahead whose buckets are prefetched
constexpr int64_t kChunk = 2048;          // ids a task

inline uint32_t Fmix(uint32_t h) {  // ops/id_hash.fmix32
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// id_hash.hash_keyed with its three seed words (id_hash.hash_words)
struct Keys {
  uint32_t s0, s1, s2;
  uint32_t operator()(uint32_t hi, uint32_t lo) const {
    const uint32_t a = Fmix(lo ^ s0), b = Fmix(hi ^ s1);
    return Fmix((a + b * 0x9E3779B1u) ^ s2);
  }
};

// The row of (hi, lo) in bucket b ([3, W]: key words, low words, row words), or -1.
inline int64_t Probe(const uint32_t* bucket, uint32_t hi, uint32_t lo) {
  const uint32_t* key = bucket;
  const uint32_t* low = bucket + kWidth;
  const uint32_t* row = bucket + 2 * kWidth;
  uint32_t hit = 0;  // a bit a matching slot
  for (int64_t j = 0; j < kWidth; ++j)
    hit |= static_cast<uint32_t>((key[j] == hi) & (low[j] == lo) & (row[j] != kEmpty)) << j;
  return hit ? static_cast<int64_t>(row[__builtin_ctz(hit)]) : -1;
}

inline void PrefetchBucket(const uint32_t* bucket) {
  PrefetchLine(bucket);               // the key words (one 64-byte line)
  PrefetchLine(bucket + kWidth);      // the low words
  PrefetchLine(bucket + 2 * kWidth);  // the row words
}

// index u32 [B, 3, W], use_count s32 [c], hi / lo u32 [n], valid pred [n]; attributes:
// the two bucket hashes' seed words (a0..a2, b0..b2), distinct (the caller's promise that
// no valid id occurs twice). Results: status s32 [2] (1 when every valid id hit, and then
// the distinct hits), rows s32 [n] (each valid id's row, -1 where invalid; meaningless
// when status[0] is 0). Reads the state, writes none of it.
//
// Status 1 means the jnp path's answer to the call is: these rows, nothing admitted, and
// the rows' use counts added without saturating (the caller scatters last_used and the
// counts). A call it cannot answer so (a miss, a row word outside [0, c), a use count
// that is negative or within n of 2^31 - 1) gets status 0: the jnp path decides.
ffi::Error Hits(ffi::Buffer<ffi::U32> index, ffi::Buffer<ffi::S32> use_count_in,
                ffi::Buffer<ffi::U32> hi_in, ffi::Buffer<ffi::U32> lo_in,
                ffi::Buffer<ffi::PRED> valid_in, int64_t a0, int64_t a1, int64_t a2, int64_t b0,
                int64_t b1, int64_t b2, int64_t distinct,
                ffi::Result<ffi::Buffer<ffi::S32>> status_out,
                ffi::Result<ffi::Buffer<ffi::S32>> rows_out) {
  auto idims = index.dimensions();
  if (idims.size() != 3 || idims[1] != 3 || idims[2] != kWidth)
    return ffi::Error::InvalidArgument("id_map_hits: index must be [buckets, 3, 16]");
  const int64_t buckets = idims[0];
  if (buckets <= 0 || (buckets & (buckets - 1)))
    return ffi::Error::InvalidArgument("id_map_hits: the bucket count must be a power of two");
  const uint32_t mask = static_cast<uint32_t>(buckets - 1);
  const int64_t c = use_count_in.element_count();
  const int64_t n = hi_in.element_count();
  const uint32_t* ix = index.typed_data();
  const int32_t* use_count = use_count_in.typed_data();
  const uint32_t* hi = hi_in.typed_data();
  const uint32_t* lo = lo_in.typed_data();
  const bool* valid = valid_in.typed_data();
  int32_t* status = status_out->typed_data();
  int32_t* rows = rows_out->typed_data();
  status[0] = 0;
  status[1] = 0;
  // the most a call adds to a count: no saturation below this
  const int64_t room = static_cast<int64_t>(kMax) - n;

  const Keys k1{static_cast<uint32_t>(a0), static_cast<uint32_t>(a1), static_cast<uint32_t>(a2)};
  const Keys k2{static_cast<uint32_t>(b0), static_cast<uint32_t>(b1), static_cast<uint32_t>(b2)};
  std::atomic<bool> missed{false};
  std::atomic<int64_t> valid_count{0};
  // each valid id's row (tasks own disjoint ranges of `rows`)
  ParallelFor(NumChunks(n, kChunk), [&](int64_t chunk) {
    const int64_t begin = chunk * kChunk, end = std::min(n, begin + kChunk);
    uint32_t first[kChunk], second[kChunk];
    for (int64_t i = begin; i < end; ++i) {
      first[i - begin] = k1(hi[i], lo[i]) & mask;
      second[i - begin] = k2(hi[i], lo[i]) & mask;
    }
    int64_t count = 0;
    for (int64_t i = begin; i < end; ++i) {
      if (missed.load(std::memory_order_relaxed)) return;
      if (i + kAhead < end && valid[i + kAhead]) {
        PrefetchBucket(ix + int64_t{first[i + kAhead - begin]} * 3 * kWidth);
        PrefetchBucket(ix + int64_t{second[i + kAhead - begin]} * 3 * kWidth);
      }
      if (!valid[i]) {
        rows[i] = -1;
        continue;
      }
      int64_t r = Probe(ix + int64_t{first[i - begin]} * 3 * kWidth, hi[i], lo[i]);
      if (r < 0) r = Probe(ix + int64_t{second[i - begin]} * 3 * kWidth, hi[i], lo[i]);
      if (r < 0 || r >= c) {  // a miss (or a row word no live row has: the jnp path's call)
        missed.store(true, std::memory_order_relaxed);
        return;
      }
      rows[i] = static_cast<int32_t>(r);
      ++count;
    }
    valid_count.fetch_add(count, std::memory_order_relaxed);
  });
  if (missed.load()) return ffi::Error::Success();
  for (int64_t i = 0; i < n; ++i) {  // counts the jnp path's arithmetic must decide
    if (i + kPrefetch < n && valid[i + kPrefetch]) PrefetchLine(use_count + rows[i + kPrefetch]);
    if (valid[i] && (use_count[rows[i]] < 0 || use_count[rows[i]] > room))
      return ffi::Error::Success();
  }
  int64_t hits = valid_count.load();
  if (!distinct) {  // the distinct rows (= the distinct ids: no two live ids share a row)
    std::vector<int32_t> sorted;
    sorted.reserve(hits);
    for (int64_t i = 0; i < n; ++i)
      if (valid[i]) sorted.push_back(rows[i]);
    std::sort(sorted.begin(), sorted.end());
    hits = std::unique(sorted.begin(), sorted.end()) - sorted.begin();
  }
  status[0] = 1;
  status[1] = static_cast<int32_t>(hits);
  return ffi::Error::Success();
}

}  // namespace id_map_hits
}  // namespace embedmesh

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmIdMapHits, embedmesh::id_map_hits::Hits,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("a0")
                                  .Attr<int64_t>("a1")
                                  .Attr<int64_t>("a2")
                                  .Attr<int64_t>("b0")
                                  .Attr<int64_t>("b1")
                                  .Attr<int64_t>("b2")
                                  .Attr<int64_t>("distinct")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
EM_LIST_HANDLER("embedmesh_id_map_hits", EmIdMapHits)
