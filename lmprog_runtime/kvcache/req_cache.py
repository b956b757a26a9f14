"""Where requests meet the prefix cache: claim a cached prefix, give computed KV back.

A request's row in the request-to-token table starts with `tree_len` slots owned by the
radix tree (locked through `req.last_node`), followed by slots the request owns itself.
`cache_unfinished` moves what a request has computed so far into the tree (so others can
share it at once); `cache_finished` does the same at the end, frees the request's own
slots and its row, and drops its lock. With the cache disabled, nothing is shared. All of
it reads and writes the host side of the request table (`ReqToTokenPool.host_table`,
through its numpy view `host_rows`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.radix_node import PrefixMatch, TreeNode
from lmprog_runtime.kvcache.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


class ReqCache:
    def __init__(
        self,
        tree: RadixCache | None,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
    ) -> None:
        self.tree = tree  # None: the prefix cache is disabled
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size

    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    def match(self, req: Req) -> int:
        """Match `req` against the tree (no lock yet); remembers and returns the prefix length."""
        if self.tree is None or req.kv_len > 0:
            req.match = None  # a request that already holds its K/V (jump-forward) continues
            return req.kv_len
        limit = req.max_prefix_len()
        # (a prompt alone is read in place; a retracted request's output joins it)
        key = req.input_ids if not req.output_ids else req.fill_ids_between(0, limit)
        # A waiting request is matched at each scheduling: the same prompt resumes at the
        # node its last match ended at (`RadixCache.match_path`).
        last, tree = req.match, self.tree
        since = None
        if last is not None and last.key is key:
            if last.length == 0 and last.node is tree.root and not tree.starts_an_edge(key):
                return 0  # (nothing cached starts it, as before: most prompts of a queue)
            since = last.node
        req.match = PrefixMatch(*tree.match_path(key, limit, since), key)
        return req.match.length

    def claim_prefix(self, req: Req) -> TreeNode | None:
        """Lock the matched prefix and write its slots at the start of the request's row;
        returns the node claimed (None: nothing matched). A claim is no hit yet: admission
        counts one for the requests that go in (`RadixCache.count_hit`)."""
        match: PrefixMatch | None = req.match
        req.match = None
        if match is None or match.length == 0:
            return None
        n = match.length
        self.req_to_token.write(req.req_pool_idx, 0, match.slots)
        self.tree.inc_lock_ref(match.node)
        req.last_node, req.tree_len, req.kv_len = match.node, n, n
        return match.node

    def cache_unfinished(self, req: Req) -> None:
        """Share what `req` has computed so far; its row then points at the tree's slots."""
        if self.tree is None:
            return
        n = req.kv_len // self.page_size * self.page_size
        if n <= req.tree_len:
            return
        start = req.tree_len  # (the tree has the first ones: the walk starts past them)
        key = req.fill_ids_between(start, n)
        value = self.req_to_token.host_rows[req.req_pool_idx, start:n]  # (insert copies)
        below = _prefix_node(req, start)
        already, node = self.tree.insert_node(key, value, below=below, locking=True)
        if already > start:
            # Slots we computed for tokens the tree already had are duplicates: drop ours,
            # and read the tree's instead (past them the tree holds our own).
            self.allocator.free(value[: already - start])
            slots = self.tree.path_slots(node, start)  # (no walk from the root)
            self.req_to_token.write(req.req_pool_idx, start, slots)
        self.tree.inc_lock_ref(node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.tree_len = node, n

    def cache_finished(self, req: Req, insert: bool = True) -> None:
        """Give a leaving request's KV to the tree (unless `insert` is False), free the rest."""
        if req.req_pool_idx is None:
            return
        table, row = self.req_to_token.host_rows, req.req_pool_idx
        kv_len = req.kv_len
        start = req.tree_len
        if self.tree is not None and insert:
            n = kv_len // self.page_size * self.page_size
            if n > start:  # (the walk starts past the tree's own first tokens)
                value = table[row, start:n]  # (a view: `insert` copies what it keeps)
                key = req.fill_ids_between(start, n)
                already, _ = self.tree.insert_node(key, value, below=_prefix_node(req, start))
                if already > start:
                    self.allocator.free(value[: already - start])
                start = n
        if kv_len > start:
            self.allocator.free(table[row, start:kv_len])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.tree_len, req.kv_len = None, None, 0, 0

    def evict(self, num_tokens: int) -> int:
        return self.tree.evict(num_tokens) if self.tree is not None and num_tokens > 0 else 0


def _prefix_node(req: Req, start: int) -> TreeNode | None:
    """The node `req`'s cached prefix (its first `start` tokens) ends at, where putting its
    next tokens in the tree starts; None if it holds none."""
    node = req.last_node
    if node is not None and node.depth != start:  # (a bug: never inserted off its path)
        raise RuntimeError(
            f"request {req.rid}: its cached prefix is {node.depth} tokens, its row says {start}"
        )
    return node
