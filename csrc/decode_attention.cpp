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

#if LMPROG_AVX512
// dot_rows' blocks of 16 keys, for one head size (HEAD_DIM > 0: known at compile time, so
// the products unroll and the query stays in registers) or any (HEAD_DIM == 0). A block's
// last keys past n repeat its last key (their scores are not stored). Each block's rows are
// prefetched while the block before runs: a request's KV slots need not be adjacent, so the
// hardware prefetcher cannot follow them.
template <int HEAD_DIM, typename T>
inline void dot_blocks(const T* q, int64_t heads, const int64_t* slots, int64_t n, const T* base,
                       int64_t stride, int64_t any_head_dim, float scale, float* scores) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : any_head_dim;
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    const T* rows[16];
    for (int64_t i = 0; i < 16; ++i) rows[i] = base + slots[j0 + std::min(i, count - 1)] * stride;
    for (int64_t i = j0 + 16; i < std::min(n, j0 + 32); ++i)
      for (int64_t at = 0; at < row_bytes; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + slots[i] * stride) + at, _MM_HINT_T0);
    for (int64_t h = 0; h < heads; ++h) {
      const T* qh = q + h * head_dim;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = dot_partial(qh, rows[i], head_dim);
      lmprog::store16_ps(scores + h * n + j0, tail16(count), _mm512_mul_ps(sum_lanes16(acc), vscale));
    }
  }
}
#endif

// scores[h * n + j] = scale * (q_h . k_j) over head_dim elements, for the `heads` query
// heads of one kv head (q_h = q + h * head_dim); float32 products and sums. Keys in blocks of
// 16, whose 16 dot products are summed across lanes together; every head of the group takes
// a block before the next one is read, so its rows are read from memory once and then from
// L1 (head-major order re-read a whole request's keys from L2 for each head).
template <typename T>
inline void dot_rows(const T* q, int64_t heads, const int64_t* slots, int64_t n, const T* base,
                     int64_t stride, int64_t head_dim, float scale, float* scores) {
#if LMPROG_AVX512
  if (head_dim == 64) return dot_blocks<64>(q, heads, slots, n, base, stride, 0, scale, scores);
  if (head_dim == 128) return dot_blocks<128>(q, heads, slots, n, base, stride, 0, scale, scores);
  dot_blocks<0>(q, heads, slots, n, base, stride, head_dim, scale, scores);
#else
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < n; ++j) {
      const T* k = base + slots[j] * stride;
      const T* qh = q + h * head_dim;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < head_dim; ++d) acc += to_f32(qh[d]) * to_f32(k[d]);
      scores[h * n + j] = acc * scale;
    }
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

#if LMPROG_BF16_DOT
// Where the lanes of the two accumulators a pair of value rows fills go in dim order. The
// pair's words are interleaved by unpacklo / unpackhi, which work per 128-bit lane: for a
// 32-dim chunk, lane 4L + i of the low accumulator is dim 8L + i, of the high one dim
// 8L + 4 + i (i < 4). As permutex2var indices (16 + i: lane i of the high one): dims 0-15
// and dims 16-31.
alignas(64) constexpr int32_t kPairDims[2][16] = {
    {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
    {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};

// out[h] = sum_j p[h][j] * v_j for H query heads of one kv head, bfloat16 values and
// probabilities (p[h] = p + h * p_stride, one more zero when n is odd), head_dim a multiple
// of 64: vdpbf16ps over pairs of keys, the two rows' words interleaved meeting each head's
// two probabilities broadcast, which does in one instruction what two float32 FMAs do over
// widened values.
template <int H>
inline void weighted_pairs(const uint16_t* p, int64_t p_stride, const int64_t* slots, int64_t n,
                           const bf16* base, int64_t stride, int64_t head_dim, float* out) {
  const __m512i low = _mm512_load_si512(kPairDims[0]), high = _mm512_load_si512(kPairDims[1]);
  for (int64_t c = 0; c < head_dim; c += 64) {
    __m512 a[H][4];
    for (int h = 0; h < H; ++h) a[h][0] = a[h][1] = a[h][2] = a[h][3] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 2) {
      if (j + 16 < n) {
        _mm_prefetch(reinterpret_cast<const char*>(base + slots[j + 16] * stride + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(base + slots[j + 16] * stride + c + 32), _MM_HINT_T0);
      }
      if (j + 17 < n) {
        _mm_prefetch(reinterpret_cast<const char*>(base + slots[j + 17] * stride + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(base + slots[j + 17] * stride + c + 32), _MM_HINT_T0);
      }
      const bf16* v0 = base + slots[j] * stride + c;
      const __m512i x0 = _mm512_loadu_si512(v0), x1 = _mm512_loadu_si512(v0 + 32);
      __m512i y0 = _mm512_setzero_si512(), y1 = _mm512_setzero_si512();
      if (j + 1 < n) {
        const bf16* v1 = base + slots[j + 1] * stride + c;
        y0 = _mm512_loadu_si512(v1);
        y1 = _mm512_loadu_si512(v1 + 32);
      }
      const __m512bh w0 = lmprog::as_bh(_mm512_unpacklo_epi16(x0, y0));
      const __m512bh w1 = lmprog::as_bh(_mm512_unpackhi_epi16(x0, y0));
      const __m512bh w2 = lmprog::as_bh(_mm512_unpacklo_epi16(x1, y1));
      const __m512bh w3 = lmprog::as_bh(_mm512_unpackhi_epi16(x1, y1));
      for (int h = 0; h < H; ++h) {
        const __m512bh pj = lmprog::broadcast_pair(p + h * p_stride + j);
        a[h][0] = _mm512_dpbf16_ps(a[h][0], pj, w0);
        a[h][1] = _mm512_dpbf16_ps(a[h][1], pj, w1);
        a[h][2] = _mm512_dpbf16_ps(a[h][2], pj, w2);
        a[h][3] = _mm512_dpbf16_ps(a[h][3], pj, w3);
      }
    }
    for (int h = 0; h < H; ++h) {
      float* o = out + h * head_dim + c;
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(a[h][0], low, a[h][1]));
      _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a[h][0], high, a[h][1]));
      _mm512_storeu_ps(o + 32, _mm512_permutex2var_ps(a[h][2], low, a[h][3]));
      _mm512_storeu_ps(o + 48, _mm512_permutex2var_ps(a[h][2], high, a[h][3]));
    }
  }
}

// The softmax of each head's n scores (scores + h * n, already scaled) as unnormalized
// bfloat16 probabilities exp(s - max) into probs + h * p_stride (a zero after the last when
// n is odd), 1 / their sum into inv[h] (the sum of the rounded values, which is what the
// output gets weighted by) and the log-sum-exp into lse[h].
inline void softmax_to_bf16(const float* scores, int64_t heads, int64_t n, int64_t p_stride,
                            uint16_t* probs, float* inv, float* lse) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* s = scores + h * n;
    uint16_t* ph = probs + h * p_stride;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail16(n - j);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, lmprog::load16_ps(s + j, m));
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    const __m512 shift = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = tail16(n - j);
      const __m512 e = _mm512_maskz_mov_ps(
          m, lmprog::exp_nonpositive(_mm512_sub_ps(lmprog::load16_ps(s + j, m), shift)));
      const __m256bh pb = _mm512_cvtneps_pbh(e);
      const __m256i bits = reinterpret_cast<const __m256i&>(pb);
      if (m == 0xFFFF)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + j), bits);
      else
        _mm256_mask_storeu_epi16(ph + j, m, bits);
      vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(pb));
    }
    if (n & 1) ph[n] = 0;
    const float sum = _mm512_reduce_add_ps(vsum);
    inv[h] = sum > 0.f ? 1.f / sum : 0.f;
    lse[h] = sum > 0.f ? mx + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
}
#endif

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
      // Pass 2: the weighted sum of value rows, the query heads of each kv head together,
      // up to four at a time (16 accumulators).
      for (int64_t h = 0; h < num_heads;) {
        const int64_t take = std::min<int64_t>(4, group - h % group);
        const uint16_t* ph = s.probs.data() + h * p_stride;
        const bf16* vg = vp + (h / group) * head_dim;
        float* oh = s.acc.data() + h * head_dim;
        if (take == 4) weighted_pairs<4>(ph, p_stride, slots, n, vg, slot_stride, head_dim, oh);
        if (take == 3) weighted_pairs<3>(ph, p_stride, slots, n, vg, slot_stride, head_dim, oh);
        if (take == 2) weighted_pairs<2>(ph, p_stride, slots, n, vg, slot_stride, head_dim, oh);
        if (take == 1) weighted_pairs<1>(ph, p_stride, slots, n, vg, slot_stride, head_dim, oh);
        h += take;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const __m512 inv = _mm512_set1_ps(s.inv[h]);
        for (int64_t d = h * head_dim; d < (h + 1) * head_dim; d += 16) {
          const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&s.acc[d]), inv));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + d), reinterpret_cast<const __m256i&>(rounded));
        }
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
