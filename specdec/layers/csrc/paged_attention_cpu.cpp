// Paged attention for the CPU in one call per layer: writes the step's K/V into the paged
// cache, then attends every query token (see specdec/attention.py for the terms and
// specdec/cpu_extension.py for how it is built, specdec/attention_cpu.py for where it is used).
//
// Why: the reference backend does per sequence an index_select of the whole context, a
// dtype conversion and an SDPA call, ~20 dispatcher trips a layer, which cost more than the
// arithmetic of a decode or verify step (about 120 us a layer against a few us of math for
// the default model). Here a short query segment (a decode token or a verify window)
// reads its K/V rows straight out of the blocks, in fp32 arithmetic whatever the cache's
// dtype, and the query heads that share a KV head are done together so each cached row is
// loaded once. A long segment (a prefill chunk) goes through the same kernel in pieces of 32
// tokens, so that each of its rows is reduced over its keys exactly as a decode of that token
// would be (batch invariance: a token's bits do not depend on whether its prefix was computed
// in this call or read from the cache); with batch invariance off it gathers its context and
// calls torch's SDPA as the reference does. What no layer changes (slots, block
// tables, the units of work) is planned once a step (`plan_attention`) and each layer runs
// on raw rows (`attend_planned`): the decoder stack plans once for all its layers;
// `paged_attention`, the operator the other forwards call, is a plan and one layer.
//
// Layouts (all on the CPU): query [T, H, D], key/value [T, KVH, D] with the last dim
// contiguous (any other strides); caches [num_blocks, block_size, KVH, D] contiguous;
// block tables int32 or int64. Output [T, H, D] contiguous, the query's dtype.

#include "cpu_kernels.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace specdec_cpu {
namespace {

// Query segments up to this length are planned chunk by chunk (every query row of a chunk in
// one unit, the chunks merged after); longer ones (a prefill chunk) in pieces of this many
// tokens, each piece's rows over all its chunks in one unit, or by SDPA when the plan is not
// batch-invariant.
constexpr int64_t kMaxKernelQueryLen = 32;
// Below this many (query row x cached row) products a step runs on one thread: forking
// costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 10;

template <typename T>
inline void to_float_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Sixteen floats in one value, for the loops over head_dim when it is a multiple of 16: GCC
// and Clang lower it to one AVX-512 register, two AVX2 or four NEON ones.
typedef float Float16 __attribute__((vector_size(64)));

inline Float16 load16(const float* src) {
  Float16 v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}
// Sixteen cached elements in fp32 (exact for every dtype the cache holds).
template <typename T>
inline Float16 load16(const T* src) {
  Float16 v;
  for (int i = 0; i < 16; ++i) v[i] = to_float(src[i]);
  return v;
}
inline Float16 load16(const c10::BFloat16* src) {
  typedef uint16_t Bits16 __attribute__((vector_size(32)));
  typedef uint32_t Bits32 __attribute__((vector_size(64)));
  Bits16 half;
  std::memcpy(&half, src, sizeof(half));
  const Bits32 widened = __builtin_convertvector(half, Bits32) << 16;
  Float16 v;
  std::memcpy(&v, &widened, sizeof(v));
  return v;
}

// 32 bf16 widened to fp32 by interleaving each with a zero below it, per 128-bit lane L:
// `lo` takes elements 8L..8L+3, `hi` 8L+4..8L+7 (lane 4L + k holds element 8L + k, resp.
// 8L + 4 + k). unpacked_order puts two such vectors' lanes back in element order.
inline void load32_unpacked(const c10::BFloat16* src, Float16& lo, Float16& hi) {
  typedef uint16_t Bits32x16 __attribute__((vector_size(64)));
  Bits32x16 x;
  std::memcpy(&x, src, sizeof(x));
  const Bits32x16 z{};
  const Bits32x16 l = __builtin_shufflevector(z, x, 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43,
                                              16, 48, 17, 49, 18, 50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59);
  const Bits32x16 h = __builtin_shufflevector(z, x, 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47,
                                              20, 52, 21, 53, 22, 54, 23, 55, 28, 60, 29, 61, 30, 62, 31, 63);
  std::memcpy(&lo, &l, sizeof(lo));
  std::memcpy(&hi, &h, sizeof(hi));
}
inline void unpacked_order(Float16 lo, Float16 hi, float* out) {
  for (int L = 0; L < 4; ++L)
    for (int k = 0; k < 4; ++k) out[8 * L + k] = lo[4 * L + k], out[8 * L + 4 + k] = hi[4 * L + k];
}

// The sums of sixteen vectors' lanes in one vector, each vector halved by one tree written
// out (lane i + lane i + 8, then + 4, + 2, + 1; a compiler's own reduction of a vector is
// sixteen dependent scalar adds), so a score's bits do not depend on the other fifteen. The
// vectors come in `slot` order: position j of sixteen goes in slot reduce16_slot(j) and its
// sum comes out in lane j.
inline int reduce16_slot(int64_t j) { return static_cast<int>(j % 4 * 4 + j / 4); }
inline Float16 reduce16(const float (*v)[16]) {
  Float16 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i) {
    const Float16 a = load16(v[2 * i]), b = load16(v[2 * i + 1]);
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    s[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(u[0], u[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
         __builtin_shufflevector(u[0], u[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
}

// Query rows handled together: each cached row loaded serves this many dot products or
// updates, and their sums are independent chains the CPU overlaps. A segment's rows (its
// tokens times the query heads sharing a KV head) go in as few blocks as this allows,
// balanced and unpadded. The default model has three query heads a KV head: a decode token
// is one block of 3 and a token with one draft one block of 6, where fixed blocks of 4
// padded a decode to 4 rows and walked a draft's cached rows twice (4 + 4). Six rows when
// head_dim is 64 (their value sums take 24 of the 32 vector registers), four otherwise.
// Measured (bf16, 2 threads, fixed blocks of 4 and these alternated in one process): the 30
// layers' attention alone 1.00-1.08x for one token a sequence, 1.28-1.42x for two,
// 1.12-1.23x for four (1 to 16 sequences, context 200-1000); the decoder stack and LM head
// at context 250, 8 and 16 sequences, 1.02x decoding and 1.09-1.10x with a draft token each.
constexpr int64_t kMaxRowBlock = 6;
template <int64_t kHeadDim>
constexpr int64_t max_row_block() {
  return kHeadDim == 64 ? kMaxRowBlock : 4;
}
// Cached positions one unit of work attends over. Chunks start at multiples of this in every
// call, so a token's sums depend on its own visible prefix only, never on how many tokens
// share its step (row invariance) or on how chunks are spread over threads; a long context
// is split across threads (one sequence's decode used to keep one thread per KV head). 128
// rather than 256: a decode at context 200 is then six units, not three, which two threads
// share 3 + 3 instead of 2 + 1 (units go KV head by KV head, each head's chunks together):
// 30 layers' attention in a bf16 forward 0.84 -> 0.68 ms at 1 token, 1.58 -> 1.42 at 5;
// unchanged at context 1000. 64 gained less (0.90 -> 0.84).
constexpr int64_t kChunk = 128;
// Cached positions ahead whose rows the score and value loops prefetch, into L2. The hardware did
// not keep up with rows read a head's slice at a time (128 of every 384 bytes for the default
// model): 30 layers' attention in a bf16 forward 0.72 -> 0.61 ms at context 200, 3.22 ->
// 2.66 ms at 1000, 4.12 -> 3.74 ms for a step of eight sequences (a burst at the start of a
// unit, or before the layer's qkv projection, did not help). Into L1 (prefetcht0) 16 ahead,
// until the score and value loops got faster (reduce16, load32_unpacked): then a batch's
// attention, its rows evicted from the caches by the weights, took the time of its reads
// plus its arithmetic, both halves unoverlapped (16 sequences at context 250: 7.4 ms, 3.5
// with the rows in cache). An L1 prefetch holds a miss buffer of the few L1 has; into L2 the
// rows stay in flight 32 ahead. The 30 layers alone, old and new alternated in one process,
// rows not in cache: 16 sequences at context 250 / 1000, one token each, 1.16x / 1.22x (64
// ahead 1.16x / 1.11x; into L1 16 ahead with the faster loops 0.99x / 0.99x).
constexpr int64_t kPrefetchAhead = 32;

// Asks for the cache lines of one cached row (head_dim elements at `row`) into L2.
template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < head_dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b, 0, 2);
}

// One chunk's softmax over part of a query row's context, kept unnormalised for the merge:
// [max score, sum of e^(score - max), sum of e^(score - max) * value row (head_dim floats)].
inline int64_t partial_width(int64_t head_dim) { return head_dim + 2; }

// A row's scores over the `seen` positions it may see -> e^(score - their max), the rest up
// to `block_seen` zeros; the max and the sum of the exponentials out. The sum goes in an
// order written out (lane i of sixteen takes positions i, i + 16, ... in turn, the lanes then
// summed as a tree, the tail after), not one the compiler picks, so a row's bits are the
// same in every block size that inlines this.
inline void softmax_row(float* row, int64_t seen, int64_t block_seen, float& max_out, float& total_out) {
  const float lowest = -std::numeric_limits<float>::infinity();
  Float16 lane_max = Float16{} + lowest;
  int64_t p = 0;
  for (; p + 16 <= seen; p += 16) {
    const Float16 x = load16(row + p);
    lane_max = x > lane_max ? x : lane_max;
  }
  float max_score = lowest;
  for (int i = 0; i < 16; ++i) max_score = std::max(max_score, lane_max[i]);
  for (; p < seen; ++p) max_score = std::max(max_score, row[p]);
#pragma omp simd
  for (int64_t q = 0; q < seen; ++q) row[q] = exp_clamped(row[q] - max_score);
  Float16 lanes{};
  for (p = 0; p + 16 <= seen; p += 16) lanes += load16(row + p);
  const Float16 half = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  float total = ((half[0] + half[4]) + (half[2] + half[6])) + ((half[1] + half[5]) + (half[3] + half[7]));
  for (; p < seen; ++p) total += row[p];
  for (p = seen; p < block_seen; ++p) row[p] = 0.f;
  max_out = max_score;
  total_out = total;
}

// The MR query rows of one block, from row r0 of the chunk's scaled `queries`, against the
// chunk's cached positions: each row's partial written as attend_chunk describes. A row's
// sums do not depend on MR or r0 (its products summed in the same order, its lanes reduced
// by the same tree), so the blocking cannot break row invariance.
template <typename T, int64_t kHeadDim, int MR>
void attend_block(const float* queries, int64_t r0, int64_t head_dim, int64_t group,
                  const T* key_cache, const T* value_cache, const int64_t* rows_at, int64_t block_seen,
                  const int64_t* row_seen, float* weights, int64_t chunk_len, int64_t num_heads,
                  int64_t kv_head, float* partials) {
  const int64_t width = partial_width(head_dim);
  // head_dim a compiled-in multiple of 16: whole vectors only, the value sums in registers.
  constexpr bool kWhole = kHeadDim > 0 && kHeadDim % 16 == 0;
  const float* q[MR];
  float* w[MR];
  for (int b = 0; b < MR; ++b) q[b] = queries + (r0 + b) * head_dim, w[b] = weights + b * chunk_len;
  // Sixteen positions at a time: each row's products summed in sixteen lanes over whole
  // vectors of head_dim go to `lanes`, then one transposing reduction (reduce16) turns them
  // into the sixteen scores at once, where a reduction per position spent most of its
  // shuffles on lanes it threw away; then any tail past the whole vectors, in order. A row's
  // sums are the same in every block. With the value rows widened by load32_unpacked, the 30
  // layers' attention with its rows in cache (bf16, old and new alternated in one process):
  // 16 sequences at context 250 1.24x for one token each, 1.14x / 1.15x for two / four; one
  // sequence 1.04-1.11x. The same bits as the reduction per position (the same trees),
  // checked over these cases.
  const int64_t vector_end = kWhole ? kHeadDim : head_dim / 16 * 16;
  alignas(64) float lanes[MR][16][16];
  for (int64_t p0 = 0; p0 < block_seen; p0 += 16) {
    const int64_t count = std::min<int64_t>(16, block_seen - p0);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t p = p0 + j;
      const T* k = key_cache + rows_at[p];
      if (p + kPrefetchAhead < block_seen) prefetch_row(key_cache + rows_at[p + kPrefetchAhead], head_dim);
      Float16 s[MR];
      for (int b = 0; b < MR; ++b) s[b] = Float16{};
      for (int64_t d = 0; d < vector_end; d += 16) {
        const Float16 kd = load16(k + d);
        for (int b = 0; b < MR; ++b) s[b] += load16(q[b] + d) * kd;
      }
      for (int b = 0; b < MR; ++b) std::memcpy(lanes[b][reduce16_slot(j)], &s[b], sizeof(Float16));
    }
    for (int64_t j = count; j < 16; ++j)
      for (int b = 0; b < MR; ++b) std::memset(lanes[b][reduce16_slot(j)], 0, sizeof(Float16));
    for (int b = 0; b < MR; ++b) {
      const Float16 scores = reduce16(lanes[b]);
      std::memcpy(w[b] + p0, &scores, count * sizeof(float));
    }
    if constexpr (!kWhole) {
      for (int64_t p = p0; p < p0 + count; ++p) {
        const T* k = key_cache + rows_at[p];
        for (int64_t d = vector_end; d < head_dim; ++d) {
          const float kd = to_float(k[d]);
          for (int b = 0; b < MR; ++b) w[b][p] += q[b][d] * kd;
        }
      }
    }
  }
  // e^(score - the row's max over what it sees); what it may not see weighs zero.
  float maxima[MR], totals[MR];
  for (int b = 0; b < MR; ++b) softmax_row(w[b], row_seen[b], block_seen, maxima[b], totals[b]);
  // Weighted sum of the value rows, the block's accumulators kept together (in registers
  // when head_dim is a known multiple of 16).
  auto write = [&](int b, const float* sums) {
    const int64_t r = r0 + b;
    float* dst = partials + ((r / group) * num_heads + kv_head * group + r % group) * width;
    dst[0] = maxima[b];
    dst[1] = totals[b];
    std::memcpy(dst + 2, sums, head_dim * sizeof(float));
  };
  if constexpr (kWhole) {
    constexpr int64_t kVecs = kHeadDim / 16;
    // bf16 value rows widened two vectors at a time by interleaving with zeros (one
    // instruction a vector, where load16 takes two), their elements in unpacked order.
    constexpr bool kUnpacked = std::is_same_v<T, c10::BFloat16> && kHeadDim % 32 == 0;
    Float16 acc[MR][kVecs];
    for (int b = 0; b < MR; ++b)
      for (int64_t i = 0; i < kVecs; ++i) acc[b][i] = Float16{};
    for (int64_t p = 0; p < block_seen; ++p) {
      const T* v = value_cache + rows_at[p];
      if (p + kPrefetchAhead < block_seen) prefetch_row(value_cache + rows_at[p + kPrefetchAhead], head_dim);
      if constexpr (kUnpacked) {
        for (int64_t i = 0; i < kVecs; i += 2) {
          Float16 lo, hi;
          load32_unpacked(v + 16 * i, lo, hi);
          for (int b = 0; b < MR; ++b) acc[b][i] += w[b][p] * lo, acc[b][i + 1] += w[b][p] * hi;
        }
      } else {
        for (int64_t i = 0; i < kVecs; ++i) {
          const Float16 vd = load16(v + 16 * i);
          for (int b = 0; b < MR; ++b) acc[b][i] += w[b][p] * vd;
        }
      }
    }
    for (int b = 0; b < MR; ++b) {
      float sums[kHeadDim];
      if constexpr (kUnpacked) {
        for (int64_t i = 0; i < kVecs; i += 2) unpacked_order(acc[b][i], acc[b][i + 1], sums + 16 * i);
      } else {
        for (int64_t i = 0; i < kVecs; ++i) std::memcpy(sums + 16 * i, &acc[b][i], sizeof(Float16));
      }
      write(b, sums);
    }
  } else {
    std::vector<float> accum(MR * head_dim, 0.f);
    for (int64_t p = 0; p < block_seen; ++p) {
      const T* v = value_cache + rows_at[p];
      for (int b = 0; b < MR; ++b) {
        const float u = w[b][p];
        float* a = accum.data() + b * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += u * to_float(v[d]);
      }
    }
    for (int b = 0; b < MR; ++b) write(b, accum.data() + b * head_dim);
  }
}

// The chunk of cached positions [chunk_start, chunk_start + kChunk) of one short query
// segment (query_len tokens), for the `group` query heads that share KV head `kv_head`
// (loaded once for all of them): writes each query row's partial (token j, head h at row
// j * num_heads + h of `partials`). Token j attends to positions
// [0, context_len - query_len + j]; a row that sees none of the chunk gets a sum of 0.
// Position p lies at the block table's slot for p, or at tail_slots[p - tail_start] from
// tail_start on when tail_slots is given (a tree node: its ancestors' and its own slots).
// kHeadDim: head_dim as a compile-time constant (the common sizes, so that the loops over it
// unroll into a few vector instructions), or 0 for any other size.
template <typename T, int64_t kHeadDim>
void attend_chunk(const T* query, int64_t query_token_stride, int64_t query_head_stride,
                  const T* key_cache, const T* value_cache, const int64_t* block_table,
                  int64_t block_size, int64_t num_kv_heads, int64_t runtime_head_dim, int64_t num_heads,
                  int64_t kv_head, int64_t query_len, int64_t context_len, int64_t chunk_start, float scale,
                  float* partials, const int64_t* tail_slots = nullptr, int64_t tail_start = 0) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = query_len * group;
  const int64_t chunk_len = std::min(kChunk, context_len - chunk_start);
  const int64_t first_query_position = context_len - query_len;
  // This thread's scratch, kept across calls (no allocation a chunk); every part is written
  // before it is read. The cached rows are read where they lie and widened to fp32 in
  // registers (the same values, so the same sums, as the fp32 copies this kernel first made
  // of them): 30 layers' attention at context 1000 took 66 us a layer with the copies, 49
  // without (2 threads, caches warm); in a whole forward, where streaming the weights has
  // evicted the KV cache, 3% of the attention's time.
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> row_offsets;
  const size_t needed = static_cast<size_t>(rows * head_dim + kMaxRowBlock * chunk_len);
  if (scratch.size() < needed) scratch.resize(needed);
  if (row_offsets.size() < static_cast<size_t>(chunk_len)) row_offsets.resize(chunk_len);
  float* const queries = scratch.data();                // [rows, D], scaled
  float* const weights = queries + rows * head_dim;     // [kMaxRowBlock, chunk_len]
  // Where each position of the chunk lies in the caches, walking the block table.
  const int64_t row_stride = num_kv_heads * head_dim;
  int64_t* const rows_at = row_offsets.data();
  // A tree node's positions from tail_start on are its path's slots (see AttentionPlan::tails).
  for (int64_t i = 0, block = chunk_start / block_size, offset = chunk_start % block_size; i < chunk_len; ++i) {
    const int64_t position = chunk_start + i;
    const int64_t slot = tail_slots != nullptr && position >= tail_start ? tail_slots[position - tail_start]
                                                                         : block_table[block] * block_size + offset;
    rows_at[i] = slot * row_stride + kv_head * head_dim;
    if (++offset == block_size) offset = 0, ++block;
  }
  for (int64_t j = 0; j < query_len; ++j) {
    for (int64_t i = 0; i < group; ++i) {
      const T* src = query + j * query_token_stride + (kv_head * group + i) * query_head_stride;
      float* dst = queries + (j * group + i) * head_dim;
      to_float_row(src, dst, head_dim);
      for (int64_t d = 0; d < head_dim; ++d) dst[d] *= scale;
    }
  }
  // Positions of the chunk row r may see (0 when it starts past the row's last one).
  auto seen = [&](int64_t r) {
    return std::max<int64_t>(0, std::min(chunk_len, first_query_position + r / group + 1 - chunk_start));
  };
  constexpr int64_t kMax = max_row_block<kHeadDim>();
  const int64_t num_blocks = num_balanced_parts(rows, kMax);
  for (int64_t block = 0, r0 = 0; block < num_blocks; ++block) {
    const int64_t mr = balanced_part(rows, num_blocks, block);
    int64_t row_seen[kMaxRowBlock];
    for (int64_t b = 0; b < mr; ++b) row_seen[b] = seen(r0 + b);
    const int64_t block_seen = row_seen[mr - 1];  // the block's last row sees most
    auto run = [&](auto mr_constant) {
      attend_block<T, kHeadDim, decltype(mr_constant)::value>(
          queries, r0, head_dim, group, key_cache, value_cache, rows_at, block_seen, row_seen, weights,
          chunk_len, num_heads, kv_head, partials);
    };
    switch (mr) {
      case 6: if constexpr (kMax >= 6) run(std::integral_constant<int, 6>{}); break;
      case 5: if constexpr (kMax >= 5) run(std::integral_constant<int, 5>{}); break;
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      default: run(std::integral_constant<int, 1>{}); break;
    }
    r0 += mr;
  }
}

// One chunk's partial (see partial_width) merged into a row's running [max, total, sums]:
// rescaled to the running max (a chunk the row sees none of is skipped). Not inlined, so the
// decode path (merge_partials) and a long segment's online merge run the very same
// instructions: a row's bits then do not depend on which of the two served it.
__attribute__((noinline)) void merge_chunk(const float* part, int64_t head_dim, float& max_score, float& total,
                                           float* accum) {
  if (part[1] == 0.f) return;  // the row sees none of this chunk
  if (total == 0.f) {
    max_score = part[0];
    total = part[1];
    std::memcpy(accum, part + 2, head_dim * sizeof(float));
    return;
  }
  const float new_max = std::max(max_score, part[0]);
  const float old_scale = exp_clamped(max_score - new_max), part_scale = exp_clamped(part[0] - new_max);
  total = total * old_scale + part[1] * part_scale;
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) accum[d] = accum[d] * old_scale + part[2 + d] * part_scale;
  max_score = new_max;
}

// A row's merged sums normalised and rounded to T.
template <typename T>
__attribute__((noinline)) void finish_row(const float* accum, float total, int64_t head_dim, T* out) {
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < head_dim; ++d) out[d] = from_float<T>(accum[d] * inverse);
}

// A query row's output from its chunks' partials, merged in chunk order, then normalised and
// rounded to T.
template <typename T>
void merge_partials(const float* partials, int64_t num_chunks, int64_t chunk_stride, int64_t head_dim,
                    float* accum, T* out) {  // accum: head_dim floats of scratch
  float max_score = 0.f, total = 0.f;
  for (int64_t c = 0; c < num_chunks; ++c) merge_chunk(partials + c * chunk_stride, head_dim, max_score, total, accum);
  finish_row(accum, total, head_dim, out);
}

// A piece of a long segment (piece_len query tokens whose last sees context_len positions),
// the `group` query heads of KV head `kv_head`: every chunk the piece sees, in order, by
// attend_chunk, each row's partial merged into its running sums as it comes (merge_chunk), so
// the memory is one chunk's partials whatever the context; then each row normalised into
// `out` (the piece's first token, [piece_len, num_heads, head_dim]). A row gets the bits a
// decode of its token gets: the same chunk partials (attend_chunk's rows do not depend on
// the other rows of the call), merged by the same instructions in the same order.
template <typename T, int64_t kHeadDim>
void attend_piece(const T* query, int64_t query_token_stride, int64_t query_head_stride, const T* key_cache,
                  const T* value_cache, const int64_t* block_table, int64_t block_size, int64_t num_kv_heads,
                  int64_t head_dim, int64_t num_heads, int64_t kv_head, int64_t piece_len, int64_t context_len,
                  float scale, T* out) {
  const int64_t group = num_heads / num_kv_heads, rows = piece_len * group, width = partial_width(head_dim);
  thread_local std::vector<float> chunk_partials, sums, maxima, totals;
  chunk_partials.resize(static_cast<size_t>(piece_len * num_heads * width));
  sums.resize(static_cast<size_t>(rows * head_dim));
  maxima.assign(static_cast<size_t>(rows), 0.f);
  totals.assign(static_cast<size_t>(rows), 0.f);
  const int64_t num_chunks = (context_len + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < num_chunks; ++c) {
    attend_chunk<T, kHeadDim>(query, query_token_stride, query_head_stride, key_cache, value_cache, block_table,
                              block_size, num_kv_heads, head_dim, num_heads, kv_head, piece_len, context_len,
                              c * kChunk, scale, chunk_partials.data());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head_row = (r / group) * num_heads + kv_head * group + r % group;
      merge_chunk(chunk_partials.data() + head_row * width, head_dim, maxima[r], totals[r],
                  sums.data() + r * head_dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head_row = (r / group) * num_heads + kv_head * group + r % group;
    finish_row(sums.data() + r * head_dim, totals[r], head_dim, out + head_row * head_dim);
  }
}

// Stores each token's K/V row at its slot (rows as in AttentionRows, the caches' dtype).
void write_kv(const AttentionPlan& plan, const AttentionRows& rows, void* key_cache, void* value_cache,
              int64_t element_size) {
  const int64_t row_bytes = plan.head_dim * element_size;
  auto* key_base = static_cast<char*>(key_cache);
  auto* value_base = static_cast<char*>(value_cache);
  const auto* key_rows = static_cast<const char*>(rows.key);
  const auto* value_rows = static_cast<const char*>(rows.value);
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    for (int64_t h = 0; h < plan.num_kv_heads; ++h) {
      const int64_t offset = (plan.slots[t] * plan.num_kv_heads + h) * row_bytes;
      std::memcpy(key_base + offset, key_rows + (t * rows.key_token_stride + h * rows.key_head_stride) * element_size,
                  row_bytes);
      std::memcpy(value_base + offset,
                  value_rows + (t * rows.value_token_stride + h * rows.value_head_stride) * element_size, row_bytes);
    }
  }
}

// A long query segment: gather its context and run torch's SDPA (fp32 math for 16 bits).
at::Tensor attend_long_segment(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_table, int64_t context_len, double scale) {
  const int64_t query_len = query.size(0);
  at::Tensor seq_key, seq_value;
  std::optional<at::Tensor> mask;
  bool is_causal = false;
  if (context_len == query_len) {
    seq_key = key;  // the cache holds exactly this step's tokens
    seq_value = value;
    is_causal = query_len > 1;
  } else {
    const int64_t block_size = key_cache.size(1);
    const int64_t num_blocks = (context_len + block_size - 1) / block_size;
    const at::Tensor blocks = block_table.slice(0, 0, num_blocks);  // int64 already
    seq_key = key_cache.index_select(0, blocks).flatten(0, 1).slice(0, 0, context_len);
    seq_value = value_cache.index_select(0, blocks).flatten(0, 1).slice(0, 0, context_len);
    mask = at::ones({query_len, context_len}, query.options().dtype(at::kBool)).tril(context_len - query_len);
  }
  auto heads_first = [](const at::Tensor& x) { return x.to(at::kFloat).transpose(0, 1).unsqueeze(0); };
  const at::Tensor out = at::scaled_dot_product_attention(
      heads_first(query), heads_first(seq_key), heads_first(seq_value), mask, 0.0, is_causal, scale,
      /*enable_gqa=*/query.size(1) != seq_key.size(1));  // [1, H, query_len, D]
  return out.squeeze(0).transpose(0, 1);
}

// The plan's segments: each sequence's query tokens as they come, except a sequence with
// tree parents, whose every token becomes a segment of its own that sees the cached prefix
// and then its path (ancestors, itself) as its last positions, through plan.tails. So a tree
// node's row is computed as a decode of its path would compute it, bit for bit: its sums run
// over the same rows in the same order and the same chunks.
void expand_tree_segments(AttentionPlan& plan, const std::vector<int64_t>& query_start_locs,
                          const std::vector<int64_t>& context_lens, const std::vector<at::Tensor>& block_tables,
                          const std::vector<at::Tensor>& tree_parents) {
  const int64_t num_seqs = static_cast<int64_t>(context_lens.size());
  plan.query_start_locs.assign(1, query_start_locs[0]);
  plan.context_lens.clear();
  plan.tables.clear();
  plan.tails.clear();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = query_start_locs[s], query_len = query_start_locs[s + 1] - start;
    const bool is_tree = !tree_parents.empty() && tree_parents[s].numel() > 0;
    if (!is_tree) {
      plan.query_start_locs.push_back(query_start_locs[s + 1]);
      plan.context_lens.push_back(context_lens[s]);
      plan.tables.push_back(block_tables[s]);
      plan.tails.emplace_back();
      continue;
    }
    TORCH_CHECK(tree_parents[s].numel() == query_len, "sequence ", s, ": ", tree_parents[s].numel(),
                " tree parents for ", query_len, " query tokens");
    const at::Tensor parents = tree_parents[s].to(at::kLong).contiguous();
    const int64_t* parent_of = parents.data_ptr<int64_t>();
    const int64_t first_position = context_lens[s] - query_len;
    TORCH_CHECK(first_position >= 0, "sequence ", s, ": context_len ", context_lens[s], " is shorter than its ",
                query_len, " query tokens");
    for (int64_t j = 0; j < query_len; ++j) {
      TORCH_CHECK(parent_of[j] >= -1 && parent_of[j] < j, "sequence ", s, ": token ", j, "'s tree parent ",
                  parent_of[j], " does not come before it");
      std::vector<int64_t> path;
      for (int64_t node = j; node >= 0; node = parent_of[node]) path.push_back(plan.slots[start + node]);
      std::reverse(path.begin(), path.end());
      plan.query_start_locs.push_back(start + j + 1);
      plan.context_lens.push_back(first_position + static_cast<int64_t>(path.size()));
      plan.tables.push_back(block_tables[s]);
      plan.tails.push_back(std::move(path));
    }
  }
}

}  // namespace

AttentionPlan plan_attention(int64_t num_tokens, int64_t num_heads, const at::Tensor& key_cache,
                             const at::Tensor& slot_mapping, const std::vector<int64_t>& query_start_locs,
                             const std::vector<int64_t>& context_lens, const std::vector<at::Tensor>& block_tables,
                             bool batch_invariant, const std::vector<at::Tensor>& tree_parents) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous(),
              "the KV caches must be contiguous [blocks, block_size, KVH, D]");
  AttentionPlan plan;
  plan.batch_invariant = batch_invariant;
  plan.num_tokens = num_tokens;
  plan.num_heads = num_heads;
  plan.num_kv_heads = key_cache.size(2);
  plan.head_dim = key_cache.size(3);
  plan.block_size = key_cache.size(1);
  plan.num_blocks = key_cache.size(0);
  TORCH_CHECK(num_heads % plan.num_kv_heads == 0, "the number of KV heads does not divide the query heads");
  const int64_t num_seqs = static_cast<int64_t>(context_lens.size());
  TORCH_CHECK(static_cast<int64_t>(query_start_locs.size()) == num_seqs + 1 &&
                  static_cast<int64_t>(block_tables.size()) == num_seqs,
              "query_start_locs, context_lens and block_tables disagree on the number of sequences");
  TORCH_CHECK(query_start_locs.back() == num_tokens, "query_start_locs must end at the number of tokens");
  TORCH_CHECK(slot_mapping.numel() == num_tokens, "slot_mapping must give one slot per token");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t num_slots = plan.num_blocks * plan.block_size;
  plan.slots.assign(slot_data, slot_data + num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(plan.slots[t] >= 0 && plan.slots[t] < num_slots, "slot ", plan.slots[t], " of token ", t,
                " is outside the cache (", num_slots, " slots)");
  }
  TORCH_CHECK(tree_parents.empty() || static_cast<int64_t>(tree_parents.size()) == num_seqs,
              "tree_parents must be empty or give one tensor per sequence");
  expand_tree_segments(plan, query_start_locs, context_lens, block_tables, tree_parents);
  const int64_t num_segments = static_cast<int64_t>(plan.context_lens.size());
  plan.partial_starts.assign(num_segments, 0);
  const int64_t width = partial_width(plan.head_dim);
  int64_t num_partials = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t start = plan.query_start_locs[s], query_len = plan.query_start_locs[s + 1] - start;
    const int64_t context_len = plan.context_lens[s];
    if (query_len == 0) continue;
    TORCH_CHECK(query_len > 0 && context_len >= query_len, "sequence ", s, ": context_len ", context_len,
                " is shorter than its ", query_len, " query tokens");
    plan.tables[s] = plan.tables[s].to(at::kLong).contiguous();
    TORCH_CHECK(plan.tables[s].numel() * plan.block_size >= context_len, "sequence ", s,
                "'s block table covers fewer than ", context_len, " tokens");
    if (query_len > kMaxKernelQueryLen) {
      if (!batch_invariant) {
        plan.has_long_segment = true;
        continue;
      }
      // Pieces in the order first, last, second, second to last, ...: a later piece sees
      // more context, and parallel_for hands each thread a contiguous range of units.
      const int64_t num_pieces = (query_len + kMaxKernelQueryLen - 1) / kMaxKernelQueryLen;
      for (int64_t i = 0; i < num_pieces; ++i) {
        const int64_t piece = i % 2 == 0 ? i / 2 : num_pieces - 1 - i / 2;
        const int64_t piece_start = piece * kMaxKernelQueryLen;
        const int64_t piece_len = std::min(kMaxKernelQueryLen, query_len - piece_start);
        for (int64_t h = 0; h < plan.num_kv_heads; ++h) {
          plan.units.push_back({s, h, AttentionPlan::kWholePiece, piece_start, piece_len});
        }
      }
      plan.work += query_len * num_heads * context_len;
      continue;
    }
    const int64_t num_chunks = (context_len + kChunk - 1) / kChunk;
    for (int64_t h = 0; h < plan.num_kv_heads; ++h) {
      for (int64_t c = 0; c < num_chunks; ++c) plan.units.push_back({s, h, c});
    }
    plan.partial_starts[s] = num_partials;
    num_partials += num_chunks * query_len * num_heads * width;
    plan.work += query_len * num_heads * context_len;
  }
  plan.partials.resize(num_partials);
  plan.merge_scratch.resize(plan.head_dim);
  return plan;
}

void attend_planned(AttentionPlan& plan, at::ScalarType dtype, const AttentionRows& rows, void* key_cache,
                    void* value_cache, void* out, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_attention_cpu", [&] {
    using T = scalar_t;
    write_kv(plan, rows, key_cache, value_cache, sizeof(T));
    const auto* query_data = static_cast<const T*>(rows.query);
    const auto* key_cache_data = static_cast<const T*>(key_cache);
    const auto* value_cache_data = static_cast<const T*>(value_cache);
    auto* out_data = static_cast<T*>(out);
    const int64_t num_heads = plan.num_heads, head_dim = plan.head_dim, width = partial_width(head_dim);
    if (plan.has_long_segment) {
      // Views of this layer's rows and caches for torch's SDPA (the long segments only).
      const auto options = at::TensorOptions().dtype(dtype);
      const int64_t T_ = plan.num_tokens, KVH = plan.num_kv_heads;
      const at::Tensor query = at::from_blob(const_cast<T*>(query_data), {T_, num_heads, head_dim},
                                             {rows.query_token_stride, rows.query_head_stride, 1}, options);
      const at::Tensor key = at::from_blob(const_cast<void*>(rows.key), {T_, KVH, head_dim},
                                           {rows.key_token_stride, rows.key_head_stride, 1}, options);
      const at::Tensor value = at::from_blob(const_cast<void*>(rows.value), {T_, KVH, head_dim},
                                             {rows.value_token_stride, rows.value_head_stride, 1}, options);
      const std::vector<int64_t> cache_shape{plan.num_blocks, plan.block_size, KVH, head_dim};
      const at::Tensor keys = at::from_blob(key_cache, cache_shape, options);
      const at::Tensor values = at::from_blob(value_cache, cache_shape, options);
      at::Tensor attended = at::from_blob(out, {T_, num_heads, head_dim}, options);
      for (size_t s = 0; s < plan.context_lens.size(); ++s) {
        const int64_t start = plan.query_start_locs[s], query_len = plan.query_start_locs[s + 1] - start;
        if (query_len <= kMaxKernelQueryLen) continue;
        attended.slice(0, start, start + query_len).copy_(attend_long_segment(
            query.slice(0, start, start + query_len), key.slice(0, start, start + query_len),
            value.slice(0, start, start + query_len), keys, values, plan.tables[s], plan.context_lens[s], scale));
      }
    }
    if (plan.units.empty()) return;
    auto run = [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const AttentionPlan::Unit& unit = plan.units[u];
        const int64_t s = unit.seq;
        const int64_t start = plan.query_start_locs[s], query_len = plan.query_start_locs[s + 1] - start;
        if (unit.chunk == AttentionPlan::kWholePiece) {
          auto attend = [&](auto head_dim_constant) {
            attend_piece<T, decltype(head_dim_constant)::value>(
                query_data + (start + unit.piece_start) * rows.query_token_stride, rows.query_token_stride,
                rows.query_head_stride, key_cache_data, value_cache_data, plan.tables[s].data_ptr<int64_t>(),
                plan.block_size, plan.num_kv_heads, head_dim, num_heads, unit.kv_head, unit.piece_len,
                plan.context_lens[s] - query_len + unit.piece_start + unit.piece_len, static_cast<float>(scale),
                out_data + (start + unit.piece_start) * num_heads * head_dim);
          };
          switch (head_dim) {
            case 64: attend(std::integral_constant<int64_t, 64>{}); break;
            case 128: attend(std::integral_constant<int64_t, 128>{}); break;
            default: attend(std::integral_constant<int64_t, 0>{}); break;
          }
          continue;
        }
        float* chunk_partials =
            plan.partials.data() + plan.partial_starts[s] + unit.chunk * query_len * num_heads * width;
        auto attend = [&](auto head_dim_constant) {
          attend_chunk<T, decltype(head_dim_constant)::value>(
              query_data + start * rows.query_token_stride, rows.query_token_stride, rows.query_head_stride,
              key_cache_data, value_cache_data, plan.tables[s].data_ptr<int64_t>(), plan.block_size,
              plan.num_kv_heads, head_dim, num_heads, unit.kv_head, query_len, plan.context_lens[s],
              unit.chunk * kChunk, static_cast<float>(scale), chunk_partials,
              plan.tails[s].empty() ? nullptr : plan.tails[s].data(),
              plan.context_lens[s] - static_cast<int64_t>(plan.tails[s].size()));
        };
        switch (head_dim) {
          case 64: attend(std::integral_constant<int64_t, 64>{}); break;
          case 128: attend(std::integral_constant<int64_t, 128>{}); break;
          default: attend(std::integral_constant<int64_t, 0>{}); break;
        }
      }
    };
    const int64_t num_units = static_cast<int64_t>(plan.units.size());
    if (plan.work < kMinParallelWork) {
      run(0, num_units);
    } else {
      at::parallel_for(0, num_units, 1, run);
    }
    for (size_t s = 0; s < plan.context_lens.size(); ++s) {
      const int64_t start = plan.query_start_locs[s], query_len = plan.query_start_locs[s + 1] - start;
      if (query_len == 0 || query_len > kMaxKernelQueryLen) continue;
      const int64_t num_chunks = (plan.context_lens[s] + kChunk - 1) / kChunk;
      const int64_t chunk_stride = query_len * num_heads * width;
      for (int64_t row = 0; row < query_len * num_heads; ++row) {
        // every row sees at least its own position's chunk
        merge_partials(plan.partials.data() + plan.partial_starts[s] + row * width, num_chunks, chunk_stride,
                       head_dim, plan.merge_scratch.data(), out_data + (start * num_heads + row) * head_dim);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slot_mapping,
                           const std::vector<int64_t>& query_start_locs,
                           const std::vector<int64_t>& context_lens,
                           const std::vector<at::Tensor>& block_tables, double scale, bool batch_invariant,
                           const std::vector<at::Tensor>& tree_parents) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "paged_attention_cpu runs on the CPU");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4,
              "expected query [T, H, D], key/value [T, KVH, D], caches [blocks, block_size, KVH, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type() && value_cache.sizes() == key_cache.sizes(),
              "the KV caches must have the query's dtype and one shape");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && key.size(0) == num_tokens && value.size(0) == num_tokens &&
                  key.size(1) == key_cache.size(2) && value.size(1) == key_cache.size(2) &&
                  key.size(2) == head_dim && value.size(2) == head_dim,
              "head_dim or the number of KV heads does not fit the query");
  AttentionPlan plan =
      plan_attention(num_tokens, num_heads, key_cache, slot_mapping, query_start_locs, context_lens, block_tables,
                     batch_invariant, tree_parents);
  // Rows with the last dim contiguous, in the caches' dtype.
  auto usable = [&](const at::Tensor& x) {
    const at::Tensor typed = x.to(key_cache.scalar_type());
    return typed.stride(2) == 1 ? typed : typed.contiguous();
  };
  const at::Tensor query_rows = query.stride(2) == 1 ? query : query.contiguous();
  const at::Tensor key_rows = usable(key), value_rows = usable(value);
  const AttentionRows rows{query_rows.data_ptr(), query_rows.stride(0), query_rows.stride(1),
                           key_rows.data_ptr(),   key_rows.stride(0),   key_rows.stride(1),
                           value_rows.data_ptr(), value_rows.stride(0), value_rows.stride(1)};
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  attend_planned(plan, query.scalar_type(), rows, key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(), scale);
  return out;
}

}  // namespace specdec_cpu
