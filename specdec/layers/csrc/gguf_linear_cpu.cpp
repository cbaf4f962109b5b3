// y = x W^T + b where W is held in GGUF's quantized formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K),
// decoded in registers; never dequantised to memory (see specdec/models/gguf_linear.py).
//
// Why: a decode or verify step on a CPU is bound by reading the weights. A GGUF file at
// 4 bits dequantised to bf16 reads ~3.5x the bytes per token; here the kernel reads the
// file's own integers and scales.
//
// Layout (made by specdec/models/gguf_blocks.py, holding exactly the file's values): the
// output columns in blocks of 32, each block one ascending stream of *units* along the input
// (32 inputs for Q8_0 / Q4_0 / Q4_1, a 256-input super-block for Q4_K / Q6_K). A unit is its
// header, then its codes in pair rows (inputs k, k + 1 of the 32 columns: 64 codes):
//
//   format  unit header (32 columns each)                 a pair row's codes
//   Q8_0    d f16                                          64 int8 (in the lookups' unpack order)
//   Q4_0    d f16                                          32 bytes of 4-bit codes u (w = d (u - 8))
//   Q4_1    d f16, m f16                                   32 bytes of u (w = d u + m)
//   Q4_K    d f16, dmin f16, sc u8 [8], m u8 [8]           32 bytes of u (w = d sc_j u - dmin m_j)
//   Q6_K    d f16, sc i8 [16]                              32 bytes of low 4 bits, 16 of high 2 (w = d sc_j (q - 32))
//
// A block's format is its own (a table row: byte offset, GGML type id, first output column,
// column count), so a fused projection whose parts the file stores in different formats
// (Q4_K_M's q/k at Q4_K, v at Q6_K) is one operand.
//
// How: each pair row's codes become bf16 pairs in registers (4- and 6-bit codes by two byte
// lookups, vpermb, that give the bf16's low and high bytes; int8 by two 128-entry lookups,
// vpermi2b, of its magnitude, the sign or-ed in), all exact;
// bf16 rows multiply them by vdpbf16ps (or, where the CPU has AMX, by tile products: see
// "AMX" below), fp32 rows widen them and use FMAs. The products of a
// scale group (32 inputs, 16 for Q6_K) are summed in fp32 apart and then scaled into the
// row's sums: acc += part * scale (+ min * sum of the group's inputs, precomputed per row).
// So the result is the dequantised weight's product up to fp32 summation order (and, for
// bf16 rows, the output's rounding): tests hold it to that (tests/unit/test_gguf_linear.py).
//
// Row invariance: a row's sums take the same operations in the same order whatever the
// number of rows in the call (tiles of up to kQuantTileRows rows share each decoded pair
// row; every fused multiply-add is written out), and threads split the blocks. A call of
// more rows than one tile decodes each unit once into a buffer that every tile reads (the
// same values), its sums kept in memory between units (exactly).

#include "cpu_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specdec_cpu {
namespace {

constexpr int64_t kBlockColumns = 32;
// Rows summed at once at most: each row holds 2 registers of sums and 2 of a group's part.
constexpr int64_t kQuantTileRows = 6;
constexpr int64_t kMinBlocksPerThread = 8;
constexpr int64_t kMinGroup = 32;  // the inputs a min-sum covers (Q4_1, Q4_K)
// How far ahead of its decoding a block's stream of codes is fetched (the hardware's
// prefetcher alone leaves a one-row decode waiting on memory).
constexpr int64_t kPrefetchBytes = 2048;

// GGML's type ids.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

struct FormatShape {
  int64_t unit_inputs, header_bytes, pair_row_bytes;
};

bool shape_of(int64_t format, FormatShape& shape) {
  switch (format) {
    case kQ8_0: shape = {32, 64, 64}; return true;
    case kQ4_0: shape = {32, 64, 32}; return true;
    case kQ4_1: shape = {32, 128, 32}; return true;
    case kQ4_K: shape = {256, 64 + 64 + 8 * 32 + 8 * 32, 32}; return true;
    case kQ6_K: shape = {256, 64 + 16 * 32, 48}; return true;
    default: return false;
  }
}

int64_t unit_bytes(const FormatShape& s) { return s.header_bytes + s.unit_inputs / 2 * s.pair_row_bytes; }

}  // namespace

int64_t gguf_block_bytes(int64_t format, int64_t in_features) {
  FormatShape shape;
  if (!shape_of(format, shape) || in_features % shape.unit_inputs != 0) return -1;
  return in_features / shape.unit_inputs * unit_bytes(shape);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define SPECDEC_HAS_GGUF_KERNEL 1
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
// The AMX path is compiled into the AVX-512 build (by GCC, whose target pragma it uses) and
// taken where the CPU has the tiles and the kernel grants the process their state (Linux 5.16 on).
#define SPECDEC_HAS_AMX 1
// Whether bf16 rows take the AMX path (see there; gguf_use_amx sets it).
std::atomic<bool>& amx_enabled();
#endif

namespace {

// bf16 bits of small integers, as two 64-byte tables (low bytes, high bytes) for vpermb.
struct LookupTable {
  __m512i low, high;
  explicit LookupTable(int offset) {
    alignas(64) uint8_t lo[64], hi[64];
    for (int i = 0; i < 64; ++i) {
      const uint16_t bits = from_float<at::BFloat16>(static_cast<float>(i + offset)).x;  // exact
      lo[i] = static_cast<uint8_t>(bits & 0xFF), hi[i] = static_cast<uint8_t>(bits >> 8);
    }
    low = _mm512_load_si512(lo), high = _mm512_load_si512(hi);
  }
  // 64 indices (positions ordered for the unpacks) -> a pair row's two registers of bf16 pairs.
  void decode(__m512i index, __m512i& w0, __m512i& w1) const {
    const __m512i lo = _mm512_permutexvar_epi8(index, low), hi = _mm512_permutexvar_epi8(index, high);
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

// 32 bytes of 4-bit codes -> 64 byte indices: bytes 0-31 the low nibbles, 32-63 the high.
inline __m512i nibbles(const uint8_t* p) {
  const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i shifted = _mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
  return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
}

// Q8_0: bf16(q) = sign(q) | bf16(|q|), so two 128-entry lookups (vpermi2b) by |q| give the
// bf16's low and high bytes and the sign is or-ed in. |q| = 128 (q = -128) indexes entry 0 as
// 0 does: their low bytes agree (0x00), the high table holds 128's at entry 0 and q = 0 is
// masked to zero. The codes are stored in the lookups' unpack order (like the 4-bit ones).
struct Int8Codes {
  static constexpr int64_t kBytes = 64;
  __m512i low0, low1, high0, high1;
  Int8Codes() {
    alignas(64) uint8_t lo[128], hi[128];
    for (int i = 0; i < 128; ++i) {
      const uint16_t bits = from_float<at::BFloat16>(static_cast<float>(i == 0 ? 128 : i)).x;  // exact
      lo[i] = static_cast<uint8_t>(bits & 0xFF), hi[i] = static_cast<uint8_t>(bits >> 8);
    }
    low0 = _mm512_load_si512(lo), low1 = _mm512_load_si512(lo + 64);
    high0 = _mm512_load_si512(hi), high1 = _mm512_load_si512(hi + 64);
  }
  void decode(const uint8_t* p, __m512i& w0, __m512i& w1) const {
    const __m512i q = _mm512_loadu_si512(p);
    const __m512i magnitude = _mm512_abs_epi8(q);
    const __m512i lo = _mm512_permutex2var_epi8(low0, magnitude, low1);
    const __m512i high = _mm512_maskz_permutex2var_epi8(_mm512_test_epi8_mask(q, q), high0, magnitude, high1);
    const __m512i hi = _mm512_ternarylogic_epi32(high, q, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // high | (q & sign)
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

struct NibbleCodes {
  static constexpr int64_t kBytes = 32;
  LookupTable table;
  explicit NibbleCodes(int offset) : table(offset) {}
  void decode(const uint8_t* p, __m512i& w0, __m512i& w1) const { table.decode(nibbles(p), w0, w1); }
};

// Q6_K: the low 4 bits as NibbleCodes, then 16 bytes holding each index's high 2 bits (index
// 16 L + i in byte i, bits 2L and 2L + 1).
struct SixBitCodes {
  static constexpr int64_t kBytes = 48;
  LookupTable table{-32};
  void decode(const uint8_t* p, __m512i& w0, __m512i& w1) const {
    const __m512i high = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)));
    const __m512i counts = _mm512_set_epi64(0x0006000600060006LL, 0x0006000600060006LL, 0x0004000400040004LL,
                                            0x0004000400040004LL, 0x0002000200020002LL, 0x0002000200020002LL, 0, 0);
    const __m512i bits = _mm512_and_si512(_mm512_srlv_epi16(high, counts), _mm512_set1_epi8(0x03));
    table.decode(_mm512_or_si512(nibbles(p), _mm512_slli_epi16(bits, 4)), w0, w1);
  }
};

struct Bf16Rows {
  using T = at::BFloat16;
  using W = __m512bh;
  using X = __m512bh;
  static W weights(__m512i pairs) { return (__m512bh)pairs; }
  static X broadcast(const T* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 dot(__m512 acc, W w, X x) { return _mm512_dpbf16_ps(acc, w, x); }
  static __m512 load_bias(const T* b, __mmask16 mask) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(T* out, __m512 sums, __mmask16 mask) {
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(sums));
  }
  // 16 values from p as fp32.
  static __m512 widen(const T* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
};

struct Fp32Rows {
  using T = float;
  struct W {
    __m512 first, second;  // the weights at k = 2p and 2p + 1
  };
  using X = W;
  static W weights(__m512i pairs) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  static X broadcast(const T* x) { return {_mm512_set1_ps(x[0]), _mm512_set1_ps(x[1])}; }
  static __m512 dot(__m512 acc, const W& w, const X& x) {
    return _mm512_fmadd_ps(w.second, x.second, _mm512_fmadd_ps(w.first, x.first, acc));
  }
  static __m512 load_bias(const T* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
  static void store(T* out, __m512 sums, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, sums); }
  static __m512 widen(const T* p) { return _mm512_loadu_ps(p); }
};

// A unit's pair rows decoded once (bf16 pairs, 2 registers a pair row), for calls with more
// rows than one tile: every tile then reads them instead of decoding the codes again. The
// values are the decoders' own, so a row's sums do not depend on which path ran.
struct Decoded {
  static constexpr int64_t kBytes = 128;
  static void decode(const uint8_t* p, __m512i& w0, __m512i& w1) {
    w0 = _mm512_load_si512(p);
    w1 = _mm512_load_si512(p + 64);
  }
};

// part[2m], part[2m + 1] (columns 0-15, 16-31 of row m) = the products of `pairs` pair rows
// of codes at p with the MR rows' inputs [k0, k0 + 2 pairs), summed in input order.
template <typename Rows, typename Codes, int MR>
inline void group_sums(const Codes& codes, const uint8_t* p, int64_t pairs, const typename Rows::T* x, int64_t K,
                       int64_t k0, __m512* part) {
  for (int i = 0; i < 2 * MR; ++i) part[i] = _mm512_setzero_ps();
  for (int64_t r = 0; r < pairs; ++r, p += Codes::kBytes) {
    if constexpr (!std::is_same_v<Codes, Decoded>) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
    __m512i pairs0, pairs1;
    codes.decode(p, pairs0, pairs1);
    const typename Rows::W w0 = Rows::weights(pairs0), w1 = Rows::weights(pairs1);
    for (int m = 0; m < MR; ++m) {
      const typename Rows::X b = Rows::broadcast(x + m * K + k0 + 2 * r);
      part[2 * m] = Rows::dot(part[2 * m], w0, b);
      part[2 * m + 1] = Rows::dot(part[2 * m + 1], w1, b);
    }
  }
}

inline __m512 halves(const uint8_t* f16, int half) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f16 + 32 * half)));
}
inline __m512 bytes_as_floats(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

// acc += part * scale (+ min * the group's input sum) for each of the MR rows.
template <int MR>
inline void scale_into(__m512* acc, const __m512* part, __m512 scale_lo, __m512 scale_hi) {
  for (int m = 0; m < MR; ++m) {
    acc[2 * m] = _mm512_fmadd_ps(part[2 * m], scale_lo, acc[2 * m]);
    acc[2 * m + 1] = _mm512_fmadd_ps(part[2 * m + 1], scale_hi, acc[2 * m + 1]);
  }
}
template <int MR>
inline void add_mins(__m512* acc, __m512 min_lo, __m512 min_hi, const float* group_sums, int64_t sums_per_row) {
  for (int m = 0; m < MR; ++m) {
    const __m512 s = _mm512_set1_ps(group_sums[m * sums_per_row]);
    acc[2 * m] = _mm512_fmadd_ps(min_lo, s, acc[2 * m]);
    acc[2 * m + 1] = _mm512_fmadd_ps(min_hi, s, acc[2 * m + 1]);
  }
}

struct Decoders {
  Int8Codes int8;
  NibbleCodes signed4{-8}, unsigned4{0};
  SixBitCodes six;
};

// One call's operands.
template <typename Rows>
struct QuantOperands {
  using T = typename Rows::T;
  int64_t M, K, N;
  const uint8_t* bytes;
  const int64_t* table;  // [blocks, 4]
  const T* x;
  const float* sums;  // [M, K / kMinGroup] input sums, or nullptr
  const T* bias;
  T* out;
};

// The most pair rows a unit holds (Q4_K and Q6_K: 256 inputs).
constexpr int64_t kMaxUnitPairs = 128;

// A unit's scale groups in input order, each with its scales for the 32 columns (and its
// min, for Q4_1 and Q4_K): visit(first pair row, pair rows, scales).
struct GroupScales {
  __m512 scale_lo, scale_hi, min_lo, min_hi;
  bool has_min;
};
template <typename Visit>
inline void unit_groups(const uint8_t* unit, int64_t format, Visit&& visit) {
  const __m512 zero = _mm512_setzero_ps();
  switch (format) {
    case kQ8_0:
    case kQ4_0:
      visit(0, 16, GroupScales{halves(unit, 0), halves(unit, 1), zero, zero, false});
      break;
    case kQ4_1:
      visit(0, 16, GroupScales{halves(unit, 0), halves(unit, 1), halves(unit + 64, 0), halves(unit + 64, 1), true});
      break;
    case kQ4_K: {
      const __m512 d_lo = halves(unit, 0), d_hi = halves(unit, 1);
      const __m512 dmin_lo = halves(unit + 64, 0), dmin_hi = halves(unit + 64, 1);
      const uint8_t* sc = unit + 128;
      const uint8_t* mins = sc + 8 * 32;
      for (int64_t j = 0; j < 8; ++j) {
        // -(dmin m): exact, as the dequantised weight's term.
        visit(16 * j, 16,
              GroupScales{_mm512_mul_ps(d_lo, bytes_as_floats(sc + 32 * j, false)),
                          _mm512_mul_ps(d_hi, bytes_as_floats(sc + 32 * j + 16, false)),
                          _mm512_mul_ps(dmin_lo, _mm512_sub_ps(zero, bytes_as_floats(mins + 32 * j, false))),
                          _mm512_mul_ps(dmin_hi, _mm512_sub_ps(zero, bytes_as_floats(mins + 32 * j + 16, false))),
                          true});
      }
      break;
    }
    default: {  // kQ6_K
      const __m512 d_lo = halves(unit, 0), d_hi = halves(unit, 1);
      const uint8_t* sc = unit + 64;
      for (int64_t j = 0; j < 16; ++j) {
        visit(8 * j, 8,
              GroupScales{_mm512_mul_ps(d_lo, bytes_as_floats(sc + 32 * j, true)),
                          _mm512_mul_ps(d_hi, bytes_as_floats(sc + 32 * j + 16, true)), zero, zero, false});
      }
      break;
    }
  }
}

// Calls f with the decoder of a format's codes.
template <typename F>
inline void with_decoder(const Decoders& d, int64_t format, F&& f) {
  switch (format) {
    case kQ8_0: f(d.int8); break;
    case kQ4_0: f(d.signed4); break;
    case kQ4_1: case kQ4_K: f(d.unsigned4); break;
    default: f(d.six); break;  // kQ6_K
  }
}

// Pair rows [first, first + pairs) of a unit's codes (`codes`: the unit's first pair row)
// decoded into `decoded` (Decoded's layout, 128 bytes a pair row).
inline void decode_pairs(const Decoders& d, int64_t format, const uint8_t* codes, int64_t first, int64_t pairs,
                         uint8_t* decoded) {
  with_decoder(d, format, [&](const auto& decoder) {
    using Codes = std::decay_t<decltype(decoder)>;
    const uint8_t* p = codes + first * Codes::kBytes;
    for (int64_t r = 0; r < pairs; ++r, p += Codes::kBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
      __m512i w0, w1;
      decoder.decode(p, w0, w1);
      _mm512_store_si512(decoded + r * Decoded::kBytes, w0);
      _mm512_store_si512(decoded + r * Decoded::kBytes + 64, w1);
    }
  });
}

// One unit (inputs k0 on) of a block into the MR rows' sums `acc`; x and sums start at the
// tile's first row. kPredecoded: the codes come from decode_pairs's `decoded`, else from the
// unit itself.
template <typename Rows, int MR, bool kPredecoded>
inline void unit_rows(const Decoders& d, const QuantOperands<Rows>& a, const uint8_t* unit, int64_t format,
                      int64_t header_bytes, const uint8_t* decoded, const typename Rows::T* x, const float* sums,
                      int64_t k0, __m512* acc) {
  const int64_t K = a.K, groups_per_row = K / kMinGroup;
  const uint8_t* codes = unit + header_bytes;
  __m512 part[2 * MR];
  with_decoder(d, format, [&](const auto& decoder) {
    using Codes = std::decay_t<decltype(decoder)>;
    unit_groups(unit, format, [&](int64_t first, int64_t pairs, const GroupScales& g) {
      // The products of `pairs` pair rows from pair row `first` (inputs k0 + 2 first on).
      if constexpr (kPredecoded) {
        group_sums<Rows, Decoded, MR>(Decoded{}, decoded + first * Decoded::kBytes, pairs, x, K, k0 + 2 * first, part);
      } else {
        group_sums<Rows, Codes, MR>(decoder, codes + first * Codes::kBytes, pairs, x, K, k0 + 2 * first, part);
      }
      scale_into<MR>(acc, part, g.scale_lo, g.scale_hi);
      if (g.has_min) add_mins<MR>(acc, g.min_lo, g.min_hi, sums + (k0 + 2 * first) / kMinGroup, groups_per_row);
    });
  });
}

// Row m's outputs of the block at column n: its sums plus the bias.
template <typename Rows>
inline void store_row(const QuantOperands<Rows>& a, int64_t m, int64_t n, int64_t columns, __m512 lo, __m512 hi) {
  const __mmask16 lo_mask = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 hi_mask = columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  __m512 lo_bias = _mm512_setzero_ps(), hi_bias = _mm512_setzero_ps();
  if (a.bias != nullptr) lo_bias = Rows::load_bias(a.bias + n, lo_mask), hi_bias = Rows::load_bias(a.bias + n + 16, hi_mask);
  typename Rows::T* o = a.out + m * a.N + n;
  Rows::store(o, _mm512_add_ps(lo, lo_bias), lo_mask);
  Rows::store(o + 16, _mm512_add_ps(hi, hi_bias), hi_mask);
}

// Block `block`'s columns for all MR rows of the call (one tile), decoding in registers.
template <typename Rows, int MR>
void block_rows(const Decoders& d, const QuantOperands<Rows>& a, int64_t block) {
  const int64_t* row = a.table + 4 * block;
  const uint8_t* unit = a.bytes + row[0];
  const int64_t format = row[1];
  FormatShape shape;
  shape_of(format, shape);
  const int64_t per_unit = unit_bytes(shape);
  __m512 acc[2 * MR];
  for (int i = 0; i < 2 * MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < a.K; k0 += shape.unit_inputs, unit += per_unit) {
    unit_rows<Rows, MR, false>(d, a, unit, format, shape.header_bytes, nullptr, a.x, a.sums, k0, acc);
  }
  for (int m = 0; m < MR; ++m) store_row(a, m, row[2], row[3], acc[2 * m], acc[2 * m + 1]);
}

// One tile's MR rows from row m0 for one unit, their sums kept in `sums_out` ([M, 32]) between units.
template <typename Rows, int MR>
void tile_unit(const Decoders& d, const QuantOperands<Rows>& a, const uint8_t* unit, int64_t format,
               int64_t header_bytes, const uint8_t* decoded, int64_t m0, int64_t k0, float* sums_out) {
  __m512 acc[2 * MR];
  float* s = sums_out + m0 * kBlockColumns;
  for (int i = 0; i < 2 * MR; ++i) acc[i] = _mm512_loadu_ps(s + 16 * i);
  const float* sums = a.sums == nullptr ? nullptr : a.sums + m0 * (a.K / kMinGroup);
  unit_rows<Rows, MR, true>(d, a, unit, format, header_bytes, decoded, a.x + m0 * a.K, sums, k0, acc);
  for (int i = 0; i < 2 * MR; ++i) _mm512_storeu_ps(s + 16 * i, acc[i]);
}

// Block `block`'s columns for a call of several tiles: each unit decoded once, then read by
// every tile. `decoded` holds kMaxUnitPairs pair rows, `sums_out` M x 32 floats.
template <typename Rows>
void block_tiles(const Decoders& d, const QuantOperands<Rows>& a, int64_t block, uint8_t* decoded, float* sums_out) {
  const int64_t* row = a.table + 4 * block;
  const uint8_t* unit = a.bytes + row[0];
  const int64_t format = row[1];
  FormatShape shape;
  shape_of(format, shape);
  const int64_t per_unit = unit_bytes(shape), tiles = num_balanced_parts(a.M, kQuantTileRows);
  std::fill(sums_out, sums_out + a.M * kBlockColumns, 0.f);
  for (int64_t k0 = 0; k0 < a.K; k0 += shape.unit_inputs, unit += per_unit) {
    decode_pairs(d, format, unit + shape.header_bytes, 0, shape.unit_inputs / 2, decoded);
    for (int64_t tile = 0, m = 0; tile < tiles; ++tile) {
      const int64_t rows = balanced_part(a.M, tiles, tile);
      switch (rows) {
        case 6: tile_unit<Rows, 6>(d, a, unit, format, shape.header_bytes, decoded, m, k0, sums_out); break;
        case 5: tile_unit<Rows, 5>(d, a, unit, format, shape.header_bytes, decoded, m, k0, sums_out); break;
        case 4: tile_unit<Rows, 4>(d, a, unit, format, shape.header_bytes, decoded, m, k0, sums_out); break;
        case 3: tile_unit<Rows, 3>(d, a, unit, format, shape.header_bytes, decoded, m, k0, sums_out); break;
        case 2: tile_unit<Rows, 2>(d, a, unit, format, shape.header_bytes, decoded, m, k0, sums_out); break;
        default: tile_unit<Rows, 1>(d, a, unit, format, shape.header_bytes, decoded, m, k0, sums_out); break;
      }
      m += rows;
    }
  }
  for (int64_t m = 0; m < a.M; ++m) {
    const float* s = sums_out + m * kBlockColumns;
    store_row(a, m, row[2], row[3], _mm512_loadu_ps(s), _mm512_loadu_ps(s + 16));
  }
}

template <typename Rows>
void walk(const QuantOperands<Rows>& a, int64_t begin, int64_t end) {
  static const Decoders decoders;  // its lookup tables, built once
  if (a.M > kQuantTileRows) {
    alignas(64) uint8_t decoded[kMaxUnitPairs * Decoded::kBytes];
    std::vector<float> sums_out(a.M * kBlockColumns);
    for (int64_t block = begin; block < end; ++block) block_tiles(decoders, a, block, decoded, sums_out.data());
    return;
  }
  for (int64_t block = begin; block < end; ++block) {
    switch (a.M) {
      case 6: block_rows<Rows, 6>(decoders, a, block); break;
      case 5: block_rows<Rows, 5>(decoders, a, block); break;
      case 4: block_rows<Rows, 4>(decoders, a, block); break;
      case 3: block_rows<Rows, 3>(decoders, a, block); break;
      case 2: block_rows<Rows, 2>(decoders, a, block); break;
      default: block_rows<Rows, 1>(decoders, a, block); break;
    }
  }
}

#if defined(SPECDEC_HAS_AMX)
// ---- AMX: bf16 rows by tile products (Sapphire Rapids and later) ----
//
// Where the CPU has AMX tiles (and the kernel lets it use them: `gguf_use_amx`), bf16 rows
// take this path for every row count, one row included: a group's pair rows, decoded as above
// into a buffer, are a tile of weights in the layout `tdpbf16ps` reads (16 pair rows of 16
// columns), the rows' inputs of that group a tile of up to 16 rows, so one instruction gives
// up to 16 rows' products for 16 columns. A verify window's further rows then cost a tile's
// rows, not two `vdpbf16ps` a pair row each. The tile's fp32 sums are not `vdpbf16ps`'s
// (its order of rounding is the hardware's own), so one path serves all row counts: a row's
// products are the same tile operations whatever the call's other rows, and its sums take
// them group by group in input order as above (scaled into the row's sums, plus the min).
//
// Q6_K's groups are 16 inputs, half a tile's depth: two of them share one product, each row
// of inputs given as two tile rows (the first group's 16 inputs then zeros, zeros then the
// second's), so the product's rows 2m and 2m + 1 are row m's two groups. Its tiles hold 8
// rows of inputs, and every Q6_K product is made so whatever the call's rows.
//
// Up to two tiles of rows (a verify window), each product's 16 pair rows are decoded a few
// products before it is made, into a ring of buffers (so that its tile loads never wait on
// the stores just made), and both tiles read them; up to kRegisterRows rows, the rows' sums
// stay in registers through the block. More rows (a prefill chunk), each block is decoded
// whole once into a per-thread buffer that every tile reads.
//
// (This part is compiled for the tile instructions as a whole, lambdas included, so that the
// products and the decoding inline into each walk.)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

constexpr int64_t kAmxRows = 16;
constexpr int64_t kProductPairs = 16;  // a product's pair rows (32 inputs)
// How many products ahead of its tile product the ring is decoded (bench forward at 0.8B
// Q4_K_M, one row: 1 ahead 1.15-1.18x the vdpbf16ps path's time, 2 1.11x, 3 1.06-1.10x, 5 1.12x).
constexpr int64_t kAhead = 3;
// The most rows whose sums a block holds in registers (two a row).
constexpr int64_t kRegisterRows = 8;

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Two sets of tiles share the weights (tiles 3, 4: 16 pair rows of 16 columns, the two column
// halves): set 0's sums for columns 0-15 and 16-31 in tiles 0, 1 and its inputs in tile 2
// (`rows0` tile rows of 32 bf16), set 1's in tiles 5, 6 and 7 (`rows1` tile rows).
void configure_tiles(int64_t rows0, int64_t rows1) {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  const auto set = [&](int tile, int64_t tile_rows) {
    c.rows[tile] = static_cast<uint8_t>(tile_rows), c.colsb[tile] = 64;
  };
  set(0, rows0), set(1, rows0), set(2, rows0), set(3, 16), set(4, 16);
  if (rows1 > 0) set(5, rows1), set(6, rows1), set(7, rows1);
  _tile_loadconfig(&c);
}

// Tiles configured for rows0 and rows1 tile rows unless they are already (`configured`: the
// thread's current pair, {-1, -1} before any).
void use_tiles(int64_t (&configured)[2], int64_t rows0, int64_t rows1) {
  if (rows0 != configured[0] || rows1 != configured[1]) {
    configure_tiles(rows0, rows1), configured[0] = rows0, configured[1] = rows1;
  }
}

// part (the set's configured rows, 32 floats each) = the tile of inputs at `x` (rows `stride`
// bytes apart) times 16 decoded pair rows, on tile set S. (The tile intrinsics take a tile's
// number as a literal, hence the macro: sums in tiles LO and HI, inputs in tile INPUTS.)
#define SPECDEC_TILE_PRODUCT(LO, HI, INPUTS)                         \
  _tile_zero(LO);                                                   \
  _tile_zero(HI);                                                   \
  _tile_loadd(INPUTS, x, stride);                                   \
  _tile_loadd(3, decoded, Decoded::kBytes);                         \
  _tile_loadd(4, decoded + 64, Decoded::kBytes);                    \
  _tile_dpbf16ps(LO, INPUTS, 3);                                    \
  _tile_dpbf16ps(HI, INPUTS, 4);                                    \
  _tile_stored(LO, part, kBlockColumns * sizeof(float));            \
  _tile_stored(HI, part + 16, kBlockColumns * sizeof(float))
template <int S>
inline void amx_product(const uint8_t* decoded, const at::BFloat16* x, int64_t stride, float* part) {
  if constexpr (S == 0) {
    SPECDEC_TILE_PRODUCT(0, 1, 2);
  } else {
    SPECDEC_TILE_PRODUCT(5, 6, 7);
  }
}
#undef SPECDEC_TILE_PRODUCT

// Products' sums: for each tile set, two products' worth (the one just made, the one waiting).
using Parts = float[2][2][kAmxRows * kBlockColumns];

// A group whose product is made, waiting to be scaled into the rows' sums: row m's part at
// parts[set][slot] + offset + m * step.
struct PendingGroup {
  GroupScales scales;
  int64_t k, slot, offset, step;
};

// Row m's sums (lo: columns 0-15, hi: 16-31) += its part of the group * the group's scales
// (+ its min times the row's input sum of the group at input k), as scale_into and add_mins.
inline void scale_row(__m512& lo, __m512& hi, const PendingGroup& group, const float* part, int64_t m,
                      const float* sums, int64_t sums_per_row) {
  const GroupScales& g = group.scales;
  const float* q = part + m * group.step;
  lo = _mm512_fmadd_ps(_mm512_loadu_ps(q), g.scale_lo, lo);
  hi = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), g.scale_hi, hi);
  if (g.has_min) {
    const __m512 s = _mm512_set1_ps(sums[m * sums_per_row + group.k / kMinGroup]);
    lo = _mm512_fmadd_ps(g.min_lo, s, lo);
    hi = _mm512_fmadd_ps(g.min_hi, s, hi);
  }
}

// scale_row for each of `rows` rows whose sums are in `out` (32 floats a row).
inline void scale_rows(float* out, const PendingGroup& group, const float* part, int64_t rows, const float* sums,
                       int64_t sums_per_row) {
  for (int64_t m = 0; m < rows; ++m) {
    float* o = out + m * kBlockColumns;
    __m512 lo = _mm512_loadu_ps(o), hi = _mm512_loadu_ps(o + 16);
    scale_row(lo, hi, group, part, m, sums, sums_per_row);
    _mm512_storeu_ps(o, lo);
    _mm512_storeu_ps(o + 16, hi);
  }
}

// The same for R rows whose sums are held in registers (row m's in acc[2 m], acc[2 m + 1]).
template <int R>
inline void scale_registers(__m512* acc, const PendingGroup& group, const float* part, const float* sums,
                            int64_t sums_per_row) {
  for (int m = 0; m < R; ++m) scale_row(acc[2 * m], acc[2 * m + 1], group, part, m, sums, sums_per_row);
}

// Q6_K's inputs as its products read them: for each 32 inputs, each row as two tile rows (the
// first 16 inputs then zeros, zeros then the last 16): [K / 32][2 M][32].
std::vector<at::BFloat16> split_halves(const at::BFloat16* x, int64_t M, int64_t K) {
  std::vector<at::BFloat16> halves(K / 32 * 2 * M * 32, at::BFloat16(0.f));
  for (int64_t c = 0; c < K / 32; ++c) {
    for (int64_t m = 0; m < M; ++m) {
      at::BFloat16* first = halves.data() + (c * 2 * M + 2 * m) * 32;
      std::memcpy(first, x + m * K + 32 * c, 16 * sizeof(at::BFloat16));
      std::memcpy(first + 32 + 16, x + m * K + 32 * c + 16, 16 * sizeof(at::BFloat16));
    }
  }
  return halves;
}

// One block on the AMX path: where its units are and how they are laid out.
struct AmxBlock {
  const uint8_t* first_unit;
  int64_t format, per_unit, units, header_bytes, unit_products;
  bool paired;  // Q6_K: two groups a product
  int64_t products() const { return units * unit_products; }
};

// A block's products over its units in input order for the rows of `Sets` tile sets (set s's
// first row m0[s]); each group's part handed to scale(set, group, part) once the next product
// is issued (so that no load waits on the tile stores just before it; a row's operations keep
// their order). decoded(product, k): where the product's pair rows are; after_issue(product):
// called once each product is issued on every set.
template <int Sets, typename DecodedAt, typename AfterIssue, typename Scale>
inline void tile_products(const AmxBlock& b, const QuantOperands<Bf16Rows>& a, const at::BFloat16* halves,
                          const int64_t* m0, Parts& parts, DecodedAt&& decoded, AfterIssue&& after_issue,
                          Scale&& scale) {
  const int64_t M = a.M, K = a.K, unit_inputs = K / b.units;
  PendingGroup pending[2];
  int64_t num_pending = 0, products = 0;
  const auto scale_pending = [&]() {
    for (int64_t i = 0; i < num_pending; ++i) {
      const PendingGroup& group = pending[i];
      scale(0, group, parts[0][group.slot] + group.offset);
      if constexpr (Sets == 2) scale(1, group, parts[1][group.slot] + group.offset);
    }
    num_pending = 0;
  };
  for (int64_t u = 0; u < b.units; ++u) {
    const int64_t k0 = u * unit_inputs;
    unit_groups(b.first_unit + u * b.per_unit, b.format, [&](int64_t first, int64_t /*pairs*/, const GroupScales& g) {
      const int64_t k = k0 + 2 * first;
      const bool second_half = b.paired && first % 16 != 0;
      if (!second_half) {
        const int64_t product = products++;
        const uint8_t* w = decoded(product, k);
        for (int s = 0; s < Sets; ++s) {
          const at::BFloat16* x = b.paired ? halves + (k / 32 * 2 * M + 2 * m0[s]) * 32 : a.x + m0[s] * K + k;
          const int64_t stride = (b.paired ? 32 : K) * static_cast<int64_t>(sizeof(at::BFloat16));
          if (s == 0) amx_product<0>(w, x, stride, parts[0][product % 2]);
          else amx_product<1>(w, x, stride, parts[1][product % 2]);
        }
        after_issue(product);
        scale_pending();
      }
      const int64_t slot = (products - 1) % 2;
      pending[num_pending++] = b.paired ? PendingGroup{g, k, slot, second_half ? kBlockColumns : 0, 2 * kBlockColumns}
                                        : PendingGroup{g, k, slot, 0, kBlockColumns};
    });
  }
  scale_pending();
}

// The ring of buffers a block's products are decoded into, kAhead products before each is made.
struct DecodeRing {
  const Decoders& d;
  const AmxBlock& b;
  uint8_t* buffer;  // (kAhead + 1) products' pair rows
  uint8_t* at(int64_t p) const { return buffer + p % (kAhead + 1) * kProductPairs * Decoded::kBytes; }
  void decode(int64_t p) const {
    decode_pairs(d, b.format, b.first_unit + p / b.unit_products * b.per_unit + b.header_bytes,
                 p % b.unit_products * kProductPairs, kProductPairs, at(p));
  }
  void start() const {
    for (int64_t p = 0; p < std::min(kAhead, b.products()); ++p) decode(p);
  }
  void after_issue(int64_t p) const {
    if (p + kAhead < b.products()) decode(p + kAhead);
  }
};

// A block of R <= kRegisterRows rows (one tile set), the rows' sums in registers.
template <int R>
__attribute__((flatten)) void amx_block_registers(const DecodeRing& ring, const QuantOperands<Bf16Rows>& a,
                                                  const at::BFloat16* halves, Parts& parts, const int64_t* row) {
  const int64_t sums_per_row = a.K / kMinGroup, m0[1] = {0};
  __m512 acc[2 * R];
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm512_setzero_ps();
  ring.start();
  tile_products<1>(
      ring.b, a, halves, m0, parts, [&](int64_t product, int64_t) { return ring.at(product); },
      [&](int64_t product) { ring.after_issue(product); },
      [&](int, const PendingGroup& group, const float* part) {
        scale_registers<R>(acc, group, part, a.sums, sums_per_row);
      });
  for (int m = 0; m < R; ++m) store_row(a, m, row[2], row[3], acc[2 * m], acc[2 * m + 1]);
}

// A block of more rows, their sums in `out` (M x 32 floats): up to two tile sets read the ring;
// more, the block is decoded whole into `buffer` (K / 2 pair rows) and read tile by tile.
__attribute__((flatten)) void amx_block_memory(const DecodeRing& ring, const QuantOperands<Bf16Rows>& a,
                                               const at::BFloat16* halves, Parts& parts, float* out,
                                               int64_t (&configured)[2], const int64_t* row) {
  const AmxBlock& b = ring.b;
  const int64_t M = a.M, sums_per_row = a.K / kMinGroup;
  const int64_t tiles = num_balanced_parts(M, b.paired ? kAmxRows / 2 : kAmxRows), fold = b.paired ? 2 : 1;
  const auto scale = [&](int64_t m0, int64_t rows) {
    return [=, &a](int, const PendingGroup& group, const float* part) {
      scale_rows(out + m0 * kBlockColumns, group, part, rows, a.sums == nullptr ? nullptr : a.sums + m0 * sums_per_row,
                 sums_per_row);
    };
  };
  std::fill(out, out + M * kBlockColumns, 0.f);
  if (tiles <= 2) {
    const int64_t rows0 = balanced_part(M, tiles, 0), rows1 = tiles == 2 ? balanced_part(M, tiles, 1) : 0;
    use_tiles(configured, fold * rows0, fold * rows1);
    ring.start();
    const auto decoded = [&](int64_t product, int64_t) { return ring.at(product); };
    const auto after_issue = [&](int64_t product) { ring.after_issue(product); };
    if (tiles == 1) {
      const int64_t m0[1] = {0};
      tile_products<1>(b, a, halves, m0, parts, decoded, after_issue, scale(0, rows0));
    } else {
      const int64_t m0[2] = {0, rows0};
      const auto scale0 = scale(0, rows0), scale1 = scale(rows0, rows1);
      tile_products<2>(b, a, halves, m0, parts, decoded, after_issue,
                       [&](int set, const PendingGroup& group, const float* part) {
                         if (set == 0) scale0(set, group, part); else scale1(set, group, part);
                       });
    }
  } else {
    const int64_t unit_pairs = a.K / b.units / 2;
    for (int64_t u = 0; u < b.units; ++u) {
      decode_pairs(ring.d, b.format, b.first_unit + u * b.per_unit + b.header_bytes, 0, unit_pairs,
                   ring.buffer + u * unit_pairs * Decoded::kBytes);
    }
    for (int64_t tile = 0, m0 = 0; tile < tiles; ++tile) {
      const int64_t rows = balanced_part(M, tiles, tile), first[1] = {m0};
      use_tiles(configured, fold * rows, 0);
      tile_products<1>(
          b, a, halves, first, parts, [&](int64_t, int64_t k) { return ring.buffer + k / 2 * Decoded::kBytes; },
          [](int64_t) {}, scale(m0, rows));
      m0 += rows;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* s = out + m * kBlockColumns;
    store_row(a, m, row[2], row[3], _mm512_loadu_ps(s), _mm512_loadu_ps(s + 16));
  }
}

// Blocks [begin, end) of a call of bf16 rows, by tile products; `halves`: split_halves's
// inputs where a block is Q6_K.
void amx_walk(const QuantOperands<Bf16Rows>& a, const at::BFloat16* halves, int64_t begin, int64_t end) {
  static const Decoders d;
  const int64_t M = a.M, K = a.K;
  std::vector<float> out(M * kBlockColumns);
  alignas(64) Parts parts;
  const int64_t buffer_pairs = std::max((kAhead + 1) * kProductPairs, K / 2);
  auto* buffer = static_cast<uint8_t*>(std::aligned_alloc(64, buffer_pairs * Decoded::kBytes));
  int64_t configured[2] = {-1, -1};
  for (int64_t block = begin; block < end; ++block) {
    const int64_t* row = a.table + 4 * block;
    FormatShape shape;
    shape_of(row[1], shape);
    const AmxBlock b{a.bytes + row[0], row[1], unit_bytes(shape), K / shape.unit_inputs, shape.header_bytes,
                     shape.unit_inputs / 2 / kProductPairs, row[1] == kQ6_K};
    const DecodeRing ring{d, b, buffer};
    if (M > kRegisterRows) {
      amx_block_memory(ring, a, halves, parts, out.data(), configured, row);
      continue;
    }
    use_tiles(configured, b.paired ? 2 * M : M, 0);
    switch (M) {
      case 8: amx_block_registers<8>(ring, a, halves, parts, row); break;
      case 7: amx_block_registers<7>(ring, a, halves, parts, row); break;
      case 6: amx_block_registers<6>(ring, a, halves, parts, row); break;
      case 5: amx_block_registers<5>(ring, a, halves, parts, row); break;
      case 4: amx_block_registers<4>(ring, a, halves, parts, row); break;
      case 3: amx_block_registers<3>(ring, a, halves, parts, row); break;
      case 2: amx_block_registers<2>(ring, a, halves, parts, row); break;
      default: amx_block_registers<1>(ring, a, halves, parts, row); break;
    }
  }
  std::free(buffer);
  _tile_release();
}
#pragma GCC pop_options
#endif  // SPECDEC_HAS_AMX

template <typename Rows>
void gguf_rows(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& table,
               const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  using T = typename Rows::T;
  const int64_t M = x.size(0), K = x.size(1), blocks = table.size(0);
  const int64_t* rows = table.data_ptr<int64_t>();
  bool has_mins = false;
  for (int64_t b = 0; b < blocks; ++b) has_mins |= rows[4 * b + 1] == kQ4_1 || rows[4 * b + 1] == kQ4_K;
  // Each row's input sums per group of 32 (the min terms' factor), the same for a row in any call.
  std::vector<float> sums(has_mins ? M * (K / kMinGroup) : 0);
  const T* xs = x.data_ptr<T>();
  for (size_t g = 0; g < sums.size(); ++g) {
    const T* p = xs + static_cast<int64_t>(g) * kMinGroup;
    sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(Rows::widen(p), Rows::widen(p + 16)));
  }
  const QuantOperands<Rows> operands{M, K, out.size(1), static_cast<const uint8_t*>(bytes.data_ptr()), rows, xs,
                                     has_mins ? sums.data() : nullptr,
                                     bias.has_value() ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>()};
#if defined(SPECDEC_HAS_AMX)
  if constexpr (std::is_same_v<Rows, Bf16Rows>) {
    if (amx_enabled().load(std::memory_order_relaxed)) {
      bool has_q6_k = false;
      for (int64_t b = 0; b < blocks; ++b) has_q6_k |= rows[4 * b + 1] == kQ6_K;
      const std::vector<at::BFloat16> halves = has_q6_k ? split_halves(xs, M, K) : std::vector<at::BFloat16>();
      at::parallel_for(0, blocks, kMinBlocksPerThread,
                       [&](int64_t begin, int64_t end) { amx_walk(operands, halves.data(), begin, end); });
      return;
    }
  }
#endif
  at::parallel_for(0, blocks, kMinBlocksPerThread,
                   [&](int64_t begin, int64_t end) { walk<Rows>(operands, begin, end); });
}

}  // namespace
#endif

#if defined(SPECDEC_HAS_AMX)
namespace {
// Whether this CPU has AMX tiles with bf16 products and Linux grants this process their state.
bool amx_available() {
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return tile && bf16 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return available;
}
}  // namespace
std::atomic<bool>& amx_enabled() {
  static std::atomic<bool> enabled{amx_available()};
  return enabled;
}
#endif

bool gguf_use_amx(c10::optional<bool> enable) {
#if defined(SPECDEC_HAS_AMX)
  if (enable.has_value()) amx_enabled().store(*enable && amx_available());
  return amx_enabled().load();
#else
  (void)enable;
  return false;
#endif
}

bool gguf_linear_supported(at::ScalarType dtype) {
#if defined(SPECDEC_HAS_GGUF_KERNEL)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  (void)dtype;
  return false;
#endif
}

void check_gguf_packed(const at::Tensor& bytes, const at::Tensor& table, int64_t in_features, int64_t out_features,
                       at::ScalarType dtype) {
  TORCH_CHECK(gguf_linear_supported(dtype), "specdec_cpu::linear has no ", dtype,
              " kernel for GGUF weights on this machine (it needs AVX512-BF16 and AVX512-VBMI)");
  TORCH_CHECK(bytes.dim() == 1 && bytes.scalar_type() == at::kByte && bytes.is_contiguous() && bytes.device().is_cpu(),
              "specdec_cpu::linear: GGUF weights are one contiguous uint8 CPU tensor");
  TORCH_CHECK(table.dim() == 2 && table.size(1) == 4 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "specdec_cpu::linear: a GGUF weight's block table is int64 [blocks, 4]");
  const int64_t* rows = table.data_ptr<int64_t>();
  int64_t offset = 0, column = 0;
  for (int64_t b = 0; b < table.size(0); ++b) {
    const int64_t* row = rows + 4 * b;
    const int64_t size = gguf_block_bytes(row[1], in_features);
    TORCH_CHECK(size > 0, "specdec_cpu::linear: block ", b, " has GGML type ", row[1],
                ", which is not one of Q8_0, Q4_0, Q4_1, Q4_K, Q6_K for ", in_features, " inputs");
    TORCH_CHECK(row[0] == offset && row[2] == column && row[3] >= 1 && row[3] <= kBlockColumns,
                "specdec_cpu::linear: block ", b, " of the GGUF table is out of order");
    offset += size, column += row[3];
  }
  TORCH_CHECK(offset == bytes.size(0) && column == out_features, "specdec_cpu::linear: the GGUF weight holds ",
              bytes.size(0), " bytes and ", column, " columns, not ", offset, " bytes and ", out_features);
}

void gguf_linear_out(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& table,
                     const c10::optional<at::Tensor>& bias, at::Tensor& out) {
#if defined(SPECDEC_HAS_GGUF_KERNEL)
  if (x.scalar_type() == at::kBFloat16) return gguf_rows<Bf16Rows>(x, bytes, table, bias, out);
  if (x.scalar_type() == at::kFloat) return gguf_rows<Fp32Rows>(x, bytes, table, bias, out);
#endif
  TORCH_CHECK(false, "specdec_cpu::linear: no GGUF kernel for ", x.scalar_type(), " on this machine");
}

}  // namespace specdec_cpu
