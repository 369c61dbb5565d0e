// The pooled message of one source (ops.pack_pooled_pairs), as an owner reads it: per
// source block, U ids, then per pair k int32 words: its id's position (U: none) and its row
// among the Rc rows the owner feeds (Rc: none), packed into one word as
// position * (Rc + 1) + row when k == 2, two words when k == 3, then its gain's float bits.
// Shared by pooled.cc (packing, partial sums) and update.cc (the fused backward).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace embedmesh {

struct PooledLayout {
  int64_t n, u, p, rc, k;  // sources, ids, pairs, rows fed, words a pair
  // ceil(2^64 / (rc + 1)) for rc >= 1, else 0 (MakePooledLayout; 0 on a layout made
  // otherwise): a packed word's quotient by rc + 1 is then a multiplication (DecodePair)
  uint64_t rc_magic = 0;
  int64_t width() const { return u + p * k; }
};

inline PooledLayout MakePooledLayout(int64_t n, int64_t words, int64_t u, int64_t rc,
                                     int64_t k) {
  PooledLayout l{n, u, k > 0 ? (words - u) / k : 0, rc, k};
  if (rc >= 1 && rc < (int64_t{1} << 32) - 1) l.rc_magic = ~uint64_t{0} / (rc + 1) + 1;
  return l;
}

// v / d for a 32-bit v and d = rc + 1 in [2, 2^32): (M * v) >> 64 with M = ceil(2^64 / d)
// is exact for every 32-bit v (Lemire, Kaser, Kurz, "Faster remainder by direct
// computation", 2019); a 64-bit division takes ~10x as long, ~1 ms over an owner's pairs.
inline uint64_t PackedQuotient(uint64_t v, const PooledLayout& l) {
  if (l.rc_magic == 0) return v / static_cast<uint64_t>(l.rc + 1);
  return static_cast<uint64_t>((static_cast<unsigned __int128>(l.rc_magic) * v) >> 64);
}

// Pair q of source s: its id's position and its row (each -1 when none) and gain.
inline void DecodePair(const int32_t* block, const PooledLayout& l, int64_t q, int32_t* position,
                       int32_t* row, float* gain) {
  const int32_t* w = block + l.u + q * l.k;
  int64_t pos, r;
  if (l.k == 2) {
    const uint64_t v = static_cast<uint32_t>(w[0]);
    const uint64_t quot = PackedQuotient(v, l);
    pos = static_cast<int64_t>(quot);
    r = static_cast<int64_t>(v - quot * static_cast<uint64_t>(l.rc + 1));
  } else {
    pos = w[0];
    r = w[1];
  }
  *position = (pos >= 0 && pos < l.u) ? static_cast<int32_t>(pos) : -1;
  *row = (r >= 0 && r < l.rc) ? static_cast<int32_t>(r) : -1;
  std::memcpy(gain, w + l.k - 1, sizeof(float));
}

}  // namespace embedmesh
