r"""Stop regexes searched incrementally: O(new characters) per token, not O(output).

A stop regex may match anywhere in the output, so searching the whole text with `re` after
every token costs O(n) per token and O(n^2) per request. Instead each pattern's DFA runs
as a search: the scanner keeps, for every DFA state that some suffix of the text has
reached, the earliest position such a suffix starts at. Each new character advances those
states and starts one more at the initial state; a match exists once a final state is
reached. The earliest live start is also the first character a match could still begin at,
so a stream holds back only the text from there.

The DFA is built lazily from the pattern's NFA (`regex_nfa.py`): linear in the pattern, so
no pattern can stall the thread that submits it (an up-front DFA took 82 s for
`(a|b)*a(a|b){14}`). Patterns whose meaning depends on more than the characters read
(anchors, lookarounds, backreferences) are searched over the whole text by the `regex`
module (Python's syntax, with a time limit: `re` has none, and `(x+x+)+y$` held the engine
loop for minutes); a search past `SEARCH_TIMEOUT_S` fails its request with a ValueError
naming the pattern. Where the first match begins comes from the DFA, and what it matched
from the NFA run at that start in `re`'s order (`NFA.match_end`; once per request: the
`regex` module's match there read `\w` and `\d` as Unicode has them, not as `re` does),
or, where a repeat's body can match nothing, from the `regex` module's match.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from lmprog_runtime.regex_nfa import FINAL, NFA, LazyDFA, Unsupported

try:
    import regex as _regex_engine  # (a dependency of transformers)
except ImportError:  # pragma: no cover
    _regex_engine = None

SEARCH_TIMEOUT_S = 0.05  # a search of one pattern over the output, where the DFA cannot


class StopRegexScanner:
    """Whether any of `patterns` matches somewhere in a text that only ever grows."""

    def __init__(self, patterns: list[str]) -> None:
        self._patterns = patterns
        self._dfas: list[LazyDFA | None] = [search_dfa(p) for p in patterns]
        self.restart(0)

    def restart(self, origin: int) -> None:
        """Forget what was read: from now on only matches that begin at `origin` or later
        count (the text's first `origin` characters are read already)."""
        self._read = self.origin = origin  # (characters read; no match begins before origin)
        self._active: list[dict[Any, int]] = [{} for _ in self._patterns]  # state -> start
        self.matched = False
        # A searched pattern's match in the text read: (text length, start, matched text)
        self._searched: dict[int, tuple[int, int, str]] = {}

    def feed(self, text: str) -> bool:
        """Read what `text` adds to the text of the previous call; True once a pattern has
        matched somewhere in it."""
        if self.matched or len(text) <= self._read:
            return self.matched
        new, start = text[self._read :], self._read
        self._read = len(text)
        for i, dfa in enumerate(self._dfas):
            if dfa is None:
                match = _search(self._patterns[i], text, self.origin)
                if match is not None:
                    self._searched[i] = (len(text), match.start(), match.group())
                found = match is not None
            else:
                found = _advance(dfa, self._active[i], new, start)
            if found:
                self.matched = True
                return True
        return False

    def may_match(self, text: str) -> bool:
        """Whether `text` (the text read so far, a prefix of it, or more) may hold a match:
        not where it holds no more than was read and nothing matched."""
        return self.matched or len(text) > self._read

    def stable_len(self) -> int:
        """How many leading characters of the text read so far no match can begin in."""
        if any(dfa is None for dfa in self._dfas):
            return self.origin
        return min((min(a.values(), default=self._read) for a in self._active), default=0)

    def first_match(self, text: str, origin: int) -> tuple[int, str] | None:
        """Where the first match in `text` from `origin` begins, and what it matched (the
        match `re.search` finds, of the pattern listed first on a tie); None if none."""
        best: tuple[int, str] | None = None
        for i, (pattern, dfa) in enumerate(zip(self._patterns, self._dfas)):
            if dfa is None:
                searched = self._searched.get(i)
                if searched is not None and searched[0] == len(text) and origin == self.origin:
                    span = searched[1:]  # (searched once more, it could run out of time)
                else:
                    found = _search(pattern, text, origin)
                    span = None if found is None else (found.start(), found.group())
                if span is not None and (best is None or span[0] < best[0]):
                    best = span
                continue
            span = _leftmost(dfa, text, origin)
            if span is not None and (best is None or span[0] < best[0]):
                best = (span[0], _matched(pattern, dfa, text, span))
        return best


def _advance(dfa: LazyDFA, active: dict[Any, int], new: str, start: int) -> bool:
    """Advance the partial matches in `active` (in place) over `new`, which begins at
    position `start`; True as soon as one completes."""
    move, initial = dfa.move, dfa.initial
    for offset, ch in enumerate(new):
        here = start + offset
        nxt: dict[Any, int] = {}
        for state, begin in [*active.items(), (initial, here)]:
            target = move(state, ch)
            if target and begin < nxt.get(target, here + 1):
                nxt[target] = begin
        active.clear()
        active.update(nxt)
        if any(FINAL in state for state in nxt):
            return True
    return False


def _leftmost(dfa: LazyDFA, text: str, origin: int) -> tuple[int, int] | None:
    """(start, end) of the match of `text[origin:]` that starts first (its shortest end)."""
    best: tuple[int, int] | None = None
    active: dict[Any, int] = {}
    for here in range(origin, len(text)):
        ch = text[here]
        starts = [*active.items()] if best is not None else [*active.items(), (dfa.initial, here)]
        active = {}
        for state, begin in starts:
            target = dfa.move(state, ch)
            if target and begin < active.get(target, here + 1):
                active[target] = begin
        for state, begin in active.items():
            if FINAL in state and (best is None or begin < best[0]):
                best = (begin, here + 1)
        if best is not None:  # only an earlier start can win now
            active = {state: begin for state, begin in active.items() if begin < best[0]}
            if not active:
                break
    return best


def _matched(pattern: str, dfa: LazyDFA, text: str, span: tuple[int, int]) -> str:
    """What the match `re` finds at `span`'s start takes of `text` (`span`: the shortest
    match there): the NFA's run in `re`'s order; where a repeat's body can match nothing,
    the `regex` module's match (the shortest where it runs out of time)."""
    start = span[0]
    if not dfa.nfa.repeats_empty:
        end = dfa.nfa.match_end(text, start)
        return text[start : span[1] if end is None else end]
    try:
        found = _search(pattern, text, start, at_start=True)
    except ValueError:
        found = None
    return text[start : span[1]] if found is None else found.group()


def _search(pattern: str, text: str, pos: int, at_start: bool = False) -> Any:
    """`pattern`'s first match in `text` from `pos` (or one beginning at `pos`), by the
    `regex` module with a time limit: a ValueError naming the pattern past it."""
    compiled = _compiled(pattern)
    if compiled.__class__.__module__ == "re":
        return compiled.match(text, pos) if at_start else compiled.search(text, pos)
    try:
        if at_start:
            return compiled.match(text, pos, timeout=SEARCH_TIMEOUT_S)
        return compiled.search(text, pos, timeout=SEARCH_TIMEOUT_S)
    except TimeoutError:
        raise ValueError(
            f"stop_regex {pattern!r} took over {SEARCH_TIMEOUT_S} s to search the output "
            f"({len(text)} characters): it backtracks without end; write it without "
            "nested repeats, or without anchors and lookarounds"
        ) from None


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> Any:
    """`pattern` compiled by the `regex` module, or by `re` where they read it otherwise:
    a class inside a class (`[[:alpha:]]`, a POSIX class to `regex`, literals to `re`)."""
    from lmprog_runtime.constrained.outlines_backend import rust_only_class_syntax

    if _regex_engine is None or rust_only_class_syntax(pattern) is not None:
        return re.compile(pattern)
    return _regex_engine.compile(pattern)


@functools.lru_cache(maxsize=256)
def search_dfa(pattern: str) -> LazyDFA | None:
    """The pattern's lazily built DFA; None where the `regex` module must search it."""
    try:
        return LazyDFA(NFA(pattern))
    except (Unsupported, re.error, RecursionError):
        return None
