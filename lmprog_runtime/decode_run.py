"""Decode runs (`decode_steps` > 1; SGLang's num_continuous_decode_steps): several decode
steps from one scheduling, each step's tokens fed to the next on the device.

A synchronous decode step is a round trip through the host: schedule, prepare the inputs,
forward, draw, read the tokens back, check them. Past the forward and the draw, all of it
is per-request Python, so a small model on a GPU waits for the host most of each step
(issue 18). A run of K steps schedules once and allocates each request's next K slots
(`Scheduler.extend_decode_run`), then queues K forwards and draws back to back: the input
of step k > 0 is the tokens step k - 1 drew, on the device (`ModelRunner.prepare_run`
sends the whole run's inputs at once). The tokens are then committed and checked step by
step, exactly as K synchronous steps would: a request that finishes at step k (EOS, a stop string, its
`max_new_tokens`) keeps the K/V of its steps up to k, and the pages its later steps
started are freed as it finishes, before its caller wakes (`RunSlots`); what those steps
computed for it is dropped, and the counters do not count it (they equal single steps').
Each step's tokens are copied to the host as soon as they are drawn, so on a GPU a step
is checked while the later ones compute.

A run needs every request's next K draws to depend on nothing the host would learn from
its earlier tokens: no grammar (its mask follows each token), no penalties (they count
the tokens), no pending `min_new_tokens` (EOS is banned until it is reached), and no
logprobs (read per step). When any request of the step needs one of them, the step runs
alone. Seeded draws stay identical: a CPU generator draws once per token, in order, and
an accelerator's race is keyed by the request's seed and how many tokens it has, counted
here for each step ahead. Greedy and seeded outputs are token-identical to `decode_steps=1`
(`tests/runtime/test_decode_run.py`, float32 on a CPU; in bfloat16 the batch's shape,
which keeps a finished request to the end of its run, can move a token, as any batching
can).

What runs wait for: callers' new requests, aborts and deadlines are taken between runs,
so they wait up to K steps (as SGLang's option documents: more throughput, later first
tokens for requests that arrive during a run). A run fails as a whole if anything in it
raises before its tokens are read: its further slots are freed, generators rewound, and
its first step runs again as a synchronous step (which finds the failing request).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.keyed_race import race_key
from lmprog_runtime.sampling import NO_MASS, SampleRow, on_accelerator, sample_each, sample_rows
from lmprog_runtime.scheduler import ScheduledBatch
from lmprog_runtime.transfer import host_ints, to_host_async

if TYPE_CHECKING:
    from lmprog_runtime.request import Req

logger = logging.getLogger("lmprog_runtime.engine")
# A step's drawn tokens on their way to the host: the copy, and (CUDA) when it is there.
HostTokens = tuple[torch.Tensor, "torch.cuda.Event | None"]


def runs_ahead(req: Req) -> bool:
    """Whether `req`'s next draws depend on nothing its earlier tokens tell the host."""
    return (
        req.matcher is None
        and req.char_fsm is None
        and not req.params.has_penalties
        and not req.return_logprob
        and req.can_stop
    )


class DecodeRunLoop:
    """Decode runs of the synchronous `EngineLoop` (a mixin: `Engine` sets every attribute
    used here)."""

    def _run_length(self, batch: ScheduledBatch) -> int:
        """How many decode steps `batch` runs: 1, or up to `decode_steps` when every request
        of it may run ahead, no more than its longest remaining output needs and its
        shortest remaining context allows."""
        steps = self.config.decode_steps
        if steps == 1 or batch.mode is not ForwardMode.DECODE:
            return 1
        if not all(runs_ahead(req) for req in batch.reqs):
            return 1
        remaining = max(req.max_new_tokens - len(req.output_ids) for req in batch.reqs)
        room = self.runner.context_len - max(batch.prefix_lens)
        return max(1, min(steps, remaining, room))

    def _step_run(self, batch: ScheduledBatch, steps: int) -> None:
        """Run `batch` and `steps - 1` decode steps after it, then commit and check them
        one by one (see the module docstring)."""
        start = time.perf_counter()
        ahead = self.scheduler.extend_decode_run(batch, steps)
        if not ahead:
            self._step(batch)
            return
        reqs, vocab = batch.reqs, self.runner.model_config.vocab_size
        seeded = [] if on_accelerator(self.runner.device) else _generators(reqs)
        states = [generator.get_state() for generator in seeded]
        try:
            drawn, errors = self._launch_run(batch, ahead, vocab)
        except Exception:  # noqa: BLE001 - the first step alone finds the culprit
            logger.exception("decode run failed; running its first step alone")
            for generator, state in zip(seeded, states):
                generator.set_state(state)
            for slots in ahead:
                self.scheduler.free_started_pages(slots)
            self._step(batch)
            return
        seconds = (time.perf_counter() - start) / (len(ahead) + 1)
        self._decode_run = RunSlots(batch, ahead, self.scheduler.free_started_pages)
        try:
            self._commit_run(batch, ahead, drawn, errors, seconds)
        finally:  # (also when committing raised: the loop then fails the batch)
            run, self._decode_run = self._decode_run, None
            run.free_unused()
        self._stats.add("step_seconds", time.perf_counter() - start)

    def _leave_run(self, req: Req) -> None:
        """`req` finishes while its run is committed: the pages its later steps started
        are freed now (before its caller wakes)."""
        if self._decode_run is not None:
            self._decode_run.leave(req)

    def _launch_run(
        self, batch: ScheduledBatch, ahead: list[torch.Tensor], vocab: int
    ) -> tuple[list[HostTokens], list[dict[int, Exception]]]:
        """Queue the run's forwards and draws, each draw's tokens the next step's inputs
        (on the device) and copied to the host as soon as they are drawn. Returns each
        step's tokens on their way to the host (-1 where a row drew none) and its failed
        rows. (The fault hook, a test hook, runs once per run, at its start.)"""
        reqs = batch.reqs
        if self.fault_hook is not None:
            for req in reqs:
                self.fault_hook("forward", req)
                self.fault_hook("sample", req)
        rows = sample_rows(reqs, vocab)
        drawn, errors = [], []
        token_ids = None
        for k, fb in enumerate(self.runner.prepare_run(batch, ahead)):
            if token_ids is not None:
                fb.input_ids = token_ids.clamp(min=0)  # (a row that drew none: its request fails)
            logits = self.runner.run(fb)
            token_ids, failed = sample_each(logits, _rows_ahead(rows, reqs, k))
            drawn.append(to_host_async(token_ids))
            errors.append(failed)
        return drawn, errors

    @staticmethod
    def _read_step(tokens: HostTokens) -> list[int]:
        """One step's tokens on the host, once they are there (on a GPU the later steps
        of the run still compute meanwhile)."""
        host, ready = tokens
        if ready is not None:
            ready.synchronize()
        return host.tolist()

    def _commit_run(
        self,
        batch: ScheduledBatch,
        ahead: list[torch.Tensor],
        drawn: list[HostTokens],
        errors: list[dict[int, Exception]],
        forward_seconds: float,
    ) -> None:
        """Each step in turn, as a synchronous step commits and checks it, as soon as its
        tokens reach the host. The counters count what single steps would: the tokens of
        the requests still running at each step, the steps up to the last one's finish."""
        reqs, run = batch.reqs, self._decode_run
        batch.kv_committed = True  # (kv_len grows step by step below)
        for k, tokens in enumerate(drawn):
            live = [i for i, req in enumerate(reqs) if not req.done.is_set()]
            if not live:
                break
            step_ids = self._read_step(tokens)
            for i in live:
                reqs[i].kv_len += 1
                run.used[i] += 1
            step = batch if k == 0 else _step_ahead(batch, ahead[k - 1], k)
            if len(live) < len(reqs):
                step = ScheduledBatch(
                    ForwardMode.DECODE,
                    [reqs[i] for i in live],
                    step.out_cache_loc[host_ints(live)],
                    [step.prefix_lens[i] for i in live],
                    [1] * len(live),
                )
            self._stats.record_step(
                step, num_running=len(self.scheduler.running), forward_seconds=forward_seconds
            )
            appended = []
            for i in live:
                req, token = reqs[i], step_ids[i]
                error = errors[k].get(i)
                if error is None and token < 0:
                    error = ValueError(f"request {req.rid}: {NO_MASS}")
                if error is not None:
                    self._finish(req, error)
                    continue
                req.output_ids.append(token)
                appended.append(req)
            self._check(appended)


class RunSlots:
    """A decode run's slots while it is committed: each step's ([n] each), how many steps
    each request has kept the K/V of, and `free` (`Scheduler.free_started_pages`)."""

    def __init__(
        self,
        batch: ScheduledBatch,
        ahead: list[torch.Tensor],
        free: Callable[[torch.Tensor], None],
    ) -> None:
        self.slots = [batch.out_cache_loc, *ahead]
        self.index = {id(req): i for i, req in enumerate(batch.reqs)}
        self.used = [0] * len(batch.reqs)
        self._free = free
        self._left = [False] * len(batch.reqs)

    def leave(self, req: Req) -> None:
        """`req` finished: free the pages its steps past the last one it kept started."""
        i = self.index.get(id(req))
        if i is not None:
            self._leave(i)

    def free_unused(self) -> None:
        """After the run: the same for every request still in it (one that goes on has
        kept every step; one the loop fails after a commit that raised has not)."""
        for i in range(len(self.used)):
            self._leave(i)

    def _leave(self, i: int) -> None:
        if not self._left[i]:
            self._left[i] = True
            for later in self.slots[self.used[i] :]:
                self._free(later[i : i + 1])


def _generators(reqs: list[Req]) -> list[torch.Generator]:
    return [req.generator for req in reqs if not req.params.is_greedy]


def _step_ahead(batch: ScheduledBatch, slots: torch.Tensor, k: int) -> ScheduledBatch:
    """Step k of a run that starts with `batch`: its requests, one position further each
    step, on `slots`."""
    prefix_lens = [p + k for p in batch.prefix_lens]
    return ScheduledBatch(ForwardMode.DECODE, batch.reqs, slots, prefix_lens, batch.extend_lens)


def _rows_ahead(rows: list[SampleRow], reqs: list[Req], k: int) -> list[SampleRow]:
    """The sample rows of step k of a run: a keyed draw counts the k tokens drawn before
    it in the run (nothing else of a row that runs ahead changes)."""
    if k == 0:
        return rows
    return [
        row
        if row.params.is_greedy
        else row._replace(key=race_key(req.seed, len(req.output_ids) + k))
        for row, req in zip(rows, reqs)
    ]
