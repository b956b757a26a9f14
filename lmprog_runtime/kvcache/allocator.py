"""The KV-slot allocator: hands out indices into the K/V buffers, a page at a time.

The pool is cut into pages of `page_size` consecutive slots. A request's tokens fill its
pages in order, so a page belongs to exactly one owner (one request, or one node of the
radix tree, whose edges are page-aligned). Page 0 (slots 0..page_size-1) is never handed
out: padded writes and masked gathers point at slot 0, so it may hold garbage at any time.
Allocation and freeing are exact; freeing a page that is already free raises, so leaks and
double frees show up in tests rather than as silent corruption. All of it is host
bookkeeping: slot indices live in CPU tensors and numpy arrays (the prefix cache's),
whatever device holds the K/V.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from lmprog_runtime.transfer import host_ints, host_slots

# Above this many slots a free finds repeats by sorting; below, with a set of Python ints.
_SET_CHECK_MAX = 256


class TokenSlotAllocator:
    """Free-list allocator over pages 1..num_pages (page 0 is reserved for padding).

    Example:
        >>> alloc = TokenSlotAllocator(8)
        >>> slots = alloc.alloc(3); alloc.num_free
        5
        >>> alloc.free(slots); alloc.num_free
        8
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size:
            raise ValueError(f"num_slots ({num_slots}) must be >= page_size ({page_size})")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # Page 0 reads as free: it is never handed out, and freeing it is refused with the
        # double frees, by the one check `free` makes. A numpy array, which `free` reads
        # and writes through numpy views of the pages: a torch op costs the loop several
        # times a numpy one, most of all the first after a stretch of Python, when its code
        # has left the CPU's caches (20-27 us for a copy of a few slots there). A take
        # marks its pages through a tensor on the same memory (one op a decode step).
        self._page_is_free = np.ones(self.num_pages + 1, dtype=np.bool_)
        self._page_is_free_t = torch.from_numpy(self._page_is_free)
        # Pages never handed out: `_fresh[_head:]` (a take moves the head: one view).
        self._fresh = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device="cpu")
        self._head = 0
        # Freed pages, a stack: a take reuses the pages freed last before any fresh one, so
        # the memory the pool touches follows the pages in use. The K/V buffers are mapped
        # lazily, and handing every page out once before reusing any made a long-running
        # engine's whole pool resident (3.9 GiB for SmolLM2's, serving 400 tokens at a
        # time). A free costs O(freed), never a copy of the whole free list.
        self._stack = np.empty(self.num_pages, dtype=np.int64)
        self._top = 0

    @property
    def num_slots(self) -> int:
        """Usable slots (whole pages)."""
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Free slots, counted in whole free pages."""
        return (self._fresh.numel() - self._head + self._top) * self.page_size

    def _take(self, num_pages: int) -> torch.Tensor | None:
        """`num_pages` free pages, those freed last first, then fresh ones; None if short."""
        reused = min(num_pages, self._top)
        head, fresh = self._head, num_pages - reused
        if fresh > self._fresh.numel() - head:
            return None
        pages = self._fresh[head : head + fresh]
        self._head = head + fresh
        if reused:
            top = self._top - reused
            # Popped in turn (one take of n is n takes of one); a copy: later frees write
            # over the stack.
            last_freed = torch.from_numpy(self._stack[top : self._top][::-1].copy())
            self._top = top
            pages = torch.cat([last_freed, pages]) if fresh else last_freed
        self._page_is_free_t.index_fill_(0, pages, False)
        return pages

    def pages_needed(self, num_tokens: int, last_slot: int | None = None) -> int:
        """Pages that `alloc(num_tokens, last_slot)` would take from the free list."""
        room = self._room_after(last_slot)
        return -(-max(0, num_tokens - room) // self.page_size)

    def alloc(self, num_tokens: int, last_slot: int | None = None) -> torch.Tensor | None:
        """Return `num_tokens` slot indices (int64) continuing after `last_slot`, or None.

        `last_slot` is the slot of the owner's previous token: the rest of its page is used
        first. None starts on a fresh page.
        """
        ps = self.page_size
        room = min(self._room_after(last_slot), num_tokens)
        num_pages = -(-(num_tokens - room) // ps)
        pages = self._take(num_pages)
        if pages is None:
            return None
        if ps == 1:
            return pages
        offsets = torch.arange(ps, device="cpu")
        fresh = (pages[:, None] * ps + offsets).reshape(-1)[: num_tokens - room]
        if room == 0:
            return fresh
        assert last_slot is not None
        tail = torch.arange(last_slot + 1, last_slot + 1 + room, device="cpu")
        return torch.cat([tail, fresh])

    def alloc_fresh(self, counts: Sequence[int]) -> torch.Tensor | None:
        """`alloc(n)` for each n of `counts` (owners that each start on a fresh page), from
        one take of the free list: their slots one after another, in order; None if the
        pages run short (then nothing is taken)."""
        ps = self.page_size
        pages_each = [-(-n // ps) for n in counts]
        pages = self._take(sum(pages_each))
        if pages is None or ps == 1:
            return pages
        slots = (pages[:, None] * ps + torch.arange(ps, device="cpu")).reshape(-1)
        if all(n % ps == 0 for n in counts):
            return slots
        # Each owner's first n slots of its pages (the rest of its last page stays its own).
        blocks = host_ints([p * ps for p in pages_each])
        starts = host_ints(list(itertools.accumulate(pages_each, initial=0))[:-1]) * ps
        within = torch.arange(slots.numel(), device="cpu") - starts.repeat_interleave(blocks)
        return slots[within < host_ints(counts).repeat_interleave(blocks)]

    def alloc_decode(self, last_slots: torch.Tensor) -> torch.Tensor | None:
        """One new slot after each of `last_slots` ([batch] int64); None if pages run out."""
        ps = self.page_size
        if ps == 1:
            return self.alloc(int(last_slots.numel()))
        needs_page = (last_slots + 1) % ps == 0
        pages = self._take(int(needs_page.sum()))
        if pages is None:
            return None
        slots = last_slots + 1
        slots[needs_page] = pages * ps
        return slots

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        """Free the pages holding `slots` (an owner frees whole pages: it owns them all), a
        CPU tensor or a numpy array (the prefix cache's). Keeps nothing of `slots`: a view
        of a table row may be freed and the row reused."""
        slots = host_slots(slots)
        if slots.size == 0:
            return
        ps = self.page_size
        if ps > 1:
            index = np.unique(slots.reshape(-1) // ps)
            repeated = False
        else:  # (a copy: `slots` may be a view of a row that is reused)
            index = slots.astype(np.int64).reshape(-1)
            if index.size <= _SET_CHECK_MAX:
                repeated = len(set(index.tolist())) != index.size
            else:
                repeated = np.unique(index).size != index.size
        # One check for both errors (a request's finish frees up to six times, and each
        # op costs the loop microseconds); which one it is is told apart only then.
        if repeated or self._page_is_free[index].any():
            if (index == 0).any():
                raise RuntimeError("slot 0 is reserved and never allocated")
            raise RuntimeError("double free of KV slots")
        self._page_is_free[index] = True
        self._stack[self._top : self._top + index.size] = index[::-1]  # (pop in order)
        self._top += index.size

    def _room_after(self, last_slot: int | None) -> int:
        if last_slot is None or self.page_size == 1:
            return 0
        return (self.page_size - 1 - last_slot % self.page_size) % self.page_size
