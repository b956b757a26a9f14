"""Continuous batching: which requests run in the next forward, and their KV memory.

Each step is either a prefill (extend) of newly admitted requests within a token budget, or
one decode step of every running request. Admission reserves room for a request's whole
output, so a running request never finds the pool empty mid-decode. Finished requests leave
at once and give their memory back. The scheduler never touches the model's tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.request import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    out_cache_loc: torch.Tensor  # [num_new_tokens] KV slots of the tokens computed now
    prefix_lens: list[int]  # per request: tokens already in the pool before this forward


class Scheduler:
    def __init__(
        self,
        config: RuntimeConfig,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def _reserved_tokens(self) -> int:
        """Slots the running requests may still claim for their remaining decode steps."""
        return sum(r.max_new_tokens - len(r.output_ids) for r in self.running)

    def next_batch(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        if self.running:
            return self._schedule_decode()
        return None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting:
            return None
        budget = self.config.max_prefill_tokens
        free = self.allocator.num_free - self._reserved_tokens()
        admitted: list[Req] = []
        num_tokens = 0
        while self.waiting:
            req = self.waiting[0]
            extend_len = req.prompt_len - req.kv_len
            need = extend_len + req.max_new_tokens
            if len(self.running) + len(admitted) >= self.config.max_running_requests:
                break
            if admitted and num_tokens + extend_len > budget:
                break
            if need > free or self.req_to_token.num_free == 0:
                break
            self.waiting.popleft()
            admitted.append(req)
            num_tokens += extend_len
            free -= need
        if not admitted:
            return None
        slots = self.allocator.alloc(num_tokens)
        assert slots is not None, "admission checked the free slots"
        prefix_lens = []
        offset = 0
        for req in admitted:
            if req.req_pool_idx is None:  # a request with a cached prefix keeps its row
                req.req_pool_idx = self.req_to_token.alloc()
            extend_len = req.prompt_len - req.kv_len
            self.req_to_token.write(
                req.req_pool_idx, req.kv_len, slots[offset : offset + extend_len]
            )
            prefix_lens.append(req.kv_len)
            offset += extend_len
        return ScheduledBatch(ForwardMode.EXTEND, admitted, slots, prefix_lens)

    def _schedule_decode(self) -> ScheduledBatch:
        reqs = list(self.running)
        slots = self.allocator.alloc(len(reqs))
        assert slots is not None, "admission reserved a slot for every decode step"
        prefix_lens = []
        for i, req in enumerate(reqs):
            self.req_to_token.write(req.req_pool_idx, req.kv_len, slots[i : i + 1])
            prefix_lens.append(req.kv_len)
        return ScheduledBatch(ForwardMode.DECODE, reqs, slots, prefix_lens)

    def on_forward_done(self, batch: ScheduledBatch) -> None:
        """The new tokens' K/V are in the pool now."""
        for req in batch.reqs:
            req.kv_len = req.seq_len if batch.mode is ForwardMode.DECODE else req.prompt_len
        if batch.mode is ForwardMode.EXTEND:
            self.running.extend(batch.reqs)

    def release(self, req: Req) -> None:
        """Free a finished (or aborted) request's KV slots and its table row."""
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:
            row = self.req_to_token.table[req.req_pool_idx, : req.kv_len]
            self.allocator.free(row.clone())
            self.req_to_token.free(req.req_pool_idx)
            req.req_pool_idx = None
            req.kv_len = 0

    def abort_waiting(self) -> list[Req]:
        reqs = list(self.waiting)
        self.waiting.clear()
        return reqs
