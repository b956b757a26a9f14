"""Logprobs the caller asked for, read from a forward's logits rows: each drawn token's
(and its top-k alternatives'), and each prompt token's once its prefill is done. Raw
distributions (log-softmax of the unprocessed logits), as SGLang and vLLM report them;
the values are read back to the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


def token_logprobs(
    logits: torch.Tensor, ids: list[int], reqs: list[Req]
) -> list[tuple[float, list[tuple[float, int]]] | None]:
    """Logprob of `ids[i]` under row i of `logits`, plus its top-k list, for rows that ask."""
    out: list[tuple[float, list[tuple[float, int]]] | None] = [None] * len(reqs)
    rows = [i for i, r in enumerate(reqs) if r.return_logprob]
    if not rows:
        return out
    device = logits.device
    logprobs = torch.log_softmax(logits[rows], dim=-1)
    picked = torch.tensor([ids[i] for i in rows], dtype=torch.int64, device=device)
    chosen = logprobs[torch.arange(len(rows), device=device), picked].tolist()
    for j, i in enumerate(rows):
        out[i] = (chosen[j], top_logprobs(logprobs[j], reqs[i].top_logprobs_num))
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, indices = logprobs.topk(min(k, logprobs.numel()))
    return list(zip(values.tolist(), indices.tolist()))


def record_prompt_logprobs(
    reqs: list[Req], logits: torch.Tensor, row_of: dict[int, list[int]]
) -> None:
    """Prompt-token logprobs of requests whose prefill just finished (from their rows)."""
    for req in reqs:
        if req.logprob_start_len < 0 or req.input_logprobs_done:
            continue
        req.input_logprobs_done = True
        req_rows = row_of[id(req)]
        first = req.prompt_len - len(req_rows)  # position of the first logits row
        targets = req.input_ids[first + 1 :]
        if req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.input_ids[0]))
            req.input_top_logprobs.append(None)
        if not targets:
            continue
        device = logits.device
        rows_t = torch.tensor(req_rows[:-1], dtype=torch.int64, device=device)
        scored = torch.log_softmax(logits.index_select(0, rows_t), dim=-1)
        targets_t = torch.tensor(targets, dtype=torch.int64, device=device)
        chosen = scored.gather(1, targets_t[:, None]).squeeze(1).tolist()
        for j, token in enumerate(targets):
            req.input_token_logprobs.append((chosen[j], token))
            if req.top_logprobs_num:
                req.input_top_logprobs.append(top_logprobs(scored[j], req.top_logprobs_num))
