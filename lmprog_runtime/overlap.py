"""Overlap scheduling: the device never waits for the host between decode steps.

Run synchronously, a step is its forward, then the CPU work on its results: drawing the
tokens, stop checks and the detokenizing they need, grammar advances, jump-forward,
streaming, finishing requests (slots to the cache, callers told), scheduling and preparing
the next step; the device waits through all of it. Overlapped, as SGLang's zero-overhead
scheduler does, the next tokens stay on the device ("future tokens"): one iteration of the
loop, with forward N launched by the previous one,

1. commits forward N as soon as it is queued (`_advance`): its K/V go to the requests, the
   requests whose prompt is done get a placeholder for their next token, and the draw of
   those tokens is queued behind the forward (`ForwardWorker.sample`), with what sampling
   reads of each request taken now (`sampling.sample_rows`);
2. takes what callers handed in, schedules step N+1, reads its inputs from the requests and
   launches its forward, queued behind that draw: a placeholder input `-(row + 1)` is
   replaced on the device by the token just drawn for table row `row`
   (`ModelRunner.future_tokens`);
3. waits for step N's tokens, puts them in place of the placeholders (`_collect`) and checks
   them (`EngineLoop._check`) while forward N+1 runs.

On a GPU the host's whole iteration runs during forward N+1: the device idles only if the
host takes longer than a forward. The tokens a request's sampling depends on
(min_new_tokens, its grammar's state) are all checked before its next draw is queued
(penalties count them on the device: `penalties.py`), and
the draw's randomness depends on nothing the loops do differently (on a CPU its generator
draws once per token; on an accelerator the draw is keyed by its seed and how many tokens
it has): the outputs are token-identical to the synchronous loop.

Step N+1 is scheduled before step N's tokens are checked, so it carries the requests those
checks finish: each leaves it as it finishes (`_leave_in_flight`: the pages the forward
started for it are freed at once), and what the forward computed for it is dropped when
the forward is committed; a request that jumps forward leaves the same way, and one that
finishes while its token is being drawn (aborted, past its timeout) drops its placeholder
(`EngineLoop._finish`). A forward that fails is seen when it is committed, before anything
depends on it (launching is all a forward does before it is committed: on a GPU its
kernels are queued, on a CPU it has run); its requests then run one by one, as in the
synchronous loop. A draw that fails, or a row without mass (drawn as -1, nothing read
back), fails its own request only, when the tokens are read (`sampling.sample_each`).

Everything a forward reads from the requests is read on the loop thread, in step 2
(`ModelRunner.prepare`); the worker touches tensors only. The K/V pool is written by
forwards alone, queued in order on the worker. The request table's device copy is
written by `prepare` (on the loop's stream; with a worker on a stream of its own, while the
forward before may run):
only entries that forward does not read (new positions, rows of requests admitted since),
rows of requests that left it (their results are dropped), or entries the prefix cache
points at other slots holding the same K/V.

The forwards and draws are queued on `forward_worker.ForwardWorker`: on CUDA from the loop
thread, on the loop's stream (the stream keeps them in order with the loop's copies, with
no events or stream switches to queue); on a CPU on a thread of its own.

With decode runs (`decode_steps` > 1, `decode_run.py`; with "auto" while `run_choice.py`
takes them), a decode batch whose requests can all run ahead is not launched on the
worker in step 2: it runs as decode runs on the loop thread, queued on the loop's stream
behind all the worker queued (`ForwardWorker.hand_over`). Off a CPU the run is launched
in step 2, its first inputs the placeholders (`DecodeRunLoop._launch_before_check`), and
the requests step 3 finishes leave it; it is committed after step 3. On a CPU, or when it
cannot be launched, the batch is held (in flight, computing nothing, so the requests step
3 finishes leave it as they leave a forward) and runs after step 3. The iteration after a
run starts with nothing in flight, and a forward the worker queues then waits for the
loop's stream, as each does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.logprobs import LogprobAsk

if TYPE_CHECKING:
    from lmprog_runtime.request import Req
    from lmprog_runtime.scheduled_batch import ScheduledBatch

logger = logging.getLogger("lmprog_runtime.engine")


@dataclass
class InFlight:
    """A launched forward: its batch, each request's logits rows and slots, the worker's
    future, and the requests that left it while it ran (finished or jumped forward)."""

    batch: ScheduledBatch
    rows: Sequence[list[int]]
    future: Future
    left: set[int] = field(default_factory=set)  # indices of the requests that left
    table_rows: torch.Tensor | None = None  # the batch's table rows on the device, as sent
    launched: list[Req] = field(init=False)  # the batch's requests as launched
    _index: dict[int, int] | None = field(default=None, init=False)
    _starts: list[int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.launched = self.batch.reqs  # (narrowing rebinds `batch.reqs`: this stays)

    @property
    def index(self) -> dict[int, int]:
        """id(request) -> its index in the batch as launched; built at the first request
        that leaves (most forwards have none)."""
        if self._index is None:
            self._index = {id(req): i for i, req in enumerate(self.launched)}
        return self._index

    def slots_of(self, i: int) -> torch.Tensor:
        """Request i's new KV slots (a view; `i` as launched, before `drop_left`)."""
        if self._starts is None:  # (at the first request that leaves, as `index`)
            self._starts = list(itertools.accumulate(self.batch.extend_lens, initial=0))
        return self.batch.out_cache_loc[self._starts[i] : self._starts[i + 1]]

    def drop_left(self) -> None:
        """Narrow the batch (and its rows) to the requests that stayed."""
        if self.left:
            keep = [i for i in range(len(self.batch.reqs)) if i not in self.left]
            self.batch.narrow(keep)
            self.rows = [self.rows[i] for i in keep] if self.rows else []


@dataclass
class Pending:
    """A queued draw: the requests whose next token it draws (each holds a placeholder for
    it) and the worker's future of it."""

    reqs: list[Req]
    future: Future
    ask: LogprobAsk  # the logprobs drawn with the tokens
    forward_counted: bool = False  # its forward's seconds are in the stats already
    released: int = 0  # the loop's count of finished requests when it was queued
    is_decode: bool = False  # its forward a decode step's
    # Seconds the loop waited for the device's forward and draw (`run_choice.py`); None if
    # the draw failed.
    waited: float | None = 0.0


class OverlapLoop:
    """The overlapped iteration of `EngineLoop` (a mixin, as it is: `Engine` sets
    `_worker` and `_in_flight`)."""

    def _run_once_overlapped(self) -> None:
        """Commit forward N and queue its draw, launch forward N+1, check step N's tokens
        (see the module docstring)."""
        start = time.perf_counter()
        if self._run_choice is not None and self._in_flight is None and not self.scheduler.has_work:
            self._run_choice.reset()  # (nothing runs: the work to come is probed afresh)
        drawing = self._advance() if self._in_flight is not None else None
        self._take_inputs()
        batch = self._schedule()
        steps = self._run_length(batch) if batch is not None else 1
        runs, run = steps > 1, None
        if runs:  # (a decode run, on the loop's stream, after all the worker queued)
            self._worker.hand_over()
            run = self._launch_before_check(batch, steps)
            if run is None:
                self._hold(batch)
        elif batch is not None:
            self._launch(batch)
        if drawing is not None:
            appended = self._collect(drawing) if isinstance(drawing, Pending) else drawing
            self._check(appended)
            now = time.perf_counter()
            self._stats.add("step_seconds", now - start)
            if self._run_choice is not None and not runs and isinstance(drawing, Pending):
                self._observe_step(drawing, now - start)
            start = now
        if run is not None:
            self._run_batch(batch, run, since=start)  # (its launch counted once)
        elif runs:
            self._run_held()

    def _observe_step(self, drawing: Pending, spent: float) -> None:
        """Tell `decode_steps="auto"`'s choice how long the step of `drawing` waited for
        the device, of the `spent` seconds of its iteration: a decode step's whose draw
        did not fail (a prompt's forward says nothing of a decode step's)."""
        if drawing.is_decode and drawing.waited is not None:
            self._run_choice.observe_step(drawing.waited, spent)

    def _hold(self, batch: ScheduledBatch) -> None:
        """`batch` runs as a decode run after step N's check: until then it stands in
        flight, launched but computing nothing, so the requests the check finishes leave
        it as they would a forward."""
        done: Future = Future()
        done.set_result(None)
        self._in_flight = InFlight(batch, [], done)

    def _run_held(self) -> None:
        """Run the held batch, less the requests that left it (`EngineLoop._run_batch`)."""
        flight, self._in_flight = self._in_flight, None
        flight.drop_left()
        if flight.batch.reqs:
            self._run_batch(flight.batch)

    def _launch(self, batch: ScheduledBatch) -> None:
        """Read `batch`'s inputs from the requests now, then queue its forward on the
        worker. A failure here counts as the forward's: it shows when `batch` is committed."""
        rows: Sequence[list[int]] = []
        try:
            if self.fault_hook is not None:
                for req in batch.reqs:
                    self.fault_hook("forward", req)
            fb, rows = self.runner.prepare(batch)
            future = self._worker.launch(fb)
        except BaseException as error:  # noqa: BLE001 - handled as the forward's failure
            future = Future()
            future.set_exception(error)
            fb = None
        table_rows = fb.req_pool_indices if fb is not None else None
        self._in_flight = InFlight(batch, rows, future, table_rows=table_rows)

    def _leave_in_flight(self, req: Req) -> None:
        """`req` finished or jumped forward while a forward that carries it runs: what that
        forward computes for it will be dropped, and the pages it started for it are freed
        now (so a finished request's slots are all free when its caller wakes)."""
        flight = self._in_flight
        i = flight.index.pop(id(req), None) if flight is not None else None
        if i is not None:
            flight.left.add(i)
            self.scheduler.free_started_pages(flight.slots_of(i))

    def _advance(self) -> Pending | list[Req] | None:
        """Commit the launched forward for the requests that stayed in it, and queue the
        draw of their next tokens. A failed forward is run again request by request, as the
        synchronous loop does (its tokens are then drawn at once). Returns the draw; the
        requests that got a token if they got it at once; None if nothing is drawn."""
        flight, self._in_flight = self._in_flight, None
        batch = flight.batch
        asked = time.perf_counter()
        try:
            logits, timer = flight.future.result()
            error = None
        except BaseException as forward_error:  # noqa: BLE001 - find the request it belongs to
            error = forward_error
        # On a CPU a worker thread's forward is the device's work. On CUDA the future is
        # set once the kernels are queued (a worker thread's `timer.end` then marks the
        # device's end), so there only the tokens' wait in `_collect` is the device's.
        waited = time.perf_counter() - asked if error is None and timer.end is None else 0.0
        try:
            flight.drop_left()
            if not batch.reqs:
                return None  # every request of it finished meanwhile: nothing to count
            if error is None:
                pending = self._commit_launched(flight, logits)
                pending.waited = waited
                return pending
            if len(batch.reqs) < 2 or not isinstance(error, Exception):
                raise error
            logger.error("forward failed; running each request alone", exc_info=error)
            self._worker.synchronize()  # nothing of the failed forward may still write
            logits, rows = self._forward_alone(batch)
            if not batch.reqs:
                return None
            return self._commit(batch, logits, rows, 0.0)
        except BaseException as step_error:  # one bad step must not take the loop down
            logger.exception("engine step failed")  # (a BaseException too: `_run_batch`)
            self._fail_step(batch, step_error)
            return None

    def _commit_launched(self, flight: InFlight, logits: torch.Tensor) -> Pending:
        """`EngineLoop._commit` for a forward still on the device: the same bookkeeping, and
        the requests whose prompt is done get a placeholder token, drawn on the worker."""
        batch = flight.batch
        ready, row_of = self._account(batch, flight.rows, 0.0)
        # Requests told now (prefill-only ones), or prompt logprobs to read: the forward
        # must be over first, and its seconds counted before any caller wakes.
        # (A decode batch has neither: it holds no prefill-only request.)
        waits = batch.mode is ForwardMode.EXTEND and any(
            r.max_new_tokens == 0 or _wants_prompt_logprobs(r) for r in ready
        )
        if waits:
            logits, timer = self._worker.wait_forward(flight.future)
            self._stats.add("forward_seconds", timer.seconds())
            self._record_prompt_logprobs(ready, logits, row_of)
        to_sample, rows = self._rows_to_draw(self._to_draw(ready), logits.shape[-1])
        index = row_of.last_rows(to_sample)
        table_rows: list[int] | torch.Tensor
        if flight.table_rows is not None and _all_of(to_sample, flight):
            table_rows = flight.table_rows  # (already on the device: no copy)
        else:
            table_rows = [req.req_pool_idx for req in to_sample]
        ask = LogprobAsk.of(to_sample)
        future = self._worker.sample(flight.future, index, rows, table_rows, ask)
        for req in to_sample:
            req.output_ids.append(-(req.req_pool_idx + 1))  # what the next forward reads
        is_decode = batch.mode is ForwardMode.DECODE
        return Pending(to_sample, future, ask, waits, self._released, is_decode)

    def _collect(self, drawing: Pending) -> list[Req]:
        """Wait for a queued draw and put its tokens in place of the placeholders, for the
        requests still running; a row whose draw failed fails its request. Returns the
        requests that got a token."""
        asked = time.perf_counter()
        try:
            ids, errors, logprobs, seconds = self._worker.sampled(drawing.future, drawing.ask)
            drawing.waited += time.perf_counter() - asked
        except Exception as error:  # noqa: BLE001 - the draw itself broke: its requests fail
            drawing.waited = None
            logger.exception("drawing the next tokens failed")
            for req in drawing.reqs:
                self._finish(req, error)
            return []
        if not drawing.forward_counted:
            self._stats.add("forward_seconds", seconds)
        reqs = drawing.reqs
        if drawing.released != self._released:  # (most steps none finished meanwhile)
            reqs, ids, errors, logprobs = _still_running(reqs, ids, errors, logprobs)
        got = []
        for req, token, logprob in self._drawn(reqs, ids, errors, logprobs):
            req.output_ids[-1] = token  # its placeholder
            if logprob is None or self._record_token_logprob(req, token, logprob):
                got.append(req)
        return got

    def _abandon_in_flight(self, error: BaseException) -> None:
        """Fail the requests of the launched forward, if any, once it is over (at shutdown,
        or when an iteration failed): what it wrote counts as theirs, so failing them frees
        it."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        with contextlib.suppress(Exception):  # its outcome no longer matters
            flight.future.result()
        with contextlib.suppress(Exception):  # (a worker shut down already)
            self._worker.synchronize()
        flight.drop_left()
        for req, n in zip(flight.batch.reqs, flight.batch.extend_lens):
            req.kv_len += n
            self._finish(req, error)


def _still_running(
    reqs: list[Req], ids: list[int], errors: dict[int, Exception], logprobs: list
) -> tuple[list[Req], list[int], dict[int, Exception], list]:
    """A draw's rows of the requests not finished since it was queued (their errors keyed
    by their new rows)."""
    keep = [i for i, req in enumerate(reqs) if not req.released]
    if len(keep) == len(reqs):
        return reqs, ids, errors, logprobs
    position = {i: j for j, i in enumerate(keep)}
    errors = {position[i]: e for i, e in errors.items() if i in position}
    return [reqs[i] for i in keep], [ids[i] for i in keep], errors, [logprobs[i] for i in keep]


def _all_of(reqs: list[Req], flight: InFlight) -> bool:
    """Whether `reqs` are all of the requests `flight` was launched with, in order."""
    batch = flight.batch.reqs
    return not flight.left and len(reqs) == len(batch) and all(map(operator.is_, reqs, batch))


def _wants_prompt_logprobs(req: Req) -> bool:
    return req.logprob_start_len >= 0 and not req.input_logprobs_done
