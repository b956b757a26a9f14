"""Top-k and top-p cuts of a batch of probability rows, as sampling runs them
(`sampling._filtered_probs` applies temperature before and min-p after).

On a CPU a sort: only the leading `FILTER_WINDOW` tokens of each row (or top_k, if more),
and the whole row only where the top-p cut lies beyond them (found by a read-back, free on
a CPU). On an accelerator no sort and nothing read back: top-k keeps the tokens at least
as likely as the k-th, top-p those above the nucleus floor (`keyed_race.nucleus_floors`).
"""

from __future__ import annotations

import torch

from lmprog_runtime.keyed_race import nucleus_floors

# Tokens of each row the CPU's top-k / top-p sorts first.
FILTER_WINDOW = 256


def top_k_top_p(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_top_k: int | None = None,
    full: bool = False,
) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens, then the smallest prefix of those whose
    share of their mass reaches `top_p` (the first is always kept). probs: [n, vocab].

    Only the leading FILTER_WINDOW tokens (or top_k, if larger) are sorted; a row whose
    top-p cut lies beyond them (a very flat distribution) is then sorted in full (found by
    reading back which rows: free on a CPU). With `full`, every row is sorted in full and
    nothing is read back (what `gpu_check.py` times the accelerators' way against:
    `top_k_top_p_unsorted`). `max_top_k`, the largest top_k below the vocabulary (0 if
    none), saves reading it from `top_k`."""
    vocab = probs.shape[-1]
    if max_top_k is None:
        limited = top_k[top_k < vocab]
        max_top_k = int(limited.max()) if len(limited) else 0
    width = vocab if full else min(vocab, max(FILTER_WINDOW, max_top_k))
    values, index = probs.topk(width, dim=-1)  # [n, width], descending
    total = probs.sum(dim=-1)
    kept, is_cut = _cut_sorted(values, top_k, top_p, total, vocab)
    out = torch.zeros_like(probs).scatter_(1, index, kept)
    flat = (~is_cut & (top_p < 1.0)).nonzero().flatten() if width < vocab else []
    if len(flat):
        values, index = probs[flat].sort(dim=-1, descending=True)
        kept, _ = _cut_sorted(values, top_k[flat], top_p[flat], total[flat], vocab)
        out[flat] = torch.zeros_like(values).scatter_(1, index, kept)
    return out


def top_k_top_p_unsorted(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int
) -> torch.Tensor:
    """`top_k_top_p` as an accelerator runs it: no sort and nothing read back. Top-k keeps
    the tokens at least as likely as the k-th (from a top-k of the largest k asked for, as
    transformers' warper does), then top-p keeps those above the nucleus floor
    (`keyed_race.nucleus_floors`). Tokens tied at either cut are all kept; otherwise the
    same tokens as `top_k_top_p`'s."""
    vocab = probs.shape[-1]
    if max_top_k:
        values = probs.topk(max_top_k, dim=-1).values  # [n, max_top_k], descending
        kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
        probs = probs.masked_fill((probs < kth) & (top_k[:, None] < vocab), 0.0)
    floors = nucleus_floors(probs, top_p.to(torch.float32))
    return probs.masked_fill(probs <= floors[:, None], 0.0)  # (compared in float32)


def _cut_sorted(
    values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, on rows sorted in descending order (the leading part of each row
    when `values` is narrower than the vocabulary; `total` is each full row's mass).
    Returns the kept values and, per row, whether top-p cut inside `values`."""
    ranks = torch.arange(values.shape[-1], device=values.device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], 0.0)
    # The mass top-p shares out: the top-k tokens' (inside `values`), or the whole row's.
    kept_mass = torch.where(top_k < vocab, values.sum(dim=-1), total)
    share_before = (values.cumsum(dim=-1) - values) / kept_mass[:, None]
    # (The first token stays, even for a top_p that rounds to 0 in float32.)
    drop = (share_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0)
    return values.masked_fill(drop, 0.0), drop.any(dim=-1)
