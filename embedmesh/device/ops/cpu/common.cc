// The thread count of embedmesh's CPU kernels, and what the Python side asks of the
// library through ctypes (kernels.py): setting the thread count, reading it and kPad.
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

}  // namespace

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

// The handlers to register (embedmesh::Handlers): how many, and the i-th's target name
// and address (library.py registers each with XLA).
int64_t EmbedmeshHandlerCount() { return static_cast<int64_t>(embedmesh::Handlers().size()); }

const char* EmbedmeshHandlerName(int64_t i) { return embedmesh::Handlers()[i].first.c_str(); }

void* EmbedmeshHandlerAddress(int64_t i) { return embedmesh::Handlers()[i].second; }

}  // extern "C"
