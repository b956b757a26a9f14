"""Frequency and presence penalties: each penalised request's token counts, kept on the
device and counted by the draws themselves.

A penalised request holds a row of `PenaltyCounts`' tables (on the logits' device): how
many times its output has each token, and the penalty each token gets, `frequency *
count + presence * (count > 0)` ([rows, vocab] float32 each). A draw subtracts the rows
of its penalised requests from their logits and, once its tokens are final, counts each
drawn token in its row (`count_drawn`: one count and one penalty per row updated), on
the device, in the order the draws are queued. So the host sends a draw nothing that
grows with the outputs, a decode run's steps count the tokens the steps before drew
without the host ever seeing them, and a draw launched from placeholders counts the
token being drawn before it.

The two sides are kept apart. The host side (the engine's loop thread) hands out rows and
knows, per request, how many of its tokens the draws it queued will have counted
(`Req.penalty_counted`); the device side (the draws, on the forward worker or the loop's
stream, one after another) alone touches the tables, growing them when a row past
their end is used. When the two disagree (a request's first draw, a jump-forward that
rewrote its output, a draw or a run that was queued in part and dropped), the row is
counted again from the request's output on the host (`PenaltyRow.reset`), which the
draw applies first; that is only possible when none of the request's tokens is still
being drawn, and anything else raises (a draw then fails the request, a decode run is
not launched), never a wrong count.

The counts are whole numbers in float32 (exact to 2^24), and each penalty is computed
from its count alone, the same way wherever it is: deterministic, and the same on every
device and in any batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from lmprog_runtime.transfer import index_tensor, to_device

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


class PenaltyRow(NamedTuple):
    """A penalised request's row in `counts`, and the tokens to count in it from scratch
    before the draw (None: the row already counts every token the request has)."""

    counts: PenaltyCounts
    row: int
    reset: list[int] | None


class PenaltyCounts:
    """The table of penalised requests' token counts (see the module docstring).

    Example:
        >>> counts = PenaltyCounts()
        >>> counts.num_used
        0
    """

    def __init__(self) -> None:
        # Host side (loop thread): rows handed out and returned.
        self._free: list[int] = []
        self._num_rows = 0
        # Device side (draws, in queue order), on the logits' device, grown on demand
        # (allocated by the first penalised draw), a row per request: how many times it
        # has each token, the penalty that makes ([rows, vocab] float32 each) and its
        # weights (frequency, presence: [rows, 2]).
        self._counts: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None

    # ---- host side ---------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        """Rows held by requests (0 when the engine is idle)."""
        return self._num_rows - len(self._free)

    def row_of(self, req: Req, offset: int = 0, draws: int = 1) -> PenaltyRow:
        """`req`'s row for `draws` draws queued now, when it has `offset` tokens more than
        `output_ids` holds (a run launched before the one before it is committed). Raises
        `RuntimeError` if its row must be counted again while a token of it is still
        being drawn (which the loops never do)."""
        if req.penalty_row is None:
            req.penalty_row = self._free.pop() if self._free else self._take_new()
        held = len(req.output_ids) + offset
        reset = None
        if req.penalty_counted != held:
            if offset or any(token < 0 for token in req.output_ids[-1:]):
                raise RuntimeError(
                    f"request {req.rid}: its penalty counts are out of step while a token "
                    "of it is still being drawn"
                )
            reset = list(req.output_ids)
        req.penalty_counted = held + draws
        return PenaltyRow(self, req.penalty_row, reset)

    def release(self, req: Req) -> None:
        """`req` leaves the engine: its row is free (the next request to hold it counts it
        from scratch)."""
        if req.penalty_row is not None:
            self._free.append(req.penalty_row)
            req.penalty_row = req.penalty_counted = None

    def _take_new(self) -> int:
        self._num_rows += 1
        return self._num_rows - 1

    # ---- device side -------------------------------------------------------------------
    def apply(
        self,
        logits: torch.Tensor,
        rows: list[PenaltyRow],
        weights: list[tuple[float, float]],
        where: list[int],
    ) -> None:
        """The penalties of `rows`, each (frequency, presence) `weights`, on
        `logits[where]`, in place: `logit - (frequency * count + presence * (count > 0))`,
        in float32, rounded once to the logits' dtype. The rows to count again are counted
        first. Nothing is read back from the device."""
        self._grow(max(row.row for row in rows), logits)
        counted = [i for i, row in enumerate(rows) if row.reset is not None]
        if counted:
            self._count_again([rows[i] for i in counted], [weights[i] for i in counted])
        bias = self._bias
        if _row_by_row(logits):
            for row, i in zip(rows, where):
                logits[i].sub_(bias[row.row])
            return
        sent = index_tensor([*(row.row for row in rows), *where], logits.device)
        at, index = sent[: len(rows)], sent[len(rows) :]
        values = logits.index_select(0, index).float() - bias.index_select(0, at)
        logits.index_copy_(0, index, values.to(logits.dtype))

    def count_drawn(self, rows: list[PenaltyRow], token_ids: torch.Tensor) -> None:
        """Count each row's drawn token (`token_ids` [len(rows)], -1 where none was drawn)
        for its request (after `apply` on a draw with these rows)."""
        counts, bias = self._counts, self._bias
        assert counts is not None and bias is not None, "count_drawn before apply"
        at = index_tensor([row.row for row in rows], token_ids.device)
        tokens = token_ids.clamp(min=0)
        held = counts[at, tokens] + (token_ids >= 0).to(counts.dtype)  # [n]
        counts[at, tokens] = held
        frequency, presence = self._weights.index_select(0, at).T
        bias[at, tokens] = frequency * held + presence * (held > 0)

    def _count_again(self, rows: list[PenaltyRow], weights: list[tuple[float, float]]) -> None:
        """`rows` counted from scratch, from their `reset` tokens (those outside the
        vocabulary count for nothing), with their `weights`."""
        counts, device = self._counts, self._counts.device
        ids = [_in_vocab(row.reset, counts.shape[-1]) for row in rows]
        lengths = [len(tokens) for tokens in ids]
        n, flat = len(rows), [token for tokens in ids for token in tokens]
        sent = index_tensor([*(row.row for row in rows), *lengths, *flat], device)
        at, lengths_t, tokens = sent[:n], sent[n : 2 * n], sent[2 * n :]
        counts.index_fill_(0, at, 0.0)
        at_rows = at.repeat_interleave(lengths_t, output_size=len(flat))
        ones = torch.ones(len(flat), dtype=counts.dtype, device=device)
        counts.index_put_((at_rows, tokens), ones, accumulate=True)
        host = torch.tensor(weights, dtype=torch.float32, device="cpu")
        mine = to_device(host, device)  # [n, 2]
        self._weights.index_copy_(0, at, mine)
        held = counts.index_select(0, at)  # [n, vocab]
        self._bias.index_copy_(0, at, mine[:, :1] * held + mine[:, 1:] * (held > 0))

    def _grow(self, last_row: int, logits: torch.Tensor) -> None:
        """The tables, with `last_row` in them (grown, their rows kept, if not), on the
        logits' device."""
        counts, vocab = self._counts, logits.shape[-1]
        if counts is not None and (counts.shape[1] != vocab or counts.device != logits.device):
            raise RuntimeError("penalties drawn with logits of another shape or device")
        if counts is not None and last_row < counts.shape[0]:
            return
        size = max(last_row + 1, 8, 0 if counts is None else 2 * counts.shape[0])
        grown = []
        for table, width in ((counts, vocab), (self._bias, vocab), (self._weights, 2)):
            new = torch.zeros(size, width, dtype=torch.float32, device=logits.device)
            if table is not None:
                new[: table.shape[0]] = table
                if table.device.type == "cuda":  # (freed now, copied on this stream)
                    table.record_stream(torch.cuda.current_stream(table.device))
            grown.append(new)
        self._counts, self._bias, self._weights = grown


def _row_by_row(logits: torch.Tensor) -> bool:
    """Whether penalties are subtracted in place row by row (float32 logits on a CPU, where
    each pass over [rows, vocab] is one over memory: for 64 rows of 49,152, 2-7x less time
    than gathering the rows), rather than in a few launches for the batch."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def _in_vocab(ids: list[int], vocab: int) -> list[int]:
    """`ids` less those outside [0, vocab) (a C-speed check first: they are rare)."""
    if ids and (max(ids) >= vocab or min(ids) < 0):
        return [t for t in ids if 0 <= t < vocab]
    return ids
