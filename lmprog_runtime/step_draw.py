"""A step's tokens drawn from its logits, one per request, as one batch: a request whose
row cannot be drawn (its grammar cannot say what may come next, its sampling raises, its
row has no mass left) fails alone and the others keep their tokens; and the logprobs asked
for, recorded beside them.

`StepDraw` holds these methods of `Engine`'s loop side (a mixin: `Engine` sets every
attribute used here). The synchronous loop draws through them; the overlapped loop
(`overlap.py`) queues its draw on the worker and takes the rows and the drawn tokens
through them (`_rows_to_draw`, `_drawn`); decode runs draw on their own (`decode_run.py`)
and record logprobs through `_record_token_logprob`. Only the loop thread runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lmprog_runtime.forward_batch import RowsOf
from lmprog_runtime.logprobs import (
    TokenLogprob,
    record_next_token_alternatives,
    record_prompt_logprobs,
    token_logprobs,
)
from lmprog_runtime.request import Req
from lmprog_runtime.sampling import NO_MASS, SampleRow, sample_each, sample_rows, take_rows

logger = logging.getLogger("lmprog_runtime.engine")


class StepDraw:
    """The drawing half of `EngineLoop`."""

    def _sample(self, reqs: list[Req], logits: torch.Tensor, row_of: RowsOf) -> list[Req]:
        """Draw each request's next token and append it, unchecked; a request whose
        sampling raises fails alone. Returns the requests that got a token."""
        appended = []
        for req, token, logprob in self._draw(reqs, logits, row_of):
            req.output_ids.append(token)
            if logprob is None or self._record_token_logprob(req, token, logprob):
                appended.append(req)
        return appended

    def _record_token_logprob(self, req: Req, token: int, logprob: TokenLogprob) -> bool:
        """Record `req`'s logprob of `token` (and its top ones); False where that raised
        (its tokens' texts, `return_text_in_logprobs`): it failed, alone (it once failed the
        whole step, and with overlap every live request)."""
        try:
            entry = req.logprob_entry(logprob[0], token)
            top = req.logprob_entries(logprob[1]) if req.top_logprobs_num else None
        except Exception as error:  # noqa: BLE001 - this request fails, the rest go on
            logger.exception("the logprobs of request %d failed", req.rid)
            self._finish(req, error)
            return False
        req.output_token_logprobs.append(entry)
        if top is not None:
            req.output_top_logprobs.append(top)
        return True

    def _draw(
        self, reqs: list[Req], logits: torch.Tensor, row_of: RowsOf
    ) -> list[tuple[Req, int, TokenLogprob | None]]:
        """(request, token, logprob) for each request, sampled as one batch; a request whose
        row raises fails alone (`sample_each`)."""
        reqs, rows = self._rows_to_draw(reqs, logits.shape[-1])
        if not reqs:
            return []
        index = row_of.last_rows(reqs)
        token_ids = self.runner.greedy_tokens(logits, index, rows)
        errors: dict[int, Exception] = {}
        if token_ids is None:  # (else drawn in the decode graph)
            logits = take_rows(logits, index)
            token_ids, errors = sample_each(logits, rows)
        logprobs = token_logprobs(logits, token_ids, reqs)
        return self._drawn(reqs, token_ids.tolist(), errors, logprobs)

    def _rows_to_draw(self, reqs: list[Req], vocab: int) -> tuple[list[Req], list[SampleRow]]:
        """What sampling reads of each request (`sample_rows`), and the requests it was
        taken for: one whose grammar cannot say what may come next fails alone, as does one
        the fault hook's "sample" point fails (a test hook)."""
        if self.fault_hook is not None:
            reqs = self._each(reqs, lambda req: self.fault_hook("sample", req))
        try:
            return reqs, sample_rows(reqs, vocab, self.penalty_counts)
        except Exception:  # noqa: BLE001 - find the culprit below
            logger.exception("preparing the draw failed; preparing each request alone")
        rows: dict[int, SampleRow] = {}
        counts = self.penalty_counts
        reqs = self._each(
            reqs, lambda req: rows.update({id(req): sample_rows([req], vocab, counts)[0]})
        )
        return reqs, [rows[id(req)] for req in reqs]

    def _each(self, reqs: list[Req], action: Callable[[Req], Any]) -> list[Req]:
        """Run `action` on each request; one it raises for fails. Returns the others."""
        kept = []
        for req in reqs:
            try:
                action(req)
            except Exception as error:  # noqa: BLE001 - this request fails, the rest go on
                self._finish(req, error)
                continue
            kept.append(req)
        return kept

    def _drawn(
        self,
        reqs: list[Req],
        ids: list[int],
        errors: dict[int, Exception],
        logprobs: list[TokenLogprob | None],
    ) -> list[tuple[Req, int, TokenLogprob | None]]:
        """Fail the requests whose row failed or had no mass (token -1); (request, token,
        logprob) for the others (row i of each list is reqs[i]'s)."""
        if ids and min(ids) < 0:
            for i, token in enumerate(ids):
                if token < 0 and i not in errors:
                    errors[i] = ValueError(f"request {reqs[i].rid}: {NO_MASS}")
        if not errors:
            return list(zip(reqs, ids, logprobs))
        for i, error in errors.items():
            self._finish(reqs[i], error)
        return [row for i, row in enumerate(zip(reqs, ids, logprobs)) if i not in errors]

    def _record_prompt_logprobs(
        self, reqs: list[Req], logits: torch.Tensor, row_of: RowsOf
    ) -> None:
        for req in reqs:
            try:
                record_prompt_logprobs([req], logits, row_of)
                record_next_token_alternatives([req], logits, row_of)
            except Exception as error:  # noqa: BLE001 - this request fails, the rest go on
                logger.exception("prompt logprobs of request %d failed", req.rid)
                self._finish(req, error)
