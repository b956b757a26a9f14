"""A regex as an NFA (Thompson's construction from Python's own parse of it), searched
through a lazily built DFA: time linear in the text, whatever the pattern.

`interegular` built the whole DFA up front, which is exponential in the pattern for some
(`(a|b)*a(a|b){14}` took 82 s on the submitting thread, which every program shares).
Here a DFA state (a set of NFA states) and its transition on a character are made the first
time the text needs them, and at most `MAX_DFA_MOVES` are kept (the cache starts afresh
past that), so a step costs at most one walk of the NFA.

Character classes are tested one character at a time with `re`'s own meaning (`\\d`, `\\w`
and `\\s` are Unicode classes, as in `re`; under flags, `(?i)`, `(?s)`, `(?a)` or `(?i:...)`,
by `re` itself, compiled for that one character test). Patterns whose meaning depends on
more than the characters read (anchors, lookarounds, backreferences, possessive repeats,
atomic groups) are left to the caller (`Unsupported`).

`NFA.match_end` gives the end of the match `re.match` finds at a position, by running the
NFA's states in `re`'s order of preference (a Pike VM: a greedy repeat tries its body
first, a lazy one its exit), in time linear in the text; not where a repeat's body can
match nothing (`repeats_empty`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

try:
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_NFA_STATES = 5_000  # more (nested bounded repeats): the caller searches with a regex engine
MAX_DFA_MOVES = 250_000  # (state, character) moves kept; past it the cache starts afresh
# A character test's answers kept (per class, shared by its states); past it, afresh.
MAX_KNOWN_CHARS = 4096
FINAL = 0  # the NFA's accepting state
# Flags read here: those a character's test depends on (MULTILINE only changes anchors,
# VERBOSE only the parse).
_CHAR_FLAGS = re.IGNORECASE | re.DOTALL | re.ASCII | re.UNICODE
_FLAGS = _CHAR_FLAGS | re.MULTILINE | re.VERBOSE
_FLAG_LETTERS = ((re.IGNORECASE, "i"), (re.DOTALL, "s"), (re.ASCII, "a"), (re.UNICODE, "u"))


class Flags(NamedTuple):
    """The flags a character's test is read under: the pattern's, and those of the groups
    around it (`(?i:...)`), outermost first. A test under any of them is `re`'s own, with
    the same groups around it: `re` reads them its way (`(?a:\\W)` leaves `\\W` Unicode)."""

    pattern: int
    scopes: tuple[tuple[int, int], ...]  # (flags added, flags removed) per group

    def any_set(self, flags: int) -> bool:
        """Whether a test may depend on the flags: set for the pattern, or any group."""
        return bool(self.pattern & flags) or bool(self.scopes)


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
    epsilon state a list of next states. `literals[state]`: the one character a state's
    test takes, where it takes one only (a literal, not under `(?i)`), else None."""

    def __init__(self, pattern: str, max_states: int = MAX_NFA_STATES) -> None:
        parsed = sre_parse.parse(pattern)
        flags = parsed.state.flags
        if flags & ~_FLAGS:  # (a bytes pattern's LOCALE, DEBUG)
            raise Unsupported(pattern)
        self.max_states = max_states
        self.tests: list[Callable[[str], bool] | None] = [None]
        self.nexts: list[Any] = [[]]
        self.literals: list[str | None] = [None]
        self._class_tests: dict[Any, Callable[[str], bool]] = {}
        self.repeats_empty = False  # whether a repeat's body can match nothing
        self.initial = self._sequence(parsed, FINAL, Flags(flags & _CHAR_FLAGS, ()))

    def match_end(self, text: str, start: int) -> int | None:
        """Where the match `re.match(pattern, text, start)` finds ends; None if none. Not
        for a pattern that `repeats_empty`: `re` ends a repeat at a try of its body that
        matched nothing (`(?:|b)*` matches "" of "bb"), which runs here as any other."""
        tests, nexts = self.tests, self.nexts
        threads = self._preferred([self.initial])
        matched = None
        for here in range(start, len(text) + 1):
            char = text[here] if here < len(text) else None
            following = []
            for state in threads:
                if state == FINAL:
                    matched = here  # (the states after it are ones `re` tries later)
                    break
                if char is not None and tests[state](char):
                    following.append(nexts[state])
            if char is None:
                break
            threads = self._preferred(following)
            if not threads:
                break
        return matched

    def _preferred(self, starts: list[int]) -> list[int]:
        """The character states (and FINAL) `starts` reach through epsilon moves, in the
        order `re` tries them, each once."""
        tests, nexts = self.tests, self.nexts
        out, seen = [], set()
        todo = list(reversed(starts))
        while todo:
            state = todo.pop()
            if state in seen:
                continue
            seen.add(state)
            if tests[state] is not None or state == FINAL:
                out.append(state)
            else:
                todo.extend(reversed(nexts[state]))
        return out

    def _add(self, test: Callable[[str], bool] | None, nxt: Any, literal: str | None = None) -> int:
        if len(self.tests) >= self.max_states:
            raise Unsupported("too many states")
        self.tests.append(test)
        self.nexts.append(nxt)
        self.literals.append(literal)
        return len(self.tests) - 1

    def _sequence(self, items: Any, nxt: int, flags: Flags) -> int:
        """The start of `items` (a parsed sequence) going on to `nxt` (built backwards)."""
        for op, av in reversed(list(items)):
            nxt = self._item(op, av, nxt, flags)
        return nxt

    def _item(self, op: Any, av: Any, nxt: int, flags: Flags) -> int:
        if op in (sre_constants.LITERAL, sre_constants.NOT_LITERAL, sre_constants.ANY):
            one = op is sre_constants.LITERAL and not flags.any_set(re.IGNORECASE)
            return self._add(_char_test(op, av, flags), nxt, chr(av) if one else None)
        if op is sre_constants.IN:  # (one test per class: `[^"]{0,500}` has 500 states)
            key = (tuple(av), flags)
            test = self._class_tests.get(key)
            if test is None:
                test = self._class_tests[key] = _class_test(av, flags)
            return self._add(test, nxt)
        if op is sre_constants.BRANCH:
            return self._add(None, [self._sequence(alt, nxt, flags) for alt in av[1]])
        if op is sre_constants.SUBPATTERN:  # (a group's own flags: (?i:...), (?-i:...))
            scope = (av[1] & _CHAR_FLAGS, av[2] & _CHAR_FLAGS)
            if scope != (0, 0):
                flags = Flags(flags.pattern, (*flags.scopes, scope))
            return self._sequence(av[3], nxt, flags)
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            low, high, body = av
            if body.getwidth()[0] == 0:  # (`match_end` cannot say where `re` ends it)
                self.repeats_empty = True
            lazy = op is sre_constants.MIN_REPEAT
            start = nxt
            if high == sre_constants.MAXREPEAT:
                loop = self._add(None, [])
                self.nexts[loop] = _tried(self._sequence(body, loop, flags), nxt, lazy)
                start = loop
            else:
                for _ in range(high - low):
                    start = self._add(None, _tried(self._sequence(body, start, flags), nxt, lazy))
            for _ in range(low):
                start = self._sequence(body, start, flags)
            return start
        raise Unsupported(str(op))  # AT, ASSERT, GROUPREF, POSSESSIVE_REPEAT, ATOMIC_GROUP...


def _tried(body: int, after: int, lazy: bool) -> list[int]:
    """A repeat's next states in the order `re` tries them: a greedy repeat's body first, a
    lazy one's exit."""
    return [after, body] if lazy else [body, after]


def _char_test(op: Any, av: Any, flags: Flags) -> Callable[[str], bool]:
    """A literal's, a negated literal's or `.`'s test."""
    if flags.any_set(re.IGNORECASE | re.DOTALL):
        if op is sre_constants.ANY:
            return _re_test(".", flags)
        piece = _escape(av) if op is sre_constants.LITERAL else f"[^{_escape(av)}]"
        return _re_test(piece, flags)
    if op is sre_constants.LITERAL:
        return chr(av).__eq__
    if op is sre_constants.NOT_LITERAL:
        return chr(av).__ne__
    return "\n".__ne__


def _class_test(items: list[tuple[Any, Any]], flags: Flags) -> Callable[[str], bool]:
    """A `[...]` class's test, its answers kept per character."""
    negate = bool(items) and items[0][0] is sre_constants.NEGATE
    parts = items[1:] if negate else items
    for op, av in parts:
        if op not in (sre_constants.LITERAL, sre_constants.RANGE, sre_constants.CATEGORY) or (
            op is sre_constants.CATEGORY and av not in _CATEGORIES
        ):
            raise Unsupported(str(op))
    if flags.any_set(re.IGNORECASE | re.ASCII):
        rendered = "".join(
            _escape(av)
            if op is sre_constants.LITERAL
            else f"{_escape(av[0])}-{_escape(av[1])}"
            if op is sre_constants.RANGE
            else _CATEGORIES[av].pattern
            for op, av in parts
        )
        return _re_test(f"[{'^' if negate else ''}{rendered}]", flags)
    known: dict[str, bool] = {}

    def test(char: str) -> bool:
        found = known.get(char)
        if found is None:
            if len(known) >= MAX_KNOWN_CHARS:
                known.clear()
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


def _escape(code: int) -> str:
    return f"\\U{code:08x}"


def _re_test(piece: str, flags: Flags) -> Callable[[str], bool]:
    """`piece` (one character's pattern) compiled by `re` under `flags`, as a test of one
    character, its answers kept per character."""
    for add, remove in reversed(flags.scopes):  # (the innermost group first)
        piece = f"(?{_letters(add)}{'-' + _letters(remove) if remove else ''}:{piece})"
    match = re.compile(piece, flags.pattern).fullmatch
    known: dict[str, bool] = {}

    def test(char: str) -> bool:
        found = known.get(char)
        if found is None:
            if len(known) >= MAX_KNOWN_CHARS:
                known.clear()
            found = known[char] = match(char) is not None
        return found

    return test


def _letters(flags: int) -> str:
    return "".join(letter for flag, letter in _FLAG_LETTERS if flags & flag)


class LazyDFA:
    """The NFA's subset DFA, built as the text needs it. A DFA state is a frozenset of the
    NFA's character states (and FINAL); `dead` is the empty one."""

    def __init__(self, nfa: NFA, max_moves: int = MAX_DFA_MOVES) -> None:
        self.nfa = nfa
        self.initial = self._closure([nfa.initial])
        self.dead: frozenset[int] = frozenset()
        self.max_moves = max_moves
        self._moves: dict[tuple[frozenset[int], str], frozenset[int]] = {}

    def move(self, state: frozenset[int], char: str) -> frozenset[int]:
        key = (state, char)
        found = self._moves.get(key)
        if found is None:
            if len(self._moves) >= self.max_moves:
                self._moves.clear()
            tests, nexts = self.nfa.tests, self.nfa.nexts
            found = self._closure([nexts[s] for s in state if s != FINAL and tests[s](char)])
            self._moves[key] = found
        return found

    def moves_kept(self) -> int:
        """How many moves it holds now (at most `max_moves`)."""
        return len(self._moves)

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
