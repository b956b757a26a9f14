"""What a state of either kind (a running program's or a traced one's) appends through:
role blocks and variable scopes (`with s.user():`, `with s.var_scope(name):`, SGLang's
method forms), and the branches of a fork (`forks += ...`, `forks[i]`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, Literal, TypeVar, overload

from lmprog.api import role_expr
from lmprog.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd

JoinMode = Literal["gather_variable", "concate_and_append"]
JOIN_MODES: tuple[JoinMode, ...] = ("gather_variable", "concate_and_append")


class StateBlocks:
    """`with s.user():`, `with s.assistant():`, `with s.system():` and `with s.var_scope(name):`,
    for any state that can append a node; `s.user(expr)` appends a whole message (SGLang's
    method form)."""

    def _append_node(self, node: Expr) -> None:
        raise NotImplementedError

    def __iadd__(self, expr: Expr | str) -> Any:
        raise NotImplementedError

    @contextmanager
    def _block(self, begin: Expr, end: Expr) -> Iterator[StateBlocks]:
        """`begin`, what the `with` body appends, then `end` (also when the body raises)."""
        self._append_node(begin)
        try:
            yield self
        finally:
            self._append_node(end)

    def _role_block(self, role: str) -> Any:
        return self._block(RoleBegin(role), RoleEnd(role))

    def _role(self, role: str, expr: Expr | str | None) -> Any:
        if expr is None:
            return self._role_block(role)
        self.__iadd__(role_expr(role, expr))
        return None

    # (for type checkers: with no text, a block for `with`; with text, a message appended)
    @overload
    def system(self, expr: None = None) -> AbstractContextManager[Any]: ...
    @overload
    def system(self, expr: Expr | str) -> None: ...
    def system(self, expr: Expr | str | None = None) -> Any:
        """`with s.system(): s += ...` writes a system message; `s.system(expr)` appends one."""
        return self._role("system", expr)

    @overload
    def user(self, expr: None = None) -> AbstractContextManager[Any]: ...
    @overload
    def user(self, expr: Expr | str) -> None: ...
    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role("user", expr)

    @overload
    def assistant(self, expr: None = None) -> AbstractContextManager[Any]: ...
    @overload
    def assistant(self, expr: Expr | str) -> None: ...
    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role("assistant", expr)

    def var_scope(self, name: str) -> AbstractContextManager[Any]:
        """Capture the text written inside the block as variable `name`."""
        if not isinstance(name, str):  # (as gen's name: a list failed as it was hashed)
            raise TypeError(f"var_scope's name must be a str, got {type(name).__name__}")
        return self._block(VarScopeBegin(name), VarScopeEnd(name))


_Group = TypeVar("_Group", bound="BranchGroup[Any]")  # (`forks += ...` keeps its class)
_Branch = TypeVar("_Branch", bound=StateBlocks)


class BranchGroup(Generic[_Branch]):
    """The branches of a fork: `group += expr | callable(i) | list`, `group[i]`, iteration."""

    def __init__(self, branches: list[_Branch]) -> None:
        self._branches = branches

    def __len__(self) -> int:
        return len(self._branches)

    def __getitem__(self, i: int) -> _Branch:
        return self._branches[i]

    def __iter__(self) -> Iterator[_Branch]:
        return iter(self._branches)

    def __setitem__(self, i: int, value: _Branch) -> None:
        """`forks[i] += expr` appends to branch i, then assigns it back."""
        if value is not self._branches[i]:
            raise TypeError("forks[i] can only be appended to: `forks[i] += ...`")

    def __iadd__(
        self: _Group, other: Expr | str | Callable[[int], Expr | str] | list[Any] | tuple[Any, ...]
    ) -> _Group:
        if isinstance(other, (list, tuple)):  # (one item per branch, as SGLang's)
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
