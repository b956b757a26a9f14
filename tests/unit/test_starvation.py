"""No waiting request is passed without bound by later ones, under any policy: a steady
stream of requests that share a cached prefix went in ahead of a prompt sharing none
(`lpm` sorted it last at every step), and lone requests took every freed row ahead of a
fork's group that needed several at once (under `fcfs` too). Once `MAX_OVERTAKES` later
requests have gone in past a waiting request, it goes first and admission stops at it.

And a prompt prefilled in chunks goes in only when its whole remaining prompt fits the
pool: with room for its first chunk only, it went in, filled the pool and was retracted,
its chunks computed again.

The scheduler runs here on its own, as the engine loop drives it (`next_batch`, then
`on_forward_done`, a drawn token for each request whose prompt is done, `release` at the
end); arrivals are counted in requests, not seconds."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.schedule_policy import MAX_OVERTAKES
from lmprog_runtime.scheduled_batch import RequestGroup
from lmprog_runtime.scheduler import Scheduler
from lmprog_runtime.stats import EngineStats

POLICIES = ["fcfs", "lpm", "dfs-weight"]
SHARED = list(range(1, 61))  # the stream's common prefix (cached after its first request)


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


def _stream(
    sim: Sim,
    rng: random.Random,
    steps: int,
    waiting: int,
    watch: list[Req],
    longest: int = 9,
    own: int = 4,
    jump_every: int = 0,
) -> None:
    """`steps` steps of a steady load: the queue kept at `waiting` requests that share the
    cached prefix (then `own` tokens of their own, up to `longest` new tokens), until every
    watched request went in (or the steps ran out); every `jump_every` steps a running
    request jumps forward."""
    for step in range(steps):
        while len(sim.sched.waiting) < waiting:
            ids = SHARED + [rng.randrange(100, 2000) for _ in range(own)]
            sim.submit([ids], rng.randint(2, longest))
        if jump_every and step % jump_every == 0:
            _jump_forward_one(sim)
        sim.step()
        if all(r.rid in sim.admitted for r in watch):
            return


def _jump_forward_one(sim: Sim) -> None:
    """A running request's output grows by a forced token (no K/V yet): it goes back to
    the front of the queue to extend it, as jump-forward puts it."""
    for req in sim.sched.running:
        if len(req.output_ids) < req.max_new_tokens - 1:
            req.output_ids.append(9)
            sim.sched.jump_forward(req)
            return


def _drain(sim: Sim) -> None:
    for _ in range(10_000):
        if not sim.sched.has_work:
            break
        sim.step()
    assert sim.is_clean()


def _warm(policy: str, max_running: int = 4, pool: int = 2048, chunk: int = 0):
    sim, rng = Sim(policy, max_running, pool, chunk), random.Random(0)
    _stream(sim, rng, 30, waiting=8, watch=[])
    return sim, rng


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("jump_every", [0, 4])
def test_a_prompt_sharing_no_cached_prefix_goes_in(policy, jump_every):
    """(`jump_every`: requests that jump forward go in front of it for a step, now and
    then; counted for the queue's head only, its count started over each time, and it
    waited out 12,000 later requests)"""
    sim, rng = _warm(policy)
    lone = sim.submit([[rng.randrange(100, 2000) for _ in range(30)]], 4)
    _stream(sim, rng, 4000, waiting=8, watch=lone, jump_every=jump_every)
    assert lone[0].rid in sim.admitted
    assert sim.passed_by(lone) <= MAX_OVERTAKES + 4  # (plus what one step admits)
    if policy != "fcfs":  # (sorted last, it goes in first only once 32 went past it: each
        # request jumped forward, admitted again, counted once more, it went after 5)
        assert sim.passed_by(lone) >= MAX_OVERTAKES
    _drain(sim)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_group_needing_several_rows_goes_in(policy):
    """(the stream's requests of many lengths: ending apart, each frees one row at a time)"""
    sim, rng = _warm(policy, max_running=8)
    group = sim.submit([SHARED + [3000 + i] for i in range(6)], 12)
    _stream(sim, rng, 3000, waiting=8, watch=group, longest=60)
    assert all(r.rid in sim.admitted for r in group)
    assert sim.passed_by(group) <= MAX_OVERTAKES + 8
    _drain(sim)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_long_prompt_in_chunks_goes_in_when_all_of_it_fits(policy):
    """A 600-token prompt (chunks of 64) in a 1,024-slot pool among requests that keep it
    over half full: it waits for room for all of it, then goes in once and is never
    retracted (with room for one chunk only, it went in at once and was retracted as the
    pool filled, its chunks computed again)."""
    sim, rng = _warm(policy, max_running=8, pool=1024, chunk=64)
    long = sim.submit([[rng.randrange(100, 2000) for _ in range(600)]], 8)
    _stream(sim, rng, 4000, waiting=12, watch=long, longest=40, own=60)
    assert long[0].rid in sim.admitted
    _drain(sim)
    assert sim.retracted.get(long[0].rid, 0) == 0
    assert sim.computed[long[0].rid] == 600  # (its prompt's K/V, computed once)
