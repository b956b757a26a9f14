"""The rules of execution, one per node type, shared by the interpreter and `trace()`.

Constant nodes (text, roles, variable references and assignments, var scopes) change an
`ExecState` directly; `gen` and `select` are split into "the request to send" and "apply
its result", so the interpreter (`interpreter.py`) can send them without waiting and
batch them across branches and programs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, overload

from lmprog.backend import Backend
from lmprog.choices import ChoiceDecision, ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import (
    FLOAT_PATTERN,
    INT_PATTERN,
    REGEX_BOOL,
    REGEX_STR,
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
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
    "stop_regex": "stop_regex",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos",
    "token_healing": "token_healing",
    "end_outside_pattern": "end_outside_pattern",
    "timeout_s": "timeout_s",
}


# Per-request options (not sampling parameters) a program may set for all its gens.
REQUEST_KEYS = (
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "return_text_in_logprobs",
)

# gen(dtype=...) -> the pattern the runtime enforces. A number may end with one of
# DTYPE_NUMBER_END: a model ends "... a day is 24" with "." or " hours", and with only
# digits or EOS allowed it writes "2400..." instead. The end is consumed like a stop string.
DTYPE_NUMBER_END = " \n.,"
DTYPE_REGEX = {
    int: f"{INT_PATTERN}[{DTYPE_NUMBER_END}]?",
    float: f"{FLOAT_PATTERN}[{DTYPE_NUMBER_END}]?",
    bool: REGEX_BOOL,
    str: REGEX_STR,
}


@dataclass
class Span:
    """A piece of the state's text, for notebooks: kind is text, gen, select or role."""

    kind: str
    text: str
    name: str | None = None
    # A gen's or select's meta info when it was emitted: a name used again holds only the
    # latest in the state's meta, and each span showed that one.
    meta: dict[str, Any] | None = None


@dataclass
class ExecState:
    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    # A gen's or select's meta info; a gathered variable's, the list of its branches'.
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    role: str | None = None  # the open role
    role_start: int = 0
    scopes: dict[str, int] = field(default_factory=dict)
    on_emit: Callable[[str | None, str], None] | None = None  # streaming listener

    def copy(self) -> ExecState:
        # (each container read in one C call: the live view copies while the interpreter
        # thread writes; the values are shared: a meta dict or list, a message, is
        # replaced, never changed in place, and a copy of each made every fork of a long
        # program copy all its earlier gens' meta: 21 MB for 200 rounds of fork(2))
        return ExecState(
            self.text,
            dict(self.variables),
            dict(self.meta),
            list(self.messages),
            list(self.spans),
            self.role,
            self.role_start,
            dict(self.scopes),
        )

    def emit(self, text: str, kind: str = "text", name: str | None = None) -> None:
        self.text += text
        if text:
            meta = self.meta.get(name) if kind in ("gen", "select") and name else None
            spans = self.spans
            if meta is not None and spans and (spans[-1].kind, spans[-1].name) == (kind, name):
                # A streamed gen's chunks, shown as one span with the latest meta: each
                # chunk's own (its logprob lists so far) kept n^2 entries for n tokens.
                # (A new span: a fork's branch shares its parent's span objects.)
                spans[-1] = replace(spans[-1], meta=None)
            spans.append(Span(kind, text, name, meta))
        if self.on_emit is not None:  # (a role's text is no variable's: `text_iter("user")`
            # once streamed the markup of every user turn, with a gen named "user")
            self.on_emit(name if kind in ("gen", "select") else None, text)


class _Roles(Sequence[str]):
    """The roles of the first `len(messages)` messages, a view (the list of them built at
    every role made a chat of n messages cost n^2; a template reads the last one alone,
    unless it checks the whole conversation)."""

    def __init__(self, messages: list[dict[str, str]]) -> None:
        self._messages, self._len = messages, len(messages)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._messages[i]["role"] for i in range(self._len)[index]]
        return self._messages[range(self._len)[index]]["role"]


class SelectPlan(NamedTuple):
    fulls: list[list[int]]  # prompt + choice token ids, per choice
    starts: list[int]  # first scored position, per choice
    bare: list[list[int]] | None  # the choice's tokens alone, for unconditional scores


class ProgramOps:
    """The execution rules of one program's streams (its root state and fork branches)."""

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
            text = self.roles.role_text(node.role, _Roles(st.messages))
            st.emit(text.begin, "role", node.role)
            st.role, st.role_start = node.role, len(st.text)
        elif isinstance(node, RoleEnd):
            if st.role != node.role:
                raise ValueError(f"{node.role!r} role ended but {st.role!r} is open")
            previous = _Roles(st.messages)
            if not previous and node.role != "system":  # the template wrote its default
                default = self.roles.default_system_prompt()
                if default is not None:
                    st.messages.append({"role": "system", "content": default})
            st.messages.append({"role": node.role, "content": st.text[st.role_start :]})
            st.role = None
            st.emit(self.roles.role_text(node.role, previous).end, "role", node.role)
        elif isinstance(node, SetVar):
            st.variables[node.name] = node.value
        elif isinstance(node, VarScopeBegin):
            st.scopes[node.name] = len(st.text)
        elif isinstance(node, VarScopeEnd):
            st.variables[node.name] = st.text[st.scopes.pop(node.name) :]
        else:
            raise TypeError(f"the interpreter has no rule for {type(node).__name__} nodes")

    # ---- gen ------------------------------------------------------------------------------
    def gen_request(self, st: ExecState, gen: Gen) -> tuple[list[int], dict[str, Any]]:
        """The prompt ids and parameters of `gen`: the program's defaults, then the gen's own.
        Request options (`return_logprob`, ...) travel in the parameters to the backend."""
        params = {SAMPLING_KEYS.get(k, k): v for k, v in self.defaults.items() if v is not None}
        params.update(
            {SAMPLING_KEYS.get(k, k): v for k, v in gen.sampling.items() if v is not None}
        )
        if gen.regex is not None:
            params["regex"] = gen.regex
        elif gen.json_schema is not None:
            params["json_schema"] = gen.json_schema
        elif gen.dtype is not None:
            params["regex"] = DTYPE_REGEX[gen.dtype]
        if "regex" in params or "json_schema" in params:
            # (None: a complete value ends where the model goes on past the pattern)
            params.setdefault("end_outside_pattern", True)
        else:
            params.pop("end_outside_pattern", None)
        if params.get("token_healing") is None and st.text.endswith(" "):
            # (None: heal the trailing space a template like "Name: " + gen leaves)
            params["token_healing"] = True
        return self.backend.encode(st.text), params

    @staticmethod
    def is_number_gen(gen: Gen) -> bool:
        return gen.dtype in (int, float) and gen.regex is None and gen.json_schema is None

    def finish_gen(
        self, st: ExecState, gen: Gen, out: dict[str, Any], emitted: bool = False
    ) -> None:
        """Append a finished gen's text and set its variable. A constrained output cut short
        (by `max_tokens` or a stop) is kept as it is; its `finish_reason` says
        `"constraint": "incomplete"`."""
        text = out["text"]
        if self.is_number_gen(gen) and text[-1:] and text[-1] in DTYPE_NUMBER_END:
            text = text[:-1]  # the number's end is consumed, like a stop string
        st.meta[gen.name] = dict(out["meta_info"])  # (before the emit: a stream reads it)
        if not emitted:
            st.emit(text, "gen", gen.name)
        elif st.spans and (st.spans[-1].kind, st.spans[-1].name) == ("gen", gen.name):
            # (its chunks' spans had partial counts; a new span, as in `emit`)
            st.spans[-1] = replace(st.spans[-1], meta=st.meta[gen.name])
        st.variables[gen.name] = text

    def defaults_or(self, gen: Gen, key: str) -> Any:
        value = gen.sampling.get(key)
        return self.defaults.get(key) if value is None else value

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
        if _method(sel).requires_unconditional_logprobs:
            # As SGLang scores them: the choice's tokens alone, the first one without a
            # logprob (None, which the method counts as 0).
            bare = [full[k:] for full, k in zip(fulls, starts)]
        return SelectPlan(fulls, starts, bare)

    def select_requests(self, plan: SelectPlan) -> tuple[list[list[int]], list[int]]:
        """All prefill-only scoring requests of one select: (input ids, logprob starts)."""
        ids, starts = list(plan.fulls), list(plan.starts)
        if plan.bare is not None:
            ids += plan.bare
            starts += [0] * len(plan.bare)
        return ids, starts

    @staticmethod
    def finish_select(st: ExecState, sel: Select, plan: SelectPlan, outs: list[dict]) -> None:
        n = len(sel.choices)
        entries = [o["meta_info"]["input_token_logprobs"] for o in outs[:n]]
        token_lps = [[lp for lp, *_ in e] for e in entries]
        bare = None
        if plan.bare is not None:
            bare = [o["meta_info"]["input_token_logprobs"] for o in outs[n:]]
        method = _method(sel)
        normalized = [sum(lps) / len(lps) for lps in token_lps]
        unconditional = None  # (the first, None, counts as 0)
        if bare is not None:
            unconditional = [[lp or 0.0 for lp, *_ in e] for e in bare]
        if method.is_sglang_style:  # a method written for SGLang: its own __call__
            decided = method(
                choices=list(sel.choices),
                normalized_prompt_logprobs=normalized,
                input_token_logprobs=entries,
                output_token_logprobs=[[] for _ in range(n)],
                unconditional_token_logprobs=bare,
            )
            if not hasattr(decided, "decision"):
                raise TypeError(
                    f"select {sel.name!r}: {method.label} returned "
                    f"{type(decided).__name__}, not a ChoicesDecision(decision, meta_info)"
                )
            if decided.decision not in sel.choices:
                raise ValueError(
                    f"select {sel.name!r}: {method.label} decided {decided.decision!r}, "
                    "not one of its choices"
                )
            method_meta = dict(decided.meta_info or {})
            decision = ChoiceDecision(
                sel.choices.index(decided.decision), method_meta.get("scores", normalized)
            )
        else:
            decision = method.decide(token_lps, unconditional)
            method_meta = method.extra_meta(token_lps, unconditional, decision)
        index = decision.index
        if sel.temperature > 0:
            top = max(decision.scores)
            weights = [math.exp((s - top) / sel.temperature) for s in decision.scores]
            index = random.choices(range(n), weights=weights)[0]
        choice = sel.choices[index]
        st.meta[sel.name] = {  # (before the emit: a stream reads it)
            # SGLang's keys: the mean token logprob of each choice, the scored tokens'
            # entries, and what the method adds (its own values win for these)
            "normalized_prompt_logprobs": normalized,
            "input_token_logprobs": entries,
            "output_token_logprobs": [[] for _ in range(n)],  # prefill only: nothing decoded
            "unconditional_token_logprobs": bare,
            **method_meta,
            # lmprog's
            "choice": choice,
            "choices": list(sel.choices),
            "method": method.label,
            "scores": decision.scores,
            "token_logprobs": token_lps,
            "unconditional_logprobs": unconditional,
            # (the tokens before the scored ones: a choice merged with the prompt's last
            # token is scored from that token on, which the prompt counted too)
            "prompt_tokens": plan.starts[index],
            "completion_tokens": len(plan.fulls[index]) - plan.starts[index],
            "cached_tokens": outs[index]["meta_info"]["cached_tokens"],
            "finish_reason": {"type": "select", "matched": choice},
        }
        st.emit(choice, "select", sel.name)
        st.variables[sel.name] = choice


def gathered_variables(before: set[str], branches: list[ExecState]) -> dict[str, list[Any]]:
    """A `gather_variable` join: each variable the branches made (not in `before`), as the
    list of its values in branch order."""
    names: dict[str, None] = {}  # (in order; a list's `in` made n names cost n^2)
    for branch in branches:
        names.update((n, None) for n in branch.variables if n not in before)
    return {name: [b.variables.get(name) for b in branches] for name in names}


def gathered_meta(names: Iterable[str], branches: list[ExecState]) -> dict[str, list[Any]]:
    """The meta info of the gathered variables that a branch generated, as the list of
    each branch's (None where a branch did not), in branch order."""
    return {
        name: [b.meta.get(name) for b in branches]
        for name in names
        if any(name in b.meta for b in branches)
    }


def _method(sel: Select) -> ChoicesSamplingMethod:
    return sel.choices_method or token_length_normalized


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
