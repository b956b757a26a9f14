"""A request group's members are admitted with fresh prefix matches whatever the order
policy: in arrival order the policy matches only the request it gives, and the scheduler
matches the others as it claims them with it. A match left from an earlier step (the
group did not fit then, and the cache was evicted since) must never be claimed."""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.scheduler import RequestGroup, Scheduler
from lmprog_runtime.stats import EngineStats

PREFIX = list(range(1, 41))
POLICIES = ["fcfs", "lpm", "dfs-weight"]


def _setup(policy: str, max_running: int):
    allocator = TokenSlotAllocator(512, 1)
    table = ReqToTokenPool(8, 128, torch.device("cpu"))
    tree = RadixCache(allocator, 1)
    config = RuntimeConfig(
        page_size=1, max_total_tokens=512, schedule_policy=policy, max_running_requests=max_running
    )
    sched = Scheduler(config, allocator, table, ReqCache(tree, allocator, table), EngineStats())
    tree.insert(PREFIX, allocator.alloc(len(PREFIX)))  # (the group's prefix, cached)
    members = [_req(i, PREFIX + [100 + i, 200 + i]) for i in range(3)]
    group = RequestGroup(members, None)
    for member in members:
        member.group = group
        sched.add(member)
    return sched, tree, allocator, members


def _req(rid: int, ids: list[int], new: int = 4) -> Req:
    params = SamplingParams(max_new_tokens=new)
    return Req(rid, ids, params, tokenizer=None, eos_token_ids=frozenset(), context_len=128)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_member_claims_the_cached_prefix(policy):
    sched, _, _, members = _setup(policy, max_running=3)
    batch = sched._schedule_extend()
    assert sorted(batch.prefix_lens) == [40, 40, 40]
    assert sorted(batch.extend_lens) == [2, 2, 2]
    assert all(m.cached_tokens == 40 for m in members)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_match_from_an_earlier_step_is_never_claimed(policy):
    sched, tree, allocator, members = _setup(policy, max_running=3)
    other = _req(9, [7, 7], 0)
    sched.running.append(other)  # room for 2 of the 3 members: the group waits
    assert sched._schedule_extend() is None
    sched.running.remove(other)
    assert tree.evict(10**6) == 40  # (the prefix is gone; no match may point at it)
    batch = sched._schedule_extend()
    assert batch.prefix_lens == [0, 0, 0] and batch.extend_lens == [42, 42, 42]
    assert tree.evictable_size == tree.protected_size == 0
    assert allocator.num_free + batch.out_cache_loc.numel() == allocator.num_slots
