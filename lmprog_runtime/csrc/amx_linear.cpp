// bfloat16 linear layers for a few rows (decode batches) on AMX tiles, or by AVX512-BF16 dot
// products on CPUs without AMX, over weights packed once into the tiles' layout.
//
// At a decode batch (M = 1..64 rows), a linear layer reads its whole weight for little
// arithmetic, so its speed is the speed of streaming the weight. torch's bfloat16 matmul
// (oneDNN) ran well below that on SmolLM2's layer shapes at 32 rows (30 layers in 31.6 ms,
// 7 GB/s of weights). Here the weight [N, K] is packed once into AMX's second-operand
// layout: per block of 16 outputs and chunk of 32 inputs, a tile whose row r holds, for
// each of the 16 outputs, the pair of inputs (2r, 2r + 1) (`pack_for_amx` in
// `models/amx_linear.py`: a view and a permute). Each thread takes pairs of output blocks
// and, for every 32 rows of x, accumulates 2 x 2 float32 tiles over K; the weight is read
// once for up to 32 rows (again for every further 32). Without AMX (AVX512-BF16: AMD Zen 4),
// a tile row is one register of 16 outputs' input pairs, and vdpbf16ps adds to each output
// lane its pair times the row's pair of x, broadcast: per pair of output blocks, up to 8
// rows at a time, the blocks' weights re-read from cache for each further 8. torch's
// bfloat16 matmul there streamed a one-row step's weights at about 11 GB/s. Products of
// bfloat16 values are exact in float32; the output is rounded once to bfloat16, plus the
// bias if any.
//
//   x      [M, K] bfloat16 (rows contiguous)
//   packed [N / 16, K / 32, 16, 32] bfloat16: packed[b, c, r, 2j + p] = w[16b + j, 32c + 2r + p]
//   bias   [N] bfloat16 or undefined
//   returns [M, N] bfloat16
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "cpu_vec.h"
#include "native_ops.h"

using lmprog::bf16;

namespace {

constexpr int64_t kTile = 16;     // rows of a tile; outputs per block
constexpr int64_t kChunk = 32;    // inputs (bfloat16) per tile row

// Writes out[i, col0 + j] = round(sum[i][j] + bias) for `rows` rows of `cols` outputs.
inline void store_rows(const float* sums, int64_t sums_stride, int64_t rows, int64_t cols,
                       int64_t col0, int64_t n, const bf16* bias, bf16* out) {
  for (int64_t i = 0; i < rows; ++i) {
    bf16* dst = out + i * n + col0;
    const float* src = sums + i * sums_stride;
    for (int64_t j = 0; j < cols; ++j) {
      const float b = bias != nullptr ? lmprog::to_f32(bias[col0 + j]) : 0.f;
      dst[j] = lmprog::from_f32<bf16>(src[j] + b);
    }
  }
}

#if LMPROG_AMX
// sums[i * 32 + 16 b + j] = x_i . w_j of block b, for the 16 * RowTiles rows of `a` and the
// Blocks (1 or 2) packed blocks at `w` (each [k / 32][16][32]); the caller's tiles configured.
template <int RowTiles, int Blocks>
void tile_sums(const uint16_t* a, int64_t k, const uint16_t* w, float* sums) {
  const int64_t chunks = k / kChunk;
  const uint16_t* b0 = w;
  const uint16_t* b1 = b0 + chunks * kTile * kChunk;
  _tile_zero(0);
  if (Blocks == 2) _tile_zero(1);
  if (RowTiles == 2) _tile_zero(2);
  if (RowTiles == 2 && Blocks == 2) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, a + c * kChunk, k * 2);
    if (RowTiles == 2) _tile_loadd(5, a + kTile * k + c * kChunk, k * 2);
    _tile_loadd(6, b0 + c * kTile * kChunk, 64);
    if (Blocks == 2) _tile_loadd(7, b1 + c * kTile * kChunk, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (Blocks == 2) _tile_dpbf16ps(1, 4, 7);
    if (RowTiles == 2) _tile_dpbf16ps(2, 5, 6);
    if (RowTiles == 2 && Blocks == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 128);
  if (Blocks == 2) _tile_stored(1, sums + 16, 128);
  if (RowTiles == 2) _tile_stored(2, sums + 16 * 32, 128);
  if (RowTiles == 2 && Blocks == 2) _tile_stored(3, sums + 16 * 32 + 16, 128);
}

// out[m0 .. m0 + rows, 16 nb .. 16 nb + 16 * blocks] for rows <= 32, blocks <= 2.
template <int RowTiles, int Blocks>
void tile_product(const uint16_t* a, int64_t k, const uint16_t* packed, int64_t nb, int64_t rows,
                  int64_t n, const bf16* bias, bf16* out, float* cbuf) {
  tile_sums<RowTiles, Blocks>(a, k, packed + nb * (k / kChunk) * kTile * kChunk, cbuf);
  store_rows(cbuf, 32, rows, Blocks * kTile, nb * kTile, n, bias, out);
}
#endif

#if LMPROG_BF16_DOT
// sums[i * stride + 16 b + j] = x_i . w_j of block b for the R rows of `a` and the Blocks
// (1 or 2) packed blocks at `w` (each [k / 32][16][32]), by vdpbf16ps: accumulator (i, b)
// holds the 16 outputs of block b for row i.
// `fetch`: the weights the caller multiplies next, a share fetched per chunk (NextWeights).
// Over SmolLM2-135M's 30 layers on a 2-core Zen 5 (ms, `bench_packed_linears.py` shapes):
// at 1 / 8 / 32 rows 5.3 / 7.2 / 12.7 without (one run of that script), 3.6-4.9 / 4.1-5.0 /
// 7.9-8.7 with (three processes alternating with other variants).
template <int R, int Blocks>
void dot_sums(const uint16_t* a, int64_t k, const uint16_t* w, float* sums, int64_t stride,
              lmprog::NextWeights fetch = {}) {
  const int64_t chunks = k / kChunk;
  __m512 acc[R][Blocks];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    fetch.step();
    for (int r = 0; r < kTile; ++r) {
      __m512bh wr[Blocks];
      for (int b = 0; b < Blocks; ++b)
        wr[b] = lmprog::as_bh(_mm512_loadu_si512(w + (b * chunks + c) * kTile * kChunk + r * kChunk));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512bh xi = lmprog::broadcast_pair(a + i * k + c * kChunk + 2 * r);
        for (int b = 0; b < Blocks; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], xi, wr[b]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int b = 0; b < Blocks; ++b) _mm512_storeu_ps(sums + i * stride + b * kTile, acc[i][b]);
}

// out[m0 .. m0 + rows, 16 nb .. 16 (nb + Blocks)] for rows <= R.
template <int R, int Blocks>
void dot_product(const uint16_t* a, int64_t k, const uint16_t* packed, int64_t nb, int64_t rows,
                 int64_t n, const bf16* bias, bf16* out, lmprog::NextWeights fetch) {
  alignas(64) float sums[R * Blocks * kTile];
  dot_sums<R, Blocks>(a, k, packed + nb * (k / kChunk) * kTile * kChunk, sums, Blocks * kTile, fetch);
  store_rows(sums, Blocks * kTile, rows, Blocks * kTile, nb * kTile, n, bias, out);
}

// Every row of x against output blocks nb (and nb + 1 when `two`), 8 rows at a time,
// fetching the next pair of blocks (`next`, null at the end) meanwhile (NextWeights).
inline void dot_rows(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t nb,
                     bool two, int64_t n, const bf16* bias, bf16* out, const uint16_t* next) {
  for (int64_t m0 = 0; m0 < m; m0 += 8) {
    const int64_t rows = std::min<int64_t>(8, m - m0);
    const uint16_t* ap = a + m0 * k;
    bf16* dst = out + m0 * n;
    const lmprog::NextWeights fetch(next, 2 * k * kTile * 2, m, m0, k / kChunk);
    lmprog::with_row_tile(rows, [&](auto tile) {
      constexpr int R = decltype(tile)::value;
      two ? dot_product<R, 2>(ap, k, packed, nb, rows, n, bias, dst, fetch)
          : dot_product<R, 1>(ap, k, packed, nb, rows, n, bias, dst, fetch);
    });
  }
}

// A gated MLP's activation from its fused gate/up weight packed by pairs (`pack_for_amx`,
// gated: block 2p holds gate outputs 16p .. 16p + 15, block 2p + 1 the same up outputs):
// y[i][16 p + j] = silu(g) u for every row, g and u rounded to bfloat16 first, as the
// layer's output would be before `silu_and_mul`. `next` as for `dot_rows`.
inline void gated_rows(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t p,
                       int64_t inter, bf16* y, const uint16_t* next) {
  const uint16_t* pair = packed + 2 * p * (k / kChunk) * kTile * kChunk;
  for (int64_t m0 = 0; m0 < m; m0 += 8) {
    const int64_t rows = std::min<int64_t>(8, m - m0);
    lmprog::with_row_tile(rows, [&](auto tile) {
      constexpr int R = decltype(tile)::value;
      alignas(64) float sums[R * 2 * kTile];
      dot_sums<R, 2>(a + m0 * k, k, pair, sums, 2 * kTile,
                     lmprog::NextWeights(next, 2 * k * kTile * 2, m, m0, k / kChunk));
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 g = lmprog::round16_bf16(_mm512_load_ps(sums + i * 2 * kTile));
        const __m512 u = lmprog::round16_bf16(_mm512_load_ps(sums + i * 2 * kTile + kTile));
        lmprog::store16_bf16(y + (m0 + i) * inter + p * kTile, 0xFFFF, lmprog::silu_mul16(g, u));
      }
    });
  }
}
#endif

}  // namespace

bool amx_linear_available() { return lmprog::amx_available() || LMPROG_BF16_DOT; }

// Dot products only where they are also amx_linear's products: on AMX tiles, a prefill's
// gate/up projection is faster through oneDNN's matmul, then `silu_and_mul`.
bool amx_gated_available() { return LMPROG_BF16_DOT && !lmprog::amx_available(); }

int64_t amx_linear_max_rows() {
  // AMX tiles read the packed weight once for every 32 rows, and from 64 rows oneDNN's own
  // kernels were as fast on a Xeon. The AVX512-BF16 dot products stayed ahead of torch's
  // bfloat16 matmul up to 256 rows over SmolLM2-135M's 30 layers on a 2-core Zen 5 (1.10-1.16x
  // at 32-256 rows, `bench_packed_linears.py`).
  return lmprog::amx_available() ? 32 : 256;
}

namespace {

// x @ w.T + bias for up to any number of rows: pairs of output blocks split among threads.
// `gated`: a gated MLP's activation from a pair-packed gate/up weight, by dot products
// (`gated_rows`; only where `amx_gated_available()`: no AMX tiles).
class AmxWork final : public SplitWork {
 public:
  AmxWork(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
          bool gated = false)
      : packed_(packed), gated_(gated) {
    TORCH_CHECK(amx_linear_available(),
                "amx_linear: this build or CPU has neither AMX bfloat16 tiles nor AVX512-BF16");
    TORCH_CHECK(!gated || amx_gated_available(), "amx_gated: this build has no AVX512-BF16 kernel");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2,
                "amx_linear: x must be a bfloat16 CPU tensor [rows, in]");
    TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                    packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == kChunk,
                "amx_linear: packed must be contiguous bfloat16 [out / 16, in / 32, 16, 32]");
    m_ = x.size(0), k_ = x.size(1), blocks_ = packed.size(0), n_ = blocks_ * kTile;
    TORCH_CHECK(packed.size(1) * kChunk == k_, "amx_linear: x has ", k_, " inputs, the weight ",
                packed.size(1) * kChunk);
    if (bias.defined()) {
      TORCH_CHECK(bias.scalar_type() == torch::kBFloat16 && bias.is_contiguous() &&
                      bias.numel() == n_,
                  "amx_linear: bias must be contiguous bfloat16 [out]");
      bias_ = bias.data_ptr<bf16>();
    }
    TORCH_CHECK(!gated || (blocks_ % 2 == 0 && !bias.defined()),
                "amx_gated: a gated weight needs gate and up outputs in whole blocks of 16 and no bias");
    out_ = torch::empty({m_, gated ? n_ / 2 : n_}, x.options());
    // Rows zero padded to whole tiles.
    padded_rows_ = (m_ + kTile - 1) / kTile * kTile;
    a_.assign(padded_rows_ * k_, 0);
    const auto xc = x.contiguous();
    std::memcpy(a_.data(), xc.data_ptr<bf16>(), m_ * k_ * 2);
  }

  void run(int64_t thread, int64_t num_threads) override {
    const int64_t pairs = (blocks_ + 1) / 2;
    const int64_t first = pairs * thread / num_threads, last = pairs * (thread + 1) / num_threads;
    if (first == last) return;
    const auto* w = reinterpret_cast<const uint16_t*>(packed_.data_ptr<bf16>());
    bf16* op = out_.data_ptr<bf16>();
#if LMPROG_BF16_DOT
    if (gated_ || !amx_) {
      const int64_t pair_words = 2 * (k_ / kChunk) * kTile * kChunk;
      for (int64_t p = first; p < last; ++p) {
        const uint16_t* next = p + 1 < last ? w + (p + 1) * pair_words : nullptr;
        if (gated_)
          gated_rows(a_.data(), m_, k_, w, p, n_ / 2, op, next);
        else
          dot_rows(a_.data(), m_, k_, w, 2 * p, 2 * p + 1 < blocks_, n_, bias_, op, next);
      }
      return;
    }
#endif
#if LMPROG_AMX
    lmprog::configure_tiles();
    alignas(64) float cbuf[32 * 32];
    for (int64_t p = first; p < last; ++p) {
      const int64_t nb = 2 * p;
      const bool two = nb + 1 < blocks_;
      for (int64_t m0 = 0; m0 < padded_rows_; m0 += 2 * kTile) {
        const uint16_t* ap = a_.data() + m0 * k_;
        const int64_t rows = std::min<int64_t>(2 * kTile, m_ - m0);
        bf16* dst = op + m0 * n_;
        if (padded_rows_ - m0 > kTile) {
          two ? tile_product<2, 2>(ap, k_, w, nb, rows, n_, bias_, dst, cbuf)
              : tile_product<2, 1>(ap, k_, w, nb, rows, n_, bias_, dst, cbuf);
        } else {
          two ? tile_product<1, 2>(ap, k_, w, nb, rows, n_, bias_, dst, cbuf)
              : tile_product<1, 1>(ap, k_, w, nb, rows, n_, bias_, dst, cbuf);
        }
      }
    }
    _tile_release();
#endif
  }

  torch::Tensor output() const override { return out_; }

 private:
  torch::Tensor packed_, out_;
  const bf16* bias_ = nullptr;
  const bool gated_;
  const bool amx_ = lmprog::amx_available();  // else AVX512-BF16 dot products
  int64_t m_ = 0, k_ = 0, blocks_ = 0, n_ = 0, padded_rows_ = 0;
  std::vector<uint16_t> a_;
};

}  // namespace

PackedRows::PackedRows(const torch::Tensor& x) : amx_(lmprog::amx_available()) {
  TORCH_CHECK(amx_linear_available(), "PackedRows: neither AMX bfloat16 tiles nor AVX512-BF16 here");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
                  x.size(1) % kChunk == 0,
              "PackedRows: x must be a bfloat16 CPU tensor [rows, in], in a multiple of 32");
  m_ = x.size(0), k_ = x.size(1);
  padded_ = (m_ + 2 * kTile - 1) / (2 * kTile) * (2 * kTile);
  a_.assign(padded_ * k_, 0);
  const auto xc = x.contiguous();
  std::memcpy(a_.data(), xc.data_ptr<bf16>(), m_ * k_ * 2);
}

void PackedRows::begin() const {
#if LMPROG_AMX
  if (amx_) lmprog::configure_tiles();
#endif
}

void PackedRows::end() const {
#if LMPROG_AMX
  if (amx_) _tile_release();
#endif
}

void PackedRows::sums(const uint16_t* blocks, bool two, float* out, const void* next,
                      int64_t next_bytes) const {
#if LMPROG_AMX
  if (amx_) {
    for (int64_t m0 = 0; m0 < padded_; m0 += 2 * kTile) {
      two ? tile_sums<2, 2>(a_.data() + m0 * k_, k_, blocks, out + m0 * 2 * kTile)
          : tile_sums<2, 1>(a_.data() + m0 * k_, k_, blocks, out + m0 * 2 * kTile);
    }
    return;
  }
#endif
#if LMPROG_BF16_DOT
  for (int64_t m0 = 0; m0 < m_; m0 += 8) {
    const uint16_t* ap = a_.data() + m0 * k_;
    float* dst = out + m0 * 2 * kTile;
    const lmprog::NextWeights fetch(next, next_bytes, m_, m0, k_ / kChunk);
    lmprog::with_row_tile(m_ - m0, [&](auto tile) {
      constexpr int R = decltype(tile)::value;
      two ? dot_sums<R, 2>(ap, k_, blocks, dst, 2 * kTile, fetch)
          : dot_sums<R, 1>(ap, k_, blocks, dst, 2 * kTile, fetch);
    });
  }
#endif
}

std::unique_ptr<SplitWork> prepare_amx_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                               const torch::Tensor& bias) {
  return std::make_unique<AmxWork>(x, packed, bias);
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  AmxWork work(x, packed, bias.has_value() ? *bias : torch::Tensor());
#pragma omp parallel
  work.run(omp_get_thread_num(), omp_get_num_threads());
  return work.output();
}

std::unique_ptr<SplitWork> prepare_amx_gated(const torch::Tensor& x, const torch::Tensor& packed) {
  return std::make_unique<AmxWork>(x, packed, torch::Tensor(), true);
}

torch::Tensor amx_gated(torch::Tensor x, torch::Tensor packed) {
  AmxWork work(x, packed, torch::Tensor(), true);
#pragma omp parallel
  work.run(omp_get_thread_num(), omp_get_num_threads());
  return work.output();
}
