"""The incremental stop-regex scanner against `re.search` over the whole text (issue 14).

Fed a growing text in random pieces, the scanner must report a match exactly when
`re.search` finds one in the text so far, and must never release text a later match could
begin in (its `stable_len`), for patterns it runs as a DFA and patterns it leaves to `re`.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.stop_regex import StopRegexScanner, search_dfa

PATTERNS = [
    r"END",
    r"\n\n",
    r"[A-Z][a-z]+\.",
    r"ab|ba",
    r"a{2,3}b",
    r"(ab)+c",
    r"[^ab]b",
    r"a.b",
    r"\d\d",  # `re`'s Unicode class: ٣ is a digit
    r"\w+!",
    r"\bab",  # `re` only (context)
    r"(?i)ab",  # (flags: each character tested by `re` itself)
    r"(?i:a)b",
    r"b$",
    r"x(?=y)",
]
ALPHABET = "abcxyEND .!\n0123A٣é"


@given(
    patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3, unique=True),
    text=st.text(alphabet=ALPHABET, max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
@settings(max_examples=400, deadline=None)
def test_scanner_agrees_with_re_search(patterns, text, cuts):
    scanner = StopRegexScanner(patterns)
    for end in sorted({min(c, len(text)) for c in cuts} | {len(text)}):
        prefix = text[:end]
        expected = any(re.search(p, prefix) for p in patterns)
        assert scanner.feed(prefix) == expected, (patterns, prefix)
        if expected:
            return
        stable = scanner.stable_len()
        assert 0 <= stable <= len(prefix)
        # No match in any continuation begins inside the stable part.
        for rest in ("", "END", "\n\n", "ab", "bc!", "aab", "Abc.", "00", "by"):
            for p in patterns:
                found = re.search(p, prefix + rest)
                assert found is None or found.start() >= stable, (p, prefix, rest, stable)


def test_which_patterns_run_as_a_dfa():
    assert search_dfa(r"END|STOP") is not None
    assert search_dfa(r"\d+") is not None  # (`re`'s Unicode class, tested per character)
    for pattern in (r"(?i)x", r"(?i:x)y", r"(?s)a.b", r"(?a)\w", r"(?x) a b # c", r"(?m)ab"):
        assert search_dfa(pattern) is not None, pattern  # (flags: tested by `re` itself)
    for pattern in (r"\bx", r"x$", r"(a)\1", r"x(?=y)", r"(?<=a)b"):
        assert search_dfa(pattern) is None, pattern
    for pattern in (r"x*+y", r"(?>xy|x)y", r"(?:a{100}){100}"):  # (possessive, atomic, huge)
        assert search_dfa(pattern) is None, pattern


@given(
    patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3, unique=True),
    # (few letters: matches that merge, and ties between patterns, are common)
    text=st.one_of(st.text(alphabet="abc", max_size=30), st.text(alphabet=ALPHABET, max_size=60)),
    origin=st.integers(0, 60),
)
@settings(max_examples=400, deadline=None)
def test_first_match_is_the_match_re_search_finds_first(patterns, text, origin):
    """Where the stop cuts and what it reports: the leftmost `re.search` match from
    `origin` over the patterns, the one listed first on a tie (it was `re.search` itself,
    which backtracks without end on some patterns)."""
    origin = min(origin, len(text))
    expected = _first_re_match(patterns, text, origin)
    assert StopRegexScanner(patterns).first_match(text, origin) == expected, patterns


# Patterns the DFA runs, with flags, lazy repeats and classes `re` and the `regex` module
# read apart (`\w` for "²" and combining marks, `\s` for U+001C, case folding of "ſ", the
# Kelvin sign "K"), over text holding those characters.
DFA_PATTERNS = [
    r"(?i)ab",
    r"(?i:a)b|B",
    r"(?i)[a-c]+k",
    r"(?i)s\W",
    r"x\w*",
    r"\w+?\s",
    r"(?s)a.b",
    r"a.*?b",
    r"(?a)\w+",
    r"(?i)[^a]s",
    r"(?-i:a)(?i:b)",
    r"a{1,3}?x?b",
    r"(?i)ſ|k",
    r"a(?:|b)*",
    r"k(?:s??)*x?",
]
WIDE_ALPHABET = "abxkK\u212asSſAB ²\u0301é\x1c\n_"


@given(
    patterns=st.lists(st.sampled_from(DFA_PATTERNS), min_size=1, max_size=3, unique=True),
    text=st.text(alphabet=WIDE_ALPHABET, max_size=40),
    origin=st.integers(0, 40),
)
@settings(max_examples=400, deadline=None)
def test_flags_and_repeats_run_as_a_dfa_as_re_reads_them(patterns, text, origin):
    r"""The scan finds a match where `re.search` does, and reports `re`'s match (a lazy
    repeat's extent, `\w` as `re` reads it: it was the `regex` module's match, and with
    an inline flag its search, which read "²" as no word character)."""
    assert all(search_dfa(p) is not None for p in patterns)
    origin = min(origin, len(text))
    expected = _first_re_match(patterns, text, origin)
    assert StopRegexScanner(patterns).first_match(text, origin) == expected, patterns
    scanner = StopRegexScanner(patterns)
    assert scanner.feed(text) == any(re.search(p, text) for p in patterns)


def _first_re_match(patterns: list[str], text: str, origin: int) -> tuple[int, str] | None:
    """The leftmost `re.search` match from `origin` over `patterns` (the one listed first
    on a tie): (where it begins, what it matched)."""
    expected = None
    for pattern in patterns:
        found = re.compile(pattern).search(text, origin)
        if found is not None and (expected is None or found.start() < expected[0]):
            expected = (found.start(), found.group())
    return expected


@pytest.mark.parametrize(
    ("patterns", "text", "expected"),
    [
        (["ab|ba", "(ab)+c"], "xabc", (1, "ab")),  # a tie: the pattern listed first
        (["(ab)+c", "ab|ba"], "xabc", (1, "abc")),
        (["(ab)+c"], "abababc", (0, "abababc")),  # runs from 0, 2 and 4 merge: the first
        (["b", "a.*c"], "abc", (0, "abc")),
        (["a+?"], "aaa", (0, "a")),  # lazy: `re`'s extent
        # A repeat's try that matches nothing ends it in `re` (the NFA's run went on).
        (["a(?:|b)*"], "abb", (0, "a")),
        (["x(?:a??)*"], "xaa", (0, "x")),
        ([r"END(?:\s*?)+"], "END   x", (0, "END")),
        (["a{2,3}"], "aaaa", (0, "aaa")),
        (["b$", "c"], "abc", (2, "c")),  # (`regex` searches `b$`: no match)
        # `re` reads a class inside a class as literals; `regex` read a POSIX class
        (["[[:alpha:]]+$"], "aa", None),
        (["[[:alpha:]]+$"], "x:]]", (1, ":]]")),
    ],
)
@pytest.mark.filterwarnings("ignore:Possible nested set")  # (`re`'s, for `[[:alpha:]]`)
def test_first_match_examples(patterns, text, expected):
    assert StopRegexScanner(patterns).first_match(text, 0) == expected


def test_a_pattern_whose_dfa_is_exponential_is_built_lazily():
    """(a|b)*a(a|b){n}: the DFA up front has 2^n states (n = 14 took 82 s on the thread
    that submits, which every program shares); the NFA has a few per character of the
    pattern, and the scan agrees with `re.search`."""
    pattern = r"(a|b)*a(a|b){40}"
    dfa = search_dfa(pattern)
    assert dfa is not None and len(dfa.nfa.tests) < 300
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(rng.choice("ab") for _ in range(60)) + "c" + "b" * 50
        scanner = StopRegexScanner([pattern])
        seen = [scanner.feed(text[: i + 1]) for i in range(len(text))]
        expected = [re.search(pattern, text[: i + 1]) is not None for i in range(len(text))]
        first = expected.index(True) if True in expected else len(text)
        assert seen[: first + 1] == expected[: first + 1]


def test_a_search_that_backtracks_without_end_fails_with_the_pattern_named():
    """Anchored patterns are searched by a backtracking engine: one that explodes (2^60
    paths here) is stopped by its time limit, instead of holding the engine loop."""
    scanner = StopRegexScanner([r"^(a|aa)+$"])
    with pytest.raises(ValueError, match=r"stop_regex '\^\(a\|aa\)\+\$' took over"):
        scanner.feed("a" * 60 + "b")
    assert StopRegexScanner([r"^(a|aa)+$"]).feed("aaab") is False  # (a short one is searched)


def test_scanning_is_proportional_to_the_new_text():
    """Feeding 20,000 characters one at a time reads each character once per live state."""
    scanner = StopRegexScanner([r"STOP[0-9]{3}"])
    text = ""
    for i in range(20_000):
        text += "S" if i % 50 == 0 else "x"
        assert not scanner.feed(text)
    assert scanner.stable_len() == len(text)  # nothing pending: all of it may be streamed
    assert scanner.feed(text + "STOP123")
