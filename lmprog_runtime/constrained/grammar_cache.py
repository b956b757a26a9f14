"""Compiled grammars, keyed by (kind, pattern): a repeated schema compiles once.

Compilation runs on a worker thread, never on the engine loop, so the engine keeps
serving while a new schema compiles. The submitting caller waits for it, at most
`timeout_s`; errors (a bad pattern, one too large, one too slow to compile) reach the
caller as ValueError before anything is queued. Concurrent callers asking for the same
pattern share one compile.

The cache keeps the `max_entries` grammars used last (a compiled grammar over a 49k-token
vocabulary takes 20-35 MiB: a dataset run with a pattern per row, or token healing's
patterns, would otherwise grow without bound). Dropping one only drops the cache's
reference: requests using it keep it; asked for again, it compiles again. Compiles still
running are never dropped, so their callers keep sharing them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from lmprog_runtime.constrained.base import BaseGrammarBackend, Grammar

MAX_PATTERN_CHARS = 50_000
SHUT_DOWN = "the engine was shut down before this pattern compiled"
logger = logging.getLogger(__name__)


class GrammarCache:
    """`jump_forward`: each compile builds the grammar's character FSM too (`char_fsm`),
    under the same timeout."""

    def __init__(
        self,
        backend: BaseGrammarBackend,
        timeout_s: float = 60.0,
        max_entries: int = 64,
        jump_forward: bool = False,
    ) -> None:
        self.backend = backend
        self.jump_forward = jump_forward
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()  # oldest use first
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmprog-grammar")
        self._closed = False

    def char_fsm(self, grammar: Grammar):
        """The character-level FSM of a compiled grammar, for jump-forward (built once);
        None where interegular cannot read its pattern (it runs without jump-forward)."""
        if not hasattr(grammar, "_char_fsm"):
            _build_char_fsm(grammar)
        return grammar._char_fsm or None  # type: ignore[attr-defined]

    def get(self, kind: str, pattern: str) -> Grammar:
        """kind: "regex" or "json_schema" (JSON text). Raises ValueError for bad patterns."""
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"{kind} is too large ({len(pattern)} > {MAX_PATTERN_CHARS} chars)")
        key = (kind, pattern)
        with self._lock:
            if self._closed:
                raise RuntimeError(SHUT_DOWN)
            future = self._entries.get(key)
            if future is None:
                future = self._pool.submit(self._compile, kind, pattern)
                self._entries[key] = future
            else:
                self._entries.move_to_end(key)
        try:
            grammar = future.result(timeout=self.timeout_s)
        except CancelledError as error:  # (queued when the engine shut down)
            raise RuntimeError(SHUT_DOWN) from error
        except FutureTimeout as error:
            self._forget(key, future)
            also = " (or turn jump-forward off: disable_jump_forward=True)" * self.jump_forward
            raise ValueError(
                f"{kind} took longer than {self.timeout_s:g} s to compile; simplify it{also}"
            ) from error
        except Exception:
            self._forget(key, future)  # a bad pattern is not remembered
            raise
        self._trim()
        return grammar

    def close(self) -> None:
        """Stop the compile threads (the engine shuts down): compiles not started are
        cancelled, one running finishes on its own, and the threads then exit."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def keys(self) -> list[tuple[str, str]]:
        """The cached (kind, pattern) keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def _trim(self) -> None:
        """Drop the least recently used compiled grammars beyond `max_entries`."""
        with self._lock:
            excess = len(self._entries) - self.max_entries
            if excess > 0:
                for key in [k for k, f in self._entries.items() if f.done()][:excess]:
                    del self._entries[key]

    def _compile(self, kind: str, pattern: str) -> Grammar:
        regex = pattern if kind == "regex" else self.backend.schema_to_regex(pattern)
        if len(regex) > MAX_PATTERN_CHARS:
            raise ValueError(f"the {kind} expands to a regex too large to compile")
        grammar = self.backend.compile_regex(regex)
        if self.jump_forward:  # (here, not on the caller's thread: its size may explode)
            _build_char_fsm(grammar)
        return grammar

    def _forget(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            if self._entries.get(key) is future:
                del self._entries[key]


def _build_char_fsm(grammar: Grammar) -> None:
    """Set `grammar._char_fsm`: its character FSM, or False where interegular cannot read
    a pattern outlines-core compiled (`\\u00e9`, `$`, flags: no jump-forward then)."""
    from lmprog_runtime.constrained.jump_forward import CharFSM

    try:
        grammar._char_fsm = CharFSM(grammar.regex)  # type: ignore[attr-defined]
    except Exception as error:  # noqa: BLE001 - interegular's own exception types
        logger.info("no jump-forward for %.80r: %s", grammar.regex, error)
        grammar._char_fsm = False  # type: ignore[attr-defined]
