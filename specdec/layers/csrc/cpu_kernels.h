// The entry points specdec's CPU kernels share across their source files (one extension
// module, built by specdec/cpu_extension.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace specdec_cpu {

// Conversions between fp32 and a kernel's storage dtype, as torch does them (bf16: round to
// nearest even, NaN to the quiet NaN 0x7FC0), written on the bits without branches so that
// GCC and Clang vectorise the loops that use them (c10::BFloat16's own conversions keep them
// scalar: ~4 ns an element, which made a bf16 decode's norms cost more than their reads).
template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}
// v rounded to T and back: the value a T holds.
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

// `total` rows split into as few parts of at most `most` rows as can hold them, balanced
// (17 rows in parts of at most 10: 9 + 8): how many parts, and part `index`'s rows, the
// larger parts first. The linear tiles and the attention's row blocks split this way.
inline int64_t num_balanced_parts(int64_t total, int64_t most) { return (total + most - 1) / most; }
inline int64_t balanced_part(int64_t total, int64_t parts, int64_t index) {
  return total / parts + (index < total % parts ? 1 : 0);
}

// e^x in plain arithmetic the compiler vectorises, unlike std::exp: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative error below 2e-7, about
// fp32's rounding), 2^n by building the exponent bits. x is clamped to [-87, 88] (e^-87 ~
// 1.6e-38: a softmax weight of nothing, a SiLU of -0; e^88 ~ 1.7e38 stays finite).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, x));
  float p = 1.f / 5040.f;
  p = std::fma(p, r, 1.f / 720.f);
  p = std::fma(p, r, 1.f / 120.f);
  p = std::fma(p, r, 1.f / 24.f);
  p = std::fma(p, r, 1.f / 6.f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// linear_cpu.cpp: y = x W^T + b on a weight packed by pack_weight (x's dtype) or, times a
// float32 scale per output column, pack_weight_int8 (int8 weights for bf16 or fp32 rows),
// row-invariant (see there); also torch.ops.specdec_cpu.linear, .pack_weight, .pack_weight_int8.
at::Tensor pack_weight(const at::Tensor& weight);
at::Tensor pack_weight_int8(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features, const c10::optional<at::Tensor>& scales);
// The same into `out` ([rows, out_features] contiguous, x's dtype), unchecked: for a caller
// that checked the packed weight (check_packed), the bias, x and out once for many calls (the
// decoder stack checks every layer's before its first).
void linear_out(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias, at::Tensor& out);
// Refuses (TORCH_CHECK) a tensor that is not pack_weight's (or pack_weight_int8's, with its
// scales) of an [out, in] weight for rows of `dtype`.
void check_packed(const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t in_features,
                  int64_t out_features, at::ScalarType dtype);
bool linear_supports(at::ScalarType dtype, bool int8_weights);

// gguf_linear_cpu.cpp: the same for weights in GGUF's quantized formats, one uint8 tensor of
// blocks and an int64 [blocks, 4] table (see there); linear_out and check_packed hand them on.
inline bool is_gguf_packed(const at::Tensor& packed) { return packed.dim() == 1 && packed.scalar_type() == at::kByte; }
bool gguf_linear_supported(at::ScalarType dtype);
// Whether bf16 rows take the AMX tile path where the CPU has one (for every row count, so a
// row's result never depends on the path); `enable` turns it on (where available) or off,
// for tests and benches. Returns the setting now in force.
bool gguf_use_amx(c10::optional<bool> enable);
// A block's bytes in `format` (a GGML type id) for `in_features` inputs; -1 if it has none.
int64_t gguf_block_bytes(int64_t format, int64_t in_features);
void check_gguf_packed(const at::Tensor& bytes, const at::Tensor& table, int64_t in_features, int64_t out_features,
                       at::ScalarType dtype);
void gguf_linear_out(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& table,
                     const c10::optional<at::Tensor>& bias, at::Tensor& out);

// paged_attention_cpu.cpp: writes the step's K/V into the paged cache, attends every query token.
//
// What a step's attention does not owe to its layer (slots, block tables, the units of work),
// worked out once a step by plan_attention; attend_planned then runs one layer without a
// torch operator call (except for a long segment's SDPA), so the decoder stack pays no
// dispatcher trips or allocations a layer. Every cache the plan serves has the shape of the
// one it was made with.
struct AttentionPlan {
  // chunk >= 0: that chunk of a short segment's context, every query row of it (merged after
  // all units ran); kWholePiece: query tokens [piece_start, piece_start + piece_len) of a long
  // segment over every chunk they see, merged as they go.
  static constexpr int64_t kWholePiece = -1;
  struct Unit {
    int64_t seq, kv_head, chunk;
    int64_t piece_start = 0, piece_len = 0;
  };
  int64_t num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0, num_blocks = 0;
  // Per segment (a sequence's query tokens, or one token of a tree-drafted sequence): where
  // its tokens start (and the last one's end), its context length, its block table and,
  // for a tree token, the slots of its last positions (its ancestors' and its own, in path
  // order; empty otherwise).
  std::vector<int64_t> slots, query_start_locs, context_lens;
  std::vector<at::Tensor> tables;  // int64, contiguous
  std::vector<std::vector<int64_t>> tails;
  std::vector<Unit> units;
  std::vector<int64_t> partial_starts;  // where each sequence's chunk partials begin
  int64_t work = 0;  // query rows x cached positions, the units' arithmetic
  // Long segments (a prefill chunk) go by torch's SDPA (faster for long prompts, but its
  // reduction order depends on the segment's length) unless batch_invariant: then by the
  // kernel in pieces (Unit::kWholePiece), each row computed as a decode of it would be.
  bool batch_invariant = true;
  bool has_long_segment = false;
  std::vector<float> partials;       // every unit's chunk partials, reused by every layer
  std::vector<float> merge_scratch;  // head_dim floats
};
// A step's query, key and value rows: element strides between tokens and between heads, the
// last dim contiguous, all in the caches' dtype.
struct AttentionRows {
  const void* query;
  int64_t query_token_stride, query_head_stride;
  const void* key;
  int64_t key_token_stride, key_head_stride;
  const void* value;
  int64_t value_token_stride, value_head_stride;
};
AttentionPlan plan_attention(int64_t num_tokens, int64_t num_heads, const at::Tensor& key_cache,
                             const at::Tensor& slot_mapping, const std::vector<int64_t>& query_start_locs,
                             const std::vector<int64_t>& context_lens, const std::vector<at::Tensor>& block_tables,
                             bool batch_invariant, const std::vector<at::Tensor>& tree_parents);
// Writes the rows' K/V into the caches and the attention of every query row into `out`
// ([num_tokens, num_heads, head_dim] contiguous).
void attend_planned(AttentionPlan& plan, at::ScalarType dtype, const AttentionRows& rows, void* key_cache,
                    void* value_cache, void* out, double scale);
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slot_mapping,
                           const std::vector<int64_t>& query_start_locs,
                           const std::vector<int64_t>& context_lens,
                           const std::vector<at::Tensor>& block_tables, double scale, bool batch_invariant,
                           const std::vector<at::Tensor>& tree_parents);

}  // namespace specdec_cpu
