"""The request-to-token table: request slot -> position -> KV slot.

A running request owns one row; `table[row, :seq_len]` are the KV-slot indices of its
tokens in order. The table exists twice when the model runs on an accelerator:

- `host_table` (CPU) is the bookkeeping. The scheduler and the prefix cache read and write
  it between forwards, and every write goes through `write` / `write_tokens`. `host_rows`
  is the same memory as a numpy array, for the reads of one row's slots a request makes
  (a torch slice costs the loop about 2 us, numpy's 0.1).
- `table` (the model's device) is what attention kernels read. It is brought up to date in
  one place, `sync`, before each forward: the writes since the last sync travel in one
  host-to-device copy (the model runner's own, with the forward's inputs: `take_writes`,
  `apply_writes`).

On a CPU model both names are the same tensor and `sync` has nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmprog_runtime.transfer import host_slots, to_device


class ReqToTokenPool:
    """`num_reqs` rows of `context_len` KV-slot indices, with a free list of rows, plus one
    padding row (`padding_row`, never handed out) whose entries all point at slot 0.

    Example:
        >>> pool = ReqToTokenPool(4, 16, "cpu")
        >>> row = pool.alloc()
        >>> pool.write(row, 0, torch.tensor([5, 6, 7], device="cpu"))
        >>> pool.host_table[row, :3].tolist()
        [5, 6, 7]
    """

    def __init__(self, num_reqs: int, context_len: int, device: str | torch.device) -> None:
        self.num_reqs = num_reqs
        self.context_len = context_len
        self.device = torch.device(device)
        # [num_reqs + 1, context_len]; unused entries point at the padding slot 0.
        shape = (num_reqs + 1, context_len)
        self.host_table = torch.zeros(shape, dtype=torch.int64, device="cpu")
        self.host_rows: np.ndarray = self.host_table.numpy()
        self.table = (
            self.host_table
            if self.device.type == "cpu"
            else torch.zeros(shape, dtype=torch.int64, device=self.device)
        )
        self._free_rows = list(range(num_reqs))
        self._row_is_free = bytearray(b"\x01") * num_reqs  # (a double free told in O(1))
        # Entries written since the last sync (flat indices into the table), device only.
        self._pending: list[torch.Tensor] = []

    @property
    def padding_row(self) -> int:
        """A row of zeros: padded requests (CUDA-graph batches) read slot 0 through it."""
        return self.num_reqs

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._row_is_free[row] = 0
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.num_reqs or self._row_is_free[row]:
            raise RuntimeError(f"double free of request slot {row}")
        self._row_is_free[row] = 1
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor | np.ndarray) -> None:
        """`host_table[row, start : start + len(slots)] = slots` (host slots, int64: a CPU
        tensor or a numpy array)."""
        slots = host_slots(slots)
        n = slots.size
        self.host_rows[row, start : start + n] = slots
        if self.table is not self.host_table and n:
            first = row * self.context_len + start
            self._pending.append(torch.arange(first, first + n, device="cpu"))

    def write_rows(
        self,
        rows: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        slots: torch.Tensor | np.ndarray,
    ) -> None:
        """`write(rows[i], starts[i], ...)` of the next `counts[i]` of `slots` for each i
        (each row's slots one after another in `slots`): an extend batch's rows. A numpy
        slice a row, about 0.3 us each: the torch scatter it replaces took 40 us for 64
        prompts in a tight loop, and about 300 us in the engine loop's admission."""
        slots = host_slots(slots)
        table, at = self.host_rows, 0
        for row, start, n in zip(rows, starts, counts):
            table[row, start : start + n] = slots[at : at + n]
            at += n
        if self.table is not self.host_table and at:
            # Flat index of each slot written: its row's first entry, shifted by its place.
            first = np.asarray(rows, dtype=np.int64) * self.context_len + np.asarray(starts)
            offsets = np.cumsum(counts) - np.asarray(counts)
            flat = np.repeat(first - offsets, counts) + np.arange(at)
            self._pending.append(torch.from_numpy(flat))

    def write_tokens(
        self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """`host_table[rows[i], positions[i]] = slots[i]` for each i ([n] int64 host tensors)."""
        self.host_table[rows, positions] = slots
        if self.table is not self.host_table and slots.numel():
            self._pending.append(rows * self.context_len + positions)

    def sync(self) -> None:
        """Bring the device table up to date with the host one: the entries written since the
        last sync, with their current values, in one host-to-device copy."""
        writes = self.take_writes()
        if writes is not None:
            self.apply_writes(to_device(writes, self.device))

    def take_writes(self) -> torch.Tensor | None:
        """`sync` in two halves, for a caller that sends the writes with copies of its own:
        the entries written since the last sync as a [2, n] int64 host tensor (flat indices
        into the table; their current values), or None if there are none. An entry written
        twice appears twice, with the same value: the scatter needs no order."""
        if not self._pending:
            return None
        flat = torch.cat(self._pending)
        self._pending = []
        return torch.stack([flat, self.host_table.view(-1)[flat]])

    def restore_writes(self, writes: torch.Tensor) -> None:
        """`take_writes`'s entries back to the pending ones (their copy to the device
        failed): the next sync sends them, with the values the host table has then."""
        self._pending.insert(0, writes[0])

    def apply_writes(self, writes: torch.Tensor) -> None:
        """Write `take_writes`'s entries, on the device, to the device table."""
        self.table.view(-1)[writes[0]] = writes[1]
