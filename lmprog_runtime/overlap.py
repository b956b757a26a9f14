"""Overlap scheduling: the loop checks step N's tokens while step N+1's forward runs.

Run synchronously, a step is its forward, then the CPU work on its results: stop checks and
the detokenizing they need, grammar advances, jump-forward, streaming, finishing requests
(slots to the cache, callers told); the device waits through all of it. Overlapped (as
SGLang's zero-overhead scheduler does), one iteration of the loop:

1. collects step N from the `ForwardWorker`, accounts its K/V, draws its tokens and appends
   them to the requests, unchecked (`EngineLoop._commit`);
2. takes what callers handed in, schedules step N+1, reads its inputs from the requests and
   launches its forward on the worker;
3. checks step N's tokens (`EngineLoop._check`) while that forward runs.

Step N+1 is scheduled before step N's tokens are checked, so it carries the requests those
checks finish: each leaves it as it finishes (`_leave_in_flight`: the pages the forward
started for it are freed at once), and what the forward computed for it is dropped when the
forward is collected; a request that jumps forward leaves the same way. Everything a forward
reads from the requests is read in step 2, on the loop thread (`ModelRunner.prepare`): the
worker touches tensors only, and nothing writes the K/V pool or the request table while it
runs (step 3 only frees slots and rows, which nothing can take before the next schedule).
Sampling stays in step 1, after the previous checks, so penalties, grammar masks and seeded
generators see what they see in the synchronous loop: the outputs are token-identical.

The worker is one thread. On CUDA it queues the forward on a stream of its own, behind the
loop thread's copies of the inputs, and waits for it there; on a CPU it computes the forward
itself (overlap is off there by default: the forward and the loop share the cores).
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmprog_runtime.forward_batch import ForwardBatch
    from lmprog_runtime.model_runner import ModelRunner
    from lmprog_runtime.request import Req
    from lmprog_runtime.scheduler import ScheduledBatch

logger = logging.getLogger("lmprog_runtime.engine")


class ForwardWorker:
    """Runs prepared forwards one at a time, in launch order, off the loop thread.

    Example:
        >>> worker = ForwardWorker(engine.runner)  # doctest: +SKIP
        >>> fb, rows = engine.runner.prepare(batch)  # doctest: +SKIP
        >>> logits, seconds = worker.result(worker.launch(fb))  # doctest: +SKIP
    """

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner  # `runner.run` is looked up at each forward (tests wrap it)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lmprog-forward")
        is_cuda = runner.device.type == "cuda"
        self._stream = torch.cuda.Stream(runner.device) if is_cuda else None

    def launch(self, fb: ForwardBatch) -> Future:
        """Start `fb`'s forward; returns a future of (logits, seconds the forward took)."""
        inputs_ready = None
        if self._stream is not None:
            inputs_ready = torch.cuda.Event()
            inputs_ready.record()  # after the inputs' copies, queued on the loop's stream
        return self._executor.submit(self._forward, fb, inputs_ready)

    def result(self, future: Future) -> tuple[torch.Tensor, float]:
        """Wait for a launched forward (raising its error). Its kernels are done, so the
        logits may be used on the loop thread's stream. (Freed, they may serve the worker's
        next forward, which first waits for what the loop queued before launching it.)"""
        return future.result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)

    def _forward(
        self, fb: ForwardBatch, inputs_ready: torch.cuda.Event | None
    ) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        if self._stream is None:
            return self._runner.run(fb), time.perf_counter() - start
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(inputs_ready)
            logits = self._runner.run(fb)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        return logits, time.perf_counter() - start


@dataclass
class InFlight:
    """A launched forward: its batch, each request's logits rows and slots, the worker's
    future, and the requests that left it while it ran (finished or jumped forward)."""

    batch: ScheduledBatch
    rows: list[list[int]]
    future: Future
    slots: list[torch.Tensor] = field(init=False)  # per request: its new KV slots
    index: dict[int, int] = field(init=False)  # id(request) -> its index in `batch`
    left: set[int] = field(default_factory=set)  # indices of the requests that left

    def __post_init__(self) -> None:
        self.slots = self.batch.slots_per_req()
        self.index = {id(req): i for i, req in enumerate(self.batch.reqs)}

    def drop_left(self) -> None:
        """Narrow the batch (and its rows) to the requests that stayed."""
        if self.left:
            keep = [i for i in range(len(self.batch.reqs)) if i not in self.left]
            self.batch.narrow(keep)
            self.rows = [self.rows[i] for i in keep] if self.rows else []


class OverlapLoop:
    """The overlapped iteration of `EngineLoop` (a mixin, as it is: `Engine` sets
    `_worker` and `_in_flight`)."""

    def _run_once_overlapped(self) -> None:
        """Collect step N, launch step N+1, check step N (see the module docstring)."""
        start = time.perf_counter()
        appended = self._collect() if self._in_flight is not None else None
        self._take_inputs()
        batch = self._schedule()
        if batch is not None:
            self._launch(batch)
        if appended is not None:
            self._check(appended)
            self._stats.add("step_seconds", time.perf_counter() - start)

    def _launch(self, batch: ScheduledBatch) -> None:
        """Read `batch`'s inputs from the requests now, then start its forward on the
        worker. A failure here counts as the forward's: it shows when `batch` is collected."""
        rows: list[list[int]] = []
        try:
            if self.fault_hook is not None:
                for req in batch.reqs:
                    self.fault_hook("forward", req)
            fb, rows = self.runner.prepare(batch)
            future = self._worker.launch(fb)
        except Exception as error:  # noqa: BLE001 - handled as the forward's failure
            future = Future()
            future.set_exception(error)
        self._in_flight = InFlight(batch, rows, future)

    def _leave_in_flight(self, req: Req) -> None:
        """`req` finished or jumped forward while a forward that carries it runs: what that
        forward computes for it will be dropped, and the pages it started for it are freed
        now (so a finished request's slots are all free when its caller wakes)."""
        flight = self._in_flight
        i = flight.index.pop(id(req), None) if flight is not None else None
        if i is not None:
            flight.left.add(i)
            self.scheduler.free_started_pages(flight.slots[i])

    def _collect(self) -> list[Req] | None:
        """Wait for the launched forward and commit it for the requests that stayed in it
        (their tokens drawn and appended). A failed forward is run again request by request,
        as the synchronous loop does. Returns the requests that got a token; None if the
        step failed or nothing is left of it."""
        flight, self._in_flight = self._in_flight, None
        batch = flight.batch
        try:
            logits, forward_seconds = self._worker.result(flight.future)
            error = None
        except Exception as forward_error:  # noqa: BLE001 - find the request it belongs to
            error, forward_seconds = forward_error, 0.0
        try:
            flight.drop_left()
            if not batch.reqs:
                return None  # every request of it finished meanwhile: nothing to count
            rows = flight.rows
            if error is not None:
                if len(batch.reqs) < 2:
                    raise error
                logger.error("forward failed; running each request alone", exc_info=error)
                logits, rows = self._forward_alone(batch)
                if not batch.reqs:
                    return None
            return self._commit(batch, logits, rows, forward_seconds)
        except Exception as step_error:  # one bad step must not take the loop down
            logger.exception("engine step failed")
            self._fail_step(batch, step_error)
            return None

    def _abandon_in_flight(self, error: BaseException) -> None:
        """Fail the requests of the launched forward, if any, once it is over (at shutdown,
        or when an iteration failed): what it wrote counts as theirs, so failing them frees
        it."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        with contextlib.suppress(Exception):  # its outcome no longer matters
            flight.future.result()
        flight.drop_left()
        for req, n in zip(flight.batch.reqs, flight.batch.extend_lens):
            req.kv_len += n
            self._finish(req, error)
