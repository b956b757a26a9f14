"""A plain reference interpreter for the random programs of `test_lazy_execution.py`.

It knows nothing about lmprog's frontend: it keeps the prompt as a Python string, and for
each `gen` / `select` it sends ONE request at a time to `Engine.generate`, in program order,
waiting for each before the next. The rules it follows are the documented ones:

- the prompt of a request is the whole text so far, tokenized with
  `engine.encode(text, add_special_tokens=not (bos and text.startswith(bos)))`
  (lmprog's `EngineBackend.encode`);
- a gen is `{"max_new_tokens", "stop", "temperature": 0}`, plus `"token_healing": True`
  where the text so far ends with a space; its text is appended and is the variable's value;
- a select scores every choice with a prefill-only request (`max_new_tokens=0`,
  `return_logprob=True`, `logprob_start_len=k`) of `encode(text + choice)`, where `k` is the
  common token prefix of `encode(text)` and `encode(text + choice)` clamped to
  `[1, len - 1]` (a choice whose first token merges with the prompt's last token is scored
  from the merged token on; a one-token whole is prefixed with the context token, BOS else
  EOS); the winner has the best mean token log-probability (first on ties);
- `fork(n)` copies the text and variables into n branches; `gather_variable` sets each
  variable the branches made to the list of branch values, `concate_and_append` appends each
  branch's text written after the fork, in branch order.

The programs are data (nested tuples); `name_program` gives every gen / select a unique name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ---- program data ---------------------------------------------------------------------------
# ("text", str)                                  append text
# ("gen", name, max_tokens, stop | None)          greedy gen
# ("select", name, (choice, ...))                 select, token_length_normalized
# ("tool", )                                      s += tool(source value)
# ("if", then_ops, else_ops)                      Python branch on len(source value) % 2
# ("fork", n, branch_ops, mode, style)            fork / branch ops / join(mode)
# branch ops: ("text", str), ("btext", ), ("pread", ), ("gen", ...), ("select", ...),
#   ("bif", )
#   btext appends f" b{i}" to branch i; pread reads the parent's source value while the
#   fork is open and appends f" p{len % 7}" to every branch; bif appends " odd" to branch i
#   when the branch's latest variable (else its text) has odd length.
# The "source value" is the latest variable defined at this level (a gathered list is
# joined), else the whole text.


def name_program(ops: list, counter: list[int] | None = None) -> list:
    """The same program with every gen / select named uniquely (v0, v1, ...)."""
    counter = counter if counter is not None else [0]

    def fresh() -> str:
        counter[0] += 1
        return f"v{counter[0] - 1}"

    named = []
    for op in ops:
        kind = op[0]
        if kind == "gen":
            named.append(("gen", fresh(), op[1], op[2]))
        elif kind == "select":
            named.append(("select", fresh(), op[1]))
        elif kind == "if":
            named.append(("if", name_program(op[1], counter), name_program(op[2], counter)))
        elif kind == "fork":
            named.append(("fork", op[1], name_program(op[2], counter), op[3], op[4]))
        else:
            named.append(op)
    return named


def flatten_value(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else value


def tool_text(value: str) -> str:
    """What the tool returns for its input (deterministic, depends on the generated value)."""
    return f" [tool:{len(value)}:{value[-3:]!r}]"


@dataclass
class RefState:
    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # names visible as "latest variable"

    def copy(self) -> RefState:
        return RefState(self.text, dict(self.variables), list(self.order))

    def emit(self, name: str, value: str) -> None:
        """A generated value: appended to the text and set as variable `name`."""
        self.text += value
        self.variables[name] = value
        self.order.append(name)

    def source(self) -> str:
        if self.order:
            return flatten_value(self.variables[self.order[-1]])
        return self.text


@dataclass
class RefResult:
    text: str
    variables: dict[str, Any]
    tool_calls: int
    ret: str
    requests: int
    near_tie: bool  # a select whose two best scores were closer than TIE


TIE = 1e-4


class ReferenceInterpreter:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        tok = engine.tokenizer
        self.bos = getattr(tok, "bos_token", None)
        ctx = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        self.context_token_id = int(ctx) if ctx is not None else 0
        self.requests = 0
        self.near_tie = False

    # ---- the three request kinds ------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.engine.encode(
            text, add_special_tokens=not (self.bos and text.startswith(self.bos))
        )

    def gen(
        self, text: str, max_tokens: int, stop: list[str] | None, regex: str | None = None
    ) -> str:
        params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": 0}
        if stop is not None:
            params["stop"] = list(stop)
        if regex is not None:
            params["regex"] = regex
        if text.endswith(" "):
            params["token_healing"] = True
        self.requests += 1
        out = self.engine.generate(input_ids=self.encode(text), sampling_params=params)
        return out["text"]

    def select_scores(self, text: str, choices: tuple[str, ...]) -> list[float]:
        prompt = self.encode(text)
        if not prompt:
            raise ValueError("select needs some prompt text before it")
        scores = []
        for choice in choices:
            full = self.encode(text + choice)
            if len(full) < 2:
                full = [self.context_token_id, *full]
            common = 0
            while common < min(len(prompt), len(full)) and prompt[common] == full[common]:
                common += 1
            k = max(1, min(common, len(full) - 1))
            self.requests += 1
            out = self.engine.generate(
                input_ids=full,
                sampling_params={"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=k,
            )
            lps = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"]]
            assert len(lps) == len(full) - k, (len(lps), len(full), k)
            scores.append(sum(lps) / len(lps))
        return scores

    def select(self, text: str, choices: tuple[str, ...]) -> str:
        scores = self.select_scores(text, choices)
        best = max(range(len(scores)), key=lambda i: scores[i])
        others = [s for i, s in enumerate(scores) if i != best]
        if others and scores[best] - max(others) < TIE:
            self.near_tie = True
        return choices[best]

    # ---- programs ------------------------------------------------------------------------------
    def run(self, ops: list) -> RefResult:
        self.requests, self.near_tie = 0, False
        st = RefState()
        calls = [0]
        self._run_ops(st, ops, calls)
        ret = st.source() + "!"
        return RefResult(st.text, st.variables, calls[0], ret, self.requests, self.near_tie)

    def _run_ops(self, st: RefState, ops: list, calls: list[int]) -> None:
        for op in ops:
            kind = op[0]
            if kind == "text":
                st.text += op[1]
            elif kind == "gen":
                _, name, max_tokens, stop = op
                st.emit(name, self.gen(st.text, max_tokens, stop))
            elif kind == "select":
                _, name, choices = op
                st.emit(name, self.select(st.text, choices))
            elif kind == "tool":
                calls[0] += 1
                st.text += tool_text(st.source())
            elif kind == "if":
                self._run_ops(st, op[1] if len(st.source()) % 2 else op[2], calls)
            elif kind == "fork":
                self._fork(st, op)
            else:
                raise AssertionError(f"unknown op {op!r}")

    def _fork(self, st: RefState, op: tuple) -> None:
        _, n, branch_ops, mode, _style = op
        fork_pos = len(st.text)
        branches = [RefState(st.text, dict(st.variables), []) for _ in range(n)]
        made: list[str] = []
        for bop in branch_ops:
            kind = bop[0]
            for i, b in enumerate(branches):
                if kind == "text":
                    b.text += bop[1]
                elif kind == "btext":
                    b.text += f" b{i}"
                elif kind == "pread":
                    b.text += f" p{len(st.source()) % 7}"
                elif kind == "bif":
                    if len(b.source()) % 2:
                        b.text += " odd"
                elif kind == "gen":
                    _, name, max_tokens, stop = bop
                    b.emit(name, self.gen(b.text, max_tokens, stop))
                elif kind == "select":
                    _, name, choices = bop
                    b.emit(name, self.select(b.text, choices))
                else:
                    raise AssertionError(f"unknown branch op {bop!r}")
            if kind in ("gen", "select"):
                made.append(bop[1])
        if mode == "gather_variable":
            for name in made:
                st.variables[name] = [b.variables[name] for b in branches]
                st.order.append(name)
        else:
            for b in branches:
                st.text += b.text[fork_pos:]
