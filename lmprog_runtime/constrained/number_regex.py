"""Regexes for numbers that can end: integers in an exact range, floats with bounded digits.

An unbounded `[0-9]+` lets a model that has lost track write digits until `max_tokens`
runs out; a bounded pattern ends by itself. `int_range_regex(lo, hi)` matches exactly the
decimal integers in [lo, hi] (no leading zeros, no `-0`), built digit-wise: the range is
split into numbers of one length, and each of those into buckets sharing a prefix
(`123-456` -> `45[0-6]|4[0-4][0-9]|[2-3][0-9]{2}|1[3-9][0-9]|12[3-9]`).

Example:
    >>> int_range_regex(0, 120)
    '(120|1[0-1][0-9]|[1-9][0-9]|[0-9])'
"""

from __future__ import annotations

import math

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# float64 holds 15-17 significant digits; exponents of two digits never overflow it.
FLOAT_REGEX = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"


def _digit(lo: str, hi: str) -> str:
    return lo if lo == hi else f"[{lo}-{hi}]"


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives matching the fixed-width digit strings from `lo` to `hi` (lo <= hi)."""
    if lo == hi:
        return [lo]
    n = len(lo) - 1  # digits after the first
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    tail = f"[0-9]{{{n}}}" if n > 1 else "[0-9]" if n == 1 else ""
    out: list[str] = []
    first, last = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:  # a partial bucket at the bottom
        out += [lo[0] + rest for rest in _same_length(lo[1:], "9" * n)]
        first += 1
    upper = [] if hi[1:] == "9" * n else [hi[0] + r for r in _same_length("0" * n, hi[1:])]
    if upper:
        last -= 1
    if first <= last:
        out.append(_digit(str(first), str(last)) + tail)
    return out + upper


def _non_negative(lo: int, hi: int) -> list[str]:
    """Alternatives for [lo, hi] (lo >= 0), the longest numbers first: outlines-core's index
    takes the first alternative that completes the pattern, so with `[0-9]|[1-9][0-9]` a "2"
    at the end of a pattern could never become "24"."""
    out: list[str] = []
    full: list[int] = []  # a run of lengths >= 2 covered whole: one `[1-9][0-9]{m,n}`
    for length in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (length - 1) if length > 1 else 0)
        b = min(hi, 10**length - 1)
        if length > 1 and (a, b) == (10 ** (length - 1), 10**length - 1):
            full.append(length)
            continue
        out += _full_lengths(full)
        full = []
        out += _same_length(str(a), str(b))
    return list(reversed(out + _full_lengths(full)))


def _full_lengths(lengths: list[int]) -> list[str]:
    if not lengths:
        return []
    m, n = lengths[0] - 1, lengths[-1] - 1
    repeat = "" if m == n == 1 else f"{{{m}}}" if m == n else f"{{{m},{n}}}"
    return [f"[1-9][0-9]{repeat}"]


def int_range_regex(lo: int | None = None, hi: int | None = None) -> str:
    """The decimal integers in [lo, hi]; a missing bound is int64's. Raises ValueError for
    an empty range."""
    lo = INT64_MIN if lo is None else lo
    hi = INT64_MAX if hi is None else hi
    if lo > hi:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    parts: list[str] = []
    if hi >= 0:
        parts += _non_negative(max(lo, 0), hi)
    if lo < 0:
        negative = _non_negative(max(-hi, 1), -lo)
        parts.append("-" + (negative[0] if len(negative) == 1 else f"({'|'.join(negative)})"))
    return "(" + "|".join(parts) + ")"


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The inclusive integer range a JSON schema's bound keywords allow (None: unbounded).
    Handles draft 4 boolean `exclusiveMinimum` / `exclusiveMaximum` and draft 6+ numbers."""
    lo = hi = None
    for key, value in schema.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "minimum":
            strict = schema.get("exclusiveMinimum") is True
            lo = _max(lo, math.floor(value) + 1 if strict else math.ceil(value))
        elif key == "exclusiveMinimum":
            lo = _max(lo, math.floor(value) + 1)
        elif key == "maximum":
            strict = schema.get("exclusiveMaximum") is True
            hi = _min(hi, math.ceil(value) - 1 if strict else math.floor(value))
        elif key == "exclusiveMaximum":
            hi = _min(hi, math.ceil(value) - 1)
    if "maxDigits" in schema:  # outlines-core's keyword: at most that many digits
        limit = 10 ** int(schema["maxDigits"]) - 1
        lo, hi = _max(lo, -limit), _min(hi, limit)
    return lo, hi


def _max(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)


def _min(a: int | None, b: int) -> int:
    return b if a is None else min(a, b)


def number_range_regex(schema: dict) -> str:
    """Decimal numbers (no exponent) inside a schema's bounds: the integers in range, and
    `n.f` wherever every value from n to n+1 is in range. A number just short of a
    fractional bound (9.5 under `maximum: 9.7`) is left out, never one outside."""
    lo, hi = integer_bounds(schema)
    lo, hi = _max(lo, -FLOAT_WHOLE_MAX), _min(hi, FLOAT_WHOLE_MAX)
    fraction = r"\.[0-9]{1,16}"
    parts: list[str] = []  # `n.f` before the integers: the longer alternative first
    # n.f (n >= 0) lies in [n, n + 1): n >= lo's integer bound, n + 1 <= the bound keyword.
    top = _min(_upper(schema), FLOAT_WHOLE_MAX + 1) - 1
    if max(lo, 0) <= top:
        parts.append(int_range_regex(max(lo, 0), top) + fraction)
    # -n.f lies in (-(n + 1), -n]: -n <= hi's integer bound, -(n + 1) >= the bound keyword.
    low = _max(_lower(schema), -FLOAT_WHOLE_MAX - 1)
    first, last = max(-hi, 0), -low - 1
    if first <= last:
        parts.append("-" + int_range_regex(first, last) + fraction)
    if lo <= hi:
        parts.append(int_range_regex(lo, hi))
    if not parts:
        raise ValueError(f"number bounds {schema} leave no integer or n.f range to generate")
    return "(" + "|".join(parts) + ")"


FLOAT_WHOLE_MAX = 10**16 - 1  # FLOAT_REGEX's integer part


def _upper(schema: dict) -> int | None:
    """floor of the tightest upper bound keyword (inclusive or not: n + 1 <= it either way)."""
    bounds = [schema.get("maximum"), schema.get("exclusiveMaximum")]
    values = [math.floor(b) for b in bounds if _is_number(b)]
    return min(values) if values else None


def _lower(schema: dict) -> int | None:
    bounds = [schema.get("minimum"), schema.get("exclusiveMinimum")]
    values = [math.ceil(b) for b in bounds if _is_number(b)]
    return max(values) if values else None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
