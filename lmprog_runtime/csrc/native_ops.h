// The native CPU entry points, defined across csrc/*.cpp: the Python module exposes them
// (decode_attention.cpp) and the decode stack chains them (decode_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

// One kernel's work (a quantized or AMX linear layer's product, a step of decode attention)
// split among threads that already run (the decode stack's one parallel region): made by
// one thread, which readies the input and allocates the output, then `run` by each of
// `num_threads` threads for its share, then `output` read by one thread once all are done.
class SplitWork {
 public:
  virtual ~SplitWork() = default;
  virtual void run(int64_t thread, int64_t num_threads) = 0;
  virtual torch::Tensor output() const = 0;
};

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf,
                                            torch::Tensor v_buf, torch::Tensor req_to_token,
                                            torch::Tensor req_rows, torch::Tensor seq_lens,
                                            torch::Tensor key_starts, torch::Tensor order,
                                            double scale, int64_t sliding_window);
// decode_attention's output [batch, num_heads, head_dim], its requests split among threads
// (each thread a contiguous run of `order`); output() raises if a KV slot was out of range.
std::unique_ptr<SplitWork> prepare_decode_attention(torch::Tensor q, torch::Tensor k_buf,
                                                    torch::Tensor v_buf, torch::Tensor req_to_token,
                                                    torch::Tensor req_rows, torch::Tensor seq_lens,
                                                    torch::Tensor key_starts, torch::Tensor order,
                                                    double scale, int64_t sliding_window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin);
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          bool out_float32);
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor mins, bool out_float32);
// kind "q8_0" (mins undefined) or "q4_1"; x [rows, in], float32 or bfloat16; output in x's dtype.
std::unique_ptr<SplitWork> prepare_quantized_linear(const std::string& kind,
                                                              const torch::Tensor& weight,
                                                              const torch::Tensor& scales,
                                                              const torch::Tensor& mins,
                                                              const torch::Tensor& x);
// From this many rows (of bfloat16 activations when `bf16`, else float32) a quantized layer
// is faster dequantized to one dense matmul.
int64_t quantized_dense_rows(bool bf16);
torch::Tensor q8_0_dequantize(torch::Tensor qweight, torch::Tensor scales, bool to_bf16);
torch::Tensor q4_1_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                              bool to_bf16);
// W8A8 (w8a8_linear.cpp): x [rows, in] float32 or bfloat16 rounded to int8 per row ->
// {int8 [rows, in], float32 scales [rows]}; and x @ w.T + bias over an int8 weight [out, in]
// with float32 scales [out], through those int8 rows (output in x's dtype or float32). Up to
// `w8a8_packed_max_rows()` rows go through `packed` (`w8a8_pack(qweight)`) where given and
// the CPU has AVX512-VNNI (`w8a8_packed_available()`); `prepare_w8a8_linear` is that path
// split among a parallel region's threads.
std::vector<torch::Tensor> w8a8_quantize_rows(torch::Tensor x);
bool w8a8_packed_available();
int64_t w8a8_packed_max_rows();
// `gated`: a gated MLP's fused gate/up weight, blocks of gate and up outputs paired, for
// `w8a8_gated`: silu(x @ gate.T) * (x @ up.T), each product rounded to x's dtype first.
torch::Tensor w8a8_pack(torch::Tensor qweight, bool gated);
torch::Tensor w8a8_gated(torch::Tensor x, torch::Tensor scales, torch::Tensor packed);
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> packed, c10::optional<torch::Tensor> bias,
                          bool out_float32);
std::unique_ptr<SplitWork> prepare_w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                               const torch::Tensor& scales, const torch::Tensor& bias,
                                               bool out_float32, bool gated);
bool extend_attention_available(bool amx);
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                               torch::Tensor req_to_token, torch::Tensor req_rows,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens,
                               torch::Tensor q_starts, double scale, int64_t sliding_window,
                               bool amx);
bool amx_linear_available();
// Up to how many rows a layer multiplies on its packed weight (more: a dense matmul).
int64_t amx_linear_max_rows();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
std::unique_ptr<SplitWork> prepare_amx_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                               const torch::Tensor& bias);
// A gated MLP's activation, silu(x @ gate.T) * (x @ up.T) with each product rounded to
// bfloat16 first, from its fused gate/up weight packed by pairs of 16-output blocks (gate
// block p, then up block p), at any row count, by AVX512-BF16 dot products; available
// (`amx_gated_available()`) on CPUs that have those and no AMX tiles.
bool amx_gated_available();
torch::Tensor amx_gated(torch::Tensor x, torch::Tensor packed);
std::unique_ptr<SplitWork> prepare_amx_gated(const torch::Tensor& x, const torch::Tensor& packed);
// The rows of a bfloat16 x [rows, in] readied once (copied, zero padded to whole tiles) for
// products with packed bfloat16 weight blocks built on the fly (a quantized layer's blocks,
// dequantized one pair of 16 outputs at a time): AMX tiles where the CPU has them, else
// AVX512-BF16 dot products. Needs `amx_linear_available()`.
class PackedRows {
 public:
  explicit PackedRows(const torch::Tensor& x);
  int64_t padded_rows() const { return padded_; }
  // Around each thread's calls of `sums` (AMX: loads and releases the tile configuration).
  void begin() const;
  void end() const;
  // out[i * 32 + 16 b + j] = x_i . (output j of block b) for every row i < padded_rows(),
  // over one or (`two`) two blocks packed at `blocks`, each [in / 32][16][32]:
  // block[c][r][2j + p] = w[j][32c + 2r + p] (`amx_linear`'s layout). Meanwhile the
  // `next_bytes` at `next` (what the caller reads next, if any) are fetched into cache.
  void sums(const uint16_t* blocks, bool two, float* out, const void* next = nullptr,
            int64_t next_bytes = 0) const;

 private:
  bool amx_;
  int64_t m_ = 0, k_ = 0, padded_ = 0;
  std::vector<uint16_t> a_;
};
void register_decode_stack(py::module& m);
