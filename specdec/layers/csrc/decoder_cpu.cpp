// Every decoder layer of a Llama-family model in one call, on the CPU (see
// specdec/models/cpu_stack.py for where it is used and what it accepts).
//
// Why: with the linears and the attention in C++ (linear_cpu.cpp, paged_attention_cpu.cpp),
// a decode step of the default model spent ~2 ms of its ~7.4 (bf16, 2 cores) between them:
// the norms, RoPE, SiLU and residual adds as inductor's small fused kernels, each called
// from its Python wrapper, ~8 calls a layer, plus dynamo's guards. Here one call runs the
// embedding lookup, the 30 layers and the final norm; the elementwise work is a few plain
// loops over rows, and nothing is compiled at start-up.
//
// Numerics follow transformers' LlamaForCausalLM in the model's dtype, as the eager model
// does: RMSNorm's statistic in fp32, the normed row rounded to the dtype before the weight
// multiplies it; each RoPE product and sum, SiLU, the gate product and each residual add
// rounded to the dtype. The row statistic and e^x are not computed as ATen does, so results
// may differ from the eager model's in the last bit (tests hold them to rounding).
//
// Row invariance: every elementwise step computes a row from that row alone in a fixed
// order, the linears are row-invariant and so is the attention, so
// a token's outputs are bit-identical in a one-token decode and in a verify window. That is
// what makes greedy speculation reproduce plain decoding in 16 bits.

#include "cpu_kernels.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <utility>

namespace specdec_cpu {
namespace {

// Elementwise work is split over threads by rows, at least this many a task (a decode step's
// few rows are cheaper than forking).
constexpr int64_t kRowsPerTask = 16;

template <typename F>
void for_rows(int64_t rows, const F& body) {
  if (rows <= kRowsPerTask) {
    body(0, rows);
  } else {
    at::parallel_for(0, rows, kRowsPerTask, body);
  }
}

// out = weight * (x / rms(x)): the statistic in fp32, the normed row rounded to T.
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  for_rows(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      T* o = out + r * width;
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < width; ++i) sum_sq += to_float(xr[i]) * to_float(xr[i]);
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(width) + eps);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float normed = round_to<T>(to_float(xr[i]) * inv_rms);
        o[i] = from_float<T>(to_float(weight[i]) * normed);
      }
    }
  });
}

// RoPE in place on the first `num_heads` heads of each row (the query and key heads of a
// fused qkv row): x * cos + rotate_half(x) * sin, each product and the sum rounded to T.
template <typename T>
void rotate(T* rows_data, int64_t row_stride, const int64_t* positions, const T* cos, const T* sin,
            int64_t rows, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for_rows(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + positions[r] * head_dim;
      const T* s = sin + positions[r] * head_dim;
      const T* c_hi = c + half;
      const T* s_hi = s + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        // The halves as two pointers and no T locals: either kept GCC from vectorising bf16.
        T* lo = rows_data + r * row_stride + h * head_dim;
        T* hi = lo + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(lo[i]), x2 = to_float(hi[i]);
          const float first = round_to<T>(x1 * to_float(c[i])) + round_to<T>(-x2 * to_float(s[i]));
          const float second = round_to<T>(x2 * to_float(c_hi[i])) + round_to<T>(x1 * to_float(s_hi[i]));
          lo[i] = from_float<T>(first);
          hi[i] = from_float<T>(second);
        }
      }
    }
  });
}

// out = silu(gate) * up for rows [gate | up] of width 2 * size; silu rounded to T first.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t size) {
  for_rows(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * size;
      const T* up = gate + size;
      T* o = out + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float g = to_float(gate[i]);
        const float activated = round_to<T>(g / (1.f + exp_clamped(-g)));
        o[i] = from_float<T>(activated * to_float(up[i]));
      }
    }
  });
}

template <typename T>
void add(const T* a, const T* b, T* out, int64_t rows, int64_t width) {
  for_rows(rows, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin * width; i < end * width; ++i) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
  });
}

// A layer's tensors in `layer_tensors`, in this order: each linear's weight (packed by
// pack_weight, or pack_weight_int8 with its float32 scales), scales and bias; a scales or
// bias tensor of no elements means none.
enum LayerTensor : int64_t {
  kInputNorm, kQkvWeight, kQkvScales, kQkvBias, kOWeight, kOScales, kOBias, kPostNorm, kGateUpWeight,
  kGateUpScales, kGateUpBias, kDownWeight, kDownScales, kDownBias, kTensorsPerLayer
};

c10::optional<at::Tensor> optional_of(const at::Tensor& tensor) {
  return tensor.numel() ? c10::optional<at::Tensor>(tensor) : c10::nullopt;
}

}  // namespace

// Returns {final normed hidden [T, H], then the residual entering each of aux_layer_ids}.
std::vector<at::Tensor> decoder_stack(
    const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embed_weight,
    const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& layer_tensors,
    const at::Tensor& final_norm, const std::vector<at::Tensor>& key_caches,
    const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
    const std::vector<int64_t>& query_start_locs, const std::vector<int64_t>& context_lens,
    const std::vector<at::Tensor>& block_tables, const std::vector<int64_t>& aux_layer_ids,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
    double scale, bool batch_invariant, const std::vector<at::Tensor>& tree_parents) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(num_layers > 0, "decoder_stack: no layers (no KV caches) given");
  TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == num_layers * kTensorsPerLayer &&
                  static_cast<int64_t>(value_caches.size()) == num_layers,
              "decoder_stack: ", kTensorsPerLayer, " tensors and one K and V cache per layer expected");
  TORCH_CHECK(input_ids.dim() == 1 && positions.dim() == 1 && positions.size(0) == input_ids.size(0),
              "decoder_stack: input_ids and positions must be [num_tokens]");
  const at::ScalarType dtype = embed_weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decoder_stack runs fp32 or bf16 models, not ",
              dtype);
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && final_norm.scalar_type() == dtype &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim,
              "decoder_stack: the RoPE tables and the final norm must be contiguous ", dtype);
  const int64_t hidden_size = embed_weight.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t num_tokens = input_ids.size(0);
  const at::Tensor position_rows = positions.to(at::kLong).contiguous();
  const int64_t* position_data = position_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(position_data[t] >= 0 && position_data[t] < cos.size(0), "decoder_stack: position ",
                position_data[t], " is outside the RoPE table (", cos.size(0), " positions)");
  }
  const float norm_eps = static_cast<float>(eps);

  const int64_t qkv_size = q_size + 2 * kv_size;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layer_tensors.data() + layer * kTensorsPerLayer;
    for (const LayerTensor kind : {kInputNorm, kQkvBias, kOBias, kPostNorm, kGateUpBias, kDownBias}) {
      TORCH_CHECK(!w[kind].numel() || (w[kind].scalar_type() == dtype && w[kind].is_contiguous()),
                  "decoder_stack: every norm weight and bias must be contiguous ", dtype);
    }
    // The linears run unchecked (linear_out) on buffers sized from these widths.
    check_packed(w[kQkvWeight], optional_of(w[kQkvScales]), hidden_size, qkv_size, dtype);
    check_packed(w[kOWeight], optional_of(w[kOScales]), q_size, hidden_size, dtype);
    check_packed(w[kGateUpWeight], optional_of(w[kGateUpScales]), hidden_size, 2 * intermediate_size, dtype);
    check_packed(w[kDownWeight], optional_of(w[kDownScales]), intermediate_size, hidden_size, dtype);
    for (const auto& [bias, width] : {std::pair{kQkvBias, qkv_size}, std::pair{kOBias, hidden_size},
                                      std::pair{kGateUpBias, 2 * intermediate_size}, std::pair{kDownBias, hidden_size}}) {
      TORCH_CHECK(!w[bias].numel() || (w[bias].dim() == 1 && w[bias].size(0) == width),
                  "decoder_stack: a bias must be [out_features] of its linear");
    }
    const at::Tensor& keys = key_caches[layer];
    const at::Tensor& values = value_caches[layer];
    TORCH_CHECK(keys.sizes() == key_caches[0].sizes() && values.sizes() == key_caches[0].sizes() &&
                    keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == dtype &&
                    values.scalar_type() == dtype,
                "decoder_stack: every layer's K and V caches must be contiguous ", dtype, " of one shape");
  }
  TORCH_CHECK(key_caches[0].size(2) == num_kv_heads && key_caches[0].size(3) == head_dim,
              "decoder_stack: the KV caches do not fit the heads");
  // One plan and one set of buffers for every layer: a layer makes no allocation and, but for
  // a long prefill segment's SDPA (not batch_invariant), no torch operator call (each cost ~1-5 us a layer, more
  // with the code cold after the weights streamed through the caches).
  AttentionPlan plan = plan_attention(num_tokens, num_heads, key_caches[0], slot_mapping, query_start_locs,
                                      context_lens, block_tables, batch_invariant, tree_parents);
  const auto options = embed_weight.options();
  at::Tensor normed = at::empty({num_tokens, hidden_size}, options);
  at::Tensor qkv = at::empty({num_tokens, qkv_size}, options);
  at::Tensor attended = at::empty({num_tokens, q_size}, options);
  at::Tensor projected = at::empty({num_tokens, hidden_size}, options);
  at::Tensor residual = at::empty({num_tokens, hidden_size}, options);
  at::Tensor gate_up = at::empty({num_tokens, 2 * intermediate_size}, options);
  at::Tensor activated = at::empty({num_tokens, intermediate_size}, options);
  at::Tensor down = at::empty({num_tokens, hidden_size}, options);

  std::vector<at::Tensor> aux(aux_layer_ids.size());
  // The residual stream, updated in place layer by layer.
  at::Tensor hidden = at::index_select(embed_weight, 0, input_ids.to(at::kLong));  // [T, H]
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "decoder_stack", [&] {
    using T = scalar_t;
    T* const qkv_data = qkv.data_ptr<T>();
    const AttentionRows rows{qkv_data,           qkv_size, head_dim, qkv_data + q_size, qkv_size, head_dim,
                             qkv_data + q_size + kv_size, qkv_size, head_dim};
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      for (size_t j = 0; j < aux_layer_ids.size(); ++j) {
        if (aux_layer_ids[j] == layer) aux[j] = hidden.clone();
      }
      const at::Tensor* w = layer_tensors.data() + layer * kTensorsPerLayer;
      rms_norm<T>(hidden.data_ptr<T>(), w[kInputNorm].data_ptr<T>(), normed.data_ptr<T>(), num_tokens,
                  hidden_size, norm_eps);
      specdec_cpu::linear_out(normed, w[kQkvWeight], optional_of(w[kQkvScales]), optional_of(w[kQkvBias]),
                              qkv);  // [T, q + 2 kv]
      rotate<T>(qkv_data, qkv_size, position_data, cos.data_ptr<T>(), sin.data_ptr<T>(), num_tokens,
                num_heads + num_kv_heads, head_dim);
      attend_planned(plan, dtype, rows, key_caches[layer].data_ptr(), value_caches[layer].data_ptr(),
                     attended.data_ptr(), scale);  // [T, heads * head_dim]
      specdec_cpu::linear_out(attended, w[kOWeight], optional_of(w[kOScales]), optional_of(w[kOBias]),
                              projected);
      add<T>(hidden.data_ptr<T>(), projected.data_ptr<T>(), residual.data_ptr<T>(), num_tokens, hidden_size);
      rms_norm<T>(residual.data_ptr<T>(), w[kPostNorm].data_ptr<T>(), normed.data_ptr<T>(), num_tokens,
                  hidden_size, norm_eps);
      specdec_cpu::linear_out(normed, w[kGateUpWeight], optional_of(w[kGateUpScales]),
                              optional_of(w[kGateUpBias]), gate_up);
      silu_mul<T>(gate_up.data_ptr<T>(), activated.data_ptr<T>(), num_tokens, intermediate_size);
      specdec_cpu::linear_out(activated, w[kDownWeight], optional_of(w[kDownScales]), optional_of(w[kDownBias]),
                              down);
      add<T>(residual.data_ptr<T>(), down.data_ptr<T>(), hidden.data_ptr<T>(), num_tokens, hidden_size);
    }
    at::Tensor out = at::empty_like(hidden);
    rms_norm<T>(hidden.data_ptr<T>(), final_norm.data_ptr<T>(), out.data_ptr<T>(), num_tokens, hidden_size,
                norm_eps);
    hidden = out;
  });
  std::vector<at::Tensor> result{hidden};
  result.insert(result.end(), aux.begin(), aux.end());
  return result;
}

}  // namespace specdec_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the verifier runs the forward on its event loop's thread, and gRPC's
  // completion-queue thread needs the GIL to hand the loop new calls and cancellations.
  m.def("paged_attention", &specdec_cpu::paged_attention,
        "Write this step's K/V into the paged cache, then attend every query token",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decoder_stack", &specdec_cpu::decoder_stack,
        "Embedding, every decoder layer and the final norm of a Llama-family model in one call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
