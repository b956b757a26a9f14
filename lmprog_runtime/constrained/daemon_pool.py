"""A thread pool for compiles whose threads are daemons.

The interpreter's exit joins a `ThreadPoolExecutor`'s threads before the at-exit handlers
run, so a script that ended while one of its programs was compiling a pattern waited for
that compile (up to `grammar_compile_timeout_s`, a minute by default) before the engine's
at-exit shutdown could stop it. Daemon threads are not joined: the shutdown interrupts
their compiles (`GrammarCache.close`). The same `submit` / `shutdown` as the executor's,
threads started as needed up to `max_workers`, an idle one reused first. As the
executor's, the threads hold the pool only weakly and end once it is collected (a dropped
engine's grammar cache, and the compile processes it holds, go with it), and hold nothing
of a compile once it is over.
"""

from __future__ import annotations

import itertools
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_names = itertools.count()


class DaemonPool:
    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future, Callable, tuple] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # released by a thread that waits for work
        self._lock = threading.Lock()
        self._threads = 0
        self._count = [0]  # threads not yet told to end (shared with the finalizer)
        self._is_shut_down = False
        # Collected unused: its threads end (each takes one None).
        weakref.finalize(self, _release, self._queue, self._count)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((future, fn, args))
            if not self._idle.acquire(timeout=0) and self._threads < self.max_workers:
                self._threads += 1
                self._count[0] = self._threads
                name = f"{self.name}_{next(_names)}"
                work = (self._queue, self._idle)  # (not the pool: see the module doc)
                threading.Thread(target=_work, args=work, name=name, daemon=True).start()
        return future

    def is_drained(self) -> bool:
        """Shut down with nothing queued: no work left to cancel (what runs may go on)."""
        return self._is_shut_down and self._queue.empty()

    def shutdown(self, cancel_futures: bool = False) -> None:
        """The threads end once the work queued before ends (`cancel_futures`: is
        cancelled); work running goes on. Never waits."""
        with self._lock:
            self._is_shut_down = True
            if cancel_futures:
                ends = 0  # (a shutdown before put them there: each a thread's end)
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        ends += 1
                    else:
                        item[0].cancel()
                for _ in range(ends):
                    self._queue.put(None)
            _release(self._queue, self._count)


def _release(work: queue.SimpleQueue, count: list[int]) -> None:
    """Ends the threads once the work queued before is over (each takes one None)."""
    for _ in range(count[0]):
        work.put(None)
    count[0] = 0


def _work(work: queue.SimpleQueue, idle: threading.Semaphore) -> None:
    while (item := work.get()) is not None:
        _run(*item)
        del item  # (holds nothing of the compile while idle)
        idle.release()


def _run(future: Future, fn: Callable, args: tuple) -> None:
    if future.set_running_or_notify_cancel():
        try:
            result = fn(*args)
        except BaseException as error:  # (a compile's interruption included)
            future.set_exception(error)
        else:
            future.set_result(result)
