"""The program's building blocks: immutable expression nodes a program appends to a state.

`s += lp.user("Hi") + lp.assistant(lp.gen("reply"))` builds a tree of these nodes; the
interpreter executes them in text order against a backend. They are placeholders, not
values: turning a `Gen` into a string (`str()`, an f-string) is an error, because its text
does not exist until the program runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

# Patterns for typed values (SGLang's names). Numbers are bounded by what the value's machine
# type holds (18 digits always fit int64; float64 keeps 15-17 significant digits), so a
# model that has lost track cannot write digits until `max_tokens`. As in SGLang, a number
# may end with a space or a newline, which keeps it valid JSON next to `stop=[" ", "\n"]`.
INT_PATTERN = r"-?(0|[1-9][0-9]{0,17})"
FLOAT_PATTERN = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"
NUMBER_END = " \n"
REGEX_INT = f"{INT_PATTERN}[{NUMBER_END}]?"
REGEX_FLOAT = f"{FLOAT_PATTERN}[{NUMBER_END}]?"
REGEX_BOOL = r"(True|False)"
# A JSON string literal: ends where the model closes the quote; escapes stay whole.
REGEX_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'


class ConcreteValueNeeded(TypeError):
    """Python code asked a placeholder for its value (str(), an f-string, `if`, ==, int())."""

    def __init__(self, expr: Expr, operation: str) -> None:
        self.operation = operation
        self.expr = expr
        super().__init__(
            f"{operation} of {expr!r}: it is a placeholder for a value produced when the "
            "program runs; append it with `s += ...` and read the result with `s[name]`"
        )


class Expr:
    """Base of every node. `a + b` concatenates (strings are wrapped as `Text`).

    Asking a node for a concrete value raises `ConcreteValueNeeded`; the tracer stops there.
    """

    def __add__(self, other: Expr | str) -> Concat:
        return Concat((self, as_expr(other)))

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat((as_expr(other), self))

    def __str__(self) -> str:
        raise ConcreteValueNeeded(self, "str()")

    def __format__(self, spec: str) -> str:
        raise ConcreteValueNeeded(self, "an f-string")

    def __bool__(self) -> bool:
        raise ConcreteValueNeeded(self, "a truth test (if / while / and / or)")

    def __eq__(self, other: object) -> bool:
        raise ConcreteValueNeeded(self, "a comparison (==)")

    def __ne__(self, other: object) -> bool:
        raise ConcreteValueNeeded(self, "a comparison (!=)")

    def __hash__(self) -> int:
        return id(self)

    def __int__(self) -> int:
        raise ConcreteValueNeeded(self, "int()")

    def __float__(self) -> float:
        raise ConcreteValueNeeded(self, "float()")

    def __index__(self) -> int:
        raise ConcreteValueNeeded(self, "use as an index")

    def __len__(self) -> int:
        raise ConcreteValueNeeded(self, "len()")

    def __iter__(self) -> NoReturn:
        raise ConcreteValueNeeded(self, "iteration")

    def __getitem__(self, key: object) -> object:
        raise ConcreteValueNeeded(self, "indexing")

    def __contains__(self, item: object) -> bool:
        raise ConcreteValueNeeded(self, "`in`")

    def __repr__(self) -> str:
        parts = []
        for key, value in vars(self).items():
            if isinstance(value, dict):
                value = {k: v for k, v in value.items() if v is not None}
                if not value:
                    continue
            elif value is None:
                continue
            parts.append(f"{key}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(frozen=True, eq=False, repr=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False, repr=False)
class Concat(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True, eq=False, repr=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False, repr=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False, repr=False)
class Gen(Expr):
    """Generate text into variable `name`; every sampling field None = program default."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    regex: str | None = None
    json_schema: str | None = None
    dtype: type | None = None


@dataclass(frozen=True, eq=False, repr=False)
class Select(Expr):
    """Pick one of `choices` by the model's likelihood; stores it in `name`."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: Any


@dataclass(frozen=True, eq=False, repr=False)
class Argument(Expr):
    """A program argument left symbolic when tracing."""

    name: str


@dataclass(frozen=True, eq=False, repr=False)
class VarRef(Expr):
    """The value of variable `name`, produced by an earlier gen / select / var scope."""

    name: str


@dataclass(frozen=True, eq=False, repr=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True, eq=False, repr=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True, eq=False, repr=False)
class SetVar(Expr):
    """`s[name] = value`: sets a variable at this point of the text order."""

    name: str
    value: Any


@dataclass(frozen=True, eq=False, repr=False)
class Fork(Expr):
    """The state splits into `num_branches` copies (fork `fork_id`)."""

    fork_id: int
    num_branches: int


@dataclass(frozen=True, eq=False, repr=False)
class ForkItem(Expr):
    """The start of branch `index` of fork `fork_id`."""

    fork_id: int
    index: int


@dataclass(frozen=True, eq=False, repr=False)
class Join(Expr):
    fork_id: int
    mode: str


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        check_text(value, "appended text")
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


def check_text(text: str, what: str) -> None:
    """ValueError if `text` holds a lone surrogate (`"\\ud83d"`, half an emoji from a
    mis-decoded file or a JSON escape): no tokenizer encodes one (its error was a TypeError
    about input types, raised when the program ran)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise ValueError(f"{what} holds a lone surrogate, U+{code:04X}: it is not text") from None


class AutoNames:
    """The names of a state's unnamed gens and selects: `gen_0`, `gen_1`, ... A name never
    repeats one that its state's join could meet: its ancestors' own names, and those of
    every fork of theirs but the one it is in (an earlier fork's gathered values, or an
    open one's), nor its own branches' (their names come back with the join). A branch's
    `gen_0` was a name it inherited, or its parent's after the fork, or an earlier fork's,
    and a join lost or overwrote values. The branches of one fork do not see each other:
    `forks += gen()` names the gen alike in each, and the join gathers it as one."""

    def __init__(self, parent: AutoNames | None = None, fork: _ForkNames | None = None) -> None:
        self.parent, self.fork_names = parent, fork
        self.count = parent.high if parent is not None else 0  # the next own name, at least
        self.high = self.count  # the next past this state's and its branches' names
        self.forks: list[_ForkNames] = []

    def fork(self, size: int) -> list[AutoNames]:
        """The names of a fork's `size` branches."""
        fork = _ForkNames(self.high)
        self.forks.append(fork)
        return [AutoNames(self, fork) for _ in range(size)]

    def take(self) -> str:
        used, node = self.high, self
        while node.parent is not None:  # (a walk, not recursion: forks nest deep)
            up = node.parent
            used = max(used, up.count, *(f.high for f in up.forks if f is not node.fork_names))
            node = up
        self.count = nxt = used + 1
        walk: AutoNames | None = self
        while walk is not None:  # (the family's highs now reach past it)
            walk.high = max(walk.high, nxt)
            if walk.fork_names is not None:
                walk.fork_names.high = max(walk.fork_names.high, nxt)
            walk = walk.parent
        return f"gen_{used}"


class _ForkNames:
    """One fork of a state: the next name past all of its branches'."""

    def __init__(self, high: int) -> None:
        self.high = high
