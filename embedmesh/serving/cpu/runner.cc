// One serving request's kernels in one call, spread over a pool of threads (see
// EmServingRun in serving.h).
//
// Why here and not in Python: a request is 8-30 kernel calls of 0.2-2 ms each. Spread over
// Python threads, each feature was one unit of work (a thread holding a large feature
// finished last), every call took the GIL around ctypes' argument conversion, and a pool
// thread's wake-up cost tens of microseconds under load. Here every task is split into
// chunks of whole bags (or id ranges) of about equal entries, the threads take chunks
// from one atomic counter, and the request costs one ctypes call.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "serving.h"

namespace embedmesh_serving_runner {
namespace {

constexpr int64_t kBag = 0, kSparseBag = 1, kGather = 2, kSparseOffsetsBag = 3;
constexpr int64_t kMinChunkEntries = 4096;  // below this a chunk's start-up costs show

// A piece of one task: bags [lo, hi) of a bag task, ids [lo, hi) of a gather, or a whole
// sparse bag task (its bags are found by reading its indices in order).
struct Chunk {
  int64_t task, lo, hi;
};

inline const int64_t* words(const int64_t* tasks, int64_t t) { return tasks + t * EM_TASK_WORDS; }

template <typename T>
inline T* ptr(int64_t w) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(w));
}

// Entries of task t (the unit chunks are sized in; a sparse offsets task's bag part once
// its offsets are written).
int64_t entries(const int64_t* w) {
  switch (w[0]) {
    case kBag:
    case kSparseOffsetsBag: {
      const int64_t* offsets = ptr<const int64_t>(w[7]);
      return offsets[w[8]] - offsets[0];
    }
    case kSparseBag:
      return w[9];
    default:
      return w[7];
  }
}

// The chunks of task t, about `target` entries each (one when target <= 0).
void split(const int64_t* w, int64_t t, int64_t target, std::vector<Chunk>& out) {
  const int64_t kind = w[0];
  const int64_t n = entries(w);
  int64_t pieces = target > 0 ? (n + target - 1) / target : 1;
  if (kind == kSparseBag || pieces < 1) pieces = 1;
  if (kind == kGather) {
    const int64_t count = w[7];
    for (int64_t j = 0; j < pieces; ++j) out.push_back({t, count * j / pieces, count * (j + 1) / pieces});
    return;
  }
  if (kind == kSparseBag) {
    out.push_back({t, 0, 0});
    return;
  }
  // bags [lo, hi): each piece ends at the first bag starting at or after its share of
  // the entries (a bag is never split: its sum is one register block's work)
  const int64_t* offsets = ptr<const int64_t>(w[7]);
  const int64_t rows = w[8], base = offsets[0];
  int64_t lo = 0;
  for (int64_t j = 1; j <= pieces; ++j) {
    const int64_t hi =
        j == pieces ? rows
                    : std::lower_bound(offsets + lo, offsets + rows, base + n * j / pieces) -
                          offsets;
    if (hi > lo) {
      out.push_back({t, lo, hi});
      lo = hi;
    }
  }
}

// The first phase of a sparse offsets task: its bag offsets from its COO indices
// (checked: inside the dense shape, row-major, no repeats); -1 or -2 - the first bad
// index (EmServingSparseBagF32's convention).
int64_t run_offsets(const int64_t* tasks, const Chunk& c) {
  const int64_t* w = words(tasks, c.task);
  const int64_t shape[2] = {w[8], w[18]};
  const int64_t bad = EmServingSparseOffsets(ptr<const void>(w[15]), static_cast<int32_t>(w[16]),
                                             w[17], 2, shape, ptr<int64_t>(w[7]));
  return bad >= 0 ? -2 - bad : -1;
}

// Run one chunk; the result as its whole task's kernel would give it for those entries.
int64_t run_chunk(const int64_t* tasks, const Chunk& c) {
  const int64_t* w = words(tasks, c.task);
  switch (w[0]) {
    case kBag:
    case kSparseOffsetsBag: {
      const int64_t out_stride = w[14];
      return EmServingBagF32(ptr<const float>(w[1]), w[2], w[3], w[4], ptr<const void>(w[5]),
                             static_cast<int32_t>(w[6]), ptr<const int64_t>(w[7]) + c.lo,
                             c.hi - c.lo, ptr<const float>(w[9]), static_cast<int32_t>(w[10]),
                             static_cast<int32_t>(w[11]), static_cast<int32_t>(w[12]),
                             ptr<float>(w[13]) + c.lo * out_stride, out_stride);
    }
    case kSparseBag:
      return EmServingSparseBagF32(
          ptr<const float>(w[1]), w[2], w[3], w[4], ptr<const void>(w[5]),
          static_cast<int32_t>(w[6]), ptr<const void>(w[7]), static_cast<int32_t>(w[8]), w[9],
          w[10], w[11], ptr<const float>(w[12]), static_cast<int32_t>(w[13]),
          static_cast<int32_t>(w[14]), static_cast<int32_t>(w[15]), ptr<float>(w[16]), w[17]);
    case kGather: {
      const int64_t id_bytes = w[6] ? 8 : 4, row_bytes = w[3];
      const int64_t bad = EmServingGather(
          ptr<const void>(w[1]), w[2], row_bytes, w[4], ptr<const char>(w[5]) + c.lo * id_bytes,
          static_cast<int32_t>(w[6]), c.hi - c.lo, ptr<char>(w[8]) + c.lo * row_bytes);
      return bad >= 0 ? bad + c.lo : bad;
    }
    default:
      return INT64_MIN + 1;  // unknown kind (the caller checks kinds first)
  }
}

struct Job {
  const int64_t* tasks;
  const Chunk* chunks;
  int64_t n_chunks;
  int64_t* chunk_results;
  int64_t (*run)(const int64_t*, const Chunk&);
  int helpers = 0;  // pool threads wanted besides the caller
  std::atomic<int64_t> next{0};

  void work() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_chunks;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      chunk_results[i] = run(tasks, chunks[i]);
    }
  }
};

// Run `chunks` with `run` on up to `threads` threads; their results in `chunk_results`.
void run_all(const int64_t* tasks, const std::vector<Chunk>& chunks,
             int64_t (*run)(const int64_t*, const Chunk&), int64_t threads,
             std::vector<int64_t>& chunk_results);

// Threads that sleep between requests. One request uses it at a time; another request
// arriving meanwhile runs on its own thread alone (a server with its own request
// threads gets one core a request, and nobody waits for the pool).
class Pool {
 public:
  const pid_t pid = getpid();
  std::mutex busy;  // held by the request using the pool

  void run(Job& job, int threads) {
    grow(threads - 1);
    job.helpers = threads - 1;
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = &job;
      ++generation_;
    }
    cv_.notify_all();
    job.work();
    std::unique_lock<std::mutex> lk(m_);
    job_ = nullptr;  // no thread joins from now; wait for those that did
    done_.wait(lk, [&] { return active_ == 0; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_, done_;
  std::vector<std::thread> threads_;  // never joined: the pool lives as long as the process
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0;

  void grow(int n) {
    while (static_cast<int>(threads_.size()) < n) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { loop(index); });
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      Job* job = job_;
      if (job == nullptr || index >= job->helpers) continue;
      ++active_;
      lk.unlock();
      job->work();
      lk.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }
};

std::mutex g_pool_lock;
Pool* g_pool = nullptr;  // leaked on purpose (no join at exit); replaced in a forked child

Pool* pool() {
  std::lock_guard<std::mutex> lk(g_pool_lock);
  // a forked child inherits the memory but not the threads: start a new pool there
  if (g_pool == nullptr || g_pool->pid != getpid()) g_pool = new Pool();
  return g_pool;
}

void run_all(const int64_t* tasks, const std::vector<Chunk>& chunks,
             int64_t (*run)(const int64_t*, const Chunk&), int64_t threads,
             std::vector<int64_t>& chunk_results) {
  chunk_results.assign(chunks.size(), -1);
  Job job;
  job.tasks = tasks;
  job.chunks = chunks.data();
  job.n_chunks = static_cast<int64_t>(chunks.size());
  job.chunk_results = chunk_results.data();
  job.run = run;
  const int use = static_cast<int>(std::min<int64_t>(threads, job.n_chunks));
  Pool* p = use > 1 ? pool() : nullptr;
  if (p != nullptr && p->busy.try_lock()) {
    p->run(job, use);
    p->busy.unlock();
  } else {
    job.work();
  }
}

}  // namespace
}  // namespace embedmesh_serving_runner

using namespace embedmesh_serving_runner;

extern "C" {

int64_t EmServingRun(const int64_t* tasks, int64_t n_tasks, int64_t threads, int64_t* results) {
  for (int64_t t = 0; t < n_tasks; ++t) {
    const int64_t kind = words(tasks, t)[0];
    if (kind != kBag && kind != kSparseBag && kind != kGather && kind != kSparseOffsetsBag) {
      return t;
    }
  }
  for (int64_t t = 0; t < n_tasks; ++t) results[t] = -1;
  std::vector<Chunk> chunks;
  std::vector<int64_t> chunk_results;
  // phase 1: the offsets of sparse offsets tasks, a task a chunk
  for (int64_t t = 0; t < n_tasks; ++t) {
    if (words(tasks, t)[0] == kSparseOffsetsBag) chunks.push_back({t, 0, 0});
  }
  if (!chunks.empty()) {
    run_all(tasks, chunks, &run_offsets, threads, chunk_results);
    for (size_t i = 0; i < chunks.size(); ++i) results[chunks[i].task] = chunk_results[i];
    chunks.clear();
  }
  // phase 2: every kernel (but those whose indices were bad), in chunks
  int64_t total = 0;
  for (int64_t t = 0; t < n_tasks; ++t) {
    if (results[t] == -1) total += entries(words(tasks, t));
  }
  const int64_t target = threads > 1 ? std::max(kMinChunkEntries, total / (threads * 4)) : 0;
  chunks.reserve(static_cast<size_t>(n_tasks) * 4);
  for (int64_t t = 0; t < n_tasks; ++t) {
    if (results[t] == -1) split(words(tasks, t), t, target, chunks);
  }
  run_all(tasks, chunks, &run_chunk, threads, chunk_results);
  // each task's result: its first chunk (in entry order) that did not succeed
  for (size_t i = chunks.size(); i-- > 0;) {
    if (chunk_results[i] != -1) results[chunks[i].task] = chunk_results[i];
  }
  return -1;
}

}  // extern "C"
