// embedmesh.serving._request: the serving request's rules, compiled. A request's common
// features (ragged, 2-D sparse or dense int32/int64 numpy ids, finite float32 weights or
// none, float32 or quantized numpy tables, no sequence or output_shape) are checked and
// turned into C++ kernel tasks in one call; this file is the one statement of which
// features are common and how each becomes a task (tests/support/request_rules.py
// restates them in Python as the tests' oracle, never run by the package).
//
// Why compiled: in Python those tests spent ~5 us a feature warm and 15-20 cold (the
// kernels of the request before have just streamed megabytes through the caches), on
// type, dtype and layout tests and on ~4 array addresses; on 2 threads only one thread
// sums while the caller does it. Here each feature takes ~1 us: its arrays are read
// through numpy's fields (or the buffer protocol; stable ABI, Python 3.11+), and its
// task goes to the serving library's runner (EmServingOpen / Add / Close, bound once
// through `bind`). Whatever is not a common case returns None before any buffer is
// taken, and so does any error the kernels report: the caller then runs the general path
// (embedmesh/serving/lookup.py), which raises it.

#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <pthread.h>
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <thread>
#include <vector>

namespace {

constexpr int kTaskWords = 20;  // EM_TASK_WORDS (serving/cpu/serving.h)
constexpr int64_t kGather = 2, kSparseOffsetsBag = 3, kCheckedBag = 4;

using OpenFn = void* (*)(int64_t, int64_t);
using AddFn = int64_t (*)(void*, const int64_t*);
using CloseFn = void (*)(void*, int64_t*);
using ThreadsFn = int64_t (*)(int64_t, int64_t);
OpenFn g_open = nullptr;
AddFn g_add = nullptr;
CloseFn g_close = nullptr;
ThreadsFn g_threads_for = nullptr;
// The GIL policy (docs/serving.md, "Serving from many threads"; measured with
// benchmarks/serving/serving_online.py, benchmarks/serving/RESULTS.md). Its one setting
// is g_hold_gil_below (set_hold_gil_below): a request whose kernels sum or copy fewer
// entries (ids) keeps the GIL while they run, unless requests are shared (shared_now:
// another thread is inside a host lookup, or entered one lately); then it releases it,
// as every larger request does.
// - Alone, releasing costs a small request nothing, but beside a busy Python thread
//   (one that is not serving) taking the GIL back waits up to Python's switch interval
//   (5 ms), far longer than the kernels (32k entries: ~1 ms on one core).
// - With other threads serving, the one that holds the GIL through its kernels makes
//   them wait for it until the switch interval forces it out: the requests run one
//   after the other, and the waits show as a p99 of ~5 ms. Released, the next thread
//   takes it as soon as the kernels start, and its Python runs beside them.
int64_t g_hold_gil_below = 32768;
// Threads inside a host lookup (enter / leave around serving_embedding_lookup); changed
// and read only with the GIL held, so a plain integer.
int64_t g_in_flight = 0;
// The hand-over. A thread whose kernels end while another serving thread holds the GIL
// inside a lookup would block in CPython's take_gil on a condition variable, and be woken
// (a futex wake: 10-50 us on a VM, the GIL idle meanwhile) only when that thread gives it
// up: with 2 clients at batch 1 that wake cost more than the kernels it let overlap.
// CPython's GIL is not fair either: a thread that gives it up for a few us of kernels
// takes it back before a sleeping waiter has woken. So after its kernels a shared
// request waits its turn (Turns below), then, first in line, waits without the GIL,
// yielding its core (at most kHandoffUs), while g_gil_busy says another serving thread
// holds the GIL in a lookup, claims it (g_gil_busy -> 1) and takes the GIL, which that
// thread has just dropped: no sleep, and the threads take turns. g_gil_busy is set by a
// thread that holds the GIL inside a lookup (enter, the GIL taken back after its
// kernels) and cleared once it has dropped the GIL for its kernels; 2 once it leaves the
// lookup (its own Python may then block and release the GIL in ways not seen here).
std::atomic<int> g_gil_busy{0};
constexpr int64_t kHandoffUs = 1000;

// The turns. With 3+ serving threads CPython's GIL is taken by whichever thread asks at
// the right moment: a thread asleep in CPython's take_gil is woken when the GIL is
// dropped, finds it taken again by a thread that asked meanwhile, and sleeps another
// switch interval, each time anew as long as other threads keep switching (4 clients at
// batch 1, perf sched, 2026-12-05: the slowest 1% of requests took 21 ms against a 65 us
// median; p99/p50 with 4 clients 37.7 / 7.2 / 12.0 / 2.05 at batch 1 / 8 / 64 / 256
// without the turns, 1.97 / 1.56 / 1.92 / 1.93 with them, benchmarks/serving/RESULTS.md).
// Here threads whose kernels have ended take the GIL back in the order their kernels
// ended: each takes a ticket and sleeps on a futex without the GIL until the thread
// before it has the GIL. Threads that are not serving take the GIL as usual.
//
// Tickets on a 32-bit counter: ticket t may pass once t - done < 1, a passing thread adds
// 1 to done and wakes (FUTEX_WAKE_BITSET, bit t % 32) only the thread whose turn came.
// A forked child starts them again (pthread_atfork).
int64_t now_ns();

class Turns {
 public:
  uint32_t take() { return next_.fetch_add(1); }

  // Until ticket t may pass.
  void wait(uint32_t t) {
    for (;;) {
      // signed: done_ may have passed t already (later tickets passed first)
      const uint32_t d = done_.load();
      if (static_cast<int32_t>(t - d) < 1) return;
#if defined(__linux__)
      // sleeps unless done_ has moved on from d meanwhile
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&done_), FUTEX_WAIT_BITSET_PRIVATE, d,
              nullptr, nullptr, bit(t));
#else
      std::this_thread::yield();
#endif
    }
  }

  // The thread holding the ticket that passed lets the next one in.
  void pass() {
    const uint32_t d = done_.fetch_add(1) + 1;  // seq_cst both: against take() then wait()
    if (next_.load() - d < 1) return;  // every ticket taken has passed: nobody waits
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&done_), FUTEX_WAKE_BITSET_PRIVATE, INT_MAX,
            nullptr, nullptr, bit(d));
#endif
  }

  void reset() {
    next_.store(0);
    done_.store(0);
  }

 private:
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word");
  std::atomic<uint32_t> next_{0};
  std::atomic<uint32_t> done_{0};
  static uint32_t bit(uint32_t t) { return 1u << (t % 32); }
};

Turns g_gil_turns;
// g_gil_busy 2: the serving thread that holds the GIL has left its lookup (at
// g_left_ns). A client thread whose next request follows at once (its own Python
// between two requests: a few us) drops the GIL again in that request's kernels: the
// first in line keeps waiting for that, kBetweenUs at most after the leave, as long as
// serving threads come back within kBetweenUs (g_gap_ns: a running mean of the time from
// a thread's leave to its next enter). Asking CPython instead, it sleeps in take_gil
// until the holder drops the GIL, and waking it then costs 50-250 us on a VM. A server
// whose threads block between requests (a socket, a queue) has a long gap: the first in
// line asks at once.
std::atomic<int64_t> g_left_ns{0};
std::atomic<int64_t> g_gap_ns{INT64_MAX / 2};  // nothing measured yet: no wait
constexpr int64_t kBetweenUs = 100;
thread_local int64_t t_left_ns = 0;  // this thread's last leave (0: none yet)

bool holder_back_soon() {
  const int64_t between = kBetweenUs * 1000;
  return g_gap_ns.load(std::memory_order_relaxed) < between &&
         now_ns() - g_left_ns.load(std::memory_order_relaxed) < between;
}

// First in line for the GIL: wait (yielding, at most `us`) while another serving thread
// holds it inside a lookup, and claim it as that thread drops it.
void wait_first_in_line(int64_t us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    int seen = g_gil_busy.load(std::memory_order_relaxed);
    if (seen == 2 && holder_back_soon()) seen = -1;  // wait for its next lookup to drop it
    if ((seen == 0 || seen == 2) && g_gil_busy.compare_exchange_strong(seen, 1)) return;
    if (std::chrono::steady_clock::now() >= until) return;
    std::this_thread::yield();
  }
}

void reset_after_fork() {
  g_gil_turns.reset();
  g_gil_busy.store(0);
}

// Serving threads that wait for the GIL outside a lookup (between two requests: a
// client's own Python) are not in g_in_flight, yet a request that keeps the GIL through
// its kernels makes them wait for it until Python's switch interval forces it out (5 ms):
// with 2 clients, each one's next request started late, and they ran one after the
// other. So "shared" also counts a lookup entered by another thread within the last
// kSharedWindowUs: a server whose threads take turns stays shared; one thread beside a
// busy Python thread that is not serving is never shared. Read and written with the GIL
// held.
constexpr int64_t kSharedWindowUs = 20000;
int64_t g_shared_until_ns = 0;   // steady clock, ns
const void* g_last_thread = nullptr;  // the last thread that entered a lookup
thread_local char t_token;            // its address names this thread

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Another thread is inside a lookup, or entered one lately.
bool shared_now() { return g_in_flight > 1 || now_ns() < g_shared_until_ns; }

// Counters of what ran without the GIL (stats()): requests, those that released it, ns
// between releasing and asking for it back.
int64_t g_requests = 0, g_released = 0, g_released_ns = 0;

// numpy, read directly where `bind_numpy` was given its C API (numpy's `_ARRAY_API`
// capsule: a table of function pointers whose slots numpy keeps for good) and its
// common dtypes. Reading an array's fields costs a few loads where a buffer export
// cost ~45 ns (three a feature: the table, the ids, the row splits), and an output view
// made by PyArray_NewFromDescr ~0.1 us where a slice and a reshape through the
// Python API cost ~0.35 us (a batch-1 request of 26 features: ~9 of its ~25 us held
// the GIL on those; benchmarks/serving/RESULTS.md, online).
// The head of every ndarray (numpy's PyArrayObject_fields, the same in numpy 1.x and 2.x).
struct NpArray {
  PyObject_HEAD
  char* data;
  int nd;
  Py_ssize_t* dimensions;
  Py_ssize_t* strides;
  PyObject* base;
  PyObject* descr;
  int flags;
};
constexpr int kNpCContiguous = 0x0001, kNpAligned = 0x0100, kNpWriteable = 0x0400;
using NpNewFromDescr = PyObject* (*)(PyTypeObject*, PyObject*, int, const Py_ssize_t*,
                                     const Py_ssize_t*, void*, int, PyObject*);
using NpSetBase = int (*)(PyObject*, PyObject*);
NpNewFromDescr g_np_new = nullptr;  // PyArray_NewFromDescr (slot 94)
NpSetBase g_np_set_base = nullptr;  // PyArray_SetBaseObject (slot 282)
PyTypeObject* g_ndarray = nullptr;
// np.dtype of int64, int32, float32, float16, uint8 (their one shared object) and the
// format code a buffer export gives each
constexpr int kDescrs = 5;
PyObject* g_descr[kDescrs] = {nullptr};
// The output pool's lease(nbytes) -> (owner, address): a request's one buffer, the base
// of its outputs (embedmesh/serving/pool.py), or nullptr.
PyObject* g_lease = nullptr;
// Small request buffers (at most kBlockMax bytes) come from here instead: a Block object
// (below) over 64-byte aligned memory, which its dealloc keeps for the next request of
// that size (at most g_block_cache_bytes of them, set_block_cache; the pool's limit, up
// to 1 MiB) or frees. The pool's lease through Python cost a batch-1 request ~1.1 us of
// its GIL-held time; this is a few loads. Larger buffers stay the pool's (fresh memory
// faults its pages in: ~0.45 ms a MB on this VM). Only touched with the GIL held.
constexpr int64_t kBlockMax = 64 << 10;
int64_t g_block_cache_bytes = 1 << 20;
struct FreeBlock {
  void* mem;
  int64_t nbytes;
};
std::vector<FreeBlock> g_free_blocks;  // most recently freed last
int64_t g_free_block_bytes = 0;
PyTypeObject* g_block_type = nullptr;
struct Block {
  PyObject_HEAD
  void* mem;
  int64_t nbytes;
};
void block_dealloc(PyObject* self) {
  Block* b = reinterpret_cast<Block*>(self);
  if (b->mem != nullptr) {
    if (g_free_block_bytes + b->nbytes <= g_block_cache_bytes) {
      g_free_blocks.push_back({b->mem, b->nbytes});
      g_free_block_bytes += b->nbytes;
    } else {
      std::free(b->mem);
    }
  }
  PyTypeObject* tp = Py_TYPE(self);
  reinterpret_cast<freefunc>(PyType_GetSlot(tp, Py_tp_free))(self);
  Py_DECREF(tp);
}
// The cached blocks freed down to `keep` bytes (the oldest first).
void trim_blocks(int64_t keep) {
  size_t drop = 0;
  while (drop < g_free_blocks.size() && g_free_block_bytes > keep) {
    std::free(g_free_blocks[drop].mem);
    g_free_block_bytes -= g_free_blocks[drop].nbytes;
    ++drop;
  }
  g_free_blocks.erase(g_free_blocks.begin(), g_free_blocks.begin() + static_cast<long>(drop));
}
// A Block of `nbytes` (a multiple of 64, at most kBlockMax) and its address, or nullptr
// with a Python error set.
PyObject* take_block(int64_t nbytes, int64_t* addr) {
  void* mem = nullptr;
  for (size_t k = g_free_blocks.size(); k-- > 0;) {
    if (g_free_blocks[k].nbytes == nbytes) {
      mem = g_free_blocks[k].mem;
      g_free_blocks.erase(g_free_blocks.begin() + static_cast<long>(k));
      g_free_block_bytes -= nbytes;
      break;
    }
  }
  if (mem == nullptr) mem = std::aligned_alloc(64, static_cast<size_t>(nbytes));
  if (mem == nullptr) return PyErr_NoMemory();
  PyObject* o = PyType_GenericAlloc(g_block_type, 0);
  if (o == nullptr) {
    std::free(mem);
    return nullptr;
  }
  Block* b = reinterpret_cast<Block*>(o);
  b->mem = mem;
  b->nbytes = nbytes;
  *addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(mem));
  return o;
}
PyType_Slot kBlockSlots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(block_dealloc)},
                             {Py_tp_doc, const_cast<char*>("A serving request's output buffer.")},
                             {0, nullptr}};
PyType_Spec kBlockSpec = {"embedmesh.serving._request.Block", sizeof(Block), 0,
                          Py_TPFLAGS_DEFAULT, kBlockSlots};
const char* const kDescrCode[kDescrs] = {"q", "i", "f", "e", "B"};
const Py_ssize_t kDescrSize[kDescrs] = {8, 4, 4, 2, 1};
// An array's memory as the checks read it: numpy's fields read directly (an ndarray,
// or a subclass such as np.memmap, of one of g_descr's dtypes: a reference held), else
// a buffer export (released with its holder).
struct View {
  Py_buffer b{};
  bool held = false;
  bool c_contig = false;
  PyObject* ref = nullptr;
  View() = default;
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  ~View() { reset(); }
  void reset() {
    if (held) PyBuffer_Release(&b);
    held = false;
    Py_XDECREF(ref);
    ref = nullptr;
    c_contig = false;
  }
  // false (and no Python error set) when `obj` has no buffer of this kind
  bool get(PyObject* obj) {
    if (direct(obj)) return true;
    if (PyObject_GetBuffer(obj, &b, PyBUF_RECORDS_RO) != 0) {
      PyErr_Clear();
      return false;
    }
    held = true;
    c_contig = PyBuffer_IsContiguous(&b, 'C') != 0;
    return true;
  }
  bool direct(PyObject* obj) {
    if (g_ndarray == nullptr ||
        (Py_TYPE(obj) != g_ndarray && !PyType_IsSubtype(Py_TYPE(obj), g_ndarray)))
      return false;
    const NpArray* a = reinterpret_cast<const NpArray*>(obj);
    int k = 0;
    while (k < kDescrs && a->descr != g_descr[k]) ++k;
    if (k == kDescrs || a->nd > 32) return false;  // another dtype: the buffer export's
    Py_ssize_t len = kDescrSize[k];
    for (int d = 0; d < a->nd; ++d) len *= a->dimensions[d];
    b.buf = a->data;
    b.len = len;
    b.itemsize = kDescrSize[k];
    b.readonly = (a->flags & kNpWriteable) == 0;
    b.ndim = a->nd;
    b.format = const_cast<char*>(kDescrCode[k]);
    b.shape = a->dimensions;
    b.strides = a->strides;
    b.suboffsets = nullptr;
    c_contig = (a->flags & kNpCContiguous) != 0;
    Py_INCREF(obj);
    ref = obj;
    return true;
  }
  int64_t addr() const { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.buf)); }
  // the format's one type code, native little-endian order ('=', '<', '@' or none)
  char code() const {
    const char* f = b.format == nullptr ? "B" : b.format;
    if (*f == '=' || *f == '<' || *f == '@') ++f;
    return f[0] != '\0' && f[1] == '\0' ? f[0] : '\0';
  }
  bool contiguous() const { return c_contig; }
};

// Signed integer ids (int32 or int64) in one C-contiguous buffer of an np.ndarray;
// *is64 says which.
bool ids_ok(const View& v, int* is64) {
  const char c = v.code();
  if (!v.contiguous()) return false;
  if ((c == 'l' || c == 'q') && v.b.itemsize == 8) {
    *is64 = 1;
    return true;
  }
  if ((c == 'i' || c == 'l') && v.b.itemsize == 4) {
    *is64 = 0;
    return true;
  }
  return false;
}

bool is_int64(const View& v) {
  const char c = v.code();
  return (c == 'l' || c == 'q') && v.b.itemsize == 8 && v.contiguous();
}

bool is_float32(const View& v) { return v.code() == 'f' && v.b.itemsize == 4; }

// An attribute as a new reference, or nullptr (no Python error left set).
PyObject* attr(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj, name);
  if (r == nullptr) PyErr_Clear();
  return r;
}

struct Owned {
  PyObject* p;
  explicit Owned(PyObject* q = nullptr) : p(q) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { Py_XDECREF(p); }
  void reset() {
    Py_XDECREF(p);
    p = nullptr;
  }
};

// One feature's prepared task: its arrays' views, its output's shape, its words.
struct Feature {
  View table, ids, splits, indices, weights, qvalues;
  Owned values, row_splits, idx, wvalues, qdata, qcodes;  // the objects the views read
  int64_t kind = 0, rows = 0, entries = 0;
  int64_t format[2] = {0, 0};  // a quantized table's row format (EmServingBagQ), else 0
  int64_t out_shape[8] = {0};
  int out_ndim = 0;
  int64_t words[kTaskWords] = {0};
  // as constructed, its references released (for the next request: FeatureSlab)
  void reset() {
    for (View* v : {&table, &ids, &splits, &indices, &weights, &qvalues}) v->reset();
    for (Owned* o : {&values, &row_splits, &idx, &wvalues, &qdata, &qcodes}) o->reset();
    kind = rows = entries = 0;
    format[0] = format[1] = 0;
    out_ndim = 0;
    std::memset(words, 0, sizeof(words));
  }
};

// A request's features: this thread's array, reused request after request (~900 bytes
// a feature: allocating and clearing them anew cost a batch-1 request of 26 features
// ~0.5 us), or a fresh one where a request runs inside another on the same thread (a
// finish callback's). Their references are released as the request ends.
struct ThreadFeatures {
  std::unique_ptr<Feature[]> p;
  Py_ssize_t cap = 0;
  bool busy = false;
};
thread_local ThreadFeatures t_features;

class FeatureSlab {
 public:
  explicit FeatureSlab(Py_ssize_t n) : n_(n > 0 ? n : 1) {
    ThreadFeatures& t = t_features;
    if (!t.busy) {
      if (t.cap < n_) {
        t.p.reset(new Feature[static_cast<size_t>(n_)]);
        t.cap = n_;
      }
      t.busy = true;
      local_ = true;
      f_ = t.p.get();
    } else {
      heap_.reset(new Feature[static_cast<size_t>(n_)]);
      f_ = heap_.get();
    }
  }
  FeatureSlab(const FeatureSlab&) = delete;
  FeatureSlab& operator=(const FeatureSlab&) = delete;
  ~FeatureSlab() {
    if (!local_) return;
    for (Py_ssize_t i = 0; i < n_; ++i) f_[i].reset();  // may run Python (a dealloc)
    t_features.busy = false;
  }
  Feature& operator[](Py_ssize_t i) { return f_[i]; }

 private:
  Py_ssize_t n_;
  bool local_ = false;
  Feature* f_ = nullptr;
  std::unique_ptr<Feature[]> heap_;
};

// New references, released with their holder (the request's outputs).
struct Refs {
  std::vector<PyObject*> v;
  explicit Refs(Py_ssize_t n) : v(static_cast<size_t>(n > 0 ? n : 0), nullptr) {}
  Refs(const Refs&) = delete;
  Refs& operator=(const Refs&) = delete;
  ~Refs() {
    for (PyObject* p : v) Py_XDECREF(p);
  }
};

// A new list of the first n of `items`, each a new reference (nullptr: None).
PyObject* list_of(PyObject* const* items, Py_ssize_t n) {
  PyObject* list = PyList_New(n);
  if (list == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = items[i] != nullptr ? items[i] : Py_None;
    Py_INCREF(x);
    PyList_SetItem(list, i, x);
  }
  return list;
}

PyObject* s_values = nullptr;  // interned attribute names
PyObject* s_row_splits = nullptr;
PyObject* s_indices = nullptr;
PyObject* s_dense_shape = nullptr;
PyObject* s_reshape = nullptr;

// A feature's output elements.
int64_t out_size(const Feature& f) {
  int64_t size = 1;
  for (int d = 0; d < f.out_ndim; ++d) size *= f.out_shape[d];
  return size;
}

// Weights: finite float32 of the ids' shape in one C-contiguous buffer of an np.ndarray.
bool weights_ok(PyObject* ndarray, Feature& f, PyObject* weight) {
  f.wvalues.p = attr(weight, s_values);
  if (f.wvalues.p == nullptr || Py_TYPE(f.wvalues.p) != reinterpret_cast<PyTypeObject*>(ndarray))
    return false;
  if (!f.weights.get(f.wvalues.p) || !is_float32(f.weights) || !f.weights.contiguous() ||
      f.weights.b.ndim != f.ids.b.ndim)
    return false;
  for (int d = 0; d < f.ids.b.ndim; ++d) {
    if (f.weights.b.shape[d] != f.ids.b.shape[d]) return false;
  }
  const uint32_t* w = static_cast<const uint32_t*>(f.weights.b.buf);
  const Py_ssize_t n = f.weights.b.len / 4;
  uint32_t bad = 0;  // a NaN or Inf: all exponent bits set
  for (Py_ssize_t k = 0; k < n; ++k) bad |= (w[k] & 0x7f800000u) == 0x7f800000u;
  return bad == 0;
}

// The two ints of a length-2 sequence (a dense shape), or false.
bool shape2(PyObject* seq, int64_t* a, int64_t* b) {
  if (seq == nullptr || !PySequence_Check(seq) || PySequence_Size(seq) != 2) {
    PyErr_Clear();
    return false;
  }
  int64_t out[2];
  for (int i = 0; i < 2; ++i) {
    Owned item(PySequence_GetItem(seq, i));
    Owned num(item.p == nullptr ? nullptr : PyNumber_Index(item.p));
    out[i] = num.p == nullptr ? -1 : PyLong_AsLongLong(num.p);
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  *a = out[0];
  *b = out[1];
  return true;
}

void table_words(const Feature& f, int64_t* w, int64_t dim) {
  w[1] = f.table.addr();
  w[2] = f.table.b.shape[0];
  w[3] = dim;
  if (f.format[0] != 0) {  // EmServingBagQ: the stride in bytes, the format in word 19
    w[4] = f.table.b.strides[0];
    w[19] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(f.format));
  } else {
    w[4] = f.table.b.strides[0] / 4;
  }
}

PyObject* s_kind = nullptr;  // QuantizedTable's attributes
PyObject* s_data = nullptr;
PyObject* s_dim = nullptr;

// A QuantizedTable (embedmesh/serving/quantized.py) whose rows the bag kernels decode
// (EmServingBagQ): its `data` a numpy array [vocab, row] of contiguous rows of its
// kind's bytes (int8: dim + 8 bytes, fp16: dim float16 values, codes: dim bytes and
// float32 `values`), its `dim` the feature's. Sets f.table (the rows) and f.format;
// false: the general path's (which converts, or names what is wrong; bf16 too: numpy's
// buffer protocol does not carry ml_dtypes' bfloat16).
bool quantized_ok(PyObject* ndarray, PyObject* table, int64_t vocab, int64_t dim, Feature& f) {
  Owned kind(attr(table, s_kind)), qdim(attr(table, s_dim));
  f.qdata.p = attr(table, s_data);
  if (kind.p == nullptr || qdim.p == nullptr || f.qdata.p == nullptr ||
      Py_TYPE(f.qdata.p) != reinterpret_cast<PyTypeObject*>(ndarray) ||
      !PyUnicode_Check(kind.p) || !PyLong_Check(qdim.p))
    return false;
  if (PyLong_AsLongLong(qdim.p) != dim || PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  int64_t code = 0, itemsize = 1, row = dim;
  if (PyUnicode_CompareWithASCIIString(kind.p, "int8") == 0) {
    code = 3;
    row = dim + 8;
  } else if (PyUnicode_CompareWithASCIIString(kind.p, "fp16") == 0) {
    code = 1;
    itemsize = 2;
  } else if (PyUnicode_CompareWithASCIIString(kind.p, "codes") == 0) {
    code = 4;
  } else {
    return false;
  }
  View& t = f.table;
  if (!t.get(f.qdata.p) || t.b.ndim != 2 || t.b.itemsize != itemsize || t.b.shape[0] != vocab ||
      t.b.shape[1] != row || t.b.strides[1] != itemsize || t.b.strides[0] < row * itemsize)
    return false;
  if (code == 1 && t.code() != 'e') return false;
  if ((code == 3 || code == 4) && t.code() != 'B') return false;
  f.format[0] = code;
  if (code == 4) {
    f.qcodes.p = attr(table, s_values);
    if (f.qcodes.p == nullptr || Py_TYPE(f.qcodes.p) != reinterpret_cast<PyTypeObject*>(ndarray) ||
        !f.qvalues.get(f.qcodes.p) || !is_float32(f.qvalues) || f.qvalues.b.ndim != 1 ||
        !f.qvalues.contiguous() || f.qvalues.b.shape[0] < 1)
      return false;
    f.format[1] = f.qvalues.addr();
  }
  return true;
}

// A feature's plan (eligible, vocab, dim, combiner code, safe, table key, prune
// weights) read into C once for the plans tuple served last (Plans below).
struct Plan {
  bool eligible = false, safe = false, prune_weights = false;
  int64_t vocab = 0, dim = 0, combiner = 0;
  PyObject* key = nullptr;  // borrowed: the plans tuple is held while the plan is
};

// The plans read into C and the request types (np.ndarray, RaggedTensor, SparseTensor[,
// QuantizedTable]), kept for the `plans` and `types` tuples read last (references held,
// so their addresses name them): a loaded model's requests read each feature's plan
// from its tuple once, not ~14 Python API calls a feature a request. Tuples cannot
// change; a model planned anew brings new tuples. Only touched with the GIL held.
struct Plans {
  PyObject* plans = nullptr;
  PyObject* types = nullptr;
  PyObject *ndarray = nullptr, *ragged = nullptr, *sparse = nullptr, *quantized = nullptr;
  std::vector<Plan> v;
};
Plans g_plans;
// g_plans in use by a request on some thread (its checks may run Python, and so another
// request): a request that finds it so reads its own.
bool g_plans_busy = false;

// `plans` and `types` read into `into` (their references taken); false with a Python
// error set where an entry is not what _plans makes.
bool read_plans(PyObject* plans, PyObject* types, Plans& into) {
  const Py_ssize_t n = PyTuple_Size(plans);
  std::vector<Plan> v(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* plan = PyTuple_GetItem(plans, i);
    if (plan == nullptr || !PyTuple_Check(plan) || PyTuple_Size(plan) < 7) {
      PyErr_SetString(PyExc_TypeError, "lookup: a plan is not a 7-tuple");
      return false;
    }
    Plan& p = v[static_cast<size_t>(i)];
    const int eligible = PyObject_IsTrue(PyTuple_GetItem(plan, 0));
    p.vocab = PyLong_AsLongLong(PyTuple_GetItem(plan, 1));
    p.dim = PyLong_AsLongLong(PyTuple_GetItem(plan, 2));
    p.combiner = PyLong_AsLongLong(PyTuple_GetItem(plan, 3));
    const int safe = PyObject_IsTrue(PyTuple_GetItem(plan, 4));
    const int prune = PyObject_IsTrue(PyTuple_GetItem(plan, 6));
    if (PyErr_Occurred()) return false;
    p.eligible = eligible == 1;
    p.safe = safe == 1;
    p.prune_weights = prune == 1;
    p.key = PyTuple_GetItem(plan, 5);
  }
  PyObject* old_plans = into.plans;  // released last: a dealloc may run Python
  PyObject* old_types = into.types;
  Py_INCREF(plans);
  Py_INCREF(types);
  into.plans = plans;
  into.types = types;
  into.ndarray = PyTuple_GetItem(types, 0);
  into.ragged = PyTuple_GetItem(types, 1);
  into.sparse = PyTuple_GetItem(types, 2);
  into.quantized = PyTuple_Size(types) > 3 ? PyTuple_GetItem(types, 3) : nullptr;
  into.v.swap(v);
  Py_XDECREF(old_plans);
  Py_XDECREF(old_types);
  return true;
}

// A request's plans: g_plans (read anew where `plans` or `types` are not the ones kept),
// marked in use until done(); its own where that is in use (a request that
// runs inside another's checks, on this thread or on another while Python runs there).
class RequestPlans {
 public:
  RequestPlans() = default;
  RequestPlans(const RequestPlans&) = delete;
  RequestPlans& operator=(const RequestPlans&) = delete;
  ~RequestPlans() {
    done();
    Py_XDECREF(fresh_.plans);
    Py_XDECREF(fresh_.types);
  }
  // false with a Python error set (a malformed plan)
  bool read(PyObject* plans, PyObject* types) {
    const bool cached = !g_plans_busy;
    p_ = cached ? &g_plans : &fresh_;
    if (!cached || g_plans.plans != plans || g_plans.types != types) {
      if (!read_plans(plans, types, *p_)) return false;
    }
    busy_ = cached;
    if (busy_) g_plans_busy = true;
    return true;
  }
  const Plans& get() const { return *p_; }
  void done() {
    if (busy_) g_plans_busy = false;
    busy_ = false;
  }

 private:
  Plans fresh_;
  Plans* p_ = nullptr;
  bool busy_ = false;
};

// A ragged feature's task (the runner checks row_splits as it is added); false: not a
// common case.
bool prepare_ragged(const Plan& plan, PyObject* ndarray, PyObject* inp, PyObject* weight,
                    Feature& f) {
  int is64 = 0;
  f.values.p = attr(inp, s_values);
  f.row_splits.p = attr(inp, s_row_splits);
  if (f.values.p == nullptr || f.row_splits.p == nullptr ||
      Py_TYPE(f.values.p) != reinterpret_cast<PyTypeObject*>(ndarray) ||
      Py_TYPE(f.row_splits.p) != reinterpret_cast<PyTypeObject*>(ndarray) ||
      !f.ids.get(f.values.p) || !ids_ok(f.ids, &is64) || f.ids.b.ndim != 1 ||
      !f.splits.get(f.row_splits.p) || !is_int64(f.splits) || f.splits.b.ndim != 1 ||
      f.splits.b.shape[0] < 2)
    return false;
  if (weight != Py_None) {
    Owned wsplits(attr(weight, s_row_splits));
    if (wsplits.p == nullptr) return false;
    if (wsplits.p != f.row_splits.p) {  // equal values, else the general path names it
      View ws;
      if (!ws.get(wsplits.p) || !is_int64(ws) || ws.b.ndim != 1 || ws.b.len != f.splits.b.len ||
          std::memcmp(ws.b.buf, f.splits.b.buf, ws.b.len) != 0)
        return false;
    }
    if (!weights_ok(ndarray, f, weight)) return false;
  }
  const int64_t dim = plan.dim;
  int64_t* w = f.words;
  f.kind = kCheckedBag;
  f.rows = f.splits.b.shape[0] - 1;
  f.entries = f.ids.b.shape[0];
  f.out_ndim = 2;
  f.out_shape[0] = f.rows;
  f.out_shape[1] = dim;
  w[0] = kCheckedBag;
  table_words(f, w, dim);
  w[5] = f.ids.addr();
  w[6] = is64;
  w[7] = f.splits.addr();
  w[8] = f.rows;
  w[9] = weight != Py_None ? f.weights.addr() : 0;
  w[10] = plan.combiner;
  w[14] = dim;
  w[15] = f.entries;  // checked against row_splits[-1] by the runner
  return true;
}

// A 2-D sparse feature's task (its bag offsets derived and its indices checked in the
// runner's first phase); false: not a common case.
bool prepare_sparse(const Plan& plan, PyObject* ndarray, PyObject* inp, PyObject* weight,
                    Feature& f) {
  int is64 = 0;
  int64_t rows = 0, cols = 0;
  Owned shape(attr(inp, s_dense_shape));
  if (!shape2(shape.p, &rows, &cols)) return false;
  f.values.p = attr(inp, s_values);
  f.idx.p = attr(inp, s_indices);
  if (f.values.p == nullptr || f.idx.p == nullptr ||
      Py_TYPE(f.values.p) != reinterpret_cast<PyTypeObject*>(ndarray) ||
      Py_TYPE(f.idx.p) != reinterpret_cast<PyTypeObject*>(ndarray) || !f.ids.get(f.values.p) ||
      !ids_ok(f.ids, &is64) || f.ids.b.ndim != 1 || !f.indices.get(f.idx.p))
    return false;
  int idx64 = 0;
  if (!ids_ok(f.indices, &idx64) || f.indices.b.ndim != 2 ||
      f.indices.b.shape[0] != f.ids.b.shape[0] || f.indices.b.shape[1] != 2)
    return false;
  if (rows <= 0 || cols <= 0) return false;
  if (weight != Py_None) {
    Owned wshape(attr(weight, s_dense_shape));
    int64_t wr = 0, wc = 0;
    if (!shape2(wshape.p, &wr, &wc) || wr != rows || wc != cols) return false;
    if (!weights_ok(ndarray, f, weight)) return false;
  }
  // TensorFlow's safe lookup (validate_weights_and_indices): ids < 0 dropped, and with
  // a combiner other than sum weights not > 0 (plan[6])
  const int64_t prune_w = plan.prune_weights && weight != Py_None;
  const int64_t dim = plan.dim;
  int64_t* w = f.words;
  f.kind = kSparseOffsetsBag;
  f.rows = rows;
  f.entries = f.ids.b.shape[0];
  f.out_ndim = 2;
  f.out_shape[0] = rows;
  f.out_shape[1] = dim;
  w[0] = kSparseOffsetsBag;
  table_words(f, w, dim);
  w[5] = f.ids.addr();
  w[6] = is64;
  // w[7]: the offsets, written by the request's first phase (set when added)
  w[8] = rows;
  w[9] = weight != Py_None ? f.weights.addr() : 0;
  w[10] = plan.combiner;
  w[11] = plan.safe;
  w[12] = prune_w;
  w[14] = dim;
  w[15] = f.indices.addr();
  w[16] = idx64;
  w[17] = f.entries;
  w[18] = cols;
  return true;
}

// A dense feature's gather task (1-7 dims of ids, a float32 table); false: not a common
// case.
bool prepare_dense(const Plan& plan, PyObject* inp, Feature& f) {
  int is64 = 0;
  if (!f.ids.get(inp) || !ids_ok(f.ids, &is64) || f.ids.b.ndim < 1 || f.ids.b.ndim > 7)
    return false;
  const int64_t dim = plan.dim;
  int64_t* w = f.words;
  f.kind = kGather;
  f.entries = f.ids.b.len / f.ids.b.itemsize;
  f.out_ndim = f.ids.b.ndim + 1;
  for (int d = 0; d < f.ids.b.ndim; ++d) f.out_shape[d] = f.ids.b.shape[d];
  f.out_shape[f.ids.b.ndim] = dim;
  w[0] = kGather;
  w[1] = f.table.addr();
  w[2] = f.table.b.shape[0];
  w[3] = dim * 4;
  w[4] = f.table.b.strides[0];
  w[5] = f.ids.addr();
  w[6] = is64;
  w[7] = f.entries;
  return true;
}

// Check one feature (its plan, the request types) and fill its words but the output's
// address; false: not a common case.
bool prepare(const Plan& plan, PyObject* inp, PyObject* weight, PyObject* table,
             const Plans& types, Feature& f) {
  PyObject* ndarray = types.ndarray;
  if (!plan.eligible) return false;  // sequence, output_shape
  const int64_t vocab = plan.vocab;
  const int64_t dim = plan.dim;
  PyObject* kind = reinterpret_cast<PyObject*>(Py_TYPE(inp));
  if (weight != Py_None && (reinterpret_cast<PyObject*>(Py_TYPE(weight)) != kind || kind == ndarray))
    return false;
  if (table == nullptr || dim <= 0) return false;
  PyObject* quantized = types.quantized;
  if (quantized != nullptr && Py_TYPE(table) == reinterpret_cast<PyTypeObject*>(quantized)) {
    // decoded by the bag kernels: ragged and sparse input (a dense lookup is a gather of
    // float rows: the general path's)
    if (kind == ndarray) return false;
    if (!quantized_ok(ndarray, table, vocab, dim, f)) return false;
  } else if (!f.table.get(table) || !is_float32(f.table) || f.table.b.ndim != 2 ||
             f.table.b.shape[0] != vocab || f.table.b.shape[1] != dim ||
             f.table.b.strides[1] != 4 || f.table.b.strides[0] < 0 ||
             f.table.b.strides[0] % 4) {
    return false;
  }
  if (kind == types.ragged) return prepare_ragged(plan, ndarray, inp, weight, f);
  if (kind == types.sparse) return prepare_sparse(plan, ndarray, inp, weight, f);
  if (kind == ndarray) return prepare_dense(plan, inp, f);
  return false;
}

// A feature's task words given its output's address (and a sparse feature its offsets).
void set_out(Feature* f, int64_t out_addr, std::vector<std::unique_ptr<int64_t[]>>& offsets) {
  int64_t* w = f->words;
  if (f->kind == kGather) {
    w[8] = out_addr;
  } else {
    w[13] = out_addr;
  }
  if (f->kind == kSparseOffsetsBag) {
    offsets.emplace_back(new int64_t[static_cast<size_t>(f->rows + 1)]);
    w[7] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(offsets.back().get()));
  }
}


// Every feature checked (its plan, the request types) and its task's words filled but
// the output's address, before anything is taken: 1, or 0 (a feature that is not a
// common case: the general path's), or -1 (a Python error set). Sums the request's
// entries and tasks.
int check_features(const Plans& planned, PyObject* const* inputs, PyObject* const* weights,
                   Py_ssize_t n, PyObject* tables, FeatureSlab& all, int64_t* entries,
                   int64_t* tasks) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* inp = inputs[i];
    if (inp == Py_None) continue;
    const Plan& plan = planned.v[static_cast<size_t>(i)];
    PyObject* table = PyDict_GetItemWithError(tables, plan.key);
    if (table == nullptr && PyErr_Occurred()) return -1;
    Feature& f = all[i];
    if (!prepare(plan, inp, weights == nullptr ? Py_None : weights[i], table, planned, f))
      return PyErr_Occurred() ? -1 : 0;
    *entries += f.entries;
    ++*tasks;
  }
  return 1;
}

// The request's one output buffer (more than one task): each feature's output a view of
// it, 64-byte aligned (jax wraps it without a copy); taking one buffer from the pool a
// feature cost ~4 us of Python each (a batch-1 request of 26 features: most of it). With
// numpy's C API bound (`direct`), the pool's lease of the bytes (a small one: a Block of
// this module's cache), each output a view made here; else the pool's float32 array,
// each output a slice of it. Sets `block` (a new reference) and its address, and each
// feature's start in floats; false with a Python error set.
bool take_block_for(FeatureSlab& all, Py_ssize_t n, bool direct, PyObject* alloc,
                    std::vector<int64_t>& starts, Owned& block, int64_t* block_addr) {
  int64_t total = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const Feature& f = all[i];
    if (f.kind == 0) continue;
    starts[static_cast<size_t>(i)] = total;
    total += (out_size(f) + 15) / 16 * 16;  // floats: 64-byte steps
  }
  const long long floats = total > 0 ? total : 16;
  if (direct && g_lease != nullptr && g_block_type != nullptr && 4 * floats <= kBlockMax) {
    block.p = take_block(4 * floats, block_addr);
    return block.p != nullptr;
  }
  Owned got(direct && g_lease != nullptr ? PyObject_CallFunction(g_lease, "L", 4 * floats)
                                         : PyObject_CallFunction(alloc, "((L))", floats));
  if (got.p == nullptr) return false;
  PyObject* b = PyTuple_GetItem(got.p, 0);
  *block_addr = PyLong_AsLongLong(PyTuple_GetItem(got.p, 1));
  if (b == nullptr || PyErr_Occurred()) return false;
  Py_INCREF(b);
  block.p = b;
  return true;
}

// Feature f's output (a new reference) and its address: a view of the request's buffer
// `block` from float `start` on (made by numpy's C API where `direct`, else a slice and
// a reshape), or, without a block, its own buffer from `alloc`. nullptr: a Python error.
PyObject* output_of(const Feature& f, PyObject* block, int64_t block_addr, int64_t start,
                    bool direct, PyObject* alloc, int64_t* out_addr) {
  if (block != nullptr && direct) {
    *out_addr = block_addr + 4 * start;
    Py_ssize_t dims[8];
    for (int d = 0; d < f.out_ndim; ++d) dims[d] = static_cast<Py_ssize_t>(f.out_shape[d]);
    Py_INCREF(g_descr[2]);  // float32; stolen by the call
    PyObject* out = g_np_new(g_ndarray, g_descr[2], f.out_ndim, dims, nullptr,
                             reinterpret_cast<void*>(static_cast<uintptr_t>(*out_addr)),
                             kNpCContiguous | kNpAligned | kNpWriteable, nullptr);
    if (out == nullptr) return nullptr;
    Py_INCREF(block);  // stolen: the view keeps the request's buffer
    if (g_np_set_base(out, block) != 0) {
      Py_DECREF(out);
      return nullptr;
    }
    return out;
  }
  Owned shape(PyTuple_New(f.out_ndim));
  if (shape.p == nullptr) return nullptr;
  for (int d = 0; d < f.out_ndim; ++d) {
    PyObject* v = PyLong_FromLongLong(f.out_shape[d]);
    if (v == nullptr) return nullptr;
    PyTuple_SetItem(shape.p, d, v);
  }
  if (block != nullptr) {  // a view of the request's one buffer
    Owned lo(PyLong_FromLongLong(start)), hi(PyLong_FromLongLong(start + out_size(f)));
    if (lo.p == nullptr || hi.p == nullptr) return nullptr;
    Owned range(PySlice_New(lo.p, hi.p, nullptr));
    if (range.p == nullptr) return nullptr;
    Owned flat(PyObject_GetItem(block, range.p));
    if (flat.p == nullptr) return nullptr;
    *out_addr = block_addr + 4 * start;
    return PyObject_CallMethodObjArgs(flat.p, s_reshape, shape.p, nullptr);
  }
  Owned got(PyObject_CallFunctionObjArgs(alloc, shape.p, nullptr));
  if (got.p == nullptr) return nullptr;
  PyObject* out = PyTuple_GetItem(got.p, 0);
  *out_addr = PyLong_AsLongLong(PyTuple_GetItem(got.p, 1));
  if (out == nullptr || PyErr_Occurred()) return nullptr;
  Py_INCREF(out);
  return out;
}

// Every feature's output into `outs` (new references, None where no input) and its
// address into its task's words (a sparse feature's bag offsets into `offsets`); false
// with a Python error set.
bool take_outputs(FeatureSlab& all, Py_ssize_t n, int64_t tasks, PyObject* alloc,
                  PyObject** outs, std::vector<std::unique_ptr<int64_t[]>>& offsets) {
  std::vector<int64_t> starts(static_cast<size_t>(n), 0);
  const bool direct = g_np_new != nullptr;
  Owned block;
  int64_t block_addr = 0;
  if (tasks > 1 && !take_block_for(all, n, direct, alloc, starts, block, &block_addr))
    return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Feature& f = all[i];
    if (f.kind == 0) {
      Py_INCREF(Py_None);
      outs[i] = Py_None;
      continue;
    }
    int64_t out_addr = 0;
    outs[i] = output_of(f, block.p, block_addr, starts[static_cast<size_t>(i)], direct, alloc,
                        &out_addr);
    if (outs[i] == nullptr) return false;
    set_out(&f, out_addr, offsets);
  }
  return true;
}

// The runner runs the checked features' tasks (its checks of ragged row_splits as each
// task is added, its thread pool, the sums) on `threads` threads; each task's code into
// `results`, how many were added into *added; false: an unknown task kind. No Python
// object is touched: the caller may have released the GIL.
bool run_features(FeatureSlab& all, Py_ssize_t n, int64_t tasks, int64_t threads,
                  std::vector<int64_t>& results, int64_t* added) {
  bool known = true;
  void* handle = g_open(tasks, threads);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const Feature& f = all[i];
    if (f.kind == 0) continue;
    if (g_add(handle, f.words) != -1) {
      known = false;
      break;
    }
    ++*added;
  }
  g_close(handle, results.data());  // runs the tasks added, whatever happened
  return known;
}

// run_features with the GIL kept or released by the GIL policy (above): a small request
// alone keeps it; any other releases it, and a shared one takes it back in its turn.
bool run_with_gil_policy(FeatureSlab& all, Py_ssize_t n, int64_t tasks, int64_t entries,
                         int64_t threads, std::vector<int64_t>& results, int64_t* added) {
  const bool shared = shared_now();
  ++g_requests;
  if (entries < g_hold_gil_below && !shared) return run_features(all, n, tasks, threads, results, added);
  PyThreadState* state = PyEval_SaveThread();  // other Python threads go on
  g_gil_busy.store(0);
  const int64_t t0 = now_ns();
  const bool known = run_features(all, n, tasks, threads, results, added);
  const int64_t ns = now_ns() - t0;
  if (shared) {  // in the order the kernels ended, then first in line
    g_gil_turns.wait(g_gil_turns.take());
    wait_first_in_line(kHandoffUs);
  }
  PyEval_RestoreThread(state);
  g_gil_busy.store(1);  // held inside the lookup until it drops or leaves
  if (shared) g_gil_turns.pass();  // the next in line may wait for it now
  ++g_released;
  g_released_ns += ns;
  return known;
}

// Packs a request's outputs (`outs`, n of them) as the caller returns them: a list, or a
// dict under the inputs' keys (lookup_dict_of). nullptr: a Python error.
using Pack = std::function<PyObject*(PyObject** outs)>;

PyObject* lookup_core(PyObject* plans, PyObject* const* inputs, PyObject* const* weights,
                      Py_ssize_t n, PyObject* tables, PyObject* types, PyObject* alloc,
                      PyObject* finish, long long threads, const Pack& pack) {
  if (g_open == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "embedmesh.serving._request: bind() was not called");
    return nullptr;
  }
  if (PyTuple_Size(plans) != n || PyTuple_Size(types) < 3 || PyTuple_Size(types) > 4) {
    PyErr_SetString(PyExc_ValueError, "lookup: plans, inputs and weights differ in length");
    return nullptr;
  }
  FeatureSlab all(n);  // kind 0: no input
  int64_t entries = 0, tasks = 0;
  {
    RequestPlans planned;  // until every feature is checked (not read after)
    if (!planned.read(plans, types)) return nullptr;
    const int ok = check_features(planned.get(), inputs, weights, n, tables, all, &entries, &tasks);
    if (ok <= 0) {
      if (ok < 0) return nullptr;
      Py_RETURN_NONE;  // not a common case: the general path's
    }
  }
  Refs outs(n);  // the outputs, held while the request runs
  std::vector<std::unique_ptr<int64_t[]>> offsets;  // sparse features' bag offsets
  if (!take_outputs(all, n, tasks, alloc, outs.v.data(), offsets)) return nullptr;
  Owned packed(pack(outs.v.data()));
  if (packed.p == nullptr) return nullptr;
  // the result while the kernels have not run (see lookup._finish_common); no finish: the
  // packed outputs themselves
  Owned result;
  if (finish != Py_None) {
    result.p = PyObject_CallFunctionObjArgs(finish, packed.p, Py_True, nullptr);
    if (result.p == nullptr) return nullptr;
  }
  const int64_t t = threads < 1 ? 1 : threads;
  const int64_t run_threads = t > 1 ? g_threads_for(entries, t) : 1;
  std::vector<int64_t> results(static_cast<size_t>(tasks > 0 ? tasks : 1), -1);
  int64_t added = 0;
  if (!run_with_gil_policy(all, n, tasks, entries, run_threads, results, &added)) {
    PyErr_SetString(PyExc_RuntimeError, "EmServingAdd: an unknown task kind");
    return nullptr;
  }
  for (int64_t k = 0; k < added; ++k) {
    if (results[static_cast<size_t>(k)] != -1) Py_RETURN_NONE;  // the general path names it
  }
  if (finish == Py_None) {
    PyObject* r = packed.p;
    packed.p = nullptr;
    return r;
  }
  if (result.p != Py_None) {
    PyObject* r = result.p;
    result.p = nullptr;
    return r;
  }
  return PyObject_CallFunctionObjArgs(finish, packed.p, Py_False, nullptr);
}

// A method calling `body(args)`: no C++ exception may cross into the interpreter.
template <PyObject* (*body)(PyObject*)>
PyObject* guarded(PyObject*, PyObject* args) {
  try {
    return body(args);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}


// lookup(plans, inputs, weights, tables, types, alloc, finish, threads)
//   plans: per feature (eligible, vocab, dim, combiner code, safe, table key, prune
//   weights: safe and a combiner other than sum);
//   inputs / weights: per feature (None: no input / no weights); tables: the user's
//   dict; types: (np.ndarray, RaggedTensor, SparseTensor[, QuantizedTable]: ragged and
//   sparse features on its tables are decoded by EmServingBagQ); alloc(shape) -> (array,
//   address) of a float32 output; finish(outs, before_run) -> result or None.
// Returns the result, or None (not a common request, or a kernel reported an error).
PyObject* lookup_checked(PyObject* args) {
  PyObject *plans, *inputs, *weights, *tables, *types, *alloc, *finish;
  long long threads;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!OOL", &PyTuple_Type, &plans, &PyList_Type, &inputs,
                        &PyList_Type, &weights, &PyDict_Type, &tables, &PyTuple_Type, &types,
                        &alloc, &finish, &threads))
    return nullptr;
  const Py_ssize_t n = PyTuple_Size(plans);
  if (PyList_Size(inputs) != n || PyList_Size(weights) != n) {
    PyErr_SetString(PyExc_ValueError, "lookup: plans, inputs and weights differ in length");
    return nullptr;
  }
  Refs in(n), w(n);  // held while the request runs (a finish may change the lists)
  for (Py_ssize_t i = 0; i < n; ++i) {
    in.v[static_cast<size_t>(i)] = PyList_GetItem(inputs, i);
    w.v[static_cast<size_t>(i)] = PyList_GetItem(weights, i);
    Py_INCREF(in.v[static_cast<size_t>(i)]);
    Py_INCREF(w.v[static_cast<size_t>(i)]);
  }
  return lookup_core(plans, in.v.data(), w.v.data(), n, tables, types, alloc, finish, threads,
                     [n](PyObject** outs) { return list_of(outs, n); });
}

// Whether `config` still holds the FeatureConfigs the plans were made of under the same
// keys (`order` walked alongside `config`; where it differs, `index` and `features`
// looked up): 1, 0 (changed: plan again), or -1 (a Python error set).
int same_config(PyObject* config, PyObject* index, PyObject* features, PyObject* order,
                Py_ssize_t n) {
  if (PyDict_Size(config) != n) return 0;
  PyObject *key, *value;
  Py_ssize_t pos = 0, j = 0;
  bool same_order = true;
  while (PyDict_Next(config, &pos, &key, &value)) {  // as the plans saw it, in its order
    PyObject* seen = PyTuple_GetItem(order, j++);
    if (key != PyTuple_GetItem(seen, 0) || value != PyTuple_GetItem(seen, 1)) {
      same_order = false;
      break;
    }
  }
  if (same_order) return 1;
  pos = 0;  // another order, or changed: each key looked up
  while (PyDict_Next(index, &pos, &key, &value)) {
    PyObject* now = PyDict_GetItemWithError(config, key);
    if (now == nullptr && PyErr_Occurred()) return -1;
    const Py_ssize_t i = PyLong_AsSsize_t(value);
    if (i < 0 || i >= n) return PyErr_Occurred() ? -1 : 0;
    if (now != PyTuple_GetItem(features, i)) return 0;
  }
  return 1;
}

// `inputs` (a dict of some of the config's keys) in the config's flat order into `flat`
// (None: not given), each given one's position into `where`, in `inputs`' order: 1, 0
// (not of this form: a key the config lacks, an explicit None input), -1 (a Python error).
int flatten_dict(PyObject* inputs, PyObject* index, PyObject* order, Py_ssize_t n, Refs& flat,
                 std::vector<Py_ssize_t>& where) {
  PyObject *key, *value;
  Py_ssize_t pos = 0, j = 0;
  where.reserve(static_cast<size_t>(PyDict_Size(inputs)));
  while (PyDict_Next(inputs, &pos, &key, &value)) {
    Py_ssize_t i = -1;
    PyObject* seen = j < n ? PyTuple_GetItem(order, j) : nullptr;
    if (seen != nullptr && key == PyTuple_GetItem(seen, 0)) {
      i = PyLong_AsSsize_t(PyTuple_GetItem(seen, 2));  // given in the config's order
    } else {
      PyObject* at = PyUnicode_CheckExact(key) ? PyDict_GetItemWithError(index, key) : nullptr;
      if (at == nullptr) return PyErr_Occurred() ? -1 : 0;  // the general path names it
      i = PyLong_AsSsize_t(at);
    }
    ++j;
    if (i < 0 || i >= n || flat.v[static_cast<size_t>(i)] != nullptr || value == Py_None)
      return PyErr_Occurred() ? -1 : 0;  // an explicit None: the usual path
    Py_INCREF(value);
    flat.v[static_cast<size_t>(i)] = value;
    where.push_back(i);
  }
  for (PyObject*& x : flat.v) {
    if (x == nullptr) {
      Py_INCREF(Py_None);
      x = Py_None;
    }
  }
  return 1;
}

// lookup_dict_of(config, index, features, plans, order, inputs, tables, types, alloc,
// finish, threads): the common request of a model whose feature config is one dict of
// FeatureConfigs under str keys (`config`), its inputs a dict of some of those keys, no
// weights: the request without the Python that flattens the inputs, resolves the config
// and packs the outputs (at batch 1, 26 features: ~40% of a request, all of it holding
// the GIL). index: {key: position in the config's flat (sorted) order}; features: the
// FeatureConfigs in that order, as `config` held them when `plans` were made; order: per
// entry of `config` in its own order then, (key, FeatureConfig, position). The outputs
// come as a dict in `inputs`' key order, given to finish(dict, before_run) as `lookup`'s
// list is (finish None: the dict itself). False where the config changed since the plans
// (the caller plans again); NotImplemented (the caller's usual path): another structure,
// a key the config lacks, an explicit None input; None (the general path): whatever
// `lookup` returns None for.
PyObject* lookup_dict_of(PyObject* config, PyObject* index, PyObject* features, PyObject* plans,
                         PyObject* order, PyObject* inputs, PyObject* tables, PyObject* types,
                         PyObject* alloc, PyObject* finish, long long threads) {
  const Py_ssize_t n = PyTuple_Size(features);
  if (!PyDict_CheckExact(config) || !PyDict_CheckExact(inputs) || !PyDict_CheckExact(tables) ||
      PyTuple_Size(plans) != n || PyDict_Size(index) != n || PyTuple_Size(order) != n)
    Py_RETURN_NOTIMPLEMENTED;
  const int same = same_config(config, index, features, order, n);
  if (same < 0) return nullptr;
  if (same == 0) Py_RETURN_FALSE;  // changed since the plan: plan again
  Refs flat(n);  // the inputs in the flat order (None: not given)
  std::vector<Py_ssize_t> where;
  const int flattened = flatten_dict(inputs, index, order, n, flat, where);
  if (flattened < 0) return nullptr;
  if (flattened == 0) Py_RETURN_NOTIMPLEMENTED;
  // the outputs under the inputs' keys, in their order: a copy of `inputs` (its keys as
  // they are, no resizing) with each value replaced
  auto pack = [inputs, &where](PyObject** outs) -> PyObject* {
    Owned result(PyDict_Copy(inputs));
    if (result.p == nullptr) return nullptr;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    size_t k = 0;
    while (PyDict_Next(inputs, &pos, &key, &value)) {
      if (k == where.size()) break;  // changed by another thread meanwhile: theirs
      if (PyDict_SetItem(result.p, key, outs[where[k++]]) != 0) return nullptr;
    }
    PyObject* r = result.p;
    result.p = nullptr;
    return r;
  };
  return lookup_core(plans, flat.v.data(), nullptr, n, tables, types, alloc, finish, threads, pack);
}

// bind(open, add, close, threads_for): the serving library's runner functions' addresses.
PyObject* bind(PyObject*, PyObject* args) {
  unsigned long long o, a, c, t;
  if (!PyArg_ParseTuple(args, "KKKK", &o, &a, &c, &t)) return nullptr;
  if (o == 0 || a == 0 || c == 0 || t == 0) {
    PyErr_SetString(PyExc_ValueError, "bind: a null function address");
    return nullptr;
  }
  g_open = reinterpret_cast<OpenFn>(static_cast<uintptr_t>(o));
  g_add = reinterpret_cast<AddFn>(static_cast<uintptr_t>(a));
  g_close = reinterpret_cast<CloseFn>(static_cast<uintptr_t>(c));
  g_threads_for = reinterpret_cast<ThreadsFn>(static_cast<uintptr_t>(t));
  Py_RETURN_NONE;
}

// bind_numpy(api, ndarray, dtypes[, lease]): numpy's C API (its `_ARRAY_API` capsule),
// np.ndarray and np.dtype of (int64, int32, float32, float16, uint8): arrays of those
// dtypes are read directly and output views made by numpy's C API (see NpArray), over
// the buffer `lease(nbytes) -> (owner, address)` gives (the output pool's: no numpy
// array made for the whole buffer). Returns whether
// they will be (False: a numpy whose C ABI is not 1.x or 2.x; the buffer protocol and
// the Python API then, as before).
PyObject* bind_numpy(PyObject*, PyObject* args) {
  PyObject *api, *ndarray, *dtypes, *lease = nullptr;
  if (!PyArg_ParseTuple(args, "OOO!|O", &api, &ndarray, &PyTuple_Type, &dtypes, &lease))
    return nullptr;
  if (!PyCapsule_CheckExact(api) || !PyType_Check(ndarray) || PyTuple_Size(dtypes) != kDescrs) {
    PyErr_SetString(PyExc_TypeError, "bind_numpy: (capsule, type, 5 dtypes)");
    return nullptr;
  }
  void** table = static_cast<void**>(PyCapsule_GetPointer(api, nullptr));
  if (table == nullptr) return nullptr;
  // PyArray_GetNDArrayCVersion: numpy's C ABI version, 1.x's or 2.x's
  const unsigned abi = reinterpret_cast<unsigned (*)()>(table[0])();
  if (abi != 0x01000009u && abi != 0x02000000u) Py_RETURN_FALSE;
  for (int k = 0; k < kDescrs; ++k) {
    PyObject* d = PyTuple_GetItem(dtypes, k);
    Py_INCREF(d);
    Py_XDECREF(g_descr[k]);
    g_descr[k] = d;
  }
  Py_INCREF(ndarray);
  Py_XDECREF(reinterpret_cast<PyObject*>(g_ndarray));
  g_ndarray = reinterpret_cast<PyTypeObject*>(ndarray);
  g_np_new = reinterpret_cast<NpNewFromDescr>(table[94]);
  g_np_set_base = reinterpret_cast<NpSetBase>(table[282]);
  if (lease != nullptr && lease != Py_None) {
    Py_INCREF(lease);
    Py_XDECREF(g_lease);
    g_lease = lease;
  }
  Py_RETURN_TRUE;
}

// set_count(args, setting): `setting` takes the call's one argument (a count, negatives
// 0), its previous value returned.
PyObject* set_count(PyObject* args, int64_t& setting) {
  long long n;
  if (!PyArg_ParseTuple(args, "L", &n)) return nullptr;
  const int64_t previous = setting;
  setting = n < 0 ? 0 : n;
  return PyLong_FromLongLong(previous);
}

// set_hold_gil_below(n) -> the previous value: requests of fewer than n entries keep the
// GIL while their kernels run when requests are not shared (0: every request releases
// it; default 32768). The policy's one setting (embedmesh.serving.settings).
PyObject* set_hold_gil_below(PyObject*, PyObject* args) {
  return set_count(args, g_hold_gil_below);
}

// enter() / leave(): a thread starts / ends a host lookup (serving_embedding_lookup
// calls them around its work); in_flight() -> how many are inside one now.
void enter_now() {
  ++g_in_flight;
  g_gil_busy.store(1);  // this thread holds the GIL inside a lookup
  if (t_left_ns != 0) {  // the gap since its last lookup, into the running mean (1/8)
    const int64_t gap = now_ns() - t_left_ns, mean = g_gap_ns.load(std::memory_order_relaxed);
    g_gap_ns.store(mean >= INT64_MAX / 2 ? gap : mean + (gap - mean) / 8,
                   std::memory_order_relaxed);
  }
  if (g_last_thread != &t_token) {  // another thread than the last one: shared a while
    if (g_last_thread != nullptr) g_shared_until_ns = now_ns() + kSharedWindowUs * 1000;
    g_last_thread = &t_token;
  }
}

void leave_now() {
  if (g_in_flight > 0) --g_in_flight;
  t_left_ns = now_ns();
  g_left_ns.store(t_left_ns, std::memory_order_relaxed);
  g_gil_busy.store(2);  // held, outside a lookup: what comes next is not seen here
}

PyObject* enter(PyObject*, PyObject*) {
  enter_now();
  Py_RETURN_NONE;
}

PyObject* leave(PyObject*, PyObject*) {
  leave_now();
  Py_RETURN_NONE;
}

// serve(served, inputs, tables): serving_embedding_lookup's dict request in one call,
// enter and leave included: `served` is (config, index, features, plans, order, types,
// alloc, threads, finish, collect), the first eight as `lookup_dict_of` takes them, then
// its finish (None: numpy outputs) and collect (None, or called first: jaxlib's flush of
// deleted arrays, so that their buffers are free for this request). The result dict, or
// what `lookup_dict_of` gives otherwise (None, NotImplemented, False: the caller's usual
// path then); NotImplemented at once, without entering, where inputs or tables are not
// dicts.
PyObject* serve(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_CheckExact(args[0]) || PyTuple_Size(args[0]) != 10) {
    PyErr_SetString(PyExc_TypeError, "serve(served: 10-tuple, inputs, tables)");
    return nullptr;
  }
  PyObject* inputs = args[1];
  PyObject* tables = args[2];
  if (!PyDict_CheckExact(inputs) || !PyDict_CheckExact(tables)) Py_RETURN_NOTIMPLEMENTED;
  PyObject* served = args[0];
  PyObject* index = PyTuple_GetItem(served, 1);
  PyObject* features = PyTuple_GetItem(served, 2);
  PyObject* plans = PyTuple_GetItem(served, 3);
  PyObject* order = PyTuple_GetItem(served, 4);
  PyObject* types = PyTuple_GetItem(served, 5);
  if (!PyDict_CheckExact(index) || !PyTuple_CheckExact(features) || !PyTuple_CheckExact(plans) ||
      !PyTuple_CheckExact(order) || !PyTuple_CheckExact(types)) {
    PyErr_SetString(PyExc_TypeError, "serve: a malformed `served`");
    return nullptr;
  }
  const long long threads = PyLong_AsLongLong(PyTuple_GetItem(served, 7));
  if (threads == -1 && PyErr_Occurred()) return nullptr;
  PyObject* collect = PyTuple_GetItem(served, 9);
  if (collect != Py_None) {
    Owned done(PyObject_CallNoArgs(collect));
    if (done.p == nullptr) return nullptr;
  }
  struct Inside {
    Inside() { enter_now(); }
    ~Inside() { leave_now(); }
  } inside;
  try {
    return lookup_dict_of(PyTuple_GetItem(served, 0), index, features, plans, order, inputs,
                          tables, types, PyTuple_GetItem(served, 6), PyTuple_GetItem(served, 8),
                          threads);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* in_flight(PyObject*, PyObject*) { return PyLong_FromLongLong(g_in_flight); }

// set_block_cache(nbytes) -> the previous value: the bytes of small request buffers kept
// for reuse once their outputs are gone (bound to the output pool's limit, up to 1 MiB);
// the cache is trimmed to it at once.
PyObject* set_block_cache(PyObject*, PyObject* args) {
  PyObject* previous = set_count(args, g_block_cache_bytes);
  if (previous != nullptr) trim_blocks(g_block_cache_bytes);
  return previous;
}

// block_cache() -> (blocks, bytes) kept for reuse now.
PyObject* block_cache(PyObject*, PyObject*) {
  return Py_BuildValue("(nL)", static_cast<Py_ssize_t>(g_free_blocks.size()),
                       static_cast<long long>(g_free_block_bytes));
}

// stats() -> (requests, requests that released the GIL, ns between releasing it and
// asking for it back, their kernels): counted since the process started.
PyObject* stats(PyObject*, PyObject*) {
  return Py_BuildValue("(LLL)", static_cast<long long>(g_requests),
                       static_cast<long long>(g_released), static_cast<long long>(g_released_ns));
}

PyMethodDef kMethods[] = {
    {"stats", stats, METH_NOARGS, "(requests, released the GIL, ns released)."},
    {"set_hold_gil_below", set_hold_gil_below, METH_VARARGS,
     "Requests of fewer entries keep the GIL while their kernels run, when alone."},
    {"enter", enter, METH_NOARGS, "A thread starts a host lookup."},
    {"leave", leave, METH_NOARGS, "A thread ends a host lookup."},
    {"in_flight", in_flight, METH_NOARGS, "Threads inside a host lookup now."},
    {"set_block_cache", set_block_cache, METH_VARARGS,
     "Bytes of small request buffers kept for reuse."},
    {"block_cache", block_cache, METH_NOARGS, "(blocks, bytes) of small buffers kept now."},
    {"lookup", guarded<lookup_checked>, METH_VARARGS,
     "A request's common features on the C++ kernels."},
    {"serve", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(serve)), METH_FASTCALL,
     "A dict request in one call, enter and leave included."},
    {"bind", bind, METH_VARARGS, "Bind the serving library's runner functions."},
    {"bind_numpy", bind_numpy, METH_VARARGS, "Bind numpy's C API: direct reads and views."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_request", nullptr, -1, kMethods,
                       nullptr,               nullptr,    nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__request(void) {
  s_values = PyUnicode_InternFromString("values");
  s_row_splits = PyUnicode_InternFromString("row_splits");
  s_indices = PyUnicode_InternFromString("indices");
  s_dense_shape = PyUnicode_InternFromString("dense_shape");
  s_reshape = PyUnicode_InternFromString("reshape");
  s_kind = PyUnicode_InternFromString("kind");
  s_data = PyUnicode_InternFromString("data");
  s_dim = PyUnicode_InternFromString("dim");
  if (!s_values || !s_row_splits || !s_indices || !s_dense_shape || !s_reshape || !s_kind ||
      !s_data || !s_dim)
    return nullptr;
  static const bool at_fork = pthread_atfork(nullptr, nullptr, reset_after_fork) == 0;
  (void)at_fork;
  g_block_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&kBlockSpec));
  if (g_block_type == nullptr) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  // lookup's `types` may name QuantizedTable fourth: its tables go to EmServingBagQ
  if (m != nullptr && PyModule_AddIntConstant(m, "QUANTIZED_TABLES", 1) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  // the calling convention of `lookup` and `serve` (request.py's INTERFACE): a module
  // built from another source (an editable install not rebuilt) is not used
  if (m != nullptr && PyModule_AddIntConstant(m, "INTERFACE", 2) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
