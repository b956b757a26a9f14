"""Slots for a decode run's further steps (`decode_run.py`): one allocation ahead for
each request and step, written to the request table before the run is launched, evicting
when short; nothing is retracted for a run, which stops short instead.

`RunSlots` holds these methods of `Scheduler` (a mixin: `Scheduler.__init__` sets every
attribute used here).
"""

from __future__ import annotations

import torch

from lmprog_runtime.request import Req
from lmprog_runtime.scheduled_batch import ScheduledBatch
from lmprog_runtime.transfer import host_ints


class RunSlots:
    """The decode-run side of `Scheduler`: slots for the steps after the first."""

    def extend_decode_run(
        self, batch: ScheduledBatch, steps: int, needs: list[int]
    ) -> list[torch.Tensor]:
        """Slots for up to `steps - 1` more decode steps of `batch` (a decode batch just
        scheduled), in the request table: a decode run (`decode_run.py`). Step k's slot of
        request i follows its slot of step k - 1; a request that needs fewer steps
        (`needs[i]`, its tokens left) gets the padding slot 0 past them, which no one reads
        (it has finished by then). Stops short where pages run out after evicting (nothing
        is retracted for a run). Returns each further step's slots ([n])."""
        rows = host_ints([req.req_pool_idx for req in batch.reqs])
        positions = host_ints(batch.prefix_lens)
        need = host_ints(needs)
        if self.allocator.page_size == 1:
            return self._extend_run_by_slots(rows, positions, need, steps - 1)
        last, extra = batch.out_cache_loc, []
        try:
            for k in range(1, steps):
                mine = need > k
                slots = self._alloc_next(last[mine])
                if slots is None:
                    break
                step = torch.zeros_like(last)  # (slot 0: the padding slot)
                step[mine] = slots
                extra.append(step)
                self.req_to_token.write_tokens(rows[mine], positions[mine] + k, slots)
                self._decay_new_token_ratio()  # once per decode step, as single steps do
                last = step
        except BaseException:
            for slots in extra:
                self.free_started_pages(slots)
            raise
        return extra

    def _alloc_next(self, last: torch.Tensor) -> torch.Tensor | None:
        """One slot after each of `last` (evicting when short); None if pages run out."""
        slots = self.allocator.alloc_decode(last)
        if slots is None:
            ps = self.allocator.page_size
            short = int(((last + 1) % ps == 0).sum()) * ps - self.allocator.num_free
            self._evict(short)
            slots = self.allocator.alloc_decode(last)
        return slots

    def continue_decode_run(
        self, reqs: list[Req], last: torch.Tensor, positions: list[int]
    ) -> torch.Tensor | None:
        """The first step's slots of a decode run that continues one not yet committed:
        one after each of `last` (the slots of `reqs`' last step there), written to the
        table at `positions`. None if pages run out after evicting."""
        slots = self._alloc_next(last)
        if slots is None:
            return None
        try:
            rows = host_ints([req.req_pool_idx for req in reqs])
            self.req_to_token.write_tokens(rows, host_ints(positions), slots)
        except BaseException:
            self.free_started_pages(slots)
            raise
        self._decay_new_token_ratio()
        return slots

    def _extend_run_by_slots(
        self, rows: torch.Tensor, positions: torch.Tensor, need: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """`extend_decode_run` on pages of one slot: every step's slots in one allocation
        and one table write."""
        if steps < 1:
            return []
        ahead = torch.arange(1, steps + 1, dtype=torch.int64, device="cpu")[:, None]
        mine = need[None, :] > ahead  # [steps, n]: the slots to allocate
        wanted = mine.sum(dim=1).cumsum(dim=0)  # slots for the first 1, 2, ... steps
        short = int(wanted[-1]) - self.allocator.num_free
        if short > 0:
            self._evict(short)
        steps = int((wanted <= self.allocator.num_free).sum())
        if steps == 0:
            return []
        mine = mine[:steps]
        grid = torch.zeros(mine.shape, dtype=torch.int64, device="cpu")  # (0: padding)
        grid[mine] = self.allocator.alloc(int(wanted[steps - 1]))
        table_rows = rows[None, :].expand(mine.shape)[mine]
        self.req_to_token.write_tokens(table_rows, (positions + ahead[:steps])[mine], grid[mine])
        for _ in range(steps):
            self._decay_new_token_ratio()  # once per decode step, as single steps do
        return list(grid.unbind(0))
