"""RadixAttention's prefix cache: a radix tree over token ids whose nodes own KV slots.

Each edge holds a run of tokens and the KV-slot indices of those tokens. `match_prefix`
finds the longest cached prefix of a sequence (splitting an edge where the match ends
inside it); `insert` adds a computed sequence and reports how much of it was already
there. Running requests lock the path they use (`inc_lock_ref`), so `evict` only ever
frees unlocked leaves, least recently used first (or least frequently used). With
`page_size > 1`, matching and edges are page-aligned, so every node owns whole pages.

Invariant (checked by the property tests): evictable_size + protected_size equals the
tokens held by the tree, and no KV slot is owned twice. Node values are host arrays (numpy,
int64): the tree is bookkeeping, read and written between forwards, never by a kernel,
a few times per request (at its admission, after its prefill and at its finish), and a
torch op on a few slots costs the loop 2-4 us where numpy's costs 0.1-0.3. `insert` takes
a CPU tensor or an array; `match_prefix` and `owned_slots` return tensors. The nodes and
the match records are in `radix_node.py`.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch

from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
from lmprog_runtime.kvcache.radix_node import NO_SLOTS, MatchResult, TreeNode, joined
from lmprog_runtime.transfer import host_slots

EVICTION_POLICIES = ("lru", "lfu")


class RadixCache:
    """The tree. It frees slots through `allocator` when it evicts or flushes.

    Example:
        >>> alloc = TokenSlotAllocator(64)
        >>> cache = RadixCache(alloc)
        >>> cache.insert([1, 2, 3], alloc.alloc(3))
        0
        >>> cache.match_prefix([1, 2, 9]).slots.numel()
        2
    """

    def __init__(
        self, allocator: TokenSlotAllocator, page_size: int = 1, eviction_policy: str = "lru"
    ) -> None:
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}"
            )
        if page_size != allocator.page_size:
            raise ValueError("the radix cache and the allocator must use the same page_size")
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode(None, [], NO_SLOTS)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self._num_nodes = 0  # (the root's children and below)
        # Eviction candidates, (priority, node_id, node), kept as the tree changes
        # (`_offer`), so that an eviction does not walk the whole tree: every unlocked leaf
        # has an entry, entered with its priority then, in the min-heap or in `_fresh` (the
        # entries since the last eviction, heaped by it: a push at every insert cost the
        # loop more than an append, and most leaves are never evicted). Priorities only
        # grow (recency, hits), so an entry's may be stale, never too high: `evict`
        # re-enters a stale one at its current priority, and drops entries of nodes that
        # are no longer unlocked leaves of the tree.
        self._leaf_heap: list[tuple[tuple[int, int], int, TreeNode]] = []
        self._fresh: list[tuple[tuple[int, int], int, TreeNode]] = []

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- match / insert ------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached, page-aligned prefix of `key`; bumps recency along the path."""
        node, _, values = self.match_path(key)
        return MatchResult(torch.from_numpy(np.concatenate([NO_SLOTS, *values])), node)

    def match_path(
        self, key: list[int], limit: int | None = None, since: TreeNode | None = None
    ) -> tuple[TreeNode, int, list[np.ndarray]]:
        """`match_prefix` of `key[:limit]` without joining the slots: the deepest node
        matched, how many tokens it matched, and the slots of the edges down to it, in
        order. The walk reads `key` in place (no copy of it, nor of what is left of it at
        each edge): a prompt of thousands of tokens is matched at each scheduling of a
        waiting request.

        `since`: a node an earlier match of the same tokens ended at. While it is in the
        tree, the path down to it is the same (edges are only ever split, never joined), so
        the walk takes that path without comparing its tokens again and goes on from it;
        the path's nodes are used as a walk from the root uses them."""
        end = len(key) if limit is None else max(0, min(limit, len(key)))
        end = end // self.page_size * self.page_size
        node, values, now, at = self.root, [], next(self._clock), 0
        path = self._path_to(since) if since is not None and since.depth <= end else None
        for child in path or ():
            child.last_access = now
            values.append(child.value)
        if path:
            node, at = since, since.depth
        while at < end and (step := self._descend(node, key, now, at, end)) is not None:
            child, n = step
            values.append(child.value)
            node, at = child, at + n
        return node, at, values

    def count_hit(self, node: TreeNode) -> None:
        """A request reuses the path down to `node` (its prefix, claimed): one hit for each
        node of it (`lfu`'s frequency). A match alone counts none: a waiting request is
        matched at each scheduling, and its prefix counted a hit at every step it waited."""
        while node.parent is not None:
            node.hit_count += 1
            node = node.parent

    def insert(self, key: list[int], value: torch.Tensor | np.ndarray) -> int:
        """Add `key` (page-aligned length) with its slots; return how many leading tokens
        were already cached (the caller still owns, and must free, those of its slots)."""
        return self.insert_node(key, value)[0]

    def insert_node(
        self,
        key: list[int],
        value: torch.Tensor | np.ndarray,
        below: TreeNode | None = None,
        locking: bool = False,
    ) -> tuple[int, TreeNode]:
        """`insert`, and the node whose path is all of `key` (lock it to keep it).

        `below`: a node whose path is the tokens before `key` (a request's locked prefix):
        the walk starts there, not at the root (O(the new tokens), not O(the whole
        sequence); the count returned includes its path). Its path gets the recency a walk
        from the root gives it. `locking`: the caller locks the node returned before
        anything may evict (a new leaf is then no eviction candidate until unlocked)."""
        value = host_slots(value)
        if len(key) % self.page_size or len(key) != value.size:
            raise ValueError("insert needs a page-aligned key and one slot per token")
        now = next(self._clock)
        node = self.root if below is None else below
        up = node
        while up.parent is not None:  # (below's path: as a walk from the root would)
            up.last_access = now
            up = up.parent
        matched = 0  # tokens of `key` the tree had
        while key and (step := self._descend(node, key, now)) is not None:
            child, n = step
            matched += n
            node, key = child, key[n:]
        if key:
            # (the new edge's own copies: of the caller's list, or of the slice made above;
            # the slots sliced once, at the end)
            edge = key[:] if matched == 0 else key
            leaf = TreeNode(node, edge, value[matched:].copy())
            leaf.last_access = now
            node.children[self._child_key(key)] = leaf
            self.evictable_size += len(key)
            self._num_nodes += 1
            if not locking:
                self._offer(leaf)
            node = leaf
        return matched + (below.depth if below is not None else 0), node

    def path_slots(self, node: TreeNode, depth: int) -> np.ndarray:
        """The slots of `node`'s path past its first `depth` tokens (a node of the path
        ends there), read up from `node`: no tokens compared. The path's nodes are used as
        a match of it from the root uses them (recency)."""
        now, values, ends = next(self._clock), [], depth == 0
        while node.parent is not None:
            node.last_access = now
            if node.depth > depth:
                values.append(node.value)
            ends = ends or node.depth == depth
            node = node.parent
        if not ends:
            raise ValueError(f"no node of the path ends at {depth} tokens")
        values.reverse()
        return joined(values)

    def starts_an_edge(self, key: list[int]) -> bool:
        """Whether an edge from the root starts with `key`'s first page: if not, nothing of
        `key` is cached, and `match_path` of it matches nothing (and touches no node)."""
        return bool(key) and self._child_key(key) in self.root.children

    def _path_to(self, node: TreeNode) -> list[TreeNode] | None:
        """The nodes from the root's child down to `node`; None if `node` has left the tree
        (evicted, or flushed with it)."""
        path = []
        while node.parent is not None:
            parent = node.parent
            if parent.children.get(self._child_key(node.key)) is not node:
                return None
            path.append(node)
            node = parent
        if node is not self.root:
            return None
        path.reverse()
        return path

    def _descend(
        self, node: TreeNode, key: list[int], now: int, start: int = 0, end: int | None = None
    ) -> tuple[TreeNode, int] | None:
        """The child of `node` that `key[start:end]` continues into, cut at the end of the
        match (only the matched part counts as used), and how many tokens matched; None if
        none."""
        child = node.children.get(self._child_key(key, start))
        if child is None:
            return None
        n = self._match_len(child.key, key, start, len(key) if end is None else end)
        if n < len(child.key):
            child = self._split(child, n)
        child.last_access = now
        return child, n

    def _child_key(self, key: list[int], start: int = 0) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _match_len(self, edge: list[int], key: list[int], start: int, end: int) -> int:
        """How many tokens `edge` and `key[start:end]` share, in whole pages."""
        n = min(len(edge), end - start)
        if (edge if n == len(edge) else edge[:n]) == key[start : start + n]:
            return n // self.page_size * self.page_size
        # The longest equal prefix by halving, each test one comparison of slices in C (a
        # long edge, a system prompt's, is told apart from a prompt that leaves it late).
        low, high = 0, n - 1  # (equal up to low; they differ within the first n)
        while low < high:
            mid = (low + high + 1) // 2
            if edge[low:mid] == key[start + low : start + mid]:
                low = mid
            else:
                high = mid - 1
        return low // self.page_size * self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(parent, child.key[:n], child.value[:n])
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hit_count = child.hit_count
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        self._num_nodes += 1  # (`child` stays the node it was: its heap entries hold)
        return upper

    # ---- locking ---------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (one reference per user)."""
        while node.parent is not None:  # every node but a root
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a radix node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                if not node.children:
                    self._offer(node)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves if possible, the lowest
        (priority, node_id) first, then again among the leaves left; returns freed."""
        heap, freed, values = self._leaf_heap, 0, []
        for entry in self._fresh:
            heapq.heappush(heap, entry)
        self._fresh = []
        while freed < num_tokens and heap:
            priority, node_id, node = heap[0]
            parent = node.parent
            if (
                node.lock_ref
                or node.children
                or parent.children.get(self._child_key(node.key)) is not node
            ):  # (locked, or a parent, or evicted since it was entered)
                heapq.heappop(heap)
                continue
            now = self._priority(node)
            if now != priority:  # (used since it was entered)
                heapq.heapreplace(heap, (now, node_id, node))
                continue
            heapq.heappop(heap)
            values.append(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            del parent.children[self._child_key(node.key)]
            self._num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, self._entry(parent))
        if values:  # (one free: each costs CPU ops)
            self.allocator.free(joined(values))
        return freed

    def _offer(self, node: TreeNode) -> None:
        """`node` may have become an unlocked leaf: an eviction candidate. (The entries
        of nodes locked, extended or evicted since pile up: past twice the tree's nodes,
        they are made again from the tree's unlocked leaves, once in so many offers.)"""
        self._fresh.append(self._entry(node))
        if len(self._fresh) + len(self._leaf_heap) > 2 * self._num_nodes + 64:
            self._leaf_heap = [self._entry(n) for n in self._leaves() if n.lock_ref == 0]
            heapq.heapify(self._leaf_heap)
            self._fresh = []

    def _entry(self, node: TreeNode) -> tuple[tuple[int, int], int, TreeNode]:
        return self._priority(node), node.node_id, node

    def _priority(self, node: TreeNode) -> tuple[int, int]:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access)
        return (node.last_access, 0)

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def flush(self) -> None:
        """Free every cached slot. Only valid when nothing holds a lock."""
        if self.protected_size:
            raise RuntimeError("cannot flush the prefix cache while requests use it")
        values = [node.value for node in self._all_nodes()]
        if values:
            self.allocator.free(joined(values))  # (one free: each costs CPU ops)
        self.reset()

    def _all_nodes(self) -> list[TreeNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def owned_slots(self) -> torch.Tensor:
        """Every slot the tree owns (for invariant checks)."""
        return torch.from_numpy(np.concatenate([NO_SLOTS, *(n.value for n in self._all_nodes())]))
