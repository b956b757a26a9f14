"""Eager execution: each `ProgramState` owns a `StreamExecutor`.

`s += expr` puts the expression on the executor's queue and returns at once; a worker
thread runs the queue with the rules of `interpreter.ProgramOps`, so independent states
(fork branches, programs of a batch) send requests concurrently and the runtime batches
them. Reading a value waits for the queue to drain. The first error stops the queue; it is
kept for `error()`. The branches of one fork send their `gen`s through a `ForkGate`, as
one co-scheduled request group.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from lmprog.backend import Backend
from lmprog.interpreter import ExecState, ProgramOps, score_requests
from lmprog.ir import Expr, Gen, Select, flatten


class StreamExecutor:
    """Runs one state's expressions, in order, on a worker thread."""

    def __init__(
        self,
        backend: Backend,
        defaults: dict[str, Any],
        *,
        stream: bool = False,
        state: ExecState | None = None,
        gate: ForkGate | None = None,
        skip: int = 0,
    ) -> None:
        self.ops = ProgramOps(backend, defaults)
        # Replay: the first `skip` leaves were already executed (by waves) into `state`.
        self._skip = skip
        self.is_stream = stream
        self.state = state or ExecState()
        self.state.on_emit = self._on_emit
        self.gate = gate
        self.error: BaseException | None = None
        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._events: list[tuple[str | None, str]] = []  # (variable or None, text delta)
        self._events_cv = threading.Condition()
        self._closed = False
        self._auto_names = 0
        self._thread = threading.Thread(target=self._run, name="lmprog-program", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        for leaf in flatten(expr):
            leaf = self.name_leaf(leaf)
            if self._skip:
                self._skip -= 1
                continue
            self._queue.put(leaf)

    def name_leaf(self, leaf: Expr) -> Expr:
        """Unnamed gens / selects get stable names: gen_0, gen_1, ..."""
        if isinstance(leaf, (Gen, Select)) and leaf.name is None:
            from dataclasses import replace

            leaf = replace(leaf, name=f"gen_{self._auto_names}")
            self._auto_names += 1
        return leaf

    def sync(self) -> None:
        self._queue.join()

    def close(self) -> None:
        """No more expressions: streams end once the queue drains."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def events(self, var_name: str | None):
        """Text deltas as they are produced, until the program is done."""
        index = 0
        while True:
            with self._events_cv:
                while index >= len(self._events) and not self._finished():
                    self._events_cv.wait(0.1)
                batch = self._events[index:]
                index = len(self._events)
                finished = self._finished() and index >= len(self._events)
            for name, delta in batch:
                if var_name is None or name == var_name:
                    yield delta
            if finished:
                return

    def _finished(self) -> bool:
        return self._closed and self._queue.unfinished_tasks == 0

    def _on_emit(self, name: str | None, text: str) -> None:
        with self._events_cv:
            self._events.append((name, text))
            self._events_cv.notify_all()

    # ---- worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is not None and self.error is None:
                    self._execute(expr)
            except BaseException as error:  # noqa: BLE001 - kept for error(), never lost
                self.error = error
            finally:
                self._queue.task_done()
                with self._events_cv:
                    self._events_cv.notify_all()
            if expr is None:
                return

    def _execute(self, expr: Expr) -> None:
        st, ops = self.state, self.ops
        if isinstance(expr, Gen):
            ids, params = ops.gen_request(st, expr)
            if self.is_stream and self.gate is None:
                text, meta = "", {}
                for chunk in ops.backend.generate_stream(ids, params):
                    text += chunk["text"]
                    meta = chunk["meta_info"]
                    st.emit(chunk["text"], "gen", expr.name)
                ops.finish_gen(st, expr, {"text": text, "meta_info": meta}, emitted=True)
            elif self.gate is not None:
                ops.finish_gen(st, expr, self.gate.generate(ids, params))
            else:
                ops.finish_gen(st, expr, ops.backend.generate([ids], [params])[0])
        elif isinstance(expr, Select):
            plan = ops.select_plan(st, expr)
            outs = score_requests(ops.backend, [ops.select_requests(plan)])[0]
            ops.finish_select(st, expr, plan, outs)
        else:
            ops.apply_constant(st, expr)


class ForkGate:
    """Co-schedules the branches of one fork: their concurrent `gen`s go to the runtime as
    one request group. A branch waits briefly for its siblings, then the batch is sent."""

    WINDOW_S = 0.05

    def __init__(self, backend: Backend, num_branches: int) -> None:
        self.backend = backend
        self.num_branches = num_branches
        self._cv = threading.Condition()
        self._pending: list[dict[str, Any]] = []

    def generate(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        mine = {"ids": ids, "params": params, "result": None, "error": None, "done": False}
        deadline = time.monotonic() + self.WINDOW_S
        with self._cv:
            self._pending.append(mine)
            self._cv.notify_all()
            while not mine["done"]:
                if mine in self._pending and (
                    len(self._pending) >= self.num_branches or time.monotonic() >= deadline
                ):
                    batch, self._pending = self._pending, []
                    self._cv.release()
                    try:
                        self._send(batch)
                    finally:
                        self._cv.acquire()
                        self._cv.notify_all()
                else:
                    self._cv.wait(max(0.0, deadline - time.monotonic()) or 0.01)
        if mine["error"] is not None:
            raise mine["error"]
        return mine["result"]

    def _send(self, batch: list[dict[str, Any]]) -> None:
        try:
            outs = self.backend.generate(
                [b["ids"] for b in batch], [b["params"] for b in batch], group=len(batch) > 1
            )
            for b, out in zip(batch, outs):
                b["result"] = out
        except BaseException as error:  # noqa: BLE001 - every waiting branch gets it
            for b in batch:
                b["error"] = error
        for b in batch:
            b["done"] = True
