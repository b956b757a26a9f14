"""What LFU eviction reads from the tree: the hit count and recency of each node. The
state machine of test_radix_cache.py orders its reference eviction by the tree's own
counts, so these examples pin the counts down against counts kept by hand: a reused
path counts a hit on every node along it, and an edge split by a later match keeps its
hits on both halves."""

from __future__ import annotations

from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache


def _cache() -> RadixCache:
    return RadixCache(TokenSlotAllocator(64), eviction_policy="lfu")


def _fill(cache: RadixCache, key: list[int]) -> None:
    slots = cache.allocator.alloc(len(key))
    cache.allocator.free(slots[: cache.insert(key, slots)])


def _cached(cache: RadixCache, key: list[int]) -> int:
    return cache.match_prefix(key).slots.numel()


def _reuse(cache: RadixCache, key: list[int]) -> None:
    cache.count_hit(cache.match_prefix(key).node)


def _evict_with_locked(cache: RadixCache, locked: list[int], n: int) -> None:
    node = cache.match_prefix(locked).node
    cache.inc_lock_ref(node)
    assert cache.evict(n) == n
    cache.dec_lock_ref(node)


def test_a_split_edge_keeps_its_hits_on_the_upper_half():
    """[1,2,3,4] reused 3 times, then split at 2 by a match of [1,2,9]: once [3,4] is gone,
    the leaf [1,2] has 3 hits and outlives [7,7] (1 hit)."""
    cache = _cache()
    _fill(cache, [1, 2, 3, 4])
    for _ in range(3):
        _reuse(cache, [1, 2, 3, 4])
    _fill(cache, [7, 7])
    _reuse(cache, [7, 7])
    assert _cached(cache, [1, 2, 9]) == 2  # (the split)
    _evict_with_locked(cache, [7, 7], 2)  # [3,4], the only unlocked leaf
    assert _cached(cache, [1, 2, 3, 4]) == 2
    assert cache.evict(2) == 2
    assert _cached(cache, [1, 2]) == 2 and _cached(cache, [7, 7]) == 0


def test_a_hit_counts_on_every_node_of_the_path():
    """Three reuses of [1,2,3,4] count for the shared node [1,2] too: once its children
    are gone, it outlives [7,7] (reused once)."""
    cache = _cache()
    _fill(cache, [1, 2, 3, 4])
    _fill(cache, [1, 2, 5, 6])  # [1,2] with the leaves [3,4] and [5,6]
    for _ in range(3):
        _reuse(cache, [1, 2, 3, 4])
    _fill(cache, [7, 7])
    _reuse(cache, [7, 7])
    _evict_with_locked(cache, [7, 7], 4)  # [5,6] and [3,4]: [1,2] is left a leaf
    assert cache.evict(2) == 2
    assert _cached(cache, [1, 2]) == 2 and _cached(cache, [7, 7]) == 0
    cache.flush()
    assert cache.allocator.num_free == cache.allocator.num_slots
