"""A regex as an NFA (Thompson's construction from Python's own parse of it), searched
through a lazily built DFA: time linear in the text, whatever the pattern.

`interegular` built the whole DFA up front, which is exponential in the pattern for some
(`(a|b)*a(a|b){14}` took 82 s on the submitting thread, which every program shares).
Here a DFA state (a set of NFA states) and its transition on a character are made the first
time the text needs them, and at most `MAX_DFA_MOVES` are kept (the cache starts afresh
past that), so a step costs at most one walk of the NFA.

Character classes are tested one character at a time with `re`'s own meaning (`\\d`, `\\w`
and `\\s` are Unicode classes, as in `re`). Patterns whose meaning depends on more than the
characters read (anchors, lookarounds, backreferences, inline flags, possessive repeats,
atomic groups) are left to the caller (`Unsupported`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

try:
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_NFA_STATES = 5_000  # more (nested bounded repeats): the caller searches with a regex engine
MAX_DFA_MOVES = 250_000  # (state, character) moves kept; past it the cache starts afresh
FINAL = 0  # the NFA's accepting state

_CATEGORIES = {
    getattr(sre_constants, name): re.compile(text)
    for name, text in (
        ("CATEGORY_DIGIT", r"\d"),
        ("CATEGORY_NOT_DIGIT", r"\D"),
        ("CATEGORY_SPACE", r"\s"),
        ("CATEGORY_NOT_SPACE", r"\S"),
        ("CATEGORY_WORD", r"\w"),
        ("CATEGORY_NOT_WORD", r"\W"),
    )
}


class Unsupported(Exception):
    """The pattern needs more than its characters (or is too large for an NFA here)."""


class NFA:
    """States 0.. (0 is FINAL): a character state has a test and one next state, an
    epsilon state a list of next states."""

    def __init__(self, pattern: str) -> None:
        parsed = sre_parse.parse(pattern)
        if parsed.state.flags & ~re.UNICODE:  # inline flags: (?i), (?s), (?m), (?x), ...
            raise Unsupported(pattern)
        self.tests: list[Callable[[str], bool] | None] = [None]
        self.nexts: list[Any] = [[]]
        self.initial = self._sequence(parsed, FINAL)

    def _add(self, test: Callable[[str], bool] | None, nxt: Any) -> int:
        if len(self.tests) >= MAX_NFA_STATES:
            raise Unsupported("too many states")
        self.tests.append(test)
        self.nexts.append(nxt)
        return len(self.tests) - 1

    def _sequence(self, items: Any, nxt: int) -> int:
        """The start of `items` (a parsed sequence) going on to `nxt` (built backwards)."""
        for op, av in reversed(list(items)):
            nxt = self._item(op, av, nxt)
        return nxt

    def _item(self, op: Any, av: Any, nxt: int) -> int:
        if op is sre_constants.LITERAL:
            char = chr(av)
            return self._add(char.__eq__, nxt)
        if op is sre_constants.NOT_LITERAL:
            char = chr(av)
            return self._add(char.__ne__, nxt)
        if op is sre_constants.ANY:
            return self._add("\n".__ne__, nxt)
        if op is sre_constants.IN:
            return self._add(_class_test(av), nxt)
        if op is sre_constants.BRANCH:
            return self._add(None, [self._sequence(alt, nxt) for alt in av[1]])
        if op is sre_constants.SUBPATTERN:
            if av[1] or av[2]:  # a group with its own flags: (?i:...)
                raise Unsupported("flags")
            return self._sequence(av[3], nxt)
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            low, high, body = av
            start = nxt
            if high == sre_constants.MAXREPEAT:
                loop = self._add(None, [])
                self.nexts[loop] = [self._sequence(body, loop), nxt]
                start = loop
            else:
                for _ in range(high - low):
                    start = self._add(None, [self._sequence(body, start), nxt])
            for _ in range(low):
                start = self._sequence(body, start)
            return start
        raise Unsupported(str(op))  # AT, ASSERT, GROUPREF, POSSESSIVE_REPEAT, ATOMIC_GROUP...


def _class_test(items: list[tuple[Any, Any]]) -> Callable[[str], bool]:
    """A `[...]` class's test, its answers kept per character."""
    negate = bool(items) and items[0][0] is sre_constants.NEGATE
    parts = items[1:] if negate else items
    for op, av in parts:
        if op not in (sre_constants.LITERAL, sre_constants.RANGE, sre_constants.CATEGORY) or (
            op is sre_constants.CATEGORY and av not in _CATEGORIES
        ):
            raise Unsupported(str(op))
    known: dict[str, bool] = {}

    def test(char: str) -> bool:
        found = known.get(char)
        if found is None:
            code = ord(char)
            found = negate != any(
                (op is sre_constants.LITERAL and code == av)
                or (op is sre_constants.RANGE and av[0] <= code <= av[1])
                or (op is sre_constants.CATEGORY and _CATEGORIES[av].match(char) is not None)
                for op, av in parts
            )
            known[char] = found
        return found

    return test


class LazyDFA:
    """The NFA's subset DFA, built as the text needs it. A DFA state is a frozenset of the
    NFA's character states (and FINAL); `dead` is the empty one."""

    def __init__(self, nfa: NFA) -> None:
        self.nfa = nfa
        self.initial = self._closure([nfa.initial])
        self.dead: frozenset[int] = frozenset()
        self._moves: dict[tuple[frozenset[int], str], frozenset[int]] = {}

    def move(self, state: frozenset[int], char: str) -> frozenset[int]:
        key = (state, char)
        found = self._moves.get(key)
        if found is None:
            if len(self._moves) >= MAX_DFA_MOVES:
                self._moves.clear()
            tests, nexts = self.nfa.tests, self.nfa.nexts
            found = self._closure([nexts[s] for s in state if s != FINAL and tests[s](char)])
            self._moves[key] = found
        return found

    def _closure(self, starts: list[int]) -> frozenset[int]:
        """The character states (and FINAL) `starts` reach through epsilon moves."""
        tests, nexts = self.nfa.tests, self.nfa.nexts
        out, seen, todo = set(), set(starts), list(starts)
        while todo:
            state = todo.pop()
            if tests[state] is not None or state == FINAL:
                out.add(state)
                continue
            for target in nexts[state]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(out)
