"""outlines-core's index compiles, in child processes that can be stopped.

Its compile is native code: a thread running it can be neither interrupted nor bounded,
and one that explodes (`(abc|def|ghi0){1,20}[a-z0-9]{3,60}x0` over a small vocabulary)
went on after its timeout at a full core and 25-100 MB/s, past `shutdown()`, holding up
the process's exit; eight of them filled a 24 GiB machine. So each compile runs in a child
(`index_child.py`, which holds the vocabulary) and the calling thread waits in short
steps: when the grammar cache abandons the compile (an exception raised in that thread,
`grammar_cache._Job.interrupt`), the wait ends, the child is killed and its memory freed.
An idle child is kept for the next compile (at most `MAX_IDLE`); a busy one is never
shared.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from lmprog_runtime.constrained.index_child import read_frame, write_frame, write_pickled

CHILD = str(Path(__file__).with_name("index_child.py"))
MAX_IDLE = 4
POLL_S = 0.05  # (how soon an abandoned compile's thread sees its interruption)


class IndexCompiler:
    """Compiles regexes into outlines-core indexes over one vocabulary."""

    def __init__(self, vocabulary: Any) -> None:
        self._vocabulary = pickle.dumps(vocabulary)  # (each child gets it once)
        self._lock = threading.Lock()
        self._idle: list[subprocess.Popen] = []
        self._closed = False
        weakref.finalize(self, _kill_all, self._idle)

    def compile(self, regex: str) -> Any:
        """outlines-core's `Index` of `regex`; ValueError with outlines-core's message where
        it refuses it. Interruptible: an exception raised in this thread meanwhile ends the
        wait and kills the child."""
        child = self._take()
        done = False
        try:
            write_frame(child.stdin.fileno(), regex)
            while not select.select([child.stdout], [], [], POLL_S)[0]:
                pass  # (an exception raised in this thread lands here)
            reply = read_frame(child.stdout.fileno())
            if reply is None:
                raise ValueError(f"the index compile ended without a result ({child.wait()})")
            done = True
        finally:
            self._give_back(child) if done else _kill(child)
        status, value = reply
        if status != "ok":
            raise ValueError(value)
        return value

    def close(self) -> None:
        """Stop the idle children; a busy one stops when its compile returns or is
        abandoned."""
        with self._lock:
            self._closed = True
            idle, self._idle[:] = list(self._idle), []
        _kill_all(idle)

    def _take(self) -> subprocess.Popen:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        child = subprocess.Popen(
            [sys.executable, CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        try:
            write_pickled(child.stdin.fileno(), self._vocabulary)
        except BaseException:
            _kill(child)
            raise
        return child

    def _give_back(self, child: subprocess.Popen) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(child)
                return
        _kill(child)


def _kill(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    for pipe in (child.stdin, child.stdout):
        pipe.close()


def _kill_all(children: list[subprocess.Popen]) -> None:
    for child in children:
        _kill(child)
