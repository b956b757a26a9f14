"""The forward worker of overlap scheduling (`overlap.py`): it runs forwards and draws one
at a time, in the order they are queued, and hands back futures of their results.

On CUDA the worker queues its jobs on the loop thread (`threaded=False`, an
`InlineExecutor`), on the loop's own stream: queuing a forward or a draw never waits for
the device, so the loop goes on at once, and the stream keeps everything in the order it
was queued (the loop's input copies, the forwards, the draws, the copies back), with no
events, stream switches or waits between them to queue on the host (each costs the host
some 15 us a step there: `gpu_check.py`'s `host_costs`). A second Python thread would only
take turns with the loop at the GIL (torch drops it around each op), and each turn costs a
hand-over (SGLang's scheduler, too, now overlaps with a CUDA stream and no thread:
sgl-project/sglang#11210). On a CPU the worker is a thread that computes its jobs (overlap
is off there by default: the forward and the loop share the cores); a threaded worker on
CUDA queues on a stream of its own, behind an event after the loop's input copies.

A forward's seconds are its device time where a stream of the worker's own holds it (CUDA
events around it), else what its call took on the host (on CUDA: queuing its kernels, as
the synchronous loop and decode runs time theirs).

The worker touches tensors only; what a forward or a draw reads of the requests is read
on the loop thread before it is queued.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmprog_runtime.logprobs import LogprobAsk, TokenLogprob
from lmprog_runtime.sampling import SampleRow, sample_each, take_rows
from lmprog_runtime.transfer import use_device

if TYPE_CHECKING:
    from lmprog_runtime.forward_batch import ForwardBatch
    from lmprog_runtime.model_runner import ModelRunner


class ForwardTimer:
    """How long a forward took on its device: CUDA events around it (read once they have
    passed), or the seconds a CPU forward ran."""

    def __init__(self, seconds: float = 0.0) -> None:
        self._seconds = seconds
        self.start: torch.cuda.Event | None = None
        self.end: torch.cuda.Event | None = None

    def seconds(self) -> float:
        if self.end is None:
            return self._seconds
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000


@dataclass
class Sampled:
    """A queued draw's outcome: the tokens and the logprobs table its rows asked for
    (`LogprobAsk.gather`; host tensors, valid once `ready` has passed), the rows that
    failed, the forward's timer."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    ready: torch.cuda.Event | None
    errors: dict[int, Exception]
    timer: ForwardTimer


class ForwardWorker:
    """Runs forwards and draws one at a time, in the order they are queued: on a thread of
    its own, or (on CUDA) queued on its stream from the caller's thread.

    Example (one request decoding, its logits in row 0, its table row `row`):
        >>> worker = ForwardWorker(engine.runner)  # doctest: +SKIP
        >>> fb, rows = engine.runner.prepare(batch)  # doctest: +SKIP
        >>> launched = worker.launch(fb)  # doctest: +SKIP
        >>> ask = LogprobAsk.of([req])  # doctest: +SKIP
        >>> drawing = worker.sample(launched, [0], sample_rows([req], vocab, counts), [row], ask)  # doctest: +SKIP
        >>> ids, errors, logprobs, seconds = worker.sampled(drawing, ask)  # doctest: +SKIP
    """

    def __init__(self, runner: ModelRunner, threaded: bool | None = None) -> None:
        """`threaded`: the jobs run on a thread of their own, or on the caller's thread as
        they are queued (None: a thread on a CPU, where a forward computes; none on CUDA,
        where queuing one returns at once; see the module docstring)."""
        self._runner = runner  # `runner.run` is looked up at each forward (tests wrap it)
        self._device = runner.device
        is_cuda = runner.device.type == "cuda"
        if threaded is None:
            threaded = not is_cuda
        self._executor: ThreadPoolExecutor | InlineExecutor = (
            ThreadPoolExecutor(
                1,
                thread_name_prefix="lmprog-forward",
                initializer=use_device,
                initargs=(runner.device,),
            )
            if threaded
            else InlineExecutor()
        )
        # A stream of its own for a thread queuing on CUDA; inline, the loop's stream.
        self._stream = torch.cuda.Stream(runner.device) if is_cuda and threaded else None

    def launch(self, fb: ForwardBatch) -> Future:
        """Queue `fb`'s forward; returns a future of (logits, its `ForwardTimer`), set once
        the forward is queued on the device (on a CPU, once it has run)."""
        inputs_ready = None
        if self._stream is not None:
            inputs_ready = torch.cuda.Event()
            inputs_ready.record()  # after the inputs' copies, queued on the loop's stream
        return self._executor.submit(self._forward, fb, inputs_ready)

    def sample(
        self,
        launched: Future,
        index: list[int],
        rows: list[SampleRow],
        table_rows: list[int] | torch.Tensor,
        ask: LogprobAsk,
    ) -> Future:
        """Queue the draw of `rows` from rows `index` of a launched forward's logits, behind
        it, and the logprobs `ask` wants of it; the tokens also go to
        `future_tokens[table_rows]` (`table_rows` a list, or on the device), where the next
        forward's placeholders find them.
        Returns a future of `Sampled`."""
        return self._executor.submit(self._sample, launched, index, rows, table_rows, ask)

    @staticmethod
    def sampled(
        future: Future, ask: LogprobAsk
    ) -> tuple[list[int], dict[int, Exception], list[TokenLogprob | None], float]:
        """Wait for a queued draw: (token ids, failed rows' errors, each row's logprobs as
        `ask` wanted them, the forward's seconds). Nothing here reads the device."""
        drawn: Sampled = future.result()
        if drawn.ready is not None:
            drawn.ready.synchronize()
        ids, logprobs = drawn.token_ids.tolist(), ask.unpack(drawn.logprobs)
        return ids, drawn.errors, logprobs, drawn.timer.seconds()

    @staticmethod
    def wait_forward(launched: Future) -> tuple[torch.Tensor, ForwardTimer]:
        """A launched forward's (logits, timer), readable on the loop thread's stream (as
        prompt logprobs read them): once its kernels are done where the worker has a stream
        of its own; where it queues on the loop's, at once (the stream orders the reads)."""
        logits, timer = launched.result()
        if timer.end is not None:
            timer.end.synchronize()
            _read_on_current_stream(logits)
        return logits, timer

    def synchronize(self) -> None:
        """Wait until nothing queued on the worker runs any more (on the device too)."""
        self._executor.submit(lambda: None).result()
        if self._stream is not None:
            self._stream.synchronize()
        elif self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def hand_over(self) -> None:
        """The loop thread runs forwards itself from now on (a decode run takes over from
        the overlapped loop): the worker's thread has run all it was given, and what the
        loop queues on its own stream runs after all the worker queued on the device (no
        wait on the host there). The worker's jobs, the other way round, already wait for
        the loop's stream (`launch`)."""
        self._executor.submit(lambda: None).result()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def close(self) -> None:
        self._executor.shutdown(wait=False)

    def _forward(
        self, fb: ForwardBatch, inputs_ready: torch.cuda.Event | None
    ) -> tuple[torch.Tensor, ForwardTimer]:
        if self._stream is None:
            start = time.perf_counter()
            logits = self._runner.run(fb)
            return logits, ForwardTimer(time.perf_counter() - start)
        timer = ForwardTimer()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(inputs_ready)
            # The inputs are one block, made on the loop's stream and dropped once this is
            # queued: not to be handed out again before this stream has read it.
            fb.positions.record_stream(self._stream)
            timer.start = torch.cuda.Event(enable_timing=True)
            timer.end = torch.cuda.Event(enable_timing=True)
            timer.start.record()
            logits = self._runner.run(fb)
            timer.end.record()
        return logits, timer

    def _sample(
        self,
        launched: Future,
        index: list[int],
        rows: list[SampleRow],
        table_rows: list[int] | torch.Tensor,
        ask: LogprobAsk,
    ) -> Sampled:
        logits, timer = launched.result()  # done: jobs run in order
        on_stream = self._stream is not None
        with torch.cuda.stream(self._stream) if on_stream else contextlib.nullcontext():
            token_ids = self._runner.greedy_tokens(logits, index, rows)
            errors: dict[int, Exception] = {}
            if token_ids is None:  # (else drawn and stored in the decode graph)
                logits = take_rows(logits, index)
                token_ids, errors = sample_each(logits, rows)
                self._runner.store_future_tokens(table_rows, token_ids)
            token_ids, logprobs, ready = ask.gather_to_host(logits, token_ids)
        return Sampled(token_ids, logprobs, ready, errors, timer)


class InlineExecutor:
    """Runs each job as it is submitted, on the caller's thread: `submit` returns its
    future done (with the job's result or exception), so jobs run in order."""

    @staticmethod
    def submit(fn: Callable[..., Any], /, *args: Any) -> Future:
        future: Future = Future()
        try:
            result = fn(*args)
        except BaseException as error:  # noqa: BLE001 - to its future, as a thread's would
            future.set_exception(error)
        else:
            future.set_result(result)
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs behind the caller's back: nothing to stop."""


def _read_on_current_stream(tensor: torch.Tensor) -> None:
    """`tensor`, made on the worker's stream, is read on the caller's: its block must not
    be handed to the worker's stream again before that reading has run."""
    tensor.record_stream(torch.cuda.current_stream(tensor.device))
