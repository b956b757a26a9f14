"""What callers get back from the engine, and how they wait for it: a request's result or
its error as they see it, the stream of a streamed request, a submitted request's future
resolved, the one wake of a caller waiting for a batch, and the flag each request's caller
waits on (`DoneFlag`). These run on callers' threads, or as the loop thread's last act for
a request (`EngineLoop._announce` calls `on_done`); they never touch the scheduler.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmprog_runtime.engine import Engine
    from lmprog_runtime.request import Req


class DoneFlag:
    """`threading.Event`'s `is_set` / `set` / `wait`, set by the loop (again: no effect):
    two objects for the collector to walk where an event makes six (its condition, lock,
    waiters and the condition's bound methods). Its calls are the lock's own (C): an
    Event's `wait` enters its condition in Python, and a Ctrl-C there left that lock held,
    so the loop's `set` would hang.

    Example:
        >>> flag = DoneFlag()
        >>> flag.wait(0), flag.set(), flag.wait(), flag.is_set()
        (False, None, True, True)
    """

    __slots__ = ("_lock", "_is_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held until set: a waiter acquires it to wake
        self._lock.acquire()
        self._is_set = False

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        if not self._is_set:
            self._is_set = True
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, waiting up to `timeout` seconds (None: until it is)."""
        if self._is_set:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            return False
        self._lock.release()  # (for the next waiter)
        return True


def wait_all(
    engine: Engine, reqs: list[Req], woken: DoneFlag | None = None
) -> list[dict[str, Any]]:
    """Wait for every request of `engine` (`woken`, from `wake_once`: first until all are
    done or one failed) and return their results; if the wait is interrupted (Ctrl-C),
    abort the ones still running before the interrupt goes on."""
    try:
        if woken is not None:
            wait_for(engine, woken)
        results = []
        for req in reqs:
            wait_for(engine, req.done)
            if req.error is not None:
                raise request_error(req)
            results.append(req.to_output())
        return results
    except BaseException:
        for req in reqs:
            if not req.done.is_set():
                engine.abort(req.rid)
        raise


def check_off_loop(
    engine: Engine, what: str, hint: str = "use submit() there, and read its future elsewhere"
) -> None:
    """RuntimeError where `what` would wait on `engine`'s own loop thread (in a callback:
    `on_chunk`, a future's done callback): the loop waited for itself, and every request
    of the engine hung."""
    if threading.current_thread() is engine._thread:
        raise RuntimeError(
            f"{what} cannot wait on the engine's own loop thread (a callback would wait for "
            f"the loop that runs it): {hint}"
        )


def wait_for(engine: Engine, event: DoneFlag) -> None:
    """Wait for `event`, set by `engine`'s loop thread; a RuntimeError if that thread has
    stopped (a caller never waits forever), or if this is that thread."""
    if not event.is_set():
        check_off_loop(engine, "a blocking call")
    while not event.wait(0.5):
        if not engine._thread.is_alive():
            raise RuntimeError("the engine loop has stopped")


def wake_once(reqs: list[Req]) -> DoneFlag:
    """An event set when all of `reqs` are done, or one of them failed (set on the loop
    thread, by their `on_done`: set it before they are submitted). A caller waiting for
    a batch wakes once, not at each request: at every wake it takes the GIL from the loop,
    which finishes the others meanwhile (each torch op of the loop hands the GIL over)."""
    woken, left = DoneFlag(), [len(reqs)]

    def done(req: Req) -> None:
        left[0] -= 1
        if not left[0] or req.error is not None:
            woken.set()

    for req in reqs:
        req.on_done = done
    return woken


class RequestAborted(RuntimeError):
    """A request was cancelled: `Engine.abort`, a closed stream or an interrupted wait."""


class QueueFull(RuntimeError):
    """More requests wait to be admitted than the engine's `max_queued_requests`."""


class RequestStream:
    """The chunks of one streamed request. Closing it (or dropping it) before the end
    aborts the request."""

    def __init__(self, engine: Engine, req: Req) -> None:
        assert req.stream_queue is not None
        self._engine = engine
        self._req = req
        self._is_over = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._is_over:
            raise StopIteration
        if self._req.stream_queue.empty():
            check_off_loop(self._engine, "reading a stream")
        try:
            chunk = self._req.stream_queue.get()
        except BaseException:
            self.close()
            raise
        if chunk is not None:
            return chunk
        self._is_over = True
        if self._req.error is not None:
            raise request_error(self._req)
        raise StopIteration

    def close(self) -> None:
        """Stop reading: the request is aborted if it has not finished."""
        if not self._is_over:
            self._is_over = True
            if not self._req.done.is_set():
                self._engine.abort(self._req.rid)

    def __del__(self) -> None:
        if not self._engine._stopping:
            with contextlib.suppress(Exception):  # never raise from a finalizer
                self.close()


def request_error(req: Req) -> Exception:
    """What a caller gets for a failed request: the request named, its error as the cause;
    a cancelled one (aborted, timed out) raises its own error, which names it. A timed-out
    one's error holds what it generated before its deadline (`partial_output`, an output
    dict whose `finish_reason` is an abort)."""
    if isinstance(req.error, TimeoutError):
        req.error.partial_output = req.to_output()  # type: ignore[attr-defined]
    if isinstance(req.error, (RequestAborted, TimeoutError)):
        return req.error
    # (the message `abort` read: an error's own may raise when read again)
    message = (req.finished_reason or {}).get("message", req.error)
    error = RuntimeError(f"request {req.rid} failed: {message}")
    error.__cause__ = req.error
    return error


class RequestFuture(Future):
    """A submitted request's `concurrent.futures.Future`, whose `result()` and
    `exception()`, still unresolved, raise RuntimeError on the engine's own loop thread (a
    callback) rather than wait there for ever."""

    def result(self, timeout: float | None = None) -> Any:
        self._check_off_loop("result()", timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._check_off_loop("exception()", timeout)
        return super().exception(timeout)

    def _check_off_loop(self, what: str, timeout: float | None) -> None:
        engine = self.__dict__.get("engine")  # (until it resolves)
        waits = timeout is None or timeout > 0  # (a poll, `timeout=0`, raises TimeoutError)
        if waits and engine is not None and not self.done():
            check_off_loop(engine, f"a future's {what}")


def resolve_future(future: Future, req: Req) -> None:
    """A submitted request finished: its future gets the result or the error (and lets go
    of its engine)."""
    future.__dict__.pop("engine", None)
    if req.error is not None:
        future.set_exception(request_error(req))
    else:
        future.set_result(req.to_output())
