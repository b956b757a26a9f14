"""Draws on an accelerator: a whole batch in one kernel, each row from its request's seed.

A draw from unnormalised probabilities p is an exponential race: argmax(p / e) over the
row, with e ~ Exp(1) per token. On the CPU the engine takes each e from the request's own
`torch.Generator`, as `torch.multinomial` would (`sampling.draw`). On a GPU that costs a
launch per row (a generator fills one tensor at a time); here e instead comes from a hash
of the request's key and the token id, computed inside the kernel that races the row:

    key = race_key(seed, draws)              # host: the seed, and how many tokens the
                                             # request has drawn before
    x   = h(h((token * C) mod 2^32 ^ key_lo) ^ key_hi)      # h: a 32-bit integer hash
    u   = ((x >> 8) + 0.5) / 2^24            # uniform in (0, 1), exact in float32
    e   = -log(u)

A row depends on nothing but its own key and probabilities: a seed gives the same tokens
whatever shares its batch and whichever loop (synchronous or overlapped) draws it, and
nothing is drawn on the host or read back. The tokens are not the CPU's (its draws follow
`torch.multinomial`'s generator), as the logits are not the CPU's either.

On CUDA with Triton the race is one kernel (`triton_race.py`); elsewhere it is torch ops
on the same values (`keyed_exponentials`), the reference the kernel is tested against.

Top-p on an accelerator needs no sort either (`nucleus_floors`): a token is in a row's
nucleus when the tokens more likely than it hold less than top_p of the row's mass, so the
nucleus is every token above some floor, and the floor is searched for over the float32
bit patterns of the probabilities (ordered as the values are, for non-negative floats):
four bits per pass over the row, each pass summing the mass above 16 candidate floors at
once, eight passes in all. Tokens tied at the cut are all kept (a sort keeps some of them).
"""

from __future__ import annotations

import functools

import torch

from lmprog_runtime.transfer import host_ints, to_device

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
# Token ids are spread by this odd constant (2^32 / golden ratio, below 2^31 so that every
# product of the hash stays under 2^63 in int64 arithmetic).
TOKEN_STRIDE = 0x61C88647
# A 32-bit hash (shift-xor, multiply, twice): both multipliers below 2^31, as above.
HASH_ROUNDS = ((16, 0x21F0AAAD), (15, 0x735A2D97))
HASH_LAST_SHIFT = 15


def _mix64(z: int) -> int:
    """splitmix64's finaliser (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def race_key(seed: int, draws: int) -> int:
    """The 64-bit key of a request's draw number `draws` (0 for its first token).

    Example:
        >>> race_key(7, 0) == race_key(7, 0) != race_key(7, 1)
        True
    """
    return _mix64((_mix64(seed & MASK64) + draws * 0x9E3779B97F4A7C15) & MASK64)


def key_words(keys: list[int], device: torch.device | str) -> torch.Tensor:
    """Keys as int64 [n, 2] (low and high 32 bits), on `device`."""
    words = [word for key in keys for word in (key & MASK32, key >> 32)]
    return to_device(host_ints(words).view(-1, 2), device)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash, on int64 values below 2^32."""
    for shift, multiplier in HASH_ROUNDS:
        x = ((x ^ (x >> shift)) * multiplier) & MASK32
    return x ^ (x >> HASH_LAST_SHIFT)


def keyed_exponentials(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [n, vocab] (float32) for keys `words` [n, 2] (`key_words`), on their
    device: the race's noise as torch ops (the kernel computes the same values)."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=words.device)
    x = (tokens * TOKEN_STRIDE) & MASK32
    x = _hash32(x[None, :] ^ words[:, :1])
    x = _hash32(x ^ words[:, 1:])
    uniform = ((x >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return uniform.log_().neg_()


def keyed_race(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """argmax(p / e) per row of `probs` [n, vocab] (unnormalised, non-negative), row i's
    noise e keyed by `keys[i]` (`race_key`). Returns int64 [n] on `probs`' device."""
    if len(keys) != probs.shape[0]:
        raise ValueError(f"keys has {len(keys)} entries for {probs.shape[0]} rows of probs")
    words = key_words(keys, probs.device)
    if probs.device.type == "cuda" and _has_triton():
        from lmprog_runtime.triton_race import race

        return race(probs, words)
    return (probs / keyed_exponentials(words, probs.shape[-1])).argmax(dim=-1)


@functools.cache
def _has_triton() -> bool:
    """(Looked up once: `keyed_race` runs every sampling step.)"""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


# The bit positions each pass of the floor search decides (four bits from there up; the
# first pass three, as the sign bit stays 0).
NUCLEUS_SHIFTS = (28, 24, 20, 16, 12, 8, 4, 0)
TINY32 = torch.finfo(torch.float32).tiny  # the smallest normal float32


def nucleus_floors(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The floor of each row's top-p nucleus: the tokens with a probability above it are
    those whose more likely tokens hold less than `top_p` of the row's mass. probs [n,
    vocab] float32 (unnormalised, non-negative), top_p [n] float32, on one device; returns
    float32 [n] there (0 for a row with top_p >= 1, or without mass: every token with mass
    is kept; the most likely tokens always are). Nothing is sorted or read back; on CUDA
    with Triton one kernel, elsewhere torch ops on the same sums.

    Example:
        >>> probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
        >>> (probs > nucleus_floors(probs, torch.tensor([0.6]))[:, None]).tolist()
        [[True, True, False, False]]
    """
    if probs.dim() != 2 or top_p.shape != probs.shape[:1]:
        raise ValueError("probs must be [n, vocab] and top_p [n]")
    if probs.device.type == "cuda" and _has_triton():
        from lmprog_runtime.triton_race import nucleus_floors as triton_floors

        return triton_floors(probs, top_p)
    probs = probs.float()
    # At least the smallest normal float: a top_p that rounds to 0 (or a product that
    # underflows) still keeps the most likely tokens.
    target = (top_p.float() * probs.sum(dim=-1)).clamp(min=TINY32)  # [n]
    m = torch.arange(16, dtype=torch.int32, device=probs.device)
    prefix = torch.zeros(probs.shape[0], dtype=torch.int32, device=probs.device)
    for i, shift in enumerate(NUCLEUS_SHIFTS):
        candidates = (prefix[:, None] | (m[None, :] << shift)).view(torch.float32)  # [n, 16]
        mass = torch.stack(  # [n, 16]; a candidate at a time: [n, vocab] in memory
            [torch.where(probs > c[:, None], probs, 0.0).sum(dim=-1) for c in candidates.T], 1
        )
        short = (mass >= target[:, None]) & (m < (8 if i == 0 else 16))
        prefix |= torch.where(short, m, 0).amax(dim=-1) << shift
    return torch.where(top_p < 1.0, prefix.view(torch.float32), 0.0)
