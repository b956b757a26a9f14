"""How a decode run is planned and kept (`decode_run.py` runs it): which requests may run
ahead, how many steps a run takes, what each step's draw reads and each step's batch,
and a run's slots while it is committed (`RunSlots`). Bookkeeping on the host only: no
tensor of the model is touched here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.keyed_race import race_key
from lmprog_runtime.sampling import SampleRow
from lmprog_runtime.scheduled_batch import ScheduledBatch

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


def runs_ahead(req: Req) -> bool:
    """Whether `req`'s next draws depend on nothing its earlier tokens tell the host."""
    return req.matcher is None and req.char_fsm is None


class RunSlots:
    """A decode run's slots while it is committed: each step's ([n] each), how many steps
    each request has kept the K/V of, and `free` (`Scheduler.free_started_pages`)."""

    def __init__(
        self,
        batch: ScheduledBatch,
        ahead: list[torch.Tensor],
        free: Callable[[torch.Tensor], None],
    ) -> None:
        self.slots = [batch.out_cache_loc, *ahead]
        self.index = {id(req): i for i, req in enumerate(batch.reqs)}
        self.used = [0] * len(batch.reqs)
        self._free = free
        self._left = [False] * len(batch.reqs)

    def leave(self, req: Req) -> None:
        """`req` finished: free the pages its steps past the last one it kept started."""
        i = self.index.get(id(req))
        if i is not None:
            self._leave(i)

    def free_unused(self) -> None:
        """After the run: the same for every request still in it (one that goes on has
        kept every step; one the loop fails after a commit that raised has not)."""
        for i in range(len(self.used)):
            self._leave(i)

    def _leave(self, i: int) -> None:
        if not self._left[i]:
            self._left[i] = True
            for later in self.slots[self.used[i] :]:
                self._free(later[i : i + 1])


def generators_of(reqs: list[Req]) -> list[torch.Generator]:
    return [req.generator for req in reqs if not req.params.is_greedy]


def step_ahead(batch: ScheduledBatch, slots: torch.Tensor, k: int) -> ScheduledBatch:
    """Step k of a run that starts with `batch` (a batch of its own): its requests, one
    position further each step, on `slots`."""
    prefix_lens = [p + k for p in batch.prefix_lens]
    return ScheduledBatch(ForwardMode.DECODE, batch.reqs, slots, prefix_lens, batch.extend_lens)


def rows_ahead(rows: list[SampleRow], reqs: list[Req], k: int) -> list[SampleRow]:
    """The sample rows of a draw k tokens past what `reqs` hold: a keyed draw counts
    them, EOS and stop tokens are banned while they leave `min_new_tokens` unreached, and
    penalty counts are not counted again (the first draw did; nothing else of a row that
    runs ahead changes)."""
    if k == 0 or getattr(rows, "plain", False):  # (plain rows: nothing of them changes)
        return rows
    ahead = []
    for row, req in zip(rows, reqs):
        held = len(req.output_ids) + k
        if not row.params.is_greedy:
            row = row._replace(key=race_key(req.seed, held))
        if row.banned and held >= req.min_new_tokens:
            row = row._replace(banned=[])
        if row.penalty is not None and row.penalty.reset is not None:
            row = row._replace(penalty=row.penalty._replace(reset=None))
        ahead.append(row)
    return ahead


def run_length(
    steps: int, reqs: list[Req], positions: list[int], offset: int, context_len: int
) -> int:
    """A run's steps: at most `steps`, no more than its requests' longest remaining output
    needs (they hold `offset` tokens more than `output_ids` says) and their shortest
    remaining context allows (`positions`: each one's first step's)."""
    remaining = max(tokens_left(reqs, offset))
    return max(1, min(steps, remaining, context_len - max(positions)))


def tokens_left(reqs: list[Req], offset: int = 0) -> list[int]:
    """The tokens each of `reqs` may still draw, when it holds `offset` more than
    `output_ids` says."""
    return [req.max_new_tokens - len(req.output_ids) - offset for req in reqs]
