"""Admission's slots: the extend batch of requests that each start on a fresh page takes
all of their slots in one allocation and writes their rows of the request table in one
go; it must equal what allocating and writing request by request gives."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.scheduler import Scheduler
from lmprog_runtime.stats import EngineStats


def _scheduler(page: int, prefixes: list[int], churn: int):
    """A scheduler whose request i holds `prefixes[i]` tokens' slots in its row (its
    free list reordered by `churn` frees first)."""
    allocator = TokenSlotAllocator(160, page)
    table = ReqToTokenPool(len(prefixes), 64, torch.device("cpu"))
    config = RuntimeConfig(page_size=page, max_total_tokens=160)
    sched = Scheduler(config, allocator, table, ReqCache(None, allocator, table), EngineStats())
    scratch = [allocator.alloc(1 + k % 5) for k in range(churn)]
    for slots in scratch[::2]:
        allocator.free(slots)
    reqs = []
    for i, kv in enumerate(prefixes):
        row = table.alloc()
        if kv:
            table.write(row, 0, allocator.alloc(kv))
        reqs.append(SimpleNamespace(req_pool_idx=row, kv_len=kv, seq_len=0, name=i))
    return sched, reqs


@settings(max_examples=150, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4]),
    churn=st.integers(0, 8),
    shapes=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 9), st.integers(0, 3)),
        min_size=1,
        max_size=5,
    ),
)
def test_one_allocation_for_the_batch_equals_one_per_request(page, churn, shapes):
    # per request: (prefix pages, tokens past them, tokens computed now, tokens after it)
    prefixes = [pages * page + extra for pages, extra, _, _ in shapes]
    batched, reqs = _scheduler(page, prefixes, churn)
    alone, reqs_alone = _scheduler(page, prefixes, churn)
    alone.allocator.alloc_fresh = lambda counts: None  # request by request, as before
    asked, fresh = [], batched.allocator.alloc_fresh
    batched.allocator.alloc_fresh = lambda counts: asked.append(counts) or fresh(counts)
    entries, entries_alone = [], []
    for (_, _, n, after), req, other in zip(shapes, reqs, reqs_alone):
        req.seq_len = other.seq_len = req.kv_len + n + after
        entries.append((req, n))
        entries_alone.append((other, n))
    got = batched._alloc_extend(entries)
    want = alone._alloc_extend(entries_alone)
    # (one allocation exactly when every request starts on a fresh page)
    assert bool(asked) == all(kv % page == 0 for kv in prefixes)
    assert got.out_cache_loc.tolist() == want.out_cache_loc.tolist()
    assert got.prefix_lens == want.prefix_lens == prefixes
    assert got.extend_lens == want.extend_lens == [n for _, _, n, _ in shapes]
    assert [r.name for r in got.reqs] == [r.name for r in want.reqs]
    assert torch.equal(batched.req_to_token.host_table, alone.req_to_token.host_table)
    assert batched.allocator.num_free == alone.allocator.num_free
    chunked = batched.chunked_req, alone.chunked_req
    assert (chunked[0] and chunked[0].name) == (chunked[1] and chunked[1].name)
    start = 0
    for req, n in entries:  # each row holds its new slots from its next position on
        row = batched.req_to_token.host_table[req.req_pool_idx]
        assert (
            row[req.kv_len : req.kv_len + n].tolist()
            == got.out_cache_loc[start : start + n].tolist()
        )
        start += n
