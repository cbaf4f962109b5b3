// y = x W^T + b for the rows of a decode, verify or prefill step, on the CPU (see
// specdec/models/packed_linear.py for where it is used).
//
// Why: a one-token decode step of a small model is bound by streaming its weights, and a
// batch of a few sequences (8-16 rows) by the multiply-adds: the stock kernels do neither
// well for a handful of rows. oneDNN on prepacked bf16 weights streamed the default model's
// layers at 33 / 28 GB/s for 1 / 8 rows (2 cores), torch's best fp32 path at 34 / 15.
//
// How: the weight is packed once (`pack_weight`) into blocks of 32 output columns, each
// block [ceil(K / P), 32, P] for P = 2 bf16 (a pair per fp32 lane, as AVX512-BF16's vdpbf16ps
// takes it) or P = 1 fp32. A block is one ascending stream (the Zen 4 this was tuned on
// prefetches one stream well and several interleaved ones badly). For up to ten input
// rows at once, each step of the block loads two registers of weights (32 columns, one
// pair each) and multiplies them by each row's pair broadcast to every lane, summing into
// up to 20 fp32 registers; more rows are split into balanced tiles that take the same
// block again from the caches. Ten, not eight: a batch of eight sequences with a draft
// token or two (9-10 rows) is then one pass, not a pass and a one-row pass (in cache, one
// core, old and new alternated: 9 rows 1.17x, 10 rows 1.08-1.21x, 17-18 rows as 9 + 8 / 9 + 9
// 1.04-1.12x; 8, 16 and 20 rows unchanged). No horizontal
// sums, one weight load per ten rows (in cache ~112 GMAC/s a core against ~58 for the
// dot-product kernel this replaced, which dotted each weight row with each input row, four
// rows at a time). Measured on the default model (2 cores, bf16, weights read from DRAM as
// in a real forward, old and new alternated in one process): the 121 matrices alone
// 1.11-1.16x at 1 row, 1.42-1.47x at 8, 1.9-2.1x at 16; the decoder stack and LM head at
// context 200 unchanged at 1 token, 1.26x at 4, 1.31-1.35x for 8 sequences, 1.52-1.58x for
// 16 rows. At 64-512 rows 0.9-1.8x oneDNN per matrix, so every row count takes it. Threads
// split the blocks.
//
// Eight to forty rows (a batch of sequences, a long verify window) walk a block in chunks of
// 64 pair rows (8 KB of bf16), every tile taking the chunk in turn while the first prefetches
// the next chunk into L2. At 8-16 rows a core multiplies about as fast as it can stream, and
// without the prefetch the reads and the multiply-adds took turns. Measured on the default
// model (2 cores, the two walks alternated in one process, weights from DRAM): the 121
// matrices at 8 / 10 / 16 / 20 rows 0.97-1.20x / 1.04-1.23x / 1.11-1.30x / 1.09-1.24x in bf16,
// 1.11-1.17x with int8 weights; the decoder stack and LM head at context 200, 8 sequences
// 0.97-1.32x, 16 sequences 1.10-1.16x (more where the memory reads are slow at the time). A
// prefetch into L1 gained nothing; below 8 rows the chunked walk lost (4-6 rows 0.88-0.96x),
// so fewer rows keep the plain walk, one token's path included.
//
// Row invariance: an output element is its weight column's products with its input row,
// summed in input order in one lane, whatever the number of rows in the call or the
// threads, so a token's projections are bit-identical in a one-token decode and in a verify
// window (the stock kernels pick different summation orders for different row counts).

#include "cpu_kernels.h"

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specdec_cpu {
namespace {

// Output columns a packed block holds: two registers of fp32 sums.
constexpr int64_t kBlockColumns = 32;
// Input rows summed at once at most: 2 x 10 registers of sums, of the 32 (12 spilled).
constexpr int64_t kTileRows = 10;
// Blocks a thread takes at least (256 columns): forking for less costs more than it saves.
constexpr int64_t kMinBlocksPerThread = 8;
// Rows the chunked walk takes at most (its sums live on the stack); more go by linear_rows.
constexpr int64_t kMaxRowsChunked = 40;

#if defined(__AVX512F__)

struct Fp32Ops {
  using T = float;
  using W = float;  // the packed weight's elements
  static constexpr int64_t kPair = 1;  // input elements a broadcast carries
  static constexpr int64_t kRowElements = kBlockColumns;  // of W, a block's pair row
  using Vec = __m512;
  static Vec load(const T* p) { return _mm512_loadu_ps(p); }
  // A pair row's two registers: columns 0-15, 16-31.
  void load_row(const W* w, Vec& w0, Vec& w1) const { w0 = load(w), w1 = load(w + 16); }
  static Vec broadcast(const T* x) { return _mm512_set1_ps(*x); }
  static Vec broadcast_last(const T* x) { return _mm512_set1_ps(*x); }
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
  static __m512 load_bias(const T* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
  static void store(T* out, __m512 sums, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, sums); }
};

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define SPECDEC_HAS_BF16_KERNEL 1
struct Bf16Ops {
  using T = at::BFloat16;
  using W = at::BFloat16;
  static constexpr int64_t kPair = 2;
  static constexpr int64_t kRowElements = 2 * kBlockColumns;
  using Vec = __m512bh;
  static Vec load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  void load_row(const W* w, Vec& w0, Vec& w1) const { w0 = load(w), w1 = load(w + 32); }
  // The pair x[0], x[1] in every fp32 lane.
  static Vec broadcast(const T* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  // An odd width's last element, its pair's other half 0 (its weight is the packing's 0).
  static Vec broadcast_last(const T* x) { return (__m512bh)_mm512_set1_epi32(x->x); }
  // acc += w[2i] x[2i] + w[2i+1] x[2i+1] in each fp32 lane.
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
  static __m512 load_bias(const T* b, __mmask16 mask) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));  // exact
  }
  // Rounded to nearest even, as torch rounds fp32 to bf16.
  static void store(T* out, __m512 sums, __mmask16 mask) {
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(sums));
  }
};

#endif

#if defined(__AVX512VBMI__)
#define SPECDEC_HAS_INT8_KERNEL 1
// Weight-only int8: the sums of the integer weights' products with the rows, then each
// output column's scale. A weight q (|q| <= 127) is packed as one byte, sign and magnitude,
// and becomes bf16 in registers, exactly (q needs at most 7 significant bits): two byte
// lookups (vpermi2b on 128-entry tables) give the bf16's low and high bytes of |q|, the sign
// goes into the high byte, and unpacking the two byte vectors interleaves them into 16-bit
// lanes. The packing orders the 64 bytes of a pair row so that the unpacks, which work
// within 128-bit lanes, yield the pair row's two registers as Bf16Ops loads them. Five
// instructions a pair row, shared by up to ten rows, for half the bytes of bf16 to read.
struct Int8Codes {
  __m512i low0, low1, high0, high1;  // bf16(m)'s low and high bytes, m = 0..63, 64..127
  __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));

  struct Tables {
    alignas(64) uint8_t low[128];
    alignas(64) uint8_t high[128];
  };
  // Made once (a function-local static), loaded into registers by each kernel call.
  static const Tables& tables() {
    static const Tables made = [] {
      Tables t;
      for (int m = 0; m < 128; ++m) {
        const uint16_t bits = from_float<at::BFloat16>(static_cast<float>(m)).x;  // exact
        t.low[m] = static_cast<uint8_t>(bits & 0xFF);
        t.high[m] = static_cast<uint8_t>(bits >> 8);
      }
      return t;
    }();
    return made;
  }
  Int8Codes() {
    const Tables& t = tables();
    low0 = _mm512_load_si512(t.low), low1 = _mm512_load_si512(t.low + 64);
    high0 = _mm512_load_si512(t.high), high1 = _mm512_load_si512(t.high + 64);
  }
  // A pair row's 64 codes as bf16 bits: columns 0-15 and 16-31, a (k, k + 1) pair a lane.
  void decode(const uint8_t* w, __m512i& w0, __m512i& w1) const {
    const __m512i codes = _mm512_loadu_si512(w);
    const __m512i low = _mm512_permutex2var_epi8(low0, codes, low1);  // the index's bit 7 is ignored
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, codes, high1), codes, sign,
                                                   0xF8);  // high | (codes & 0x80)
    w0 = _mm512_unpacklo_epi8(low, high);
    w1 = _mm512_unpackhi_epi8(low, high);
  }
};

#if defined(SPECDEC_HAS_BF16_KERNEL)
#define SPECDEC_HAS_INT8_BF16_KERNEL 1
// bf16 rows: the decoded pairs go through vdpbf16ps as Bf16Ops's weights do.
struct Int8Bf16Ops : Bf16Ops {
  using W = uint8_t;
  static constexpr int64_t kRowElements = 2 * kBlockColumns;  // bytes
  Int8Codes codes;
  void load_row(const W* w, Vec& w0, Vec& w1) const {
    __m512i pairs0, pairs1;
    codes.decode(w, pairs0, pairs1);
    w0 = (__m512bh)pairs0, w1 = (__m512bh)pairs1;
  }
};
#endif

// fp32 rows: each decoded bf16 widened to fp32 (exact: its bits in a lane's high half), and
// a lane's two inputs k, k + 1 multiplied and added one after the other, in input order.
// The bias and the stores are Fp32Ops's.
struct Int8Fp32Ops : Fp32Ops {
  using W = uint8_t;
  static constexpr int64_t kPair = 2;
  static constexpr int64_t kRowElements = 2 * kBlockColumns;  // bytes
  struct Vec {
    __m512 first, second;  // at k = 2p and 2p + 1
  };
  Int8Codes codes;
  static Vec widen(__m512i pairs) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  void load_row(const W* w, Vec& w0, Vec& w1) const {
    __m512i pairs0, pairs1;
    codes.decode(w, pairs0, pairs1);
    w0 = widen(pairs0), w1 = widen(pairs1);
  }
  static Vec broadcast(const T* x) { return {_mm512_set1_ps(x[0]), _mm512_set1_ps(x[1])}; }
  // An odd width's last element, its pair's other half 0 (its weight is the packing's 0).
  static Vec broadcast_last(const T* x) { return {_mm512_set1_ps(x[0]), _mm512_setzero_ps()}; }
  static __m512 dot(__m512 acc, const Vec& w, const Vec& x) {
    return _mm512_fmadd_ps(w.second, x.second, _mm512_fmadd_ps(w.first, x.first, acc));
  }
};
#endif

// Columns [n, n + 32) of a row's output from its two registers of sums: times the int8
// weights' scales (when given), plus the bias (when given), rounded to the rows' dtype.
template <typename Ops>
struct BlockOutput {
  using T = typename Ops::T;
  __mmask16 lo_mask, hi_mask;
  bool scaled;
  __m512 lo_scale, hi_scale, lo_bias = _mm512_setzero_ps(), hi_bias = _mm512_setzero_ps();

  BlockOutput(const float* scales, const T* bias, int64_t N, int64_t n) : scaled(scales != nullptr) {
    const int64_t columns = std::min<int64_t>(kBlockColumns, N - n);
    lo_mask = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
    hi_mask = columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
    lo_scale = scaled ? _mm512_maskz_loadu_ps(lo_mask, scales + n) : _mm512_setzero_ps();
    hi_scale = scaled ? _mm512_maskz_loadu_ps(hi_mask, scales + n + 16) : _mm512_setzero_ps();
    if (bias != nullptr) {
      lo_bias = Ops::load_bias(bias + n, lo_mask);
      hi_bias = Ops::load_bias(bias + n + 16, hi_mask);
    }
  }
  // `out`: the row's output at column n. Scaled sums take the bias in one fused multiply-add,
  // written out: a multiply and an add left to the compiler may be fused in one walk's
  // inlined copy and not in another's (with the chunked walk's own epilogue, one output in
  // ~10^5 differed between 40 rows and 45), and a row's outputs must not depend on the walk.
  void store(__m512 lo, __m512 hi, T* out) const {
    if (scaled) {
      lo = _mm512_fmadd_ps(lo, lo_scale, lo_bias), hi = _mm512_fmadd_ps(hi, hi_scale, hi_bias);
    } else {
      lo = _mm512_add_ps(lo, lo_bias), hi = _mm512_add_ps(hi, hi_bias);
    }
    Ops::store(out, lo, lo_mask);
    Ops::store(out + 16, hi, hi_mask);
  }
};

// One tile's sums over pair rows [0, pairs) of a chunk at w, carried in `acc` (2 * MR
// vectors: each row's lo then hi) from the chunk before; `last_odd`: K is odd and the chunk
// ends the block, so its last pair row holds the final element alone. While summing, the
// next chunk's lines are prefetched (`ahead`, or nullptr), `lines_per_step` a pair row.
template <typename Ops, int MR>
inline void tile_chunk(const Ops& ops, const typename Ops::W* w, const typename Ops::T* x, int64_t K,
                       int64_t p0, int64_t pairs, bool last_odd, __m512* acc, const char* ahead,
                       int64_t lines_per_step) {
  using Vec = typename Ops::Vec;
  constexpr int64_t kPair = Ops::kPair;
  __m512 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = acc[2 * m], hi[m] = acc[2 * m + 1];
  Vec w0, w1;
  const int64_t full = last_odd ? pairs - 1 : pairs;
  for (int64_t p = 0; p < full; ++p, w += Ops::kRowElements) {
    if (ahead != nullptr) {
      for (int64_t line = 0; line < lines_per_step; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
      ahead += lines_per_step * 64;
    }
    ops.load_row(w, w0, w1);
    for (int m = 0; m < MR; ++m) {
      const Vec b = Ops::broadcast(x + m * K + (p0 + p) * kPair);
      lo[m] = Ops::dot(lo[m], w0, b);
      hi[m] = Ops::dot(hi[m], w1, b);
    }
  }
  if (last_odd) {
    ops.load_row(w, w0, w1);
    for (int m = 0; m < MR; ++m) {
      const Vec b = Ops::broadcast_last(x + m * K + K - 1);
      lo[m] = Ops::dot(lo[m], w0, b);
      hi[m] = Ops::dot(hi[m], w1, b);
    }
  }
  for (int m = 0; m < MR; ++m) acc[2 * m] = lo[m], acc[2 * m + 1] = hi[m];
}

// Columns [n, n + 32) of the MR input rows at x, from their packed block ([pairs, 32, kPair]),
// times `scales` (int8 weights; else nullptr) plus `bias` (or nullptr): the whole block as
// one chunk. Each output lane sums its products in input order in one fp32 register lane.
template <typename Ops, int MR>
inline void block_rows(const Ops& ops, const typename Ops::W* block, const typename Ops::T* x,
                       const float* scales, const typename Ops::T* bias, typename Ops::T* out, int64_t K,
                       int64_t N, int64_t n) {
  constexpr int64_t kPair = Ops::kPair;
  __m512 acc[2 * MR];
  for (int i = 0; i < 2 * MR; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t pairs = (K + kPair - 1) / kPair;
  tile_chunk<Ops, MR>(ops, block, x, K, 0, pairs, pairs * kPair > K, acc, nullptr, 0);
  const BlockOutput<Ops> output(scales, bias, N, n);
  for (int m = 0; m < MR; ++m) output.store(acc[2 * m], acc[2 * m + 1], out + m * N + n);
}

// One call's operands, read once for every thread's walk.
template <typename Ops>
struct Operands {
  using T = typename Ops::T;
  using W = typename Ops::W;
  int64_t M, K, N, pairs_per_block, block_elements;
  const W* w;
  const T* x;
  const float* scales;  // int8 weights' per-column scales, or nullptr
  const T* bias;        // or nullptr
  T* out;

  Operands(const at::Tensor& rows, const at::Tensor& packed, const c10::optional<at::Tensor>& scales_,
           const c10::optional<at::Tensor>& bias_, at::Tensor& out_)
      : M(rows.size(0)), K(rows.size(1)), N(out_.size(1)), pairs_per_block(packed.size(1)),
        block_elements(packed.size(1) * Ops::kRowElements), w(static_cast<const W*>(packed.data_ptr())),
        x(rows.data_ptr<T>()), scales(scales_.has_value() ? scales_->data_ptr<float>() : nullptr),
        bias(bias_.has_value() ? bias_->data_ptr<T>() : nullptr), out(out_.data_ptr<T>()) {}
};

// Blocks [begin, end), each whole per tile: the rows in as few tiles as kTileRows allows,
// balanced (17 rows: 9 + 8), so a tile's second pass over the block comes only past
// kTileRows rows.
template <typename Ops>
void plain_walk(const Operands<Ops>& a, int64_t begin, int64_t end) {
  const Ops ops;
  const int64_t M = a.M, K = a.K, N = a.N;
  const int64_t tiles = num_balanced_parts(M, kTileRows);
  for (int64_t block = begin; block < end; ++block) {
    const auto* wb = a.w + block * a.block_elements;
    const int64_t n = block * kBlockColumns;
    for (int64_t tile = 0, m = 0; tile < tiles; ++tile) {
      const int64_t rows = balanced_part(M, tiles, tile);
      const auto* xm = a.x + m * K;
      auto* ym = a.out + m * N;
      switch (rows) {
        case 10: block_rows<Ops, 10>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 9: block_rows<Ops, 9>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 8: block_rows<Ops, 8>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 7: block_rows<Ops, 7>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 6: block_rows<Ops, 6>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 5: block_rows<Ops, 5>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 4: block_rows<Ops, 4>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 3: block_rows<Ops, 3>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        case 2: block_rows<Ops, 2>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
        default: block_rows<Ops, 1>(ops, wb, xm, a.scales, a.bias, ym, K, N, n); break;
      }
      m += rows;
    }
  }
}

// Pair rows a chunk holds: the unit in which rows of several tiles share what was read, and
// the distance the weights are prefetched ahead (8 KB of bf16 or fp32 weights, 4 KB of int8).
constexpr int64_t kChunkPairs = 64;
// Rows from which the chunked walk pays (see the top of the file).
constexpr int64_t kChunkMinRows = 8;

// Blocks [begin, end) in chunks of kChunkPairs pair rows, every tile (as plain_walk's)
// taking a chunk in turn while the first prefetches the next chunk: the same sums in the
// same order, with reading the weights overlapping the multiply-adds.
template <typename Ops>
void chunked_walk(const Operands<Ops>& a, int64_t begin, int64_t end) {
  const Ops ops;
  const int64_t M = a.M, K = a.K, N = a.N;
  const int64_t tiles = num_balanced_parts(M, kTileRows);
  const bool odd = a.pairs_per_block * Ops::kPair > K;
  constexpr int64_t kRowBytes = static_cast<int64_t>(sizeof(typename Ops::W)) * Ops::kRowElements;
  constexpr int64_t kLinesPerStep = (kRowBytes + 63) / 64;
  const auto* range_end = reinterpret_cast<const char*>(a.w + end * a.block_elements);
  __m512 acc[2 * kMaxRowsChunked];  // each row's lo and hi sums, carried from chunk to chunk
  for (int64_t block = begin; block < end; ++block) {
    const auto* wb = a.w + block * a.block_elements;
    for (int64_t i = 0; i < 2 * M; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < a.pairs_per_block; p0 += kChunkPairs) {
      const int64_t pairs = std::min(kChunkPairs, a.pairs_per_block - p0);
      const bool last_odd = odd && p0 + pairs == a.pairs_per_block;
      const auto* chunk = wb + p0 * Ops::kRowElements;
      const char* ahead = reinterpret_cast<const char*>(chunk) + kChunkPairs * kRowBytes;
      if (ahead >= range_end) ahead = nullptr;  // this thread's last chunk
      for (int64_t tile = 0, m = 0; tile < tiles; ++tile) {
        const int64_t rows = balanced_part(M, tiles, tile);
        const auto* xm = a.x + m * K;
        const char* prefetch = tile == 0 ? ahead : nullptr;
        __m512* sums = acc + 2 * m;
        switch (rows) {  // 8 to 40 rows: tiles of 5 (11 rows: 6 + 5) to 10
          case 10: tile_chunk<Ops, 10>(ops, chunk, xm, K, p0, pairs, last_odd, sums, prefetch, kLinesPerStep); break;
          case 9: tile_chunk<Ops, 9>(ops, chunk, xm, K, p0, pairs, last_odd, sums, prefetch, kLinesPerStep); break;
          case 8: tile_chunk<Ops, 8>(ops, chunk, xm, K, p0, pairs, last_odd, sums, prefetch, kLinesPerStep); break;
          case 7: tile_chunk<Ops, 7>(ops, chunk, xm, K, p0, pairs, last_odd, sums, prefetch, kLinesPerStep); break;
          case 6: tile_chunk<Ops, 6>(ops, chunk, xm, K, p0, pairs, last_odd, sums, prefetch, kLinesPerStep); break;
          default: tile_chunk<Ops, 5>(ops, chunk, xm, K, p0, pairs, last_odd, sums, prefetch, kLinesPerStep); break;
        }
        m += rows;
      }
    }
    const int64_t n = block * kBlockColumns;
    const BlockOutput<Ops> output(a.scales, a.bias, N, n);
    for (int64_t m = 0; m < M; ++m) output.store(acc[2 * m], acc[2 * m + 1], a.out + m * N + n);
  }
}

// y = x W^T + b on the packed weight, threads splitting the blocks; 8 to 40 rows take the
// chunked walk (see the top of the file).
template <typename Ops>
void linear_rows(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                 const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const Operands<Ops> operands(x, packed, scales, bias, out);
  const bool chunked = operands.M >= kChunkMinRows && operands.M <= kMaxRowsChunked;
  at::parallel_for(0, packed.size(0), kMinBlocksPerThread, [&](int64_t begin, int64_t end) {
    if (chunked) {
      chunked_walk<Ops>(operands, begin, end);
    } else {
      plain_walk<Ops>(operands, begin, end);
    }
  });
}

#endif  // __AVX512F__

}  // namespace

bool linear_supports(at::ScalarType dtype, bool int8_weights) {
  if (int8_weights) {
#if defined(SPECDEC_HAS_INT8_BF16_KERNEL)
    if (dtype == at::kBFloat16) return true;
#endif
#if defined(SPECDEC_HAS_INT8_KERNEL)
    if (dtype == at::kFloat) return true;
#endif
    return false;
  }
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
#if defined(SPECDEC_HAS_BF16_KERNEL)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

namespace {

// Input elements a packed lane holds: a bf16 pair (also an int8 pair, whatever the rows'
// dtype), one fp32.
int64_t pair_of(at::ScalarType weight_dtype) { return weight_dtype == at::kFloat ? 1 : 2; }

void check_dtype(at::ScalarType dtype, bool int8_weights) {
  TORCH_CHECK(linear_supports(dtype, int8_weights), "specdec_cpu::linear has no ", dtype,
              int8_weights ? " x int8 weights" : "", " kernel on this machine");
}

// The packed block layout of a [N, K] weight whose elements are `dtype` (kByte: int8 codes).
at::Tensor blocked(const at::Tensor& weight, at::ScalarType dtype) {
  const int64_t N = weight.size(0), K = weight.size(1), P = pair_of(dtype);
  const int64_t blocks = (N + kBlockColumns - 1) / kBlockColumns, pairs = (K + P - 1) / P;
  at::Tensor padded = at::zeros({blocks * kBlockColumns, pairs * P}, weight.options().dtype(dtype));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({blocks, kBlockColumns, pairs, P}).permute({0, 2, 1, 3}).contiguous();
}

}  // namespace

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(),
              "specdec_cpu::pack_weight expects a CPU weight [out, in]; got ", weight.sizes());
  check_dtype(weight.scalar_type(), false);
  return blocked(weight, weight.scalar_type());
}

at::Tensor pack_weight_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && weight.scalar_type() == at::kChar,
              "specdec_cpu::pack_weight_int8 expects a CPU int8 weight [out, in]; got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(linear_supports(at::kFloat, true), "specdec_cpu::pack_weight_int8: no int8 kernel on this machine");
  TORCH_CHECK(weight.numel() == 0 || weight.min().item<int8_t>() > -128,
              "specdec_cpu::pack_weight_int8: weights must lie in [-127, 127] (symmetric int8)");
  // Sign and magnitude, as Int8Codes reads them.
  const at::Tensor magnitude = weight.abs().to(at::kByte);
  const at::Tensor codes = at::where(weight < 0, magnitude.bitwise_or(0x80), magnitude);
  at::Tensor rows = blocked(codes, at::kByte);  // [blocks, pairs, 32, 2]
  // A pair row's 64 bytes reordered for the 128-bit-lane unpacks: the register of columns
  // 0-15 takes bytes 16 L + j (j < 8) of each lane L, the one of columns 16-31 bytes 16 L + 8 + j.
  std::vector<int64_t> order(64);
  for (int64_t word = 0; word < 64; ++word) {
    const int64_t half = word / 32, j = word % 32;
    order[(j / 8) * 16 + half * 8 + j % 8] = word;
  }
  const at::Tensor index = at::tensor(order, at::kLong);
  const int64_t blocks = rows.size(0), pairs = rows.size(1);
  return rows.view({blocks, pairs, 64}).index_select(2, index).view({blocks, pairs, kBlockColumns, 2}).contiguous();
}

void check_packed(const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t in_features,
                  int64_t out_features, at::ScalarType dtype) {
  if (is_gguf_packed(packed)) {
    TORCH_CHECK(scales.has_value(), "specdec_cpu::linear: GGUF weights need their block table");
    return check_gguf_packed(packed, *scales, in_features, out_features, dtype);
  }
  const bool int8_weights = packed.scalar_type() == at::kByte;
  TORCH_CHECK(int8_weights || packed.scalar_type() == dtype, "specdec_cpu::linear: x is ", dtype,
              " but the weight is ", packed.scalar_type());
  check_dtype(dtype, int8_weights);
  const int64_t P = pair_of(packed.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlockColumns && packed.size(3) == P &&
                  packed.size(1) == (in_features + P - 1) / P && out_features > 0 &&
                  packed.size(0) == (out_features + kBlockColumns - 1) / kBlockColumns,
              "specdec_cpu::linear: the packed weight ", packed.sizes(), " is not ",
              int8_weights ? "pack_weight_int8" : "pack_weight", "'s of a [", out_features, ", ", in_features,
              "] weight");
  TORCH_CHECK(packed.is_contiguous() && packed.device().is_cpu(),
              "specdec_cpu::linear: the packed weight must be a contiguous CPU tensor");
  if (int8_weights) {
    TORCH_CHECK(scales.has_value() && scales->dim() == 1 && scales->size(0) == out_features &&
                    scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->device().is_cpu(),
                "specdec_cpu::linear: int8 weights need their scales, a contiguous float32 [out_features]");
  } else {
    TORCH_CHECK(!scales.has_value(), "specdec_cpu::linear: scales go with int8 weights only");
  }
}

namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "specdec_cpu::linear expects x [rows, in] on the CPU; got ",
              x.sizes());
  check_packed(packed, scales, x.size(1), out_features, x.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == x.scalar_type(),
                "specdec_cpu::linear: the bias must be [out] in x's dtype");
  }
}

}  // namespace

void linear_out(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  if (x.size(0) == 0) return;
  // Already contiguous in the decoder stack: no copies (each would be a dispatcher trip).
  const at::Tensor rows = x.is_contiguous() ? x : x.contiguous();
  const c10::optional<at::Tensor> b =
      bias.has_value() ? c10::optional<at::Tensor>(bias->is_contiguous() ? *bias : bias->contiguous()) : c10::nullopt;
  if (is_gguf_packed(packed)) return gguf_linear_out(rows, packed, *scales, b, out);
#if defined(SPECDEC_HAS_INT8_BF16_KERNEL)
  if (packed.scalar_type() == at::kByte && x.scalar_type() == at::kBFloat16) {
    return linear_rows<Int8Bf16Ops>(rows, packed, scales, b, out);
  }
#endif
#if defined(SPECDEC_HAS_INT8_KERNEL)
  if (packed.scalar_type() == at::kByte) return linear_rows<Int8Fp32Ops>(rows, packed, scales, b, out);
#endif
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) linear_rows<Fp32Ops>(rows, packed, c10::nullopt, b, out);
#endif
#if defined(SPECDEC_HAS_BF16_KERNEL)
  if (x.scalar_type() == at::kBFloat16) linear_rows<Bf16Ops>(rows, packed, c10::nullopt, b, out);
#endif
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features, const c10::optional<at::Tensor>& scales) {
  check_inputs(x, packed, scales, bias, out_features);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  linear_out(x, packed, scales, bias, out);
  return out;
}

}  // namespace specdec_cpu

TORCH_LIBRARY(specdec_cpu, m) {
  // scales: int8 weights' per-column scales, or a GGUF weight's block table.
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor? scales=None) -> Tensor");
  m.def("pack_weight(Tensor weight) -> Tensor", &specdec_cpu::pack_weight);
  m.def("pack_weight_int8(Tensor weight) -> Tensor", &specdec_cpu::pack_weight_int8);
  m.def("gguf_supports(ScalarType dtype) -> bool",
        [](at::ScalarType dtype) { return specdec_cpu::gguf_linear_supported(dtype); });
  m.def("gguf_amx(bool? enable=None) -> bool",
        [](c10::optional<bool> enable) { return specdec_cpu::gguf_use_amx(enable); });
  m.def("linear_supports(ScalarType dtype, bool int8_weights=False) -> bool",
        [](at::ScalarType dtype, bool int8_weights) { return specdec_cpu::linear_supports(dtype, int8_weights); });
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("linear", &specdec_cpu::linear); }
