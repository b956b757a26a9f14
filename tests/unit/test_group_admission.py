"""A request group's members are admitted with fresh prefix matches whatever the order
policy: in arrival order the policy matches only the request it gives, and the scheduler
matches the others as it claims them with it. A match left from an earlier step (the
group did not fit then, and the cache was evicted since) must never be claimed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.scheduled_batch import RequestGroup
from lmprog_runtime.scheduler import Scheduler
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


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    lone=st.integers(0, 300),
    group_at=st.integers(0, 10),
    gap=st.integers(0, 300),
    ready=st.booleans(),
)
def test_a_long_queue_keeps_its_order(policy, lone, group_at, gap, ready):
    """Admission reads a long queue only as far as it orders it (129 requests); what it
    admits leaves the queue, wherever it stood (a group's second member may stand past
    that), and the rest keep their order."""
    allocator = TokenSlotAllocator(4096, 1)
    table = ReqToTokenPool(8, 128, torch.device("cpu"))
    config = RuntimeConfig(
        page_size=1, max_total_tokens=4096, schedule_policy=policy, max_running_requests=8
    )
    cache = ReqCache(RadixCache(allocator, 1), allocator, table)
    sched = Scheduler(config, allocator, table, cache, EngineStats())
    queue = [_req(i, [1 + i % 50, 2 + i // 50]) for i in range(lone)]
    first, second = _req(1000, [7, 7, 7]), _req(1001, [7, 7, 8])
    group = RequestGroup([first, second], None)
    first.group = second.group = group
    if not ready:  # (a member not submitted yet: the group is not admitted)
        group.members.append(_req(1002, [7, 7, 9]))
    at = min(group_at, len(queue))
    queue[at:at] = [first]
    queue.insert(min(at + 1 + gap, len(queue)), second)
    for req in queue:
        sched.add(req)
    batch = sched._schedule_extend()
    admitted = {id(r) for r in batch.reqs} if batch is not None else set()
    assert sched.waiting == [r for r in queue if id(r) not in admitted]
    assert (id(first) in admitted) == (id(second) in admitted)
    if policy == "fcfs" or len(queue) > 129:  # (arrival order: the first that fit)
        assert len(admitted) == min(8, len(queue) - 2 + 2 * (id(first) in admitted))


@pytest.mark.parametrize("waiting, hot_first", [(128, True), (129, False)])
def test_past_128_waiting_admission_goes_by_arrival(waiting, hot_first):
    """`lpm` orders up to 128 waiting requests by cached prefix; one more, and admission
    takes them in arrival order (matching every prompt at every step would cost more
    than the order saves)."""
    sched, tree, allocator, _ = _setup("lpm", max_running=1)
    sched.waiting.clear()
    queue = [_req(i, [500 + i, 600 + i]) for i in range(waiting - 1)]
    hot = _req(999, PREFIX + [1, 2])  # (its first 40 tokens cached)
    for req in [queue[0], hot, *queue[1:]]:  # (second: among the first 128 either way)
        sched.add(req)
    batch = sched._schedule_extend()
    assert batch.reqs == ([hot] if hot_first else [queue[0]])


def test_a_waiting_request_holding_kv_gives_it_back_to_the_cache():
    """A request that jumped forward waits to extend its forced tokens, still holding its
    K/V; admission may never reach it (it stops at the first request that does not fit).
    Given back, its K/V are the cache's, evictable, and claimed back on its admission are
    its own, not served from the cache."""
    allocator = TokenSlotAllocator(64, 1)
    table = ReqToTokenPool(8, 128, torch.device("cpu"))
    tree = RadixCache(allocator, 1)
    config = RuntimeConfig(page_size=1, max_total_tokens=64, schedule_policy="lpm")
    sched = Scheduler(config, allocator, table, ReqCache(tree, allocator, table), EngineStats())
    holder = _req(1, list(range(100, 130)), new=8)
    sched.add(holder)
    sched.on_forward_done(sched._schedule_extend())  # (its prompt's K/V, in the cache)
    holder.output_ids += [1, 2, 3]  # (forced tokens, no K/V yet)
    sched.jump_forward(holder)
    assert sched.waiting == [holder] and holder.kv_len == 30 and tree.evictable_size == 0
    assert sched.give_back_held() == 1
    assert holder.req_pool_idx is None and tree.evictable_size == 30
    assert allocator.num_free == 64 - 30 and sched.give_back_held() == 0
    batch = sched._schedule_extend()  # claims its 30 back, extends the 3 forced tokens
    assert batch.reqs == [holder] and batch.prefix_lens == [30] and batch.extend_lens == [3]
    assert holder.cached_tokens == 0 and sched.stats.snapshot()["cached_tokens"] == 0


def test_a_forced_text_another_request_computed_is_not_counted_as_cached():
    """Given back after a jump forward, a request claims its forced tokens from the cache
    where another request with the same prompt computed them: they are its output, not
    prompt tokens served (it counted 34 cached of a 30-token prompt)."""
    allocator = TokenSlotAllocator(128, 1)
    table = ReqToTokenPool(8, 128, torch.device("cpu"))
    tree = RadixCache(allocator, 1)
    config = RuntimeConfig(page_size=1, max_total_tokens=128, schedule_policy="lpm")
    sched = Scheduler(config, allocator, table, ReqCache(tree, allocator, table), EngineStats())
    prompt, forced = list(range(100, 130)), [1, 2, 3, 4, 5, 6]
    first = _req(1, prompt, new=20)
    sched.add(first)
    sched.on_forward_done(sched._schedule_extend())
    first.output_ids += forced
    sched.jump_forward(first)
    sched.on_forward_done(sched._schedule_extend())  # (the forced tokens' K/V, cached)
    first.output_ids.append(7)
    sched.release(first)
    twin = _req(2, list(prompt), new=20)
    sched.add(twin)
    sched.on_forward_done(sched._schedule_extend())
    assert twin.cached_tokens == 29  # (its prompt but the last token, which is computed)
    twin.output_ids += forced
    sched.jump_forward(twin)
    assert sched.give_back_held() == 1
    batch = sched._schedule_extend()
    assert batch.prefix_lens == [35] and batch.extend_lens == [1]
    assert twin.cached_tokens == 29 and sched.stats.snapshot()["cached_tokens"] == 29
    sched.release(twin)


def test_a_chunk_short_of_slots_takes_those_a_waiting_request_holds():
    """The chunked prompt's next chunk goes in before any waiting request, and nothing
    decodes; a request that jumped forward waits holding its K/V, locked, which the chunk
    needs. Given back, evicted, its slots take the chunk (the chunk waited for them at
    every step, with nothing to give them back: every request hung)."""
    allocator = TokenSlotAllocator(40, 1)
    table = ReqToTokenPool(4, 128, torch.device("cpu"))
    tree = RadixCache(allocator, 1)
    config = RuntimeConfig(
        page_size=1, max_total_tokens=40, max_running_requests=1, chunked_prefill_size=8
    )
    sched = Scheduler(config, allocator, table, ReqCache(tree, allocator, table), EngineStats())
    long = _req(1, list(range(100, 136)), new=4)
    sched.add(long)
    sched.on_forward_done(sched.next_batch())
    assert sched.chunked_req is long and long.kv_len == 8
    # A request that jumped forward, as it waits: its prompt's K/V in the tree, locked.
    holder = _req(2, list(range(200, 230)), new=8)
    holder.req_pool_idx = table.alloc()
    table.write(holder.req_pool_idx, 0, allocator.alloc(30))
    holder.kv_len = 30
    sched.req_cache.cache_unfinished(holder)
    holder.output_ids += [1, 2, 3]
    sched.waiting.insert(0, holder)
    assert allocator.num_free == 2 and tree.evictable_size == 0
    batch = sched.next_batch()
    assert batch is not None and batch.reqs == [long] and batch.extend_lens == [8]
    assert holder.req_pool_idx is None and holder in sched.waiting
