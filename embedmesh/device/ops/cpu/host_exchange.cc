// The lifecycle of the shared-memory segments of processes of one host (host_peers.h),
// which the cross-device ops' SharedMemory transport (transport.h) exchanges through: what
// the Python side calls through ctypes at a job's start and at exit, and, for tests, which
// channels ran. Part of embedmesh's CPU kernels; built by build.py, called by library.py.
#include "host_peers.h"

// Waits (up to timeout_s) until every peer has read the last round of each of this
// process's channels, then unlinks their segments; returns how many it unlinked. The Python
// side calls it at exit. Mappings (ours and the peers') stay valid after an unlink.
extern "C" int64_t EmbedmeshHostExchangeRelease(double timeout_s) {
  namespace hp = embedmesh::hostpeers;
  std::lock_guard<std::mutex> lock(hp::Mutex());
  const auto deadline =
      hp::Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  int64_t unlinked = 0;
  for (auto& [key, ch] : hp::Channels()) {
    if (ch->own.fd < 0) continue;
    for (int64_t s = 0; s < ch->n; ++s) {
      const auto& m = ch->peers[s];
      if (s == ch->rank || m.base == nullptr) continue;
      const int64_t last = ch->round;
      hp::WaitUntil(
          [&] { return m.header()->done.v.load(std::memory_order_acquire) >= last; }, deadline,
          [&] { return hp::WriterExited(m.header()); });
    }
    if (!ch->unlinked && shm_unlink(ch->Name(ch->rank).c_str()) == 0) ++unlinked;
    ch->unlinked = true;
    close(ch->own.fd);
    ch->own.fd = -1;
  }
  return unlinked;
}

// A job starts (peers.same_host_job, at build): registers the pids of its processes (in
// process order, with their pid namespaces) for its waiters to watch, and removes the
// segments of exited writers that jobs killed whole left in /dev/shm; returns how many.
extern "C" int64_t EmbedmeshHostJobBegin(int64_t job, const int64_t* pids, const int64_t* ns,
                                         int64_t count) {
  namespace hp = embedmesh::hostpeers;
  std::vector<hp::JobProcess> procs;
  for (int64_t i = 0; i < count; ++i) {
    char state = 0;
    int64_t start = 0;  // now, while it runs: a later process with its pid is another
    hp::ProcStat(pids[i], state, start);
    procs.push_back({pids[i], ns[i], start});
  }
  {
    std::lock_guard<std::mutex> lock(hp::JobsMutex());
    hp::JobProcesses()[job] = std::move(procs);
  }
  return hp::RemoveDeadSegments();
}

// The tags of this process's channels of job `job` (up to `cap` of them into `out`); how
// many there are. Which host kernels ran, for tests.
extern "C" int64_t EmbedmeshHostChannelTags(int64_t job, int64_t* out, int64_t cap) {
  namespace hp = embedmesh::hostpeers;
  std::lock_guard<std::mutex> lock(hp::Mutex());
  int64_t count = 0;
  for (auto& [key, ch] : hp::Channels()) {
    if (ch->job != job) continue;
    if (count < cap) out[count] = ch->tag;
    ++count;
  }
  return count;
}
