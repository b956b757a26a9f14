// The packed key / value layout of the native extend attention and the two products over
// it: on AMX tiles (tdpbf16ps) and by AVX512-BF16 dot products (vdpbf16ps).
//
// Keys and values are rearranged once per (request, kv head) into the tile layout AMX
// expects for its second operand: pairs of bfloat16 along the reduced dimension (see
// `pack_keys` / `pack_values`). A tile row is also one AVX-512 register, 16 keys (or 16
// dims) in its lanes, which vdpbf16ps multiplies by a query's (or a probability row's) pair
// broadcast to every lane. Products of bfloat16 values are exact in float32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "cpu_vec.h"

// The kernel needs AVX-512 with its bfloat16 instructions (LMPROG_BF16_DOT); the AMX tile
// path comes on top where the build has it.
#if LMPROG_BF16_DOT
#include <immintrin.h>

namespace lmprog::extend {

using lmprog::as_bh;
using lmprog::bf16;
using lmprog::broadcast_pair;
using lmprog::transpose16;

constexpr int64_t kKeys = 32;      // keys per step (two 16-column score tiles)
constexpr int64_t kTileWords = 512;   // bfloat16 values per tile

// Keys [keys, head_dim] (pool rows through `slots`) as second operands of q . k^T: per block
// of 32 keys, per half (16 keys), per 32 dims c, a tile whose row r holds, for each of the
// 16 keys, the pair of dims (32c + 2r, 32c + 2r + 1): the transpose of the 16 keys' words
// of that chunk. Keys past `keys` are zero.
inline void pack_keys(const bf16* buf, int64_t slot_stride, const int64_t* slots, int64_t keys,
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
inline void pack_values(const bf16* buf, int64_t slot_stride, const int64_t* slots, int64_t keys,
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

#if LMPROG_AMX
// q . k^T for the blocks [first_block, blocks) of 32 keys on AMX tiles: the query's CHUNKS
// tiles of 32 dims resident in tiles 2.., two 16 x 16 score tiles per block.
template <int CHUNKS>
void scores_amx(const uint16_t* kpacked, int64_t first_block, int64_t blocks, const uint16_t* q,
                float* scores, int64_t stride) {
  constexpr int64_t head_dim = CHUNKS * 32;
  for (int c = 0; c < CHUNKS; ++c) {
    switch (c) {
      case 0: _tile_loadd(2, q, head_dim * 2); break;
      case 1: _tile_loadd(3, q + 32, head_dim * 2); break;
      case 2: _tile_loadd(4, q + 64, head_dim * 2); break;
      default: _tile_loadd(5, q + 96, head_dim * 2); break;
    }
  }
  for (int64_t b = first_block; b < blocks; ++b) {
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
}

// out = p . v on AMX tiles, four 16-dim tiles at a time, accumulated over the blocks.
template <int CHUNKS>
void values_amx(const uint16_t* vpacked, int64_t first_block, int64_t blocks, const uint16_t* probs,
                float* out, int64_t stride) {
  constexpr int64_t head_dim = CHUNKS * 32, dtiles = head_dim / 16;
  for (int64_t j0 = 0; j0 < dtiles; j0 += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = first_block; b < blocks; ++b) {
      _tile_loadd(4, probs + b * kKeys, stride * 2);
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
    float* o = out + j0 * 16;
    _tile_stored(0, o, head_dim * 4);
    _tile_stored(1, o + 16, head_dim * 4);
    _tile_stored(2, o + 32, head_dim * 4);
    _tile_stored(3, o + 48, head_dim * 4);
  }
}
#endif

// q . k^T for the blocks [first_block, blocks) by AVX512-BF16 dot products, 8 query rows at
// a time: per block, lane i of a row's two accumulators is keys i and 16 + i; row r of a
// packed key tile (pair r of 16 keys) meets pair r of each row's 32-dim chunk, broadcast.
template <int CHUNKS>
void scores_dot(const uint16_t* kpacked, int64_t first_block, int64_t blocks, int64_t rows,
                const uint16_t* queries, float* scores, int64_t stride) {
  constexpr int64_t head_dim = CHUNKS * 32;
  constexpr int kGroup = 8;
  for (int64_t i0 = 0; i0 < rows; i0 += kGroup) {
    const uint16_t* q = queries + i0 * head_dim;
    for (int64_t b = first_block; b < blocks; ++b) {
      const uint16_t* kb = kpacked + b * 2 * CHUNKS * kTileWords;
      __m512 acc[kGroup][2];
      for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
      for (int c = 0; c < CHUNKS; ++c) {
        for (int r = 0; r < 16; ++r) {
          const __m512bh k0 = as_bh(_mm512_loadu_si512(kb + (0 * CHUNKS + c) * kTileWords + r * 32));
          const __m512bh k1 = as_bh(_mm512_loadu_si512(kb + (1 * CHUNKS + c) * kTileWords + r * 32));
#pragma GCC unroll 8
          for (int i = 0; i < kGroup; ++i) {
            const __m512bh qi = broadcast_pair(q + i * head_dim + c * 32 + 2 * r);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qi, k0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qi, k1);
          }
        }
      }
      for (int i = 0; i < kGroup; ++i) {
        float* row = scores + (i0 + i) * stride + b * kKeys;
        _mm512_storeu_ps(row, acc[i][0]);
        _mm512_storeu_ps(row + 16, acc[i][1]);
      }
    }
  }
}

// out = p . v by AVX512-BF16 dot products, 4 query rows x 64 dims at a time: lane j of
// accumulator (row i, group g) is dim 16g + j; row r of a packed value tile (keys 2r and
// 2r + 1 of 16 dims) meets the row's probabilities of those two keys, broadcast.
template <int CHUNKS>
void values_dot(const uint16_t* vpacked, int64_t first_block, int64_t blocks, int64_t rows,
                const uint16_t* probs, float* out, int64_t stride) {
  constexpr int64_t head_dim = CHUNKS * 32, dtiles = head_dim / 16;
  constexpr int kGroup = 4, kDims = 4;  // rows and 16-dim tiles per step
  for (int64_t i0 = 0; i0 < rows; i0 += kGroup) {
    for (int64_t j0 = 0; j0 < dtiles; j0 += kDims) {
      __m512 acc[kGroup][kDims];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      for (int64_t b = first_block; b < blocks; ++b) {
        const uint16_t* vb = vpacked + (b * dtiles + j0) * kTileWords;
        const uint16_t* p = probs + i0 * stride + b * kKeys;
        for (int r = 0; r < 16; ++r) {
          __m512bh v[kDims];
          for (int g = 0; g < kDims; ++g) v[g] = as_bh(_mm512_loadu_si512(vb + g * kTileWords + r * 32));
#pragma GCC unroll 4
          for (int i = 0; i < kGroup; ++i) {
            const __m512bh pi = broadcast_pair(p + i * stride + 2 * r);
            for (int g = 0; g < kDims; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], pi, v[g]);
          }
        }
      }
      for (int i = 0; i < kGroup; ++i)
        for (int g = 0; g < kDims; ++g)
          _mm512_storeu_ps(out + (i0 + i) * head_dim + (j0 + g) * 16, acc[i][g]);
    }
  }
}

}  // namespace lmprog::extend
#endif
