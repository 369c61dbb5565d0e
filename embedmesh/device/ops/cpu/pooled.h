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
  int64_t width() const { return u + p * k; }
};

inline PooledLayout MakePooledLayout(int64_t n, int64_t words, int64_t u, int64_t rc,
                                     int64_t k) {
  return PooledLayout{n, u, k > 0 ? (words - u) / k : 0, rc, k};
}

// Pair q of source s: its id's position and its row (each -1 when none) and gain.
inline void DecodePair(const int32_t* block, const PooledLayout& l, int64_t q, int32_t* position,
                       int32_t* row, float* gain) {
  const int32_t* w = block + l.u + q * l.k;
  int64_t pos, r;
  if (l.k == 2) {
    const int64_t v = static_cast<uint32_t>(w[0]);
    pos = v / (l.rc + 1);
    r = v % (l.rc + 1);
  } else {
    pos = w[0];
    r = w[1];
  }
  *position = (pos >= 0 && pos < l.u) ? static_cast<int32_t>(pos) : -1;
  *row = (r >= 0 && r < l.rc) ? static_cast<int32_t>(r) : -1;
  std::memcpy(gain, w + l.k - 1, sizeof(float));
}

}  // namespace embedmesh
