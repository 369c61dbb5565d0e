// In-process A/B of the update kernels' row prefetch (issue #25 item 1; RESULTS_train.md,
// "Fused-update speed goals"): the old PrefetchWrite (a loop of __builtin_prefetch, which
// GCC 12 -O3 deletes: no prefetch instruction) against common.h's asm prefetch, in the same
// process, interleaved pass by pass (ABBA) over fresh random rows of 256 MiB arrays, for
// each rule at dims 16, 64 and 128. Prints per rule and dim the median ns/row of each, the
// median of per-pass ratios old/new with its quartiles, and the ratio of the best passes.
// Not part of the package; build and run from the repository root:
//   g++ -O3 -ffp-contract=off -fno-math-errno -std=c++17 -w -march=x86-64-v4 -mtune=generic \
//     -I $(python -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     -I embedmesh/device/ops/cpu benchmarks/update_prefetch_ab.cc -o /tmp/pfab -pthread
//   /tmp/pfab 31        # passes per rule and dim
#include "update.cc"
#include "common.cc"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
using namespace embedmesh;
inline void OldPrefetchWrite(char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 1, 0);
}
template <class Rule>
void Bench(const char* name, typename Rule::Params p, int64_t d, int reps) {
  const int64_t rows = (int64_t{1} << 28) / (4 * d);  // 256 MiB an array
  const int64_t n = 20000;
  Updater<Rule, float> up;
  std::vector<float> w(rows * d, 0.01f), s0(rows * d, 0.1f), s1(rows * d, 0.0f), g(n * d, 0.001f);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int64_t> ud(0, rows - 1);
  // a fresh sorted set of ids each pass: rows not in cache from the pass before
  std::vector<std::vector<int32_t>> sets(2 * reps + 2);
  for (auto& ids : sets) {
    ids.resize(n);
    for (auto& x : ids) x = ud(rng);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }
  int next_set = 0;
  up.w = w.data();
  if (Rule::kSlots > 0) up.slot[0] = s0.data();
  if (Rule::kSlots > 1) up.slot[Rule::kSlots > 1 ? 1 : 0] = s1.data();
  static volatile float vinf = INFINITY, vlr = 0.01f;
  up.rows = rows, up.d = d, up.slot_width = Rule::kRowWise ? 1 : d, up.lr = vlr, up.wd = 0;
  up.c.clip_lo = -vinf, up.c.clip_hi = vinf, up.c.wmin = -vinf, up.c.wmax = vinf;
  up.c.has_wd = false, up.c.wd_lr = false, up.c.wd = 0;
  up.p = p;
  if constexpr (HasAtLr<Rule>::value) Rule::AtLr(up.p, up.lr);
  up.Select();
  auto pass = [&](bool asm_pf) {
    const std::vector<int32_t>& ids = sets[next_set++];
    const int64_t m = ids.size();
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < m; ++i) {
      if (i + kPrefetch < m) {
        const int64_t r = ids[i + kPrefetch];
        if (asm_pf) {
          up.Prefetch(r);
        } else {
          OldPrefetchWrite(reinterpret_cast<char*>(up.w + r * d), 4 * d);
          for (int j = 0; j < Rule::kSlots; ++j)
            OldPrefetchWrite(reinterpret_cast<char*>(up.slot[j] + r * up.slot_width), 4 * up.slot_width);
        }
      }
      up.Row(ids[i], g.data() + i * d);
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / m;
  };
  pass(false), pass(true);
  std::vector<double> ratios, olds, news;
  for (int rep = 0; rep < reps; ++rep) {
    double a, b;
    if (rep % 2 == 0) a = pass(false), b = pass(true);
    else b = pass(true), a = pass(false);
    ratios.push_back(a / b), olds.push_back(a), news.push_back(b);
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::sort(ratios.begin(), ratios.end());
  const double best_old = *std::min_element(olds.begin(), olds.end()), best_new = *std::min_element(news.begin(), news.end());
  printf("%-16s d=%3ld  no-prefetch %7.1f ns/row (best %7.1f)  asm prefetch %7.1f ns/row (best %7.1f)  old/new: median of per-rep ratios %.2f [%.2f, %.2f], of bests %.2f, %d reps\n",
         name, (long)d, med(olds), best_old, med(news), best_new, med(ratios), ratios[ratios.size() / 4], ratios[3 * ratios.size() / 4], best_old / best_new, reps);
  fflush(stdout);
}
int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 9;
  for (int64_t d : {16, 64, 128}) {
    Bench<Sgd>("sgd", {}, d, reps);
    Bench<Adagrad>("adagrad", {}, d, reps);
    Adam::Params ap{0.9f, 0.1f, 0.999f, 0.001f, 1e-14f, 1e-7f, false};
    Bench<Adam>("adam", ap, d, reps);
    RowWiseAdagrad::Params rp{1e-8f, 0.0f};
    Bench<RowWiseAdagrad>("rowwise_adagrad", rp, d, reps);
    Ftrl::Params fp{};
    fp.q = 0.5f, fp.q_kind = 2;
    Bench<Ftrl>("ftrl", fp, d, reps);
  }
}
