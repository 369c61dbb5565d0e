// The all-to-all of CPU devices that live in one process, through their shared memory.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by kernels.py.
//
// XLA's own CPU all_to_all moves about 1.4 GB/s here (its rendezvous copies each block
// through a staging path); the devices of one process share an address space, so each
// device can copy the blocks meant for it straight out of its peers' input buffers.
//
// Every device of the mesh runs the same program, so the k-th call at a given call site
// (`tag`, unique per traced call) on every device belongs to one exchange. Each call
// registers its input, waits until all `n` devices have arrived (then every input is
// final), copies block `rank` of every peer's input into its own output (block s of the
// result came from device s), and waits until all have copied before returning, so no
// input is released or overwritten while a peer still reads it. A device that never
// arrives makes the others fail with an error after `kTimeout` rather than hang.
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "common.h"

namespace embedmesh {
namespace {

constexpr auto kTimeout = std::chrono::seconds(300);

struct Rendezvous {
  std::mutex mu;
  std::condition_variable cv;
  int64_t n = 0;
  int64_t arrived = 0;
  int64_t copied = 0;
  int64_t generation = 0;  // completed exchanges
  std::vector<const char*> inputs;
};

Rendezvous& RendezvousOf(int64_t tag, int64_t n) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Rendezvous>> table;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = table[{tag, n}];
  if (!slot) {
    slot = std::make_unique<Rendezvous>();
    slot->n = n;
    slot->inputs.assign(n, nullptr);
  }
  return *slot;
}

ffi::Error Exchange(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf, int64_t tag, int64_t n,
                    ffi::Result<ffi::AnyBuffer> out) {
  const int64_t rank = rank_buf.typed_data()[0];
  if (n < 1 || rank < 0 || rank >= n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "embedmesh exchange: rank " + std::to_string(rank) + " of " +
                          std::to_string(n) + " devices");
  }
  const size_t bytes = x.size_bytes();
  if (bytes % n != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "embedmesh exchange: " + std::to_string(bytes) +
                          " bytes do not split into " + std::to_string(n) + " blocks");
  }
  const size_t block = bytes / n;
  char* dst = static_cast<char*>(out->untyped_data());
  Rendezvous& rv = RendezvousOf(tag, n);
  std::unique_lock<std::mutex> lock(rv.mu);
  const int64_t gen = rv.generation;
  rv.inputs[rank] = static_cast<const char*>(x.untyped_data());
  if (++rv.arrived == n) {
    rv.cv.notify_all();
  } else if (!rv.cv.wait_for(lock, kTimeout,
                             [&] { return rv.arrived == n || rv.generation != gen; })) {
    --rv.arrived;
    rv.inputs[rank] = nullptr;
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      "embedmesh exchange: only " + std::to_string(rv.arrived + 1) + " of " +
                          std::to_string(n) + " devices arrived within 300 s");
  }
  std::vector<const char*> inputs = rv.inputs;
  lock.unlock();
  PrepareOutput(dst, bytes);
  for (int64_t s = 0; s < n; ++s) {
    std::memcpy(dst + s * block, inputs[s] + rank * block, block);
  }
  lock.lock();
  if (++rv.copied == n) {  // the last one out opens the next exchange
    rv.arrived = 0;
    rv.copied = 0;
    std::fill(rv.inputs.begin(), rv.inputs.end(), nullptr);
    ++rv.generation;
    rv.cv.notify_all();
  } else {
    rv.cv.wait(lock, [&] { return rv.generation != gen; });
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embedmesh

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmExchange, embedmesh::Exchange,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::AnyBuffer>());
