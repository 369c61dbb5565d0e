// The thread count of embedmesh's CPU kernels, and what the Python side asks of the
// library through ctypes (kernels.py): setting the thread count, reading it and kPad;
// and the persistent thread pool behind ParallelFor (RunChunks).
#include <pthread.h>

#include <condition_variable>
#include <mutex>

#include "common.h"

namespace embedmesh {
namespace {

// Set by EmbedmeshSetThreads; below 1: one thread per usable CPU.
std::atomic<int64_t> threads_setting{0};

int64_t UsableCpus() {
  static const int64_t n = [] {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

// One ParallelFor call: its chunks, handed out by `next`; pool threads may join it while
// seats are left (counted under the pool's mutex, as `active`, those inside).
struct Job {
  int64_t n;
  void (*call)(const void*, int64_t);
  const void* ctx;
  std::atomic<int64_t> next{0};
  int64_t seats;
  int64_t active = 0;

  void Work() {
    int64_t c;
    while ((c = next.fetch_add(1, std::memory_order_relaxed)) < n) call(ctx, c);
  }
};

// Threads started once (as many as the largest call asked for helpers) that wait for
// jobs. A caller posts its job, works on it itself, then withdraws it (no one joins it
// after) and waits for the pool threads inside to finish their chunks.
class Pool {
 public:
  void Run(Job* job) {
    int64_t wake;
    {
      std::lock_guard<std::mutex> l(mu_);
      Grow(job->seats);
      jobs_.push_back(job);
      wake = std::min(job->seats, threads_);
    }
    for (int64_t i = 0; i < wake; ++i) wake_.notify_one();
    job->Work();
    std::unique_lock<std::mutex> l(mu_);
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
    done_.wait(l, [job] { return job->active == 0; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      Job* job = nullptr;
      wake_.wait(l, [&] { return (job = Open()) != nullptr; });
      --job->seats;
      ++job->active;
      l.unlock();
      job->Work();
      l.lock();
      if (--job->active == 0) done_.notify_all();
    }
  }

  Job* Open() const {
    for (Job* j : jobs_)
      if (j->seats > 0 && j->next.load(std::memory_order_relaxed) < j->n) return j;
    return nullptr;
  }

  void Grow(int64_t want) {
    while (threads_ < want) {
      try {
        std::thread(&Pool::Loop, this).detach();
      } catch (...) {  // no thread: callers do the work
        return;
      }
      ++threads_;
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<Job*> jobs_;
  int64_t threads_ = 0;
};

// The process's pool, never destroyed (its threads are detached); a child of fork() gets
// a fresh one (the parent's threads do not exist there).
std::atomic<Pool*> the_pool{nullptr};

Pool& ThePool() {
  static const bool once = [] {
    the_pool.store(new Pool, std::memory_order_release);
    pthread_atfork(nullptr, nullptr, [] { the_pool.store(new Pool, std::memory_order_release); });
    return true;
  }();
  (void)once;
  return *the_pool.load(std::memory_order_acquire);
}

}  // namespace

void RunChunks(int64_t n, int64_t helpers, void (*call)(const void*, int64_t), const void* ctx) {
  Job job;
  job.n = n;
  job.call = call;
  job.ctx = ctx;
  job.seats = helpers;
  ThePool().Run(&job);
}

int64_t NumWorkers() {
  const int64_t n = threads_setting.load(std::memory_order_relaxed);
  return n >= 1 ? n : UsableCpus();
}

}  // namespace embedmesh

extern "C" {

// The thread count of every later call (embedmesh passes EMBEDMESH_CPU_THREADS, read by
// embedmesh._runtime, right after loading the library); below 1: one per usable CPU.
void EmbedmeshSetThreads(int64_t n) {
  embedmesh::threads_setting.store(n, std::memory_order_relaxed);
}

int64_t EmbedmeshThreads() { return embedmesh::NumWorkers(); }

int32_t EmbedmeshPadId() { return embedmesh::kPad; }

// For the tests: `callers` threads at once each run a ParallelFor of `outer` chunks whose
// every chunk runs a ParallelFor of `inner` chunks; out[0] = the inner chunks run, out[1]
// = the sum of (their global index + 1), out[2] = of its square (each chunk run exactly
// once: n, n(n+1)/2 and n(n+1)(2n+1)/6 for n = callers * outer * inner).
void EmbedmeshParallelForCheck(int64_t callers, int64_t outer, int64_t inner, int64_t* out) {
  std::atomic<int64_t> count{0}, sum{0}, squares{0};
  auto one = [&](int64_t id) {
    embedmesh::ParallelFor(outer, [&](int64_t o) {
      embedmesh::ParallelFor(inner, [&](int64_t i) {
        const int64_t k = (id * outer + o) * inner + i + 1;
        count.fetch_add(1);
        sum.fetch_add(k);
        squares.fetch_add(k * k);
      });
    });
  };
  std::vector<std::thread> threads;
  for (int64_t id = 1; id < callers; ++id) threads.emplace_back(one, id);
  one(0);
  for (auto& t : threads) t.join();
  out[0] = count.load();
  out[1] = sum.load();
  out[2] = squares.load();
}

// The handlers to register (embedmesh::Handlers): how many, and the i-th's target name
// and address (library.py registers each with XLA).
int64_t EmbedmeshHandlerCount() { return static_cast<int64_t>(embedmesh::Handlers().size()); }

const char* EmbedmeshHandlerName(int64_t i) { return embedmesh::Handlers()[i].first.c_str(); }

void* EmbedmeshHandlerAddress(int64_t i) { return embedmesh::Handlers()[i].second; }

}  // extern "C"
