"""Stop regexes searched incrementally: O(new characters) per token, not O(output).

A stop regex may match anywhere in the output, so searching the whole text with `re` after
every token costs O(n) per token and O(n^2) per request. Instead each pattern's character
DFA (interegular) runs as a search: the scanner keeps, for every DFA state that some
suffix of the text has reached, the earliest position such a suffix starts at. Each new
character advances those states and starts one more at the initial state; a match exists
once a final state is reached. The earliest live start is also the first character a
match could still begin at, so a stream holds back only the text from there.

The DFA is used only where it means what Python's `re` means: patterns with anchors,
lookarounds, backreferences or inline flags are searched with `re` over the whole text as
before, and a pattern with `\\d`, `\\w` or `\\s` (Unicode classes in `re`, ASCII in the DFA)
switches to `re` at its first non-ASCII character. The scanner only answers whether a
match exists; where it begins and what it matched come from `re` (once per request).
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

try:
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

# Constructs whose meaning depends on more than the characters read so far.
_CONTEXT_OPS = {
    sre_constants.AT,
    sre_constants.ASSERT,
    sre_constants.ASSERT_NOT,
    sre_constants.GROUPREF,
    sre_constants.GROUPREF_EXISTS,
}


class SearchDFA(NamedTuple):
    transitions: dict[Any, dict[Any, Any]]  # state -> symbol -> state, live states only
    alphabet: Any  # char -> symbol
    initial: Any
    finals: frozenset
    ascii_only: bool  # its character classes agree with `re` on ASCII text only


class StopRegexScanner:
    """Whether any of `patterns` matches somewhere in a text that only ever grows."""

    def __init__(self, patterns: list[str]) -> None:
        self._patterns = patterns
        self._dfas: list[SearchDFA | None] = [search_dfa(p) for p in patterns]
        self.restart(0)

    def restart(self, origin: int) -> None:
        """Forget what was read: from now on only matches that begin at `origin` or later
        count (the text's first `origin` characters are read already)."""
        self._read = self.origin = origin  # (characters read; no match begins before origin)
        self._active: list[dict[Any, int]] = [{} for _ in self._patterns]  # state -> start
        self.matched = False

    def feed(self, text: str) -> bool:
        """Read what `text` adds to the text of the previous call; True once a pattern has
        matched somewhere in it."""
        if self.matched or len(text) <= self._read:
            return self.matched
        new, start = text[self._read :], self._read
        self._read = len(text)
        for i, dfa in enumerate(self._dfas):
            if dfa is not None and dfa.ascii_only and not new.isascii():
                self._dfas[i] = dfa = None  # `re` from now on
            if dfa is None:
                found = re.compile(self._patterns[i]).search(text, self.origin) is not None
            else:
                found = _advance(dfa, self._active[i], new, start)
            if found:
                self.matched = True
                return True
        return False

    def stable_len(self) -> int:
        """How many leading characters of the text read so far no match can begin in."""
        if any(dfa is None for dfa in self._dfas):
            return self.origin
        return min((min(a.values(), default=self._read) for a in self._active), default=0)


def _advance(dfa: SearchDFA, active: dict[Any, int], new: str, start: int) -> bool:
    """Advance the partial matches in `active` (in place) over `new`, which begins at
    position `start`; True as soon as one completes."""
    transitions, alphabet, finals = dfa.transitions, dfa.alphabet, dfa.finals
    for offset, ch in enumerate(new):
        symbol = alphabet[ch]
        nxt: dict[Any, int] = {}
        for state, begin in [*active.items(), (dfa.initial, start + offset)]:
            target = transitions[state].get(symbol)
            if target is not None and begin < nxt.get(target, start + offset + 1):
                nxt[target] = begin
        active.clear()
        active.update(nxt)
        if not finals.isdisjoint(nxt):
            return True
    return False


@functools.lru_cache(maxsize=256)
def search_dfa(pattern: str) -> SearchDFA | None:
    """The pattern's DFA, pruned to states that can still reach a match; None where `re`
    must search it."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error:
        return None
    if parsed.state.flags & ~re.UNICODE:  # inline flags: (?i), (?s), (?m), (?x), ...
        return None
    ascii_only = False
    for op, av in _walk(parsed):
        if op in _CONTEXT_OPS or (op is sre_constants.SUBPATTERN and (av[1] or av[2])):
            return None  # context, or a group with its own flags: (?i:...)
        if op is sre_constants.CATEGORY or (
            op is sre_constants.IN and any(o is sre_constants.CATEGORY for o, _ in av)
        ):
            ascii_only = True
    try:
        import interegular

        fsm = interegular.parse_pattern(pattern).to_fsm()
    except Exception:  # noqa: BLE001 - a construct interegular lacks: `re` searches it
        return None
    live = _states_reaching(fsm.finals, fsm.map)
    transitions = {
        state: {sym: t for sym, t in fsm.map.get(state, {}).items() if t in live} for state in live
    }
    if fsm.initial not in live:
        return None
    return SearchDFA(transitions, fsm.alphabet, fsm.initial, frozenset(fsm.finals), ascii_only)


def _states_reaching(finals: Any, transitions: dict[Any, dict[Any, Any]]) -> set:
    reverse: dict[Any, set] = {}
    for state, edges in transitions.items():
        for target in edges.values():
            reverse.setdefault(target, set()).add(state)
    live, todo = set(finals), list(finals)
    while todo:
        for source in reverse.get(todo.pop(), ()):
            if source not in live:
                live.add(source)
                todo.append(source)
    return live


def _walk(node: Any):
    """Every (op, argument) of a parsed pattern, nested groups and repeats included."""
    for op, av in node:
        yield op, av
        yield from _walk_children(av)


def _walk_children(av: Any):
    if isinstance(av, sre_parse.SubPattern):
        yield from _walk(av)
    elif isinstance(av, (list, tuple)):
        for item in av:
            yield from _walk_children(item)
