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
    if (ch->nameless) continue;  // no name; its descriptor stays listed (and open)
    if (!ch->unlinked && shm_unlink(ch->Name(ch->rank).c_str()) == 0) ++unlinked;
    ch->unlinked = true;
    close(ch->own.fd);
    ch->own.fd = -1;
  }
  return unlinked;
}

// A job starts (peers.same_host_job, at build): registers the pids of its processes (in
// process order, with their pid namespaces) for its waiters to watch, and removes the
// named segments of exited writers that jobs killed whole left in /dev/shm; returns how
// many.
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

// A new directory of this process's nameless segments (host_peers.h), for a job about to
// start: its descriptor (listed with the pids at build), or -1 when it cannot be made.
extern "C" int64_t EmbedmeshHostDirectory() {
  namespace hp = embedmesh::hostpeers;
  const int fd = memfd_create("embedmesh-directory", MFD_CLOEXEC);
  if (fd < 0) return -1;
  hp::Mapping m;
  m.fd = fd;
  if (!hp::Reserve(fd, sizeof(hp::Directory)).empty() ||
      !hp::Remap(m, sizeof(hp::Directory), true)) {
    close(fd);
    return -1;
  }
  auto* d = reinterpret_cast<hp::Directory*>(m.base);  // zero-filled: no entries
  d->magic = hp::kDirectoryMagic;
  std::lock_guard<std::mutex> lock(hp::JobsMutex());
  hp::NewDirectories()[fd] = d;
  return fd;
}

// Opens the directories of job `job`'s processes (`fds[i]`, of pid `pids[i]`; this
// process is `self`, its own made by EmbedmeshHostDirectory); 1 when every one opened (the
// job can go nameless, once every process says so: EmbedmeshHostJobNameless), else 0.
extern "C" int64_t EmbedmeshHostJobDirectories(int64_t job, int64_t self, const int64_t* pids,
                                               const int64_t* fds, int64_t count) {
  namespace hp = embedmesh::hostpeers;
  hp::JobDirectories jd;
  jd.self = self;
  bool all = self >= 0 && self < count;
  for (int64_t i = 0; i < count && all; ++i) {
    jd.pids.push_back(pids[i]);
    if (i == self) {
      std::lock_guard<std::mutex> lock(hp::JobsMutex());
      auto it = hp::NewDirectories().find(fds[i]);
      if (it == hp::NewDirectories().end()) {
        all = false;
        break;
      }
      jd.dirs.push_back(it->second);
      hp::NewDirectories().erase(it);
      continue;
    }
    hp::Mapping m;
    m.fd = fds[i] < 0 ? -1 : open(hp::ProcFd(pids[i], fds[i]).c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (m.fd < 0 || fstat(m.fd, &st) != 0 ||
        static_cast<size_t>(st.st_size) < sizeof(hp::Directory) ||
        !hp::Remap(m, sizeof(hp::Directory), false)) {
      if (m.fd >= 0) close(m.fd);
      all = false;
      break;
    }
    close(m.fd);  // the mapping stays
    const auto* d = reinterpret_cast<const hp::Directory*>(m.base);
    if (d->magic != hp::kDirectoryMagic) {
      munmap(m.base, m.len);
      all = false;
      break;
    }
    jd.dirs.push_back(d);
  }
  if (!all) return 0;
  std::lock_guard<std::mutex> lock(hp::JobsMutex());
  hp::JobDirectoryTable()[job] = std::move(jd);
  return 1;
}

// Whether job `job`'s segments are nameless (on: every process opened every directory;
// set before its first exchange, the same in every process).
extern "C" void EmbedmeshHostJobNameless(int64_t job, int64_t on) {
  namespace hp = embedmesh::hostpeers;
  std::lock_guard<std::mutex> lock(hp::JobsMutex());
  auto it = hp::JobDirectoryTable().find(job);
  if (it != hp::JobDirectoryTable().end()) it->second.nameless = on != 0;
}

// Whether job `job`'s segments are nameless (EmbedmeshHostJobNameless), for tests.
extern "C" int64_t EmbedmeshHostJobIsNameless(int64_t job) {
  return embedmesh::hostpeers::NamelessJob(job) ? 1 : 0;
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
