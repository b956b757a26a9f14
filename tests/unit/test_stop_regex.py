"""The incremental stop-regex scanner against `re.search` over the whole text (issue 14).

Fed a growing text in random pieces, the scanner must report a match exactly when
`re.search` finds one in the text so far, and must never release text a later match could
begin in (its `stable_len`), for patterns it runs as a DFA and patterns it leaves to `re`.
"""

from __future__ import annotations

import re

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
    r"\d\d",  # ASCII in the DFA: switches to `re` on non-ASCII text
    r"\w+!",
    r"\bab",  # `re` only (context)
    r"(?i)ab",  # `re` only (flags)
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
    assert search_dfa(r"\d+").ascii_only
    for pattern in (r"\bx", r"x$", r"(?i)x", r"(?i:x)y", r"(a)\1", r"x(?=y)", r"(?<=a)b"):
        assert search_dfa(pattern) is None, pattern


def test_scanning_is_proportional_to_the_new_text():
    """Feeding 20,000 characters one at a time reads each character once per live state."""
    scanner = StopRegexScanner([r"STOP[0-9]{3}"])
    text = ""
    for i in range(20_000):
        text += "S" if i % 50 == 0 else "x"
        assert not scanner.feed(text)
    assert scanner.stable_len() == len(text)  # nothing pending: all of it may be streamed
    assert scanner.feed(text + "STOP123")
