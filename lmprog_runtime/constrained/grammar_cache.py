"""Compiled grammars, keyed by (kind, pattern): a repeated schema compiles once.

Compilation runs on a worker thread, never on the engine loop, so the engine keeps
serving while a new schema compiles. The submitting caller waits for it, at most
`timeout_s`; errors (a bad pattern, one too large, one too slow to compile) reach the
caller as ValueError before anything is queued. Concurrent callers asking for the same
pattern share one compile.

The cache keeps the `max_entries` grammars used last, and fewer where they would hold more
than `max_bytes` (over a 49k-token vocabulary a small JSON schema's grammar takes about
1.4 MiB with jump-forward's FSM, but `[^\n]{1,150}`'s index about 170 MiB: a dataset run
with a pattern per row, or token healing's patterns, would otherwise grow without bound,
and 64 patterns of bounded free text would hold 11 GiB). Dropping
one only drops the cache's reference: requests using it keep it; asked for again, it
compiles again. Compiles still running are never dropped, so their callers keep sharing
them.

A compile that outlasts the timeout, or whose only caller is interrupted (Ctrl-C), is
abandoned: its thread is interrupted (the jump-forward FSM's build, pure Python, stops at
once; outlines-core's compile, native code, runs in a child process that is then killed:
`index_process.py`), and later compiles go to fresh threads, so a pattern that explodes does
not hold up the others (while at most `MAX_STUCK` abandoned compiles still run, as a
backend's native code in a thread would: the threads of more would grow without bound).
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

from lmprog_runtime.constrained.base import BaseGrammarBackend, Grammar
from lmprog_runtime.constrained.daemon_pool import DaemonPool
from lmprog_runtime.constrained.portable_regex import without_edge_anchors

MAX_PATTERN_CHARS = 50_000
MAX_STUCK = 4  # abandoned compiles (busy in native code) beside which fresh threads start
QUEUED_POLL_S = 0.05  # how often a caller looks whether its queued compile has started
QUEUED_TIMEOUTS = 4  # ... and for how many timeouts at most (threads stuck ahead of it)
SHUT_DOWN = "the engine was shut down before this pattern compiled"
logger = logging.getLogger(__name__)


class GrammarCache:
    """`jump_forward`: each compile builds the grammar's character FSM too (`char_fsm`),
    under the same timeout. `max_bytes`: what the grammars kept may hold together (their
    `nbytes`; None: no bound)."""

    def __init__(
        self,
        backend: BaseGrammarBackend,
        timeout_s: float = 60.0,
        max_entries: int = 64,
        jump_forward: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        self.backend = backend
        self.jump_forward = jump_forward
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()  # oldest use first
        self._jobs: dict[Future, _Job] = {}  # the compiles submitted and not yet over
        self._waiting: dict[Future, int] = {}  # callers waiting for each of those
        self._pool = _new_pool()
        self._old_pools: list[DaemonPool] = []  # replaced after a timeout
        self._stuck: set[_Job] = set()  # abandoned compiles that may still run
        self._closed = False

    def char_fsm(self, grammar: Grammar):
        """The character automaton of a compiled grammar, for jump-forward (built once);
        None where it cannot be built from the pattern (it runs without jump-forward)."""
        if not hasattr(grammar, "_char_fsm"):
            _build_char_fsm(grammar)
        return grammar._char_fsm or None  # type: ignore[attr-defined]

    def get(self, kind: str, pattern: str, *, size_checked: bool = False) -> Grammar:
        """kind: "regex" or "json_schema" (JSON text). Raises ValueError for bad patterns.
        `size_checked`: `pattern` was made from one this cache took (a healed pattern: the
        backed-up text in front), so is not refused for its length."""
        if len(pattern) > MAX_PATTERN_CHARS and not size_checked:
            raise ValueError(f"{kind} is too large ({len(pattern)} > {MAX_PATTERN_CHARS} chars)")
        key = (kind, pattern)
        with self._lock:
            if self._closed:
                raise RuntimeError(SHUT_DOWN)
            future = self._entries.get(key)
            if future is None:
                job = _Job()
                future = self._pool.submit(job.run, self._compile, kind, pattern)
                self._entries[key] = future
                self._jobs[future] = job
            else:
                self._entries.move_to_end(key)
            job = self._jobs.get(future)
            self._waiting[future] = self._waiting.get(future, 0) + 1
        try:
            grammar = self._result(future, job)
        except CancelledError as error:  # (queued when the engine shut down)
            raise RuntimeError(SHUT_DOWN) from error
        except (FutureTimeout, _Abandoned) as error:
            self._forget(key, future)
            self._abandon(future)
            if self._closed:
                raise RuntimeError(SHUT_DOWN) from error
            raise ValueError(  # (the time is outlines-core's index: jump-forward's NFA is quick)
                f"{kind} took longer than {self.timeout_s:g} s to compile; simplify it"
            ) from error
        except Exception:
            self._forget(key, future)  # a bad pattern is not remembered
            raise
        except BaseException:  # Ctrl-C while waiting: a compile no one else waits for stops
            with self._lock:
                alone = self._waiting.get(future) == 1
            if alone:
                self._forget(key, future)
                self._abandon(future)
            raise
        finally:
            with self._lock:
                left = self._waiting.pop(future, 1) - 1
                if left:
                    self._waiting[future] = left
                else:
                    self._jobs.pop(future, None)
        self._trim()
        return grammar

    def _result(self, future: Future, job: _Job | None) -> Grammar:
        """The compile's grammar, waiting until `timeout_s` after it started: one queued
        behind slow compiles is not charged for their time (it timed out, and its pattern
        was called too slow)."""
        queued_until = time.monotonic() + QUEUED_TIMEOUTS * self.timeout_s
        while job is not None and job.started_at is None:
            if time.monotonic() > queued_until:  # (the threads ahead of it never came back)
                raise ValueError(
                    f"no compile thread was free for {QUEUED_TIMEOUTS * self.timeout_s:g} s: "
                    "the patterns ahead of this one are too slow to compile"
                )
            try:
                return future.result(timeout=QUEUED_POLL_S)
            except FutureTimeout:
                continue
        started = job.started_at if job is not None else time.monotonic()
        return future.result(timeout=max(0.0, started + self.timeout_s - time.monotonic()))

    def _abandon(self, future: Future) -> None:
        """A compile outlasted the timeout: stop it, and let later compiles start on fresh
        threads, as its own may stay busy in native code for long (up to `MAX_STUCK` such
        compiles: past them, later ones wait for the threads there are, as before)."""
        with self._lock:
            job = self._jobs.pop(future, None)
            if job is None or self._closed or future.cancel():  # (not started: never will)
                return
            self._stuck = {j for j in self._stuck if not j.is_over}
            self._stuck.add(job)
            old, is_replaced = self._pool, len(self._stuck) <= MAX_STUCK
            if is_replaced:
                self._pool = _new_pool()
                # (kept to cancel what they hold at `close`: one a timeout, they grew in a
                # long-lived engine)
                self._old_pools = [p for p in self._old_pools if not p.is_drained()] + [old]
        job.interrupt()
        if is_replaced:
            old.shutdown()  # its other threads exit once its queue is done

    def close(self) -> None:
        """Stop the compile threads (the engine shuts down): compiles not started are
        cancelled, running ones interrupted (their callers get the shutdown's error), and
        the threads then exit."""
        with self._lock:
            self._closed = True
            pools, self._old_pools = [*self._old_pools, self._pool], []
            running = list(self._jobs.values())
        for pool in pools:
            pool.shutdown(cancel_futures=True)
        for job in running:
            job.interrupt()
        self.backend.close()

    def is_compiled(self, kind: str, pattern: str) -> bool:
        """Whether `get(kind, pattern)` would return at once (compiled, cached)."""
        with self._lock:
            future = self._entries.get((kind, pattern))
        return (
            future is not None
            and future.done()
            and not future.cancelled()
            and future.exception() is None
        )

    def keys(self) -> list[tuple[str, str]]:
        """The cached (kind, pattern) keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def _trim(self) -> None:
        """Drop the least recently used compiled grammars beyond `max_entries`, and while
        those kept hold more than `max_bytes`; a grammar larger than that alone is never
        kept (it emptied the cache). Compiles still running are kept."""
        with self._lock:
            done = [(key, _nbytes(f)) for key, f in self._entries.items() if f.done()]
            if self.max_bytes is not None:
                for key, size in done:
                    if size > self.max_bytes:
                        del self._entries[key]
                done = [(key, size) for key, size in done if size <= self.max_bytes]
            excess = len(self._entries) - self.max_entries
            held = sum(size for _, size in done)
            for key, size in done:  # (least recently used first)
                if excess <= 0 and (self.max_bytes is None or held <= self.max_bytes):
                    break
                del self._entries[key]
                excess, held = excess - 1, held - size

    def _compile(self, kind: str, pattern: str) -> Grammar:
        regex = pattern if kind == "regex" else self.backend.schema_to_regex(pattern)
        if kind != "regex" and len(regex) > MAX_PATTERN_CHARS:  # (`get` checked a regex's)
            hint = (
                "optional properties grow it most (each may be left out, so the pattern "
                "spells out what may follow each): make some required, or split the schema"
                if _has_optional_properties(pattern)
                else "split it, or shorten its patterns"
            )
            raise ValueError(
                f"the {kind} expands to a regex of {len(regex):,} characters, over the "
                f"{MAX_PATTERN_CHARS:,} this engine compiles; {hint}"
            )
        grammar = self.backend.compile_regex(regex)
        if self.jump_forward:  # (here, not on the caller's thread: its size may explode)
            _build_char_fsm(grammar)
        return grammar

    def _forget(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            if self._entries.get(key) is future:
                del self._entries[key]


def _nbytes(future: Future) -> int:
    """The size of a finished compile's grammar, its character FSM's included (0 for one
    that failed)."""
    if future.cancelled() or future.exception() is not None:
        return 0
    grammar = future.result()
    char_fsm = getattr(grammar, "_char_fsm", None)
    return grammar.nbytes + (char_fsm.nbytes() if char_fsm else 0)


def _has_optional_properties(schema: str) -> bool:
    """Whether the schema (JSON text) has a property that is not required anywhere."""

    def walk(node: Any) -> bool:
        if isinstance(node, list):
            return any(walk(item) for item in node)
        if not isinstance(node, dict):
            return False
        props = node.get("properties")
        if isinstance(props, dict) and set(props) - set(node.get("required") or ()):
            return True
        return any(walk(value) for value in node.values())

    return walk(json.loads(schema))


def _build_char_fsm(grammar: Grammar) -> None:
    """Set `grammar._char_fsm`: its character automaton, or False where `regex_nfa` cannot
    read a pattern outlines-core compiled (an anchor inside it, over `MAX_STATES` states:
    no jump-forward then)."""
    from lmprog_runtime.constrained.jump_forward import CharFSM

    try:
        regex = without_edge_anchors(grammar.regex)  # (the NFA reads no anchor)
        grammar._char_fsm = CharFSM(regex)  # type: ignore[attr-defined]
    except Exception as error:  # noqa: BLE001 - `Unsupported`, re.error, RecursionError
        logger.info("no jump-forward for %.80r: %s", grammar.regex, error)
        grammar._char_fsm = False  # type: ignore[attr-defined]


def _new_pool() -> DaemonPool:
    return DaemonPool(max_workers=4, name="lmprog-grammar")


class _Abandoned(BaseException):
    """Raised in a compile's thread to stop it (a BaseException: no `except Exception` in a
    library it runs through may swallow it)."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread `thread_id` at its next Python instruction (None: clear
    one pending)."""
    py_exc = ctypes.py_object(exc) if exc is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), py_exc)


class _Job:
    """One compile on a pool thread, which the caller may interrupt while it runs, and only
    then: an interruption never outlives the compile (a pending one is cleared at its end),
    nor lands inside an `uninterrupted()` block (it lands at the block's end)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread_id: int | None = None
        self.started_at: float | None = None  # (time.monotonic())
        self.shielded = 0  # `uninterrupted()` blocks it is in
        self.is_interrupted = False
        self.is_over = False

    def run(self, compile_: Callable[[str, str], Grammar], kind: str, pattern: str) -> Grammar:
        with self.lock:
            if self.is_interrupted:
                raise _Abandoned
            self.thread_id, self.started_at = threading.get_ident(), time.monotonic()
        _running.job = self
        try:
            return compile_(kind, pattern)
        finally:
            _running.job = None
            while True:  # (an interruption arriving here is taken, then the loop goes on)
                try:
                    with self.lock:
                        self.thread_id, self.is_over = None, True
                        if self.is_interrupted:
                            _set_async_exc(threading.get_ident(), None)
                    break
                except _Abandoned:
                    continue

    def interrupt(self) -> None:
        with self.lock:
            self.is_interrupted = True
            if self.thread_id is not None and not self.shielded:
                _set_async_exc(self.thread_id, _Abandoned)


_running = threading.local()  # .job: the `_Job` this thread runs, if any


@contextmanager
def uninterrupted() -> Iterator[None]:
    """A block a compile's interruption must not land in (starting a child process: an
    exception inside `subprocess.Popen`, after its fork, left the child unreaped); one
    asked for meanwhile is raised at its end."""
    job = getattr(_running, "job", None)
    if job is None:
        yield
        return
    with job.lock:
        if job.is_interrupted:  # (asked for just before: it may not have landed yet)
            raise _Abandoned
        job.shielded += 1
    try:
        yield
    finally:
        with job.lock:
            job.shielded -= 1
            owed = job.is_interrupted and not job.shielded
        if owed:
            raise _Abandoned
