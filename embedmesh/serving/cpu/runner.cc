// One serving request's kernels, spread over a pool of threads (see EmServingRun and
// EmServingOpen in serving.h).
//
// Why here and not in Python: a request is 8-30 kernel calls of 0.2-2 ms each. Spread over
// Python threads, each feature was one unit of work (a thread holding a large feature
// finished last), every call took the GIL around ctypes' argument conversion, and a pool
// thread's wake-up cost tens of microseconds under load. Here every task is split into
// chunks of whole bags (or id ranges) of about equal entries, and the threads take chunks
// from one atomic counter. A request can also be handed its tasks one by one
// (EmServingOpen / Add / Close): the pool starts on the first feature's chunks while the
// caller still checks and prepares the next ones in Python.

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "serving.h"

namespace embedmesh_serving_runner {
namespace {

constexpr int64_t kBag = 0, kGather = 2, kSparseOffsetsBag = 3;  // 1: a one-pass sparse bag, gone
constexpr int64_t kCheckedBag = 4;   // a bag task whose offsets (ragged row_splits) add() checks
constexpr int64_t kRejectedBag = -4;  // internal: a kCheckedBag whose offsets broke the rules
constexpr int64_t kBadOffsets = -3;   // its result
constexpr int64_t kMinChunkEntries = 2048;  // below this a chunk's start-up costs show
// Chunks of one task, at most, per thread: a request's last chunk leaves the other
// threads idle while it runs, so chunks are small against a thread's share (8 features
// on 2 threads, one chunk each: up to 1/8 of the work on one thread at the end).
constexpr int64_t kChunksPerThread = 4;

// A piece of one task: bags [lo, hi) of a bag task, ids [lo, hi) of a gather, or
// (offsets) the first phase of a sparse offsets task.
struct Chunk {
  int64_t task, lo, hi;
  bool offsets;
};

template <typename T>
inline T* ptr(int64_t w) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(w));
}

bool known_kind(int64_t kind) {
  return kind == kBag || kind == kGather || kind == kSparseOffsetsBag || kind == kCheckedBag;
}

// Whether a kCheckedBag's offsets (w[7], w[8] + 1 of them) run non-decreasing from 0 to its
// number of ids (w[15]): ragged row_splits as given, checked here, in the caller's thread
// as the task is added, before any chunk of it is cut (cutting reads them). Branch-free,
// so the compiler vectorises it: 4k splits take ~1 us.
bool offsets_ok(const int64_t* w) {
  const int64_t* offsets = ptr<const int64_t>(w[7]);
  const int64_t rows = w[8];
  if (rows < 0 || offsets[0] != 0 || offsets[rows] != w[15]) return false;
  bool down = false;
  for (int64_t r = 0; r < rows; ++r) down |= offsets[r + 1] < offsets[r];
  return !down;
}

// Entries of a task (what chunks are sized in; a sparse offsets task's bag part once its
// offsets are written).
int64_t entries(const int64_t* w) {
  switch (w[0]) {
    case kBag:
    case kCheckedBag:
    case kSparseOffsetsBag: {
      const int64_t* offsets = ptr<const int64_t>(w[7]);
      return offsets[w[8]] - offsets[0];
    }
    case kRejectedBag:
      return 0;
    default:
      return w[7];
  }
}

// Entries a task will sum or copy, read without trusting anything unchecked (a kind 4
// task's offsets, a kind 3 task's offsets not yet written): what the request's size is
// judged by before it starts.
int64_t entries_given(const int64_t* w) {
  switch (w[0]) {
    case kBag:
      return entries(w);
    case kCheckedBag:
      return w[15];
    case kSparseOffsetsBag:
      return w[17];
    default:
      return w[7];
  }
}

// Threads worth waking for a request of `n` entries: each thread must have at least
// g_min_entries_per_thread to do. Waking a pool thread costs tens of microseconds (more on
// a VM whose idle vCPU was descheduled): a batch-64 request of 8 features (5k entries)
// took 80-90 us of C++ on one thread and 103-127 us on two, a batch-512 one (41k) 452
// us on one and 359 us on two (2026-12-03, dim 64).
std::atomic<int64_t> g_min_entries_per_thread{8192};  // EmServingSetMinEntriesPerThread
int64_t threads_for(int64_t n, int64_t threads) {
  const int64_t per = std::max<int64_t>(1, g_min_entries_per_thread.load());
  return std::max<int64_t>(1, std::min<int64_t>(threads, n / per));
}

// Pieces for a task of n entries on `threads` threads.
int64_t pieces_for(int64_t n, int64_t threads) {
  if (threads <= 1) return 1;
  const int64_t by_size = (n + kMinChunkEntries - 1) / kMinChunkEntries;
  return std::max<int64_t>(1, std::min(by_size, threads * kChunksPerThread));
}

// Append the chunks of task t (whose words are w) to `out`.
template <typename Out>
void split(const int64_t* w, int64_t t, int64_t threads, Out&& out) {
  const int64_t kind = w[0];
  const int64_t n = entries(w);
  const int64_t pieces = pieces_for(n, threads);
  if (kind == kRejectedBag) {
    out(Chunk{t, 0, 0, false});
    return;
  }
  if (kind == kGather) {
    const int64_t count = w[7];
    for (int64_t j = 0; j < pieces; ++j) {
      out(Chunk{t, count * j / pieces, count * (j + 1) / pieces, false});
    }
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
      out(Chunk{t, lo, hi, false});
      lo = hi;
    }
  }
}

// The first phase of a sparse offsets task: its bag offsets from its COO indices
// (checked: inside the dense shape, row-major, no repeats); -1 or -2 - the first bad
// index (the result of a task whose index k is bad: -2 - k).
int64_t run_offsets(const int64_t* w) {
  const int64_t shape[2] = {w[8], w[18]};
  const int64_t bad = EmServingSparseOffsets(ptr<const void>(w[15]), static_cast<int32_t>(w[16]),
                                             w[17], 2, shape, ptr<int64_t>(w[7]));
  return bad >= 0 ? -2 - bad : -1;
}

struct OutputBytesReset {
  ~OutputBytesReset() { embedmesh_serving::t_output_bytes = 0; }
};

// Run one kernel chunk; the result as its whole task's kernel would give it for those
// entries.
int64_t run_kernel(const int64_t* w, const Chunk& c) {
  switch (w[0]) {
    case kRejectedBag:
      return kBadOffsets;
    case kBag:
    case kCheckedBag:
    case kSparseOffsetsBag: {
      const int64_t out_stride = w[14];
      // the whole task's output, not this chunk's (see stream_rows in serving.cc)
      embedmesh_serving::t_output_bytes = w[8] * out_stride * 4;
      const OutputBytesReset reset;
      if (w[19] != 0) {  // a quantized table (EmServingBagQ: word 4 in bytes)
        return EmServingBagQ(ptr<const void>(w[1]), w[2], w[3], w[4], ptr<const void>(w[5]),
                             static_cast<int32_t>(w[6]), ptr<const int64_t>(w[7]) + c.lo,
                             c.hi - c.lo, ptr<const float>(w[9]), static_cast<int32_t>(w[10]),
                             static_cast<int32_t>(w[11]), static_cast<int32_t>(w[12]),
                             ptr<float>(w[13]) + c.lo * out_stride, out_stride,
                             ptr<const int64_t>(w[19]));
      }
      return EmServingBagF32(ptr<const float>(w[1]), w[2], w[3], w[4], ptr<const void>(w[5]),
                             static_cast<int32_t>(w[6]), ptr<const int64_t>(w[7]) + c.lo,
                             c.hi - c.lo, ptr<const float>(w[9]), static_cast<int32_t>(w[10]),
                             static_cast<int32_t>(w[11]), static_cast<int32_t>(w[12]),
                             ptr<float>(w[13]) + c.lo * out_stride, out_stride);
    }
    default: {  // kGather
      const int64_t id_bytes = w[6] ? 8 : 4, row_bytes = w[3];
      const int64_t bad = EmServingGather(
          ptr<const void>(w[1]), w[2], row_bytes, w[4], ptr<const char>(w[5]) + c.lo * id_bytes,
          static_cast<int32_t>(w[6]), c.hi - c.lo, ptr<char>(w[8]) + c.lo * row_bytes);
      return bad >= 0 ? bad + c.lo : bad;
    }
  }
}

// One request: its tasks' words (copied in), and the chunks the threads take in order.
// Chunks are appended (by the caller adding a task, or by the thread that wrote a sparse
// task's offsets) under `append`, then published by raising `published`; threads claim
// them through `next`. Storage is reserved up front, so claimed chunks never move.
class Request {
 public:
  Request(int64_t max_tasks, int64_t threads)
      : max_tasks_(max_tasks), threads_(threads < 1 ? 1 : threads) {
    words_.resize(static_cast<size_t>(max_tasks_ * EM_TASK_WORDS));
    // per task: its offsets chunk and at most pieces_for(...) kernel chunks
    const int64_t per_task = 1 + (threads_ <= 1 ? 1 : threads_ * kChunksPerThread);
    chunks_.resize(static_cast<size_t>(max_tasks_ * per_task));
    results_.assign(chunks_.size(), -1);
  }

  // Copy task t's words in and publish its first chunks; false for an unknown kind or a
  // request already full.
  bool add(const int64_t* w) {
    if (!known_kind(w[0]) || n_tasks_ >= max_tasks_) return false;
    const int64_t t = n_tasks_++;
    int64_t* mine = &words_[static_cast<size_t>(t * EM_TASK_WORDS)];
    std::memcpy(mine, w, EM_TASK_WORDS * sizeof(int64_t));
    if (mine[0] == kCheckedBag && !offsets_ok(mine)) mine[0] = kRejectedBag;  // one chunk: -3
    if (mine[0] == kSparseOffsetsBag) {
      pending_.fetch_add(1, std::memory_order_acq_rel);
      append_and_publish([&](auto&& out) { out(Chunk{t, 0, 0, true}); });
    } else {
      append_and_publish([&](auto&& out) { split(mine, t, threads_, out); });
    }
    return true;
  }

  void close() { closed_.store(true, std::memory_order_release); }

  // Take and run chunks until the request is closed and every chunk has run or been
  // claimed; threads that find nothing yet yield (the caller is preparing the next task).
  void work() {
    for (;;) {
      int64_t i = next_.load(std::memory_order_acquire);
      if (i < published_.load(std::memory_order_acquire)) {
        if (next_.compare_exchange_weak(i, i + 1, std::memory_order_acq_rel)) run(i);
        continue;
      }
      if (closed_.load(std::memory_order_acquire) &&
          pending_.load(std::memory_order_acquire) == 0 &&
          next_.load(std::memory_order_acquire) >= published_.load(std::memory_order_acquire)) {
        return;
      }
      sched_yield();
    }
  }

  // Each task's result: its first chunk (offsets first, then entry order) that failed.
  void results(int64_t* out) const {
    for (int64_t t = 0; t < n_tasks_; ++t) out[t] = -1;
    const int64_t n = published_.load(std::memory_order_acquire);
    std::vector<bool> done(static_cast<size_t>(n_tasks_), false);
    for (int64_t i = 0; i < n; ++i) {
      const Chunk& c = chunks_[static_cast<size_t>(i)];
      if (!done[static_cast<size_t>(c.task)] && results_[static_cast<size_t>(i)] != -1) {
        out[c.task] = results_[static_cast<size_t>(i)];
        done[static_cast<size_t>(c.task)] = true;
      }
    }
  }

 private:
  const int64_t max_tasks_, threads_;
  int64_t n_tasks_ = 0;  // the adding thread's only
  std::vector<int64_t> words_;
  std::vector<Chunk> chunks_;
  std::vector<int64_t> results_;
  std::mutex append_;
  int64_t appended_ = 0;  // under append_
  std::atomic<int64_t> published_{0}, next_{0}, pending_{0};
  std::atomic<bool> closed_{false};

  template <typename F>
  void append_and_publish(F&& make) {
    std::lock_guard<std::mutex> lk(append_);
    make([&](const Chunk& c) { chunks_[static_cast<size_t>(appended_++)] = c; });
    published_.store(appended_, std::memory_order_release);
  }

  void run(int64_t i) {
    const Chunk c = chunks_[static_cast<size_t>(i)];
    const int64_t* w = &words_[static_cast<size_t>(c.task * EM_TASK_WORDS)];
    if (!c.offsets) {
      results_[static_cast<size_t>(i)] = run_kernel(w, c);
      return;
    }
    const int64_t r = run_offsets(w);
    results_[static_cast<size_t>(i)] = r;
    if (r == -1) append_and_publish([&](auto&& out) { split(w, c.task, threads_, out); });
    pending_.fetch_sub(1, std::memory_order_acq_rel);  // after its chunks are published
  }
};

// How long a pool thread keeps polling for the next request after one (microseconds)
// before it sleeps, as OpenMP runtimes' threads do. Waking a sleeping thread costs tens
// of microseconds on a VM, and that thread then starts late on a request of ~1 ms.
// Requests handed over task by task, back to back on 2 threads, each system alone in its
// turn, 8 x 1M tables (benchmarks/serving_pool_ab.py, 11 rounds, 2026-12-03; removed
// since: `git show 978d03b:benchmarks/serving_pool_ab.py`), torch's 2 threads over ours:
// dim 16 0.925 -> 0.995, dim 32 0.991 -> 1.048, dim 64 1.128 -> 1.203, batch 512 0.732 ->
// 0.813 (1000 us: 0.996, 1.077, 1.262). A thread polls with `pause`;
// only processes that ran a request on 2+ threads have pool threads at all.
constexpr int64_t kDefaultPoolSpinUs = 300;
std::atomic<int64_t> g_pool_spin_us{kDefaultPoolSpinUs};  // EmServingSetPoolSpin

// A polling loop's pause: lets the core's other hyperthread (or the VM's other guest
// threads) run, and costs no memory traffic.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Threads that sleep between requests (after polling for the next one a while: see
// g_pool_spin_us). One request uses it at a time; another request
// arriving meanwhile runs on its own thread alone (a server with its own request
// threads gets one core a request, and nobody waits for the pool).
class Pool {
 public:
  const pid_t pid = getpid();
  std::mutex busy;  // held by the request using the pool

  // Wake `helpers` threads onto `r` (they work until it is closed and drained).
  void start(Request* r, int helpers) {
    grow(helpers);
    std::lock_guard<std::mutex> lk(m_);
    request_ = r;
    helpers_ = helpers;
    generation_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  // After the caller has drained `r` too: no thread joins from now; wait for those that
  // did.
  void finish() {
    std::unique_lock<std::mutex> lk(m_);
    request_ = nullptr;
    done_.wait(lk, [&] { return active_ == 0; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_, done_;
  std::vector<std::thread> threads_;  // never joined: the pool lives as long as the process
  Request* request_ = nullptr;
  int helpers_ = 0;
  std::atomic<uint64_t> generation_{0};
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
      const int64_t spin = g_pool_spin_us.load(std::memory_order_relaxed);
      if (spin > 0 && generation_.load(std::memory_order_acquire) == seen) {
        lk.unlock();  // poll without the lock: start() takes it
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
        while (generation_.load(std::memory_order_acquire) == seen &&
               std::chrono::steady_clock::now() < until) {
          relax();
        }
        lk.lock();
      }
      cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      seen = generation_.load(std::memory_order_acquire);
      Request* r = request_;
      if (r == nullptr || index >= helpers_) continue;
      ++active_;
      lk.unlock();
      r->work();
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

// A request and the pool it holds (nullptr: the caller's thread alone). The pool is
// woken once the tasks added hold enough entries for a second thread (threads_for):
// a small request never wakes it.
struct Handle {
  Request request;
  const int64_t threads;
  int64_t entries = 0;
  bool asked = false;  // the pool was asked for (and given, or found busy)
  Pool* pool = nullptr;
  Handle(int64_t max_tasks, int64_t threads) : request(max_tasks, threads), threads(threads) {}

  bool add(const int64_t* w) {
    if (!request.add(w)) return false;
    entries += entries_given(w);
    if (!asked && threads > 1 && threads_for(entries, threads) > 1) {
      asked = true;
      Pool* p = embedmesh_serving_runner::pool();
      if (p->busy.try_lock()) {
        pool = p;
        p->start(&request, static_cast<int>(threads - 1));
      }
    }
    return true;
  }
};

Handle* open(int64_t max_tasks, int64_t threads) { return new Handle(max_tasks, threads); }

void close(Handle* h, int64_t* results) {
  h->request.close();
  h->request.work();
  if (h->pool != nullptr) {
    h->pool->finish();
    h->pool->busy.unlock();
  }
  h->request.results(results);
  delete h;
}

}  // namespace
}  // namespace embedmesh_serving_runner

using namespace embedmesh_serving_runner;

extern "C" {

int64_t EmServingSetMinEntriesPerThread(int64_t n) {
  return g_min_entries_per_thread.exchange(n < 1 ? 1 : n);
}

int64_t EmServingSetPoolSpin(int64_t us) { return g_pool_spin_us.exchange(us < 0 ? 0 : us); }

int64_t EmServingThreadsForEntries(int64_t entries, int64_t threads) {
  return threads_for(entries, threads);
}

int64_t EmServingThreadsFor(const int64_t* tasks, int64_t n_tasks, int64_t threads) {
  int64_t n = 0;
  for (int64_t t = 0; t < n_tasks; ++t) n += entries_given(tasks + t * EM_TASK_WORDS);
  return threads_for(n, threads);
}

int64_t EmServingRun(const int64_t* tasks, int64_t n_tasks, int64_t threads, int64_t* results) {
  for (int64_t t = 0; t < n_tasks; ++t) {
    if (!known_kind(tasks[t * EM_TASK_WORDS])) return t;
  }
  Handle* h = open(n_tasks, EmServingThreadsFor(tasks, n_tasks, threads));
  for (int64_t t = 0; t < n_tasks; ++t) h->add(tasks + t * EM_TASK_WORDS);
  close(h, results);
  return -1;
}

void* EmServingOpen(int64_t max_tasks, int64_t threads) {
  return open(max_tasks < 0 ? 0 : max_tasks, threads);
}

int64_t EmServingAdd(void* request, const int64_t* words) {
  return static_cast<Handle*>(request)->add(words) ? -1 : 0;
}

void EmServingClose(void* request, int64_t* results) {
  close(static_cast<Handle*>(request), results);
}

}  // extern "C"
