// The whole of a `map_ids` call (embedmesh/device/id_map.py's `_map_ids`, the jnp path,
// bit for bit on a consistent state): hits, the admission sketch, a sweep, admissions.
// The state arrays are aliased to the results and updated in place; nothing of the
// capacity's size is read or written except by a sweep (as in the jnp path).
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
#include "common.h"

#include <utility>
#include <vector>

namespace embedmesh {
namespace id_map_step {

constexpr uint32_t kEmpty = 0xFFFFFFFFu;  // id_map.EMPTY: the row word of an empty slot
constexpr int64_t kWidth = 8;             // id_map.BUCKET_WIDTH
constexpr int64_t kBucket = 2 * kWidth;   // words a bucket: its tags, then its row words
constexpr int32_t kMax = 2147483647;      // use counts saturate here
// a row's words in row_info (id_map.ID_HI, ID_LO, LAST_USED, USE_COUNT)
constexpr int64_t kHi = 0, kLo = 1, kLast = 2, kCount = 3, kInfo = 4;

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

// The row word of the live slot with `tag` in bucket b ([2, W]: tags, row words; at most
// one such slot), or -1.
inline int64_t Probe(const uint32_t* bucket, uint32_t tag) {
  uint32_t hit = 0;  // a bit a matching slot
  for (int64_t j = 0; j < kWidth; ++j)
    hit |= static_cast<uint32_t>((bucket[j] == tag) & (bucket[kWidth + j] != kEmpty)) << j;
  return hit ? static_cast<int64_t>(bucket[kWidth + __builtin_ctz(hit)]) : -1;
}

// Whether row r (a probe's row word) is a row of the capacity holding the id (hi, lo).
inline bool Holds(const int32_t* info, int64_t r, int64_t c, uint32_t hi, uint32_t lo) {
  return r >= 0 && r < c && static_cast<uint32_t>(info[r * kInfo + kHi]) == hi &&
         static_cast<uint32_t>(info[r * kInfo + kLo]) == lo;
}

// Each of n positions' first and second bucket (`mask`: the bucket count less one) and
// tag: a loop of uint32 arithmetic on unaliased arrays, which the compiler vectorises.
// (Written inside the probe loop's task, with a flag array reset in it, it was scalar:
// ~7 ns a position, 0.16 ms of a call of 16,384 slots, whatever their validity.)
inline void HashChunk(const uint32_t* __restrict__ hi, const uint32_t* __restrict__ lo,
                      int64_t n, Keys k1, Keys k2, Keys kt, uint32_t mask,
                      uint32_t* __restrict__ first, uint32_t* __restrict__ second,
                      uint32_t* __restrict__ tag) {
  for (int64_t j = 0; j < n; ++j) {
    first[j] = k1(hi[j], lo[j]) & mask;
    second[j] = k2(hi[j], lo[j]) & mask;
    tag[j] = kt(hi[j], lo[j]);
  }
}

constexpr int64_t kChunk = 2048;  // positions a task
constexpr int64_t kAhead = 12;    // positions ahead whose first bucket is prefetched
constexpr int64_t kProbeAhead = 4;  // ... and probed (the second prefetched on a miss)
constexpr int64_t kBehind = 8;    // positions a hit's touch follows its probe by

// jnp's int32 arithmetic (wrapping)
inline int32_t Wrap(int64_t x) { return static_cast<int32_t>(static_cast<uint32_t>(x)); }
// `_touch`: cnt + min(occ, MAX - cnt), in wrapping int32 as XLA computes it
inline int32_t SatAdd(int32_t cnt, int32_t occ) {
  const int32_t room = Wrap(int64_t{kMax} - cnt);
  return Wrap(int64_t{cnt} + std::min(occ, room));
}
inline uint32_t Biased(int32_t x) { return static_cast<uint32_t>(x) ^ 0x80000000u; }

inline void PrefetchLineForWriteIf(void* p, bool yes) {
  if (yes) PrefetchLineForWrite(p);
}

// `_admitted`'s room of bucket b for an id of `tag`: its empty slots, or -1 when a live
// slot has the tag (a bucket's live tags are distinct)
inline int RoomIn(const uint32_t* ix, int64_t b, uint32_t tag) {
  const uint32_t* bucket = ix + b * kBucket;
  int e = 0;
  bool clash = false;
  for (int64_t j = 0; j < kWidth; ++j) {
    const bool empty = bucket[kWidth + j] == kEmpty;
    e += empty;
    clash |= !empty && bucket[j] == tag;
  }
  return clash ? -1 : e;
}

// A call's scratch array of n elements: the calling thread's own, kept between calls up
// to `kept_max` elements (a fresh vector each call costs its allocation, its zeroing and,
// past malloc's mmap threshold, page faults), or for a larger call `own`, freed with the
// call. Slot distinguishes a call's several arrays.
template <typename T, int Slot>
T* CallBuffer(int64_t n, int64_t kept_max, std::vector<T>& own) {
  static thread_local std::vector<T> kept;
  std::vector<T>& buffer = n <= kept_max ? kept : own;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

template <typename T>
T* InPlace(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  T* dst = static_cast<T*>(out->untyped_data());
  if (dst != in.untyped_data()) std::memcpy(dst, in.untyped_data(), in.size_bytes());
  return dst;
}

// The state's arrays (updated in place: aliased to the results) and their sizes.
struct State {
  uint32_t* ix;         // index [buckets, 2, W]: each bucket's tags, then its row words
  int32_t* info;        // row_info [c, 4]
  int32_t* row_slot;    // [c]
  int32_t* free_rows;   // free [c]
  int32_t* free_head;   // []
  int32_t* num_free;    // []
  int32_t* sketch;      // [depth, width]
  int32_t* sightings;   // []
  int64_t num_slots = 0, c = 0, depth = 0, width = 0;
  uint32_t mask = 0;    // the bucket count less one
};

// A call's ids and settings.
struct Call {
  int64_t n = 0;
  const uint32_t* hi;
  const uint32_t* lo;
  const bool* valid;
  int32_t step = 0;
  const uint32_t* kw;  // keys [3 + depth, 3]: the bucket hashes' and the tag's, each sketch row's
  Keys k1, k2, kt;
  int64_t lfu, admit_after, evict_batch, halve_every, distinct;
};

// The state's sizes from its operands' shapes, as they are or with leading unit dimensions
// (one shard's block of an engine's map: a squeeze before an aliased operand costs XLA a
// copy); an error names the operand whose shape is wrong.
ffi::Error ReadSizes(const ffi::AnyBuffer& index_in, const ffi::AnyBuffer& row_info_in,
                     const ffi::AnyBuffer& row_slot_in, const ffi::AnyBuffer& sketch_in,
                     const ffi::Buffer<ffi::U32>& words_in, const ffi::Buffer<ffi::U32>& keys_in,
                     int64_t admit_after, State& st, int64_t& n) {
  auto idims = index_in.dimensions();
  const size_t r = idims.size();
  if (r < 3 || idims[r - 2] != 2 || idims[r - 1] != kWidth)
    return ffi::Error::InvalidArgument("id_map_step: index must be [..., buckets, 2, 8]");
  const int64_t buckets = idims[r - 3];
  if (buckets <= 0 || (buckets & (buckets - 1)))
    return ffi::Error::InvalidArgument("id_map_step: the bucket count must be a power of two");
  st.num_slots = buckets * kWidth;
  st.mask = static_cast<uint32_t>(buckets - 1);
  st.c = row_slot_in.element_count();
  if (static_cast<int64_t>(row_info_in.element_count()) != kInfo * st.c)
    return ffi::Error::InvalidArgument("id_map_step: row_info must be [..., capacity, 4]");
  n = words_in.element_count() / 2;
  if (words_in.element_count() != 2 * n)
    return ffi::Error::InvalidArgument("id_map_step: the raw ids' words must be [n, 2]");
  auto sdims = sketch_in.dimensions();
  if (sdims.size() < 2) return ffi::Error::InvalidArgument("id_map_step: sketch must be 2-d");
  st.depth = sdims[sdims.size() - 2];
  st.width = sdims[sdims.size() - 1];
  if (static_cast<int64_t>(keys_in.element_count()) < 3 * (3 + (admit_after > 1 ? st.depth : 0)))
    return ffi::Error::InvalidArgument("id_map_step: keys must be [3 + depth, 3]");
  return ffi::Error::Success();
}

constexpr int64_t kKept = int64_t{1} << 20;  // a thread keeps 4 MiB a word, 8 of `found`

// 1. every valid position's row (-1: not in the index), its buckets read in stages:
//    the first bucket (one line: its tags and row words) prefetched kAhead positions
//    ahead and probed kProbeAhead ahead, the second prefetched then only where the
//    first has no live slot of the id's tag, probed at the position; the row's
//    row_info (one 16-byte record: the id's words, last used, use count) prefetched at
//    its probe and read kBehind positions later, where the id's words confirm the row
//    (another id may share the tag: then the second bucket is probed there) and, with
//    distinct ids, a hit is touched (distinct rows: no race). 2 lines a hit, where
//    the layout before (a bucket's id and row words apart, last used and use count
//    apart) read 5. Standalone (one thread, 14,700 hits ascending by raw id, 360,000
//    live rows of 10^6, caches flushed between calls): 0.51-0.58x that layout's time
//    with the same pipeline (12/4/8).
//    Each position's row and fresh flag are written here too (-1 for a valid id not
//    found: step 8 gives those theirs): with distinct ids a call of every valid id
//    found (a step of hits, the steady state) ends after this loop, without the
//    serial steps 2-8. Returns whether a valid id was not found; `valid_count`: the
//    valid positions.
bool FindRows(const State& st, const Call& call, int64_t* const found, int32_t* rows,
              bool* fresh, int64_t& valid_count_out) {
  // the captured values as locals (a store through a captured pointer may alias a
  // structure's fields, which the compiler would then reload at every position)
  uint32_t* const ix = st.ix;
  int32_t* const info = st.info;
  const int64_t c = st.c, n = call.n;
  const uint32_t mask = st.mask;
  const uint32_t* const hi = call.hi;
  const uint32_t* const lo = call.lo;
  const bool* const valid = call.valid;
  const int32_t step = call.step;
  const int64_t distinct = call.distinct;
  const Keys k1 = call.k1, k2 = call.k2, kt = call.kt;
  std::atomic<bool> missed{false};
  std::atomic<int64_t> valid_count{0};
  ParallelFor(NumChunks(n, kChunk), [&](int64_t chunk) {
    const int64_t begin = chunk * kChunk, end = std::min(n, begin + kChunk);
    uint32_t first[kChunk], second[kChunk], tag[kChunk];
    bool probed_second[kChunk];
    bool chunk_missed = false;
    int64_t chunk_valid = 0;
    HashChunk(hi + begin, lo + begin, end - begin, k1, k2, kt, mask, first, second, tag);
    std::fill(probed_second, probed_second + (end - begin), false);
    // (not in the loop: a bool store there may alias the captured pointers, which the
    // compiler then reloads at every position)
    std::fill(fresh + begin, fresh + end, false);
    auto bucket = [&](const uint32_t* b, int64_t i) {
      return ix + int64_t{b[i - begin]} * kBucket;
    };
    auto record = [&](int64_t r) { PrefetchLineForWriteIf(info + r * kInfo, r >= 0 && r < c); };
    auto probe_first = [&](int64_t i) {  // found[i]: the first bucket's row of the tag, or -1
      int64_t r = -1;
      if (valid[i]) {
        r = Probe(bucket(first, i), tag[i - begin]);
        if (r < 0) PrefetchLine(bucket(second, i));
        record(r);
      }
      found[i] = r;
    };
    auto probe_second = [&](int64_t i) {
      probed_second[i - begin] = true;
      return Probe(bucket(second, i), tag[i - begin]);
    };
    for (int64_t i = begin; i < std::min(end, begin + kAhead); ++i)
      if (valid[i]) PrefetchLine(bucket(first, i));
    for (int64_t i = begin; i < std::min(end, begin + kProbeAhead); ++i) probe_first(i);
    for (int64_t i = begin; i < end + kBehind; ++i) {
      if (i + kAhead < end && valid[i + kAhead]) PrefetchLine(bucket(first, i + kAhead));
      if (i + kProbeAhead < end) probe_first(i + kProbeAhead);
      if (i < end && valid[i] && found[i] < 0) {
        found[i] = probe_second(i);
        record(found[i]);
      }
      const int64_t t = i - kBehind;
      if (t < begin) continue;
      int64_t r = found[t];
      if (valid[t] && !Holds(info, r, c, hi[t], lo[t])) {  // (rare: a tag another id has)
        r = probed_second[t - begin] ? -1 : probe_second(t);
        if (!Holds(info, r, c, hi[t], lo[t])) r = -1;
        found[t] = r;
      }
      if (distinct && r >= 0) {
        info[r * kInfo + kLast] = step;
        info[r * kInfo + kCount] = SatAdd(info[r * kInfo + kCount], 1);
      }
      rows[t] = valid[t] && r >= 0 ? static_cast<int32_t>(r) : -1;
      chunk_valid += valid[t];
      chunk_missed |= valid[t] && r < 0;
    }
    if (chunk_missed) missed.store(true, std::memory_order_relaxed);
    valid_count.fetch_add(chunk_valid, std::memory_order_relaxed);
  });
  valid_count_out = valid_count.load();
  return missed.load();
}

// 2. the distinct valid ids ("u"), in the order of their first position (the
//    admission order): first position, occurrences; each position's u
void DistinctIds(const Call& call, std::vector<int32_t>& u_first, std::vector<int32_t>& u_occ,
                 std::vector<int32_t>& inverse) {
  const int64_t n = call.n;
  const uint32_t* hi = call.hi;
  const uint32_t* lo = call.lo;
  const bool* valid = call.valid;
  inverse.assign(n, -1);
  if (call.distinct) {
    u_first.reserve(n);
    for (int64_t i = 0; i < n; ++i)
      if (valid[i]) {
        inverse[i] = static_cast<int32_t>(u_first.size());
        u_first.push_back(static_cast<int32_t>(i));
      }
    u_occ.assign(u_first.size(), 1);
    return;
  }
  int64_t size = 16;
  while (size < 2 * n) size <<= 1;
  std::vector<int32_t> table(size, -1);
  for (int64_t i = 0; i < n; ++i) {
    if (!valid[i]) continue;
    uint64_t h = (uint64_t{hi[i]} << 32 | lo[i]) * 0x9E3779B97F4A7C15ull;
    int64_t s = static_cast<int64_t>(h >> 32) & (size - 1);
    for (;; s = (s + 1) & (size - 1)) {
      const int32_t u = table[s];
      if (u < 0) {
        table[s] = static_cast<int32_t>(u_first.size());
        inverse[i] = table[s];
        u_first.push_back(static_cast<int32_t>(i));
        u_occ.push_back(1);
        break;
      }
      const int32_t f = u_first[u];
      if (hi[f] == hi[i] && lo[f] == lo[i]) {
        inverse[i] = u;
        ++u_occ[u];
        break;
      }
    }
  }
}

// 3. hits (touched: the repeats' occurrences at once), misses (u). Returns the hits.
int32_t TouchHits(const State& st, const Call& call, const int64_t* found,
                  const std::vector<int32_t>& u_first, const std::vector<int32_t>& u_occ,
                  std::vector<int32_t>& misses) {
  int32_t hits = 0;
  const int64_t nu = static_cast<int64_t>(u_first.size());
  for (int64_t u = 0; u < nu; ++u) {
    const int64_t r = found[u_first[u]];
    if (r < 0) {
      misses.push_back(static_cast<int32_t>(u));
      continue;
    }
    ++hits;
    if (!call.distinct && r < st.c) {
      st.info[r * kInfo + kLast] = call.step;
      st.info[r * kInfo + kCount] = SatAdd(st.info[r * kInfo + kCount], u_occ[u]);
    }
  }
  return hits;
}

// 4. sightings (conservative update from the estimates before the call); returns the
//    candidates (u): the misses seen admit_after times, all of them without a sketch
std::vector<int32_t> Candidates(const State& st, const Call& call,
                                const std::vector<int32_t>& u_first,
                                const std::vector<int32_t>& misses) {
  if (call.admit_after <= 1) return misses;
  const int64_t depth = st.depth, width = st.width;
  int32_t* sketch = st.sketch;
  const uint32_t* kw = call.kw;
  std::vector<int32_t> cand;
  const uint32_t wmask = static_cast<uint32_t>(width - 1);
  std::vector<int32_t> est(misses.size());
  std::vector<uint32_t> cols(misses.size() * depth);
  for (size_t m = 0; m < misses.size(); ++m) {
    const int32_t f = u_first[misses[m]];
    int32_t least = kMax;
    for (int64_t d = 0; d < depth; ++d) {
      const Keys kd{kw[3 * (3 + d)], kw[3 * (3 + d) + 1], kw[3 * (3 + d) + 2]};
      const uint32_t col = kd(call.hi[f], call.lo[f]) & wmask;
      cols[m * depth + d] = col;
      least = std::min(least, sketch[d * width + col]);
    }
    est[m] = std::min(Wrap(int64_t{least} + 1), kMax);
  }
  for (size_t m = 0; m < misses.size(); ++m)
    for (int64_t d = 0; d < depth; ++d) {
      int32_t& counter = sketch[d * width + cols[m * depth + d]];
      counter = std::max(counter, est[m]);
    }
  *st.sightings = Wrap(int64_t{*st.sightings} + static_cast<int64_t>(misses.size()));
  if (*st.sightings >= call.halve_every) {
    for (int64_t k = 0; k < depth * width; ++k) sketch[k] >>= 1;
    *st.sightings = 0;
  }
  for (size_t m = 0; m < misses.size(); ++m)
    if (est[m] >= call.admit_after) cand.push_back(misses[m]);
  return cand;
}

// 5. a sweep (when the candidates outnumber the free rows): the least recently (lfu:
//    least often) used live rows not used this step evicted, at least evict_batch of
//    them, and the free list rebuilt. Returns the evictions.
int64_t Sweep(const State& st, const Call& call, int64_t needed) {
  const int64_t c = st.c;
  uint32_t* ix = st.ix;
  int32_t* info = st.info;
  int32_t* row_slot = st.row_slot;
  std::vector<uint8_t> live(c);
  struct Key {
    uint64_t a;
    uint32_t b;
  };
  std::vector<Key> evictable;
  for (int64_t r = 0; r < c; ++r) {
    const int64_t s = std::min<int64_t>(std::max<int64_t>(row_slot[r], 0), st.num_slots - 1);
    const uint32_t word = ix[(s / kWidth) * kBucket + kWidth + s % kWidth];
    live[r] = row_slot[r] >= 0 && word == static_cast<uint32_t>(r);
    const int32_t last = info[r * kInfo + kLast], count = info[r * kInfo + kCount];
    if (live[r] && last != call.step) {
      if (call.lfu)
        evictable.push_back(
            {uint64_t{Biased(count)} << 32 | Biased(last), static_cast<uint32_t>(r)});
      else
        evictable.push_back({uint64_t{Biased(last)} << 32 | static_cast<uint32_t>(r), 0});
    }
  }
  const int64_t want = std::max<int64_t>(call.evict_batch, needed - *st.num_free);
  const int64_t evictions = std::min<int64_t>(want, static_cast<int64_t>(evictable.size()));
  auto less = [](const Key& x, const Key& y) { return x.a != y.a ? x.a < y.a : x.b < y.b; };
  if (evictions < static_cast<int64_t>(evictable.size()))
    std::nth_element(evictable.begin(), evictable.begin() + evictions, evictable.end(), less);
  for (int64_t k = 0; k < evictions; ++k) {
    const int64_t r =
        call.lfu ? evictable[k].b : static_cast<int64_t>(evictable[k].a & 0xFFFFFFFFu);
    const int64_t s = row_slot[r];
    ix[(s / kWidth) * kBucket + kWidth + s % kWidth] = kEmpty;
    live[r] = 2;  // a victim: free
  }
  int64_t k = 0;
  for (int64_t r = 0; r < c; ++r)
    if (live[r] != 1) st.free_rows[k++] = static_cast<int32_t>(r);
  std::fill(st.free_rows + k, st.free_rows + c, 0);
  *st.free_head = 0;
  *st.num_free = static_cast<int32_t>(k);
  return evictions;
}

// 6. the first `fits` candidates' slots, each in the emptier of its two buckets (the
//    first on a tie) that has no live slot of its tag (neither: none), the k-th
//    empty slot of a bucket for its k-th id in u order (u order: the position with
//    distinct ids, else the id's (hi, lo)); an id whose tag an earlier one of them
//    has gets none (its k-th slot stays empty). Returns each candidate's slot, or -1.
std::vector<int64_t> PlaceCandidates(const State& st, const Call& call,
                                     const std::vector<int32_t>& u_first,
                                     const std::vector<int32_t>& cand, int64_t fits) {
  const uint32_t* hi = call.hi;
  const uint32_t* lo = call.lo;
  struct Want {
    int64_t bucket;
    uint64_t tie;
    int32_t m;  // index into cand
    uint32_t tag;
    bool clash;  // the bucket has a live slot of the tag
  };
  std::vector<Want> wants(fits);
  for (int64_t m = 0; m < fits; ++m) {
    const int32_t f = u_first[cand[m]];
    const int64_t b1 = call.k1(hi[f], lo[f]) & st.mask, b2 = call.k2(hi[f], lo[f]) & st.mask;
    const uint32_t t = call.kt(hi[f], lo[f]);
    const int room1 = RoomIn(st.ix, b1, t), room2 = RoomIn(st.ix, b2, t);
    const bool use2 = room2 > room1;
    const uint64_t tie =
        call.distinct ? static_cast<uint64_t>(f) : (uint64_t{hi[f]} << 32 | lo[f]);
    wants[m] = {use2 ? b2 : b1, tie, static_cast<int32_t>(m), t, (use2 ? room2 : room1) < 0};
  }
  std::sort(wants.begin(), wants.end(), [](const Want& x, const Want& y) {
    return x.bucket != y.bucket ? x.bucket < y.bucket : x.tie < y.tie;
  });
  std::vector<int64_t> slot(fits, -1);
  for (int64_t g = 0; g < fits;) {
    const int64_t b = wants[g].bucket, g0 = g;
    const uint32_t* word = st.ix + b * kBucket + kWidth;
    int64_t j = 0;
    for (; g < fits && wants[g].bucket == b; ++g) {
      while (j < kWidth && word[j] != kEmpty) ++j;
      if (j >= kWidth) continue;
      bool twin = false;  // an earlier id of the bucket's has the tag
      for (int64_t e = g0; e < g; ++e) twin |= wants[e].tag == wants[g].tag;
      if (!wants[g].clash && !twin) slot[wants[g].m] = b * kWidth + j;
      ++j;
    }
  }
  return slot;
}

// 7. rows, lowest free first, in admission order: each placed candidate's slot and
//    row_info written, new_row[u] its row (-1 for none). Returns the rows taken.
int64_t Admit(const State& st, const Call& call, const std::vector<int32_t>& u_first,
              const std::vector<int32_t>& u_occ, const std::vector<int32_t>& cand,
              const std::vector<int64_t>& slot, std::vector<int32_t>& new_row) {
  const int64_t c = st.c;
  int64_t taken = 0;
  new_row.assign(u_first.size(), -1);
  for (size_t m = 0; m < slot.size(); ++m) {
    if (slot[m] < 0) continue;
    const int32_t u = cand[m], f = u_first[u];
    const int32_t r = st.free_rows[std::min<int64_t>(*st.free_head + taken, c - 1)];
    ++taken;
    new_row[u] = r;
    uint32_t* bucket = st.ix + (slot[m] / kWidth) * kBucket;
    const int64_t j = slot[m] % kWidth;
    bucket[j] = call.kt(call.hi[f], call.lo[f]);
    bucket[kWidth + j] = static_cast<uint32_t>(r);
    int32_t* rec = st.info + int64_t{r} * kInfo;
    rec[kHi] = static_cast<int32_t>(call.hi[f]);
    rec[kLo] = static_cast<int32_t>(call.lo[f]);
    rec[kLast] = call.step;
    rec[kCount] = u_occ[u];
    st.row_slot[r] = static_cast<int32_t>(slot[m]);
  }
  *st.num_free -= static_cast<int32_t>(taken);
  *st.free_head += static_cast<int32_t>(taken);
  return taken;
}

// Operands: the state (index u32 [B, 2, W], row_info s32 [c, 4], row_slot s32 [c], free
// s32 [c], free_head, num_free s32 [], sketch s32 [depth, width], sightings s32 []), the
// call (the ids' words u32 [n, 2]: high, low; valid pred [n]; step s32 []) and `keys`
// u32 [3 + depth, 3] (the two bucket hashes' and the tag's seed words, then each sketch
// row's). Attributes: lfu,
// admit_after, evict_batch, halve_every, distinct. Results: the state (aliased), rows s32
// [n], fresh pred [n], stats s32 [6] (hits, admissions, evictions, pending, refused,
// occupancy). Steps 1-8 below, each its own function but the last.
ffi::Error Step(ffi::AnyBuffer index_in, ffi::AnyBuffer row_info_in, ffi::AnyBuffer row_slot_in,
                ffi::AnyBuffer free_in, ffi::AnyBuffer free_head_in, ffi::AnyBuffer num_free_in,
                ffi::AnyBuffer sketch_in, ffi::AnyBuffer sightings_in,
                ffi::Buffer<ffi::U32> words_in,
                ffi::Buffer<ffi::PRED> valid_in, ffi::Buffer<ffi::S32> step_in,
                ffi::Buffer<ffi::U32> keys_in, int64_t lfu, int64_t admit_after,
                int64_t evict_batch, int64_t halve_every, int64_t distinct,
                ffi::Result<ffi::AnyBuffer> index_out, ffi::Result<ffi::AnyBuffer> row_info_out,
                ffi::Result<ffi::AnyBuffer> row_slot_out, ffi::Result<ffi::AnyBuffer> free_out,
                ffi::Result<ffi::AnyBuffer> free_head_out,
                ffi::Result<ffi::AnyBuffer> num_free_out, ffi::Result<ffi::AnyBuffer> sketch_out,
                ffi::Result<ffi::AnyBuffer> sightings_out,
                ffi::Result<ffi::Buffer<ffi::S32>> rows_out,
                ffi::Result<ffi::Buffer<ffi::PRED>> fresh_out,
                ffi::Result<ffi::Buffer<ffi::S32>> stats_out) {
  State st;
  int64_t n = 0;
  ffi::Error sizes = ReadSizes(index_in, row_info_in, row_slot_in, sketch_in, words_in, keys_in,
                               admit_after, st, n);
  if (sizes.failure()) return sizes;
  st.ix = InPlace<uint32_t>(index_in, index_out);
  st.info = InPlace<int32_t>(row_info_in, row_info_out);
  st.row_slot = InPlace<int32_t>(row_slot_in, row_slot_out);
  st.free_rows = InPlace<int32_t>(free_in, free_out);
  st.free_head = InPlace<int32_t>(free_head_in, free_head_out);
  st.num_free = InPlace<int32_t>(num_free_in, num_free_out);
  st.sketch = InPlace<int32_t>(sketch_in, sketch_out);
  st.sightings = InPlace<int32_t>(sightings_in, sightings_out);
  // the ids' words apart (their [n, 2] pairs split by XLA cost a thunk each, two a call:
  // ~26 us a call of 16,384 ids on CPU; here ~5)
  std::vector<uint32_t> hi_own, lo_own;
  uint32_t* __restrict__ hi_words = CallBuffer<uint32_t, 0>(n, kKept, hi_own);
  uint32_t* __restrict__ lo_words = CallBuffer<uint32_t, 1>(n, kKept, lo_own);
  const uint32_t* __restrict__ w = words_in.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    hi_words[i] = w[2 * i];
    lo_words[i] = w[2 * i + 1];
  }
  const uint32_t* kw = keys_in.typed_data();
  const Call call{n, hi_words, lo_words, valid_in.typed_data(), step_in.typed_data()[0], kw,
                  Keys{kw[0], kw[1], kw[2]}, Keys{kw[3], kw[4], kw[5]}, Keys{kw[6], kw[7], kw[8]},
                  lfu, admit_after, evict_batch, halve_every, distinct};
  int32_t* rows = rows_out->typed_data();
  bool* fresh = fresh_out->typed_data();
  int32_t* stats = stats_out->typed_data();

  std::vector<int64_t> found_own;
  int64_t* const found = CallBuffer<int64_t, 0>(n, kKept, found_own);
  int64_t valid_count = 0;
  const bool missed = FindRows(st, call, found, rows, fresh, valid_count);  // 1.
  if (distinct && !missed) {  // every valid id found: steps 2-8 would change nothing
    stats[0] = static_cast<int32_t>(valid_count);  // hits (distinct ids)
    stats[1] = stats[2] = stats[3] = stats[4] = 0;  // admitted, evicted, pending, refused
    stats[5] = static_cast<int32_t>(st.c - *st.num_free);
    return ffi::Error::Success();
  }
  std::vector<int32_t> u_first, u_occ, inverse;
  DistinctIds(call, u_first, u_occ, inverse);  // 2.
  std::vector<int32_t> misses;  // u
  const int32_t hits = TouchHits(st, call, found, u_first, u_occ, misses);  // 3.
  int64_t evictions = 0, taken = 0, needed = 0, pending = 0;
  std::vector<int32_t> new_row;  // a miss's row, -1 for none
  if (!misses.empty()) {
    const std::vector<int32_t> cand = Candidates(st, call, u_first, misses);  // 4.
    needed = static_cast<int64_t>(cand.size());
    pending = static_cast<int64_t>(misses.size()) - needed;
    if (needed > *st.num_free) evictions = Sweep(st, call, needed);  // 5.
    const int64_t fits = std::min<int64_t>(needed, std::max<int32_t>(*st.num_free, 0));
    const std::vector<int64_t> slot = PlaceCandidates(st, call, u_first, cand, fits);  // 6.
    taken = Admit(st, call, u_first, u_occ, cand, slot, new_row);  // 7.
  }

  // 8. per position: the valid ids not found (step 1 wrote the others)
  for (int64_t i = 0; i < n; ++i) {
    if (!call.valid[i] || found[i] >= 0) continue;
    const int32_t nr = new_row.empty() ? -1 : new_row[inverse[i]];
    rows[i] = nr;
    fresh[i] = nr >= 0;
  }
  stats[0] = hits;
  stats[1] = static_cast<int32_t>(taken);
  stats[2] = static_cast<int32_t>(evictions);
  stats[3] = static_cast<int32_t>(pending);
  stats[4] = static_cast<int32_t>(needed - taken);
  stats[5] = static_cast<int32_t>(st.c - *st.num_free);
  return ffi::Error::Success();
}

}  // namespace id_map_step
}  // namespace embedmesh

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmIdMapStep, embedmesh::id_map_step::Step,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("lfu")
                                  .Attr<int64_t>("admit_after")
                                  .Attr<int64_t>("evict_batch")
                                  .Attr<int64_t>("halve_every")
                                  .Attr<int64_t>("distinct")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
EM_LIST_HANDLER("embedmesh_id_map_step", EmIdMapStep)

