// Host preprocessing kernels of embedmesh: plain C ABI, called with ctypes (which
// releases the GIL), one call per (stack, local device) task.
//
// The same algorithm as the numba backend (embedmesh/host/numba_backend.py), line for
// line, so that the two give bit-identical arrays: per (table, device) block, the
// entries keyed by `shard * rows_per_shard + block row` (the mod row layout over the
// table's span), sorted by a stable LSD radix sort (<= 11 bits a pass), then one pass
// per shard that merges duplicates and appends to the stack's partitions, then padding.
// Gains are computed and summed in double, in entry order (no FMA: the library is
// built with -ffp-contract=off), and rounded once to float.
//
// A table is described by TABLE_WORDS int64 words (embedmesh/host/native_backend.py
// writes them): the addresses of its ids (int32 or int64), weights (float32; none:
// unweighted), splits (int64), fmeta ([F, 4] int64: first split index, rows per
// device, buffer row offset, combiner code) and params (int64, the P_* layout of
// embedmesh/host/kernel_params.py).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

// params (embedmesh/host/kernel_params.py)
enum : int {
  P_SPAN = 0,
  P_ROTATION = 1,
  P_SHARD_SHIFT = 2,
  P_ROWS_PER_SHARD = 3,
  P_LOCAL_ROW_OFFSET = 4,
  P_VOCAB = 5,
  P_KEY_BITS = 6,
  P_LOW_BITS = 7,
  P_ROW_BASE = 8,
  P_ROW_SPAN = 9,
  P_CAP_UNIQUE = 10,
  P_CAP_PAIRS = 11,
  P_FIRST_SHARD = 12,
};

// counters [COUNTERS, D, N]
enum : int { C_UNIQUE_TOTAL = 0, C_PAIR_TOTAL = 1, C_UNIQUE_KEPT = 2, C_PAIR_KEPT = 3 };

// a table's descriptor words
enum : int {
  T_IDS = 0,
  T_IDS_64 = 1,
  T_WEIGHTS = 2,  // 0: unweighted
  T_SPLITS = 3,
  T_FMETA = 4,
  T_NUM_FEATURES = 5,
  T_PARAMS = 6,
  TABLE_WORDS = 8,
};

template <typename T>
const T* ptr(int64_t word) {
  return reinterpret_cast<const T*>(static_cast<intptr_t>(word));
}

// A table's params (the P_* words), read once: what numba_backend.TableParams holds.
struct TableParams {
  int64_t span, rotation, shard_shift, rps, local_off, vocab, key_bits, low_bits, row_base,
      row_span, cap_u, cap_p, first_shard;
  explicit TableParams(const int64_t* p)
      : span(p[P_SPAN]),
        rotation(p[P_ROTATION]),
        shard_shift(p[P_SHARD_SHIFT]),
        rps(p[P_ROWS_PER_SHARD]),
        local_off(p[P_LOCAL_ROW_OFFSET]),
        vocab(p[P_VOCAB]),
        key_bits(p[P_KEY_BITS]),
        low_bits(p[P_LOW_BITS]),
        row_base(p[P_ROW_BASE]),
        row_span(p[P_ROW_SPAN]),
        cap_u(p[P_CAP_UNIQUE]),
        cap_p(p[P_CAP_PAIRS]),
        first_shard(p[P_FIRST_SHARD]) {}
};

template <typename T>
std::unique_ptr<T[]> uninit(int64_t n) {
  return std::unique_ptr<T[]>(new T[n > 0 ? n : 1]);
}

// One (table, device) block's sorted entries: what table_sort returns in numba.
struct Sorted {
  int64_t bad = -1;  // the first entry whose id lies outside the table (-1: none)
  bool has_w = false;
  int64_t m = 0;
  std::unique_ptr<int64_t[]> a, b;  // the sort's two buffers; `vals` is one of them
  int64_t* vals = nullptr;
  std::unique_ptr<int64_t[]> per_shard;  // [n_shards + 1], starts
  std::unique_ptr<double[]> gain;        // weighted: per entry
  std::unique_ptr<int32_t[]> orow;       // weighted: per entry
  std::unique_ptr<double[]> row_scale;   // unweighted: per output row
};

double combiner_scale(const float* weights, int64_t s, int64_t e, int64_t comb, bool has_w) {
  if (comb == 0) return 1.0;
  double acc = 0.0;
  if (has_w) {
    for (int64_t k = s; k < e; ++k) {
      double w = static_cast<double>(weights[k]);
      acc += comb == 1 ? w : w * w;
    }
  } else {
    acc = static_cast<double>(e - s);
  }
  if (comb == 2) acc = std::sqrt(acc);
  return acc != 0.0 ? 1.0 / acc : 0.0;
}

template <typename Id>
void table_sort(const int64_t* t, int64_t d, int64_t n_shards, Sorted& out) {
  const Id* ids = ptr<Id>(t[T_IDS]);
  const float* weights = ptr<float>(t[T_WEIGHTS]);
  const int64_t* splits = ptr<int64_t>(t[T_SPLITS]);
  const int64_t* fmeta = ptr<int64_t>(t[T_FMETA]);
  const int64_t nf = t[T_NUM_FEATURES];
  const TableParams tp(ptr<int64_t>(t[T_PARAMS]));
  const bool has_w = weights != nullptr;
  const int64_t passes = (tp.key_bits + 10) / 11;
  const int64_t bits = passes ? (tp.key_bits + passes - 1) / passes : 1;
  const int64_t mask = (int64_t{1} << bits) - 1;
  const int64_t buckets = int64_t{1} << bits;
  int64_t m = 0;
  for (int64_t f = 0; f < nf; ++f) {
    const int64_t sb = fmeta[f * 4], rpd = fmeta[f * 4 + 1];
    m += splits[sb + (d + 1) * rpd] - splits[sb + d * rpd];
  }
  out.has_w = has_w;
  out.m = m;
  out.a = uninit<int64_t>(m);
  int64_t* vals = out.a.get();
  const int64_t np_ = passes > 0 ? passes : 1;
  auto hist = std::unique_ptr<int64_t[]>(new int64_t[np_ * buckets]());
  out.per_shard = std::unique_ptr<int64_t[]>(new int64_t[n_shards + 1]());
  int64_t* per_shard = out.per_shard.get();
  double* gain = nullptr;
  int32_t* orow = nullptr;
  double* row_scale = nullptr;
  if (has_w) {
    out.gain = uninit<double>(m);
    out.orow = uninit<int32_t>(m);
    gain = out.gain.get();
    orow = out.orow.get();
  } else {
    out.row_scale = uninit<double>(tp.row_span);
    row_scale = out.row_scale.get();
  }
  out.vals = vals;
  int64_t i = 0;
  for (int64_t f = 0; f < nf; ++f) {
    const int64_t sb = fmeta[f * 4], rpd = fmeta[f * 4 + 1];
    const int64_t ooff = fmeta[f * 4 + 2], comb = fmeta[f * 4 + 3];
    for (int64_t r = 0; r < rpd; ++r) {
      const int64_t s = splits[sb + d * rpd + r];
      const int64_t e = splits[sb + d * rpd + r + 1];
      const double scale = combiner_scale(weights, s, e, comb, has_w);
      const int64_t o = ooff + r;
      if (!has_w) row_scale[o - tp.row_base] = scale;
      for (int64_t k = s; k < e; ++k) {
        const int64_t v = static_cast<int64_t>(ids[k]);
        if (v < 0 || v >= tp.vocab) {
          out.bad = k;
          return;
        }
        int64_t q, rem;
        if (tp.shard_shift >= 0) {
          q = v >> tp.shard_shift;
          rem = v & (tp.span - 1);
        } else {
          q = v / tp.span;
          rem = v - q * tp.span;
        }
        int64_t j = rem + tp.rotation;
        if (j >= tp.span) j -= tp.span;
        j += tp.first_shard;
        const int64_t key = j * tp.rps + q;
        for (int64_t p = 0; p < passes; ++p) ++hist[p * buckets + ((key >> (p * bits)) & mask)];
        ++per_shard[j + 1];
        if (has_w) {
          gain[i] = static_cast<double>(weights[k]) * scale;
          orow[i] = static_cast<int32_t>(o);
          vals[i] = (key << tp.low_bits) | i;
        } else {
          vals[i] = (key << tp.low_bits) | o;
        }
        ++i;
      }
    }
  }
  // stable LSD radix sort by vals >> low_bits (numba_backend._radix_sort)
  int64_t* srt = vals;
  int64_t* dst = nullptr;
  for (int64_t p = 0; p < passes; ++p) {
    int64_t* c = hist.get() + p * buckets;
    bool trivial = false;
    for (int64_t b = 0; b < buckets; ++b) {
      if (c[b] == m) {
        trivial = true;
        break;
      }
    }
    if (trivial) continue;
    if (dst == nullptr) {
      out.b = uninit<int64_t>(m);
      dst = out.b.get();
    }
    int64_t acc = 0;
    for (int64_t b = 0; b < buckets; ++b) {
      const int64_t cnt = c[b];
      c[b] = acc;
      acc += cnt;
    }
    const int64_t shift = tp.low_bits + p * bits;
    for (int64_t k = 0; k < m; ++k) {
      const int64_t x = srt[k];
      dst[c[(x >> shift) & mask]++] = x;
    }
    int64_t* tmp = srt;
    srt = dst;
    dst = tmp;
  }
  out.vals = srt;
  for (int64_t j = 0; j < n_shards; ++j) per_shard[j + 1] += per_shard[j];
}

void sort_any(const int64_t* t, int64_t d, int64_t n_shards, Sorted& out) {
  if (t[T_IDS_64])
    table_sort<int64_t>(t, d, n_shards, out);
  else
    table_sort<int32_t>(t, d, n_shards, out);
}

// Outputs of a stack: [D, N, U] / [D, N, P] arrays and the counters [4, D, N].
struct Outputs {
  int64_t D, N, U, P;
  int32_t* unique_ids;
  int32_t* pair_rows;
  int32_t* pair_unique;
  float* pair_gains;
  int64_t* counts;
  int64_t* counter(int c, int64_t d, int64_t j) const { return counts + (c * D + d) * N + j; }
};

// numba_backend.table_fill: the sorted entries appended to device d's partitions.
int64_t table_fill(const Sorted& s, const int64_t* params, int64_t d, const Outputs& o) {
  const int64_t N = o.N;
  const TableParams tp(params);
  const bool has_w = s.has_w;
  const int64_t low_mask = (int64_t{1} << tp.low_bits) - 1;
  const int64_t* srt = s.vals;
  const int64_t* per_shard = s.per_shard.get();
  const double* gain = s.gain.get();
  const int32_t* orow = s.orow.get();
  const double* row_scale = s.row_scale.get();
  int64_t n_drop = 0;
  for (int64_t j = 0; j < N; ++j) {
    const int64_t t0 = per_shard[j], t1 = per_shard[j + 1];
    if (t0 == t1) continue;
    int32_t* uo = o.unique_ids + (d * N + j) * o.U;
    int32_t* pr = o.pair_rows + (d * N + j) * o.P;
    int32_t* pu = o.pair_unique + (d * N + j) * o.P;
    float* pg = o.pair_gains + (d * N + j) * o.P;
    int64_t uc = *o.counter(C_UNIQUE_TOTAL, d, j);
    int64_t pc = *o.counter(C_PAIR_TOTAL, d, j);
    int64_t uk = *o.counter(C_UNIQUE_KEPT, d, j);
    int64_t pk = *o.counter(C_PAIR_KEPT, d, j);
    const int64_t base = tp.local_off - j * tp.rps;
    int64_t prev_key = -1, prev_o = -1, cur_u = 0, cur_q = 0;
    bool keep_u = false, keep_p = false;
    double acc_g = 0.0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t x = srt[t];
      const int64_t key = x >> tp.low_bits;
      const int64_t lo = x & low_mask;
      int64_t or_;
      double g;
      if (has_w) {
        or_ = static_cast<int64_t>(orow[lo]);
        g = gain[lo];
      } else {
        or_ = lo;
        g = row_scale[or_ - tp.row_base];
      }
      bool new_pair;
      if (key != prev_key) {
        if (keep_p) pg[cur_q] = static_cast<float>(acc_g);
        prev_key = key;
        cur_u = uc;
        uc += 1;
        keep_u = cur_u < tp.cap_u && pc < tp.cap_p;
        if (keep_u) {
          uo[cur_u] = static_cast<int32_t>(base + key);
          uk = cur_u + 1;
        }
        new_pair = true;
      } else {
        new_pair = or_ != prev_o;
        if (new_pair && keep_p) pg[cur_q] = static_cast<float>(acc_g);
      }
      if (new_pair) {
        prev_o = or_;
        cur_q = pc;
        pc += 1;
        keep_p = keep_u && cur_q < tp.cap_p;
        if (keep_p) {
          pr[cur_q] = static_cast<int32_t>(or_);
          pu[cur_q] = static_cast<int32_t>(cur_u);
          pk = cur_q + 1;
          acc_g = g;
        } else {
          n_drop += 1;
        }
      } else if (keep_p) {
        acc_g += g;
      } else {
        n_drop += 1;
      }
    }
    if (keep_p) pg[cur_q] = static_cast<float>(acc_g);
    *o.counter(C_UNIQUE_TOTAL, d, j) = uc;
    *o.counter(C_PAIR_TOTAL, d, j) = pc;
    *o.counter(C_UNIQUE_KEPT, d, j) = uk;
    *o.counter(C_PAIR_KEPT, d, j) = pk;
  }
  return n_drop;
}

// numba_backend.fill_padding
void fill_padding(const Outputs& o, int64_t pad_id, int64_t pad_row, int64_t d) {
  for (int64_t j = 0; j < o.N; ++j) {
    const int64_t uk = *o.counter(C_UNIQUE_KEPT, d, j);
    const int64_t pk = *o.counter(C_PAIR_KEPT, d, j);
    int32_t* uo = o.unique_ids + (d * o.N + j) * o.U;
    for (int64_t k = uk; k < o.U; ++k) uo[k] = static_cast<int32_t>(pad_id);
    const int64_t at = (d * o.N + j) * o.P;
    for (int64_t k = pk; k < o.P; ++k) {
      o.pair_rows[at + k] = static_cast<int32_t>(pad_row);
      o.pair_unique[at + k] = 0;
      o.pair_gains[at + k] = 0.0f;
    }
  }
}

}  // namespace

extern "C" {

// Words of a table's descriptor (see the top of this file).
int64_t EmHostTableWords() { return TABLE_WORDS; }

// One table's entries for local device d keyed and sorted, ahead of EmHostDevice (the
// tables of a stack in parallel when threads are spare). Returns an opaque handle that
// EmHostDevice consumes (or EmHostFree frees); 0 when memory ran out.
int64_t EmHostSort(const int64_t* table, int64_t d, int64_t n_shards) {
  try {
    auto s = std::make_unique<Sorted>();
    sort_any(table, d, n_shards, *s);
    return static_cast<int64_t>(reinterpret_cast<intptr_t>(s.release()));
  } catch (...) {
    return 0;
  }
}

void EmHostFree(int64_t handle) {
  delete reinterpret_cast<Sorted*>(static_cast<intptr_t>(handle));
}

// Every table of a stack (`n_tables` descriptors, in row order) for local device d:
// sorted (unless `handles[i]`, from EmHostSort, holds it already: every handle given is
// consumed), appended to the partitions, then the padding written. The outputs are the
// stack's [D, N, U] unique ids, [D, N, P] pair rows, pair uniques and pair gains, and the
// counters [4, D, N] (zeroed by the caller); `bad` [n_tables, D] gets the first
// out-of-range entry of the table that has one (its later tables are not run, no padding
// written), `dropped[d]` the entries dropped for capacity. Returns 0, or -1 when memory
// ran out (nothing reliable written).
int64_t EmHostDevice(const int64_t* tables, int64_t n_tables, int64_t* handles, int64_t d,
                     int64_t D, int64_t N, int64_t U, int64_t P, int32_t* unique_ids,
                     int32_t* pair_rows, int32_t* pair_unique, float* pair_gains, int64_t* counts,
                     int64_t pad_id, int64_t pad_row, int64_t* bad, int64_t* dropped) {
  const Outputs o{D, N, U, P, unique_ids, pair_rows, pair_unique, pair_gains, counts};
  int64_t rc = 0;
  int64_t i = 0;
  try {
    for (; i < n_tables; ++i) {
      std::unique_ptr<Sorted> owned(reinterpret_cast<Sorted*>(static_cast<intptr_t>(handles[i])));
      handles[i] = 0;
      if (!owned) {
        owned = std::make_unique<Sorted>();
        sort_any(tables + i * TABLE_WORDS, d, N, *owned);
      }
      if (owned->bad >= 0) {
        bad[i * D + d] = owned->bad;
        ++i;
        break;
      }
      dropped[d] += table_fill(*owned, ptr<int64_t>(tables[i * TABLE_WORDS + T_PARAMS]), d, o);
      if (i == n_tables - 1) fill_padding(o, pad_id, pad_row, d);
    }
    if (n_tables == 0) fill_padding(o, pad_id, pad_row, d);
  } catch (...) {
    rc = -1;
    ++i;
  }
  for (; i < n_tables; ++i) {  // handles of tables not reached
    EmHostFree(handles[i]);
    handles[i] = 0;
  }
  return rc;
}

}  // extern "C"
