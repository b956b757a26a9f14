"""outlines-core's index compiles, in child processes that can be stopped.

Its compile is native code: a thread running it can be neither interrupted nor bounded,
and one that explodes (`(abc|def|ghi0){1,20}[a-z0-9]{3,60}x0` over a small vocabulary)
went on after its timeout at a full core and 25-100 MB/s, past `shutdown()`, holding up
the process's exit; eight of them filled a 24 GiB machine. So each compile runs in a child
(`index_child.py`, which holds the vocabulary) and the calling thread waits in short
steps: when the grammar cache abandons the compile (an exception raised in that thread,
`grammar_cache._Job.interrupt`), the wait ends, the child is killed and its memory freed.
An idle child is kept for the next compile (at most `MAX_IDLE`, holding `MAX_IDLE_MIB`
together: one holds about 20 MiB, but one that compiled a large grammar keeps what it
grew); a busy one is never shared.
"""

from __future__ import annotations

import pickle
import selectors
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from lmprog_runtime.constrained.grammar_cache import uninterrupted
from lmprog_runtime.constrained.index_child import read_sized_frame, write_frame, write_pickled

CHILD = str(Path(__file__).with_name("index_child.py"))
MAX_IDLE = 4
# What the idle children may hold together (each was bounded alone: four held 540 MiB
# after large compiles over SmolLM2's vocabulary)
MAX_IDLE_MIB = 256
POLL_S = 0.05  # (how soon an abandoned compile's thread sees its interruption)


class IndexCompiler:
    """Compiles regexes into outlines-core indexes over one vocabulary."""

    def __init__(self, vocabulary: Any) -> None:
        self._vocabulary = pickle.dumps(vocabulary)  # (each child gets it once)
        self._lock = threading.Lock()
        self._idle: list[subprocess.Popen] = []
        self._idle_mib: dict[subprocess.Popen, float] = {}  # (each one's resident MiB)
        self._busy: set[subprocess.Popen] = set()
        self._closed = False
        weakref.finalize(self, _kill_all, self._idle, self._busy)

    def compile(self, regex: str) -> tuple[Any, int]:
        """outlines-core's `Index` of `regex` and its size in bytes (pickled); ValueError
        with outlines-core's message where it refuses it, RuntimeError where no child could
        compile it. Interruptible: an exception raised in this thread meanwhile ends the
        wait and kills the child."""
        for first_try in (True, False):
            child, fresh, done = None, True, False
            try:
                with uninterrupted():  # (an interruption lands once `child` is set)
                    child, fresh = self._take()
                reply = _ask(child, regex)
                done = reply is not None
            except (OSError, ValueError):  # (its pipe broke or was closed: the child is gone)
                reply = None
            finally:
                if child is not None:
                    self._give_back(child, reply[2]) if done else self._drop(child)
            if reply is not None:
                break
            if fresh or not first_try:  # (an idle child may have died: once more, on a new one)
                raise RuntimeError(
                    f"the index compile process ended without a result (exit code "
                    f"{getattr(child, 'returncode', None)}; it runs {sys.executable} {CHILD})"
                )
        status, value, _, nbytes = reply
        if status != "ok":
            raise ValueError(value)
        return value, nbytes

    def close(self) -> None:
        """Stop the children, idle and busy (a busy one's compile then fails)."""
        with self._lock:
            self._closed = True
            children = [*self._idle, *self._busy]
            self._idle.clear()
            self._idle_mib.clear()
        _kill_all(children)

    def _take(self) -> tuple[subprocess.Popen, bool]:
        """A child for one compile, and whether it is new (called `uninterrupted`)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine was shut down before this pattern compiled")
            if self._idle:
                child = self._idle.pop()
                del self._idle_mib[child]
                self._busy.add(child)
                return child, False
        child = subprocess.Popen(  # (uninterrupted: an exception inside left it unreaped)
            [sys.executable, CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        with self._lock:
            self._busy.add(child)
        try:
            write_pickled(child.stdin.fileno(), self._vocabulary)
        except BaseException:
            self._drop(child)
            raise
        return child, True

    def _give_back(self, child: subprocess.Popen, mib: float) -> None:
        """Keep `child`, which holds `mib`, idle if the idle ones stay within bounds."""
        with self._lock:
            self._busy.discard(child)
            held = sum(self._idle_mib.values()) + mib
            if not self._closed and len(self._idle) < MAX_IDLE and held <= MAX_IDLE_MIB:
                self._idle.append(child)
                self._idle_mib[child] = mib
                return
        _kill(child)

    def _drop(self, child: subprocess.Popen) -> None:
        with self._lock:
            self._busy.discard(child)
        _kill(child)


def _ask(child: subprocess.Popen, regex: str) -> tuple[str, Any, float, int] | None:
    """`child`'s reply for `regex`: (status, index or message, its resident MiB, the
    reply's size in bytes); None if it ended first."""
    write_frame(child.stdin.fileno(), regex)
    with selectors.DefaultSelector() as selector:  # (not select(): no fd above 1023)
        selector.register(child.stdout, selectors.EVENT_READ)
        while not selector.select(POLL_S):
            pass  # (an exception raised in this thread lands here)
    sized = read_sized_frame(child.stdout.fileno())
    return None if sized is None else (*sized[0], sized[1])


def _kill(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    for pipe in (child.stdin, child.stdout):
        pipe.close()


def _kill_all(*groups: Any) -> None:
    for child in [child for group in groups for child in list(group)]:
        _kill(child)
