"""Executes a program's expressions against a backend.

`ProgramOps` holds the rules, one per node type: constant nodes (text, roles, variable
references, var scopes) change the state directly; `gen` and `select` are split into
"the requests to send" and "apply the results", so the eager executor (`executor.py`) can
send them one at a time and the wave planner (`planner.py`) can batch them across branches
and programs.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lmprog.api import NUMBER_END, REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from lmprog.backend import Backend
from lmprog.choices import ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    VarRef,
    VarScopeBegin,
    VarScopeEnd,
)

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


# gen(dtype=...) -> the regex the runtime enforces, and how the text becomes a value.
DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}
DTYPE_PARSE: dict[type, Callable[[str], Any]] = {
    int: lambda text: int(text.rstrip(NUMBER_END)),
    float: lambda text: float(text.rstrip(NUMBER_END)),
    bool: lambda text: text == "True",
    str: json.loads,
}


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
    on_emit: Callable[[str | None, str], None] | None = None  # streaming listener

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

    def emit(self, text: str, kind: str = "text", name: str | None = None) -> None:
        self.text += text
        if text:
            self.spans.append(Span(kind, text, name))
        if self.on_emit is not None:
            self.on_emit(name, text)


class SelectPlan(NamedTuple):
    prompt_len: int
    fulls: list[list[int]]  # prompt + choice token ids, per choice
    starts: list[int]  # first scored position, per choice
    bare: list[list[int]] | None  # context token + choice tokens, for unconditional scores


class ProgramOps:
    """The execution rules, shared by eager and wave execution."""

    def __init__(self, backend: Backend, defaults: dict[str, Any]) -> None:
        self.backend = backend
        self.defaults = defaults
        self.roles = backend.chat_roles()

    def apply_constant(self, st: ExecState, node: Expr) -> None:
        """Text, roles, variable references and var scopes: no request needed."""
        if isinstance(node, Text):
            st.emit(node.value)
        elif isinstance(node, VarRef):
            if node.name not in st.variables:
                raise KeyError(
                    f"unknown variable {node.name!r}; this state has {sorted(st.variables)}"
                )
            st.emit(str(st.variables[node.name]))
        elif isinstance(node, RoleBegin):
            if st.role is not None:
                raise ValueError(f"nested roles: {node.role!r} opened inside {st.role!r}")
            text = self.roles.role_text(node.role, [m["role"] for m in st.messages])
            st.emit(text.begin, "role", node.role)
            st.role, st.role_start = node.role, len(st.text)
        elif isinstance(node, RoleEnd):
            if st.role != node.role:
                raise ValueError(f"{node.role!r} role ended but {st.role!r} is open")
            previous = [m["role"] for m in st.messages]
            st.messages.append({"role": node.role, "content": st.text[st.role_start :]})
            st.role = None
            st.emit(self.roles.role_text(node.role, previous).end, "role", node.role)
        elif isinstance(node, VarScopeBegin):
            st.scopes[node.name] = len(st.text)
        elif isinstance(node, VarScopeEnd):
            st.variables[node.name] = st.text[st.scopes.pop(node.name) :]
        else:
            raise TypeError(f"the interpreter has no rule for {type(node).__name__} nodes")

    # ---- gen ------------------------------------------------------------------------------
    def gen_request(self, st: ExecState, gen: Gen) -> tuple[list[int], dict[str, Any]]:
        params = {SAMPLING_KEYS[k]: v for k, v in self.defaults.items() if v is not None}
        params.update(
            {SAMPLING_KEYS.get(k, k): v for k, v in gen.sampling.items() if v is not None}
        )
        if gen.regex is not None:
            params["regex"] = gen.regex
        elif gen.json_schema is not None:
            params["json_schema"] = gen.json_schema
        elif gen.dtype is not None:
            params["regex"] = DTYPE_REGEX[gen.dtype]
        return self.backend.encode(st.text), params

    @staticmethod
    def finish_gen(st: ExecState, gen: Gen, out: dict[str, Any], emitted: bool = False) -> None:
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("constraint") == "incomplete":
            raise ValueError(
                f"gen {gen.name!r} stopped ({reason.get('type')}) before its output matched "
                f"its constraint; got {out['text']!r}"
            )
        if not emitted:
            st.emit(out["text"], "gen", gen.name)
        value: Any = out["text"]
        if gen.dtype is not None and gen.regex is None and gen.json_schema is None:
            value = DTYPE_PARSE[gen.dtype](value)
        st.variables[gen.name] = value
        st.meta[gen.name] = out["meta_info"]

    # ---- select ---------------------------------------------------------------------------
    def select_plan(self, st: ExecState, sel: Select) -> SelectPlan:
        prompt = self.backend.encode(st.text)
        if not prompt:
            raise ValueError("select needs some prompt text before it")
        fulls, starts = [], []
        for choice in sel.choices:
            full = self.backend.encode(st.text + choice)
            if len(full) < 2:  # the whole prompt merged into one token with the choice
                full = [self.backend.context_token_id, *full]
            # A choice whose first token merges with the prompt's last token is scored from
            # that merged token on: the way the model would have produced the text.
            k = max(1, min(_common_prefix_len(prompt, full), len(full) - 1))
            fulls.append(full)
            starts.append(k)
        bare = None
        if _method(sel).needs_unconditional:
            ctx = self.backend.context_token_id
            bare = [[ctx, *full[k:]] for full, k in zip(fulls, starts)]
        return SelectPlan(len(prompt), fulls, starts, bare)

    def select_requests(self, plan: SelectPlan) -> tuple[list[list[int]], list[int]]:
        """All prefill-only scoring requests of one select: (input ids, logprob starts)."""
        ids, starts = list(plan.fulls), list(plan.starts)
        if plan.bare is not None:
            ids += plan.bare
            starts += [1] * len(plan.bare)
        return ids, starts

    @staticmethod
    def finish_select(st: ExecState, sel: Select, plan: SelectPlan, outs: list[dict]) -> None:
        n = len(sel.choices)
        token_lps = [[lp for lp, _ in o["meta_info"]["input_token_logprobs"]] for o in outs[:n]]
        unconditional = None
        if plan.bare is not None:
            unconditional = [
                [lp for lp, _ in o["meta_info"]["input_token_logprobs"]] for o in outs[n:]
            ]
        method = _method(sel)
        decision = method.decide(token_lps, unconditional)
        index = decision.index
        if sel.temperature > 0:
            top = max(decision.scores)
            weights = [math.exp((s - top) / sel.temperature) for s in decision.scores]
            index = random.choices(range(n), weights=weights)[0]
        choice = sel.choices[index]
        st.emit(choice, "select", sel.name)
        st.variables[sel.name] = choice
        st.meta[sel.name] = {
            "choice": choice,
            "choices": list(sel.choices),
            "method": method.name,
            "scores": decision.scores,
            "token_logprobs": token_lps,
            "unconditional_token_logprobs": unconditional,
            "prompt_tokens": plan.prompt_len,
            "completion_tokens": len(plan.fulls[index]) - plan.starts[index],
            "cached_tokens": outs[index]["meta_info"]["cached_tokens"],
            "finish_reason": {"type": "select", "matched": choice},
        }


def gathered_variables(before: set[str], branches: list[ExecState]) -> dict[str, list[Any]]:
    """A `gather_variable` join: each variable the branches made (not in `before`), as the
    list of its values in branch order."""
    names: list[str] = []
    for branch in branches:
        names += [n for n in branch.variables if n not in before and n not in names]
    return {name: [b.variables.get(name) for b in branches] for name in names}


def score_requests(
    backend: Backend, requests: list[tuple[list[list[int]], list[int]]]
) -> list[list[dict]]:
    """Send several selects' scoring requests as one co-scheduled batch."""
    ids = [i for req_ids, _ in requests for i in req_ids]
    starts = [s for _, req_starts in requests for s in req_starts]
    outs = backend.generate(
        ids,
        [{"max_new_tokens": 0}] * len(ids),
        group=True,
        return_logprob=True,
        logprob_start_len=starts,
    )
    split, offset = [], 0
    for req_ids, _ in requests:
        split.append(outs[offset : offset + len(req_ids)])
        offset += len(req_ids)
    return split


def _method(sel: Select) -> ChoicesSamplingMethod:
    return sel.choices_method or token_length_normalized


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
