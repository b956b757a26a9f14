"""Continuous batching over the radix prefix cache: what runs in the next forward.

Each step is an extend (prefill) of newly admitted requests, with one decode token of
every running request mixed in (a decode is an extend of one token), or a decode step of
every running request when nothing is admitted. Admission (`admission.py`) matches prompts
against the radix tree so only uncached suffixes are computed, orders the queue by the
schedule policy, admits a request group whole (in parts only if it could never fit),
splits long prompts into chunks that run beside the decodes, and reserves an (optimistic)
share of each request's future output. Here: the step's choice, decode slots (a decode
run's: `run_slots.py`), and what follows a forward or a finish. When the pool runs dry it evicts
unlocked cache leaves first, then retracts running requests (their computed tokens go to
the cache, they requeue, and resume exactly where they were). The scheduler never touches
the model's tensors: slots and table rows are host tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from lmprog_runtime.admission import Admission
from lmprog_runtime.admission_wait import AdmissionWait
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.request import Req
from lmprog_runtime.run_choice import RunChoice
from lmprog_runtime.run_slots import RunSlots
from lmprog_runtime.schedule_policy import SchedulePolicy
from lmprog_runtime.scheduled_batch import ScheduledBatch
from lmprog_runtime.stats import EngineStats
from lmprog_runtime.transfer import host_ints

# Share of a request's remaining max_new_tokens reserved at admission; it decays towards
# the minimum while decoding goes well and jumps back up after a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler(Admission, RunSlots):
    def __init__(
        self,
        config: RuntimeConfig,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        req_cache: ReqCache,
        stats: EngineStats,
        admission_wait_steps: int = 0,
        run_choice: RunChoice | None = None,
    ) -> None:
        """`admission_wait_steps`: `RuntimeConfig.admission_wait_steps` as resolved for the
        engine (None there is 8 where single decode steps replay CUDA graphs, else 0).
        `run_choice`: with `decode_steps="auto"`, the engine's choice."""
        self.config = config
        self.admission_wait = AdmissionWait(
            admission_wait_steps, config.max_running_requests, config.max_prefill_tokens
        )
        # While the choice takes decode runs, admission does not wait (a run's end makes it
        # wait already).
        self.run_choice = run_choice
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.req_cache = req_cache
        self.stats = stats
        self.policy = SchedulePolicy(config.schedule_policy, req_cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # partly prefilled, continues next extend
        self._ratio_scale = config.schedule_conservativeness
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self._ratio_scale
        self._last_was_extend = False
        self._refused: list[tuple[Req, Exception]] = []  # admission raised for these
        self.fault: Callable[[str, Req], None] = lambda point, req: None  # a test hook

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    @property
    def decoding(self) -> list[Req]:
        """The running requests that decode next step: not those whose last token (still
        being drawn, with overlap scheduling) is their last by max_new_tokens."""
        return [r for r in self.running if len(r.output_ids) < r.max_new_tokens]

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    # ---- choosing the next batch ----------------------------------------------------------
    def next_batch(self) -> ScheduledBatch | None:
        decoding = self.decoding
        if self.chunked_req is not None and decoding and self._last_was_extend:
            batch = self._schedule_decode(decoding)  # a long prompt must not stall decoding
        else:
            batch = self._schedule_extend(len(decoding))
            if batch is not None and decoding and not self.config.disable_mixed_batches:
                self._mix_decodes(batch, decoding)
            if batch is None and decoding:
                batch = self._schedule_decode(decoding)
        self._last_was_extend = (
            batch is not None and batch.mode is ForwardMode.EXTEND and not batch.num_decodes
        )
        return batch

    def _mix_decodes(self, batch: ScheduledBatch, decoding: list[Req]) -> None:
        """Add one decode token of each `decoding` request to an extend batch, if a slot for
        each is free now (otherwise they decode next step, evicting or retracting there)."""
        rows, kv_lens = self._decode_positions(decoding)
        slots = self._alloc_decode(rows, kv_lens)
        if slots is None:
            return
        self._write_decode_slots(rows, kv_lens, slots)
        batch.reqs += decoding
        batch.out_cache_loc = torch.cat([batch.out_cache_loc, slots])
        batch.prefix_lens += kv_lens.tolist()
        batch.extend_lens += [1] * len(decoding)
        batch.num_decodes = len(decoding)
        self._decay_new_token_ratio()

    def _decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO * self._ratio_scale, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def _reserved_tokens(self) -> int:
        remaining = sum(r.max_new_tokens - len(r.output_ids) for r in self.running)
        return int(remaining * self.new_token_ratio)

    def _schedule_decode(self, decoding: list[Req]) -> ScheduledBatch | None:
        slots, rows, kv_lens, reqs = self._alloc_decode_slots(decoding)
        if not reqs:
            return None
        self._write_decode_slots(rows, kv_lens, slots)
        self._decay_new_token_ratio()
        prefix_lens = kv_lens.tolist()
        return ScheduledBatch(ForwardMode.DECODE, reqs, slots, prefix_lens, [1] * len(reqs))

    def _alloc_decode_slots(
        self, decoding: list[Req]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Req]]:
        """One new slot per `decoding` request (evicting, then retracting, when short).
        Returns (slots, table rows, positions), each [n], and the n requests that got one
        (those not retracted)."""
        while True:
            rows, kv_lens = self._decode_positions(decoding)
            slots = self._alloc_decode(rows, kv_lens)
            if slots is not None:
                return slots, rows, kv_lens, decoding
            short = self._decode_pages(rows, kv_lens) * self.allocator.page_size
            short -= self.allocator.num_free
            if self._evict(short) >= short:
                continue
            if len(decoding) < len(self.running):
                # (overlap) the others finish at their next check, freeing their slots:
                # nothing decodes until then, and nothing is retracted for room they give.
                return kv_lens[:0], rows[:0], kv_lens[:0], []
            if self.give_back_held():  # (their K/V are evictable now)
                continue
            victim = self._pick_victim(decoding)
            if victim is None:
                # Admission checks every request fits the pool alone, so this cannot happen.
                raise RuntimeError("KV pool exhausted by a single request")
            self.retract(victim)
            decoding = [r for r in decoding if r is not victim]

    def _decode_positions(self, decoding: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per `decoding` request: its table row and its next position."""
        rows = host_ints([r.req_pool_idx for r in decoding])
        return rows, host_ints([r.kv_len for r in decoding])

    def _last_slots(self, rows: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
        """The KV slot of each request's position before `kv_lens` (running requests always
        hold K/V, so there is one)."""
        return self.req_to_token.host_table[rows, kv_lens - 1]

    def _alloc_decode(self, rows: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """A new slot for each request's position `kv_lens`, on its last page while it has
        room; None if pages run out. (Pages of one slot: no last slot to read.)"""
        if self.allocator.page_size == 1:
            return self.allocator.alloc(int(kv_lens.numel()))
        return self.allocator.alloc_decode(self._last_slots(rows, kv_lens))

    def _decode_pages(self, rows: torch.Tensor, kv_lens: torch.Tensor) -> int:
        """The fresh pages `_alloc_decode` takes: one for each request whose last page is
        full."""
        ps = self.allocator.page_size
        if ps == 1:
            return int(kv_lens.numel())
        return int(((self._last_slots(rows, kv_lens) + 1) % ps == 0).sum())

    def _write_decode_slots(
        self, rows: torch.Tensor, kv_lens: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.req_to_token.write_tokens(rows, kv_lens, slots)

    def _pick_victim(self, decoding: list[Req]) -> Req | None:
        if self.chunked_req is not None:
            return self.chunked_req
        if len(decoding) <= 1:
            return None
        # The request that has made the least progress loses the least by recomputing.
        return min(decoding, key=lambda r: (len(r.output_ids), -r.prompt_len))

    def jump_forward(self, req: Req) -> None:
        """`req`'s output grew by forced tokens without K/V: extend it next, then decode."""
        if req in self.running:  # (with overlap scheduling it may have been retracted)
            self.running.remove(req)
            self.waiting.insert(0, req)

    def retract(self, req: Req) -> None:
        """Give `req`'s computed tokens to the cache, free its slots and requeue it."""
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self.give_back(req)
        self.waiting.insert(0, req)
        self.stats.add("retracted_requests")
        self.new_token_ratio = min(1.0, 2 * INIT_NEW_TOKEN_RATIO) * self._ratio_scale

    def give_back(self, req: Req, held: int | None = None) -> None:
        """`req`, to wait again, gives its K/V to the cache (claimed back on its admission)
        and frees its row and slots; `held`: how many of its tokens were its own before
        (default: all it has; a prefix it claimed just now was not)."""
        req.held_len = max(req.held_len, req.kv_len if held is None else held)
        self.req_cache.cache_finished(req)

    def give_back_held(self) -> int:
        """Waiting requests that still hold K/V (one that jumped forward waits to extend
        its forced tokens) give it back; returns how many did. Admission may never reach
        them (it stops at the first request that does not fit): their slots, held, once
        left a running request no room to decode, and every request failed."""
        held = [r for r in self.waiting if r.req_pool_idx is not None]
        for req in held:
            self.give_back(req)
        return len(held)

    def _evict(self, num_tokens: int) -> int:
        freed = self.req_cache.evict(num_tokens)
        if freed:
            self.stats.add("evicted_tokens", freed)
        return freed

    def _last_slot(self, req: Req) -> int | None:
        if req.kv_len == 0:
            return None
        return int(self.req_to_token.host_rows[req.req_pool_idx, req.kv_len - 1])

    # ---- after the forward ---------------------------------------------------------------
    def on_forward_done(self, batch: ScheduledBatch) -> list[Req]:
        """The new tokens' K/V are in the pool. Returns the requests whose prompt is now
        fully computed (they sample their next token from this forward's logits)."""
        if batch.mode is ForwardMode.DECODE:
            for req in batch.reqs:
                req.kv_len += 1
            batch.kv_committed = True  # (a failure after this must not count it again)
            return list(batch.reqs)
        num_extends = len(batch.reqs) - batch.num_decodes
        for req in batch.reqs[num_extends:]:
            req.kv_len += 1
        for req, n in zip(batch.reqs[:num_extends], batch.extend_lens):
            req.kv_len += n
        # Counted once, before anything that can raise: a step failed after this point
        # counted the K/V again for the requests already advanced, and their frees took
        # the cache's slots (later outputs were wrong, silently).
        batch.kv_committed = True
        done = []
        for req in batch.reqs[:num_extends]:
            try:
                self.fault("cache", req)
                self.req_cache.cache_unfinished(req)
            except Exception as error:  # noqa: BLE001 - it fails (`take_refused`), alone
                if req is self.chunked_req:
                    self.chunked_req = None
                self._refuse([req], error)
                continue
            if req.kv_len < req.seq_len:
                continue  # more chunks to come
            if req is self.chunked_req:
                self.chunked_req = None
            self.running.append(req)
            done.append(req)
        return done + batch.reqs[num_extends:]

    def free_started_pages(self, slots: torch.Tensor) -> None:
        """A request left a launched forward (overlap scheduling: it finished or jumped
        forward meanwhile; a decode run: it finished at an earlier step of the run), so
        that forward's `slots` for it are nobody's. Frees the pages they start; a page they
        continue is the request's own (freed with it, or reused when it extends); the
        padding slot 0 (a run's steps past a request's end) is no one's."""
        self.allocator.free(slots[(slots % self.allocator.page_size == 0) & (slots != 0)])

    def release(self, req: Req, insert: bool = True) -> None:
        """A finished (or failed) request leaves: its KV goes to the cache, the rest is freed."""
        if req is self.chunked_req:
            self.chunked_req = None
        try:
            self.running.remove(req)
        except ValueError:  # not running: it may be waiting (never both)
            if req in self.waiting:
                self.waiting.remove(req)
        self.req_cache.cache_finished(req, insert=insert)

    def _refuse(self, members: list[Req], error: Exception) -> None:
        for member in members:
            with contextlib.suppress(Exception):  # the engine fails it all the same
                self.req_cache.cache_finished(member, insert=False)
            self._refused.append((member, error))
        refused = {id(member) for member in members}  # (one pass: a group may be large)
        self.waiting[:] = [r for r in self.waiting if id(r) not in refused]

    def take_refused(self) -> list[tuple[Req, Exception]]:
        """The requests whose admission raised since the last call (the engine fails them)."""
        refused, self._refused = self._refused, []
        return refused

    def abort_all(self) -> list[Req]:
        reqs = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        return reqs
