// Native CPU fused elementwise ops for the Llama-family forward (float32, OpenMP).
//
// Each op makes one pass over memory where the torch reference makes several (and
// allocates a temporary per step). Numerics follow transformers: RMSNorm accumulates in
// float32, RoPE is rotate-half, SiLU is x / (1 + exp(-x)).
#include <torch/extension.h>

#include <cmath>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, cols] with unit column stride");
}

inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

}  // namespace

// out = weight * x / rms(x); x: [rows, hidden]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rms_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
  return out;
}

// residual += x (in place); returns weight * residual / rms(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "x/residual shape mismatch");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* res = rp + r * n;
    const float* xr = xp + r * stride;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) res[i] += xr[i];
    rms_row(res, wp, op + r * n, n, static_cast<float>(eps));
  }
  return out;
}

// x: [rows, 2 * inter] (gate | up) -> silu(gate) * up: [rows, inter]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "last dimension must be even");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, stride = x.stride(0);
  auto out = torch::empty({rows, inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = xp + r * stride;
    const float* up = gate + inter;
    float* o = op + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
  return out;
}

// In-place rotate-half RoPE on q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim]
// (row strides may be anything, heads contiguous); cos/sin: [max_pos, head_dim].
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin) {
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->dim() == 3, "q/k must be float32 [T, H, D]");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q/k heads must be contiguous");
  }
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "bad cos/sin");
  const int64_t tokens = q.size(0), head_dim = q.size(2), half = head_dim / 2;
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == head_dim && cos.size(1) == head_dim, "shape mismatch");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  auto apply = [&](torch::Tensor& x) {
    float* xp = x.data_ptr<float>();
    const int64_t heads = x.size(1), stride = x.stride(0);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* c = cp + pos[t] * head_dim;
      const float* s = sp + pos[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] - x2 * s[i];
          v[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  };
  apply(q);
  apply(k);
}
