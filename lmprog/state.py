"""The prompt state a program builds: `ProgramState` and the branches of a fork.

`s += expr` queues `expr` on the state's executor and returns at once; reading (`s[name]`,
`s.text()`, `s.messages()`) waits for what was queued. `s.fork(n)` commits the text so far
(prefilled once in the runtime) and returns `n` branch states whose `gen`s are sent as one
request group; `join()` brings their results back.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lmprog.backend import Backend
from lmprog.executor import ForkGate, StreamExecutor
from lmprog.interpreter import ExecState, gathered_variables
from lmprog.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr

JOIN_MODES = ("gather_variable", "concate_and_append")


class StateBlocks:
    """`with s.user():`, `with s.assistant():`, `with s.system():` and `with s.var_scope(name):`,
    for any state that can append a node."""

    def _append_node(self, node: Expr) -> None:
        raise NotImplementedError

    @contextmanager
    def _role(self, role: str) -> Iterator[StateBlocks]:
        self._append_node(RoleBegin(role))
        try:
            yield self
        finally:
            self._append_node(RoleEnd(role))

    def system(self):
        """`with s.system(): s += ...` writes a system message."""
        return self._role("system")

    def user(self):
        return self._role("user")

    def assistant(self):
        return self._role("assistant")

    @contextmanager
    def var_scope(self, name: str) -> Iterator[StateBlocks]:
        """Capture the text written inside the block as variable `name`."""
        self._append_node(VarScopeBegin(name))
        try:
            yield self
        finally:
            self._append_node(VarScopeEnd(name))


class ProgramState(StateBlocks):
    """The state `s` of one program run.

    Example:
        >>> state = qa.run(question="Where is my parcel?")  # doctest: +SKIP
        >>> state["answer"], state.text(), state.messages()  # doctest: +SKIP
    """

    def __init__(
        self,
        backend: Backend,
        defaults: dict[str, Any],
        *,
        stream: bool = False,
        exec_state: ExecState | None = None,
        gate: ForkGate | None = None,
        skip: int = 0,
    ) -> None:
        self._backend = backend
        self._defaults = defaults
        self._executor = StreamExecutor(
            backend, defaults, stream=stream, state=exec_state, gate=gate, skip=skip
        )
        self.ret_value: Any = None

    # ---- building -----------------------------------------------------------------------
    def __iadd__(self, expr: Expr | str) -> ProgramState:
        self._executor.submit(as_expr(expr))
        return self

    def __add__(self, other: object) -> None:
        raise TypeError("use `s += ...` to append to a program state")

    def _append_node(self, node: Expr) -> None:
        self._executor.submit(node)

    def fork(self, num_branches: int) -> ProgramStateGroup:
        """`num_branches` copies of this state; the text so far is prefilled once."""
        if not isinstance(num_branches, int) or num_branches < 1:
            raise ValueError(f"fork needs a positive number of branches, got {num_branches!r}")
        self.sync()
        self._raise_error()
        base = self._executor.state
        if base.text:
            self._backend.commit_prefix(self._backend.encode(base.text))
        gate = ForkGate(self._backend, num_branches)
        branches = [
            ProgramState(self._backend, self._defaults, exec_state=base.copy(), gate=gate)
            for _ in range(num_branches)
        ]
        return ProgramStateGroup(self, branches, len(base.text), set(base.variables))

    # ---- reading ------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait until everything appended so far has run."""
        self._executor.sync()

    def error(self) -> BaseException | None:
        self.sync()
        return self._executor.error

    def _raise_error(self) -> None:
        if self._executor.error is not None:
            raise RuntimeError(
                f"the program failed: {self._executor.error}"
            ) from self._executor.error

    def text(self) -> str:
        self.sync()
        return self._executor.state.text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._executor.state.messages]

    def __getitem__(self, name: str) -> Any:
        self.sync()
        variables = self._executor.state.variables
        if name not in variables:
            self._raise_error()
            raise KeyError(f"unknown variable {name!r}; this state has {sorted(variables)}")
        return variables[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        self._executor.state.variables[name] = value

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.state.variables

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.sync()
        meta = self._executor.state.meta
        if name not in meta:
            self._raise_error()
            raise KeyError(f"no generation named {name!r}; this state has {sorted(meta)}")
        return meta[name]

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced (`run(stream=True)`): all of it, or one variable's."""
        self._executor.close()
        yield from self._executor.events(var_name)
        self._raise_error()

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def _repr_html_(self) -> str:
        """Roles as blocks, generated and selected spans highlighted, everything escaped."""
        self.sync()
        out, in_role = (
            ['<div class="lmprog-state" style="font-family:monospace;white-space:pre-wrap">'],
            False,
        )
        for span in self._executor.state.spans:
            text = html.escape(span.text)
            if span.kind == "role":
                if not in_role:
                    out.append(
                        '<div style="border-left:3px solid #888;margin:4px 0;padding-left:6px">'
                        f"<b>{html.escape(span.name or '')}</b>: "
                    )
                    in_role = True
                else:
                    out.append("</div>")
                    in_role = False
            elif span.kind in ("gen", "select"):
                color = "#d7f5d7" if span.kind == "gen" else "#d7e4f5"
                name = html.escape(span.name or "", quote=True)
                out.append(f'<span style="background:{color}" title="{name}">{text}</span>')
            else:
                out.append(text)
        if in_role:
            out.append("</div>")
        out.append("</div>")
        return "".join(out)


class BranchGroup:
    """The branches of a fork: `group += expr | callable(i) | list`, `group[i]`, iteration."""

    def __init__(self, branches: list[Any]) -> None:
        self._branches = branches

    def __len__(self) -> int:
        return len(self._branches)

    def __getitem__(self, i: int) -> Any:
        return self._branches[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._branches)

    def __iadd__(self, other: Expr | str | Callable[[int], Expr | str] | list) -> BranchGroup:
        if isinstance(other, list):
            if len(other) != len(self._branches):
                raise ValueError(f"{len(other)} items for {len(self._branches)} branches")
            items = other
        elif callable(other) and not isinstance(other, Expr):
            items = [other(i) for i in range(len(self._branches))]
        else:
            items = [other] * len(self._branches)
        for branch, item in zip(self._branches, items):
            branch += item
        return self


def check_join_mode(mode: str) -> None:
    if mode not in JOIN_MODES:
        raise ValueError(f"join mode must be one of {JOIN_MODES}, got {mode!r}")


class ProgramStateGroup(BranchGroup):
    """The branches of `s.fork(n)` in a running program."""

    def __init__(
        self,
        parent: ProgramState,
        branches: list[ProgramState],
        fork_pos: int,
        parent_vars: set[str],
    ) -> None:
        super().__init__(branches)
        self._parent = parent
        self._fork_pos = fork_pos
        self._parent_vars = parent_vars

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch; then `gather_variable` sets parent[var] = [branch values]
        for variables the branches made, or `concate_and_append` appends each branch's text."""
        check_join_mode(mode)
        for branch in self._branches:
            branch.sync()
            branch._raise_error()
        parent = self._parent
        if mode == "gather_variable":
            branches = [b._executor.state for b in self._branches]
            for name, values in gathered_variables(self._parent_vars, branches).items():
                parent[name] = values
            return
        for branch in self._branches:
            parent += branch._executor.state.text[self._fork_pos :]
