"""The request-to-token table: request slot -> position -> KV slot.

A running request owns one row; `table[row, :seq_len]` are the KV-slot indices of its tokens
in order. Attention backends read this table to find a request's keys and values.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`num_reqs` rows of `context_len` KV-slot indices, with a free list of rows."""

    def __init__(self, num_reqs: int, context_len: int, device: str | torch.device) -> None:
        self.num_reqs = num_reqs
        self.context_len = context_len
        # [num_reqs, context_len]; unused entries point at the padding slot 0.
        self.table = torch.zeros(num_reqs, context_len, dtype=torch.int64, device=device)
        self._free_rows = list(range(num_reqs))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.num_reqs:
            raise RuntimeError(f"double free of request slot {row}")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(self.table.device)
