// Native CPU decode attention over the paged KV pool (float32 or bfloat16, OpenMP).
//
// One query token per request attends to all of that request's keys, found through the
// request-to-token table, without gathering K/V into a padded copy first. Work is split
// over requests; within one, each query head streams its kv head's slice of the request's
// K rows (scores, 16 keys at a time), then the query heads of each kv head (grouped-query
// attention) stream its V rows together (weighted sums, accumulated in registers with
// AVX-512). Scores, softmax and the weighted sum are float32 whatever the storage type;
// only `out` is rounded.
//
// Shapes:
//   q            [batch, num_heads, head_dim], float32 or bfloat16
//   k_buf, v_buf [num_slots, num_kv_heads, head_dim], q's dtype
//   req_to_token [num_rows, context_len] int64
//   req_rows     [batch] int64, seq_lens [batch] int64
//   key_starts   [batch] int64: first key position per request (the keys before it, a
//                prefix shared with other requests, are attended to by the caller)
//   order        [batch] int64: the order requests are processed in. Requests that share a
//                cached prefix should be adjacent: each thread takes a contiguous run of
//                the order, so a shared prefix is read from memory once and then from cache.
//   returns      out [batch, num_heads, head_dim] in q's dtype and lse [batch, num_heads] in
//                float32 (log-sum-exp of the scores, -inf when a request has no keys in range)
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"
#include "native_ops.h"

#if LMPROG_AVX512
#include <immintrin.h>
#endif

using lmprog::bf16;
using lmprog::to_f32;

namespace {

#if LMPROG_AVX512
// 16-lane helpers for the loops below: masked tails, bfloat16 widened in registers.
inline __mmask16 tail16(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16(const float* p, __mmask16 m) { return lmprog::load16_ps(p, m); }

inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i bits = lmprog::load16_epi16(p, m);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// q . k over n elements as a vector of partial sums (its lanes add up to the product).
template <typename T>
inline __m512 dot_partial(const T* q, const T* k, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail16(n - i);
    acc = _mm512_fmadd_ps(load16(q + i, m), load16(k + i, m), acc);
  }
  return acc;
}

#if defined(__AVX512BF16__)
// Pairs of bfloat16 products summed into float32 lanes, 32 elements per instruction.
template <>
inline __m512 dot_partial(const bf16* q, const bf16* k, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 32) {
    const int64_t left = n - i;
    __m512i qi, ki;
    if (left >= 32) {
      qi = _mm512_loadu_si512(q + i);
      ki = _mm512_loadu_si512(k + i);
    } else {
      const __mmask32 m = (1u << left) - 1;
      qi = _mm512_maskz_loadu_epi16(m, q + i);
      ki = _mm512_maskz_loadu_epi16(m, k + i);
    }
    acc = _mm512_dpbf16_ps(acc, (__m512bh)qi, (__m512bh)ki);
  }
  return acc;
}
#endif

// Lane i of the result = the sum of the 16 lanes of a[i]: a transpose-and-add in four
// levels (within 128-bit chunks, then across them), a few instructions per vector where a
// reduction of each alone takes a dozen.
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per chunk: [x0+x2, y0+y2, x1+x3, y1+y3], x = a[2i], y = a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per chunk: the chunk's sums of a[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // chunks: c[2i] (0+1, 2+3), c[2i+1] (0+1, 2+3)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // chunk i: the full sums of a[4i .. 4i + 3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// The two inner loops of a decode step, over a request's n keys; row j of a kv head is
// base + slots[j] * stride. With AVX-512 they use the helpers above: the compiler's loops
// spend more on remainders than on the work for rows of 64 elements, and pass 2 must keep
// its accumulators in registers (accumulating into memory stalls on every masked
// store->load).

// scores[j] = scale * (q . k_j) over head_dim elements, float32 products and sums; keys in
// blocks of 16, whose 16 dot products are summed across lanes together.
template <typename T>
inline void dot_rows(const T* q, const int64_t* slots, int64_t n, const T* base, int64_t stride,
                     int64_t head_dim, float scale, float* scores) {
#if LMPROG_AVX512
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    __m512 acc[16];
    for (int64_t i = 0; i < 16; ++i)
      acc[i] = i < count ? dot_partial(q, base + slots[j0 + i] * stride, head_dim) : _mm512_setzero_ps();
    lmprog::store16_ps(scores + j0, tail16(count), _mm512_mul_ps(sum_lanes16(acc), vscale));
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    const T* k = base + slots[j] * stride;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < head_dim; ++d) acc += to_f32(q[d]) * to_f32(k[d]);
    scores[j] = acc * scale;
  }
#endif
}

// out[h] = sum_j p[h][j] * v_j over head_dim elements, for the H query heads of one kv
// head (probabilities p[h] = p + h * p_stride, outputs out + h * head_dim): each value row
// is read once for all of them.
template <int H, typename T>
inline void weighted_rows(const float* p, int64_t p_stride, const int64_t* slots, int64_t n,
                          const T* base, int64_t stride, int64_t head_dim, float* out) {
#if LMPROG_AVX512
  for (int64_t c = 0; c < head_dim; c += 64) {  // 64 columns: four accumulators per head
    const __mmask16 m0 = tail16(head_dim - c), m1 = tail16(head_dim - c - 16),
                    m2 = tail16(head_dim - c - 32), m3 = tail16(head_dim - c - 48);
    __m512 a[H][4];
    for (int h = 0; h < H; ++h) a[h][0] = a[h][1] = a[h][2] = a[h][3] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* v = base + slots[j] * stride + c;
      const __m512 v0 = load16(v, m0), v1 = load16(v + 16, m1), v2 = load16(v + 32, m2),
                   v3 = load16(v + 48, m3);
      for (int h = 0; h < H; ++h) {
        const __m512 pj = _mm512_set1_ps(p[h * p_stride + j]);
        a[h][0] = _mm512_fmadd_ps(pj, v0, a[h][0]);
        a[h][1] = _mm512_fmadd_ps(pj, v1, a[h][1]);
        a[h][2] = _mm512_fmadd_ps(pj, v2, a[h][2]);
        a[h][3] = _mm512_fmadd_ps(pj, v3, a[h][3]);
      }
    }
    for (int h = 0; h < H; ++h) {
      float* o = out + h * head_dim + c;
      lmprog::store16_ps(o, m0, a[h][0]);
      lmprog::store16_ps(o + 16, m1, a[h][1]);
      lmprog::store16_ps(o + 32, m2, a[h][2]);
      lmprog::store16_ps(o + 48, m3, a[h][3]);
    }
  }
#else
  for (int h = 0; h < H; ++h) {
    float* o = out + h * head_dim;
    const float* ph = p + h * p_stride;
    std::fill(o, o + head_dim, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = base + slots[j] * stride;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += ph[j] * to_f32(v[d]);
    }
  }
#endif
}

// weighted_rows for `heads` consecutive query heads of one kv head: up to four at a time
// for head sizes up to 64 (16 accumulators); one at a time beyond (at 128, two or four at
// once measured slower than one: 3.0 against 2.5 ms for 8 requests x 1000 keys x 32 heads).
template <typename T>
inline void weighted_rows_group(const float* p, int64_t p_stride, const int64_t* slots, int64_t n,
                                const T* base, int64_t stride, int64_t head_dim, int64_t heads,
                                float* out) {
  const int64_t most = head_dim <= 64 ? 4 : 1;
  for (int64_t h = 0; h < heads;) {
    const int64_t take = std::min(most, heads - h);
    const float* ph = p + h * p_stride;
    float* oh = out + h * head_dim;
    if (take == 4) weighted_rows<4>(ph, p_stride, slots, n, base, stride, head_dim, oh);
    if (take == 3) weighted_rows<3>(ph, p_stride, slots, n, base, stride, head_dim, oh);
    if (take == 2) weighted_rows<2>(ph, p_stride, slots, n, base, stride, head_dim, oh);
    if (take == 1) weighted_rows<1>(ph, p_stride, slots, n, base, stride, head_dim, oh);
    h += take;
  }
}

void check(const torch::Tensor& t, const char* name, int64_t dim, c10::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

struct DecodeProblem {
  int64_t batch, num_heads, num_kv_heads, head_dim, context_len, num_slots;
  const int64_t* table;  // [num_rows, context_len]
  const int64_t* rows;
  const int64_t* lens;
  const int64_t* firsts;
  const int64_t* ord;
  float scale;
  int64_t sliding_window;
};

// Attention of request ord[i] into op / lp, with the scratch vectors of the thread doing it.
// Returns false if one of its KV slot indices is out of range (no exception may leave an
// OpenMP region).
template <typename T>
bool decode_request(const DecodeProblem& pb, int64_t i, const T* qp, const T* kp, const T* vp,
                    T* op, float* lp, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim;
  const int64_t group = num_heads / pb.num_kv_heads;
  const int64_t slot_stride = pb.num_kv_heads * head_dim;
  const int64_t b = pb.ord[i];
  const int64_t len = pb.lens[b];
  int64_t start = pb.sliding_window > 0 ? std::max<int64_t>(0, len - pb.sliding_window) : 0;
  start = std::max(start, pb.firsts[b]);  // keys before it are handled by the caller
  const int64_t n = std::max<int64_t>(0, len - start);
  const int64_t* slots = pb.table + pb.rows[b] * pb.context_len + start;
  const T* qb = qp + b * num_heads * head_dim;
  bool slots_ok = true;
  for (int64_t j = 0; j < n; ++j) slots_ok &= slots[j] >= 0 && slots[j] < pb.num_slots;
  if (!slots_ok) return false;
  scores.resize(num_heads * n);
  acc.resize(num_heads * head_dim);
  // Pass 1: scores of each query head h against its kv head h / group, per key.
  for (int64_t h = 0; h < num_heads; ++h) {
    dot_rows(qb + h * head_dim, slots, n, kp + (h / group) * head_dim, slot_stride, head_dim,
             pb.scale, scores.data() + h * n);
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
  // Pass 2: the softmax-weighted sum of value rows, the query heads of each kv head
  // together.
  for (int64_t g = 0; g < pb.num_kv_heads; ++g) {
    weighted_rows_group(scores.data() + g * group * n, n, slots, n, vp + g * head_dim,
                        slot_stride, head_dim, group, acc.data() + g * group * head_dim);
  }
  T* ob = op + b * num_heads * head_dim;
  for (int64_t d = 0; d < num_heads * head_dim; ++d) ob[d] = lmprog::from_f32<T>(acc[d]);
  return true;
}

// The checked inputs and the outputs of one decode attention call; `run` does the requests
// ord[first .. last) for one thread, in its own parallel region or a caller's.
class DecodeAttentionWork final : public SplitWork {
 public:
  DecodeAttentionWork(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                      torch::Tensor req_to_token, torch::Tensor req_rows, torch::Tensor seq_lens,
                      torch::Tensor key_starts, torch::Tensor order, double scale,
                      int64_t sliding_window);

  void run(int64_t thread, int64_t num_threads) override {
    const int64_t first = pb_.batch * thread / num_threads;
    const int64_t last = pb_.batch * (thread + 1) / num_threads;
    std::vector<float> scores, acc;
    lmprog::dispatch_float_types(q_.scalar_type(), "decode_attention", [&](auto tag) {
      using T = decltype(tag);
      for (int64_t i = first; i < last; ++i) {
        if (!decode_request<T>(pb_, i, q_.data_ptr<T>(), k_buf_.data_ptr<T>(),
                               v_buf_.data_ptr<T>(), out_.data_ptr<T>(), lse_.data_ptr<float>(),
                               scores, acc))
          bad_slot_ = true;
      }
    });
  }

  torch::Tensor output() const override {
    TORCH_CHECK(!bad_slot_, "decode_attention: a KV slot index is out of range");
    return out_;
  }

  torch::Tensor lse() const { return lse_; }

 private:
  torch::Tensor q_, k_buf_, v_buf_, tensors_[5], out_, lse_;  // tensors_: what pb_ points into
  DecodeProblem pb_{};
  std::atomic<bool> bad_slot_{false};
};

DecodeAttentionWork::DecodeAttentionWork(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                         torch::Tensor req_to_token, torch::Tensor req_rows,
                                         torch::Tensor seq_lens, torch::Tensor key_starts,
                                         torch::Tensor order, double scale,
                                         int64_t sliding_window) {
  TORCH_CHECK(lmprog::is_supported_dtype(q.scalar_type()), "q must be float32 or bfloat16, got ",
              q.scalar_type());
  check(q, "q", 3, q.scalar_type());
  check(k_buf, "k_buf", 3, q.scalar_type());
  check(v_buf, "v_buf", 3, q.scalar_type());
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
  pb_ = DecodeProblem{batch,
                      num_heads,
                      num_kv_heads,
                      head_dim,
                      req_to_token.size(1),
                      k_buf.size(0),
                      req_to_token.data_ptr<int64_t>(),
                      req_rows.data_ptr<int64_t>(),
                      seq_lens.data_ptr<int64_t>(),
                      key_starts.data_ptr<int64_t>(),
                      order.data_ptr<int64_t>(),
                      static_cast<float>(scale),
                      sliding_window};
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(pb_.lens[b] >= 1 && pb_.lens[b] <= pb_.context_len, "seq_len out of range");
    TORCH_CHECK(pb_.ord[b] >= 0 && pb_.ord[b] < batch, "order out of range");
  }
  q_ = std::move(q), k_buf_ = std::move(k_buf), v_buf_ = std::move(v_buf);
  tensors_[0] = std::move(req_to_token), tensors_[1] = std::move(req_rows);
  tensors_[2] = std::move(seq_lens), tensors_[3] = std::move(key_starts);
  tensors_[4] = std::move(order);
  out_ = torch::empty_like(q_);
  lse_ = torch::empty({batch, num_heads}, q_.options().dtype(torch::kFloat32));
}

}  // namespace

std::unique_ptr<SplitWork> prepare_decode_attention(torch::Tensor q, torch::Tensor k_buf,
                                                    torch::Tensor v_buf, torch::Tensor req_to_token,
                                                    torch::Tensor req_rows, torch::Tensor seq_lens,
                                                    torch::Tensor key_starts, torch::Tensor order,
                                                    double scale, int64_t sliding_window) {
  return std::make_unique<DecodeAttentionWork>(q, k_buf, v_buf, req_to_token, req_rows, seq_lens,
                                               key_starts, order, scale, sliding_window);
}

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf,
                                            torch::Tensor v_buf, torch::Tensor req_to_token,
                                            torch::Tensor req_rows, torch::Tensor seq_lens,
                                            torch::Tensor key_starts, torch::Tensor order,
                                            double scale, int64_t sliding_window) {
  DecodeAttentionWork work(q, k_buf, v_buf, req_to_token, req_rows, seq_lens, key_starts, order,
                           scale, sliding_window);
#pragma omp parallel
  work.run(omp_get_thread_num(), omp_get_num_threads());
  return {work.output(), work.lse()};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU, float32 or bfloat16)");
  m.def("extend_attention", &extend_attention,
        "causal extend attention over the paged pool (CPU, bfloat16; AMX tiles or AVX512-BF16)");
  m.def("extend_attention_available", &extend_attention_available,
        "whether extend_attention can run here, on AMX tiles (amx=True) or AVX512-BF16");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU, float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused [rows, 2 * inter] input");
  m.def("rope_", &rope_, "in-place rotate-half RoPE on q and k");
  m.def("q8_0_linear", &q8_0_linear, "x @ w.T over Q8_0 blocks");
  m.def("q4_1_linear", &q4_1_linear, "x @ w.T over Q4_1 blocks");
  m.def("quantized_dense_rows", &quantized_dense_rows,
        "rows from which a quantized layer runs as a dense matmul over its dequantized weight");
  m.def("q8_0_dequantize", &q8_0_dequantize, "Q8_0 blocks to a dense float32 / bfloat16 matrix");
  m.def("q4_1_dequantize", &q4_1_dequantize, "Q4_1 blocks to a dense float32 / bfloat16 matrix");
  m.def("amx_linear_available", &amx_linear_available, "whether amx_linear can run here");
  m.def("amx_linear", &amx_linear, "x @ w.T + bias over a weight packed for AMX tiles (CPU, bfloat16)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  register_decode_stack(m);
}
