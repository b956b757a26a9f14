"""JSON schema -> regex: outlines-core's translation, with numbers that end and a chosen
whitespace layout.

Before translation, every integer / number subschema is replaced by a marker constant and,
after it, by our own pattern: integers match exactly their `minimum` / `maximum` /
`exclusiveMinimum` / `exclusiveMaximum` range (int64 when unbounded), numbers have bounded
digits (float64's precision), and bounded numbers are written without an exponent, as
integers in range or `n.f` with the whole step from n to n+1 in range. outlines-core would
leave `[0-9]*` unbounded and ignore the bound keywords. Keywords that still cannot be
enforced are refused, named.

Whitespace between JSON tokens is placed by `Layout`: outlines-core is given a marker as
its whitespace pattern, and each marker becomes fixed text by where it stands. `SPACED`
(`{"a": 1, "b": [1, 2]}`, `json.dumps`' own layout) is the default: keys and punctuation
stay forced text for jump-forward, and it is the layout instruct models write. Measured on
SmolLM2-135M-Instruct, 20 customer records, greedy, three prompt wordings: SPACED got the
most fields right (60, 67, 72 of 80; COMPACT 53, 62, 72; OPTIONAL 52, 54, 73) and the
fewest or equal forward passes per output token (0.45 where COMPACT needed 0.51 and
OPTIONAL, whose every optional space is a model choice that stops jump-forward, 0.65).
"""

from __future__ import annotations

import json
import math
from enum import Enum, auto
from typing import Any

from lmprog_runtime.constrained.number_regex import (
    FLOAT_REGEX,
    int_range_regex,
    integer_bounds,
    number_range_regex,
)
from lmprog_runtime.constrained.schema_prepare import MAX_REF_DEPTH, prepared
from lmprog_runtime.constrained.schema_size import MAX_REGEX_CHARS, estimated_size

BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
DIGIT_KEYWORDS = (
    "minDigitsInteger",
    "maxDigitsInteger",
    "minDigitsFraction",
    "maxDigitsFraction",
    "minDigitsExponent",
    "maxDigitsExponent",
)
# Keywords outlines-core's regex translation would ignore: refuse them rather than produce
# documents that do not validate. (Bounds on integers are consumed before this check.)
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        *BOUND_KEYWORDS,
        "multipleOf",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "minProperties",
        "maxProperties",
    }
)
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, never descended into


class Layout(Enum):
    """Whitespace between JSON tokens."""

    COMPACT = auto()  # {"a":1,"b":[1,2]}
    SPACED = auto()  # {"a": 1, "b": [1, 2]}
    OPTIONAL = auto()  # at most one space or newline wherever JSON allows whitespace


DEFAULT_LAYOUT = Layout.SPACED
# Objects and lists in one another that outlines-core's JSON reader takes (serde_json's limit).
MAX_JSON_DEPTH = 127


def schema_to_regex(schema: str, layout: Layout = DEFAULT_LAYOUT) -> str:
    """The regex of the documents `schema` (JSON text) accepts, laid out as `layout`.
    Raises ValueError for invalid JSON and for keywords that cannot be enforced."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"json_schema is not valid JSON: {error}") from error
    except RecursionError:  # (Python's parser, past about a thousand levels)
        raise ValueError(_too_deep("over a thousand")) from None
    if parsed is True:  # (every document: outlines-core refused the bare `true`)
        parsed = {}
    elif parsed is False:
        raise ValueError("json_schema false accepts no document")
    _check_values(parsed)
    numbers: dict[str, str] = {}
    ready = prepared(parsed)
    _check_size(ready)
    parsed = _replace_numbers(ready, numbers, schema)
    _refuse(_unsupported_keywords(parsed))
    _check_values(parsed)  # (a number's bounds may have wrapped it in an anyOf)
    space = _unused("LMPROGSPACE", schema)
    try:
        # (past MAX_REF_DEPTH is refused: outlines-core's own limit dropped properties)
        regex = build_regex_from_schema(
            json.dumps(parsed), space, max_recursion_depth=MAX_REF_DEPTH + 2
        )
    except Exception as error:
        raise ValueError(f"unsupported JSON schema: {error}") from error
    for marker, pattern in numbers.items():
        regex = regex.replace(json.dumps(marker), f"({pattern})")
        if marker in regex.replace("\\", ""):  # rendered otherwise: never leave it as text
            raise ValueError(f"unsupported JSON schema: cannot place a number pattern in {regex}")
    return _lay_out(regex, space, layout)


def _check_values(value: Any) -> None:
    """ValueError for JSON nested deeper than outlines-core reads (serde_json's limit: it
    said "Expected a valid JSON string."), and for a number that is not finite
    (`Infinity`, `1e400`: an OverflowError in the bounds' translation)."""
    todo = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise ValueError(f"json_schema holds a number that is not finite: {node}")
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(_too_deep(f"more than {MAX_JSON_DEPTH}"))
            children = node.values() if isinstance(node, dict) else node
            todo += [(child, depth + 1) for child in children]


def _check_size(schema: Any) -> None:
    """ValueError for a schema whose regex would pass MAX_REGEX_CHARS: each level of
    arrays doubles its items' pattern, and a `$ref` is written out where it stands (22
    levels of arrays in 568 characters took every GiB of memory there was)."""
    size = estimated_size(schema)
    if size > MAX_REGEX_CHARS:
        raise ValueError(
            f"unsupported JSON schema: its regex would be about {size:,} characters (at most "
            f"{MAX_REGEX_CHARS:,}): nest fewer arrays, or reference fewer large definitions"
        )


def _too_deep(depth: str) -> str:
    return (
        f"unsupported JSON schema: its objects and lists nest {depth} deep; outlines-core "
        f"reads at most {MAX_JSON_DEPTH} (a level of properties takes two)"
    )


def _refuse(keywords: set[str]) -> None:
    if keywords:
        raise ValueError(
            f"unsupported JSON schema feature(s) {sorted(keywords)}: outputs could not be "
            "guaranteed to validate"
        )


def _lay_out(regex: str, space: str, layout: Layout) -> str:
    if layout is Layout.OPTIONAL:
        return regex.replace(space, "[ \\n]?")
    if layout is Layout.SPACED:
        # outlines-core writes `M:M` between key and value, `M,M` between members and
        # `,M` between items; a separator gets one space after it, nothing else does.
        regex = regex.replace(f"{space}:{space}", ": ").replace(f"{space},{space}", ", ")
        regex = regex.replace(f",{space}", ", ")
        # (an optional member's comma ends its group: `("a": 1,)?"b"` gave `1,"b"`; one
        # after a required member opens the group of an optional one: `M,(M"b"`)
        regex = regex.replace(f"{space},)?", ", )?").replace(f"{space},({space}", ", (")
    return regex.replace(space, "")


def _unused(stem: str, text: str) -> str:
    """A marker that does not occur in `text`."""
    n = 0
    while f"{stem}{n}Z" in text:
        n += 1
    return f"{stem}{n}Z"


def _replace_numbers(schema: Any, numbers: dict[str, str], text: str) -> Any:
    """Replace integer / number subschemas by marker constants (`numbers` maps each marker
    to its pattern), and put each enum's longest values first."""
    if isinstance(schema, list):
        return [_replace_numbers(item, numbers, text) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kind = schema.get("type")
    if isinstance(kind, list) and {"integer", "number"} & set(kind):
        rest = {k: v for k, v in schema.items() if k != "type"}
        # Bound and digit keywords apply to numbers only: the other branches drop them.
        plain = {k: v for k, v in rest.items() if k not in (*BOUND_KEYWORDS, *DIGIT_KEYWORDS)}
        options = [
            {**(rest if t in ("integer", "number") else plain), "type": t}
            for t in kind
            if t != "integer" or "number" not in kind
        ]
        return _replace_numbers({"anyOf": options}, numbers, text)
    if kind in ("integer", "number") and "enum" not in schema and "const" not in schema:
        # (its own keywords, bounds aside, are checked here: the marker replaces them all)
        _refuse(_unsupported_keywords({k: v for k, v in schema.items() if k not in BOUND_KEYWORDS}))
        pattern = _integer_pattern(schema) if kind == "integer" else _number_pattern(schema)
        marker = _unused(f"LMPROGNUMBER{len(numbers)}X", text)  # plain: never escaped
        numbers[marker] = pattern
        return {"const": marker}
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _replace_numbers(sub, numbers, text) for name, sub in value.items()}
        else:
            out[key] = value if key in _NOT_SCHEMAS else _replace_numbers(value, numbers, text)
    if isinstance(out.get("enum"), list):
        # Longest first: outlines-core's index takes the first alternative that completes
        # the pattern, so `(1|12)` could never give 12 (see number_regex._non_negative).
        out["enum"] = sorted(out["enum"], key=lambda v: -len(json.dumps(v)))
    return out


def _integer_pattern(schema: dict) -> str:
    lo, hi = integer_bounds(schema)
    try:
        return int_range_regex(lo, hi)
    except ValueError as error:
        raise ValueError(f"unsupported JSON schema: {error} ({schema})") from error


def _number_pattern(schema: dict) -> str:
    bounds = sorted(k for k in BOUND_KEYWORDS if k in schema)
    digits = sorted(k for k in DIGIT_KEYWORDS if k in schema)
    if bounds and digits:
        raise ValueError(f"unsupported JSON schema: {bounds} together with {digits} on a number")
    if bounds:
        try:
            return number_range_regex(schema)
        except ValueError as error:
            raise ValueError(f"unsupported JSON schema feature(s) {bounds}: {error}") from error
    if not digits:
        return FLOAT_REGEX
    lo = max(int(schema.get("minDigitsInteger", 1)), 1)
    hi = int(schema.get("maxDigitsInteger", 16))
    whole = ("0|" if lo == 1 else "") + f"[1-9][0-9]{{{lo - 1},{max(hi, lo) - 1}}}"
    fraction = _digits(schema, "Fraction", 16)
    exponent = _digits(schema, "Exponent", 2)
    return f"-?({whole})(\\.{fraction})?([eE][+-]?{exponent})?"


def _digits(schema: dict, part: str, default: int) -> str:
    # At least one digit: `1.` and `1e+` are not JSON.
    lo = max(int(schema.get(f"minDigits{part}", 1)), 1)
    hi = max(int(schema.get(f"maxDigits{part}", default)), lo)
    return f"[0-9]{{{lo},{hi}}}"


def _unsupported_keywords(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in UNSUPPORTED_SCHEMA_KEYWORDS:
                found.add(key)
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                for sub in value.values():
                    found |= _unsupported_keywords(sub)
            elif key not in _NOT_SCHEMAS:
                found |= _unsupported_keywords(value)
    elif isinstance(schema, list):
        for item in schema:
            found |= _unsupported_keywords(item)
    return found
