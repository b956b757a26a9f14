// Element access shared by the native CPU kernels: float32 or bfloat16 in memory, float32
// arithmetic in registers.
//
// Every kernel is a template over its storage type T (float or at::BFloat16). Loads widen to
// float32 (a bfloat16 is the top half of a float32, so widening is a 16-bit shift); stores
// round to nearest even, as torch's own float -> bfloat16 cast does. The loops stay plain
// C++ that the compiler vectorizes for whatever -march=native offers (AVX2, AVX-512).
// AVX-512 intrinsics appear only where they beat that (the inner loops of decode attention),
// each behind a compile-time feature check with the portable loop as its fallback.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

// AVX-512 code paths need the foundation plus 16-bit element (BW) and 256-bit (VL) forms,
// which every AVX-512 server CPU has; anything else takes the portable loops.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LMPROG_AVX512 1
#include <immintrin.h>
#else
#define LMPROG_AVX512 0
#endif

// AVX-512 with its bfloat16 instructions (conversions, vdpbf16ps dot products): AMX CPUs
// and some without AMX (AMD Zen 4 and later, Intel Cooper Lake).
#if LMPROG_AVX512 && defined(__AVX512BF16__)
#define LMPROG_BF16_DOT 1
#include <immintrin.h>
#else
#define LMPROG_BF16_DOT 0
#endif

namespace lmprog {

using bf16 = at::BFloat16;

inline float to_f32(float x) { return x; }

inline float to_f32(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round a float32 to storage type T (round to nearest even; NaN stays a quiet NaN).
template <typename T>
inline T from_f32(float f);

template <>
inline float from_f32<float>(float f) {
  return f;
}

// Whether `f` is a NaN, by its bits: not std::isnan, which -ffast-math lets the compiler
// assume false.
inline bool is_nan_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

template <>
inline bf16 from_f32<bf16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const bool is_nan = is_nan_bits(f);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return bf16(static_cast<uint16_t>(is_nan ? 0x7fc0u : rounded), bf16::from_bits());
}

// The float32 value `f` takes once stored as T (rounding an intermediate as torch does).
template <typename T>
inline float round_to(float f) {
  return to_f32(from_f32<T>(f));
}

// The C++ storage type of a float32 or bfloat16 tensor; anything else is refused.
inline bool is_supported_dtype(c10::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16;
}

// Calls fn(T{}) with T the storage type of `dtype` (float or bf16).
template <typename Fn>
inline void dispatch_float_types(c10::ScalarType dtype, const char* op, Fn&& fn) {
  TORCH_CHECK(is_supported_dtype(dtype), op, ": dtype ", dtype, " is not float32 or bfloat16");
  if (dtype == torch::kFloat32) {
    fn(float{});
  } else {
    fn(bf16{});
  }
}

// fn(std::integral_constant<int, I>{}) for I = 0 .. N - 1, unrolled as written out. Kernels
// index their register arrays this way: with plain loops, even under `#pragma GCC unroll`,
// GCC 12 keeps such an array addressable (it is split into registers before loops are
// unrolled), then copies accumulators between registers and the stack on every step.
template <typename Fn, int... I>
inline void static_for(Fn&& fn, std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>{}), ...);
}

template <int N, typename Fn>
inline void static_for(Fn&& fn) {
  static_for(fn, std::make_integer_sequence<int, N>{});
}

// fn(R) with R the rows of accumulators (8, 4, 2 or 1, a compile-time constant) for the
// `rows` (at most 8) left of a matmul whose kernels hold 8 rows' accumulators at most.
template <typename Fn>
inline void with_row_tile(int64_t rows, Fn&& fn) {
  if (rows > 4) {
    fn(std::integral_constant<int, 8>{});
  } else if (rows > 2) {
    fn(std::integral_constant<int, 4>{});
  } else if (rows == 2) {
    fn(std::integral_constant<int, 2>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

#if LMPROG_AVX512
// 16 lanes of float32 / 16-bit words from memory, those of `m` (the others zero), and 16
// float32 lanes to memory. Full vectors take plain loads and stores: masked ones cost more
// on AMD Zen 4 and 5 even with every lane set (a Q4_1 kernel streamed its weights at half
// the speed of plain loads through them on a Zen 5).
// The first `left` of 16 lanes (none when left <= 0, all from 16): a loop's tail.
inline __mmask16 tail16(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16_ps(const float* p, __mmask16 m) {
  return m == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

inline __m256i load16_epi16(const void* p, __mmask16 m) {
  return m == 0xFFFF ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                     : _mm256_maskz_loadu_epi16(m, p);
}

inline void store16_ps(float* p, __mmask16 m, __m512 v) {
  if (m == 0xFFFF)
    _mm512_storeu_ps(p, v);
  else
    _mm512_mask_storeu_ps(p, m, v);
}
#endif

// Prefetching the weights a kernel multiplies next while it multiplies these, a few cache
// lines every step of its loop: the reads of a decode batch's weights then overlap its
// products (the first rows' pass otherwise took as long as streaming the weight alone). A
// kernel that passes over its weights once for every 8 rows fetches a share in each of the
// first (up to) 32 passes: into L1 when a single pass covers all the rows, else into L2
// (into L1 there, it evicts the weights the next pass reads again).
class NextWeights {
 public:
  NextWeights() = default;
  // The share of `bytes` of weights at `base` (null: none) for the pass over the 8 rows
  // from row0 of `rows`, spread over `steps` steps.
  NextWeights(const void* base, int64_t bytes, int64_t rows, int64_t row0, int64_t steps) {
    const int64_t parts = std::min<int64_t>((rows + 7) / 8, 32), part = row0 / 8;
    if (base == nullptr || part >= parts || steps <= 0) return;
    const int64_t lines = (bytes + 63) / 64;
    const int64_t first = lines * part / parts, last = lines * (part + 1) / parts;
    next_ = static_cast<const char*>(base) + first * 64;
    end_ = static_cast<const char*>(base) + last * 64;
    per_step_ = (last - first + steps - 1) / steps;
    to_l1_ = parts == 1;
  }

  // Fetch this step's lines.
  inline void step() {
    for (int64_t l = 0; l < per_step_ && next_ < end_; ++l, next_ += 64) {
      if (to_l1_)
        __builtin_prefetch(next_, 0, 3);  // prefetcht0
      else
        __builtin_prefetch(next_, 0, 2);  // prefetcht1
    }
  }

 private:
  const char* next_ = nullptr;
  const char* end_ = nullptr;
  int64_t per_step_ = 0;
  bool to_l1_ = false;
};

#if LMPROG_AVX512
// exp(x) for x <= 0 (attention scores minus their row's maximum): 2^(x log2 e) as
// 2^n * 2^f with |f| <= 1/2, 2^f by its degree-5 Taylor polynomial (relative error under
// 3e-6, far below the bfloat16 rounding of the probabilities), 2^n by vscalefps (0 below
// float range).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // in nats
  __m512 p = _mm512_set1_ps(1.f / 120);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u lane by lane in float32: silu(g) = g sigmoid(g), with e = e^-|g|
// (exp_nonpositive's range): sigmoid(g) is 1 / (1 + e) for g >= 0 and e / (1 + e) below. No
// infinity on the way (-ffast-math assumes none: 1 / (1 + e^-g) through e^-g = inf gave NaN).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
  return _mm512_mul_ps(_mm512_div_ps(_mm512_mul_ps(g, numerator), _mm512_add_ps(one, e)), u);
}

// 16 float32 lanes rounded to bfloat16 (to nearest even, as from_f32; NaN aside) and widened
// back: what storing them as bfloat16 keeps.
inline __m512 round16_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

#if LMPROG_AVX512
// Transposes a 16 x 16 matrix of 32-bit words held as 16 rows: rows[i] becomes column i.
inline void transpose16(__m512i* rows) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: pairs of rows 2i, 2i + 1
    t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);      // lanes 0, 2
    const __m512i w0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);      // lanes 1, 3
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    rows[k] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    rows[8 + k] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    rows[4 + k] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    rows[12 + k] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}
#endif

#if LMPROG_BF16_DOT
// 32 bfloat16 as vdpbf16ps's operand type.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// 16 float32 lanes rounded to bfloat16 (to nearest even) and stored, those of `m`; returns
// the rounded values (what was stored).
inline __m256bh store16_bf16(void* p, __mmask16 m, __m512 v) {
  const __m256bh rounded = _mm512_cvtneps_pbh(v);
  const __m256i bits = reinterpret_cast<const __m256i&>(rounded);
  if (m == 0xFFFF)
    _mm256_storeu_si256(static_cast<__m256i*>(p), bits);
  else
    _mm256_mask_storeu_epi16(p, m, bits);
  return rounded;
}

// One pair of bfloat16 (a 32-bit word) broadcast to every lane: with a register of 16 pairs
// (one per lane), vdpbf16ps adds to each lane the dot product of its pair with this one.
inline __m512bh broadcast_pair(const uint16_t* pair) {
  int32_t word;
  std::memcpy(&word, pair, sizeof word);
  return as_bh(_mm512_set1_epi32(word));
}
#endif

}  // namespace lmprog
