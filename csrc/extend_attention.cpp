// Native CPU extend (prefill) attention in bfloat16 on AMX tiles.
//
// Each request's new tokens attend to its keys (its cached prefix and the new tokens
// themselves, already written to the paged pool), causally, optionally within a sliding
// window. torch's CPU flash attention spends as long on a 2 x 1024-token prefill as all of
// a small model's matmuls do; here the products run on AMX (tdpbf16ps: a 16 x 16 float32
// tile from 16 x 32 bfloat16 operands per instruction) and only the softmax on AVX-512.
//
// Per request and kv head, the keys and values are first rearranged into the tile layout
// AMX expects for its second operand (pairs of bfloat16 along the reduced dimension, see
// `pack_keys` / `pack_values`), once for every query head of the group. Then per query head
// and block of 16 query rows, in two passes over the keys that the block can see (causal:
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
// head_dim must be 64 or 128. `extend_attention_available()` says whether this
// build and CPU can run it (AMX compiled in, the CPU has it, the OS grants the tile state).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"
#include "native_ops.h"

#include "amx.h"

using lmprog::bf16;

namespace {

#if LMPROG_AMX
constexpr int64_t kRows = 16;      // query rows per block (a tile's rows)
constexpr int64_t kKeys = 32;      // keys per step (two 16-column score tiles)
constexpr int64_t kTileWords = 512;   // bfloat16 values per tile

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

// Keys [keys, head_dim] (pool rows through `slots`) as second operands of q . k^T: per block
// of 32 keys, per half (16 keys), per 32 dims c, a tile whose row r holds, for each of the
// 16 keys, the pair of dims (32c + 2r, 32c + 2r + 1): the transpose of the 16 keys' words
// of that chunk. Keys past `keys` are zero.
void pack_keys(const bf16* buf, int64_t slot_stride, const int64_t* slots, int64_t keys,
               int64_t head_dim, uint16_t* packed) {
  const int64_t chunks = head_dim / 32, halves = (keys + kKeys - 1) / kKeys * 2;
  for (int64_t half = 0; half < halves; ++half) {
    const int64_t first = half * 16, count = std::clamp<int64_t>(keys - first, 0, 16);
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i rows[16];
      for (int64_t i = 0; i < 16; ++i) {
        rows[i] = i < count ? _mm512_loadu_si512(buf + slots[first + i] * slot_stride + c * 32)
                            : _mm512_setzero_si512();
      }
      transpose16(rows);
      uint16_t* tile = packed + (half * chunks + c) * kTileWords;
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * 32, rows[r]);
    }
  }
}

// Values [keys, head_dim] as second operands of p . v: per block of 32 keys, per 16 dims j,
// a tile whose row r holds, for each of the 16 dims, the values of keys 2r and 2r + 1
// (the two keys' 16 values interleaved). Keys past `keys` are zero.
void pack_values(const bf16* buf, int64_t slot_stride, const int64_t* slots, int64_t keys,
                 int64_t head_dim, uint16_t* packed) {
  const int64_t dtiles = head_dim / 16, blocks = (keys + kKeys - 1) / kKeys;
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t r = 0; r < kKeys / 2; ++r) {
      const int64_t k0 = block * kKeys + 2 * r, k1 = k0 + 1;
      const bf16* v0 = k0 < keys ? buf + slots[k0] * slot_stride : nullptr;
      const bf16* v1 = k1 < keys ? buf + slots[k1] * slot_stride : nullptr;
      for (int64_t j = 0; j < dtiles; ++j) {
        const __m512i a = v0 ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + j * 16)))
                             : _mm512_setzero_si512();
        const __m512i b = v1 ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + j * 16)))
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(packed + (block * dtiles + j) * kTileWords + r * 32,
                            _mm512_permutex2var_epi16(a, interleave, b));
      }
    }
  }
}

struct Scratch {
  std::vector<float> scores;     // [16, keys_padded]
  std::vector<uint16_t> probs;   // [16, keys_padded] bfloat16, not normalized
  std::vector<uint16_t> q;       // [16, head_dim] bfloat16, zero padded rows
  std::vector<float> out;        // [16, head_dim]
  float inv_sum[kRows];          // 1 / each row's sum of probabilities
};

// exp(x) for x <= 0 (scores minus their row's maximum): 2^(x log2 e) as 2^n * 2^f with
// |f| <= 1/2, 2^f by its degree-5 Taylor polynomial (relative error under 3e-6, far below
// the bfloat16 rounding of the probabilities), 2^n by vscalefps (0 below float range).
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

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// q . k^T for one block of 32 keys, the query's CHUNKS tiles of 32 dims resident in tiles 2..
template <int CHUNKS>
inline void score_block(const uint16_t* kpacked, int64_t b, float* scores, int64_t stride) {
  _tile_zero(0);
  _tile_zero(1);
  const uint16_t* kb = kpacked + b * 2 * CHUNKS * kTileWords;
  // (Tile numbers must be literals: the intrinsics paste them into the instruction.)
#define LMPROG_SCORE_CHUNK(c, query_tile)                    \
  if constexpr (CHUNKS > c) {                               \
    _tile_loadd(6, kb + (0 * CHUNKS + c) * kTileWords, 64); \
    _tile_dpbf16ps(0, query_tile, 6);                       \
    _tile_loadd(7, kb + (1 * CHUNKS + c) * kTileWords, 64); \
    _tile_dpbf16ps(1, query_tile, 7);                       \
  }
  LMPROG_SCORE_CHUNK(0, 2)
  LMPROG_SCORE_CHUNK(1, 3)
  LMPROG_SCORE_CHUNK(2, 4)
  LMPROG_SCORE_CHUNK(3, 5)
#undef LMPROG_SCORE_CHUNK
  _tile_stored(0, scores + b * kKeys, stride * 4);
  _tile_stored(1, scores + b * kKeys + 16, stride * 4);
}

// One block of up to 16 query rows of one head against its request's packed keys/values.
// Query row i sits at position `first_pos + i`; it sees keys [max(0, pos - window + 1), pos].
template <int CHUNKS>
void attend_block(const uint16_t* kpacked, const uint16_t* vpacked, int64_t rows,
                  int64_t first_pos, int64_t window, float scale, Scratch& s) {
  constexpr int64_t head_dim = CHUNKS * 32, dtiles = head_dim / 16;
  const int64_t end = first_pos + rows;  // keys the block needs
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t first_block = lo / kKeys, blocks = (end + kKeys - 1) / kKeys;
  const int64_t stride = blocks * kKeys;  // row stride of scores / probs (from key 0)
  if (static_cast<int64_t>(s.scores.size()) < kRows * stride) {
    s.scores.resize(kRows * stride);
    s.probs.resize(kRows * stride);
  }
  // 1. scores, the query's tiles loaded once
  for (int c = 0; c < CHUNKS; ++c) {
    switch (c) {
      case 0: _tile_loadd(2, s.q.data(), head_dim * 2); break;
      case 1: _tile_loadd(3, s.q.data() + 32, head_dim * 2); break;
      case 2: _tile_loadd(4, s.q.data() + 64, head_dim * 2); break;
      default: _tile_loadd(5, s.q.data() + 96, head_dim * 2); break;
    }
  }
  for (int64_t b = first_block; b < blocks; ++b) score_block<CHUNKS>(kpacked, b, s.scores.data(), stride);
  // Softmax per row over its visible keys, left unnormalized (each row's 1 / sum scales
  // its output at the end); the probabilities of every other key in range are zero.
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
      const __mmask16 m = lanes(k1 - k);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, row + k));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 m = lanes(k1 - k);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, row + k), vscale, shift);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(x));
      const __m256bh p = _mm512_cvtneps_pbh(e);
      _mm256_mask_storeu_epi16(prow + k, m, reinterpret_cast<const __m256i&>(p));
      // The sum of what the output will be weighted by: the rounded probabilities.
      vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(p));
    }
    s.inv_sum[i] = 1.f / _mm512_reduce_add_ps(vsum);
  }
  // 2. out = p . v, four 16-dim tiles at a time
  for (int64_t j0 = 0; j0 < dtiles; j0 += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = first_block; b < blocks; ++b) {
      _tile_loadd(4, s.probs.data() + b * kKeys, stride * 2);
      const uint16_t* vb = vpacked + (b * dtiles + j0) * kTileWords;
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, vb + kTileWords, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, vb + 2 * kTileWords, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, vb + 3 * kTileWords, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* o = s.out.data() + j0 * 16;
    _tile_stored(0, o, head_dim * 4);
    _tile_stored(1, o + 16, head_dim * 4);
    _tile_stored(2, o + 32, head_dim * 4);
    _tile_stored(3, o + 48, head_dim * 4);
  }
}
#endif

}  // namespace

bool extend_attention_available() { return lmprog::amx_available(); }

torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                               torch::Tensor req_to_token, torch::Tensor req_rows,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens,
                               torch::Tensor q_starts, double scale, int64_t sliding_window) {
  TORCH_CHECK(extend_attention_available(), "extend_attention: AMX is not available here");
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
#if LMPROG_AMX
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
                    starts[r] >= 0 && starts[r] + extend[r] <= q.size(0),
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
    lmprog::configure_tiles();
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
                        sliding_window, fscale, s);
      } else {
        attend_block<4>(kpacked.data() + base, vpacked.data() + base, count, prefix[r] + row0,
                        sliding_window, fscale, s);
      }
      for (int64_t i = 0; i < count; ++i) {
        bf16* dst = op + (starts[r] + row0 + i) * heads * head_dim + it.head * head_dim;
        const float inv = s.inv_sum[i];
        for (int64_t d = 0; d < head_dim; ++d)
          dst[d] = lmprog::from_f32<bf16>(s.out[i * head_dim + d] * inv);
      }
    }
    _tile_release();
  }
#endif
  return out;
}
