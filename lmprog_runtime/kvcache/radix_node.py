"""The radix tree's parts (`radix_cache.py`): a node, which owns the KV slots of the tokens
on its edge, and the records a match returns.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

_node_ids = itertools.count()


# No slots (read only: a miss costs no new array).
NO_SLOTS = np.empty(0, dtype=np.int64)
NO_SLOTS.flags.writeable = False


class TreeNode:
    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access",
        "hit_count",
        "node_id",
        "depth",
    )

    def __init__(self, parent: TreeNode | None, key: list[int], value: np.ndarray) -> None:
        self.node_id = next(_node_ids)  # breaks eviction ties deterministically
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of the edge into this node
        self.value = value  # [len(key)] int64 KV slots (numpy)
        # Tokens on its path from the root (a split keeps the lower node's: its path's end).
        self.depth = (parent.depth if parent is not None else 0) + len(key)
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0


class MatchResult(NamedTuple):
    slots: torch.Tensor  # [prefix_len] int64 KV slots of the matched prefix
    node: TreeNode  # deepest node of the match (lock it to keep the prefix)


class PrefixMatch:
    """A waiting request's match (`RadixCache.match_path`): its deepest node and length,
    its slots joined only when read (most matches only order the queue; the one admitted
    reads them)."""

    __slots__ = ("node", "length", "_values", "key")

    def __init__(
        self, node: TreeNode, length: int, values: list[np.ndarray], key: list[int]
    ) -> None:
        self.node, self.length, self._values = node, length, values
        self.key = key  # the list matched (a later match of the same list resumes at node)

    @property
    def slots(self) -> np.ndarray:
        """[length] int64 KV slots of the matched prefix (read only: may be a node's own)."""
        return joined(self._values)


def joined(values: list[np.ndarray]) -> np.ndarray:
    """`values` one after another (one of them itself, read only: a node's own)."""
    if len(values) < 2:
        return values[0] if values else NO_SLOTS
    return np.concatenate(values)
