"""The prompt state a program builds: `ProgramState` and the branches of a fork.

`s += expr` appends IR nodes to the state's stream (`interpreter.py` runs them) and
returns at once; reading (`s[name]`, `s.text()`, `s.messages()`) waits for the nodes the
value depends on. `s.fork(n)` returns `n` branch states whose first requests go to the
runtime as one group; `join()` appends the join, which waits for every branch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lmprog.backend import Backend
from lmprog.display import LIVE_FLUSH_S, short_repr, stream_html
from lmprog.interpreter import INTERPRETER
from lmprog.ir import (
    Expr,
    Fork,
    Gen,
    Join,
    Select,
    SetVar,
    VarScopeEnd,
    as_expr,
    flatten,
)
from lmprog.state_blocks import BranchGroup, JoinMode, StateBlocks, check_join_mode
from lmprog.state_streaming import StreamReading
from lmprog.static_checks import check_static
from lmprog.stream import Stream

# Branches one fork may make (each is a program state and a request).
MAX_FORK_SIZE = 4096


class ProgramCancelled(RuntimeError):
    """A program stopped by `ProgramState.cancel()`."""


class ProgramState(StateBlocks, StreamReading):
    """The state `s` of one program run (or of one branch of a fork).

    Appending returns at once; reading a value waits for the nodes it depends on.

    Example:
        >>> state = qa.run(question="Where is my parcel?")  # doctest: +SKIP
        >>> state["answer"], state.text(), state.messages()  # doctest: +SKIP
    """

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._ret_value: Any = None
        # `run(stream=True)`: the thread running the body (SGLang's), and the thread that
        # called `run`, whose reads wait for the body where they need the program's end.
        self._body: threading.Thread | None = None
        self._caller: int | None = None

    @property
    def ret_value(self) -> Any:
        """What the body returned (with `run(stream=True)`: once the body has returned)."""
        self._join_body()
        return self._ret_value

    @ret_value.setter
    def ret_value(self, value: Any) -> None:
        self._ret_value = value

    def _outside_body(self) -> bool:
        """A read by `run`'s caller while the streaming body still runs. Other threads read
        as the body does (a helper thread of the body's must never wait for it)."""
        body = self._body
        return body is not None and threading.get_ident() == self._caller and body.is_alive()

    @contextmanager
    def _cancel_on_interrupt(self) -> Iterator[None]:
        """Ctrl-C (or any exception: a signal handler's timeout) while the caller waits on
        a streaming run: its body sees the program cancelled (its requests stop, its next
        read raises), as `run()` without a thread does (only Ctrl-C did: a request ran on
        and held its slots)."""
        try:
            yield
        except BaseException as error:
            if self._body is not None:
                self._cancel(error)
            raise

    def _join_body(self) -> None:
        if self._outside_body():
            self._stream.ops.backend.check_can_wait("a read of a streaming run's state")
            with self._cancel_on_interrupt():
                self._body.join()  # type: ignore[union-attr]

    @classmethod
    def start(
        cls, backend: Backend, defaults: dict[str, Any], *, stream: bool = False
    ) -> ProgramState:
        """The root state of a new program."""
        return cls(Stream(INTERPRETER, backend, defaults, is_streaming=stream))

    # ---- building -----------------------------------------------------------------------
    def __iadd__(self, expr: Expr | str) -> ProgramState:
        stream = self._stream
        nodes = []
        for leaf in flatten(as_expr(expr)):
            produces = None
            if isinstance(leaf, (Gen, Select)):
                if leaf.name is None:
                    leaf = replace(leaf, name=stream.auto_names.take())
                check_static(leaf, stream.ops.backend)
                produces = leaf.name
            elif isinstance(leaf, VarScopeEnd):
                produces = leaf.name
            nodes.append((leaf, produces))
        if nodes:
            stream.append(nodes)
        return self

    if not TYPE_CHECKING:  # (a checker names `s + x` an unsupported operand without it)

        def __add__(self, other: object) -> None:
            raise TypeError("use `s += ...` to append to a program state")

    def _append_node(self, node: Expr) -> None:
        self._stream.append([(node, node.name if isinstance(node, VarScopeEnd) else None)])

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` copies of this state, each going on from the text so far.

        Their first requests go to the runtime as one group (the shared text is computed
        once); the program goes on at once and joins them with `join()`.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive int, got {size!r}")
        if size > MAX_FORK_SIZE:  # (each branch a state and a request; 10**30 never returned)
            raise ValueError(f"fork size must be at most {MAX_FORK_SIZE}, got {size}")
        parent = self._stream
        with parent.lock:
            if parent.is_closed:
                raise RuntimeError("this state's program has ended; it cannot fork")
            fork_id = len(parent.branches)
            branches = [
                Stream(
                    INTERPRETER,
                    parent.ops.backend,
                    parent.ops.defaults,
                    parent=parent,
                    fork_id=fork_id,
                )
                for _ in range(size)
            ]
            for branch, names in zip(branches, parent.auto_names.fork(size)):
                branch.auto_names = names
            parent.branches[fork_id] = branches
            parent.unfilled[fork_id] = size
            index = parent.append([(Fork(fork_id, size), None)])
            if parent.hold is None:  # released once every branch has a node, or on a read
                parent.hold = index
            if parent.is_done:  # the program has failed: its fork never runs
                INTERPRETER.fail(parent, parent.error or RuntimeError("the program ended"))
        return ProgramStateGroup(self, [ProgramState(b) for b in branches], fork_id)

    # ---- reading ------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait until everything appended so far has run (or the program failed); from
        outside a streaming run's body, until the body has returned and all of it has run."""
        self._join_body()
        stream = self._stream
        with stream.lock:  # (refused before the wait: the program goes on)
            stream.check_wait(stream.is_synced)
        with self._cancel_on_interrupt(), stream.lock:
            stream.wait(stream.is_synced)
        self._flush_live()

    def _flush_live(self) -> None:
        """(`run`'s caller, with a live view) Wait until the view shows what has been
        emitted so far (at most `LIVE_FLUSH_S`): a notebook run headless (nbconvert,
        nbclient) could end before the view's last draw, and kept an older one."""
        root = self._stream.root
        if threading.get_ident() != self._caller or root.live_drawn is None:
            return
        with root.lock:
            target = root.emitted
            root.live_flush = True
            root.cv.notify_all()
            root.cv.wait_for(
                lambda: root.live_drawn is None or root.live_drawn >= target, LIVE_FLUSH_S
            )

    def _wait_done(self) -> None:
        """Wait until this state and every branch below it have ended (after `close`)."""
        self._join_body()
        for stream in self._stream.lineage():
            with stream.lock:
                stream.wait(lambda: False)

    def cancel(self) -> None:
        """Stop the program (a deadline, a stop button; `asyncio.wait_for` on its reader
        does not stop it): nothing more is sent for it, its requests in flight are aborted
        within one engine step, freeing their slots, and its body's next read raises
        `ProgramCancelled`, which `error()` then holds. A program that has ended stays as
        it ended."""
        self._cancel(ProgramCancelled("the program was cancelled"))

    def _cancel(self, error: BaseException) -> None:
        """Fail the program with `error` and abort its requests in flight."""
        self._stream.interpreter.cancel(self._stream, error)

    def error(self) -> BaseException | None:
        """The exception that ended the program (its own, or a refused request), or None."""
        self.sync()
        return self._stream.failure()

    def _raise_error(self) -> None:
        if (error := self._stream.failure()) is not None:
            raise error

    def text(self) -> str:
        self.sync()
        return self._stream.st.text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._stream.st.messages]

    def _wait_var(self, name: str) -> None:
        """Wait until the node setting `name` has run; from outside a streaming run's body,
        for the body to append it first (or to end without it)."""
        stream, outside = self._stream, self._outside_body()

        def ready() -> bool:
            appended = not outside or name in stream.producers or stream.is_closed
            return appended and stream.has_run(name)

        with stream.lock:  # (refused before the wait: the program goes on)
            stream.check_wait(ready)
        with self._cancel_on_interrupt(), stream.lock:
            stream.wait(ready, release=not outside)

    def __getitem__(self, name: str) -> Any:
        """The value of variable `name`, once the node producing it has run."""
        self._wait_var(name)
        self._flush_live()
        if name not in self._stream.st.variables:
            self._raise_error()
            self._check_produced(name)
        return self._stream.st.variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def __setitem__(self, name: str, value: Any) -> None:
        """Set a variable at this point of the program (later reads see it); on a finished
        state, set it at once."""
        if not isinstance(name, str):  # (as gen's name: 5 was accepted)
            raise TypeError(f"a variable name must be a str, got {type(name).__name__}")
        stream = self._stream
        with stream.lock:
            if not stream.is_closed:
                stream.append([(SetVar(name, value), name)])
                return
            stream.wait(lambda: False)  # its program has ended: wait for its last nodes
            stream.st.variables[name] = value

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def __contains__(self, name: str) -> bool:
        self._wait_var(name)
        return name in self._stream.st.variables

    def get_meta_info(self, name: str) -> Any:
        """The meta info of generation `name` once it has run; None if the program made
        no generation of that name (as in SGLang; a failed program raises its error). For
        a variable a join gathered from fork branches, the list of the branches' meta info
        in branch order (SGLang gives None there). A new dict each call: a fork's branches
        share their parent's meta info, so a key set in it is the caller's own (the lists
        and dicts in it are shared)."""
        self._wait_var(name)
        meta = self._stream.st.meta
        if name not in meta:
            self._raise_error()
            return None
        value = meta[name]
        if isinstance(value, list):  # (gathered: each branch's, or None)
            return [dict(m) if isinstance(m, dict) else m for m in value]
        return dict(value)

    def __str__(self) -> str:
        """`ProgramState(<the whole text>)`, as SGLang's (`text()` is the bare text)."""
        return f"ProgramState({self.text()})"

    def __repr__(self) -> str:
        """Short text, whatever the length of the state (a terminal never sees HTML). It
        does not wait: a running program shows what it has so far, marked running (it once
        waited for the end, and so did `asyncio.run` returning such a state)."""
        stream = self._stream
        with stream.lock:
            text, variables, error = stream.st.text, dict(stream.st.variables), stream.failure()
            kind = "ProgramState" if stream.is_done else "ProgramState[running]"
        return short_repr(kind, text, variables, error)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        """Jupyter: the transcript by role, generated and selected spans highlighted, and
        each fork branch's own text below it."""
        self.sync()
        return stream_html(self._stream, self._stream.failure())


class ProgramStateGroup(BranchGroup["ProgramState"]):
    """The branches of `s.fork(n)` in a running program: `forks[i] += ...`, `forks[i][name]`."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState], fork_id: int) -> None:
        super().__init__(branches)
        self._parent = parent
        self._fork_id = fork_id
        self._is_joined = False

    def join(self, mode: JoinMode = "gather_variable") -> None:
        """End the branches: `gather_variable` sets parent[var] = [branch values] for the
        variables the branches made; `concate_and_append` appends each branch's new text.
        Returns at once; reading the parent waits for the branches."""
        check_join_mode(mode)
        if self._is_joined:  # (a second join appended the branches' text once more)
            raise RuntimeError("these branches have been joined already")
        self._is_joined = True
        branches = [b._stream for b in self._branches]
        for branch in branches:
            branch.close()
        parent = self._parent._stream
        with parent.lock:  # (one step: a reader waiting for a gathered name sees it at once)
            index = parent.append([(Join(self._fork_id, mode), None)])
            if mode == "gather_variable":
                for branch in branches:
                    for name in branch.producers:
                        parent.producers[name] = index
