"""Compiled grammars, keyed by (kind, pattern): a repeated schema compiles once.

Compilation happens in the submitting caller's thread (never on the engine loop), so a
new schema's compile does not stall other requests, and its errors reach the caller as
ValueError before anything is queued. Concurrent callers asking for the same pattern wait
for one compile.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from lmprog_runtime.constrained.base import BaseGrammarBackend, Grammar


class GrammarCache:
    def __init__(self, backend: BaseGrammarBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], Future] = {}

    def get(self, kind: str, pattern: str) -> Grammar:
        """kind: "regex" or "json_schema" (JSON text). Raises ValueError for bad patterns."""
        key = (kind, pattern)
        with self._lock:
            future = self._entries.get(key)
            owner = future is None
            if owner:
                future = Future()
                self._entries[key] = future
        if owner:
            try:
                regex = pattern if kind == "regex" else self.backend.schema_to_regex(pattern)
                future.set_result(self.backend.compile_regex(regex))
            except Exception as error:
                future.set_exception(error)
                with self._lock:
                    del self._entries[key]  # a bad pattern is not remembered
        return future.result()
