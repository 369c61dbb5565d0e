// Pooling on the owner (shard_program.lookup_pooled): a source packs its pairs for each
// owner into one int32 message (pooled.h), and an owner sums its sources' pairs from its
// table into partial activations; each also fused with its exchange, written once over the
// transports of transport.h (each message written straight into where its receiver reads
// it). Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by
// library.py.
#include "pooled.h"
#include "transport.h"

namespace embedmesh {
namespace {

// What a source sends its owners when they pool: its batch (ids [n, u], pair rows,
// positions and gains [n, p], and `compact` [n, cw], each owner's position of every row,
// or none), packed per owner (pooled.h).
struct PairSource {
  const int32_t* ids;
  const int32_t* prow;
  const int32_t* puniq;
  const float* gains;
  const int32_t* compact;
  int64_t cw;
};

// The message of `src` for owner o: ids[o] then per pair (position, row, gain).
void PackBlock(const PairSource& src, const PooledLayout& l, int64_t o, int32_t* block) {
  std::memcpy(block, src.ids + o * l.u, sizeof(int32_t) * l.u);
  const int32_t* pr = src.prow + o * l.p;
  const int32_t* pu = src.puniq + o * l.p;
  const float* pg = src.gains + o * l.p;
  const int64_t cw = src.cw;
  const int32_t* map = cw ? src.compact + o * cw : nullptr;
  int32_t* w = block + l.u;
  for (int64_t q = 0; q < l.p; ++q, w += l.k) {
    // out of range: "none" (compact[R], rc, u)
    int64_t r = pr[q];
    if (map != nullptr) r = map[(r < 0 || r > cw - 1) ? cw - 1 : r];
    if (r < 0 || r > l.rc) r = l.rc;
    int64_t pos = pu[q];
    if (pos < 0 || pos > l.u) pos = l.u;
    if (l.k == 2) {
      w[0] = static_cast<int32_t>(pos * (l.rc + 1) + r);
    } else {
      w[0] = static_cast<int32_t>(pos);
      w[1] = static_cast<int32_t>(r);
    }
    std::memcpy(w + l.k - 1, pg + q, sizeof(float));
  }
}

PairSource SourceOf(ffi::Buffer<ffi::S32>& ids, ffi::Buffer<ffi::S32>& prow,
                    ffi::Buffer<ffi::S32>& puniq, ffi::Buffer<ffi::F32>& gains,
                    ffi::Buffer<ffi::S32>& compact, int64_t n, PooledLayout* l, int64_t rc,
                    int64_t k) {
  const int64_t u = n ? static_cast<int64_t>(ids.element_count()) / n : 0;
  const int64_t p = n ? static_cast<int64_t>(prow.element_count()) / n : 0;
  *l = PooledLayout{n, u, p, rc, k};
  return PairSource{ids.typed_data(), prow.typed_data(), puniq.typed_data(), gains.typed_data(),
                    compact.typed_data(),
                    n ? static_cast<int64_t>(compact.element_count()) / n : 0};
}

// The attributes' names, for the handlers bound from their signatures (ffi::Attr).
constexpr char kPooledU[] = "u";
constexpr char kPooledRc[] = "rc";
constexpr char kPooledK[] = "k";

// ops.pack_pooled_pairs: the message of every owner.
ffi::Error PackPooledPairs(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> prow,
                           ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                           ffi::Buffer<ffi::S32> compact, ffi::Attr<int64_t, kPooledRc> rc,
                           ffi::Attr<int64_t, kPooledK> k,
                           ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto idd = ids.dimensions();
  const int64_t n = idd.size() ? idd[0] : 1;
  PooledLayout l{};
  const PairSource src = SourceOf(ids, prow, puniq, gains, compact, n, &l, *rc, *k);
  int32_t* o = out->typed_data();
  ParallelFor(n, [&](int64_t s) { PackBlock(src, l, s, o + s * l.width()); });
  return ffi::Error::Success();
}

// ops.exchange_pooled_pairs: each owner's message packed straight into where the owner
// reads it (AllToAll): exchange(pack_pooled_pairs(...)).
template <class T>
ffi::Error ExchangePooledPairs(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> prow,
                               ffi::Buffer<ffi::S32> puniq, ffi::Buffer<ffi::F32> gains,
                               ffi::Buffer<ffi::S32> compact, ffi::Buffer<ffi::S32> rank_buf,
                               ffi::Result<ffi::Buffer<ffi::S32>> out, ffi::Dictionary attrs) {
  T t;
  if (ffi::Error e; !ReadTransport(attrs, rank_buf, "exchange_pooled_pairs", &t, &e)) return e;
  AttrReader a(attrs);
  const int64_t rc = a.I("rc"), k = a.I("k");
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  PooledLayout l{};
  const PairSource src = SourceOf(ids, prow, puniq, gains, compact, t.n, &l, rc, k);
  const size_t block = sizeof(int32_t) * l.width();
  return AllToAll(t, block, reinterpret_cast<char*>(out->typed_data()), nullptr,
                  [&](int64_t s, char* to) {
                    PackBlock(src, l, s, reinterpret_cast<int32_t*>(to));
                  });
}

// A source's partial activations [rc, d] into o from its message `block`: each row sums
// gain * table row over its pairs, in pair order, in float32 (SegmentPairSums; the table
// of a storage type E), each pair decoded as it is read (ids out of [0, rows): none).
template <typename E>
void PartialsOf(const int32_t* block, const PooledLayout& l, const E* t, int64_t rows,
                int64_t d, float* o) {
  SegmentPairSums(o, d, l.rc, l.p, [&](int64_t q, int64_t, int64_t) {
    int32_t pos, row;
    float gain;
    DecodePair(block, l, q, &pos, &row, &gain);
    const int32_t id = pos >= 0 ? block[pos] : -1;
    const bool ok = row >= 0 && id >= 0 && id < rows;
    return SumPair<E>{ok ? row : -1, gain, ok ? t + static_cast<int64_t>(id) * d : nullptr};
  });
}

// ops.pooled_partials: out[s * rc + row] += gain * table[ids_s[position]] over each
// source's pairs.
ffi::Error PooledPartials(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> served,
                          ffi::Attr<int64_t, kPooledU> u_attr,
                          ffi::Attr<int64_t, kPooledRc> rc_attr,
                          ffi::Attr<int64_t, kPooledK> k_attr,
                          ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t u = *u_attr, rc = *rc_attr, k = *k_attr;
  auto td = table.dimensions();
  auto sd = served.dimensions();
  const int64_t rows = td.size() ? td[0] : 1, d = RowWidth(td);
  const int64_t n = sd.size() ? sd[0] : 1;
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const int32_t* msg = served.typed_data();
  float* o = out->typed_data();
  PrepareOutput(o, sizeof(float) * n * rc * d);
  return WithStorage(table.element_type(), "pooled_partials", [&](auto tag) {
    using E = typename decltype(tag)::type;
    const E* w = static_cast<const E*>(table.untyped_data());
    for (int64_t s = 0; s < n; ++s) PartialsOf(msg + s * words, l, w, rows, d, o + s * rc * d);
    return ffi::Error::Success();
  });
}

// ops.exchange_pooled_partials: the partials of each source summed straight into where
// the source reads them (AllToAll): exchange(pooled_partials(...)).
template <class T>
ffi::Error ExchangePooledPartials(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> served,
                                  ffi::Buffer<ffi::S32> rank_buf,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Dictionary attrs) {
  T t;
  if (ffi::Error e; !ReadTransport(attrs, rank_buf, "exchange_pooled_partials", &t, &e)) return e;
  AttrReader a(attrs);
  const int64_t u = a.I("u"), rc = a.I("rc"), k = a.I("k");
  if (!a.error().empty()) return ffi::Error::InvalidArgument(a.error());
  const int64_t n = t.n;
  auto td = table.dimensions();
  const int64_t rows = td.size() ? td[0] : 1, d = RowWidth(td);
  const int64_t words = n ? static_cast<int64_t>(served.element_count()) / n : 0;
  const PooledLayout l = MakePooledLayout(n, words, u, rc, k);
  const int32_t* msg = served.typed_data();
  const size_t block = sizeof(float) * rc * d;
  float* o = out->typed_data();
  PrepareOutput(o, n * block);
  return WithStorage(table.element_type(), "exchange_pooled_partials", [&](auto tag) {
    using E = typename decltype(tag)::type;
    const E* w = static_cast<const E*>(table.untyped_data());
    return AllToAll(t, block, reinterpret_cast<char*>(o), nullptr, [&](int64_t s, char* to) {
      PartialsOf(msg + s * words, l, w, rows, d, reinterpret_cast<float*>(to));
    });
  });
}

}  // namespace
}  // namespace embedmesh

EM_HANDLER("embedmesh_pack_pooled_pairs", EmPackPooledPairs, embedmesh::PackPooledPairs)
EM_HANDLER("embedmesh_pooled_partials", EmPooledPartials, embedmesh::PooledPartials)
EM_DEFINE_TRANSPORTED(ExchangePooledPairs,
                      ffi::Ffi::Bind()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::F32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>()
                          .Attrs(),
                      "embedmesh_exchange_pooled_pairs", "embedmesh_host_pack_pooled_pairs")
EM_DEFINE_TRANSPORTED(ExchangePooledPartials,
                      ffi::Ffi::Bind()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::F32>>()
                          .Attrs(),
                      "embedmesh_exchange_pooled_partials", "embedmesh_host_pooled_partials")
