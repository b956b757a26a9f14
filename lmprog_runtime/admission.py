"""Admission: which waiting requests the next extend computes, and how much of each.

Prompts are matched against the radix tree (only uncached suffixes are computed) and
ordered by the schedule policy; a request group is admitted whole (or, too large to ever
fit, in parts); a request that would compute a prefix another admitted one computes now
waits a step to reuse it; one long prompt at a time goes in chunks beside the decodes; an
optimistic share of each request's future output is set aside (`new_token_ratio`); and
while requests decode, admission may wait a few steps to admit several at once
(`admission_wait.py`). A request whose admission raises is refused (a group's members
with it); the others go on.

`Admission` holds these methods of `Scheduler` (a mixin: `Scheduler.__init__` sets every
attribute used here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.request import Req
from lmprog_runtime.schedule_policy import (
    MAX_CACHE_AWARE_QUEUE,
    SHARED_PREFIX_BLOCK,
    PrefixBlocks,
    first_in_line,
    note_overtakes,
)
from lmprog_runtime.scheduled_batch import ScheduledBatch

if TYPE_CHECKING:
    from lmprog_runtime.kvcache.radix_node import TreeNode


class Admission:
    """The extend side of `Scheduler`: admitting waiting requests."""

    def _schedule_extend(self, num_decoding: int = 0) -> ScheduledBatch | None:
        """The extend batch of this step: the chunked request's next chunk and the waiting
        requests admitted now (`num_decoding`: the running requests that decode this step
        whatever it admits; admission may wait while there are some)."""
        cfg = self.config
        chunk_size = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None
        budget = cfg.max_prefill_tokens
        entries: list[tuple[Req, int]] = []
        num_active = len(self.running)

        if self.chunked_req is not None:
            req = self.chunked_req
            n = min(req.seq_len - req.kv_len, budget, chunk_size or budget)
            entries.append((req, n))
            budget -= n
            num_active += 1
        # Rows held by waiting requests (jumped forward, or a group's members admitted in
        # parts): such requests need no free row.
        held = self.req_to_token.num_reqs - self.req_to_token.num_free - num_active
        if self._room(num_active, held) <= 0:
            # A full batch admits nothing: the queue is not read (a dataset's may hold
            # thousands; as SGLang's scheduler, which tries no prefill then either).
            return self._alloc_extend(entries) if entries else None
        waiting, end = self._eligible()
        if not waiting and not entries:
            self.admission_wait.reset()
            return None  # (every decode step: nothing is computed for it)
        # The chunked prompt's next chunk is allocated first: counted here, a request
        # admitted beside it can no longer lock the prefix the chunk must evict (both then
        # failed to allocate, at every step).
        used = self._reserved_tokens() + sum(self._rest_needed(r) for r, _ in entries)
        if not entries and num_decoding and self._admission_waits(waiting, num_active, used):
            self.stats.add("admission_waits")
            return None
        admitted: set[int] = set()
        blocked: set[int] = set()  # groups that cannot go in now: tried once per step
        queued: set[int] | None = None  # ids in `self.waiting`, once a group needs them
        blocks = PrefixBlocks()
        first = first_in_line(waiting)  # (passed by too many: it blocks the rest)
        for req in self.policy.order(waiting, first):
            if id(req) in admitted or id(req.group) in blocked:
                continue
            # (a lone request is in `waiting` still: only its own admission refuses it;
            # a group going in parts leaves its admitted members in `waiting` until the
            # end of the step: they are not claimed again with the rest)
            members = [req]
            if req.group is not None:
                # (a set: `m in self.waiting` made a group of G in a queue of W cost G x W
                # for each of its members, and fork(4096)'s admission half its run)
                queued = {id(r) for r in self.waiting} if queued is None else queued
                members = [
                    m for m in req.group.members if id(m) not in admitted and id(m) in queued
                ]
            if len(members) == 1 and req.kv_len == 0 and self._shares_uncached_prefix(req, blocks):
                continue  # compute the shared prefix once: this one reuses it next step
            room = self._room(num_active, sum(m.req_pool_idx is not None for m in members))
            if len(members) > room:
                if req.group is not None and not entries and not self.running and room > 0:
                    members = members[:room]  # a group too big to ever fit goes in parts
                elif req.group is not None and req is not first:
                    blocked.add(id(req.group))
                    continue
                elif room <= 0 < self.config.max_running_requests - num_active:
                    continue  # no free row for it: a request holding one may still go in
                else:
                    break
            try:
                # Lock the matched prefixes first: what is left evictable is then exact.
                claimed, held = {}, {id(member): member.kv_len for member in members}
                nodes = {}  # the prefix each claimed (a hit, if the member goes in)
                for member in members:
                    self.fault("schedule", member)
                    if member is not req:  # (the order matches only the request it gives)
                        self.req_cache.match(member)
                    claimed[id(member)], nodes[id(member)] = self._claim(member)
                plan = self._plan_admission(members, entries, budget, chunk_size, used)
            except Exception as error:  # noqa: BLE001 - these fail, the others are admitted
                self._refuse(members, error)
                queued = None  # (they left the queue)
                continue
            planned = {id(m) for m, _, _ in plan or ()}
            for member in members:
                if id(member) not in planned:  # waits: give back its lock, row and K/V
                    self.give_back(member, held[id(member)])
            if not plan:
                if req.group is not None and req is not first:
                    blocked.add(id(req.group))  # (each member would claim them all again)
                    continue  # a blocked group must not stall the rest (`first_in_line`)
                # A request that does not fit stops admission, as in SGLang: skipped past, a
                # request that needs the running ones' room never got it under steady load.
                break
            for member, n, need in plan:
                if nodes[id(member)] is not None:  # (one that waits gives it back: no hit)
                    self.req_cache.tree.count_hit(nodes[id(member)])
                self.stats.add("cached_tokens", claimed[id(member)])
                member.cached_tokens += claimed[id(member)]
                entries.append((member, n))
                admitted.add(id(member))
                blocks.add(member.fill_ids)
                budget -= n
                num_active += 1
                used += need
            if budget <= 0:
                break
        if admitted:
            note_overtakes(waiting, [r for r, _ in entries if id(r) in admitted])
        if not entries:
            return None
        if admitted:
            self.admission_wait.reset()
        head = self.waiting[:end]
        kept = [r for r in head if id(r) not in admitted]
        if len(head) - len(kept) == len(admitted):
            self.waiting[:end] = kept  # (the rest of a long queue is not read)
        else:  # (a group's members from further on)
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
        return self._alloc_extend(entries)

    def _admission_waits(self, waiting: list[Req], num_active: int, used: int) -> bool:
        """Whether admission waits this step, to admit several requests in one later
        (`AdmissionWait.holds`). Called only while requests decode: the step is theirs."""
        wait = self.admission_wait
        if not wait.can_hold:  # (most steps: the room and the pool are not even read)
            return False
        if self.run_choice is not None and not self.run_choice.is_probing:
            return False
        available = self.allocator.num_free + self.req_cache.evictable_size - used
        return wait.holds(waiting, self._room(num_active), available, self.new_token_ratio)

    def _eligible(self) -> tuple[list[Req], int]:
        """The waiting requests admission may consider (a group's once all its members
        came), in order, up to one more than the cache-aware policies order (past that,
        admission goes by arrival), and how far into the queue they reach: a queue of
        thousands (one `generate` of a whole dataset) is not read whole at every step."""
        eligible = []
        for end, req in enumerate(self.waiting, 1):
            if req.group is None or req.group.is_ready:
                eligible.append(req)
                if len(eligible) > MAX_CACHE_AWARE_QUEUE:
                    return eligible, end
        return eligible, len(self.waiting)

    def _slots_needed(self, req: Req, n: int) -> int:
        """KV slots that extending `req` by `n` tokens takes, in whole pages."""
        return self.allocator.pages_needed(n, self._last_slot(req)) * self.allocator.page_size

    def _rest_needed(self, req: Req) -> int:
        """KV slots the chunked request's remaining chunks and its output take."""
        return self._slots_needed(req, req.seq_len - req.kv_len) + self._output_reserve(req)

    def _output_reserve(self, req: Req) -> int:
        """Slots set aside for `req`'s output (the share `new_token_ratio` expects)."""
        return int((req.max_new_tokens - len(req.output_ids)) * self.new_token_ratio)

    def _room(self, num_active: int, holding: int = 0) -> int:
        """How many more requests may run next to `num_active`, `holding` of them holding
        their request-table rows already (a request that jumped forward keeps its row while
        it waits to extend: with every row so held, nothing was admitted, and the loop
        failed a request as unschedulable)."""
        rows = self.req_to_token.num_free + max(holding, 0)
        return min(self.config.max_running_requests - num_active, rows)

    def _note_chunked(self, req: Req, n: int) -> None:
        """`req` computes `n` tokens now: if that leaves part of its prompt, it is the
        request prefilled in chunks."""
        if req is not self.chunked_req and req.kv_len + n < req.seq_len:
            self.chunked_req = req

    def _plan_admission(
        self,
        members: list[Req],
        entries: list[tuple[Req, int]],
        budget: int,
        chunk_size: int | None,
        used: int,
    ) -> list[tuple[Req, int, int]] | None:
        """(request, extend length, tokens to set aside) for admitting all `members` now,
        or None if they must wait. Their prefixes are already claimed (locked)."""
        available = self.allocator.num_free + self.req_cache.evictable_size - used
        plan = []
        for req in members:
            extend = req.seq_len - req.kv_len
            # One request at a time is partly prefilled: not if one already is, or if an
            # entry planned this step already is (chunked_req is set only at allocation).
            # (Asked only of a request too long to go whole: it reads every entry.)
            too_long = extend > budget or (chunk_size is not None and extend > chunk_size)
            can_chunk = (
                too_long
                and chunk_size is not None
                and len(members) == 1
                and self.chunked_req is None
                and all(r.kv_len + n >= r.seq_len for r, n in entries)
                and (req.logprob_start_len < 0 or req.input_logprobs_done)
            )
            if extend > budget:
                if can_chunk and budget >= self.allocator.page_size:
                    extend = budget
                elif plan and not entries:
                    return plan  # a group larger than the budget is admitted in parts
                elif entries or plan:
                    return None
            if chunk_size is not None and can_chunk and extend > chunk_size:
                extend = chunk_size
            # A prompt going in chunks needs room for all of them (as SGLang's check of the
            # whole prompt): room for its first chunk only, it went in and was retracted
            # once the pool filled, its chunks computed again.
            need = self._slots_needed(req, req.seq_len - req.kv_len)
            reserve = self._output_reserve(req)
            if need + reserve > available and (entries or plan or self.running):
                if plan and not entries and not self.running:
                    return plan  # a group larger than the pool is admitted in parts
                return None
            available -= need + reserve
            budget -= extend
            plan.append((req, extend, need + reserve))
        return plan

    @staticmethod
    def _shares_uncached_prefix(req: Req, blocks: PrefixBlocks) -> bool:
        prefix = req.match.length if req.match is not None else 0
        ids = req.input_ids if not req.output_ids else req.fill_ids  # (no copy of a prompt)
        return blocks.shared_len(ids) >= prefix + SHARED_PREFIX_BLOCK

    def _claim(self, req: Req) -> tuple[int, TreeNode | None]:
        """Lock the request's matched prefix; returns how many prompt tokens of it the cache
        served (not its output's: a forced text another request computed counted as cached,
        nor those it held before it gave them back: retracted), and the node it claimed."""
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_to_token.alloc()
        before = max(req.kv_len, req.held_len)
        node = self.req_cache.claim_prefix(req)
        prompt = req.prompt_len
        return max(0, min(req.kv_len, prompt) - min(before, prompt)), node

    def _alloc_extend(self, entries: list[tuple[Req, int]]) -> ScheduledBatch:
        ps = self.allocator.page_size
        if all(req.kv_len % ps == 0 for req, _ in entries):
            # Each starts on a fresh page: all of their slots in one take, and their rows of
            # the request table in one write (each alone costs the loop several CPU ops).
            counts = [n for _, n in entries]
            slots = self.allocator.alloc_fresh(counts)
            if slots is not None:
                return self._extend_batch(entries, counts, slots)
        slots_list, reqs, prefix_lens, extend_lens = [], [], [], []
        for req, n in entries:
            last = self._last_slot(req)
            slots = self.allocator.alloc(n, last)
            if slots is None:
                slots = self._alloc_evicting(n, last)
            if slots is None:
                # Cannot happen when admission's accounting is right; if it does, this
                # request and the rest wait for the next step instead of failing.
                unadmitted = [r for r, _ in entries[len(reqs) :] if r is not self.chunked_req]
                for later in unadmitted:
                    self.give_back(later)  # (its claim counted: not again when it goes in)
                self.waiting[:0] = unadmitted
                break
            self.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
            slots_list.append(slots)
            reqs.append(req)
            prefix_lens.append(req.kv_len)
            extend_lens.append(n)
            self._note_chunked(req, n)
        if not reqs:
            return None  # type: ignore[return-value]
        return ScheduledBatch(
            ForwardMode.EXTEND, reqs, torch.cat(slots_list), prefix_lens, extend_lens
        )

    def _alloc_evicting(self, n: int, last: int | None) -> torch.Tensor | None:
        """`n` slots after `last`, evicting for them, and then, where still short, with the
        K/V that waiting requests hold given back: a request that jumped forward holds its
        slots, locked, until it extends again, and the chunked prompt's next chunk (computed
        before any waiting request goes in) once waited for them at every step, with
        nothing decoding to give them back (`give_back_held`): every request hung."""
        need = self.allocator.pages_needed(n, last) * self.allocator.page_size
        self._evict(need)
        slots = self.allocator.alloc(n, last)
        if slots is None and self.give_back_held():
            self._evict(need)
            slots = self.allocator.alloc(n, last)
        return slots

    def _extend_batch(
        self, entries: list[tuple[Req, int]], counts: list[int], slots: torch.Tensor
    ) -> ScheduledBatch:
        """The extend batch of `entries`, given their `slots` (`counts[i]` for entry i, one
        after another): each request's row gets its slots from its next position on."""
        reqs = [req for req, _ in entries]
        prefix_lens = [req.kv_len for req in reqs]
        rows = [req.req_pool_idx for req in reqs]
        self.req_to_token.write_rows(rows, prefix_lens, counts, slots)
        for req, n in entries:
            self._note_chunked(req, n)
        return ScheduledBatch(ForwardMode.EXTEND, reqs, slots, prefix_lens, counts)
