// Serving kernels of embedmesh: plain C ABI (no XLA headers), called with ctypes.
//
// Every function works on caller-owned memory, allocates nothing the caller sees,
// and returns -1 on success or the index of the first offending entry.
#pragma once

#include <cstdint>

extern "C" {

// out[r, :] = combine over kept k in [offsets[r], offsets[r+1]) of w_k * table[ids[k], :].
// ids: int32 (ids_are_64 = 0) or int64 (1). weights: NULL for all ones. mode: 0 sum,
// 1 mean (divide by sum w), 2 sqrtn (divide by sqrt(sum w^2)); a zero denominator gives
// a zero row. prune_ids: skip ids < 0; prune_weights: skip entries whose weight is not
// > 0 (TensorFlow's safe lookup). Accumulates in float32 in entry order, no FMA.
// table_stride and out_stride in floats. Returns -1, or the first kept entry whose id
// lies outside [0, vocab) (rows before it are written, the rest are not).
int64_t EmServingBagF32(const float* table, int64_t vocab, int64_t dim, int64_t table_stride,
                        const void* ids, int32_t ids_are_64, const int64_t* offsets,
                        int64_t num_rows, const float* weights, int32_t mode, int32_t prune_ids,
                        int32_t prune_weights, float* out, int64_t out_stride);

// Whether EmServingBagQ prefetches every line of rows over 132 bytes (default 1; 0: the
// first line only, as the float32 kernels); returns the previous setting (A/B runs).
int64_t EmServingSetQuantizedRowPrefetch(int64_t on);

// EmServingBagF32 over a quantized table (embedmesh/serving/quantized.py): each row is
// decoded to float32 inside the sum, then summed as EmServingBagF32 sums (float32, entry
// order, no FMA). `format`: two int64 words, the row format and (codes) the address of
// the codes' float32 values. Formats: 1 float16 [dim], 2 bfloat16 [dim], 3 FBGEMM's
// fused 8-bit row-wise (dim bytes q, then float32 scale and bias: q * scale + bias), 4
// one-byte codes (values[q]). `table_stride_bytes`: in bytes (rows of at least the
// format's row bytes). Returns as EmServingBagF32, or INT64_MIN for an unknown format.
// In a bag task of EmServingRun (kinds 0, 3, 4), word 19 holds `format` (0: a float32
// table, EmServingBagF32) and word 4 the stride in bytes.
int64_t EmServingBagQ(const void* table, int64_t vocab, int64_t dim, int64_t table_stride_bytes,
                      const void* ids, int32_t ids_are_64, const int64_t* offsets,
                      int64_t num_rows, const float* weights, int32_t mode, int32_t prune_ids,
                      int32_t prune_weights, float* out, int64_t out_stride,
                      const int64_t* format);

// out[k, :] = table[ids[k], :] byte for byte, rows of row_bytes (table rows
// table_stride_bytes apart, out rows packed). Returns -1, or the first k with an id
// outside [0, vocab).
int64_t EmServingGather(const void* table, int64_t vocab, int64_t row_bytes,
                        int64_t table_stride_bytes, const void* ids, int32_t ids_are_64,
                        int64_t n, void* out);

// Bag offsets (num_rows + 1 values, num_rows = prod(shape[:-1])) of sorted COO
// indices [n, rank] (int32 or int64): checks each index lies in shape and follows the
// previous one in row-major order without repeats. Returns -1 or the first bad entry.
int64_t EmServingSparseOffsets(const void* indices, int32_t indices_are_64, int64_t n,
                               int64_t rank, const int64_t* shape, int64_t* offsets);

// One request's kernels in one call. `tasks`: n_tasks rows of EM_TASK_WORDS int64 words,
// each a kind (0: EmServingBagF32, 2: EmServingGather; 1, a one-pass sparse bag, is gone) then
// that function's arguments in order (pointers and NULL as integers), unused words 0.
// Kind 3, 2-D sparse input: EmServingBagF32's arguments, then the COO indices [n, 2], whether
// they are int64, n, and the dense shape's column count; the bag offsets (its `offsets`
// argument, num_rows + 1 values) are written from the indices first (as
// EmServingSparseOffsets; a bad index k gives the result -2 - k, and no bag is summed).
// Kind 4, ragged input: kind 0's words, then (word 15) the number of ids; the offsets are
// checked first (non-decreasing from 0 to that number; else the result is -3, and no bag is
// summed).
// Bag tasks are split into chunks of whole bags, gathers into id ranges, of about equal
// entries, run on `threads` threads: the caller's, plus a pool started at first use (a
// request arriving while another holds the pool runs on its caller's thread alone).
// results[t]: what task t's function returns for all of its entries. Returns -1, or the
// first task of an unknown kind (then nothing ran).
// A request too small to share (under 8,192 entries a thread, or what
// EmServingSetMinEntriesPerThread set, returning the previous value) runs on fewer
// threads (EmServingThreadsFor: how many).
#define EM_TASK_WORDS 20
int64_t EmServingRun(const int64_t* tasks, int64_t n_tasks, int64_t threads, int64_t* results);
int64_t EmServingThreadsFor(const int64_t* tasks, int64_t n_tasks, int64_t threads);
int64_t EmServingSetMinEntriesPerThread(int64_t n);
// Threads a request of `entries` entries runs on, of `threads`.
int64_t EmServingThreadsForEntries(int64_t entries, int64_t threads);
// How long (microseconds; default 300, 0: not at all) the pool's threads poll for the next
// request before they sleep; returns the previous value.
int64_t EmServingSetPoolSpin(int64_t us);

// The same, its tasks handed over one by one as the caller prepares them: the pool's
// threads start on the first task's chunks at once. EmServingOpen returns the request
// (for up to max_tasks tasks); EmServingAdd copies one task's EM_TASK_WORDS words in and
// returns -1, or 0 (an unknown kind or a full request: not added); EmServingClose runs
// what is left on the caller's thread too, waits for the rest, writes each added task's
// result and frees the request. Every request opened must be closed. The pool's threads
// join once the tasks added hold 8,192 entries a thread for two of them (see below).
void* EmServingOpen(int64_t max_tasks, int64_t threads);
int64_t EmServingAdd(void* request, const int64_t* words);
void EmServingClose(void* request, int64_t* results);

// Cache lines of rows prefetched ahead (default 128; the bag kernels' entries ahead are
// this over the lines of a row for rows of up to 3 lines, this over 4 for longer rows, of
// which only the first line is prefetched; within [2, 64]; 0: no prefetch); returns the
// previous value.
int64_t EmServingSetPrefetch(int64_t entries);

// Cache lines prefetched per row (default 0: every line the row touches); returns the
// previous setting.
int64_t EmServingSetRowLines(int64_t n);

// Whether rows on 64-byte lines skip the prefetches that land in a line already
// prefetched (default 1); returns the previous setting (benchmarks compare the two).
int64_t EmServingSetAlignedPrefetch(int64_t on);

// Whether rows of at most one register block use the one-pass kernel (default 1);
// returns the previous setting (benchmarks compare the two).
int64_t EmServingSetFused(int64_t on);

// The vector width the kernels were built for, in floats (16 AVX-512, 8 AVX2, 4 else).
int64_t EmServingVectorWidth(void);

// Whether bag kernels may write outputs of 256 KB or more with streaming stores (default
// 1); returns the previous setting (benchmarks compare the two; same values either way).
int64_t EmServingSetStreamOutput(int64_t on);

}  // extern "C"

namespace embedmesh_serving {
// The output bytes of the whole task the calling thread's bag kernel call is a chunk of
// (set by the runner around each chunk; 0: the call is the whole task). Kernels judge
// whether to stream their output by it.
extern thread_local int64_t t_output_bytes;
}  // namespace embedmesh_serving
