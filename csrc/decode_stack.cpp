// A decode step of every decoder layer in one native call (CPU).
//
// At batch 1 a decode step of a 30-layer model is some 400 small kernels; launched one by
// one from Python, the interpreter's share of the step rivals the arithmetic. `DecodeStack`
// holds the layers' weights (float, Q8_0 or Q4_1 linears) and the KV pool's buffers, and
// runs the same kernels in the same order as the Python forward (`LlamaForCausalLM` with
// `NativeOps` and the native attention backend), so its results are identical to it:
// RMSNorm, fused QKV projection, RoPE, KV store, paged decode attention, output projection,
// residual + RMSNorm, gate/up projection, SiLU-and-mul, down projection, residual + RMSNorm.
// It covers the plain case only; the caller keeps the Python path for anything else
// (prefills, cascade attention over shared prefixes, Q/K norms).
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "native_ops.h"

namespace {

// One linear layer: `kind` "dense" (weight [out, in]), "q8_0" (weight int8, scales) or
// "q4_1" (weight packed, scales, mins); bias optional (an undefined tensor when absent).
struct Linear {
  std::string kind;
  torch::Tensor weight, scales, mins, bias;
  int64_t dense_rows;  // quantized: from this many rows, dequantize and run a dense matmul

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == "dense") return at::linear(x, weight, bias);
    torch::Tensor out;
    if (x.size(0) >= dense_rows) {
      const bool bf16 = x.scalar_type() == torch::kBFloat16;
      auto dense = kind == "q8_0" ? q8_0_dequantize(weight, scales, bf16)
                                  : q4_1_dequantize(weight, scales, mins, bf16);
      out = at::linear(x, dense);
    } else {
      out = kind == "q8_0" ? q8_0_linear(x, weight, scales, false)
                           : q4_1_linear(x, weight, scales, mins, false);
    }
    return bias.defined() ? out + bias : out;
  }
};

// buf[slots[t]] = rows[t] for every token t: a row copy each (what `buf[slots] = rows`
// does in torch, without advanced indexing's set-up cost for a handful of rows).
void store_rows(const torch::Tensor& buf, const torch::Tensor& rows, const torch::Tensor& slots) {
  const int64_t tokens = rows.size(0), row = buf.stride(0);
  const bool plain = rows.scalar_type() == buf.scalar_type() && buf.is_contiguous() &&
                     rows.stride(2) == 1 && rows.stride(1) == rows.size(2) &&
                     rows.size(1) * rows.size(2) == row && slots.scalar_type() == torch::kInt64 &&
                     slots.is_contiguous();
  if (!plain) {
    buf.index_put_({slots}, rows);
    return;
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = row * buf.element_size();
  auto* dst = static_cast<char*>(buf.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < buf.size(0), "KV slot ", slot[t], " out of range");
    std::memcpy(dst + slot[t] * bytes, src + t * rows.stride(0) * buf.element_size(), bytes);
  }
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  torch::Tensor k_buf, v_buf;
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sliding_window, torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        sliding_window_(sliding_window),
        cos_(std::move(cos)),
        sin_(std::move(sin)),
        final_norm_(std::move(final_norm)) {}

  // Linears are given as (kind, weight, scales, mins, bias) tuples, unused parts None.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, py::tuple qkv, py::tuple o,
                 py::tuple gate_up, py::tuple down, torch::Tensor k_buf, torch::Tensor v_buf,
                 int64_t dense_rows) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), linear(qkv, dense_rows),
                            linear(o, dense_rows), linear(gate_up, dense_rows),
                            linear(down, dense_rows), std::move(k_buf), std::move(v_buf)});
  }

  // residual: the embeddings of the batch's tokens [batch, hidden] (consumed: it is the
  // residual stream). Returns the final norm's output [batch, hidden].
  torch::Tensor forward(torch::Tensor residual, torch::Tensor positions, torch::Tensor out_cache_loc,
                        torch::Tensor req_to_token, torch::Tensor req_rows, torch::Tensor seq_lens,
                        torch::Tensor key_starts, torch::Tensor order) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack has no layers");
    const int64_t tokens = residual.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    auto hidden = rms_norm(residual, layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto qkv = layer.qkv(hidden);
      auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      auto q = parts[0].view({tokens, num_heads_, head_dim_});
      auto k = parts[1].view({tokens, num_kv_heads_, head_dim_});
      auto v = parts[2].view({tokens, num_kv_heads_, head_dim_});
      rope_(q, k, positions, cos_, sin_);
      store_rows(layer.k_buf, k, out_cache_loc);
      store_rows(layer.v_buf, v, out_cache_loc);
      auto attn = decode_attention(q.contiguous(), layer.k_buf, layer.v_buf, req_to_token, req_rows,
                                   seq_lens, key_starts, order, scale_, sliding_window_)[0];
      auto attn_out = layer.o(attn.view({tokens, q_size}));
      hidden = add_rms_norm(attn_out, residual, layer.post_norm, eps_);
      auto mlp_out = layer.down(silu_and_mul(layer.gate_up(hidden)));
      const auto& next_norm = i + 1 == layers_.size() ? final_norm_ : layers_[i + 1].input_norm;
      hidden = add_rms_norm(mlp_out, residual, next_norm, eps_);
    }
    return hidden;
  }

 private:
  static Linear linear(const py::tuple& t, int64_t dense_rows) {
    TORCH_CHECK(t.size() == 5, "a linear is (kind, weight, scales, mins, bias)");
    auto tensor = [&](size_t i) {
      return t[i].is_none() ? torch::Tensor() : t[i].cast<torch::Tensor>();
    };
    Linear l{t[0].cast<std::string>(), tensor(1), tensor(2), tensor(3), tensor(4), dense_rows};
    TORCH_CHECK(l.kind == "dense" || l.kind == "q8_0" || l.kind == "q4_1", "unknown linear kind ",
                l.kind);
    return l;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t sliding_window_;
  torch::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
};

void register_decode_stack(py::module& m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, torch::Tensor, torch::Tensor,
                    torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}
