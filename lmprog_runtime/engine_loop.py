"""The engine's loop: each step it takes what callers handed in, schedules, runs one
forward, samples, and finishes requests the moment they stop (with overlap scheduling, the
checks of one step run while the next step's forward does: see `overlap.py`; with decode
runs, several decode steps run from one scheduling: see `decode_run.py`).

`EngineLoop` holds the loop-side methods of `Engine` (the caller side: `engine*.py`;
validation: `request_maker.py`, `engine_inputs.py`; a step's draw: `step_draw.py`; the
loop's thread: `loop_thread.py`; failing what a failure holds: `loop_failures.py`). Only the loop thread runs them: it alone owns the
scheduler, the model runner and every KV slot.
An exception in one step fails only the requests of that step; the loop keeps serving.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmprog_runtime.decode_run import DecodeRunLoop
from lmprog_runtime.forward_batch import ForwardMode, RowsOf
from lmprog_runtime.kvcache.radix_view import snapshot
from lmprog_runtime.loop_failures import LoopFailures
from lmprog_runtime.overlap import OverlapLoop
from lmprog_runtime.request import Req
from lmprog_runtime.run_commit import Run
from lmprog_runtime.scheduled_batch import ScheduledBatch
from lmprog_runtime.steady_check import SteadyCheck
from lmprog_runtime.step_draw import StepDraw

logger = logging.getLogger("lmprog_runtime.engine")


class EngineLoop(LoopFailures, StepDraw, OverlapLoop, DecodeRunLoop):
    """The loop-side half of `Engine` (a mixin: `Engine` sets every attribute used here)."""

    @property
    def fault_hook(self) -> Callable[[str, Req], None] | None:
        """Tests only: called as `hook(point, req)` at "schedule" (admission), "forward"
        (for each request of a forward), "cache" (its prompt's K/V put in the prefix cache
        after an extend) and "sample"; raising there fails that request alone."""
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, Req], None] | None) -> None:
        self._fault_hook = hook
        self.scheduler.fault = hook if hook is not None else _no_fault

    def _is_idle(self) -> bool:
        """Nothing to do until a caller submits or commands (call with `_cv` held)."""
        has_work = self.scheduler.has_work or self._in_flight is not None
        return not (self._inbox or self._commands or has_work)

    def _run_once(self) -> None:
        """Take what callers handed in, then schedule and run one step (call without `_cv`)."""
        if self._worker is not None:
            self._run_once_overlapped()
            return
        self._take_inputs()
        batch = self._schedule()
        if batch is not None:
            self._run_batch(batch)

    def _run_batch(
        self, batch: ScheduledBatch, run: Run | None = None, since: float | None = None
    ) -> None:
        """Run `batch` synchronously: one step, or a decode run when it can run ahead
        (`run`: `batch` launched as one already, to commit; the loop's seconds from
        `since` on count as its step's)."""
        try:
            if run is not None:
                self._commit_runs(run, time.perf_counter() if since is None else since)
            elif (steps := self._run_length(batch)) > 1:
                self._step_run(batch, steps)
            else:
                self._step(batch)
        # (a BaseException too: on this thread none comes from a signal, and one from the
        # model's code, left to the loop's last resort, failed every request and lost the
        # step's slots)
        except BaseException as error:  # one bad step must not take the loop down
            logger.exception("engine step failed")
            self._fail_step(batch, error)

    def _take_inputs(self) -> None:
        """Admit what callers submitted, run their commands, cancel what they aborted."""
        with self._lock:
            new, self._inbox = self._inbox, []
            commands, self._commands = self._commands, []
            aborts, self._aborts = self._aborts, []
        # (a group's internal prefill of its shared prefix too: its claims count in
        # `cached_tokens`, and without it a fork's hit rate passed 100%)
        self._stats.add("prompt_tokens", sum(req.prompt_len for req in new))
        for req in new:
            self._live[req.rid] = req
            if req.deadline is not None:
                heapq.heappush(self._deadlines, (req.deadline, req.rid))
            self.scheduler.add(req)
        for name, args, done, result in commands:
            try:
                result.append(self._run_command(name, *args))
            except Exception as error:  # noqa: BLE001 - raised on the caller's thread
                result.append(error)
            done.set()
        self._cancel(aborts)

    def _schedule(self) -> ScheduledBatch | None:
        """The next batch to run; None if nothing can run now."""
        batch = None
        try:
            batch = self.scheduler.next_batch()
        except Exception as error:  # a bug in scheduling: fail what it held, never spin
            logger.exception("scheduling failed")
            self._recover_schedule(error)
            return None
        finally:
            self._fail_refused()
        if batch is None:
            self._fail_unschedulable()
            return None
        self._schedule_failures = 0
        return batch

    def _cancel_aborted(self) -> None:
        """The aborts callers made since `_take_inputs` of requests the loop holds, at
        once: between the steps of a decode run being committed, so that a request aborted
        from its stream's callback gets no chunk after it, as between single steps. An
        abort of a request not taken in yet (submitted meanwhile) waits for `_take_inputs`,
        which takes the request in first."""
        live = self._live
        with self._lock:
            aborts = [abort for abort in self._aborts if abort[0] in live]
            self._aborts = [abort for abort in self._aborts if abort[0] not in live]
        self._cancel(aborts)

    def _cancel(self, aborts: list[tuple[int, BaseException]]) -> None:
        """Finish aborted requests and those past their deadline, between steps: their
        slots are freed, their computed prefix stays in the cache."""
        now, deadlines, live = time.monotonic(), self._deadlines, self._live
        while deadlines and deadlines[0][0] <= now:  # (each step looks at the first only)
            _, rid = heapq.heappop(deadlines)
            req = live.get(rid)
            if req is not None:  # (a finished one is not live)
                message = f"request {rid} ran past its timeout_s={req.params.timeout_s:g}"
                aborts.append((rid, TimeoutError(message)))
        if len(deadlines) > 2 * len(live) + 64:  # finished ones' entries, dropped (amortised)
            self._deadlines = [entry for entry in deadlines if entry[1] in live]
            heapq.heapify(self._deadlines)
        for rid, error in aborts:
            req = self._live.get(rid)
            if req is not None and not req.done.is_set():
                self._finish(req, error, keep_prefix=True)

    def _run_command(self, name: str, *args: Any) -> Any:
        if name == "radix_snapshot":
            return snapshot(self.tree_cache.root, *args)
        if name == "flush_cache":
            if self.scheduler.has_work or self.tree_cache is None:
                return self.tree_cache is None and not self.scheduler.has_work
            self.tree_cache.flush()
            return True
        raise ValueError(f"unknown engine command {name!r}")

    def _step(self, batch: ScheduledBatch) -> None:
        start = time.perf_counter()
        try:
            logits, rows = self._forward(batch)
        except Exception:  # noqa: BLE001 - find the request it belongs to
            if len(batch.reqs) < 2:
                raise
            logger.exception("forward failed; running each request alone")
            logits, rows = self._forward_alone(batch)
            if not batch.reqs:
                return
        forward_seconds = time.perf_counter() - start
        self._check(self._commit(batch, logits, rows, forward_seconds))
        self._stats.add("step_seconds", time.perf_counter() - start)

    def _commit(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        rows: Sequence[list[int]],
        forward_seconds: float,
    ) -> list[Req]:
        """After the forward: its K/V go to the requests and its counters to the stats, those
        requests whose prompt is done draw their next token and append it (checked by
        `_check`), and prefill-only requests finish. Returns the requests that got a token."""
        ready, row_of = self._account(batch, rows, forward_seconds)
        if batch.mode is ForwardMode.EXTEND:
            self._record_prompt_logprobs(ready, logits, row_of)
        to_sample = self._to_draw(ready)
        return self._sample(to_sample, logits, row_of) if to_sample else []

    def _account(
        self, batch: ScheduledBatch, rows: Sequence[list[int]], forward_seconds: float
    ) -> tuple[list[Req], RowsOf]:
        """A forward's K/V to its requests and its counters to the stats. Returns the
        requests whose prompt is now done, and each request's logits rows by id()."""
        ready = self.scheduler.on_forward_done(batch)
        self._fail_refused()  # (a request whose prefix could not be cached: at once)
        num_running = len(self.scheduler.running)
        self._stats.record_step(batch, num_running=num_running, forward_seconds=forward_seconds)
        return ready, RowsOf(batch.reqs, rows)

    def _to_draw(self, ready: list[Req]) -> list[Req]:
        """Of the requests whose prompt is done, finish the prefill-only ones; returns
        those that draw a token now."""
        draw = [r for r in ready if not r.released and r.max_new_tokens > len(r.output_ids)]
        if len(draw) < len(ready):
            for req in ready:
                if not req.released and req.max_new_tokens == 0:
                    try:  # (its pattern's check: it failed the whole step)
                        req.finish_prefill_only()
                    except Exception as error:  # noqa: BLE001 - this request fails alone
                        self._finish(req, error)
                        continue
                    self._finish(req)
        return draw

    def _check(self, reqs: list[Req]) -> None:
        """Check each request's new token: it finishes the request (slots freed, caller
        told), or a constrained request jumps forward, or a streamed one gets its chunk. A
        request whose check raises fails alone. A batch checked unchanged, step after
        step, is checked as a whole while it finishes none (`SteadyCheck`)."""
        steady = self._steady
        if steady is not None and steady.settles(reqs):
            return
        released, stopped = self._released, []
        for req in reqs:
            if req.released:  # aborted since its token was drawn (overlap scheduling)
                continue
            try:
                if req.continues_plainly():
                    continue
                req.check_last_token()
                finished = req.finished_reason is not None  # (`is_finished`)
                if req.char_fsm is not None and not finished:
                    self._jump_forward(req)
                    finished = req.finished_reason is not None
                if finished:
                    stopped.append(req)
                elif req.is_streamed:
                    chunk = req.stream_delta()
                    if chunk is not None:
                        req.emit_chunk(chunk)
            except Exception as error:  # noqa: BLE001 - this request fails, the rest go on
                logger.exception("request %d failed after its step", req.rid)
                self._finish(req, error)
        self._finish_stopped(stopped)
        plain = bool(reqs) and released == self._released and all(r.checks_plainly for r in reqs)
        self._steady = SteadyCheck(reqs) if plain else None

    def _finish_stopped(self, reqs: list[Req]) -> None:
        """Finish the requests their check stopped (after the check of the step's other
        requests: their chunks and jumps come first), their texts decoded first, in one pass:
        the tokenizer's tables stay in the CPU's caches (finishing 64 requests of 64 tokens
        took 2.06-2.23 ms with each text decoded between the others' frees, 1.93-2.00 ms
        so, with the tokenizers library's decode; `bench_admit_finish.py`)."""
        decoded = []
        for req in reqs:
            try:
                req.finalize_text()
            except Exception:  # noqa: BLE001 - decoded again by `_finish`, which fails it
                decoded.append(False)
                continue
            decoded.append(True)
        for req, text_done in zip(reqs, decoded):
            self._finish(req, decoded=text_done)

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, Sequence[list[int]]]:
        if self.fault_hook is not None:
            for req in batch.reqs:
                self.fault_hook("forward", req)
        return self.runner.forward(batch)

    def _forward_alone(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[list[int]]]:
        """A forward of the whole batch raised: run each request on its own (same slots,
        so what the others compute is what they would have), fail the ones that raise
        again, and narrow `batch` to the rest. Returns their logits and rows, as one
        forward of the narrowed batch would."""
        kept, parts, rows = [], [], []
        num_rows = 0
        for i, req in enumerate(batch.reqs):
            try:
                logits, (req_rows,) = self._forward(batch.alone(i))
            except Exception as error:  # noqa: BLE001 - this request fails, the rest go on
                req.kv_len += batch.extend_lens[i]  # its slots of this step go with it
                self._finish(req, error)
                continue
            kept.append(i)
            parts.append(logits.clone())  # (a decode graph's: its next run overwrites it)
            rows.append([num_rows + r for r in req_rows])
            num_rows += logits.shape[0]
        batch.narrow(kept)
        return (torch.cat(parts) if parts else torch.empty(0, device=self.runner.device)), rows

    def _finish(
        self,
        req: Req,
        error: BaseException | None = None,
        keep_prefix: bool = False,
        decoded: bool = False,
    ) -> None:
        """The request leaves the engine: its slots are freed (its computed tokens go to the
        cache if it succeeded or `keep_prefix`), then its caller is told. Never raises: a
        failure while finishing fails the request instead. `decoded`: its text is final
        already (`_finish_stopped`)."""
        if req.done.is_set():
            return
        req.released = True
        self._released += 1
        self._live.pop(req.rid, None)
        # The last check's batch is stale now (it held this request), and it keeps no
        # finished request alive (a batch that ends by aborts sees no further check).
        self._steady = None
        if req.output_ids and req.output_ids[-1] < 0:  # (overlap) a token still being drawn
            req.output_ids.pop()
        if error is not None:
            req.abort(error)
        self.penalty_counts.release(req)
        try:
            self.scheduler.release(req, insert=error is None or keep_prefix)
            self._leave_in_flight(req)  # (overlap) its slots are free before its caller wakes
            self._leave_run(req)  # (a decode run) likewise
            if not decoded:
                req.finalize_text()
        except Exception as release_error:  # noqa: BLE001
            logger.exception("finishing request %d failed", req.rid)
            if req.error is None:
                req.abort(release_error)
            req.text = ""
        if req.error is None:
            self._stats.add("finished_requests")
        req.group = None  # (its group holds it: a cycle that kept the engine, `Req.tokenizer`)
        with self._lock:
            self._num_unfinished -= 1
        self._announce(req)

    def _announce(self, req: Req) -> None:
        if req.is_streamed:
            # A request past its deadline streams the text it kept (its `partial_output`):
            # the part a stop string might have cut was held back, and never came.
            keep = req.error is None or (isinstance(req.error, TimeoutError) and req.output_ids)
            try:  # (it failed the whole step: every request in it)
                chunk = req.stream_delta() if keep else None
            except Exception as error:  # noqa: BLE001 - this request fails, the rest go on
                logger.exception("the last chunk of request %d failed", req.rid)
                if req.error is None:  # (a timed-out one keeps its TimeoutError)
                    req.abort(error)
                chunk = None
            if chunk is not None:
                req.emit_chunk(chunk)
            if req.stream_queue is not None:
                req.stream_queue.put(None)
        req.done.set()
        if req.on_done is not None:
            try:
                req.on_done(req)
            except BaseException:  # a caller's callback (sys.exit() too) must not fail
                logger.exception("on_done callback of request %d failed", req.rid)


def _no_fault(point: str, req: Req) -> None:
    pass
