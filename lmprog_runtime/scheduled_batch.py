"""What the scheduler hands the loop each step (`ScheduledBatch`: the requests of one
forward, their slots, and how much of each it computes) and what admission takes as one
(`RequestGroup`: a fork's branches, behind their common prefix). Plain host data: no
tensor of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import ForwardMode

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    out_cache_loc: torch.Tensor  # [num_new_tokens] KV slots of the tokens computed now
    prefix_lens: list[int]  # per request: tokens already in the pool before this forward
    extend_lens: list[int]  # per request: tokens computed by this forward
    kv_committed: bool = False  # set once the forward's K/V are accounted to the requests
    num_decodes: int = 0  # an extend's last requests: running ones decoding one token

    def is_decode(self, i: int) -> bool:
        """Request i decodes one token (in a decode batch, or at the end of a mixed one)."""
        return self.mode is ForwardMode.DECODE or i >= len(self.reqs) - self.num_decodes

    def slots_per_req(self) -> list[torch.Tensor]:
        """Each request's slots in `out_cache_loc` (views)."""
        slots, start = [], 0
        for n in self.extend_lens:
            slots.append(self.out_cache_loc[start : start + n])
            start += n
        return slots

    def alone(self, i: int) -> ScheduledBatch:
        """Request i as a batch of its own, on the same slots (to find out which request a
        failing forward belongs to)."""
        mode = ForwardMode.DECODE if self.is_decode(i) else ForwardMode.EXTEND
        slots, n = self.slots_per_req()[i], self.extend_lens[i]
        return ScheduledBatch(mode, [self.reqs[i]], slots, [self.prefix_lens[i]], [n])

    def narrow(self, keep: list[int]) -> None:
        """Keep only the requests at indices `keep` (ascending), with their slots."""
        per_req = self.slots_per_req()
        pieces = [per_req[i] for i in keep]
        self.out_cache_loc = torch.cat(pieces) if pieces else self.out_cache_loc[:0]
        if self.mode is ForwardMode.EXTEND:
            self.num_decodes = sum(1 for i in keep if self.is_decode(i))
        self.reqs = [self.reqs[i] for i in keep]
        self.prefix_lens = [self.prefix_lens[i] for i in keep]
        self.extend_lens = [self.extend_lens[i] for i in keep]


class RequestGroup:
    """Requests admitted together (the branches of a fork), after `prefix_req` is done."""

    def __init__(self, members: list[Req], prefix_req: Req | None) -> None:
        self.members = members
        self.prefix_req = prefix_req

    @property
    def is_ready(self) -> bool:
        return self.prefix_req is None or self.prefix_req.done.is_set()
