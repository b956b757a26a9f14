"""The program's building blocks: immutable expression nodes a program appends to a state.

`s += lp.user("Hi") + lp.assistant(lp.gen("reply"))` builds a tree of these nodes; the
interpreter executes them in text order against a backend. They are placeholders, not
values: turning a `Gen` into a string (`str()`, an f-string) is an error, because its text
does not exist until the program runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    """Base of every node. `a + b` concatenates (strings are wrapped as `Text`)."""

    def __add__(self, other: Expr | str) -> Concat:
        return Concat((self, as_expr(other)))

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat((as_expr(other), self))

    def __str__(self) -> str:
        raise TypeError(
            f"{type(self).__name__} is a placeholder for text generated later; append it with "
            "`s += ...` and read the result with `s[name]`"
        )

    def __format__(self, spec: str) -> str:
        return str(self)

    def __bool__(self) -> bool:
        raise TypeError(
            f"{type(self).__name__} has no value yet; read `s[name]` after appending it"
        )


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Concat(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text into variable `name`; every sampling field None = program default."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    regex: str | None = None
    json_schema: str | None = None
    dtype: type | None = None


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Pick one of `choices` by the model's likelihood; stores it in `name`."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: Any


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use str or lp.*")


def flatten(expr: Expr) -> list[Expr]:
    """Leaves of a concatenation, in text order."""
    if isinstance(expr, Concat):
        out: list[Expr] = []
        for part in expr.parts:
            out.extend(flatten(part))
        return out
    return [expr]
