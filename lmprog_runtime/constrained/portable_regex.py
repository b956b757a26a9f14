"""A regex as Python's `re` reads it, written again in the syntax outlines-core's engine
(Rust's `regex`) reads the same way.

A gen's regex follows Python's `re` (its outputs `re.fullmatch` it), but outlines-core
reads the text otherwise in places: its `\\w`, `\\S` and `(?i)` take characters Python's
do not (combining marks, U+001C..U+001F, U+0345), it refuses `a{,3}` and any `^`, and it
reads `a{1, 3}` as a repeat where Python reads text. So the pattern is parsed with Python's
own parser and written again with nothing left to read differently:
- every character not an ASCII letter or digit as an escape (`\\x2d`, `\\u00e9`), read
  alike by both;
- every class (`\\w`, `[^\\s\\d]`, a letter under `(?i)`, `.`) as the explicit ranges of
  the characters Python's `re` takes, found by running it over all of Unicode;
- groups as `(?:...)`, repeats as `{m,n}`;
- a `^` / `\\A` at the start and a `$` / `\\Z` at the end dropped: there they change
  nothing, since the whole output must match. Elsewhere they are refused, as are
  back-references, lookarounds, atomic groups, possessive repeats, `\\b` and `\\B`.

The output is a valid Python regex too, with the same meaning (the tests check both).
"""

from __future__ import annotations

import _sre
import functools
import re
import sys
import warnings

try:  # (Python 3.11 on; 3.10 has them as sre_parse, sre_constants and sre_compile's)
    from re import _casefix, _constants, _parser

    _EXTRA_CASES: dict[int, tuple[int, ...]] = _casefix._EXTRA_CASES
except ImportError:  # pragma: no cover - Python 3.10
    import sre_compile
    import sre_constants as _constants
    import sre_parse as _parser

    # (the same map: 3.10's `(?i)s` took U+017F too, which an empty one left out)
    _EXTRA_CASES = sre_compile._ignorecase_fixes

_SURROGATES = (0xD800, 0xDFFF)  # (no UTF-8 text holds one; Rust's classes cannot name one)
_KEPT_FLAGS = re.IGNORECASE | re.ASCII | re.DOTALL  # (what a character class depends on)
_TYPE_FLAGS = re.ASCII | re.UNICODE | re.LOCALE
_STARTS = {"AT_BEGINNING", "AT_BEGINNING_STRING"}
_ENDS = {"AT_END", "AT_END_STRING"}
_REFUSED = {
    "GROUPREF": "a back-reference",
    "GROUPREF_EXISTS": "a conditional group",
    "ASSERT": "a lookaround",
    "ASSERT_NOT": "a lookaround",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repeat",
}
_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}


@functools.lru_cache(maxsize=256)
def portable_regex(regex: str) -> str:
    """`regex` (Python's syntax and meaning) written so that Rust's `regex` and Python's
    `re` read the same language from it; ValueError naming what cannot be written so."""
    try:
        tree = _parse(regex)
    except re.error as error:
        raise ValueError(f"Python's re refuses it: {error}") from None
    return _sequence(list(tree), tree.state.flags, at_start=True, at_end=True)


def nests_as_written(regex: str) -> bool:
    """Whether `regex` keeps its meaning behind other text (`x(?:regex)`): False where
    Python's `re` reads an anchor in it or a flag set for the whole pattern (`(?i)`, and
    `(?u)`, which it refuses there though a text pattern is read so anyway); True where it
    cannot read it (the compile names why)."""
    try:
        tree = _parse(regex)
    except re.error:
        return True
    if tree.state.flags & ~re.UNICODE or "AT" in _op_names(tree):
        return False
    try:
        _parse(f"(?:{regex})")
    except re.error:
        return False
    return True


def without_edge_anchors(regex: str) -> str:
    """`regex` less a `^` / `\\A` it starts with and a `$` / `\\Z` it ends with, cut
    from its text: the same whole matches, for a reader that reads no anchor (interegular,
    which builds jump-forward's FSM) or behind other text (a healed pattern)."""
    for start in ("^", "\\A"):
        if regex.startswith(start):
            regex = regex[len(start) :]
            break
    for end in ("$", "\\Z"):
        stem = regex[: len(regex) - len(end)]
        escaped = (len(stem) - len(stem.rstrip("\\"))) % 2 == 1  # (`\\$` is a dollar)
        if regex.endswith(end) and not escaped:
            return stem
    return regex


def width(regex: str) -> tuple[int, int | None]:
    """The fewest and the most characters a whole match of `regex` holds (None: no most);
    re.error where Python's `re` refuses it."""
    low, high = _parse(regex).getwidth()
    return low, None if high >= _constants.MAXREPEAT else high


def _parse(regex: str):
    """Python's parse of `regex` (re.error where it refuses it)."""
    with warnings.catch_warnings():  # (re's FutureWarning on `[[`: the compile refuses it)
        warnings.simplefilter("ignore", FutureWarning)
        return _parser.parse(regex)


def _op_names(items) -> set[str]:
    names = set()
    for op, arg in items:
        names.add(str(op))
        for part in arg if isinstance(arg, (tuple, list)) else ():
            for child in part if isinstance(part, list) else [part]:
                if hasattr(child, "data"):  # a nested pattern (a group, a branch, a repeat)
                    names |= _op_names(child)
    return names


def _sequence(items: list, flags: int, *, at_start: bool, at_end: bool) -> str:
    """Items one after another; `at_start` / `at_end`: nothing can come before / after
    them in a match."""
    wide = [i for i, (op, _) in enumerate(items) if str(op) != "AT"]  # (what takes text)
    first, last = (wide[0], wide[-1]) if wide else (len(items), -1)
    return "".join(
        _item(str(op), arg, flags, at_start and i <= first, at_end and i >= last)
        for i, (op, arg) in enumerate(items)
    )


def _item(op: str, arg, flags: int, at_start: bool, at_end: bool) -> str:
    if op in _REFUSED:
        raise ValueError(f"{_REFUSED[op]} is not a regular construct; the engine cannot follow it")
    if op == "AT":
        return _anchor(str(arg), at_start, at_end)
    if op == "BRANCH":
        branches = [_sequence(list(b), flags, at_start=at_start, at_end=at_end) for b in arg[1]]
        return "(?:" + "|".join(branches) + ")"
    if op == "SUBPATTERN":
        _group, add, remove, body = arg
        if add & _TYPE_FLAGS:  # (`(?u:...)` in `(?a)`: one type flag replaces the other)
            flags &= ~_TYPE_FLAGS
        inner = _sequence(list(body), (flags | add) & ~remove, at_start=at_start, at_end=at_end)
        return f"(?:{inner})"
    if op in ("MAX_REPEAT", "MIN_REPEAT"):  # (lazy or greedy: the same whole matches)
        low, high, body = arg
        once = high <= 1  # (an anchor in a body repeated twice would stand mid-pattern)
        inner = _sequence(list(body), flags, at_start=at_start and once, at_end=at_end and once)
        return f"(?:{inner}){_count(low, high)}"
    if op == "LITERAL" and not _is_surrogate(arg):
        return _render(_case_spans(arg, flags)) if flags & re.IGNORECASE else _char(arg)
    spans = _direct_spans(op, arg, flags)
    return _render(_scanned_spans(_python_class(op, arg), flags) if spans is None else spans)


def _anchor(code: str, at_start: bool, at_end: bool) -> str:
    if code in _STARTS and at_start or code in _ENDS and at_end:
        return ""  # (where the whole output must match, it changes nothing)
    if code in _STARTS or code in _ENDS:
        raise ValueError(
            "'^' and '\\A' can stand only at the start of the pattern, '$' and '\\Z' only at "
            "its end (there they change nothing: a gen's whole output matches the pattern)"
        )
    raise ValueError("\\b and \\B are not supported (write the text they stand for)")


def _count(low: int, high: int) -> str:
    if high == _constants.MAXREPEAT:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _python_class(op: str, arg) -> str:
    """One character's construct (`op` LITERAL, NOT_LITERAL, ANY or IN) in Python's class
    syntax, every member escaped."""
    if op == "ANY":
        return "."
    if op == "LITERAL":
        return _char(arg)
    if op == "NOT_LITERAL":
        return f"[^{_char(arg)}]"
    parts = []
    for kind, value in arg:
        kind = str(kind)
        if kind == "NEGATE":
            parts.append("^")
        elif kind == "LITERAL":
            parts.append(_char(value))
        elif kind == "RANGE":
            parts.append(f"{_char(value[0])}-{_char(value[1])}")
        elif kind == "CATEGORY":
            parts.append(_CATEGORIES[str(value)])
        else:
            raise ValueError(f"unexpected {kind} in a character class")
    return "[" + "".join(parts) + "]"


@functools.lru_cache(maxsize=4096)
def _case_spans(code: int, flags: int) -> tuple[tuple[int, int], ...]:
    """The characters Python's `re` takes for the letter `code` under `(?i)`: among those
    of its lowercase (re's `tolower`) and re's table of extra case pairs (`ſ` for `s`),
    each asked of `re` itself. (Scanning all of Unicode took 12 ms a letter.)"""
    pattern = re.compile(_char(code), flags & _KEPT_FLAGS)
    groups, lowered = _lower_groups(), _sre.unicode_tolower(code)
    related = {code, *groups.get(lowered, ())}
    for extra in _EXTRA_CASES.get(lowered, ()):
        related |= {extra, *groups.get(_sre.unicode_tolower(extra), ())}
    found = sorted(x for x in related if pattern.fullmatch(chr(x)))
    return tuple(_without_surrogates(union([(x, x) for x in found])))


@functools.cache
def _lower_groups() -> dict[int, set[int]]:
    """re's lowercase of a character -> every character with that lowercase (where one
    has a lowercase other than itself)."""
    groups: dict[int, set[int]] = {}
    for code in range(sys.maxunicode + 1):
        lowered = _sre.unicode_tolower(code)
        if lowered != code:
            groups.setdefault(lowered, {lowered}).add(code)
    return groups


def _direct_spans(op: str, arg, flags: int) -> tuple[tuple[int, int], ...] | None:
    """The code point ranges of a class of plain members (literals and ranges, negated or
    not), `.` or a negated literal, worked out directly; None where `re` must be asked (a
    category such as `\\d`, or a class under `(?i)`)."""
    if flags & re.IGNORECASE:
        return None
    if op == "ANY":
        negate, members = True, [] if flags & re.DOTALL else [(10, 10)]  # (all but "\\n")
    elif op in ("LITERAL", "NOT_LITERAL"):
        negate, members = op == "NOT_LITERAL", [(arg, arg)]
    else:
        negate, members = False, []
        for kind, value in arg:
            kind = str(kind)
            if kind == "NEGATE":
                negate = True
            elif kind == "LITERAL":
                members.append((value, value))
            elif kind == "RANGE":
                members.append(value)
            else:
                return None
    spans = union(members)
    return tuple(_without_surrogates(_complement(spans) if negate else spans))


@functools.lru_cache(maxsize=1024)
def _scanned_spans(python_class: str, flags: int) -> tuple[tuple[int, int], ...]:
    """The code point ranges of the characters Python's `re` takes for `python_class`
    under `flags`, found by running it over all of Unicode."""
    pattern = re.compile(f"(?:{python_class})+", flags & _KEPT_FLAGS)
    spans = [(m.start(), m.end() - 1) for m in pattern.finditer(_every_character())]
    return tuple(_without_surrogates(spans))


def _is_surrogate(code: int) -> bool:
    return _SURROGATES[0] <= code <= _SURROGATES[1]


def union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` (code point ranges) sorted, the overlapping and adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for low, high in sorted(spans):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def _complement(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every code point outside `spans` (sorted, disjoint)."""
    out, next_free = [], 0
    for low, high in spans:
        if low > next_free:
            out.append((next_free, low - 1))
        next_free = high + 1
    if next_free <= sys.maxunicode:
        out.append((next_free, sys.maxunicode))
    return out


def _without_surrogates(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for low, high in spans:
        if low <= _SURROGATES[1] and high >= _SURROGATES[0]:
            out += [(low, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, high)]
        else:
            out.append((low, high))
    return [(low, high) for low, high in out if low <= high]


def _render(spans: tuple[tuple[int, int], ...]) -> str:
    """A class of `spans`; one that takes no character is written as all of them, negated
    (Rust's empty class)."""
    if not spans:
        return f"[^{_char(0)}-{_char(sys.maxunicode)}]"
    ranges = (_char(low) if low == high else f"{_char(low)}-{_char(high)}" for low, high in spans)
    return "[" + "".join(ranges) + "]"


@functools.cache
def _every_character() -> str:
    return "".join(map(chr, range(sys.maxunicode + 1)))


def _char(code: int) -> str:
    """Character `code` as itself (an ASCII letter or digit) or as an escape both engines
    read alike."""
    if code < 128 and chr(code).isalnum():
        return chr(code)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
