// Native CPU extend (prefill) attention in bfloat16: products on AMX tiles, or by AVX512-BF16
// dot products on CPUs without AMX.
//
// Each request's new tokens attend to its keys (its cached prefix and the new tokens
// themselves, already written to the paged pool), causally, optionally within a sliding
// window. torch's CPU flash attention spends as long on a 2 x 1024-token prefill as all of
// a small model's matmuls do; here the products run on AMX (tdpbf16ps: a 16 x 16 float32
// tile from 16 x 32 bfloat16 operands per instruction) or AVX512-BF16 (vdpbf16ps: 16
// float32 lanes, each += one pair of bfloat16 products), the softmax on AVX-512.
//
// Per request and kv head, the keys and values are first rearranged into AMX's tile layout
// (`extend_tiles.h`, which also holds the products: AMX tiles, or AVX512-BF16 dot products
// from the same layout), once for every query head of the group. Then per query head and
// block of 16 query rows, in two passes over the keys that the block can see (causal:
// later blocks see more):
// 1. scores = q . k^T into a float32 row buffer, 32 keys per step; masked, softmax per row
//    in float32 (exact, no running rescale), probabilities rounded to bfloat16;
// 2. out = p . v, accumulated in float32 tiles over all key blocks, rounded once.
// Products of bfloat16 values are exact in float32; the one rounding besides the output's
// is that of the probabilities to bfloat16, as in torch's bfloat16 flash attention.
//
// Shapes:
//   q            [tokens, num_heads, head_dim] bfloat16 (rows may be strided; last dim contiguous)
//   k_buf, v_buf [num_slots, num_kv_heads, head_dim] bfloat16 (the pool)
//   req_to_token [num_rows, context_len] int64
//   req_rows, prefix_lens, extend_lens, q_starts [requests] int64 (q_starts: first row of
//                each request's new tokens in q)
//   returns      out [tokens, num_heads * head_dim] bfloat16
// head_dim must be 64 or 128. `extend_attention_available(amx)` says whether this build and
// CPU can run it: on AMX tiles (AMX compiled in, the CPU has it, the OS grants the tile
// state) or by AVX512-BF16 dot products (compiled in: -march=native on a CPU that has them).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"
#include "extend_tiles.h"
#include "native_ops.h"

using lmprog::bf16;

namespace {

#if LMPROG_BF16_DOT
constexpr int64_t kRows = 16;      // query rows per block (a tile's rows)
using namespace lmprog::extend;

struct Scratch {
  std::vector<float> scores;     // [16, keys_padded]
  std::vector<uint16_t> probs;   // [16, keys_padded] bfloat16, not normalized
  std::vector<uint16_t> q;       // [16, head_dim] bfloat16, zero padded rows
  std::vector<float> out;        // [16, head_dim]
  float inv_sum[kRows];          // 1 / each row's sum of probabilities
};

// Softmax per row over its visible keys, left unnormalized (each row's 1 / sum scales its
// output at the end); the probabilities of every other key in range are zero.
void softmax_rows(Scratch& s, int64_t rows, int64_t first_pos, int64_t window, int64_t first_block,
                  int64_t blocks, int64_t stride, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kRows; ++i) {
    float* row = s.scores.data() + i * stride;
    uint16_t* prow = s.probs.data() + i * stride;
    const int64_t from = first_block * kKeys, to = blocks * kKeys;
    if (i >= rows) {
      std::fill(prow + from, prow + to, uint16_t{0});
      continue;
    }
    const int64_t pos = first_pos + i;
    const int64_t k0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, k1 = pos + 1;
    std::fill(prow + from, prow + k0, uint16_t{0});
    std::fill(prow + k1, prow + to, uint16_t{0});
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 m = lmprog::tail16(k1 - k);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, lmprog::load16_ps(row + k, m));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 m = lmprog::tail16(k1 - k);
      const __m512 x = _mm512_fmsub_ps(lmprog::load16_ps(row + k, m), vscale, shift);
      const __m512 e = _mm512_maskz_mov_ps(m, lmprog::exp_nonpositive(x));
      // The sum of what the output will be weighted by: the rounded probabilities.
      vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(lmprog::store16_bf16(prow + k, m, e)));
    }
    s.inv_sum[i] = 1.f / _mm512_reduce_add_ps(vsum);
  }
}

// One block of up to 16 query rows of one head against its request's packed keys/values.
// Query row i sits at position `first_pos + i`; it sees keys [max(0, pos - window + 1), pos].
template <int CHUNKS>
void attend_block(const uint16_t* kpacked, const uint16_t* vpacked, int64_t rows,
                  int64_t first_pos, int64_t window, float scale, bool amx, Scratch& s) {
  const int64_t end = first_pos + rows;  // keys the block needs
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t first_block = lo / kKeys, blocks = (end + kKeys - 1) / kKeys;
  const int64_t stride = blocks * kKeys;  // row stride of scores / probs (from key 0)
  if (static_cast<int64_t>(s.scores.size()) < kRows * stride) {
    s.scores.resize(kRows * stride);
    s.probs.resize(kRows * stride);
  }
#if LMPROG_AMX
  if (amx) {
    scores_amx<CHUNKS>(kpacked, first_block, blocks, s.q.data(), s.scores.data(), stride);
    softmax_rows(s, rows, first_pos, window, first_block, blocks, stride, scale);
    values_amx<CHUNKS>(vpacked, first_block, blocks, s.probs.data(), s.out.data(), stride);
    return;
  }
#endif
  // Rows past `rows` are zero queries (their scores are not read) and zero probabilities.
  scores_dot<CHUNKS>(kpacked, first_block, blocks, rows, s.q.data(), s.scores.data(), stride);
  softmax_rows(s, rows, first_pos, window, first_block, blocks, stride, scale);
  values_dot<CHUNKS>(vpacked, first_block, blocks, rows, s.probs.data(), s.out.data(), stride);
}
#endif

}  // namespace

bool extend_attention_available(bool amx) {
#if LMPROG_BF16_DOT
  return amx ? lmprog::amx_available() : true;
#else
  return false;
#endif
}

torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                               torch::Tensor req_to_token, torch::Tensor req_rows,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens,
                               torch::Tensor q_starts, double scale, int64_t sliding_window,
                               bool amx) {
  TORCH_CHECK(extend_attention_available(amx), "extend_attention: ",
              amx ? "AMX" : "AVX512-BF16", " is not available here");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.stride(2) == 1,
              "extend_attention: q must be bfloat16 [tokens, heads, head_dim], last dim contiguous");
  TORCH_CHECK(k_buf.scalar_type() == torch::kBFloat16 && v_buf.scalar_type() == torch::kBFloat16 &&
                  k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3 &&
                  k_buf.sizes() == v_buf.sizes(),
              "extend_attention: k_buf / v_buf must be contiguous bfloat16 [slots, kv_heads, head_dim]");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_buf.size(1);
  TORCH_CHECK((head_dim == 64 || head_dim == 128) && k_buf.size(2) == head_dim &&
                  heads % kv_heads == 0,
              "extend_attention: head_dim must be 64 or 128 and heads a multiple of kv_heads");
  for (const auto* t : {&req_rows, &prefix_lens, &extend_lens, &q_starts}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->dim() == 1 &&
                    t->size(0) == req_rows.size(0),
                "extend_attention: per-request tensors must be contiguous int64 [requests]");
  }
  TORCH_CHECK(req_to_token.scalar_type() == torch::kInt64 && req_to_token.is_contiguous(),
              "extend_attention: req_to_token must be contiguous int64");
  auto out = torch::empty({q.size(0), heads * head_dim}, q.options());
#if LMPROG_BF16_DOT
  const int64_t requests = req_rows.size(0), group = heads / kv_heads;
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.size(1), slot_stride = kv_heads * head_dim;
  const int64_t slots_total = k_buf.size(0);
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(extend[r] >= 0 && prefix[r] >= 0 && prefix[r] + extend[r] <= table_stride &&
                    starts[r] >= 0 && starts[r] + extend[r] <= q.size(0) && rows[r] >= 0 &&
                    rows[r] < req_to_token.size(0),
                "extend_attention: request ", r, " is out of range");
    for (int64_t k = 0; k < prefix[r] + extend[r]; ++k) {
      const int64_t slot = table[rows[r] * table_stride + k];
      TORCH_CHECK(slot >= 0 && slot < slots_total, "extend_attention: KV slot ", slot, " out of range");
    }
  }
  // Packed keys and values per (request, kv head).
  std::vector<int64_t> offsets(requests + 1, 0);
  for (int64_t r = 0; r < requests; ++r) {
    const int64_t blocks = (prefix[r] + extend[r] + kKeys - 1) / kKeys;
    offsets[r + 1] = offsets[r] + blocks * 2 * (head_dim / 32) * kTileWords;  // = values' size
  }
  std::vector<uint16_t> kpacked(offsets[requests] * kv_heads), vpacked(offsets[requests] * kv_heads);
  const auto* kb = k_buf.data_ptr<bf16>();
  const auto* vb = v_buf.data_ptr<bf16>();
#pragma omp parallel for schedule(dynamic)
  for (int64_t w = 0; w < requests * kv_heads; ++w) {
    const int64_t r = w / kv_heads, h = w % kv_heads;
    const int64_t* slots = table + rows[r] * table_stride;
    const int64_t keys = prefix[r] + extend[r], base = offsets[r] * kv_heads + (offsets[r + 1] - offsets[r]) * h;
    pack_keys(kb + h * head_dim, slot_stride, slots, keys, head_dim, kpacked.data() + base);
    pack_values(vb + h * head_dim, slot_stride, slots, keys, head_dim, vpacked.data() + base);
  }
  // Work items: (request, head, block of 16 query rows), largest blocks (latest) first.
  struct Item {
    int64_t r, head, block;
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t b = (extend[r] + kRows - 1) / kRows - 1; b >= 0; --b)
      for (int64_t hd = 0; hd < heads; ++hd) items.push_back({r, hd, b});
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return prefix[a.r] + a.block * kRows > prefix[b.r] + b.block * kRows;
  });
  const auto* qp = q.data_ptr<bf16>();
  auto* op = out.data_ptr<bf16>();
  const int64_t q_row_stride = q.stride(0), q_head_stride = q.stride(1);
  const float fscale = static_cast<float>(scale);
#pragma omp parallel
  {
#if LMPROG_AMX
    if (amx) lmprog::configure_tiles();
#endif
    Scratch s;
    s.q.resize(kRows * head_dim);
    s.out.resize(kRows * head_dim);
#pragma omp for schedule(dynamic)
    for (int64_t n = 0; n < static_cast<int64_t>(items.size()); ++n) {
      const Item it = items[n];
      const int64_t r = it.r, h = it.head / group;
      const int64_t row0 = it.block * kRows, count = std::min(kRows, extend[r] - row0);
      std::fill(s.q.begin(), s.q.end(), uint16_t{0});
      for (int64_t i = 0; i < count; ++i) {
        const bf16* src = qp + (starts[r] + row0 + i) * q_row_stride + it.head * q_head_stride;
        std::memcpy(s.q.data() + i * head_dim, src, head_dim * 2);
      }
      const int64_t base = offsets[r] * kv_heads + (offsets[r + 1] - offsets[r]) * h;
      if (head_dim == 64) {
        attend_block<2>(kpacked.data() + base, vpacked.data() + base, count, prefix[r] + row0,
                        sliding_window, fscale, amx, s);
      } else {
        attend_block<4>(kpacked.data() + base, vpacked.data() + base, count, prefix[r] + row0,
                        sliding_window, fscale, amx, s);
      }
      for (int64_t i = 0; i < count; ++i) {
        bf16* dst = op + (starts[r] + row0 + i) * heads * head_dim + it.head * head_dim;
        const float inv = s.inv_sum[i];
        for (int64_t d = 0; d < head_dim; ++d)
          dst[d] = lmprog::from_f32<bf16>(s.out[i * head_dim + d] * inv);
      }
    }
#if LMPROG_AMX
    if (amx) _tile_release();
#endif
  }
#endif
  return out;
}
