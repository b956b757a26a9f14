// Native CPU matmuls over block-quantized weights, for decode (a few rows at a time).
//
// Weights are [out, in] in blocks of 32 inputs, the layouts of llama.cpp's Q8_0 and Q4_1:
// - Q8_0: int8 values q and one float16 scale d per block: w = q * d.
// - Q4_1: 4-bit values q in 0..15, packed two per byte (byte j of a block holds element j
//   in its low nibble and element j + 16 in its high nibble), and a float16 scale d and
//   minimum m per block: w = q * d + m.
// Decode reads every weight once per step. With float32 activations the kernel widens each
// block to float32 in registers and multiplies it with float32 accumulation, so its result
// is the float32 matmul over the dequantized weight up to summation order. With bfloat16
// activations on a CPU with AVX512-VNNI, the activations are rounded to int16 per block and
// the products are integer dot products (see `Int16Activations`), within the activations' own
// bfloat16 rounding of that result. On a CPU with AVX2 but not AVX-512, activations of
// either dtype are rounded to int16 per block the same way and multiplied by vpmaddwd
// (`avx2_dot_rows`). Each weight block is read once for all rows of the input. Rows are
// processed in tiles of up to four, whose accumulators stay in registers.
//
// From 8 rows of bfloat16 activations on a CPU with AVX512-BF16 or AMX (a decode batch),
// the per-row rescaling of every block costs more than the products: there each thread
// dequantizes 16 outputs at a time to bfloat16, in the packed layout of `amx_linear`, and
// multiplies every row by them (`tiled_outputs`, `PackedRows`).
//
// `dequantize_*` expand a layer to a dense float32 or bfloat16 matrix: many rows at once (a
// prefill) run faster as one dense matmul (AMX / AVX-512 through torch) than here.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"
#include "native_ops.h"

#if LMPROG_AVX512 || defined(__F16C__)
#include <immintrin.h>
#endif

// 16-bit integer dot products (vpdpwssd, AVX512-VNNI: Cascade Lake and later, Zen 4).
#if LMPROG_AVX512 && defined(__AVX512VNNI__)
#define LMPROG_VNNI 1
#else
#define LMPROG_VNNI 0
#endif

// Without AVX-512: 16-bit integer products by AVX2's vpmaddwd (Haswell and later, Zen 1-3).
#if !LMPROG_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMPROG_AVX2_INT16 1
#include <immintrin.h>
#else
#define LMPROG_AVX2_INT16 0
#endif

// Either integer path rounds the activations to int16 per block (`Int16Activations`).
#define LMPROG_INT16 (LMPROG_VNNI || LMPROG_AVX2_INT16)

using lmprog::bf16;

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowTile = 4;

// One F16C instruction where the CPU has it (c10's own conversion is a dozen scalar
// operations in a build without torch's CPU_CAPABILITY macros, such as this one).
inline float half_to_f32(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

enum class Format { Q8_0, Q4_1 };

// A layer's quantized storage, read-only.
struct QWeight {
  Format format;
  int64_t out_features, in_features;
  const uint8_t* data;   // Q8_0: [out, in] int8; Q4_1: [out, in / 2] packed nibbles
  const at::Half* d;     // [out, in / 32] scales
  const at::Half* m;     // [out, in / 32] minimums (Q4_1 only)

  int64_t blocks() const { return in_features / kBlock; }
  int64_t row_bytes() const { return format == Format::Q8_0 ? in_features : in_features / 2; }
};

// Block `b` of output row `n`, widened to 32 float32 values.
inline void dequantize_block(const QWeight& w, int64_t n, int64_t b, float* out) {
  const int64_t nb = w.blocks();
  const float d = half_to_f32(w.d[n * nb + b]);
  if (w.format == Format::Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.data + n * w.row_bytes() + b * kBlock);
#pragma omp simd
    for (int k = 0; k < kBlock; ++k) out[k] = static_cast<float>(q[k]) * d;
  } else {
    const uint8_t* q = w.data + n * w.row_bytes() + b * (kBlock / 2);
    const float m = half_to_f32(w.m[n * nb + b]);
#pragma omp simd
    for (int k = 0; k < kBlock / 2; ++k) {
      out[k] = static_cast<float>(q[k] & 0x0F) * d + m;
      out[k + kBlock / 2] = static_cast<float>(q[k] >> 4) * d + m;
    }
  }
}

#if LMPROG_AVX512
// The integer values of block `b` of output row `n` (not yet scaled), as two vectors of 16
// floats: elements 0-15 and 16-31.
inline void block_values_avx512(const QWeight& w, int64_t n, int64_t b, __m512& lo, __m512& hi) {
  if (w.format == Format::Q8_0) {
    const uint8_t* q = w.data + n * w.row_bytes() + b * kBlock;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
  } else {
    const uint8_t* q = w.data + n * w.row_bytes() + b * (kBlock / 2);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
}

// x_b . (q_b * d + m) for rows r of one block: acc[r] += d * (x_b . q_b) (a vector, reduced
// at the end) and, for Q4_1, mins[r] += m * sum(x_b).
template <int R>
inline void accumulate_block(const QWeight& w, const float* x, const float* xsums, int64_t n,
                             int64_t b, __m512* acc, float* mins) {
  const int64_t nb = w.blocks(), in = w.in_features;
  __m512 lo, hi;
  block_values_avx512(w, n, b, lo, hi);
  const __m512 d = _mm512_set1_ps(half_to_f32(w.d[n * nb + b]));
  for (int r = 0; r < R; ++r) {
    const float* xb = x + r * in + b * kBlock;
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(xb), lo);
    p = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), hi, p);
    acc[r] = _mm512_fmadd_ps(p, d, acc[r]);
  }
  if (w.format == Format::Q4_1) {
    const float m = half_to_f32(w.m[n * nb + b]);
    for (int r = 0; r < R; ++r) mins[r] += m * xsums[r * nb + b];
  }
}
#endif

// out[r, n] = sum_k x[r, k] * w[n, k] for R rows of x (float32 [rows, in], contiguous) and
// one output n. xsums [rows, in / 32]: each row's sum over each block (used by Q4_1).
template <int R>
inline void dot_rows(const QWeight& w, const float* x, const float* xsums, int64_t n, float* sums) {
  const int64_t nb = w.blocks(), in = w.in_features;
  float mins[R] = {};
#if LMPROG_AVX512
  // Two accumulators per row, alternating blocks, so consecutive FMAs into one do not wait
  // on each other's latency.
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    accumulate_block<R>(w, x, xsums, n, b, even, mins);
    accumulate_block<R>(w, x, xsums, n, b + 1, odd, mins);
  }
  if (b < nb) accumulate_block<R>(w, x, xsums, n, b, even, mins);
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + mins[r];
#else
  float acc[R] = {};
  float wb[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    dequantize_block(w, n, b, wb);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * in + b * kBlock;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int k = 0; k < kBlock; ++k) s += xb[k] * wb[k];
      acc[r] += s;
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = acc[r] + mins[r];
  (void)xsums;
#endif
}

#if LMPROG_INT16
// Integer dot products: bfloat16 activations on AVX512-VNNI, any activations on AVX2.
//
// Each block of 32 activations is scaled to int16 (x = s * qx, s = max|x| / 32767, qx
// rounded) and multiplied by the weights' integers in int32, exactly:
//   x_b . (d q_b + m) = d s (qx_b . q_b) + m sum(x_b)
// with the block sum taken over the unrounded activations. int16 keeps 15 bits of every
// activation within 2^7 of its block's largest, more than bfloat16's 8, so this rounding is
// below the activations' own; smaller ones lose bits, but their products are as small.
// (llama.cpp rounds activations to int8, which this does not.) Q8_0 weights widen to int16
// and multiply with vpdpwssd (32 products per instruction); Q4_1 nibbles multiply the
// activations' two bytes with vpdpbusd (64 per instruction, see `q4_byte`). Either replaces
// the float path's widening, conversion and FMA per 16 weights.

// Activations of each row as int16 with one float32 scale per block, and each block's sum.
struct Int16Activations {
  std::vector<int16_t> values;  // [rows, padded]: in the kernel's word order
  std::vector<float> scales;    // [rows, blocks] or, VNNI Q4_1, [rows, groups, 16] (per lane)
  std::vector<float> sums;      // [rows, blocks]
  int64_t padded = 0;           // values per row
  int64_t blocks = 0;           // scales and sums per row (VNNI Q4_1: sums only)
};

// How a kernel wants its activations laid out.
enum class Layout {
  Plain,    // values in input order
  Q4Bytes,  // VNNI Q4_1: each value's two bytes in `q4_byte`'s order
};

constexpr int64_t kGroupBlocks = 4;  // Q4_1 blocks per 512-bit load (64 bytes of nibbles)
constexpr int64_t kGroupValues = kGroupBlocks * kBlock;

inline int64_t q4_groups(int64_t blocks) { return (blocks + kGroupBlocks - 1) / kGroupBlocks; }

// Q4_1 activations are split into bytes: qx = 256 h + l, h signed and l unsigned, so the
// weights' nibbles (unsigned bytes once masked) multiply them with vpdpbusd (u8 x s8, 64
// products per instruction): x . q = 256 (q . h) + (q . l), exact in int32. A 64-byte load
// of four blocks gives two byte vectors, the low nibbles (elements 0-15 of each block) and
// the high ones (16-31), each 128-bit lane one block; a group's activations are four byte
// vectors in that order: h of elements 0-15, h of 16-31, l of 0-15, l of 16-31.
inline int64_t q4_byte(int64_t block_in_group, int64_t j, bool low_byte) {
  return (low_byte ? 128 : 0) + (j >= 16 ? 64 : 0) + block_in_group * 16 + j % 16;
}

template <typename T>
Int16Activations quantize_activations(const T* x, int64_t rows, int64_t in, Layout layout) {
  const int64_t nb = in / kBlock;
  const bool q4 = layout == Layout::Q4Bytes;
  Int16Activations a;
  a.blocks = nb;
  a.padded = q4 ? q4_groups(nb) * kGroupValues : in;
  a.values.assign(rows * a.padded, 0);
  a.scales.assign(q4 ? rows * q4_groups(nb) * 16 : rows * a.blocks, 0.f);
  a.sums.assign(rows * a.blocks, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = x + r * in + b * kBlock;
      float v[kBlock], amax = 0.f, sum = 0.f;
      bool has_nan = false;  // (std::max drops a NaN: the block's scale carries it instead)
      for (int j = 0; j < kBlock; ++j) {
        v[j] = lmprog::to_f32(xb[j]);
        amax = std::max(amax, std::abs(v[j]));
        sum += v[j];
        has_nan |= lmprog::is_nan_bits(v[j]);
      }
      if (has_nan) amax = std::numeric_limits<float>::quiet_NaN();
      const float scale = amax / 32767.f, inv = !has_nan && amax > 0.f ? 32767.f / amax : 0.f;
      int16_t* out = a.values.data() + r * a.padded;
      for (int j = 0; j < kBlock; ++j) {
        const auto q = static_cast<int16_t>(std::nearbyint(v[j] * inv));
        if (q4) {
          // Bytes: two per value, in q4_byte's order.
          auto* group = reinterpret_cast<uint8_t*>(out + (b / kGroupBlocks) * kGroupValues);
          group[q4_byte(b % kGroupBlocks, j, false)] = static_cast<uint8_t>(q >> 8);
          group[q4_byte(b % kGroupBlocks, j, true)] = static_cast<uint8_t>(q & 0xFF);
        } else {
          out[b * kBlock + j] = q;
        }
      }
      a.sums[r * a.blocks + b] = sum;
      if (q4) {
        float* lanes = a.scales.data() + (r * q4_groups(nb) + b / kGroupBlocks) * 16 + (b % kGroupBlocks) * 4;
        std::fill(lanes, lanes + 4, scale);
      } else {
        a.scales[r * a.blocks + b] = scale;
      }
    }
  }
  return a;
}

#if LMPROG_AVX2_INT16
// AVX2: a block's 32 weights widen to int16 in registers (Q8_0: two sign extensions; Q4_1:
// one zero extension of the 16 bytes, whose words then hold the low nibble, elements 0-15,
// and the high one, 16-31), and the activations' int16 multiply them with vpmaddwd (16
// products, summed in pairs, per instruction), exact in int32. Four blocks' int32 sums are
// reduced together (`quad_sums`) and scaled as one vector: d_b s_b (qx_b . q_b), plus
// m_b sum(x_b) for Q4_1; the last blocks of a row that fill no quad go one at a time.
constexpr int64_t kQuad = 4;  // blocks reduced and scaled together

struct WeightBlock {
  __m256i lo, hi;  // elements 0-15 and 16-31 as int16
};

template <Format F>
inline WeightBlock load_block(const uint8_t* row, int64_t b) {
  if constexpr (F == Format::Q8_0) {
    const auto* q = reinterpret_cast<const __m128i*>(row + b * kBlock);
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(q)), _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1))};
  } else {
    const __m256i words =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2))));
    return {_mm256_and_si256(words, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(words, 4)};
  }
}

// Eight int32 partial sums of one block's 32 products.
inline __m256i block_dot(const int16_t* x, const WeightBlock& wb) {
  const auto* xv = reinterpret_cast<const __m256i*>(x);
  const __m256i lo = _mm256_madd_epi16(_mm256_loadu_si256(xv), wb.lo);
  const __m256i hi = _mm256_madd_epi16(_mm256_loadu_si256(xv + 1), wb.hi);
  return _mm256_add_epi32(lo, hi);
}

// With s01 = hadd(s0, s1) and s23 = hadd(s2, s3), one more hadd leaves in each 128-bit
// half [s0, s1, s2, s3], each a sum over half the lanes; adding the halves gives the four
// blocks' totals.
inline __m128i quad_sums(__m256i s01, __m256i s23) {
  const __m256i u = _mm256_hadd_epi32(s01, s23);
  return _mm_add_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

inline __m128 load_quad_halves(const at::Half* h) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
}

// Output n for R rows of `a` from row r0 on.
template <Format F, int R>
inline void avx2_dot_rows(const QWeight& w, const Int16Activations& a, int64_t r0, int64_t n,
                          float* sums) {
  constexpr bool q4 = F == Format::Q4_1;
  const int64_t nb = w.blocks(), full = nb / kQuad * kQuad, stride = a.padded, sstride = a.blocks;
  const uint8_t* row = w.data + n * w.row_bytes();
  const int16_t* xq = a.values.data() + r0 * stride;
  const float* xscale = a.scales.data() + r0 * sstride;
  const float* xsum = a.sums.data() + r0 * sstride;
  const at::Half* d = w.d + n * nb;
  const at::Half* m = q4 ? w.m + n * nb : nullptr;
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t b0 = 0; b0 < full; b0 += kQuad) {
    __m256i s01[R];
    {
      const WeightBlock w0 = load_block<F>(row, b0), w1 = load_block<F>(row, b0 + 1);
      for (int r = 0; r < R; ++r) {
        const int16_t* x = xq + r * stride + b0 * kBlock;
        s01[r] = _mm256_hadd_epi32(block_dot(x, w0), block_dot(x + kBlock, w1));
      }
    }
    const WeightBlock w2 = load_block<F>(row, b0 + 2), w3 = load_block<F>(row, b0 + 3);
    const __m128 dv = load_quad_halves(d + b0);
    for (int r = 0; r < R; ++r) {
      const int16_t* x = xq + r * stride + (b0 + 2) * kBlock;
      const __m256i s23 = _mm256_hadd_epi32(block_dot(x, w2), block_dot(x + kBlock, w3));
      const __m128 scale = _mm_mul_ps(dv, _mm_loadu_ps(xscale + r * sstride + b0));
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(quad_sums(s01[r], s23)), scale, acc[r]);
    }
    if constexpr (q4) {
      const __m128 mv = load_quad_halves(m + b0);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm_fmadd_ps(mv, _mm_loadu_ps(xsum + r * sstride + b0), acc[r]);
    }
  }
  float tail[R] = {};
  for (int64_t b = full; b < nb; ++b) {
    const WeightBlock wb = load_block<F>(row, b);
    const float db = half_to_f32(d[b]), mb = q4 ? half_to_f32(m[b]) : 0.f;
    for (int r = 0; r < R; ++r) {
      const float dot = static_cast<float>(sum_lanes(block_dot(xq + r * stride + b * kBlock, wb)));
      tail[r] += dot * db * xscale[r * sstride + b] + mb * xsum[r * sstride + b];
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 v = _mm_add_ps(acc[r], _mm_movehl_ps(acc[r], acc[r]));
    sums[r] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v))) + tail[r];
  }
}

template <Format F, int R, typename T>
inline void avx2_tile(const QWeight& w, const Int16Activations& a, int64_t r, int64_t n, T* out) {
  float sums[R];
  avx2_dot_rows<F, R>(w, a, r, n, sums);
  for (int i = 0; i < R; ++i) out[(r + i) * w.out_features + n] = lmprog::from_f32<T>(sums[i]);
}

// Outputs [n_begin, n_end) of every row.
template <Format F, typename T>
void avx2_outputs(const QWeight& w, const Int16Activations& a, int64_t rows, int64_t n_begin,
                  int64_t n_end, T* out) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    int64_t r = 0;
    for (; r + kRowTile <= rows; r += kRowTile) avx2_tile<F, kRowTile>(w, a, r, n, out);
    for (; r < rows; ++r) avx2_tile<F, 1>(w, a, r, n, out);
  }
}

template <typename T>
void int16_outputs(const QWeight& w, const Int16Activations& a, int64_t rows, int64_t n_begin,
                   int64_t n_end, T* out) {
  if (w.format == Format::Q4_1) return avx2_outputs<Format::Q4_1>(w, a, rows, n_begin, n_end, out);
  avx2_outputs<Format::Q8_0>(w, a, rows, n_begin, n_end, out);
}
#endif  // LMPROG_AVX2_INT16

#if LMPROG_VNNI
// A single row streams the weights with little arithmetic per byte, ahead of what the
// hardware prefetcher fetches: each output tile asks for the weights this many tiles on.
// Measured on a Zen 5 (2 threads, SmolLM2-135M's 30 layers): Q4_1 1.15-1.4x, Q8_0 1.06-1.1x.
constexpr int64_t kPrefetchTiles = 2;

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// sums[r] += sum over blocks of m_b * sum(x_rb), sixteen blocks at a time (Q4_1's minimums).
template <int R>
inline void add_min_terms(const at::Half* m, const float* xs, int64_t nb, __m512* acc) {
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 k = lmprog::tail16(nb - b);
    const __m512 mv = _mm512_cvtph_ps(lmprog::load16_epi16(m + b, k));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(mv, lmprog::load16_ps(xs + r * nb + b, k), acc[r]);
  }
}

// Q4_1 outputs n .. n + N - 1 for R rows (activations starting at row 0 of `a`'s slices):
// sums[r * N + j] for output n + j. Several outputs at once share each activation load and
// interleave independent chains of dot products.
template <int R, int N>
inline void q4_1_dot_rows_int16(const QWeight& w, const int16_t* xq, const float* xscale,
                                const float* xs, int64_t padded, int64_t n, float* sums) {
  const int64_t nb = w.blocks(), groups = q4_groups(nb), row_bytes = w.row_bytes();
  const uint8_t* rows = w.data + n * row_bytes;
  const at::Half* d = w.d + n * nb;
  if (R == 1) prefetch(rows + kPrefetchTiles * N * row_bytes, N * row_bytes);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // The four scales of a group, one per 128-bit lane (a lane is a block).
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t blocks = std::min(kGroupBlocks, nb - g * kGroupBlocks);
    const bool full = blocks == kGroupBlocks;
    const __mmask64 bytes = full ? ~__mmask64{0} : (__mmask64{1} << (16 * blocks)) - 1;
    __m512i lo[N], hi[N];
    __m512 dv[N];
    for (int j = 0; j < N; ++j) {
      const uint8_t* src = rows + j * row_bytes + g * kGroupBlocks * 16;
      const __m512i packed = full ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(bytes, src);
      lo[j] = _mm512_and_si512(packed, nibble);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      const at::Half* dg = d + j * nb + g * kGroupBlocks;
      const __m128i d4 = full ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(dg))
                              : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << blocks) - 1), dg);
      dv[j] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(d4)));
    }
    for (int r = 0; r < R; ++r) {
      const int16_t* xg = xq + r * padded + g * kGroupValues;
      const __m512i x0 = _mm512_loadu_si512(xg), x1 = _mm512_loadu_si512(xg + 32),
                    x2 = _mm512_loadu_si512(xg + 64), x3 = _mm512_loadu_si512(xg + 96);
      const __m512 xsc = _mm512_loadu_ps(xscale + (r * groups + g) * 16);
      for (int j = 0; j < N; ++j) {
        __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], x0);
        __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x2, lo[j]);
        h = _mm512_dpbusd_epi32(h, hi[j], x1);
        l = _mm512_dpbusd_epi32(l, x3, hi[j]);
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv[j], xsc), acc[r][j]);
      }
    }
  }
  for (int j = 0; j < N; ++j) {
    __m512 col[R];
    for (int r = 0; r < R; ++r) col[r] = acc[r][j];
    add_min_terms<R>(w.m + (n + j) * nb, xs, nb, col);
    for (int r = 0; r < R; ++r) sums[r * N + j] = _mm512_reduce_add_ps(col[r]);
  }
}

// Q8_0 output n for R rows: one block (32 int8 -> 32 int16 words) per dot product.
template <int R>
inline void q8_0_dot_rows_int16(const QWeight& w, const int16_t* xq, const float* xscale,
                                int64_t in, int64_t n, float* sums) {
  const int64_t nb = w.blocks();
  const int8_t* row = reinterpret_cast<const int8_t*>(w.data + n * w.row_bytes());
  const at::Half* d = w.d + n * nb;
  if (R == 1) prefetch(row + kPrefetchTiles * w.row_bytes(), w.row_bytes());
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  float ds[16];
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, nb - b0);
    _mm512_storeu_ps(ds, _mm512_cvtph_ps(lmprog::load16_epi16(d + b0, lmprog::tail16(count))));
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b = b0 + i;
      const __m512i wq = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock)));
      for (int r = 0; r < R; ++r) {
        const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xq + r * in + b * kBlock), wq);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(ds[i] * xscale[r * nb + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

// Outputs n .. n + N - 1 of rows r .. r + R - 1 (Q8_0: N is 1).
template <int R, int N, typename T>
inline void int16_dot_tile(const QWeight& w, const Int16Activations& a, int64_t r, int64_t n,
                           T* out) {
  const int64_t nb = w.blocks();
  float sums[R * N];
  if (w.format == Format::Q4_1) {
    const int64_t groups = q4_groups(nb);
    q4_1_dot_rows_int16<R, N>(w, a.values.data() + r * a.padded,
                              a.scales.data() + r * groups * 16, a.sums.data() + r * nb, a.padded,
                              n, sums);
  } else if constexpr (N == 1) {
    q8_0_dot_rows_int16<R>(w, a.values.data() + r * a.padded, a.scales.data() + r * nb,
                           a.padded, n, sums);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < N; ++j)
      out[(r + i) * w.out_features + n + j] = lmprog::from_f32<T>(sums[i * N + j]);
}

// Outputs [n_begin, n_end) of every row. Q4_1 takes four outputs at a time for a single row
// (a decode step of one stream): with its prefetches 1.15-1.4x faster over SmolLM2-135M's 30
// layers on a Zen 5 (without them, slower than one at a time); tiles of rows gained nothing.
template <typename T>
void int16_outputs(const QWeight& w, const Int16Activations& a, int64_t rows, int64_t n_begin,
                   int64_t n_end, T* out) {
  int64_t n = n_begin;
  if (w.format == Format::Q4_1 && rows == 1) {
    for (; n + 4 <= n_end; n += 4) int16_dot_tile<1, 4>(w, a, 0, n, out);
  }
  for (; n < n_end; ++n) {
    int64_t r = 0;
    for (; r + kRowTile <= rows; r += kRowTile) int16_dot_tile<kRowTile, 1>(w, a, r, n, out);
    for (; r < rows; ++r) int16_dot_tile<1, 1>(w, a, r, n, out);
  }
}
#endif  // LMPROG_VNNI
#endif  // LMPROG_INT16

// Outputs [n_begin, n_end) of every row: x float32 [rows, in], xs its block sums.
template <typename T>
void float_outputs(const QWeight& w, const float* x, const float* xs, int64_t rows,
                   int64_t n_begin, int64_t n_end, T* out) {
  const int64_t out_features = w.out_features, in = w.in_features, nb = w.blocks();
  for (int64_t n = n_begin; n < n_end; ++n) {
    float sums[kRowTile];
    int64_t r = 0;
    for (; r + kRowTile <= rows; r += kRowTile) {
      dot_rows<kRowTile>(w, x + r * in, xs + r * nb, n, sums);
      for (int i = 0; i < kRowTile; ++i) out[(r + i) * out_features + n] = lmprog::from_f32<T>(sums[i]);
    }
    for (; r < rows; ++r) {
      dot_rows<1>(w, x + r * in, xs + r * nb, n, sums);
      out[r * out_features + n] = lmprog::from_f32<T>(sums[0]);
    }
  }
}

#if LMPROG_BF16_DOT
// From this many rows of bfloat16 activations a layer runs `tiled_outputs`; up to
// `kTiledMaxRows` (`quantized_dense_rows`), beyond which it dequantizes the whole weight
// once and runs one dense matmul. Over SmolLM2-135M's 30 layers on a 2-core Zen 5 (ms, int8
// / int4, `bench_quant_linears.py --activations bfloat16`): at 4 rows the integer kernels
// 8.1 / 8.2 against 12.9 / 12.7 tiled, at 8 rows 20.0 / 15.0 against 16.9 / 14.3, at 12
// 22.9 / 22.2 against 16.4 / 15.7; at 1024 rows tiled and dense break even.
constexpr int64_t kTiledMinRows = 8;
constexpr int64_t kTiledMaxRows = 1024;

// Outputs n0 .. n0 + 15 (those below out_features; zeros past it) dequantized to bfloat16
// in `PackedRows`' block layout, [in / 32][16][32]: per block of 32 inputs, the 16 outputs'
// values as 16 words each (pairs of inputs), transposed so that row r holds pair r of every
// output. Each value is q * d (+ m) in float32 rounded to nearest, as `dequantize` rounds it.
inline void dequantize_packed_block(const QWeight& w, int64_t n0, uint16_t* tiles) {
  const int64_t nb = w.blocks(), outputs = std::min<int64_t>(16, w.out_features - n0);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= outputs) {
        rows[j] = _mm512_setzero_si512();
        continue;
      }
      const int64_t n = n0 + j;
      __m512 lo, hi;
      block_values_avx512(w, n, b, lo, hi);
      const __m512 d = _mm512_set1_ps(half_to_f32(w.d[n * nb + b]));
      if (w.format == Format::Q8_0) {
        lo = _mm512_mul_ps(lo, d);
        hi = _mm512_mul_ps(hi, d);
      } else {
        const __m512 m = _mm512_set1_ps(half_to_f32(w.m[n * nb + b]));
        lo = _mm512_fmadd_ps(lo, d, m);
        hi = _mm512_fmadd_ps(hi, d, m);
      }
      const __m512bh values = _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-31 in order
      rows[j] = reinterpret_cast<const __m512i&>(values);
    }
    lmprog::transpose16(rows);
    for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tiles + b * 512 + r * 32, rows[r]);
  }
}

// Outputs [n_begin, n_end) (whole blocks of 16, save at the end) of every row of bfloat16
// activations: per pair of blocks of 16 outputs, the weights dequantized to bfloat16 into
// a buffer that stays in L2 (`dequantize_packed_block`), then multiplied by every row
// (`PackedRows::sums`). At 8-256 rows this keeps a decode batch at the speed of a bfloat16
// layer: the per-block rescaling of `int16_outputs` costs more per row, and dequantizing the
// whole weight for each step more than the products (a Q8_0 engine's decode step at 32 rows
// on SmolLM2-135M ran 2.8x a bfloat16 one's).
template <typename T>
void tiled_outputs(const QWeight& w, const PackedRows& x, int64_t rows, int64_t n_begin,
                   int64_t n_end, T* out) {
  if (n_begin >= n_end) return;
  const int64_t chunk_words = w.blocks() * 512;
  std::vector<uint16_t> tiles(2 * chunk_words);
  std::vector<float> sums(x.padded_rows() * 32);
  x.begin();
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 32) {
    const bool two = n0 + 16 < n_end;
    dequantize_packed_block(w, n0, tiles.data());
    if (two) dequantize_packed_block(w, n0 + 16, tiles.data() + chunk_words);
    // The next 32 outputs' quantized rows are fetched while these multiply.
    const int64_t next = std::min<int64_t>(32, std::max<int64_t>(0, n_end - n0 - 32));
    const uint8_t* next_rows = next > 0 ? w.data + (n0 + 32) * w.row_bytes() : nullptr;
    x.sums(tiles.data(), two, sums.data(), next_rows, next * w.row_bytes());
    const int64_t cols = std::min<int64_t>(32, n_end - n0);
    for (int64_t i = 0; i < rows; ++i) {
      T* dst = out + i * w.out_features + n0;
      const float* src = sums.data() + i * 32;
      for (int64_t j = 0; j < cols; ++j) dst[j] = lmprog::from_f32<T>(src[j]);
    }
  }
  x.end();
}
#endif

QWeight check_weight(Format format, const torch::Tensor& data, const torch::Tensor& scales,
                     const torch::Tensor* mins) {
  const char* name = format == Format::Q8_0 ? "q8_0" : "q4_1";
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 2 && data.is_contiguous(), name,
              ": weight must be a contiguous 2-D CPU tensor");
  const int64_t out = data.size(0);
  const int64_t in = format == Format::Q8_0 ? data.size(1) : data.size(1) * 2;
  TORCH_CHECK(data.scalar_type() == (format == Format::Q8_0 ? torch::kInt8 : torch::kUInt8), name,
              ": weight has dtype ", data.scalar_type());
  TORCH_CHECK(in % kBlock == 0, name, ": in_features ", in, " is not a multiple of ", kBlock);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == out && scales.size(1) == in / kBlock,
              name, ": scales must be contiguous float16 [out, in / 32]");
  if (mins != nullptr) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == torch::kFloat16 &&
                    mins->is_contiguous(),
                name, ": mins must be contiguous float16 [out, in / 32]");
  }
  return QWeight{format,
                 out,
                 in,
                 reinterpret_cast<const uint8_t*>(data.data_ptr()),
                 scales.data_ptr<at::Half>(),
                 mins != nullptr ? mins->data_ptr<at::Half>() : nullptr};
}

// y = x @ w.T in x's dtype (float32 or bfloat16), or in float32 when `out_float32`. The
// input is readied once (rounded to int16 blocks, or widened to float32 with its block
// sums); output rows are then split among threads in contiguous ranges.
class Work final : public SplitWork {
 public:
  Work(const QWeight& w, const torch::Tensor& x, bool out_float32) : w_(w), rows_(x.size(0)) {
    TORCH_CHECK(x.device().is_cpu() && lmprog::is_supported_dtype(x.scalar_type()),
                "x must be a float32 or bfloat16 CPU tensor");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in_features, "x must be [rows, ", w.in_features,
                "], got ", x.sizes());
    out_ = torch::empty({rows_, w.out_features},
                        x.options().dtype(out_float32 ? torch::kFloat32 : x.scalar_type()));
#if LMPROG_BF16_DOT
    if (x.scalar_type() == torch::kBFloat16 && rows_ >= kTiledMinRows) {
      tiled_ = std::make_unique<PackedRows>(x);
      return;
    }
#endif
#if LMPROG_VNNI
    // Q8_0 gains only for a row or two (its per-block rescaling is per row); Q4_1 always.
    int16_ = x.scalar_type() == torch::kBFloat16 && (w.format == Format::Q4_1 || rows_ < kRowTile);
    if (int16_) {
      const auto xc = x.contiguous();
      const Layout layout = w.format == Format::Q4_1 ? Layout::Q4Bytes : Layout::Plain;
      a_ = quantize_activations(xc.data_ptr<bf16>(), rows_, w.in_features, layout);
      return;
    }
#elif LMPROG_AVX2_INT16
    // Every row count and activation dtype: the float path spends more on widening each
    // weight than on its products.
    int16_ = true;
    const auto xc = x.contiguous();
    lmprog::dispatch_float_types(x.scalar_type(), "quantized_linear", [&](auto tag) {
      using T = decltype(tag);
      a_ = quantize_activations(xc.data_ptr<T>(), rows_, w.in_features, Layout::Plain);
    });
    return;
#endif
    x32_ = x.to(torch::kFloat32).contiguous();
    const int64_t in = w.in_features, nb = w.blocks();
    const float* xp = x32_.data_ptr<float>();
    xsums_.assign(rows_ * nb, 0.f);
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t b = 0; b < nb; ++b)
        for (int k = 0; k < kBlock; ++k) xsums_[r * nb + b] += xp[r * in + b * kBlock + k];
  }

  void run(int64_t thread, int64_t num_threads) override {
    const int64_t n_begin = w_.out_features * thread / num_threads;
    const int64_t n_end = w_.out_features * (thread + 1) / num_threads;
    lmprog::dispatch_float_types(out_.scalar_type(), "quantized_linear", [&](auto tag) {
      using T = decltype(tag);
#if LMPROG_BF16_DOT
      if (tiled_) {  // whole pairs of blocks of 16 outputs per thread
        const int64_t pairs = (w_.out_features + 31) / 32;
        const int64_t first = pairs * thread / num_threads * 32;
        const int64_t last = std::min(w_.out_features, pairs * (thread + 1) / num_threads * 32);
        return tiled_outputs<T>(w_, *tiled_, rows_, first, last, out_.data_ptr<T>());
      }
#endif
#if LMPROG_INT16
      if (int16_) return int16_outputs<T>(w_, a_, rows_, n_begin, n_end, out_.data_ptr<T>());
#endif
      float_outputs<T>(w_, x32_.data_ptr<float>(), xsums_.data(), rows_, n_begin, n_end,
                       out_.data_ptr<T>());
    });
  }

  torch::Tensor output() const override { return out_; }

 private:
  QWeight w_;
  int64_t rows_;
  torch::Tensor out_;
  bool int16_ = false;
#if LMPROG_INT16
  Int16Activations a_;
#endif
  torch::Tensor x32_;         // the float path's input
  std::vector<float> xsums_;  // and its block sums [rows, in / 32]
  std::unique_ptr<PackedRows> tiled_;  // the tiled path's input (bfloat16, many rows)
};

torch::Tensor quantized_linear(const QWeight& w, const torch::Tensor& x, bool out_float32) {
  Work work(w, x, out_float32);
#pragma omp parallel
  work.run(omp_get_thread_num(), omp_get_num_threads());
  return work.output();
}

torch::Tensor dequantize(const QWeight& w, c10::ScalarType dtype) {
  auto out = torch::empty({w.out_features, w.in_features}, torch::dtype(dtype));
  lmprog::dispatch_float_types(dtype, "dequantize", [&](auto tag) {
    using T = decltype(tag);
    T* op = out.data_ptr<T>();
    const int64_t nb = w.blocks();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < w.out_features; ++n) {
      float block[kBlock];
      for (int64_t b = 0; b < nb; ++b) {
        dequantize_block(w, n, b, block);
        T* dst = op + n * w.in_features + b * kBlock;
        for (int k = 0; k < kBlock; ++k) dst[k] = lmprog::from_f32<T>(block[k]);
      }
    }
  });
  return out;
}

}  // namespace

int64_t quantized_dense_rows(bool bf16) {
#if LMPROG_BF16_DOT
  if (bf16) return kTiledMaxRows;
#endif
#if LMPROG_AVX2_INT16
  // Widened once per output row, a weight serves every row tile from L1: on a 2-core Zen 3
  // this kernel beat dequantize + float32 matmul up to about 64 rows (Q8_0 to 128).
  return 64;
#else
  return 16;
#endif
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          bool out_float32) {
  return quantized_linear(check_weight(Format::Q8_0, qweight, scales, nullptr), x, out_float32);
}

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor mins, bool out_float32) {
  return quantized_linear(check_weight(Format::Q4_1, packed, scales, &mins), x, out_float32);
}

// bfloat16 when `to_bf16`, else float32.
torch::Tensor q8_0_dequantize(torch::Tensor qweight, torch::Tensor scales, bool to_bf16) {
  return dequantize(check_weight(Format::Q8_0, qweight, scales, nullptr),
                    to_bf16 ? torch::kBFloat16 : torch::kFloat32);
}

torch::Tensor q4_1_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                              bool to_bf16) {
  return dequantize(check_weight(Format::Q4_1, packed, scales, &mins),
                    to_bf16 ? torch::kBFloat16 : torch::kFloat32);
}

std::unique_ptr<SplitWork> prepare_quantized_linear(const std::string& kind,
                                                              const torch::Tensor& weight,
                                                              const torch::Tensor& scales,
                                                              const torch::Tensor& mins,
                                                              const torch::Tensor& x) {
  TORCH_CHECK(kind == "q8_0" || kind == "q4_1", "unknown quantized linear kind ", kind);
  const QWeight w = kind == "q8_0" ? check_weight(Format::Q8_0, weight, scales, nullptr)
                                   : check_weight(Format::Q4_1, weight, scales, &mins);
  return std::make_unique<Work>(w, x, false);
}
