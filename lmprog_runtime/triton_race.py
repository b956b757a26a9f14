"""The keyed exponential race (`keyed_race.py`) as one Triton kernel: each program reads
its row of probabilities once, block by block, hashes each token's noise in registers and
keeps the running winner (the first index among equal scores, as `argmax`). And top-p's
floor search (`keyed_race.nucleus_floors`): a program per row, nine passes over it (its
mass, then the mass above 16 candidate floors per pass).

Imported only on CUDA with Triton (`keyed_race`); on CPU tensors it runs only under
`TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmprog_runtime.keyed_race import (
    HASH_LAST_SHIFT,
    HASH_ROUNDS,
    MASK32,
    NUCLEUS_SHIFTS,
    TINY32,
    TOKEN_STRIDE,
)

# The hash's constants as Triton compile-time globals (the values of `keyed_race`).
_STRIDE = tl.constexpr(TOKEN_STRIDE)
_SHIFT_A = tl.constexpr(HASH_ROUNDS[0][0])
_MUL_A = tl.constexpr(HASH_ROUNDS[0][1])
_SHIFT_B = tl.constexpr(HASH_ROUNDS[1][0])
_MUL_B = tl.constexpr(HASH_ROUNDS[1][1])
_SHIFT_C = tl.constexpr(HASH_LAST_SHIFT)
_MASK = tl.constexpr(MASK32)
_FIRST_SHIFT = tl.constexpr(NUCLEUS_SHIFTS[0])
_NUM_PASSES = tl.constexpr(len(NUCLEUS_SHIFTS))
_TINY = tl.constexpr(TINY32)


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


@triton.jit
def _nucleus_kernel(probs_ptr, top_p_ptr, out_ptr, vocab, probs_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * probs_stride
    top_p = tl.load(top_p_ptr + row)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        total += tl.load(base + tokens, mask=tokens < vocab, other=0.0).to(tl.float32)
    target = tl.maximum(top_p * tl.sum(total, axis=0), _TINY)  # (`keyed_race`'s clamp)
    m = tl.arange(0, 16)
    prefix = tl.zeros([16], tl.int32)  # (the same in every lane)
    for i in tl.static_range(_NUM_PASSES):
        shift = _FIRST_SHIFT - 4 * i
        candidates = (prefix | (m << shift)).to(tl.float32, bitcast=True)  # [16]
        mass = tl.zeros([16, BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            p = tl.load(base + tokens, mask=tokens < vocab, other=0.0).to(tl.float32)
            mass += tl.where(p[None, :] > candidates[:, None], p[None, :], 0.0)
        limit = 8 if i == 0 else 16
        short = (tl.sum(mass, axis=1) >= target) & (m < limit)
        prefix = prefix | (tl.max(tl.where(short, m, 0), axis=0) << shift)
    floor = tl.max(prefix, axis=0).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row, tl.where(top_p < 1.0, floor, 0.0))


def nucleus_floors(probs: torch.Tensor, top_p: torch.Tensor, block: int = 256) -> torch.Tensor:
    """`keyed_race.nucleus_floors` of `probs` [n, vocab] (float32, last dim contiguous)
    and `top_p` [n] (float32, same device). Returns float32 [n]."""
    if probs.dim() != 2 or probs.stride(-1) != 1:
        raise ValueError("probs must be [n, vocab] with a contiguous last dim")
    if top_p.shape != probs.shape[:1]:
        raise ValueError("top_p must be [n]")
    out = torch.empty(probs.shape[0], dtype=torch.float32, device=probs.device)
    if probs.shape[0] == 0:
        return out
    _nucleus_kernel[(probs.shape[0],)](
        probs, top_p.float().contiguous(), out, probs.shape[1], probs.stride(0), BLOCK=block
    )
    return out
