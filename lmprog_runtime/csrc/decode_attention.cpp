// Native CPU decode attention over the paged KV pool (float32 or bfloat16, OpenMP).
//
// One query token per request attends to all of that request's keys, found through the
// request-to-token table, without gathering K/V into a padded copy first. Work is split
// over requests, each thread a contiguous run holding about its share of the keys. Within
// one request, per kv head (grouped-query attention: its query heads together):
// 1. scores: 16 K rows at a time, each read once for all the group's heads, dot products
//    unrolled for head sizes 64 and 128 (the query in registers), 16 keys' partial sums
//    added across lanes together;
// 2. softmax per head, float32;
// 3. the weighted sum of V rows, up to four heads per pass over the rows, accumulated in
//    registers. float32, and bfloat16 on CPUs without AVX512-BF16 or with head sizes not a
//    multiple of 64: float32 FMAs over the widened values. Otherwise bfloat16 dot products
//    over pairs of keys, the probabilities rounded to bfloat16 first (as transformers' and
//    torch's bfloat16 attention round them): half the instructions.
// Scores and sums are float32 whatever the storage type. The rows of the next keys are
// prefetched while the current ones are used: a request's KV slots need not be adjacent.
// On SmolLM2-135M's shape (9 heads, 3 kv heads, 64 dims), 32 requests x 560 keys x 30
// layers on a 2-core Zen 5: 13.4 -> 6.1 ms in bfloat16 (2.2x; 2.9x with shuffled slots),
// 2.0x in float32.
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
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"
#include "decode_rows.h"
#include "native_ops.h"

#if LMPROG_AVX512
#include <immintrin.h>
#endif

using lmprog::bf16;

namespace {

using namespace lmprog::decode;

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

  // The keys request b attends to here: the last ones of its sequence, after its key start
  // (the keys before it are attended to by the caller) and within the window.
  int64_t keys(int64_t b) const {
    int64_t start = sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : 0;
    start = std::max(start, firsts[b]);
    return std::max<int64_t>(0, lens[b] - start);
  }
};

// A thread's scratch space, kept across its requests.
struct Scratch {
  std::vector<float> scores, acc, inv;
  std::vector<uint16_t> probs;  // bfloat16
};

// Attention of request ord[i] into op / lp, with the scratch space of the thread doing it.
// Returns false if one of its KV slot indices is out of range (no exception may leave an
// OpenMP region).
//
// bfloat16 with head sizes a multiple of 64 (and AVX512-BF16): the probabilities are rounded
// to bfloat16 before they weight the values, as transformers' and torch's bfloat16 attention
// do, and the value products run as bfloat16 dot products (`weighted_pairs`); otherwise they
// stay float32 (`weighted_rows`).
template <typename T>
bool decode_request(const DecodeProblem& pb, int64_t i, const T* qp, const T* kp, const T* vp,
                    T* op, float* lp, Scratch& s) {
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim;
  const int64_t group = num_heads / pb.num_kv_heads;
  const int64_t slot_stride = pb.num_kv_heads * head_dim;
  const int64_t b = pb.ord[i];
  const int64_t n = pb.keys(b);
  const int64_t* slots = pb.table + pb.rows[b] * pb.context_len + (pb.lens[b] - n);
  const T* qb = qp + b * num_heads * head_dim;
  int64_t lowest = 0, highest = 0;
  for (int64_t j = 0; j < n; ++j) {
    lowest = std::min(lowest, slots[j]);
    highest = std::max(highest, slots[j]);
  }
  if (lowest < 0 || highest >= pb.num_slots) return false;
  s.scores.resize(num_heads * n);
  s.acc.resize(num_heads * head_dim);
  // Pass 1: scores of each query head against its kv head, per key.
  for (int64_t g = 0; g < pb.num_kv_heads; ++g) {
    dot_rows(qb + g * group * head_dim, group, slots, n, kp + g * head_dim, slot_stride, head_dim,
             pb.scale, s.scores.data() + g * group * n);
  }
  T* ob = op + b * num_heads * head_dim;
#if LMPROG_BF16_DOT
  if constexpr (std::is_same_v<T, bf16>) {
    if (head_dim % 64 == 0) {
      const int64_t p_stride = n + (n & 1);
      s.probs.resize(num_heads * p_stride);
      s.inv.resize(num_heads);
      softmax_to_bf16(s.scores.data(), num_heads, n, p_stride, s.probs.data(), s.inv.data(),
                      lp + b * num_heads);
      // Pass 2: the weighted sum of value rows, the query heads of each kv head together.
      for (int64_t g = 0; g < pb.num_kv_heads; ++g) {
        weighted_pairs_group(s.probs.data() + g * group * p_stride, p_stride, slots, n,
                             vp + g * head_dim, slot_stride, head_dim, group,
                             s.acc.data() + g * group * head_dim);
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const __m512 inv = _mm512_set1_ps(s.inv[h]);
        for (int64_t d = h * head_dim; d < (h + 1) * head_dim; d += 16)
          lmprog::store16_bf16(ob + d, 0xFFFF, _mm512_mul_ps(_mm512_loadu_ps(&s.acc[d]), inv));
      }
      return true;
    }
  }
#endif
  for (int64_t h = 0; h < num_heads; ++h) {
    float* sc = s.scores.data() + h * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sc[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sc[j] = std::exp(sc[j] - m);
      sum += sc[j];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < n; ++j) sc[j] *= inv;
    // log-sum-exp of the scores, so partial results over key ranges can be merged.
    lp[b * num_heads + h] = sum > 0.f ? m + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
  // Pass 2: the softmax-weighted sum of value rows, the query heads of each kv head
  // together.
  for (int64_t g = 0; g < pb.num_kv_heads; ++g) {
    weighted_rows_group(s.scores.data() + g * group * n, n, slots, n, vp + g * head_dim,
                        slot_stride, head_dim, group, s.acc.data() + g * group * head_dim);
  }
  for (int64_t d = 0; d < num_heads * head_dim; ++d) ob[d] = lmprog::from_f32<T>(s.acc[d]);
  return true;
}

// The checked inputs and the outputs of one decode attention call; `run` does one thread's
// share of the requests, in its own parallel region or a caller's.
class DecodeAttentionWork final : public SplitWork {
 public:
  DecodeAttentionWork(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                      torch::Tensor req_to_token, torch::Tensor req_rows, torch::Tensor seq_lens,
                      torch::Tensor key_starts, torch::Tensor order, double scale,
                      int64_t sliding_window);

  // Each thread takes a contiguous run of the order holding about its share of the keys
  // (requests differ in length; an even split by count left one thread waiting on the other).
  void run(int64_t thread, int64_t num_threads) override {
    constexpr int64_t kRequestCost = 32;  // a request's fixed work, in keys
    int64_t total = 0;
    for (int64_t i = 0; i < pb_.batch; ++i) total += pb_.keys(pb_.ord[i]) + kRequestCost;
    Scratch s;
    lmprog::dispatch_float_types(q_.scalar_type(), "decode_attention", [&](auto tag) {
      using T = decltype(tag);
      int64_t before = 0;
      for (int64_t i = 0; i < pb_.batch; ++i) {
        const int64_t cost = pb_.keys(pb_.ord[i]) + kRequestCost;
        // The thread whose share holds the middle of this request's keys.
        const int64_t owner = std::min(num_threads - 1, (2 * before + cost) * num_threads / (2 * total));
        before += cost;
        if (owner < thread) continue;
        if (owner > thread) break;
        if (!decode_request<T>(pb_, i, q_.data_ptr<T>(), k_buf_.data_ptr<T>(),
                               v_buf_.data_ptr<T>(), out_.data_ptr<T>(), lse_.data_ptr<float>(), s))
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
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  std::vector<char> ordered(batch, 0);  // order must be a permutation: each output written once
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(pb_.lens[b] >= 1 && pb_.lens[b] <= pb_.context_len, "seq_len out of range");
    TORCH_CHECK(rows[b] >= 0 && rows[b] < req_to_token.size(0), "req_rows out of range");
    TORCH_CHECK(pb_.ord[b] >= 0 && pb_.ord[b] < batch && !ordered[pb_.ord[b]],
                "order must be a permutation of the batch");
    ordered[pb_.ord[b]] = 1;
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
