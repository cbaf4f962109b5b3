// y = x W^T + b for the few rows of a decode or verify step, on the CPU, at the speed of
// reading W (see specdec/models/packed_linear.py for where it is used).
//
// Why: a decode step of a small model is bound by streaming its weights, and the stock
// kernels stream them slowly for a handful of rows. Measured on the default model's 30
// layers and LM head (2 cores, weights read from DRAM as in a real forward), GB/s of weights
// read at 1 / 8 rows: bf16 here 41 / 34, oneDNN on prepacked weights 33 / 28; fp32 here
// 43 / 38, torch's best fp32 path (specdec/models/linear.py) 34 / 15. A small layer (576 x 576,
// 0.66 MB) is dominated by a library call's fixed cost: ~15 us in oneDNN, ~5 us here.
//
// How: each output element is one dot product of a weight row with an input row, summed in
// fp32 in 16 lanes (bf16 pairs by AVX512-BF16's vdpbf16ps, fp32 by FMA) and reduced by one
// fixed tree. Four weight rows are loaded once for up to four input rows; more input rows
// reread the same four weight rows from L1. The weight is used as it is (row-major
// [out, in], no repacking, no copy). Threads split the output columns.
//
// Row invariance: an output element's arithmetic depends only on its weight row and its
// input row, never on how many other rows the call has (in bf16 up to kMaxRowsBf16), so a
// token's projections are bit-identical in a one-token decode and in a verify window (the
// stock kernels pick different summation orders for different row counts).
//
// bf16 calls beyond kMaxRowsBf16 rows (long prefill chunks) are compute-bound work that
// oneDNN does better: they go to at::linear, as do dtypes this build has no kernel for.

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

// bf16 calls with more rows than this go to at::linear (oneDNN). Measured on the default
// model's 30 layers and LM head (2 cores), this kernel against oneDNN's bf16 on prepacked
// weights: 1.24x at 1 row, 1.0-1.2x from 2 to 64, 0.96x at 128, 0.70x at 512. In fp32 it
// beats torch's path (MKL) at every row count measured (1.26x at 1 row, 2.3-2.8x from 5 to
// 128, 1.75x at 512, 1.15-1.5x per layer at 2048), so fp32 takes every call.
constexpr int64_t kMaxRowsBf16 = 128;
// Output rows a thread takes at least: forking for less costs more than it saves.
constexpr int64_t kMinRowsPerThread = 256;

#if defined(__AVX512F__)

// The four sums of a0..a3's lanes (one fixed tree for each).
inline __m128 sum_lanes4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 t2 = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t2), _mm512_extractf32x8_ps(t2, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

struct Fp32Ops {
  using T = float;
  static constexpr int64_t kStep = 16;  // elements of a row per register
  using Vec = __m512;
  static Vec load(const T* p) { return _mm512_loadu_ps(p); }
  static Vec load_first(const T* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
  static __m128 load_bias(const T* b, int64_t n) {
    return _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << n) - 1), b);
  }
  static void store(T* out, __m128 sums, int64_t n) {
    _mm_mask_storeu_ps(out, static_cast<__mmask8>((1u << n) - 1), sums);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define SPECDEC_HAS_BF16_KERNEL 1
struct Bf16Ops {
  using T = at::BFloat16;
  static constexpr int64_t kStep = 32;
  using Vec = __m512bh;
  static Vec load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec load_first(const T* p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  // acc += w[2i] x[2i] + w[2i+1] x[2i+1] in each fp32 lane.
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
  static __m128 load_bias(const T* b, int64_t n) {
    const __m128i bits = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), b);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));  // bf16 -> fp32 is exact
  }
  // Rounded to nearest even, as torch rounds fp32 to bf16.
  static void store(T* out, __m128 sums, int64_t n) {
    _mm_mask_storeu_epi16(out, static_cast<__mmask8>((1u << n) - 1), (__m128i)_mm_cvtneps_pbh(sums));
  }
};
#endif

// Output columns [n, n + R) for the MT input rows at x (R <= 4, MT <= 4).
//
// The R weight rows are read one after another, front to back, so a thread's reads are one
// ascending stream through its share of W. Reading the four rows side by side (four
// streams, as this kernel first did) streamed at 0.7x the rate on an AMD EPYC (Zen 4) whose
// prefetchers follow one stream well and four interleaved ones badly: bf16, 1 / 4 input
// rows, 23 / 18 GB/s against 33 / 25 in order (2 cores, 212 MB of weights, alternated in one
// process); fp32 27 / 25 against 35 / 28. Each (row, input) pair sums in two accumulators,
// even and odd register steps (one would be a chain of K / kStep dependent dot products,
// latency-bound for one input row), added at the end: a fixed order for every MT.
template <typename Ops, int R, int MT>
inline void dot_block(const typename Ops::T* w, const typename Ops::T* x, const typename Ops::T* bias,
                      typename Ops::T* out, int64_t K, int64_t N, int64_t n) {
  using T = typename Ops::T;
  using Vec = typename Ops::Vec;
  constexpr int64_t kStep = Ops::kStep;
  __m512 acc[4][MT];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const T* row = w + (n + r) * K;
    __m512 even[MT], odd[MT];
    for (int m = 0; m < MT; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * kStep <= K; k += 2 * kStep) {
      const Vec w0 = Ops::load(row + k), w1 = Ops::load(row + k + kStep);
      for (int m = 0; m < MT; ++m) {
        even[m] = Ops::dot(even[m], w0, Ops::load(x + m * K + k));
        odd[m] = Ops::dot(odd[m], w1, Ops::load(x + m * K + k + kStep));
      }
    }
    if (k + kStep <= K) {
      const Vec w0 = Ops::load(row + k);
      for (int m = 0; m < MT; ++m) even[m] = Ops::dot(even[m], w0, Ops::load(x + m * K + k));
      k += kStep;
    }
    if (k < K) {
      const Vec w1 = Ops::load_first(row + k, K - k);
      for (int m = 0; m < MT; ++m) odd[m] = Ops::dot(odd[m], w1, Ops::load_first(x + m * K + k, K - k));
    }
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_add_ps(even[m], odd[m]);
  }
  const __m128 b = bias != nullptr ? Ops::load_bias(bias + n, R) : _mm_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    const __m128 sums = _mm_add_ps(sum_lanes4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]), b);
    Ops::store(out + m * N + n, sums, R);
  }
}

template <typename Ops, int MT>
inline void dot_rows(const typename Ops::T* w, const typename Ops::T* x, const typename Ops::T* bias,
                     typename Ops::T* out, int64_t K, int64_t N, int64_t n) {
  switch (std::min<int64_t>(4, N - n)) {
    case 4: dot_block<Ops, 4, MT>(w, x, bias, out, K, N, n); break;
    case 3: dot_block<Ops, 3, MT>(w, x, bias, out, K, N, n); break;
    case 2: dot_block<Ops, 2, MT>(w, x, bias, out, K, N, n); break;
    default: dot_block<Ops, 1, MT>(w, x, bias, out, K, N, n); break;
  }
}

template <typename Ops>
void linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  using T = typename Ops::T;
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const T* w = weight.data_ptr<T>();
  const T* xs = x.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* ys = out.data_ptr<T>();
  const int64_t num_groups = (N + 3) / 4;
  at::parallel_for(0, num_groups, kMinRowsPerThread / 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * 4;
      for (int64_t m = 0; m < M; m += 4) {
        const T* xm = xs + m * K;
        T* ym = ys + m * N;
        switch (std::min<int64_t>(4, M - m)) {
          case 4: dot_rows<Ops, 4>(w, xm, b, ym, K, N, n); break;
          case 3: dot_rows<Ops, 3>(w, xm, b, ym, K, N, n); break;
          case 2: dot_rows<Ops, 2>(w, xm, b, ym, K, N, n); break;
          default: dot_rows<Ops, 1>(w, xm, b, ym, K, N, n); break;
        }
      }
    }
  });
}

#endif  // __AVX512F__

}  // namespace

bool linear_supports(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
#if defined(SPECDEC_HAS_BF16_KERNEL)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "specdec_cpu::linear expects x [rows, in] and weight [out, in]; got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "specdec_cpu::linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "specdec_cpu::linear: x is ", x.scalar_type(),
              " but the weight is ", weight.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type(),
                "specdec_cpu::linear: the bias must be [out] in the weight's dtype");
  }
}

// linear_out once its inputs and `out` are known good.
void linear_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  const int64_t M = x.size(0);
  if (M == 0) return;
  if (!linear_supports(x.scalar_type()) || (x.scalar_type() == at::kBFloat16 && M > kMaxRowsBf16)) {
    at::linear_out(out, x, weight, bias);
    return;
  }
  // Already contiguous in the decoder stack: no copies (each would be a dispatcher trip).
  const at::Tensor rows = x.is_contiguous() ? x : x.contiguous();
  const at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  const c10::optional<at::Tensor> b =
      bias.has_value() ? c10::optional<at::Tensor>(bias->is_contiguous() ? *bias : bias->contiguous()) : c10::nullopt;
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) linear_rows<Fp32Ops>(rows, w, b, out);
#endif
#if defined(SPECDEC_HAS_BF16_KERNEL)
  if (x.scalar_type() == at::kBFloat16) linear_rows<Bf16Ops>(rows, w, b, out);
#endif
}

}  // namespace

void linear_out(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                at::Tensor& out) {
  check_inputs(x, weight, bias);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0) && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "specdec_cpu::linear: out must be a contiguous [rows, out] tensor in x's dtype");
  linear_into(x, weight, bias, out);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, weight, bias);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_into(x, weight, bias, out);
  return out;
}

}  // namespace specdec_cpu

TORCH_LIBRARY(specdec_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_supports(ScalarType dtype) -> bool",
        [](at::ScalarType dtype) { return specdec_cpu::linear_supports(dtype); });
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("linear", &specdec_cpu::linear); }
