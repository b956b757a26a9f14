"""Logprobs the caller asked for, read from a forward's logits rows: each drawn token's
(and its top-k alternatives'), and each prompt token's once its prefill is done. Raw
distributions (log-softmax of the unprocessed logits), as SGLang and vLLM report them.

A draw's logprobs are gathered on the device in one table (`LogprobAsk.gather`) and read
back in one copy: with overlap scheduling the table is made on the forward worker behind
the draw and copied to the host with its tokens, so the loop never reads the logits (on
a GPU a read there would wait for all the loop queued since, a decode run's steps too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from lmprog_runtime.transfer import index_tensor, to_host_async

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lmprog_runtime.request import Req

# A drawn token's logprob and its top alternatives' (logprob, token), best first.
TokenLogprob = tuple[float, list[tuple[float, int]]]


class LogprobAsk(NamedTuple):
    """Which rows of a draw want their token's logprob (`rows`, ascending), and how many
    alternatives each wants (`tops`). Read from the requests on the loop thread."""

    num_rows: int
    rows: list[int]
    tops: list[int]

    @classmethod
    def of(cls, reqs: list[Req]) -> LogprobAsk:
        """What `reqs` (row i is reqs[i]'s) ask for."""
        rows = [i for i, req in enumerate(reqs) if req.return_logprob]
        return cls(len(reqs), rows, [max(0, reqs[i].top_logprobs_num) for i in rows])

    def gather(self, logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The table of the rows that ask, on the logits' device (no host wait): row j is
        [logprob of the drawn token, the top k logprobs, their tokens], float64 (exact for
        both), k the most any row wants. `token_ids` [num_rows]: the drawn tokens (a
        failed row's, negative, read as token 0: its request fails anyway). None if no
        row asks."""
        if not self.rows:
            return None
        index = index_tensor(self.rows, logits.device)
        scored = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        picked = token_ids.index_select(0, index).clamp(min=0)
        return _table(scored, picked, max(self.tops))

    def gather_to_host(
        self, logits: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event | None]:
        """A draw's tokens and `gather`'s table, both on their way to the host without
        waiting (`transfer.to_host_async`): (tokens, table or None, the event that passes
        once both are there; None off CUDA)."""
        table = self.gather(logits, token_ids)
        token_ids, ready = to_host_async(token_ids)  # (on CUDA: into pinned memory)
        if table is not None:  # (its copy queued after the tokens': its event covers both)
            table, ready = to_host_async(table)
        return token_ids, table, ready

    def unpack(self, table: torch.Tensor | None) -> list[TokenLogprob | None]:
        """Each row's (logprob, top list) from `gather`'s table on the host; None for a row
        that did not ask."""
        out: list[TokenLogprob | None] = [None] * self.num_rows
        if table is None:
            return out
        for i, top, row in zip(self.rows, self.tops, table.tolist()):
            out[i] = _unpack_row(row, top)
        return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, reqs: list[Req]
) -> list[TokenLogprob | None]:
    """Logprob of `token_ids[i]` under row i of `logits`, plus its top-k list, for the rows
    that ask (read back at once)."""
    ask = LogprobAsk.of(reqs)
    table = ask.gather(logits, token_ids)
    return ask.unpack(None if table is None else table.cpu())


def record_prompt_logprobs(
    reqs: list[Req], logits: torch.Tensor, row_of: Mapping[int, list[int]]
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
            req.input_token_logprobs.append(req.logprob_entry(None, req.input_ids[0]))
            req.input_top_logprobs.append(None)
        if not targets:
            continue
        index = index_tensor(req_rows[:-1], logits.device)
        scored = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        picked = index_tensor(targets, logits.device)
        top = max(0, req.top_logprobs_num)
        for token, row in zip(targets, _table(scored, picked, top).tolist()):
            logprob, alternatives = _unpack_row(row, top)
            req.input_token_logprobs.append(req.logprob_entry(logprob, token))
            if top:
                req.input_top_logprobs.append(req.logprob_entries(alternatives))


def record_next_token_alternatives(
    reqs: list[Req], logits: torch.Tensor, row_of: Mapping[int, list[int]]
) -> None:
    """A prefill-only request (`max_new_tokens=0`) that asks for top logprobs gets the next
    token's `top_logprobs_num` most likely alternatives as `output_top_logprobs[0]`, no
    token drawn (SGLang returns them there, and its CoT-decoding example branches on them);
    `output_token_logprobs` stays empty."""
    for req in reqs:
        if req.max_new_tokens != 0 or not req.top_logprobs_num or req.output_top_logprobs:
            continue
        scored = torch.log_softmax(logits[row_of[id(req)][-1]].float(), dim=-1)
        values, tokens = scored.topk(min(req.top_logprobs_num, scored.shape[-1]))
        alternatives = list(zip(values.double().tolist(), tokens.tolist()))
        req.output_top_logprobs.append(req.logprob_entries(alternatives))


def _table(scored: torch.Tensor, picked: torch.Tensor, top: int) -> torch.Tensor:
    """[m, 1 + 2k] float64 (exact for logprobs and token ids): row j is the logprob of
    `picked[j]` under `scored[j]` (log-softmaxed rows [m, vocab]), then the top k
    logprobs, then their tokens (k = `top`, at most the vocabulary)."""
    chosen = scored.gather(1, picked[:, None]).double()  # [m, 1]
    top = min(top, scored.shape[-1])
    if not top:
        return chosen
    values, indices = scored.topk(top, dim=-1)
    return torch.cat([chosen, values.double(), indices.double()], dim=1)


def _unpack_row(row: list[float], top: int) -> TokenLogprob:
    """(logprob, its first `top` alternatives) of a `_table` row."""
    width = (len(row) - 1) // 2
    pairs = zip(row[1 : 1 + top], row[1 + width : 1 + width + top])
    return row[0], [(value, int(token)) for value, token in pairs]
