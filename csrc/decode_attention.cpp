// Native CPU decode attention over the paged KV pool (float32, OpenMP).
//
// One query token per request attends to all of that request's keys, found through the
// request-to-token table, without gathering K/V into a padded copy first. Work is split
// over requests; each reads every K/V row (all kv heads, contiguous in the pool) once and
// serves every query head from it (grouped-query attention).
//
// Shapes:
//   q            [batch, num_heads, head_dim]
//   k_buf, v_buf [num_slots, num_kv_heads, head_dim]
//   req_to_token [num_rows, context_len] int64
//   req_rows     [batch] int64, seq_lens [batch] int64
//   key_starts   [batch] int64: first key position per request (the keys before it, a
//                prefix shared with other requests, are attended to by the caller)
//   order        [batch] int64: the order requests are processed in. Requests that share a
//                cached prefix should be adjacent: each thread takes a contiguous run of
//                the order, so a shared prefix is read from memory once and then from cache.
//   returns      out [batch, num_heads, head_dim] and lse [batch, num_heads] (log-sum-exp
//                of the scores, -inf when a request has no keys in range)
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void check(const torch::Tensor& t, const char* name, int64_t dim, c10::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf,
                                            torch::Tensor v_buf, torch::Tensor req_to_token,
                                            torch::Tensor req_rows, torch::Tensor seq_lens,
                                            torch::Tensor key_starts, torch::Tensor order,
                                            double scale, int64_t sliding_window) {
  check(q, "q", 3, torch::kFloat32);
  check(k_buf, "k_buf", 3, torch::kFloat32);
  check(v_buf, "v_buf", 3, torch::kFloat32);
  check(req_to_token, "req_to_token", 2, torch::kInt64);
  check(req_rows, "req_rows", 1, torch::kInt64);
  check(seq_lens, "seq_lens", 1, torch::kInt64);
  check(order, "order", 1, torch::kInt64);
  check(key_starts, "key_starts", 1, torch::kInt64);
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == head_dim && v_buf.sizes() == k_buf.sizes(), "K/V pool shape mismatch");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(req_rows.size(0) == batch && seq_lens.size(0) == batch && order.size(0) == batch &&
                  key_starts.size(0) == batch,
              "batch size mismatch");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t context_len = req_to_token.size(1);
  const int64_t num_slots = k_buf.size(0);

  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, num_heads}, q.options());
  float* lp = lse.data_ptr<float>();
  const int64_t* firsts = key_starts.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k_buf.data_ptr<float>();
  const float* vp = v_buf.data_ptr<float>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t slot_stride = num_kv_heads * head_dim;

  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= context_len, "seq_len out of range");
    TORCH_CHECK(ord[b] >= 0 && ord[b] < batch, "order out of range");
  }

  std::atomic<bool> bad_slot{false};  // no exceptions may leave an OpenMP region
#pragma omp parallel
  {
    std::vector<float> scores;  // [num_heads, n]
    std::vector<float> acc(num_heads * head_dim);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t b = ord[i];
      const int64_t len = lens[b];
      int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      start = std::max(start, firsts[b]);  // keys before it are handled by the caller
      const int64_t n = std::max<int64_t>(0, len - start);
      const int64_t* slots = table + rows[b] * context_len + start;
      const float* qb = qp + b * num_heads * head_dim;
      scores.assign(num_heads * n, 0.f);
      // Pass 1: one contiguous [num_kv_heads, head_dim] key row per position serves all heads.
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slots[j];
        if (slot < 0 || slot >= num_slots) {
          bad_slot = true;
          continue;
        }
        if (j + 4 < n) __builtin_prefetch(kp + slots[j + 4] * slot_stride);
        const float* key = kp + slot * slot_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          scores[h * n + j] = dot(qb + h * head_dim, key + (h / group) * head_dim, head_dim) * scale;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        // log-sum-exp of the scores, so partial results over key ranges can be merged.
        lp[b * num_heads + h] = sum > 0.f ? m + std::log(sum) : -std::numeric_limits<float>::infinity();
      }
      // Pass 2: weighted sum of value rows, again one contiguous row per position.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n && !bad_slot; ++j) {
        if (j + 4 < n) __builtin_prefetch(vp + slots[j + 4] * slot_stride);
        const float* value = vp + slots[j] * slot_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * n + j];
          const float* vh = value + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * num_heads * head_dim);
    }
  }
  TORCH_CHECK(!bad_slot, "decode_attention: a KV slot index is out of range");
  return {out, lse};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU, float32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused [rows, 2 * inter] input");
  m.def("rope_", &rope_, "in-place rotate-half RoPE on q and k");
}
