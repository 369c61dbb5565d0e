// The rendezvous of the CPU devices of one process: what lets a kernel on one device read
// its peers' buffers, the InProcess transport of the cross-device ops (transport.h). Part of
// embedmesh's CPU kernels (XLA FFI).
//
// Every device of a mesh runs the same program, so the k-th call at a given call site
// (`tag`, unique per traced call) on every device belongs to one round. Each call registers
// a pointer, waits until all `n` devices have arrived (then every registered buffer is
// final), runs its work reading its peers' pointers, and waits until all have run theirs
// before returning, so nothing registered is released or overwritten while a peer still
// reads it. A device that never arrives makes the others fail after `kTimeout`, not hang.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "common.h"

namespace embedmesh {

constexpr auto kTimeout = std::chrono::seconds(60);

struct Rendezvous {
  std::mutex mu;
  std::condition_variable cv;
  int64_t n = 0;
  int64_t arrived = 0;
  int64_t copied = 0;
  int64_t generation = 0;  // completed rounds
  std::vector<const char*> inputs;
};

inline Rendezvous& RendezvousOf(int64_t tag, int64_t n) {
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

// Runs `work(peers)` once every one of the `n` devices has arrived at call site `tag`
// with its pointer (`peers[s]`: device s's), and returns once every device has run it,
// so no device releases or overwrites what it registered while a peer still reads it.
// (One function for every caller: `work` passed as an FnRef, see WithPeers below.)
__attribute__((noinline)) inline ffi::Error PeerRound(
    int64_t tag, int64_t n, int64_t rank, const void* mine, const char* what,
    FnRef<void(const std::vector<const char*>&)> work) {
  if (n < 1 || rank < 0 || rank >= n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string("embedmesh ") + what + ": rank " + std::to_string(rank) +
                          " of " + std::to_string(n) + " devices");
  }
  Rendezvous& rv = RendezvousOf(tag, n);
  std::unique_lock<std::mutex> lock(rv.mu);
  const int64_t gen = rv.generation;
  rv.inputs[rank] = static_cast<const char*>(mine);
  if (++rv.arrived == n) {
    rv.cv.notify_all();
  } else if (!rv.cv.wait_for(lock, kTimeout, [&] { return rv.arrived == n; })) {
    --rv.arrived;
    rv.inputs[rank] = nullptr;
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      std::string("embedmesh ") + what + ": only " +
                          std::to_string(rv.arrived + 1) + " of " + std::to_string(n) +
                          " devices arrived within 60 s (on XLA:CPU, keep at most two "
                          "multi-device steps in flight: see docs/training.md)");
  }
  const std::vector<const char*> peers = rv.inputs;
  lock.unlock();
  work(peers);
  lock.lock();
  if (++rv.copied == n) {  // the last one out opens the next round
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

template <typename F>
ffi::Error WithPeers(int64_t tag, int64_t n, int64_t rank, const void* mine, const char* what,
                     const F& work) {
  auto read = [&](const std::vector<const char*>& peers) { work(peers); };
  return PeerRound(tag, n, rank, mine, what, read);
}

}  // namespace embedmesh
