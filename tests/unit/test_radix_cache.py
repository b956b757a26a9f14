"""RadixCache (the prefix tree over token ids) against a naive reference model.

The model is a dict from page-tuple prefixes of cached sequences to the KV slots of their
last page (page_size 1: token prefixes to one slot), with each prefix's last use (the
model's own clock) and hits (claims of a path through it). A hypothesis state machine drives
insert / match (whole keys, and a key's first tokens read in place) / claim / lock /
unlock / evict / flush and checks after every step that matches, sizes, locks, slot
ownership, hits and recency agree with the model, that eviction takes the leaves the
model's LRU / LFU order gives, and that no KV slot leaks. Example
tests pin down edge splits, LRU/LFU order, cascading eviction, page alignment and the
eviction walk-through of the reference document (S=2,000 shared, A=900, B=600, C=400).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.radix_node import PrefixMatch

POOL = 64  # slots: small enough that inserts run out and must evict


def pages_of(key, ps):
    return tuple(tuple(key[i : i + ps]) for i in range(0, len(key) // ps * ps, ps))


def path_tokens(node):
    """The tokens of the path from the root down to `node`."""
    tokens = []
    while node.parent is not None:
        tokens[:0] = node.key
        node = node.parent
    return tokens


class RadixModel(RuleBasedStateMachine):
    PAGE_SIZE, POLICY = 1, "lru"

    def __init__(self):
        super().__init__()
        self.alloc = TokenSlotAllocator(POOL, page_size=self.PAGE_SIZE)
        self.cache = RadixCache(self.alloc, self.PAGE_SIZE, self.POLICY)
        self.cached: dict[tuple, tuple[int, ...]] = {}  # page prefix -> slots of its last page
        self.locks: list[tuple[object, tuple]] = []  # (node, locked page prefix)
        self.earlier: list[tuple[list, int, object]] = []  # match_path's (key, limit, node)
        self.used: dict[tuple, int] = {}  # page prefix -> the model's clock at its last use
        self.hits: dict[tuple, int] = {}  # page prefix -> claims of a path through it
        self.clock = 0
        self.inserted: list[list[int]] = []  # (keys matches are drawn near)

    # ---- the reference model -------------------------------------------------------------
    def hit_pages(self, pg):
        i = 0
        while i < len(pg) and pg[: i + 1] in self.cached:
            i += 1
        return i

    def expected_slots(self, pg):
        return [s for j in range(self.hit_pages(pg)) for s in self.cached[pg[: j + 1]]]

    def use(self, pg):
        """A walk down the page prefixes of `pg` (all cached): each used now."""
        self.clock += 1
        for j in range(1, len(pg) + 1):
            self.used[pg[:j]] = self.clock
            self.hits.setdefault(pg[:j], 0)

    def priority(self, node):
        """`node`'s eviction order by the model: its path's last page prefix, read."""
        prefix = pages_of(path_tokens(node), self.PAGE_SIZE)
        if self.POLICY == "lfu":
            return (self.hits[prefix], self.used[prefix])
        return (self.used[prefix], 0)

    def locked_prefixes(self):
        return {p[:j] for _, p in self.locks for j in range(1, len(p) + 1)}

    def check_match(self, key):
        res = self.cache.match_prefix(key)
        pg = pages_of(key, self.PAGE_SIZE)
        assert res.slots.tolist() == self.expected_slots(pg), key
        self.use(pg[: self.hit_pages(pg)])
        return res, pg[: self.hit_pages(pg)]

    def do_evict(self, n):
        ps, free_before = self.PAGE_SIZE, self.alloc.num_free
        evictable, locked = self.cache.evictable_size, self.locked_prefixes()
        expected = naive_eviction(self.cache, n, self.priority)
        freed = self.cache.evict(n)
        assert node_ids(self.cache.root) == expected  # the nodes the order leaves
        owned = set(self.cache.owned_slots().tolist())
        kept = {p: v for p, v in self.cached.items() if v[0] in owned}
        assert all(set(v) <= owned for v in kept.values())  # whole pages survive or go
        removed = self.cached.keys() - kept.keys()
        assert all(len(p) == 1 or p[:-1] in kept for p in kept)  # only leaves-first removal
        assert not removed & locked, "evict freed tokens of a locked path"
        assert freed == ps * len(removed) and self.alloc.num_free == free_before + freed
        assert freed >= min(n, evictable)
        if freed < n:
            assert self.cache.evictable_size == 0
        self.cached = kept
        for prefix in removed:
            del self.used[prefix], self.hits[prefix]
        for _, p in self.locks:  # every locked sequence still matches fully
            assert self.check_match([t for page in p for t in page])[1] == p
        return freed

    # ---- rules -----------------------------------------------------------------------------
    def key_strategy(self, aligned):
        if self.PAGE_SIZE == 1:
            return st.lists(st.integers(0, 3), max_size=12)
        # pages from a small set; (0,0,0,0) and (0,0,0,1) diverge mid-page
        page = st.sampled_from([(0, 0, 0, 0), (0, 0, 0, 1), (1, 1, 1, 1), (0, 1, 2, 3)])
        key = st.lists(page, max_size=3).map(lambda ps: [t for p in ps for t in p])
        if aligned:
            return key
        key = st.tuples(key, st.lists(st.integers(0, 1), max_size=3)).map(lambda kt: kt[0] + kt[1])
        return st.one_of(key, self.near_an_inserted_key()) if self.inserted else key

    def near_an_inserted_key(self):
        """A key inserted earlier, cut anywhere, then another tail: a match of a whole
        cached path, or one that splits an edge used before (random keys seldom do)."""
        tail = st.lists(st.integers(0, 3), max_size=2)
        parts = st.tuples(st.sampled_from(self.inserted), st.integers(0, 12), tail)
        return parts.map(lambda kct: kct[0][: kct[1]] + kct[2])

    @rule(data=st.data())
    def insert(self, data):
        key = data.draw(self.key_strategy(aligned=True), label="key")
        value = self.alloc.alloc(len(key))
        if value is None:  # like the scheduler: evict what is missing, then retry
            self.do_evict(len(key) - self.alloc.num_free)
            value = self.alloc.alloc(len(key))
            if value is None:
                return
        pg = pages_of(key, self.PAGE_SIZE)
        hit = self.hit_pages(pg)
        already = self.cache.insert(key, value)
        assert already == hit * self.PAGE_SIZE
        self.alloc.free(value[:already])  # our duplicates of cached tokens (as ReqCache does)
        for j in range(hit, len(pg)):
            start = j * self.PAGE_SIZE
            self.cached[pg[: j + 1]] = tuple(value[start : start + self.PAGE_SIZE].tolist())
        self.use(pg)
        self.inserted.append(key)

    @rule(data=st.data())
    def insert_below(self, data):
        """Past a locked node (a request's prefix, as ReqCache inserts): the same outcome
        as inserting the whole sequence from the root."""
        if not self.locks:
            return
        node, prefix = self.locks[data.draw(st.integers(0, len(self.locks) - 1), label="lock")]
        head = [t for page in prefix for t in page]
        assert node.depth == len(head)
        tail = data.draw(self.key_strategy(aligned=True), label="tail")
        value = self.alloc.alloc(len(tail))
        if value is None:
            self.do_evict(len(tail) - self.alloc.num_free)
            value = self.alloc.alloc(len(tail))
            if value is None:
                return
        pg = pages_of(head + tail, self.PAGE_SIZE)
        hit = self.hit_pages(pg)
        # `locking`: as a prefill chunk's insert, which locks the node at once
        locking = data.draw(st.booleans(), label="locking")
        already, leaf = self.cache.insert_node(tail, value, below=node, locking=locking)
        assert already == hit * self.PAGE_SIZE and leaf.depth == len(head) + len(tail)
        self.alloc.free(value[: already - len(head)])
        for j in range(hit, len(pg)):
            start = j * self.PAGE_SIZE - len(head)
            self.cached[pg[: j + 1]] = tuple(value[start : start + self.PAGE_SIZE].tolist())
        self.use(pg)  # (the locked node's path too, as a walk from the root)
        self.inserted.append(head + tail)
        if locking and pg:
            self.cache.inc_lock_ref(leaf)
            self.locks.append((leaf, pg))

    @rule(data=st.data())
    def match(self, data):
        self.check_match(data.draw(self.key_strategy(aligned=False), label="key"))

    @rule(data=st.data())
    def match_path_of_a_prefix(self, data):
        """`match_path` of a key's first `limit` tokens, the key read in place: as the
        reference's match of those tokens (its slots joined only when read)."""
        key = data.draw(self.key_strategy(aligned=False), label="key")
        limit = data.draw(st.integers(-1, len(key) + 1), label="limit")
        node, length, values = self.cache.match_path(key, limit)
        pg = pages_of(key[: max(limit, 0)], self.PAGE_SIZE)
        expected = self.expected_slots(pg)
        assert PrefixMatch(node, length, values, key).slots.tolist() == expected
        assert length == len(expected) == node.depth
        self.use(pg[: self.hit_pages(pg)])
        self.earlier.append((key, limit, node))

    @rule(data=st.data())
    def match_path_again(self, data):
        """The same key matched again from where an earlier match ended (a waiting request
        at its next scheduling), whatever came between (inserts, splits, evictions, a
        flush): as the reference's match, ending at the node a walk from the root ends at,
        and using the same nodes (their recency and hits)."""
        if not self.earlier:
            return
        key, limit, since = self.earlier[data.draw(st.integers(0, len(self.earlier) - 1))]
        twin = copy.deepcopy(self.cache)  # the same tree, walked from its root
        node, length, values = self.cache.match_path(key, limit, since)
        pg = pages_of(key[: max(limit, 0)], self.PAGE_SIZE)
        expected = self.expected_slots(pg)
        assert PrefixMatch(node, length, values, key).slots.tolist() == expected
        self.use(pg[: self.hit_pages(pg)])
        twin_node, twin_length, _ = twin.match_path(key, limit)
        assert length == twin_length == node.depth == twin_node.depth
        assert _shape(self.cache.root) == _shape(twin.root)

    @rule(data=st.data())
    def lock(self, data):
        res, hit = self.check_match(data.draw(self.key_strategy(aligned=False), label="key"))
        if not hit:
            return  # like ReqCache.claim_prefix: an empty match locks nothing
        self.cache.inc_lock_ref(res.node)
        self.locks.append((res.node, hit))

    @rule(data=st.data())
    def claim(self, data):
        """A request reuses its matched prefix (`ReqCache.claim_prefix`): a hit for each
        page prefix of it."""
        res, hit = self.check_match(data.draw(self.key_strategy(aligned=False), label="key"))
        if hit:
            self.cache.count_hit(res.node)
            for j in range(1, len(hit) + 1):
                self.hits[hit[:j]] += 1

    @rule(i=st.integers(0, 63))
    def unlock(self, i):
        # Draws never depend on state: eviction ties are broken by id(), so the state itself
        # may differ between runs of the same example.
        if self.locks:
            node, _ = self.locks.pop(i % len(self.locks))
            self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 16))
    def evict(self, n):
        self.do_evict(n)

    @rule(now=st.integers(0, 7))
    def flush(self, now):
        if now:  # flush rarely, so that the tree grows and evictions compete with locks
            return
        if self.locked_prefixes():
            with pytest.raises(RuntimeError):
                self.cache.flush()
            return
        self.cache.flush()
        self.cached.clear()
        self.used.clear()
        self.hits.clear()
        assert self.alloc.num_free == self.alloc.num_slots and self.cache.total_size == 0

    @invariant()
    def consistent(self):
        owned = self.cache.owned_slots().tolist()
        assert len(owned) == len(set(owned)), "a KV slot is owned twice"
        assert sorted(owned) == sorted(s for v in self.cached.values() for s in v)
        protected = len(self.locked_prefixes()) * self.PAGE_SIZE
        assert self.cache.protected_size == protected
        assert self.cache.evictable_size == len(owned) - protected
        assert self.alloc.num_free + len(owned) == self.alloc.num_slots  # no leak
        probe = self.alloc.alloc(self.alloc.num_free)  # every free slot is really not owned
        assert not set(probe.tolist()) & set(owned)
        self.alloc.free(probe)

    @invariant()
    def hits_and_recency(self):
        """Each node's hits are its pages' (all alike), and its recency orders the nodes as
        the model's last uses do (the two clocks differ: only the order is compared)."""
        order: dict[int, int] = {}  # the tree's last_access -> the model's last use
        for node in _nodes(self.cache.root)[1:]:
            pg = pages_of(path_tokens(node), self.PAGE_SIZE)
            own = pg[len(pg) - len(node.key) // self.PAGE_SIZE :]
            for j in range(len(pg) - len(own) + 1, len(pg) + 1):
                assert self.hits[pg[:j]] == node.hit_count, (pg[:j], node.hit_count)
                assert self.used[pg[:j]] == self.used[pg]
            assert order.setdefault(node.last_access, self.used[pg]) == self.used[pg]
        uses = [use for _, use in sorted(order.items())]
        assert uses == sorted(set(uses))  # (the same order, ties alike)

    def teardown(self):
        for node, _ in self.locks:
            self.cache.dec_lock_ref(node)
        assert self.cache.protected_size == 0
        self.cache.flush()
        assert self.alloc.num_free == self.alloc.num_slots and self.cache.total_size == 0


def machine_test(page_size, policy, max_examples, slow=False):
    attrs = {"PAGE_SIZE": page_size, "POLICY": policy}
    name = f"RadixPage{page_size}{policy.upper()}" + ("Many" if slow else "")
    case = type(name, (RadixModel,), attrs).TestCase
    case.settings = settings(max_examples=max_examples, stateful_step_count=40)
    if slow:
        case.pytestmark = [pytest.mark.slow]
    return case


TestRadixPage1LRU = machine_test(1, "lru", 50)
TestRadixPage4LRU = machine_test(4, "lru", 50)
TestRadixPage1LFU = machine_test(1, "lfu", 50)
TestRadixPage4LFU = machine_test(4, "lfu", 50)
# The slow tier runs ten times as many operation sequences.
TestRadixPage1LRUMany = machine_test(1, "lru", 500, slow=True)
TestRadixPage4LRUMany = machine_test(4, "lru", 500, slow=True)
TestRadixPage1LFUMany = machine_test(1, "lfu", 500, slow=True)
TestRadixPage4LFUMany = machine_test(4, "lfu", 500, slow=True)


# ---- targeted examples ---------------------------------------------------------------------
def fill(cache, key):
    """Insert `key` with fresh slots (dropping duplicates like ReqCache); returns the slots."""
    value = cache.allocator.alloc(len(key))
    cache.allocator.free(value[: cache.insert(key, value)])
    return value


def hit(cache, key):
    return cache.match_prefix(key).slots.numel()


def test_edge_split_and_shared_prefix():
    cache = RadixCache(TokenSlotAllocator(64))
    s = fill(cache, [1, 2, 3, 4])
    res = cache.match_prefix([1, 2, 9])
    assert res.slots.tolist() == s[:2].tolist()
    assert res.node.key == [1, 2] and [c.key for c in res.node.children.values()] == [[3, 4]]
    v = cache.allocator.alloc(3)
    assert cache.insert([1, 2, 9], v) == 2
    cache.allocator.free(v[:2])
    assert cache.match_prefix([1, 2, 9]).slots.tolist() == s[:2].tolist() + [int(v[2])]
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == s.tolist()
    assert cache.total_size == 5 and cache.owned_slots().numel() == 5


@pytest.mark.parametrize("as_array", [True, False])
def test_the_tree_keeps_its_own_copy_of_the_slots(as_array):
    """A request's slots are inserted as a view of its row of the request table, and the row
    is reused once it leaves: the tree must keep copies (a numpy array or a tensor given)."""
    import numpy as np

    cache = RadixCache(TokenSlotAllocator(64))
    row = np.zeros(8, dtype=np.int64)
    row[:4] = cache.allocator.alloc(4).numpy()
    kept = row[:4].tolist()
    cache.insert([1, 2, 3, 4], row[:4] if as_array else torch.from_numpy(row)[:4])
    row[:] = 0  # (the row reused by the next request)
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == kept
    assert sorted(cache.owned_slots().tolist()) == sorted(kept)


def test_lru_evicts_least_recently_used_leaf_first():
    cache = RadixCache(TokenSlotAllocator(64))
    for key in ([1, 1], [2, 2], [3, 3]):
        fill(cache, key)
    hit(cache, [1, 1])  # order is now [2,2] < [3,3] < [1,1]
    assert cache.evict(1) == 2
    assert (hit(cache, [2, 2]), hit(cache, [3, 3]), hit(cache, [1, 1])) == (0, 2, 2)
    assert cache.evict(1) == 2  # [3,3] went next; [1,1] was just touched again
    assert (hit(cache, [3, 3]), hit(cache, [1, 1])) == (0, 2)


def use(cache, key):
    """A request admitted with its cached prefix (`ReqCache.claim_prefix`, then admission's
    `count_hit`): a match and a hit."""
    res = cache.match_prefix(key)
    cache.count_hit(res.node)
    return res.slots.numel()


@pytest.mark.parametrize("policy, survivor", [("lfu", [1, 1]), ("lru", [2, 2])])
def test_lfu_keeps_the_frequently_used_prefix(policy, survivor):
    """A hit is a request reusing the prefix. A match alone (a waiting request's, at each
    scheduling) is none: it counted one, and a prefix whose request waited long outranked
    one that many requests reused."""
    cache = RadixCache(TokenSlotAllocator(64), eviction_policy=policy)
    fill(cache, [1, 1])
    fill(cache, [2, 2])
    for _ in range(3):
        use(cache, [1, 1])  # hot
    for _ in range(5):
        hit(cache, [2, 2])  # cold (matched while waiting, never used), but touched last
    assert cache.root.children[cache._child_key([2, 2])].hit_count == 0
    assert cache.evict(2) == 2
    assert cache.owned_slots().numel() == 2 and hit(cache, survivor) == 2


def test_childless_parent_is_evicted_when_more_is_needed():
    cache = RadixCache(TokenSlotAllocator(64))
    fill(cache, [1, 2, 3, 4])
    fill(cache, [1, 2, 5, 6])  # node [1,2] with leaves [3,4] and [5,6]
    assert cache.evict(4) == 4 and cache.total_size == 2 and hit(cache, [1, 2]) == 2
    cache.flush()
    fill(cache, [1, 2, 3, 4])
    fill(cache, [1, 2, 5, 6])
    assert cache.evict(5) == 6 and cache.total_size == 0  # the parent went too
    assert cache.allocator.num_free == cache.allocator.num_slots
    fill(cache, [1, 2, 3, 4])
    fill(cache, [1, 2, 5, 6])
    node = cache.match_prefix([1, 2]).node
    cache.inc_lock_ref(node)  # a locked parent stays
    assert cache.evict(6) == 4 and hit(cache, [1, 2]) == 2
    cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)  # no longer locked


def test_eviction_keeps_its_candidates_as_the_tree_changes():
    """`evict` keeps a heap of candidates instead of walking the tree: a leaf passed over
    while locked is a candidate again once unlocked; a leaf entered twice goes once; and
    entries that pile up with no eviction (locks taken and dropped) are made again from
    the tree, evicting in the same order as a walk of the whole tree (`naive_eviction`)."""
    cache = RadixCache(TokenSlotAllocator(64))
    fill(cache, [1, 1])
    fill(cache, [2, 2])
    node = cache.match_prefix([1, 1]).node
    cache.inc_lock_ref(node)
    fill(cache, [1, 1])  # (used again: [2, 2] is the older one now)
    cache.match_prefix([2, 2])  # ([1, 1] older again, but locked: passed over)
    assert cache.evict(1) == 2 and hit(cache, [2, 2]) == 0
    cache.dec_lock_ref(node)
    assert cache.evict(1) == 2 and cache.total_size == 0  # unlocked: a candidate again

    fill(cache, [3, 3])
    node = cache.match_prefix([3, 3]).node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)  # (two entries for it now)
    assert cache.evict(2) == 2
    fill(cache, [4, 4])
    assert cache.evict(2) == 2 and cache.total_size == 0  # not [3, 3] twice: a double free

    keys = [[5, i, i] for i in range(6)]
    for key in keys:
        fill(cache, key)
    for round_ in range(100):  # an entry an unlock, none popped: 106 for 7 nodes
        node = cache.match_prefix(keys[round_ % 6]).node
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(node)
    assert len(cache._leaf_heap) + len(cache._fresh) <= 2 * cache._num_nodes + 64  # (remade)
    expected = naive_eviction(cache, 5)
    assert cache.evict(5) == 6 and node_ids(cache.root) == expected
    cache.flush()
    assert cache.allocator.num_free == cache.allocator.num_slots


def test_page_aligned_matching():
    alloc = TokenSlotAllocator(64, page_size=4)
    cache = RadixCache(alloc, page_size=4)
    s = fill(cache, list(range(8)))
    assert cache.match_prefix([0, 1, 2, 3, 4, 5]).slots.tolist() == s[:4].tolist()
    assert hit(cache, list(range(9))) == 8 and hit(cache, [0, 1, 2]) == 0
    assert hit(cache, [0, 1, 2, 3, 4, 5, 9, 9]) == 4  # diverges mid-page: rounds down
    v = alloc.alloc(8)
    assert cache.insert([0, 1, 2, 3, 4, 5, 9, 9], v) == 4
    alloc.free(v[:4])
    assert cache.total_size == 12 and alloc.num_free == 64 - 12
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(3))


def test_flush_refuses_while_locked():
    cache = RadixCache(TokenSlotAllocator(16))
    fill(cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.flush()
    cache.dec_lock_ref(node)
    cache.flush()
    assert cache.total_size == 0 and cache.allocator.num_free == 16


# ---- the reference document's walk-through --------------------------------------------------
S, A, B, C, D = [0] * 2000, [1] * 900, [2] * 600, [3] * 400, [4] * 500


def request(cache, key):
    """A request: match and lock its prefix, allocate the rest, insert; returns its node."""
    res = cache.match_prefix(key)
    cache.inc_lock_ref(res.node)
    n = res.slots.numel()
    new = cache.allocator.alloc(len(key) - n)
    value = torch.cat([res.slots, new])
    cache.allocator.free(value[n : cache.insert(key, value)])
    return res.node


@pytest.mark.parametrize(
    "locked, evicted, total",
    [("C", A, 3500), ("AC", B, 3800), ("ABC", None, None)],
    ids=["A-goes", "B-goes", "all-locked-D-waits"],
)
def test_eviction_walkthrough(locked, evicted, total):
    alloc = TokenSlotAllocator(4000)
    cache = RadixCache(alloc)
    for branch in (A, B, C):  # used in this order: A is least recently used
        cache.dec_lock_ref(request(cache, S + branch))
    assert cache.total_size == 3900 and alloc.num_free == 100
    for name in locked:  # still-running requests
        cache.inc_lock_ref(cache.match_prefix(S + {"A": A, "B": B, "C": C}[name]).node)
    res = cache.match_prefix(S + D)  # request D reuses S and locks it
    assert res.slots.numel() == 2000
    cache.inc_lock_ref(res.node)
    assert alloc.alloc(500) is None
    freed = cache.evict(500 - alloc.num_free)
    if evicted is None:  # everything is locked: nothing to free, D waits
        assert freed == 0 and cache.evictable_size == 0 and alloc.alloc(500) is None
        return
    assert freed == len(evicted) and cache.total_size == 3900 - len(evicted)
    for branch in (A, B, C):
        assert hit(cache, S + branch) == (2000 if branch is evicted else 2000 + len(branch))
    new = alloc.alloc(500)
    assert cache.insert(S + D, torch.cat([res.slots, new])) == 2000
    assert cache.total_size == total  # 3,000 or 3,300 cached + D's 500
    assert hit(cache, S + D) == 2500


@pytest.mark.parametrize("page_size", [1, 2])
def test_inserting_below_a_node_equals_inserting_from_the_root(page_size):
    """The same tree, slots, recency and returned counts either way, splits included."""
    trees = []
    for below in (False, True):
        cache = RadixCache(TokenSlotAllocator(64, page_size), page_size)
        fill(cache, [1, 2, 3, 4, 5, 6])
        fill(cache, [1, 2, 7, 8])  # (splits [1..6] after 2)
        prefix = cache.match_prefix([1, 2, 3, 4])
        node = prefix.node
        cache.match_prefix([9, 9])  # (moves the clock on)
        tail = [5, 6, 7, 8]
        value = cache.allocator.alloc(len(tail))
        if below:
            got = cache.insert_node(tail, value, below=node)
        else:
            got = cache.insert_node([1, 2, 3, 4, *tail], torch.cat([prefix.slots, value]))
        trees.append((got[0], got[1].depth, _shape(cache.root)))
        cache.allocator.free(value[: got[0] - 4])
    assert trees[0] == trees[1] and trees[0][:2] == (6, 8)


def naive_eviction(cache, n, priority=None):
    """The ids of the nodes left after evicting `n` tokens, by brute force on a copy: the
    unlocked leaf of lowest (priority, node_id) among all the leaves then, again and again
    (what `evict` does without walking the tree each time). `priority`: of a node (of the
    copy), by default the tree's own."""
    twin = copy.deepcopy(cache)
    priority = priority or twin._priority
    freed = 0
    while freed < n:
        leaves = [x for x in _nodes(twin.root) if not x.children and x.lock_ref == 0 and x.parent]
        if not leaves:
            break
        node = min(leaves, key=lambda x: (priority(x), x.node_id))
        del node.parent.children[twin._child_key(node.key)]
        freed += len(node.key)
    return node_ids(twin.root)


def _nodes(node):
    out = [node]
    for child in node.children.values():
        out.extend(_nodes(child))
    return out


def node_ids(root):
    return {x.node_id for x in _nodes(root)} - {root.node_id}


def _shape(node):
    """A node's subtree: each edge's tokens, slots, recency, hits and depth, by first
    token."""
    return sorted(
        (tuple(c.key), tuple(c.value.tolist()), c.last_access, c.hit_count, c.depth, _shape(c))
        for c in node.children.values()
    )


def test_a_match_resumed_after_a_flush_or_an_eviction_walks_from_the_root():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc, 1, "lru")
    key = [1, 2, 3, 4, 5]
    cache.insert(key, alloc.alloc(5))
    since, length, _ = cache.match_path(key)
    assert length == 5
    cache.flush()
    slots = alloc.alloc(3)
    cache.insert(key[:3], slots)  # the same tokens again, in new nodes
    node, length, values = cache.match_path(key, None, since)
    assert (length, node) == (3, cache.match_prefix(key).node)
    assert PrefixMatch(node, length, values, key).slots.tolist() == slots.tolist()
    cache.evict(3)
    assert cache.match_path(key, None, node)[:2] == (cache.root, 0)
