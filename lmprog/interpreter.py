"""Executes a program's expressions against a backend, one state at a time, in order.

Each `ProgramState` owns a `StreamExecutor`: `s += expr` puts the expression on its queue
and returns at once; a worker thread runs the queue (constant text, roles, `gen`,
`select`), so independent states (fork branches, programs of a batch) send their requests
concurrently and the runtime batches them. Reading a value (`s["x"]`, `s.text()`) waits
for the queue to drain. The first error stops the queue; it is kept for `error()`.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lmprog.backend import Backend
from lmprog.chat_template import ChatRoles
from lmprog.choices import ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import Expr, Gen, RoleBegin, RoleEnd, Select, Text, flatten

# gen() argument -> runtime sampling parameter.
SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos",
}


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass
class Span:
    """A piece of the state's text, for notebooks: kind is text, gen, select or role."""

    kind: str
    text: str
    name: str | None = None


@dataclass
class ExecState:
    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    role: str | None = None  # the open role
    role_start: int = 0
    scopes: dict[str, int] = field(default_factory=dict)

    def copy(self) -> ExecState:
        return ExecState(
            self.text,
            dict(self.variables),
            {k: dict(v) for k, v in self.meta.items()},
            [dict(m) for m in self.messages],
            list(self.spans),
            self.role,
            self.role_start,
            dict(self.scopes),
        )


class StreamExecutor:
    def __init__(
        self,
        backend: Backend,
        defaults: dict[str, Any],
        *,
        stream: bool = False,
        state: ExecState | None = None,
        gate: ForkGate | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.is_stream = stream
        self.state = state or ExecState()
        self.gate = gate
        self.error: BaseException | None = None
        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._events: list[tuple[str | None, str]] = []  # (variable or None, text delta)
        self._events_cv = threading.Condition()
        self._closed = False
        self._auto_names = 0
        self._roles = ChatRoles(backend.render_chat)
        self._thread = threading.Thread(target=self._run, name="lmprog-program", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        for leaf in flatten(expr):
            if isinstance(leaf, (Gen, Select)) and leaf.name is None:
                leaf = _named(leaf, f"gen_{self._auto_names}")  # stable: gen_0, gen_1, ...
                self._auto_names += 1
            self._queue.put(leaf)

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

    def _emit(self, text: str, kind: str = "text", name: str | None = None) -> None:
        st = self.state
        st.text += text
        if text:
            st.spans.append(Span(kind, text, name))
        with self._events_cv:
            self._events.append((name, text))
            self._events_cv.notify_all()

    def _execute(self, expr: Expr) -> None:
        st = self.state
        if isinstance(expr, Text):
            self._emit(expr.value)
        elif isinstance(expr, RoleBegin):
            if st.role is not None:
                raise ValueError(f"nested roles: {expr.role!r} opened inside {st.role!r}")
            text = self._roles.role_text(expr.role, [m["role"] for m in st.messages])
            self._emit(text.begin, "role", expr.role)
            st.role, st.role_start = expr.role, len(st.text)
        elif isinstance(expr, RoleEnd):
            if st.role != expr.role:
                raise ValueError(f"{expr.role!r} role ended but {st.role!r} is open")
            content = st.text[st.role_start :]
            previous = [m["role"] for m in st.messages]
            st.messages.append({"role": expr.role, "content": content})
            st.role = None
            self._emit(self._roles.role_text(expr.role, previous).end, "role", expr.role)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, VarScopeBegin):
            st.scopes[expr.name] = len(st.text)
        elif isinstance(expr, VarScopeEnd):
            st.variables[expr.name] = st.text[st.scopes.pop(expr.name) :]
        else:
            raise TypeError(f"the interpreter has no rule for {type(expr).__name__} nodes")

    def _sampling_params(self, gen: Gen) -> dict[str, Any]:
        params = {SAMPLING_KEYS[k]: v for k, v in self.defaults.items() if v is not None}
        params.update({SAMPLING_KEYS[k]: v for k, v in gen.sampling.items() if v is not None})
        return params

    def _gen(self, gen: Gen) -> None:
        if gen.regex is not None or gen.json_schema is not None or gen.dtype is not None:
            raise NotImplementedError(
                "regex / json_schema / dtype-constrained generation needs constrained decoding, "
                "which the runtime does not provide yet"
            )
        if gen.sampling.get("choices"):
            raise AssertionError("gen(choices=...) is turned into a select by lp.gen")
        params = self._sampling_params(gen)
        ids = self.backend.encode(self.state.text)
        if self.is_stream and self.gate is None:
            text, meta = "", {}
            for chunk in self.backend.generate_stream(ids, params):
                text += chunk["text"]
                meta = chunk["meta_info"]
                self._emit(chunk["text"], "gen", gen.name)
        else:
            if self.gate is not None:
                out = self.gate.generate(ids, params)
            else:
                out = self.backend.generate([ids], [params])[0]
            text, meta = out["text"], out["meta_info"]
            self._emit(text, "gen", gen.name)
        self.state.variables[gen.name] = text
        self.state.meta[gen.name] = meta

    def _select(self, sel: Select) -> None:
        st = self.state
        prompt = self.backend.encode(st.text)
        if not prompt:
            raise ValueError("select needs some prompt text before it")
        fulls, starts = [], []
        for choice in sel.choices:
            full = self.backend.encode(st.text + choice)
            if len(full) < 2:  # the whole prompt merged into one token with the choice
                full = [self.backend.context_token_id, *full]
            k = _common_prefix_len(prompt, full)
            # A choice whose first token merges with the prompt's last token is scored from
            # that merged token on: the way the model would have produced the text.
            k = max(1, min(k, len(full) - 1))
            fulls.append(full)
            starts.append(k)
        outs = self.backend.generate(
            fulls,
            [{"max_new_tokens": 0}] * len(fulls),
            group=True,
            return_logprob=True,
            logprob_start_len=starts,
        )
        token_lps = [[lp for lp, _ in o["meta_info"]["input_token_logprobs"]] for o in outs]
        unconditional = None
        method: ChoicesSamplingMethod = sel.choices_method or token_length_normalized
        if method.needs_unconditional:
            ctx = self.backend.context_token_id
            bare = [[ctx] + full[k:] for full, k in zip(fulls, starts)]
            plain = self.backend.generate(
                bare,
                [{"max_new_tokens": 0}] * len(bare),
                return_logprob=True,
                logprob_start_len=[1] * len(bare),
            )
            unconditional = [
                [lp for lp, _ in o["meta_info"]["input_token_logprobs"]] for o in plain
            ]
        decision = method.decide(token_lps, unconditional)
        index = decision.index
        if sel.temperature > 0:
            weights = [
                _softmax_weight(s, decision.scores, sel.temperature) for s in decision.scores
            ]
            index = random.choices(range(len(sel.choices)), weights=weights)[0]
        choice = sel.choices[index]
        self._emit(choice, "select", sel.name)
        st.variables[sel.name] = choice
        st.meta[sel.name] = {
            "choice": choice,
            "choices": list(sel.choices),
            "method": method.name,
            "scores": decision.scores,
            "token_logprobs": token_lps,
            "unconditional_token_logprobs": unconditional,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(fulls[index]) - starts[index],
            "cached_tokens": outs[index]["meta_info"]["cached_tokens"],
            "finish_reason": {"type": "select", "matched": choice},
        }


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


def _named(leaf: Gen | Select, name: str) -> Gen | Select:
    from dataclasses import replace

    return replace(leaf, name=name)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _softmax_weight(score: float, scores: list[float], temperature: float) -> float:
    import math

    top = max(scores)
    return math.exp((score - top) / temperature)
