"""A scheduler run on its own, as the engine loop drives it (`next_batch`, then
`on_forward_done`, a drawn token for each request whose prompt is done, `release` at the
end), recording when each request arrived, first went in, what it computed and how often it
was retracted. Arrivals are counted in requests, not seconds."""

from __future__ import annotations

import itertools

import torch

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.scheduled_batch import RequestGroup
from lmprog_runtime.scheduler import Scheduler
from lmprog_runtime.stats import EngineStats


class Sim:
    """A scheduler and the requests it has seen: when each arrived, when each first went
    in (its first extend), how many tokens it computed and how often it was retracted."""

    def __init__(self, policy: str, max_running: int, pool: int, chunk: int = 0) -> None:
        self.allocator = TokenSlotAllocator(pool, 1)
        table = ReqToTokenPool(max_running + 4, 1024, torch.device("cpu"))
        config = RuntimeConfig(
            page_size=1,
            max_total_tokens=pool,
            schedule_policy=policy,
            max_running_requests=max_running,
            chunked_prefill_size=chunk,
        )
        self.tree = RadixCache(self.allocator, 1)
        cache = ReqCache(self.tree, self.allocator, table)
        self.sched = Scheduler(config, self.allocator, table, cache, EngineStats())
        self.rids = itertools.count()
        self.arrived: dict[int, int] = {}  # rid -> arrival number
        self.admitted: list[int] = []  # rids, in the order of their first extend
        self.computed: dict[int, int] = {}  # rid -> tokens extended (decodes not counted)
        self.retracted: dict[int, int] = {}
        retract = self.sched.retract

        def counting_retract(req: Req) -> None:
            self.retracted[req.rid] = self.retracted.get(req.rid, 0) + 1
            retract(req)

        self.sched.retract = counting_retract  # type: ignore[method-assign]

    def submit(self, prompts: list[list[int]], new: int) -> list[Req]:
        reqs = []
        for ids in prompts:
            rid = next(self.rids)
            params = SamplingParams(max_new_tokens=new)
            reqs.append(
                Req(rid, ids, params, tokenizer=None, eos_token_ids=frozenset(), context_len=1024)
            )
            self.arrived[rid] = len(self.arrived)
        if len(reqs) > 1:
            group = RequestGroup(reqs, None)
            for req in reqs:
                req.group = group
        for req in reqs:
            self.sched.add(req)
        return reqs

    def step(self) -> None:
        batch = self.sched.next_batch()
        if batch is None:
            return
        if batch.mode is ForwardMode.EXTEND:
            extends = batch.reqs[: len(batch.reqs) - batch.num_decodes]
            for req, n in zip(extends, batch.extend_lens):
                if req.rid not in self.computed:
                    self.admitted.append(req.rid)
                self.computed[req.rid] = self.computed.get(req.rid, 0) + n
        for req in self.sched.on_forward_done(batch):
            req.output_ids.append(7)  # (a drawn token: its K/V comes with the next step)
        for req in [r for r in self.sched.running if len(r.output_ids) >= r.max_new_tokens]:
            self.sched.release(req)

    def passed_by(self, reqs: list[Req]) -> int:
        """How many requests that arrived after `reqs` went in before them."""
        arrived = max(self.arrived[r.rid] for r in reqs)
        rids = {r.rid for r in reqs}
        first = min(self.admitted.index(rid) for rid in rids if rid in self.admitted)
        return sum(self.arrived[rid] > arrived for rid in self.admitted[:first])

    def is_clean(self) -> bool:
        idle = not self.sched.has_work
        free = self.allocator.num_free + self.tree.evictable_size == self.allocator.num_slots
        return idle and free and self.tree.protected_size == 0
