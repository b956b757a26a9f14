"""Decode runs (`decode_steps` > 1; SGLang's num_continuous_decode_steps): several decode
steps from one scheduling, each step's tokens fed to the next on the device, and while
nothing waits, each run launched before the one before it is checked. (With
`decode_steps="auto"`, the overlapped loop takes runs only while it finds the device
waiting for the host: `run_choice.py`.)

A synchronous decode step is a round trip through the host: schedule, prepare the inputs,
forward, draw, read the tokens back, check them. Past the forward and the draw, all of it
is per-request Python, so a small model on a GPU waits for the host most of each step
(issue 18), however it overlaps: the host's work per step is longer than the forward.

A run of K steps schedules once and allocates each request's next K slots, or as many
as it has tokens left (past them it writes the padding slot, which no one reads;
`Scheduler.extend_decode_run`), then queues K forwards and draws back to back: the input
of step k > 0 is the tokens step k - 1 drew, on the device (`ModelRunner.prepare_run`
sends the whole run's inputs at once). Each step's tokens are copied to the host as soon
as they are drawn, and committed and checked step by step, exactly as K synchronous steps
would, while the later steps compute: a request that finishes at step k (EOS, a stop
string, its `max_new_tokens`) keeps the K/V of its steps up to k, and the pages its later
steps started are freed as it finishes, before its caller wakes (`RunSlots`); what those
steps computed for it is dropped, and the counters do not count it (they equal single
steps').

Runs ahead: before a run is committed, the run after it is launched (`_continue_run`),
its first step's inputs the last tokens the run drew, still on the device, for the
requests whose `max_new_tokens` lets them go on; a request that stops inside the run
leaves the one launched after it as it finishes (its slots there freed at once). So the
host checks a run while the device computes the next, and the device waits only for the
host's work per run. The loop stops launching ahead, and schedules as usual after the
commit, as soon as anything waits: shutdown, a caller's new request, an abort, a
command, a request the scheduler could not admit, or a request with a deadline in the
run. Off a CPU only (`Engine._launches_ahead`): on a CPU a run computes as it is
launched, so launching ahead would only delay the checks and waste the steps of
requests that stop.

A run needs every request's next K draws to depend on nothing the host would learn from
its earlier tokens: no grammar (its mask follows each token; a step with a grammar's
request runs alone). Penalties do not stop a run: each draw counts its tokens on the
device, where the next reads them (`penalties.py`). Neither do logprobs: each step's are
gathered with its draw, on the device, and copied to the host with its tokens
(`LogprobAsk`). What else a draw ahead depends on is counted for its step
(`run_plan.rows_ahead`): EOS and stop tokens stay banned while `min_new_tokens` is not
reached by that step, and seeded draws stay identical: a CPU generator draws once per
token, in order, and an accelerator's race is keyed by the request's seed and how many
tokens it has. Greedy and seeded outputs are token-identical to `decode_steps=1` (`tests/runtime/test_decode_run.py`, float32 on a CPU; in bfloat16
the batch's shape, which keeps a finished request to the end of its run, can move a
token, as any batching can).

On CUDA a run of plain greedy steps (`SampleRows.plain`) that asks for no logprobs is one
replay of a graph of the whole run (`DecodeGraphRunner.run_greedy`: each step's argmax the
next one's input, inside the graph): one copy of its inputs, one replay, one copy of its
[K, batch] tokens to the host (`_queue_as_graph`); a run shorter than `decode_steps` (its
requests' last tokens) replays a few graphs of shorter runs (7 steps of 8: 4, 2 and 1),
each from the tokens the one before drew. Its steps reach the host together, when the
whole replay is over, so the checks of its first step (a stop, a streamed chunk) come up
to K - 1 steps later than step by step; throughput does not suffer, since the next run
is queued before the run is checked. Other runs queue step by step
(`_queue_step_by_step`).

The commit of a launched run, step by step or at once: `run_commit.py`.

With overlap scheduling, the batches that cannot run ahead (prompts, a grammar's) are
overlapped (`overlap.py`), and a decode batch that can runs as a run on the loop thread:
off a CPU launched before the step before it is checked, from the tokens that step
draws, still on the device (`_launch_before_check`: the placeholders its requests hold);
otherwise held until that check (`OverlapLoop._hold`, `_run_held`).

What runs cost: a caller's new request or a deadline waits for the run being checked
and the one launched after it (up to 2K steps; SGLang's option documents the same trade:
more throughput, later first tokens for requests that arrive meanwhile), and so does an
abort where a run is committed at once (committed step by step, a run takes aborts
between its steps: `_cancel_aborted`); a request that stops inside a run computes the
rest of it for nothing. A run whose launch raises is dropped (its further slots freed,
CPU generators rewound); the first run's first step then runs alone (which finds the
failing request), and a run launched ahead is simply not there (the loop schedules after
the commit).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.logprobs import LogprobAsk
from lmprog_runtime.run_commit import HostTokens, Run, RunCommit
from lmprog_runtime.run_plan import (
    RunSlots,
    generators_of,
    rows_ahead,
    run_length,
    runs_ahead,
    tokens_left,
)
from lmprog_runtime.sampling import SampleRow, on_accelerator, sample_each, sample_rows
from lmprog_runtime.scheduled_batch import ScheduledBatch
from lmprog_runtime.transfer import host_ints, index_tensor, to_host_async

if TYPE_CHECKING:
    from lmprog_runtime.request import Req

logger = logging.getLogger("lmprog_runtime.engine")


class DecodeRunLoop(RunCommit):
    """Decode runs of `EngineLoop` (a mixin: `Engine` sets every attribute used here).
    With overlap scheduling a run starts from the overlapped loop
    (`OverlapLoop._run_once_overlapped`)."""

    def _run_length(self, batch: ScheduledBatch) -> int:
        """How many decode steps `batch` runs: 1, or up to `decode_steps` when every request
        of it may run ahead, no more than its longest remaining output needs and its
        shortest remaining context allows (with `decode_steps="auto"`, what the loop's
        `RunChoice` says now)."""
        choice = self._run_choice
        steps = self.config.run_steps if choice is None else choice.steps
        if steps == 1 or batch.mode is not ForwardMode.DECODE:
            return 1
        if not all(runs_ahead(req) for req in batch.reqs):
            return 1
        return run_length(steps, batch.reqs, batch.prefix_lens, 0, self.runner.context_len)

    def _step_run(self, batch: ScheduledBatch, steps: int) -> None:
        """Run `batch` and `steps - 1` decode steps after it, and while nothing waits, the
        runs that continue it, each launched before the one before is committed (see the
        module docstring)."""
        start = time.perf_counter()  # (the first run's launch counts as its step's time)
        self._commit_runs(self._launch_or_step(batch, steps), start)

    def _commit_runs(self, run: Run | None, start: float) -> None:
        """Commit `run` and, while nothing waits, launch each run that continues it before
        committing the one before; the loop's seconds from `start` on count at each
        commit."""
        try:
            while run is not None:
                after = self._continue_run(run) if self._may_continue(run) else None
                self._commit_run(run)
                run.slots.free_unused()
                self._runs.remove(run.slots)
                now = time.perf_counter()
                self._stats.add("step_seconds", now - start)
                start, run = now, after
        finally:  # (a commit raised: the loop then fails the batch)
            for slots in self._runs:
                slots.free_unused()
            self._runs = []

    def _launch_or_step(self, batch: ScheduledBatch, steps: int) -> Run | None:
        """Launch `batch` as a run of `steps`; if that fails, or no slots are left for a
        step ahead, run its first step alone (which finds the failing request)."""
        ahead = self.scheduler.extend_decode_run(batch, steps, tokens_left(batch.reqs))
        if not ahead:
            self._step(batch)
            return None
        try:
            return self._launch_run(batch, ahead)
        except Exception:  # noqa: BLE001 - the first step alone finds the culprit
            logger.exception("decode run failed; running its first step alone")
            self._step(batch)
            return None

    def _launch_before_check(self, batch: ScheduledBatch, steps: int) -> Run | None:
        """Launch `batch` as a run of `steps` before the step before it is checked (the
        overlapped loop, off a CPU): its first inputs are its requests' last tokens, still
        being drawn (the placeholders they hold, read on the device), and a request that
        the check finishes leaves it. None if there is no room for a step ahead or
        launching failed (the caller then runs `batch` after the check)."""
        if not self._launches_ahead:
            return None
        try:
            ahead = self.scheduler.extend_decode_run(batch, steps, tokens_left(batch.reqs))
            return self._launch_run(batch, ahead) if ahead else None
        except Exception:  # noqa: BLE001 - the batch runs after the check instead
            logger.exception("launching a decode run before the check failed")
            return None

    def _may_continue(self, run: Run) -> bool:
        """Whether the next run may be launched before `run` is committed: off a CPU
        (`_launches_ahead`: on a CPU a run computes as it is launched, so nothing would
        overlap), and nothing waits (shutdown, callers' requests, aborts, commands,
        admission, a deadline)."""
        if not self._launches_ahead or self._stopping:
            return False
        if self._run_choice is not None and self._run_choice.is_probing:
            return False  # (single steps now: the loop schedules them)
        if self._inbox or self._aborts or self._commands:  # (read without the lock: a hint)
            return False
        sched = self.scheduler
        if sched.waiting or sched.chunked_req is not None:
            return False
        return all(req.deadline is None for req in run.batch.reqs)

    def _continue_run(self, run: Run) -> Run | None:
        """Launch the run after `run`, before `run` is committed: its requests that its
        `max_new_tokens` lets go on, from the tokens `run`'s last step drew (on the
        device). A request that stops inside `run` leaves it when it finishes. None if
        there is nothing to continue, no room, or launching failed (the loop then
        schedules as usual once `run` is committed)."""
        reqs, n = run.batch.reqs, run.steps
        left = tokens_left(reqs)
        keep = [i for i, req in enumerate(reqs) if not req.done.is_set() and left[i] > n]
        if not keep:
            return None
        sub = [reqs[i] for i in keep]
        positions = [run.batch.prefix_lens[i] + n for i in keep]
        steps = run_length(self.config.run_steps, sub, positions, n, self.runner.context_len)
        if steps < 2:
            return None
        first = None
        try:
            kept = index_tensor(keep, run.last_tokens.device)
            first_ids = run.last_tokens[kept]
            last = run.slots.slots[-1][host_ints(keep)]
            first = self.scheduler.continue_decode_run(sub, last, positions)
            if first is None:
                return None
            batch = ScheduledBatch(ForwardMode.DECODE, sub, first, positions, [1] * len(sub))
            ahead = self.scheduler.extend_decode_run(batch, steps, tokens_left(sub, n))
            if not ahead:
                self.scheduler.free_started_pages(first)
                return None
            return self._launch_run(batch, ahead, first_ids, offset=n)
        except Exception:  # noqa: BLE001 - `run` goes on; the loop schedules after it
            logger.exception("launching a decode run ahead failed")
            if first is not None:
                self.scheduler.free_started_pages(first)  # (the steps ahead's are freed)
            return None

    def _leave_run(self, req: Req) -> None:
        """`req` finishes while a run that carries it is committed or launched: the pages
        of its steps it did not keep are freed now (before its caller wakes)."""
        for slots in self._runs:
            slots.leave(req)

    def _launch_run(
        self,
        batch: ScheduledBatch,
        ahead: list[torch.Tensor],
        first_ids: torch.Tensor | None = None,
        offset: int = 0,
    ) -> Run:
        """Queue the run's forwards and draws, each draw's tokens the next step's inputs
        (on the device) and copied to the host as soon as they are drawn. `first_ids`: the
        first step's inputs when they are still on the device (a run that continues one
        not yet committed, whose requests have `offset` tokens more than they hold). A
        failure frees the steps ahead's slots and rewinds the CPU generators (the penalty
        counts its draws counted are counted again at the next draw: `PenaltyCounts`).
        (The fault hook, a test hook, runs once per run, at its start.)"""
        start = time.perf_counter()
        reqs = batch.reqs
        seeded = [] if on_accelerator(self.runner.device) else generators_of(reqs)
        states = [generator.get_state() for generator in seeded]
        try:
            if self.fault_hook is not None:
                for req in reqs:
                    self.fault_hook("forward", req)
                    self.fault_hook("sample", req)
            vocab = self.runner.model_config.vocab_size
            rows = sample_rows(reqs, vocab, self.penalty_counts, offset, len(ahead) + 1)
            ask = LogprobAsk.of(reqs)
            graphs, steps = self.runner.graphs, len(ahead) + 1
            as_graph = (
                graphs is not None
                and getattr(rows, "plain", False)
                and not ask.rows
                and graphs.can_run_greedy(len(reqs), steps)
            )
            if as_graph:
                drawn, tables, errors, token_ids = self._queue_as_graph(batch, ahead, first_ids)
            else:
                drawn, tables, errors, token_ids = self._queue_step_by_step(
                    batch, ahead, first_ids, rows, ask, offset
                )
        except BaseException:
            for generator, state in zip(seeded, states):
                generator.set_state(state)
            for slots in ahead:
                self.scheduler.free_started_pages(slots)
            raise
        seconds = (time.perf_counter() - start) / (len(ahead) + 1)
        self._stats.add("decode_runs")
        if self._run_choice is not None:
            self._run_choice.observe_run()
        slots = RunSlots(batch, ahead, self.scheduler.free_started_pages)
        self._runs.append(slots)
        return Run(batch, ahead, drawn, tables, ask, errors, token_ids, slots, seconds)

    def _queue_as_graph(
        self, batch: ScheduledBatch, ahead: list[torch.Tensor], first_ids: torch.Tensor | None
    ) -> tuple[list[HostTokens], list[None], list[dict[int, Exception]], torch.Tensor]:
        """A run of plain greedy steps that asks for no logprobs, as graph replays
        (`ModelRunner.run_greedy`): its tokens [K, n] go to the host in one copy. Returns
        (each step's tokens on their way to the host, no logprobs, no failed rows, the last
        step's tokens on the device)."""
        steps = len(ahead) + 1
        tokens = self.runner.run_greedy(batch, ahead, first_ids)
        host, ready = to_host_async(tokens)
        drawn = [(host[k], ready) for k in range(steps)]
        return drawn, [None] * steps, [{} for _ in range(steps)], tokens[-1].clone()

    def _queue_step_by_step(
        self,
        batch: ScheduledBatch,
        ahead: list[torch.Tensor],
        first_ids: torch.Tensor | None,
        rows: list[SampleRow],
        ask: LogprobAsk,
        offset: int,
    ) -> tuple[
        list[HostTokens], list[torch.Tensor | None], list[dict[int, Exception]], torch.Tensor
    ]:
        """Each step's forward and draw queued in turn, the tokens a step drew the next
        one's inputs (on the device), each step's tokens and logprobs copied to the host
        as soon as they are drawn. Returns what `_queue_as_graph` does, with each step's
        logprobs table and failed rows."""
        reqs = batch.reqs
        drawn, tables, errors = [], [], []
        token_ids, from_graph, whole = first_ids, False, list(range(len(reqs)))
        for k, fb in enumerate(self.runner.prepare_run(batch, ahead)):
            if token_ids is not None:  # (a row that drew none, -1: its request fails)
                fb.input_ids = token_ids if from_graph else token_ids.clamp(min=0)
                fb.has_future_ids, fb.future_tail = False, 0  # (tokens, no placeholders)
            logits = self.runner.run(fb)
            step_rows = rows_ahead(rows, reqs, offset + k)
            # The decode graph's draw where it made it, but not at the last step: its
            # tokens (the first inputs of a run launched after it) are kept past this run,
            # and the graph's next replay overwrites its outputs.
            last = k == len(ahead)
            token_ids = None if last else self.runner.greedy_tokens(logits, whole, step_rows)
            from_graph, failed = token_ids is not None, {}
            if not from_graph:
                token_ids, failed = sample_each(logits, step_rows)
            host, table, ready = ask.gather_to_host(logits, token_ids)
            drawn.append((host, ready))
            tables.append(table)
            errors.append(failed)
        return drawn, tables, errors, token_ids
