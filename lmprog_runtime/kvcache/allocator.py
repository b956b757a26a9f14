"""The KV-slot allocator: hands out indices into the K/V buffers, one slot per token.

Slot 0 is never handed out: padded writes and masked gathers point at it, so it may hold
garbage at any time. Allocation and freeing are exact; freeing a slot that is already free
raises, so leaks and double frees show up in tests rather than as silent corruption.
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free-list allocator over slots 1..num_slots (slot 0 is reserved for padding).

    Example:
        >>> alloc = TokenSlotAllocator(8)
        >>> slots = alloc.alloc(3); alloc.num_free
        5
        >>> alloc.free(slots); alloc.num_free
        8
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._is_free = torch.ones(num_slots + 1, dtype=torch.bool)
        self._is_free[0] = False
        self._free_slots = torch.arange(1, num_slots + 1, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return int(self._free_slots.numel())

    def can_alloc(self, num_tokens: int) -> bool:
        return num_tokens <= self.num_free

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Return `num_tokens` free slot indices (int64), or None when there are not enough."""
        if num_tokens > self.num_free:
            return None
        slots = self._free_slots[:num_tokens]
        self._free_slots = self._free_slots[num_tokens:]
        self._is_free[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).flatten()
        if bool((slots == 0).any()):
            raise RuntimeError("slot 0 is reserved and never allocated")
        if bool(self._is_free[slots].any()) or slots.unique().numel() != slots.numel():
            raise RuntimeError("double free of KV slots")
        self._is_free[slots] = True
        self._free_slots = torch.cat([self._free_slots, slots])

    def clear(self) -> None:
        """Mark every slot free again (used by flush when nothing is running)."""
        self._is_free.fill_(True)
        self._is_free[0] = False
        self._free_slots = torch.arange(1, self.num_slots + 1, dtype=torch.int64)
