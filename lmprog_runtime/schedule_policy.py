"""In which order waiting requests are considered for admission.

- `fcfs`: arrival order.
- `lpm` (longest prefix match): requests whose prompt has the longest cached prefix first,
  so requests that share a prefix run while it is still in the cache.
- `dfs-weight`: walk the radix tree depth first, heaviest subtree (most waiting requests)
  first and deeper matches before shallower ones, so requests under the same node are
  admitted together.

With more than `MAX_CACHE_AWARE_QUEUE` waiting requests the cache-aware policies fall back to
arrival order: matching every waiting prompt each step would cost more than it saves.

Whatever the policy, a waiting request that `MAX_OVERTAKES` later requests have passed
goes first, and until it goes in nothing else does (`first_in_line`): a prompt sharing no
cached prefix under `lpm`, or a fork's group needing several rows at once, was passed by
every later request under a steady load.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator

from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req

MAX_CACHE_AWARE_QUEUE = 128
# Requests sharing at least this many not-yet-cached leading tokens with a request admitted
# in the same step wait one step, then reuse its prefix from the cache.
SHARED_PREFIX_BLOCK = 32
# Later requests admitted past a waiting one before it goes first (and blocks the rest).
MAX_OVERTAKES = 32


class SchedulePolicy:
    def __init__(self, policy: str, req_cache: ReqCache) -> None:
        self.policy = policy
        self.req_cache = req_cache

    def order(self, waiting: list[Req], first: Req | None = None) -> Iterable[Req]:
        """Waiting requests in admission order; each has a fresh prefix match by the time
        it comes (in arrival order, each is matched only then: admission stops at the
        first that does not fit, most steps after one or two). A group's other members
        are matched by the scheduler when it claims them with it. `first`: one of them,
        put first whatever the policy (`first_in_line`)."""
        if first is not None:
            self.req_cache.match(first)
            return itertools.chain((first,), self.order([r for r in waiting if r is not first]))
        if self.policy == "fcfs" or len(waiting) > MAX_CACHE_AWARE_QUEUE:
            return self._matched(waiting[:MAX_CACHE_AWARE_QUEUE])
        if self.policy == "lpm":  # (longest first; a stable sort: ties in arrival order)
            return sorted(waiting, key=self.req_cache.match, reverse=True)
        for req in waiting:
            self.req_cache.match(req)
        return self._dfs_weight(waiting)

    def _matched(self, reqs: list[Req]) -> Iterator[Req]:
        for req in reqs:
            self.req_cache.match(req)  # (admission adds no tokens to the tree meanwhile)
            yield req

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        tree = self.req_cache.tree
        if tree is None:
            return list(waiting)
        at_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for req in waiting:
            node = req.match.node if req.match is not None else tree.root
            at_node[id(node)].append(req)
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        # Post-order: heavier subtrees first, and a node's own requests after its children's
        # (deeper matches first).
        ordered: list[Req] = []
        stack: list[tuple[object, bool]] = [(tree.root, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                ordered.extend(at_node.get(id(node), ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            # Pushed lightest first so the heaviest subtree is visited next.
            stack.extend((c, False) for c in sorted(children, key=lambda c: weight[id(c)]))
        return ordered


class PrefixBlocks:
    """Leading-token blocks of the requests admitted in one step, to spot shared prefixes."""

    def __init__(self) -> None:
        self._blocks: set[int] = set()

    def add(self, ids: list[int]) -> None:
        for h, _ in _block_hashes(ids):
            self._blocks.add(h)

    def shared_len(self, ids: list[int]) -> int:
        """Length of the longest block-aligned prefix of `ids` seen in an added request."""
        shared = 0
        for h, end in _block_hashes(ids):
            if h not in self._blocks:
                break
            shared = end
        return shared


def _block_hashes(ids: list[int]):
    h = 0
    for end in range(SHARED_PREFIX_BLOCK, len(ids) + 1, SHARED_PREFIX_BLOCK):
        h = hash((h, tuple(ids[end - SHARED_PREFIX_BLOCK : end])))
        yield h, end


def first_in_line(waiting: list[Req]) -> Req | None:
    """The request that must go first this step, if any: the oldest of `waiting` (the
    requests admission reads) that `MAX_OVERTAKES` later ones have gone in past. Admission
    then stops at it until it fits, as at any request that does not fit in arrival order.
    (Counted for each request, by arrival: counted for the queue's head only, a request
    jumped forward or retracted, put in front of a starved one, started its count over.)"""
    first = None
    for req in waiting:
        if req.overtaken >= MAX_OVERTAKES and (first is None or req.arrival < first.arrival):
            first = req
    return first


def note_overtakes(waiting: list[Req], admitted: list[Req]) -> None:
    """After admission: each request of `waiting` left waiting counts those `admitted` for
    the first time that arrived after it (one that goes in again, jumped forward or
    retracted, passed it once already); those admitted start their counts over."""
    arrivals = sorted(req.arrival for req in admitted if not req.was_admitted)
    gone = set()
    for req in admitted:
        req.was_admitted, req.overtaken = True, 0
        gone.add(id(req))
    if not arrivals:
        return
    newest = arrivals[-1]
    for req in waiting:
        if req.arrival < newest and id(req) not in gone:
            req.overtaken += len(arrivals) - bisect.bisect_right(arrivals, req.arrival)
