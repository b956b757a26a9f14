"""The interpreter: submits the ready nodes of every running state to its backend.

Each state (a program's root or a fork branch) is a `Stream`: the IR nodes its program
appended, in text order, and how far they have run. A program's thread only appends nodes
and, when Python needs a value, waits for the nodes that value depends on. One interpreter
thread per process does the rest: it applies constant nodes, turns `gen` and `select`
into requests and submits them without waiting (the runtime's continuous batching
co-schedules whatever arrives together), and applies each result the moment its request
finishes, moving that stream on. There is no barrier between streams: a stream waits only
for its own request, for its parent to reach the fork, or at a join for its branches.
The thread exits when no stream is running, so nothing outlives its programs.

Threads: `lock` guards every stream's nodes, position and flags; a stream's `ExecState`
is written by the interpreter thread only (outside the lock) and read by its program once
the nodes it waits for have run.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lmprog.ir import Expr, Fork, Gen, Join, Select
from lmprog.ops import SelectPlan, gathered_meta, gathered_variables
from lmprog.outbox import Outbox
from lmprog.stream import Stream

logger = logging.getLogger(__name__)


class Interpreter:
    """The process-wide interpreter thread (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._cv = threading.Condition(self.lock)
        self._queue: deque[Stream | Callable[[], None]] = deque()
        self._num_live = 0
        self._thread: threading.Thread | None = None

    # ---- any thread -----------------------------------------------------------------------
    def add_live(self, stream: Stream) -> None:
        with self.lock:
            self._num_live += 1
            _STREAMS.add(stream)

    def wake(self, stream: Stream) -> None:
        """Look at `stream` again soon."""
        with self.lock:
            if not stream.is_queued:
                stream.is_queued = True
                self._queue.append(stream)
                self._start()

    def post(self, work: Callable[[], None]) -> None:
        """Run `work` on the interpreter thread (results arrive from the engine's thread)."""
        with self.lock:
            self._queue.append(work)
            self._start()

    def _start(self) -> None:
        self._cv.notify()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="lmprog-interpreter", daemon=True
            )
            self._thread.start()

    # ---- the interpreter thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._queue:
                    if self._num_live == 0:
                        self._thread = None
                        return
                    self._cv.wait()
                items = list(self._queue)
                self._queue.clear()
                for item in items:
                    if isinstance(item, Stream):
                        item.is_queued = False
            outbox = Outbox()
            for item in items:
                try:
                    if isinstance(item, Stream):
                        self.advance(item, outbox)
                    else:
                        item()
                except BaseException:  # noqa: BLE001 - the thread must outlive any one item
                    logger.exception("lmprog interpreter: an item failed")
            try:
                outbox.flush(self)
            except BaseException:  # noqa: BLE001
                logger.exception("lmprog interpreter: submitting failed")
            del items, item, outbox  # (while it waits, it holds no stream, nor an engine)

    def advance(self, stream: Stream, outbox: Outbox) -> None:
        """Run `stream`'s nodes until one needs a request, a join waits, or none is left."""
        while True:
            with stream.lock:
                if stream.is_done or stream.is_busy or not stream.is_started:
                    return
                limit = len(stream.nodes) if stream.hold is None else stream.hold
                raised = stream.raised
                if raised is not None and (
                    stream.pos >= limit or isinstance(stream.nodes[stream.pos], _REQUESTS)
                ):
                    stream.raised = None
                    self.cancel(stream, raised)
                    return
                if stream.error is not None or stream.pos >= limit:
                    if stream.error is not None or (
                        stream.is_closed and stream.pos == len(stream.nodes)
                    ):
                        self._end(stream)
                    return
                node = stream.nodes[stream.pos]
            try:
                finished = self._visit(stream, node, outbox)
            except BaseException as error:  # noqa: BLE001 - this program fails, others go on
                self.fail(stream, error)
                return
            with stream.lock:
                if finished:
                    stream.pos += 1
                stream.cv.notify_all()

    def _visit(self, stream: Stream, node: Expr, outbox: Outbox) -> bool:
        """Run one node; False when it waits (a request, or a join's branches)."""
        st, ops = stream.st, stream.ops
        if isinstance(node, Gen):
            ids, params = ops.gen_request(st, node)
            if self._set_busy(stream, compiling=ops.backend.may_compile(params)):
                outbox.gens.append((stream, node, ids, params))
            return False
        if isinstance(node, Select):
            plan = ops.select_plan(st, node)
            if self._set_busy(stream):
                outbox.selects.append((stream, node, plan))
            return False
        if isinstance(node, Fork):
            base = (set(st.variables), len(st.text))
            for branch in stream.branches[node.fork_id]:
                branch.st = st.copy()
                branch.st.on_emit = branch.emitter()
                branch.fork_base, branch.fork_spans = base, len(st.spans)
                with branch.lock:
                    if branch.is_streaming and st.text:  # (its stream starts with the text
                        branch.events.append((None, st.text, None))  # it inherits)
                    branch.is_started = True
                    branch.cv.notify_all()  # a reader may wait for the branch's text
                self.advance(branch, outbox)
            return True
        if isinstance(node, Join):
            branches = stream.branches[node.fork_id]
            with stream.lock:
                failed = [b.error for b in branches if b.error is not None]
                if failed:
                    raise failed[0]
                if stream.raised is not None:  # (its body raised: `advance` fails it now)
                    return False
                if not all(b.is_done for b in branches):
                    stream.is_busy = True  # the last branch to end wakes this stream
                    return False
            before, text_len = branches[0].fork_base
            if node.mode == "gather_variable":
                states = [b.st for b in branches]
                gathered = gathered_variables(before, states)
                st.meta.update(gathered_meta(gathered, states))
                st.variables.update(gathered)
            else:
                for branch in branches:
                    st.emit(branch.st.text[text_len:])
            return True
        ops.apply_constant(st, node)
        return True

    @staticmethod
    def _set_busy(stream: Stream, compiling: bool = False) -> bool:
        """Mark a request in flight (`compiling`: its pattern has to compile first), unless
        the program has just failed (its thread may fail it at any time): then nothing is
        sent and the stream ends."""
        with stream.lock:
            if stream.error is not None or stream.raised is not None:
                return False
            stream.is_busy, stream.is_compiling = True, compiling
            return True

    def fail(self, stream: Stream, error: BaseException) -> None:
        """The stream's program failed: its own error, or one of its requests was refused.
        It and its branches end once their requests in flight (if any) are back, or now
        where a request waits for its pattern to compile (it is aborted once sent); branches
        not started end now. A program that has ended keeps its outcome (a late cancel of a
        whole batch finds it finished)."""
        with stream.lock:
            if stream.error is None and not stream.is_done:
                stream.error = error
            for branches in stream.branches.values():
                for branch in branches:
                    if not branch.is_done:
                        branch.is_started = True
                        self.fail(branch, error)
            if not stream.is_busy or stream.is_compiling:
                self._end(stream)

    def cancel(self, stream: Stream, error: BaseException) -> None:
        """(any thread) Fail `stream`'s program now, with `error`, so that nothing more is
        sent for it, and abort its requests in flight (its body raised, or Ctrl-C while it
        runs): their slots are freed within one engine step."""
        self.fail(stream, error)
        self.post(functools.partial(self._abort_in_flight, stream, again=True))

    def end_body(self, stream: Stream, error: Exception) -> None:
        """(the body's thread) The body of `stream`'s program raised `error`. The nodes it
        appended before the next one that needs a request (text, variables set) still run,
        so that a variable set before the raise stays in the state (a dataset row's
        columns); then the program fails with `error`. A request in flight (nothing will
        read it) is aborted, and nothing after it runs."""
        with stream.lock:
            if stream.is_done or stream.error is not None:
                return
            if not stream.is_busy:
                stream.raised = error
                self.wake(stream)
                return
        self.cancel(stream, error)

    def _abort_in_flight(self, stream: Stream, again: bool) -> None:
        for each in stream.lineage():
            if each.inflight:
                each.ops.backend.abort(each.inflight)
        if again:  # (a request of this round's outbox is sent at the round's end)
            self.post(functools.partial(self._abort_in_flight, stream, again=False))

    def _end(self, stream: Stream) -> None:
        with stream.lock:
            if stream.is_done:
                return
            stream.is_done = True
            stream.cv.notify_all()
            with self.lock:  # (a body's or a caller's thread may end a stream: `cancel`)
                self._num_live -= 1
            parent, stream.live_parent = stream.parent, None
            if parent is not None and parent.is_busy and not parent.is_done:
                node = parent.nodes[parent.pos]
                if isinstance(node, Join) and stream.fork_id == node.fork_id:  # (one of its)
                    parent.is_busy = False
                    self.wake(parent)

    # ---- results (posted by the backend's callbacks) --------------------------------------
    def _resume(self, stream: Stream, apply: Callable[[], None]) -> None:
        """A request of `stream` came back: apply it (unless the stream failed) and go on."""
        stream.inflight = []
        try:
            if stream.error is None:
                apply()
                with stream.lock:
                    stream.pos += 1
        except BaseException as error:  # noqa: BLE001 - this program fails, others go on
            with stream.lock:
                stream.error = stream.error or error
        with stream.lock:
            stream.is_busy = False
            stream.cv.notify_all()
        if stream.error is not None:
            self.fail(stream, stream.error)
        else:
            self.wake(stream)

    def gen_done(self, stream: Stream, gen: Gen, streamed: bool, future: Future) -> None:
        def apply() -> None:
            try:
                out = future.result()
            except TimeoutError as error:  # the program fails, with what the gen made so far
                partial = getattr(error, "partial_output", None)
                if partial is not None:
                    stream.ops.finish_gen(stream.st, gen, partial, emitted=streamed)
                raise
            stream.ops.finish_gen(stream.st, gen, out, emitted=streamed)

        self._resume(stream, apply)

    def gen_chunk(self, stream: Stream, gen: Gen, chunk: dict[str, Any]) -> None:
        if stream.error is not None:
            return
        try:
            self._apply_chunk(stream, gen, chunk)
        except BaseException as error:  # noqa: BLE001 - this program fails, others go on
            with stream.lock:
                stream.error = stream.error or error  # it ends when its request is back

    def _apply_chunk(self, stream: Stream, gen: Gen, chunk: dict[str, Any]) -> None:
        stream.st.meta[gen.name] = dict(chunk["meta_info"])  # (its logprob lists: a snapshot)
        stream.st.emit(chunk["text"], "gen", gen.name)

    def select_done(
        self, stream: Stream, sel: Select, plan: SelectPlan, futures: list[Future]
    ) -> None:
        def apply() -> None:
            outs = [f.result() for f in futures]
            stream.ops.finish_select(stream.st, sel, plan, outs)

        self._resume(stream, apply)


# The nodes that wait for a request or for branches; the others apply at once.
_REQUESTS = (Gen, Select, Fork, Join)

INTERPRETER = Interpreter()


# Every stream not yet collected, for a forked child to end the parent's (`_reset_in_child`).
_STREAMS: weakref.WeakSet[Stream] = weakref.WeakSet()


def _reset_in_child() -> None:
    """A forked child has no interpreter thread (only the forking thread goes with it), and
    the parent's programs are not its own: start afresh (it once waited forever on the
    parent's thread, which it thought was running). The parent's streams get the new lock
    (the old one may have been held at the fork, and its copy stays held), and those still
    running end failed: a read of one in the child raises instead of waiting forever."""
    INTERPRETER.__init__()
    error = RuntimeError(
        "this program was running in the process this one was forked from: it runs on "
        "there, not here"
    )
    for stream in list(_STREAMS):
        stream.lock, stream.cv = INTERPRETER.lock, threading.Condition(INTERPRETER.lock)
        if not stream.is_done:
            stream.error = stream.error or error
            stream.is_done = True
            stream.inflight = []
            stream.live_parent = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
