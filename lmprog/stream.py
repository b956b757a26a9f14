"""A `Stream`: the IR nodes of one state (a program's root or a fork branch) in text order,
and where their execution stands.

The program's thread appends nodes and waits on the stream's condition for the nodes a
value depends on; the interpreter thread (`interpreter.py`) runs them. Every field but
`st` is guarded by the interpreter's lock (each stream's `cv` is a condition on it);
`st` is written by the interpreter thread only.

A stream holds its branches, and its parent only until it ends (a root a streaming run's
caller dropped still reaches its join: it waits for them); its root and its state's
listener hold it weakly. So no reference cycle outlives a program, and its streams, and
the engine its backend holds, go once nobody references them (cycles kept a dropped
engine, 560 MiB of the instruct model's, until a full garbage collection).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmprog.backend import Backend
from lmprog.ir import AutoNames, Expr, Fork
from lmprog.ops import ExecState, ProgramOps

if TYPE_CHECKING:
    from lmprog.interpreter import Interpreter


# An event whose meta a later chunk of the same gen replaced: read as the gen's latest.
_NEWER: Any = object()


class Stream:
    """The nodes of one state in text order, and where their execution stands."""

    def __init__(
        self,
        interpreter: Interpreter,
        backend: Backend,
        defaults: dict[str, Any],
        *,
        parent: Stream | None = None,
        fork_id: int = -1,
        is_streaming: bool = False,
    ) -> None:
        self.interpreter = interpreter
        self.ops = ProgramOps(backend, defaults)
        self._parent = weakref.ref(parent) if parent is not None else None
        self.live_parent = parent  # (held until it ends: `Interpreter._end` drops it)
        self._root = weakref.ref(parent.root) if parent is not None else None
        self.fork_id = fork_id  # which fork of the parent this branch belongs to
        self.is_streaming = is_streaming or (parent is not None and parent.is_streaming)
        self.nodes: list[Expr] = []
        self.pos = 0  # nodes[:pos] have run
        self.hold: int | None = None  # nodes from this index wait (a fork being filled)
        self.producers: dict[str, int] = {}  # variable -> index of the last node setting it
        self.auto_names = AutoNames()  # (a branch's: set by the fork, from its parent's)
        self.branches: dict[int, list[Stream]] = {}  # fork id -> its branch streams
        self.unfilled: dict[int, int] = {}  # fork id -> how many of its branches have no node
        self.fork_base: tuple[set[str], int] = (set(), 0)  # parent's variables, text length
        self.fork_spans = 0  # how many of its state's spans it inherited at the fork
        self.emitted = 0  # (root) text pieces streamed by it and its branches: the live view
        # (root) The live view: the `emitted` count it has drawn (None: no view, or its
        # last draw is done); and whether a reader waits for it to draw now.
        self.live_drawn: int | None = None
        self.live_flush = False
        self.st = ExecState()
        self.st.on_emit = self.emitter()
        self.events: list[tuple[str | None, str, dict[str, Any] | None]] = []
        self.error: BaseException | None = None
        # (root) The body's exception, failing the program once the nodes before its next
        # request have run (`Interpreter.end_body`).
        self.raised: Exception | None = None
        self.is_started = parent is None  # a branch starts when its parent reaches the fork
        self.is_busy = False  # a request in flight, or a join waiting for its branches
        self.is_closed = False  # no more nodes will be appended
        self.is_done = False
        self.is_queued = False
        self.inflight: list[Any] = []  # the futures of its request(s) in flight
        self.is_compiling = False  # its request is being submitted: its pattern compiles
        # Taken as `with stream.lock:` (the RLock's own C `__enter__`), never `with
        # stream.cv:`: `Condition.__enter__` is Python, and a Ctrl-C between its acquire and
        # its return left the lock held, hanging every program after it.
        self.lock = interpreter.lock
        self.cv = threading.Condition(interpreter.lock)
        interpreter.add_live(self)

    @property
    def parent(self) -> Stream | None:
        """The stream this one is a fork branch of (None: the root, or a parent gone)."""
        return self._parent() if self._parent is not None else None

    @property
    def root(self) -> Stream:
        root = self._root() if self._root is not None else None
        return self if root is None else root

    def emitter(self) -> Callable[[str | None, str], None]:
        """The listener of this stream's state: `_on_emit`, holding the stream weakly."""
        ref = weakref.ref(self)

        def on_emit(name: str | None, text: str) -> None:
            stream = ref()
            if stream is not None:
                stream._on_emit(name, text)

        return on_emit

    # ---- program side (any thread) --------------------------------------------------------
    def append(self, nodes: list[tuple[Expr, str | None]]) -> int:
        """Append `(node, variable it sets or None)` pairs as one step of the program (one
        `+=`); returns the index of the first."""
        with self.lock:
            if self.is_closed:
                raise RuntimeError("this state's program has ended; nothing can be appended")
            first = len(self.nodes)
            for node, produces in nodes:
                if produces is not None:
                    self.producers[produces] = len(self.nodes)
                self.nodes.append(node)
            if self.hold is not None and not isinstance(nodes[-1][0], Fork):
                self.hold = None  # the parent moves on: its forked branches are filled
            parent = self.parent
            if parent is not None and first == 0:  # (a count: all() made fork(n) cost n^2)
                parent.unfilled[self.fork_id] -= 1
            if parent is not None and parent.hold is not None:
                held = parent.nodes[parent.hold]
                if parent.unfilled[held.fork_id] == 0:
                    parent.hold = None
                    self.interpreter.wake(parent)
            self.interpreter.wake(self)
            self.cv.notify_all()  # a reader on another thread may wait for a producer
            return first

    def close(self) -> None:
        """The program will append nothing more here (nor in the branches of this state)."""
        with self.lock:
            for stream in self.lineage():
                stream.is_closed = True
                stream.hold = None
                self.interpreter.wake(stream)

    def lineage(self) -> list[Stream]:
        """This stream and every branch below it."""
        out, todo = [], [self]
        while todo:
            stream = todo.pop()
            out.append(stream)
            for branches in stream.branches.values():
                todo.extend(branches)
        return out

    def failure(self) -> BaseException | None:
        """What ended this state's program in failure: its own error, else the first of
        its branches' (depth first, in fork order). A branch's refused request fails the
        program even where no join reads the branch, as an unread gen's does on the main
        line (it once vanished, `error()` None); a branch cancelled on purpose
        (`ProgramCancelled`, from its `cancel()`) does not."""
        from lmprog.state import ProgramCancelled

        if self.error is not None:
            return self.error
        with self.lock:  # (a body may fork meanwhile)
            forks = [list(branches) for branches in self.branches.values()]
        for branches in forks:
            for branch in branches:
                error = branch.failure()
                if error is not None and not isinstance(error, ProgramCancelled):
                    return error
        return None

    def wait(self, ready: Callable[[], bool], release: bool = True) -> None:
        """Wait (lock held) until `ready()` or this stream has ended. With `release`, forks
        being filled above it are released, since the reader needs them to run; a reader
        watching a streaming body from outside waits for the body to fill them instead."""
        stream: Stream | None = self
        while release and stream is not None:
            if stream.hold is not None:
                stream.hold = None
                self.interpreter.wake(stream)
            stream = stream.parent
        self.check_wait(ready)
        while not (ready() or self.is_done):
            self.cv.wait()

    def check_wait(self, ready: Callable[[], bool]) -> None:
        """(Lock held) RuntimeError where waiting for `ready()` could never end: on the
        backend's own thread (a callback), which delivers what it waits for."""
        if not (ready() or self.is_done):
            self.ops.backend.check_can_wait("a program's read of its state")

    def is_synced(self) -> bool:
        """Everything appended so far has run (lock held); not while the body's exception
        waits to fail the program (`raised`: a reader saw no error)."""
        return (
            self.is_started
            and not self.is_busy
            and self.pos == len(self.nodes)
            and self.raised is None
        )

    def has_run(self, name: str) -> bool:
        """The latest node setting `name` that was appended has run (lock held)."""
        index = self.producers.get(name)
        return self.is_synced() if index is None else self.pos > index

    def next_deltas(
        self, start: int, var_name: str | None, release: bool = True
    ) -> tuple[list[tuple[str, dict[str, Any] | None]], int, bool]:
        """The non-empty text deltas (of `var_name`, or all) among the events from `start`
        on, waiting for at least one event or the end (`release` as in `wait`); returns them
        with their meta info, where the next call starts, and whether the stream has ended
        (no event after)."""
        with self.lock:
            self.wait(lambda: len(self.events) > start, release)
            events, is_done = self.events[start:], self.is_done
        # An earlier chunk's meta is its gen's next chunk's: the event after it (marked
        # only then, the slice holds it), read back to front.
        newer: dict[str | None, Any] = {}
        deltas = []
        for name, delta, meta in reversed(events):
            meta = newer[name] if meta is _NEWER else meta
            newer[name] = meta
            if delta and (var_name is None or name == var_name):
                deltas.append((delta, meta))
        deltas.reverse()
        return deltas, start + len(events), is_done

    def _on_emit(self, name: str | None, text: str) -> None:
        if self.is_streaming:
            meta = self.st.meta.get(name) if name is not None else None
            with self.lock:
                events = self.events
                last = events[-1][2] if events and events[-1][0] == name else None
                if _same_request(last, meta):
                    # The same gen's earlier chunk: a reader behind gets the newer meta (each
                    # chunk kept its own, with its logprob lists so far: n^2 entries).
                    events[-1] = (name, events[-1][1], _NEWER)
                events.append((name, text, meta))
                self.cv.notify_all()
                root = self.root
                root.emitted += 1
                if root is not self:
                    root.cv.notify_all()


def _same_request(last: Any, meta: dict[str, Any] | None) -> bool:
    """Two events' metas are chunks of one request (a gen's `id`; a select has none)."""
    return (
        isinstance(last, dict)
        and meta is not None
        and meta.get("id") is not None
        and last.get("id") == meta.get("id")
    )
