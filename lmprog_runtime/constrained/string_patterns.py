"""A string's `pattern` and `format` in a JSON schema, written for outlines-core's regex
translation (`schema_prepare.py`) so that every string allowed validates.

- A string `pattern` is matched whole by the translation, where JSON Schema searches: its
  `^` / `$` ends are dropped and it is grouped (an alternation `a|b` would otherwise take
  the quotes into its branches), so every string allowed contains a match. What it lets a
  string hold raw is narrowed to what JSON holds raw: `.` and negated classes leave out
  the quote, the backslash and control characters, as does a class's range (`[ -~]`,
  printable ASCII, held both), `\\s` is a space, `\\w` the word characters of both
  Python's `re` and pydantic's (Rust's) regex: no "other number" (`¼`, `₂`, which `re`
  takes and pydantic refuses); what cannot be narrowed so (`\\S`,
  `\\W`, `\\D`, a quote or a backslash, escapes of control characters, octal and named
  ones: `\\n`, `\\042`, `\\N{...}`, `[\\b]`) is refused.
- The formats `date`, `time`, `date-time`, `email` and `uri` become patterns of ASCII that
  JSON holds raw (outlines-core's admit Unicode digits, `time`'s lets a backslash in,
  `email`'s quoted local part and `uri`'s `[^\\s]` let quotes in); `date-time` is a
  subset of RFC 3339's, its offset required (outlines-core's allowed February 31st and
  none but `Z`); `uri` is an http(s) URL that pydantic's `HttpUrl` takes too.
- A `minLength` / `maxLength` next to a `pattern` or `format` (outlines-core drops the
  pattern for them) is dropped where every value of the pattern fits it; a `uri`'s
  `maxLength` is met by a URL pattern of bounded length (pydantic's `HttpUrl` writes 2083);
  others are refused.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import unicodedata

from lmprog_runtime.constrained.portable_regex import union, width

# What a string's pattern may hold raw: no quote, no backslash, no control character.
_UNSAFE = '"\\\\\\x00-\\x1f'
_DATE = (  # (years 1-9999; every month's days, February's up to the 28th)
    r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})-"
    r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    r"|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
)
_TIME_OF_DAY = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?"
_OFFSET = r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
# A URL pydantic's HttpUrl takes too: its last label starts with a letter (one of digits,
# `a.1`, is read as an IPv4 address, refused unless it is one), no label holds `--`
# (`xn--a` is read as punycode, refused unless it is), its port is 65535 at most.
_URI_HOST = r"([A-Za-z0-9]+(-[A-Za-z0-9]+)*\.)*[A-Za-z][A-Za-z0-9]*(-[A-Za-z0-9]+)*"
_URI_PORT = r"(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5]?[0-9]{1,4}))?"
_URI_PATH = r"[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]"
# ... and one of bounded length, for a `maxLength` (HttpUrl's 2083): counted labels cost
# far less to compile than a count of the whole (a second, against ten)
_URI_HEAD = (
    r"https?://([A-Za-z0-9](-?[A-Za-z0-9]){0,31}\.){0,3}[A-Za-z](-?[A-Za-z0-9]){0,11}" + _URI_PORT
)
_URI_HEAD_MOST = width(_URI_HEAD)[1] + 1  # (its longest, and the path's slash: 230)
_URI_PATH_MOST = 128
# An email address pydantic's `EmailStr` takes (email-validator's rules): dot-separated
# atoms of at most 64 characters before the `@`, labels that neither start nor end with a
# hyphen, nor hold two in a row. (Not left out: a special-use last label, `.test` or
# `.local`, which it refuses: written out, the exception took a compile 3.5 s against 0.5.)
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_LABEL = r"[A-Za-z0-9](-?[A-Za-z0-9]){0,15}"  # (no `--`: `ab--c`, `xn--` are refused)
_EMAIL = f"{_ATOM}{{1,32}}(\\.{_ATOM}{{1,15}}){{0,2}}@({_LABEL}\\.){{1,3}}[A-Za-z]{{2,24}}"
FORMATS = {
    "date": _DATE,
    "time": _TIME_OF_DAY + _OFFSET + "?",
    # RFC 3339's date-time: its offset is required (outlines-core's has none but `Z`, made
    # it optional, and let years 0 and below and February 31st through)
    "date-time": _DATE + "T" + _TIME_OF_DAY + _OFFSET,
    "email": _EMAIL,
    "uri": "https?://" + _URI_HOST + _URI_PORT + "(/" + _URI_PATH + "*)?",
}


def lengths_in_pattern(node: dict) -> dict:
    """`node` (a string's, with a `pattern` or a `format`) less its `minLength` /
    `maxLength` where every value of its pattern fits them (outlines-core drops the pattern
    for the lengths), a `uri` bounded to fit; ValueError where the lengths would bind."""
    lengths = {key: _length(node, key) for key in ("minLength", "maxLength") if key in node}
    if not lengths:
        return node
    least, most = lengths.get("minLength", 0), lengths.get("maxLength")
    form = node.get("format")
    if form == "uri" and "pattern" not in node and most is not None and most >= _URI_HEAD_MOST:
        path = f"(/{_URI_PATH}{{0,{min(most - _URI_HEAD_MOST, _URI_PATH_MOST)}}})?"
        node = {key: value for key, value in node.items() if key != "format"}
        node["pattern"] = _URI_HEAD + path  # (358 characters at most)
    pattern = node.get("pattern", FORMATS.get(form))  # (a `format` with one: refused later)
    if not isinstance(pattern, str):
        raise ValueError(f"unsupported JSON schema: {sorted(lengths)} next to 'format' {form!r}")
    try:
        low, high = width(json_safe_pattern(pattern))
    except re.error:
        raise ValueError(
            f"unsupported JSON schema: {sorted(lengths)} next to a pattern Python's re cannot "
            f"read ({pattern!r}): its values' lengths are unknown"
        ) from None
    if least > low or most is not None and (high is None or high > most):
        span = f"{low} or more" if high is None else f"{low} to {high}" * (low != high)
        hint = f"; a 'uri' takes a 'maxLength' of {_URI_HEAD_MOST} or more" if form == "uri" else ""
        raise ValueError(
            f"unsupported JSON schema: {sorted(lengths)} next to a 'pattern' or 'format' "
            f"whose values are {span or low} characters long (write the length into the "
            f"pattern: `^[A-Z]{{3}}$`{hint})"
        )
    return {key: value for key, value in node.items() if key not in lengths}


def _length(node: dict, key: str) -> int:
    """`node[key]`, a length: a non-negative integer (`3.0` is one, `True` is not)."""
    value = node[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"JSON schema: {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def json_safe_pattern(pattern: str) -> str:
    """`pattern` without its `^` / `$` ends, grouped, and narrowed to characters JSON holds
    raw in a string (see the module docstring); ValueError where it cannot be.

    Example:
        >>> json_safe_pattern("^(yes|no)$")
        '((yes|no))'
    """
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            out.append(_escape(body[i + 1], pattern))
            i += 2
            continue
        if ord(ch) < 0x20 or ch == '"':
            raise ValueError(f"unsupported JSON schema: pattern {pattern!r} holds {ch!r}")
        if ch == "[":
            text, i = _narrowed_class(body, i, pattern)
            out.append(text)
            continue
        out.append(f"[^{_UNSAFE}]" if ch == "." else ch)
        i += 1
    return "(" + "".join(out) + ")"


def _narrowed_class(body: str, i: int, pattern: str) -> tuple[str, int]:
    """The class at `body[i]` ("[") narrowed to what JSON holds raw, and where it ends: a
    range leaves out the quote, the backslash and control characters (`[ -~]`, printable
    ASCII, let both in), a negated class leaves them out too."""
    j = i + 1
    negated = body.startswith("^", j)
    j += negated
    items: list[tuple[bool, str]] = []  # (a character, else an escape's text)
    while j < len(body) and (body[j] != "]" or not items):
        if body[j] == "\\" and j + 1 < len(body):
            escaped = body[j + 1]
            if negated and escaped in "ws":  # (not narrowed: what is left out grows)
                raise ValueError(
                    f"unsupported JSON schema: '\\{escaped}' in a negated class in pattern "
                    f"{pattern!r}: Python's re and pydantic's regex (Rust's) read it "
                    "otherwise, so outputs could fail validation; list the characters"
                )
            if escaped.isalnum():
                items.append((False, _escape(escaped, pattern, in_class=True)))
            else:
                items.append((True, escaped))
            j += 2
        else:
            items.append((True, body[j]))
            j += 1
    out, k = [], 0
    while k < len(items):
        is_char, text = items[k]
        if is_char and k + 2 < len(items) and items[k + 1] == (True, "-") and items[k + 2][0]:
            low, high = text, items[k + 2][1]
            out.append(
                _class_char(low) + "-" + _class_char(high) if negated else _safe_range(low, high)
            )
            k += 3
            continue
        if is_char and not negated and (ord(text) < 0x20 or text in '"\\'):
            raise ValueError(f"unsupported JSON schema: pattern {pattern!r} holds {text!r}")
        out.append(_class_char(text) if is_char else text)
        k += 1
    if not "".join(out):
        raise ValueError(
            f"unsupported JSON schema: pattern {pattern!r} has a class JSON holds no character of"
        )
    if not negated and _WORD in out:  # (`[\\w.-]`: narrowed `\\w` or the rest)
        rest = [piece for piece in out if piece != _WORD]
        word = _word_class()
        return (f"(?:{word}|[{''.join(rest)}])" if rest else word), j + 1
    return "[" + ("^" + _UNSAFE if negated else "") + "".join(out) + "]", j + 1


def _safe_range(low: str, high: str) -> str:
    """The range `low`-`high` without the characters JSON escapes."""
    pieces, start = [], ord(low)
    for unsafe_low, unsafe_high in ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)):
        if start < unsafe_low:
            pieces.append((start, min(ord(high), unsafe_low - 1)))
        start = max(start, unsafe_high + 1)
    if start <= ord(high):
        pieces.append((start, ord(high)))
    return _class_ranges([(a, b) for a, b in pieces if a <= b])


def _class_ranges(spans: list[tuple[int, int]]) -> str:
    """Code point ranges as a class's members (`a-z`, a lone `x`)."""
    return "".join(
        _class_char(chr(a)) + ("" if a == b else "-" + _class_char(chr(b))) for a, b in spans
    )


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


def _escape(ch: str, pattern: str, in_class: bool = False) -> str:
    """The escape `\\ch` as the narrowed pattern writes it (inside a class or out)."""
    if ch in 'SWDxuU"\\ntrfva0123456789N' or (in_class and ch == "b"):
        what = {"x": "a \\x escape", "u": "a \\u escape", "U": "a \\U escape"}.get(ch)
        raise ValueError(
            f"unsupported JSON schema: {what or repr(chr(92) + ch)} in pattern {pattern!r} "
            "could let a quote, a backslash or a control character into the string"
        )
    if ch == "s":
        return " "
    if ch == "w" and not in_class:
        return _word_class()
    return "\\" + ch


_WORD = "\\w"


@functools.cache
def _word_class() -> str:
    """`\\w` less the characters Python's `re` takes in it and pydantic's regex (Rust's
    `\\w`: letters, marks, decimal digits, connectors) does not: the "other numbers"."""
    others = [(c, c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "No"]
    return "[^\\W" + _class_ranges(union(others)) + "]"
