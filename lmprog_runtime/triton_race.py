"""The keyed exponential race (`keyed_race.py`) as one Triton kernel: each program reads
its row of probabilities once, block by block, hashes each token's noise in registers and
keeps the running winner (the first index among equal scores, as `argmax`).

Imported only on CUDA with Triton (`keyed_race`); on CPU tensors it runs only under
`TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmprog_runtime.keyed_race import HASH_LAST_SHIFT, HASH_ROUNDS, MASK32, TOKEN_STRIDE

# The hash's constants as Triton compile-time globals (the values of `keyed_race`).
_STRIDE = tl.constexpr(TOKEN_STRIDE)
_SHIFT_A = tl.constexpr(HASH_ROUNDS[0][0])
_MUL_A = tl.constexpr(HASH_ROUNDS[0][1])
_SHIFT_B = tl.constexpr(HASH_ROUNDS[1][0])
_MUL_B = tl.constexpr(HASH_ROUNDS[1][1])
_SHIFT_C = tl.constexpr(HASH_LAST_SHIFT)
_MASK = tl.constexpr(MASK32)


@triton.jit
def _hash32(x):
    """`keyed_race._hash32` on int64 values below 2^32."""
    x = ((x ^ (x >> _SHIFT_A)) * _MUL_A) & _MASK
    x = ((x ^ (x >> _SHIFT_B)) * _MUL_B) & _MASK
    return x ^ (x >> _SHIFT_C)


@triton.jit
def _race_kernel(probs_ptr, words_ptr, out_ptr, vocab, probs_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key_lo = tl.load(words_ptr + 2 * row)
    key_hi = tl.load(words_ptr + 2 * row + 1)
    best = -1.0  # every score is >= 0 (p >= 0, e > 0)
    best_index = 0
    for start in range(0, vocab, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        valid = tokens < vocab
        p = tl.load(probs_ptr + row * probs_stride + tokens, mask=valid, other=0.0)
        x = (tokens.to(tl.int64) * _STRIDE) & _MASK
        x = _hash32(_hash32(x ^ key_lo) ^ key_hi)
        uniform = ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
        scores = tl.where(valid, p.to(tl.float32) / -tl.log(uniform), -1.0)
        block_best = tl.max(scores, axis=0)
        block_index = tl.argmax(scores, axis=0)
        better = block_best > best
        best_index = tl.where(better, start + block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def race(probs: torch.Tensor, words: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`keyed_race` of `probs` [n, vocab] (float32, last dim contiguous) with key words
    `words` [n, 2] (`key_words`, same device). Returns int64 [n]."""
    if probs.dim() != 2 or probs.stride(-1) != 1:
        raise ValueError("probs must be [n, vocab] with a contiguous last dim")
    if words.shape != (probs.shape[0], 2) or words.dtype != torch.int64:
        raise ValueError("words must be int64 [n, 2]")
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    if probs.shape[0] == 0:
        return out
    _race_kernel[(probs.shape[0],)](
        probs, words.contiguous(), out, probs.shape[1], probs.stride(0), BLOCK=block
    )
    return out
