// W8A8 linear layers (CPU): int8 weights with one scale per output channel, and activations
// rounded to int8 per row (token) as they arrive, multiplied in int32.
//
//   sx[r] = max_k |x[r][k]| / 127,  qx[r][k] = round(x[r][k] * (127 / max_k |x[r][k]|))
//   y[r][n] = (sum_k qx[r][k] qw[n][k]) * (sx[r] sw[n]) + bias[n]
//
// The rounding is what SGLang's w8a8_int8 layers do: per-token dynamic scales, no clipping.
// The sums are exact in int32, whatever the kernel, so every path gives the same output.
//
// Up to `w8a8_packed_max_rows()` rows (decode, small prefills), on a CPU with AVX512-VNNI:
// this file's kernel over a copy of the weight packed for vpdpbusd (`w8a8_pack`), split
// among threads that may already run (the decode stack's one parallel region,
// `prepare_w8a8_linear`). vpdpbusd multiplies unsigned by signed bytes, so the rows are
// stored as qx + 128 and each output subtracts 128 sum_k qw[n][k], kept with its block.
// A gated MLP's fused gate/up projection, packed with its gate and up blocks paired, goes
// this way at any row count (`w8a8_gated`): the epilogue writes silu(gate) * up itself.
//
// More rows: torch's `_int_mm` (oneDNN: the same instruction, or AMX-INT8 where present),
// as fast as the kernel above from about 512 rows. Around it one pass rounds the
// activations (and finds each row's scale) and one rescales the int32 sums into the output
// dtype, adding the bias.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"
#include "native_ops.h"

#if LMPROG_AVX512 && defined(__AVX512VNNI__)
#define LMPROG_W8A8_VNNI 1
#else
#define LMPROG_W8A8_VNNI 0
#endif

namespace {

// The packed weight: blocks of 16 outputs, each its quads (4 consecutive inputs of the 16
// outputs, 64 bytes: quad c holds qw[16 b + j][4 c + t] at byte 4 j + t, zero past the
// weight's edges) followed by 16 int32 compensations 128 sum_k qw[16 b + j][k].
constexpr int64_t kOutputs = 16;
constexpr int64_t kQuad = 4;
constexpr int64_t kQuadBytes = kOutputs * kQuad;

inline int64_t quads(int64_t in) { return (in + kQuad - 1) / kQuad; }
inline int64_t block_bytes(int64_t in) { return (quads(in) + 1) * kQuadBytes; }

// Rows and outputs below this many elements stay on the calling thread (a decode step's few
// rows: forking the team costs more than the pass).
constexpr int64_t kParallelElements = 1 << 15;
// Rows of a many-row product are multiplied in chunks of about this many bytes of sums.
constexpr int64_t kChunkBytes = 8 << 20;

template <typename T>
void quantize_row(const T* x, int64_t in, int8_t* q, float* scale) {
  float amax = 0.f;
  bool has_nan = false;  // (std::max drops a NaN: the row's scale carries it instead)
  for (int64_t k = 0; k < in; ++k) {
    const float v = lmprog::to_f32(x[k]);
    amax = std::max(amax, std::abs(v));
    has_nan |= lmprog::is_nan_bits(v);
  }
  if (has_nan) amax = std::numeric_limits<float>::quiet_NaN();
  // Quotients in double, rounded once to float: correctly rounded float quotients (53 bits
  // hold two roundings of 24), which -ffast-math's reciprocal multiply would not be.
  const float inv =
      !has_nan && amax > 0.f ? static_cast<float>(127.0 / static_cast<double>(amax)) : 0.f;
  for (int64_t k = 0; k < in; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(lmprog::to_f32(x[k]) * inv));
  }
  *scale = static_cast<float>(static_cast<double>(amax) / 127.0);
}

#if LMPROG_AVX512
// 16 float32 lanes to T, those of `m`.
template <typename T>
inline void store16(T* p, __mmask16 m, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    lmprog::store16_ps(p, m, v);
  } else {
#if LMPROG_BF16_DOT
    lmprog::store16_bf16(p, m, v);
#else
    alignas(64) float lanes[kOutputs];
    _mm512_store_ps(lanes, v);
    for (int j = 0; j < kOutputs; ++j)
      if (m >> j & 1) p[j] = lmprog::from_f32<T>(lanes[j]);
#endif
  }
}
#endif

// y[n] = acc[n] * (row_scale * col_scales[n]) + bias[n], rounded once (a fused multiply-add,
// as the VNNI kernel's).
template <typename T>
void rescale_row(const int32_t* acc, float row_scale, const float* col_scales, const T* bias,
                 int64_t out, T* y) {
  int64_t n = 0;
#if LMPROG_AVX512
  const __m512 rs = _mm512_set1_ps(row_scale);
  for (; n < out; n += kOutputs) {
    const __mmask16 m = lmprog::tail16(out - n);
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + n));
    const __m512 scale = _mm512_mul_ps(rs, lmprog::load16_ps(col_scales + n, m));
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) {
      if constexpr (std::is_same_v<T, float>) {
        b = lmprog::load16_ps(bias + n, m);
      } else {
        const __m256i bits = lmprog::load16_epi16(bias + n, m);
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      }
    }
    store16(y + n, m, _mm512_fmadd_ps(sums, scale, b));
  }
#endif
  for (; n < out; ++n) {
    const float b = bias != nullptr ? lmprog::to_f32(bias[n]) : 0.f;
    y[n] = lmprog::from_f32<T>(std::fma(static_cast<float>(acc[n]), row_scale * col_scales[n], b));
  }
}

#if LMPROG_W8A8_VNNI
// The float32 sums of the R rows of `a` (qx + 128, `stride` bytes apart) against the Blocks
// (1 or 2) packed blocks at w[0], w[1]: accumulator (i, b) holds block b's 16 outputs of row
// i, one vpdpbusd per quad of inputs; then epilogue(i, sums) for each row i < rows, sums[b]
// block b's 16 exact sums (the compensation subtracted) as float32. All R rows of `a` are
// read (the caller pads them). `fetch`: the weights multiplied next, a share per quad.
template <int R, int Blocks, typename Epilogue>
inline void block_sums(const uint8_t* a, int64_t stride, int64_t in, const int8_t* const* w,
                       int64_t rows, lmprog::NextWeights fetch, Epilogue&& epilogue) {
  const int64_t nq = quads(in);
  __m512i acc[R][Blocks];
  lmprog::static_for<R>([&](auto i) {
    lmprog::static_for<Blocks>([&](auto b) { acc[i][b] = _mm512_setzero_si512(); });
  });
  for (int64_t c = 0; c < nq; ++c) {
    fetch.step();
    __m512i wc[Blocks];
    lmprog::static_for<Blocks>([&](auto b) { wc[b] = _mm512_loadu_si512(w[b] + c * kQuadBytes); });
    lmprog::static_for<R>([&](auto i) {
      int32_t quad;
      std::memcpy(&quad, a + i * stride + c * kQuad, sizeof quad);
      const __m512i xi = _mm512_set1_epi32(quad);
      lmprog::static_for<Blocks>([&](auto b) { acc[i][b] = _mm512_dpbusd_epi32(acc[i][b], xi, wc[b]); });
    });
  }
  __m512i offsets[Blocks];
  lmprog::static_for<Blocks>([&](auto b) { offsets[b] = _mm512_loadu_si512(w[b] + nq * kQuadBytes); });
  lmprog::static_for<R>([&](auto i) {
    if (i >= rows) return;
    __m512 sums[Blocks];
    lmprog::static_for<Blocks>([&](auto b) {
      sums[b] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][b], offsets[b]));
    });
    epilogue(static_cast<int>(i), sums);
  });
}

// y[i][16 (nb + b) + j] = sums * (row scale * output scale) + bias for blocks nb, nb + 1.
template <int R, int Blocks, typename T>
void block_product(const uint8_t* a, int64_t stride, int64_t in, const int8_t* packed, int64_t nb,
                   int64_t rows, const float* row_scales, const float* col_scales, const T* bias,
                   int64_t out, T* y, lmprog::NextWeights fetch) {
  const int8_t* w[Blocks];
  int64_t n0[Blocks];
  __mmask16 m[Blocks];
  __m512 sw[Blocks], bv[Blocks];
  lmprog::static_for<Blocks>([&](auto b) {
    w[b] = packed + (nb + b) * block_bytes(in);
    n0[b] = (nb + b) * kOutputs;
    m[b] = lmprog::tail16(out - n0[b]);
    sw[b] = lmprog::load16_ps(col_scales + n0[b], m[b]);
    alignas(64) float lanes[kOutputs] = {};
    for (int j = 0; bias != nullptr && j < kOutputs && n0[b] + j < out; ++j)
      lanes[j] = lmprog::to_f32(bias[n0[b] + j]);
    bv[b] = _mm512_load_ps(lanes);
  });
  block_sums<R, Blocks>(a, stride, in, w, rows, fetch, [&](int i, const __m512* sums) {
    const __m512 rs = _mm512_set1_ps(row_scales[i]);
    lmprog::static_for<Blocks>([&](auto b) {
      store16(y + i * out + n0[b], m[b], _mm512_fmadd_ps(sums[b], _mm512_mul_ps(rs, sw[b]), bv[b]));
    });
  });
}

// 16 float32 lanes rounded to T and back (what storing them as T keeps).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return lmprog::round16_bf16(v);
  }
}

// A gated MLP's activation from its fused gate/up projection packed by pairs (`w8a8_pack`,
// gated): y[i][16 p + j] = silu(g) u, where g and u are gate and up output 16 p + j of row
// i, each rescaled and rounded to T first, as the layer's output would be before
// `silu_and_mul` (which computes g / (1 + e^-g) u in float32).
//
// The epilogue is one function for every row tile (not inlined into each; called once per
// tile): with -ffast-math the compiler contracted and reordered its float32 operations
// differently per tile size, so a row's activation (and, through the next layer's int8
// rounding, its tokens) depended on how many rows shared its call, i.e. on the other
// requests of its batch.
template <typename T>
__attribute__((noinline)) void gated_epilogue(const __m512 (*sums)[2], int64_t rows,
                                              const float* row_scales, const __m512* scales,
                                              int64_t inter, T* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 rs = _mm512_set1_ps(row_scales[i]);
    const __m512 g = round16<T>(_mm512_mul_ps(sums[i][0], _mm512_mul_ps(rs, scales[0])));
    const __m512 u = round16<T>(_mm512_mul_ps(sums[i][1], _mm512_mul_ps(rs, scales[1])));
    store16(y + i * inter, static_cast<__mmask16>(0xFFFF), lmprog::silu_mul16(g, u));
  }
}

template <int R, typename T>
void gated_product(const uint8_t* a, int64_t stride, int64_t in, const int8_t* packed, int64_t p,
                   int64_t rows, const float* row_scales, const float* col_scales, int64_t inter,
                   T* y, lmprog::NextWeights fetch) {
  const int8_t* w[2] = {packed + 2 * p * block_bytes(in), packed + (2 * p + 1) * block_bytes(in)};
  const __m512 scales[2] = {_mm512_loadu_ps(col_scales + p * kOutputs),
                            _mm512_loadu_ps(col_scales + inter + p * kOutputs)};
  __m512 tile[R][2];
  block_sums<R, 2>(a, stride, in, w, rows, fetch, [&](int i, const __m512* sums) {
    tile[i][0] = sums[0];
    tile[i][1] = sums[1];
  });
  gated_epilogue<T>(tile, rows, row_scales, scales, inter, y + p * kOutputs);
}
#endif

void check_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in], got ", x.dim(), " dimensions");
  TORCH_CHECK(lmprog::is_supported_dtype(x.scalar_type()), "x must be float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
}

void check_weight(const torch::Tensor& qweight, const torch::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(),
              "qweight must be a contiguous int8 [out, in]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == qweight.size(0) &&
                  scales.scalar_type() == torch::kFloat32 && scales.is_contiguous(),
              "scales must be a contiguous float32 [out]");
}

// The bias in the output dtype (undefined when absent).
torch::Tensor output_bias(const c10::optional<torch::Tensor>& bias, int64_t out, c10::ScalarType dtype) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, "bias must be [out]");
  return bias->to(dtype).contiguous();
}

// x @ w.T + bias through the packed weight, or (`gated`) a gated MLP's activation from its
// fused gate/up projection: pairs of output blocks split among threads, rows in chunks that
// stay in L2 while every pair passes over them.
class W8A8Work final : public SplitWork {
 public:
  W8A8Work(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
           const torch::Tensor& bias, bool out_float32, bool gated)
      : packed_(packed), scales_(scales), bias_(bias), gated_(gated) {
    check_activations(x);
    rows_ = x.size(0), in_ = x.size(1), out_ = scales.size(0);
    TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.is_contiguous() &&
                    packed.numel() == (out_ + kOutputs - 1) / kOutputs * block_bytes(in_),
                "packed must be w8a8_pack's int8 weight for ", out_, " outputs of ", in_, " inputs");
    TORCH_CHECK(!gated || (out_ % (2 * kOutputs) == 0 && !bias.defined()),
                "a gated product needs 2 x a multiple of 16 outputs and no bias");
    const int64_t width = gated ? out_ / 2 : out_;
    y_ = torch::empty({rows_, width}, torch::dtype(out_float32 ? torch::kFloat32 : x.scalar_type()));
    // The rows as qx + 128 (qx's bits with the top one flipped), zero padded to whole quads
    // and to whole tiles of 8 rows: a tile reads all 8 of its rows, whatever it keeps.
    stride_ = quads(in_) * kQuad;
    a_.assign((rows_ + 7) / 8 * 8 * stride_, 0);
    row_scales_.resize(rows_);
    const auto xc = x.contiguous();
    lmprog::dispatch_float_types(x.scalar_type(), "w8a8_linear", [&](auto tag) {
      using T = decltype(tag);
      const T* xp = xc.data_ptr<T>();
#pragma omp parallel for schedule(static) if (rows_ * in_ >= 4 * kParallelElements && !omp_in_parallel())
      for (int64_t r = 0; r < rows_; ++r) {
        uint8_t* dst = a_.data() + r * stride_;
        quantize_row(xp + r * in_, in_, reinterpret_cast<int8_t*>(dst), &row_scales_[r]);
        for (int64_t k = 0; k < in_; ++k) dst[k] ^= 0x80;
      }
    });
  }

  void run(int64_t thread, int64_t num_threads) override {
#if LMPROG_W8A8_VNNI
    const int64_t blocks = (out_ + kOutputs - 1) / kOutputs, pairs = (blocks + 1) / 2;
    const int64_t first = pairs * thread / num_threads, last = pairs * (thread + 1) / num_threads;
    lmprog::dispatch_float_types(y_.scalar_type(), "w8a8_linear", [&](auto tag) {
      using T = decltype(tag);
      const T* bias = bias_.defined() ? bias_.data_ptr<T>() : nullptr;
      const int8_t* packed = packed_.data_ptr<int8_t>();
      const float* col_scales = scales_.data_ptr<float>();
      T* y = y_.data_ptr<T>();
      const int64_t width = y_.size(1);
      for (int64_t c0 = 0; c0 < rows_; c0 += kRowChunk) {
        const int64_t c1 = std::min(rows_, c0 + kRowChunk);
        for (int64_t p = first; p < last; ++p) {
          const bool two = 2 * p + 1 < blocks;
          // The next pair of blocks, fetched while this one multiplies the chunk's rows.
          const int8_t* next = p + 1 < last ? packed + 2 * (p + 1) * block_bytes(in_) : nullptr;
          for (int64_t r0 = c0; r0 < c1; r0 += 8) {
            const int64_t rows = std::min<int64_t>(8, c1 - r0);
            const uint8_t* a = a_.data() + r0 * stride_;
            const float* rs = row_scales_.data() + r0;
            T* yr = y + r0 * width;
            const lmprog::NextWeights fetch(next, 2 * block_bytes(in_), c1 - c0, r0 - c0, quads(in_));
            lmprog::with_row_tile(rows, [&](auto tile) {
              constexpr int R = decltype(tile)::value;
              if (gated_) {
                gated_product<R, T>(a, stride_, in_, packed, p, rows, rs, col_scales, width, yr, fetch);
              } else {
                auto product = two ? block_product<R, 2, T> : block_product<R, 1, T>;
                product(a, stride_, in_, packed, 2 * p, rows, rs, col_scales, bias, out_, yr, fetch);
              }
            });
          }
        }
      }
    });
#else
    TORCH_CHECK(false, "w8a8: this build has no AVX512-VNNI kernel for packed weights");
#endif
  }

  torch::Tensor output() const override { return y_; }

 private:
  static constexpr int64_t kRowChunk = 256;
  torch::Tensor packed_, scales_, bias_, y_;
  bool gated_;
  int64_t rows_ = 0, in_ = 0, out_ = 0, stride_ = 0;
  std::vector<uint8_t> a_;
  std::vector<float> row_scales_;
};

}  // namespace

bool w8a8_packed_available() { return LMPROG_W8A8_VNNI; }

int64_t w8a8_packed_max_rows() {
  // On a 2-core Zen 5 the packed kernel was 1.02-1.5x ahead of oneDNN's up to 256 rows of
  // SmolLM2-135M's layers, even at 512 and 0.96-0.97x at 1024.
  return 256;
}

torch::Tensor w8a8_pack(torch::Tensor qweight, bool gated) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kInt8,
              "qweight must be int8 [out, in]");
  const auto w = qweight.contiguous();
  const int64_t out = w.size(0), in = w.size(1), blocks = (out + kOutputs - 1) / kOutputs;
  TORCH_CHECK(!gated || out % (2 * kOutputs) == 0,
              "a gated pack needs gate and up outputs in whole blocks of 16, got ", out, " outputs");
  const int64_t nq = quads(in), bytes = block_bytes(in);
  auto packed = torch::zeros({blocks * bytes}, torch::kInt8);
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t b = 0; b < blocks; ++b) {
    // Gated: block 2p holds gate outputs 16p.., block 2p + 1 up outputs out / 2 + 16p...
    const int64_t first = gated ? (b % 2) * (out / 2) + (b / 2) * kOutputs : b * kOutputs;
    int8_t* block = dst + b * bytes;
    int32_t offsets[kOutputs] = {};
    for (int64_t j = 0; j < kOutputs && first + j < out; ++j) {
      const int8_t* row = src + (first + j) * in;
      int32_t sum = 0;
      for (int64_t k = 0; k < in; ++k) {
        block[(k / kQuad) * kQuadBytes + j * kQuad + k % kQuad] = row[k];
        sum += row[k];
      }
      offsets[j] = 128 * sum;
    }
    std::memcpy(block + nq * kQuadBytes, offsets, sizeof offsets);
  }
  return packed;
}

std::vector<torch::Tensor> w8a8_quantize_rows(torch::Tensor x) {
  check_activations(x);
  x = x.contiguous();
  const int64_t rows = x.size(0), in = x.size(1);
  auto q = torch::empty({rows, in}, torch::kInt8);
  auto scales = torch::empty({rows}, torch::kFloat32);
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  lmprog::dispatch_float_types(x.scalar_type(), "w8a8_quantize_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
#pragma omp parallel for schedule(static) if (rows * in >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) quantize_row(xp + r * in, in, qp + r * in, sp + r);
  });
  return {q, scales};
}

std::unique_ptr<SplitWork> prepare_w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                               const torch::Tensor& scales, const torch::Tensor& bias,
                                               bool out_float32, bool gated) {
  const auto dtype = out_float32 ? torch::kFloat32 : x.scalar_type();
  return std::make_unique<W8A8Work>(
      x, packed, scales, bias.defined() ? bias.to(dtype).contiguous() : bias, out_float32, gated);
}

namespace {

// `work` run by a team of threads, or by the calling thread alone for a small weight.
torch::Tensor run_packed(W8A8Work& work, int64_t weights) {
#pragma omp parallel if (weights >= kParallelElements * 8)
  work.run(omp_get_thread_num(), omp_get_num_threads());
  return work.output();
}

}  // namespace

torch::Tensor w8a8_gated(torch::Tensor x, torch::Tensor scales, torch::Tensor packed) {
  TORCH_CHECK(w8a8_packed_available(), "w8a8_gated: this build has no AVX512-VNNI kernel");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == torch::kFloat32 && scales.is_contiguous(),
              "scales must be a contiguous float32 [out]");
  W8A8Work work(x, packed, scales, torch::Tensor(), false, true);
  return run_packed(work, scales.size(0) * x.size(1));
}

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> packed, c10::optional<torch::Tensor> bias,
                          bool out_float32) {
  check_activations(x);
  check_weight(qweight, scales);
  const int64_t out = qweight.size(0), in = qweight.size(1), rows = x.size(0);
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " inputs, the weight ", in);
  const auto dtype = out_float32 ? torch::kFloat32 : x.scalar_type();
  const torch::Tensor b = output_bias(bias, out, dtype);
  if (packed.has_value() && packed->defined() && w8a8_packed_available() &&
      rows <= w8a8_packed_max_rows()) {
    W8A8Work work(x, *packed, scales, b, out_float32, false);
    return run_packed(work, out * in);
  }
  const auto quantized = w8a8_quantize_rows(x);
  auto y = torch::empty({rows, out}, torch::dtype(dtype));
  const float* row_scales = quantized[1].data_ptr<float>();
  const float* col_scales = scales.data_ptr<float>();
  // In chunks of rows whose int32 sums stay in the cache for their rescaling (at 2048 rows x
  // 3072 outputs the whole product is 25 MB, and rescaling it from memory cost a quarter of
  // the product's time).
  // The sums go to a buffer kept by the calling thread: a fresh one each call was megabytes
  // of page faults.
  const int64_t chunk = std::min(rows, std::max<int64_t>(256, kChunkBytes / (4 * out)));
  thread_local torch::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < chunk * out) {
    scratch = torch::empty({chunk * out}, torch::kInt32);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    auto acc = scratch.narrow(0, 0, n * out).view({n, out});
    at::_int_mm_out(acc, quantized[0].narrow(0, r0, n), qweight.t());
    const int32_t* ap = acc.data_ptr<int32_t>();
    lmprog::dispatch_float_types(dtype, "w8a8_linear", [&](auto tag) {
      using T = decltype(tag);
      const T* bp = b.defined() ? b.data_ptr<T>() : nullptr;
      T* yp = y.data_ptr<T>() + r0 * out;
#pragma omp parallel for schedule(static) if (n * out >= kParallelElements)
      for (int64_t r = 0; r < n; ++r) {
        rescale_row(ap + r * out, row_scales[r0 + r], col_scales, bp, out, yp + r * out);
      }
    });
  }
  return y;
}
