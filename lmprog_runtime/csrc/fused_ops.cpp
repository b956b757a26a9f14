// Native CPU fused elementwise ops for the Llama-family forward (float32 or bfloat16, OpenMP).
//
// Each op makes one pass over memory where the torch reference makes several (and
// allocates a temporary per step). All arithmetic is float32, whatever the storage type.
// Numerics follow transformers, i.e. `TorchOps`: RMSNorm takes its statistics in float32,
// rounds the normalized row to the input dtype and then multiplies by the weight (both
// roundings as torch does them, so the result is the reference's); add_rms_norm keeps the
// residual stream in the input dtype. SiLU-and-mul and RoPE round once, at the store
// (the reference rounds each intermediate product too). RoPE is rotate-half; SiLU is
// x / (1 + exp(-x)).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "cpu_vec.h"

using lmprog::bf16;
using lmprog::from_f32;
using lmprog::round_to;
using lmprog::to_f32;

namespace {

// Below this many elements an op runs on the calling thread: waking a team costs more than the
// work (tens of microseconds where the process holds more OpenMP threads than CPUs, as when the
// engine's loop thread and the main thread each have a team: libgomp's threads then sleep at
// once between regions). Measured on a 2-core Zen 5 in SmolLM2-135M's decode steps at batch
// 32: RoPE 133 us a call in parallel.
constexpr int64_t kParallelElements = 1 << 16;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && lmprog::is_supported_dtype(t.scalar_type()), name,
              " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, cols] with unit column stride");
}

void check_weight(const torch::Tensor& weight, const torch::Tensor& x) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight has dtype ", weight.scalar_type(),
              ", expected the input's ", x.scalar_type());
}

// out = weight * to_T(x / rms(x)), statistics in float32.
template <typename T>
inline void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += to_f32(x[i]) * to_f32(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(to_f32(w[i]) * round_to<T>(to_f32(x[i]) * r));
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) rms_row(xp + r * stride, wp, op + r * n, n, eps);
}

template <typename T>
void add_rms_norm_impl(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                       torch::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    T* res = rp + r * n;
    const T* xr = xp + r * stride;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) res[i] = from_f32<T>(to_f32(res[i]) + to_f32(xr[i]));
    rms_row(res, wp, op + r * n, n, eps);
  }
}

template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2, stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = xp + r * stride;
    const T* up = gate + inter;
    T* o = op + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      // e^-g capped below float32's overflow (g < -88: silu is -0 to float32 precision
      // either way); with -ffast-math, which assumes no infinity, g / (1 + inf) gave NaN.
      const float g = to_f32(gate[i]);
      o[i] = from_f32<T>(g / (1.f + std::exp(std::min(-g, 88.f))) * to_f32(up[i]));
    }
  }
}

// x: [tokens, heads, head_dim] of T (row stride `stride`); cos/sin: [max_pos, head_dim] of C.
template <typename T, typename C>
void rope_impl(T* xp, int64_t tokens, int64_t heads, int64_t stride, int64_t head_dim,
               const int64_t* pos, const C* cp, const C* sp) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const C* c = cp + pos[t] * head_dim;
    const C* s = sp + pos[t] * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = xp + t * stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f32(v[i]), x2 = to_f32(v[i + half]);
        v[i] = from_f32<T>(x1 * to_f32(c[i]) - x2 * to_f32(s[i]));
        v[i + half] = from_f32<T>(x2 * to_f32(c[i + half]) + x1 * to_f32(s[i + half]));
      }
    }
  }
}

}  // namespace

// out = weight * x / rms(x); x: [rows, hidden]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  lmprog::dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, weight, out, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place, rounded to its dtype); returns weight * residual / rms(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "x/residual shape mismatch");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "x/residual dtype mismatch");
  check_weight(weight, x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  lmprog::dispatch_float_types(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    add_rms_norm_impl<decltype(tag)>(x, residual, weight, out, static_cast<float>(eps));
  });
  return out;
}

// x: [rows, 2 * inter] (gate | up) -> silu(gate) * up: [rows, inter]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "last dimension must be even");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  lmprog::dispatch_float_types(x.scalar_type(), "silu_and_mul",
                               [&](auto tag) { silu_and_mul_impl<decltype(tag)>(x, out); });
  return out;
}

// In-place rotate-half RoPE on q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim]
// (row strides may be anything, heads contiguous; float32 or bfloat16, both the same);
// cos/sin: [max_pos, head_dim], float32 or q's dtype.
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin) {
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3, "q/k must be CPU tensors [T, H, D]");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q/k heads must be contiguous");
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q/k dtype mismatch");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "bad cos/sin");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() &&
                  (cos.scalar_type() == torch::kFloat32 || cos.scalar_type() == q.scalar_type()),
              "cos/sin must be float32 or q's dtype");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == head_dim && cos.dim() == 2 && cos.size(1) == head_dim,
              "shape mismatch");
  TORCH_CHECK(positions.numel() == tokens, "positions must have one entry per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  lmprog::dispatch_float_types(q.scalar_type(), "rope_", [&](auto tag) {
    using T = decltype(tag);
    lmprog::dispatch_float_types(cos.scalar_type(), "rope_", [&](auto ctag) {
      using C = decltype(ctag);
      for (torch::Tensor* x : {&q, &k}) {
        rope_impl<T, C>(x->data_ptr<T>(), tokens, x->size(1), x->stride(0), head_dim, pos,
                        cos.data_ptr<C>(), sin.data_ptr<C>());
      }
    });
  });
}
