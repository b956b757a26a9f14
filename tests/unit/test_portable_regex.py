"""`portable_regex` against Python's `re`: its output is a Python regex too, and must take
exactly the strings the input takes under `re.fullmatch`, on patterns built from pieces
that Rust's engine reads otherwise (classes, `(?i)`, `(?s)`, anchors, `{,n}`) and strings
of characters where the readings differ (U+212A, U+0130, U+001C, combining marks). That
Rust reads the output as Python does is checked on a real vocabulary, in
tests/runtime/test_constrained_real.py."""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.constrained.outlines_backend import rust_only_class_syntax
from lmprog_runtime.constrained.portable_regex import (
    nests_as_written,
    portable_regex,
    without_edge_anchors,
)

CHARS = "aAkKsS_-. 0٣\n\t\x1c\u212a\u0130\u0131\u017f\u0301\u0345é{},$^\\"
PIECES = [
    "a", "k", "s", r"\.", "-", " ", ".", r"\w", r"\W", r"\d", r"\D", r"\s", r"\S", "[a-k]",
    r"[^a\s]", r"[\w-]", r"[^\W\d]", "[é{]", r"\u0130", r"\x1c", "{", "a{1, 3}", "[.^$]",
    r"(?u:\w)", r"(?a:\w)", "(?a:k)",
]  # fmt: skip


def _repeat(piece: str) -> st.SearchStrategy[str]:
    counts = st.sampled_from(["", "?", "*", "+", "{2}", "{,2}", "{1,}", "{0,2}?", "{,}"])
    return counts.map(lambda count: f"(?:{piece}){count}")


BODIES = st.recursive(
    st.sampled_from(PIECES),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda ps: "(" + "|".join(ps) + ")"),
        inner.flatmap(_repeat),
        inner.map(lambda p: f"(?i:{p})"),
    ),
    max_leaves=5,
)
PATTERNS = st.tuples(
    st.sampled_from(["", "(?i)", "(?s)", "(?a)", "(?is)"]),
    st.sampled_from(["", "^", r"\A"]),
    BODIES,
    st.sampled_from(["", "$", r"\Z"]),
).map("".join)


@settings(max_examples=300, deadline=None)
@given(PATTERNS, st.lists(st.text(CHARS, max_size=5), min_size=20, max_size=20))
def test_the_output_takes_the_strings_the_pattern_takes(pattern, texts):
    """So does the pattern less its edge anchors (jump-forward's FSM reads it)."""
    original = re.compile(pattern)
    for rewritten in (portable_regex(pattern), without_edge_anchors(pattern)):
        rewritten = re.compile(rewritten)
        for text in texts:
            expected = bool(original.fullmatch(text))
            assert bool(rewritten.fullmatch(text)) == expected, (pattern, rewritten, text)


@pytest.mark.parametrize(
    ("pattern", "cut"),
    [
        ("^a$", "a"),
        (r"\Aa\Z", "a"),
        ("^$", ""),
        (r"a\$", r"a\$"),  # an escaped dollar
        ("a\\\\$", "a\\\\"),  # an escaped backslash, then the anchor
        ("[$]", "[$]"),
        ("(?i)^a$", "(?i)^a"),  # (a flag first: the `^` is left, and the pattern read so)
    ],
)
def test_edge_anchors_are_cut_from_the_text(pattern, cut):
    assert without_edge_anchors(pattern) == cut


CLASSES = [r"\w", r"\S", r"(?i)[a-z]", r"(?i)k", r"(?s).", "[^a]", r"(?a)(?u:\w)", r"(?ia)(?u:k)"]
CLASSES += ["(?i)s", "(?i)\u0130", "(?i)\u03c3", "(?i)\u01c5", "(?i)\u00df", "(?ia)s"]


@pytest.mark.parametrize("pattern", CLASSES)
def test_a_class_is_every_character_python_takes_in_it(pattern):
    portable = re.compile(portable_regex(pattern))
    original = re.compile(pattern)
    for code in range(0x30000):
        if not 0xD800 <= code <= 0xDFFF:  # (no UTF-8 text holds a surrogate)
            char = chr(code)
            assert bool(portable.fullmatch(char)) == bool(original.fullmatch(char)), hex(code)


@pytest.mark.parametrize(
    "pattern", ["\\w", "(?i)\u0130", "\u00e9{2}", r"[\U0001F600-\U0001F64F]", "a{1, 3}"]
)
def test_the_output_is_letters_digits_escapes_and_syntax(pattern):
    """Nothing left that the two engines could read apart: every other character escaped."""
    assert re.fullmatch(r"([A-Za-z0-9()?:|*+{},\[\]^-]|\\x[0-9a-f]{2}|\\u[0-9a-f]{4}"
                        r"|\\U[0-9a-f]{8})*", portable_regex(pattern))  # fmt: skip


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("x(a|^b)", "only at the start"),
        ("a$b", "only at the start"),
        (r"a$\n", "only at the start"),
        ("(^a)*", "only at the start"),
        # (`re` reads a second `^` or `$` mid-text: `(?:^a){2}` matches no "aa")
        ("(?:^a){2}", "only at the start"),
        ("(?:a$){2}", "only at its end"),
        ("(?:^a){0,2}", "only at the start"),
        (r"\bx", r"\\b and \\B"),
        (r"(a)\1", "back-reference"),
        ("(?=a)a", "lookaround"),
        # (3.10's re has neither: it refuses them itself)
        ("a*+", "possessive" if sys.version_info >= (3, 11) else "multiple repeat"),
        ("(?>a)", "atomic" if sys.version_info >= (3, 11) else "unknown extension"),
        ("(a", "Python's re refuses it"),
    ],
)
def test_what_no_finite_automaton_follows_is_refused_with_why(pattern, message):
    with pytest.raises(ValueError, match=message):
        portable_regex(pattern)


@pytest.mark.parametrize(
    ("pattern", "nests"),
    [("a+", True), ("[^a]", True), ("^a", False), ("a$", False), ("(?i)a", False), ("(", True)],
)
def test_what_changes_meaning_behind_other_text_is_told(pattern, nests):
    """A healed pattern puts the backed-up text in front (`token_healing.healed_pattern`):
    an anchor or a global flag would then mean another thing, or be refused."""
    assert nests_as_written(pattern) == nests


@pytest.mark.parametrize(
    ("regex", "found"),
    [
        ("[a~~b]", "~~"),
        ("[a&&b]", "&&"),
        ("[a-z--b]", "--"),
        ("[[:digit:]]", "[:"),
        ("[][a]", "[a"),  # (a class's first ']' is a literal: the next '[' nests in Rust)
        ("[^][a]", "[a"),
        ("[]a]", None),
        ("\\[a~~b]", None),  # (an escaped '[' opens no class)
        ("a~~b--c", None),
    ],
)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # (re's: "Possible nested set")
def test_what_rust_reads_as_a_nested_class_or_set_operation_is_found(regex, found):
    """Where Python's `re` reads literal characters (the reference: the regex compiles,
    and the piece matches itself) Rust's engine reads a nested class or a set operation."""
    assert rust_only_class_syntax(regex) == found
    re.compile(regex)
