// The rendezvous of device ranks in different processes of one host, through POSIX shared
// memory: what the SharedMemory transport of the cross-device ops (transport.h) is built on;
// the segments' lifecycle calls are in host_exchange.cc. Part of embedmesh's CPU kernels.
//
// Each device rank r of a call site (`tag`, a stable hash of the call's channel name, the
// same in every process) owns a segment: a header (the rounds it published and finished, its
// capacity and this round's size, its process, on separate cache lines) and the data. Round g
// of a call site (counted per process-local handle; every process runs the same calls in the
// same order), `WithHostPeers`:
//   (a) wait until every peer has finished round g - 1 (nobody still reads my data),
//   (b) grow my segment if needed (ftruncate + fallocate + remap), write my data, publish
//       `arrived = g` (release),
//   (c) map each peer's segment (the first time: wait until it exists; again when it
//       grew), wait until its `arrived` >= g (acquire), check its size is mine, and run
//       the caller's work on every peer's data, read in place,
//   (d) publish `done = g`.
// A peer that does not arrive fails the call after the timeout (EMBEDMESH_EXCHANGE_
// TIMEOUT_S, default 60 s; -1 ms: none) naming the channel, the rank and the missing peers,
// sooner when its process, or any process of the job, exited (the job's pids are registered
// at build, EmbedmeshHostJobBegin, so a peer that died before creating its segment counts
// too); a size mismatch fails naming both sizes.
//
// How peers find a segment. Nameless (the default, when every process of the job can open
// every other's descriptors through /proc/<pid>/fd: the same pid namespace, same user): a
// segment is a memfd, never a name in /dev/shm; each process lists its segments (tag, n,
// rank, descriptor) in its directory, a memfd made before the job's key is agreed (its
// descriptor gathered at build with the pids; EmbedmeshHostJobDirectories opens every
// process's directory, and only when all processes could does the job go nameless,
// EmbedmeshHostJobNameless). A peer finds rank r's entry in the directories and opens
// /proc/<pid>/fd/<fd>. Everything vanishes with the processes: a job killed at any moment,
// even whole and inside its first exchange, leaves nothing in /dev/shm. Named (the
// fallback: processes in different pid namespaces sharing /dev/shm, /proc hidden):
// /embedmesh-<job>-<tag>-<n>-<r> (job: the job's random key, so segments of crashed jobs
// never collide); every rank maps its peers' segments before it first publishes, so once
// all its peers have arrived in the first round a writer unlinks its segment's name
// (mappings and descriptors outlive the name); at exit (EmbedmeshHostExchangeRelease, from a
// Python atexit hook) each process waits, briefly, until its peers have read its last round,
// then unlinks the names still there; a process that sees a peer's process exit unlinks the
// job's names it knows of; and a job killed whole before every rank arrived in its first
// round leaves its segments to the next job on the host: EmbedmeshHostJobBegin removes
// every segment whose writer has exited (the header names it: pid, pid namespace and start
// time, so a reused pid does not pass for it).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "common.h"

namespace embedmesh {
namespace hostpeers {

constexpr size_t kHeaderBytes = 4096;  // the data starts page-aligned
constexpr int64_t kMagic = 0x656d6265646d7368;

struct alignas(64) Counter {
  std::atomic<int64_t> v;
};

struct SegmentHeader {
  Counter arrived;   // the last round whose data this writer published
  Counter done;      // the last round this rank finished reading all its peers
  Counter capacity;  // data bytes the segment holds
  Counter size;      // data bytes of round `arrived` (stored before it)
  int64_t magic, rank, n;
  int64_t pid, pid_ns;  // the writer's process and pid namespace (0: unknown)
  int64_t start;        // the writer's start time (clock ticks after boot; 0: unknown)
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes, "header fits its page");

using Clock = std::chrono::steady_clock;

inline void CpuPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t PidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<int64_t>(st.st_ino) : 0;
}

// Process pid's state letter and start time (clock ticks after boot) from /proc; false
// when it cannot be read.
inline bool ProcStat(int64_t pid, char& state, int64_t& start) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return false;
  char buf[1024];
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[got] = 0;
  const char* p = std::strrchr(buf, ')');  // "pid (comm) S ppid ...": comm may hold ')'
  if (p == nullptr || p[1] != ' ' || p[2] == 0) return false;
  state = p[2];
  p += 4;  // field 4; the start time is field 22
  for (int field = 4; field < 22 && p != nullptr; ++field) {
    p = std::strchr(p, ' ');
    if (p != nullptr) ++p;
  }
  start = p != nullptr ? std::strtoll(p, nullptr, 10) : 0;
  return true;
}

inline int64_t OwnStart() {
  char state = 0;
  int64_t start = 0;
  return ProcStat(getpid(), state, start) ? start : 0;
}

// Whether process pid (of pid namespace ns, started at `start`; 0: unknown) is known to
// have exited: it ran in our pid namespace and its pid is gone, a zombie (a parent that has
// not reaped it yet) or another process's (started at another time: pids are reused).
inline bool ProcessExited(int64_t pid, int64_t ns, int64_t start) {
  static const int64_t own_ns = PidNamespace();
  if (pid <= 0 || own_ns == 0 || ns != own_ns) return false;
  char state = 0;
  int64_t started = 0;
  if (!ProcStat(pid, state, started)) {  // gone, unless /proc hides it (hidepid)
    return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  }
  return state == 'Z' || state == 'X' || (start != 0 && started != start);
}

// Whether the writer of header h is known to have exited.
inline bool WriterExited(const SegmentHeader* h) {
  return h != nullptr && ProcessExited(h->pid, h->pid_ns, h->start);
}

// The processes of each job, registered at build (EmbedmeshHostJobBegin, in process
// order): a waiter watches them all, so that a peer that died before its segment existed,
// or a process whose peers wait on others, is noticed too.
struct JobProcess {
  int64_t pid, ns, start;
};

inline std::mutex& JobsMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

inline std::map<int64_t, std::vector<JobProcess>>& JobProcesses() {
  static auto* table = new std::map<int64_t, std::vector<JobProcess>>;
  return *table;
}

// The index of a process of `job` that exited (its pid in *pid), or -1 (also for a job
// that registered none).
inline int64_t ExitedProcess(int64_t job, int64_t* pid) {
  std::vector<JobProcess> procs;
  {
    std::lock_guard<std::mutex> lock(JobsMutex());
    auto it = JobProcesses().find(job);
    if (it == JobProcesses().end()) return -1;
    procs = it->second;
  }
  for (size_t i = 0; i < procs.size(); ++i) {
    if (ProcessExited(procs[i].pid, procs[i].ns, procs[i].start)) {
      *pid = procs[i].pid;
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

// A process's directory of its nameless segments of one job (see the top): entries
// [0, count) are published (count stored with release after the entry), by one writer
// (ChannelOf, under Mutex()).
constexpr int64_t kDirectoryMagic = 0x656d646972656374;
constexpr int64_t kDirectorySlots = 4096;  // channels a process may open in one job

struct DirectorySlot {
  int64_t tag, n, rank, fd;
};

struct Directory {
  std::atomic<int64_t> count;
  int64_t magic;
  DirectorySlot slots[kDirectorySlots];
};

// A job's directories: its processes' (by process; own at `self`), mapped at build.
struct JobDirectories {
  bool nameless = false;  // set only when every process opened every directory
  int64_t self = -1;
  std::vector<int64_t> pids;
  std::vector<const Directory*> dirs;
};

inline std::map<int64_t, JobDirectories>& JobDirectoryTable() {
  static auto* table = new std::map<int64_t, JobDirectories>;  // under JobsMutex()
  return *table;
}

// This process's directories not yet given to a job, by descriptor.
inline std::map<int64_t, Directory*>& NewDirectories() {
  static auto* table = new std::map<int64_t, Directory*>;  // under JobsMutex()
  return *table;
}

// The directories of `job` when it is nameless (a copy: the mappings never go), else
// nullopt.
inline std::optional<JobDirectories> NamelessJob(int64_t job) {
  std::lock_guard<std::mutex> lock(JobsMutex());
  auto it = JobDirectoryTable().find(job);
  if (it == JobDirectoryTable().end() || !it->second.nameless) return std::nullopt;
  return it->second;
}

// The path through which this process opens descriptor fd of process pid.
inline std::string ProcFd(int64_t pid, int64_t fd) {
  return "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
}

// Spins, then yields for up to kYieldFor, then sleeps (20 us growing to 200 us: a peer's
// lateness costs at most that much) until ready() or the deadline; while sleeping, gives
// up early (false) when abandoned() says the awaited peer is gone. Yielding returns at
// once on a core of its own (a process a core: the wait then ends as soon as the peer
// arrives, where a sleep's wake-up cost 50-200 us a round, ~3 rounds a training step) and
// hands the core over where it is shared.
constexpr auto kYieldFor = std::chrono::microseconds(1500);

template <typename Ready, typename Abandoned>
bool WaitUntil(const Ready& ready, Clock::time_point deadline, const Abandoned& abandoned) {
  for (int i = 0; i < 4000; ++i) {
    if (ready()) return true;
    CpuPause();
  }
  int64_t sleep_us = 0;
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(100);
  const auto stop_yielding = start + kYieldFor;
  for (int k = 0;; ++k) {
    if (ready()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return ready();
    if (now >= next_check) {
      if (abandoned()) return ready();
      next_check = now + std::chrono::milliseconds(100);
    }
    if (now < stop_yielding) {
      sched_yield();
    } else {
      sleep_us = std::min<int64_t>(200, sleep_us ? sleep_us * 2 : 20);
      timespec ts{0, static_cast<long>(sleep_us * 1000)};
      nanosleep(&ts, nullptr);
    }
  }
}

template <typename Ready>
bool WaitUntil(const Ready& ready, Clock::time_point deadline) {
  return WaitUntil(ready, deadline, [] { return false; });
}

struct Mapping {
  int fd = -1;
  char* base = nullptr;
  size_t len = 0;
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base); }
  char* data() const { return base + kHeaderBytes; }
};

// Maps `len` bytes of m.fd (replacing any mapping m had). False with errno on failure.
inline bool Remap(Mapping& m, size_t len, bool writable) {
  void* p = mmap(nullptr, len, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, m.fd, 0);
  if (p == MAP_FAILED) return false;
  if (m.base != nullptr) munmap(m.base, m.len);
  m.base = static_cast<char*>(p);
  m.len = len;
  return true;
}

struct Channel {
  int64_t job = 0, tag = 0, n = 0, rank = 0;
  int64_t round = 0;  // rounds started
  std::string prefix;  // the segment names without the rank
  Mapping own;
  std::vector<Mapping> peers;  // by rank; peers[rank] unused
  std::atomic<bool> busy{false};
  bool unlinked = false;  // its name, once every peer has it mapped
  bool nameless = false;  // a memfd listed in this process's directory: never a name
  std::string Name(int64_t r) const { return prefix + std::to_string(r); }
};

inline std::mutex& Mutex() {
  static auto* mu = new std::mutex;  // never destroyed, as the table it guards
  return *mu;
}

inline std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<Channel>>& Channels() {
  static auto* table =
      new std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<Channel>>;
  return *table;  // never destroyed: XLA threads may still run at exit
}

inline std::string Hex(int64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
  return buf;
}

inline size_t GrownCapacity(size_t need, size_t have) {
  const size_t kGrain = size_t{2} << 20;
  size_t cap = std::max(need, have + have / 2);
  return (cap + kGrain - 1) / kGrain * kGrain;
}

// Sizes segment fd to `len` bytes with its pages reserved: a full /dev/shm (a container's
// is often 64 MB) is an error here (ENOSPC), not a SIGBUS at the first write. "" or why not.
inline std::string Reserve(int fd, size_t len) {
  if (ftruncate(fd, len) != 0) return std::string("ftruncate: ") + std::strerror(errno);
  const int e = posix_fallocate(fd, 0, len);
  if (e != 0 && e != EOPNOTSUPP && e != EINVAL) {  // a file system without it: sized only
    return std::string("posix_fallocate: ") + std::strerror(e) +
           " (is /dev/shm big enough? EMBEDMESH_HOST_EXCHANGE=0 exchanges through XLA's "
           "collectives instead)";
  }
  return "";
}

// This rank's channel at call site (job, tag) over n devices, creating its segment on
// first use; nullptr and `why` on failure.
inline Channel* ChannelOf(int64_t job, int64_t tag, int64_t n, int64_t rank, std::string& why) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto& slot = Channels()[{job, tag, n, rank}];
  if (slot) return slot.get();
  auto ch = std::make_unique<Channel>();
  ch->job = job;
  ch->tag = tag;
  ch->n = n;
  ch->rank = rank;
  ch->prefix = "/embedmesh-" + Hex(job) + "-" + Hex(tag) + "-" + std::to_string(n) + "-";
  ch->peers.resize(n);
  const std::string name = ch->Name(rank);
  const std::optional<JobDirectories> dirs = NamelessJob(job);
  Directory* own_dir = dirs ? const_cast<Directory*>(dirs->dirs[dirs->self]) : nullptr;
  ch->nameless = own_dir != nullptr;
  auto give_up = [&](const std::string& what) -> Channel* {
    why = what;
    if (ch->own.fd >= 0) {
      if (!ch->nameless) shm_unlink(name.c_str());
      close(ch->own.fd);
    }
    Channels().erase({job, tag, n, rank});
    return nullptr;
  };
  if (own_dir != nullptr &&
      own_dir->count.load(std::memory_order_relaxed) >= kDirectorySlots) {
    return give_up("this process has " + std::to_string(kDirectorySlots) +
                   " host-exchange channels in this job, the most its directory lists");
  }
  int fd = ch->nameless ? memfd_create(name.c_str() + 1, MFD_CLOEXEC)
                        : shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return give_up(std::string(ch->nameless ? "memfd_create(" : "shm_open(") + name +
                   ") failed: " + std::strerror(errno));
  }
  ch->own.fd = fd;
  const size_t cap = GrownCapacity(0, 0);
  std::string reserve = Reserve(fd, kHeaderBytes + cap);
  if (!reserve.empty() || !Remap(ch->own, kHeaderBytes + cap, true)) {
    return give_up("sizing " + name +
                   " failed: " + (reserve.empty() ? std::strerror(errno) : reserve));
  }
  SegmentHeader* h = ch->own.header();  // zero-filled by ftruncate: rounds 0
  h->magic = kMagic;
  h->rank = rank;
  h->n = n;
  h->pid = getpid();
  h->pid_ns = PidNamespace();
  h->start = OwnStart();
  h->capacity.v.store(cap, std::memory_order_release);
  if (own_dir != nullptr) {  // listed once its header is written: peers may open it now
    const int64_t i = own_dir->count.load(std::memory_order_relaxed);
    own_dir->slots[i] = DirectorySlot{tag, n, rank, fd};
    own_dir->count.store(i + 1, std::memory_order_release);
    ch->unlinked = true;  // no name to unlink
  }
  slot = std::move(ch);
  return slot.get();
}

// Opens (into m.fd) rank s's nameless segment of ch once a directory of the job lists it;
// false while none does (or its process's descriptor cannot be opened yet).
inline bool OpenListed(const Channel& ch, const JobDirectories& dirs, int64_t s, Mapping& m) {
  for (size_t p = 0; p < dirs.dirs.size(); ++p) {
    const Directory* d = dirs.dirs[p];
    const int64_t count = d->count.load(std::memory_order_acquire);
    for (int64_t i = 0; i < count; ++i) {
      const DirectorySlot& e = d->slots[i];
      if (e.tag != ch.tag || e.n != ch.n || e.rank != s) continue;
      m.fd = open(ProcFd(dirs.pids[p], e.fd).c_str(), O_RDONLY | O_CLOEXEC);
      return m.fd >= 0;
    }
  }
  return false;
}

// Opens and maps peer s's segment once it exists with its header (retrying until the
// deadline or until abandoned()); "" or why not (`appeared` false: it did not appear).
template <typename Abandoned>
std::string OpenPeer(Channel& ch, int64_t s, Clock::time_point deadline,
                     const Abandoned& abandoned, bool& appeared) {
  Mapping& m = ch.peers[s];
  if (m.base != nullptr) return "";
  const std::string name = ch.Name(s);
  std::optional<JobDirectories> dirs;
  if (ch.nameless) dirs = NamelessJob(ch.job);
  struct stat st {};
  appeared = WaitUntil(
      [&] {
        if (m.fd < 0) {
          if (dirs) {
            OpenListed(ch, *dirs, s, m);
          } else {
            m.fd = shm_open(name.c_str(), O_RDONLY, 0);
          }
        }
        if (m.fd < 0) return false;
        return fstat(m.fd, &st) == 0 && static_cast<size_t>(st.st_size) >= kHeaderBytes;
      },
      deadline, abandoned);
  if (!appeared) return "create its segment " + name;
  if (!Remap(m, st.st_size, false)) {
    return "mapping " + name + " failed: " + std::strerror(errno);
  }
  const SegmentHeader* h = m.header();  // a nameless one is listed after its header
  if (ch.nameless && (h->magic != kMagic || h->rank != s || h->n != ch.n)) {
    return "the segment listed for " + name + " is another file (its process exited?)";
  }
  return "";
}

// Makes peer s's mapping cover `bytes` of data (its writer grew it); "" or why not.
inline std::string CoverPeer(Channel& ch, int64_t s, size_t bytes) {
  Mapping& m = ch.peers[s];
  if (kHeaderBytes + bytes <= m.len) return "";
  struct stat st {};
  if (fstat(m.fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHeaderBytes + bytes ||
      !Remap(m, st.st_size, false)) {
    return "remapping " + ch.Name(s) + " failed: " + std::strerror(errno);
  }
  return "";
}

inline std::string Where(std::string_view channel, const Channel& ch) {
  return "embedmesh host exchange (channel '" + std::string(channel) + "', tag " + Hex(ch.tag) +
         ", rank " + std::to_string(ch.rank) + " of " + std::to_string(ch.n) + ")";
}

inline std::string Ranks(const std::vector<int64_t>& ranks) {
  std::string s;
  for (int64_t r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// The job is broken (a peer process exited): unlink every segment of the job this process
// knows of, its own and its peers' (a process that exits without running its atexit hooks
// would leave its segments behind); mappings stay valid.
inline void UnlinkJob(int64_t job) {
  std::lock_guard<std::mutex> lock(Mutex());
  for (auto& [key, ch] : Channels()) {
    if (ch->job != job || ch->nameless) continue;
    for (int64_t r = 0; r < ch->n; ++r) shm_unlink(ch->Name(r).c_str());
  }
}

// Removes the segments in /dev/shm whose writer has exited (jobs killed whole before every
// rank arrived in their first round, which unlinks the names); how many. A segment still being created (no
// header yet) or of another pid namespace stays.
inline int64_t RemoveDeadSegments() {
  DIR* dir = opendir("/dev/shm");  // where glibc's shm_open keeps them
  if (dir == nullptr) return 0;
  int64_t removed = 0;
  while (const dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, "embedmesh-", 10) != 0) continue;
    const std::string name = std::string("/") + e->d_name;
    Mapping m;
    m.fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (m.fd < 0) continue;
    struct stat st {};
    if (fstat(m.fd, &st) == 0 && static_cast<size_t>(st.st_size) >= kHeaderBytes &&
        Remap(m, kHeaderBytes, false)) {
      const SegmentHeader* h = m.header();
      if (h->magic == kMagic && WriterExited(h) && shm_unlink(name.c_str()) == 0) ++removed;
      munmap(m.base, m.len);
    }
    close(m.fd);
  }
  closedir(dir);
  return removed;
}

// Deadline of a call that waits timeout_ms (< 0: forever).
inline Clock::time_point Deadline(int64_t timeout_ms) {
  if (timeout_ms < 0) return Clock::time_point::max();
  return Clock::now() + std::chrono::milliseconds(timeout_ms);
}

// The ranks among `ranks` whose writer process exited.
inline std::vector<int64_t> Exited(const Channel& ch, const std::vector<int64_t>& ranks) {
  std::vector<int64_t> gone;
  for (int64_t s : ranks) {
    if (WriterExited(ch.peers[s].header())) gone.push_back(s);
  }
  return gone;
}


// One call of a host rendezvous: its call site and where this rank is.
struct HostCall {
  int64_t job, tag, n, rank, timeout_ms;
  std::string_view channel;
};

// One round at call site `call`: writes this rank's `bytes` of data (fill(dst)) into its
// segment, runs meanwhile() (work of its own that needs no peer: it overlaps the peers'
// lateness), waits for every peer's data, runs work(peers) (peers[s]: rank s's data, read
// in place; peers[rank]: this rank's own, in its segment), then marks the round done.
// Every rank must publish the same byte count. work returns "" or an error message.
// One function whatever the caller's (WithHostPeers below passes them as FnRefs): as a
// template over them it was compiled again for every op, rule and storage type.
[[gnu::noinline]] inline ffi::Error HostRound(
    const HostCall& call, size_t bytes, FnRef<void(char*)> fill, FnRef<void()> meanwhile,
    FnRef<std::string(const std::vector<const char*>&)> work) {
  const int64_t n = call.n, rank = call.rank;
  if (n < 1 || rank < 0 || rank >= n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "embedmesh host exchange (channel '" + std::string(call.channel) +
                          "'): rank " + std::to_string(rank) + " of " + std::to_string(n) +
                          " devices");
  }
  std::string why;
  Channel* found = ChannelOf(call.job, call.tag, n, rank, why);
  if (found == nullptr) {
    return ffi::Error(ffi::ErrorCode::kInternal, "embedmesh host exchange (channel '" +
                                                     std::string(call.channel) + "'): " + why);
  }
  Channel& ch = *found;
  if (ch.busy.exchange(true, std::memory_order_acquire)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      Where(call.channel, ch) +
                          ": two calls of one channel ran at once (every call site needs a "
                          "channel of its own)");
  }
  struct Release {
    Channel& ch;
    ~Release() { ch.busy.store(false, std::memory_order_release); }
  } release{ch};

  const int64_t g = ++ch.round;
  const auto deadline = Deadline(call.timeout_ms);
  char seconds_buf[32];
  std::snprintf(seconds_buf, sizeof(seconds_buf), "%g s", call.timeout_ms / 1000.0);
  const std::string seconds = seconds_buf;
  SegmentHeader* mine = ch.own.header();
  auto fail = [&](ffi::ErrorCode code, const std::string& what) {
    mine->done.v.store(g, std::memory_order_release);  // nobody waits on this rank for it
    return ffi::Error(code,
                      Where(call.channel, ch) + ", round " + std::to_string(g) + ": " + what);
  };
  // a waiter gives up when the job is broken: a process of the job exited
  int64_t dead_pid = 0;
  auto job_broken = [&] { return ExitedProcess(ch.job, &dead_pid) >= 0; };
  // a timeout, or peers whose process (or another of the job's) exited (then the job's
  // segments are unlinked)
  auto missing = [&](const std::vector<int64_t>& late, const std::string& what) {
    const std::vector<int64_t> gone = Exited(ch, late);
    if (!gone.empty()) {
      UnlinkJob(ch.job);
      return fail(ffi::ErrorCode::kAborted, "the process of peers " + Ranks(gone) +
                                                " exited (waiting for them to " + what + ")");
    }
    const int64_t process = ExitedProcess(ch.job, &dead_pid);
    if (process >= 0) {
      UnlinkJob(ch.job);
      return fail(ffi::ErrorCode::kAborted,
                  "process " + std::to_string(process) + " (pid " + std::to_string(dead_pid) +
                      ") of the job exited (waiting for peers " + Ranks(late) + " to " + what +
                      ")");
    }
    return fail(ffi::ErrorCode::kDeadlineExceeded,
                "peers " + Ranks(late) + " did not " + what + " within " + seconds);
  };
  auto open_peer = [&](int64_t s) -> std::optional<ffi::Error> {
    bool appeared = true;
    std::string err = OpenPeer(ch, s, deadline, job_broken, appeared);
    if (!appeared) return missing({s}, err);
    if (!err.empty()) return fail(ffi::ErrorCode::kInternal, err);
    return std::nullopt;
  };

  // (a) every peer has read my previous round
  if (g > 1) {
    std::vector<int64_t> late;
    for (int64_t s = 0; s < n; ++s) {
      if (s == rank) continue;
      if (auto e = open_peer(s)) return std::move(*e);
      const SegmentHeader* h = ch.peers[s].header();
      if (!WaitUntil([&] { return h->done.v.load(std::memory_order_acquire) >= g - 1; },
                     deadline, [&] { return WriterExited(h) || job_broken(); })) {
        late.push_back(s);
      }
    }
    if (!late.empty()) return missing(late, "finish the previous round");
  }

  // (b) publish my data
  const size_t cap = mine->capacity.v.load(std::memory_order_relaxed);
  if (bytes > cap) {
    const size_t grown = GrownCapacity(bytes, cap);
    std::string reserve = Reserve(ch.own.fd, kHeaderBytes + grown);
    if (!reserve.empty() || !Remap(ch.own, kHeaderBytes + grown, true)) {
      return fail(ffi::ErrorCode::kResourceExhausted,
                  "growing " + ch.Name(rank) + " to " + std::to_string(grown) +
                      " bytes failed: " + (reserve.empty() ? std::strerror(errno) : reserve));
    }
    mine = ch.own.header();
    mine->capacity.v.store(grown, std::memory_order_relaxed);
  }
  fill(ch.own.data());
  mine->size.v.store(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  // every peer's segment mapped before this rank first arrives: a peer seen arrived has
  // mapped this rank's segment (see the unlink below)
  for (int64_t s = 0; s < n; ++s) {
    if (s == rank) continue;
    if (auto e = open_peer(s)) return std::move(*e);
  }
  mine->arrived.v.store(g, std::memory_order_release);
  meanwhile();

  // (c) every peer's data, once all have arrived
  std::vector<int64_t> late;
  for (int64_t s = 0; s < n; ++s)
    if (s != rank) late.push_back(s);
  if (!WaitUntil(
          [&] {
            while (!late.empty() && ch.peers[late.back()].header()->arrived.v.load(
                                        std::memory_order_acquire) >= g) {
              late.pop_back();
            }
            return late.empty();
          },
          deadline, [&] { return !Exited(ch, late).empty() || job_broken(); })) {
    return missing(late, "arrive");
  }
  // (named segments) every peer has arrived, so has my segment mapped (and remaps it
  // through its descriptor when it grows): its name can go now, and a job killed from here
  // on (SIGKILL, os._exit: no atexit hooks) leaves nothing in /dev/shm
  if (!ch.unlinked) {
    shm_unlink(ch.Name(rank).c_str());
    ch.unlinked = true;
  }
  std::vector<const char*> data(n);
  for (int64_t s = 0; s < n; ++s) {
    if (s == rank) {
      data[s] = ch.own.data();
      continue;
    }
    const int64_t size = ch.peers[s].header()->size.v.load(std::memory_order_relaxed);
    if (size != static_cast<int64_t>(bytes)) {
      return fail(ffi::ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(s) + " sent " + std::to_string(size) +
                      " bytes, this rank " + std::to_string(bytes) +
                      " (the processes traced different shapes for this channel)");
    }
    std::string cover = CoverPeer(ch, s, bytes);
    if (!cover.empty()) return fail(ffi::ErrorCode::kInternal, cover);
    data[s] = ch.peers[s].data();
  }
  std::string err = work(data);
  if (!err.empty()) return fail(ffi::ErrorCode::kInvalidArgument, err);

  // (d) done reading: peers may overwrite their segments
  mine->done.v.store(g, std::memory_order_release);
  return ffi::Error::Success();
}

template <typename Fill, typename Meanwhile, typename Work>
ffi::Error WithHostPeers(const HostCall& call, size_t bytes, const Fill& fill,
                         const Meanwhile& meanwhile, const Work& work) {
  auto write = [&](char* seg) { fill(seg); };
  auto own = [&] { meanwhile(); };
  auto read = [&](const std::vector<const char*>& peers) -> std::string { return work(peers); };
  return HostRound(call, bytes, write, own, read);
}

// Offsets of consecutive arrays packed into one segment, each 64-byte aligned.
struct Packing {
  size_t bytes = 0;
  size_t Add(size_t n) {
    const size_t at = bytes;
    bytes += (n + 63) / 64 * 64;
    return at;
  }
};

}  // namespace hostpeers
}  // namespace embedmesh
