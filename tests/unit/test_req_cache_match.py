"""A waiting request is matched again at every scheduling step (`ReqCache.match`), the
later matches resuming where the earlier one ended, or skipping the walk when nothing
cached starts its prompt. Whatever the tree went through between two matches (inserts
that share its prompt or not, evictions, flushes), the match must equal a fresh match of
the prompt from the root, slots included, and leave the tree as that match does; and the
`lpm` order built on these matches is a naive one's."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.schedule_policy import SchedulePolicy

POOL = 256
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=8)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), tokens),
        # (a waiting prompt's first tokens, then others: matches that grow)
        st.tuples(st.just("insert"), st.tuples(st.integers(0, 2), st.integers(1, 8), tokens)),
        st.tuples(st.just("evict"), st.integers(1, 8)),
        st.tuples(st.just("flush"), st.none()),
        st.tuples(st.just("match"), st.integers(0, 2)),
    ),
    max_size=40,
)


def _shape(node):
    """A subtree: each edge's tokens, slots, recency and hits."""
    return sorted(
        (tuple(c.key), tuple(c.value.tolist()), c.last_access, c.hit_count, _shape(c))
        for c in node.children.values()
    )


@settings(max_examples=300, deadline=None)
@given(
    page_size=st.sampled_from([1, 2]),
    prompts=st.lists(st.lists(st.integers(1, 3), min_size=2, max_size=8), min_size=3, max_size=3),
    ops=operations,
)
def test_a_repeated_match_equals_a_fresh_one(page_size, prompts, ops):
    allocator = TokenSlotAllocator(POOL, page_size)
    tree = RadixCache(allocator, page_size)
    req_cache = ReqCache(tree, allocator, ReqToTokenPool(4, 16, torch.device("cpu")))
    params = SamplingParams(max_new_tokens=1)
    reqs = [
        Req(i, p, params, tokenizer=None, eos_token_ids=frozenset(), context_len=16)
        for i, p in enumerate(prompts)
    ]
    for op, arg in ops:
        if op == "insert" and isinstance(arg, tuple):
            i, n, tail = arg
            arg = prompts[i][:n] + tail
        if op == "insert":
            n = len(arg) // page_size * page_size
            if n:
                slots = allocator.alloc(n)
                already = tree.insert(arg[:n], slots)
                allocator.free(slots[:already])
        elif op == "evict":
            tree.evict(arg)
        elif op == "flush":
            tree.flush()
        else:
            req = reqs[arg]
            twin = copy.deepcopy(tree)  # (the reference: walked from the root)
            expected = twin.match_path(req.input_ids, req.max_prefix_len())
            got = req_cache.match(req)
            assert got == expected[1] == req.match.length
            assert req.match.slots.tolist() == [int(s) for value in expected[2] for s in value]
            assert _shape(tree.root) == _shape(twin.root)
            assert tree._path_to(req.match.node) is not None  # (in this tree: not a flushed one)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(1, 3), min_size=2, max_size=6), max_size=12),
    cached=st.lists(tokens, max_size=6),
    rounds=st.integers(1, 3),
)
def test_lpm_orders_by_cached_prefix_then_arrival(prompts, cached, rounds):
    """Longest cached prefix first (a naive longest common prefix with what was
    inserted), ties in arrival order, at every step the queue is ordered again."""
    allocator = TokenSlotAllocator(POOL, 1)
    tree = RadixCache(allocator, 1)
    policy = SchedulePolicy(
        "lpm", ReqCache(tree, allocator, ReqToTokenPool(4, 16, torch.device("cpu")))
    )
    params = SamplingParams(max_new_tokens=1)
    reqs = [Req(i, p, params, tokenizer=None, eos_token_ids=frozenset(), context_len=16)
            for i, p in enumerate(prompts)]  # fmt: skip
    inserted: list[list[int]] = []
    for step in range(rounds):
        for key in cached[step::rounds]:  # (the cache grows between the orderings)
            slots = allocator.alloc(len(key))
            allocator.free(slots[: tree.insert(key, slots)])
            inserted.append(key)

        def cached_len(req):
            best = max((_common(req.input_ids, key) for key in inserted), default=0)
            return min(best, req.max_prefix_len())

        expected = sorted(range(len(reqs)), key=lambda i: (-cached_len(reqs[i]), i))
        assert [req.rid for req in policy.order(reqs)] == expected


def test_a_prompt_computed_again_reads_the_trees_slots():
    """A request that computed tokens the tree already holds (a prompt admitted beside
    the same one) frees its own and points its row at the tree's, across every edge of
    the path they span, and keeps its own past them."""
    allocator = TokenSlotAllocator(POOL, 1)
    tree = RadixCache(allocator, 1)
    table = ReqToTokenPool(4, 16, torch.device("cpu"))
    req_cache = ReqCache(tree, allocator, table)
    for key in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]):  # (edges: [1,2] [3,4] [5,6])
        slots = allocator.alloc(len(key))
        allocator.free(slots[: tree.insert(key, slots)])
    params = SamplingParams(max_new_tokens=1)
    req = Req(0, [1, 2, 3, 4, 5, 6, 7, 8], params, tokenizer=None, eos_token_ids=frozenset(),
              context_len=16)  # fmt: skip
    req.req_pool_idx = table.alloc()
    own = allocator.alloc(8)  # (computed whole, as if nothing had been cached)
    table.write(req.req_pool_idx, 0, own)
    req.kv_len = 8
    free_before = allocator.num_free
    req_cache.cache_unfinished(req)
    hits = [node.hit_count for node in tree._path_to(req.last_node)]
    assert hits == [0, 0, 0, 0]  # (its own computed tokens: no request reused them)
    cached = tree.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist()
    assert table.host_table[req.req_pool_idx, :8].tolist() == cached + own[6:].tolist()
    assert allocator.num_free == free_before + 6  # (its first six, duplicates, freed)
    assert tree.match_prefix(req.input_ids).slots.tolist() == cached + own[6:].tolist()
    req_cache.cache_finished(req)
    assert tree.path_slots(tree.match_prefix([1, 2, 3, 4, 5, 6]).node, 2).tolist() == cached[2:]
    with pytest.raises(ValueError):
        tree.path_slots(tree.match_prefix([1, 2, 3, 4]).node, 1)  # (no node ends at 1)
