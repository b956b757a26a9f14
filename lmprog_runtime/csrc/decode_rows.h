// The inner loops of the native decode attention (`decode_attention.cpp`) over one
// request's keys, one kv head's query heads at a time: scores against the K rows, softmax
// (bfloat16 path), weighted sums of the V rows. Row j of a kv head is base + slots[j] *
// stride in the paged pool; every loop reads its rows through `slots`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu_vec.h"

#if LMPROG_AVX512
#include <immintrin.h>
#endif

namespace lmprog::decode {

using lmprog::bf16;
using lmprog::to_f32;

#if LMPROG_AVX512
// 16-lane helpers for the loops below: masked tails, bfloat16 widened in registers.
using lmprog::tail16;

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

// fn(h, H) for the `heads` consecutive query heads of one kv head, H (a compile-time 1-4)
// of them from head h at a time, at most `most`.
template <typename Fn>
inline void in_head_tiles(int64_t heads, int64_t most, Fn&& fn) {
  for (int64_t h = 0; h < heads;) {
    const int64_t take = std::min(most, heads - h);
    if (take == 4) fn(h, std::integral_constant<int, 4>{});
    if (take == 3) fn(h, std::integral_constant<int, 3>{});
    if (take == 2) fn(h, std::integral_constant<int, 2>{});
    if (take == 1) fn(h, std::integral_constant<int, 1>{});
    h += take;
  }
}

// weighted_rows for `heads` consecutive query heads of one kv head: up to four at a time
// for head sizes up to 64 (16 accumulators); one at a time beyond (at 128, two or four at
// once measured slower than one: 3.0 against 2.5 ms for 8 requests x 1000 keys x 32 heads).
template <typename T>
inline void weighted_rows_group(const float* p, int64_t p_stride, const int64_t* slots, int64_t n,
                                const T* base, int64_t stride, int64_t head_dim, int64_t heads,
                                float* out) {
  in_head_tiles(heads, head_dim <= 64 ? 4 : 1, [&](int64_t h, auto tile) {
    weighted_rows<decltype(tile)::value>(p + h * p_stride, p_stride, slots, n, base, stride,
                                         head_dim, out + h * head_dim);
  });
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

// weighted_pairs for `heads` consecutive query heads of one kv head, up to four at a time
// (16 accumulators).
inline void weighted_pairs_group(const uint16_t* p, int64_t p_stride, const int64_t* slots,
                                 int64_t n, const bf16* base, int64_t stride, int64_t head_dim,
                                 int64_t heads, float* out) {
  in_head_tiles(heads, 4, [&](int64_t h, auto tile) {
    weighted_pairs<decltype(tile)::value>(p + h * p_stride, p_stride, slots, n, base, stride,
                                          head_dim, out + h * head_dim);
  });
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
      vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(lmprog::store16_bf16(ph + j, m, e)));
    }
    if (n & 1) ph[n] = 0;
    const float sum = _mm512_reduce_add_ps(vsum);
    inv[h] = sum > 0.f ? 1.f / sum : 0.f;
    lse[h] = sum > 0.f ? mx + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
}
#endif

}  // namespace lmprog::decode
